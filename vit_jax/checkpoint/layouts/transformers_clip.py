"""transformers' CLIP image tower (`CLIPVisionModel`, `CLIPVisionModelWithProjection`, and the
vision half of a whole `CLIPModel`, as openai/clip-vit-* on the Hugging Face Hub) in the
released layout, with numpy alone.

The tower is vit_jax's ViT with `pre_norm` (`pre_layrnorm`; the patch embedding has no bias),
QuickGELU (`hidden_act: quick_gelu`), LayerNorm epsilon 1e-5 and a class token. Its
`post_layernorm` normalises the pooled class token; here it is the encoder's final norm, which
gives the class token the same values: the pre-logits equal transformers' `pooler_output`,
while `encoded` (all tokens, normalised) is transformers' `last_hidden_state` after
`post_layernorm` (transformers leaves it out there). `visual_projection` (no bias) is the head,
without bias: the logits are `image_embeds`, CLIP's image embedding (not normalised).

A whole CLIPModel's file holds the text tower too (`text_model.*`, `text_projection`,
`logit_scale`): the image tower is loaded and the text tower left out, named in one logged line.
Refusing the file would refuse every CLIP repo that OpenAI and LAION published, and OpenCLIP's
own files (layouts/open_clip.py) always hold both towers; the text tower is a second model,
not a part of the image model left unused.

Other resolutions: the position embedding's grid is resampled as `interpolate_pos_encoding`
does (torch's bicubic, no antialiasing: `posemb_interpolation='bicubic_no_antialias'`).
Preprocessing (CLIPImageProcessor): bicubic resize of the shorter side to `size.shortest_edge`
(the longer side truncated), centre crop `crop_size` at int(margin / 2), OpenAI's mean and std:
'central_crop' in the "transformers" geometry (input_contract.GEOMETRIES), to the pixel.
"""
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import repo_config, state_dict, transformers_vit
from vit_jax.checkpoint.npz import POSEMB_KEY

NAME = "transformers CLIP"
# transformers' hidden_act values -> vit_jax's GELUs.
_GELUS = {"quick_gelu": "quick", "gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh",
          "gelu_fast": "tanh"}
# A CLIPModel's arrays beside its image tower's.
_TEXT_TOWER = ("text_model.", "text_projection.", "logit_scale")
_BICUBIC = 3  # PIL's resample code.


def matches(keys: Any) -> bool:
  # CLIPVisionModel's own files (transformers 5) have no `vision_model.` prefix.
  return any(k.removeprefix("vision_model.") == "pre_layrnorm.weight" for k in keys)


def vision_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
  """The image tower's settings: a CLIPModel's `vision_config`, or the CLIPVisionConfig."""
  return config.get("vision_config") or config


def _position_ids(sd: state_dict.StateDict, key: str, tokens: int) -> None:
  """Older files hold the position ids transformers now rebuilds: used where they are
  0..tokens-1, the only ids the model takes; refused otherwise."""
  if sd.has(key):
    ids = sd.take(key)
    if not np.array_equal(ids.reshape(-1), np.arange(tokens)):
      raise CheckpointError(f"{sd.name}: {key} is not 0..{tokens - 1}: position ids that "
                            "reorder the embeddings are not supported.")


def _block(sd: state_dict.StateDict, i: int, heads: int) -> dict[str, np.ndarray]:
  p, q = f"encoder.layers.{i}.", f"Transformer/encoderblock_{i}/"
  att, out = q + "MultiHeadDotProductAttention_1/", {}
  out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "layer_norm1")
  for name in ("q", "k", "v"):
    dense = sd.linear(p + f"self_attn.{name}_proj", "")
    d = dense["kernel"].shape[0]
    full = {"q": "query", "k": "key", "v": "value"}[name]
    out[att + f"{full}/kernel"] = dense["kernel"].reshape(d, heads, d // heads)
    out[att + f"{full}/bias"] = dense["bias"].reshape(heads, d // heads)
  dense = sd.linear(p + "self_attn.out_proj", "")
  out[att + "out/kernel"] = dense["kernel"].reshape(heads, -1, dense["kernel"].shape[-1])
  out[att + "out/bias"] = dense["bias"]
  out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(p + "layer_norm2")
  out |= sd.linear(p + "mlp.fc1", q + "MlpBlock_3/Dense_0/")
  out |= sd.linear(p + "mlp.fc2", q + "MlpBlock_3/Dense_1/")
  return out


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """The image tower's state dict (numpy) as flat original-layout arrays; the text tower of a
  CLIPModel is left out (one logged line); raises CheckpointError naming any other array it
  does not use."""
  sd = state_dict.StateDict({k.removeprefix("vision_model."): v for k, v in arrays.items()},
                            source)
  sd.leave_out(_TEXT_TOWER, "a CLIPModel's text tower, which vit_jax's image model has no "
               "place for")
  heads = int(vision_config(config).get("num_attention_heads") or 0)
  if not heads:
    raise CheckpointError(f"{source}: its config.json names no num_attention_heads.")
  e, out = "embeddings.", {}
  out["embedding/kernel"] = sd.conv(e + "patch_embedding.weight")
  out["cls"] = sd.take(e + "class_embedding").reshape(1, 1, -1)
  posemb = sd.take(e + "position_embedding.weight")
  out[POSEMB_KEY] = posemb[None]
  _position_ids(sd, e + "position_ids", posemb.shape[0])
  out["Transformer/pre_norm/scale"], out["Transformer/pre_norm/bias"] = sd.take_pair(
      "pre_layrnorm")
  for i in sd.numbered("encoder.layers.", ".layer_norm1.weight"):
    out |= _block(sd, i, heads)
  out["Transformer/encoder_norm/scale"], out["Transformer/encoder_norm/bias"] = sd.take_pair(
      "post_layernorm")
  if sd.has("visual_projection.weight"):
    out["head/kernel"] = sd.take("visual_projection.weight").T
  sd.check_all_used()
  return out


def gelu(config: Mapping[str, Any], origin: str) -> str:
  act = str(vision_config(config).get("hidden_act", "quick_gelu"))
  if act not in _GELUS:
    raise CheckpointError(f"{origin}: hidden_act={act!r} is not a GELU vit_jax's ViT runs.")
  return _GELUS[act]


def _side(value: Any, key: str) -> int | None:
  """A size entry of preprocessor_config.json: an int, or a dict with `key` (or height and
  width, equal)."""
  if isinstance(value, dict):
    if key in value:
      return int(value[key])
    if value.get("height") != value.get("width"):
      raise CheckpointError(f"a non-square processor size {value} is not supported.")
    value = value.get("height")
  return None if value is None else int(value)


def processor_preprocessing(processor: Mapping[str, Any]) -> desc_lib.Preprocessing:
  """CLIPImageProcessor's preprocessor_config.json: the shorter side resized to
  size.shortest_edge, the centre crop_size cut out (crop_size / shortest_edge is the central
  crop fraction), normalised with its mean and std (OpenAI's by default)."""
  mean = processor.get("image_mean", repo_config.OPENAI_CLIP_MEAN)
  std = processor.get("image_std", repo_config.OPENAI_CLIP_STD)
  if not processor.get("do_normalize", True):
    mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
  interpolation = "bilinear" if processor.get("resample", _BICUBIC) == 2 else "bicubic"
  common = dict(mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std),
                interpolation=interpolation)
  size = processor.get("size", 224)
  if not processor.get("do_center_crop", True):
    if isinstance(size, dict) and "shortest_edge" in size:
      raise CheckpointError("preprocessor_config.json resizes the shorter side without a crop: "
                            "non-square inputs, which vit_jax's square evaluation does not give.")
    return desc_lib.Preprocessing(crop="resize", **common)
  shortest = _side(size, "shortest_edge")
  crop = _side(processor.get("crop_size", 224), "shortest_edge")
  if not shortest or not crop or crop > shortest:
    raise CheckpointError(f"preprocessor_config.json: a crop of {crop} from a shorter side of "
                          f"{shortest} is not a central crop vit_jax applies.")
  return desc_lib.Preprocessing(crop="central_crop", central_crop_fraction=crop / shortest,
                                geometry="transformers", **common)


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What config.json (its vision_config) says the arrays are (layouts/__init__.py's contract)."""
  return transformers_vit.declared(vision_config(config))


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description config.json (its vision_config) and preprocessor_config.json give."""
  vision = vision_config(config)
  fields = fields | {"gelu": gelu(config, origin),
                     "layer_norm_eps": float(vision.get("layer_norm_eps", 1e-5)),
                     "posemb_interpolation": "bicubic_no_antialias"}
  return desc_lib.Description(
      model=fields, model_name=models.registry.match_name(fields),
      num_classes=repo_config.num_classes(flat),
      image_size=int(vision.get("image_size", desc_lib.DEFAULT_IMAGE_SIZE)),
      preprocessing=processor_preprocessing(processor))
