"""Runs the protocol's fine-tuning runs over checkpoints and tasks, one after another in this process,
recording each result in its task's rows file as it ends (results.py) and the merged report
after each task: a rerun skips what is done (a run killed midway resumes from its own
checkpoints), and a task that fails is named while the sweep goes on with the next. SIGTERM or
Ctrl-C stops the sweep: the run going saves and writes no row, and no other run starts
(stop_signals.Interrupted reaches the command)."""
import time
import traceback
from collections.abc import Callable, Sequence

from absl import logging
import ml_collections

from vit_jax import data
from vit_jax.checkpoint import loader
from vit_jax.checkpoint import workdir_lock
from vit_jax.data import tasks
from vit_jax.train import loop, stop_signals
from vit_jax.transfer import protocol, report, results
from vit_jax.transfer.results import OK


def _done(task_dir: str) -> set[tuple[str, str, str, str]]:
  return {(r["checkpoint"], r["task"], r["phase"], r["lr"])
          for r in results.task_rows(task_dir) if r["status"] == OK}


def _one_line(e: BaseException) -> str:
  text = e.worded(protocol.DATA_OPTIONS) if isinstance(e, data.DataOptionError) else str(e)
  return f"{type(e).__name__}: {' '.join(text.split())}"


def fine_tune(ft: protocol.FineTune, settings: protocol.Settings, opened: loader.Opened,
              out_dir: str) -> dict[str, object]:
  """Fine-tunes and evaluates one run of the protocol from its checkpoint, `opened` (its
  description, and its arrays, read again only where an earlier run released them); its row,
  appended to the task's rows. Its workdir is locked while it runs: a second sweep on the
  same out_dir stops there (WorkdirInUse)."""
  c = protocol.config(ft, settings, opened.description)
  lock = workdir_lock.take(ft.workdir)
  try:
    return _fine_tune_locked(ft, c, opened, out_dir)
  finally:
    if lock:
      lock.release()


def _fine_tune_locked(ft: protocol.FineTune, c: ml_collections.ConfigDict,
                      opened: loader.Opened, out_dir: str) -> dict[str, object]:
  t0 = time.time()
  row = {"checkpoint": ft.checkpoint, "model": opened.description.model_name or "",
         "task": ft.task.name, "suite": ft.task.suite,
         "group": ft.task.group, "phase": ft.phase, "lr": protocol.format_lr(ft.lr),
         "steps": c.total_steps, "workdir": ft.workdir}
  try:
    metrics = loop.train_and_evaluate(c, ft.workdir, pretrained=opened)
    row |= {"accuracy": f"{metrics['accuracy']:.6f}", "status": OK}
  except Exception as e:  # any failure of one task leaves the others to run
    # An input the library refuses (data that is not there) says all in its message.
    detail = "" if isinstance(e, (ValueError, OSError)) else "\n" + traceback.format_exc()
    logging.error("%s on %s failed: %s%s", ft.checkpoint, ft.task.name, _one_line(e), detail)
    row |= {"accuracy": "", "status": f"failed: {_one_line(e)}"}
  row["wall_s"] = f"{time.time() - t0:.1f}"
  results.append(protocol.task_dir(out_dir, ft.checkpoint, ft.task), row)
  return row


def _selected(rows: list[results.Row], ckpt: str, task: tasks.Task) -> dict[float, float]:
  return {float(r["lr"]): float(r["accuracy"]) for r in rows
          if r["status"] == OK and (r["checkpoint"], r["task"], r["phase"]) ==
          (ckpt, task.name, protocol.SELECT)}


def _check(stop: stop_signals.StopSignals) -> None:
  if stop.received is not None:  # Between runs: nothing to save.
    raise stop_signals.Interrupted(stop.received)


def transfer_task(ckpt: str, task: tasks.Task, settings: protocol.Settings, out_dir: str,
                  opened: loader.Opened, log: Callable[[str], None],
                  stop: stop_signals.StopSignals) -> str | None:
  """The task's selection runs, then its final run, each unless done; None, or why it failed."""
  task_dir = protocol.task_dir(out_dir, ckpt, task)
  for ft in protocol.fine_tunes(ckpt, task, settings, out_dir)[:-1]:
    if ft.key in _done(task_dir):
      continue
    _check(stop)
    row = fine_tune(ft, settings, opened, out_dir)
    log(f"{task.name} lr={row['lr']} on {ft.phase}: {row['accuracy'] or row['status']}")
    if row["status"] != OK:
      return str(row["status"])
  selected = _selected(results.task_rows(task_dir), ckpt, task)
  chosen = protocol.choose_lr(selected) if selected else None
  final = protocol.fine_tunes(ckpt, task, settings, out_dir, chosen)[-1]
  if final.key in _done(task_dir):
    return None
  _check(stop)
  row = fine_tune(final, settings, opened, out_dir)
  log(f"{task.name} lr={row['lr']} on {final.phase}: {row['accuracy'] or row['status']}")
  return None if row["status"] == OK else str(row["status"])


def transfer(checkpoints: Sequence[str], task_list: Sequence[tasks.Task],
             settings: protocol.Settings, out_dir: str,
             log: Callable[[str], None] = print) -> dict[tuple[str, str], str]:
  """Every (checkpoint, task), the report rewritten after each; returns the failures,
  (checkpoint, task name) -> why."""
  with stop_signals.StopSignals() as stop:
    return _transfer(checkpoints, task_list, settings, out_dir, log, stop)


def _transfer(checkpoints: Sequence[str], task_list: Sequence[tasks.Task],
              settings: protocol.Settings, out_dir: str, log: Callable[[str], None],
              stop: stop_signals.StopSignals) -> dict[tuple[str, str], str]:
  failures = {}
  for ckpt in checkpoints:
    try:
      opened = loader.open_checkpoint(ckpt)
    except Exception as e:  # the other checkpoints still run
      logging.error("%s failed: %s", ckpt, _one_line(e))
      failures |= {(ckpt, t.name): f"failed: {_one_line(e)}" for t in task_list}
      continue
    for task in task_list:
      if (why := transfer_task(ckpt, task, settings, out_dir, opened, log, stop)) is not None:
        failures[ckpt, task.name] = why
      report.write(out_dir, failures)
  report.write(out_dir, failures)
  return failures
