"""What the command lines share: their exit status, how a user's error is reported, the
checks before any work, and how a console script ends (where logs go: logs.py).

Exit status: 0 done; 128 + N stopped by signal N (SIGTERM 143, Ctrl-C 130; 141 where the
output's reader left, as `| head` does) after saving what a rerun resumes from
(vit_jax/train/stop_signals.py); 1 a failure while running (an exception with its traceback, or work a
command reports it could not do, e.g. a job of a sweep failed: jobs.py); 2 a usage or input
error: a bad flag (argparse and absl print the usage), or an input the library refuses (a path
that holds no checkpoint, a dataset that cannot be read, a checkpoint that contradicts a
flag), reported as one line `error: MESSAGE` on stderr in the library's own words.
"""
import argparse
import atexit
import contextlib
import functools
import gc
import os
import signal
import sys
import threading
from typing import Callable, Mapping, NoReturn, Sequence, TextIO

from vit_jax import cpu_backend
from vit_jax.train import stop_signals

# Read by TensorFlow and XLA once, when they load: set here, on import, because the commands
# import this module before the library, which imports TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
cpu_backend.skip_absent_tpu()  # Before JAX starts: no TPU probed where there is none.
# Python collects its youngest objects every 700 allocations by default: a command's imports
# (TensorFlow, JAX) and its tracing make millions, and these collections took ~6% of a short
# run's CPU (tests/tiny_config.py's 12 steps: 11.4 -> 10.8 s; 10,000 gains all there is).
gc.set_threshold(10_000)

FAILED, USAGE = 1, 2

# What the library raises for what a user gave it: ValueError (ConfigError, CheckpointError,
# DescriptionMismatch and ZooError among them) and OSError (a missing or unreadable file).
INPUT_ERRORS = (ValueError, OSError)

Main = Callable[[Sequence[str] | None], int]


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """A command's parser: its docstring's first paragraph is the description, the rest the
  epilog after the options, both as written."""
  summary, _, rest = doc.strip().partition("\n\n")
  return argparse.ArgumentParser(prog=prog, description=summary, epilog=rest or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def input_error(message: object) -> int:
  """Reports an input error as one line on stderr; returns its status, 2."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  return USAGE


def fail(message: object) -> NoReturn:
  """Ends the command on an input error."""
  sys.exit(input_error(message))


def stopped(e: BaseException) -> int:
  """Reports a run stopped by a signal (stop_signals.Interrupted, or Ctrl-C outside the steps)
  as one line on stderr; returns its status, 128 + the signal's number."""
  if not isinstance(e, stop_signals.Interrupted):
    e = stop_signals.Interrupted(signal.SIGINT, resumable=False)
  with contextlib.suppress(BrokenPipeError):  # Stopped because stderr's reader left.
    print(e, file=sys.stderr, flush=True)
  return e.exit_status


def discard(stream: TextIO) -> None:
  """Points `stream`'s file at /dev/null: what is written to it from now on goes nowhere."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, stream.fileno())
  os.close(devnull)


def reader_gone() -> int:
  """Ends quietly where stdout's reader has left, as a command killed by SIGPIPE would (Python
  ignores the signal): nothing more on stderr, stdout discarded so that the exit's flush finds
  no pipe, status 128 + SIGPIPE."""
  discard(sys.stdout)
  return 128 + signal.SIGPIPE


def command(body: Callable[[list[str]], int]) -> Main:
  """A command's `main`: `main(argv)` runs `body` in this process and returns its status (an
  input error one line on stderr and status 2, a stop by a signal one line and 128 + its
  number); `main()`, the console script, runs it on sys.argv's arguments and ends the process
  with that status (exit_with)."""

  @functools.wraps(body)
  def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
      exit_with(lambda: main(sys.argv[1:]))
    try:
      return body(list(argv))
    except BrokenPipeError:  # Whoever read stdout stopped (`| head`): not the input's fault.
      return reader_gone()
    except INPUT_ERRORS as e:
      return input_error(e)
    except (stop_signals.Interrupted, KeyboardInterrupt) as e:
      return stopped(e)

  return main


def check_checkpoints(paths: Sequence[str]) -> None:
  """Refuses a local checkpoint path that does not exist before the work starts; Hub and
  AugReg specs and URLs (gs://) are checked where they are read (checkpoint/specs.py)."""
  from vit_jax.checkpoint import specs  # Here, not on import: the package takes seconds.
  for path in paths:
    if path and specs.is_local(path) and not os.path.exists(specs.without_ema(path)):
      raise FileNotFoundError(f"No checkpoint at {path}.")


def check_not_exported(paths: Sequence[str]) -> None:
  """Refuses a model that vit-export wrote in a serving format where a command reads a
  checkpoint's parameters, naming the checkpoint it was exported from where its description
  records it (the loader would call it no .npz or no step directory). Imports the serving
  formats, and so JAX: call it where JAX may start."""
  from vit_jax.checkpoint import specs
  from vit_jax.serving import formats
  for path in paths:
    fmt = path and specs.is_local(path) and formats.format_of(specs.without_ema(path))
    if fmt:
      try:
        origin = formats.describe(path).exported_from
      except Exception:  # noqa: BLE001  A damaged file, or its packages not installed.
        origin = None
      raise ValueError(f"{path} is a model that vit-export wrote ({fmt}): a graph for "
                       "serving, not the parameters this command reads; give the checkpoint "
                       f"it was exported from{f' ({origin})' if origin else ''}")


def check_output_dir(flag: str, path: str) -> None:
  """Refuses, with a line naming the flag, a local output folder that cannot be made or
  written in: a path under a regular file, or where this user may not write. Creates
  nothing (a refused run leaves nothing behind); URLs are left to their writers."""
  if "://" in path:
    return
  existing = next(a for a in _ancestors(path) if os.path.exists(a))
  if not os.path.isdir(existing):
    raise OSError(f"{flag} {path}: cannot create this folder: {existing} is a file")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise OSError(f"{flag} {path}: this user may not write in {existing}")


def check_owned(flag: str, path: str, owned: Callable[[str], bool], what: str) -> None:
  """Refuses an existing local folder `path` that holds an entry `owned` does not recognise as
  this command's own (`what` says what it writes there): a run must not write into a user's
  folder of other files, nor leave its output mixed with them."""
  if "://" in path or not os.path.isdir(path):
    return
  foreign = sorted(name for name in os.listdir(path) if not owned(name))
  if foreign:
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    raise OSError(f"{flag} {path}: the folder holds files this command did not write ({shown}); "
                  f"it writes {what}: give a new or empty folder")


def check_apart(flag: str, out: str | None, inputs: Mapping[str, Sequence[str]],
                file_out: bool = False) -> None:
  """Refuses, in one line naming both flags, an output path (`flag`'s) that is one of the
  paths the command reads (`inputs`: each flag's paths, globs expanded here), lies inside one
  (writing into the data or a checkpoint's folder) or holds one (a folder the command writes
  and prunes): no command writes over what it reads. A new file (`file_out`: the output is
  one file) may go into a folder of inputs; an existing one there may be one of them. Hub and
  AugReg specs, and local paths that do not exist (a TFDS name), are no paths it reads; URLs
  are compared as written."""
  if not out:
    return
  where = _place(out)
  for source, paths in inputs.items():
    for path in (p for spec in paths if spec for p in _expanded(spec)):
      read = _place(path)
      if where is None or read is None or ("://" not in read and not os.path.exists(read)):
        continue  # A missing input is refused where it is read; a TFDS name is no path.
      if where == read:
        how = "is"
      elif _under(where, read) and not (file_out and not os.path.exists(where)):
        how = "lies inside"
      elif _under(read, where):
        how = "holds"
      else:
        continue
      raise OSError(f"{flag} {out} {how} {source} {path}, which this command reads: writing "
                    f"there would overwrite or change its input; give {flag} a path apart "
                    "from every input")


def _place(path: str) -> str | None:
  """A local path, through symbolic links, or a URL as written; None for a Hub or AugReg spec."""
  from vit_jax.checkpoint import specs  # Here, not on import: the package takes seconds.
  bare = specs.without_ema(path)
  if "://" in bare:
    return bare.rstrip("/")
  if not specs.is_local(path):
    return None
  return os.path.realpath(os.path.expanduser(bare))


def _under(inner: str, outer: str) -> bool:
  sep = "/" if "://" in outer else os.sep
  return inner.startswith(outer.rstrip(sep) + sep)


def _expanded(spec: str) -> list[str]:
  """A glob's matches (the spec itself where it matches nothing), or the path."""
  import glob
  if glob.has_magic(spec) and "://" not in spec:
    return sorted(glob.glob(os.path.expanduser(spec), recursive=True)) or [spec]
  return [spec]


def check_counts(args: argparse.Namespace, minimums: Mapping[str, int]) -> None:
  """Refuses, in one line naming the flag, a count flag (an int or a list of ints; None: not
  given) below its minimum: before any work, not as a late failure or a meaningless row."""
  for name, minimum in minimums.items():
    value = getattr(args, name)
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(v is not None and v < minimum for v in values):
      each = "each value " if len(values) > 1 else ""
      raise ValueError(f"--{name}={','.join(map(str, values))}: {each}must be a whole number "
                       f"of {minimum} or more")


def _ancestors(path: str) -> list[str]:
  """path and the folders above it, nearest first."""
  out, path = [], os.path.abspath(path)
  while path not in out:
    out.append(path)
    path = os.path.dirname(path)
  return out


def add_base_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--base", default=None, metavar="PATH",
                 help="a LoRA adapters file's base checkpoint, where it is no longer at the "
                      "path the file records (it must hold the same arrays)")


def add_verbose_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--verbose", action="store_true",
                 help="show the library's INFO logs (absl) on stderr too")


def exit_with(main: Callable[[], int | None]) -> NoReturn:
  """Ends the process with main's status (or the status main exits with), as exit_now does:
  what a console script's `main()` does."""
  try:
    status = main()
  except SystemExit as e:
    status = e.code
  exit_now(status)


def exit_now(status: object) -> NoReturn:
  """Ends the process as sys.exit(status) would, less the interpreter's finalisation: freeing
  TensorFlow's and JAX's modules and objects one by one takes 1-1.5 s of a command's end on
  two cores. What the interpreter's exit does before that still happens, in its order and with
  its own (private) calls: thread pools are shut down and other threads joined, then the atexit
  handlers run (logging's flush, jax.distributed's shutdown, orbax's)."""
  if status is None:
    status = 0
  elif not isinstance(status, int):
    print(status, file=sys.stderr)
    status = FAILED
  threading._shutdown()  # Joining the threads alone would wait forever on idle pool workers.
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):  # A closed pipe (`| head`) or stream.
      stream.flush()
  os._exit(status)
