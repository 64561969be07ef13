"""The position-embedding resize, against its references: scipy.ndimage.zoom for bilinear (the
official ViT code and big_vision), torch's antialiased bicubic for bicubic (timm), torch's plain
bicubic for bicubic_no_antialias (transformers); and its jax path under jit against its numpy
path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from vit_jax.models import posemb_resize

# (h, w) -> (h2, w2): scipy's output size round(in * zoom) equals the target for each.
BILINEAR_CASES = [((7, 7), (14, 14)), ((14, 14), (24, 24)), ((24, 24), (14, 14)),
                  ((14, 14), (24, 16)), ((7, 5), (1, 1)), ((1, 1), (5, 3)), ((3, 8), (8, 3))]
BICUBIC_CASES = [((7, 7), (14, 14)), ((14, 14), (24, 24)), ((24, 24), (14, 14)),
                 ((14, 14), (24, 16)), ((16, 24), (7, 30)), ((24, 24), (5, 5)), ((5, 9), (9, 5))]


def random_grid(hw: tuple[int, int], depth: int = 6, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal((*hw, depth)).astype(np.float32)


@pytest.mark.parametrize("old_hw,new_hw", BILINEAR_CASES)
def test_bilinear_equals_scipy_zoom(old_hw, new_hw):
  grid = random_grid(old_hw)
  zoom = (new_hw[0] / old_hw[0], new_hw[1] / old_hw[1], 1)
  expected = scipy.ndimage.zoom(grid.astype(np.float64), zoom, order=1)
  assert expected.shape == (*new_hw, 6)
  got = posemb_resize.resample(grid, new_hw, "bilinear")
  assert got.shape == expected.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("method", ["bicubic", "bicubic_no_antialias"])
@pytest.mark.parametrize("old_hw,new_hw", BICUBIC_CASES)
def test_bicubic_equals_torchs_interpolate(old_hw, new_hw, method):
  """timm's antialiased resize; transformers' (ViT, DINOv2, CLIP) without antialias."""
  from vit_jax.models import timm_models
  torch, _ = timm_models.import_torch()
  grid = random_grid(old_hw, seed=1)
  nchw = torch.from_numpy(grid.transpose(2, 0, 1)[None].copy())
  expected = torch.nn.functional.interpolate(nchw, size=new_hw, mode="bicubic",
                                             align_corners=False,
                                             antialias=method == "bicubic")
  expected = expected[0].numpy().transpose(1, 2, 0)
  got = posemb_resize.resample(grid, new_hw, method)
  assert got.shape == expected.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("method", posemb_resize.METHODS)
@pytest.mark.parametrize("in_size,out_size", [(7, 14), (24, 14), (14, 1), (1, 9), (16, 16)])
def test_matrix_shape_and_rows_summing_to_one(method, in_size, out_size):
  mat = posemb_resize.interpolation_matrix(in_size, out_size, method)
  assert mat.shape == (out_size, in_size) and mat.dtype == np.float64
  np.testing.assert_allclose(mat.sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("method", posemb_resize.METHODS)
@pytest.mark.parametrize("old_hw,new_hw", [((14, 14), (24, 16)), ((24, 24), (14, 14))])
def test_jax_under_jit_equals_numpy(method, old_hw, new_hw):
  grid = random_grid(old_hw, seed=2)
  resize = jax.jit(lambda g: posemb_resize.resample(g, new_hw, method))
  got = resize(jnp.asarray(grid))
  assert isinstance(got, jax.Array) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), posemb_resize.resample(grid, new_hw, method),
                             atol=1e-5)
  half = resize(jnp.asarray(grid, jnp.bfloat16))
  assert half.dtype == jnp.bfloat16 and half.shape == (*new_hw, 6)


@pytest.mark.parametrize("method", posemb_resize.METHODS)
def test_equal_sizes_return_the_input(method):
  grid = random_grid((7, 5))
  assert posemb_resize.resample(grid, (7, 5), method) is grid
  as_jax = jnp.asarray(grid)
  assert posemb_resize.resample(as_jax, (7, 5), method) is as_jax


def test_an_unknown_method_is_refused():
  with pytest.raises(ValueError, match="bilinear.*bicubic"):
    posemb_resize.interpolation_matrix(7, 14, "nearest")
  with pytest.raises(ValueError, match="bilinear.*bicubic"):
    posemb_resize.resample(random_grid((7, 7)), (14, 14), "lanczos")
