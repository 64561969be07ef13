"""The serving formats `vit-export` writes and every command opens, and what each holds.

Each format is one module that owns its conversion, the checkpoint's description it carries
and its runtime, with this contract:
  holds(path) -> bool                       whether `path` is a model in this format
  write(loaded, out, scratch, **kwargs)     `loaded` (a checkpoint.Loaded) written to `out`,
                                            its description in it; `scratch`: a folder for
                                            the formats it is converted through; `kwargs`
                                            go to savedmodel.serving_module (platforms)
  read_description(path) -> str | None      the description's JSON, None if it has none
  predictor(path, num_threads) -> Predictor its runtime, behind the Predictor interface
  REQUIRES: tuple[str, ...]                 the packages (import names) its writer, reader
                                            and runtime need beyond vit_jax's own: the export
                                            extra's
FORMATS names them: `vit-export --format`, `convert.write`, `predictors.open_model` and
`describe` read it, so that a new format is its module and a row here. The modules load
their runtimes (TensorFlow, onnxruntime) only when used; `require` checks that they are
installed before a format is written or opened.
"""
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType

import numpy as np

from vit_jax.checkpoint.description import Description, UnreadableDescription

FORMATS = {"savedmodel": "vit_jax.serving.savedmodel", "tflite": "vit_jax.serving.tflite",
           "onnx": "vit_jax.serving.onnx"}

# Where each format keeps the description: a file of a SavedModel's assets.extra, the name of
# a TFLite metadata entry and of an ONNX metadata_props key.
METADATA_NAME = "vit_jax_description"


def module(fmt: str) -> ModuleType:
  """The module of a format of FORMATS."""
  if fmt not in FORMATS:
    raise ValueError(f"Unknown serving format {fmt!r}: use one of {', '.join(FORMATS)}.")
  return importlib.import_module(FORMATS[fmt])


class NotInstalled(ValueError):
  """A serving format whose packages (its module's REQUIRES) are not installed."""


def not_installed(fmt: str) -> list[str]:
  """The packages of `fmt`'s REQUIRES that this Python cannot import."""
  return [name for name in module(fmt).REQUIRES if importlib.util.find_spec(name) is None]


def require(fmt: str, subject: str) -> None:
  """Raises NotInstalled, naming the packages, where `fmt` needs some that are not installed:
  said before a conversion or an opening starts, not as an ImportError half-way through it
  (with a file half-written, or read as a damaged model)."""
  absent = not_installed(fmt)
  if absent:
    raise NotInstalled(f"{subject}: the {fmt} format needs {', '.join(absent)}, not installed "
                       "here: pip install 'vit_jax[export]'")


def format_of(path: str) -> str | None:
  """Which format `path` holds; None for anything else, e.g. a checkpoint."""
  return next((fmt for fmt in FORMATS if module(fmt).holds(path)), None)


def describe(path: str) -> Description:
  """The description an exported model carries; raises ValueError if it has none."""
  fmt = format_of(path)
  if fmt:
    require(fmt, path)
  text = module(fmt).read_description(path) if fmt else None
  if text is None:
    raise ValueError(f"{path} carries no vit_jax description: it was not written by "
                     "`vit-export` (or by a version before descriptions).")
  try:
    return Description.from_json(text)
  except UnreadableDescription as e:
    raise UnreadableDescription(f"{path} carries a description no vit_jax wrote ({e}): export "
                                "it again with vit-export.") from e


@dataclasses.dataclass
class Predictor:
  """`predict_fn(uint8 images) -> logits` of one model in one format ("jax" or a row of
  FORMATS), its input size, and the checkpoint's description (None for a model exported
  before descriptions)."""
  format: str
  image_size: int
  num_classes: int
  predict_fn: Callable[[np.ndarray], np.ndarray]
  source: str
  description: Description | None = None

  def __call__(self, images: np.ndarray) -> np.ndarray:
    if images.dtype != np.uint8 or images.shape[1:] != (self.image_size, self.image_size, 3):
      raise ValueError(f"{self.source} takes uint8 images (batch, {self.image_size}, "
                       f"{self.image_size}, 3); got {images.dtype} {images.shape}.")
    return np.asarray(self.predict_fn(images), np.float32)


def description_or_none(path: str) -> Description | None:
  """What a predictor reports: the description, or None for a model exported before them."""
  try:
    return describe(path)
  except ValueError:
    return None
