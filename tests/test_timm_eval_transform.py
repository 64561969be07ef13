"""The evaluation's fit to the model's resolution (`preprocess.fit`, with the Preprocessing a
timm checkpoint's description gets from its pretrained_cfg) against timm's own eval transform
(`timm.data.create_transform` of `resolve_data_config(pretrained_cfg)`) for each crop_mode and
crop_pct, on odd image sizes: the same resized sizes, crop offsets and padding exactly, and
the same pixels within what the two resize kernels (TensorFlow's, PIL's) leave."""
import math

import numpy as np
import pytest
import tensorflow as tf

from vit_jax.checkpoint.layouts import repo_config
from vit_jax.data import preprocess as pp
from vit_jax.models import timm_models

torch, timm = timm_models.import_torch()
from PIL import Image  # noqa: E402
from timm.data import create_transform, resolve_data_config  # noqa: E402
from timm.data.transforms import CenterCropOrPad, ResizeKeepRatio  # noqa: E402
from torchvision import transforms  # noqa: E402

SIZE = 224
IMAGE_SIZES = [(333, 517), (517, 333), (225, 225), (97, 301)]
CROP_PCTS = [0.875, 0.9, 0.95, 1.0]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _hw(image: tf.Tensor) -> tuple[int, int]:
  return tuple(image.shape[:2])


def _pil_hw(image: Image.Image) -> tuple[int, int]:
  return image.height, image.width


@pytest.mark.parametrize("hw", IMAGE_SIZES)
def test_resized_sizes_are_torchvisions_and_timms(hw):
  blank = np.zeros((*hw, 3), np.uint8)
  for crop_pct in CROP_PCTS:
    scale = math.floor(SIZE / crop_pct)  # timm's scale_size.
    pil = Image.fromarray(blank)
    assert _hw(pp.resize_shorter_side(blank, scale)) == _pil_hw(transforms.Resize(scale)(pil))
    assert _hw(pp.resize(blank, scale)) == _pil_hw(transforms.Resize((scale, scale))(pil))
    longest = ResizeKeepRatio(scale, longest=1.0)
    assert _hw(pp.resize_longer_side(blank, scale)) == _pil_hw(longest(pil))


@pytest.mark.parametrize("hw", [(256, 301), (235, 248), (225, 225), (224, 231), (164, 256)])
def test_crop_offsets_and_padding_are_torchvisions_and_timms(hw):
  """Each pixel its own value: a window off by one pixel, or padding on the wrong side, shows."""
  image = tf.reshape(tf.range(hw[0] * hw[1] * 3, dtype=tf.float32), (*hw, 3))
  chw = torch.from_numpy(image.numpy()).permute(2, 0, 1)
  fill = (124, 116, 104)
  # One channel at a time: a tensor's padding takes one fill value.
  padded = np.concatenate([CenterCropOrPad(SIZE, fill=f)(chw[c:c + 1]).permute(1, 2, 0).numpy()
                           for c, f in enumerate(fill)], axis=-1)
  np.testing.assert_array_equal(pp.central_crop(pp.pad_to(image, SIZE, fill), SIZE), padded)
  if min(hw) >= SIZE:
    cropped = transforms.CenterCrop(SIZE)(chw).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(pp.central_crop(image, SIZE), cropped)


def _timm_pixels(image: np.ndarray, cfg: dict) -> np.ndarray:
  """timm's eval transform of `image`, before its tensor conversion: uint8 pixels as PIL
  resizes, crops and pads them."""
  steps = create_transform(**resolve_data_config(pretrained_cfg=cfg), is_training=False)
  pil = Image.fromarray(image)
  for step in steps.transforms[:-2]:  # Less MaybeToTensor and Normalize.
    pil = step(pil)
  return np.asarray(pil, np.float32)


# Bilinear on noise: PIL rounds to uint8 (0.5) and computes in fixed point; a pixel's shift in
# the geometry would be off by tens. Bicubic on a smooth image: on noise PIL's uint8 clip
# between its horizontal and vertical passes moves the overshoot by up to 24 levels.
TOLERANCE = {"bilinear": 1.01, "bicubic": 1.25}


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("crop_mode", ["center", "squash", "border", None])
def test_eval_pixels_are_timms(crop_mode, interpolation):
  """None: crop_mode or crop_pct left out of the pretrained_cfg, timm's defaults."""
  rng = np.random.default_rng(0)
  for h, w in IMAGE_SIZES:
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if interpolation == "bicubic":  # Smooth: noise 8x enlarged.
      coarse = rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
      image = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR))
    for crop_pct in CROP_PCTS + [None]:
      cfg = dict(input_size=(3, SIZE, SIZE), crop_pct=crop_pct, crop_mode=crop_mode,
                 interpolation=interpolation, mean=MEAN, std=STD)
      cfg = {k: v for k, v in cfg.items() if v is not None}
      preprocessing = repo_config.timm_preprocessing({"pretrained_cfg": cfg})
      ours = pp.apply_preprocessing(tf.constant(image), preprocessing, SIZE, normalise=False)
      np.testing.assert_allclose(ours, _timm_pixels(image, cfg), rtol=0,
                                 atol=TOLERANCE[interpolation], err_msg=f"{(h, w)} {crop_pct}")
