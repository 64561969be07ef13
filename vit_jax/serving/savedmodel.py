"""A loaded checkpoint as a TensorFlow SavedModel, through `jax.experimental.jax2tf`.

The serving signature takes what a client has, uint8 images (batch, H, W, 3) at the
model's resolution, any batch size, and returns `logits` (batch, classes) float32 and
`top5` (batch, 5) int32, the indices of the largest logits. Preprocessing is part of it:
the input pipeline's own `apply_preprocessing` maps [0, 255] per channel as the checkpoint's
description records (the value range or mean and std it was trained with). The description
itself is written beside the graph, in `assets.extra/`, where TensorFlow Serving keeps
files that belong to a model but not to its graph. One format of `formats`.

jax2tf (jax 0.10) serializes natively only: the model becomes one `XlaCallModule` op
holding a StableHLO program per platform of PLATFORMS, so the SavedModel runs wherever
TensorFlow runs XLA (CPU, GPU, TPU), and the TFLite converter lowers it to builtin ops.
The parameters are `tf.Variable`s beside it, so the graph stays small for any model.
"""
from collections.abc import Sequence

import jax
import numpy as np
from etils import epath, epy

from vit_jax.checkpoint import loader
from vit_jax.serving import formats

with epy.lazy_imports():  # Telling a SavedModel and reading its description need neither.
  import tensorflow as tf
  from jax.experimental import jax2tf

  from vit_jax.data import preprocess as pp

REQUIRES = ()  # TensorFlow, a requirement of vit_jax itself.
SIGNATURE = "serving_default"
INPUT = "images"
OUTPUTS = ("logits", "top5")
PLATFORMS = ("cpu", "cuda", "tpu")


def _check_servable(loaded: loader.Loaded) -> None:
  if not loaded.model.num_classes:
    raise ValueError(f"{loaded.source} has no classification head: a served model returns "
                     "logits, so export a checkpoint with a head (head=True).")


_DESCRIPTION_FILE = f"assets.extra/{formats.METADATA_NAME}.json"


def holds(path: str) -> bool:
  return (epath.Path(path) / "saved_model.pb").exists()


def serving_module(loaded: loader.Loaded,
                   platforms: Sequence[str] = PLATFORMS) -> "tf.Module":
  """A tf.Module with the params as variables and `serve`, the serving signature."""
  _check_servable(loaded)
  preprocessing = loaded.description.preprocessing
  size, k = loaded.image_size, min(5, loaded.model.num_classes)
  apply = jax2tf.convert(
      lambda params, images: loaded.model.apply({"params": params}, images, train=False),
      polymorphic_shapes=[None, f"(b, {size}, {size}, 3)"], with_gradient=False,
      native_serialization_platforms=tuple(platforms))
  module = tf.Module()
  module.params = jax.tree.map(lambda x: tf.Variable(np.asarray(x), trainable=False),
                               loaded.params)

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec([None, size, size, 3], tf.uint8, name=INPUT)])
  def serve(images):
    logits = apply(module.params, pp.apply_preprocessing(images, preprocessing))
    return {"logits": logits, "top5": tf.math.top_k(logits, k).indices}

  module.serve = serve
  return module


def save(loaded: loader.Loaded, out_dir: str, **kwargs) -> str:
  """Writes `loaded` as a SavedModel with the serving signature and its description;
  returns `out_dir`."""
  module = serving_module(loaded, **kwargs)
  epath.Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
  tf.saved_model.save(module, out_dir, signatures={SIGNATURE: module.serve})
  description = epath.Path(out_dir) / _DESCRIPTION_FILE
  description.parent.mkdir(parents=True, exist_ok=True)
  description.write_text(loaded.description.to_json())
  return out_dir


def write(loaded: loader.Loaded, out: str, scratch: str, **kwargs) -> None:
  del scratch  # Written directly.
  save(loaded, out, **kwargs)


def read_description(path: str) -> str | None:
  f = epath.Path(path) / _DESCRIPTION_FILE
  return f.read_text() if f.exists() else None


def load(saved_model_dir: str):
  """The serving signature of a SavedModel: images=uint8 tensor -> dict of outputs."""
  return tf.saved_model.load(saved_model_dir).signatures[SIGNATURE]


def predictor(path: str, num_threads: int | None = None) -> formats.Predictor:
  """TensorFlow's runtime (`num_threads`: left to TensorFlow)."""
  del num_threads
  serve = load(path)
  spec = serve.structured_input_signature[1][INPUT]
  num_classes = serve.structured_outputs["logits"].shape[-1]
  predict_fn = lambda images: serve(**{INPUT: tf.constant(images)})["logits"].numpy()  # noqa: E731
  return formats.Predictor("savedmodel", spec.shape[1], num_classes, predict_fn, path,
                           formats.description_or_none(path))
