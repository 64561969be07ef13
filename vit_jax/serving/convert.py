"""One call from a loaded checkpoint to any serving format of `formats`: SavedModel, TFLite,
ONNX. TFLite is converted from the SavedModel and ONNX from the TFLite model; the steps
between are written to a temporary folder and removed. Each format carries the checkpoint's
description.
"""
import tempfile

from vit_jax import checkpoint
from vit_jax.serving import formats


def write(loaded: checkpoint.Loaded, out: str, fmt: str, **kwargs) -> str:
  """Writes `loaded` as `fmt` to `out` (a folder for a SavedModel, else a file); `kwargs`
  go to savedmodel.serving_module (platforms). Returns `out`."""
  module = formats.module(fmt)
  with tempfile.TemporaryDirectory(prefix="vit_jax_export_") as scratch:
    module.write(loaded, out, scratch, **kwargs)
  return out


def export(path: str, out: str, fmt: str, model_name: str | None = None,
           image_size: int | None = None, base: str | None = None) -> checkpoint.Loaded:
  """Writes the checkpoint at `path` as `fmt` to `out` (at `image_size`, the position
  embedding resized; `model_name` checked against the file; `base` a LoRA adapters file's
  moved base); returns the model it loaded."""
  loaded = checkpoint.load(path, model_name, image_size=image_size, base=base)
  loaded.description = loaded.description.replace(exported_from=loaded.source)
  write(loaded, out, fmt)
  return loaded
