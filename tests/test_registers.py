"""Register tokens (num_registers): timm's register ViTs' weights moved into ours give timm's
logits and block outputs, ours moved into timm's give ours, and ours write to and read from
.npz as every other array."""
import jax
import numpy as np
import pytest

from vit_jax import checkpoint, models
from vit_jax.models import features, timm_models

# timm's layouts: position embedding over the patches only (its register models), or over
# every token, registers included.
LAYOUTS = {
    "token, no_embed_class": dict(no_embed_class=True),
    "token, embedded registers": dict(no_embed_class=False),
    "gap, no_embed_class": dict(no_embed_class=True, class_token=False, global_pool="avg",
                                fc_norm=False),
}


def timm_with_registers(**kwargs):
  """timm's ViT-Ti/16 at 64 px with 4 registers, its weights perturbed away from their
  initialisation (the registers' is 1e-6 noise), and the same weights as our arrays."""
  torch, _ = timm_models.import_torch()
  torch.manual_seed(0)
  reference = timm_models.create("ViT-Ti_16", num_classes=10, img_size=64, reg_tokens=4,
                                 **kwargs)
  with torch.no_grad():
    for p in reference.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return reference, timm_models.to_npz(reference)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_prefix_tokens_are_timms(layout, tmp_path):
  torch, _ = timm_models.import_torch()
  reference, arrays = timm_with_registers(**LAYOUTS[layout])
  assert arrays["reg"].shape == (1, 4, 192)
  np.savez(tmp_path / "timm.npz", **arrays)
  loaded = checkpoint.load(str(tmp_path / "timm.npz"))
  assert loaded.model.num_registers == 4
  assert loaded.model.classifier == ("gap" if "gap" in layout else "token")
  images = np.random.default_rng(0).uniform(-1, 1, (2, 64, 64, 3)).astype(np.float32)
  ours = loaded.model.apply({"params": loaded.params}, images)
  np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images),
                             atol=1e-4, rtol=1e-4)

  maps, prefix = features.forward_intermediates(loaded.model, loaded.params, images, [1, -1],
                                                prefix_tokens=True, output_fmt="NLC")
  with torch.no_grad():
    theirs = reference.forward_intermediates(
        torch.from_numpy(images.transpose(0, 3, 1, 2)), indices=[1, -1],
        intermediates_only=True, return_prefix_tokens=True, output_fmt="NLC")
  for m, p, (tm, tp) in zip(maps, prefix, theirs):
    assert p.shape == (2, 4 if "gap" in layout else 5, 192)
    np.testing.assert_allclose(np.asarray(m), tm.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(p), tp.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ours_moved_into_timm_give_our_logits(layout):
  gap = "gap" in layout
  model = models.create_model("ViT-Ti_16", num_classes=10, num_registers=4,
                              classifier="gap" if gap else "token")
  images = np.random.default_rng(0).uniform(-1, 1, (2, 64, 64, 3)).astype(np.float32)
  params = model.init(jax.random.key(0), images)["params"]
  noise = np.random.default_rng(1)
  params = jax.tree.map(lambda p: p + 0.05 * noise.standard_normal(p.shape, np.float32), params)
  reference, _ = timm_with_registers(**LAYOUTS[layout])
  timm_models.load_into(reference, checkpoint.flatten(params))
  np.testing.assert_allclose(timm_models.logits(reference, images),
                             np.asarray(model.apply({"params": params}, images)),
                             atol=1e-4, rtol=1e-4)


def test_registers_round_trip_through_npz(tmp_path):
  model = models.create_model("ViT-Ti_16", num_classes=3, num_registers=2, patch_size=8,
                              num_layers=2)
  params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))["params"]
  assert params["reg"].shape == (1, 2, 192)
  assert params["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 17, 192)
  checkpoint.save_npz(str(tmp_path / "r.npz"), params)
  loaded = checkpoint.load(str(tmp_path / "r.npz"))
  assert loaded.model.num_registers == 2 and loaded.description.model["num_registers"] == 2
  for name, value in checkpoint.flatten(params).items():
    np.testing.assert_array_equal(checkpoint.flatten(loaded.params)[name], value, err_msg=name)
  with pytest.raises(checkpoint.CheckpointError, match="reg: in the checkpoint"):
    checkpoint.load(str(tmp_path / "r.npz"), num_registers=0)
