"""transformers' ViT weights (`ViTModel`, `ViTForImageClassification`, as google/vit-* on the
Hugging Face Hub hold them) in the released layout, with numpy alone.

Google's uploads are the released JAX checkpoints converted: `pooler` is the pre-logits layer
(dense + tanh on the class token), `classifier` the head, and the weights were trained with
flax's tanh GELU although transformers runs the exact one (`hidden_act: gelu`).
"""
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib, specs
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import repo_config, state_dict
from vit_jax.checkpoint.npz import POSEMB_KEY

NAME = "transformers"
_TANH_ACTS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")
# Organisations whose transformers ViTs are conversions of JAX-trained (tanh GELU) weights.
_JAX_TRAINED_ORGS = ("google/",)
# config.json's sizes (transformers' ViT, DINOv2 and CLIP configs), as model fields.
_DECLARED = {"patch_size": "patch_size", "hidden_size": "hidden_size",
             "mlp_dim": "intermediate_size", "num_layers": "num_hidden_layers"}


def matches(keys: Any) -> bool:
  return any(k.removeprefix("vit.") == "embeddings.patch_embeddings.projection.weight"
             for k in keys)


def _dense(sd: state_dict.StateDict, p: str, q: str, heads: int | None = None,
           out: bool = False) -> dict[str, np.ndarray]:
  """A torch Linear as a flax Dense, or a DenseGeneral over heads (into or out of them)."""
  dense = sd.linear(p, "")
  w, b = dense["kernel"], dense["bias"]
  if heads and out:
    w = w.reshape(heads, -1, w.shape[-1])
  elif heads:
    w, b = w.reshape(w.shape[0], heads, -1), b.reshape(heads, -1)
  return {q + "kernel": w, q + "bias": b}


def _block(sd: state_dict.StateDict, i: int, heads: int) -> dict[str, np.ndarray]:
  p, q = f"encoder.layer.{i}.", f"Transformer/encoderblock_{i}/"
  att, out = q + "MultiHeadDotProductAttention_1/", {}
  out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(
      p + "layernorm_before")
  for name in ("query", "key", "value"):
    out |= _dense(sd, p + f"attention.attention.{name}", att + f"{name}/", heads)
  out |= _dense(sd, p + "attention.output.dense", att + "out/", heads, out=True)
  out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(
      p + "layernorm_after")
  out |= _dense(sd, p + "intermediate.dense", q + "MlpBlock_3/Dense_0/")
  out |= _dense(sd, p + "output.dense", q + "MlpBlock_3/Dense_1/")
  return out


def num_heads(config: Mapping[str, Any], source: str) -> int:
  heads = int(config.get("num_attention_heads") or 0)
  if not heads:
    raise CheckpointError(f"{source}: its config.json names no num_attention_heads.")
  return heads


def embeddings(sd: state_dict.StateDict) -> dict[str, np.ndarray]:
  """The patch embedding, class token and position embedding under `embeddings.` (ViT's and
  DINOv2's names)."""
  e, out = "embeddings.", {}
  out["embedding/kernel"] = sd.conv(e + "patch_embeddings.projection.weight")
  out["embedding/bias"] = sd.take(e + "patch_embeddings.projection.bias")
  out["cls"] = sd.take(e + "cls_token")
  out[POSEMB_KEY] = sd.take(e + "position_embeddings")
  return out


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """transformers' ViT state dict (numpy) as flat original-layout arrays; raises
  CheckpointError naming any array it does not use."""
  sd = state_dict.StateDict({k.removeprefix("vit."): v for k, v in arrays.items()}, source)
  heads, out = num_heads(config, source), embeddings(sd)
  for i in sd.numbered("encoder.layer.", ".layernorm_before.weight"):
    out |= _block(sd, i, heads)
  out["Transformer/encoder_norm/scale"], out["Transformer/encoder_norm/bias"] = sd.take_pair(
      "layernorm")
  for prefix, to in (("pooler.dense", "pre_logits/"), ("classifier", "head/")):
    if sd.has(prefix + ".weight"):
      out |= sd.linear(prefix, to)
  sd.check_all_used()
  return out


def gelu(config: Mapping[str, Any], origin: str) -> str:
  """"tanh" where the config says so, or where the weights are Google's JAX-trained ones
  (the repo, or the config's `_name_or_path`, under google/); else transformers' exact GELU."""
  act = str(config.get("hidden_act", "gelu"))
  if act in _TANH_ACTS:
    return "tanh"
  if act != "gelu":
    raise CheckpointError(f"{origin}: hidden_act={act!r} is not a GELU vit_jax's ViT runs.")
  named = (origin.removeprefix(specs.HUB_PREFIX), str(config.get("_name_or_path", "")))
  return "tanh" if any(n.startswith(_JAX_TRAINED_ORGS) for n in named) else "exact"


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What config.json says the arrays are (layouts/__init__.py's contract): ViTConfig's, and
  CLIP's and DINOv2's (their vision config's) sizes where they name them."""
  out = {field: int(config[key]) for field, key in _DECLARED.items() if config.get(key)}
  if config.get("image_size"):
    out["image_size"] = repo_config.side(config["image_size"])
  return out


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description transformers' config.json and preprocessor_config.json give, with
  transformers' resampling of the position embedding to another size (ViTEmbeddings'
  interpolate_pos_encoding: torch's bicubic without antialias)."""
  num_classes = repo_config.num_classes(flat)
  fields = fields | {"gelu": gelu(config, origin), "posemb_interpolation": "bicubic_no_antialias"}
  return desc_lib.Description(
      model=fields, model_name=models.registry.match_name(fields), num_classes=num_classes,
      image_size=int(config.get("image_size", desc_lib.DEFAULT_IMAGE_SIZE)),
      preprocessing=repo_config.processor_preprocessing(processor),
      class_names=repo_config.id2label_names(config, num_classes))
