"""One call from a loaded checkpoint to any serving format of `formats`: SavedModel, TFLite,
ONNX. TFLite is converted from the SavedModel and ONNX from the TFLite model; the steps
between are written to a temporary folder and removed. Each format carries the checkpoint's
description. `export` runs what it wrote in that format's runtime and compares it with JAX
before it returns (`check`): a model that computes something else is removed, not left as if
good.
"""
import os
import shutil
import tempfile
from typing import NamedTuple

import numpy as np

from vit_jax.checkpoint import loader
from vit_jax.serving import formats, predictors

# How far an exported model's logits may be from JAX's, as a fraction of the logits' scale
# (max(1, max |logit|)): float32 arithmetic in another order. Measured: <= 2.3e-5 (ViT-B/16 at
# 224 px in TFLite), <= 1.6e-5 on the tiny models of every variant (tests/test_serving.py).
TOLERANCE = 1e-4
CHECK_IMAGES = 2  # Two, so that the batch dimension the signature leaves open is exercised.


class Mismatch(RuntimeError):
  """An exported model that, run in its format's runtime, does not give JAX's logits."""


class Exported(NamedTuple):
  loaded: loader.Loaded  # The model as JAX runs it.
  max_diff: float  # Max |logit difference| from JAX in the format's runtime, on CHECK_IMAGES.


def write(loaded: loader.Loaded, out: str, fmt: str, **kwargs) -> str:
  """Writes `loaded` as `fmt` to `out` (a folder for a SavedModel, else a file); `kwargs`
  go to savedmodel.serving_module (platforms). Returns `out`."""
  formats.require(fmt, out)
  module = formats.module(fmt)
  with tempfile.TemporaryDirectory(prefix="vit_jax_export_") as scratch:
    module.write(loaded, out, scratch, **kwargs)
  return out


def check(loaded: loader.Loaded, out: str, num_images: int = CHECK_IMAGES) -> float:
  """Runs the exported model at `out` in its runtime and `loaded` in JAX on the same random
  uint8 images; returns the max |logit difference|, or raises Mismatch (a NaN, another shape,
  a difference over TOLERANCE of the logits' scale, a model its runtime cannot run)."""
  size, fmt = loaded.image_size, formats.format_of(out)
  images = np.random.default_rng(0).integers(0, 256, (num_images, size, size, 3), np.uint8)
  want = predictors.jax_predictor(loaded)(images)
  try:
    got = predictors.open_model(out)(images)
  except Exception as e:  # noqa: BLE001  Whatever the runtime raises, the file is no good.
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise Mismatch(f"the {fmt} model at {out} cannot be run in its runtime "
                   f"({type(e).__name__}: {first})") from e
  where = f"the {fmt} model at {out}, run in its runtime on {num_images} images,"
  if got.shape != want.shape:
    raise Mismatch(f"{where} gives logits of shape {got.shape}, JAX {want.shape}")
  if not np.isfinite(got).all():
    raise Mismatch(f"{where} gives {np.size(got) - np.isfinite(got).sum()} NaN or inf logits "
                   f"of {np.size(got)}")
  diff, bound = float(np.abs(got - want).max()), TOLERANCE * max(1.0, float(np.abs(want).max()))
  if diff > bound:
    raise Mismatch(f"{where} is {diff:.1e} from JAX's logits (max |diff|; tolerance {bound:.1e})")
  return diff


def _discard(out: str, existed: bool) -> None:
  """Removes what `write` put at `out`: the file, or the SavedModel folder (its entries alone
  where the folder was there before)."""
  if not os.path.isdir(out):
    if os.path.exists(out):
      os.remove(out)
  elif existed:
    for entry in os.listdir(out):
      path = os.path.join(out, entry)
      if os.path.isdir(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
  else:
    shutil.rmtree(out)


def export(path: str, out: str, fmt: str, model_name: str | None = None,
           image_size: int | None = None, base: str | None = None) -> Exported:
  """Writes the checkpoint at `path` as `fmt` to `out` (at `image_size`, the position
  embedding resized; `model_name` checked against the file; `base` a LoRA adapters file's
  moved base) and checks it (`check`): on a mismatch `out` is removed and Mismatch raised."""
  loaded = loader.load(path, model_name, image_size=image_size, base=base)
  loaded.description = loaded.description.replace(exported_from=loaded.source)
  existed = os.path.isdir(out)
  try:
    write(loaded, out, fmt)
  except BaseException:  # A conversion that fails half-way leaves no half-written model.
    _discard(out, existed)
    raise
  try:
    return Exported(loaded, check(loaded, out))
  except Mismatch as e:
    _discard(out, existed)
    raise Mismatch(f"{e}: removed, not left as a good export. This is a fault of the "
                   "converters or of vit_jax: please report it with the checkpoint") from e
