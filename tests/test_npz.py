"""Checkpoint interchange (checkpoint/npz.py): layouts, fitting to a model, round trips, timm
equivalence, bad files refused, and a bucket of one's own read straight from gs://."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from helpers import big_vision_layout, new_flax_layout, random_params
from vit_jax import models
from vit_jax.checkpoint import errors, npz
from vit_jax.checkpoint.layouts import timm_vit
from vit_jax.models import timm_models


TINY = dict(hidden_size=32, mlp_dim=64, num_heads=4, num_layers=2, patch_size=8)
HYBRID_TINY = dict(hidden_size=32, mlp_dim=64, num_heads=4, num_layers=2, resnet_layers=(1, 1, 1, 1))


def assert_trees_equal(a, b):
  fa, fb = npz.flatten(a), npz.flatten(b)
  assert set(fa) == set(fb)
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


def write_npz(path, flat):
  np.savez(path, **flat)
  return str(path)


@pytest.fixture(scope="module")
def hybrid():
  model = models.create_model("R26+ViT-S_32", num_classes=7, representation_size=16, **HYBRID_TINY)
  return model, random_params(model, 64)


def test_round_trip_is_exact(tmp_path, hybrid):
  _, params = hybrid
  npz.save_npz(tmp_path / "a.npz", params)
  assert_trees_equal(npz.load_npz(tmp_path / "a.npz"), params)
  assert_trees_equal(npz.load_npz(tmp_path / "a.npz", target=params), params)
  with np.load(tmp_path / "a.npz", allow_pickle=False) as f:
    assert "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel" in f.files
    assert f["Transformer/posembed_input/pos_embedding"].shape == (1, 1 + 4, 32)


@pytest.mark.parametrize("layout", ["new_flax", "big_vision", "big_vision_scanned", "opt_target"])
def test_every_layout_loads_to_the_same_params(tmp_path, hybrid, layout):
  model, params = hybrid
  flat = npz.flatten(params)
  converted = {
      "new_flax": lambda: new_flax_layout(flat),
      "big_vision": lambda: big_vision_layout(flat, scanned=False),
      "big_vision_scanned": lambda: big_vision_layout(flat, scanned=True),
      "opt_target": lambda: {f"opt/target/{k}": v for k, v in flat.items()},
  }[layout]()
  assert set(converted) != set(flat)
  path = write_npz(tmp_path / "c.npz", converted)
  loaded = npz.load_npz(path, target=params)
  if layout.startswith("big_vision"):
    # big_vision gives the class token no position embedding: the class entry loads as zero.
    expected = dict(flat)
    expected[npz.POSEMB_KEY] = np.concatenate(
        [np.zeros((1, 1, 32), np.float32), flat[npz.POSEMB_KEY][:, 1:]], axis=1)
    assert_trees_equal(loaded, npz.unflatten(expected))
  else:
    assert_trees_equal(loaded, params)


def test_big_vision_posemb_is_numerically_equivalent(tmp_path):
  """A big_vision model (class token without position embedding) is reproduced exactly."""
  model = models.create_model("ViT-Ti_16", num_classes=3, **TINY)
  params = random_params(model, 32)
  flat = npz.flatten(params)
  flat[npz.POSEMB_KEY][:, :1] = 0.0
  path = write_npz(tmp_path / "bv.npz", big_vision_layout(flat, scanned=True))
  loaded = npz.load_npz(path, target=params)
  images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  np.testing.assert_array_equal(model.apply({"params": loaded}, images),
                                model.apply({"params": npz.unflatten(flat)}, images))


def test_posemb_resize_matches_official_convention():
  rng = np.random.RandomState(0)
  posemb = rng.normal(size=(1, 1 + 14 * 14, 8)).astype(np.float32)
  out = npz.resize_posemb(posemb, 1 + 24 * 24, has_class_token=True,
                                 target_has_class_token=True)
  grid = scipy.ndimage.zoom(posemb[0, 1:].reshape(14, 14, 8), (24 / 14, 24 / 14, 1), order=1)
  np.testing.assert_array_equal(out[:, 0], posemb[:, 0])
  np.testing.assert_allclose(out[0, 1:], grid.reshape(576, 8), rtol=1e-6)
  # Corners of a bilinear zoom land on the corners of the old grid.
  np.testing.assert_allclose(out[0, 1], posemb[0, 1], rtol=1e-6)
  np.testing.assert_allclose(out[0, -1], posemb[0, -1], rtol=1e-6)
  # token -> gap drops the class entry.
  gap = npz.resize_posemb(posemb, 24 * 24, has_class_token=True,
                                 target_has_class_token=False)
  np.testing.assert_array_equal(gap, out[:, 1:])


def test_finetune_fit_resizes_posemb_resets_head_drops_prelogits(tmp_path, hybrid):
  _, params = hybrid
  path = tmp_path / "p.npz"
  npz.save_npz(path, params)
  target_model = models.create_model("R26+ViT-S_32", num_classes=3, head_bias_init=-10.0, **HYBRID_TINY)
  target = jax.jit(target_model.init)(jax.random.key(3), jnp.zeros((1, 96, 96, 3)))["params"]
  loaded = npz.load_npz(path, target=target)
  assert "pre_logits" not in loaded
  np.testing.assert_array_equal(loaded["head"]["kernel"], np.zeros((32, 3)))
  np.testing.assert_array_equal(loaded["head"]["bias"], np.full((3,), -10.0))
  posemb = loaded["Transformer"]["posembed_input"]["pos_embedding"]
  assert posemb.shape == (1, 1 + 9, 32)
  old = params["Transformer"]["posembed_input"]["pos_embedding"]
  np.testing.assert_array_equal(posemb[:, 0], old[:, 0])
  np.testing.assert_array_equal(loaded["block1"]["unit1"]["conv1"]["kernel"],
                                params["block1"]["unit1"]["conv1"]["kernel"])
  logits = jax.jit(target_model.apply)({"params": loaded}, jnp.ones((2, 96, 96, 3)))
  np.testing.assert_array_equal(logits, -10.0)


def test_abstract_target_is_enough(tmp_path, hybrid):
  model, params = hybrid
  npz.save_npz(tmp_path / "p.npz", params)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 64, 64, 3)))["params"]
  assert_trees_equal(npz.load_npz(tmp_path / "p.npz", target=shapes), params)


def test_mismatch_names_key_shapes_and_fix(tmp_path, hybrid):
  _, params = hybrid
  npz.save_npz(tmp_path / "p.npz", params)
  wrong = models.create_model("R26+ViT-S_32", num_classes=7, representation_size=16,
                              **{**HYBRID_TINY, "mlp_dim": 48})
  target = jax.eval_shape(wrong.init, jax.random.key(0), jnp.zeros((1, 64, 64, 3)))["params"]
  with pytest.raises(errors.CheckpointError) as e:
    npz.load_npz(tmp_path / "p.npz", target=target)
  msg = str(e.value)
  assert "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel: checkpoint has (32, 64), " \
         "model wants (32, 48); check the model name" in msg
  plain = models.create_model("ViT-S_32", num_classes=7, representation_size=16,
                              **{**TINY, "patch_size": 32})
  target = jax.eval_shape(plain.init, jax.random.key(0), jnp.zeros((1, 64, 64, 3)))["params"]
  with pytest.raises(errors.CheckpointError, match="conv_root/kernel: in the checkpoint"):
    npz.load_npz(tmp_path / "p.npz", target=target)


def test_missing_prelogits_names_the_fix(tmp_path):
  model = models.create_model("ViT-Ti_16", num_classes=3, **TINY)
  params = random_params(model, 32)
  npz.save_npz(tmp_path / "p.npz", params)
  rep = models.create_model("ViT-Ti_16", num_classes=3, representation_size=8, **TINY)
  target = jax.eval_shape(rep.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
  with pytest.raises(errors.CheckpointError, match="pre_logits/kernel: missing .*representation_size=None"):
    npz.load_npz(tmp_path / "p.npz", target=target)


def test_refuses_non_npz_and_pickles(tmp_path):
  (tmp_path / "x.npz").write_bytes(b"not a zip")
  with pytest.raises(errors.CheckpointError, match="not an .npz file"):
    npz.load_npz(tmp_path / "x.npz")
  np.savez(tmp_path / "p.npz", a=np.array([{"x": 1}], dtype=object))
  with pytest.raises(errors.CheckpointError, match="pickled objects"):
    npz.load_npz(tmp_path / "p.npz")
  with pytest.raises(errors.CheckpointError, match="is a directory"):
    npz.load_npz(tmp_path)
  np.savez(tmp_path / "whole.npz", a=np.zeros((64, 64), np.float32))
  data = (tmp_path / "whole.npz").read_bytes()
  (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2])
  with pytest.raises(errors.CheckpointError, match=r"cut\.npz is damaged .*copy it again"):
    npz.load_npz(tmp_path / "cut.npz")
  import zipfile
  with zipfile.ZipFile(tmp_path / "empty.npz", "w") as z:
    z.writestr("notes.txt", "no arrays here")
  with pytest.raises(errors.CheckpointError, match=r"empty\.npz is a zip file holding no arrays"):
    npz.load_npz(tmp_path / "empty.npz")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ViT-Ti_16", "R+ViT-Ti_16", "R26+ViT-S_32"])
def test_logits_match_timm_both_directions(tmp_path, name):
  """Named models at their full size, random weights: our .npz -> timm's loader, and timm ->
  ours (every named model's count is checked against timm's in test_models.py)."""
  torch, _ = timm_models.import_torch()
  from timm.models.vision_transformer import _load_weights
  torch.set_num_threads(2)
  model = models.create_model(name, num_classes=10)
  params = random_params(model, 224)
  images = np.random.RandomState(0).uniform(-1, 1, (2, 224, 224, 3)).astype(np.float32)
  apply = jax.jit(model.apply)
  ours = np.asarray(apply({"params": params}, images))
  assert np.abs(ours).max() > 0.1  # non-trivial logits

  npz.save_npz(tmp_path / "ours.npz", params)
  reference = timm_models.create(name, num_classes=10)
  _load_weights(reference, str(tmp_path / "ours.npz"))
  np.testing.assert_allclose(timm_models.logits(reference, images), ours, rtol=0, atol=1e-4)

  # Reverse: timm's own random weights, exported, loaded here.
  reference = timm_models.create(name, num_classes=10)
  with torch.no_grad():
    for p in reference.parameters():
      p.add_(0.02 * torch.randn_like(p))
  flat = timm_vit.to_npz(reference)
  path = write_npz(tmp_path / "timm.npz", flat)
  loaded = npz.load_npz(path, target=params)
  np.testing.assert_allclose(np.asarray(apply({"params": loaded}, images)),
                             timm_models.logits(reference, images), rtol=0, atol=1e-4)


def test_checkpoints_in_a_bucket_of_ones_own_are_read_through_tf_gfile(tmp_path, monkeypatch):
  """etils.epath hands gs:// paths to TensorFlow's gfile (which reads the buckets the user's
  credentials reach: their own, a mirror of gs://vit_models); here gfile is pointed at a local
  copy of the bucket."""
  import tensorflow as tf
  from vit_jax.checkpoint import errors, npz

  bucket = tmp_path / "my-bucket" / "vit_models" / "imagenet21k"
  bucket.mkdir(parents=True)
  arrays = {"cls": np.zeros((1, 1, 8), np.float32), "head/kernel": np.ones((8, 3), np.float32)}
  with open(bucket / "ViT-B_16.npz", "wb") as f:
    np.savez(f, **arrays)
  opened = []
  local = lambda path: str(path).replace("gs://", f"{tmp_path}/")

  def gfile_open(path, mode="r"):
    opened.append(str(path))
    return open(local(path), mode)

  monkeypatch.setattr(tf.io.gfile, "GFile", gfile_open)
  monkeypatch.setattr(tf.io.gfile, "exists", lambda p: os.path.exists(local(p)))
  monkeypatch.setattr(tf.io.gfile, "isdir", lambda p: os.path.isdir(local(p)))
  flat = npz.load_npz_flat("gs://my-bucket/vit_models/imagenet21k/ViT-B_16.npz")
  assert opened == ["gs://my-bucket/vit_models/imagenet21k/ViT-B_16.npz"]
  assert set(flat) == set(arrays)
  np.testing.assert_array_equal(flat["head/kernel"], arrays["head/kernel"])


@pytest.mark.parametrize("layout", [
    {}, {"qkv_bias": "none", "classifier": "gap"},
    {"pre_norm": True, "layer_scale": True, "qkv_bias": "qv", "mlp": "swiglu", "mlp_norm": True,
     "attention_norm": True, "head_bias": False}], ids=["official", "no_qkv_bias", "every_field"])
def test_the_layout_fields_are_read_off_the_arrays(layout):
  """What the arrays tell (a layout's converted checkpoint is described from them): each
  field read back, the defaults left out."""
  arch = dict(patch_size=4, hidden_size=32, mlp_dim=48, num_heads=2, num_layers=2)
  model = models.vit.VisionTransformer(num_classes=7, **arch, **layout)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))["params"]
  inferred = npz.infer_model_config(npz.flatten(jax.device_get(params)))
  classifier = layout.pop("classifier", "token")
  assert inferred == {**arch, "classifier": classifier, **layout, "representation_size": None,
                      "posemb": "learn"}
