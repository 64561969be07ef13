"""notebooks/finetune_fewshot.ipynb run top to bottom on a tiny ViT pre-trained here: few-shot
sweep, a short fine-tuning run, export, the two compared (committed without outputs:
test_notebooks.py); the representation it probes is the one asked for. Both runs share one
kernel, its namespace emptied before each (helpers.notebook_kernel)."""
import json
import math

import pytest
from nbclient.exceptions import CellExecutionError

from helpers import REPO, notebook_kernel, tiny_config
from vit_jax.checkpoint import loader, npz as npz_lib
from vit_jax.train import loop


NOTEBOOK = REPO / "notebooks" / "finetune_fewshot.ipynb"
TINY = dict(patch_size=7, hidden_size=64, mlp_dim=128, num_heads=4, num_layers=2)


def small_run(dataset, pretrained_npz: str, **params: str) -> dict[str, str]:
  """The notebook's parameters for a few seconds' run on the tiny model, and `params`."""
  name, data_dir = dataset
  return dict(
      VIT_PRETRAINED=pretrained_npz, VIT_MODEL="ViT-Ti_16", VIT_MODEL_OVERRIDES=json.dumps(TINY),
      VIT_DATASET=name, VIT_DATA_DIR=data_dir, VIT_DOWNLOAD="0", VIT_TRAIN_SPLIT="train[:1000]",
      VIT_TEST_SPLIT="test[:500]", VIT_IMAGE_SIZE="28", VIT_WARMUP_STEPS="2",
      VIT_BATCH_SIZE="64",
      VIT_CONFIG_OVERRIDES='{"data.train_crop": "resize", "data.flip": false}') | params


@pytest.fixture(scope="module")
def pretrained_npz(dataset, tmp_path_factory):
  """A tiny ViT (tests/tiny_config.py, wider, mean-pooled) trained for 150 steps on MNIST
  (else Fashion-MNIST), exported: its few-shot accuracy rises clearly from 1 to 10 shots.
  Trained on one of the session's 8 devices: the notebook is the question, not sharding."""
  workdir = tmp_path_factory.mktemp("pretrain")
  c = tiny_config(dataset, total_steps=150, checkpoint_every_steps=150, log_every_steps=50,
                  cpu_devices=1, **{f"model.{k}": v for k, v in TINY.items()},
                  **{"model.classifier": "gap", "data.train_split": "train[:4800]"})
  loop.train_and_evaluate(c, str(workdir))
  npz = str(workdir / "pretrained.npz")
  loader.export_npz(str(workdir), npz)
  return npz


@pytest.fixture(scope="module")
def kernel():
  with notebook_kernel() as run:
    yield run


@pytest.mark.slow
def test_finetune_notebook_runs_top_to_bottom(kernel, dataset, pretrained_npz, tmp_path):
  out_dir, workdir = tmp_path / "out", tmp_path / "ft"
  nb = kernel(NOTEBOOK, **small_run(
      dataset, pretrained_npz, VIT_SHOTS="1,5,10", VIT_SEEDS="3",
      VIT_REPRESENTATION="patch_mean",  # The mean-pooled model's pre-logits.
      VIT_STEPS="20", VIT_WORKDIR=str(workdir), VIT_OUT_DIR=str(out_dir)))
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  pictures = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(pictures) == 3  # Few-shot, loss curve, both checkpoints.
  tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert len(tables) == 1 and "| fine-tuned | 28px |" in tables[0]

  results = json.loads((out_dir / "results.json").read_text())
  assert results["representation"] == "patch_mean"
  pre, fine = results["fewshot"]["pretrained"], results["fewshot"]["finetuned"]
  assert [r["shots"] for r in pre] == [r["shots"] for r in fine] == [1, 5, 10]
  means = [r["mean"] for r in pre]
  assert means[0] < means[1] < means[2], pre
  assert means[2] > 0.3  # Ten classes: chance is 0.1.
  assert all(len(r["accuracies"]) == 3 and 0 <= r["mean"] <= 1 for r in pre + fine)

  ft = results["finetune"]
  assert ft["steps"] == 20 and (workdir / "checkpoints" / "20").is_dir()
  assert len(ft["train_loss"]) == 20 and all(math.isfinite(v) for v in ft["train_loss"].values())
  assert ft["metrics"]["num_examples"] == 500 and ft["accuracy"] == ft["metrics"]["accuracy"] > 0.5
  # It started from the checkpoint: same ten classes, so the head was kept, not zeroed (ln 10).
  assert ft["train_loss"]["1"] < math.log(10) - 0.5
  # The export holds the fine-tuned model: mean-pooled as the checkpoint (which the fine-tuning
  # config took from it), a 4x4 patch grid without a class token, the 10-class head.
  assert results["finetuned"] == str(out_dir / "finetuned.npz")
  flat = npz_lib.load_npz_flat(results["finetuned"])
  assert "cls" not in flat and flat[npz_lib.POSEMB_KEY].shape == (1, 16, 64)
  assert flat["head/kernel"].shape == (64, 10)


@pytest.mark.slow
def test_finetune_notebook_probes_the_representation_asked_for(kernel, dataset, pretrained_npz,
                                                               tmp_path):
  """The mean-pooled checkpoint has no class token: the probe refuses before reading data."""
  with pytest.raises(CellExecutionError, match="representation 'class_token': the model has no "
                                               "class token"):
    kernel(NOTEBOOK, **small_run(
        dataset, pretrained_npz, VIT_REPRESENTATION="class_token", VIT_SHOTS="1", VIT_SEEDS="1",
        VIT_STEPS="2", VIT_WORKDIR=str(tmp_path)))
