"""What a Hub repo's config files say beside the weights, as the layouts describe them:
timm's config.json (`pretrained_cfg`, `model_args`) and transformers' config.json and
preprocessor_config.json: preprocessing, the head count the arrays do not show, the GELU the
weights were trained with, class names."""
import re
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib
from vit_jax.checkpoint.errors import CheckpointError

# Pretrained tags of weights trained by Google in JAX, whose GELU was flax's tanh form;
# timm runs every ViT with the exact GELU unless its config names another.
_TANH_TAGS = ("augreg_in21k", "augreg_in21k_ft_in1k", "augreg_in1k", "orig_in21k",
              "orig_in21k_ft_in1k", "sam_in1k", "webli", "v2_webli")
# timm's defaults where a pretrained_cfg leaves them out.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# OpenAI CLIP's, the default of CLIPImageProcessor and of open_clip's preprocess_cfg.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DEFAULT_CROP_PCT = 0.875
# timm's crop_mode (any other: 'center') -> Preprocessing.crop, which preprocess.fit applies
# in the geometry of timm's eval transform.
_TIMM_CROPS = {"squash": "squash_central_crop", "border": "letterbox_central_crop"}
# Heads of timm's ViT widths whose head size is not 64 (ViT-H, -g, SigLIP's So400m).
_HEADS_OF_WIDTH = {1152: 16, 1280: 16, 1408: 16}
# transformers' resample codes (PIL's): 2 bilinear, 3 bicubic.
_RESAMPLE = {2: "bilinear", 3: "bicubic"}


def num_classes(flat: Mapping[str, np.ndarray]) -> int | None:
  return flat["head/kernel"].shape[-1] if "head/kernel" in flat else None


def timm_num_heads(config: Mapping[str, Any], width: int, mlp: int, layers: int,
                   patch: int) -> int:
  """The head count, which the arrays do not show: the config's, the registry's, or timm's."""
  heads = (config.get("model_args") or {}).get("num_heads")
  if heads:
    return int(heads)
  fields = dict(patch_size=patch, hidden_size=width, mlp_dim=mlp, num_layers=layers)
  for named in models.MODEL_CONFIGS.values():
    if all(named[k] == v for k, v in fields.items()) and named.get("resnet_layers") is None:
      return named["num_heads"]
  if width in _HEADS_OF_WIDTH or width % 64 == 0:
    return _HEADS_OF_WIDTH.get(width, width // 64)
  raise CheckpointError(f"Cannot tell the number of attention heads of a width-{width} ViT: "
                        "its config.json names none (model_args.num_heads).")


def timm_gelu(config: Mapping[str, Any]) -> str:
  """"tanh" for weights trained with it (Google's JAX-trained tags, SigLIP; or the config's
  act_layer), else "exact", timm's own."""
  act = (config.get("model_args") or {}).get("act_layer")
  if act:
    return "tanh" if "tanh" in str(act) else "exact"
  tag = (config.get("pretrained_cfg") or {}).get("tag") or ""
  return "tanh" if tag in _TANH_TAGS or "siglip" in config.get("architecture", "") else "exact"


def timm_preprocessing(config: Mapping[str, Any]) -> desc_lib.Preprocessing:
  """timm's pretrained_cfg: mean, std, interpolation, crop_pct / crop_mode."""
  cfg = config.get("pretrained_cfg") or {}
  return desc_lib.Preprocessing(
      mean=tuple(float(v) for v in cfg.get("mean", IMAGENET_MEAN)),
      std=tuple(float(v) for v in cfg.get("std", IMAGENET_STD)),
      interpolation="bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic",
      crop=_TIMM_CROPS.get(cfg.get("crop_mode"), "central_crop"),
      central_crop_fraction=float(cfg.get("crop_pct") or _DEFAULT_CROP_PCT),
      geometry="torchvision")


def timm_description(flat: Mapping[str, np.ndarray], fields: dict[str, Any],
                     config: Mapping[str, Any], gelu: str) -> desc_lib.Description:
  """The description timm's config.json gives: resolution, preprocessing, classes."""
  cfg = config.get("pretrained_cfg") or {}
  n = num_classes(flat)
  names = config.get("label_names") or cfg.get("label_names") or ()
  size = (cfg.get("input_size") or [desc_lib.DEFAULT_IMAGE_SIZE])[-1]
  fields = fields | {"gelu": gelu}
  return desc_lib.Description(
      model=fields, model_name=models.registry.match_name(fields), num_classes=n,
      image_size=int(size), preprocessing=timm_preprocessing(config),
      class_names=tuple(names) if n and len(names) == n else ())


def processor_preprocessing(processor: Mapping[str, Any]) -> desc_lib.Preprocessing:
  """transformers' preprocessor_config.json as ViTImageProcessor applies it: resize to `size`
  (no crop) and normalise."""
  mean = processor.get("image_mean", (0.5, 0.5, 0.5))
  std = processor.get("image_std", (0.5, 0.5, 0.5))
  if not processor.get("do_normalize", True):
    mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
  return desc_lib.Preprocessing(
      mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std), crop="resize",
      interpolation=_RESAMPLE.get(processor.get("resample", 2), "bilinear"))


def id2label_names(config: Mapping[str, Any], n: int | None) -> tuple[str, ...]:
  """transformers' config.json `id2label`, unless it holds only the LABEL_i placeholders."""
  labels = {int(k): v for k, v in (config.get("id2label") or {}).items()}
  if not n or len(labels) != n:
    return ()
  names = tuple(labels[i] for i in range(n))
  return () if all(name == f"LABEL_{i}" for i, name in enumerate(names)) else names


def side(size: Any) -> int | None:
  """An image size as configs give it (an int, [h, w] or [c, h, w]); its side."""
  if isinstance(size, (list, tuple)):
    size = size[-1] if size else None
  return None if size is None else int(size)


def timm_declared(config: Mapping[str, Any], registers_arg: str) -> dict[str, Any]:
  """What timm's config.json says the arrays are, where it says it: the patch size
  (model_args', else the architecture's name `..._patch14_...`), width and depth (model_args'),
  registers (model_args' `registers_arg`, else the name's `_reg4_`) and the resolution the
  position embedding is for (model_args' img_size, else pretrained_cfg's input_size)."""
  args = config.get("model_args") or {}
  arch = config.get("architecture") or ""
  out = {}
  patch = args.get("patch_size") or (re.search(r"_patch(\d+)(_|$)", arch) or [None, None])[1]
  if patch:
    out["patch_size"] = side(patch)
  for field, arg in (("hidden_size", "embed_dim"), ("num_layers", "depth")):
    if args.get(arg):
      out[field] = int(args[arg])
  registers = args.get(registers_arg, (re.search(r"_reg(\d+)(_|$)", arch) or [None, None])[1])
  if registers is not None:
    out["num_registers"] = int(registers)
  size = args.get("img_size") or (config.get("pretrained_cfg") or {}).get("input_size")
  if size:
    out["image_size"] = side(size)
  return out
