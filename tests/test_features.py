"""models.features: a ViT's intermediate blocks against timm's `forward_intermediates` on the
same random weights, and a model cut after its last needed block."""
import jax
import numpy as np
import pytest

from vit_jax import models
from vit_jax.checkpoint import npz
from vit_jax.checkpoint.layouts import timm_vit
from vit_jax.models import features, timm_models


@pytest.fixture(scope="module")
def pair():
  """timm's ViT-Ti/16 with random weights (perturbed away from its initialisation), and ours
  holding the same weights."""
  torch, _ = timm_models.import_torch()
  torch.manual_seed(0)
  reference = timm_models.create("ViT-Ti_16", num_classes=10)
  with torch.no_grad():
    for p in reference.parameters():
      p.add_(0.05 * torch.randn_like(p))
  params = npz.unflatten(timm_vit.to_npz(reference))
  images = np.random.default_rng(0).uniform(-1, 1, (2, 224, 224, 3)).astype(np.float32)
  return reference, models.create_model("ViT-Ti_16", num_classes=10), params, images


def timm_intermediates(reference, images, **kwargs) -> list[tuple[np.ndarray, np.ndarray]]:
  """(feature map NCHW, class token) per block taken."""
  torch, _ = timm_models.import_torch()
  reference.eval()
  with torch.no_grad():
    out = reference.forward_intermediates(torch.from_numpy(images.transpose(0, 3, 1, 2)),
                                          intermediates_only=True, return_prefix_tokens=True,
                                          output_fmt="NCHW", **kwargs)
  return [(f.numpy(), p.numpy()) for f, p in out]


@pytest.mark.parametrize("indices", [None, 3, [0, 5, -1]], ids=["all", "last3", "chosen"])
@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
def test_block_outputs_are_timms(pair, indices, norm):
  reference, model, params, images = pair
  ours, prefix = features.forward_intermediates(model, params, images, indices, norm=norm,
                                                prefix_tokens=True)
  theirs = timm_intermediates(reference, images, indices=indices, norm=norm)
  assert len(ours) == len(theirs) == (12 if indices is None else 3)
  for (f, p), ours_f, ours_p in zip(theirs, ours, prefix):
    assert ours_f.shape == (2, 14, 14, 192) and ours_p.shape == (2, 1, 192)
    np.testing.assert_allclose(np.asarray(ours_f), f.transpose(0, 2, 3, 1), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(ours_p), p, atol=1e-4, rtol=1e-4)


def test_token_sequences_and_stopping_early_give_the_same_values(pair):
  _, model, params, images = pair
  maps = features.forward_intermediates(model, params, images, [1, 4])
  tokens = features.forward_intermediates(model, params, images, [1, 4], output_fmt="NLC",
                                          stop_early=True)
  for m, t in zip(maps, tokens):
    assert t.shape == (2, 196, 192)
    np.testing.assert_allclose(np.asarray(m).reshape(2, 196, 192), np.asarray(t), atol=1e-5)


def test_a_pruned_model_has_no_later_blocks_and_no_head(pair):
  _, model, params, _ = pair
  pruned, kept = features.prune(model, params, 4)
  assert pruned.num_layers == 5 and pruned.num_classes is None
  assert "head" not in kept and sorted(k for k in kept["Transformer"] if "block" in k) == [
      f"encoderblock_{i}" for i in range(5)]
  abstract = jax.eval_shape(pruned.init, jax.random.key(0), np.zeros((1, 224, 224, 3)))
  assert jax.tree.structure(abstract["params"]) == jax.tree.structure(kept)


@pytest.mark.parametrize("indices,message", [(0, "0 < n <= 12"), ([12], "blocks 0 to 11"),
                                             (13, "0 < n <= 12")])
def test_bad_indices_are_named(pair, indices, message):
  _, model, params, images = pair
  with pytest.raises(ValueError, match=message):
    features.forward_intermediates(model, params, images[:1], indices)
