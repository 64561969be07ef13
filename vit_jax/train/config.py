"""The training config's defaults and its validation (before anything compiles)."""
import collections.abc
from collections.abc import Collection
import types
import typing
from typing import Any

import ml_collections

from vit_jax import data, losses, models
from vit_jax.config_errors import ConfigError, check, check_known
from vit_jax.data import config as data_config
from vit_jax.evaluators import registry as evaluators
from vit_jax.models import lora
from vit_jax.train import optimizers

if typing.TYPE_CHECKING:  # Imported where used: the shipped configs import no JAX.
  from vit_jax.checkpoint import loader

DTYPES = ("float32", "bfloat16")


def _cli_type(annotation: Any) -> type:
  """The type the command line gives a model field: Optional[X]'s X, a tuple for a sequence."""
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
  origin = typing.get_origin(annotation) or annotation
  return tuple if origin in (collections.abc.Sequence, tuple, list) else origin


# The model fields a config may override (typed, so that the command line can set them): not
# those the data (num_classes), config.dtype and config.lora set.
MODEL_FIELDS = {
    f: _cli_type(models.VisionTransformer.__dataclass_fields__[f].type)
    for f in models.registry.fields_except(models.Role.CLASSES, models.Role.PRECISION,
                                           models.Role.LORA, models.Role.INTERNAL)}


def _lora_config() -> ml_collections.ConfigDict:
  """LoRA (models/lora.py): adapters of `rank` on the encoder blocks' `targets` (of
  lora.TARGETS), their product scaled by alpha / rank (alpha None: the rank). Only the
  adapters and the head are trained; a step read back has them merged. rank 0: off."""
  return ml_collections.ConfigDict(dict(
      rank=0, alpha=ml_collections.FieldReference(None, field_type=float),
      targets=lora.DEFAULT_TARGETS))


def base_config() -> ml_collections.ConfigDict:
  """Every field a training config may set; config files start from this."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model_name = "ViT-B_16"
  # Overrides of the named model's fields; None keeps the registry's value.
  c.model = ml_collections.ConfigDict(
      {f: ml_collections.FieldReference(None, field_type=t) for f, t in MODEL_FIELDS.items()})
  c.dtype = "float32"  # Computation dtype of the model (parameters stay float32).
  c.pretrained = ml_collections.FieldReference(None, field_type=str)  # .npz to start from.
  c.data = data.get_data_config()

  c.batch_size = 512  # Global, per optimizer update.
  c.accum_steps = 1  # Micro-batches per update (optax.MultiSteps).
  # Durations: set exactly one of each pair; epochs are converted with the train split size.
  c.total_steps = ml_collections.FieldReference(None, field_type=int)
  c.total_epochs = ml_collections.FieldReference(None, field_type=float)
  c.warmup_steps = ml_collections.FieldReference(None, field_type=int)
  c.warmup_epochs = ml_collections.FieldReference(None, field_type=float)

  c.optimizer = optimizers.default_config()
  c.loss = "softmax_xent"
  c.label_smoothing = 0.0  # Targets become (1 - a) * targets + a / num_classes.
  # A moving average of the parameters, after every optimizer update: ema = d * ema +
  # (1 - d) * params, starting from the initial ones. Checkpointed and resumed with the run,
  # evaluated beside the parameters (metrics `ema_*`); `ema:WORKDIR` reads it as a checkpoint.
  c.ema_decay = ml_collections.FieldReference(None, field_type=float)
  c.lora = _lora_config()

  # Named evaluators (vit_jax/evaluators/registry.py): {name: {type, every_steps, at_end,
  # ...the type's own fields}}; `eval` is the run's own, on data.eval_split. Each runs every
  # `every_steps` (None: eval_every_steps) and at the end (at_end).
  c.evals = ml_collections.ConfigDict({evaluators.MAIN: evaluators.entry_config("classification")})

  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, dcn_data=-1))  # sharding.make_mesh
  # XLA devices to split a CPU host into (None: JAX's default, one, or XLA_FLAGS' count), set
  # by vit-train before JAX starts (vit_jax/cpu_backend.py); where JAX has already started
  # with more (a notebook), the run takes the first so many.
  c.cpu_devices = ml_collections.FieldReference(None, field_type=int)
  # Seconds without a step ending after which the run stops (exit status 1) instead of
  # hanging; None: 50 median step times, at least 300 s (vit_jax/train/watchdog.py).
  c.stall_timeout_s = ml_collections.FieldReference(None, field_type=float)
  c.log_every_steps = 50
  c.eval_every_steps = ml_collections.FieldReference(None, field_type=int)  # None: at the end.
  c.checkpoint_every_steps = 1000
  c.keep_checkpoints = 3
  # Resume a workdir although the config changed what the run does (learning rate, schedule,
  # batch, steps, data; not the state's layout): its trajectory differs from an uninterrupted one.
  c.allow_resume_changes = False
  return c


# Fields that moved: the one line that says where to.
MOVED = {
    "fewshot": "few-shot probes are an evaluator now: config.evals.NAME = {'type': 'fewshot', "
               "'datasets': (...), 'shots': ..., ...}, e.g. --config.evals=\"{'eval': {'type': "
               "'classification'}, 'fewshot': {'type': 'fewshot', 'datasets': ('mnist',)}}\"",
}


def check_not_moved(field: str, value: object) -> None:
  check(field not in MOVED, field, value, MOVED.get(field, ""))


def check_evals(evals: object) -> None:
  """config.evals' check; the tuple form it replaced is refused with its translation."""
  if isinstance(evals, (tuple, list)):
    try:
      new = evaluators.from_old_form(evals)
    except ValueError:
      new = {evaluators.MAIN: {"type": "classification"}, "NAME": {"type": "..."}}
    check(False, "evals", evals, f"config.evals is a dict of named evaluators now: "
          f"--config.evals=\"{new}\"")
  evaluators.validate(evals)


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first wrong field."""
  known = base_config()
  for key in c.keys():
    check_not_moved(key, c[key])
    check_known(key, c[key], known.keys())
  check(c.model_name in models.MODEL_CONFIGS, "model_name", c.model_name,
        f"unknown model; known: {', '.join(models.MODEL_CONFIGS)}")
  for group in ("model", "optimizer", "mesh", "lora"):
    for key in c[group].keys():
      check_known(f"{group}.{key}", c[group][key], known[group].keys())
  check(c.dtype in DTYPES, "dtype", c.dtype, f"expected one of {DTYPES}")
  check(c.loss in losses.LOSSES, "loss", c.loss, f"expected one of {losses.LOSSES}")
  check(0 <= c.label_smoothing < 1, "label_smoothing", c.label_smoothing,
        "must be in [0, 1) (0: off)")
  check(c.model.stochastic_depth is None or 0 <= c.model.stochastic_depth < 1,
        "model.stochastic_depth", c.model.stochastic_depth, "must be in [0, 1) (0: off)")
  for field, allowed in models.vit.CHOICES.items():
    check(c.model[field] is None or c.model[field] in allowed, f"model.{field}", c.model[field],
          f"expected one of {allowed} (None: the checkpoint's or the model's)")
  check(c.model.num_registers is None or c.model.num_registers >= 0, "model.num_registers",
        c.model.num_registers, "must be >= 0 (0: none)")
  check(c.ema_decay is None or 0 < c.ema_decay < 1, "ema_decay", c.ema_decay, "must be in (0, 1)")
  check_evals(c.evals)
  _validate_lora(c.lora, c.pretrained)
  _validate_optimizer(c.optimizer)
  check(c.batch_size > 0, "batch_size", c.batch_size, "must be > 0")
  check(c.accum_steps >= 1 and c.batch_size % c.accum_steps == 0, "accum_steps", c.accum_steps,
        f"must be >= 1 and divide batch_size={c.batch_size}")
  check((c.total_steps is None) != (c.total_epochs is None), "total_steps", c.total_steps,
        f"set exactly one of total_steps / total_epochs (total_epochs={c.total_epochs})")
  check(c.warmup_steps is None or c.warmup_epochs is None, "warmup_steps", c.warmup_steps,
        f"set at most one of warmup_steps / warmup_epochs (warmup_epochs={c.warmup_epochs})")
  for key in ("log_every_steps", "checkpoint_every_steps", "keep_checkpoints"):
    check(c[key] >= 1, key, c[key], "must be >= 1")
  check(c.cpu_devices is None or c.cpu_devices >= 1, "cpu_devices", c.cpu_devices,
        "must be None or >= 1")
  check(c.stall_timeout_s is None or c.stall_timeout_s > 0, "stall_timeout_s",
        c.stall_timeout_s, "must be None (automatic) or > 0 seconds")
  check(c.eval_every_steps is None or c.eval_every_steps >= 1, "eval_every_steps",
        c.eval_every_steps, "must be None or >= 1")
  data_config.validate(c.data)


# Model fields that decide which arrays a model has, or their shapes, beyond what loading
# adapts (the patch embedding is resampled, the position embedding resized, the head
# replaced): a config that sets one against config.pretrained's arrays cannot load them.
FIXED_BY_ARRAYS = ("hidden_size", "mlp_dim", "num_heads", "num_layers", "resnet_layers",
                   "resnet_width_factor", "num_registers", "layer_scale", "qkv_bias", "mlp",
                   "mlp_norm", "attention_norm", "pre_norm")


def check_pretrained(c: ml_collections.ConfigDict, flagged: Collection[str] = ()
                     ) -> "loader.Opened":
  """Refuses, in one line naming the field and the fix, a config that contradicts
  config.pretrained's description: a model field its arrays fix (FIXED_BY_ARRAYS), or one the
  description records otherwise (inherit_model_fields' and resolve_value_range's checks). On a
  copy of `c`: before a run writes anything. `flagged`: the fields set on the command line
  (`model.hidden_size`), named first, as flags. Returns config.pretrained opened, for the run
  to start from (`RunSetup.from_config`) without reading it again.
  """
  # Here: the shipped configs import this module, not JAX.
  from vit_jax.checkpoint import loader
  from vit_jax.train import run_setup
  opened = loader.open_checkpoint(c.pretrained)
  parent = opened.description
  c = c.copy_and_resolve_references()
  run_setup.resolve_value_range(c, parent)
  run_setup.inherit_model_fields(c, parent)
  fields = models.model_config(c.model_name,
                               **{k: v for k, v in c.model.items() if v is not None})
  for field in sorted(FIXED_BY_ARRAYS, key=lambda f: f"model.{f}" not in flagged):
    recorded, given = parent.model.get(field), fields.get(field, models.registry.default(field))
    recorded, given = (tuple(v) if isinstance(v, list) else v for v in (recorded, given))
    if recorded is not None and c.model.get(field) is not None and given != recorded:
      named = f"{'--' * (f'model.{field}' in flagged)}config.model.{field}"
      raise ConfigError(
          f"{named}={given!r}: {c.pretrained}'s arrays have {field}={recorded!r}, "
          f"so they cannot load into this model; leave config.model.{field} unset (the run "
          f"takes the checkpoint's model) or set it to {recorded!r}")
  return opened


def _validate_lora(lo: ml_collections.ConfigDict, pretrained: str | None) -> None:
  check(lo.rank >= 0, "lora.rank", lo.rank, "must be >= 0 (0: off)")
  check(lo.alpha is None or lo.alpha > 0, "lora.alpha", lo.alpha, "must be > 0 (None: the rank)")
  check(bool(lo.targets) and all(t in lora.TARGETS for t in lo.targets), "lora.targets",
        lo.targets, f"expected one or more of {lora.TARGETS}")
  check(not lo.rank or pretrained, "lora.rank", lo.rank,
        "adapts a pretrained model: set config.pretrained (on a random base the adapters would "
        "train beside weights that never change)")


def _validate_optimizer(o: ml_collections.ConfigDict) -> None:
  check(o.name in optimizers.OPTIMIZERS, "optimizer.name", o.name,
        f"expected one of {optimizers.OPTIMIZERS}")
  check(o.decay in optimizers.DECAYS, "optimizer.decay", o.decay,
        f"expected one of {optimizers.DECAYS}")
  check(o.lr > 0, "optimizer.lr", o.lr, "must be > 0")
  check(0 <= o.end_lr <= o.lr, "optimizer.end_lr", o.end_lr, "must be in [0, optimizer.lr]")
  check(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
  check(o.mu_dtype in (None, *DTYPES), "optimizer.mu_dtype", o.mu_dtype,
        f"expected None or one of {DTYPES}")
  optimizers.validate(o)


def resolve_steps(c: ml_collections.ConfigDict, num_train_examples: int) -> tuple[int, int]:
  """(total, warm-up) optimizer updates, converting epochs with the split size."""
  steps_per_epoch = num_train_examples / c.batch_size
  total = c.total_steps if c.total_steps is not None else round(c.total_epochs * steps_per_epoch)
  warmup = (c.warmup_steps if c.warmup_steps is not None else
            round((c.warmup_epochs or 0) * steps_per_epoch))
  if c.total_steps is None and not 1 <= total >= warmup:  # The batch size made it so.
    made = "no whole step" if total < 1 else f"{total} steps, fewer than the {warmup} of warm-up"
    check(False, "batch_size", c.batch_size,
          f"total_epochs={c.total_epochs:g} of this batch make {made}: use a smaller batch, "
          "more epochs, or set total_steps")
  check(total >= 1, "total_steps", total, "the run must last at least one step")
  check(0 <= warmup <= total, "warmup_steps", warmup, f"must be in [0, total steps={total}]")
  return total, warmup


def micro_batch_size(c: ml_collections.ConfigDict, num_devices: int) -> int:
  """Examples per train-step call; fails unless they split evenly over the devices."""
  micro_batch = c.batch_size // c.accum_steps
  check(micro_batch % num_devices == 0, "batch_size", c.batch_size,
        f"each micro-batch ({micro_batch}) must split evenly over the {num_devices} devices")
  return micro_batch
