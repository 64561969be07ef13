"""vit-transfer: the protocol's jobs and learning-rate choice, a sweep end to end on
Fashion-MNIST (selection on minival, the final run on test, a failing task named while the
others run, a rerun that skips what is done), the task list and the dry run."""
import csv
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from vit_jax import checkpoint, models
from vit_jax.data import sources, tasks
from vit_jax.tools import cli, transfer
from vit_jax.train import stop_signals
from vit_jax.transfer import paper_results, protocol, report, results, sweep

from helpers import REPO, cpu_env, read_scalars

TINY = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory) -> str:
  """A randomly initialised tiny ViT at 28 px, written without a description."""
  model = models.create_model("ViT-Ti_16", num_classes=3, **TINY)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3), np.float32))["params"]
  path = str(tmp_path_factory.mktemp("transfer") / "tiny.npz")
  checkpoint.save_npz(path, params)
  return path


def test_jobs_select_on_minival_then_train_once_more():
  task = tasks.resolve_or_custom("fashion_mnist")[0]
  settings = protocol.Settings(lr_grid=(0.01, 0.03))
  select, final = protocol.fine_tunes("c.npz", task, settings, "/out")[:2], protocol.fine_tunes(
      "c.npz", task, settings, "/out", chosen=0.03)[-1]
  assert [(j.phase, j.lr) for j in select] == [("minival", 0.01), ("minival", 0.03)]
  assert (final.phase, final.lr) == ("test", 0.03)
  assert len({j.workdir for j in select + [final]}) == 3
  assert protocol.fine_tunes("c.npz", task, protocol.Settings(lr_grid=(0.01,)), "/out") == [
      protocol.FineTune("c.npz", task, "test", 0.01, protocol.run_dir("/out", "c.npz", task, "test",
                                                                  0.01))]
  assert protocol.choose_lr({0.01: 0.5, 0.003: 0.7, 0.03: 0.7}) == 0.003  # Ties: the smaller.


def test_the_report_averages_vtab_groups_and_cites_the_paper():
  def row(task, accuracy, phase="test"):
    return {"checkpoint": "b16.npz", "model": "ViT-B_16", "task": task, "phase": phase,
            "group": tasks.get(task).group, "lr": "0.01", "accuracy": str(accuracy),
            "status": "ok"}
  rows = [row(n, 0.5 + 0.01 * i) for i, n in enumerate(tasks.SUITES["vtab1k"])]
  rows += [row("paper/cifar10", 0.25, "minival"), row("paper/cifar10", 0.9)]
  md = report.markdown(rows, {("b16.npz", "vtab1k/dmlab"): "failed: why"})
  # Tasks 0-6 natural, 7-10 specialized, 11-18 structured.
  for group, mean in (("natural", 53.0), ("specialized", 58.5), ("structured", 64.5),
                      ("vtab1k", 59.0)):
    assert f"| b16.npz | VTAB-1k {group} mean | | | {mean:.2f} |" in md
  cited = paper_results.lookup("ViT-B_16", "paper/cifar10")
  assert cited and all(f"{r.accuracy:.2f} ({r.pretraining}, " in md for r in cited)
  assert "| b16.npz | paper/cifar10 | paper | 0.01 | 90.00 |" in md
  assert "- b16.npz on vtab1k/dmlab: failed: why" in md


def test_list_prints_every_vtab_task_as_json(capsys):
  assert transfer.main(["--list", "vtab1k", "--format", "json"]) == 0
  listed = json.loads(capsys.readouterr().out)
  assert len(listed) == 19
  assert {"name", "tfds_name", "label", "train", "minitrain", "minival", "test",
          "num_classes"} <= set(listed[0])


def test_a_dry_run_prints_each_run(tiny_npz, capsys):
  assert transfer.main([tiny_npz, "--suite", "vtab1k/cifar100,fashion_mnist", "--dry_run",
                        "--lr_grid", "0.001,0.01"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 6 and all(line.startswith("vit-train --config finetune:") for line in lines)
  assert "--config.data.name=task:vtab1k/cifar100" in lines[0]
  assert "--config.optimizer.lr=0.001" in lines[0] and "--config.data.eval_split=" in lines[0]
  assert lines[2].endswith("# --config.optimizer.lr: the rate chosen on minival")


def test_an_image_folder_is_a_task_with_vtab_splits(digits_folder):
  """minitrain and minival cut the train folder's first 1,000 examples in its reading order,
  as TFDS slices a split; the task is named by the folder's absolute path."""
  [task] = tasks.resolve_or_custom(digits_folder)
  assert (task.name, task.suite, task.tfds_name) == (digits_folder, "custom", digits_folder)
  source = sources.get_source(task.tfds_name, None, False, "fail")
  images = {split: list(sources.load_table(source, split, 0, 1, decoded=False)["image"])
            for split in (task.minitrain, task.minival, task.train, task.test, "train",
                          "train[-10%:]")}
  assert [len(images[s]) for s in images] == [800, 200, 1000, 297, 1500, 150]
  assert images[task.minitrain] + images[task.minival] == images[task.train]
  assert images["train"][:1000] == images[task.train]
  assert images["train"][-150:] == images["train[-10%:]"]
  with pytest.raises(ValueError, match="is empty"):
    source.meta("train[1500:]")
  with pytest.raises(ValueError, match=r"expected FOLDER or FOLDER\[START:STOP\]"):
    source.meta("train[:10]+test")


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
           "--image_size=28", "--batch_size=32", "--steps=30", "--data_dir", data_dir]
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # The jobs'.
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


FAKE_SBATCH = """#!{python}
import json, os, sys
with open(os.environ["SBATCH_LOG"], "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\\n")
print(f"{{sum(1 for _ in open(os.environ['SBATCH_LOG'])) + 100}};cluster")
"""


def test_slurm_gets_a_job_per_task_and_a_report_after_them(tmp_path, tiny_npz, monkeypatch,
                                                          capfd):
  """Submitted through an sbatch that records its arguments: the printed script submits the
  same jobs, the report's job waits for the ids sbatch gave."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(python=sys.executable))
  (bin_dir / "sbatch").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  flags = [tiny_npz, "--suite", "vtab1k/dtd,fashion_mnist", "--out_dir", str(tmp_path / "out"),
           "--steps=30", "--launch", "slurm"]
  submitted = []
  for dry in (False, True):
    log = tmp_path / f"sbatch_{dry}.jsonl"
    monkeypatch.setenv("SBATCH_LOG", str(log))
    capfd.readouterr()
    assert transfer.main([*flags, *(["--dry_run"] if dry else []), "--",
                          "--partition", "gpu"]) == 0
    if dry:
      subprocess.run(["bash", "-e", "-c", capfd.readouterr().out], check=True)
    submitted.append([json.loads(line) for line in log.read_text().splitlines()])
  assert submitted[0] == submitted[1]
  *tasks_, report_job = submitted[0]
  wraps = [shlex.split(job[job.index("--wrap") + 1]) for job in tasks_]
  assert [w[w.index("--suite") + 1] for w in wraps] == ["vtab1k/dtd", "fashion_mnist"]
  assert all(w[1:4] == ["-m", "vit_jax.tools.transfer", tiny_npz] for w in wraps)
  assert all("--partition=gpu" in job and "--gpus-per-node=8" in job for job in tasks_)
  assert "--dependency=afterany:101:102" in report_job
  assert shlex.split(report_job[-1])[3:] == ["--report_only", "--out_dir", str(tmp_path / "out")]


def test_tpu_vms_each_run_their_share_then_the_report(tiny_npz, capfd):
  flags = ["augreg:B_16", "--suite", "vtab1k/dtd,vtab1k/svhn,fashion_mnist", "--out_dir",
           "gs://b/vtab", "--launch", "tpu_vm", "--dry_run", "--", "--names", "vit-a,vit-b",
           "--zone", "us-central2-b", "--accelerator-type"]
  assert transfer.main([*flags, "v4-8"]) == 0
  chains = [shlex.split(line) for line in capfd.readouterr().out.splitlines()]
  assert [c[c.index("ssh") + 1] for c in chains] == ["vit-a", "vit-b"]
  remote = [shlex.split(c[c.index("--command") + 1]) for c in chains]
  shares = [shlex.split(r[r.index("-c") + 1]) for r in remote]
  suites = [[s[i + 1] for i, w in enumerate(s) if w == "--suite"] for s in shares]
  assert suites == [["vtab1k/dtd", "fashion_mnist"], ["vtab1k/svhn"]]
  assert all(s[-3:] == ["--report_only", "--out_dir", "gs://b/vtab"] for s in shares)
  assert transfer.main([*flags, "v4-32"]) == cli.USAGE  # A pod slice: 4 workers.
  assert "single-host TPU VMs" in capfd.readouterr().err
  assert transfer.main([tiny_npz, *flags[1:4], "/tmp/vtab", *flags[5:], "v4-8"]) == cli.USAGE
  assert f"on this machine: {tiny_npz}" in capfd.readouterr().err


def _task_rows(out_dir, task: str) -> list[dict[str, str]]:
  rows = [r for p in pathlib.Path(out_dir).glob("*/*/rows.csv") for r in csv.DictReader(open(p))]
  return [r for r in rows if r["task"] == task]


@pytest.mark.slow
def test_sigterm_stops_a_sweep_after_saving_and_the_rerun_completes_it(
    tmp_path, dataset, digits_folder, tiny_npz):
  """SIGTERM (a pre-emption) while a two-task sweep trains its first task: that task saves and
  writes no row, the second never starts, the status is 143; the rerun resumes the first from
  its checkpoint and runs the second, and no row says failed."""
  _, data_dir = dataset
  flags = [tiny_npz, "--suite", f"fashion_mnist,{digits_folder}", "--out_dir", str(tmp_path),
           "--image_size=28", "--batch_size=16", "--steps=150", "--lr_grid=0.1",
           "--data_dir", data_dir]
  proc = subprocess.Popen([sys.executable, "-m", "vit_jax.tools.transfer", *flags],
                          env=cpu_env(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  training = lambda: list(tmp_path.glob("*/fashion_mnist/**/events.out.tfevents.*"))  # noqa
  t0 = time.time()
  while not training():
    assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()[1][-3000:]
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)  # The job's handler is in place once its events file is.
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 143, stderr[-3000:]
  step = int(re.search(r"Stopped: saved step (\d+)", stderr)[1])
  assert 0 < step < 150
  [last] = stderr.strip().splitlines()[-1:]
  assert re.fullmatch(rf"stopped by SIGTERM after saving step {step} to \S+; rerun the same "
                      "command to resume", last), stderr[-3000:]
  assert _task_rows(tmp_path, "fashion_mnist") == [] == _task_rows(tmp_path, digits_folder)
  assert not list(tmp_path.glob(f"*/{pathlib.Path(digits_folder).name}*"))

  assert transfer.main(flags) == 0
  rows = _task_rows(tmp_path, "fashion_mnist") + _task_rows(tmp_path, digits_folder)
  assert [(r["task"], r["phase"], r["status"]) for r in rows] == [
      ("fashion_mnist", "test", "ok"), (digits_folder, "test", "ok")]
  resumed = read_scalars(rows[0]["workdir"], "train_loss", newest_file_only=True)
  assert min(resumed) > step and max(resumed) == 150  # From the saved step, not from 0.


def test_a_signal_between_jobs_stops_the_sweep_before_the_next(monkeypatch, tmp_path, tiny_npz):
  """SIGTERM that arrives after one job has ended: no further job starts, and the command's
  status says so (143) instead of 0."""
  started, handler = [], signal.getsignal(signal.SIGTERM)

  def job_then_signal(job, settings, described, out_dir):
    started.append(job.task.name)
    os.kill(os.getpid(), signal.SIGTERM)  # Caught: the sweep's handler only notes it.
    row = {"checkpoint": job.checkpoint, "task": job.task.name, "phase": job.phase,
           "lr": protocol.format_lr(job.lr), "accuracy": "0.5", "status": "ok"}
    results.append(protocol.task_dir(out_dir, job.checkpoint, job.task), row)
    return row

  monkeypatch.setattr(sweep, "run_fine_tune", job_then_signal)
  suite = tasks.resolve_or_custom("fashion_mnist,mnist")
  with pytest.raises(stop_signals.Interrupted) as stopped:
    sweep.run([tiny_npz], suite, transfer.settings_of(transfer.parse_args(
        [tiny_npz, "--suite", "fashion_mnist", "--lr_grid=0.1", "--out_dir", str(tmp_path)])),
        str(tmp_path), log=print)
  assert started == ["fashion_mnist"] and stopped.value.exit_status == 143
  assert signal.getsignal(signal.SIGTERM) == handler  # Put back as it was.


def test_a_rerun_row_replaces_the_failed_one_of_the_same_run(tmp_path):
  row = {"checkpoint": "c.npz", "task": "t", "phase": "test", "lr": "0.1"}
  results.append(str(tmp_path), row | {"status": "failed: OSError: gone"})
  results.append(str(tmp_path), row | {"lr": "0.01", "status": "ok"})
  results.append(str(tmp_path), row | {"accuracy": "0.9", "status": "ok"})
  assert [(r["lr"], r["status"]) for r in results.task_rows(str(tmp_path))] == [
      ("0.01", "ok"), ("0.1", "ok")]
