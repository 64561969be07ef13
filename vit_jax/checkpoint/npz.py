"""The released-checkpoint (.npz) layout: read any of the published layouts,
fit them to a model (position-embedding resize, head reset), write the original.

Layouts read:
  * original (gs://vit_models): `Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/...`,
    position embedding `Transformer/posembed_input/pos_embedding` with the class entry;
    some older files carry an `opt/target/` prefix.
  * newer Flax names: block children `LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
    MlpBlock_0`.
  * big_vision: `params/` prefix, newer names (or a scanned `Transformer/encoderblock/` with a
    leading layer axis), top-level `pos_embedding` without the class entry.
Everything is converted to the original layout, which is also what `save_npz` writes.
"""
import hashlib
import io
import logging
import re
import zipfile
from typing import Any, Mapping, Optional

import jax
import numpy as np
from etils import epath
from flax import traverse_util

from vit_jax.checkpoint import description as description_lib
from vit_jax.checkpoint import patch_resize
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.models import posemb_resize, vit
from vit_jax.models.vit import POSEMB_KEY  # noqa: F401 (the layouts' and loader's, from here)

Params = Mapping[str, Any]

_NEW_TO_OLD_BLOCK_NAMES = {
    "LayerNorm_0": "LayerNorm_0",
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}


def flatten(params: Params) -> dict[str, Any]:
  return traverse_util.flatten_dict(dict(params), sep="/")


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  return traverse_util.unflatten_dict(dict(flat), sep="/")


def read_npz(path: str) -> dict[str, np.ndarray]:
  """Reads an .npz file (local or any epath-supported URL) as a flat dict, without pickle."""
  path = epath.Path(path)
  if path.is_dir():
    raise CheckpointError(
        f"{path} is a directory, not an .npz file. For a training run (a workdir or one of "
        "its step directories) use `vit_jax.checkpoint.loader.load` or `run.read_params`.")
  data = path.read_bytes()
  if not data.startswith(b"PK"):
    raise CheckpointError(f"{path} is not an .npz file (no zip header). Released ViT "
                          "checkpoints are .npz files with '/'-joined keys.")
  try:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files if f"{k}.npy" in npz.zip.namelist()}
  except ValueError as e:
    raise CheckpointError(f"{path} holds pickled objects, which are refused for safety "
                          f"(np.load(allow_pickle=False)): {e}") from e
  except (zipfile.BadZipFile, EOFError, OSError) as e:
    raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}), e.g. truncated by an "
                          "interrupted copy: copy it again from its source.") from e
  if not arrays:
    raise CheckpointError(f"{path} is a zip file holding no arrays, not a ViT checkpoint.")
  return arrays


def _rename_new_flax_block(key: str) -> str:
  m = re.match(r"(Transformer/encoderblock_\d+/)([^/]+)(/.*)", key)
  if not m:
    return key
  return m.group(1) + _NEW_TO_OLD_BLOCK_NAMES.get(m.group(2), m.group(2)) + m.group(3)


def to_original_layout(flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Converts any supported layout to the original release layout."""
  flat = dict(flat)
  for prefix in ("opt/target/", "params/"):
    if flat and all(k.startswith(prefix) for k in flat):
      flat = {k[len(prefix):]: v for k, v in flat.items()}

  # big_vision's scanned encoder: one stacked `encoderblock` with a leading layer axis.
  scanned = {k: v for k, v in flat.items() if k.startswith("Transformer/encoderblock/")}
  if scanned:
    for k, v in scanned.items():
      del flat[k]
      rest = k[len("Transformer/encoderblock/"):]
      for i, layer in enumerate(v):
        flat[f"Transformer/encoderblock_{i}/{rest}"] = layer

  if any("/MultiHeadDotProductAttention_0/" in k for k in flat if k.startswith("Transformer/")):
    flat = {_rename_new_flax_block(k): v for k, v in flat.items()}

  if "pos_embedding" in flat:  # big_vision: patches only; the class token gets none.
    posemb = flat.pop("pos_embedding")
    if "cls" in flat:
      posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
    flat[POSEMB_KEY] = posemb
  return flat


def split_description(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
  """(the arrays of an .npz in any layout, as flat keys of the original layout; the
  `description.Description` that `save_npz` wrote into it, or None)."""
  described = description_lib.from_npz_entry(arrays)
  arrays = {k: v for k, v in arrays.items() if k != description_lib.DESCRIPTION_KEY}
  return to_original_layout(arrays), described


def arrays_sha256(flat: Mapping[str, np.ndarray]) -> str:
  """A checkpoint's identity by content: sha256 over its arrays' names, dtypes, shapes and
  bytes, in name order (the same for an .npz and its copy in another layout or container)."""
  digest = hashlib.sha256()
  for name in sorted(flat):
    a = np.ascontiguousarray(flat[name])
    digest.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
    digest.update(a.data)
  return digest.hexdigest()


def load_npz_flat(path: str) -> dict[str, np.ndarray]:
  """Reads a released .npz in any layout, as flat keys of the original layout."""
  return split_description(read_npz(path))[0]


def infer_model_config(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The `VisionTransformer` fields of original-layout arrays, read off their shapes."""
  block = "Transformer/encoderblock_0/"
  if "embedding/kernel" not in flat or block + "MlpBlock_3/Dense_0/kernel" not in flat:
    raise CheckpointError("Cannot infer the architecture: the checkpoint has no embedding or "
                          "encoder block 0.")
  kernel = flat["embedding/kernel"]
  config = dict(
      patch_size=kernel.shape[0], hidden_size=kernel.shape[-1],
      mlp_dim=flat[block + "MlpBlock_3/Dense_1/kernel"].shape[0],
      num_heads=flat[block + "MultiHeadDotProductAttention_1/query/kernel"].shape[1],
      num_layers=len({k.split("/")[1] for k in flat if k.startswith("Transformer/encoderblock_")}),
      representation_size=(flat["pre_logits/kernel"].shape[-1] if "pre_logits/kernel" in flat
                            else None),
      classifier="token" if "cls" in flat else "map" if "MAPHead_0/probe" in flat else "gap",
      posemb="learn" if POSEMB_KEY in flat else "sincos2d")
  if "reg" in flat:
    config["num_registers"] = flat["reg"].shape[1]
  if "fc_norm/scale" in flat:
    config["fc_norm"] = True
  config.update(_block_layout(flat, block))
  if "conv_root/kernel" in flat:
    stages = sorted({k.split("/")[0] for k in flat if re.match(r"block\d+/", k)})
    config["resnet_layers"] = tuple(
        len({k.split("/")[1] for k in flat if k.startswith(f"block{i + 1}/")})
        for i in range(len(stages)))
    config["resnet_width_factor"] = flat["conv_root/kernel"].shape[-1] / 64
  return config


def _block_layout(flat: Mapping[str, np.ndarray], block: str) -> dict[str, Any]:
  """The fields the arrays of the blocks and around them tell, where they differ from the
  default (the official layout)."""
  attention, mlp = block + "MultiHeadDotProductAttention_1/", block + "MlpBlock_3/"
  has = lambda key: key in flat  # noqa: E731
  found = dict(
      pre_norm=has("Transformer/pre_norm/scale"), layer_scale=has(block + "LayerScale_0/scale"),
      qkv_bias=("qkv" if has(attention + "key/bias") else
                "qv" if has(attention + "query/bias") else "none"),
      # SwiGLU's Dense_0 holds the gate and the value: twice the hidden layer Dense_1 reads.
      mlp="swiglu" if (flat[mlp + "Dense_0/kernel"].shape[-1] ==
                       2 * flat[mlp + "Dense_1/kernel"].shape[0]) else "gelu",
      mlp_norm=has(mlp + "LayerNorm_0/scale"), attention_norm=has(attention + "LayerNorm_0/scale"),
      head_bias=not has("head/kernel") or has("head/bias"))
  fields = vit.VisionTransformer.__dataclass_fields__
  return {k: v for k, v in found.items() if v != fields[k].default}


def resize_posemb(posemb: np.ndarray, num_tokens: int, *, has_class_token: bool,
                  target_has_class_token: bool, interpolation: str = "bilinear") -> np.ndarray:
  """Resizes a (1, tokens, D) position embedding to `num_tokens` tokens.

  The patch grid is resampled in 2-D as a model with dynamic_image_size does
  (models/posemb_resize.py; "bilinear" is scipy.ndimage.zoom's order 1, as the official
  code zooms); the class entry is kept, dropped or added (as zeros) to match the target.
  Both grids must be square.
  """
  tok, grid = (posemb[:, :1], posemb[0, 1:]) if has_class_token else (posemb[:, :0], posemb[0])
  if target_has_class_token and not has_class_token:
    tok = np.zeros_like(posemb[:, :1])
  elif not target_has_class_token:
    tok = posemb[:, :0]
  num_grid_new = num_tokens - tok.shape[1]
  gs_old, gs_new = int(np.sqrt(len(grid))), int(np.sqrt(num_grid_new))
  if gs_old**2 != len(grid) or gs_new**2 != num_grid_new:
    raise CheckpointError(
        f"Cannot resize a position embedding of {len(grid)} patches to {num_grid_new}: "
        "only square grids are resized automatically.")
  if gs_old != gs_new:
    logging.info("Resizing position embedding grid %dx%d -> %dx%d.", gs_old, gs_old, gs_new, gs_new)
    grid = posemb_resize.resample(grid.reshape(gs_old, gs_old, -1), (gs_new, gs_new),
                                  interpolation)
  grid = grid.reshape(1, gs_new * gs_new, -1)
  return np.concatenate([tok, grid], axis=1).astype(posemb.dtype)


def _reshaped(key: str, value: np.ndarray, want: Any, has_class_token: bool,
              target_has_class_token: bool, interpolation: str) -> np.ndarray | None:
  """`value` made to `want`'s shape where that has a meaning (position embedding, patch
  embedding, head); None where it has none."""
  want_shape = tuple(want.shape)
  if key == POSEMB_KEY and value.shape[-1] == want_shape[-1]:
    return resize_posemb(value, want_shape[1], has_class_token=has_class_token,
                         target_has_class_token=target_has_class_token,
                         interpolation=interpolation)
  if key == "embedding/kernel" and value.shape[2:] == want_shape[2:]:
    logging.info("Resampling the patch embedding %s -> %s (FlexiViT's PI-resize).",
                 value.shape[:2], want_shape[:2])
    return patch_resize.pi_resize(value, want_shape[:2])
  if key.startswith("head/"):
    logging.info("Resetting %s: checkpoint %s, model %s.", key, value.shape, want_shape)
    return _reset(want)
  return None


def fit_to_target(flat: Mapping[str, np.ndarray], target: Params,
                  posemb_interpolation: str = "bilinear") -> dict[str, Any]:
  """Fits original-layout flat arrays to the structure and shapes of `target`.

  Resizes the position embedding (`posemb_interpolation`), resamples the patch embedding to the target's patch size
  (patch_resize), resets the head (to the target's own init,
  i.e. zeros) when the class count differs, drops pre-logits the target lacks.
  Any other missing, unexpected or mis-shaped array is reported, all in one error.
  """
  flat = dict(flat)
  target_flat = flatten(target)
  has_class_token = "cls" in flat
  problems = []

  if "pre_logits/kernel" in flat and "pre_logits/kernel" not in target_flat:
    logging.info("Dropping the checkpoint's pre_logits: the model has representation_size=None.")
    flat.pop("pre_logits/kernel")
    flat.pop("pre_logits/bias", None)

  out = {}
  for key, want in target_flat.items():
    want_shape = tuple(want.shape)
    if key not in flat:
      if key.startswith("head/"):
        out[key] = _reset(want)
        continue
      fix = ("set representation_size=None or use a checkpoint with pre-logits"
             if key.startswith("pre_logits/") else "check the model name and options")
      problems.append(f"  {key}: missing from the checkpoint, model wants {want_shape}; {fix}.")
      continue
    value = np.asarray(flat.pop(key))
    if value.shape != want_shape:
      fitted = _reshaped(key, value, want, has_class_token, "cls" in target_flat,
                         posemb_interpolation)
      if fitted is None:
        problems.append(f"  {key}: checkpoint has {value.shape}, model wants {want_shape}; "
                        "check the model name and options (hidden_size, patch_size, ...).")
        continue
      value = fitted
    out[key] = value.astype(getattr(want, "dtype", value.dtype))

  for key in sorted(flat):
    problems.append(f"  {key}: in the checkpoint {flat[key].shape} but not in the model; "
                    "check the model name and options (classifier, resnet_layers, ...).")
  if problems:
    raise CheckpointError("Checkpoint does not fit the model:\n" + "\n".join(problems))
  return unflatten(out)


def _reset(target_leaf: Any) -> np.ndarray:
  """The target's own initial value (the zero-initialised head), or zeros if abstract."""
  if isinstance(target_leaf, jax.ShapeDtypeStruct):
    return np.zeros(target_leaf.shape, target_leaf.dtype)
  return np.asarray(target_leaf)


def load_npz(path: str, target: Optional[Params] = None) -> dict[str, Any]:
  """Loads a released .npz (any layout). With `target` (e.g. `variables["params"]`
  of the model to fine-tune) the result is fitted to it: see `fit_to_target`; the position
  embedding resized as the file's description says (an export of a timm or transformers
  checkpoint: its framework's interpolation), else bilinearly, as the official code."""
  flat, described = split_description(read_npz(path))
  if target is None:
    return unflatten(flat)
  method = described.model.get("posemb_interpolation") if described else None
  return fit_to_target(flat, target, method or "bilinear")


def save_npz(path: str, params: Params, description: Any = None) -> None:
  """Writes params as a flat .npz with '/'-joined keys: the original release layout; a
  `description.Description` goes in as one more entry (a string, which the official code and
  timm skip over)."""
  flat = {k: np.asarray(v) for k, v in flatten(params).items()}
  if description is not None:
    flat[description_lib.DESCRIPTION_KEY] = np.array(description.to_json())
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  buf = io.BytesIO()
  np.savez(buf, **flat)
  tmp = path.parent / (path.name + ".tmp")
  tmp.write_bytes(buf.getvalue())
  tmp.replace(path)
