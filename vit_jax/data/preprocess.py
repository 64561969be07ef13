"""Preprocessing ops: small TF functions on images, and `apply_preprocessing`, the one
function that applies a checkpoint's `Preprocessing` (input_contract.py) for evaluation and
serving.

Random ops work on a batch [B, H, W, C] of equally sized images (a single
image goes in as a batch of one) and draw every example's randomness from one
stateless seed `rng` (shape [2]): the output depends on nothing else, so a
pipeline that derives `rng` from (seed, step) or (seed, example position) is
deterministic however many threads run it. Batching first matters for small
images, where tf.data's per-example overhead would cost more than the work.
The other ops take one image [H, W, C] or a batch.
"""
import math
from collections.abc import Callable, Sequence

import tensorflow as tf

from vit_jax.data.input_contract import GEOMETRIES, INTERPOLATIONS, Preprocessing  # noqa: F401


def traced(fn: Callable) -> Callable:
  """`fn` for tf.data to trace as written: without AutoGraph's rewrite of its source, which
  these functions do not need (they branch on Python values only) and which costs ~1 s of
  every run's start."""
  return tf.autograph.experimental.do_not_convert(fn)


def decode(data: tf.Tensor, channels: int) -> tf.Tensor:
  """Encoded JPEG/PNG/GIF (its first frame)/BMP/WebP bytes -> uint8 [H, W, channels]."""
  image = tf.io.decode_image(data, channels=channels, expand_animations=False)
  image.set_shape([None, None, channels])
  return image


def resize(images: tf.Tensor, size: int, method: str = "bilinear") -> tf.Tensor:
  """Resizes to size x size (`method`: one of INTERPOLATIONS); returns float32."""
  height_width = tuple(images.shape[-3:-1])
  if height_width == (size, size):
    return tf.cast(images, tf.float32)
  # Antialiasing only matters when shrinking, and costs 4x when enlarging.
  enlarging = None not in height_width and max(height_width) <= size
  return tf.image.resize(images, [size, size], method, antialias=not enlarging)


def resize_shorter_side(images: tf.Tensor, side: int, method: str = "bilinear",
                        truncate: bool = True) -> tf.Tensor:
  """Resizes so that the shorter side is `side` and the longer side side * long / short,
  truncated as torchvision's Resize(side) does, or rounded as big_vision's resize_small."""
  hw = tf.shape(images)[-3:-1]
  if truncate:
    return tf.image.resize(images, hw * side // tf.reduce_min(hw), method, antialias=True)
  hw = tf.cast(hw, tf.float32)
  new_hw = tf.cast(tf.round(hw * (side / tf.reduce_min(hw))), tf.int32)
  return tf.image.resize(images, tf.maximum(new_hw, side), method, antialias=True)


def resize_longer_side(images: tf.Tensor, side: int, method: str = "bilinear") -> tf.Tensor:
  """Resizes so that the longer side is `side`, keeping the aspect ratio, as timm's
  ResizeKeepRatio(longest=1) does: each side / max(h / side, w / side), rounded half to even
  in float64 (Python's round)."""
  hw = tf.cast(tf.shape(images)[-3:-1], tf.float64)
  ratio = tf.reduce_max(hw / side)
  return tf.image.resize(images, tf.cast(tf.round(hw / ratio), tf.int32), method,
                         antialias=True)


def central_crop(images: tf.Tensor, size: int, round_offsets: bool = True) -> tf.Tensor:
  """The central size x size window of images at least that large; an odd margin's offset
  rounded half to even, as torchvision's CenterCrop (int(round(margin / 2))), or down, as
  big_vision's central_crop."""
  margin = tf.shape(images)[-3:-1] - size
  offsets = (tf.cast(tf.round(tf.cast(margin, tf.float32) / 2), tf.int32) if round_offsets
             else margin // 2)
  top, left = tf.unstack(offsets)
  crop = images[..., top:top + size, left:left + size, :]
  crop.set_shape(images.shape[:-3] + (size, size, images.shape[-1]))
  return crop


def pad_to(images: tf.Tensor, size: int, fill: Sequence[float]) -> tf.Tensor:
  """Images smaller than size x size centred on a `fill` background (per channel), the odd
  margin's extra pixel right and below, as timm's CenterCropOrPad pads; larger sides kept."""
  margin = tf.maximum(size - tf.shape(images)[-3:-1], 0)
  paddings = tf.stack([margin // 2, margin - margin // 2], axis=1)
  paddings = tf.pad(paddings, [[len(images.shape) - 3, 1], [0, 0]])  # Batch and channels.
  background = tf.pad(tf.zeros_like(images[..., :1]), paddings, constant_values=1.0)
  return tf.pad(images, paddings) + background * tf.constant(fill, images.dtype)


def inception_crop(images: tf.Tensor, rng: tf.Tensor, size: int,
                   area: Sequence[float] = (0.05, 1.0),
                   aspect: Sequence[float] = (3 / 4, 4 / 3)) -> tf.Tensor:
  """Random crops covering `area` of each image, resized to size x size.

  The "Inception" / random-resized crop (Szegedy et al. 2015), with boxes from
  tf.image's sampler as in big_vision; bilinear, float32 [B, size, size, C].
  """
  image_shape = tf.shape(images)[1:]
  batch = tf.shape(images)[0]

  def box(seed):
    begin, extent, _ = tf.image.stateless_sample_distorted_bounding_box(
        image_shape, tf.zeros([0, 0, 4], tf.float32), seed=seed,
        area_range=area, aspect_ratio_range=aspect, min_object_covered=0,
        use_image_if_no_bounding_boxes=True)
    # crop_and_resize maps coordinate y to pixel y * (H - 1).
    scale = tf.cast(tf.maximum(image_shape[:2] - 1, 1), tf.float32)
    top_left = tf.cast(begin[:2], tf.float32)
    bottom_right = tf.cast(begin[:2] + extent[:2] - 1, tf.float32)
    return tf.concat([top_left / scale, bottom_right / scale], axis=0)

  seeds = tf.random.experimental.stateless_split(rng, batch)
  boxes = tf.map_fn(box, seeds, fn_output_signature=tf.float32)
  return tf.image.crop_and_resize(images, boxes, tf.range(batch), [size, size])


def random_crop(images: tf.Tensor, rng: tf.Tensor, padding: int) -> tf.Tensor:
  """Shifts each image by up to `padding` pixels: zero-pad, crop to H x W."""
  height, width = tf.shape(images)[1], tf.shape(images)[2]
  images = tf.pad(images, [[0, 0], [padding, padding], [padding, padding],
                           [0, 0]])
  offsets = tf.cast(
      tf.random.stateless_uniform([tf.shape(images)[0], 2], rng) *
      (2 * padding + 1), tf.int32)
  rows = offsets[:, :1] + tf.range(height)
  cols = offsets[:, 1:] + tf.range(width)
  images = tf.gather(images, rows, axis=1, batch_dims=1)
  return tf.gather(images, cols, axis=2, batch_dims=1)


def random_flip(images: tf.Tensor, rng: tf.Tensor) -> tf.Tensor:
  """Flips each image left-right with probability 1/2."""
  flip = tf.random.stateless_uniform([tf.shape(images)[0], 1, 1, 1], rng) < 0.5
  return tf.where(flip, tf.reverse(images, axis=[2]), images)


def gray_to_rgb(images: tf.Tensor) -> tf.Tensor:
  """Repeats a single channel three times; RGB images pass through."""
  return tf.image.grayscale_to_rgb(images) if images.shape[-1] == 1 else images


def value_range(images: tf.Tensor, low: float, high: float,
                in_low: float = 0.0, in_high: float = 255.0) -> tf.Tensor:
  """Maps [in_low, in_high] linearly to [low, high], as float32."""
  images = tf.cast(images, tf.float32)
  return low + (images - in_low) * ((high - low) / (in_high - in_low))


def mixup(batch: dict[str, tf.Tensor], rng: tf.Tensor, alpha: float,
          num_classes: int) -> dict[str, tf.Tensor]:
  """Mixes each example with its neighbour in the batch (Zhang et al. 2018).

  As big_vision's `get_mixup(rng, p)`, which AugReg used with alpha = p: one
  r ~ Beta(alpha, alpha) for the batch, folded to r = max(r, 1 - r) so that
  every example keeps the larger share of itself, image = r*x_i + (1-r)*x_{i-1},
  and `label` becomes the same mix of one-hot vectors (rows sum to one). Every
  batch is mixed: p is the Beta concentration, not a probability.
  """
  # Beta(a, a) as G1 / (G1 + G2) with Gi ~ Gamma(a); float64 so that small
  # alphas don't underflow both draws to 0.
  g = tf.random.stateless_gamma([2], seed=rng, alpha=alpha, dtype=tf.float64)
  total = g[0] + g[1]
  ratio = tf.where(total > 0, g[0] / total, 0.5)
  ratio = tf.cast(tf.maximum(ratio, 1 - ratio), tf.float32)
  labels = tf.one_hot(batch["label"], num_classes, dtype=tf.float32)
  mix = lambda x: ratio * x + (1 - ratio) * tf.roll(x, shift=1, axis=0)
  return {**batch, "image": mix(batch["image"]), "label": mix(labels)}


def fit(images: tf.Tensor, size: int, preprocessing: Preprocessing) -> tf.Tensor:
  """One image [H, W, C] or a batch at size x size as `preprocessing.crop` fits it, with its
  interpolation, in the rounding of its `geometry` (input_contract.GEOMETRIES; "torchvision":
  timm's `transforms_imagenet_eval` exactly): 'resize' to size x size;
  else resized to scale = size / central_crop_fraction ('central_crop': the shorter
  side; 'squash_central_crop': both sides; 'letterbox_central_crop': the longer side, the
  shorter padded to size with `_letterbox_fill`), then the centre cut out. float32 in
  [0, 255]: bicubic's overshoot is clipped, as timm's PIL images and `serving.images`' uint8
  ones are."""
  method, crop = preprocessing.interpolation, preprocessing.crop
  truncate, round_offsets = GEOMETRIES[preprocessing.geometry]
  if crop == "resize":
    images = resize(images, size, method)
  else:
    scale = (math.floor if truncate else round)(size / preprocessing.central_crop_fraction)
    if crop == "central_crop":
      images = resize_shorter_side(images, scale, method, truncate=truncate)
    elif crop == "squash_central_crop":
      images = resize(images, scale, method)
    else:
      images = pad_to(resize_longer_side(images, scale, method), size,
                      _letterbox_fill(preprocessing))
    images = central_crop(images, size, round_offsets=round_offsets)
  return tf.clip_by_value(images, 0.0, 255.0) if method == "bicubic" else images


def _letterbox_fill(preprocessing: Preprocessing) -> tuple[int, ...]:
  """The pixel 'letterbox_central_crop' pads with: the one the model sees as (about) zero,
  round(255 * mean) per channel as timm fills, or the one the value range maps to 0."""
  if preprocessing.mean is not None:
    return tuple(round(255 * m) for m in preprocessing.mean)
  low, high = preprocessing.value_range
  return (round(255 * -low / (high - low)),) * preprocessing.channels


def affine_map(images: tf.Tensor, preprocessing: Preprocessing) -> tf.Tensor:
  """RGB pixels in [0, 255] -> the model's input, per channel images * scale + offset
  (Preprocessing.affine); float32."""
  scale, offset = preprocessing.affine()
  return (tf.cast(images, tf.float32) * tf.constant(scale, tf.float32)
          + tf.constant(offset, tf.float32))


def apply_preprocessing(images: tf.Tensor, preprocessing: Preprocessing,
                        size: int | None = None, *, normalise: bool = True) -> tf.Tensor:
  """The model's input from decoded images (uint8, one [H, W, C] or a batch), as
  `preprocessing` says: the one function evaluation, serving and the notebooks apply.

  Grayscale to RGB; `size`: fitted to size x size (`fit`), None: images already at the model's
  resolution (the serving signature's input); then the affine map. Without
  `normalise`, float32 pixels in [0, 255] (to be stored as uint8, as `serving.images` does).
  """
  images = gray_to_rgb(images)  # First: a letterbox is padded in colour.
  if size is not None:
    images = fit(images, size, preprocessing)
  return affine_map(images, preprocessing) if normalise else tf.cast(images, tf.float32)
