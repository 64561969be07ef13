"""Fine-tuning from released checkpoints, end to end: from the Hugging Face Hub (a timm repo
written offline by helpers.timm_repo, with torch loaded before TensorFlow for its
vit_jax.models.timm_models: see conftest.py), taking its GELU, fc_norm and normalisation; and
from the AugReg zoo (`augreg:Ti_16`), then a few-shot sweep over both checkpoints."""
import csv
import os

import pytest

from helpers import AUGREG_TINY as TINY
from helpers import SIZE, TI, timm_repo, tiny_config, write_repo
from vit_jax.checkpoint import description, loader
from vit_jax.tools import fewshot
from vit_jax.train import loop


@pytest.mark.slow
def test_fine_tuning_from_the_hub_takes_its_gelu_fc_norm_and_normalisation(tmp_path, hub_cache,
                                                                         dataset):
  from helpers import tiny_config
  from vit_jax.train import loop, run_setup
  _, folder, config = timm_repo(tmp_path, "gap_fc_norm")
  write_repo(hub_cache, "timm/gap", {f: folder / f for f in os.listdir(folder)})
  tiny_vit = dict(patch_size=16, hidden_size=192, mlp_dim=768, num_heads=3, num_layers=2,
                  classifier="gap")
  c = tiny_config(dataset, total_steps=2, pretrained="hf-hub:timm/gap", **{
      "data.image_size": SIZE, **{f"model.{k}": v for k, v in tiny_vit.items()}})
  loop.train_and_evaluate(c, str(tmp_path / "ft"))
  d = loader.describe(str(tmp_path / "ft"))
  assert (d.model["gelu"], d.model["fc_norm"], d.parent) == ("exact", True, "hf-hub:timm/gap")
  cfg = config["pretrained_cfg"]
  assert (d.preprocessing.mean, d.preprocessing.std) == (tuple(cfg["mean"]), tuple(cfg["std"]))
  # A config that says otherwise is refused, naming the field.
  c = tiny_config(dataset, pretrained="hf-hub:timm/gap", **{"model.gelu": "tanh"})
  with pytest.raises(description.DescriptionMismatch, match="config.model.gelu 'tanh'"):
    run_setup.inherit_model_fields(c, loader.describe("hf-hub:timm/gap"))


# Starting work from `augreg:`: fine-tune a few steps, few-shot sweep, through the entry points.
@pytest.mark.usefixtures("hub_offline")  # As for every test of test_zoo.py: no network.
def test_finetune_and_fewshot_from_augreg(zoo_dir, tmp_path, monkeypatch, digits_folder):
  monkeypatch.setenv("VIT_JAX_AUGREG_DIR", zoo_dir)
  monkeypatch.setenv("VIT_JAX_CACHE", str(tmp_path / "cache"))
  c = tiny_config((digits_folder, None), total_steps=4, checkpoint_every_steps=4, cpu_devices=1,
                  pretrained="augreg:Ti_16", **{f"model.{k}": v for k, v in TINY.items()},
                  **{"model.patch_size": 16, "data.image_size": 32, "data.eval_split": "test"})
  metrics = loop.train_and_evaluate(c, str(tmp_path / "ft"))
  assert metrics["num_examples"] == 297  # The digits' test split, every example once.
  cached = tmp_path / "cache" / "augreg" / f"{TI}.npz"
  assert cached.is_file()  # Fetched once; the sweep below reads the cache.
  out_dir = tmp_path / "sweep"
  code = fewshot.main(["augreg:Ti_16", str(tmp_path / "ft"), f"--datasets={digits_folder}",
                       "--image_size=32", "--shots=1,5", "--seeds=2", f"--out_dir={out_dir}"])
  assert code == 0
  rows = list(csv.DictReader(open(out_dir / "fewshot.csv")))
  assert {r["checkpoint"] for r in rows} == {"augreg:Ti_16", str(tmp_path / "ft")}
  assert all(0.0 <= float(r["mean"]) <= 1.0 for r in rows) and len(rows) == 4
