"""`Preprocessing`: what turns a decoded uint8 image into a checkpoint's input (resolution
fit, channels, the affine map), as a checkpoint's description records it. Plain Python, so
that reading a description imports no TensorFlow; `preprocess.apply_preprocessing` applies it.
"""
import dataclasses
import math
import numbers
from typing import Any, Mapping

from vit_jax.data import config as data_config

# tf.image.resize's methods a checkpoint's evaluation may name: the official code's and
# big_vision's bilinear, timm's and transformers' usual bicubic.
INTERPOLATIONS = ("bilinear", "bicubic")
# Whose arithmetic places a central crop (preprocess.fit): whether the resize target
# size / central_crop_fraction and the shorter side's partner are truncated (else rounded),
# and whether the crop's offsets are rounded half to even (else down).
# "big_vision": the official code's, big_vision's and AugReg's
# `resize_small(round(size / fraction))|central_crop(size)`, and vit_jax's own runs.
# "torchvision": timm's transforms_imagenet_eval and open_clip's (Resize, CenterCrop).
# "transformers": its image processors' resize and center_crop (int(margin / 2)).
GEOMETRIES = {"big_vision": (False, False), "torchvision": (True, True),
              "transformers": (True, False)}


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """What turns a decoded uint8 image into a checkpoint's input, at evaluation and serving
  (`apply_preprocessing` applies it): fitted to the resolution (`crop`, `interpolation`),
  grayscale repeated to RGB, then one affine map per channel, input = uint8 * scale + offset
  (`affine`). The map is given either as `value_range`, what [0, 255] maps onto linearly
  (the official code's and AugReg's (-1, 1)), or as `mean` and `std` per channel of pixels
  scaled to [0, 1], as timm's `pretrained_cfg` and transformers' preprocessor_config state
  them: input = (uint8 / 255 - mean) / std. Invalid fields raise ValueError."""
  # [0, 255] maps onto (low, high). None where mean and std are given, else left out: the
  # official code's data_config.DEFAULT_VALUE_RANGE.
  value_range: tuple[float, float] | None = None
  crop: str = "resize"  # data_config.EVAL_CROPS: 'resize', 'central_crop', 'squash_...'.
  central_crop_fraction: float = 0.875  # The *central_crop's: resize to size / fraction, crop.
  channels: int = 3  # The model sees RGB; grayscale images are repeated to 3 channels.
  mean: tuple[float, ...] | None = None  # Per channel, of pixels in [0, 1]; with std.
  std: tuple[float, ...] | None = None
  interpolation: str = "bilinear"  # INTERPOLATIONS: how images are resized.
  geometry: str = "big_vision"  # GEOMETRIES: the *central_crop's rounding.

  def __post_init__(self):
    for field, value in _checked(self).items():
      object.__setattr__(self, field, value)  # Lists (JSON's) as tuples, numbers as floats.

  @classmethod
  def from_data_config(cls, data: Mapping[str, Any]) -> "Preprocessing":
    """The evaluation preprocessing of a `config.data` (or of its stored dict): its value
    range or mean and std, its eval crop, bilinear as the pipeline resizes."""
    return cls(value_range=data.get("value_range"), mean=data.get("mean"),
               std=data.get("std"), crop=data["eval_crop"],
               central_crop_fraction=float(data["central_crop_fraction"]))

  def affine(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per channel (scale, offset): the model's input is uint8 pixel * scale + offset."""
    if self.mean is not None:
      return (tuple(1.0 / (255.0 * s) for s in self.std),
              tuple(-m / s for m, s in zip(self.mean, self.std)))
    low, high = self.value_range
    return ((high - low) / 255.0,) * self.channels, (low,) * self.channels

  def normalisation(self) -> str:
    """The affine map in words, for reports."""
    if self.mean is None:
      low, high = self.value_range
      return f"[0, 255] -> [{low:g}, {high:g}]"
    text = lambda values: "(" + ", ".join(f"{v:g}" for v in values) + ")"  # noqa: E731
    return f"mean {text(self.mean)}, std {text(self.std)} of [0, 1] pixels"


def _invalid(field: str, value: Any, why: str) -> ValueError:
  return ValueError(f"Preprocessing.{field}={value!r}: {why}.")


def _numbers(p: Preprocessing, field: str, length: int) -> tuple[float, ...] | None:
  value = getattr(p, field)
  if value is None:
    return None
  if not (isinstance(value, (tuple, list)) and len(value) == length and all(
      isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
      for v in value)):
    raise _invalid(field, value, f"expected {length} finite numbers")
  return tuple(float(v) for v in value)


def _checked(p: Preprocessing) -> dict[str, Any]:
  """The fields of `p` that need normalising, normalised; raises ValueError naming the first
  field that is wrong."""
  if p.crop not in data_config.EVAL_CROPS:
    raise _invalid("crop", p.crop, f"expected one of {data_config.EVAL_CROPS}")
  if p.geometry not in GEOMETRIES:
    raise _invalid("geometry", p.geometry, f"expected one of {tuple(GEOMETRIES)}")
  if p.interpolation not in INTERPOLATIONS:
    raise _invalid("interpolation", p.interpolation, f"expected one of {INTERPOLATIONS}")
  if not 0 < p.central_crop_fraction <= 1:
    raise _invalid("central_crop_fraction", p.central_crop_fraction, "must be in (0, 1]")
  out = {f: _numbers(p, f, n) for f, n in (("value_range", 2), ("mean", p.channels),
                                          ("std", p.channels))}
  if (out["mean"] is None) != (out["std"] is None):
    missing = "std" if out["std"] is None else "mean"
    raise _invalid(missing, None, f"mean and std go together: give {missing} too")
  if out["std"] is not None and min(out["std"]) <= 0:
    raise _invalid("std", p.std, "every channel's std must be > 0")
  if out["mean"] is not None and out["value_range"] is not None:
    raise _invalid("value_range", p.value_range,
                   "give a value range or mean and std, not both (mean and std: leave it None)")
  if out["value_range"] is not None and not out["value_range"][0] < out["value_range"][1]:
    raise _invalid("value_range", p.value_range, "must be a pair (low, high) with low < high")
  if out["mean"] is None and out["value_range"] is None:
    out["value_range"] = data_config.DEFAULT_VALUE_RANGE
  return {**out, "central_crop_fraction": float(p.central_crop_fraction)}
