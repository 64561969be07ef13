"""The training loop: data -> sharded train step -> metrics, evaluation, checkpoints."""
import json
import logging
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from clu import metric_writers, periodic_actions
from etils import epath
from jax.experimental import multihost_utils

from vit_jax import checkpoint, data, fewshot, models
from vit_jax.evaluators.classification import ClassificationEvaluator
from vit_jax.evaluators.fewshot import FewShotEvaluator
from vit_jax.train import config as config_lib
from vit_jax.train import optimizers, sharding, trainer


class NonFiniteLossError(RuntimeError):
  pass


class _Preemption:
  """Notices SIGTERM; with several processes all of them agree on the step to stop at."""

  def __init__(self):
    self.received = False
    if jax.process_count() == 1:
      signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint and stopping.")
    self.received = True

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received


def _model_overrides(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The model fields the config sets (tuples may come back from the command line as lists)."""
  return {k: tuple(v) if isinstance(v, list) else v for k, v in c.model.items() if v is not None}


def build_model(c: ml_collections.ConfigDict, num_classes: int) -> models.VisionTransformer:
  return models.create_model(c.model_name, num_classes=num_classes,
                             dtype=jnp.dtype(c.dtype), **_model_overrides(c))


def _meta(c: ml_collections.ConfigDict, model: models.VisionTransformer) -> dict[str, Any]:
  """What a checkpoint must agree with to be resumed."""
  fields = models.model_config(c.model_name, **_model_overrides(c))
  fields = {k: v for k, v in fields.items() if k not in ("dropout", "attention_dropout", "remat",
                                                         "attention_impl", "stochastic_depth")}
  return {"model_name": c.model_name, "num_classes": model.num_classes,
          "model": json.loads(json.dumps(fields, default=list))}


def _check_resumable(found: dict[str, Any], wanted: dict[str, Any], workdir: str) -> None:
  if found != wanted:
    raise ValueError(
        f"{workdir} holds a checkpoint of a different model ({found['model_name']}, "
        f"{found['num_classes']} classes, {found['model']}) than the config asks for "
        f"({wanted['model_name']}, {wanted['num_classes']} classes, {wanted['model']}). "
        "Use a new --workdir, or the config that wrote the checkpoint.")


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from `workdir` if it holds a checkpoint) and returns final eval metrics."""
  config_lib.validate(c)
  info = data.dataset_info(c.data)
  total_steps, warmup_steps = config_lib.resolve_steps(c, info.num_train_examples)
  loop_steps = total_steps * c.accum_steps
  mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp)
  micro_batch = c.batch_size // c.accum_steps
  if micro_batch % jax.device_count():
    raise config_lib.ConfigError(
        f"config.batch_size={c.batch_size}: each micro-batch ({micro_batch}) must split evenly "
        f"over the {jax.device_count()} devices.")

  model = build_model(c, info.num_classes)
  tx, schedule = optimizers.make_optimizer(c.optimizer, total_steps, warmup_steps, c.accum_steps)
  init_rng, dropout_rng = jax.random.split(jax.random.key(c.seed))
  image_shape = (c.data.image_size, c.data.image_size, 3)

  workdir = epath.Path(workdir)
  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=c.keep_checkpoints, create=True),
      item_names=("state", "meta"))
  meta = _meta(c, model)
  start = manager.latest_step() or 0

  params = None
  if start == 0 and c.pretrained:
    abstract = jax.eval_shape(model.init, init_rng, jnp.zeros((1,) + image_shape))["params"]
    params = checkpoint.load_npz(c.pretrained, target=abstract)
    logging.info("Initialised from %s.", c.pretrained)
  state, state_shardings = trainer.init_state(model, tx, mesh, image_shape, init_rng, params)
  if start:
    found = manager.restore(start, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    _check_resumable(found, meta, str(workdir))
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_shardings)
    state = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    logging.info("Resumed from %s at step %d.", workdir, start)

  train_step = trainer.make_train_step(model, tx, c.loss, state_shardings, mesh, dropout_rng,
                                       label_smoothing=c.label_smoothing)
  batches = data.train_iterator(c.data, global_batch_size=micro_batch,
                                sharding=sharding.batch_sharding(mesh), seed=c.seed,
                                start_step=start)
  predict = lambda params, images: model.apply({"params": params}, images)
  evaluator = ClassificationEvaluator(
      predict, lambda: data.eval_iterator(c.data, global_batch_size=micro_batch,
                                          sharding=sharding.batch_sharding(mesh)), c.loss)
  evaluators = {"eval": evaluator}
  if c.fewshot.datasets:
    f = c.fewshot
    evaluators["fewshot"] = FewShotEvaluator(
        lambda params, images: model.apply({"params": params}, images, return_aux=True)[1][
            "pre_logits"],
        fewshot.fewshot_datasets(f.datasets, f.data_dir, f.train_split, f.test_split,
                                 c.data.image_size, micro_batch),
        f.shots, f.seeds, f.l2)
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  if start == 0:
    writer.write_hparams({k: str(v) for k, v in c.to_dict().items()})
  progress = periodic_actions.ReportProgress(num_train_steps=loop_steps, writer=writer,
                                             every_steps=c.log_every_steps)
  preemption = _Preemption()

  def save(step: int) -> None:
    bad = int(state["first_nonfinite_step"])
    if bad >= 0:
      raise NonFiniteLossError(
          f"Loss or gradients became NaN/inf at step {bad + 1}; stopped without saving. "
          f"The last good checkpoint in {workdir} is step {manager.latest_step()}.")
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  eval_metrics = {}
  step = start
  try:
    train_metrics, t0 = [], time.time()
    while step < loop_steps:
      state, metrics = train_step(state, next(batches))
      step += 1
      train_metrics.append(metrics)
      progress(step)
      if step % c.log_every_steps == 0 or step == loop_steps:
        summary = jax.tree.map(lambda *x: float(np.mean(x)), *jax.device_get(train_metrics))
        if int(state["first_nonfinite_step"]) >= 0:
          save(step)  # Raises, naming the step.
        elapsed = time.time() - t0
        writer.write_scalars(step, {
            "train_loss": summary["loss"], "grad_norm": summary["grad_norm"],
            "learning_rate": float(schedule(step // c.accum_steps)),
            "img_per_sec": len(train_metrics) * micro_batch / elapsed})
        train_metrics, t0 = [], time.time()
      if step == loop_steps or (c.eval_every_steps and step % c.eval_every_steps == 0):
        for prefix, ev in evaluators.items():
          with progress.timed(prefix):
            metrics = ev.run(state["params"])
          writer.write_scalars(step, {f"{prefix}_{k}": v for k, v in metrics.items()})
          eval_metrics |= {k if prefix == "eval" else f"{prefix}_{k}": v for k, v in metrics.items()}
        t0 = time.time()
      preempted = preemption.reached(step)
      if step % c.checkpoint_every_steps == 0 or step == loop_steps or preempted:
        save(step)
      if preempted:
        logging.warning("Preempted: saved step %d to %s; rerun the same command to resume.",
                        step, workdir)
        break
  finally:
    manager.close()  # Waits for the last save, then stops orbax's writer and deleter threads.
    writer.close()
  return eval_metrics
