"""RandAugment (Cubuk et al. 2020) on batches, with stateless randomness.

`randaugment(images, rng, num_layers, magnitude)` is big_vision's `randaug(N, M)`,
the op AugReg (Steiner et al. 2021) trained with: every image gets `num_layers`
ops, each drawn uniformly from the policy and applied at the shared `magnitude`.
Magnitudes use that code's scale (pp/autoaugment.py, forked from the TPU
EfficientNet code): 10 is its `_MAX_LEVEL`, the paper's values reach 30.

Policies: "augreg" is that code's 16 ops (no Identity; Invert, Cutout and
SolarizeAdd added to the paper's list), "paper" the 14 ops of Cubuk et al.

Each op is defined as PIL's (ImageOps / ImageEnhance) where PIL has it, and
the level -> argument mapping is the TF code's, including its quirks: the
enhance factors are 0.1 + 1.8 * M / 10 (never below 1 for M >= 5), Solarize's
threshold is 256 * M / 10 (a no-op from M = 10 on), Posterize keeps 4 * M / 10
bits (at least 1, as TF's clamped shifts give). Two deviations: translations
(100 px at M = 10) and Cutout (40 px) scale with the image side, so they are
the TF code's at 224 px, where AugReg trained; and Contrast blends towards the
mean grey level, as PIL does, where the TF code uses pixel count / 256 (a bug).

Ops work on uint8 [B, H, W, 3]; each example's randomness comes from one
stateless seed, so the result depends only on (images, rng).
"""
from collections.abc import Callable
import math

import tensorflow as tf

MAX_LEVEL = 10.0
_REFERENCE_SIDE = 224  # Image side at which the TF code's pixel sizes hold.
_FILL = 128  # Grey for pixels that geometric ops and Cutout uncover.


def _per_example(value, images: tf.Tensor, dtype=tf.float32) -> tf.Tensor:
  """A scalar or [B] argument as [B, 1, 1, 1] for broadcasting."""
  value = tf.cast(value, dtype) * tf.ones([tf.shape(images)[0]], dtype)
  return value[:, None, None, None]


def _to_uint8(x: tf.Tensor) -> tf.Tensor:
  return tf.cast(tf.clip_by_value(x, 0, 255), tf.uint8)


def _select(condition: tf.Tensor, a, b: tf.Tensor) -> tf.Tensor:
  """tf.where(condition, a, b) for uint8 b by arithmetic, 3-5x faster on CPU than
  SelectV2 or than broadcasting inside the arithmetic."""
  keep = tf.broadcast_to(tf.cast(condition, tf.uint8), tf.shape(b))
  return a * keep + b * (1 - keep)


def grayscale(images: tf.Tensor) -> tf.Tensor:
  """PIL's convert("L"): (19595 R + 38470 G + 7471 B + 2**15) >> 16, as int32 [B, H, W, 1]."""
  rgb = tf.cast(images, tf.int32)
  weighted = rgb[..., :1] * 19595 + rgb[..., 1:2] * 38470 + rgb[..., 2:] * 7471
  return tf.bitwise.right_shift(weighted + 2**15, 16)


def blend(degenerate: tf.Tensor, images: tf.Tensor, factor) -> tf.Tensor:
  """PIL's Image.blend(degenerate, images, factor): truncated and clipped to uint8."""
  degenerate = tf.cast(degenerate, tf.float32)
  out = degenerate + _per_example(factor, images) * (tf.cast(images, tf.float32) - degenerate)
  return _to_uint8(out)


def color(images: tf.Tensor, factor) -> tf.Tensor:
  """ImageEnhance.Color: blends with the grey version; 0 gives grey, 1 the image."""
  return blend(tf.broadcast_to(grayscale(images), tf.shape(images)), images, factor)


def contrast(images: tf.Tensor, factor) -> tf.Tensor:
  """ImageEnhance.Contrast: blends with the image's mean grey level (rounded)."""
  mean = tf.reduce_mean(tf.cast(grayscale(images), tf.float64), axis=[1, 2, 3], keepdims=True)
  degenerate = tf.floor(mean + 0.5) * tf.ones_like(images, tf.float64)
  return blend(degenerate, images, factor)


def brightness(images: tf.Tensor, factor) -> tf.Tensor:
  """ImageEnhance.Brightness: blends with black."""
  return blend(tf.zeros_like(images), images, factor)


def sharpness(images: tf.Tensor, factor) -> tf.Tensor:
  """ImageEnhance.Sharpness: blends with ImageFilter.SMOOTH (the border stays)."""
  kernel = tf.constant([[1., 1., 1.], [1., 5., 1.], [1., 1., 1.]]) / 13.
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, images.shape[-1], 1])
  smooth = tf.nn.depthwise_conv2d(tf.cast(images, tf.float32), kernel, [1] * 4, "SAME")
  smooth = _to_uint8(tf.floor(smooth + 0.5))
  h, w = tf.shape(images)[1], tf.shape(images)[2]
  inside = tf.pad(tf.ones([h - 2, w - 2, 1], tf.bool), [[1, 1], [1, 1], [0, 0]])
  return blend(_select(inside, smooth, images), images, factor)


def _channel_luts(images: tf.Tensor, lut_fn) -> tf.Tensor:
  """Maps each (image, channel) through its own 256-entry table lut_fn(histograms),
  histograms and tables being [B * C, 256]."""
  b, c = tf.shape(images)[0], tf.shape(images)[3]
  # Value v of channel j of image i counts in bin (i * C + j) * 256 + v.
  offsets = tf.reshape(tf.range(b * c) * 256, [b, 1, 1, c])
  bins = tf.cast(images, tf.int32) + offsets
  hist = tf.math.bincount(tf.reshape(bins, [-1]), minlength=b * c * 256,
                          maxlength=b * c * 256)
  lut = lut_fn(tf.reshape(hist, [b * c, 256]))
  return tf.cast(tf.gather(tf.reshape(lut, [-1]), bins), tf.uint8)


def autocontrast(images: tf.Tensor) -> tf.Tensor:
  """ImageOps.autocontrast: stretches each channel to [0, 255]; flat channels stay."""
  def lut(hist):
    seen = hist > 0
    lo = tf.argmax(seen, axis=1, output_type=tf.int32)[:, None]
    hi = 255 - tf.argmax(tf.reverse(seen, [1]), axis=1, output_type=tf.int32)[:, None]
    scale = 255.0 / tf.cast(tf.maximum(hi - lo, 1), tf.float64)
    # PIL's float64 arithmetic, truncated (the exact quotient differs in 0.4% of entries).
    values = tf.range(256, dtype=tf.float64)[None]
    stretched = tf.cast(values * scale - tf.cast(lo, tf.float64) * scale, tf.int32)
    return tf.where(hi > lo, tf.clip_by_value(stretched, 0, 255), tf.range(256)[None])
  return _channel_luts(images, lut)


def equalize(images: tf.Tensor) -> tf.Tensor:
  """ImageOps.equalize: each channel's histogram made flat."""
  def lut(hist):
    last = tf.gather(hist, 255 - tf.argmax(tf.reverse(hist > 0, [1]), axis=1), batch_dims=1)
    step = ((tf.reduce_sum(hist, axis=1) - last) // 255)[:, None]
    below = tf.cumsum(hist, axis=1, exclusive=True)
    table = (step // 2 + below) // tf.maximum(step, 1)
    return tf.where(step > 0, tf.clip_by_value(table, 0, 255), tf.range(256)[None])
  return _channel_luts(images, lut)


def invert(images: tf.Tensor) -> tf.Tensor:
  return 255 - images


def posterize(images: tf.Tensor, bits) -> tf.Tensor:
  """ImageOps.posterize: keeps the `bits` (1..8) highest bits of each value."""
  mask = 256 - tf.bitwise.left_shift(1, 8 - _per_example(bits, images, tf.int32))
  return tf.cast(tf.bitwise.bitwise_and(tf.cast(images, tf.int32), mask), tf.uint8)


def solarize(images: tf.Tensor, threshold) -> tf.Tensor:
  """ImageOps.solarize: inverts the values >= threshold."""
  keep = tf.cast(images, tf.int32) < _per_example(threshold, images, tf.int32)
  return _select(keep, images, 255 - images)


def solarize_add(images: tf.Tensor, addition, threshold=128) -> tf.Tensor:
  """The TF code's SolarizeAdd: adds `addition` (clipped) to the values < threshold."""
  values = tf.cast(images, tf.int32)
  added = _to_uint8(values + _per_example(addition, images, tf.int32))
  return _select(values < _per_example(threshold, images, tf.int32), added, images)


def _transform(images: tf.Tensor, rows: list[tf.Tensor]) -> tf.Tensor:
  """Output pixel (x, y) takes input pixel round(a0 x + a1 y + a2, a3 x + a4 y + a5);
  grey where that is outside the image. `rows` are the six [B] coefficients."""
  b = tf.shape(images)[0]
  coefficients = [tf.cast(r, tf.float32) * tf.ones([b]) for r in rows] + [tf.zeros([b])] * 2
  return tf.raw_ops.ImageProjectiveTransformV3(
      images=images, transforms=tf.stack(coefficients, axis=1),
      output_shape=tf.shape(images)[1:3], fill_value=float(_FILL),
      interpolation="NEAREST", fill_mode="CONSTANT")


def rotate(images: tf.Tensor, degrees) -> tf.Tensor:
  """Rotates counter-clockwise by `degrees` about the image centre."""
  radians = tf.cast(degrees, tf.float32) * (math.pi / 180)
  cos, sin = tf.cos(radians), tf.sin(radians)
  h, w = (tf.cast(tf.shape(images)[i] - 1, tf.float32) for i in (1, 2))
  x_offset = (w - (cos * w - sin * h)) / 2
  y_offset = (h - (sin * w + cos * h)) / 2
  return _transform(images, [cos, -sin, x_offset, sin, cos, y_offset])


def shear_x(images: tf.Tensor, level) -> tf.Tensor:
  """PIL's affine (1, level, 0, 0, 1, 0): x_in = x + level * y."""
  return _transform(images, [1., level, 0., 0., 1., 0.])


def shear_y(images: tf.Tensor, level) -> tf.Tensor:
  return _transform(images, [1., 0., 0., level, 1., 0.])


def translate_x(images: tf.Tensor, pixels) -> tf.Tensor:
  """Moves the content `pixels` to the left (PIL's affine (1, 0, pixels, 0, 1, 0))."""
  return _transform(images, [1., 0., pixels, 0., 1., 0.])


def translate_y(images: tf.Tensor, pixels) -> tf.Tensor:
  return _transform(images, [1., 0., 0., 0., 1., pixels])


def cutout(images: tf.Tensor, centers: tf.Tensor, pad_size) -> tf.Tensor:
  """Greys rows [cy - pad, cy + pad) x columns [cx - pad, cx + pad) (clipped) around
  each image's centers[i] = (cy, cx)."""
  pad = _per_example(pad_size, images, tf.int32)
  cy, cx = (tf.cast(centers[:, i], tf.int32)[:, None, None, None] for i in (0, 1))
  y = tf.range(tf.shape(images)[1])[None, :, None, None]
  x = tf.range(tf.shape(images)[2])[None, None, :, None]
  inside = (y >= cy - pad) & (y < cy + pad) & (x >= cx - pad) & (x < cx + pad)
  return _select(inside, tf.constant(_FILL, tf.uint8), images)


def _random_sign(rng: tf.Tensor, images: tf.Tensor) -> tf.Tensor:
  return tf.where(tf.random.stateless_uniform([tf.shape(images)[0]], rng) < 0.5, -1.0, 1.0)


def _random_centers(rng: tf.Tensor, images: tf.Tensor) -> tf.Tensor:
  size = tf.cast(tf.shape(images)[1:3], tf.float32)
  return tf.floor(tf.random.stateless_uniform([tf.shape(images)[0], 2], rng) * size)


def _enhance(level: float) -> float:
  return level * 1.8 + 0.1


def _scaled(pixels_at_224: float, side: int) -> float:
  return pixels_at_224 * side / _REFERENCE_SIDE


Op = Callable[[tf.Tensor, float, tf.Tensor], tf.Tensor]  # (images, level, rng) -> images

# Each op at level = magnitude / MAX_LEVEL, with the TF code's mapping to arguments.
OPS: dict[str, Op] = {
    "Identity": lambda x, level, rng: x,
    "AutoContrast": lambda x, level, rng: autocontrast(x),
    "Equalize": lambda x, level, rng: equalize(x),
    "Invert": lambda x, level, rng: invert(x),
    "Rotate": lambda x, level, rng: rotate(x, 30 * level * _random_sign(rng, x)),
    "Posterize": lambda x, level, rng: posterize(x, min(max(int(4 * level), 1), 8)),
    "Solarize": lambda x, level, rng: solarize(x, int(256 * level)),
    "SolarizeAdd": lambda x, level, rng: solarize_add(x, int(110 * level)),
    "Color": lambda x, level, rng: color(x, _enhance(level)),
    "Contrast": lambda x, level, rng: contrast(x, _enhance(level)),
    "Brightness": lambda x, level, rng: brightness(x, _enhance(level)),
    "Sharpness": lambda x, level, rng: sharpness(x, _enhance(level)),
    "ShearX": lambda x, level, rng: shear_x(x, 0.3 * level * _random_sign(rng, x)),
    "ShearY": lambda x, level, rng: shear_y(x, 0.3 * level * _random_sign(rng, x)),
    "TranslateX": lambda x, level, rng: translate_x(
        x, _scaled(100 * level, x.shape[2]) * _random_sign(rng, x)),
    "TranslateY": lambda x, level, rng: translate_y(
        x, _scaled(100 * level, x.shape[1]) * _random_sign(rng, x)),
    "Cutout": lambda x, level, rng: cutout(
        x, _random_centers(rng, x), int(_scaled(40 * level, min(x.shape[1:3])))),
}

POLICIES: dict[str, tuple[str, ...]] = {
    # big_vision's pp/autoaugment.py `distort_image_with_randaugment`, in its order.
    "augreg": ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize",
               "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY",
               "TranslateX", "TranslateY", "Cutout", "SolarizeAdd"),
    # Cubuk et al. 2020, Section 3.
    "paper": ("Identity", "AutoContrast", "Equalize", "Rotate", "Solarize", "Color",
              "Posterize", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY",
              "TranslateX", "TranslateY"),
}


def randaugment(images: tf.Tensor, rng: tf.Tensor, num_layers: int, magnitude: float,
                policy: str = "augreg") -> tf.Tensor:
  """`num_layers` ops of `policy` per image, each drawn uniformly, at `magnitude`.

  images: [B, H, W, 3], values in [0, 255] (rounded to uint8 first). Returns uint8.
  Each layer groups the batch by drawn op and runs every op once on its group.
  """
  ops = POLICIES[policy]
  images = tf.cast(tf.clip_by_value(tf.round(tf.cast(images, tf.float32)), 0, 255), tf.uint8)
  shape, b = images.shape, tf.shape(images)[0]
  level = magnitude / MAX_LEVEL
  for layer in range(num_layers):
    choice_rng, ops_rng = tf.unstack(tf.random.experimental.stateless_split(
        tf.random.experimental.stateless_fold_in(rng, layer), 2))
    choice = tf.random.stateless_uniform([b], choice_rng, 0, len(ops), tf.int32)
    groups = tf.dynamic_partition(images, choice, len(ops))
    positions = tf.dynamic_partition(tf.range(b), choice, len(ops))
    op_rngs = tf.random.experimental.stateless_split(ops_rng, len(ops))
    results = [OPS[name](group, level, op_rngs[i])
               for i, (name, group) in enumerate(zip(ops, groups))]
    images = tf.dynamic_stitch(positions, results)
    images.set_shape(shape)
  return images
