"""Defaults and validation of the `config.data` sub-config."""
import numbers

import ml_collections

TRAIN_CROPS = ("inception", "random_crop", "resize")
EVAL_CROPS = ("resize", "central_crop")
ON_BAD_IMAGE = ("fail", "skip")
RANDAUG_POLICIES = ("augreg", "paper")  # randaugment.POLICIES' keys.
MAX_RANDAUG_MAGNITUDE = 30.0


def get_data_config() -> ml_collections.ConfigDict:
  """Returns the defaults of `config.data` (Fashion-MNIST at its own 28 px)."""
  c = ml_collections.ConfigDict()
  # A TFDS name ('cifar10', 'mnist:3.0.1') or the root of an image folder laid
  # out as root/<split>/<class>/<image>.{jpg,png}.
  c.name = "fashion_mnist"
  c.data_dir = ml_collections.FieldReference(None, field_type=str)  # TFDS data_dir.
  c.download = False  # Let TFDS download and prepare `name` if missing.
  c.train_split = "train"
  c.eval_split = "test"

  c.image_size = 28  # Side of the square images the model sees.
  c.train_crop = "random_crop"  # One of TRAIN_CROPS.
  c.crop_padding = 2  # 'random_crop' shifts the stored image by up to this many px.
  c.inception_area = (0.05, 1.0)  # Fraction of the image an 'inception' crop covers.
  c.flip = True  # Random horizontal flips in training.
  c.eval_crop = "resize"  # One of EVAL_CROPS.
  c.central_crop_fraction = 0.875  # 'central_crop': resize to size/fraction, crop.
  c.value_range = (-1.0, 1.0)
  # Mixup's Beta(alpha, alpha), big_vision's `p`; 0 turns it off, else labels are soft targets.
  c.mixup_alpha = 0.0
  # RandAugment after cropping and flipping: randaug_layers ops per image (0: off) at
  # randaug_magnitude (big_vision's scale, 0-30), from one of randaugment.POLICIES.
  c.randaug_layers = 0
  c.randaug_magnitude = 10.0
  c.randaug_policy = "augreg"

  c.shuffle_buffer = 50_000  # Only for splits streamed from disk.
  c.cache = True  # Keep a process's split in memory if it fits in cache_max_mb.
  c.cache_max_mb = 2048
  # Training streams: each shuffles its own part of the split and fills an equal part
  # of every global batch. Fixed, they make the batches independent of the number of
  # processes (which must divide it); 0: one per process.
  c.num_shards = 0
  c.threads = 0  # tf.data threadpool size; 0: half the CPU cores.
  c.prefetch = 2  # Batches prepared ahead of the training step.
  c.on_bad_image = "fail"  # Image folders: 'fail' or 'skip' undecodable files.
  return c


def _fail(field: str, value, why: str) -> None:
  raise ValueError(f"data.{field}={value!r} {why}")


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first field of `cfg` that is wrong."""
  defaults = get_data_config()
  for key in cfg.keys():
    if key not in defaults:
      raise ValueError(
          f"data.{key} is not a known field; known: {sorted(defaults.keys())}")
  for key in defaults.keys():
    if key not in cfg:
      raise ValueError(f"data.{key} is missing; start from get_data_config()")

  for field, choices in (("train_crop", TRAIN_CROPS), ("eval_crop", EVAL_CROPS),
                         ("on_bad_image", ON_BAD_IMAGE),
                         ("randaug_policy", RANDAUG_POLICIES)):
    if cfg[field] not in choices:
      _fail(field, cfg[field], f"is not one of {choices}")
  for field in ("name", "train_split", "eval_split"):
    if not isinstance(cfg[field], str) or not cfg[field]:
      _fail(field, cfg[field], "must be a non-empty string")
  for field, minimum in (("image_size", 1), ("crop_padding", 0),
                         ("shuffle_buffer", 1), ("cache_max_mb", 0),
                         ("threads", 0), ("prefetch", 0), ("num_shards", 0),
                         ("randaug_layers", 0)):
    value = cfg[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      _fail(field, value, f"must be an integer >= {minimum}")
  for field in ("flip", "cache", "download"):
    if not isinstance(cfg[field], bool):
      _fail(field, cfg[field], "must be True or False")

  def pair(field):
    value = cfg[field]
    if (not isinstance(value, (tuple, list)) or len(value) != 2 or
        not all(isinstance(v, numbers.Real) for v in value) or
        not value[0] < value[1]):
      _fail(field, value, "must be a pair (low, high) with low < high")
    return value

  low, high = pair("inception_area")
  if not (0 < low and high <= 1):
    _fail("inception_area", cfg.inception_area, "must lie in (0, 1]")
  pair("value_range")
  if not 0 < cfg.central_crop_fraction <= 1:
    _fail("central_crop_fraction", cfg.central_crop_fraction, "must be in (0, 1]")
  if not isinstance(cfg.mixup_alpha, numbers.Real) or cfg.mixup_alpha < 0:
    _fail("mixup_alpha", cfg.mixup_alpha, "must be a number >= 0 (0: off)")
  magnitude = cfg.randaug_magnitude
  if (not isinstance(magnitude, numbers.Real) or isinstance(magnitude, bool) or
      not 0 <= magnitude <= MAX_RANDAUG_MAGNITUDE):
    _fail("randaug_magnitude", magnitude,
          f"must be a number in [0, {MAX_RANDAUG_MAGNITUDE:g}] (10: the TF code's max level)")
