"""A training run's set-up: what the config, the dataset's sizes and config.pretrained's
description fix before the first step (model, optimizer and schedule, mesh, batch, steps), the
metadata a checkpoint must agree with to be resumed, and the steps that compile_check compiles.
"""
import contextlib
import dataclasses
import json
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import optax

from vit_jax import data, models
from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint import loader
from vit_jax.checkpoint.loader import Opened  # What from_config takes: config.pretrained, read.
from vit_jax.models import attention, lora
from vit_jax.train import config as config_lib
from vit_jax.train import optimizers, sharding, trainer


def _model_overrides(c: ml_collections.ConfigDict) -> dict[str, Any]:
  overrides = {k: v for k, v in c.model.items() if v is not None}
  if c.lora.rank:
    overrides |= dict(lora_rank=c.lora.rank, lora_alpha=c.lora.alpha,
                      lora_targets=tuple(c.lora.targets))
  return overrides


def build_model(c: ml_collections.ConfigDict, num_classes: int) -> models.VisionTransformer:
  return models.create_model(c.model_name, num_classes=num_classes,
                             dtype=jnp.dtype(c.dtype), **_model_overrides(c))


# Data fields that change no batch: where the data lives, how it is read, what is evaluated
# (allow_class_mismatch only lets a run start; the train split's files are read either way).
_DATA_FIELDS_OFF_TRAJECTORY = ("data_dir", "download", "eval_split", "cache", "cache_max_mb",
                               "threads", "prefetch", "on_bad_image", "allow_class_mismatch")


def _jsonable(tree: Any) -> Any:
  return json.loads(json.dumps(tree, default=list))


_REGULARISATION = models.registry.fields_of(models.Role.REGULARISATION)
# Not what the parameters depend on: the trajectory records regularisation, and how the model
# executes may change when a run resumes.
_OFF_MODEL = _REGULARISATION + models.registry.fields_of(models.Role.EXECUTION)


def _model_fields(c: ml_collections.ConfigDict) -> dict[str, Any]:
  return models.model_config(c.model_name, **_model_overrides(c))


def _architecture(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The model's fields that its parameters depend on (no regularisation, no remat)."""
  return _jsonable({k: v for k, v in _model_fields(c).items() if k not in _OFF_MODEL})


def run_meta(c: ml_collections.ConfigDict, num_classes: int, total_steps: int,
             warmup_steps: int) -> dict[str, Any]:
  """What a checkpoint must agree with to be resumed: the model (its architecture's fields,
  which loaders also read from here) and everything else that changes the trajectory."""
  data_fields = {k: v for k, v in c.data.items() if k not in _DATA_FIELDS_OFF_TRAJECTORY}
  trajectory = dict(
      seed=c.seed, dtype=c.dtype, loss=c.loss, label_smoothing=c.label_smoothing,
      batch_size=c.batch_size, accum_steps=c.accum_steps, total_steps=total_steps,
      warmup_steps=warmup_steps, optimizer=c.optimizer.to_dict(), data=data_fields,
      ema_decay=c.ema_decay,
      **{k: _model_fields(c).get(k, models.registry.default(k)) for k in _REGULARISATION})
  return {"model_name": c.model_name, "num_classes": num_classes, "model": _architecture(c),
          "trajectory": _jsonable(trajectory)}


def resolve_value_range(c: ml_collections.ConfigDict,
                        parent: desc_lib.Description | None = None) -> None:
  """Sets config.data's input normalisation where the config leaves it open (value_range,
  mean and std all None): config.pretrained's, value range or mean and std as its description
  records them, else the default value range. What the config sets must agree with the
  former."""
  fields = ("value_range", "mean", "std")
  if c.pretrained:
    parent = parent or loader.describe(c.pretrained)
    pre = parent.preprocessing
    if "preprocessing" not in parent.assumed:
      for field in fields:
        given = c.data[field] and tuple(float(v) for v in c.data[field])
        what, recorded = f"the input {field.replace('_', ' ')}", getattr(pre, field)
        if given is not None and recorded is None:  # It records the other form.
          what, recorded = "the input normalisation", pre.normalisation()
        desc_lib.check_option(what, f"config.data.{field}", given, recorded, c.pretrained)
    if all(c.data[field] is None for field in fields):
      c.data.value_range, c.data.mean, c.data.std = pre.value_range, pre.mean, pre.std
  c.data.value_range = data.value_range(c.data)


# Model fields that change what a checkpoint's weights compute without changing their shapes:
# a fine-tuning run takes them from config.pretrained's description unless the config sets them,
# and a field it sets must agree.
_INHERITED_MODEL_FIELDS = models.registry.fields_of(models.Role.COMPUTATION)


def inherit_model_fields(c: ml_collections.ConfigDict, parent: desc_lib.Description) -> None:
  """Sets config.model's open fields from config.pretrained's description (`parent`)."""
  for field in _INHERITED_MODEL_FIELDS:
    recorded = parent.model.get(field)
    desc_lib.check_option(f"the model's {field}", f"config.model.{field}",
                          c.model[field], recorded, c.pretrained)
    if c.model[field] is None and recorded is not None:
      c.model[field] = recorded
  _inherit_posemb_interpolation(c, parent)
  # The model's shapes and which arrays it has (registry.SHAPE): taken from a description that
  # records them (not one assumed from a bare file's arrays) where the config leaves them open,
  # so that no flag repeats what the file tells. A field the config sets wins: a run may
  # fine-tune another pooling or patch size, as far as the arrays load.
  if "model" in parent.assumed:
    return
  named = models.model_config(c.model_name)
  taken = {f: parent.model[f] for f in models.registry.SHAPE
           if c.model[f] is None and f in parent.model
           and parent.model[f] != named.get(f, models.registry.default(f))}
  for field, value in taken.items():
    c.model[field] = tuple(value) if isinstance(value, list) else value
  if taken:
    logging.info("model: %s with %s, as %s describes it", c.model_name,
                 ", ".join(f"{k}={v}" for k, v in taken.items()), c.pretrained)


def _inherit_posemb_interpolation(c: ml_collections.ConfigDict,
                                  parent: desc_lib.Description) -> None:
  """How the position embedding is resized to config.data.image_size (at the start of the
  run) and at run time (dynamic_image_size): config.model.posemb_interpolation where the config
  sets it, else as config.pretrained's framework resizes it (its description's)."""
  recorded, given = parent.model.get("posemb_interpolation"), c.model.posemb_interpolation
  if given is None:  # A bare file records none: the model's default, the official code's.
    c.model.posemb_interpolation = recorded
  elif recorded and given != recorded:
    logging.info("model.posemb_interpolation=%s: %s's framework resizes with %s; the "
                 "config's is used", given, c.pretrained, recorded)


def _cpu_devices(c: ml_collections.ConfigDict) -> Sequence[Any] | None:
  """config.cpu_devices in a process whose JAX has started with more CPU devices (a notebook,
  a test): its first so many (vit-train starts JAX with that many). None: all of JAX's."""
  wanted = c.get("cpu_devices")
  if wanted is None or jax.default_backend() != "cpu" or jax.process_count() > 1:
    return None
  found = jax.local_devices()
  config_lib.check(wanted <= len(found), "cpu_devices", wanted,
                   f"this process's JAX has started with {len(found)} CPU devices; more can "
                   "only be asked for before it starts (vit-train, or XLA_FLAGS)")
  return found[:wanted]


@dataclasses.dataclass
class RunSetup:
  """What the config and the dataset fix before the first step."""
  config: ml_collections.ConfigDict
  workdir: str
  model: models.VisionTransformer
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  mesh: jax.sharding.Mesh
  micro_batch: int
  total_steps: int  # Optimizer updates.
  warmup_steps: int
  class_names: tuple[str, ...]
  # LoRA runs: their adapters need this base, so its content is recorded (description).
  parent_sha256: str | None = None
  # config.pretrained, opened once: described for the set-up, its arrays fitted to the model
  # at the first step (`pretrained_params`), then released (a resumed run releases them
  # unused).
  pretrained: Opened | None = None

  @property
  def loop_steps(self) -> int:
    """Train-step calls: optimizer updates x accum_steps."""
    return self.total_steps * self.config.accum_steps

  @property
  def meta(self) -> dict[str, Any]:
    return run_meta(self.config, self.model.num_classes, self.total_steps, self.warmup_steps)

  @property
  def description(self) -> desc_lib.Description:
    """What every checkpoint of the run records about itself (`save` adds the step)."""
    c = self.config
    model = _architecture(c)
    return desc_lib.Description(
        model=model, model_name=models.registry.match_name(model, preferred=c.model_name),
        num_classes=self.model.num_classes,
        image_size=c.data.image_size, class_names=self.class_names,
        preprocessing=desc_lib.Preprocessing.from_data_config(c.data),
        output=desc_lib.output_of_loss(c.loss), dataset=data.located(c.data.name),
        parent=self.pretrained.located if self.pretrained else c.pretrained,
        parent_sha256=self.parent_sha256, config=_jsonable(c.to_dict()))

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict, workdir: str,
                  pretrained: Opened | None = None) -> "RunSetup":
    """The set-up of the run of `c` in `workdir`. `pretrained`: config.pretrained already
    opened (vit-train's checks opened it), else it is opened here; either way it is read
    once, described here and fitted by `pretrained_params`."""
    config_lib.validate(c)
    if c.pretrained and (pretrained is None or pretrained.path != c.pretrained):
      pretrained = loader.open_checkpoint(c.pretrained)
    parent = pretrained.description if c.pretrained else None
    resolve_value_range(c, parent)
    if parent:
      inherit_model_fields(c, parent)
    info = data.dataset_info(c.data)
    job = cls.build(c, workdir, info.num_classes, info.num_train_examples,
                    tuple(info.class_names))
    if c.pretrained and c.lora.rank:
      job.parent_sha256 = pretrained.sha256()
    job.pretrained = pretrained if c.pretrained else None
    return job

  @classmethod
  def build(cls, c: ml_collections.ConfigDict, workdir: str, num_classes: int,
            num_train_examples: int, class_names: tuple[str, ...],
            devices: Sequence[Any] | None = None) -> "RunSetup":
    """The set-up of a validated config on a dataset of these sizes, its mesh over `devices`
    (default: all of JAX's); `from_config` reads the sizes from the data."""
    total_steps, warmup_steps = config_lib.resolve_steps(c, num_train_examples)
    trained_only = lora.TRAINED if c.lora.rank else ()
    tx, schedule = optimizers.make_optimizer(c.optimizer, total_steps, warmup_steps,
                                             c.accum_steps, trained_only)
    model = build_model(c, num_classes)
    stride = model.stride
    config_lib.check(c.data.image_size % stride == 0, "data.image_size", c.data.image_size,
          f"not divisible by the model's patch stride {stride} ({loader.model_label(model)}); "
          f"use a multiple of {stride}, e.g. {models.fitted_size(c.data.image_size, stride)}")
    if c.optimizer.frozen:  # Refused now (patterns that freeze all), before anything is written.
      optimizers.trained(models.abstract_params(model, c.data.image_size), c.optimizer.frozen,
                         trained_only)
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp, devices or _cpu_devices(c),
                              c.mesh.dcn_data)
    # "auto" decided for the run's devices, not the host's (compile_check's are a TPU's).
    model = model.clone(attention_impl=attention.resolve(
        model.attention_impl, model.dtype, model.hidden_size // model.num_heads,
        mesh.devices.flat[0]))
    return cls(c, workdir, model, tx, schedule, mesh,
               config_lib.micro_batch_size(c, mesh.size), total_steps, warmup_steps,
               class_names)

  def mesh_scope(self) -> contextlib.AbstractContextManager:
    """What the run's steps are traced in: its mesh set (`jax.set_mesh`) where the attention
    kernel runs on each device's part of the batch (Pallas on TPU), nothing otherwise."""
    if self.model.attention_impl in attention.PALLAS_IMPLS:
      return jax.set_mesh(self.mesh)
    return contextlib.nullcontext()

  @property
  def batch_sharding(self) -> jax.sharding.NamedSharding:
    return sharding.batch_sharding(self.mesh)

  def pretrained_params(self, rng: jax.Array) -> Any:
    """config.pretrained's params fitted to the model; its arrays are released after."""
    if self.pretrained is None:  # A set-up made by `build`, which opens no checkpoint.
      self.pretrained = loader.open_checkpoint(self.config.pretrained)
    size = self.config.data.image_size
    params = load_pretrained(self.model, self.pretrained, rng, size)
    self.pretrained.release()
    return params

  def trained(self, params: Any) -> Any:
    """`params` with the frozen ones (and LoRA's base) None."""
    c = self.config
    mask = optimizers.trained(params, c.optimizer.frozen, lora.TRAINED if c.lora.rank else ())
    return jax.tree.map(lambda p, t: p if t else None, params, mask)


def load_pretrained(model: models.VisionTransformer, opened: Opened, rng: jax.Array,
                    image_size: int) -> Any:
  """The opened checkpoint's params fitted to `model` at `image_size`; LoRA adapters, which
  no checkpoint has, initialised (`fit_params` keeps the target's)."""
  if model.lora_rank:
    target = jax.jit(model.init)(rng, jnp.zeros((1, image_size, image_size, 3)))["params"]
  else:
    target = models.abstract_params(model, image_size)
  return loader.fit_params(opened, target, model.posemb_interpolation)


def setup_on(c: ml_collections.ConfigDict, num_classes: int, devices: Sequence[Any]) -> RunSetup:
  """The set-up of a run of the validated config `c` on `devices` (compile_check's): no data,
  no workdir, no checkpoint read, so nothing that config.pretrained's description would
  change. Epochs count as NOMINAL_EXAMPLES images: the schedule's length changes no compiled
  shape or cost, only constants."""
  return RunSetup.build(c, "", num_classes, NOMINAL_EXAMPLES, (), devices)


NOMINAL_EXAMPLES = 10**9  # More than any dataset's: a config's warm-up always fits its epochs.


def predict_fn(model: models.VisionTransformer) -> Callable:
  """`(params, images) -> logits`, what the evaluators compile."""
  return lambda params, images: model.apply({"params": params}, images)


def train_step_fn(setup: RunSetup, shardings: trainer.TrainState, rng: jax.Array) -> Callable:
  """The run's train step, jit-wrapped, not yet compiled."""
  c = setup.config
  return trainer.make_train_step(setup.model, setup.tx, c.loss, shardings, setup.mesh, rng,
                                 c.label_smoothing, c.ema_decay, c.accum_steps)
