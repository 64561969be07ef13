"""A workdir is owned by one process: WORKDIR/lock names it (host, PID), taken atomically before
the run writes there and removed when it ends; a dead process's lock is taken over, a live
one's (or another host's) refused with one line naming the holder (a second `vit-train` on a
workdir in use: test_e2e_train.py)."""
import json
import logging
import os
import socket
import subprocess

import pytest

from vit_jax.checkpoint import workdir_lock


def write_lock(workdir, host: str, pid: int) -> None:
  workdir.mkdir(exist_ok=True)
  holder = workdir_lock.Holder(host, pid, "2026-01-02T03:04:05+00:00")
  (workdir / "lock").write_text(holder.to_json())


def dead_pid() -> int:
  child = subprocess.Popen(["true"])
  child.wait()  # Reaped: its PID names no process now.
  return child.pid


def test_take_names_this_process_and_release_removes_it(tmp_path):
  workdir = tmp_path / "run"  # Created by take.
  with workdir_lock.take(str(workdir)) as lock:
    held = json.loads((workdir / "lock").read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    assert held["since"] and lock.path == str(workdir / "lock")
    with pytest.raises(workdir_lock.WorkdirInUse):  # Not twice, not even by its holder.
      workdir_lock.take(str(workdir))
  assert os.listdir(workdir) == []


def test_a_live_holder_on_this_host_is_refused_naming_it(tmp_path):
  write_lock(tmp_path, socket.gethostname(), os.getppid())
  with pytest.raises(workdir_lock.WorkdirInUse) as e:
    workdir_lock.take(str(tmp_path))
  assert str(e.value) == (
      f"{tmp_path} is in use by PID {os.getppid()} on host {socket.gethostname()} (since "
      f"2026-01-02T03:04:05+00:00): wait for it, stop it, or remove {tmp_path}/lock if that "
      "process is gone.")


def test_another_hosts_holder_is_refused_even_with_a_pid_dead_here(tmp_path):
  write_lock(tmp_path, "other-host", dead_pid())
  with pytest.raises(workdir_lock.WorkdirInUse, match=r"in use by PID \d+ on host other-host"):
    workdir_lock.take(str(tmp_path))
  assert json.loads((tmp_path / "lock").read_text())["host"] == "other-host"  # Left as it was.


def test_a_dead_holders_lock_is_taken_over_with_one_warning(tmp_path, caplog):
  pid = dead_pid()
  write_lock(tmp_path, socket.gethostname(), pid)
  with caplog.at_level(logging.WARNING):
    lock = workdir_lock.take(str(tmp_path))
  assert [r.getMessage() for r in caplog.records] == [
      f"took over the lock of dead process {pid} on {socket.gethostname()} "
      f"({tmp_path}/lock, held since 2026-01-02T03:04:05+00:00)"]
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  assert os.listdir(tmp_path) == ["lock"]  # Nothing set aside is left.
  lock.release()
  assert os.listdir(tmp_path) == []


def test_a_killed_holder_not_yet_reaped_is_dead(tmp_path):
  """A run killed with its parent waits as a zombie until init reaps it (seconds in a
  container): its lock is free, and the run restarted at once takes it."""
  child = subprocess.Popen(["sleep", "60"])
  child.kill()
  while not workdir_lock._zombie(child.pid):  # Ended; not waited for.
    pass
  write_lock(tmp_path, socket.gethostname(), child.pid)
  lock = workdir_lock.take(str(tmp_path))
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  lock.release()
  child.wait()


def test_release_leaves_a_lock_that_another_process_holds_now(tmp_path):
  lock = workdir_lock.take(str(tmp_path))
  write_lock(tmp_path, socket.gethostname(), os.getppid())  # Removed by hand, taken by another.
  lock.release()
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getppid()


def test_a_file_that_is_no_lock_is_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(workdir_lock, "READ_RETRY_S", 0.0)
  (tmp_path / "lock").write_text("")
  with pytest.raises(workdir_lock.WorkdirInUse, match="not a lock file .* remove it if no run"):
    workdir_lock.take(str(tmp_path))


def test_a_bucket_workdir_takes_no_lock_and_says_so_in_the_log(caplog):
  with caplog.at_level(logging.INFO):
    assert workdir_lock.take("gs://some-bucket/run") is None
  assert "no lock is taken there" in caplog.text


def test_only_process_0_takes_it(tmp_path, monkeypatch):
  import jax
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert workdir_lock.take(str(tmp_path)) is None and os.listdir(tmp_path) == []
