"""vit-transfer end to end on Fashion-MNIST and an image folder: a sweep launched on two local
slots (selection on minival, the final run on test, a failing task named while the others run,
a rerun that chooses the rate and skips what is done), and SIGTERM stopping a sweep after
saving, its rerun completing it."""
import csv
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from helpers import REPO, cpu_env, finish, read_scalars, wait_for, xla_flags
from vit_jax.tools import transfer


def rows_of(out_dir, task: str) -> list[dict[str, str]]:
  with open(out_dir / "results.csv") as f:
    return [r for r in csv.DictReader(f) if r["task"] == task]


@pytest.mark.slow
def test_a_launched_sweep_goes_past_a_failure_then_a_rerun_chooses_the_rate_and_resumes(
    tmp_path, dataset, digits_folder, tiny_npz, capfd, monkeypatch):
  """Launched on two local slots, three tasks (Fashion-MNIST, the digits as an image folder)
  run side by side as processes of their own, the third when a slot is free, and the report
  merges their rows; a rerun here with a grid of two rates selects on minival and takes the
  final run, killed before its row was written, from its complete workdir."""
  _, data_dir = dataset
  flags = [tiny_npz, "--suite", "vtab1k/dtd,fashion_mnist", "--out_dir", str(tmp_path),
           "--image_size=28", "--batch_size=32", "--steps=30", "--data_dir", data_dir,
           "--cpu_devices=1"]  # The reruns here too: one of this process's 8 devices.
  monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # The jobs'.
  flags[2] += "," + digits_folder
  assert transfer.main([*flags, "--lr_grid=0.1", "--launch", "hosts", "--",
                        "--hosts", "localhost,localhost"]) == 1  # dtd is not in data_dir.
  flags[2] = "vtab1k/dtd,fashion_mnist"
  out = capfd.readouterr().out
  started = re.findall(r"\[launch\] job (\d) on localhost: .* --suite (\S+) ", out)
  assert sorted(started) == [("0", "vtab1k/dtd"), ("1", "fashion_mnist"), ("2", digits_folder)]
  [digits] = rows_of(tmp_path, digits_folder)
  assert (digits["phase"], digits["status"]) == ("test", "ok")
  assert float(digits["accuracy"]) > 0.14  # Chance: 0.1 +- 0.017 on 297 examples.
  assert "[launch] then:" in out and "--report_only" in out
  assert "vtab1k/dtd: failed: " in out and "not prepared" in out
  [final] = rows_of(tmp_path, "fashion_mnist")
  assert (final["phase"], final["lr"], final["status"]) == ("test", "0.1", "ok")
  assert float(final["accuracy"]) > 0.2  # Chance: 0.1; 30 steps from a random init.
  assert "fashion_mnist | custom | 0.1 |" in (tmp_path / "results.md").read_text()
  assert (tmp_path / "results.png").stat().st_size > 0

  task_rows = pathlib.Path(final["workdir"]).parent / "rows.csv"
  task_rows.write_text(task_rows.read_text().splitlines(keepends=True)[0])  # Header only.
  assert transfer.main([*flags, "--lr_grid=0.0001,0.1"]) == 1
  assert "vtab1k/dtd" in capfd.readouterr().out
  rows = rows_of(tmp_path, "fashion_mnist")
  assert [(r["phase"], r["lr"], r["status"]) for r in rows] == [
      ("minival", "0.0001", "ok"), ("minival", "0.1", "ok"), ("test", "0.1", "ok")]
  assert float(rows[1]["accuracy"]) > float(rows[0]["accuracy"])
  assert rows[2]["accuracy"] == final["accuracy"]  # The same checkpoint, evaluated again.
  assert len(rows_of(tmp_path, "vtab1k/dtd")) == 2
  assert transfer.main(["--report_only", "--out_dir", str(tmp_path)]) == 1
  assert "| fashion_mnist | custom | 0.1 |" in capfd.readouterr().out


def _task_rows(out_dir, task: str) -> list[dict[str, str]]:
  rows = [r for p in pathlib.Path(out_dir).glob("*/*/rows.csv") for r in csv.DictReader(open(p))]
  return [r for r in rows if r["task"] == task]


@pytest.mark.slow
def test_sigterm_stops_a_sweep_after_saving_and_the_rerun_completes_it(
    tmp_path, dataset, digits_folder, tiny_npz, children):
  """SIGTERM (a pre-emption) while a two-task sweep trains its first task: that task saves and
  writes no row, the second never starts, the status is 143; the rerun resumes the first from
  its checkpoint and runs the second, and no row says failed."""
  _, data_dir = dataset
  flags = [tiny_npz, "--suite", f"fashion_mnist,{digits_folder}", "--out_dir", str(tmp_path),
           "--image_size=28", "--batch_size=16", "--steps=150", "--lr_grid=0.1",
           "--data_dir", data_dir, "--cpu_devices=1"]  # The rerun too, in this process.
  proc = children(subprocess.Popen([sys.executable, "-m", "vit_jax.tools.transfer", *flags],
                                   env=cpu_env(), cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
  wait_for(lambda: any(tmp_path.glob("*/fashion_mnist/**/events.out.tfevents.*")), proc, 300,
           "the first task's events file")
  proc.send_signal(signal.SIGTERM)  # The job's handler is in place once its events file is.
  _, stderr = finish(proc, 120)
  assert proc.returncode == 143, stderr[-3000:]
  [last] = [line for line in stderr.splitlines() if "stop" in line.lower()]  # One line.
  assert last == stderr.strip().splitlines()[-1], stderr[-3000:]
  step = int(re.fullmatch(r"stopped by SIGTERM after saving step (\d+) to \S+; rerun the same "
                          "command to resume", last)[1])
  assert 0 < step < 150
  assert _task_rows(tmp_path, "fashion_mnist") == [] == _task_rows(tmp_path, digits_folder)
  assert not list(tmp_path.glob(f"*/{pathlib.Path(digits_folder).name}*"))

  assert transfer.main(flags) == 0
  rows = _task_rows(tmp_path, "fashion_mnist") + _task_rows(tmp_path, digits_folder)
  assert [(r["task"], r["phase"], r["status"]) for r in rows] == [
      ("fashion_mnist", "test", "ok"), (digits_folder, "test", "ok")]
  resumed = read_scalars(rows[0]["workdir"], "train_loss", newest_file_only=True)
  assert min(resumed) > step and max(resumed) == 150  # From the saved step, not from 0.
