"""timm's `eva.py` models (the `timm/` repos of the Hugging Face Hub, `model.safetensors`) in
the released layout: DINOv3 (`vit_*_patch16_dinov3*`) and EVA-02 (`eva02_*`, its CLIP image
towers included).

What an Eva computes is not all in its arrays: the rotary embedding (its kind, the grid EVA-02
scales positions to), the LayerNorm epsilon and the head count come from config.json's
`architecture`, as eva.py defines it, with the `model_args` a newer export records on top; the
pooling from `global_pool`. Arrays the model here has no place for (q/k norms, gated
attention, learned rotary frequencies, an attention pool, BEiT's relative position biases)
are refused by name, as is any array this reader does not use, and an eva.py architecture
outside these families by its name.
"""
import math
import re
from typing import Any, Mapping

import numpy as np

from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.layouts import repo_config, state_dict
from vit_jax.checkpoint.npz import POSEMB_KEY

NAME = "timm eva.py"
# Arrays of eva.py (and BEiT) models that this ViT has no place for: the reason, said once.
_UNSUPPORTED = {
    r"\.attn\.(q_norm|k_norm)\.": "query/key normalisation (q_norm, k_norm)",
    r"\.attn\.gate\.": "gated attention (attn.gate)",
    r"^rope\.": "learned rotary frequencies (rope_type='mixed')",
    r"^attn_pool\.": "an attention pool (global_pool='map')",
    r"^norm_pre\.": "a norm before the blocks (norm_pre, Perception Encoder's layout)",
    r"relative_position": "relative position biases (BEiT's layout)",
}
# The eva.py architectures read here: (name pattern, what the name implies of the arguments
# that no array shows, LayerNorm epsilon, heads by width). From timm 1.0's model definitions.
_DINOV3 = (r"vit_\w+_patch16_dinov3(_qkvb)?",
           dict(use_rot_pos_emb=True, rope_type="dinov3", rope_temperature=100,
                rope_rotate_half=True),
           1e-5, {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32})
_EVA02 = (r"eva02_(tiny|small|base|large)_patch1[46]_(clip_)?(224|336|448)",
          dict(use_rot_pos_emb=True, ref_feat_shape=16), 1e-6,
          {192: 3, 384: 6, 768: 12, 1024: 16})
_FAMILIES = (_DINOV3, _EVA02)
# What each family's arrays hold that its name implies (Eva's use_abs_pos_emb, num_reg_tokens):
# DINOv3 has four registers and no learned embedding, EVA-02 a learned one and no registers.
_FAMILY_ARRAYS = {_DINOV3[0]: dict(posemb="none", num_registers=4),
                  _EVA02[0]: dict(posemb="learn", num_registers=0)}
# Eva's defaults of those arguments.
_EVA_DEFAULTS = dict(use_rot_pos_emb=False, rope_type="cat", rope_temperature=10000.,
                     rope_rotate_half=False, rope_grid_offset=0., rope_grid_indexing="ij",
                     ref_feat_shape=None, use_post_norm=False, attn_type="eva",
                     num_kv_heads=None)


def matches(keys: Any) -> bool:
  """Eva's own names: LayerScale as gamma_1, q/v biases beside a fused qkv, or separate
  q/k/v projections (timm's VisionTransformer has none of them)."""
  return "patch_embed.proj.weight" in keys and any(
      k in keys for k in ("blocks.0.gamma_1", "blocks.0.attn.q_bias",
                          "blocks.0.attn.q_proj.weight"))


def _family(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any], float, dict]:
  """(the timm arguments the architecture and model_args give, epsilon, heads by width)."""
  arch = config.get("architecture") or ""
  family = next((f for f in _FAMILIES if re.fullmatch(f[0], arch)), None)
  if family is None:
    raise CheckpointError(
        f"{source}: {arch or 'a model whose config.json names no architecture'} is not an "
        "eva.py model vit_jax reads (DINOv3's vit_*_patch16_dinov3*, EVA-02's eva02_*): its "
        "rotary embedding and blocks cannot be told from its arrays.")
  args = _EVA_DEFAULTS | family[1] | dict(config.get("model_args") or {})
  if "clip" in arch:  # eva.py's EVA-02 CLIP towers pool the class token.
    args.setdefault("global_pool", "token")
  return args, family[2], family[3]


def _rope(args: Mapping[str, Any], source: str) -> dict[str, Any]:
  """The model's rope fields for Eva's rotary arguments; refuses the rotary forms, and the
  post-norm or grouped-query blocks, that the ViT here has not."""
  unsupported = {k: args[k] for k in ("use_post_norm", "num_kv_heads", "rope_grid_offset")
                 if args[k]}
  if args["attn_type"] != "eva" or args["rope_grid_indexing"] != "ij":
    unsupported |= {k: args[k] for k in ("attn_type", "rope_grid_indexing")}
  if unsupported:
    raise CheckpointError(f"{source}: timm's {unsupported} is not a form vit_jax's ViT has.")
  if not args["use_rot_pos_emb"]:
    return {}
  kind, temperature = args["rope_type"], float(args["rope_temperature"])
  if kind == "dinov3" and temperature == 100 and args["rope_rotate_half"]:
    return dict(rope="dinov3")
  ref = args["ref_feat_shape"]
  ref = tuple(ref) if isinstance(ref, (list, tuple)) else (ref, ref)
  if kind == "cat" and temperature == 10000 and not args["rope_rotate_half"] and (
      ref[0] == ref[1]):
    return dict(rope="eva", rope_ref_grid=ref[0])
  raise CheckpointError(
      f"{source}: a rotary embedding rope_type={kind!r}, temperature {temperature:g}, "
      f"rotate_half={args['rope_rotate_half']}, ref_feat_shape={args['ref_feat_shape']} is not "
      "one vit_jax's ViT has (EVA-02's cat at 10000, DINOv3's at 100).")


def _pooling(args: Mapping[str, Any], config: Mapping[str, Any], has_cls: bool,
             source: str) -> dict[str, Any]:
  """The classifier fields for timm's global_pool (config.json's, else the model's)."""
  pool = config.get("global_pool", args.get("global_pool", "avg"))
  if pool == "avg":
    return dict(classifier="gap", class_token=has_cls)
  if pool == "token" and has_cls:
    return dict(classifier="token")
  raise CheckpointError(f"{source}: global_pool={pool!r} is not a pooling vit_jax's ViT has "
                        "for an eva.py model (token with a class token, avg).")


def _refuse_unsupported(keys: Any, source: str) -> None:
  state_dict.refuse_unsupported(keys, _UNSUPPORTED, source)
  if "norm.weight" in keys and "fc_norm.weight" in keys:
    raise CheckpointError(f"{source} has a norm both before pooling and after it (norm.weight, "
                          "fc_norm.weight); vit_jax's ViT has one of the two.")


def _tokens(sd: state_dict.StateDict) -> dict[str, np.ndarray]:
  """Class token, registers and the learned embedding where there is one. Ours covers the
  class token (a zero row where timm's `no_embed_class` gives it none) and the patches; rows
  timm gives the registers are folded into them."""
  out, cls = {}, sd.has("cls_token")
  if cls:
    out["cls"] = sd.take("cls_token")
  if sd.has("reg_token"):
    out["reg"] = sd.take("reg_token")
  if not sd.has("pos_embed"):
    return out
  posemb = sd.take("pos_embed")
  prefix = int(cls) + (out["reg"].shape[1] if "reg" in out else 0)
  square = lambda n: n >= 0 and math.isqrt(n) ** 2 == n  # noqa: E731
  if prefix and square(posemb.shape[1] - prefix):  # Rows for the class token and registers.
    if "reg" in out:
      out["reg"] = out["reg"] + posemb[:, int(cls):prefix]
      posemb = np.delete(posemb, np.s_[int(cls):prefix], axis=1)
  elif square(posemb.shape[1]):  # no_embed_class: a zero row for the class token.
    posemb = np.concatenate([np.zeros_like(posemb[:, :int(cls)]), posemb], axis=1)
  else:
    raise CheckpointError(f"{sd.name}: pos_embed's {posemb.shape[1]} rows are not a square "
                          f"patch grid with or without the {prefix} prefix tokens' rows.")
  out[POSEMB_KEY] = posemb
  return out


def _attention(sd: state_dict.StateDict, p: str, q: str, heads: int) -> dict[str, np.ndarray]:
  """Eva's attention (block prefix `p`): fused qkv with q/v biases, or q/k/v projections."""
  if sd.has(p + "qkv.weight"):
    weights = np.split(sd.take(p + "qkv.weight"), 3)
    if sd.has(p + "qkv.bias"):
      biases = np.split(sd.take(p + "qkv.bias"), 3)
    else:
      # Eva's k_bias is a zero buffer, never stored: one stored is refused as unused.
      biases = [sd.take(p + f"{n}_bias") if n != "k" and sd.has(p + f"{n}_bias") else None
                for n in "qkv"]
  else:
    weights = [sd.take(p + f"{n}_proj.weight") for n in "qkv"]
    biases = [sd.take(p + f"{n}_proj.bias") if sd.has(p + f"{n}_proj.bias") else None
              for n in "qkv"]
  d = weights[0].shape[1]
  out = {}
  for name, w, b in zip(("query", "key", "value"), weights, biases):
    out[q + f"{name}/kernel"] = w.T.reshape(d, heads, d // heads)
    if b is not None:  # No key bias: the model's qkv_bias="qv" (none at all: "none").
      out[q + f"{name}/bias"] = b.reshape(heads, d // heads)
  if sd.has(p + "norm.weight"):  # EVA-02 CLIP's scale_attn_inner.
    out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "norm")
  out[q + "out/kernel"] = sd.take(p + "proj.weight").T.reshape(heads, d // heads, d)
  out[q + "out/bias"] = sd.take(p + "proj.bias")
  return out


def _mlp(sd: state_dict.StateDict, p: str, q: str) -> dict[str, np.ndarray]:
  """Mlp, packed SwiGLU (fc1: gate then value, as ours) or SwiGLU (fc1_g, fc1_x)."""
  if sd.has(p + "fc1_g.weight"):
    gate, value = sd.linear(p + "fc1_g", ""), sd.linear(p + "fc1_x", "")
    out = {q + f"Dense_0/{k}": np.concatenate([gate[k], value[k]], -1) for k in gate}
  else:
    out = sd.linear(p + "fc1", q + "Dense_0/")
  if sd.has(p + "norm.weight"):  # EVA-02's scale_mlp.
    out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "norm")
  return out | sd.linear(p + "fc2", q + "Dense_1/")


def _blocks(sd: state_dict.StateDict, heads: int) -> dict[str, np.ndarray]:
  out = {}
  for i in sd.numbered("blocks.", ".norm1.weight"):
    p, q = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
    out[q + "LayerNorm_0/scale"], out[q + "LayerNorm_0/bias"] = sd.take_pair(p + "norm1")
    out |= _attention(sd, p + "attn.", q + "MultiHeadDotProductAttention_1/", heads)
    out[q + "LayerNorm_2/scale"], out[q + "LayerNorm_2/bias"] = sd.take_pair(p + "norm2")
    out |= _mlp(sd, p + "mlp.", q + "MlpBlock_3/")
    if sd.has(p + "gamma_1"):
      out[q + "LayerScale_0/scale"] = sd.take(p + "gamma_1")
      out[q + "LayerScale_1/scale"] = sd.take(p + "gamma_2")
  return out


def _num_heads(args: Mapping[str, Any], width: int, by_width: Mapping[int, int],
               source: str) -> int:
  heads = args.get("num_heads") or by_width.get(width)
  if not heads:
    raise CheckpointError(f"{source}: cannot tell the attention heads of a width-{width} "
                          "model: its config.json names none (model_args.num_heads).")
  return int(heads)


def to_released(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any],
                source: str) -> dict[str, np.ndarray]:
  """An Eva's state dict (numpy) as flat original-layout arrays; raises CheckpointError
  naming what vit_jax's ViT cannot express or this reader does not use."""
  _refuse_unsupported(arrays, source)
  args, _, by_width = _family(config, source)
  _rope(args, source)
  _pooling(args, config, "cls_token" in arrays, source)
  sd = state_dict.StateDict(arrays, source)
  out = {"embedding/kernel": sd.conv("patch_embed.proj.weight"),
         "embedding/bias": sd.take("patch_embed.proj.bias")}
  out |= _tokens(sd)
  out |= _blocks(sd, _num_heads(args, out["embedding/kernel"].shape[-1], by_width, source))
  for name, key in (("norm", "Transformer/encoder_norm"), ("fc_norm", "fc_norm")):
    if sd.has(name + ".weight"):
      out[key + "/scale"], out[key + "/bias"] = sd.take_pair(name)
  if sd.has("head.weight"):
    out |= sd.linear("head", "head/")
  sd.check_all_used()
  return out


def declared(config: Mapping[str, Any]) -> dict[str, Any]:
  """What config.json says the arrays are (layouts/__init__.py's contract): the architecture's
  family (a learned embedding, registers) beside what timm's config says of any model."""
  arch, args = config.get("architecture") or "", config.get("model_args") or {}
  family = next((f for f in _FAMILIES if re.fullmatch(f[0], arch)), None)
  out = dict(_FAMILY_ARRAYS[family[0]]) if family else {}
  if "use_abs_pos_emb" in args:
    out["posemb"] = "learn" if args["use_abs_pos_emb"] else "none"
  out |= repo_config.timm_declared(config, "num_reg_tokens")
  if out.get("posemb") == "none":
    out.pop("image_size", None)  # No embedding to say it of: the rotary grid is any size.
  return out


def describe(flat: Mapping[str, np.ndarray], fields: dict[str, Any], config: Mapping[str, Any],
             processor: Mapping[str, Any], origin: str) -> desc_lib.Description:
  """The description timm's config.json gives, with what the arrays do not tell: the pooling,
  no learned embedding (DINOv3), the rotary embedding, the LayerNorm epsilon, and timm's
  resampling of a learned embedding to another size (resample_abs_pos_embed: antialiased
  bicubic, in eva.py's dynamic_img_size forward and its checkpoint_filter_fn alike)."""
  del processor
  args, eps, _ = _family(config, origin)
  fields = fields | _pooling(args, config, "cls" in flat, origin) | _rope(args, origin)
  fields |= dict(layer_norm_eps=eps, posemb=fields["posemb"] if POSEMB_KEY in flat else "none",
                 posemb_interpolation="bicubic")
  return repo_config.timm_description(flat, fields, config, repo_config.timm_gelu(config))
