"""vit-transfer (tools/transfer.py, vit_jax/transfer/): the protocol's jobs and learning-rate
choice, the report, the task list and the dry run, an image folder as a task, jobs handed to
Slurm and TPU VMs, a signal between jobs, rows of a rerun (sweeps end to end on
Fashion-MNIST: test_e2e_transfer.py)."""
import errno
import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

from vit_jax.data import sources, tasks
from vit_jax.tools import cli, transfer
from vit_jax.train import stop_signals
from vit_jax.transfer import paper_results, protocol, report, results, sweep


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
  # The recipe's 384 px fitted to the file's patches of 7 (384 would refuse every run).
  assert all("--config.data.image_size=385 " in line for line in lines), lines[0]


STRIDES = {"ViT-B_16": 384, "ViT-H_14": 378, "ViT-B_32": 384, "R50+ViT-B_16": 384,
           "R26+ViT-S_32": 384}


@pytest.mark.parametrize("name, size", STRIDES.items(), ids=STRIDES)
def test_the_recipes_resolution_fits_the_models_patch_stride(name, size):
  """Each run's images split into whole tokens: 384 px where the stride divides it, else the
  nearest multiple of the stride (ViT-H/14: 378; at 384 every run of an H/14 was refused);
  --image_size as given."""
  from vit_jax import models
  from vit_jax.checkpoint import description
  described = description.Description(model=models.model_config(name), model_name=name,
                                      image_size=224, num_classes=10)
  task = tasks.resolve_or_custom("fashion_mnist")[0]
  ft = protocol.fine_tunes("c.npz", task, protocol.Settings(lr_grid=(0.01,)), "/out")[0]
  got = protocol.overrides(ft, protocol.Settings(lr_grid=(0.01,)), described)
  assert got["data.image_size"] == size and size % models.create_model(name).stride == 0
  given = protocol.overrides(ft, protocol.Settings(image_size=224, lr_grid=(0.01,)), described)
  assert given["data.image_size"] == 224


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
      subprocess.run(["bash", "-e", "-c", capfd.readouterr().out], check=True, timeout=60)
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

  monkeypatch.setattr(sweep, "fine_tune", job_then_signal)
  suite = tasks.resolve_or_custom("fashion_mnist,mnist")
  with pytest.raises(stop_signals.Interrupted) as stopped:
    sweep.transfer([tiny_npz], suite, transfer.settings_of(transfer.parse_args(
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


# Each report file of both sweeps: the test points the name its writer writes it under before
# putting it in place (results.replacing's) at a full device (/dev/full).
REPORTS = ("results.csv", "results.md", "results.png", "fewshot.csv", "fewshot.md",
           "fewshot.png")


@pytest.mark.parametrize("name", REPORTS)
def test_a_report_that_a_full_device_refuses_is_named(name, tmp_path, monkeypatch):
  """vit-transfer's and vit-fewshot's reports on a full disk: the error names the report (a
  write or close that fails said only '[Errno 28] No space left on device', the command's
  one line too)."""
  from vit_jax.transfer import fewshot_sweep
  monkeypatch.setattr(results.uuid, "uuid4", lambda: type("U", (), {"hex": "0" * 32}))
  out = tmp_path / "out"
  out.mkdir()
  if name.startswith("results"):
    results.append(protocol.task_dir(str(out), "b16.npz", tasks.get("paper/cifar10")), {
        "checkpoint": "b16.npz", "model": "ViT-B_16", "task": "paper/cifar10", "phase": "test",
        "group": "paper", "lr": "0.01", "accuracy": "0.9", "status": "ok"})
    write = lambda: report.write(str(out))  # noqa: E731
  else:
    write = lambda: fewshot_sweep.write_reports([dict(  # noqa: E731
        checkpoint="b16.npz", dataset="digits", shots=1, mean=0.5, std=0.0, l2=1.0,
        accuracies="0.5", representation="pre_logits")], {}, str(out))
  os.symlink("/dev/full", out / f".{name}.{'0' * 32}")
  with pytest.raises(OSError) as e:
    write()
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(out / name)), repr(e.value)
  assert not os.path.lexists(out / f".{name}.{'0' * 32}")  # The failed write's file removed.
  assert results.replaced(f".{name}.{'0' * 32}") == name
