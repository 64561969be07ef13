"""layouts/open_clip.py: OpenCLIP's own files (open_clip_model.safetensors, open_clip_config.json)
from a Hub cache written in huggingface_hub's layout (offline), against open_clip's
`encode_image` of the same files (`create_model("local-dir:...")`) with random weights in every
array, at the native resolution and at another (open_clip resizing the position embedding as it
loads)."""
import json
import logging
import os

import jax
import numpy as np
import pytest

from helpers import perturbed, write_repo
from test_hub import assert_one_line_error
from vit_jax.checkpoint import loader

SIZE, OTHER = 32, 48
TEXT = dict(context_length=8, vocab_size=100, width=32, heads=2, layers=1)


def open_clip_repo(tmp_path, quick_gelu: bool = True, preprocess=None, **vision):
  """The folder open_clip's push_to_hf_hub writes (its weights and config), a tiny ViT-CLIP of
  random weights."""
  import open_clip
  import torch
  from safetensors.torch import save_file
  model_cfg = dict(embed_dim=48, quick_gelu=quick_gelu, text_cfg=TEXT,
                   vision_cfg=dict(image_size=SIZE, patch_size=8, width=64, layers=2,
                                   head_width=16, mlp_ratio=2.0) | vision)
  model = perturbed(open_clip.model.CLIP(**model_cfg), torch, 0.05)
  folder = tmp_path / "open_clip"
  folder.mkdir()
  save_file(model.state_dict(), folder / "open_clip_model.safetensors")
  config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess or {
      "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "interpolation": "bicubic",
      "resize_mode": "shortest"}}
  (folder / "open_clip_config.json").write_text(json.dumps(config))
  return folder


def theirs(folder, x: np.ndarray) -> np.ndarray:
  """open_clip's encode_image of the folder's files at x's size."""
  import open_clip
  import torch
  model = open_clip.create_model(f"local-dir:{folder}", force_image_size=x.shape[1]).eval()
  with torch.no_grad():
    return model.encode_image(torch.from_numpy(np.ascontiguousarray(
        x.transpose(0, 3, 1, 2)))).numpy()


def ours(spec: str, size: int):
  loaded = loader.load(spec, image_size=size)
  x = np.random.RandomState(size).randn(2, size, size, 3).astype(np.float32)
  return x, np.asarray(jax.jit(loaded.model.apply)({"params": loaded.params}, x)), loaded


@pytest.mark.parametrize("quick_gelu,vision", [
    (True, {}),  # OpenAI's CLIP as open_clip holds it.
    (False, {"pool_type": "avg", "final_ln_after_pool": True, "no_ln_pre": True}),
])
def test_image_tower_matches_open_clip_at_two_sizes(quick_gelu, vision, tmp_path, hub_cache,
                                                    caplog):
  folder = open_clip_repo(tmp_path, quick_gelu, **vision)
  files = {f: folder / f for f in os.listdir(folder)}
  if vision:  # A config.json (e.g. transformers') beside OpenCLIP's files, no model.safetensors.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip"}))
    files["config.json"] = tmp_path / "config.json"
  write_repo(hub_cache, "laion/tiny", files)
  with caplog.at_level(logging.WARNING):
    for size in (SIZE, OTHER):
      x, logits, loaded = ours("hf-hub:laion/tiny", size)
      np.testing.assert_allclose(logits, theirs(folder, x), atol=1e-4)
  lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
  assert len(lines) == 2 and all(w in lines[0] for w in (
      "text tower", "transformer.* (", "token_embedding.* (1 array)", "text_projection",
      "logit_scale")), lines
  d = loaded.description
  assert d.num_classes == 48 and d.image_size == OTHER
  want = dict(gelu="quick" if quick_gelu else "exact", layer_norm_eps=1e-5, head_bias=False,
              pre_norm=not vision, classifier="gap" if vision else "token",
              posemb_interpolation="bicubic")
  assert {k: d.model[k] for k in want} == want
  pre = d.preprocessing
  assert (pre.mean, pre.std, pre.crop, pre.central_crop_fraction, pre.interpolation,
          pre.geometry) == ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), "central_crop", 1.0, "bicubic",
                            "torchvision")
  # The same files in a local folder read the same.
  again = loader.load(str(folder), image_size=OTHER)
  jax.tree.map(np.testing.assert_array_equal, again.params, loaded.params)
  assert again.description == loaded.description


def test_refusals_are_one_line(capsys, tmp_path, hub_cache):
  from safetensors.numpy import load_file, save_file
  folder = open_clip_repo(tmp_path)
  arrays = load_file(folder / "open_clip_model.safetensors")
  extra = "visual.transformer.resblocks.0.ls_1.gamma"
  save_file(arrays | {extra: np.ones(64, np.float32)}, folder / "open_clip_model.safetensors")
  write_repo(hub_cache, "laion/extra", {f: folder / f for f in os.listdir(folder)})
  assert_one_line_error(capsys, ["hf-hub:laion/extra"], extra, "Nothing was loaded")
  config = json.loads((folder / "open_clip_config.json").read_text())
  config["model_cfg"]["vision_cfg"]["attentional_pool"] = True
  (folder / "open_clip_config.json").write_text(json.dumps(config))
  assert_one_line_error(capsys, [str(folder)], "attentional_pool=True")


@pytest.mark.parametrize("mode,crop", [("squash", "resize"),
                                       ("longest", "letterbox_central_crop")])
def test_resize_modes(mode, crop):
  from vit_jax.checkpoint.layouts import open_clip, repo_config
  pre = open_clip.preprocessing({"preprocess_cfg": {"resize_mode": mode}}, "x")
  assert (pre.crop, pre.interpolation, pre.mean) == (crop, "bicubic",
                                                     repo_config.OPENAI_CLIP_MEAN)


@pytest.mark.parametrize("hw", [(333, 517), (517, 333), (97, 301)])
def test_eval_pixels_are_open_clips(hw):
  """'shortest' and 'squash' through preprocess.fit against open_clip's image_transform (PIL),
  on a smooth image (bicubic's overshoot on noise is PIL's uint8 clip between its passes): the
  same geometry, pixels within what the two resize kernels leave (1.25 levels, as timm's)."""
  import open_clip
  import tensorflow as tf
  from PIL import Image
  from vit_jax.checkpoint.layouts import open_clip as layout
  from vit_jax.data import preprocess
  rng = np.random.default_rng(0)
  coarse = rng.integers(0, 256, (hw[0] // 8 + 2, hw[1] // 8 + 2, 3), dtype=np.uint8)
  image = np.asarray(Image.fromarray(coarse).resize(hw[::-1], Image.BILINEAR))
  for mode in ("shortest", "squash"):
    cfg = {"preprocess_cfg": {"resize_mode": mode, "interpolation": "bicubic"}}
    pre = layout.preprocessing(cfg, "x")
    ours = preprocess.apply_preprocessing(tf.constant(image), pre, 224, normalise=False)
    pil = Image.fromarray(image)
    for step in open_clip.image_transform(224, is_train=False, resize_mode=mode).transforms[:-2]:
      pil = step(pil)
    np.testing.assert_allclose(ours, np.asarray(pil, np.float32), rtol=0, atol=1.25,
                               err_msg=f"{hw} {mode}")


@pytest.mark.parametrize("files,want", [
    (("open_clip_config.json", "open_clip_model.safetensors"), "open_clip_model.safetensors"),
    (("config.json", "open_clip_config.json", "open_clip_model.safetensors"),
     "open_clip_model.safetensors"),
    (("config.json", "model.safetensors", "open_clip_config.json", "open_clip_model.safetensors"),
     "model.safetensors"),
])
def test_fetch_asks_for_open_clips_files_where_the_repo_has_no_model_safetensors(
    files, want, tmp_path, monkeypatch):
  """hub.fetch online, before anything is cached: each file asked for is downloaded, or is
  absent from the repo."""
  from vit_jax.checkpoint import errors, hub
  asked = []

  def download(self, filename, absent_ok=False, uncached_ok=False):
    asked.append(filename)
    if filename in files:
      return str(tmp_path / filename)
    if absent_ok:
      return None
    raise errors.CheckpointError(f"no {filename}")

  monkeypatch.setattr(hub._Repo, "download", download)
  folder, weights = hub.fetch("hf-hub:laion/tiny")
  assert folder == str(tmp_path) and weights == [str(tmp_path / want)], asked
