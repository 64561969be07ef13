"""Builds timm's matching models, the independent implementation tests compare against."""
import functools

import numpy as np

torch = None
timm = None
try:
  import timm
  import torch
except ImportError:  # pragma: no cover - the [test] extra installs both.
  pass

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
  timm_name, extra = TIMM_NAMES[name]
  act = functools.partial(torch.nn.GELU, approximate="tanh")
  return timm.create_model(timm_name, pretrained=False, act_layer=act, **extra, **kwargs)


def logits(model, images: np.ndarray) -> np.ndarray:
  """timm logits for NHWC float images."""
  model.eval()
  with torch.no_grad():
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
    return model(x).numpy()
