"""Fine-tuning from the Hub, end to end, for each family the layouts read: timm's DINOv2 with
registers and CLIP, timm's eva.py DINOv3 and EVA-02, OpenCLIP. The run takes the model from the
repo's description (no model flag), trains with layer decay, frozen blocks and EMA, or LoRA on
every target, over the families' own parameter names (LayerScale, SwiGLU, no key bias), and
what it saves reads back as the description says; `vit-transfer` and `vit-train --compile_only`
take the repo's model too."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import (REPO, TINY_CONFIG_VIT, assert_finetuning_loads_the_file, needs_libtpu,
                     run_inspect, tiny_config, write_repo)
from vit_jax import models
from vit_jax.checkpoint import loader, npz
from vit_jax.models import lora, timm_models  # noqa: F401  (conftest: torch before TensorFlow)
from vit_jax.tools import transfer
from vit_jax.train import loop

# family: (the repo's builder, image size of the fine-tuning run, LoRA or not).
FAMILIES = {
    "dinov2_reg4": ("timm_vit", 56, False),
    "clip_quickgelu": ("timm_vit", 32, False),
    "dinov3": ("timm_eva", 32, True),
    "eva02_in1k": ("timm_eva", 24, True),
    "open_clip": ("open_clip", 32, False),
}
FROZEN = "Transformer/encoderblock_0/.*"
SHARED = (models.Role.ARCHITECTURE, models.Role.LAYOUT, models.Role.COMPUTATION)


def write_family_repo(tmp_path, hub_cache, family: str) -> str:
  """A tiny repo of `family` with random weights in the offline Hub cache; its spec."""
  builder = FAMILIES[family][0]
  if builder == "timm_vit":
    import test_layouts_dinov2_clip
    _, folder, _ = test_layouts_dinov2_clip.timm_repo(tmp_path, family)
  elif builder == "timm_eva":
    import test_timm_eva
    folder = tmp_path / family
    test_timm_eva.save(test_timm_eva.timm_model(family), folder)
  else:
    import test_layouts_open_clip
    folder = test_layouts_open_clip.open_clip_repo(tmp_path)
  write_repo(hub_cache, f"org/{family}", {f: folder / f for f in os.listdir(folder)})
  return f"hf-hub:org/{family}"


def flat(params) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in npz.flatten(params).items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fine_tuning_a_family_from_the_hub(family, tmp_path, hub_cache, dataset):
  spec = write_family_repo(tmp_path, hub_cache, family)
  _, size, with_lora = FAMILIES[family]
  parent = loader.describe(spec)
  tuning = {"lora.rank": 2, "lora.targets": lora.TARGETS} if with_lora else {
      "optimizer.layer_decay": 0.75, "optimizer.frozen": (FROZEN,)}
  # One of the session's 8 devices: the family's loading and training are the question here
  # (sharded fine-tuning from the Hub: test_e2e_pretrained); 17% less CPU.
  c = tiny_config(dataset, total_steps=3, checkpoint_every_steps=3, pretrained=spec,
                  cpu_devices=1, ema_decay=0.5, **tuning,
                  **{"data.image_size": size,  # What 3 steps of 32 read, and one eval batch.
                     "data.train_split": "train[:96]", "data.eval_split": "test[:32]"})
  c.model.update({f: None for f in TINY_CONFIG_VIT})  # The repo's architecture, unflagged.
  metrics = loop.train_and_evaluate(c, str(tmp_path / "ft"))
  assert np.isfinite(metrics["loss"])

  run = loader.load(str(tmp_path / "ft"))
  d = run.description
  assert d.parent == spec and d.image_size == size and d.num_classes == 10
  for field in models.registry.fields_of(*SHARED):  # Shapes, layout, numerics: the repo's.
    default = models.registry.default(field)
    assert d.model.get(field, default) == parent.model.get(field, default), field
  start, tuned = flat(loader.load(spec, image_size=size).params), flat(run.params)
  ema = flat(loader.load("ema:" + str(tmp_path / "ft")).params)
  assert set(ema) == set(tuned) and any(not np.array_equal(ema[k], tuned[k]) for k in tuned)
  body = [k for k in tuned if not k.startswith("head/")]
  assert set(body) <= set(start)
  changed = {k for k in body if not np.array_equal(tuned[k], start[k])}
  if with_lora:  # Merged: each adapted kernel moved, nothing else.
    adapted = {k for k in body if "/encoderblock_" in k and k.endswith("/kernel")
               and k.split("/")[-2] in lora.TARGETS}
    assert changed == adapted and len(adapted) == 6 * run.model.num_layers
  else:  # Block 0 frozen, every other array moved (LayerScale with its block).
    assert not {k for k in changed if k.startswith("Transformer/encoderblock_0/")}
    assert {k for k in body if not k.startswith("Transformer/encoderblock_0/")} == changed


@needs_libtpu
def test_compile_only_builds_the_model_the_hub_repo_describes(tmp_path, hub_cache):
  spec = write_family_repo(tmp_path, hub_cache, "dinov2_reg4")
  result = subprocess.run(
      [sys.executable, "-m", "vit_jax.tools.train", "--config=finetune:s16,cifar10",
       f"--config.pretrained={spec}", "--config.data.image_size=56", "--config.batch_size=8",
       "--compile_only", "--topology=v5litepod-4", "--json"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  r = json.loads(result.stdout)
  assert r["fits"] and r["pretrained"] == spec
  fields = r["model_fields"]
  assert (fields["patch_size"], fields["hidden_size"], fields["num_registers"]) == (14, 128, 4)
  assert fields["layer_scale"] and fields["gelu"] == "exact"


@pytest.mark.slow
def test_vit_transfer_runs_the_protocol_from_a_hub_repo(tmp_path, hub_cache, digits_folder):
  spec = write_family_repo(tmp_path, hub_cache, "dinov3")
  out = tmp_path / "sweep"
  assert transfer.main([spec, "--suite", digits_folder, "--out_dir", str(out), "--image_size=32",
                        "--batch_size=32", "--steps=8", "--lr_grid=0.03"]) == 0
  [row] = list(csv.DictReader(open(out / "results.csv")))
  assert (row["checkpoint"], row["phase"], row["status"]) == (spec, "test", "ok")
  run = loader.describe(row["workdir"])
  assert (run.parent, run.model["rope"], run.model["num_registers"]) == (spec, "dinov3", 4)


def test_vit_inspects_fine_tuning_command_needs_no_model_flag(tmp_path, hub_cache, capsys,
                                                                 monkeypatch):
  spec = write_family_repo(tmp_path, hub_cache, "dinov2_reg4")
  rc, out, _ = run_inspect(capsys, spec)
  command = out.split("fine-tune      ")[1].splitlines()[0]
  assert rc == 0 and "--config.model." not in command
  c = assert_finetuning_loads_the_file(command, monkeypatch)
  assert (c.model.patch_size, c.model.num_registers, c.model.layer_scale) == (14, 4, True)


def test_vit_predict_refuses_a_clip_tower_in_one_line(tmp_path, hub_cache, capsys):
  from PIL import Image
  from vit_jax.tools import predict
  spec = write_family_repo(tmp_path, hub_cache, "clip_quickgelu")
  Image.new("RGB", (40, 40), (120, 30, 200)).save(tmp_path / "a.png")
  rc = predict.main([spec, str(tmp_path / "a.png")])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "CLIP's projection to 5-d" in err, err
