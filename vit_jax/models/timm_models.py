"""timm's ViTs beside this project's: the timm model of each registry name, its logits, and
original-layout arrays into a timm ViT (`load_into`). The independent implementation the tests
and benchmarks compare against. The other way, a timm ViT's weights as original-layout arrays,
is the checkpoint package's: `checkpoint.layouts.timm_vit.to_npz`, the reader of timm's Hub
repos.

torch and timm are imported on first use. A process that also uses TensorFlow must import
them first (`import_torch()` before TensorFlow): the other order crashes in triton's import
(torch 2.14, TensorFlow 2.21).
"""
import functools
import os
import tempfile
import types

import numpy as np

from vit_jax.models.vit import POSEMB_KEY


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


def load_into(model, arrays: dict[str, np.ndarray]) -> None:
  """Original-layout arrays into a timm ViT: timm's own `_load_weights` reads every tensor it
  knows; the class token, registers and position embedding are first put in the model's
  layout (the inverse of checkpoint/layouts/timm_vit.py's `_tokens`: a `no_embed_class`
  model's class token takes its embedding row; an embedding over the registers gets zero rows
  for them, which have none)."""
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
