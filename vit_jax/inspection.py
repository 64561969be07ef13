"""What `vit-inspect` reports on a checkpoint, as a JSON-ready dict: its model (the registry
name nearest it, or its fields), resolution, head and size, its description, and the
fine-tuning command that fits it. Reading it takes one read of the checkpoint
(loader.open_checkpoint), which also gives the loaded model for the figures.
"""
import shlex
from typing import Any

import jax
import numpy as np

from vit_jax import models
from vit_jax.checkpoint import description as desc_lib, loader
from vit_jax.configs import finetune
from vit_jax.models import registry


def registry_name(model: models.VisionTransformer) -> str | None:
  """The registry name of the model's architecture, preferring one with its pooling."""
  fields = registry.described_fields(model)
  names = [n for n, c in registry.MODEL_CONFIGS.items()
           if registry.architecture(c) == registry.architecture(fields)]
  same_pooling = [n for n in names
                  if registry.MODEL_CONFIGS[n].get("classifier", "token") == model.classifier]
  return (same_pooling or names or [None])[0]


def _run_model_name(described: desc_lib.Description) -> str | None:
  """The config's model_name of a run whose overrides left its model without a registry name
  (the quick-start's ViT-Ti_16, 64 wide with patches of 7)."""
  if "model" in described.assumed or described.model_name:
    return None
  return (described.config or {}).get("model_name")


def _flag_value(value: Any) -> str:
  if isinstance(value, (tuple, list)):  # ml_collections parses a tuple literal.
    return "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def finetune_command(ckpt: loader.Loaded, path: str, dataset: str = "cifar10") -> str:
  """`vit-train` with the finetune config on `dataset`, starting from `path`: the registry
  model nearest the file, and overrides for every field that differs where the file does not
  describe its model (a file that does gives it to the run)."""
  model = ckpt.model
  base = (registry_name(model) or model.name_in_registry or _run_model_name(ckpt.description)
          or ("R50+ViT-B_16" if model.resnet_layers is not None else "ViT-B_16"))
  overrides = {}
  if "model" in ckpt.description.assumed:  # Else the run takes the model the file describes.
    base_fields = models.model_config(base)
    overrides = {f: getattr(model, f) for f in registry.SHAPE
                 if getattr(model, f) != base_fields.get(f, registry.default(f))}
  size = finetune.image_size(model.stride)
  args = ["vit-train", "--config",
          f"finetune:{registry.short_name(base)},{dataset}",
          "--workdir", "WORKDIR", f"--config.pretrained={path}"]
  args += [f"--config.model.{k}={_flag_value(v)}" for k, v in overrides.items()]
  if size != finetune.IMAGE_SIZE:
    args.append(f"--config.data.image_size={size}")
  return shlex.join(args)


def _head(flat: dict[str, np.ndarray]) -> str:
  if "head/kernel" not in flat:
    return "none"
  if np.any(flat["head/kernel"]):
    return "trained"
  return "zeros" if not np.any(flat.get("head/bias", 0)) else "zero kernel"


def report(path: str, model_name: str | None = None, dataset: str = "cifar10",
           base: str | None = None) -> tuple[dict[str, Any], loader.Loaded]:
  """The report on `path` (a JSON-ready dict) and the loaded checkpoint (`base`: a LoRA
  adapters file's moved base)."""
  opened = loader.open_checkpoint(path, base)  # Read once: the report and the model.
  flat, described, source = opened.flat, opened.description, opened.source
  if model_name:
    model_name = registry.resolve_name(model_name)
  ckpt = loader.from_opened(opened, model_name)
  m = ckpt.model
  head = _head(flat)
  return {
      "checkpoint": path, "source": source, "description": described.to_dict(),
      "model": registry_name(m),
      "run_model_name": _run_model_name(described),
      "fields": registry.described_fields(m),
      "patch_size": m.patch_size, "token_px": m.stride, "width": m.hidden_size,
      "depth": m.num_layers, "heads": m.num_heads, "mlp_dim": m.mlp_dim,
      "resnet_layers": m.resnet_layers, "pooling": m.classifier, "posemb": m.posemb,
      "posemb_grid": list(ckpt.grid) if m.posemb == "learn" else None,
      "image_size": ckpt.image_size, "pre_logits": m.representation_size,
      "num_classes": m.num_classes,
      "parameters": int(sum(np.size(x) for x in jax.tree.leaves(ckpt.params))),
      "dtype": ", ".join(sorted({str(v.dtype) for v in flat.values()})),
      "head": head, "head_all_zeros": head == "zeros" if head != "none" else None,
      "finetune_command": finetune_command(ckpt, path, dataset),
      "lora": opened.lora, "lora_base": opened.base,
  }, ckpt
