"""The three workflows end to end on real data: pre-train on one half of Fashion-MNIST's
train split, export .npz, fine-tune on the other half at a higher resolution, few-shot
sweep over checkpoints. The runs train on one of the session's 8 devices (config.cpu_devices):
what they show is learning, and 8 simulated devices on two cores took 1.5x the CPU; sharded
runs are test_e2e_distributed's and the other end-to-end files'."""
import csv

import numpy as np
import pytest

from helpers import read_scalars, tiny_config
from vit_jax import configs
from vit_jax.checkpoint import loader, npz as npz_lib, run
from vit_jax.tools import fewshot
from vit_jax.train import loop

TINY = dict(patch_size=7, hidden_size=64, mlp_dim=128, num_heads=4, num_layers=2)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, dataset):
  """A tiny ViT pre-trained on the first half of Fashion-MNIST's train split, exported."""
  workdir = tmp_path_factory.mktemp("pretrain")
  c = tiny_config(dataset, total_steps=250, batch_size=64,
                  **{"data.train_split": "train[:30000]", "data.eval_split": "test[:500]",
                     "model.representation_size": 64,
                     **{f"model.{k}": v for k, v in TINY.items()},
                     "checkpoint_every_steps": 250, "log_every_steps": 50, "cpu_devices": 1})
  metrics = loop.train_and_evaluate(c, str(workdir))
  assert metrics["accuracy"] > 0.7
  npz = str(workdir / "pretrained.npz")
  described = loader.export_npz(str(workdir), npz)
  assert described.model["hidden_size"] == 64 and loader.describe(npz) == described
  return workdir, npz


def finetune_config(data_dir, pretrained=None):
  c = configs.get_config("finetune:ti16,fashion_mnist")
  c.model.update(**TINY)
  c.data.update(data_dir=data_dir, train_split="train[30000:]", image_size=42,
                train_crop="resize", flip=False, eval_split="test[:1000]")
  c.batch_size = 64
  c.total_steps = 80
  c.warmup_steps = 10
  c.log_every_steps = 40
  c.checkpoint_every_steps = 80
  c.pretrained = pretrained
  c.cpu_devices = 1
  return c


@pytest.mark.slow
def test_finetuning_beats_scratch_and_fewshot_rises_with_shots(tmp_path, pretrained, dataset):
  workdir, npz = pretrained
  data_dir = dataset[1]

  # The exported .npz loads back exactly.
  flat, _ = run.read_params(run.latest_step_dir(workdir))
  np.testing.assert_array_equal(npz_lib.load_npz_flat(npz)["embedding/kernel"],
                                flat["embedding/kernel"])

  finetuned = loop.train_and_evaluate(finetune_config(data_dir, npz), str(tmp_path / "ft"))
  scratch = loop.train_and_evaluate(finetune_config(data_dir), str(tmp_path / "scratch"))
  assert finetuned["accuracy"] > scratch["accuracy"] + 0.02, (finetuned, scratch)
  assert sorted(read_scalars(tmp_path / "ft", "train_loss")) == [40, 80]
  # Resolution 28 -> 42: the 4x4 position-embedding grid was resized to 6x6.
  key = "Transformer/posembed_input/pos_embedding"
  tuned, _ = run.read_params(run.latest_step_dir(tmp_path / "ft"))
  assert flat[key].shape[1] - 16 == tuned[key].shape[1] - 36 >= 0, (flat[key].shape,
                                                                    tuned[key].shape)

  out_dir = tmp_path / "sweep"
  step_dir = str(run.latest_step_dir(workdir))
  # Fails alone: the sweep goes on, writes the others' results, and its status says a job failed.
  (tmp_path / "broken.npz").write_bytes(b"not a checkpoint")
  code = fewshot.main([npz, step_dir, str(tmp_path / "broken.npz"), "--datasets=fashion_mnist",
                       f"--data_dir={data_dir}", "--train_split=train[:2000]",
                       "--test_split=test[:1000]", "--image_size=28", "--shots=1,5,25",
                       "--seeds=2", f"--out_dir={out_dir}"])
  assert code == 1
  rows = list(csv.DictReader(open(out_dir / "fewshot.csv")))
  for ckpt in (npz, step_dir):
    means = [float(r["mean"]) for r in rows if r["checkpoint"] == ckpt]
    assert len(means) == 3 and means[0] < means[1] < means[2], rows
  # The .npz (architecture inferred) and the orbax checkpoint give the same features.
  assert [r["mean"] for r in rows if r["checkpoint"] == npz] == [
      r["mean"] for r in rows if r["checkpoint"] == step_dir]
  table = (out_dir / "fewshot.md").read_text()
  assert "25-shot" in table and "broken.npz" in table and (out_dir / "fewshot.png").stat().st_size
