"""A SavedModel of `savedmodel` as a float32 TFLite model, and the interpreter to run it.

TensorFlow's converter deserializes the StableHLO inside jax2tf's `XlaCallModule` and
lowers it to TFLite builtin ops (no Flex/select TF ops); the serving signature keeps its
names (`images` -> `logits`, `top5`) and a dynamic batch size. The description is a
metadata entry of the flatbuffer (`Model.metadata`, named formats.METADATA_NAME), which
interpreters ignore. One format of `formats`.
"""
import contextlib
import os
import warnings
from collections.abc import Iterator

from etils import epath, epy

from vit_jax import checkpoint
from vit_jax.checkpoint.description import Description
from vit_jax.serving import formats, savedmodel

with epy.lazy_imports():
  import tensorflow as tf
  from tensorflow.lite.python import schema_py_generated as schema
  from tensorflow.lite.tools import flatbuffer_utils


def holds(path: str) -> bool:
  return path.endswith(".tflite")


def from_savedmodel(saved_model_dir: str, out_file: str) -> str:
  """Converts the serving signature of `saved_model_dir` to `out_file`; returns it."""
  converter = tf.lite.TFLiteConverter.from_saved_model(
      saved_model_dir, signature_keys=[savedmodel.SIGNATURE])
  out = epath.Path(out_file)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(converter.convert())
  return out_file


def write(loaded: checkpoint.Loaded, out: str, scratch: str, **kwargs) -> None:
  saved = savedmodel.save(loaded, os.path.join(scratch, "saved_model"), **kwargs)
  from_savedmodel(saved, out)
  write_description(out, loaded.description)


def write_description(tflite_file: str, description: Description) -> None:
  """Adds the description to the model's metadata, in place."""
  model = flatbuffer_utils.read_model(tflite_file)
  buffer = schema.BufferT()
  buffer.data = list(description.to_json().encode())
  model.buffers.append(buffer)
  entry = schema.MetadataT()
  entry.name, entry.buffer = formats.METADATA_NAME, len(model.buffers) - 1
  model.metadata = [m for m in (model.metadata or [])
                    if m.name != formats.METADATA_NAME.encode()]
  model.metadata.append(entry)
  flatbuffer_utils.write_model(model, tflite_file)


def read_description(path: str) -> str | None:
  model = schema.Model.GetRootAsModel(epath.Path(path).read_bytes(), 0)
  for i in range(model.MetadataLength()):
    entry = model.Metadata(i)
    if entry.Name().decode() == formats.METADATA_NAME:
      return model.Buffers(entry.Buffer()).DataAsNumpy().tobytes().decode()
  return None


def interpreter(model_path: str, num_threads: int | None = None):
  """A TFLite interpreter: LiteRT's (ai-edge-litert, the export extra), else TensorFlow's
  own (deprecated since TF 2.20, still in 2.21)."""
  try:
    from ai_edge_litert.interpreter import Interpreter
  except ImportError:
    Interpreter = tf.lite.Interpreter  # noqa: N806
  with fallback_chosen():
    return Interpreter(model_path=model_path, num_threads=num_threads)


@contextlib.contextmanager
def fallback_chosen() -> Iterator[None]:
  """Silences TensorFlow's deprecation notice of its own interpreter (the fallback above, and
  what tf2onnx reads a TFLite model with): a choice made, not news to the user."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", ".*tf.lite.Interpreter is deprecated", UserWarning)
    yield


def signature_runner(model_path: str, num_threads: int | None = None):
  """The serving signature as a callable: runner(images=uint8 array) -> dict of arrays."""
  return interpreter(model_path, num_threads).get_signature_runner(savedmodel.SIGNATURE)


def runner(path: str, num_threads: int | None = None) -> formats.Runner:
  serve = signature_runner(path, num_threads)
  shape = serve.get_input_details()[savedmodel.INPUT]["shape_signature"]
  num_classes = serve.get_output_details()["logits"]["shape_signature"][-1]
  run = lambda images: serve(**{savedmodel.INPUT: images})["logits"]  # noqa: E731
  return formats.Runner("tflite", int(shape[1]), int(num_classes), run, path,
                        formats.description_or_none(path))
