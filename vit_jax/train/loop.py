"""The training loop: restore or initialise, build the evaluators, run the steps (the run's
set-up is run_setup's)."""
import dataclasses
import errno
import functools
import itertools
import logging
import os
import re
import shlex
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from clu import metric_writers, periodic_actions

from vit_jax import cpu_backend, data, goodput
from vit_jax.checkpoint import errors, run
from vit_jax.evaluators import registry as evaluators
from vit_jax.train import run_setup, stop_signals, trainer, watchdog


class NonFiniteLossError(RuntimeError):
  pass


def _restore_or_init(setup: run_setup.RunSetup, rng: jax.Array
                     ) -> tuple[ocp.CheckpointManager, trainer.TrainState, trainer.TrainState, int]:
  """The checkpoint manager, the state to start from (the newest checkpoint that verifies,
  else `config.pretrained` or an initialisation), its shardings, and its step."""
  c = setup.config
  image_shape = (c.data.image_size, c.data.image_size, 3)
  state_of = (setup.model, setup.tx, setup.mesh, image_shape, rng)
  init = functools.partial(trainer.init_state, *state_of, ema=c.ema_decay is not None)
  if not run.finished_steps(setup.workdir):
    params = None
    if c.pretrained:
      params = setup.pretrained_params(rng)
      logging.info("Initialised from %s.", c.pretrained)
    return run.make_manager(setup.workdir, c.keep_checkpoints), *init(params), 0
  if setup.pretrained:
    setup.pretrained.release()  # Resumed: the run's own checkpoint holds its params.
  run.check_resumable(run.newest_meta(setup.workdir), setup.meta, setup.workdir, c.allow_resume_changes)
  # Restored into the state's shapes and shardings: an initialised state would be compiled and
  # computed for nothing, and held in device memory beside the restored one.
  target, shardings = trainer.abstract_state(*state_of, ema=c.ema_decay is not None)
  manager, state, found, start = run.restore_latest(setup.workdir, c.keep_checkpoints, target,
                                                    shardings)
  if start:
    run.check_resumable(found, setup.meta, setup.workdir, c.allow_resume_changes)
    logging.info("Resumed from %s at step %d.", setup.workdir, start)
    return manager, state, shardings, start
  if c.pretrained:
    raise errors.CheckpointError(
        f"No checkpoint in {setup.workdir} could be restored (all set aside as STEP.corrupt); "
        f"rerun to start again from {c.pretrained}.")
  return manager, *init(), 0  # Every step set aside: the run starts again, as it first did.


def _build_evaluators(setup: run_setup.RunSetup, dog: watchdog.StallWatchdog
                      ) -> dict[str, evaluators.Scheduled]:
  """config.evals' evaluators; each batch they read is a sign of life for the watchdog."""
  c = setup.config
  context = evaluators.EvalContext(setup.model, c.data, c.loss, setup.micro_batch,
                                   setup.batch_sharding, setup.description.preprocessing,
                                   dog.beating)
  return evaluators.build(c.evals, context, c.eval_every_steps)


@dataclasses.dataclass(frozen=True)
class RunInfo:
  """What a run trains, where, and from which step: for whoever shows its progress."""
  workdir: str
  checkpoints: str  # The folder of its step folders.
  model: str  # Its registry name, or its shape: Description.model_label.
  parameters: int
  trained_parameters: int  # Fewer than `parameters` where some are frozen (or LoRA's base).
  dataset: str
  data_dir: str | None
  skip_bad_images: bool  # config.data.on_bad_image='skip'.
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


def _run_info(setup: run_setup.RunSetup, state: trainer.TrainState, start: int) -> RunInfo:
  c = setup.config
  return RunInfo(
      workdir=setup.workdir, checkpoints=str(run.checkpoint_dir(setup.workdir)),
      model=setup.description.model_label,
      parameters=_count(state.params), trained_parameters=_count(setup.trained(state.params)),
      dataset=c.data.name, data_dir=c.data.data_dir,
      skip_bad_images=c.data.on_bad_image == "skip", num_classes=setup.model.num_classes,
      image_size=c.data.image_size, batch_size=setup.micro_batch, total_steps=setup.loop_steps,
      start_step=start, epochs=c.get("total_epochs"), pretrained=c.pretrained,
      devices=setup.mesh.size, platform=setup.mesh.devices.flat[0].platform,
      processes=jax.process_count())


class Report:
  """What the loop tells whoever shows its progress (vit-train's console), on every process:
  `started`, then `step`, `logged`, `evaluating` and `evaluated` as the run goes. This one
  shows nothing."""

  def started(self, info: RunInfo) -> None:
    """Before the first step, and before compiling it; a run already complete is evaluated
    only (`info.start_step >= info.total_steps`)."""

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

  def __init__(self, setup: run_setup.RunSetup, writer: metric_writers.MetricWriter, last_good: Callable,
               report: Report):
    self.setup, self.writer, self.last_good, self.report = setup, writer, last_good, report
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
            f"The last good checkpoint in {self.setup.workdir} is step {self.last_good()}.")
    return [m for _, m in host]

  def write(self, step: int) -> None:
    metrics = self.check_finite()
    summary = jax.tree.map(lambda *x: float(np.mean(x)), *metrics)
    elapsed = time.time() - self.t0
    scalars = {
        "train_loss": summary["loss"], "grad_norm": summary["grad_norm"],
        "learning_rate": float(self.setup.schedule(step // self.setup.config.accum_steps)),
        "img_per_sec": len(metrics) * self.setup.micro_batch / elapsed}
    self.writer.write_scalars(step, scalars)
    self.report.logged(step, scalars)
    self.restart_clock()

  def restart_clock(self) -> None:
    self.pending, self.t0 = [], time.time()


def _evaluate_params(due: dict[str, evaluators.Scheduled], params: Any, step: int,
                     writer: metric_writers.MetricWriter, progress: Any,
                     tag: str = "") -> dict[str, float]:
  """Runs the evaluators `due`; metrics named as registry.metric_names says, `tag` before
  every name."""
  out = {}
  for name, scheduled in due.items():
    with progress.timed(tag + name):
      metrics = scheduled.evaluator.evaluate(params)
    writer.write_scalars(step, {f"{tag}{name}_{k}": v for k, v in metrics.items()})
    out |= {tag + k: v for k, v in evaluators.metric_names(name, metrics).items()}
  return out


def _evaluate(due: dict[str, evaluators.Scheduled], state: trainer.TrainState, step: int,
              writer: metric_writers.MetricWriter, progress: Any,
              report: Report) -> dict[str, float]:
  """The parameters' metrics, and their moving average's beside them (`ema_` names)."""
  report.evaluating(step)
  out = _evaluate_params(due, state.params, step, writer, progress)
  if state.ema_params is not None:
    out |= _evaluate_params(due, state.ema_params, step, writer, progress, tag="ema_")
  report.evaluated(step, out)
  return out


def _run_steps(setup: run_setup.RunSetup, state: trainer.TrainState, start: int, train_step: Callable,
               batches: Any, scheduled: dict[str, evaluators.Scheduled],
               manager: ocp.CheckpointManager,
               writer: metric_writers.MetricWriter, dog: watchdog.StallWatchdog,
               report: Report, stop: stop_signals.StopSignals,
               attempt: goodput.AttemptLog) -> dict[str, float]:
  c, meta, description = setup.config, setup.meta, setup.description
  progress = periodic_actions.ReportProgress(num_train_steps=setup.loop_steps, writer=writer,
                                             every_steps=c.log_every_steps)
  log = _TrainMetrics(setup, writer, manager.latest_step, report)
  eval_metrics = {}
  for step in range(start + 1, setup.loop_steps + 1):
    dog.beat(step)
    state, metrics = train_step(state, next(batches))
    log.add(step, metrics)
    report.step(step)
    progress(step)
    if step % c.log_every_steps == 0 or step == setup.loop_steps:
      log.write(step)
    due = {n: e for n, e in scheduled.items() if e.due(step, setup.loop_steps)}
    if due:
      eval_metrics |= _evaluate(due, state, step, writer, progress, report)
      log.restart_clock()
    stopping = stop.reached(step)
    saving = step % c.checkpoint_every_steps == 0 or step == setup.loop_steps or stopping
    if saving:
      log.check_finite()
      run.save(manager, step, state, meta, description)
      dog.beat()
    attempt.step(step, saved=saving)
    if stopping and step < setup.loop_steps:
      manager.wait_until_finished()
      logging.info("Stopped: saved step %d to %s; rerun the same command to resume.", step,
                   setup.workdir)
      raise stop_signals.Interrupted(stop.received, step, setup.workdir)
  manager.wait_until_finished()  # The last save in full before the record calls it saved.
  return eval_metrics


def _compiled_step(setup: run_setup.RunSetup, state: trainer.TrainState, shardings: trainer.TrainState,
                   rng: jax.Array, start: int) -> tuple[Callable, Iterator[Any]]:
  """The train step compiled ahead of the first call (so that compiling, however long, is not
  counted as a stalled step), and the batches from step `start` on."""
  c = setup.config
  train_step = run_setup.train_step_fn(setup, shardings, rng)
  batches = data.train_iterator(c.data, global_batch_size=setup.micro_batch,
                                sharding=setup.batch_sharding, seed=c.seed, start_step=start)
  first = next(batches)
  return train_step.lower(state, first).compile(), itertools.chain([first], batches)


# How long a stalled run waits for a checkpoint in flight to be written before it exits.
SAVE_WAIT_S = 20.0


def _stall_message(setup: run_setup.RunSetup, manager: ocp.CheckpointManager, step: int, reason: str) -> str:
  saving = threading.Thread(target=manager.wait_until_finished, daemon=True)
  saving.start()
  saving.join(SAVE_WAIT_S)
  steps = run.finished_steps(setup.workdir)
  saved = f"step {steps[-1]}" if steps else "none yet"
  return (f"the run in {setup.workdir} stalled at step {step}: {reason}. Its last saved "
          f"checkpoint is {saved}; rerun the same command to resume from it: "
          f"{shlex.join(sys.orig_argv)}")


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str,
                       report: Report | None = None,
                       pretrained: run_setup.Opened | None = None) -> dict[str, float]:
  """Trains (resuming from `workdir` if it holds a checkpoint) and returns final eval metrics;
  `report` is told how the run goes. `pretrained`: config.pretrained already opened (by
  config.check_pretrained), so that the run reads it no more.

  A run whose steps stop ending (config.stall_timeout_s) exits the process with status 1; one
  that SIGTERM or SIGINT stops before its last step saves, then raises
  stop_signals.Interrupted; one that a full device stops raises DiskFull (an OSError, ENOSPC),
  naming its newest checkpoint.
  """
  with stop_signals.StopSignals() as stop:
    try:
      return _train_and_evaluate(c, workdir, report or Report(), stop, pretrained)
    except Exception as e:
      full = disk_full(e, workdir)
      if full is None:
        raise
      raise full from e


class DiskFull(OSError):
  """A run stopped by a full device (a save, its TensorBoard events), saying where and what it
  kept: the libraries' own errors name a temporary file deep in tensorstore's words, or the
  events file (clu's, raised as the writer closes, over the save's)."""

  def __init__(self, error: BaseException, workdir: str):
    path = getattr(error, "filename", None) or re.search(r'(?:^|[\s"])(/[^"\s;]+)', str(error))
    where = f" writing {path if isinstance(path, str) else path.group(1)}" if path else ""
    steps = run.finished_steps(workdir)
    kept = (f"its newest checkpoint is step {steps[-1]}, from which the same command resumes"
            if steps else "it saved no checkpoint; the same command starts it again")
    super().__init__(errno.ENOSPC, f"no space left on device{where}: the run stopped; {kept} "
                     "once there is room.")

  def __str__(self) -> str:
    return self.strerror


def disk_full(e: BaseException, workdir: str) -> DiskFull | None:
  """DiskFull for the first error in `e`'s chain (its causes and contexts, the deepest first)
  that says a device is full: an OSError ENOSPC, or the libraries' words for it (tensorstore's
  RESOURCE_EXHAUSTED, TensorFlow's ResourceExhaustedError, each naming its file); None if no
  error there does."""
  chain = []
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or e.__context__
  full = next((x for x in reversed(chain) if (isinstance(x, OSError) and x.errno == errno.ENOSPC)
               or os.strerror(errno.ENOSPC) in str(x)), None)
  return None if full is None else DiskFull(full, workdir)


def _train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, report: Report,
                        stop: stop_signals.StopSignals,
                        pretrained: run_setup.Opened | None) -> dict[str, float]:
  if jax.default_backend() == "cpu":
    cpu_backend.check_pool(jax.local_device_count())
  setup = run_setup.RunSetup.from_config(c, workdir, pretrained)
  init_rng, dropout_rng = jax.random.split(jax.random.key(c.seed))
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  manager = None
  try:
    with setup.mesh_scope():  # Pallas attention on TPU runs per shard of the mesh.
      manager, state, shardings, start = _restore_or_init(setup, init_rng)
      if start == 0:
        writer.write_hparams({k: str(v) for k, v in c.to_dict().items()})
      info = _run_info(setup, state, start)
      if info.trained_parameters < info.parameters:
        logging.info(info.trained_line)
      report.started(info)
      dog = watchdog.StallWatchdog(c.stall_timeout_s,
                                   functools.partial(_stall_message, setup, manager))
      scheduled = _build_evaluators(setup, dog)
      committed = lambda: max(run.finished_steps(workdir), default=None)  # noqa: E731
      with goodput.AttemptLog(workdir, start, setup.loop_steps, committed=committed,
                              enabled=jax.process_index() == 0) as attempt:
        if start >= setup.loop_steps:
          logging.info("The run in %s is complete (step %d of %d); evaluating its last "
                       "checkpoint.", workdir, start, setup.loop_steps)
          with dog:
            return _evaluate({n: e for n, e in scheduled.items() if e.at_end}, state, start,
                             writer, periodic_actions.ReportProgress(writer=writer), report)
        train_step, batches = _compiled_step(setup, state, shardings, dropout_rng, start)
        with dog:
          return _run_steps(setup, state, start, train_step, batches, scheduled, manager, writer,
                            dog, report, stop, attempt)
  finally:
    if manager is not None:
      manager.close()  # Waits for the last save, then stops orbax's writer and deleter threads.
    writer.close()
