"""No step stalls for ever: a run whose step never ends stops with status 1 and one message
(the stall, the step, the last checkpoint, the command to resume); SIGTERM or Ctrl-C during
a stall ends it within 30 s; either way the next run resumes from the last good step."""
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, cli, cpu_env, read_scalars, run_cli
from vit_jax.train import watchdog

STALL_AT = 7  # Checkpoints every 4 steps: step 4 is the last one saved.


def stalling_run(workdir, dataset, *flags) -> subprocess.Popen:
  args = cli(workdir, dataset, "--config.total_steps=12", *flags)
  args[1:3] = [str(REPO / "tests" / "stalling_main.py"), str(STALL_AT)]
  return subprocess.Popen(args, env=cpu_env(1), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def assert_resumes(workdir, dataset):
  resumed = run_cli(cli(workdir, dataset, "--config.total_steps=12"))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "at step 4" in resumed.stderr and "Final evaluation" in resumed.stdout
  assert sorted(read_scalars(workdir, "train_loss", newest_file_only=True)) == list(range(5, 13))


@pytest.mark.slow
def test_a_stalled_step_stops_the_run_with_a_message_and_it_resumes(tmp_path, dataset):
  t0 = time.time()
  proc = stalling_run(tmp_path, dataset, "--config.stall_timeout_s=5")
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 1, stderr[-3000:]
  message = [line for line in stderr.splitlines() if line.startswith("error: ")]
  assert len(message) == 1, stderr[-3000:]
  assert f"stalled at step {STALL_AT}" in message[0]
  assert "no step has ended for" in message[0] and "config.stall_timeout_s" in message[0]
  assert "last saved checkpoint is step 4" in message[0]
  # The command to resume: this process's own command line.
  assert "rerun the same command" in message[0] and "stalling_main.py 7 --config" in message[0]
  assert time.time() - t0 < 120  # The resume from step 4: the SIGTERM case below.


@pytest.mark.slow
def test_a_signal_during_a_stall_ends_the_run_within_30s(tmp_path, dataset):
  """SIGTERM and Ctrl-C (SIGINT), each to a run of its own, the two runs side by side."""
  signals = (signal.SIGTERM, signal.SIGINT)
  procs = {sig: stalling_run(tmp_path / sig.name, dataset) for sig in signals}  # Bound: minutes.
  deadline = time.time() + 240
  for sig, proc in procs.items():
    while not (tmp_path / sig.name / "checkpoints" / "4").is_dir():
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.2)
  time.sleep(5)  # Step 7 never ends: the main threads wait inside XLA.
  sent = {}
  for sig, proc in procs.items():  # Both at once: each run's wait is its own.
    proc.send_signal(sig)
    sent[sig] = time.time()
  for sig, proc in procs.items():
    _, stderr = proc.communicate(timeout=60)
    assert time.time() - sent[sig] < 30, sig.name
    assert proc.returncode == 1, stderr[-3000:]
    assert f"{sig.name} received" in stderr and "last saved checkpoint is step 4" in stderr
  # What the stall test's resume starts from, untouched by the signals: step 4 alone, and no
  # save half-written (that resume is checked above, on the same state).
  for sig in signals:
    assert sorted(p.name for p in (tmp_path / sig.name / "checkpoints").iterdir()) == ["4"]


def test_the_automatic_bound_follows_the_step_time():
  dog = watchdog.StallWatchdog(None, lambda step, reason: "")
  assert dog.bound() == watchdog.FLOOR_S
  dog._step_times.extend([20.0] * 10)  # Slow steps: 50 of them, not the floor.
  assert dog.bound() == 50 * 20.0
  assert watchdog.StallWatchdog(7.0, lambda step, reason: "").bound() == 7.0
