"""The ViT paper's published accuracies: names this repo knows, numbers as the paper prints
them (spot checks, and the tables' own sums and overlaps), and lookup's filtering."""
import collections

import pytest

from vit_jax import models
from vit_jax.data import tasks
from vit_jax.evaluators import registry as evaluators
from vit_jax.transfer import paper_results
from vit_jax.transfer.paper_results import RESULTS, VTAB_TASKS, lookup

VTAB_SUMMARIES = {"vtab1k/mean", "vtab1k/natural", "vtab1k/specialized", "vtab1k/structured"}
TABLES = {"ViT paper, Table 2", "ViT paper, Table 5", "ViT paper, Table 9"}


def _one(model: str, task: str, pretraining: str, table: str) -> float:
  found = [r.accuracy for r in lookup(model, task, pretraining) if r.table == table]
  assert len(found) == 1, (model, task, pretraining, table, found)
  return found[0]


def test_every_entry_names_a_registry_model_a_task_and_a_percentage():
  known_tasks = set(tasks.TASKS) | {"imagenet_real"} | VTAB_SUMMARIES
  assert "imagenet_real" in evaluators.EVALUATORS  # A config.evals type: the run evaluates it.
  for r in RESULTS:
    assert r.model in models.MODEL_CONFIGS, r
    assert r.task in known_tasks, r
    assert r.pretraining in paper_results.PRETRAININGS, r
    assert r.table in TABLES, r
    assert 0 < r.accuracy <= 100, r


def test_one_entry_per_model_pretraining_task_and_table():
  keys = collections.Counter((r.model, r.pretraining, r.task, r.table) for r in RESULTS)
  assert not [k for k, n in keys.items() if n > 1]
  per_table = collections.Counter(r.table for r in RESULTS)
  # Table 2: 3 columns x 7 rows; Table 5: 6 tasks x (4 + 5 + 5) models; Table 9: 3 x (19 + 1).
  assert per_table == {"ViT paper, Table 2": 21, "ViT paper, Table 5": 84,
                       "ViT paper, Table 9": 60}


def test_vtab_columns_are_the_repos_19_tasks():
  assert len(VTAB_TASKS) == len(set(VTAB_TASKS)) == 19
  assert {f"vtab1k/{t}" for t in VTAB_TASKS} == set(tasks.SUITES["vtab1k"])


@pytest.mark.parametrize("model,pretraining", [
    ("ViT-H_14", "jft300m"), ("ViT-L_16", "jft300m"), ("ViT-L_16", "imagenet21k")])
def test_table9_mean_is_the_mean_of_its_19_tasks(model, pretraining):
  per_task = [_one(model, f"vtab1k/{t}", pretraining, "ViT paper, Table 9") for t in VTAB_TASKS]
  printed = _one(model, "vtab1k/mean", pretraining, "ViT paper, Table 9")
  assert sum(per_task) / 19 == pytest.approx(printed, abs=0.1)
  # Table 2 prints the same VTAB score with two decimals.
  assert _one(model, "vtab1k/mean", pretraining, "ViT paper, Table 2") == pytest.approx(
      printed, abs=0.05)


@pytest.mark.parametrize("task", [
    "paper/cifar10", "paper/cifar100", "paper/oxford_iiit_pet", "paper/oxford_flowers102"])
def test_tables_2_and_5_agree_on_vit_h14_jft(task):
  assert _one("ViT-H_14", task, "jft300m", "ViT paper, Table 2") == _one(
      "ViT-H_14", task, "jft300m", "ViT paper, Table 5")


@pytest.mark.parametrize("model,task,pretraining,table,accuracy", [
    ("ViT-H_14", "paper/imagenet2012", "jft300m", "ViT paper, Table 2", 88.55),
    ("ViT-L_16", "imagenet_real", "jft300m", "ViT paper, Table 2", 90.54),
    ("ViT-L_16", "paper/oxford_iiit_pet", "imagenet21k", "ViT paper, Table 2", 94.67),
    ("ViT-L_16", "vtab1k/mean", "imagenet21k", "ViT paper, Table 2", 72.72),
    ("ViT-B_16", "paper/imagenet2012", "imagenet2012", "ViT paper, Table 5", 77.91),
    ("ViT-L_32", "imagenet_real", "imagenet21k", "ViT paper, Table 5", 85.65),
    ("ViT-H_14", "paper/oxford_flowers102", "imagenet21k", "ViT paper, Table 5", 99.51),
    ("ViT-B_32", "paper/cifar100", "jft300m", "ViT paper, Table 5", 90.49),
    ("ViT-H_14", "vtab1k/smallnorb_azimuth", "jft300m", "ViT paper, Table 9", 33.2),
    ("ViT-L_16", "vtab1k/kitti_distance", "jft300m", "ViT paper, Table 9", 82.2),
    ("ViT-L_16", "vtab1k/clevr_count", "imagenet21k", "ViT paper, Table 9", 70.3),
])
def test_spot_checks(model, task, pretraining, table, accuracy):
  assert _one(model, task, pretraining, table) == accuracy


def test_table2_notes_carry_the_spread_and_imagenet_resolution():
  h14 = lookup("ViT-H_14", "paper/imagenet2012", "jft300m")[0]
  assert h14.table == "ViT paper, Table 2"
  assert "± 0.04" in h14.note and "518 px" in h14.note
  assert "± 0.00" in lookup("ViT-L_16", "paper/oxford_flowers102", "jft300m")[0].note


def test_lookup_filters_on_model_task_and_pretraining():
  every = lookup("ViT-H_14", "paper/imagenet2012")
  assert [(r.pretraining, r.table, r.accuracy) for r in every] == [
      ("jft300m", "ViT paper, Table 2", 88.55),
      ("imagenet21k", "ViT paper, Table 5", 85.13),
      ("jft300m", "ViT paper, Table 5", 88.04)]
  assert [r.accuracy for r in lookup("ViT-H_14", "paper/imagenet2012", "jft300m")] == [
      88.55, 88.04]
  assert lookup("ViT-H_14", "paper/imagenet2012", "imagenet2012") == []
  assert lookup("ViT-B_16", "vtab1k/dtd") == []
  assert lookup("ViT-B_8", "paper/cifar10") == []
  assert {r.pretraining for r in lookup("ViT-B_32", "paper/cifar10")} == set(
      paper_results.PRETRAININGS)
