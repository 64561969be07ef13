"""loader.load: any checkpoint path (.npz, workdir, step dir) to a model and its params (a
training run's workdir and step dir: test_e2e_checkpoints.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.checkpoint import description, errors, loader, npz


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


B16 = models.model_config("ViT-B_16")
NAMES = {  # The name a description records, its model's fields: the name it is read with.
    "overrides that change the architecture (the quick-start's)": ("ViT-Ti_16", TINY, None),
    "the registry's model": ("ViT-B_16", B16, "ViT-B_16"),
    "another name of the architecture (its pooling's)": (
        "ViT-B_16-gap-norep", dict(B16, classifier="gap"), "ViT-B_16-gap-norep"),
    "no name, a registry architecture": (None, B16, "ViT-B_16"),
    "no name, none": (None, TINY, None),
}


@pytest.mark.parametrize("recorded, fields, named", NAMES.values(), ids=NAMES)
def test_a_description_names_its_model_only_where_the_registry_has_its_architecture(
    tmp_path, tiny, recorded, fields, named):
  """Runs before this recorded their config's model_name whatever their overrides: read back,
  the name stays only where the registry's model of that name is the model; the model
  built, the one-line summary and `--model` agree."""
  path, params = tiny
  described = description.Description(model=fields, model_name=recorded, image_size=28,
                                      num_classes=10)
  assert models.registry.match_name(fields, preferred=recorded) == named
  assert models.create_model(recorded or "ViT-B_16", **fields).name_in_registry == (
      named or None)
  if fields is not TINY:
    return  # Only the tiny file's arrays are at hand to read.
  stale = str(tmp_path / "stale.npz")
  npz.save_npz(stale, params, described)
  opened = loader.open_checkpoint(stale)
  assert opened.description.model_name is None
  label = "ViT with patch 7, width 32, depth 2, 2 heads, MLP 64"
  assert opened.description.model_label == label
  assert opened.description.summary().startswith(f"{label}; 28px; 10 classes")
  ckpt = loader.load(stale)
  assert ckpt.model.name_in_registry is None and ckpt.summary().startswith(f"{label} from ")
  with pytest.raises(description.DescriptionMismatch, match=f"records the model '{label}'"):
    loader.load(stale, "ViT-Ti_16")
  assert loader.load(stale, "ViT-Ti_16", **TINY).model.name_in_registry is None


def test_a_registry_architecture_is_named():
  fields = models.model_config("R26+ViT-S_32", resnet_layers=[2, 2, 2, 2])
  assert models.registry.match_name(fields) == "R26+ViT-S_32"
  assert models.registry.match_name(dict(fields, num_layers=3)) is None
