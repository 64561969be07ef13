"""config.optimizer: layer-wise learning-rate decay against timm's parameter groups,
multipliers and freezing by name against hand computation, and a frozen run resumed exactly."""
import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_VIT, random_like, tiny_config
from vit_jax import models
from vit_jax.checkpoint import errors, npz, run
from vit_jax.config_errors import ConfigError
from vit_jax.models import timm_models
from vit_jax.train import optimizers

TINY = dict(TINY_VIT, num_layers=3)


def abstract_params(name: str, size: int = 32, **fields) -> dict:
  model = models.create_model(name, num_classes=10, **fields)
  return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]


def opt_config(**fields):
  cfg = optimizers.default_config()
  cfg.update(grad_clip_norm=1.0, weight_decay=0.1, **fields)
  optimizers.validate(cfg)
  return cfg


def one_update(cfg, params, grads):
  tx, _ = optimizers.make_optimizer(cfg, total_steps=10, warmup_steps=0)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # Else op by op, per shape.
  return npz.flatten(updates)


def timm_prefix(name: str) -> str:
  """Where a parameter of ours lives in timm's ViT."""
  rules = [(r"cls", "cls_token"), (r"reg", "reg_token"),
           (r"Transformer/posembed_input/.*", "pos_embed"),
           (r"Transformer/pre_norm/.*", "norm_pre."),
           (r"embedding/.*", "patch_embed.proj."),
           (r"(conv_root|gn_root|block\d+/unit\d+)/.*", "patch_embed.backbone."),
           (r"Transformer/encoderblock_(\d+)/.*", "blocks.{}."),
           (r"Transformer/encoder_norm/.*", "norm."), (r"head/.*", "head.")]
  for pattern, prefix in rules:
    if m := re.fullmatch(pattern, name):
      return prefix.format(*m.groups())
  raise AssertionError(f"no timm counterpart for {name}")


# Fields of ours and timm's ViT arguments for them.
_PRE_NORM_AND_LAYER_SCALE = (dict(pre_norm=True, layer_scale=True),
                             dict(pre_norm=True, init_values=1e-5))


@pytest.mark.parametrize("name,registers,fields", [
    ("ViT-B_16", 0, None), ("R26+ViT-S_32", 0, None), ("ViT-S_16", 4, None),
    ("ViT-S_16", 0, _PRE_NORM_AND_LAYER_SCALE)])
def test_layer_decay_scales_are_timms(name, registers, fields):
  """Each parameter's lr scale as timm's optimizer factory groups them
  (`param_groups_layer_decay` with the model's `no_weight_decay`), and the tokens' weight
  decay (off) too: register tokens sit with the embeddings, timm's `reg_token` in its stem;
  the pre-norm there too (`norm_pre`), a block's LayerScale in its block."""
  from timm.optim._param_groups import param_groups_layer_decay
  torch, _ = timm_models.import_torch()
  ours_fields, timm_fields = fields or ({}, {})
  with torch.device("meta"):
    reference = timm_models.create(name, num_classes=10, **timm_fields,
                                   **({"reg_tokens": registers} if registers else {}))
  names = {id(p): n for n, p in reference.named_parameters()}
  groups = param_groups_layer_decay(reference, weight_decay=0.1, layer_decay=0.75,
                                    no_weight_decay_list=reference.no_weight_decay())
  timm_scale = {names[id(p)]: g["lr_scale"] for g in groups for p in g["params"]}
  timm_decays = {names[id(p)]: g["weight_decay"] > 0 for g in groups for p in g["params"]}

  params = abstract_params(name, 224, num_registers=registers, **ours_fields)
  decays = npz.flatten(optimizers.decay_mask(params))
  ours = optimizers.update_scales(opt_config(layer_decay=0.75), list(decays))
  for our_name, scale in ours.items():
    matching = {n: s for n, s in timm_scale.items() if n.startswith(timm_prefix(our_name))}
    assert matching and all(s == pytest.approx(scale, rel=1e-12) for s in matching.values()), (
        our_name, scale, matching)
    if len(matching) == 1:  # the tokens and position embedding: decayed as timm's are
      assert timm_decays[next(iter(matching))] == decays[our_name], (our_name, matching)
  num_layers = models.model_config(name)["num_layers"]
  assert len(set(timm_scale.values())) == num_layers + 2
  assert timm_scale["head.weight"] == 1.0
  if registers:
    assert ("reg" in ours) and ours["reg"] == pytest.approx(0.75 ** (num_layers + 1))
    assert not decays["reg"] and timm_scale["reg_token"] == ours["reg"]
  if fields:
    assert ours["Transformer/pre_norm/scale"] == timm_scale["norm_pre.weight"] == pytest.approx(
        0.75 ** (num_layers + 1))
    ls = "Transformer/encoderblock_2/LayerScale_1/scale"
    assert ours[ls] == timm_scale["blocks.2.ls2.gamma"] == pytest.approx(0.75 ** (num_layers - 2))
    assert not decays[ls] and not timm_decays["blocks.2.ls2.gamma"]


def test_layer_decay_and_multipliers_scale_the_whole_update():
  params = random_like(abstract_params("ViT-Ti_16", **TINY), 1.0, 0)
  grads = random_like(params, 1.0, 1)
  plain = one_update(opt_config(), params, grads)
  scaled = one_update(opt_config(layer_decay=0.5, lr_mults=(("head/.*", 10.0),
                                                             (r".*/bias", 3.0))), params, grads)
  depth = 3  # L: the blocks sit at 1..3, the final norm at 3, the embeddings at 0, the head 4.
  for name, update in plain.items():
    m = re.match(r"Transformer/encoderblock_(\d)/", name)
    layer = (int(m.group(1)) + 1 if m else depth if "encoder_norm" in name else
             0 if re.match(r"embedding/|cls$|Transformer/posembed_input/", name) else depth + 1)
    mult = 10.0 if name.startswith("head/") else 3.0 if name.endswith("/bias") else 1.0
    np.testing.assert_allclose(scaled[name], update * 0.5 ** (depth + 1 - layer) * mult,
                               rtol=1e-6, err_msg=name)


def test_frozen_parameters_stay_and_hold_no_optimizer_state():
  params = random_like(abstract_params("ViT-Ti_16", **TINY), 1.0, 0)
  grads = random_like(params, 1.0, 1)
  frozen = ("embedding/.*", "cls", "Transformer/posembed_input/.*",
            "Transformer/encoderblock_0/.*")
  cfg = opt_config(frozen=frozen)
  tx, _ = optimizers.make_optimizer(cfg, total_steps=10, warmup_steps=0)
  updates = npz.flatten(jax.jit(tx.update)(grads, tx.init(params), params)[0])
  is_frozen = {n: any(re.fullmatch(p, n) for p in frozen) for n in updates}
  assert 0 < sum(is_frozen.values()) < len(is_frozen)
  for name, update in updates.items():
    if is_frozen[name]:
      assert not np.any(update), name

  # The trained ones move as if the frozen ones were not there (clipping's norm included).
  def trained(tree):
    return {k: v for k, v in tree.items() if not is_frozen[k]}
  expected = one_update(opt_config(), trained(npz.flatten(params)),
                        trained(npz.flatten(grads)))
  for name, update in trained(updates).items():
    np.testing.assert_allclose(update, expected[name], rtol=1e-6, err_msg=name)

  # AdamW's two moments exist for the trained parameters only.
  state_size = sum(x.size for x in jax.tree.leaves(tx.init(params)) if x.ndim)
  trained_size = sum(v.size for v in trained(npz.flatten(params)).values())
  assert state_size == 2 * trained_size


@pytest.mark.parametrize("fields,message", [
    ({"layer_decay": 1.5}, "optimizer.layer_decay=1.5: must be in (0, 1]"),
    ({"lr_mults": (("head/.*", 0.0),)}, "freeze parameters with optimizer.frozen"),
    ({"lr_mults": ("head/.*",)}, "expected ((regex, multiplier > 0), ...)"),
    ({"frozen": ("embedding/[",)}, "optimizer.frozen"),
])
def test_bad_fields_are_named(fields, message):
  cfg = optimizers.default_config()
  cfg.update(**fields)
  with pytest.raises(ConfigError, match=re.escape(message)):
    optimizers.validate(cfg)


def test_a_pattern_that_matches_nothing_is_named():
  params = abstract_params("ViT-Ti_16", **TINY)
  tx, _ = optimizers.make_optimizer(opt_config(frozen=("Transformer/block_0/.*",)), 10, 0)
  with pytest.raises(ConfigError, match=r"optimizer.frozen: 'Transformer/block_0/\.\*' matches "
                     r"no parameter; names look like 'Transformer/"):
    jax.eval_shape(tx.init, params)


def test_patterns_that_freeze_everything_are_refused_and_a_partial_freeze_is_counted():
  params = abstract_params("ViT-Ti_16", **TINY)
  tx, _ = optimizers.make_optimizer(opt_config(frozen=("Transformer/.*", ".*")), 10, 0)
  with pytest.raises(ConfigError, match=re.escape(
      "config.optimizer.frozen: ('Transformer/.*', '.*') freezes every parameter, so nothing "
      "would train")):
    jax.eval_shape(tx.init, params)
  trained = optimizers.trained(params, ("embedding/.*", "Transformer/.*"))
  names = {n for n, t in zip(jax.tree.leaves(optimizers.param_names(params)),
                             jax.tree.leaves(trained)) if t}
  assert names == {"cls", "head/bias", "head/kernel"}


def test_a_checkpoint_from_before_these_fields_still_resumes(tmp_path, dataset):
  """Its metadata lacks optimizer.layer_decay, lr_mults and frozen: off, they change nothing."""
  from vit_jax.train import run_setup
  c = tiny_config(dataset, total_steps=4)
  wanted = run_setup.run_meta(c, 10, 4, 2)
  found = copy.deepcopy(wanted)
  for field in ("layer_decay", "lr_mults", "frozen"):
    del found["trajectory"]["optimizer"][field]
  run.check_resumable(found, wanted, str(tmp_path))
  c.optimizer.layer_decay = 0.75
  with pytest.raises(errors.CheckpointError, match="optimizer.layer_decay: checkpoint None"):
    run.check_resumable(found, run_setup.run_meta(c, 10, 4, 2), str(tmp_path))
