"""WORKDIR/goodput.json: the record of a run's attempts, and of the time spent waiting for
the capacity they ran on, from which `vit-inspect WORKDIR` tells productive step time from
wall time.

  {"attempts": [{"started": T, "start_step": 0, "total_steps": 12, "first_step_at": T,
                 "last_step": 7, "last_step_at": T, "saved_step": 4, "ended": T | null,
                 "outcome": "finished" | "stopped" | "failed: ValueError" | null}, ...],
   "capacity": [{"requested": T, "active": T, "why": "preempted at about step 7"}, ...]}

T: seconds since the epoch. A training run's process 0 appends its attempt when it starts and
updates it as it goes (`AttemptLog`); an attempt whose `outcome` stayed null ended without a
word (its machine taken away, a kill -9). `saved_step` is the last step whose checkpoint was
written in full (a save cut short by a kill is not). The launcher (launch/recover.py) appends
`capacity` entries, between attempts only, so the two never write at once.

Every reader and writer goes through `load`, which accepts the record's one version so far
(above) and answers anything else (not JSON, another shape, an entry missing a field) with one
warning line and a fresh record: readers ignore the file, a writer moves it aside first
(goodput.json.unreadable), so that no run is blocked and nothing is lost.
"""
import dataclasses
import json
import logging
import time
from typing import Any, Callable

from etils import epath

NAME = "goodput.json"
# Seconds between two progress writes (a bucket write each): the start, saves and the end are
# always written.
MIN_INTERVAL_S = 30.0


def path(workdir: str | epath.Path) -> epath.Path:
  return epath.Path(workdir) / NAME


_NUMBER, _STEP, _TEXT = (int, float), int, str
# Each entry's fields and the types their values may have (None where listed).
ATTEMPT = {"started": _NUMBER, "start_step": _STEP, "total_steps": _STEP,
           "first_step_at": (*_NUMBER, type(None)), "last_step": _STEP,
           "last_step_at": _NUMBER, "saved_step": _STEP, "ended": (*_NUMBER, type(None)),
           "outcome": (_TEXT, type(None))}
CAPACITY = {"requested": _NUMBER, "active": _NUMBER, "why": _TEXT}


def _entry_problem(entry: Any, fields: dict[str, tuple[type, ...]]) -> str | None:
  if not isinstance(entry, dict):
    return f"an entry is {type(entry).__name__}, not an object"
  for name, types in fields.items():
    value = entry.get(name)
    if name not in entry or isinstance(value, bool) or not isinstance(value, types):
      return f"an entry's {name!r} is {'missing' if name not in entry else repr(value)}"
  return None


def check(found: Any) -> str | None:
  """What keeps `found` (parsed JSON) from being a record this program wrote; None if it is."""
  if not isinstance(found, dict):
    return f"a JSON {type(found).__name__}, not an object"
  for key, fields in (("attempts", ATTEMPT), ("capacity", CAPACITY)):
    entries = found.get(key, [])
    if not isinstance(entries, list):
      return f"{key!r} is not a list"
    problem = next(filter(None, (_entry_problem(e, fields) for e in entries)), None)
    if problem:
      return f"{key}: {problem}"
  return None


def _fresh() -> dict[str, list[dict[str, Any]]]:
  return {"attempts": [], "capacity": []}


def load(workdir: str | epath.Path) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
  """(the record, None), or (a fresh record, why the file is none) where it is not one this
  program wrote; a fresh record where there is no file. OSError where it could not be read (a
  bucket's error)."""
  target = path(workdir)
  if not target.exists():
    return _fresh(), None
  text = target.read_text()
  try:
    found = json.loads(text)
  except ValueError as e:
    return _fresh(), f"not JSON ({e})"
  problem = check(found)
  if problem:
    return _fresh(), problem
  return {"attempts": list(found.get("attempts", [])),
          "capacity": list(found.get("capacity", []))}, None


def _stored(workdir: str | epath.Path) -> dict[str, list[dict[str, Any]]] | None:
  """The record for a writer; None where it could not be read (a bucket's error): what is
  written then would replace the attempts before. A file that is no record is moved aside
  (one warning), and the record begins anew."""
  try:
    record, problem = load(workdir)
    if problem:
      aside = path(workdir).parent / f"{NAME}.unreadable"
      path(workdir).replace(aside)
      logging.warning("%s is not a record this program wrote (%s): moved to %s; a new record "
                      "begins", path(workdir), problem, aside)
  except OSError:
    return None
  return record


def read(workdir: str | epath.Path) -> dict[str, list[dict[str, Any]]]:
  """The record, for a reader; empty lists where there is none, or where it could not be read
  or is no record (then one warning line says so)."""
  try:
    record, problem = load(workdir)
  except OSError as e:
    logging.warning("%s could not be read (%s): its attempts are left out", path(workdir), e)
    return _fresh()
  if problem:
    logging.warning("%s is not a record this program wrote (%s): its attempts are left out",
                    path(workdir), problem)
  return record


def _write(workdir: str | epath.Path, record: dict[str, Any]) -> None:
  target = path(workdir)
  partial = target.parent / f"{NAME}.partial"
  partial.write_text(json.dumps(record, indent=1))
  partial.replace(target)  # A reader never sees half a file.


def record_capacity(workdir: str | epath.Path, requested: float, active: float,
                    why: str) -> bool:
  """Appends a wait for capacity (between attempts: no run writes the file meanwhile); False
  where the record could not be read, and so was left as it was."""
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  record = _stored(workdir)
  if record is None:
    return False
  record["capacity"].append({"requested": requested, "active": active, "why": why})
  _write(workdir, record)
  return True


class AttemptLog:
  """This run's attempt in the record: `step` after train steps, `end` once. Written by one
  process (`enabled`); errors writing it are the run's (a workdir it cannot write).
  `committed` tells the last step whose checkpoint is written in full (orbax saves in the
  background: a save begun is not a save made), read at each write for `saved_step`."""

  def __init__(self, workdir: str, start_step: int, total_steps: int, enabled: bool = True,
               min_interval_s: float = MIN_INTERVAL_S,
               committed: Callable[[], int | None] | None = None):
    self.workdir, self.enabled, self.min_interval_s = workdir, enabled, min_interval_s
    self.committed = committed
    now = time.time()
    self.entry: dict[str, Any] = {
        "started": now, "start_step": start_step, "total_steps": total_steps,
        "first_step_at": None, "last_step": start_step, "last_step_at": now,
        "saved_step": start_step, "ended": None, "outcome": None}
    self.index: int | None = None
    self.written_at = 0.0
    self._save()

  def _save(self) -> None:
    if not self.enabled:
      return
    if self.committed is not None:
      self.entry["saved_step"] = max(self.committed() or 0, self.entry["start_step"])
    record = _stored(self.workdir)
    if record is None:  # Not written over: a later write tries again.
      return
    if self.index is None:
      self.index = len(record["attempts"])
      record["attempts"].append(self.entry)
    else:
      record["attempts"][self.index:self.index + 1] = [self.entry]
    _write(self.workdir, record)
    self.written_at = time.time()

  def step(self, step: int, saved: bool = False) -> None:
    """After train step `step`; `saved` when its checkpoint is being written (written at once;
    without `committed`, taken as saved)."""
    now = time.time()
    first = self.entry["first_step_at"] is None
    self.entry.update(last_step=step, last_step_at=now)
    if first:
      self.entry["first_step_at"] = now
    if saved and self.committed is None:
      self.entry["saved_step"] = step
    if first or saved or now - self.written_at >= self.min_interval_s:
      self._save()

  def end(self, outcome: str) -> None:
    self.entry.update(ended=time.time(), outcome=outcome)
    self._save()

  def __enter__(self) -> "AttemptLog":
    return self

  def __exit__(self, kind, error, traceback) -> None:
    """The outcome: finished; stopped (a signal's save-and-stop, Ctrl-C: not an Exception);
    failed, naming the exception."""
    if kind is None:
      self.end("finished")
    else:
      self.end(f"failed: {kind.__name__}" if issubclass(kind, Exception) else "stopped")


@dataclasses.dataclass(frozen=True)
class Summary:
  """Where a run's wall time went, in seconds."""
  attempts: int
  wall_s: float
  training_s: float  # Between the first and the last step of each attempt.
  waiting_s: float  # For capacity.
  repeated_s: float  # Training steps done again after a resume.
  repeated_steps: int
  last_step: int
  total_steps: int
  finished: bool
  unasked_s: float  # Between attempts when no run was asked for (`_unasked`): not in wall_s.

  @property
  def productive_s(self) -> float:
    return self.training_s - self.repeated_s

  @property
  def other_s(self) -> float:
    return max(self.wall_s - self.training_s - self.waiting_s, 0.0)


def _repeated(attempts: list[dict[str, Any]]) -> list[int]:
  """Each attempt's steps that an earlier attempt had already trained."""
  out, reached = [], 0
  for a in attempts:
    out.append(max(min(reached, a["last_step"]) - a["start_step"], 0))
    reached = max(reached, a["last_step"])
  return out


def _unasked(attempts: list[dict[str, Any]], capacity: list[dict[str, Any]]) -> float:
  """Seconds from an attempt that ended with its word, finished or stopped (a signal, Ctrl-C),
  to the next one where no launcher waited for capacity in between: a finished run started
  again, a stopped one resumed by hand the next day. No run was asked for then. After an end
  without a word (a kill, a lost machine) or a failure, or where a wait was recorded (a
  preemption's), the time until the next attempt is the interruption's, and stays in."""
  total = 0.0
  for before, after in zip(attempts, attempts[1:]):
    ended, started = before["ended"], after["started"]
    if before["outcome"] not in ("finished", "stopped") or ended is None:
      continue
    if any(c["requested"] < started and c["active"] > ended for c in capacity):
      continue
    total += max(started - ended, 0.0)
  return total


def summarize(record: dict[str, list[dict[str, Any]]], now: float | None = None) -> Summary | None:
  """The record's totals; None where it holds no attempt."""
  attempts, capacity = record["attempts"], record["capacity"]
  if not attempts:
    return None
  training = repeated_s = 0.0
  repeated = _repeated(attempts)
  for a, again in zip(attempts, repeated):
    if a["first_step_at"] is None:
      continue
    seconds = a["last_step_at"] - a["first_step_at"]
    timed = a["last_step"] - a["start_step"] - 1  # The first step's call is the clock's start.
    training += seconds
    repeated_s += seconds * min(again, timed) / timed if timed > 0 else 0.0
  begin = min([a["started"] for a in attempts] + [c["requested"] for c in capacity])
  last = attempts[-1]
  end = now if now is not None else (last["ended"] or last["last_step_at"])
  unasked = _unasked(attempts, capacity)
  return Summary(len(attempts), end - begin - unasked, training,
                 sum(c["active"] - c["requested"] for c in capacity), repeated_s, sum(repeated),
                 max(a["last_step"] for a in attempts), last["total_steps"],
                 # Or its last step saved: a later start of the finished run (which only
                 # evaluates) cut short leaves it finished.
                 last["outcome"] == "finished"
                 or max(a["saved_step"] for a in attempts) >= last["total_steps"], unasked)


def duration(seconds: float) -> str:
  """`1h 02m`, `3m 05s`, `12s`."""
  seconds = round(seconds)
  h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
  return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def format_summary(s: Summary) -> list[str]:
  """The summary as vit-inspect prints it: each part of the wall time and its share."""
  state = "finished" if s.finished else "not finished"
  parts = [("productive training", s.productive_s),
           (f"repeated steps ({s.repeated_steps}, done again after a resume)", s.repeated_s),
           ("waiting for capacity", s.waiting_s),
           ("other (start-up, set-up, compiling, restoring, evaluation at the end)", s.other_s)]
  wall = max(s.wall_s, 1e-9)
  unasked = (f" ({duration(s.unasked_s)} between attempts, when no run was asked for, left "
             f"out)" if s.unasked_s >= 1 else "")
  return [f"Goodput: {s.attempts} attempt{'s' * (s.attempts != 1)}, step {s.last_step} of "
          f"{s.total_steps}, {state}; wall time {duration(s.wall_s)}{unasked}"] + [
              f"  {name}: {duration(t)} ({t / wall:.1%})" for name, t in parts]
