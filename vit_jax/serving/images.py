"""Image files for prediction: found from files, globs and folders, decoded with TensorFlow
as the input pipeline decodes them, resized (and cropped) to the model's resolution as its
evaluation does, as uint8."""
import glob
import os
import re
from collections.abc import Iterable

import numpy as np
import tensorflow as tf
from PIL import Image, ImageFile

from vit_jax.data import preprocess as pp
from vit_jax.data.preprocess import Preprocessing

def _openable_suffixes() -> tuple[str, ...]:
  """The file suffixes of the formats PIL decodes (TIFF, WebP, BMP, GIF, PPM, ...; not those it
  only writes, as PDF, nor those it only identifies: HDF5, MPEG, EPS without Ghostscript),
  with TensorFlow's own (JPEG, PNG, GIF, BMP)."""
  Image.init()
  decodes = {fmt for fmt, (cls, _) in Image.OPEN.items()
             if fmt not in ("EPS", "MPEG") and not (  # Some are factories, not classes.
                 isinstance(cls, type) and issubclass(cls, ImageFile.StubImageFile))}
  return tuple(sorted({ext for ext, fmt in Image.registered_extensions().items()
                       if fmt in decodes} | {".jpg", ".jpeg", ".png", ".gif", ".bmp"}))


# What a folder is searched for; its other files are named as skipped (find_images). A file
# named on the command line is tried whatever its name.
IMAGE_SUFFIXES = _openable_suffixes()


def _folder_files(folder: str) -> tuple[list[str], list[str]]:
  """(images, other files) under a folder, sorted."""
  files = sorted(os.path.join(root, f) for root, _, names in os.walk(folder) for f in names)
  return ([f for f in files if f.lower().endswith(IMAGE_SUFFIXES)],
          [f for f in files if not f.lower().endswith(IMAGE_SUFFIXES)])


def find_images(specs: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
  """(image paths, the specs that matched nothing, the files of folders that are no image) for
  files, globs and folders (searched recursively for IMAGE_SUFFIXES). Each path is listed
  once, in the order found."""
  found, unmatched, others = {}, [], {}
  for spec in specs:
    spec = os.path.expanduser(spec)
    matches = (sorted(glob.glob(spec, recursive=True)) if any(c in spec for c in "*?[")
               else [spec] if os.path.exists(spec) else [])
    paths, other = [], []
    for m in matches:
      images, rest = _folder_files(m) if os.path.isdir(m) else ([m], [])
      paths, other = paths + images, other + rest
    if not paths and not other:
      unmatched.append(spec)
    found.update(dict.fromkeys(paths))
    others.update(dict.fromkeys(other))
  return list(found), unmatched, [p for p in others if p not in found]


def to_uint8(images: tf.Tensor) -> tf.Tensor:
  """Rounds and clips float pixel values in [0, 255] back to uint8."""
  return tf.cast(tf.clip_by_value(tf.round(images), 0, 255), tf.uint8)


def read_image(path: str, size: int, preprocessing: Preprocessing = Preprocessing()) -> np.ndarray:
  """One image file as uint8 (size, size, 3): decoded as the pipeline decodes (grayscale
  repeated to RGB), fitted to the size as its evaluation does (`pp.apply_preprocessing`,
  whose affine map the model's serving signature applies), rounded back to uint8. Raises
  ValueError if unreadable."""
  try:
    image = pp.decode(tf.io.read_file(path), 3)
  except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError,
          tf.errors.PermissionDeniedError, tf.errors.FailedPreconditionError) as e:
    image = _pil_decode(path)  # TIFF and the other formats TensorFlow does not decode.
    if image is None:
      # "{{function_node __wrapped__DecodeImage...}} Unknown image file format. ... [Op:...]"
      message = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:.*", "", e.message,
                       flags=re.S)
      raise ValueError(message.strip() or type(e).__name__) from None
  if image.shape[0] == 0 or image.shape[1] == 0:
    raise ValueError("the image is empty")
  return to_uint8(pp.apply_preprocessing(image, preprocessing, size, normalise=False)).numpy()


def _pil_decode(path: str) -> tf.Tensor | None:
  """The image (its first frame) as uint8 RGB, as PIL decodes it; None if PIL cannot."""
  try:
    with Image.open(path) as image:
      image.seek(0)
      return tf.constant(np.asarray(image.convert("RGB")))
  except (OSError, ValueError, EOFError, Image.DecompressionBombError):
    return None
