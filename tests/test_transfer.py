"""vit-transfer: the protocol's jobs and learning-rate choice, a sweep end to end on
Fashion-MNIST (selection on minival, the final run on test, a failing task named while the
others run, a rerun that skips what is done), the task list and the dry run."""
import csv
import json

import jax
import numpy as np
import pytest

from vit_jax import checkpoint, models
from vit_jax.data import tasks
from vit_jax.tools import transfer
from vit_jax.transfer import paper_results, protocol, report

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
  select, final = protocol.jobs("c.npz", task, settings, "/out")[:2], protocol.jobs(
      "c.npz", task, settings, "/out", chosen=0.03)[-1]
  assert [(j.phase, j.lr) for j in select] == [("minival", 0.01), ("minival", 0.03)]
  assert (final.phase, final.lr) == ("test", 0.03)
  assert len({j.workdir for j in select + [final]}) == 3
  assert protocol.jobs("c.npz", task, protocol.Settings(lr_grid=(0.01,)), "/out") == [
      protocol.Job("c.npz", task, "test", 0.01, protocol.run_dir("/out", "c.npz", task, "test",
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


@pytest.mark.slow
def test_a_sweep_chooses_the_rate_goes_past_a_failure_and_resumes(tmp_path, dataset, tiny_npz,
                                                                  capsys):
  _, data_dir = dataset
  flags = [tiny_npz, "--suite", "vtab1k/dtd,fashion_mnist", "--out_dir", str(tmp_path),
           "--image_size=28", "--batch_size=32", "--steps=30", "--lr_grid=0.0001,0.1",
           "--data_dir", data_dir]
  assert transfer.main(flags) == 1  # dtd is not in data_dir: named, the others run.
  out = capsys.readouterr().out
  assert "vtab1k/dtd" in out and "not prepared" in out
  with open(tmp_path / "results.csv") as f:
    rows = [r for r in csv.DictReader(f) if r["task"] == "fashion_mnist"]
  assert [(r["phase"], r["lr"], r["status"]) for r in rows] == [
      ("minival", "0.0001", "ok"), ("minival", "0.1", "ok"), ("test", "0.1", "ok")]
  assert float(rows[1]["accuracy"]) > float(rows[0]["accuracy"])
  assert float(rows[2]["accuracy"]) > 0.2  # Chance: 0.1; 30 steps from a random init.
  assert "fashion_mnist | custom | 0.1 |" in (tmp_path / "results.md").read_text()
  assert (tmp_path / "results.png").stat().st_size > 0

  # Killed before the final run's row was written: a rerun runs that one (its workdir is
  # complete, so it reports its result) and the failed task again, nothing else.
  with open(tmp_path / "results.csv") as f:
    lines = f.readlines()
  (tmp_path / "results.csv").write_text("".join(l for l in lines if ",test,0.1," not in l))
  assert transfer.main(flags) == 1
  with open(tmp_path / "results.csv") as f:
    after = list(csv.DictReader(f))
  assert [r["task"] for r in after].count("fashion_mnist") == 3
  assert [r["task"] for r in after].count("vtab1k/dtd") == 2
