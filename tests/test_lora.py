"""LoRA (models/lora.py): adapted layers against their merged kernels and a hand computation,
only the adapters and the head trained (no optimizer state for the rest), adapters added to a
pre-trained checkpoint, bad settings named."""
import os
import re

import jax
import numpy as np
import pytest

from helpers import TINY_CONFIG, TINY_VIT, tiny_config
from vit_jax import checkpoint, configs, models
from vit_jax.config_errors import ConfigError
from vit_jax.models import lora
from vit_jax.train import config as config_lib, optimizers, sharding, trainer

LORA = dict(lora_rank=3, lora_alpha=6.0, lora_targets=lora.TARGETS)
IMAGES = np.random.default_rng(0).uniform(-1, 1, (8, 32, 32, 3)).astype(np.float32)


def adapted_params(model, size: int = 32, seed: int = 1):
  """`model`'s initial params with every array (B included) moved away from its init."""
  params = model.init(jax.random.key(0), IMAGES[:1, :size, :size])["params"]
  noise = np.random.default_rng(seed)
  return jax.tree.map(lambda p: p + 0.1 * noise.standard_normal(p.shape, np.float32), params)


def test_an_adapted_model_computes_its_merged_kernels():
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  params = adapted_params(model)
  flat = checkpoint.flatten(params)
  assert sum(lora.is_adapter(k) for k in flat) == 2 * 6 * TINY_VIT["num_layers"]
  merged = lora.merge(flat, 6.0 / 3)
  assert not any(lora.is_adapter(k) for k in merged)
  name = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/"
  a, b = flat[name + "lora_a"], flat[name + "lora_b"]
  assert a.shape == (32, 3) and b.shape == (3, 32)  # (heads * head_dim, r), (r, width).
  np.testing.assert_allclose(merged[name + "kernel"],
                             flat[name + "kernel"] + 2.0 * (a @ b).reshape(2, 16, 32), rtol=1e-6)
  plain = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  want = plain.apply({"params": checkpoint.unflatten(merged)}, IMAGES)
  got = model.apply({"params": params}, IMAGES)
  assert np.abs(np.asarray(want)).max() > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_new_adapters_change_nothing():
  """B starts at zero: the adapted model computes its base model's logits."""
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  params = checkpoint.flatten(model.init(jax.random.key(0), IMAGES)["params"])
  assert all(not np.any(v) for k, v in params.items() if k.endswith("lora_b"))
  assert all(np.std(v) > 0 for k, v in params.items() if k.endswith("lora_a"))
  base = {k: v for k, v in params.items() if not lora.is_adapter(k)}
  plain = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  np.testing.assert_array_equal(
      np.asarray(model.apply({"params": checkpoint.unflatten(params)}, IMAGES)),
      np.asarray(plain.apply({"params": checkpoint.unflatten(base)}, IMAGES)))


def test_only_the_adapters_and_the_head_train():
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  mesh = sharding.make_mesh()
  tx, _ = optimizers.make_optimizer(optimizers.default_config(), 10, 0,
                                    trained_only=lora.TRAINED)
  state, shardings = trainer.init_state(model, tx, mesh, (32, 32, 3), jax.random.key(0))
  step = trainer.make_train_step(model, tx, "softmax_xent", shardings, mesh, jax.random.key(1))
  before = checkpoint.flatten(jax.device_get(state.params))
  batch = {"image": IMAGES, "label": np.arange(8, dtype=np.int32) % 5}
  for _ in range(2):  # After one step A has had no gradient yet (B was zero).
    state, _ = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
  after = checkpoint.flatten(jax.device_get(state.params))
  trained = [k for k in before if any(re.fullmatch(p, k) for p in lora.TRAINED)]
  assert len(trained) == 2 * 6 * TINY_VIT["num_layers"] + 2  # Adapters, head kernel and bias.
  for name, value in before.items():
    if name in trained:
      assert not np.array_equal(after[name], value), name
    else:
      np.testing.assert_array_equal(after[name], value, err_msg=name)
  state_size = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert state_size == 2 * sum(before[k].size for k in trained)  # AdamW's two moments.


def test_a_pretrained_checkpoint_gets_new_adapters(tmp_path):
  from vit_jax.train import run_setup
  plain = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  base = checkpoint.flatten(adapted_params(plain))
  checkpoint.save_npz(str(tmp_path / "base.npz"), checkpoint.unflatten(base))
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  params = checkpoint.flatten(run_setup.load_pretrained(model, str(tmp_path / "base.npz"),
                                                        jax.random.key(0), (32, 32, 3)))
  assert set(params) - set(base) == {k for k in params if lora.is_adapter(k)}
  for name, value in base.items():
    np.testing.assert_array_equal(params[name], value, err_msg=name)
  np.testing.assert_array_equal(  # The adapted model starts as the checkpoint.
      np.asarray(model.apply({"params": checkpoint.unflatten(params)}, IMAGES)),
      np.asarray(plain.apply({"params": checkpoint.unflatten(base)}, IMAGES)))


@pytest.mark.parametrize("fields,message", [
    ({"rank": -1}, "lora.rank=-1: must be >= 0 (0: off)"),
    ({"rank": 4, "alpha": 0.0}, "lora.alpha=0.0: must be > 0 (None: the rank)"),
    ({"rank": 4, "targets": ("qkv",)}, "lora.targets=('qkv',): expected one or more of"),
    ({"rank": 4}, "lora.rank=4: adapts a pretrained model: set config.pretrained"),
])
def test_bad_settings_are_named(fields, message):
  c = configs.get_config(TINY_CONFIG)
  c.lora.update(**fields)
  with pytest.raises(ConfigError, match=re.escape(message)):
    config_lib.validate(c)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, dataset):
  """(folder, the run's merged model, the adapters file's description): fine-tuned with LoRA
  from base.npz, a checkpoint at another resolution and class count; adapters in lora.npz."""
  from vit_jax.train import loop
  tmp = tmp_path_factory.mktemp("lora_run")
  fields = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
  base = models.create_model("ViT-Ti_16", num_classes=3, **fields)
  checkpoint.save_npz(str(tmp / "base.npz"), adapted_params(base, 14))
  checkpoint.save_npz(str(tmp / "other.npz"), adapted_params(base, 14, seed=2))
  c = tiny_config(dataset, total_steps=3, pretrained=str(tmp / "base.npz"), **{
      "lora.rank": 4, "lora.targets": ("query", "value", "Dense_1")})
  loop.train_and_evaluate(c, str(tmp / "run"))
  described = checkpoint.export_adapters(str(tmp / "run"), str(tmp / "lora.npz"))
  return tmp, checkpoint.load(str(tmp / "run")), described


def assert_same_params(got, want):
  assert set(checkpoint.flatten(got)) == set(checkpoint.flatten(want))
  for name, value in checkpoint.flatten(want).items():
    np.testing.assert_array_equal(checkpoint.flatten(got)[name], value, err_msg=name)


@pytest.mark.slow
def test_a_lora_runs_adapters_export_alone_and_load_on_their_base(lora_run):
  """The adapters file is a fraction of the model, and read back on its base it is the run's
  merged model, array for array."""
  tmp, merged, described = lora_run
  assert merged.model.lora_rank == 0 and merged.model.num_classes == 10
  assert described.parent == str(tmp / "base.npz")
  stored = checkpoint.load_npz_flat(str(tmp / "lora.npz"))
  assert set(stored) == {
      k for k in checkpoint.read_params(tmp / "run" / "checkpoints" / "3")[0]
      if lora.is_adapter(k) or k.startswith("head/")}
  size = lambda flat: sum(v.size for v in flat.values())
  assert size(stored) < 0.1 * size(checkpoint.flatten(merged.params))
  on_base = checkpoint.load(str(tmp / "lora.npz"))
  assert on_base.model == merged.model.clone(name_in_registry=on_base.model.name_in_registry)
  assert_same_params(on_base.params, merged.params)


@pytest.mark.slow
def test_adapters_refuse_another_base_and_find_a_moved_one(lora_run, tmp_path):
  """The adapters record their base by content: another file at the base's path is refused
  naming both, a missing one says how to point at it, and --base (the library's base=) finds
  a moved one, through a command too."""
  tmp, merged, described = lora_run
  sha = lambda name: checkpoint.arrays_sha256(checkpoint.load_npz_flat(str(tmp / name)))  # noqa
  assert described.parent_sha256 == sha("base.npz")
  adapters = tmp_path / "lora.npz"
  description = described.replace(parent=str(tmp_path / "base.npz"))
  checkpoint.save_npz(str(adapters), checkpoint.unflatten(checkpoint.load_npz_flat(
      str(tmp / "lora.npz"))), description)
  os.symlink(tmp / "other.npz", tmp_path / "base.npz")
  with pytest.raises(checkpoint.CheckpointError, match=re.escape(
      f"{adapters}: its LoRA adapters were trained on {tmp_path}/base.npz (arrays sha256 "
      f"{sha('base.npz')[:12]}), but {tmp_path}/base.npz holds other arrays (sha256 "
      f"{sha('other.npz')[:12]}); give the base they were trained on with --base PATH")):
    checkpoint.load(str(adapters))
  os.remove(tmp_path / "base.npz")
  with pytest.raises(checkpoint.CheckpointError, match=re.escape(
      f"the base checkpoint its LoRA adapters were trained on, {tmp_path}/base.npz, is not "
      "there; give the base")):
    checkpoint.load(str(adapters))
  moved = checkpoint.load(str(adapters), base=str(tmp / "base.npz"))
  assert_same_params(moved.params, merged.params)
  from vit_jax.tools import export
  assert export.main([str(adapters), str(tmp_path / "whole.npz"), "--base",
                      str(tmp / "base.npz")]) == 0
  assert checkpoint.describe(str(tmp_path / "whole.npz")).parent_sha256 == sha("base.npz")
