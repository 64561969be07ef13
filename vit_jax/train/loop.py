"""The training loop: restore or initialise, build the evaluators, run the steps."""
import dataclasses
import functools
import itertools
import json
import logging
import shlex
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from clu import metric_writers, periodic_actions

from vit_jax import checkpoint, cpu_backend, data, models
from vit_jax.checkpoint import description as description_lib, run
from vit_jax.data import config as data_config
from vit_jax.data import tasks
from vit_jax.evaluators import fewshot_lsr
from vit_jax.evaluators.classification import ClassificationEvaluator
from vit_jax.models import lora
from vit_jax.train import config as config_lib
from vit_jax.train import optimizers, sharding, stop_signals, trainer, watchdog


class NonFiniteLossError(RuntimeError):
  pass


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


_REGULARISATION = ("dropout", "attention_dropout", "stochastic_depth")


def _model_fields(c: ml_collections.ConfigDict) -> dict[str, Any]:
  return models.model_config(c.model_name, **_model_overrides(c))


def _architecture(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The model's fields that its parameters depend on (no regularisation, no remat)."""
  return _jsonable({k: v for k, v in _model_fields(c).items()
                    if k not in _REGULARISATION + ("remat", "attention_impl",
                                                   "dynamic_image_size")})


def run_meta(c: ml_collections.ConfigDict, num_classes: int, total_steps: int,
             warmup_steps: int) -> dict[str, Any]:
  """What a checkpoint must agree with to be resumed: the model and everything else that
  changes the trajectory."""
  data_fields = {k: v for k, v in c.data.items() if k not in _DATA_FIELDS_OFF_TRAJECTORY}
  trajectory = dict(
      seed=c.seed, dtype=c.dtype, loss=c.loss, label_smoothing=c.label_smoothing,
      batch_size=c.batch_size, accum_steps=c.accum_steps, total_steps=total_steps,
      warmup_steps=warmup_steps, optimizer=c.optimizer.to_dict(), data=data_fields,
      ema_decay=c.ema_decay,
      **{k: _model_fields(c).get(k, 0.0) for k in _REGULARISATION})
  return run.make_meta(c.model_name, num_classes, _architecture(c), _jsonable(trajectory))


def resolve_value_range(c: ml_collections.ConfigDict,
                        parent: checkpoint.Description | None = None) -> None:
  """Sets config.data's input normalisation where the config leaves it open (value_range,
  mean and std all None): config.pretrained's, value range or mean and std as its description
  records them, else the default value range. What the config sets must agree with the
  former."""
  fields = ("value_range", "mean", "std")
  if c.pretrained:
    parent = parent or checkpoint.describe(c.pretrained)
    pre = parent.preprocessing
    if "preprocessing" not in parent.assumed:
      for field in fields:
        given = c.data[field] and tuple(float(v) for v in c.data[field])
        what, recorded = f"the input {field.replace('_', ' ')}", getattr(pre, field)
        if given is not None and recorded is None:  # It records the other form.
          what, recorded = "the input normalisation", pre.normalisation()
        description_lib.check_option(what, f"config.data.{field}", given, recorded,
                                     c.pretrained)
    if all(c.data[field] is None for field in fields):
      c.data.value_range, c.data.mean, c.data.std = pre.value_range, pre.mean, pre.std
  c.data.value_range = data_config.value_range(c.data)


# Model fields that change what a checkpoint's weights compute without changing their shapes:
# a fine-tuning run takes them from config.pretrained's description unless the config sets them.
_INHERITED_MODEL_FIELDS = ("gelu", "fc_norm")


def inherit_model_fields(c: ml_collections.ConfigDict, parent: checkpoint.Description) -> None:
  for field in _INHERITED_MODEL_FIELDS:
    recorded = parent.model.get(field)
    description_lib.check_option(f"the model's {field}", f"config.model.{field}",
                                 c.model[field], recorded, c.pretrained)
    if c.model[field] is None and recorded is not None:
      c.model[field] = recorded


def _abstract_params(model: models.VisionTransformer, image_size: int) -> Any:
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  return jax.eval_shape(model.init, jax.random.key(0), images)["params"]


@dataclasses.dataclass
class _Job:
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

  @property
  def loop_steps(self) -> int:
    """Train-step calls: optimizer updates x accum_steps."""
    return self.total_steps * self.config.accum_steps

  @property
  def meta(self) -> dict[str, Any]:
    return run_meta(self.config, self.model.num_classes, self.total_steps, self.warmup_steps)

  @property
  def description(self) -> checkpoint.Description:
    """What every checkpoint of the run records about itself (`save` adds the step)."""
    c = self.config
    return checkpoint.Description(
        model=_architecture(c), model_name=c.model_name, num_classes=self.model.num_classes,
        image_size=c.data.image_size, class_names=self.class_names,
        preprocessing=checkpoint.Preprocessing.from_data_config(c.data),
        output=description_lib.output_of_loss(c.loss), dataset=c.data.name,
        parent=c.pretrained, parent_sha256=self.parent_sha256, config=_jsonable(c.to_dict()))

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict, workdir: str) -> "_Job":
    config_lib.validate(c)
    parent = checkpoint.describe(c.pretrained) if c.pretrained else None
    resolve_value_range(c, parent)
    if parent:
      inherit_model_fields(c, parent)
    info = data.dataset_info(c.data)
    job = cls.build(c, workdir, info.num_classes, info.num_train_examples,
                    tuple(info.class_names))
    if c.lora.rank:
      job.parent_sha256 = checkpoint.arrays_sha256(checkpoint.read(c.pretrained)[0])
    return job

  @classmethod
  def build(cls, c: ml_collections.ConfigDict, workdir: str, num_classes: int,
            num_train_examples: int, class_names: tuple[str, ...],
            devices: Sequence[Any] | None = None) -> "_Job":
    """The job of a validated config on a dataset of these sizes, its mesh over `devices`
    (default: all of JAX's); `from_config` reads the sizes from the data."""
    total_steps, warmup_steps = config_lib.resolve_steps(c, num_train_examples)
    trained_only = lora.TRAINED if c.lora.rank else ()
    tx, schedule = optimizers.make_optimizer(c.optimizer, total_steps, warmup_steps,
                                             c.accum_steps, trained_only)
    model = build_model(c, num_classes)
    stride = model.stride
    config_lib.check(c.data.image_size % stride == 0, "data.image_size", c.data.image_size,
          f"not divisible by the model's patch stride {stride} ({c.model_name}); use a "
          f"multiple of {stride}, e.g. {max(c.data.image_size // stride, 1) * stride}")
    if c.optimizer.frozen:  # Refused now (patterns that freeze all), before anything is written.
      optimizers.trained(_abstract_params(model, c.data.image_size), c.optimizer.frozen,
                         trained_only)
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp, devices)
    return cls(c, workdir, model, tx, schedule, mesh,
               config_lib.micro_batch_size(c, mesh.size), total_steps, warmup_steps,
               class_names)

  @property
  def batch_sharding(self) -> jax.sharding.NamedSharding:
    return sharding.batch_sharding(self.mesh)


def job_on(c: ml_collections.ConfigDict, num_classes: int, devices: Sequence[Any]) -> _Job:
  """The job a run of the validated config `c` does on `devices` (compile_check's): no data,
  no workdir, no checkpoint read, so nothing that config.pretrained's description would
  change. Epochs count as NOMINAL_EXAMPLES images: the schedule's length changes no compiled
  shape or cost, only constants."""
  return _Job.build(c, "", num_classes, NOMINAL_EXAMPLES, (), devices)


NOMINAL_EXAMPLES = 10**9  # More than any dataset's: a config's warm-up always fits its epochs.


def _pretrained_params(model: models.VisionTransformer, path: str, rng: jax.Array,
                       image_shape: tuple[int, ...]) -> Any:
  """`path`'s params fitted to `model`; LoRA adapters, which no checkpoint has, initialised."""
  images = jnp.zeros((1,) + image_shape)
  if not model.lora_rank:
    return checkpoint.load_params(path, jax.eval_shape(model.init, rng, images)["params"])
  fresh = checkpoint.flatten(jax.jit(model.init)(rng, images)["params"])
  adapters = {k: v for k, v in fresh.items() if lora.is_adapter(k)}
  base = checkpoint.unflatten({k: v for k, v in fresh.items() if k not in adapters})
  return checkpoint.unflatten(checkpoint.flatten(checkpoint.load_params(path, base)) | adapters)


def _restore_or_init(job: _Job, rng: jax.Array
                     ) -> tuple[ocp.CheckpointManager, trainer.TrainState, trainer.TrainState, int]:
  """The checkpoint manager, the state to start from (the newest checkpoint that verifies,
  else `config.pretrained` or an initialisation), its shardings, and its step."""
  c = job.config
  image_shape = (c.data.image_size, c.data.image_size, 3)
  has_steps = bool(run.finished_steps(job.workdir))
  params = None
  if not has_steps and c.pretrained:
    params = _pretrained_params(job.model, c.pretrained, rng, image_shape)
    logging.info("Initialised from %s.", c.pretrained)
  state, shardings = trainer.init_state(job.model, job.tx, job.mesh, image_shape, rng, params,
                                        ema=c.ema_decay is not None)
  if not has_steps:
    return run.make_manager(job.workdir, c.keep_checkpoints), state, shardings, 0
  run.check_resumable(run.newest_meta(job.workdir), job.meta, job.workdir, c.allow_resume_changes)
  manager, state, found, start = run.restore_latest(job.workdir, c.keep_checkpoints, state,
                                                    shardings)
  if start:
    run.check_resumable(found, job.meta, job.workdir, c.allow_resume_changes)
    logging.info("Resumed from %s at step %d.", job.workdir, start)
  elif c.pretrained:
    raise checkpoint.CheckpointError(
        f"No checkpoint in {job.workdir} could be restored (all set aside as STEP.corrupt); "
        f"rerun to start again from {c.pretrained}.")
  return manager, state, shardings, start


def predict_fn(model: models.VisionTransformer) -> Callable:
  """`(params, images) -> logits`, what the evaluators compile."""
  return lambda params, images: model.apply({"params": params}, images)


def train_step_fn(job: _Job, shardings: trainer.TrainState, rng: jax.Array) -> Callable:
  """The run's train step, jit-wrapped, not yet compiled."""
  c = job.config
  return trainer.make_train_step(job.model, job.tx, c.loss, shardings, job.mesh, rng,
                                 c.label_smoothing, c.ema_decay, c.accum_steps)


def _build_evaluators(job: _Job, dog: watchdog.StallWatchdog) -> dict[str, Any]:
  """Evaluators by metric prefix: `eval` (classification), one per `config.evals` entry,
  `fewshot` if configured; each batch they read is a sign of life for the watchdog."""
  c, model = job.config, job.model
  predict = predict_fn(model)
  evaluators = {"eval": ClassificationEvaluator(
      predict, lambda: dog.beating(data.eval_iterator(
          c.data, global_batch_size=job.micro_batch, sharding=job.batch_sharding)), c.loss)}
  for prefix, name, split in map(tasks.eval_spec, c.evals):
    cfg = c.data.copy_and_resolve_references()
    cfg.update(name=name, eval_split=split)
    evaluators[prefix] = ClassificationEvaluator(
        predict, lambda cfg=cfg: dog.beating(data.eval_iterator(
            cfg, global_batch_size=job.micro_batch, sharding=job.batch_sharding)), c.loss)
  if c.fewshot.datasets:
    f = c.fewshot
    datasets = fewshot_lsr.fewshot_datasets(f.datasets, f.data_dir, f.train_split, f.test_split,
                                            c.data.image_size, job.micro_batch,
                                            job.batch_sharding, job.description.preprocessing)
    datasets = {name: (lambda train=train: dog.beating(train()),
                       lambda test=test: dog.beating(test()), classes)
                for name, (train, test, classes) in datasets.items()}
    evaluators["fewshot"] = fewshot_lsr.FewShotEvaluator(
        fewshot_lsr.representation_fn(model), datasets, f.shots, f.seeds, f.l2)
  return evaluators


@dataclasses.dataclass(frozen=True)
class RunInfo:
  """What a run trains, where, and from which step: for whoever shows its progress."""
  workdir: str
  checkpoints: str  # The folder of its step folders.
  model_name: str
  parameters: int
  trained_parameters: int  # Fewer than `parameters` where some are frozen (or LoRA's base).
  dataset: str
  data_dir: str | None
  num_classes: int
  image_size: int
  batch_size: int  # Images per train step: config.batch_size / config.accum_steps.
  total_steps: int  # Train steps: optimizer updates x config.accum_steps.
  start_step: int  # Resumed from; total_steps (or more) for a run already complete.
  epochs: float | None  # config.total_epochs, where the config counts in epochs.
  pretrained: str | None
  devices: int
  platform: str
  processes: int

  @property
  def trained_line(self) -> str:
    return (f"trainable parameters: {self.trained_parameters:,} of {self.parameters:,} "
            f"({100 * self.trained_parameters / self.parameters:.1f}%)")


def _count(params: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _run_info(job: _Job, state: trainer.TrainState, start: int) -> RunInfo:
  c = job.config
  return RunInfo(
      workdir=job.workdir, checkpoints=str(run.checkpoint_dir(job.workdir)),
      model_name=c.model_name or "ViT",
      parameters=_count(state.params),
      trained_parameters=_count(jax.tree.map(
          lambda p, t: p if t else None, state.params, optimizers.trained(
              state.params, c.optimizer.frozen, lora.TRAINED if c.lora.rank else ()))),
      dataset=c.data.name, data_dir=c.data.data_dir, num_classes=job.model.num_classes,
      image_size=c.data.image_size, batch_size=job.micro_batch, total_steps=job.loop_steps,
      start_step=start, epochs=c.get("total_epochs"), pretrained=c.pretrained,
      devices=jax.device_count(), platform=jax.devices()[0].platform,
      processes=jax.process_count())


class Report:
  """What the loop tells whoever shows its progress (vit-train's console), on every process:
  `started`, then `step`, `logged`, `evaluating` and `evaluated` as the run goes. This one
  shows nothing."""

  def started(self, run: RunInfo) -> None:
    """Before the first step, and before compiling it; a run already complete is evaluated
    only (`run.start_step >= run.total_steps`)."""

  def step(self, step: int) -> None:
    """After each train step's call (its work may still be running on the devices)."""

  def logged(self, step: int, metrics: dict[str, float]) -> None:
    """Every config.log_every_steps: train_loss, grad_norm, learning_rate, img_per_sec, the
    means since the last."""

  def evaluating(self, step: int) -> None:
    """Before the evaluators run."""

  def evaluated(self, step: int, metrics: dict[str, float]) -> None:
    """Their metrics, named as train_and_evaluate returns them."""


class _TrainMetrics:
  """Per-step metrics since the last write: their means go to the writer and the report, and
  a NaN/inf among them stops the run, naming its step, before anything is saved."""

  def __init__(self, job: _Job, writer: metric_writers.MetricWriter, last_good: Callable,
               report: Report):
    self.job, self.writer, self.last_good, self.report = job, writer, last_good, report
    self.pending, self.t0 = [], time.time()

  def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
    self.pending.append((step, metrics))

  def check_finite(self) -> list[dict[str, np.ndarray]]:
    """The pending metrics on the host; raises at the first non-finite one."""
    host = jax.device_get(self.pending)
    for step, m in host:
      if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
        raise NonFiniteLossError(
            f"Loss or gradients became NaN/inf at step {step}; stopped without saving. "
            f"The last good checkpoint in {self.job.workdir} is step {self.last_good()}.")
    return [m for _, m in host]

  def write(self, step: int) -> None:
    metrics = self.check_finite()
    summary = jax.tree.map(lambda *x: float(np.mean(x)), *metrics)
    elapsed = time.time() - self.t0
    scalars = {
        "train_loss": summary["loss"], "grad_norm": summary["grad_norm"],
        "learning_rate": float(self.job.schedule(step // self.job.config.accum_steps)),
        "img_per_sec": len(metrics) * self.job.micro_batch / elapsed}
    self.writer.write_scalars(step, scalars)
    self.report.logged(step, scalars)
    self.restart_clock()

  def restart_clock(self) -> None:
    self.pending, self.t0 = [], time.time()


def _evaluate_params(evaluators: dict[str, Any], params: Any, step: int,
                     writer: metric_writers.MetricWriter, progress: Any,
                     tag: str = "") -> dict[str, float]:
  """Runs every evaluator; `eval` metrics keep their names, the others get their prefix;
  `tag` goes before every name."""
  out = {}
  for prefix, evaluator in evaluators.items():
    with progress.timed(tag + prefix):
      metrics = evaluator.run(params)
    writer.write_scalars(step, {f"{tag}{prefix}_{k}": v for k, v in metrics.items()})
    out |= {tag + (k if prefix == "eval" else f"{prefix}_{k}"): v for k, v in metrics.items()}
  return out


def _evaluate(evaluators: dict[str, Any], state: trainer.TrainState, step: int,
              writer: metric_writers.MetricWriter, progress: Any,
              report: Report) -> dict[str, float]:
  """The parameters' metrics, and their moving average's beside them (`ema_` names)."""
  report.evaluating(step)
  out = _evaluate_params(evaluators, state.params, step, writer, progress)
  if state.ema_params is not None:
    out |= _evaluate_params(evaluators, state.ema_params, step, writer, progress, tag="ema_")
  report.evaluated(step, out)
  return out


def _run_steps(job: _Job, state: trainer.TrainState, start: int, train_step: Callable,
               batches: Any, evaluators: dict[str, Any], manager: ocp.CheckpointManager,
               writer: metric_writers.MetricWriter, dog: watchdog.StallWatchdog,
               report: Report, stop: stop_signals.StopSignals) -> dict[str, float]:
  c, meta, description = job.config, job.meta, job.description
  progress = periodic_actions.ReportProgress(num_train_steps=job.loop_steps, writer=writer,
                                             every_steps=c.log_every_steps)
  log = _TrainMetrics(job, writer, manager.latest_step, report)
  eval_metrics = {}
  for step in range(start + 1, job.loop_steps + 1):
    dog.beat(step)
    state, metrics = train_step(state, next(batches))
    log.add(step, metrics)
    report.step(step)
    progress(step)
    if step % c.log_every_steps == 0 or step == job.loop_steps:
      log.write(step)
    if step == job.loop_steps or (c.eval_every_steps and step % c.eval_every_steps == 0):
      eval_metrics = _evaluate(evaluators, state, step, writer, progress, report)
      log.restart_clock()
    stopping = stop.reached(step)
    if step % c.checkpoint_every_steps == 0 or step == job.loop_steps or stopping:
      log.check_finite()
      run.save(manager, step, state, meta, description)
      dog.beat()
    if stopping and step < job.loop_steps:
      manager.wait_until_finished()
      logging.warning("Stopped: saved step %d to %s; rerun the same command to resume.",
                      step, job.workdir)
      raise stop_signals.Interrupted(stop.received, step, job.workdir)
  return eval_metrics


def _compiled_step(job: _Job, state: trainer.TrainState, shardings: trainer.TrainState,
                   rng: jax.Array, start: int) -> tuple[Callable, Iterator[Any]]:
  """The train step compiled ahead of the first call (so that compiling, however long, is not
  counted as a stalled step), and the batches from step `start` on."""
  c = job.config
  train_step = train_step_fn(job, shardings, rng)
  batches = data.train_iterator(c.data, global_batch_size=job.micro_batch,
                                sharding=job.batch_sharding, seed=c.seed, start_step=start)
  first = next(batches)
  return train_step.lower(state, first).compile(), itertools.chain([first], batches)


# How long a stalled run waits for a checkpoint in flight to be written before it exits.
SAVE_WAIT_S = 20.0


def _stall_message(job: _Job, manager: ocp.CheckpointManager, step: int, reason: str) -> str:
  saving = threading.Thread(target=manager.wait_until_finished, daemon=True)
  saving.start()
  saving.join(SAVE_WAIT_S)
  steps = run.finished_steps(job.workdir)
  saved = f"step {steps[-1]}" if steps else "none yet"
  return (f"the run in {job.workdir} stalled at step {step}: {reason}. Its last saved "
          f"checkpoint is {saved}; rerun the same command to resume from it: "
          f"{shlex.join(sys.orig_argv)}")


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str,
                       report: Report | None = None) -> dict[str, float]:
  """Trains (resuming from `workdir` if it holds a checkpoint) and returns final eval metrics;
  `report` is told how the run goes.

  A run whose steps stop ending (config.stall_timeout_s) exits the process with status 1; one
  that SIGTERM or SIGINT stops before its last step saves, then raises
  stop_signals.Interrupted.
  """
  with stop_signals.StopSignals() as stop:
    return _train_and_evaluate(c, workdir, report or Report(), stop)


def _train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, report: Report,
                        stop: stop_signals.StopSignals) -> dict[str, float]:
  if jax.default_backend() == "cpu":
    cpu_backend.check_pool(jax.local_device_count())
  job = _Job.from_config(c, workdir)
  init_rng, dropout_rng = jax.random.split(jax.random.key(c.seed))
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  manager = None
  try:
    manager, state, shardings, start = _restore_or_init(job, init_rng)
    if start == 0:
      writer.write_hparams({k: str(v) for k, v in c.to_dict().items()})
    info = _run_info(job, state, start)
    if info.trained_parameters < info.parameters:
      logging.info(info.trained_line)
    report.started(info)
    dog = watchdog.StallWatchdog(c.stall_timeout_s,
                                 functools.partial(_stall_message, job, manager))
    evaluators = _build_evaluators(job, dog)
    if start >= job.loop_steps:
      logging.info("The run in %s is complete (step %d of %d); evaluating its last checkpoint.",
                   workdir, start, job.loop_steps)
      with dog:
        return _evaluate(evaluators, state, start, writer,
                         periodic_actions.ReportProgress(writer=writer), report)
    train_step, batches = _compiled_step(job, state, shardings, dropout_rng, start)
    with dog:
      return _run_steps(job, state, start, train_step, batches, evaluators, manager, writer, dog,
                        report, stop)
  finally:
    if manager is not None:
      manager.close()  # Waits for the last save, then stops orbax's writer and deleter threads.
    writer.close()
