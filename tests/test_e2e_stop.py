"""A run stopped before its end: SIGTERM saves a step and exits 128 + the signal, and the
rerun resumes to the same losses (while it ran, a second `vit-train` on its workdir was refused,
writing nothing); a step that never ends stops the run with status 1 and
one message (the stall, the step, the last checkpoint, the command to resume), and SIGTERM or
Ctrl-C during a stall ends it within 30 s (train/watchdog.py)."""
import json
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from helpers import (REPO, cli, cpu_env, finish, read_scalars, read_until, tiny_config,
                     wait_for)
from vit_jax.train import loop


# Every random AugReg ingredient on: RandAugment, mixup, label smoothing, stochastic depth.
AUGREG = {"data.randaug_layers": 2, "data.randaug_magnitude": 15, "data.mixup_alpha": 0.5,
          "label_smoothing": 0.1, "model.stochastic_depth": 0.1}


class _Start(loop.Report):
  def started(self, info: loop.RunInfo) -> None:
    self.start_step = info.start_step


def files(folder) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), folder)
                for d, _, names in os.walk(folder) for f in names)


def _wait_until_stopped(pid: int) -> None:
  """Until every thread of `pid` is stopped: SIGSTOP takes effect a moment after kill()
  returns, and a save may be writing meanwhile."""
  def states():
    for task in os.listdir(f"/proc/{pid}/task"):
      try:
        yield open(f"/proc/{pid}/task/{task}/stat").read().rsplit(")", 1)[1].split()[0]
      except FileNotFoundError:  # A thread that just ended.
        pass
  deadline = time.time() + 30
  while any(state not in "TZX" for state in states()):
    assert time.time() < deadline, f"process {pid} did not stop"
    time.sleep(0.01)


def a_second_run_is_refused(workdir, dataset, first: subprocess.Popen) -> None:
  """A second `vit-train` on the workdir of `first`, a `vit-train` that trains (stopped
  meanwhile: alive, holding the lock, its files as they are), exits 2 with one line naming the
  first, and writes nothing; `first` goes on."""
  first.send_signal(signal.SIGSTOP)
  try:
    _wait_until_stopped(first.pid)
    before, lock = files(workdir), (workdir / "lock").read_text()
    second = subprocess.run(cli(workdir, dataset), env=cpu_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.splitlines() == [
        f"error: {workdir} is in use by PID {first.pid} on host {socket.gethostname()} (since "
        f"{json.loads(lock)['since']}): wait for it, stop it, or remove {workdir}/lock if that "
        "process is gone."], second.stderr[-3000:]
    assert files(workdir) == before and (workdir / "lock").read_text() == lock
    assert (workdir / "train.log").read_text().count("] Command: ") == 1  # The first's.
  finally:
    first.send_signal(signal.SIGCONT)


# SIGKILL, which resumes from an earlier step and replays the steps after it, is
# tests/test_e2e_resume.py's random-kills test.
@pytest.mark.slow
def test_a_sigterm_saves_and_the_rerun_resumes_to_the_same_losses(tmp_path, dataset, children):
  """The stop is a `vit-train` process's (its signal, status and console line; before it, a
  second `vit-train` on its workdir is refused: a_second_run_is_refused); the
  uninterrupted reference and the resume run in this process (a process of their own cost ~10
  CPU-s each), all on one device: XLA's CPU pool, sized by the process's device count, sets how
  its work is split and summed (one device of this process's eight, config.cpu_devices=1, and
  one device alone differ in the last bit; with the pool of eight, NPROC=16, they agree)."""
  workdir = tmp_path / "killed"
  proc = children(subprocess.Popen(
      cli(workdir, dataset, "--config.total_steps=24",
          *(f"--config.{k}={v}" for k, v in AUGREG.items())),
      env=cpu_env(1) | {"NPROC": "16"}, cwd=REPO, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True))
  wait_for((workdir / "checkpoints" / "8").is_dir, proc, 300, "checkpoint 8")
  a_second_run_is_refused(workdir, dataset, proc)
  proc.send_signal(signal.SIGTERM)
  _, stderr = finish(proc, 120)
  # Saved, then a non-zero status (128 + the signal's number), so a scheduler restarts it.
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  # One line on the console for the stop (the log file has the rest).
  last = [line for line in stderr.splitlines() if "stop" in line.lower()]
  assert len(last) == 1, stderr[-3000:]
  step = int(re.fullmatch(rf"stopped by SIGTERM after saving step (\d+) to {workdir}; rerun "
                          "the same command to resume", last[0])[1])
  assert stderr.strip().splitlines()[-1] == last[0], stderr[-3000:]
  assert not (workdir / "lock").exists()  # Released as it stopped.

  config = tiny_config(dataset, total_steps=24, cpu_devices=1, **AUGREG)
  loop.train_and_evaluate(config, str(tmp_path / "full"))
  expected = read_scalars(tmp_path / "full", "train_loss")
  resumed = _Start()
  loop.train_and_evaluate(config, str(workdir), resumed)
  assert resumed.start_step == step
  after = read_scalars(workdir, "train_loss", newest_file_only=True)
  assert after and min(after) > step and max(after) == 24
  np.testing.assert_array_equal([after[s] for s in sorted(after)], [expected[s] for s in sorted(after)])


def test_a_console_whose_reader_leaves_saves_and_stops_as_on_a_signal(tmp_path, dataset,
                                                                       children):
  """`vit-train ... 2>&1 | head`: the console's next write finds no reader; the run saves the
  step it is on and ends as SIGPIPE would end it (141, nothing more written), recorded as
  stopped, not failed (a BrokenPipeError's status 1 and traceback, nothing saved before). The
  rerun's resume after a stop: the SIGTERM test's."""
  workdir = tmp_path / "piped"
  proc = children(subprocess.Popen(
      cli(workdir, dataset, "--config.total_steps=200", "--config.log_every_steps=1"),
      env=cpu_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  read_until(proc, lambda line: line.startswith("step 2/200"))
  proc.stdout.close()  # As `head` ends.
  assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert len(saved) == 1 and 2 < saved[0] < 200, saved
  attempt = json.loads((workdir / "goodput.json").read_text())["attempts"][-1]
  assert attempt["outcome"] == "stopped" and attempt["saved_step"] == saved[0], attempt
  assert "SIGPIPE received: saving a checkpoint" in (workdir / "train.log").read_text()
  assert not (workdir / "lock").exists()


STALL_AT = 7  # Checkpoints every 4 steps: step 4 is the last one saved.


def stalling_run(workdir, dataset, *flags) -> subprocess.Popen:
  args = cli(workdir, dataset, "--config.total_steps=12", *flags)
  args[1:3] = [str(REPO / "tests" / "stalling_main.py"), str(STALL_AT)]
  return subprocess.Popen(args, env=cpu_env(1), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_stall_stops_the_run_with_a_message_and_a_signal_during_one_ends_it_within_30s(
    tmp_path, dataset, children):
  """Three runs side by side (their waits overlap), each stalled at step STALL_AT: one stopped
  by config.stall_timeout_s, one by SIGTERM and one by Ctrl-C (SIGINT) during the stall. The
  resume from step 4 is the SIGTERM case above."""
  t0 = time.time()
  timed_out = children(stalling_run(tmp_path / "timeout", dataset,
                                    "--config.stall_timeout_s=5"))
  signals = (signal.SIGTERM, signal.SIGINT)
  procs = {sig: children(stalling_run(tmp_path / sig.name, dataset)) for sig in signals}
  deadline = time.time() + 240  # Bound: minutes.
  for sig, proc in procs.items():
    wait_for((tmp_path / sig.name / "checkpoints" / "4").is_dir, proc,
             deadline - time.time(), f"{sig.name}'s checkpoint 4")
  time.sleep(5)  # Step 7 never ends: the main threads wait inside XLA.
  sent = {}
  for sig, proc in procs.items():  # Both at once: each run's wait is its own.
    proc.send_signal(sig)
    sent[sig] = time.time()
  for sig, proc in procs.items():
    _, stderr = finish(proc, 60)
    assert time.time() - sent[sig] < 30, sig.name
    assert proc.returncode == 1, stderr[-3000:]
    assert f"{sig.name} received" in stderr and "last saved checkpoint is step 4" in stderr
  # What a resume starts from, untouched by the signals: step 4 alone, and no save
  # half-written.
  for sig in signals:
    assert sorted(p.name for p in (tmp_path / sig.name / "checkpoints").iterdir()) == ["4"]

  _, stderr = finish(timed_out, 300)
  assert timed_out.returncode == 1, stderr[-3000:]
  message = [line for line in stderr.splitlines() if line.startswith("error: ")]
  assert len(message) == 1, stderr[-3000:]
  assert f"stalled at step {STALL_AT}" in message[0]
  assert "no step has ended for" in message[0] and "config.stall_timeout_s" in message[0]
  assert "last saved checkpoint is step 4" in message[0]
  # The command to resume: this process's own command line.
  assert "rerun the same command" in message[0] and "stalling_main.py 7 --config" in message[0]
  assert time.time() - t0 < 240
