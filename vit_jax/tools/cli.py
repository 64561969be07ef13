"""What the command lines share: their exit status, how a user's error is reported, and where
the library's logs go.

Exit status: 0 done; 128 + N stopped by signal N (SIGTERM 143, Ctrl-C 130) after saving what
a rerun resumes from (vit_jax/train/stop_signals.py); 1 a failure while running (an exception with its traceback, or work a
command reports it could not do, e.g. a job of a sweep failed: jobs.py); 2 a usage or input
error: a bad flag (argparse and absl print the usage), or an input the library refuses (a path
that holds no checkpoint, a dataset that cannot be read, a checkpoint that contradicts a
flag), reported as one line `error: MESSAGE` on stderr in the library's own words.

Logs: a command's console holds its own lines; the library's INFO logs (absl's, clu's metric
lines, orbax's and TFDS's) go to a log file or nowhere, unless asked for (`route_logs`), and
so do TensorFlow's C++ start-up lines (`native_logs`, TF_CPP_MIN_LOG_LEVEL=1).
"""
import argparse
import atexit
import contextlib
import functools
import logging
import logging.handlers
import os
import re
import signal
import sys
import tempfile
import threading
from typing import Callable, Iterator, Mapping, NoReturn, Sequence, TextIO

import tqdm
from absl import logging as absl_logging

from vit_jax import cpu_backend
from vit_jax.train import stop_signals

# Read by TensorFlow and XLA once, when they load: set here, on import, because the commands
# import this module before the library, which imports TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
cpu_backend.skip_absent_tpu()  # Before JAX starts: no TPU probed where there is none.

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
  print(e, file=sys.stderr, flush=True)
  return e.exit_status


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


# Libraries whose INFO lines are per-operation noise (kept out of any log) and whose warnings
# are no news to a user (the log file only): orbax's checkpoint steps, TFDS's data preparation.
_CHATTY = ("orbax", "tensorflow_datasets")
_MARK = "_vit_jax_route"  # On the handlers that route_logs adds, to replace them on a new call.
_shown = {"verbose": False}  # As route_logs was last told: native_logs then catches nothing.


class _ChattyBelow(logging.Filter):
  """Drops the chatty libraries' records below `level`."""

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= self.level or not any(
        f"/{lib}/" in record.pathname for lib in _CHATTY)


class _Console(logging.Handler):
  """Records on stderr (looked up at each record: tests swap it), around a progress bar;
  `warning: MESSAGE` unless a formatter is set. The watchdog's ERROR record is left out: it
  prints that message on stderr itself, then ends the process."""

  def filter(self, record: logging.LogRecord) -> bool:
    own = record.levelno >= logging.ERROR and record.pathname.endswith("train/watchdog.py")
    return not own and bool(super().filter(record))

  def format(self, record: logging.LogRecord) -> str:
    if self.formatter:
      return self.formatter.format(record)
    level = "warning" if record.levelno < logging.ERROR else "error"
    return f"{level}: {logging.Formatter().format(record)}"

  def emit(self, record: logging.LogRecord) -> None:
    try:
      text = self.format(record)
      with tqdm.tqdm.external_write_mode(file=sys.stderr):
        print(text, file=sys.stderr, flush=True)
    except Exception:  # logging's convention: a handler never raises.
      self.handleError(record)


def _take_over_root() -> list[logging.handlers.MemoryHandler]:
  """Removes from the root logger absl's handler, logging.basicConfig's and route_logs' own;
  returns the one holding records, if any."""
  root, held = logging.getLogger(), []
  for h in list(root.handlers):
    if getattr(h, _MARK, False) or h is absl_logging.get_absl_handler() or (
        type(h) is logging.StreamHandler):
      root.removeHandler(h)
      if isinstance(h, logging.handlers.MemoryHandler):
        held.append(h)
      else:
        h.close()
  return held


def _add(handler: logging.Handler, level: int, formatter: logging.Formatter | None,
         chatty_level: int) -> logging.Handler:
  setattr(handler, _MARK, True)
  handler.setLevel(level)
  handler.setFormatter(formatter)
  handler.addFilter(_ChattyBelow(chatty_level))
  logging.getLogger().addHandler(handler)
  return handler


def _one_hub_handler() -> None:
  """huggingface_hub prints its warnings (a download's retries) with a stream handler of its
  own, besides passing them on to the root logger's: the root's alone shows them once."""
  import huggingface_hub.utils.logging  # noqa: F401  (which adds that handler when imported)
  hub_logger = logging.getLogger("huggingface_hub")
  for h in list(hub_logger.handlers):
    if type(h) is logging.StreamHandler:
      hub_logger.removeHandler(h)


def route_logs(log_file: str | None = None, verbose: bool = False,
               hold: bool = False) -> TextIO | None:
  """Sends the library's logs (Python's and absl's) to `log_file` (appended to), keeping the
  console for the command's own lines, warnings and errors (`warning: MESSAGE` on stderr);
  `verbose` shows every record on stderr too, in absl's format. Without a file the INFO
  records go nowhere, unless `hold`: then they wait in memory for the next call, which names
  the file (a process that learns its index, which names its file, only once it joined the
  others), or the next call that holds them too. TFDS's progress bars are off unless
  `verbose`. Call it again to change the file. Returns the log file's stream, for other
  output that belongs there."""
  held = _take_over_root()
  _shown["verbose"] = verbose
  absl_format = absl_logging.PythonFormatter()
  _add(_Console(), logging.NOTSET if verbose else logging.WARNING,
       absl_format if verbose else None, logging.WARNING if verbose else logging.ERROR)
  root = logging.getLogger()
  if verbose or log_file or hold:
    root.setLevel(min(root.level, logging.INFO))
  sink = None
  if log_file:
    os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
    sink = _add(logging.FileHandler(log_file, mode="a", encoding="utf-8"), logging.NOTSET,
                absl_format, logging.WARNING)
  elif hold:
    root.addHandler(held.pop() if held else _add(
        logging.handlers.MemoryHandler(1 << 20, flushLevel=logging.CRITICAL + 1),
        logging.NOTSET, None, logging.WARNING))
  for h in held:
    h.setTarget(sink)
    h.close()  # Hands its records to the file, if there is one now.
  _one_hub_handler()
  if "tensorflow_datasets" in sys.modules:  # Else start_tensorflow sets it.
    sys.modules["tensorflow_datasets"].display_progress_bar(verbose)
  return sink.stream if sink else None


# libtpu's start on a machine with no TPU (compiling for a TPU topology, which needs none):
# it finds no accelerator type and no worker hostnames, and says so with a trace.
_LIBTPU_WITHOUT_TPU = (
    r"Failed to find host bounds for accelerator type|WARNING: Logging before InitGoogle|"
    r"E\d{4} .*TPU_WORKER_HOSTNAMES|=== Source Location Trace|learning/.*libtpu_init_utils")

# Native INFO and WARNING lines in absl's format (TensorFlow's start-up notices, its
# converters' "Ignored output_format."), absl's notice that such lines go to stderr, and
# TFLite's notice of its CPU delegate.
_NATIVE_NOTES = re.compile(
    r"[IW]\d{4} |WARNING: All log messages before absl::InitializeLog|INFO: Created TensorFlow "
    r"Lite|" + _LIBTPU_WITHOUT_TPU)


@contextlib.contextmanager
def native_logs(show_errors: bool = True) -> Iterator[None]:
  """Catches what is written on file descriptor 2 while the block runs: wrap the first import
  of the library, for TensorFlow's C++ start-up lines (oneDNN's notice among them, which
  TF_CPP_MIN_LOG_LEVEL does not reach). Its INFO and WARNING lines become one INFO log record
  (in the log file, or nowhere: see route_logs); the rest (errors, Python's own output) is
  shown on stderr when the block ends, unless not `show_errors` (a native library's errors that
  the command reports in its own words): then it joins the record. With
  route_logs(verbose=True) it catches nothing."""
  try:
    sys.stderr.flush()
    saved = None if _shown["verbose"] else os.dup(2)
  except (OSError, ValueError):  # No file descriptor 2 to catch.
    saved = None
  if saved is None:
    yield
    return
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      lines = caught.read().decode(errors="replace").splitlines()
      info = [line for line in lines if _NATIVE_NOTES.match(line) or not show_errors]
      if info:
        logging.info("Native lines:\n%s", "\n".join(info))
      if len(info) < len(lines):
        print("\n".join(line for line in lines if line not in info), file=sys.stderr,
              flush=True)


def start_tensorflow(datasets: bool = True) -> None:
  """Imports TensorFlow, and TFDS (the data pipeline's) unless not `datasets`, with
  TensorFlow's C++ start-up lines caught (native_logs), TFDS's progress bars as route_logs
  set them: a command that reads data or images, or serves a model, calls this once its
  arguments are checked (the library imports TensorFlow when first used)."""
  with native_logs():
    import tensorflow  # noqa: F401
    if datasets:
      import tensorflow_datasets as tfds
  if datasets:
    tfds.display_progress_bar(_shown["verbose"])


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
