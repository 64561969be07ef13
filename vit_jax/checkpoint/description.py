"""What a checkpoint is, recorded with it: its model, the input it expects, its classes, and
where it came from (timm's `pretrained_cfg` is the model for this).

Every checkpoint the project writes carries one (a run's step in its metadata, an .npz as
the `DESCRIPTION_KEY` entry, each serving format of vit_jax.serving.formats its own way), so whoever
loads it needs no flag that the file could tell. Files released without one are described
by `released`, whose defaults are those of the official code and name themselves in
`assumed`.
"""
import dataclasses
import json
import logging
import math
from typing import Any, Mapping

import numpy as np

from vit_jax.config_errors import InputError
from vit_jax.data import config as data_config
# What the input preprocessing is (value range or mean and std, crop, interpolation) lives
# beside the data transforms that apply it; description.Preprocessing is the same class.
from vit_jax.data.input_contract import Preprocessing

DESCRIPTION_KEY = "__vit_jax_description__"  # The .npz entry (a 0-d unicode array of JSON).
# 2: the preprocessing may give mean, std and interpolation. A description without them
# (no mean and std, bilinear) is written without those keys as format 1, which vit_jax
# versions before them read; theirs refuse format 2 saying to upgrade.
# 3: `parent_sha256` (a LoRA run's base, by content); written only where set.
# 4: the preprocessing's `geometry`; written only where it is not big_vision's.
FORMAT = 4
_PREPROCESSING_SINCE_2 = {"mean": None, "std": None, "interpolation": "bilinear"}
# The official code's and big_vision's evaluation input: bilinear resize to the resolution,
# RGB, [0, 255] -> [-1, 1], as the input pipeline's defaults.
RELEASED_VALUE_RANGE = data_config.DEFAULT_VALUE_RANGE
RELEASED_CROP = "resize"
DEFAULT_IMAGE_SIZE = 224  # A model without a learned position embedding to read it from.
OUTPUTS = ("softmax", "sigmoid")
_OUTPUT_OF_LOSS = {"softmax_xent": "softmax", "sigmoid_xent": "sigmoid"}


class DescriptionMismatch(InputError):
  """A command's explicit option says otherwise than the checkpoint's description."""


class UnreadableDescription(InputError):
  """A stored description that no version of vit_jax wrote: not JSON, or a field missing or
  of another type."""


@dataclasses.dataclass(frozen=True)
class Description:
  """A checkpoint's self-description; `to_json` / `from_json` are its stored form."""
  model: dict[str, Any]  # VisionTransformer fields (architecture, pooling, head options).
  image_size: int  # The resolution its position embedding is fitted to.
  num_classes: int | None  # None: no classification head.
  preprocessing: Preprocessing = Preprocessing()
  model_name: str | None = None  # Registry name, where the architecture has one.
  class_names: tuple[str, ...] = ()  # Empty where the data named none.
  output: str | None = None  # 'softmax' or 'sigmoid' (the training loss's); None: unknown.
  dataset: str | None = None  # What it was trained (or fine-tuned) on.
  step: int | None = None  # The training step the parameters are from.
  parent: str | None = None  # The checkpoint it was fine-tuned from (config.pretrained).
  # arrays_sha256 of the parent's arrays, where they are needed to read this one (LoRA
  # adapters, merged onto their base when read).
  parent_sha256: str | None = None
  exported_from: str | None = None  # The checkpoint `vit-export` read to write it.
  config: dict[str, Any] | None = None  # The training config that wrote it.
  assumed: tuple[str, ...] = ()  # Fields filled in from documented defaults, not the file.

  def __post_init__(self):
    if self.class_names and self.num_classes is not None and (
        len(self.class_names) != self.num_classes):
      raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes.")
    if self.output is not None and self.output not in OUTPUTS:
      raise ValueError(f"output={self.output!r}: expected one of {OUTPUTS}.")

  def replace(self, **changes: Any) -> "Description":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """Its stored form, in the oldest format that holds it (what older readers can read)."""
    d = json.loads(json.dumps(dataclasses.asdict(self), default=list))
    fmt, pre = 1, d["preprocessing"]
    if all(pre[k] == v for k, v in _PREPROCESSING_SINCE_2.items()):
      d["preprocessing"] = {k: v for k, v in pre.items() if k not in _PREPROCESSING_SINCE_2}
    else:
      fmt = 2
    if d["parent_sha256"] is None:
      del d["parent_sha256"]
    else:
      fmt = 3
    if d["preprocessing"]["geometry"] == "big_vision":
      del d["preprocessing"]["geometry"]
    else:
      fmt = 4
    return {"format": fmt, **d}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Description":
    """Reads every format so far; raises UnreadableDescription for anything else."""
    if not isinstance(d, Mapping):
      raise UnreadableDescription(f"a description is a JSON object, not {type(d).__name__}")
    d = dict(d)
    fmt = d.pop("format", FORMAT)
    if isinstance(fmt, int) and fmt > FORMAT:
      raise ValueError("the checkpoint's description was written by a newer vit_jax: upgrade.")
    try:
      d["model"] = {k: tuple(v) if isinstance(v, list) else v for k, v in d["model"].items()}
      d["preprocessing"] = Preprocessing(**(d.get("preprocessing") or {}))  # Lists as tuples.
      d["class_names"] = tuple(d.get("class_names") or ())
      d["assumed"] = tuple(d.get("assumed") or ())
      return cls(**d)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      raise UnreadableDescription(f"{type(e).__name__}: {e}") from e

  @classmethod
  def from_json(cls, text: str) -> "Description":
    try:
      d = json.loads(text)
    except ValueError as e:
      raise UnreadableDescription(f"not JSON ({e})") from e
    return cls.from_dict(d)

  @property
  def model_label(self) -> str:
    return model_label(self.model_name, self.model)

  def class_name(self, i: int) -> str:
    return self.class_names[i] if self.class_names else f"class {i}"

  def summary(self) -> str:
    """One line for a log or a report."""
    pre = self.preprocessing
    parts = [self.model_label, f"{self.image_size}px",
             f"{self.num_classes or 'no'} classes"
             + (f" ({', '.join(self.class_names[:3])}{', ...' if self.num_classes > 3 else ''})"
                if self.class_names else ""),
             f"input {pre.normalisation()}, {pre.crop}"
             + (f", {pre.interpolation}" if pre.interpolation != "bilinear" else "")]
    if self.dataset:
      parts.append(f"trained on {self.dataset}" + (f" to step {self.step}" if self.step else ""))
    if self.assumed:
      parts.append(f"assumed (not recorded in the file): {', '.join(self.assumed)}")
    return "; ".join(parts)


def check_option(what: str, option: str, given: Any, recorded: Any, source: str) -> None:
  """Raises DescriptionMismatch when an explicit command-line `option` (given) says
  otherwise than the checkpoint's description (recorded); None on either side agrees."""
  if given is None or recorded is None or given == recorded:
    return
  raise DescriptionMismatch(
      f"{option} {_short(given)} disagrees with {source}, whose description records {what} "
      f"{_short(recorded)}: leave {option} out to use the checkpoint's.")


def _short(value: Any) -> str:
  if isinstance(value, (list, tuple)) and len(value) > 6:
    return repr(list(value[:5]))[:-1] + f", ... ({len(value)} in all)]"
  return repr(value)


def output_of_loss(loss: str) -> str | None:
  return _OUTPUT_OF_LOSS.get(loss)


def grid_image_size(posemb_tokens: int, has_class_token: bool, stride: int) -> int:
  """The resolution a learned position embedding of `posemb_tokens` rows stands for."""
  return math.isqrt(posemb_tokens - has_class_token) * stride


def model_label(model_name: str | None, model: Mapping[str, Any]) -> str:
  """What to call a model: its registry name, or where it has none its shape, `ViT with patch
  7, width 64, depth 2, 2 heads, MLP 256` (`R+ViT with ResNet stages (3, 4, 9), patch 1, ...`
  for a hybrid)."""
  if model_name:
    return model_name
  get = lambda k: model.get(k, "?")
  stages = model.get("resnet_layers")
  resnet = "" if stages is None else f"ResNet stages {tuple(stages)}, "
  return (f"{'ViT' if stages is None else 'R+ViT'} with {resnet}patch {get('patch_size')}, "
          f"width {get('hidden_size')}, depth {get('num_layers')}, {get('num_heads')} heads, "
          f"MLP {get('mlp_dim')}")


def released(model: Mapping[str, Any], model_name: str | None, num_classes: int | None,
             image_size: int | None, **known: Any) -> Description:
  """The description of a file released without one: the model read off its arrays, the
  official code's preprocessing, the resolution from the position embedding or the AugReg
  index (`image_size`)."""
  assumed = ["model", "preprocessing"] + (["image_size"] if image_size is None else [])
  return Description(model=dict(model), model_name=model_name, num_classes=num_classes,
                     image_size=image_size or DEFAULT_IMAGE_SIZE,
                     preprocessing=Preprocessing(), assumed=tuple(assumed), **known)


def from_npz_entry(arrays: Mapping[str, np.ndarray]) -> Description | None:
  """The description an .npz carries; None for none, or (one warning) for one no vit_jax
  wrote: its arrays are then described as a released file's are."""
  if DESCRIPTION_KEY not in arrays:
    return None
  try:
    return Description.from_json(str(arrays[DESCRIPTION_KEY]))
  except UnreadableDescription as e:
    logging.warning("The .npz's %s is no description vit_jax wrote (%s): its arrays are "
                    "described as a released file's.", DESCRIPTION_KEY, e)
    return None
