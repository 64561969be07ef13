"""A SavedModel of `savedmodel` as a float32 TFLite model, and the interpreter to run it.

TensorFlow's converter deserializes the StableHLO inside jax2tf's `XlaCallModule` and
lowers it to TFLite builtin ops (no Flex/select TF ops); the serving signature keeps its
names (`images` -> `logits`, `top5`) and a dynamic batch size.
"""
import contextlib
import warnings
from collections.abc import Iterator

import tensorflow as tf
from etils import epath

from vit_jax.serving import savedmodel


def from_savedmodel(saved_model_dir: str, out_file: str) -> str:
  """Converts the serving signature of `saved_model_dir` to `out_file`; returns it."""
  converter = tf.lite.TFLiteConverter.from_saved_model(
      saved_model_dir, signature_keys=[savedmodel.SIGNATURE])
  out = epath.Path(out_file)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(converter.convert())
  return out_file


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
