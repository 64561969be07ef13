"""layouts/transformers_clip.py: transformers' CLIP image tower (CLIPVisionModel,
CLIPVisionModelWithProjection, a whole CLIPModel's vision half) from a Hub cache written in
huggingface_hub's layout (offline), against transformers' own forward with random weights in
every array, at the native resolution and at another (interpolate_pos_encoding)."""
import logging
import os

import jax
import numpy as np
import pytest

from helpers import perturbed, write_repo
from test_hub import assert_one_line_error
from vit_jax.checkpoint import loader
from vit_jax.models import timm_models

SIZE, OTHER = 32, 48
VISION = dict(image_size=SIZE, patch_size=8, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=128, projection_dim=48)


def clip_repo(tmp_path, cls: str, **vision):
  """(transformers model, its saved folder with CLIPImageProcessor's preprocessor_config.json)."""
  torch, _ = timm_models.import_torch()
  import transformers
  vision_config = transformers.CLIPVisionConfig(**(VISION | vision))
  if cls == "CLIPModel":
    text = transformers.CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       max_position_embeddings=16, projection_dim=48)
    config = transformers.CLIPConfig(text_config=text.to_dict(),
                                     vision_config=vision_config.to_dict(), projection_dim=48)
  else:
    config = vision_config
  model = perturbed(getattr(transformers, cls)(config), torch, 0.05)
  folder = tmp_path / cls
  model.save_pretrained(folder)
  transformers.CLIPImageProcessor(size={"shortest_edge": SIZE},
                                  crop_size={"height": SIZE, "width": SIZE}).save_pretrained(folder)
  return model, folder


def theirs(model, x: np.ndarray) -> np.ndarray:
  """transformers' image embedding (or pooled output without a projection), its position
  embedding interpolated where x is not the native size."""
  torch, _ = timm_models.import_torch()
  pixels = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
  other = x.shape[1] != SIZE
  with torch.no_grad():
    if hasattr(model, "get_image_features"):
      return model.get_image_features(pixel_values=pixels,
                                      interpolate_pos_encoding=other).pooler_output.numpy()
    out = model(pixel_values=pixels, interpolate_pos_encoding=other)
  return (out.image_embeds if hasattr(out, "image_embeds") else out.pooler_output).numpy()


def ours(spec: str, size: int) -> tuple[np.ndarray, np.ndarray, loader.Loaded]:
  loaded = loader.load(spec, image_size=size)
  x = np.random.RandomState(size).randn(2, size, size, 3).astype(np.float32)
  return x, np.asarray(jax.jit(loaded.model.apply)({"params": loaded.params}, x)), loaded


@pytest.mark.parametrize("cls", ["CLIPVisionModelWithProjection", "CLIPVisionModel"])
def test_image_tower_matches_transformers_at_two_sizes(cls, tmp_path, hub_cache):
  model, folder = clip_repo(tmp_path, cls, hidden_act="quick_gelu")
  write_repo(hub_cache, f"openai/{cls}", {f: folder / f for f in os.listdir(folder)})
  for size in (SIZE, OTHER):
    x, logits, loaded = ours(f"hf-hub:openai/{cls}", size)
    np.testing.assert_allclose(logits, theirs(model, x), atol=1e-4)
  d = loaded.description
  assert d.image_size == OTHER and d.num_classes == (48 if "Projection" in cls else None)
  want = dict(gelu="quick", layer_norm_eps=1e-5, pre_norm=True, classifier="token",
              head_bias=True if d.num_classes is None else False,
              posemb_interpolation="bicubic_no_antialias")
  assert {k: d.model[k] for k in want} == want
  pre = d.preprocessing
  assert (pre.crop, pre.central_crop_fraction, pre.interpolation, pre.geometry) == (
      "central_crop", 1.0, "bicubic", "transformers")
  assert pre.mean == (0.48145466, 0.4578275, 0.40821073)
  assert pre.std == (0.26862954, 0.26130258, 0.27577711)


def test_whole_clip_model_loads_its_image_tower_naming_the_text_tower(tmp_path, hub_cache,
                                                                       caplog):
  model, folder = clip_repo(tmp_path, "CLIPModel", hidden_act="gelu")
  write_repo(hub_cache, "openai/clip-tiny", {f: folder / f for f in os.listdir(folder)})
  with caplog.at_level(logging.WARNING):
    x, logits, loaded = ours("hf-hub:openai/clip-tiny", SIZE)
  np.testing.assert_allclose(logits, theirs(model, x), atol=1e-4)
  assert loaded.description.model["gelu"] == "exact"
  lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
  assert len(lines) == 1 and all(w in lines[0] for w in (
      "text tower", "text_model.* (", "text_projection.* (1 array)", "logit_scale")), lines
  x, logits, _ = ours("hf-hub:openai/clip-tiny", OTHER)
  np.testing.assert_allclose(logits, theirs(model, x), atol=1e-4)


def test_unknown_arrays_are_refused_by_name(capsys, tmp_path, hub_cache):
  from safetensors.numpy import load_file, save_file
  _, folder = clip_repo(tmp_path, "CLIPVisionModelWithProjection")
  arrays = load_file(folder / "model.safetensors")
  extra = "vision_model.encoder.layers.0.self_attn.extra.weight"
  save_file(arrays | {extra: np.ones((2, 2), np.float32)}, folder / "model.safetensors")
  write_repo(hub_cache, "openai/extra", {f: folder / f for f in os.listdir(folder)})
  capsys.readouterr()  # save_pretrained's progress bar.
  assert_one_line_error(capsys, ["hf-hub:openai/extra"], extra.removeprefix("vision_model."),
                        "Nothing was loaded")
  # Older files' position ids: taken where they are 0..N, refused where they reorder.
  ids = "vision_model.embeddings.position_ids"
  tokens = arrays["vision_model.embeddings.position_embedding.weight"].shape[0]
  for name, order in (("ids", np.arange(tokens)), ("reordered", np.arange(tokens)[::-1])):
    save_file(arrays | {ids: order[None].astype(np.int64)}, folder / "model.safetensors")
    write_repo(hub_cache, f"openai/{name}", {f: folder / f for f in os.listdir(folder)})
  assert loader.load("hf-hub:openai/ids").description.num_classes == 48
  assert_one_line_error(capsys, ["hf-hub:openai/reordered"], "position_ids", "reorder")


@pytest.mark.parametrize("processor,want", [
    ({"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224},
      "resample": 2}, ("central_crop", 0.875, "bilinear")),
    ({"size": 224, "crop_size": 224}, ("central_crop", 1.0, "bicubic")),  # Older files' ints.
    ({"size": {"height": 224, "width": 224}, "do_center_crop": False},
     ("resize", 0.875, "bicubic")),
])
def test_processor_config_gives_its_geometry(processor, want):
  from vit_jax.checkpoint.layouts import transformers_clip
  from vit_jax.data import preprocess
  pre = transformers_clip.processor_preprocessing(processor)
  assert (pre.crop, pre.central_crop_fraction, pre.interpolation) == want
  image = np.zeros((301, 517, 3), np.float32)
  assert tuple(preprocess.fit(image, 224, pre).shape) == (224, 224, 3)


@pytest.mark.parametrize("width", [229, 230, 227, 231])
def test_crop_offset_against_clip_image_processor(width):
  """transformers crops at int(margin / 2), where torchvision's CenterCrop would round half to
  even (a pixel apart for margins 3 mod 4: 227, 231). Each pixel its own value (the shorter
  side already at 224: no resize)."""
  import tensorflow as tf
  import transformers
  from vit_jax.checkpoint.layouts import transformers_clip
  from vit_jax.data import preprocess
  image = np.arange(224 * width * 3, dtype=np.float64).reshape(224, width, 3) % 251
  processor = transformers.CLIPImageProcessor(do_rescale=False, do_normalize=False)
  theirs = processor(images=image.astype(np.uint8), return_tensors="np").pixel_values[0]
  pre = transformers_clip.processor_preprocessing(processor.to_dict())
  ours = preprocess.apply_preprocessing(tf.constant(image.astype(np.uint8)), pre, 224,
                                        normalise=False).numpy()
  np.testing.assert_array_equal(ours, theirs.transpose(1, 2, 0))
