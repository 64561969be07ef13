"""One call from a loaded checkpoint to any serving format: SavedModel, TFLite, ONNX.

TFLite is converted from the SavedModel and ONNX from the TFLite model (see `onnx`); the
steps between are written to a temporary folder and removed. Each format carries the
checkpoint's description (`checkpoint.exported`).
"""
import tempfile

from etils import epy

from vit_jax import checkpoint
from vit_jax.checkpoint import exported

with epy.lazy_imports():  # TensorFlow, when a format is written: FORMATS is read without it.
  from vit_jax.serving import savedmodel, tflite

FORMATS = ("savedmodel", "tflite", "onnx")


def write(loaded: checkpoint.Loaded, out: str, fmt: str, **kwargs) -> str:
  """Writes `loaded` as `fmt` to `out` (a folder for a SavedModel, else a file); `kwargs`
  go to savedmodel.serving_module (platforms). Returns `out`."""
  if fmt not in FORMATS:
    raise ValueError(f"Unknown serving format {fmt!r}: use one of {', '.join(FORMATS)}.")
  if fmt == "savedmodel":
    return savedmodel.save(loaded, out, **kwargs)
  with tempfile.TemporaryDirectory(prefix="vit_jax_export_") as tmp:
    saved = savedmodel.save(loaded, f"{tmp}/saved_model", **kwargs)
    if fmt == "tflite":
      tflite.from_savedmodel(saved, out)
      exported.write_tflite(out, loaded.description)
      return out
    from vit_jax.serving import onnx
    return onnx.from_tflite(tflite.from_savedmodel(saved, f"{tmp}/model.tflite"), out,
                            loaded.description)


def export(path: str, out: str, fmt: str, model_name: str | None = None,
           image_size: int | None = None, base: str | None = None) -> checkpoint.Loaded:
  """Writes the checkpoint at `path` as `fmt` to `out` (at `image_size`, the position
  embedding resized; `model_name` checked against the file; `base` a LoRA adapters file's
  moved base); returns the model it loaded."""
  loaded = checkpoint.load(path, model_name, image_size=image_size, base=base)
  loaded.description = loaded.description.replace(exported_from=loaded.source)
  write(loaded, out, fmt)
  return loaded
