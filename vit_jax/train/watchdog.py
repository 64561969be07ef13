"""Ends a training run whose steps have stopped ending, instead of letting it hang for ever.

A thread watches the time since the last step (or evaluation batch, or save) ended. Past the
bound, or when SIGTERM / Ctrl-C arrived and the main thread has reached no step since (it is
stuck inside XLA, where Python cannot run its signal handlers), it prints why, lets a save in
flight finish, and exits the process with status 1. Finished checkpoints are whole either way:
orbax writes a step into a temporary folder and renames it when done.
"""
import collections
import logging
import os
import select
import signal
import statistics
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

# The automatic bound: this many median step times, and never less than the floor, which
# leaves room for evaluation's compilation, a slow save and a slow first step.
FLOOR_S = 300.0
STEP_TIMES = 50
# After SIGTERM / SIGINT, how long the main thread has to reach a step before it counts as
# stuck: at least this, and at least two step times.
SIGNAL_GRACE_S = 20.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StallWatchdog:
  """`with StallWatchdog(timeout_s, on_stall): ... beat(step) ...`.

  timeout_s: the bound in seconds (None: max(FLOOR_S, STEP_TIMES x the median step time)).
  on_stall(step, reason) -> message: called on the watchdog's thread once the run counts as
  stalled after `step`; it may wait a little (for a save); its message is printed before the
  process exits.
  """

  def __init__(self, timeout_s: float | None, on_stall: Callable[[int, str], str]):
    self.timeout_s, self.on_stall = timeout_s, on_stall
    self.step = 0
    self._last_beat = self._last_step = time.monotonic()
    self._step_times = collections.deque(maxlen=500)
    self._signal_at, self._signal_name = None, ""
    self._done = threading.Event()

  def bound(self) -> float:
    if self.timeout_s is not None:
      return self.timeout_s
    median = statistics.median(self._step_times) if self._step_times else 0.0
    return max(FLOOR_S, STEP_TIMES * median)

  def beat(self, step: int | None = None) -> None:
    """The main thread made progress: it has reached step `step` (the steps before it are
    done, as far as the loop can tell), or other work went on (None: a batch, a save)."""
    now = time.monotonic()
    if step is not None:
      if step == self.step + 1:
        self._step_times.append(now - self._last_step)
      self.step, self._last_step = step, now
    self._last_beat = now
    self._signal_at = None  # The main thread is alive: it handles signals itself.

  def beating(self, items: Iterable[T]) -> Iterator[T]:
    """`items`, with a beat for each."""
    for item in items:
      self.beat()
      yield item

  def __enter__(self) -> "StallWatchdog":
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    try:
      self._previous_fd = signal.set_wakeup_fd(self._write)
    except ValueError:  # Not the main thread: stalls are still caught, signals not.
      self._previous_fd = None
    self.beat()
    self._thread = threading.Thread(target=self._watch, name="StallWatchdog", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    try:  # Wakes the thread from its select at once: a run ended up to 1 s later without it.
      os.write(self._write, b"\0")  # 0 is no signal's number.
    except BlockingIOError:  # The pipe is full: the thread is about to wake anyway.
      pass
    self._thread.join()
    if self._previous_fd is not None:
      signal.set_wakeup_fd(self._previous_fd)
    os.close(self._read)
    os.close(self._write)

  def _grace(self) -> float:
    median = statistics.median(self._step_times) if self._step_times else 0.0
    return max(SIGNAL_GRACE_S, 2 * median)

  def _watch(self) -> None:
    while not self._done.is_set():
      readable, _, _ = select.select([self._read], [], [], 1.0)
      now, stuck = time.monotonic(), None
      if readable:
        signums = [s for s in os.read(self._read, 64) if s in _SIGNALS]
        if signums and self._signal_at is not None:
          stuck = f"{signal.Signals(signums[-1]).name} received twice"
        elif signums:
          self._signal_at, self._signal_name = now, signal.Signals(signums[-1]).name
      if self._signal_at is not None and now - self._signal_at > self._grace():
        stuck = f"{self._signal_name} received {now - self._signal_at:.0f} s ago"
      if stuck:
        self._stop(f"{stuck} while the run was stuck: no step has ended since")
      elif now - self._last_beat > self.bound():
        self._stop(f"no step has ended for {now - self._last_beat:.0f} s, over the bound of "
                   f"{self.bound():.0f} s (config.stall_timeout_s)")

  def _stop(self, reason: str) -> None:
    message = self.on_stall(self.step, reason)
    logging.error("%s", message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)  # The main thread is stuck in native code: nothing else would end it.
