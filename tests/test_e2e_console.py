"""vit-train's console, end to end: one progress bar on a terminal, a plain line per log
interval without one, the library's logs in WORKDIR/train.log, a summary that says what to run
next."""
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time

import pytest

from helpers import REPO, cli, cpu_env, run_cli


# A line as absl writes it (`I1126 01:10:05.404573 140637835959168 train.py:128] ...`), at the
# start of the output or after a line break or a bar's carriage return.
ABSL_LINE = re.compile(r"(^|[\r\n])[IWE]\d{4} \d\d:\d\d:\d\d")


def run_in_terminal(args, timeout: float = 600) -> tuple[int, str]:
  """Runs `args` with a pseudo-terminal (100 columns) as its stdout and stderr: its exit status
  and everything it wrote there."""
  leader, follower = pty.openpty()
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
  proc = subprocess.Popen(args, env=cpu_env(), cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=follower, stderr=follower)
  os.close(follower)
  out, deadline = [], time.time() + timeout
  while time.time() < deadline:
    if select.select([leader], [], [], 1.0)[0]:
      try:
        chunk = os.read(leader, 1 << 16)
      except OSError:  # EIO: the terminal's last writer is gone.
        chunk = b""
      if not chunk:
        break
      out.append(chunk)
  os.close(leader)
  if proc.poll() is None:  # Past the timeout.
    proc.kill()
  return proc.wait(), b"".join(out).decode(errors="replace")


def assert_summary(out: str, workdir, step: int) -> None:
  summary = out[out.index("Final evaluation: accuracy="):]
  assert f"Checkpoint:  {workdir}/checkpoints/{step}" in summary, summary
  assert f"Log:         {workdir}/train.log" in summary, summary
  assert f"tensorboard --logdir {workdir}" in summary, summary
  assert re.search(rf"vit-inspect {workdir}\b", summary), summary
  assert re.search(rf"vit-export {workdir} \S+\.npz", summary), summary
  assert re.search(rf"vit-fewshot {workdir} --datasets=fashion_mnist", summary), summary


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory, dataset):
  workdir = tmp_path_factory.mktemp("console") / "run"
  status, out = run_in_terminal(cli(workdir, dataset, "--config.total_steps=12"))
  assert status == 0, out[-3000:]
  return workdir, out


def test_a_terminal_gets_one_bar_and_the_library_logs_go_to_the_workdir(terminal_run):
  workdir, out = terminal_run
  # A bar redrawn in place (where the terminal ends a line with \r\n).
  assert re.search(r"\r(?!\n)", out), out[-3000:]
  bar = re.findall(r"\d+%\|[^\r\n]*\| *\d+/12 \[[^\]]*img/s, loss [0-9.]+", out)
  assert bar and bar[-1].startswith("100%|"), out[-3000:]
  assert "Training ViT with patch 7, width 32, depth 2, 2 heads, MLP 64 (22,794 parameters)" in out and f"Workdir: {workdir}" in out
  assert "eval at step 12: accuracy" in out
  assert not ABSL_LINE.search(out), out[-3000:]
  assert "oneDNN" not in out and "Traceback" not in out
  assert_summary(out.replace("\r\n", "\n"), workdir, 12)
  log = (workdir / "train.log").read_text()
  assert re.search(r"^I\d{4} .*\] JAX .*: process 0 of 1, 1 devices \(cpu\)", log, re.M), log
  assert re.search(r"^I\d{4} .*\] \[12\] .*train_loss=", log, re.M), log  # clu's metric lines.
  for line in tensorflow_startup_lines():
    assert line in log and line not in out, (line, log)


def tensorflow_startup_lines() -> list[str]:
  """What TensorFlow's C++ writes on stderr as it loads here, in the environment of the run
  above, without each line's time and process: oneDNN's notice where TensorFlow turns oneDNN on
  (CPUs with AVX-512 VNNI and newer), nothing on a CPU with AVX2 alone."""
  result = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                          text=True, env=cpu_env(), timeout=300)
  assert result.returncode == 0, result.stderr
  return [line.split("] ", 1)[-1] for line in result.stderr.splitlines() if line.strip()]


def test_without_a_terminal_a_line_per_interval_and_a_resume_says_so(terminal_run, dataset,
                                                                       tmp_path):
  """A copy of the terminal's run, resumed to 24 steps with plain lines every 4 steps."""
  workdir = tmp_path / "run"
  shutil.copytree(terminal_run[0], workdir)
  result = run_cli(cli(workdir, dataset, "--config.total_steps=24",
                       "--config.log_every_steps=4", "--config.allow_resume_changes=True"))
  assert result.returncode == 0, result.stderr[-3000:]
  err, out = result.stderr, result.stdout
  assert "\r" not in err + out and "%|" not in err and not ABSL_LINE.search(err), err
  assert f"Resumed from {workdir} at step 12 of 24." in err
  assert "warning: Resuming" in err  # A warning reaches the console, in a line of its own.
  steps = re.findall(r"^step (\d+)/24 \(\d+\.\d%\)  loss \d\.\d{3}  [\d,]+ img/s  eta \S+$",
                     err, re.M)
  assert steps == ["16", "20", "24"], err
  assert re.search(r"^eval at step 24: accuracy \d+\.\d\d%", err, re.M), err
  assert out.startswith("Final evaluation: accuracy=")
  assert "Trained steps 13-24 of 24 in" in out and "img/s" in out
  assert_summary(out, workdir, 24)
  log = (workdir / "train.log").read_text()
  assert len(re.findall(r"\] Command: ", log)) == 2, log  # Appended to on the resume.
  assert re.search(r"^I\d{4} .*\] \[24\] .*train_loss=", log, re.M), log
