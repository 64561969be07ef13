"""loader.load: any checkpoint path (.npz, workdir, step dir) to a model and its params (a
training run's workdir and step dir: test_e2e_checkpoints.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.checkpoint import errors, loader, npz


TINY = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny ViT with pre-logits and a random 10-class head, saved as .npz."""
  model = models.create_model("ViT-Ti_16", num_classes=10, representation_size=16, **TINY)
  params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"]
  params["head"]["kernel"] = jax.random.normal(jax.random.key(1), params["head"]["kernel"].shape)
  path = tmp_path_factory.mktemp("ckpt") / "tiny.npz"
  npz.save_npz(str(path), params)
  return str(path), params


def test_a_named_model_is_checked_against_the_arrays(tiny):
  path, params = tiny
  ckpt = loader.load(path, "ViT-Ti_16", **TINY)
  jax.tree.map(np.testing.assert_array_equal, ckpt.params, params)
  assert ckpt.image_size == 28 and ckpt.model.num_classes == 10
  assert ckpt.model.representation_size == 16  # Read from the file, not the name.
  with pytest.raises(errors.CheckpointError, match=r'as overrides: \{"patch_size": 7'):
    loader.load(path, "ViT-Ti_16")
  with pytest.raises(ValueError, match="Unknown model 'ViT-Q_16'. Known models: ViT-Ti_16"):
    loader.load(path, "ViT-Q_16")
  bigger = loader.load(path, "ViT-Ti_16", image_size=42, **TINY)
  assert bigger.grid == (6, 6)
  assert bigger.params["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 37, 32)


def test_without_a_name_the_architecture_is_read_off_the_arrays(tiny):
  path, params = tiny
  ckpt = loader.load(path)
  assert ckpt.model.name_in_registry is None  # No registry model is this small.
  assert {k: getattr(ckpt.model, k) for k in TINY} == TINY
  jax.tree.map(np.testing.assert_array_equal, ckpt.params, params)
  headless = loader.load(path, head=False, image_size=14)
  assert headless.model.num_classes is None and "head" not in headless.params
  images = np.random.default_rng(0).uniform(-1, 1, (2, 14, 14, 3)).astype(np.float32)
  assert headless.model.apply({"params": headless.params}, images).shape == (2, 16)


def test_a_registry_architecture_is_named():
  fields = models.model_config("R26+ViT-S_32", resnet_layers=[2, 2, 2, 2])
  assert models.registry.match_name(fields) == "R26+ViT-S_32"
  assert models.registry.match_name(dict(fields, num_layers=3)) is None
