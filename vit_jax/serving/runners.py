"""One call for every form of a model: uint8 images (batch, size, size, 3) -> float32 logits.

`open_model(path)` picks by what `path` is: an `.onnx` file (onnxruntime), a `.tflite` file
(LiteRT), a SavedModel folder (TensorFlow), else any checkpoint the project reads (JAX, on
the default backend, the batch split over the local devices).
All take the serving signature's input, so they are compared image for image.
"""
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vit_jax import checkpoint
from vit_jax.checkpoint import exported
from vit_jax.checkpoint.description import Description
from vit_jax.serving import savedmodel

FORMATS = ("jax", "savedmodel", "tflite", "onnx")


@dataclasses.dataclass
class Runner:
  """`run(uint8 images) -> logits` of one model in one format, its input size, and the
  checkpoint's description (None for a model exported before descriptions)."""
  format: str
  image_size: int
  num_classes: int
  run: Callable[[np.ndarray], np.ndarray]
  source: str
  description: Description | None = None

  def __call__(self, images: np.ndarray) -> np.ndarray:
    if images.dtype != np.uint8 or images.shape[1:] != (self.image_size, self.image_size, 3):
      raise ValueError(f"{self.source} takes uint8 images (batch, {self.image_size}, "
                       f"{self.image_size}, 3); got {images.dtype} {images.shape}.")
    return np.asarray(self.run(images), np.float32)


def jax_runner(loaded: checkpoint.Loaded) -> Runner:
  """The checkpoint's model under jax.jit, with the serving signature's preprocessing."""
  scale, offset = (np.asarray(v, np.float32) for v in loaded.description.preprocessing.affine())
  model, devices = loaded.model, jax.local_devices()
  mesh = Mesh(np.array(devices), ("data",))
  params = jax.device_put(loaded.params, NamedSharding(mesh, PartitionSpec()))

  @jax.jit
  def logits(params, images):
    x = images.astype(jnp.float32) * scale + offset  # Per channel, as pp.affine_map.
    return model.apply({"params": params}, x, train=False)

  def run(images):
    n, pad = len(images), -len(images) % len(devices)  # Padded to split over the devices.
    images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
    return logits(params, jax.device_put(images, NamedSharding(mesh, PartitionSpec("data"))))[:n]

  return Runner("jax", loaded.image_size, model.num_classes, run, loaded.source,
                loaded.description)


def _description(path: str) -> Description | None:
  try:
    return exported.read(path)
  except ValueError:
    return None


def savedmodel_runner(path: str) -> Runner:
  import tensorflow as tf
  serve = savedmodel.load(path)
  spec = serve.structured_input_signature[1][savedmodel.INPUT]
  num_classes = serve.structured_outputs["logits"].shape[-1]
  run = lambda images: serve(**{savedmodel.INPUT: tf.constant(images)})["logits"].numpy()  # noqa: E731
  return Runner("savedmodel", spec.shape[1], num_classes, run, path, _description(path))


def tflite_runner(path: str, num_threads: int | None = None) -> Runner:
  from vit_jax.serving import tflite
  runner = tflite.signature_runner(path, num_threads)
  shape = runner.get_input_details()[savedmodel.INPUT]["shape_signature"]
  num_classes = runner.get_output_details()["logits"]["shape_signature"][-1]
  run = lambda images: runner(**{savedmodel.INPUT: images})["logits"]  # noqa: E731
  return Runner("tflite", int(shape[1]), int(num_classes), run, path, _description(path))


def onnx_runner(path: str, num_threads: int | None = None) -> Runner:
  from vit_jax.serving import onnx
  session = onnx.session(path, num_threads)
  shape = session.get_inputs()[0].shape
  num_classes = next(o.shape[-1] for o in session.get_outputs() if o.name == "logits")
  run = lambda images: session.run(["logits"], {savedmodel.INPUT: images})[0]  # noqa: E731
  return Runner("onnx", int(shape[1]), int(num_classes), run, path, _description(path))


def open_model(path: str, **load_kwargs) -> Runner:
  """A Runner for an exported model or any checkpoint (`load_kwargs` go to checkpoint.load)."""
  fmt = exported.format_of(path) or "jax"
  if fmt != "jax":
    if load_kwargs:
      raise ValueError(f"{path} is an exported {fmt} model: its architecture and resolution "
                       f"are fixed, so {sorted(load_kwargs)} cannot be applied.")
    try:
      return {"onnx": onnx_runner, "tflite": tflite_runner,
              "savedmodel": savedmodel_runner}[fmt](path)
    except Exception as e:  # Each runtime fails its own way on a damaged file.
      first = (str(e).strip().splitlines() or [""])[0][:300]
      raise ValueError(f"{path}: the exported {fmt} model cannot be opened, so it is truncated "
                       f"or damaged ({type(e).__name__}: {first}); export it again") from e
  return jax_runner(checkpoint.load(path, **load_kwargs))
