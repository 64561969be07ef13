"""Any input resolution at run time (dynamic_image_size): the position embedding resampled in
the forward pass gives the logits of the checkpoint loaded at that resolution, bilinearly as
the official code resizes and bicubically as timm's `dynamic_img_size` does."""
import jax
import numpy as np
import pytest

from helpers import TINY_VIT
from vit_jax import checkpoint, models
from vit_jax.models import timm_models


def images(h: int, w: int) -> np.ndarray:
  return np.random.default_rng(0).uniform(-1, 1, (2, h, w, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  """A tiny ViT's params at 32 px (a 4x4 grid), perturbed, as an .npz."""
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  params = model.init(jax.random.key(0), images(32, 32))["params"]
  noise = np.random.default_rng(1)
  params = jax.tree.map(lambda p: p + 0.1 * noise.standard_normal(p.shape, np.float32), params)
  path = str(tmp_path_factory.mktemp("dynamic") / "tiny.npz")
  checkpoint.save_npz(path, params)
  return path


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_logits_at_another_size_are_the_resized_checkpoints(tiny_npz, method):
  dynamic = checkpoint.load(tiny_npz, dynamic_image_size=True, posemb_interpolation=method)
  assert dynamic.image_size == 32
  apply = jax.jit(lambda p, x: dynamic.model.apply({"params": p}, x))
  for size in (56, 16):
    resized = checkpoint.load(tiny_npz, image_size=size, posemb_interpolation=method)
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
  params = checkpoint.unflatten(timm_models.to_npz(reference))
  model = models.create_model("ViT-Ti_16", num_classes=10, dynamic_image_size=True,
                              posemb_interpolation="bicubic")
  for h, w in ((96, 128), (32, 48)):
    ours = model.apply({"params": params}, images(h, w))
    np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(h, w)),
                               atol=1e-4, rtol=1e-4)


def test_a_fixed_size_model_names_the_way_out(tiny_npz):
  loaded = checkpoint.load(tiny_npz)
  with pytest.raises(ValueError, match=r"position embedding has 17 tokens, the input gives 50 "
                     r"\(7x7 patches\): load the checkpoint at this image_size, or build the "
                     "model with dynamic_image_size=True"):
    loaded.model.apply({"params": loaded.params}, images(56, 56))
