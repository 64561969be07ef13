"""`vit-inspect`: the report on every kind of checkpoint path, its fine-tuning
command, the figures, bad inputs; and the mean attention distance on known answers."""
import itertools
import json
import math
import shlex
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from helpers import (REPO, big_vision_layout, cpu_env, new_flax_layout, random_params,
                     tiny_config)
from vit_jax import checkpoint, explore, models
from vit_jax.tools import inspect_checkpoint as inspect_cli

TINY = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
HYBRID_TINY = dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2,
                   resnet_layers=(1, 1, 1, 1))


def run_inspect(capsys, *argv: str) -> tuple[int, str, str]:
  rc = inspect_cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return rc, out, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny ViT (not a registry architecture) with pre-logits: (trained-head file,
  zero-head file, its flat trained params)."""
  model = models.create_model("ViT-Ti_16", num_classes=10, representation_size=16, **TINY)
  root = tmp_path_factory.mktemp("inspect")
  trained, zero = root / "tiny.npz", root / "tiny_zero_head.npz"
  params = random_params(model, 28)
  checkpoint.save_npz(str(trained), params)
  checkpoint.save_npz(str(zero), model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"])
  return str(trained), str(zero), checkpoint.flatten(params)


def parse_finetune_command(command: str, monkeypatch):
  """The config `vit-train` would build from `command`, validated."""
  from absl import flags
  from ml_collections import config_flags
  from vit_jax.tools import train
  from vit_jax.train import config as config_lib
  argv = shlex.split(command)
  assert argv[0] == "vit-train"
  monkeypatch.chdir(tempfile.gettempdir())  # The command runs from any working directory.
  argv = train.resolve_config_flag(argv)  # As vit-train: a config's name to its file.
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  values(argv)
  config_lib.validate(values.config)
  return values.config


def assert_finetuning_loads_the_file(command: str, monkeypatch, num_classes: int = 10):
  """The command's model takes the file's arrays: what `main` does before its first step."""
  from vit_jax.train import run_setup
  c = parse_finetune_command(command, monkeypatch)
  model = run_setup.build_model(c, num_classes)
  size = c.data.image_size
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))
  params = checkpoint.load_params(c.pretrained, abstract["params"])
  assert params["head"]["kernel"].shape[-1] == num_classes
  return c


# Mean attention distance on attention patterns with known answers.

def with_class_token(patch_attention: np.ndarray, to_class: float) -> np.ndarray:
  """(..., N, N) rows over the patches -> (..., N+1, N+1): every patch row gives `to_class`
  of its attention to the class token; the class token's own row is uniform."""
  *lead, n, _ = patch_attention.shape
  out = np.zeros((*lead, n + 1, n + 1))
  out[..., 0, :] = 1 / (n + 1)
  out[..., 1:, 0] = to_class
  out[..., 1:, 1:] = (1 - to_class) * patch_attention
  return out


def mean_pairwise_distance(h: int, w: int, patch_px: float) -> float:
  """Over all ordered pairs of patches (a patch with itself included), by enumeration."""
  cells = list(itertools.product(range(h), range(w)))
  total = sum(math.hypot(a[0] - b[0], a[1] - b[1]) for a in cells for b in cells)
  return patch_px * total / len(cells)**2


@pytest.mark.parametrize("has_class_token", [True, False])
def test_attending_only_to_itself_is_distance_zero(has_class_token):
  n = 12
  attention = np.tile(np.eye(n), (2, 3, 1, 1))  # (images, heads, N, N)
  if has_class_token:  # Most attention on the class token does not move the answer.
    attention = with_class_token(attention, to_class=0.9)
  distances = explore.mean_attention_distance([attention] * 4, (3, 4), 16, has_class_token)
  assert distances.shape == (4, 3)
  np.testing.assert_array_equal(distances, 0)


@pytest.mark.parametrize("grid", [(2, 2), (4, 4), (3, 5)])
def test_uniform_attention_is_the_mean_pairwise_distance(grid):
  n = grid[0] * grid[1]
  patches_only = np.full((1, 2, n, n), 1 / n)
  uniform_over_tokens = np.full((1, 2, n + 1, n + 1), 1 / (n + 1))
  expected = mean_pairwise_distance(*grid, patch_px=16)
  for attention, has_class_token in ((patches_only, False), (uniform_over_tokens, True)):
    distances = explore.mean_attention_distance([attention], grid, 16, has_class_token)
    np.testing.assert_allclose(distances, expected, rtol=1e-12)
  # 2x2: from each patch, itself (0), two neighbours (1) and the diagonal (sqrt 2), x16 px.
  if grid == (2, 2):
    np.testing.assert_allclose(expected, 16 * (2 + math.sqrt(2)) / 4)


def test_heads_layers_and_images_are_kept_apart_and_averaged():
  """Head 0 attends to the patch on its right (itself in the last column): (w-1)/w patches
  away on average; head 1 to itself. Images: the two swap heads, so the mean is half."""
  h, w, px = 3, 4, 10
  right = np.zeros((h * w, h * w))
  for q in range(h * w):
    right[q, q + 1 if q % w < w - 1 else q] = 1
  image_0 = np.stack([right, np.eye(h * w)])
  image_1 = image_0[::-1]
  one = explore.mean_attention_distance([image_0[None]], (h, w), px, False)
  np.testing.assert_allclose(one, [[px * (w - 1) / w, 0]])
  both = explore.mean_attention_distance(
      [np.stack([image_0, image_1]), np.stack([image_0, image_0])], (h, w), px, False)
  np.testing.assert_allclose(both, [[px * (w - 1) / w / 2] * 2, [px * (w - 1) / w, 0]])
  with pytest.raises(ValueError, match="does not fit a 3x3 grid"):
    explore.mean_attention_distance([image_0[None]], (3, 3), px, False)


def test_the_model_distance_averages_over_all_images_in_any_batch_size(tiny):
  ckpt = checkpoint.load(tiny[0])
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
  report, _ = inspect_cli.report(str(tmp_path / "c.npz"))
  original, _ = inspect_cli.report(tiny[0])
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
  checkpoint.save_npz(str(tmp_path / "ti.npz"),
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
  checkpoint.save_npz(str(tmp_path / "h.npz"), random_params(model, 64))
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
  checkpoint.save_npz(str(tmp_path / "r.npz"), random_params(model, 28))
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


@pytest.mark.slow
def test_a_workdir_and_its_step_dir(tmp_path, capsys, monkeypatch, dataset):
  from vit_jax.train import loop
  loop.train_and_evaluate(tiny_config(dataset, total_steps=2), str(tmp_path))
  step_dir = tmp_path / "checkpoints" / "2"
  for path in (tmp_path, step_dir):
    rc, out, _ = run_inspect(capsys, path, "--json")
    report = json.loads(out)
    assert rc == 0 and report["source"] == str(step_dir)
    assert report["model"] is None and report["run_model_name"] == "ViT-Ti_16"
    assert report["fields"]["patch_size"] == 7 and report["image_size"] == 28
    assert report["num_classes"] == 10 and report["head"] == "trained"
  c = assert_finetuning_loads_the_file(report["finetune_command"], monkeypatch)
  assert c.model_name == "ViT-Ti_16" and c.pretrained == str(step_dir)
  assert report["description"]["class_names"][:2] == ["T-shirt/top", "Trouser"]
  rc, out, _ = run_inspect(capsys, tmp_path)
  assert "no registry name fits (a run of ViT-Ti_16 with overrides)" in out
  assert f"read           {step_dir}" in out
  assert "input          28 px RGB, resized; [0, 255] -> [-1, 1]\n" in out
  assert "class names    T-shirt/top, Trouser, Pullover," in out
  assert "origin         trained on fashion_mnist; step 2\n" in out


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
