"""A SavedModel of `savedmodel` as a float32 TFLite model, and LiteRT's interpreter to run it.

TensorFlow's converter (LiteRT has none in Python) deserializes the StableHLO inside jax2tf's
`XlaCallModule` and lowers it to TFLite builtin ops (no Flex/select TF ops); the serving
signature keeps its names (`images` -> `logits`, `top5`) and a dynamic batch size. The
description is a metadata entry of the flatbuffer (`Model.metadata`, named
formats.METADATA_NAME), which interpreters ignore. Everything else, the flatbuffer's schema
and the interpreter, is LiteRT's (`ai-edge-litert`, the export extra): TensorFlow's
`tf.lite.Interpreter` is deprecated. One format of `formats`.
"""
import importlib
import os

from etils import epath, epy

from vit_jax.checkpoint import loader
from vit_jax.checkpoint.description import Description
from vit_jax.serving import formats, savedmodel

with epy.lazy_imports():
  import tensorflow as tf

REQUIRES = ("ai_edge_litert",)  # The flatbuffer's schema and the interpreter: LiteRT's.


def litert(module: str):
  """`ai_edge_litert.<module>`, or ImportError saying how to install it."""
  try:
    return importlib.import_module(f"ai_edge_litert.{module}")
  except ImportError as e:
    raise ImportError("TFLite models are written and run with LiteRT: "
                      "pip install 'vit_jax[export]'.") from e


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


def write(loaded: loader.Loaded, out: str, scratch: str, **kwargs) -> None:
  saved = savedmodel.save(loaded, os.path.join(scratch, "saved_model"), **kwargs)
  from_savedmodel(saved, out)
  write_description(out, loaded.description)


def write_description(tflite_file: str, description: Description) -> None:
  """Adds the description to the model's metadata, in place."""
  schema, flatbuffer_utils = litert("schema_py_generated"), litert("tools.flatbuffer_utils")
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
  schema = litert("schema_py_generated")
  model = schema.Model.GetRootAsModel(epath.Path(path).read_bytes(), 0)
  for i in range(model.MetadataLength()):
    entry = model.Metadata(i)
    if entry.Name().decode() == formats.METADATA_NAME:
      return model.Buffers(entry.Buffer()).DataAsNumpy().tobytes().decode()
  return None


def interpreter(model_path: str, num_threads: int | None = None):
  """LiteRT's interpreter of the model (tf.lite.Interpreter's API)."""
  return litert("interpreter").Interpreter(model_path=model_path, num_threads=num_threads)


def signature_runner(model_path: str, num_threads: int | None = None):
  """The serving signature as a callable: runner(images=uint8 array) -> dict of arrays."""
  return interpreter(model_path, num_threads).get_signature_runner(savedmodel.SIGNATURE)


def predictor(path: str, num_threads: int | None = None) -> formats.Predictor:
  serve = signature_runner(path, num_threads)
  shape = serve.get_input_details()[savedmodel.INPUT]["shape_signature"]
  num_classes = serve.get_output_details()["logits"]["shape_signature"][-1]
  predict_fn = lambda images: serve(**{savedmodel.INPUT: images})["logits"]  # noqa: E731
  return formats.Predictor("tflite", int(shape[1]), int(num_classes), predict_fn, path,
                           formats.description_or_none(path))
