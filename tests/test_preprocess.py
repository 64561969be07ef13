"""data/preprocess.py: the random ops stateless and shape-keeping, mixup as big_vision mixes, the
central crop in big_vision's rounding (timm's: test_timm_eval_transform.py)."""
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import preprocess as pp


def test_random_ops_are_stateless_and_keep_shapes():
  images = tf.random.stateless_uniform([4, 10, 12, 1], [0, 1], maxval=255)
  rng = tf.constant([3, 4], tf.int64)
  for op in (lambda x, r: pp.random_crop(x, r, 2), pp.random_flip,
             lambda x, r: pp.inception_crop(x, r, 8)):
    np.testing.assert_array_equal(op(images, rng), op(images, rng))
  assert pp.random_crop(images, rng, 2).shape == (4, 10, 12, 1)
  assert pp.inception_crop(images, rng, 8).shape == (4, 8, 8, 1)
  # A shift never invents pixels: each crop is a window of the padded image.
  shifted = pp.random_crop(images, rng, 2).numpy()
  padded = np.pad(images.numpy(), [(0, 0), (2, 2), (2, 2), (0, 0)])
  for crop, full in zip(shifted, padded):
    assert any(np.array_equal(crop, full[y:y + 10, x:x + 12])
               for y in range(5) for x in range(5))
  assert pp.central_crop(tf.zeros([9, 7, 3]), 5).shape == (5, 5, 3)
  np.testing.assert_allclose(pp.value_range(tf.constant([0., 255.]), -1, 1), [-1, 1])


def test_mixup_targets_sum_to_one():
  batch = {"image": tf.random.stateless_uniform([8, 4, 4, 3], [0, 0]),
           "label": tf.range(8) % 3}
  mixed = pp.mixup(batch, tf.constant([1, 2], tf.int64), alpha=0.2, num_classes=3)
  assert mixed["label"].shape == (8, 3)
  np.testing.assert_allclose(tf.reduce_sum(mixed["label"], -1), 1, rtol=1e-6)


def test_mixup_keeps_the_larger_share_as_big_vision():
  """image_i = r x_i + (1 - r) x_{i-1} with r = max(b, 1 - b), b ~ Beta(p, p)."""
  labels = tf.range(8)  # Distinct classes: the label rows show r.
  batch = {"image": tf.cast(tf.reshape(tf.range(8), [8, 1, 1, 1]), tf.float32) *
           tf.ones([8, 2, 2, 3]), "label": labels}
  ratios = []
  for seed in range(20):
    mixed = pp.mixup(batch, tf.constant([seed, 0], tf.int64), alpha=0.5, num_classes=8)
    own = tf.gather(mixed["label"], labels, batch_dims=1).numpy()
    np.testing.assert_allclose(own, own[0], rtol=1e-6)  # One ratio for the batch.
    expected = own[0] * np.arange(8) + (1 - own[0]) * np.roll(np.arange(8), 1)
    np.testing.assert_allclose(mixed["image"][:, 0, 0, 0], expected, rtol=1e-5)
    ratios.append(own[0])
  assert min(ratios) >= 0.5 and max(ratios) < 1


def _big_vision_central_crop(image: np.ndarray, size: int, fraction: float) -> np.ndarray:
  """big_vision's `resize_small(round(size / fraction))|central_crop(size)`, written from its
  ops: both sides scaled and rounded, the crop's offsets rounded down."""
  short = round(size / fraction)
  h, w = image.shape[:2]
  new = [round(h * short / min(h, w)), round(w * short / min(h, w))]
  resized = tf.image.resize(image, new, "bilinear", antialias=True).numpy()
  top, left = (new[0] - size) // 2, (new[1] - size) // 2
  return resized[top:top + size, left:left + size]


@pytest.mark.parametrize("hw", [(333, 517), (517, 333), (97, 301), (225, 226)])
@pytest.mark.parametrize("size,fraction", [(224, 0.875), (384, 0.875), (97, 0.9)])
def test_the_big_vision_geometry_is_its_resize_small_and_central_crop(hw, size, fraction):
  """A checkpoint of the official code, AugReg or a vit_jax run (geometry "big_vision", the
  default) is evaluated as big_vision cut it; each pixel's own value shows a shift."""
  image = np.arange(hw[0] * hw[1] * 3, dtype=np.float32).reshape(hw + (3,)) % 251
  pre = pp.Preprocessing(value_range=(-1, 1), crop="central_crop",
                         central_crop_fraction=fraction)
  got = pp.fit(tf.constant(image), size, pre).numpy()
  np.testing.assert_array_equal(got, _big_vision_central_crop(image, size, fraction))
