"""Optimizers and learning-rate schedules of the paper's recipes, built from optax; per-parameter
learning-rate scales (layer-wise decay, multipliers by name) and frozen parameters.

A parameter's name is its path in the params tree joined by "/", as the released .npz files
spell it: `Transformer/encoderblock_3/MlpBlock_3/Dense_0/kernel`. Patterns are regular
expressions matched against the whole name; the first pattern that matches decides.
"""
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from vit_jax.config_errors import ConfigError, check

OPTIMIZERS = ("adam", "adamw", "sgd")
DECAYS = ("linear", "cosine", "constant")


def default_config() -> ml_collections.ConfigDict:
  """`config.optimizer`'s defaults: the paper's pre-training recipe (AdamW, linear decay)."""
  return ml_collections.ConfigDict(dict(
      name="adamw", lr=1e-3, end_lr=0.0, decay="linear", b1=0.9, b2=0.999, momentum=0.9,
      weight_decay=0.1, grad_clip_norm=1.0,
      mu_dtype=ml_collections.FieldReference(None, field_type=str),
      # Layer-wise learning-rate decay (BEiT; timm's `layer_decay`): block i's updates (and
      # the final norm's, with the last block) are scaled by layer_decay ** (L - i), the
      # embeddings' (class and register tokens too) by layer_decay ** (L + 1), the head's by 1.
      # None: off.
      layer_decay=ml_collections.FieldReference(None, field_type=float),
      # ((pattern, multiplier), ...): the parameter's whole update (gradient step and
      # decoupled weight decay) scaled, as timm's per-group `lr_scale` scales its group's lr.
      lr_mults=(),
      # (pattern, ...): parameters kept as they are; the optimizer holds no state for them.
      frozen=()))


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int, warmup_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to `cfg.lr`, then linear / cosine decay to `cfg.end_lr` (or constant)."""
  warmup = optax.linear_schedule(0.0, cfg.lr, warmup_steps)
  decay_steps = max(total_steps - warmup_steps, 1)
  if cfg.decay == "linear":
    decay = optax.linear_schedule(cfg.lr, cfg.end_lr, decay_steps)
  elif cfg.decay == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.end_lr / cfg.lr)
  else:
    decay = optax.constant_schedule(cfg.lr)
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params):
  """Weight decay on arrays of two or more dimensions (kernels), not on norms, 1-D biases, tokens
  (class, register, MAP probe) or position embeddings (timm's ViT `no_weight_decay`). The
  attention's query/key/value biases, (heads, head_dim), are decayed; timm's fused 1-D qkv
  bias is not."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim > 1 and not any(
          getattr(k, "key", None) in ("pos_embedding", "cls", "reg", "probe") for k in path),
      params)


def param_names(tree: Any) -> Any:
  """The tree with each leaf replaced by its name ("/"-joined path)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path),
      tree)


def first_match(patterns: Sequence[str], name: str) -> int | None:
  """The index of the first pattern that matches all of `name`, if any."""
  return next((i for i, p in enumerate(patterns) if re.fullmatch(p, name)), None)


def _is_pattern(p: Any) -> bool:
  try:
    re.compile(p)
  except (re.error, TypeError):
    return False
  return isinstance(p, str)


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises ConfigError for a wrong layer_decay, lr_mults or frozen, before any tracing."""
  check(cfg.layer_decay is None or 0 < cfg.layer_decay <= 1, "optimizer.layer_decay",
        cfg.layer_decay, "must be in (0, 1] (None: off)")
  check(all(isinstance(m, (list, tuple)) and len(m) == 2 and _is_pattern(m[0])
            and isinstance(m[1], (int, float)) and m[1] > 0 for m in cfg.lr_mults),
        "optimizer.lr_mults", cfg.lr_mults, "expected ((regex, multiplier > 0), ...), e.g. "
        "(('head/.*', 10.0),); freeze parameters with optimizer.frozen")
  check(all(_is_pattern(p) for p in cfg.frozen), "optimizer.frozen", cfg.frozen,
        "expected (regex, ...), e.g. ('embedding/.*', 'Transformer/encoderblock_[0-5]/.*')")


def _check_patterns(field: str, patterns: Sequence[str], names: list[str]) -> None:
  for pattern in patterns:
    if not any(re.fullmatch(pattern, n) for n in names):
      raise ConfigError(f"config.optimizer.{field}: {pattern!r} matches no parameter; names "
                        f"look like {names[0]!r}, {names[-1]!r}.")


_BLOCK = re.compile(r"Transformer/encoderblock_(\d+)/")
# Before the blocks: patch embedding, ResNet stem (hybrids), class token, register tokens,
# position embedding, pre-norm (timm's ViT `group_matcher` puts `reg_token` and `norm_pre` in
# its stem too).
_EMBEDDING = re.compile(r"embedding/|conv_root/|gn_root/|block\d+/unit\d+/|cls$|reg$|"
                        r"Transformer/posembed_input/|Transformer/pre_norm/")


def layer_id(name: str, num_layers: int) -> int:
  """A parameter's depth for layer-wise decay, as timm's `param_groups_layer_decay` assigns it
  with ViT's `group_matcher`: the embeddings (class and register tokens, the pre-norm
  included) 0, block i i + 1 (its LayerScale included), the final norm num_layers (the last block's), the rest (pre-logits, head)
  num_layers + 1."""
  if m := _BLOCK.match(name):
    return int(m.group(1)) + 1
  if name.startswith("Transformer/encoder_norm/"):
    return num_layers
  return 0 if _EMBEDDING.match(name) else num_layers + 1


def update_scales(cfg: ml_collections.ConfigDict, names: list[str]) -> dict[str, float]:
  """Each parameter's update scale: its layer-decay factor times its lr multiplier."""
  _check_patterns("lr_mults", [p for p, _ in cfg.lr_mults], names)
  num_layers = len({m.group(1) for n in names if (m := _BLOCK.match(n))})
  scales = {}
  for name in names:
    scale = 1.0
    if cfg.layer_decay is not None:
      scale = cfg.layer_decay ** (num_layers + 1 - layer_id(name, num_layers))
    if (i := first_match([p for p, _ in cfg.lr_mults], name)) is not None:
      scale *= cfg.lr_mults[i][1]
    scales[name] = scale
  return scales


def _scale_by_name(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  def update(updates, state, params=None):
    del params
    names = param_names(updates)
    scales = update_scales(cfg, jax.tree.leaves(names))
    return jax.tree.map(lambda u, n: u if scales[n] == 1.0 else u * scales[n], updates,
                        names), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def trained(params: Any, frozen: Sequence[str], trained_only: Sequence[str] = ()) -> Any:
  """A tree of bools beside `params`: whether each parameter trains (no `frozen` pattern
  matches it and, where `trained_only` is given, one of those does). A pattern that matches
  no parameter, or patterns that leave nothing to train, raise ConfigError."""
  names = param_names(params)
  _check_patterns("frozen", frozen, jax.tree.leaves(names))
  mask = jax.tree.map(lambda n: first_match(frozen, n) is None and (
      not trained_only or first_match(trained_only, n) is not None), names)
  if not any(jax.tree.leaves(mask)):
    raise ConfigError(f"config.optimizer.frozen: {tuple(frozen)!r} freezes every parameter, "
                      "so nothing would train; freeze fewer, e.g. ('embedding/.*', "
                      "'Transformer/encoderblock_[0-5]/.*')")
  return mask


def _labels(frozen: Sequence[str], trained_only: Sequence[str]) -> Callable[[Any], Any]:
  def labels(params):
    return jax.tree.map(lambda t: "trained" if t else "frozen",
                        trained(params, frozen, trained_only))

  return labels


def _base_optimizer(cfg: ml_collections.ConfigDict, schedule: optax.Schedule
                    ) -> optax.GradientTransformation:
  if cfg.name == "sgd":
    opt = optax.sgd(schedule, momentum=cfg.momentum,
                    accumulator_dtype=jnp.dtype(cfg.mu_dtype) if cfg.mu_dtype else None)
  else:
    # `adamw`: decoupled decay multiplied by the learning rate (optax.adamw);
    # `adam`: the same with no decay.
    opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay if cfg.name == "adamw" else 0.0,
                      mu_dtype=jnp.dtype(cfg.mu_dtype) if cfg.mu_dtype else None, mask=decay_mask)
  chain = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
  if cfg.name == "sgd" and cfg.weight_decay:
    chain.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
  return optax.chain(*chain, opt)


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int, warmup_steps: int,
                   accum_steps: int = 1, trained_only: Sequence[str] = ()
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimizer of `config.optimizer`; steps count optimizer updates. Frozen parameters
  (`cfg.frozen`'s, and with `trained_only` patterns every parameter none of them matches)
  are left out of clipping's global norm and of the optimizer's state."""
  schedule = make_schedule(cfg, total_steps, warmup_steps)
  tx = _base_optimizer(cfg, schedule)
  if accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=accum_steps)
  if cfg.frozen or trained_only:
    tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()},
                               _labels(tuple(cfg.frozen), tuple(trained_only)))
  if cfg.layer_decay is not None or cfg.lr_mults:
    tx = optax.chain(tx, _scale_by_name(cfg))
  return tx, schedule
