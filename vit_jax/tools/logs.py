"""Where a command's output and the library's logs go: the console holds the command's own
lines, warnings and errors; the library's INFO logs (absl's, clu's metric lines, orbax's and
TFDS's) go to a log file or nowhere, unless asked for (`route_logs`), and so do TensorFlow's C++
start-up lines (`native_logs`, TF_CPP_MIN_LOG_LEVEL=1, which cli sets on import).
"""
import contextlib
import logging
import logging.handlers
import os
import re
import sys
import tempfile
from typing import Iterator, TextIO

import tqdm
from absl import logging as absl_logging


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
  `warning: MESSAGE` unless a formatter is set. Left out: the watchdog's ERROR record (it
  prints that message on stderr itself, then ends the process), and unless a formatter is set
  orbax's errors, each with its traceback, which orbax raises to the command too: a save that
  fails (a full disk) logs four (~80 lines), then the command says it in one."""

  def filter(self, record: logging.LogRecord) -> bool:
    own = record.levelno >= logging.ERROR and record.pathname.endswith("train/watchdog.py")
    raised = not self.formatter and "/orbax/" in record.pathname
    return not (own or raised) and bool(super().filter(record))

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


class _LogFile(logging.FileHandler):
  """The log file. A record it cannot write (a full disk) is one warning on stderr, the first
  time, instead of logging's traceback and the whole record every time; a record that cannot
  be formatted (a bug) is logging's report as before."""

  failed = False

  def handleError(self, record: logging.LogRecord) -> None:
    error = sys.exc_info()[1]
    if not isinstance(error, OSError):
      super().handleError(record)
    elif not self.failed:
      self.failed = True
      with contextlib.suppress(Exception):
        print(f"warning: cannot write {self.baseFilename} ({error}): the library's logs are "
              "not kept from here", file=sys.stderr, flush=True)


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
    sink = _add(_LogFile(log_file, mode="a", encoding="utf-8"), logging.NOTSET, absl_format,
                logging.WARNING)
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


@contextlib.contextmanager
def _keras_deferred() -> Iterator[None]:
  """TensorFlow imports Keras as it loads, where Keras is installed (it registers Keras
  optimizers for Keras models' SavedModels, which no command reads or writes): ~1 CPU-s of a
  command's start, with matplotlib, rich and IPython, which Keras imports. Inside the block
  Keras cannot be imported, which TensorFlow allows (it passes over the ImportError); after
  it Keras imports as usual wherever something asks for it."""
  if "keras" in sys.modules:
    yield
    return
  sys.modules["keras"] = None  # An import of it raises ModuleNotFoundError.
  try:
    yield
  finally:
    if "keras" in sys.modules and sys.modules["keras"] is None:
      del sys.modules["keras"]


_HPARAMS_API = "tensorboard.plugins.hparams.api"


def _hparams_api_without_keras() -> None:
  """clu's TensorBoard writer imports TensorBoard's hparams API for `write_hparams`, and that
  module defines a Keras callback as it loads: Keras, with matplotlib and IPython, ~0.8 CPU-s
  of each `vit-train` and `vit-transfer` start, for a class no command uses. Registered under
  the API's name instead: a module of the functions and classes it takes from summary_v2, its
  Keras callback imported when asked for; none where the API is loaded already."""
  if _HPARAMS_API in sys.modules:
    return
  import types
  names = ("Discrete", "Domain", "HParam", "IntInterval", "Metric", "RealInterval", "hparams",
           "hparams_pb", "hparams_config", "hparams_config_pb")  # The API's, KerasCallback aside.
  try:
    from tensorboard.plugins import hparams
    from tensorboard.plugins.hparams import summary_v2
    fields = {k: getattr(summary_v2, k) for k in names}
  except (ImportError, AttributeError):  # Another TensorBoard's layout: its own API, Keras too.
    return

  def keras_callback(name: str):
    if name != "KerasCallback":
      raise AttributeError(f"module {_HPARAMS_API!r} has no attribute {name!r}")
    from tensorboard.plugins.hparams import _keras
    return _keras.Callback

  api = types.ModuleType(_HPARAMS_API, "TensorBoard's hparams API (summary_v2's functions).")
  api.__dict__.update(fields, __getattr__=keras_callback)
  sys.modules[_HPARAMS_API] = hparams.api = api


def start_tensorflow(datasets: bool = True) -> None:
  """Imports TensorFlow, and TFDS (the data pipeline's) unless not `datasets`, with
  TensorFlow's C++ start-up lines caught (native_logs), TFDS's progress bars as route_logs
  set them, and no Keras (`_keras_deferred`, `_hparams_api_without_keras`): a command that
  reads data or images, or serves a model, calls this once its arguments are checked (the
  library imports TensorFlow when first used)."""
  with native_logs(), _keras_deferred():
    import tensorflow  # noqa: F401
    if datasets:
      import tensorflow_datasets as tfds
  _hparams_api_without_keras()
  if datasets:
    tfds.display_progress_bar(_shown["verbose"])
