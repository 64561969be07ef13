"""Image files for prediction: found from files, globs and folders, decoded with TensorFlow
as the input pipeline decodes them, resized (and cropped) to the model's resolution as its
evaluation does, as uint8."""
import glob
import os
import re
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from vit_jax.data import preprocess as pp
from vit_jax.data.preprocess import Preprocessing

# What a folder is searched for (TensorFlow's decode_image reads all of these); a file
# named on the command line is tried whatever its name.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")


def _folder_images(folder: str) -> list[str]:
  return sorted(os.path.join(root, f) for root, _, files in os.walk(folder) for f in files
                if f.lower().endswith(IMAGE_SUFFIXES))


def find_images(specs: Iterable[str]) -> tuple[list[str], list[str]]:
  """(image paths, the specs that matched nothing) for files, globs and folders (searched
  recursively for IMAGE_SUFFIXES). Each path is listed once, in the order found."""
  found, unmatched = {}, []
  for spec in specs:
    spec = os.path.expanduser(spec)
    matches = (sorted(glob.glob(spec, recursive=True)) if any(c in spec for c in "*?[")
               else [spec] if os.path.exists(spec) else [])
    paths = [p for m in matches for p in (_folder_images(m) if os.path.isdir(m) else [m])]
    if not paths:
      unmatched.append(spec)
    found.update(dict.fromkeys(paths))
  return list(found), unmatched


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
    # "{{function_node __wrapped__DecodeImage...}} Unknown image file format. ... [Op:...]"
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:.*", "", e.message, flags=re.S)
    raise ValueError(message.strip() or type(e).__name__) from None
  if image.shape[0] == 0 or image.shape[1] == 0:
    raise ValueError("the image is empty")
  return to_uint8(pp.apply_preprocessing(image, preprocessing, size, normalise=False)).numpy()
