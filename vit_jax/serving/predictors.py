"""One call for every form of a model: uint8 images (batch, size, size, 3) -> float32 logits.

`open_model(path)` picks by what `path` is: an `.onnx` file (onnxruntime), a `.tflite` file
(LiteRT), a SavedModel folder (TensorFlow), else any checkpoint the project reads (JAX, on
the default backend, the batch split over the local devices).
All take the serving signature's input, so they are compared image for image.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vit_jax.checkpoint import loader
from vit_jax.models import footprint
from vit_jax.serving import formats
from vit_jax.serving.formats import Predictor


def jax_predictor(loaded: loader.Loaded) -> Predictor:
  """The checkpoint's model under jax.jit, with the serving signature's preprocessing."""
  scale, offset = (np.asarray(v, np.float32) for v in loaded.description.preprocessing.affine())
  model, devices = loaded.model, jax.local_devices()
  mesh = Mesh(np.array(devices), ("data",))
  params = jax.device_put(loaded.params, NamedSharding(mesh, PartitionSpec()))

  @jax.jit
  def logits(params, images):
    x = images.astype(jnp.float32) * scale + offset  # Per channel, as pp.affine_map.
    return model.apply({"params": params}, x, train=False)

  free = footprint.available_bytes(devices[0])  # With the params in place.

  def predict_fn(images):
    """In calls of as many images as the memory here holds (a ViT-L/14 at 518 px takes
    ~0.5 GB an image), each padded to split over the devices."""
    n = len(images)
    step = footprint.batch_for(model, loaded.image_size, n + -n % len(devices), len(devices),
                               free)
    out = []
    for i in range(0, n, step):
      chunk = images[i:i + step]
      pad = -len(chunk) % (step if n > step else len(devices))  # One shape for every call.
      chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
      out.append(np.asarray(logits(params, jax.device_put(
          chunk, NamedSharding(mesh, PartitionSpec("data")))))[:len(chunk) - pad])
    return np.concatenate(out)

  return Predictor("jax", loaded.image_size, model.num_classes, predict_fn, loaded.source,
                   loaded.description)


def open_model(path: str, num_threads: int | None = None, **load_kwargs) -> Predictor:
  """A Predictor for an exported model (`num_threads`: its runtime's, where it takes one) or any
  checkpoint (`load_kwargs` go to loader.load)."""
  fmt = formats.format_of(path)
  if fmt is not None:
    if load_kwargs:
      raise ValueError(f"{path} is an exported {fmt} model: its architecture and resolution "
                       f"are fixed, so {sorted(load_kwargs)} cannot be applied.")
    formats.require(fmt, path)
    try:
      return formats.module(fmt).predictor(path, num_threads)
    except Exception as e:  # Each runtime fails its own way on a damaged file.
      first = (str(e).strip().splitlines() or [""])[0][:300]
      raise ValueError(f"{path}: the exported {fmt} model cannot be opened, so it is truncated "
                       f"or damaged ({type(e).__name__}: {first}); export it again") from e
  return jax_predictor(loader.load(path, **load_kwargs))
