"""checkpoint/layouts/timm_eva.py: timm's eva.py models (DINOv3, EVA-02) from a Hub cache in
huggingface_hub's layout, offline. Random weights in every array (tiny models of the real
architectures, as timm's create_model builds them); the features, pre-logits and logits equal
timm's forward at the config's size and at another (the rotary grid, EVA-02's embedding
resampled as timm does), the description is the config's, and what the ViT here cannot
express is refused in one line."""
import json
import os

import jax
import numpy as np
import pytest

from helpers import randomised_torch, write_repo
from vit_jax.checkpoint import loader
from vit_jax.checkpoint.layouts import timm_eva
from vit_jax.models import timm_models
from vit_jax.tools import inspect_checkpoint as inspect_cli

SIZE, OTHER = 32, (48, 40)
TINY = dict(embed_dim=64, depth=2, num_heads=4, patch_size=8, img_size=SIZE)
# (timm architecture, create_model kwargs, the fields the description completes: those no
# array tells).
FORMS = {
    "dinov3": ("vit_small_patch16_dinov3", dict(num_classes=0), dict(
        classifier="gap", class_token=True, num_registers=4, posemb="none", rope="dinov3",
        layer_scale=True, qkv_bias="none", layer_norm_eps=1e-5)),
    "dinov3_qkvb_swiglu_token": (
        "vit_huge_plus_patch16_dinov3_qkvb", dict(num_classes=5, global_pool="token"),
        dict(classifier="token", qkv_bias="qv", mlp="swiglu", rope="dinov3", posemb="none",
             layer_norm_eps=1e-5)),
    "eva02_mim": ("eva02_tiny_patch14_224", dict(num_classes=0), dict(
        classifier="gap", class_token=True, fc_norm=True, qkv_bias="qv", mlp="swiglu",
        rope="eva", rope_ref_grid=16, posemb="learn", layer_norm_eps=1e-6)),
    "eva02_in1k": ("eva02_base_patch14_448", dict(num_classes=5), dict(
        classifier="gap", class_token=True, fc_norm=True, mlp="swiglu", mlp_norm=True,
        rope="eva", rope_ref_grid=16)),
    "eva02_clip": ("eva02_large_patch14_clip_224", dict(num_classes=5), dict(
        classifier="token", attention_norm=True, mlp_norm=True, rope="eva", rope_ref_grid=16)),
}


def timm_model(form: str, **extra):
  torch, timm = timm_models.import_torch()
  arch, kwargs, _ = FORMS[form]
  return randomised_torch(timm.create_model(arch, pretrained=False, dynamic_img_size=True,
                                            **TINY, **kwargs, **extra))


def save(model, folder, **config_changes) -> dict:
  """The model's files as timm writes them (model_args, the tiny input size)."""
  from timm.models import _hub
  _hub.save_for_hf(model, folder, model_args=dict(TINY), data_config=dict(
      input_size=(3, SIZE, SIZE)), safe_serialization=True)
  config = json.loads((folder / "config.json").read_text()) | config_changes
  (folder / "config.json").write_text(json.dumps(config))
  return config


def images(h: int, w: int) -> np.ndarray:
  return np.random.default_rng(1).uniform(-1, 1, (2, h, w, 3)).astype(np.float32)


def timm_outputs(model, x: np.ndarray) -> tuple[np.ndarray, ...]:
  """timm's features (all tokens), pre-logits and logits."""
  torch, _ = timm_models.import_torch()
  with torch.no_grad():
    tokens = model.forward_features(torch.from_numpy(x.transpose(0, 3, 1, 2)))
    return tuple(t.numpy() for t in (tokens, model.forward_head(tokens, pre_logits=True),
                                     model.forward_head(tokens)))


def assert_timms(loaded, model, x: np.ndarray) -> float:
  """Our features, pre-logits and logits against timm's; the largest difference."""
  logits, aux = jax.jit(lambda p, x: loaded.model.apply({"params": p}, x, return_aux=True))(
      loaded.params, x)
  errors = []
  for ours, theirs in zip((aux["encoded"], aux["pre_logits"], logits), timm_outputs(model, x)):
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)
    errors.append(float(np.abs(np.asarray(ours) - theirs).max()))
  return max(errors)


@pytest.mark.parametrize("form", FORMS)
def test_eva_models_are_timms(form, tmp_path, hub_cache, capsys):
  model = timm_model(form)
  config = save(model, tmp_path / form)
  spec = f"hf-hub:timm/{FORMS[form][0]}.tiny"
  write_repo(hub_cache, spec[len("hf-hub:"):], {f: tmp_path / form / f
                                                 for f in os.listdir(tmp_path / form)})
  loaded = loader.load(spec)
  assert_timms(loaded, model, images(SIZE, SIZE))
  # Another size: DINOv3's rotary grid as it is; EVA-02's embedding resampled as timm does.
  other = loader.load(spec, dynamic_image_size=True, posemb_interpolation="bicubic")
  assert_timms(other, model, images(*OTHER))

  d, cfg = loaded.description, config["pretrained_cfg"]
  assert {k: d.model[k] for k in FORMS[form][2]} == FORMS[form][2]
  assert d.model["gelu"] == "exact" and d.image_size == SIZE
  pre = d.preprocessing
  assert (pre.mean, pre.std, pre.interpolation, pre.central_crop_fraction, pre.crop) == (
      tuple(cfg["mean"]), tuple(cfg["std"]), cfg["interpolation"], cfg["crop_pct"],
      "squash_central_crop" if cfg["crop_mode"] == "squash" else "central_crop")
  assert inspect_cli.main([spec]) == 0
  assert f"rotary ({FORMS[form][2]['rope']}) in the attention" in capsys.readouterr().out
  assert inspect_cli.main([spec, "--json"]) == 0
  described = json.loads(capsys.readouterr().out)["description"]["model"]
  assert described == {k: d.model[k] for k in described}


def assert_refused(capsys, path, *words: str) -> None:
  rc = inspect_cli.main([str(path)])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_what_the_vit_cannot_express_is_refused_in_one_line(tmp_path, capsys):
  from safetensors.numpy import load_file, save_file
  save(timm_model("dinov3", qk_norm=True), tmp_path / "qk_norm")
  assert_refused(capsys, tmp_path / "qk_norm", "query/key normalisation", "blocks.0.attn.k_norm.bias")
  folder = tmp_path / "eva02"
  save(timm_model("eva02_mim"), folder, architecture="eva02_enormous_patch14_clip_224")
  assert_refused(capsys, folder, "eva02_enormous_patch14_clip_224", "not an eva.py model")
  save(timm_model("eva02_mim"), folder, model_args={"rope_temperature": 100.0})
  assert_refused(capsys, folder, "rope_type='cat', temperature 100")
  save(timm_model("eva02_mim"), folder, model_args={})
  assert_refused(capsys, folder, "attention heads of a width-64 model")
  save(timm_model("eva02_mim"), folder, global_pool="max")
  assert_refused(capsys, folder, "global_pool='max'")
  save(timm_model("eva02_mim"), folder)
  arrays = load_file(folder / "model.safetensors")
  save_file(arrays | {"blocks.1.attn.k_bias": arrays["blocks.1.attn.q_bias"]},
            folder / "model.safetensors")
  assert_refused(capsys, folder, "blocks.1.attn.k_bias", "Nothing was loaded")


def test_timm_vit_claims_no_eva_arrays():
  """The first row that matches reads the file: every eva.py form is this layout's."""
  from vit_jax.checkpoint import layouts
  for form in FORMS:
    keys = timm_model(form).state_dict().keys()
    assert layouts.find(keys, form) is timm_eva


def test_heads_come_from_the_architecture_without_model_args(tmp_path):
  """The Hub's configs mostly name no model_args: EVA-02 Ti's 3 heads of 64 come from its
  width, as eva.py defines eva02_tiny_patch14_224 (its patch size from the name: 14)."""
  _, timm = timm_models.import_torch()
  size = 28
  model = randomised_torch(timm.create_model(
      "eva02_tiny_patch14_224", pretrained=False, img_size=size, depth=2, num_classes=0))
  from timm.models import _hub
  _hub.save_for_hf(model, tmp_path / "tiny", data_config=dict(input_size=(3, size, size)),
                   safe_serialization=True)
  config = json.loads((tmp_path / "tiny" / "config.json").read_text())
  del config["model_args"]
  (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
  loaded = loader.load(str(tmp_path / "tiny"))
  assert loaded.model.num_heads == 3
  assert_timms(loaded, model, images(size, size))
