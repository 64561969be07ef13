"""A training process's start, before the run's first step: JAX with its devices (the CPU's
split as the config asks, or none taken for a compile-only check), joined to the run's other
processes; the workdir owned (its lock) and the process's log file named.
"""
import contextlib
import os
import re
import shutil
import tempfile
from types import ModuleType
from typing import Iterator

from vit_jax import cpu_backend
from vit_jax.config_errors import InputError


def start_jax(cpu_devices: int | None, coordinator_address: str | None = None,
              num_processes: int | None = None, process_id: int | None = None,
              distributed: bool = False) -> ModuleType:
  """JAX, its CPU devices split as the config asks, joined to the other processes: by
  `coordinator_address` (CPU processes then talk through gloo), or where `distributed`, as
  jax.distributed.initialize() finds its peers (Cloud TPU pod slices, SLURM)."""
  # Before JAX starts, after absl has parsed the flags (so XLA_FLAGS set by users apply).
  cpu_backend.prepare(cpu_devices)
  import jax

  if coordinator_address or distributed:
    if jax.config.jax_platforms in (None, "", "cpu") and coordinator_address:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  return jax


def start_jax_for_compiling() -> ModuleType:
  """JAX for compiles for a TPU slice that is not here: nothing runs, so no accelerator is
  taken (the CPU, unless JAX_PLATFORMS says otherwise), and no persistent compilation cache."""
  import jax
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  # Programs compiled for a topology without its devices cannot be loaded back from JAX's
  # persistent cache (no TPU client to load them into): with a cache set, each rerun warned
  # once per program ("Error reading persistent compilation cache entry") and compiled anyway.
  jax.config.update("jax_enable_compilation_cache", False)
  return jax


def log_path(workdir: str, process: int) -> str:
  """A process's log: WORKDIR/train.log for process 0, WORKDIR/train.processN.log for the
  others; a workdir in a bucket (gs://), where a file cannot be appended to, keeps it in this
  machine's temporary folder."""
  name = "train.log" if process == 0 else f"train.process{process}.log"
  if "://" in workdir:
    return os.path.join(tempfile.gettempdir(), re.sub(r"[^\w.-]+", "_", workdir) + "." + name)
  return os.path.join(workdir, name)


@contextlib.contextmanager
def owned_workdir(workdir: str) -> Iterator[None]:
  """Holds the workdir's lock (checkpoint/workdir_lock.py) while the block runs, taken before
  anything is written there: a workdir in use by another run raises WorkdirInUse naming its
  holder, one that cannot be created or locked an InputError. A workdir made here that the
  block refuses (an InputError or FileNotFoundError: what the user gave) is removed again if
  it holds only the logs: a refused run leaves nothing behind. After a stall (the watchdog's
  os._exit) the lock stays: the next run takes it over."""
  from vit_jax.checkpoint import workdir_lock
  created = "://" not in workdir and not os.path.exists(workdir)
  try:
    lock = workdir_lock.take(workdir)
  except OSError as e:  # The workdir cannot be created, or its lock not written.
    raise InputError(f"--workdir {workdir}: {e}") from None
  try:
    yield
  except (InputError, FileNotFoundError):
    if created and lock:
      lock.release()
      lock = None
      _remove_if_only_logs(workdir)
    raise
  finally:
    if lock:
      lock.release()


def _remove_if_only_logs(workdir: str) -> None:
  left = os.listdir(workdir)
  if all(re.fullmatch(r"train(\.process\d+)?\.log", name) for name in left):
    shutil.rmtree(workdir, ignore_errors=True)
