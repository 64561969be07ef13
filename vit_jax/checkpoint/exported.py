"""A checkpoint's description, written into and read back from the models `vit-export`
writes (the serving formats of `vit_jax.serving`).

- SavedModel: `assets.extra/vit_jax_description.json`, where TensorFlow Serving keeps files
  that belong to a model but not to its graph.
- TFLite: a metadata entry of the flatbuffer (`Model.metadata`, name `METADATA_NAME`),
  which interpreters ignore.
- ONNX: the model's `metadata_props` under `METADATA_NAME`.
Reading needs no TensorFlow for a SavedModel or an ONNX file.
"""
from etils import epath

from vit_jax.checkpoint.description import Description

METADATA_NAME = "vit_jax_description"
_SAVEDMODEL_FILE = f"assets.extra/{METADATA_NAME}.json"


def format_of(path: str) -> str | None:
  """Which serving format `path` holds, by its name ('onnx', 'tflite'; a SavedModel is a
  folder with saved_model.pb): None for anything else, e.g. a checkpoint."""
  p = epath.Path(path)
  if p.suffix in (".onnx", ".tflite"):
    return p.suffix[1:]
  return "savedmodel" if (p / "saved_model.pb").exists() else None


def is_exported(path: str) -> bool:
  """Whether `path` is a model `vit-export` writes: a SavedModel, .tflite or .onnx."""
  return format_of(path) is not None


def write_savedmodel(saved_model_dir: str, description: Description) -> None:
  out = epath.Path(saved_model_dir) / _SAVEDMODEL_FILE
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(description.to_json())


def write_tflite(tflite_file: str, description: Description) -> None:
  """Adds the description to the model's metadata, in place."""
  from tensorflow.lite.python import schema_py_generated as schema
  from tensorflow.lite.tools import flatbuffer_utils
  model = flatbuffer_utils.read_model(tflite_file)
  buffer = schema.BufferT()
  buffer.data = list(description.to_json().encode())
  model.buffers.append(buffer)
  entry = schema.MetadataT()
  entry.name, entry.buffer = METADATA_NAME, len(model.buffers) - 1
  model.metadata = [m for m in (model.metadata or []) if m.name != METADATA_NAME.encode()]
  model.metadata.append(entry)
  flatbuffer_utils.write_model(model, tflite_file)


def add_to_onnx(model, description: Description) -> None:
  """Sets the description in an `onnx.ModelProto`'s metadata_props."""
  props = {p.key: p.value for p in model.metadata_props}
  props[METADATA_NAME] = description.to_json()
  del model.metadata_props[:]
  for key, value in props.items():
    entry = model.metadata_props.add()
    entry.key, entry.value = key, value


def _tflite_metadata(tflite_file: str) -> str | None:
  from tensorflow.lite.python import schema_py_generated as schema
  data = epath.Path(tflite_file).read_bytes()
  model = schema.Model.GetRootAsModel(data, 0)
  for i in range(model.MetadataLength()):
    entry = model.Metadata(i)
    if entry.Name().decode() == METADATA_NAME:
      return model.Buffers(entry.Buffer()).DataAsNumpy().tobytes().decode()
  return None


def _onnx_metadata(onnx_file: str) -> str | None:
  import onnx
  model = onnx.load(onnx_file, load_external_data=False)
  return next((p.value for p in model.metadata_props if p.key == METADATA_NAME), None)


def read(path: str) -> Description:
  """The description an exported model carries; raises ValueError if it has none."""
  p = epath.Path(path)
  if p.suffix == ".tflite":
    text = _tflite_metadata(path)
  elif p.suffix == ".onnx":
    text = _onnx_metadata(path)
  else:
    f = p / _SAVEDMODEL_FILE
    text = f.read_text() if f.exists() else None
  if text is None:
    raise ValueError(f"{path} carries no vit_jax description: it was not written by "
                     "`vit-export` (or by a version before descriptions).")
  return Description.from_json(text)
