"""SIGTERM (a scheduler's pre-emption) and SIGINT (Ctrl-C) as requests to save and stop; so is
the console's reader leaving (reader_gone: SIGPIPE's).

While a `StopSignals` is entered, either signal only sets `received`; the training loop saves
at the step it is on and raises `Interrupted`, which the commands turn into one line and exit
status 128 + the signal's number (the status a shell gives a process the signal ended), so a
scheduler that restarts failed jobs restarts this one, and the rerun resumes from the save.
With several processes, JAX's preemption sync point makes all of them stop at the same step.
"""
import signal
import threading
from typing import Any

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
  """A run stopped by a signal after saving `step`, before its last step. Not an Exception,
  as KeyboardInterrupt is not: a handler of failures (a sweep's, per task) lets it through."""

  def __init__(self, signum: int, step: int | None = None, workdir: str | None = None,
               resumable: bool = True):
    self.signum, self.step, self.workdir = signum, step, workdir
    message = f"stopped by {signal.Signals(signum).name}"
    if step is not None:
      message += f" after saving step {step} to {workdir}; rerun the same command to resume"
    elif resumable:  # Between a sweep's jobs: the rerun skips what is done.
      message += "; rerun the same command to go on where it stopped"
    super().__init__(message)

  @property
  def exit_status(self) -> int:
    return 128 + self.signum


class StopSignals:
  """Catches SIGTERM and SIGINT while entered (main thread, one process), then puts back the
  handlers it found; `received` is the first signal caught, or None."""

  def __init__(self):
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    import jax  # Here, not on import: the commands catch Interrupted before they import JAX.
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      for signum in SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.received is None:
      # The log's: the command tells the console once, in one line, when it has stopped.
      logging.info("%s received: saving a checkpoint and stopping.", signal.Signals(signum).name)
      self.received = signum

  def reached(self, step: int) -> bool:
    """Whether to save and stop at `step` (the same answer on every process)."""
    import jax
    from jax.experimental import multihost_utils
    if jax.process_count() > 1:
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = self.received or signal.SIGTERM
        return True
      return False
    return self.received is not None


def reader_gone() -> None:
  """The console's reader has left (`vit-train ... 2>&1 | head`): the run in this process
  saves and stops as on a signal, SIGPIPE's (status 141, the shell's for a process SIGPIPE
  ended). Python ignores SIGPIPE itself, so that a closed socket elsewhere stops nothing."""
  handler = signal.getsignal(signal.SIGTERM)  # The StopSignals catching signals, if one is.
  if isinstance(getattr(handler, "__self__", None), StopSignals):
    handler(signal.SIGPIPE, None)
