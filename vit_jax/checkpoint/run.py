"""The layout of a training run's checkpoints (orbax): WORKDIR/checkpoints/STEP/ holds
`state` (the train state) and `meta` (JSON: what the run must agree with to resume it, a
checksum of every array of the state, and the step's `Description`).

Here: the manager, saving and restoring one step (verified against its checksums, falling
back to older steps and setting bad ones aside), the resumability check, the latest step,
and the params of a step as host arrays for any device count. The workdir's lock, WORKDIR/lock,
is workdir_lock.py's.
"""
import contextlib
import json
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from vit_jax.checkpoint.description import (Description, Preprocessing, UnreadableDescription,
                                           output_of_loss)
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.npz import flatten
from vit_jax.models import lora, registry

ITEMS = ("state", "meta")
# Keys of `meta` beside what a resumed run must agree with.
_RECORDS = ("checksums", "description")
# Orbax's words for a target whose tree is not the saved one's.
_STRUCTURE_CHANGED = "tree structures do not match"


def absolute(path: str | epath.Path) -> epath.Path:
  """A local path made absolute: orbax writes and reads nothing else (a relative workdir failed
  at the first save, after the training)."""
  return epath.Path(path if "://" in str(path) else os.path.abspath(path))


def checkpoint_dir(workdir: str | epath.Path) -> epath.Path:
  return absolute(workdir) / "checkpoints"


def finished_steps(workdir: str | epath.Path) -> list[int]:
  """The steps saved in full in `workdir`, oldest first (orbax renames a step's folder to its
  number only once it is written)."""
  folder = checkpoint_dir(workdir)
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _meta_file(step_dir: epath.Path) -> epath.Path:
  return step_dir / "meta" / "metadata"


def _read_meta(step_dir: epath.Path) -> dict[str, Any]:
  """A step's metadata, without restoring any state."""
  return json.loads(_meta_file(step_dir).read_text())


def newest_meta(workdir: str | epath.Path) -> dict[str, Any] | None:
  """The metadata of the newest step whose metadata reads, without restoring any state."""
  for step in reversed(finished_steps(workdir)):
    try:
      return _read_meta(checkpoint_dir(workdir) / str(step))
    except (OSError, ValueError):
      continue
  return None


def make_manager(workdir: str | epath.Path, keep: int) -> ocp.CheckpointManager:
  _save_arrays_whole_where_one_process_holds_them()
  _quiet_abandoned_io()  # A save that fails (a full disk) raises one error, not one per array.
  return ocp.CheckpointManager(
      checkpoint_dir(workdir), item_names=ITEMS,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def _save_arrays_whole_where_one_process_holds_them() -> None:
  """Orbax's replica-parallel save splits each replicated array among its replicas, so that
  each host (or accelerator) moves and writes a slice of it. In one process on the CPU nothing
  moves: the slices are only eager ops, one a device and array. A ViT-Ti's AdamW state on 8 CPU
  devices saves in 2.5 s instead of 6.4 (benchmarks/checkpoint_checksums.py); a tiny 12-step
  run takes 14.5 s instead of 18.9. Orbax turns it off on GPUs by itself; several processes
  (a pod slice, or the tests' gloo runs) keep it."""
  if jax.process_count() == 1 and jax.default_backend() == "cpu":
    # Otherwise orbax's default handler: it keeps the arrays' metadata in this store, which
    # orbax names nowhere public. Registered as register_type_handler does, without the
    # warning it logs each time (in a notebook's cell, on every run's start).
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import type_handler_registry
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
        override=True, ignore_warnings=True)


def _array_checksum(x: jax.Array) -> jax.Array:
  """The sum of the array's 32-bit words, each times an odd weight made from its index,
  modulo 2**32: any flipped bit changes it. Elementwise, so it runs where the (sharded)
  array lives and needs no gathering."""
  if x.dtype.itemsize != 4:
    x = x.astype(jnp.float32)  # bfloat16 moments, exactly.
  words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  index, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for axis in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride)
    stride = stride * x.shape[axis] % 2**32
  return jnp.sum(words * (index * jnp.uint32(2654435761) | jnp.uint32(1)), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))


def checksums(state: Any) -> dict[str, int]:
  """{array path: checksum} of every array of a (train) state."""
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(_checksums(state)))[0]
  return {jax.tree_util.keystr(path): int(v) for path, v in flat}


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any],
         description: Description) -> None:
  """Saves `state` with `meta`, the state's checksums (verified by `restore_latest`) and
  `description` at this step."""
  meta = dict(meta, checksums=checksums(state),
              description=description.replace(step=step).to_dict())
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)


def restore_meta(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore_state(manager: ocp.CheckpointManager, step: int, state: Any, shardings: Any) -> Any:
  """The state saved at `step`, laid out as `shardings`; `state` gives shapes and dtypes."""
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]


def _differing(stored: dict[str, int], tree: Any, prefix: str = "") -> list[str]:
  """The paths (`prefix` + each array's path in `tree`) whose checksum is not `stored`'s."""
  return [prefix + k for k, v in checksums(tree).items() if stored.get(prefix + k) != v]


def _verified(manager: ocp.CheckpointManager, step: int, state: Any,
              shardings: Any) -> tuple[Any, dict[str, Any]]:
  """Restores `step` and checks it against the checksums saved with it."""
  meta = restore_meta(manager, step)
  restored = restore_state(manager, step, state, shardings)
  stored = meta.get("checksums")
  if stored is None:
    raise CheckpointError("its metadata holds no checksums")
  bad = _differing(stored, restored)
  if bad:
    raise CheckpointError(f"{len(bad)} array(s) differ from their checksums: {', '.join(bad[:5])}")
  return restored, meta


def set_aside(workdir: str | epath.Path, step: int) -> epath.Path:
  """Renames a bad step directory out of orbax's sight (`STEP.corrupt`), keeping its files."""
  src = checkpoint_dir(workdir) / str(step)
  dst = src.parent / f"{step}.corrupt"
  n = 1
  while dst.exists():
    dst, n = src.parent / f"{step}.corrupt{n}", n + 1
  if jax.process_index() == 0:
    src.rename(dst)
  return dst


class _AbandonedIO(logging.Filter):
  """Drops asyncio's report of a failed tensorstore read or orbax write nobody awaited (the
  restore or save had already failed on another array's)."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("exception was never retrieved" in message and (
        "tensorstore_spec" in message or "/orbax/checkpoint/" in message))


_ABANDONED_IO = _AbandonedIO()


def _ignore_loop_closed(previous: Any) -> Any:
  def hook(unraisable: Any) -> None:
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)
  hook.ignores_loop_closed = True
  return hook


def _quiet_abandoned_io() -> None:
  """A restore (or save) that fails on one array returns while orbax's reads (writes) of the
  others are still in flight, and orbax closes their event loop: each that ends then raises
  'Event loop is closed' in its callback (printed as unraisable), and each that failed too is
  reported by asyncio when collected. That repeats the one failure already reported, array by
  array (45 KB of tracebacks on the console for a ViT-Ti's read, a pipe's worth: a parent that
  reads its child's stderr only at the end blocked it; 800 lines for a save on a full disk).
  Idempotent; other unraisables and records pass."""
  asyncio_logger = logging.getLogger("asyncio")
  if _ABANDONED_IO not in asyncio_logger.filters:
    asyncio_logger.addFilter(_ABANDONED_IO)
  if not getattr(sys.unraisablehook, "ignores_loop_closed", False):
    sys.unraisablehook = _ignore_loop_closed(sys.unraisablehook)


def restore_latest(workdir: str | epath.Path, keep: int, state: Any, shardings: Any
                   ) -> tuple[ocp.CheckpointManager, Any, dict[str, Any] | None, int]:
  """(manager, state, metadata, step) of the newest step that restores and verifies.

  A step that fails is reported by step and path, set aside, and the next older one tried;
  with none left, `state` itself (its shapes suffice) is returned at step 0. A step whose state
  is laid out otherwise than `state` (a changed config, not damage) is refused, kept in place.
  """
  _quiet_abandoned_io()  # Before: the first read may end before the failure is raised.
  while True:
    manager = make_manager(workdir, keep)
    step = manager.latest_step()
    if step is None:
      return manager, state, None, 0
    try:
      restored, meta = _verified(manager, step, state, shardings)
      return manager, restored, meta, step
    except Exception as e:  # Whatever orbax or the checksums raise, the step is unusable.
      manager.close()
      if _STRUCTURE_CHANGED in str(e):  # Not damage: the config asks for another state.
        raise CheckpointError(
            f"Checkpoint step {step} in {checkpoint_dir(workdir)} holds a train state laid out "
            "otherwise than the config's (another optimizer, frozen parameters, accum_steps or "
            "ema_decay on or off): config.allow_resume_changes cannot carry it over. Rerun with "
            "the checkpoint's values, or give a new --workdir.") from e
      where = set_aside(workdir, step)
      logging.warning("Checkpoint step %d in %s cannot be used (%s: %s); set aside as %s. "
                      "Trying the previous step.", step, checkpoint_dir(workdir),
                      type(e).__name__, str(e)[:500], where)
      multihost_sync(f"set_aside_{step}")


def multihost_sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out |= _leaves(v, f"{prefix}.{k}" if prefix else k)
  return out


def check_resumable(found: dict[str, Any] | None, wanted: dict[str, Any], workdir: str,
                    allow_changes: bool = False) -> None:
  """Refuses to resume a run whose stored metadata differs from the config's, naming every
  differing field. A different model is always refused; other changes (optimizer, schedule,
  batch, steps, data) are resumed with a warning when `allow_changes`."""
  if found is None:
    return
  found, wanted = _leaves({k: v for k, v in found.items() if k not in _RECORDS}), _leaves(wanted)
  # A field added to the config since the checkpoint was written, left off, changes nothing.
  added_off = {k for k in set(wanted) - set(found) if wanted[k] in (None, [], ())}
  diffs = [(k, found.get(k), wanted.get(k)) for k in sorted(set(found) | set(wanted))
           if found.get(k) != wanted.get(k) and k not in added_off]
  if not diffs:
    return
  lines = "\n".join(f"  {k}: checkpoint {a!r}, config {b!r}" for k, a, b in diffs)
  if any(k.split(".")[0] in ("model_name", "num_classes", "model") for k, _, _ in diffs):
    raise CheckpointError(
        f"{workdir} holds a checkpoint of a different model than the config asks for:\n"
        f"{lines}\nUse a new --workdir, or the config that wrote the checkpoint.")
  if allow_changes:
    logging.warning("Resuming %s with a changed config (config.allow_resume_changes):\n%s",
                    workdir, lines)
    return
  raise CheckpointError(
      f"{workdir} was written with another config; resuming would not continue its "
      f"trajectory:\n{lines}\nEither rerun with the checkpoint's values (or give a new "
      "--workdir to start afresh), or resume with the new values anyway: "
      "--config.allow_resume_changes=True.")


def is_step_dir(path: epath.Path) -> bool:
  return (path / "state").is_dir() and _meta_file(path).exists()


def latest_step_dir(path: str | epath.Path) -> epath.Path:
  """A workdir's newest finished step directory (its checkpoints folder stands for it); a step
  directory stands for itself."""
  path = epath.Path(path)
  if path.name == "checkpoints" and not checkpoint_dir(path).is_dir():  # Not a workdir itself.
    path = path.parent
  if checkpoint_dir(path).is_dir():
    steps = finished_steps(path)
    if not steps:
      raise CheckpointError(f"{checkpoint_dir(path)} holds no finished checkpoint.")
    return checkpoint_dir(path) / str(steps[-1])
  return path


def _checked_step_dir(step_dir: str | epath.Path) -> epath.Path:
  step_dir = absolute(step_dir)
  if not is_step_dir(step_dir):
    raise CheckpointError(f"{step_dir} is not a vit_jax checkpoint step directory "
                          "(WORKDIR/checkpoints/STEP with state/ and meta/).")
  return step_dir


def read_params(step_dir: str | epath.Path, ema: bool = False
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Params (flat, original layout; with `ema` their moving average) and metadata of one step,
  as host numpy arrays."""
  step_dir = _checked_step_dir(step_dir)
  _quiet_abandoned_io()  # A damaged step raises one error, not one per array.
  try:
    # The handler's own metadata: a checkpointer's looks for a step's metadata file inside the
    # item's folder too, where a manager never writes one, and warns of it on every read.
    with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
      tree = handler.metadata(step_dir / "state").tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except Exception as e:  # Whatever orbax raises on damaged or missing files.
    raise CheckpointError(f"{step_dir} cannot be read, damaged or incomplete "
                          f"({type(e).__name__}: {str(e)[:500]}). Read another step of its "
                          "run.") from e
  key = "ema_params" if ema else "params"
  if not state.get(key):
    raise CheckpointError(f"{step_dir} holds no moving average of the parameters: its run "
                          "had no config.ema_decay.")
  meta = _read_meta(step_dir)
  stored = meta.get("checksums")  # Steps written before checksums have none to check.
  if stored:
    bad = _differing(stored, state[key], prefix=f".{key}")
    if bad:
      raise CheckpointError(
          f"{step_dir} is damaged: {len(bad)} array(s) differ from the checksums saved with "
          f"them ({', '.join(bad[:5])}). Read another step of its run.")
  return flatten(state[key]), meta


def step_description(meta: dict[str, Any], step: int) -> Description:
  """The description saved with a step; for a step saved before descriptions, the one its
  resume metadata implies (no class names, config or parent: those were not kept)."""
  if "description" in meta:
    try:
      return Description.from_dict(meta["description"])
    except UnreadableDescription as e:
      if "trajectory" not in meta:
        raise UnreadableDescription(f"step {step}'s description is no description vit_jax "
                                    f"wrote ({e}), and its metadata holds no resume record "
                                    "to describe it from.") from e
      logging.warning("Step %d's description is no description vit_jax wrote (%s): described "
                      "from its resume record instead.", step, e)
  data = meta["trajectory"]["data"]
  return Description(
      model=meta["model"], num_classes=meta["num_classes"],
      model_name=registry.match_name(meta["model"], preferred=meta["model_name"]),
      image_size=data["image_size"], preprocessing=Preprocessing.from_data_config(data),
      output=output_of_loss(meta["trajectory"]["loss"]), dataset=data["name"], step=step)


def read_step(step_dir: str | epath.Path, ema: bool = False
              ) -> tuple[dict[str, np.ndarray], Description]:
  """Params (flat, original layout; with `ema` their moving average) and description of one
  step, as host numpy arrays. A LoRA run's adapters come merged into their kernels: what is
  read is a plain ViT."""
  flat, meta = read_params(step_dir, ema)
  described = step_description(meta, int(epath.Path(step_dir).name))
  flat, model = lora.merged(flat, described.model)
  return flat, described.replace(model=model)


def read_step_description(step_dir: str | epath.Path) -> Description:
  """The description of one step, without reading its arrays."""
  step_dir = _checked_step_dir(step_dir)
  return step_description(_read_meta(step_dir), int(step_dir.name))
