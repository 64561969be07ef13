"""`vit-train --compile_only` and `--plan` as one call: compile_check's search for a TPU slice,
run in a thread of its own so that the calling (main) thread answers at once. SIGTERM or
Ctrl-C raises stop_signals.Interrupted there (libtpu's handler, which prints a stack trace,
replaced), and the time limit raises TimedOut naming the closest candidate so far. Either way
a compile may still be running in the search's thread, which nothing can stop: the caller
ends the process without waiting for it (nothing is saved).
"""
import signal
import threading
from typing import Any, Callable

import ml_collections

from vit_jax.config_errors import ConfigError, InputError
from vit_jax.train import compile_check, stop_signals, tpu_specs


class TimedOut(InputError):
  """The search's time limit passed before a candidate fit; its thread may be compiling."""


def num_classes(c: ml_collections.ConfigDict, given: int | None) -> int:
  """The head's width: `given` (--num_classes), else the count of a dataset vit_jax knows."""
  name = c.data.name.split(":")[0]
  if given is None and name not in compile_check.KNOWN_CLASSES:
    raise ConfigError(f"config.data.name={c.data.name!r}: its number of classes is not known "
                      "without reading the data; give it with --num_classes")
  return given or compile_check.KNOWN_CLASSES[name]


def search(c: ml_collections.ConfigDict, topology: compile_check.Topology, classes: int,
           plan: bool, timeout_s: int | None, log: Callable[[str], None]
           ) -> compile_check.Search:
  """compile_check.search (`log` hears of each compile) once the config is known not to be
  hopeless, in a thread; raises Interrupted on SIGTERM or SIGINT, TimedOut after `timeout_s`
  (None: no limit)."""
  compile_check.check_not_hopeless(c, topology, classes)
  found, result = compile_check.Search(None, []), {}

  def work() -> None:
    try:
      result["search"] = compile_check.search(c, topology, classes, plan, log, found)
    except BaseException as e:  # Raised again in the calling thread.
      result["error"] = e

  worker = threading.Thread(target=work, name="compile search", daemon=True)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _interrupt)
  worker.start()
  worker.join(timeout_s)
  if worker.is_alive():
    raise TimedOut(_timeout_line(found, timeout_s))
  if "error" in result:
    raise result["error"]
  return result["search"]


def _interrupt(signum: int, frame: Any) -> None:
  del frame
  raise stop_signals.Interrupted(signum, resumable=False)


def _timeout_line(found: compile_check.Search, timeout_s: int) -> str:
  line = (f"--plan_timeout={timeout_s}: {len(found.tried)} candidate(s) compiled in "
          f"{timeout_s} s, none fits yet")
  if found.tried:
    closest = min(found.tried, key=lambda a: a.over_bytes)
    line += (f"; the closest, {closest.described()}, is "
             f"{closest.over_bytes / tpu_specs.GiB:.2f} GiB per chip over")
  return line + ": give the search more time (--plan_timeout) or use a bigger slice"


def no_fit_line(found: compile_check.Search, topology: compile_check.Topology,
                spec: str) -> str:
  """Why the config of `--config spec` does not fit, and the first change found that fits."""
  head = f"--config {spec} does not fit {topology.name} ({topology.chips} {topology.unit}s)"
  if found.given is not None:
    over = found.given.over_bytes
    head += (f": at least {over / tpu_specs.GiB:.2f} GiB per {topology.unit} over its "
             f"{topology.device.hbm_bytes / tpu_specs.GiB:g} GiB")
  n = len(found.tried)
  if found.found is None:
    return (f"{head}; none of the {n} changes compiled fits (mesh.fsdp, model.remat, "
            "accum_steps): use a bigger slice")
  return (f"{head}; it fits with {found.found.described()} (the first that fit of {n} "
          "changes compiled, cheapest first)")
