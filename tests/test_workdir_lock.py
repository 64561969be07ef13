"""A workdir is owned by one process: WORKDIR/lock names it (host, PID), taken atomically before
the run writes there and removed when it ends; a dead process's lock is taken over, a live
one's (or another host's) refused with one line naming the holder (a second `vit-train` on a
workdir in use: test_e2e_train.py)."""
import dataclasses
import json
import logging
import os
import socket
import subprocess
import time

import pytest

from vit_jax.checkpoint import workdir_lock


def write_lock(workdir, host: str, pid: int) -> None:
  workdir.mkdir(exist_ok=True)
  holder = workdir_lock.Holder(host, pid, "2026-01-02T03:04:05+00:00")
  (workdir / "lock").write_text(holder.to_json())


def dead_pid() -> int:
  child = subprocess.Popen(["true"])
  child.wait(timeout=30)  # Reaped: its PID names no process now.
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
  deadline = time.monotonic() + 30
  while not workdir_lock._zombie(child.pid):  # Ended; not waited for.
    assert time.monotonic() < deadline, f"killed process {child.pid} never became a zombie"
  write_lock(tmp_path, socket.gethostname(), child.pid)
  lock = workdir_lock.take(str(tmp_path))
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  lock.release()
  child.wait(timeout=30)


def test_release_leaves_a_lock_that_another_process_holds_now(tmp_path):
  lock = workdir_lock.take(str(tmp_path))
  write_lock(tmp_path, socket.gethostname(), os.getppid())  # Removed by hand, taken by another.
  lock.release()
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getppid()


@pytest.mark.parametrize("text", ["", "{not json", "[]", '{"host": "h"}', '{"pid": 3}',
                                  '{"host": "h", "pid": -1}'])
def test_a_file_that_is_no_lock_is_replaced_with_one_warning(tmp_path, monkeypatch, caplog, text):
  """Never a blocked run: whatever the file holds, the run takes the workdir, and says so."""
  monkeypatch.setattr(workdir_lock, "READ_RETRY_S", 0.0)
  (tmp_path / "lock").write_text(text)
  workdir_lock.check_free(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    lock = workdir_lock.take(str(tmp_path))
  [warning] = [r.getMessage() for r in caplog.records]
  assert warning.startswith(f"replaced {tmp_path}/lock, which was not a lock this program wrote")
  assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  lock.release()


def test_a_lock_of_the_first_version_is_read(tmp_path):
  """{"host", "pid", "since"} alone (no boot id, no start time): judged by its PID, as then."""
  (tmp_path / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                             "since": "2026-01-02T03:04:05+00:00"}))
  with pytest.raises(workdir_lock.WorkdirInUse, match=f"in use by PID {os.getppid()} "):
    workdir_lock.take(str(tmp_path))
  (tmp_path / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid()}))
  workdir_lock.take(str(tmp_path)).release()


@pytest.mark.parametrize("change", [{"start": 1}, {"boot": "another-boot"}])
def test_a_live_pid_of_another_process_or_boot_is_dead(tmp_path, change):
  """The PID is alive, but its process started at another time (a PID reused: every restarted
  container's run is PID 1 or so again), or the lock dates from an earlier boot of this host:
  the holder is gone, and its lock is taken over."""
  live = workdir_lock.Holder(socket.gethostname(), os.getppid(), "then",
                             workdir_lock._boot_id(), workdir_lock._start_ticks(os.getppid()))
  assert live.alive() and live.boot and live.start
  (tmp_path / "lock").write_text(dataclasses.replace(live, **change).to_json())
  workdir_lock.check_free(str(tmp_path))
  workdir_lock.take(str(tmp_path)).release()


def test_a_holder_on_another_host_is_taken_over_when_the_launcher_hands_it_over(
    tmp_path, monkeypatch, caplog):
  """A run killed on a VM that is gone (SIGKILL, its slice deleted): the launcher restarting it
  on a new VM names the holder it saw (common.lock_handover), and the restart takes that lock;
  a lock naming anyone else is refused as before."""
  from launch import common
  write_lock(tmp_path, "t1v-n-0a1b2c3d-w-0", 4321)
  env = common.lock_handover(str(tmp_path))
  assert list(env) == [workdir_lock.HANDOVER_ENV]
  write_lock(tmp_path, "t1v-n-0a1b2c3d-w-0", 4322)  # Another process than the one handed over.
  monkeypatch.setenv(workdir_lock.HANDOVER_ENV, env[workdir_lock.HANDOVER_ENV])
  with pytest.raises(workdir_lock.WorkdirInUse, match="in use by PID 4322 on host t1v-n-"):
    workdir_lock.check_free(str(tmp_path))
  write_lock(tmp_path, "t1v-n-0a1b2c3d-w-0", 4321)
  workdir_lock.check_free(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    lock = workdir_lock.take(str(tmp_path))
  assert [r.getMessage() for r in caplog.records] == [
      f"took over the lock of process 4321 on t1v-n-0a1b2c3d-w-0 ({tmp_path}/lock, held since "
      "2026-01-02T03:04:05+00:00), which the launcher restarting this run says is gone"]
  lock.release()
  assert common.lock_handover(str(tmp_path)) == {} == common.lock_handover("gs://bucket/run")


def test_a_bucket_workdir_takes_no_lock_and_says_so_in_the_log(caplog):
  with caplog.at_level(logging.INFO):
    assert workdir_lock.take("gs://some-bucket/run") is None
  assert "no lock is taken there" in caplog.text


def test_only_process_0_takes_it(tmp_path, monkeypatch):
  import jax
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert workdir_lock.take(str(tmp_path)) is None and os.listdir(tmp_path) == []
