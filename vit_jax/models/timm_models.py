"""timm's ViTs beside this project's: the timm model of each registry name, a timm ViT's
weights as original-layout .npz arrays (the inverse of timm's `_load_weights`; LayerScale,
`norm_pre` and `fc_norm` under the model fields' names, anything else without arrays of ours
refused), which `checkpoint.load_npz` reads, and original-layout arrays into a timm ViT
(`load_into`). The independent implementation the tests and benchmarks compare against.

torch and timm are imported on first use. A process that also uses TensorFlow must import
them first (`import_torch()` before TensorFlow): the other order crashes in triton's import
(torch 2.14, TensorFlow 2.21).
"""
import functools
import os
import tempfile
import types

import numpy as np

POSEMB_KEY = "Transformer/posembed_input/pos_embedding"


def import_torch() -> tuple[types.ModuleType, types.ModuleType]:
  """(torch, timm), imported: `pip install 'vit_jax[test]'` installs them."""
  import torch
  import timm
  return torch, timm


# Registry name -> (timm model name, extra timm kwargs).
TIMM_NAMES = {
    "ViT-Ti_16": ("vit_tiny_patch16_224", {}),
    "ViT-S_16": ("vit_small_patch16_224", {}),
    "ViT-S_32": ("vit_small_patch32_224", {}),
    "ViT-B_8": ("vit_base_patch8_224", {}),
    "ViT-B_16": ("vit_base_patch16_224", {}),
    "ViT-B_32": ("vit_base_patch32_224", {}),
    "ViT-L_16": ("vit_large_patch16_224", {}),
    "ViT-L_32": ("vit_large_patch32_224", {}),
    "ViT-H_14": ("vit_huge_patch14_224", {}),
    "ViT-g_14": ("vit_giant_patch14_224", {}),
    "R+ViT-Ti_16": ("vit_tiny_r_s16_p8_224", {}),
    "R50+ViT-B_16": ("vit_base_r50_s16_224", {}),
    "R26+ViT-B_32": ("vit_base_r26_s32_224", {}),
    "R26+ViT-S_32": ("vit_small_r26_s32_224", {}),
    "R50+ViT-L_32": ("vit_large_r50_s32_224", {}),
}
_GAP = {"class_token": False, "global_pool": "avg", "fc_norm": False}
for _n in ("ViT-S_16", "ViT-B_16", "ViT-S_32", "ViT-B_32"):
  TIMM_NAMES[f"{_n}-gap-norep"] = (TIMM_NAMES[_n][0], _GAP)


def create(name: str, **kwargs):
  """timm's model for a registry name, with the official tanh-approximated GELU."""
  torch, timm = import_torch()
  timm_name, extra = TIMM_NAMES[name]
  act = functools.partial(torch.nn.GELU, approximate="tanh")
  return timm.create_model(timm_name, pretrained=False, act_layer=act, **extra, **kwargs)


def logits(model, images: np.ndarray) -> np.ndarray:
  """timm logits for NHWC float images."""
  torch, _ = import_torch()
  model.eval()
  with torch.no_grad():
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
    return model(x).numpy()


def _tokens(model) -> dict[str, np.ndarray]:
  """Class token, registers and position embedding. Ours covers the class token and the
  patches, not the registers: timm's `no_embed_class` gets a zero row for the class token,
  and a timm embedding over the registers has their rows added to the registers."""
  out, cls = {}, model.cls_token is not None
  posemb = model.pos_embed.detach().numpy()
  if model.no_embed_class and cls:
    posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
  if cls:
    out["cls"] = model.cls_token.detach().numpy()
  if model.reg_token is not None:
    registers = model.reg_token.detach().numpy()
    if not model.no_embed_class:
      registers = registers + posemb[:, int(cls):int(cls) + registers.shape[1]]
      posemb = np.delete(posemb, np.s_[int(cls):int(cls) + registers.shape[1]], axis=1)
    out["reg"] = registers
  out[POSEMB_KEY] = posemb
  return out


def _unconverted(model) -> list[str]:
  """The parts of a timm ViT that the released layout has no arrays for."""
  block = model.blocks[0]
  parts = {"attn_pool (MAP head)": getattr(model, "attn_pool", None) is not None,
           "q_norm/k_norm": hasattr(getattr(block.attn, "q_norm", None), "weight"),
           "attn.norm": hasattr(getattr(block.attn, "norm", None), "weight"),
           f"mlp {type(block.mlp).__name__}": type(block.mlp).__name__ != "Mlp",
           "mlp.norm": hasattr(getattr(block.mlp, "norm", None), "weight")}
  return [name for name, present in parts.items() if present]


def _block(block, d: int, h: int) -> dict[str, np.ndarray]:
  """One timm block's arrays under our block's names."""
  t = lambda x: x.detach().numpy()
  out = {"LayerNorm_0/scale": t(block.norm1.weight), "LayerNorm_0/bias": t(block.norm1.bias),
         "LayerNorm_2/scale": t(block.norm2.weight), "LayerNorm_2/bias": t(block.norm2.bias)}
  attn, a = block.attn, "MultiHeadDotProductAttention_1/"
  qkv_w = t(attn.qkv.weight)
  for n, name in enumerate(("query", "key", "value")):
    out[f"{a}{name}/kernel"] = qkv_w[n * d:(n + 1) * d].T.reshape(d, h, d // h)
    if attn.qkv.bias is not None:  # Else the model's qkv_bias="none".
      out[f"{a}{name}/bias"] = t(attn.qkv.bias)[n * d:(n + 1) * d].reshape(h, d // h)
  out[f"{a}out/kernel"] = t(attn.proj.weight).T.reshape(h, d // h, d)
  out[f"{a}out/bias"] = t(attn.proj.bias)
  for r in range(2):
    fc = getattr(block.mlp, f"fc{r + 1}")
    out[f"MlpBlock_3/Dense_{r}/kernel"] = t(fc.weight).T
    out[f"MlpBlock_3/Dense_{r}/bias"] = t(fc.bias)
  for r, ls in enumerate((block.ls1, block.ls2)):
    if hasattr(ls, "gamma"):  # The model's layer_scale=True.
      out[f"LayerScale_{r}/scale"] = t(ls.gamma)
  return out


def _norm(norm, key: str) -> dict[str, np.ndarray]:
  """A timm LayerNorm's arrays under `key`, none for an Identity."""
  if not hasattr(norm, "weight"):
    return {}
  return {f"{key}/scale": norm.weight.detach().numpy(), f"{key}/bias": norm.bias.detach().numpy()}


def to_npz(model) -> dict[str, np.ndarray]:
  """A timm ViT's weights as original-layout .npz keys (the inverse of timm's `_load_weights`),
  with the fields' arrays where it has them: LayerScale, `norm_pre` (a patch embedding without
  bias), `fc_norm`, no qkv bias. Raises ValueError naming what has no arrays of ours."""
  if type(model).__name__ != "VisionTransformer":  # eva.py's Eva: gamma_1, q_bias, rope...
    raise ValueError(f"to_npz converts timm's VisionTransformer, not its {type(model).__name__}: "
                     "save it (timm's save_for_hf) and load the folder, which "
                     "vit_jax.checkpoint reads with its layouts (eva.py's: layouts/timm_eva.py).")
  if unconverted := _unconverted(model):
    raise ValueError(f"timm's {type(model).__name__} has {', '.join(unconverted)}, which "
                     "to_npz does not convert.")
  t = lambda x: x.detach().numpy()
  d = model.embed_dim
  h = model.blocks[0].attn.num_heads
  out = {}
  emb = model.patch_embed
  if hasattr(emb, "backbone"):
    out.update(_hybrid_stem(emb.backbone))
  out["embedding/kernel"] = t(emb.proj.weight).transpose(2, 3, 1, 0)
  if emb.proj.bias is not None:  # Else the model's pre_norm=True.
    out["embedding/bias"] = t(emb.proj.bias)
  out.update(_tokens(model))
  out.update(_norm(model.norm_pre, "Transformer/pre_norm"))
  for i, block in enumerate(model.blocks):
    out.update({f"Transformer/encoderblock_{i}/{k}": v for k, v in _block(block, d, h).items()})
  out.update(_norm(model.norm, "Transformer/encoder_norm"))
  out.update(_norm(model.fc_norm, "fc_norm"))
  out["head/kernel"] = t(model.head.weight).T
  if model.head.bias is not None:
    out["head/bias"] = t(model.head.bias)
  return out


def _hybrid_stem(bb) -> dict[str, np.ndarray]:
  """A timm hybrid's ResNet-v2 stem as our arrays."""
  t = lambda x: x.detach().numpy()
  out = {"conv_root/kernel": t(bb.stem.conv.weight).transpose(2, 3, 1, 0),
         "gn_root/scale": t(bb.stem.norm.weight), "gn_root/bias": t(bb.stem.norm.bias)}
  for i, stage in enumerate(bb.stages):
    for j, block in enumerate(stage.blocks):
      p = f"block{i + 1}/unit{j + 1}/"
      for r in range(1, 4):
        out[p + f"conv{r}/kernel"] = t(getattr(block, f"conv{r}").weight).transpose(2, 3, 1, 0)
        out[p + f"gn{r}/scale"] = t(getattr(block, f"norm{r}").weight)
        out[p + f"gn{r}/bias"] = t(getattr(block, f"norm{r}").bias)
      if block.downsample is not None:
        out[p + "conv_proj/kernel"] = t(block.downsample.conv.weight).transpose(2, 3, 1, 0)
        out[p + "gn_proj/scale"] = t(block.downsample.norm.weight)
        out[p + "gn_proj/bias"] = t(block.downsample.norm.bias)
  return out


def load_into(model, arrays: dict[str, np.ndarray]) -> None:
  """Original-layout arrays into a timm ViT: timm's own `_load_weights` reads every tensor it
  knows; the class token, registers and position embedding are first put in the model's
  layout (`_tokens`' inverse: a `no_embed_class` model's class token takes its embedding
  row; an embedding over the registers gets zero rows for them, which have none)."""
  torch, _ = import_torch()
  from timm.models.vision_transformer import _load_weights
  arrays, cls = {k: np.asarray(v) for k, v in arrays.items()}, int("cls" in arrays)
  posemb, registers = arrays[POSEMB_KEY], arrays.pop("reg", None)
  if model.no_embed_class:
    if cls:
      arrays["cls"] = arrays["cls"] + posemb[:, :1]
      posemb = posemb[:, 1:]
  elif registers is not None:
    zeros = np.zeros((1, registers.shape[1], posemb.shape[-1]), posemb.dtype)
    posemb = np.concatenate([posemb[:, :cls], zeros, posemb[:, cls:]], axis=1)
  arrays[POSEMB_KEY] = posemb
  with tempfile.TemporaryDirectory() as tmp:
    np.savez(os.path.join(tmp, "weights.npz"), **arrays)
    _load_weights(model, os.path.join(tmp, "weights.npz"))
  if registers is not None:
    with torch.no_grad():
      model.reg_token.copy_(torch.from_numpy(np.array(registers)))
