"""transformers' DINOv2 weights (`Dinov2Model`, as facebook/dinov2-* on the Hugging Face Hub hold
them) in the released layout, with numpy alone.

As transformers 5 runs them (models/dinov2/modeling_dinov2.py): a class token with a position
embedding, LayerScale (`layer_scale1/2.lambda1`) on both branches, the LayerNorm epsilon of
config.json, the exact GELU MLP or, with `use_swiglu_ffn` (dinov2-giant), SwiGLU, whose
`weights_in` holds the gate and then the value as our `swiglu` Dense_0. At another input size
transformers resamples the position embedding with torch's plain bicubic (no antialias, no
offset): the description's `posemb_interpolation` "bicubic_no_antialias".
`Dinov2WithRegistersModel` (facebook/dinov2-with-registers-*) too: its `register_tokens` after
the class token, without a position embedding, as our registers; it resamples with antialias
("bicubic"). `mask_token` serves
masked pre-training only and is left out. Preprocessing: BitImageProcessor's (the shorter side
to `size.shortest_edge`, bicubic, the centre `crop_size`), which reads as CLIPImageProcessor's
(transformers_clip.processor_preprocessing, in transformers' own geometry).
`Dinov2ForImageClassification`'s head reads the class
token and the patches' mean side by side, which vit_jax's ViT has no pooling for: refused.
"""
import re
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import state_dict, transformers_clip, transformers_vit

NAME = "transformers DINOv2"
# The backbone's prefix in a ...ForImageClassification: Dinov2's, Dinov2WithRegisters'.
_PREFIX = re.compile(r"^(dinov2|dinov2_with_registers)\.")


def matches(keys: Any) -> bool:
  return any(_PREFIX.sub("", k) == "encoder.layer.0.layer_scale1.lambda1" for k in keys)


def _mlp(sd: state_dict.StateDict, p: str, q: str) -> dict[str, np.ndarray]:
  if sd.has(p + "weights_in.weight"):  # SwiGLU: [gate; value] packed, as our Dense_0.
    names = ("weights_in", "weights_out")
  else:
    names = ("fc1", "fc2")
  return sd.linear(p + names[0], q + "Dense_0/") | sd.linear(p + names[1], q + "Dense_1/")


def _block(sd: state_dict.StateDict, i: int, heads: int) -> dict[str, np.ndarray]:
  p, q = f"encoder.layer.{i}.", f"Transformer/encoderblock_{i}/"
  att, out = q + "MultiHeadDotProductAttention_1/", {}
  out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "norm1")
  for name in ("query", "key", "value"):
    a = p + f"attention.attention.{name}."
    w = sd.take(a + "weight").T
    out[att + f"{name}/kernel"] = w.reshape(w.shape[0], heads, -1)
    if sd.has(a + "bias"):  # Else config.qkv_bias=false.
      out[att + f"{name}/bias"] = sd.take(a + "bias").reshape(heads, -1)
  dense = sd.linear(p + "attention.output.dense", "")
  out[att + "out/kernel"] = dense["kernel"].reshape(heads, -1, dense["kernel"].shape[-1])
  out[att + "out/bias"] = dense["bias"]
  out[q + "LayerScale_0/scale"] = sd.take(p + "layer_scale1.lambda1")
  out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(p + "norm2")
  out |= _mlp(sd, p + "mlp.", q + "MlpBlock_3/")
  out[q + "LayerScale_1/scale"] = sd.take(p + "layer_scale2.lambda1")
  return out


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """transformers' Dinov2Model state dict (numpy) as flat original-layout arrays; raises
  CheckpointError for a classifier on [class token, patch mean] and for any array it does not
  use."""
  if "classifier.weight" in arrays:
    raise CheckpointError(
        f"{source} is a Dinov2(WithRegisters)ForImageClassification, whose head reads the class "
        "token and the patches' mean concatenated, a pooling vit_jax's ViT does not have: load its backbone "
        "(a Dinov2Model's arrays) instead.")
  sd = state_dict.StateDict({_PREFIX.sub("", k): v for k, v in arrays.items()}, source)
  heads, out = transformers_vit.num_heads(config, source), transformers_vit.embeddings(sd)
  if sd.has("embeddings.mask_token"):  # Masked pre-training's input; inference never reads it.
    sd.take("embeddings.mask_token")
  if sd.has("embeddings.register_tokens"):  # Dinov2WithRegistersModel's, after the class token.
    out["reg"] = sd.take("embeddings.register_tokens")
  for i in sd.numbered("encoder.layer.", ".norm1.weight"):
    out |= _block(sd, i, heads)
  out["Transformer/encoder_norm/scale"], out["Transformer/encoder_norm/bias"] = sd.take_pair(
      "layernorm")
  sd.check_all_used()
  return out


def _image_size(config: Mapping[str, Any], processor: Mapping[str, Any]) -> int:
  """What the processor feeds the model: its centre crop (facebook/dinov2-*: 224 of 256), else
  config.json's image_size (518: the position embedding's)."""
  crop = processor.get("crop_size") if processor.get("do_center_crop", True) else None
  side = crop.get("height") if isinstance(crop, dict) else crop
  return int(side or config.get("image_size", desc_lib.DEFAULT_IMAGE_SIZE))


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What config.json says the arrays are (layouts/__init__.py's contract): Dinov2Config's
  sizes, its MLP's width (hidden_size x mlp_ratio, where it is no SwiGLU) and registers
  (Dinov2WithRegistersConfig's num_register_tokens; a Dinov2Config has none)."""
  out = transformers_vit.declared(config)
  if config.get("mlp_ratio") and config.get("hidden_size") and not config.get("use_swiglu_ffn"):
    out["mlp_dim"] = int(config["hidden_size"] * config["mlp_ratio"])
  out["num_registers"] = int(config.get("num_register_tokens") or 0)
  return out


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description config.json and preprocessor_config.json give: the exact GELU (or SwiGLU),
  the config's LayerNorm epsilon, transformers' resampling of the position embedding, and the
  processor's crop as the resolution (the embedding, e.g. 518 px's, is fitted to it on load)."""
  act = str(config.get("hidden_act", "gelu"))
  if act != "gelu" and fields.get("mlp") != "swiglu":
    raise CheckpointError(f"{origin}: hidden_act={act!r} is not a GELU vit_jax's ViT runs.")
  # Dinov2WithRegistersModel resamples with antialias, Dinov2Model without.
  resample = "bicubic" if "reg" in flat else "bicubic_no_antialias"
  fields = fields | {"gelu": "exact", "layer_norm_eps": float(config.get("layer_norm_eps", 1e-6)),
                     "posemb_interpolation": resample}
  return desc_lib.Description(
      model=fields, model_name=models.registry.match_name(fields), num_classes=None,
      image_size=_image_size(config, processor),
      # BitImageProcessor: CLIPImageProcessor's resize, crop and defaults.
      preprocessing=transformers_clip.processor_preprocessing(processor))
