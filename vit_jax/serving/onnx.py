"""A TFLite model of `tflite` as ONNX, through tf2onnx, with the serving signature's names.

ONNX comes from the TFLite model because neither converter takes the model more directly:
- tf2onnx (1.17) has no handler for `XlaCallModule`, the one op jax2tf (jax 0.10, native
  serialization only) writes into the SavedModel: "pass1 convert failed ... XlaCallModule".
- jax2onnx (0.17.1) requires orbax-checkpoint < 0.11.37 (this project: 0.12) and gets the
  hybrids wrong: its patch of flax.linen.Conv reads the kernel from the variables,
  bypassing StdConv's weight standardisation (checked here: the root conv's output off by
  up to 29, a tiny hybrid's logits by 9e-3).
The TFLite model holds only builtin ops, which tf2onnx converts one for one, but for two:
see `_unsorted_segment_prod` and `_select`. `onnx` and `tf2onnx` come with the export extra. The
description is the model's `metadata_props` entry named formats.METADATA_NAME. One format of
`formats`.
"""
import importlib
import os
from unittest import mock

import numpy as np

from vit_jax.checkpoint import loader
from vit_jax.checkpoint.description import Description
from vit_jax.serving import formats, savedmodel, tflite

OPSET = 17
REQUIRES = ("onnx", "onnxruntime", "tf2onnx", *tflite.REQUIRES)  # Through TFLite.


def holds(path: str) -> bool:
  return path.endswith(".onnx")


def write(loaded: loader.Loaded, out: str, scratch: str, **kwargs) -> None:
  tflite_file = os.path.join(scratch, "model.tflite")
  tflite.write(loaded, tflite_file, scratch, **kwargs)
  from_tflite(tflite_file, out, loaded.description)


def _require(module: str):
  """Imports one of the export extra's packages, or says how to install them."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"ONNX export and inference need {module.split('.')[0]}: "
                      "pip install 'vit_jax[export]'.") from e


def _signature_names(tflite_file: str) -> dict[str, str]:
  """{TFLite tensor name: signature name} of the serving signature's inputs and outputs."""
  signature = tflite.signature_runner(tflite_file)
  details = signature.get_input_details() | signature.get_output_details()
  return {d["name"]: key for key, d in details.items()}


def _rename(graph, names: dict[str, str]) -> None:
  """Renames tensors of an ONNX graph; the batch dimension of its inputs and outputs is
  named `batch`."""
  for node in graph.node:
    node.input[:] = [names.get(n, n) for n in node.input]
    node.output[:] = [names.get(n, n) for n in node.output]
  for value in list(graph.input) + list(graph.output):
    value.name = names.get(value.name, value.name)
    value.type.tensor_type.shape.dim[0].dim_param = "batch"


def _unsorted_segment_prod(ctx, node, name, args) -> None:
  """tf2onnx's handler of UnsortedSegmentProd, replaced: it reads a negative segment id as
  an index from the end, where TensorFlow leaves that element out. TFLite computes the
  batch-dependent shapes of its reshapes this way (ids [-1, -1, 0] of (batch, tokens, dim)
  mean "dim"), so its handler gives (batch * tokens, tokens * dim) and onnxruntime fails.
  Here out[j] = prod(data[i] for segments[i] == j), through a (segments, elements) mask."""
  from onnx import TensorProto
  from tf2onnx import utils
  from tf2onnx.graph_builder import GraphBuilder
  build, (data, segments, num) = GraphBuilder(ctx), node.input
  rank, dtype = ctx.get_rank(data), ctx.get_dtype(data)
  const = lambda v: ctx.make_const(utils.make_name(name), np.array(v, np.int64)).output[0]  # noqa: E731
  cast = lambda t: ctx.make_node("Cast", [t], attr={"to": TensorProto.INT64}).output[0]  # noqa: E731
  count = ctx.make_node("Reshape", [cast(num), const([])]).output[0]
  ids = ctx.make_node("Range", [const(0), count, const(1)]).output[0]
  ids = build.make_unsqueeze({"data": ids, "axes": list(range(1, rank + 1))})
  segments = build.make_unsqueeze({"data": cast(segments), "axes": [0, *range(2, rank + 1)]})
  mask = ctx.make_node("Equal", [ids, segments]).output[0]
  one = ctx.make_const(utils.make_name(name), np.array(1, utils.map_onnx_to_numpy_type(dtype)))
  data = build.make_unsqueeze({"data": data, "axes": [0]})
  picked = ctx.make_node("Where", [mask, data, one.output[0]]).output[0]
  outputs, shapes = node.output, [ctx.get_shape(o) for o in node.output]
  ctx.remove_node(node.name)
  build.make_reduce_prod({"data": picked, "axes": [1], "keepdims": 0, "outputs": outputs},
                         name=name, shapes=shapes, dtypes=[dtype])


def _select(ctx, node, name, args) -> None:
  """tf2onnx's handler of Select / SelectV2, kept to its ONNX `Where` form: it writes a float
  select as cast(c) * a + cast(!c) * b (faster in old onnxruntimes), which is NaN wherever the
  branch not taken is inf or NaN, as 0 * inf is. XLA's erfc, which the exact GELU
  (jax.nn.gelu(approximate=False)) is made of, takes exp(-x^2) * p(1 / x^2) for |x| >= 1 and
  1 - erf(x) below: its large-|x| branch is inf at x near 0, so every model with the exact GELU
  gave NaN logits. tf2onnx keeps `Where` for the selects it marks `handles_nan`; here all are."""
  from tf2onnx.onnx_opset import controlflow
  del name, args
  node.set_attr("handles_nan", True)
  controlflow.Select.version_9(ctx, node)


def tflite_to_onnx(tflite_file: str, opset: int = OPSET):
  """tf2onnx's ONNX model (onnx.ModelProto) of `tflite_file`, UnsortedSegmentProd converted
  by `_unsorted_segment_prod`, Select and SelectV2 by `_select`. tf2onnx reads the tensors'
  shapes with tf.lite.Interpreter, deprecated since TensorFlow 2.20: it is handed LiteRT's,
  the same API, meanwhile."""
  convert = _require("tf2onnx.convert")
  import tensorflow as tf
  with mock.patch.object(tf.lite, "Interpreter", tflite.litert("interpreter").Interpreter):
    model, _ = convert.from_tflite(
        tflite_file, opset=opset,
        custom_op_handlers={"UnsortedSegmentProd": (_unsorted_segment_prod, []),
                            "Select": (_select, []), "SelectV2": (_select, [])})
  return model


def from_tflite(tflite_file: str, out_file: str, description: Description | None = None,
                opset: int = OPSET) -> str:
  """Converts `tflite_file` (float32, from `tflite.from_savedmodel`) to `out_file`, with
  `description` in its metadata."""
  onnx, model = _require("onnx"), tflite_to_onnx(tflite_file, opset)
  _rename(model.graph, _signature_names(tflite_file))
  missing = {savedmodel.INPUT, *savedmodel.OUTPUTS} - {
      v.name for v in list(model.graph.input) + list(model.graph.output)}
  if missing:
    raise ValueError(f"{tflite_file} has no serving signature with {sorted(missing)}: convert "
                     "a TFLite model written by vit_jax.serving.tflite.from_savedmodel.")
  if description is not None:
    _add_description(model, description)
  onnx.checker.check_model(model)
  os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
  onnx.save(model, out_file)
  return out_file


def _add_description(model, description: Description) -> None:
  """Sets the description in an `onnx.ModelProto`'s metadata_props."""
  props = {p.key: p.value for p in model.metadata_props}
  props[formats.METADATA_NAME] = description.to_json()
  del model.metadata_props[:]
  for key, value in props.items():
    entry = model.metadata_props.add()
    entry.key, entry.value = key, value


def read_description(path: str) -> str | None:
  model = _require("onnx").load(path, load_external_data=False)
  return next((p.value for p in model.metadata_props if p.key == formats.METADATA_NAME), None)


def predictor(path: str, num_threads: int | None = None) -> formats.Predictor:
  opened = session(path, num_threads)
  shape = opened.get_inputs()[0].shape
  num_classes = next(o.shape[-1] for o in opened.get_outputs() if o.name == "logits")
  predict_fn = lambda images: opened.run(["logits"], {savedmodel.INPUT: images})[0]  # noqa: E731
  return formats.Predictor("onnx", int(shape[1]), int(num_classes), predict_fn, path,
                           formats.description_or_none(path))


def session(onnx_file: str, num_threads: int | None = None):
  """An onnxruntime CPU session; run it with session.run(None, {"images": uint8 array})."""
  ort = _require("onnxruntime")
  options = ort.SessionOptions()
  if num_threads:
    options.intra_op_num_threads = num_threads
  return ort.InferenceSession(onnx_file, options, providers=["CPUExecutionProvider"])
