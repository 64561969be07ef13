"""Optimizers and learning-rate schedules of the paper's recipes, built from optax."""
import jax
import jax.numpy as jnp
import ml_collections
import optax

OPTIMIZERS = ("adam", "adamw", "sgd")
DECAYS = ("linear", "cosine", "constant")


def default_config() -> ml_collections.ConfigDict:
  """`config.optimizer`'s defaults: the paper's pre-training recipe (AdamW, linear decay)."""
  return ml_collections.ConfigDict(dict(
      name="adamw", lr=1e-3, end_lr=0.0, decay="linear", b1=0.9, b2=0.999, momentum=0.9,
      weight_decay=0.1, grad_clip_norm=1.0,
      mu_dtype=ml_collections.FieldReference(None, field_type=str)))


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
  """Weight decay on matrices and kernels only, not on biases, norms, tokens or embeddings."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim > 1 and not any(
          getattr(k, "key", None) in ("pos_embedding", "cls", "probe") for k in path), params)


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int, warmup_steps: int,
                   accum_steps: int = 1) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimizer of `config.optimizer`; steps count optimizer updates."""
  schedule = make_schedule(cfg, total_steps, warmup_steps)
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
  tx = optax.chain(*chain, opt)
  if accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=accum_steps)
  return tx, schedule
