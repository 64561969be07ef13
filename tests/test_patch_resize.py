"""FlexiViT's pseudo-inverse resize of the patch embedding, against big_vision's formula and
its defining property, and a checkpoint loaded at another patch size."""
import numpy as np
import pytest
import tensorflow as tf

from vit_jax import models
from vit_jax.checkpoint import loader, npz
from vit_jax.checkpoint import patch_resize


def big_vision_resample(old: np.ndarray, new_hw: tuple[int, int]) -> np.ndarray:
  """big_vision's `resample_patchemb` (models/proj/flexi/vit.py), restated: the resize matrix
  from tf.image.resize of each basis patch, its transpose's pseudo-inverse per channel pair."""
  old_hw = old.shape[:2]
  basis = np.eye(np.prod(old_hw)).reshape(-1, *old_hw)
  mat = np.stack([tf.image.resize(b[None, ..., None], new_hw, method="bilinear")[0, ..., 0]
                  .numpy().reshape(-1) for b in basis]).T
  pinv = np.linalg.pinv(mat.T)
  out = np.empty((*new_hw, *old.shape[2:]))
  for i in range(old.shape[2]):
    for o in range(old.shape[3]):
      out[:, :, i, o] = (pinv @ old[:, :, i, o].reshape(-1)).reshape(new_hw)
  return out


@pytest.mark.parametrize("new_hw", [(8, 8), (12, 12), (24, 24), (32, 32), (24, 16)])
def test_equals_big_visions_formula(new_hw):
  kernel = np.random.default_rng(0).standard_normal((16, 16, 3, 4)).astype(np.float32)
  np.testing.assert_allclose(patch_resize.pi_resize(kernel, new_hw),
                             big_vision_resample(kernel, new_hw), rtol=1e-5, atol=1e-5)


def test_an_upsampled_patch_gives_the_same_token():
  rng = np.random.default_rng(1)
  kernel = rng.standard_normal((8, 8, 3, 5)).astype(np.float32)
  patches = rng.uniform(-1, 1, (4, 8, 8, 3)).astype(np.float32)
  bigger = tf.image.resize(patches, (16, 16), method="bilinear").numpy()
  new = patch_resize.pi_resize(kernel, (16, 16))
  np.testing.assert_allclose(np.einsum("bhwc,hwcd->bd", bigger, new),
                             np.einsum("bhwc,hwcd->bd", patches, kernel), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_loads_at_another_patch_size(tmp_path):
  import jax
  import jax.numpy as jnp
  model = models.create_model("ViT-Ti_16", num_classes=10, patch_size=8, hidden_size=32,
                              mlp_dim=64, num_heads=2, num_layers=2)
  params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
  npz.save_npz(tmp_path / "p8.npz", params)
  loaded = loader.load(str(tmp_path / "p8.npz"), patch_size=4, image_size=64)
  assert loaded.model.patch_size == 4 and loaded.grid == (16, 16)
  assert loaded.description.model["patch_size"] == 4 and loaded.model.name_in_registry is None
  np.testing.assert_allclose(loaded.params["embedding"]["kernel"],
                             patch_resize.pi_resize(np.asarray(params["embedding"]["kernel"]),
                                                    (4, 4)), rtol=1e-6)
  assert loaded.model.apply({"params": loaded.params}, jnp.zeros((1, 64, 64, 3))).shape == (1, 10)
