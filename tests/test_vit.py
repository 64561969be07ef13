"""models/vit.py's options beyond the named models (test_models.py):

- The fused-attention path ("auto": XLA on CPU) equals the explicit softmax one
  (test_attention.py: each path).
- Register tokens (num_registers): timm's register ViTs' weights moved into ours give timm's
  logits and block outputs, ours moved into timm's give ours, and ours write to and read from
  .npz as every other array.
- Any input resolution at run time (dynamic_image_size): the position embedding resampled in
  the forward pass gives the logits of the checkpoint loaded at that resolution, bilinearly as
  the official code resizes and bicubically as timm's `dynamic_img_size` does.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_VIT, noisy
from vit_jax import models
from vit_jax.checkpoint import errors, loader, npz
from vit_jax.checkpoint.layouts import timm_vit
from vit_jax.models import features, timm_models, vit

TINY = dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=4, num_layers=1)


def normal_params(model, images):
  """N(0, 0.3) parameters of the model's shapes, made on the host (no init to compile).

  Random rather than initial values: the zero-initialised head would hide the attention.
  """
  shapes = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32), shapes)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_fused_attention_equals_explicit_softmax(dtype, tol):
  model = models.create_model("ViT-Ti_16", num_classes=5, dtype=dtype, attention_impl="auto",
                              **TINY)
  images = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype(np.float32)
  variables = {"params": normal_params(model, images)}
  apply = jax.jit(model.apply, static_argnames=("return_aux", "return_attention"))
  fused, fused_aux = apply(variables, images, return_aux=True)
  explicit, aux = apply(variables, images, return_attention=True)
  assert aux["attention"][0].shape == (2, 4, 17, 17)  # The explicit path did run.
  for a, b in ((fused, explicit), (fused_aux["encoded"], aux["encoded"])):
    np.testing.assert_allclose(a, b, atol=tol * np.max(np.abs(b)), rtol=tol)


def test_unknown_attention_impl_is_named():
  model = models.create_model("ViT-Ti_16", attention_impl="flash", **TINY)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


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
  return reference, timm_vit.to_npz(reference)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_prefix_tokens_are_timms(layout, tmp_path):
  torch, _ = timm_models.import_torch()
  reference, arrays = timm_with_registers(**LAYOUTS[layout])
  assert arrays["reg"].shape == (1, 4, 192)
  np.savez(tmp_path / "timm.npz", **arrays)
  loaded = loader.load(str(tmp_path / "timm.npz"))
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
  params = noisy(model.init(jax.random.key(0), images)["params"], 0.05, seed=1)
  reference, _ = timm_with_registers(**LAYOUTS[layout])
  timm_models.load_into(reference, npz.flatten(params))
  np.testing.assert_allclose(timm_models.logits(reference, images),
                             np.asarray(model.apply({"params": params}, images)),
                             atol=1e-4, rtol=1e-4)


def test_registers_round_trip_through_npz(tmp_path):
  model = models.create_model("ViT-Ti_16", num_classes=3, num_registers=2, patch_size=8,
                              num_layers=2)
  params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))["params"]
  assert params["reg"].shape == (1, 2, 192)
  assert params["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 17, 192)
  npz.save_npz(str(tmp_path / "r.npz"), params)
  loaded = loader.load(str(tmp_path / "r.npz"))
  assert loaded.model.num_registers == 2 and loaded.description.model["num_registers"] == 2
  for name, value in npz.flatten(params).items():
    np.testing.assert_array_equal(npz.flatten(loaded.params)[name], value, err_msg=name)
  with pytest.raises(errors.CheckpointError, match="reg: in the checkpoint"):
    loader.load(str(tmp_path / "r.npz"), num_registers=0)


def images(h: int, w: int) -> np.ndarray:
  return np.random.default_rng(0).uniform(-1, 1, (2, h, w, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  """A tiny ViT's params at 32 px (a 4x4 grid), perturbed, as an .npz."""
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  params = noisy(model.init(jax.random.key(0), images(32, 32))["params"], 0.1, seed=1)
  path = str(tmp_path_factory.mktemp("dynamic") / "tiny.npz")
  npz.save_npz(path, params)
  return path


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_logits_at_another_size_are_the_resized_checkpoints(tiny_npz, method):
  dynamic = loader.load(tiny_npz, dynamic_image_size=True, posemb_interpolation=method)
  assert dynamic.image_size == 32
  apply = jax.jit(lambda p, x: dynamic.model.apply({"params": p}, x))
  for size in (56, 16):
    resized = loader.load(tiny_npz, image_size=size, posemb_interpolation=method)
    want = resized.model.apply({"params": resized.params}, images(size, size))
    np.testing.assert_allclose(np.asarray(apply(dynamic.params, images(size, size))),
                               np.asarray(want), atol=1e-5, rtol=1e-5)
  assert apply(dynamic.params, images(48, 24)).shape == (2, 5)  # Not square either.


def test_bicubic_is_timms_dynamic_img_size():
  torch, _ = timm_models.import_torch()
  torch.manual_seed(0)
  reference = timm_models.create("ViT-Ti_16", num_classes=10, img_size=64,
                                 dynamic_img_size=True)
  with torch.no_grad():
    for p in reference.parameters():
      p.add_(0.05 * torch.randn_like(p))
  params = npz.unflatten(timm_vit.to_npz(reference))
  model = models.create_model("ViT-Ti_16", num_classes=10, dynamic_image_size=True,
                              posemb_interpolation="bicubic")
  for h, w in ((96, 128), (32, 48)):
    ours = model.apply({"params": params}, images(h, w))
    np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(h, w)),
                               atol=1e-4, rtol=1e-4)


def test_a_fixed_size_model_names_the_way_out(tiny_npz):
  loaded = loader.load(tiny_npz)
  with pytest.raises(ValueError, match=r"position embedding has 17 tokens, the input gives 50 "
                     r"\(7x7 patches\): load the checkpoint at this image_size, or build the "
                     "model with dynamic_image_size=True"):
    loaded.model.apply({"params": loaded.params}, images(56, 56))
