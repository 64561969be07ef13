"""OpenCLIP's own layout (`open_clip_model.safetensors` beside `open_clip_config.json`, as
open_clip's `push_to_hf_hub` writes them): the image tower of its ViT, `visual.*`, in the
released layout, with numpy alone.

open_clip's VisionTransformer is vit_jax's ViT with `pre_norm` (`ln_pre`; `conv1` has no bias:
a zero bias where `no_ln_pre` leaves the norm out), LayerNorm epsilon 1e-5 (or
`norm_kwargs.eps`), QuickGELU where `model_cfg.quick_gelu` says so (else torch's exact GELU),
fused `in_proj` attention. `ln_post` is the encoder's final norm (`pool_type` 'tok': the class
token's values are the same, while `encoded` holds every token normalised, where open_clip's
tokens output is not for 'tok' only after pooling), or timm's `fc_norm` ('avg' with
`final_ln_after_pool`); `proj` is the head, without bias: the logits are `encode_image`'s
features (not normalised).

The file always holds the text tower too (`token_embedding`, `transformer.*`, `ln_final`,
`text_projection`, `logit_scale`, ...): it is left out, named in one logged line (as a
CLIPModel's in layouts/transformers_clip.py, which says why).

Other resolutions: the position embedding's grid is resampled as open_clip's
`resize_pos_embed` does when it loads weights at another `image_size` (torch's bicubic with
antialiasing: 'bicubic'). Preprocessing (`preprocess_cfg`, open_clip's `image_transform`):
'shortest' is torchvision's Resize(size) and CenterCrop(size), vit_jax's 'central_crop' at
fraction 1 in torchvision's geometry exactly; 'squash' a resize to size x size; 'longest' ResizeKeepRatio(longest=1) and
CenterCropOrPad, vit_jax's 'letterbox_central_crop', which pads with round(255 * mean) as timm
does where open_clip pads with `fill_color` (0 by default).
"""
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import repo_config, state_dict
from vit_jax.checkpoint.npz import POSEMB_KEY

NAME = "OpenCLIP"
_CROPS = {"shortest": "central_crop", "squash": "resize", "longest": "letterbox_central_crop"}
_POOLS = ("tok", "avg")


def matches(keys: Any) -> bool:
  return ("visual.conv1.weight" in keys
          and "visual.transformer.resblocks.0.attn.in_proj_weight" in keys)


def vision_cfg(config: Mapping[str, Any]) -> Mapping[str, Any]:
  return (config.get("model_cfg") or {}).get("vision_cfg") or {}


def _check(config: Mapping[str, Any], source: str) -> None:
  """Refuses, by name, the settings no array shows that vit_jax's ViT does not compute."""
  vision = vision_cfg(config)
  if not vision:
    raise CheckpointError(f"{source}: open_clip_config.json has no model_cfg.vision_cfg.")
  pool = vision.get("pool_type", "tok")
  if vision.get("attentional_pool") or pool not in _POOLS:
    raise CheckpointError(f"{source}: vision_cfg pools with attentional_pool="
                          f"{vision.get('attentional_pool', False)!r}, pool_type={pool!r}; "
                          f"vit_jax's ViT pools the class token or the patches' mean "
                          f"(pool_type {' or '.join(_POOLS)}).")
  act = vision.get("act_kwargs") or {}
  if set(act) - {"approximate"}:
    raise CheckpointError(f"{source}: vision_cfg.act_kwargs={act} is not a GELU vit_jax runs.")


def _block(sd: state_dict.StateDict, i: int, heads: int) -> dict[str, np.ndarray]:
  p, q = f"visual.transformer.resblocks.{i}.", f"Transformer/encoderblock_{i}/"
  att, out = q + "MultiHeadDotProductAttention_1/", {}
  out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "ln_1")
  w, b = sd.take(p + "attn.in_proj_weight"), sd.take(p + "attn.in_proj_bias")
  d = w.shape[1]
  for n, name in enumerate(("query", "key", "value")):
    out[att + f"{name}/kernel"] = w[n * d:(n + 1) * d].T.reshape(d, heads, d // heads)
    out[att + f"{name}/bias"] = b[n * d:(n + 1) * d].reshape(heads, d // heads)
  dense = sd.linear(p + "attn.out_proj", "")
  out[att + "out/kernel"] = dense["kernel"].reshape(heads, d // heads, d)
  out[att + "out/bias"] = dense["bias"]
  out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(p + "ln_2")
  out |= sd.linear(p + "mlp.c_fc", q + "MlpBlock_3/Dense_0/")
  out |= sd.linear(p + "mlp.c_proj", q + "MlpBlock_3/Dense_1/")
  return out


def _heads(config: Mapping[str, Any], width: int, source: str) -> int:
  head_width = int(vision_cfg(config).get("head_width", 64))
  if width % head_width:
    raise CheckpointError(f"{source}: vision_cfg.head_width {head_width} does not divide the "
                          f"width {width}.")
  return width // head_width


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """The image tower's arrays (numpy) as flat original-layout arrays; the text tower is left
  out (one logged line); raises CheckpointError naming any other array it does not use."""
  _check(config, source)
  sd = state_dict.StateDict(arrays, source)
  text = sorted({k.partition(".")[0] + ("." if "." in k else "") for k in arrays
                 if not k.startswith("visual.")})
  sd.leave_out(tuple(text), "OpenCLIP's text tower, which vit_jax's image model has no place "
               "for")
  out = {"embedding/kernel": sd.conv("visual.conv1.weight")}
  width = out["embedding/kernel"].shape[-1]
  out["cls"] = sd.take("visual.class_embedding").reshape(1, 1, -1)
  out[POSEMB_KEY] = sd.take("visual.positional_embedding")[None]
  if sd.has("visual.ln_pre.weight"):
    out["Transformer/pre_norm/scale"], out["Transformer/pre_norm/bias"] = sd.take_pair(
        "visual.ln_pre")
  else:  # no_ln_pre: conv1 still has no bias.
    out["embedding/bias"] = np.zeros(width, out["embedding/kernel"].dtype)
  heads = _heads(config, width, source)
  for i in sd.numbered("visual.transformer.resblocks.", ".ln_1.weight"):
    out |= _block(sd, i, heads)
  vision = vision_cfg(config)
  fc_norm = vision.get("pool_type", "tok") == "avg" and vision.get("final_ln_after_pool")
  norm = "fc_norm" if fc_norm else "Transformer/encoder_norm"
  out[norm + "/scale"], out[norm + "/bias"] = sd.take_pair("visual.ln_post")
  if sd.has("visual.proj"):
    out["head/kernel"] = sd.take("visual.proj")
  sd.check_all_used()
  return out


def gelu(config: Mapping[str, Any]) -> str:
  if (config.get("model_cfg") or {}).get("quick_gelu"):
    return "quick"
  act = vision_cfg(config).get("act_kwargs") or {}
  return "tanh" if act.get("approximate") == "tanh" else "exact"


def preprocessing(config: Mapping[str, Any], source: str) -> desc_lib.Preprocessing:
  """open_clip's eval transform of `preprocess_cfg` (open_clip's defaults where it is silent)."""
  cfg = config.get("preprocess_cfg") or {}
  mode = cfg.get("resize_mode", "shortest")
  if mode not in _CROPS:
    raise CheckpointError(f"{source}: preprocess_cfg.resize_mode={mode!r} is not open_clip's.")
  return desc_lib.Preprocessing(
      mean=tuple(float(v) for v in cfg.get("mean", repo_config.OPENAI_CLIP_MEAN)),
      std=tuple(float(v) for v in cfg.get("std", repo_config.OPENAI_CLIP_STD)),
      interpolation="bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic",
      crop=_CROPS[mode], central_crop_fraction=1.0, geometry="torchvision")


def _image_size(config: Mapping[str, Any], source: str) -> int:
  size = vision_cfg(config).get("image_size", 224)
  if isinstance(size, (list, tuple)):
    if len(set(size)) != 1:
      raise CheckpointError(f"{source}: a non-square image_size {size} is not supported.")
    size = size[0]
  return int(size)


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What open_clip_config.json's vision_cfg says the arrays are (layouts/__init__.py's
  contract): width, layers, patch size, MLP width (width x mlp_ratio) and resolution."""
  vision, out = vision_cfg(config), {}
  for field, key in (("hidden_size", "width"), ("num_layers", "layers"),
                     ("patch_size", "patch_size"), ("image_size", "image_size")):
    if vision.get(key):
      out[field] = repo_config.side(vision[key])
  if vision.get("width"):
    out["mlp_dim"] = int(vision["width"] * vision.get("mlp_ratio", 4.0))
  return out


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description open_clip_config.json gives (there is no preprocessor_config.json)."""
  del processor
  vision = vision_cfg(config)
  fields = fields | {"gelu": gelu(config), "posemb_interpolation": "bicubic",
                     "layer_norm_eps": float((vision.get("norm_kwargs") or {}).get("eps", 1e-5))}
  if vision.get("pool_type", "tok") == "avg":
    fields |= {"classifier": "gap", "class_token": True}
  return desc_lib.Description(
      model=fields, model_name=models.registry.match_name(fields),
      num_classes=repo_config.num_classes(flat), image_size=_image_size(config, origin),
      preprocessing=preprocessing(config, origin))
