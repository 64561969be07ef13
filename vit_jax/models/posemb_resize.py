"""Resizing a position-embedding grid (h, w, D) to (h2, w2, D), as a separable linear map.

Each axis gets an (out, in) interpolation matrix built in numpy (float64) from the sizes
alone, so the forward pass under jit (jax arrays, static sizes) and a checkpoint loader
(numpy) compute the same numbers:

- "bilinear": `scipy.ndimage.zoom(x, zoom, order=1)`, corners aligned, as the official ViT
  code and big_vision's `resample_posemb` resize.
- "bicubic": `torch.nn.functional.interpolate(x, mode="bicubic", align_corners=False,
  antialias=True)`, as timm's `resample_abs_pos_embed` resizes by default.
- "bicubic_no_antialias": the same without antialias (Keys' a = -0.75, no stretched filter),
  as transformers' ViT, DINOv2 and CLIP `interpolate_pos_encoding` and Meta's DINOv2 resize.
"""
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("bilinear", "bicubic", "bicubic_no_antialias")


def _bilinear(in_size: int, out_size: int) -> np.ndarray:
  """scipy.ndimage.zoom's order-1 map (grid_mode=False): output o reads input o*(in-1)/(out-1)."""
  factor = (in_size - 1) / (out_size - 1) if out_size > 1 else 1.0
  coords = np.minimum(np.arange(out_size) * factor, in_size - 1)
  lo = np.minimum(np.floor(coords).astype(int), max(in_size - 2, 0))
  frac = coords - lo
  mat = np.zeros((out_size, in_size))
  rows = np.arange(out_size)
  np.add.at(mat, (rows, lo), 1 - frac)
  # With in_size == 1 the "upper" neighbour is the same pixel, and frac is 0.
  np.add.at(mat, (rows, np.minimum(lo + 1, in_size - 1)), frac)
  return mat


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
  """Keys' cubic convolution kernel, with PIL's and torch's antialiased a = -0.5."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _bicubic_antialiased(in_size: int, out_size: int) -> np.ndarray:
  """torch's antialiased (PIL-style) bicubic weights, align_corners=False.

  As aten/src/ATen/native/cpu/UpSampleKernel.cpp's `_compute_weights_aa`: when
  downsampling the filter stretches by the scale, so every input pixel counts.
  """
  scale = in_size / out_size
  support = 2.0 * max(scale, 1.0)
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  mat = np.zeros((out_size, in_size))
  for i in range(out_size):
    center = scale * (i + 0.5)
    xmin = max(int(center - support + 0.5), 0)
    xmax = min(int(center + support + 0.5), in_size)
    weights = _cubic((np.arange(xmin, xmax) - center + 0.5) * invscale)
    total = weights.sum()
    mat[i, xmin:xmax] = weights / total if total != 0 else weights
  return mat


def _bicubic_plain(in_size: int, out_size: int) -> np.ndarray:
  """torch's bicubic weights without antialias, align_corners=False (UpSampleKernel.cpp's
  `guard_index_and_lambda`, `get_cubic_upsample_coefficients`): four taps around each output's
  source position, clamped to the edges."""
  scale = in_size / out_size
  mat = np.zeros((out_size, in_size))
  for i in range(out_size):
    source = scale * (i + 0.5) - 0.5
    index = min(int(np.floor(source)), in_size - 1)
    lam = min(max(source - index, 0.0), 1.0)
    weights = _cubic(np.array([lam + 1, lam, 1 - lam, 2 - lam]), a=-0.75)
    for tap, weight in zip(range(index - 1, index + 3), weights):
      mat[i, min(max(tap, 0), in_size - 1)] += weight
  return mat


def interpolation_matrix(in_size: int, out_size: int, method: str) -> np.ndarray:
  """The (out_size, in_size) float64 matrix that resizes one axis by `method`."""
  if method not in METHODS:
    raise ValueError(f"method={method!r}, expected one of {METHODS}.")
  if in_size < 1 or out_size < 1:
    raise ValueError(f"sizes must be positive, got in_size={in_size}, out_size={out_size}.")
  if method == "bilinear":
    return _bilinear(in_size, out_size)
  if method == "bicubic_no_antialias":
    return _bicubic_plain(in_size, out_size)
  return _bicubic_antialiased(in_size, out_size)


def resample(grid: Any, new_hw: tuple[int, int], method: str) -> Any:
  """`grid` (h, w, D), numpy or jax, resized to (*new_hw, D) in its dtype.

  A jax array (or tracer, under jit) is resized with jnp in float32 at HIGHEST
  precision, a numpy array in float64; equal sizes return `grid` itself.
  """
  (h, w), (new_h, new_w) = grid.shape[:2], tuple(new_hw)
  if (h, w) == (new_h, new_w):
    return grid
  mat_h = interpolation_matrix(h, new_h, method)
  mat_w = interpolation_matrix(w, new_w, method)
  if isinstance(grid, jax.Array):
    hi = jax.lax.Precision.HIGHEST
    x = grid.astype(jnp.float32)
    x = jnp.einsum("oh,hwd->owd", mat_h.astype(np.float32), x, precision=hi)
    x = jnp.einsum("pw,owd->opd", mat_w.astype(np.float32), x, precision=hi)
    return x.astype(grid.dtype)
  x = np.asarray(grid)
  out = np.einsum("pw,owd->opd", mat_w, np.einsum("oh,hwd->owd", mat_h, x.astype(np.float64)))
  return out.astype(x.dtype)
