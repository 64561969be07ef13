"""RandAugment: each op against its definition (PIL's where PIL has it), the level mapping
of big_vision's TF code, and the batched, stateless policy."""
import math

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image, ImageEnhance, ImageOps

from vit_jax.data import config as data_config
from vit_jax.data import randaugment as ra


def _images(shape=(6, 17, 23, 3)) -> np.ndarray:
  """Noise, a low-contrast image, a flat channel and a narrow histogram: the edge cases."""
  rs = np.random.RandomState(0)
  images = rs.randint(0, 256, shape).astype(np.uint8)
  images[1] = images[1] // 4 + 60
  images[2, ..., 1] = 77
  images[3] = np.clip(rs.normal(128, 20, images[3].shape), 0, 255).astype(np.uint8)
  images[4] = 200
  return images


def _pil(fn, images):
  return np.stack([np.asarray(fn(Image.fromarray(x))) for x in images])


_ENHANCE = {"color": ImageEnhance.Color, "contrast": ImageEnhance.Contrast,
            "brightness": ImageEnhance.Brightness, "sharpness": ImageEnhance.Sharpness}


@pytest.mark.parametrize("name", sorted(_ENHANCE))
@pytest.mark.parametrize("factor", [0.0, 0.1, 0.5, 1.0, 1.9, 3.7])
def test_enhance_ops_equal_pil(name, factor):
  images = _images()
  expected = _pil(lambda im: _ENHANCE[name](im).enhance(factor), images)
  np.testing.assert_array_equal(getattr(ra, name)(images, factor), expected)


@pytest.mark.parametrize("op,reference", [
    (ra.autocontrast, ImageOps.autocontrast),
    (ra.equalize, ImageOps.equalize),
    (ra.invert, ImageOps.invert),
    *[(lambda x, b=b: ra.posterize(x, b), lambda im, b=b: ImageOps.posterize(im, b))
      for b in (1, 2, 4, 8)],
    *[(lambda x, t=t: ra.solarize(x, t), lambda im, t=t: ImageOps.solarize(im, t))
      for t in (0, 1, 128, 255, 256)],
], ids=["autocontrast", "equalize", "invert", *[f"posterize{b}" for b in (1, 2, 4, 8)],
        *[f"solarize{t}" for t in (0, 1, 128, 255, 256)]])
def test_pixel_ops_equal_pil(op, reference):
  images = _images()
  np.testing.assert_array_equal(op(images), _pil(reference, images))


def test_grayscale_equals_pil():
  images = _images()
  np.testing.assert_array_equal(ra.grayscale(images)[..., 0],
                                _pil(lambda im: im.convert("L"), images))


def test_per_example_arguments():
  images = _images()
  factors = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0], np.float32)
  expected = [np.asarray(ImageEnhance.Color(Image.fromarray(x)).enhance(float(f)))
              for x, f in zip(images, factors)]
  np.testing.assert_array_equal(ra.color(images, factors), np.stack(expected))


def test_solarize_add_and_cutout_match_their_definitions():
  images = _images()
  values = images.astype(int)
  expected = np.where(values < 128, np.clip(values + 110, 0, 255), values)
  np.testing.assert_array_equal(ra.solarize_add(images, 110), expected)

  centers = np.array([[0, 0], [5, 7], [16, 22], [8, 11], [3, 20], [10, 1]])
  out = ra.cutout(images, centers, 4).numpy()
  for image, result, (cy, cx) in zip(images, out, centers):
    mask = np.zeros(image.shape[:2], bool)
    mask[max(cy - 4, 0):cy + 4, max(cx - 4, 0):cx + 4] = True
    np.testing.assert_array_equal(result[mask], 128)
    np.testing.assert_array_equal(result[~mask], image[~mask])


def _projective(image, a, fill=128):
  """Output (x, y) takes input (round(a0 x + a1 y + a2), round(a3 x + a4 y + a5)), else fill;
  round half away from zero, as TF's nearest-neighbour kernel."""
  h, w, _ = image.shape
  out = np.full_like(image, fill)
  rnd = lambda v: int(math.copysign(math.floor(abs(v) + 0.5), v))
  for y in range(h):
    for x in range(w):
      xi, yi = rnd(a[0] * x + a[1] * y + a[2]), rnd(a[3] * x + a[4] * y + a[5])
      if 0 <= xi < w and 0 <= yi < h:
        out[y, x] = image[yi, xi]
  return out


def _rotation(degrees, h, w):
  r = math.radians(degrees)
  c, s = math.cos(r), math.sin(r)
  return [c, -s, ((w - 1) - (c * (w - 1) - s * (h - 1))) / 2,
          s, c, ((h - 1) - (s * (w - 1) + c * (h - 1))) / 2]


@pytest.mark.parametrize("op,scale,matrix", [
    (ra.shear_x, 1, lambda a, h, w: [1, a, 0, 0, 1, 0]),
    (ra.shear_y, 1, lambda a, h, w: [1, 0, 0, a, 1, 0]),
    (ra.translate_x, 10, lambda a, h, w: [1, 0, a, 0, 1, 0]),
    (ra.translate_y, 10, lambda a, h, w: [1, 0, 0, 0, 1, a]),
    (ra.rotate, 100, _rotation),
], ids=["shear_x", "shear_y", "translate_x", "translate_y", "rotate"])
def test_geometric_ops_match_their_definitions(op, scale, matrix):
  images = _images()
  args = np.array([-0.45, 0.3, 0.2, 0.9, 0.0, -0.15], np.float32) * scale
  expected = [_projective(x, [np.float32(v) for v in matrix(a, *x.shape[:2])])
              for x, a in zip(images, args)]
  np.testing.assert_array_equal(op(images, args), np.stack(expected))


def test_rotation_is_counter_clockwise_about_the_centre():
  images = _images((6, 9, 9, 3))
  np.testing.assert_array_equal(ra.rotate(images, 90.0), np.rot90(images, 1, axes=(1, 2)))


@pytest.mark.parametrize("name", sorted(ra.OPS))
def test_every_op_keeps_shape_and_dtype_and_takes_empty_groups(name):
  rng = tf.constant([1, 2], tf.int64)
  for images in (_images(), np.zeros((0, 17, 23, 3), np.uint8)):
    out = ra.OPS[name](tf.constant(images), 1.5, rng)
    assert out.shape == images.shape and out.dtype == tf.uint8


def _op(name, images, magnitude, rng=(1, 2)):
  return ra.OPS[name](tf.constant(images), magnitude / ra.MAX_LEVEL,
                      tf.constant(rng, tf.int64)).numpy()


def test_levels_map_to_the_tf_codes_arguments():
  images = _images()
  for magnitude, factor in ((0, 0.1), (10, 1.9), (20, 3.7)):
    np.testing.assert_array_equal(_op("Brightness", images, magnitude),
                                  ra.brightness(images, factor))
  np.testing.assert_array_equal(_op("Posterize", images, 10), ra.posterize(images, 4))
  np.testing.assert_array_equal(_op("Posterize", images, 0), ra.posterize(images, 1))
  np.testing.assert_array_equal(_op("Posterize", images, 30), images)
  np.testing.assert_array_equal(_op("Solarize", images, 0), 255 - images)
  np.testing.assert_array_equal(_op("Solarize", images, 10), images)
  np.testing.assert_array_equal(_op("SolarizeAdd", images, 5), ra.solarize_add(images, 55))
  # Signed ops: each example gets +arg or -arg, both occur.
  big = np.tile(_images()[:1], [32, 1, 1, 1])
  for name, fn, arg in (("Rotate", ra.rotate, 30.0), ("ShearX", ra.shear_x, 0.3),
                        ("TranslateY", ra.translate_y, 100 * 17 / 224)):
    out = _op(name, big, 10)
    plus, minus = fn(big[:1], arg).numpy()[0], fn(big[:1], -arg).numpy()[0]
    signs = [np.array_equal(o, plus) - np.array_equal(o, minus) for o in out]
    assert set(signs) == {1, -1}, name


def test_translation_and_cutout_scale_with_the_image_side():
  side224 = np.full((1, 224, 224, 3), 50, np.uint8)
  side224[:, :, :, 0] = np.arange(224)[None, :]
  out = _op("TranslateX", side224, 10)
  shifted = [ra.translate_x(side224, s * 100.0).numpy() for s in (1, -1)]
  assert any(np.array_equal(out, s) for s in shifted)
  for side, pad in ((224, 40), (112, 20)):  # Greys 2 pad x 2 pad, clipped at the border.
    grey = _op("Cutout", np.zeros((16, side, side, 3), np.uint8), 10)[..., 0] == 128
    for extent in (grey.any(axis=1).sum(axis=1), grey.any(axis=2).sum(axis=1)):
      assert (pad <= extent).all() and (extent <= 2 * pad).all(), (side, extent)


def test_randaugment_is_stateless_and_routes_every_example_through_one_op(monkeypatch):
  images = _images((64, 8, 8, 3))
  rng = tf.constant([5, 6], tf.int64)
  a = ra.randaugment(images, rng, 2, 15.0)
  np.testing.assert_array_equal(a, ra.randaugment(images, rng, 2, 15.0))
  assert not np.array_equal(a, ra.randaugment(images, tf.constant([5, 7], tf.int64), 2, 15.0))
  assert a.dtype == tf.uint8 and a.shape == images.shape
  np.testing.assert_array_equal(ra.randaugment(images.astype(np.float32), rng, 0, 15.0), images)

  monkeypatch.setitem(ra.POLICIES, "test", ("Identity", "Invert"))
  out = ra.randaugment(images, rng, 1, 10.0, "test").numpy()
  inverted = [np.array_equal(o, 255 - x) for o, x in zip(out, images)]
  kept = [np.array_equal(o, x) for o, x in zip(out, images)]
  assert all(i != k for i, k in zip(inverted, kept))  # Exactly one op, in place.
  assert 10 < sum(inverted) < 54  # Both drawn (a fixed seed: this does not flake).


def test_policies_and_config_agree():
  assert set(ra.POLICIES) == set(data_config.RANDAUG_POLICIES)
  assert len(ra.POLICIES["augreg"]) == 16 and len(ra.POLICIES["paper"]) == 14
  assert all(name in ra.OPS for ops in ra.POLICIES.values() for name in ops)
