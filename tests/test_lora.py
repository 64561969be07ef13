"""LoRA (models/lora.py): adapted layers against their merged kernels and a hand computation,
only the adapters and the head trained (no optimizer state for the rest), adapters added to a
pre-trained checkpoint, bad settings named (a LoRA run's adapters exported and loaded on their
base: test_e2e_checkpoints.py)."""
import re

import jax
import numpy as np
import pytest

from helpers import IMAGES, TINY_CONFIG, TINY_VIT, adapted_params
from vit_jax import configs, models
from vit_jax.checkpoint import loader, npz
from vit_jax.config_errors import ConfigError
from vit_jax.models import lora
from vit_jax.train import config as config_lib, optimizers, sharding, trainer


LORA = dict(lora_rank=3, lora_alpha=6.0, lora_targets=lora.TARGETS)


def test_an_adapted_model_computes_its_merged_kernels():
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  params = adapted_params(model)
  flat = npz.flatten(params)
  assert sum(lora.is_adapter(k) for k in flat) == 2 * 6 * TINY_VIT["num_layers"]
  merged = lora.merge(flat, 6.0 / 3)
  assert not any(lora.is_adapter(k) for k in merged)
  name = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/"
  a, b = flat[name + "lora_a"], flat[name + "lora_b"]
  assert a.shape == (32, 3) and b.shape == (3, 32)  # (heads * head_dim, r), (r, width).
  np.testing.assert_allclose(merged[name + "kernel"],
                             flat[name + "kernel"] + 2.0 * (a @ b).reshape(2, 16, 32), rtol=1e-6)
  plain = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  want = plain.apply({"params": npz.unflatten(merged)}, IMAGES)
  got = model.apply({"params": params}, IMAGES)
  assert np.abs(np.asarray(want)).max() > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_merges_to_the_plain_vit():
  """`merged`, as the checkpoint readers apply it: adapters folded, the LoRA fields gone."""
  assert lora.FIELDS == models.registry.fields_of(models.Role.LORA)
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  flat = npz.flatten(adapted_params(model))
  described = models.registry.described_fields(model)
  arrays, fields = lora.merged(flat, described | LORA)
  assert fields == described
  want = lora.merge(flat, 6.0 / 3)
  assert arrays.keys() == want.keys() and all(np.array_equal(arrays[k], want[k]) for k in want)
  same, unchanged = lora.merged(want, described)  # No adapters: as it is.
  assert same is want and unchanged is described


def test_new_adapters_change_nothing():
  """B starts at zero: the adapted model computes its base model's logits."""
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  params = npz.flatten(model.init(jax.random.key(0), IMAGES)["params"])
  assert all(not np.any(v) for k, v in params.items() if k.endswith("lora_b"))
  assert all(np.std(v) > 0 for k, v in params.items() if k.endswith("lora_a"))
  base = {k: v for k, v in params.items() if not lora.is_adapter(k)}
  plain = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT)
  np.testing.assert_array_equal(
      np.asarray(model.apply({"params": npz.unflatten(params)}, IMAGES)),
      np.asarray(plain.apply({"params": npz.unflatten(base)}, IMAGES)))


def test_only_the_adapters_and_the_head_train():
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  mesh = sharding.make_mesh()
  tx, _ = optimizers.make_optimizer(optimizers.default_config(), 10, 0,
                                    trained_only=lora.TRAINED)
  state, shardings = trainer.init_state(model, tx, mesh, (32, 32, 3), jax.random.key(0))
  step = trainer.make_train_step(model, tx, "softmax_xent", shardings, mesh, jax.random.key(1))
  before = npz.flatten(jax.device_get(state.params))
  batch = {"image": IMAGES, "label": np.arange(8, dtype=np.int32) % 5}
  for _ in range(2):  # After one step A has had no gradient yet (B was zero).
    state, _ = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
  after = npz.flatten(jax.device_get(state.params))
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
  base = npz.flatten(adapted_params(plain))
  npz.save_npz(str(tmp_path / "base.npz"), npz.unflatten(base))
  model = models.create_model("ViT-Ti_16", num_classes=5, **TINY_VIT, **LORA)
  opened = loader.open_checkpoint(str(tmp_path / "base.npz"))
  params = npz.flatten(run_setup.load_pretrained(model, opened, jax.random.key(0), 32))
  assert set(params) - set(base) == {k for k in params if lora.is_adapter(k)}
  for name, value in base.items():
    np.testing.assert_array_equal(params[name], value, err_msg=name)
  np.testing.assert_array_equal(  # The adapted model starts as the checkpoint.
      np.asarray(model.apply({"params": npz.unflatten(params)}, IMAGES)),
      np.asarray(plain.apply({"params": npz.unflatten(base)}, IMAGES)))


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
