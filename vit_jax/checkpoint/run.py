"""The layout of a training run's checkpoints (orbax): WORKDIR/checkpoints/STEP/ holds
`state` (the train state) and `meta` (JSON: what the run must agree with to resume it).

Here: the manager, saving and restoring one step, the resumability check, the latest
step, and the params of a step as host arrays for any device count.
"""
import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from vit_jax.checkpoint.npz import CheckpointError, flatten

ITEMS = ("state", "meta")


def checkpoint_dir(workdir: str | epath.Path) -> epath.Path:
  return epath.Path(workdir) / "checkpoints"


def make_manager(workdir: str | epath.Path, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      checkpoint_dir(workdir), item_names=ITEMS,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
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


def check_resumable(found: dict[str, Any], wanted: dict[str, Any], workdir: str) -> None:
  """Refuses to resume a run whose stored metadata differs from the config's, field by field."""
  if found == wanted:
    return
  diffs = [f"  {k}: checkpoint {found.get(k)!r}, config {wanted.get(k)!r}"
           for k in sorted(set(found) | set(wanted)) if found.get(k) != wanted.get(k)]
  raise CheckpointError(
      f"{workdir} holds a checkpoint of a different model than the config asks for:\n"
      + "\n".join(diffs) + "\nUse a new --workdir, or the config that wrote the checkpoint.")


def is_step_dir(path: epath.Path) -> bool:
  return (path / "state").is_dir() and (path / "meta" / "metadata").exists()


def latest_step_dir(path: str | epath.Path) -> epath.Path:
  """A workdir's newest finished step directory; a step directory stands for itself."""
  path = epath.Path(path)
  if checkpoint_dir(path).is_dir():
    steps = [p for p in checkpoint_dir(path).iterdir() if p.name.isdigit()]
    if not steps:
      raise CheckpointError(f"{checkpoint_dir(path)} holds no finished checkpoint.")
    return max(steps, key=lambda p: int(p.name))
  return path


def read_params(step_dir: str | epath.Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Params (flat, original layout) and metadata of one step, as host numpy arrays."""
  step_dir = epath.Path(step_dir)
  if not is_step_dir(step_dir):
    raise CheckpointError(f"{step_dir} is not a vit_jax checkpoint step directory "
                          "(WORKDIR/checkpoints/STEP with state/ and meta/).")
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(step_dir / "state").item_metadata.tree
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  state = checkpointer.restore(step_dir / "state",
                               args=ocp.args.PyTreeRestore(restore_args=restore_args))
  meta = json.loads((step_dir / "meta" / "metadata").read_text())
  return flatten(state["params"]), meta
