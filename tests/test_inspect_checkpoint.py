"""`vit-inspect` (tools/inspect_checkpoint.py): the report on every kind of checkpoint path, its
fine-tuning command, the figures, bad inputs, the mean attention distance it reports (a
training run's workdir: test_e2e_checkpoints.py)."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from helpers import (REPO, assert_finetuning_loads_the_file, big_vision_layout, cpu_env,
                     new_flax_layout, random_params, run_inspect)
from vit_jax import explore, inspection, models
from vit_jax.checkpoint import loader, npz
from vit_jax.tools import inspect_checkpoint as inspect_cli


TINY = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
HYBRID_TINY = dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2,
                   resnet_layers=(1, 1, 1, 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny ViT (not a registry architecture) with pre-logits: (trained-head file,
  zero-head file, its flat trained params)."""
  model = models.create_model("ViT-Ti_16", num_classes=10, representation_size=16, **TINY)
  root = tmp_path_factory.mktemp("inspect")
  trained, zero = root / "tiny.npz", root / "tiny_zero_head.npz"
  params = random_params(model, 28)
  npz.save_npz(str(trained), params)
  npz.save_npz(str(zero), model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"])
  return str(trained), str(zero), npz.flatten(params)


def test_the_model_distance_averages_over_all_images_in_any_batch_size(tiny):
  ckpt = loader.load(tiny[0])
  images = np.random.default_rng(0).uniform(-1, 1, (5, 28, 28, 3)).astype(np.float32)
  _, attention = explore.predict(ckpt, images)
  direct = explore.mean_attention_distance(attention, ckpt.grid, 7, True)
  for batch_size in (2, 5, 8):
    np.testing.assert_allclose(explore.model_attention_distance(ckpt, images, batch_size),
                               direct, rtol=1e-5)
  assert direct.shape == (2, 2) and (direct > 0).all()
  assert (direct < explore.patch_distances(ckpt.grid, 7).max()).all()


# The report.

def test_the_report_of_a_small_file(tiny, capsys, monkeypatch):
  rc, out, err = run_inspect(capsys, tiny[0])
  assert rc == 0 and not err
  lines = dict(line.split(None, 1) for line in out.splitlines() if line[:1] != " ")
  assert lines["model"].startswith("no registry name fits: patch_size=7 hidden_size=32")
  assert "resnet" not in lines["model"]
  assert "patch size     7 px" in out and "depth          2 layers" in out
  assert "learned, 4x4 grid: native resolution 28 px" in out
  assert "pre-logits     16 (tanh)" in out and "token (the class token)" in out
  assert "head           trained" in out and "classes        10\n" in out
  n = sum(v.size for v in tiny[2].values())
  assert f"parameters     {n:,} (float32)" in out
  assert ("input          28 px RGB, resized; [0, 255] -> [-1, 1] (assumed: the file does not "
          "record it)") in out
  command = out.split("fine-tune      ")[1].splitlines()[0]
  c = assert_finetuning_loads_the_file(command, monkeypatch)
  assert c.model_name == "ViT-B_16" and c.model.patch_size == 7 and c.model.num_layers == 2
  assert c.data.image_size == 385 and c.pretrained == tiny[0]  # 384 is not a multiple of 7.


def test_json_holds_the_same(tiny, capsys):
  rc, out, _ = run_inspect(capsys, tiny[0], "--json", "--dataset", "/data/my folder")
  report = json.loads(out)
  assert rc == 0 and report["model"] is None and report["fields"]["hidden_size"] == 32
  assert (report["patch_size"], report["width"], report["depth"], report["heads"],
          report["mlp_dim"]) == (7, 32, 2, 2, 64)
  assert report["posemb_grid"] == [4, 4] and report["image_size"] == 28
  assert report["pooling"] == "token" and report["pre_logits"] == 16
  assert report["num_classes"] == 10 and report["dtype"] == "float32"
  assert report["head"] == "trained" and report["head_all_zeros"] is False
  assert "'finetune:b16,/data/my folder'" in report["finetune_command"]


@pytest.mark.parametrize("layout", ["new_flax", "big_vision", "big_vision_scanned"])
def test_every_npz_layout_gives_the_same_report(tiny, tmp_path, layout):
  flat = {k: np.asarray(v) for k, v in tiny[2].items()}
  converted = {"new_flax": lambda: new_flax_layout(flat),
               "big_vision": lambda: big_vision_layout(flat, scanned=False),
               "big_vision_scanned": lambda: big_vision_layout(flat, scanned=True)}[layout]()
  np.savez(tmp_path / "c.npz", **converted)
  report, _ = inspection.report(str(tmp_path / "c.npz"))
  original, _ = inspection.report(tiny[0])
  drop = ("checkpoint", "source", "finetune_command")
  assert {k: v for k, v in report.items() if k not in drop} == {
      k: v for k, v in original.items() if k not in drop}


def test_a_zero_head_is_explained(tiny, capsys):
  rc, out, _ = run_inspect(capsys, tiny[1])
  assert rc == 0 and "head           all zeros" in out
  explanation = " ".join(out.split("all zeros")[1].split())
  assert "ImageNet-21k releases" in explanation and "predicts nothing" in explanation
  assert "fine-tune it" in explanation and "head=False" in explanation
  assert json.loads(run_inspect(capsys, tiny[1], "--json")[1])["head_all_zeros"] is True


def test_a_registry_model_is_named_and_counted(tmp_path, capsys, monkeypatch):
  """ViT-Ti_16 at 224 px with 1,000 classes: the paper's 5,717,416 parameters."""
  model = models.create_model("ViT-Ti_16", num_classes=1000)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]
  npz.save_npz(str(tmp_path / "ti.npz"),
                      jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes))
  rc, out, _ = run_inspect(capsys, tmp_path / "ti.npz", "--model", "ti16")
  assert rc == 0 and "model          ViT-Ti_16\n" in out
  assert "14x14 grid: native resolution 224 px" in out
  assert "parameters     5,717,416 (float32)" in out and "(ImageNet-1k's count)" in out
  command = out.split("fine-tune      ")[1].splitlines()[0]
  assert command == ("vit-train --config finetune:ti16,cifar10 "
                     f"--workdir WORKDIR --config.pretrained={tmp_path / 'ti.npz'}")
  assert_finetuning_loads_the_file(command, monkeypatch)


def test_a_hybrid_and_its_finetuning_overrides(tmp_path, capsys, monkeypatch):
  model = models.create_model("R26+ViT-S_32", num_classes=7, classifier="gap", **HYBRID_TINY)
  npz.save_npz(str(tmp_path / "h.npz"), random_params(model, 64))
  rc, out, _ = run_inspect(capsys, tmp_path / "h.npz", "--figures", tmp_path / "figures")
  assert rc == 0
  assert "1 on the features of a ResNet stem with stages (1, 1, 1, 1): tokens of 32 px" in out
  assert "learned, 2x2 grid: native resolution 64 px" in out and "gap (mean" in out
  assert "(The attention distance and rollout figures need --images.)" in out
  # No filters to draw: the patch embedding sees ResNet features.
  assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
      "position_embedding_similarity.png"]
  command = out.split("fine-tune      ")[1].splitlines()[0]
  assert "--config finetune:r50_b16,cifar10 " in command
  assert "'--config.model.resnet_layers=(1,1,1,1)'" in command
  c = assert_finetuning_loads_the_file(command, monkeypatch)
  assert c.model.classifier == "gap" and c.model.resnet_layers == (1, 1, 1, 1)


def test_register_tokens_are_in_the_finetuning_command(tmp_path, capsys, monkeypatch):
  model = models.create_model("ViT-Ti_16", num_classes=10, num_registers=2, **TINY)
  npz.save_npz(str(tmp_path / "r.npz"), random_params(model, 28))
  rc, out, _ = run_inspect(capsys, tmp_path / "r.npz")
  command = out.split("fine-tune      ")[1].splitlines()[0]
  assert rc == 0 and "--config.model.num_registers=2" in command
  assert assert_finetuning_loads_the_file(command, monkeypatch).model.num_registers == 2


def test_every_figure_is_written(tiny, tmp_path, capsys, digits_folder):
  rc, out, _ = run_inspect(capsys, tiny[0], "--json", "--figures", tmp_path,
                           "--images", digits_folder, "--num_images", "20", "--batch_size", "8")
  report = json.loads(out)
  assert rc == 0 and report["images"] == 20
  assert set(report["figures"]) == {"filters", "posemb", "distance", "rollout"}
  for path in report["figures"].values():
    with Image.open(path) as image:
      assert image.format == "PNG" and min(image.size) > 100
  distances = np.array(report["mean_attention_distance_px"])
  assert distances.shape == (2, 2) and (distances > 0).all()


def test_an_augreg_name(tiny, tmp_path, capsys, monkeypatch):
  """`augreg:FILENAME` of a file in the cache: no index, no network."""
  name = "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"
  monkeypatch.setenv("VIT_JAX_CACHE", str(tmp_path))
  (tmp_path / "augreg").mkdir()
  (tmp_path / "augreg" / f"{name}.npz").write_bytes(open(tiny[1], "rb").read())
  rc, out, _ = run_inspect(capsys, f"augreg:{name}", "--json")
  report = json.loads(out)
  assert rc == 0 and report["source"] == str(tmp_path / "augreg" / f"{name}.npz")
  assert report["head_all_zeros"] is True
  assert f"--config.pretrained=augreg:{name}" in report["finetune_command"]


# Bad inputs.

@pytest.mark.parametrize("case,message", [
    ("missing", "No checkpoint at "),
    ("empty_dir", "is not a vit_jax checkpoint step directory"),
    ("text_file", "is not an .npz file (no zip header)"),
    ("other_npz", "Cannot infer the architecture"),
    ("wrong_model", "The checkpoint is not a ViT-B_16"),
    ("unknown_model", "Unknown model 'ViT-Q_16'"),
    ("no_images", "No image files match"),
])
def test_bad_inputs_give_one_clear_message(tiny, tmp_path, capsys, case, message):
  (tmp_path / "empty").mkdir()
  (tmp_path / "notes.txt").write_text("not a checkpoint\n")
  np.savez(tmp_path / "other.npz", weights=np.zeros(3))
  argv = {"missing": [tmp_path / "nothing.npz"], "empty_dir": [tmp_path / "empty"],
          "text_file": [tmp_path / "notes.txt"], "other_npz": [tmp_path / "other.npz"],
          "wrong_model": [tiny[0], "--model", "ViT-B_16"],
          "unknown_model": [tiny[0], "--model", "ViT-Q_16"],
          "no_images": [tiny[0], "--figures", tmp_path / "f", "--images", tmp_path / "*.png"],
          }[case]
  rc, out, err = run_inspect(capsys, *argv)
  assert rc == 2 and out == ""
  assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_python_m_vit_jax_inspect(tiny, tmp_path):
  """As a user runs it: a report, and for a bad path one line and status 2."""
  good = subprocess.run([sys.executable, "-m", "vit_jax.tools.inspect_checkpoint", tiny[1], "--json"],
                        env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert good.returncode == 0, good.stderr
  assert json.loads(good.stdout)["head_all_zeros"] is True
  bad = subprocess.run([sys.executable, "-m", "vit_jax.tools.inspect_checkpoint", str(tmp_path / "none.npz")],
                       env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
  assert bad.stderr.strip().splitlines()[-1] == f"error: No checkpoint at {tmp_path}/none.npz."
