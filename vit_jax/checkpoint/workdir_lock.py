"""A training run's workdir has one owner: WORKDIR/lock, a JSON file naming the process that
holds it (`{"host": ..., "pid": ..., "since": ..., "boot": ..., "start": ...}`; a lock of
earlier versions has no boot or start), created atomically (O_CREAT | O_EXCL) before anything
else is written there and removed when the run ends.

A lock left by a process that is gone is taken over, with a warning: on this host, its PID no
longer alive, or alive but another process (its start time differs: a PID reused, as every
restarted container's are), or a boot of this host before the current one. One held by a live
process on this host, or by any process on another host (whose liveness cannot be checked from
here), is refused: `WorkdirInUse`; unless the launcher that restarts the run knows the holder
is gone (its machine deleted, its job ended) and hands it over: HANDOVER_ENV, set by
`handover_env(holder)`, names that holder, which is then taken over if the lock still names it
exactly (launch/common.py's lock_handover; a JobSet's pods restarted by GKE likewise). A lock
file that does not read as one (not JSON, no host or PID) is replaced, with a warning.

A multi-process run takes it once: process 0 does, and every process learns whether it did.
A workdir in a bucket (gs://) takes none: a bucket has no exclusive create through the file
API the run writes with (etils epath's open refuses mode "x"), so the run goes on unlocked,
with a note in its log.
"""
import dataclasses
import datetime
import json
import logging
import os
import socket
import time

from vit_jax.config_errors import InputError

LOCK_NAME = "lock"
# A holder (Holder.to_json) that the launcher restarting the run knows to be gone.
HANDOVER_ENV = "VIT_WORKDIR_LOCK_HANDOVER"
# How long a lock file that does not read as a lock yet (its creator between creating and
# writing it) is read again before it counts as unreadable.
READ_RETRY_S = 2.0


class WorkdirInUse(InputError):
  """The workdir is held by another process: one line naming it and what to do."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a lock: host name, process id, since when (ISO 8601, local time), and where
  known (Linux) the host's boot id and the process's start time (clock ticks after boot),
  which tell a PID reused or a host restarted."""
  host: str
  pid: int
  since: str
  boot: str = ""
  start: int = 0

  @classmethod
  def this_process(cls) -> "Holder":
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return cls(socket.gethostname(), os.getpid(), now, _boot_id(), _start_ticks(os.getpid()))

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self)) + "\n"

  @classmethod
  def from_json(cls, text: str) -> "Holder":
    """The holder a lock file names (this version's or an earlier one's); ValueError if it
    names none."""
    d = json.loads(text)
    if not (isinstance(d, dict) and isinstance(d.get("host"), str)
            and isinstance(d.get("pid"), int) and d["pid"] > 0):
      raise ValueError(f"not a lock: {text[:200]!r}")
    start = d.get("start")
    return cls(d["host"], d["pid"], str(d.get("since", "an unknown time")),
               d["boot"] if isinstance(d.get("boot"), str) else "",
               start if isinstance(start, int) else 0)

  def alive(self) -> bool:
    """Whether the process may still run: on another host it may, as far as this one knows."""
    if self.host != socket.gethostname():
      return True
    if self.boot and _boot_id() and self.boot != _boot_id():
      return False  # Held before this host last started.
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:  # Another user's process.
      return True
    if self.start and _start_ticks(self.pid) not in (0, self.start):
      return False  # Its PID is another process's now.
    return not _zombie(self.pid)


def _proc_stat(pid: int) -> list[str]:
  """/proc/PID/stat's fields after the command name (state first); [] where unknown."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return []


def _zombie(pid: int) -> bool:
  """Whether the process has ended and waits to be reaped (Linux's state Z). A killed run whose
  parent died too stays so until init reaps it, seconds where init is a container's."""
  return _proc_stat(pid)[:1] == ["Z"]


def _start_ticks(pid: int) -> int:
  """The process's start time in clock ticks after boot (stat's field 22); 0 where unknown."""
  fields = _proc_stat(pid)
  return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def lock_path(workdir: str) -> str:
  return os.path.join(workdir, LOCK_NAME)


@dataclasses.dataclass
class Lock:
  """A lock this process holds; `release` removes its file if it still names this process."""
  path: str
  holder: Holder

  def release(self) -> None:
    try:
      with open(self.path, encoding="utf-8") as f:
        if Holder.from_json(f.read()) != self.holder:
          return  # Not ours any more: someone removed it and another run took it.
      os.unlink(self.path)
    except (OSError, ValueError):  # Gone already, or replaced by a file that is no lock.
      pass

  def __enter__(self) -> "Lock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _create(path: str, holder: Holder) -> bool:
  """Creates the lock file naming `holder`, atomically; False if it exists."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return False
  try:
    os.write(fd, holder.to_json().encode())
    os.fsync(fd)
  finally:
    os.close(fd)
  return True


def _read(path: str) -> tuple[str, Holder | None] | None:
  """(text, holder) of an existing lock file, holder None for a file that does not read as a
  lock after READ_RETRY_S (its creator may be between creating and writing it); None if it is
  gone."""
  deadline = time.monotonic() + READ_RETRY_S
  while True:
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      return None
    try:
      return text, Holder.from_json(text)
    except ValueError:
      if time.monotonic() > deadline:
        return text, None
    time.sleep(0.1)


def read_holder(workdir: str) -> Holder | None:
  """Who holds the workdir's lock now, as its file says; None where there is none (or it is
  in a bucket, or does not read as a lock). Waits for nothing: for a launcher's look."""
  if "://" in str(workdir):
    return None
  try:
    with open(lock_path(str(workdir)), encoding="utf-8") as f:
      return Holder.from_json(f.read())
  except (OSError, ValueError):
    return None


def handover_env(holder: Holder) -> dict[str, str]:
  """The environment that lets a restarted run take the lock over from `holder`, a process that
  the launcher knows is gone (its machine deleted or restarted, its job ended)."""
  return {HANDOVER_ENV: holder.to_json().strip()}


def handed_over() -> Holder | None:
  """The holder that HANDOVER_ENV names, if set; one warning where it names none."""
  text = os.environ.get(HANDOVER_ENV)
  if not text:
    return None
  try:
    return Holder.from_json(text)
  except ValueError:
    logging.warning("%s=%r names no lock holder: ignored", HANDOVER_ENV, text[:200])
    return None


def _gone(other: Holder | None, handed: Holder | None) -> bool:
  """Whether the lock's holder (None: a file that is no lock) may be taken over."""
  return other is None or other == handed or not other.alive()


def _remove_if_unchanged(path: str, text: str) -> bool:
  """Removes the lock file if it still holds `text`: moved aside first (atomically), then
  compared, so that a lock another process has just taken in its place is put back."""
  aside = f"{path}.stale.{socket.gethostname()}.{os.getpid()}"
  try:
    os.rename(path, aside)
  except FileNotFoundError:  # Another process removed it first.
    return False
  with open(aside, encoding="utf-8") as f:
    moved = f.read()
  if moved != text:  # Not the stale lock: a live one, taken since it was read.
    try:
      os.link(aside, path)
    except FileExistsError:
      pass
  os.unlink(aside)
  return moved == text


def _take_here(workdir: str) -> Lock:
  """This process's lock on `workdir` (a local or mounted folder), created if need be."""
  os.makedirs(workdir, exist_ok=True)
  path, holder, handed = lock_path(workdir), Holder.this_process(), handed_over()
  taken_over = None
  for _ in range(5):  # Each round ends in a lock, a refusal, or a lock that changed meanwhile.
    if _create(path, holder):
      if taken_over:
        logging.warning(_taken_over(path, *taken_over, handed))
      return Lock(path, holder)
    found = _read(path)
    if found is None:
      continue
    text, other = found
    if not _gone(other, handed):
      raise _in_use(workdir, other)
    if _remove_if_unchanged(path, text):
      taken_over = text, other
  raise WorkdirInUse(f"{path} kept changing while it was read: is another run starting on "
                     f"{workdir}? Retry once it has.")


def _taken_over(path: str, text: str, other: Holder | None, handed: Holder | None) -> str:
  if other is None:
    return f"replaced {path}, which was not a lock this program wrote: {text[:120]!r}"
  held = f"({path}, held since {other.since})"
  if other == handed:
    return (f"took over the lock of process {other.pid} on {other.host} {held}, which the "
            "launcher restarting this run says is gone")
  return f"took over the lock of dead process {other.pid} on {other.host} {held}"


def check_free(workdir: str) -> None:
  """Raises WorkdirInUse where a live process holds the workdir's lock, as take would: a look
  that takes nothing, for a refusal before a run's seconds of start-up."""
  found = _read(lock_path(workdir)) if "://" not in str(workdir) else None
  if found is not None and not _gone(found[1], handed_over()):
    raise _in_use(workdir, found[1])


def _in_use(workdir: str, other: Holder) -> WorkdirInUse:
  return WorkdirInUse(
      f"{workdir} is in use by PID {other.pid} on host {other.host} (since {other.since}): "
      f"wait for it, stop it, or remove {lock_path(workdir)} if that process is gone.")


def _agree(refused: bool) -> bool:
  """Process 0's `refused`, on every process of a multi-process run."""
  import jax
  if jax.process_count() == 1:
    return refused
  import numpy as np
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.int32(refused)))


def take(workdir: str) -> Lock | None:
  """The workdir's lock for this run: held by process 0 (None on the others, and in a bucket,
  where none is taken). Raises WorkdirInUse on every process when process 0 cannot take it."""
  import jax
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      if "://" in str(workdir):
        # epath's files in a bucket open only "r", "w" and "a": no exclusive create.
        logging.info("%s is in a bucket: no lock is taken there; keep to one run per "
                     "workdir.", workdir)
      else:
        lock = _take_here(str(workdir))
    except Exception as e:  # Reported below, once every process has heard of it.
      error = e
  if _agree(error is not None):
    if error is not None:
      raise error
    raise WorkdirInUse(f"{workdir} is in use, or its lock cannot be taken: process 0 of the "
                       "run says why.")
  return lock

