"""DINOv2 and CLIP image towers from the Hub, offline, against their own frameworks with random
weights in every array, at the native resolution and at another (the position embedding
resampled as each framework does): timm's `*_dinov2*` and `*_clip_*` ViTs (layouts/timm_vit.py)
and transformers' Dinov2Model and Dinov2WithRegistersModel (layouts/transformers_dinov2.py)."""
import json
import os

import jax
import numpy as np
import pytest

from helpers import IMAGENET_MEAN, IMAGENET_STD, perturbed, write_repo
from test_hub import assert_one_line_error
from vit_jax.checkpoint import loader
from vit_jax.models import timm_models

# Heads of 64 channels, as timm's (its config.json names no head count).
TINY = dict(embed_dim=128, num_heads=2, depth=2)
# name: (timm architecture, pretrained cfg its config.json carries, the architecture that runs
# the weights as trained, create_model kwargs, (native, other) sizes, GELU, LayerNorm epsilon).
TIMM = {
    "dinov2": ("vit_small_patch14_dinov2", "vit_small_patch14_dinov2.lvd142m",
               "vit_small_patch14_dinov2", TINY, (98, 56), "exact", 1e-6),
    "dinov2_reg4": ("vit_small_patch14_reg4_dinov2", "vit_small_patch14_reg4_dinov2.lvd142m",
                    "vit_small_patch14_reg4_dinov2", TINY, (98, 56), "exact", 1e-6),
    # SwiGLUPacked: int(192 * 2.66667 * 2) = 1024 wide fc1, 512 after the gate.
    "dinov2_giant": ("vit_giant_patch14_dinov2", "vit_giant_patch14_dinov2.lvd142m",
                     "vit_giant_patch14_dinov2", TINY | dict(embed_dim=192, num_heads=3), (98, 56), "exact",
                     1e-6),
    # timm runs the openai weights' own repo with the exact GELU; its notes say they are
    # QuickGELU's, which the _quickgelu_ architecture runs.
    "clip_openai": ("vit_base_patch16_clip_224", "vit_base_patch16_clip_224.openai",
                    "vit_base_patch16_clip_quickgelu_224", TINY, (64, 96), "quick", 1e-5),
    "clip_quickgelu": ("vit_base_patch16_clip_quickgelu_224",
                       "vit_base_patch16_clip_quickgelu_224.openai",
                       "vit_base_patch16_clip_quickgelu_224", TINY, (64, 48), "quick", 1e-5),
    "clip_laion2b": ("vit_large_patch14_clip_224", "vit_large_patch14_clip_224.laion2b",
                     "vit_large_patch14_clip_224", TINY, (56, 84), "exact", 1e-5),
}


def images(size: int) -> np.ndarray:
  return np.random.RandomState(0).randn(2, size, size, 3).astype(np.float32)


def timm_repo(tmp_path, kind: str):
  """(timm model that runs the weights as trained, with dynamic_img_size; the repo's folder:
  model.safetensors and config.json with timm's pretrained_cfg of that tag, no model_args)."""
  torch, timm = timm_models.import_torch()
  from timm.models import _hub, _pretrained
  arch, tag, runs, kwargs, (size, _), _, _ = TIMM[kind]
  model = perturbed(timm.create_model(arch, pretrained=False, img_size=size, num_classes=5,
                                      **kwargs), torch)
  if kind.startswith("clip"):  # timm's converter gives CLIP's projection a zero bias.
    with torch.no_grad():
      model.head.bias.zero_()
  folder = tmp_path / kind
  _hub.save_for_hf(model, folder, safe_serialization=True)
  config = json.loads((folder / "config.json").read_text())
  config.pop("model_args", None)
  cfg = _pretrained.filter_pretrained_cfg(timm.models.get_pretrained_cfg(tag).to_dict(),
                                          remove_source=True)
  config["pretrained_cfg"] = cfg | {"input_size": [3, size, size], "num_classes": 5}
  (folder / "config.json").write_text(json.dumps(config))
  runner = timm.create_model(runs, pretrained=False, img_size=size, num_classes=5,
                             dynamic_img_size=True, **kwargs)
  runner.load_state_dict(model.state_dict())
  return runner.eval(), folder, config


@pytest.mark.parametrize("kind", list(TIMM))
def test_timm_dinov2_and_clip_match_timm_at_two_sizes(kind, tmp_path, hub_cache):
  model, folder, config = timm_repo(tmp_path, kind)
  native, other = TIMM[kind][4]
  write_repo(hub_cache, f"timm/{kind}", {f: folder / f for f in os.listdir(folder)})
  loaded = loader.load(f"hf-hub:timm/{kind}")
  d = loaded.description
  assert d.image_size == native and d.num_classes == 5
  assert (d.model["gelu"], d.model["layer_norm_eps"]) == TIMM[kind][5:]
  assert d.model["layer_scale"] == kind.startswith("dinov2")
  assert d.model.get("pre_norm", False) == kind.startswith("clip")
  assert d.model.get("mlp", "gelu") == ("swiglu" if kind == "dinov2_giant" else "gelu")
  assert d.model["head_bias"] != kind.startswith("clip")
  assert d.preprocessing.mean == tuple(config["pretrained_cfg"]["mean"])
  # Loading at the other size: test_layouts_posemb.py, for every layout and resize path.
  for size, kw in ((native, {}), (other, dict(dynamic_image_size=True))):
    run = loader.load(f"hf-hub:timm/{kind}", **kw) if kw else loaded
    x = images(size)
    ours = jax.jit(run.model.apply)({"params": run.params}, x)
    np.testing.assert_allclose(ours, timm_models.logits(model, x), atol=1e-6, err_msg=str(kw))


def dinov2_repo(tmp_path, swiglu: bool, head: bool = False, registers: int = 0):
  """(transformers Dinov2Model, or Dinov2WithRegistersModel, at 98 px; its folder with a
  BitImageProcessor cropping 56 px)."""
  torch, _ = timm_models.import_torch()
  import transformers
  name = "Dinov2WithRegisters" if registers else "Dinov2"
  config = getattr(transformers, name + "Config")(
      image_size=98, patch_size=14, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      layer_norm_eps=1e-6, use_swiglu_ffn=swiglu, num_labels=5,
      **(dict(num_register_tokens=registers) if registers else {}))
  cls = getattr(transformers, name + ("ForImageClassification" if head else "Model"))
  model = perturbed(cls(config), torch, 0.02)
  folder = tmp_path / f"{name}_{swiglu}_{head}"
  model.save_pretrained(folder)
  transformers.BitImageProcessor(
      size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56}, resample=3,
      image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD).save_pretrained(folder)
  return model, folder


@pytest.mark.parametrize("swiglu,registers", [(False, 0), (True, 0), (False, 4)])
def test_transformers_dinov2_matches_transformers_at_two_sizes(swiglu, registers, tmp_path,
                                                              hub_cache):
  torch, _ = timm_models.import_torch()
  model, folder = dinov2_repo(tmp_path, swiglu, registers=registers)
  write_repo(hub_cache, "facebook/dinov2-tiny", {f: folder / f for f in os.listdir(folder)})
  loaded = loader.load("hf-hub:facebook/dinov2-tiny")
  d = loaded.description
  assert d.image_size == 56 and d.num_classes is None  # The processor's crop.
  assert (d.model["gelu"], d.model["layer_norm_eps"], d.model["layer_scale"]) == (
      "exact", 1e-6, True)
  assert d.model.get("mlp", "gelu") == ("swiglu" if swiglu else "gelu")
  assert d.model.get("num_registers", 0) == registers
  pre = d.preprocessing
  assert (pre.mean, pre.std, pre.crop, pre.central_crop_fraction, pre.interpolation) == (
      IMAGENET_MEAN, IMAGENET_STD, "central_crop", 56 / 64, "bicubic")
  # 56 px: transformers resamples the 7x7 embedding to 4x4 in its forward pass.
  for size, run in ((56, loaded), (98, loader.load("hf-hub:facebook/dinov2-tiny",
                                                        image_size=98))):
    x = images(size)
    with torch.no_grad():
      want = model(pixel_values=torch.from_numpy(x.transpose(0, 3, 1, 2))).pooler_output.numpy()
    np.testing.assert_allclose(jax.jit(run.model.apply)({"params": run.params}, x), want,
                               atol=1e-5, err_msg=str(size))  # Unit-scale features.


@pytest.mark.parametrize("registers", [0, 4])
def test_dinov2_classifier_is_refused_in_one_line(registers, capsys, tmp_path, hub_cache):
  _, folder = dinov2_repo(tmp_path, swiglu=False, head=True, registers=registers)
  capsys.readouterr()  # save_pretrained's progress bar.
  assert_one_line_error(capsys, [str(folder)], "ForImageClassification", "mean", "Dinov2Model")
