"""2-D rotary position embeddings (RoPE) of the patch tokens, as EVA-02 and DINOv3 use them.

Each head's queries and keys are rotated by angles that depend on their patch's (row, column):
a quarter of the head's dimensions per (axis, sine/cosine), frequency bands shared by both axes.
The prefix tokens (class token, registers) are not rotated. The two forms differ in the grid,
the bands and the pairing of the rotated dimensions; both are what timm computes:

- "eva" (timm's `RotaryEmbeddingCat`, EVA-02): integer positions, rescaled as
  i * ref_grid / side where the model was pre-trained at a ref_grid x ref_grid grid (timm's
  `ref_feat_shape`; EVA-02: 16, also at 336 and 448 px); bands 1 / 10000^(k / (d/4));
  dimensions rotated in adjacent pairs (x0, x1), (x2, x3), ...
- "dinov3" (timm's `RotaryEmbeddingDinoV3`, Meta's `RopePositionEmbedding`): the patches'
  centres normalised to [-1, 1] along each axis, (2 (i + 0.5) / side - 1), so any grid spans
  the same range; angles 2 pi pos / 100^(2k / (d/2)); dimension k rotated with k + d/2 (the
  halves).

`embedding` gives the sines and cosines of a grid (host arrays: the grid is static), `apply`
rotates (batch, tokens, heads, head_dim) queries or keys with them.
"""
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import tokens

KINDS = ("none", "eva", "dinov3")
_HALF = {"eva": False, "dinov3": True}  # Pairs of halves, else of adjacent dimensions.


def _eva_angles(side: int, bands: np.ndarray, ref_grid: int | None) -> np.ndarray:
  t = np.arange(side, dtype=np.float32)
  if ref_grid is not None:  # timm's order of operations, in float32: t / side * ref.
    t = t / np.float32(side) * np.float32(ref_grid)
  return t[:, None] * bands


def _dinov3_angles(side: int, periods: np.ndarray) -> np.ndarray:
  t = np.arange(0.5, side, dtype=np.float32) / np.float32(side)
  t = np.float32(2.0) * t - np.float32(1.0)
  return np.float32(2 * np.pi) * t[:, None] / periods


def embedding(kind: str, grid: tuple[int, int], head_dim: int,
              ref_grid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(sin, cos), each (rows * cols, head_dim) float32, of a rows x cols patch grid (row-major,
  as the patches are flattened), laid out for `apply`. `ref_grid`: "eva"'s pre-training grid
  side (None: integer positions)."""
  if kind not in _HALF:
    raise ValueError(f"rope={kind!r}, expected one of {KINDS[1:]}.")
  if head_dim % 4:
    raise ValueError(f"2-D rotary embeddings need a head size divisible by 4, got {head_dim}.")
  n = head_dim // 4
  if kind == "eva":
    bands = (1.0 / 10000.0 ** (np.arange(n, dtype=np.float32) / np.float32(n))).astype(np.float32)
    rows, cols = (_eva_angles(s, bands, ref_grid) for s in grid)
  else:
    periods = (100.0 ** (2.0 * np.arange(n, dtype=np.float32) / np.float32(head_dim // 2)))
    rows, cols = (_dinov3_angles(s, periods.astype(np.float32)) for s in grid)
  # Per patch: the row's n angles, then the column's n.
  angles = np.concatenate([np.repeat(rows, grid[1], axis=0), np.tile(cols, (grid[0], 1))], -1)
  if _HALF[kind]:
    angles = np.concatenate([angles, angles], axis=-1)
  else:
    angles = np.repeat(angles, 2, axis=-1)
  return np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)


def _rotated(x: jax.Array, half: bool) -> jax.Array:
  """x with each rotated pair (a, b) made (-b, a)."""
  if half:
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)
  pairs = x.reshape(x.shape[:-1] + (-1, 2))
  # Plain slices: pairs[..., 1] with a symbolic batch is a gather TFLite cannot lower (tokens.py).
  a, b = (jax.lax.index_in_dim(pairs, i, axis=-1, keepdims=False) for i in (0, 1))
  return jnp.stack([-b, a], axis=-1).reshape(x.shape)


def apply(x: jax.Array, sin: jax.Array, cos: jax.Array, kind: str) -> jax.Array:
  """(batch, tokens, heads, head_dim) queries or keys, the last len(sin) tokens (the patches)
  rotated in float32 and cast back to x's dtype; the tokens before them as they are."""
  prefix, patches = tokens.split(x, x.shape[1] - sin.shape[0])
  patches = patches.astype(jnp.float32)
  sin, cos = sin[:, None, :], cos[:, None, :]  # Broadcast over the heads.
  patches = (patches * cos + _rotated(patches, _HALF[kind]) * sin).astype(x.dtype)
  return jnp.concatenate([prefix, patches], axis=1)
