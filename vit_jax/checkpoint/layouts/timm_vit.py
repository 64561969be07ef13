"""timm's ViT weights (the `timm/` repos of the Hugging Face Hub, `model.safetensors`) in the
released layout, with numpy alone: the inverse of timm's `_load_weights`.

Covers timm's `VisionTransformer` and its hybrids: class token or none, `token` / `avg` / `map`
pooling, `fc_norm` (the final norm after pooling), registers with or without position
embeddings (`no_embed_class`), an old-style `pre_logits.fc`, SigLIP's attention-pool head, the
ResNet-v2 stems of `vit_*_r50_*`, `vit_*_r26_*` and `vit_tiny_r_s16_p8`, and the families built
on it: DINOv2 (`*_dinov2*`: LayerScale, registers, the giant's `SwiGLUPacked` MLP, whose fc1
holds the gate and then the value as our `swiglu` Dense_0) and CLIP's image towers
(`*_clip_*`: `norm_pre`, no patch bias, LayerNorm epsilon 1e-5, the projection as a head whose
bias timm's converter wrote as zeros, QuickGELU where timm says so), and `avg` pooling beside a
class token (MAE's). What the model here cannot express (q/k norms, BEiT's q/v biases, a MAP head
beside a class token) is refused by name, as is any array this reader does not use: nothing is
dropped without a word.

`to_npz` reads a live timm model the same way: the tests' and benchmarks' weights of timm's
reference models (models/timm_models.py) in the released layout.
"""
import math
import re
from typing import Any, Mapping

import numpy as np

from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import repo_config, state_dict
from vit_jax.checkpoint.npz import POSEMB_KEY

NAME = "timm"
_CLIP_LAYER_NORM_EPS = 1e-5  # timm's `*_clip_*` ViTs: partial(LayerNorm, eps=1e-5).
# timm's eva.py architectures (layouts/timm_eva.py reads those it can, by their arrays).
_EVA_ARCHITECTURES = r"^eva|^vit_pe_|_rope_|_dinov3"
# Arrays timm models hold that this ViT has no place for: the reason, said once.
_UNSUPPORTED = {
    r"\.(q_norm|k_norm)\.": "query/key normalisation (q_norm, k_norm)",
    r"\.attn\.(q_bias|v_bias)$": "separate query/value biases (BEiT's layout)",
}


def matches(keys: Any) -> bool:
  return "patch_embed.proj.weight" in keys and "blocks.0.attn.qkv.weight" in keys


def _backbone(sd: state_dict.StateDict) -> dict[str, np.ndarray]:
  """The hybrids' ResNet-v2 stem (timm's ResNetV2 with StdConv: weights as stored)."""
  b, out = "patch_embed.backbone.", {}
  stem = b + "stem." if sd.has(b + "stem.conv.weight") else b  # Stem-only: R+ViT-Ti_16.
  out["conv_root/kernel"] = sd.conv(stem + "conv.weight")
  out["gn_root/scale"], out["gn_root/bias"] = sd.take_pair(stem + "norm")
  for i in sd.numbered(b + "stages.", ".blocks.0.conv1.weight"):
    for j in sd.numbered(f"{b}stages.{i}.blocks.", ".conv1.weight"):
      p, q = f"{b}stages.{i}.blocks.{j}.", f"block{i + 1}/unit{j + 1}/"
      for r in (1, 2, 3):
        out[q + f"conv{r}/kernel"] = sd.conv(p + f"conv{r}.weight")
        out[q + f"gn{r}/scale"], out[q + f"gn{r}/bias"] = sd.take_pair(p + f"norm{r}")
      if sd.has(p + "downsample.conv.weight"):
        out[q + "conv_proj/kernel"] = sd.conv(p + "downsample.conv.weight")
        out[q + "gn_proj/scale"], out[q + "gn_proj/bias"] = sd.take_pair(p + "downsample.norm")
  return out


def _square(n: int) -> bool:
  return n >= 0 and math.isqrt(n) ** 2 == n


def _tokens(sd: state_dict.StateDict) -> dict[str, np.ndarray]:
  """Class token, registers, position embedding. Ours covers the class token (a zero row
  where timm's `no_embed_class` gives it none) and the patches; registers get none, so rows
  timm gives them are folded into the registers."""
  out, posemb = {}, sd.take("pos_embed")
  cls = sd.has("cls_token")
  if cls:
    out["cls"] = sd.take("cls_token")
  registers = sd.take("reg_token") if sd.has("reg_token") else None
  prefix = int(cls) + (0 if registers is None else registers.shape[1])
  n = posemb.shape[1]
  layouts = [embed for embed, ok in ((False, _square(n)), (True, prefix and _square(n - prefix)))
             if ok]
  if len(layouts) != 1:
    raise CheckpointError(f"{sd.name}: pos_embed's {n} rows are not a square patch grid with or "
                          f"without the {prefix} prefix tokens' rows.")
  if not layouts[0] and cls:  # no_embed_class: the class token had no position embedding.
    posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
  if registers is not None:
    if layouts[0]:
      registers = registers + posemb[:, int(cls):prefix]
      posemb = np.delete(posemb, np.s_[int(cls):prefix], axis=1)
    out["reg"] = registers
  out[POSEMB_KEY] = posemb
  return out


def _attention(sd: state_dict.StateDict, p: str, q: str, heads: int) -> dict[str, np.ndarray]:
  """timm's fused qkv and proj (block `p`) as query/key/value/out of block `q`; a qkv without
  bias (`qkv_bias=False`) as the model's qkv_bias="none"."""
  w = sd.take(p + "attn.qkv.weight")
  b = sd.take(p + "attn.qkv.bias") if sd.has(p + "attn.qkv.bias") else None
  d = w.shape[1]
  out = {}
  for n, name in enumerate(("query", "key", "value")):
    out[q + f"{name}/kernel"] = w[n * d:(n + 1) * d].T.reshape(d, heads, d // heads)
    if b is not None:
      out[q + f"{name}/bias"] = b[n * d:(n + 1) * d].reshape(heads, d // heads)
  out[q + "out/kernel"] = sd.take(p + "attn.proj.weight").T.reshape(heads, d // heads, d)
  out[q + "out/bias"] = sd.take(p + "attn.proj.bias")
  return out


def _blocks(sd: state_dict.StateDict, heads: int) -> dict[str, np.ndarray]:
  out = {}
  for i in sd.numbered("blocks.", ".norm1.weight"):
    p, q = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
    out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "norm1")
    out |= _attention(sd, p, q + "MultiHeadDotProductAttention_1/", heads)
    out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(p + "norm2")
    # A GELU Mlp, or SwiGLUPacked (DINOv2-g): fc1 twice as wide as fc2 reads, gate first.
    out |= sd.linear(p + "mlp.fc1", q + "MlpBlock_3/Dense_0/")
    out |= sd.linear(p + "mlp.fc2", q + "MlpBlock_3/Dense_1/")
    if sd.has(p + "ls1.gamma"):  # LayerScale (DINOv2), on both branches.
      out[q + "LayerScale_0/scale"] = sd.take(p + "ls1.gamma")
      out[q + "LayerScale_1/scale"] = sd.take(p + "ls2.gamma")
  return out


def _attention_pool(sd: state_dict.StateDict, heads: int) -> dict[str, np.ndarray]:
  """SigLIP's head (timm's AttentionPoolLatent) as big_vision's MAPHead."""
  q, out = "MAPHead_0/MultiHeadDotProductAttention_0/", {}
  out["MAPHead_0/probe"] = sd.take("attn_pool.latent")
  if out["MAPHead_0/probe"].shape[1] != 1:
    raise CheckpointError(f"{sd.name}: an attention pool of several latents is not supported.")
  d = out["MAPHead_0/probe"].shape[-1]
  kv_w, kv_b = sd.take("attn_pool.kv.weight"), sd.take("attn_pool.kv.bias")
  parts = {"query": (sd.take("attn_pool.q.weight"), sd.take("attn_pool.q.bias")),
           "key": (kv_w[:d], kv_b[:d]), "value": (kv_w[d:], kv_b[d:])}
  for name, (w, b) in parts.items():
    out[q + f"{name}/kernel"] = w.T.reshape(d, heads, d // heads)
    out[q + f"{name}/bias"] = b.reshape(heads, d // heads)
  out[q + "out/kernel"] = sd.take("attn_pool.proj.weight").T.reshape(heads, d // heads, d)
  out[q + "out/bias"] = sd.take("attn_pool.proj.bias")
  out["MAPHead_0/LayerNorm_0/scale"], out["MAPHead_0/LayerNorm_0/bias"] = sd.take_pair(
      "attn_pool.norm")
  out |= sd.linear("attn_pool.mlp.fc1", "MAPHead_0/MlpBlock_0/Dense_0/")
  out |= sd.linear("attn_pool.mlp.fc2", "MAPHead_0/MlpBlock_0/Dense_1/")
  return out


def _check_architecture(config: Mapping[str, Any], source: str) -> None:
  """timm's eva.py models whose arrays read as a ViT's (the Perception Encoder's, timm's
  `vit_*_rope_*`) compute with a rotary embedding no array shows: refused by name, not loaded
  without it."""
  arch = config.get("architecture") or ""
  if re.search(_EVA_ARCHITECTURES, arch):
    raise CheckpointError(f"{source}: {arch} is one of timm's eva.py models, whose arrays look "
                          "like a ViT's but whose attention is rotary in a way vit_jax's "
                          "timm_eva layout does not read (it reads DINOv3 and EVA-02).")


def _pooling(config: Mapping[str, Any], has_cls: bool, has_registers: bool,
             source: str) -> dict[str, Any]:
  """The classifier fields timm's global_pool (config.json's, else model_args') gives beyond
  what the arrays tell: the patches' mean beside a class token (MAE's, EVA-02's ImageNet heads')
  is classifier="gap" with class_token=True, which the class token alone would read as "token".
  A MAP head beside a class token, or a pool over the prefix tokens too (timm's
  pool_include_prefix, which only model_args tell), is refused."""
  args = config.get("model_args") or {}
  pool = config.get("global_pool", args.get("global_pool", "token" if has_cls else "avg"))
  if pool not in ("token", "avg", "map", ""):
    raise CheckpointError(f"{source}: global_pool={pool!r} is not a pooling vit_jax's ViT has "
                          "(token, avg, map).")
  if pool == "map" and has_cls:
    raise CheckpointError(f"{source} pools with a MAP head beside a class token, which vit_jax's "
                          "ViT does not build: its MAP head is SigLIP's, without one.")
  if args.get("pool_include_prefix") and pool in ("avg", "map") and (has_cls or has_registers):
    raise CheckpointError(f"{source} pools over its prefix tokens too (pool_include_prefix), "
                          "which vit_jax's ViT does not: it pools the patches alone.")
  return dict(classifier="gap", class_token=True) if pool == "avg" and has_cls else {}


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """timm's state dict (numpy) as flat original-layout arrays; raises CheckpointError
  naming any array it does not use."""
  _check_architecture(config, source)
  state_dict.refuse_unsupported(arrays, _UNSUPPORTED, source)
  sd = state_dict.StateDict(arrays, source)
  _pooling(config, sd.has("cls_token"), sd.has("reg_token"), source)
  out = _backbone(sd) if any(k.startswith("patch_embed.backbone.") for k in arrays) else {}
  out["embedding/kernel"] = sd.conv("patch_embed.proj.weight")
  if sd.has("norm_pre.weight"):  # CLIP: a pre-norm, and a patch embedding without bias.
    out["Transformer/pre_norm/scale"], out["Transformer/pre_norm/bias"] = sd.take_pair("norm_pre")
  else:
    out["embedding/bias"] = sd.take("patch_embed.proj.bias")
  out |= _tokens(sd)
  fc1 = arrays.get("blocks.0.mlp.fc1.weight")
  if fc1 is None:  # timm's SwiGLU of separate fc1_g, fc1_x (AIMv2's), or another MLP.
    mlp = ", ".join(sorted(k for k in arrays if k.startswith("blocks.0.mlp.")))
    raise CheckpointError(f"{source}: block 0's MLP ({mlp}) is neither timm's Mlp nor its "
                          "SwiGLUPacked, the two whose arrays vit_jax's ViT has.")
  layers = len({k.split(".")[1] for k in arrays if k.startswith("blocks.")})
  heads = repo_config.timm_num_heads(config, fc1.shape[1], fc1.shape[0], layers,
                                     out["embedding/kernel"].shape[0])
  out |= _blocks(sd, heads)
  for name, key in (("norm", "Transformer/encoder_norm"), ("fc_norm", "fc_norm")):
    if sd.has(name + ".weight"):
      out[key + "/scale"], out[key + "/bias"] = sd.take_pair(name)
  if sd.has("attn_pool.latent"):
    out |= _attention_pool(sd, heads)
  if sd.has("pre_logits.fc.weight"):
    out |= sd.linear("pre_logits.fc", "pre_logits/")
  if sd.has("head.weight"):
    out |= _head(sd, clip="Transformer/pre_norm/scale" in out)
  sd.check_all_used()
  return out


def to_npz(model: Any) -> dict[str, np.ndarray]:
  """A timm VisionTransformer (a live torch module) as released .npz arrays: its state dict
  read as `to_released` reads a Hub repo's, with the pooling and heads the model tells (the
  inverse of timm's `_load_weights`; models/timm_models.py's `load_into` goes back). Only
  `state_dict()` and a few attributes are used: no torch import. A CLIP tower's all-zero head
  bias is kept, as timm holds it. Raises CheckpointError, one line, for what has no arrays of
  vit_jax's ViT."""
  source = f"timm's {type(model).__name__}"
  _check_module(model, source)
  arrays = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
  args = {"num_heads": model.blocks[0].attn.num_heads,
          "pool_include_prefix": getattr(model, "pool_include_prefix", False)}
  out = to_released(arrays, {"global_pool": model.global_pool, "model_args": args}, source)
  if "head.bias" in arrays:
    out["head/bias"] = arrays["head.bias"]
  return out


def _check_module(model: Any, source: str) -> None:
  """What a live model shows and its arrays do not: its class (eva.py's Eva holds arrays of
  another layout) and a gated MLP other than SwiGLUPacked (SiLU, gate first)."""
  if type(model).__name__ != "VisionTransformer":
    raise CheckpointError(f"to_npz converts timm's VisionTransformer, not its "
                          f"{type(model).__name__}: save it (timm's save_for_hf) and load the "
                          "folder, which vit_jax.checkpoint reads with its layouts (eva.py's: "
                          "layouts/timm_eva.py).")
  mlp = model.blocks[0].mlp
  if type(mlp).__name__ == "GluMlp" and (mlp.gate_last or type(mlp.act).__name__ != "SiLU"):
    raise CheckpointError(f"{source} has a GluMlp gated by {type(mlp.act).__name__}, gate "
                          f"{'last' if mlp.gate_last else 'first'}: vit_jax's swiglu is "
                          "SwiGLUPacked's (SiLU, gate first).")


def _head(sd: state_dict.StateDict, clip: bool) -> dict[str, np.ndarray]:
  """The classifier. A CLIP tower's (`clip`) is CLIP's projection, to which timm's converter
  gave an all-zero bias: left out, as the model's head_bias=False."""
  out = {"head/kernel": sd.take("head.weight").T}
  if sd.has("head.bias"):
    bias = sd.take("head.bias")
    if not clip or np.any(bias):
      out["head/bias"] = bias
  return out


def gelu(config: Mapping[str, Any]) -> str:
  """"quick" for weights trained with OpenAI's QuickGELU, as timm tells them: its `_quickgelu`
  models (act_layer='quick_gelu'), or a pretrained_cfg noting "natively QuickGELU" (the openai
  and metaclip tags, whose non-quickgelu models timm runs with the exact GELU); else
  repo_config's rule (Google's tanh, timm's exact)."""
  act = str((config.get("model_args") or {}).get("act_layer") or "")
  notes = " ".join((config.get("pretrained_cfg") or {}).get("notes") or ())
  if (act.replace("_", "") == "quickgelu" or "_quickgelu" in config.get("architecture", "")
      or "natively QuickGELU" in notes):
    return "quick"
  return repo_config.timm_gelu(config)


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What config.json says the arrays are (layouts/__init__.py's contract)."""
  return repo_config.timm_declared(config, "reg_tokens")


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description timm's config.json gives: resolution, preprocessing, classes, GELU
  (timm repos have no preprocessor_config; the origin changes nothing), with timm's LayerNorm
  epsilon (1e-5 in its CLIP towers, the pre-norm models; else 1e-6) and its resampling of the
  position embedding to another size (antialiased bicubic)."""
  del processor
  fields = fields | {"posemb_interpolation": "bicubic"}
  fields |= _pooling(config, "cls" in flat, "reg" in flat, origin)
  if fields.get("pre_norm"):
    fields["layer_norm_eps"] = _CLIP_LAYER_NORM_EPS
  return repo_config.timm_description(flat, fields, config, gelu(config))
