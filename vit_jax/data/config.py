"""Defaults and validation of the `config.data` sub-config."""
import numbers
import os

import ml_collections

from vit_jax.config_errors import check, check_known

TRAIN_CROPS = ("inception", "random_crop", "resize")
# How evaluation fits an image to image_size (preprocess.fit): resized to it; or, as timm's
# crop_mode center / squash / border, the shorter side / both sides / the longer side resized
# to image_size / central_crop_fraction, a short side padded (letterbox), the centre cut out,
# rounded as big_vision does (a checkpoint's description may name timm's rounding instead:
# input_contract.GEOMETRIES).
EVAL_CROPS = ("resize", "central_crop", "squash_central_crop", "letterbox_central_crop")
ON_BAD_IMAGE = ("fail", "skip")
RANDAUG_POLICIES = ("augreg", "paper")  # randaugment.POLICIES' keys.
MAX_RANDAUG_MAGNITUDE = 30.0
DEFAULT_VALUE_RANGE = (-1.0, 1.0)  # The official code's and big_vision's.


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
  c.central_crop_fraction = 0.875  # The *central_crop's: resize to size/fraction, crop.
  # What [0, 255] pixels map onto. None: the range config.pretrained's description records
  # (a fine-tuned model sees what it was trained on), else DEFAULT_VALUE_RANGE.
  c.value_range = ml_collections.FieldReference(None, field_type=tuple)
  # Or per-channel mean and std of pixels scaled to [0, 1] (timm's and transformers' form):
  # the input is (pixel / 255 - mean) / std, in place of value_range. None: config.pretrained's
  # where its description records them, else value_range.
  c.mean = ml_collections.FieldReference(None, field_type=tuple)
  c.std = ml_collections.FieldReference(None, field_type=tuple)
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
  # Image folders: let splits have different or empty class folders; the train split's
  # classes are used and files of other classes skipped. False: such folders are an error.
  c.allow_class_mismatch = False
  return c


def is_folder(name: str) -> bool:
  """Whether data.name names an image folder rather than a TFDS dataset: a name spelled as a
  path (/, ., ~, a URL's ://), there or not (a missing one is then refused as a folder that is
  not there, not looked up as a dataset), or a bare name that is a directory here."""
  return name.startswith(("/", ".", "~")) or "://" in name or os.path.isdir(name)


def located(name: str) -> str:
  """data.name as a run's checkpoints record it: a local image folder by its absolute path
  (`./photos` means nothing from elsewhere), a dataset or a URL as it is."""
  if not is_folder(name) or "://" in name:
    return name
  return os.path.abspath(os.path.expanduser(name))


def _check(ok: bool, field: str, value, why: str) -> None:
  check(ok, f"data.{field}", value, why)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_pair(value) -> bool:
  return (isinstance(value, (tuple, list)) and len(value) == 2 and
          all(isinstance(v, numbers.Real) for v in value) and value[0] < value[1])


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first field of `cfg` that is wrong."""
  defaults = get_data_config()
  for key in cfg.keys():
    check_known(f"data.{key}", cfg[key], defaults.keys())
  for key in defaults.keys():
    _check(key in cfg, key, None, "missing; start from get_data_config()")

  for field, choices in (("train_crop", TRAIN_CROPS), ("eval_crop", EVAL_CROPS),
                         ("on_bad_image", ON_BAD_IMAGE), ("randaug_policy", RANDAUG_POLICIES)):
    _check(cfg[field] in choices, field, cfg[field], f"expected one of {choices}")
  for field in ("name", "train_split", "eval_split"):
    _check(isinstance(cfg[field], str) and bool(cfg[field]), field, cfg[field],
           "must be a non-empty string")
  for field, minimum in (("image_size", 1), ("crop_padding", 0),
                         ("shuffle_buffer", 1), ("cache_max_mb", 0),
                         ("threads", 0), ("prefetch", 0), ("num_shards", 0),
                         ("randaug_layers", 0)):
    _check(_is_int(cfg[field]) and cfg[field] >= minimum, field, cfg[field],
           f"must be an integer >= {minimum}")
  for field in ("flip", "cache", "download", "allow_class_mismatch"):
    _check(isinstance(cfg[field], bool), field, cfg[field], "must be True or False")
  for field in ("inception_area", "value_range"):
    _check(_is_pair(cfg[field]) or (field == "value_range" and cfg[field] is None), field,
           cfg[field], "must be a pair (low, high) with low < high")
  _check_mean_std(cfg)
  _check(0 < cfg.inception_area[0] and cfg.inception_area[1] <= 1, "inception_area",
         cfg.inception_area, "must lie in (0, 1]")
  _check(0 < cfg.central_crop_fraction <= 1, "central_crop_fraction",
         cfg.central_crop_fraction, "must be in (0, 1]")
  _check(isinstance(cfg.mixup_alpha, numbers.Real) and cfg.mixup_alpha >= 0, "mixup_alpha",
         cfg.mixup_alpha, "must be a number >= 0 (0: off)")
  magnitude = cfg.randaug_magnitude
  _check(isinstance(magnitude, numbers.Real) and not isinstance(magnitude, bool) and
         0 <= magnitude <= MAX_RANDAUG_MAGNITUDE, "randaug_magnitude", magnitude,
         f"must be a number in [0, {MAX_RANDAUG_MAGNITUDE:g}] (10: the TF code's max level)")


def _check_mean_std(cfg: ml_collections.ConfigDict) -> None:
  for field in ("mean", "std"):
    value = cfg[field]
    _check(value is None or (isinstance(value, (tuple, list)) and len(value) == 3 and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)), field, value,
        "must be three numbers (red, green, blue), of pixels scaled to [0, 1]")
  _check(cfg.std is None or min(cfg.std) > 0, "std", cfg.std, "must be > 0 for every channel")
  if (cfg.mean is None) != (cfg.std is None):
    missing = "std" if cfg.std is None else "mean"
    _check(False, missing, None, "give data.mean and data.std together")
  _check(cfg.mean is None or cfg.value_range is None, "value_range", cfg.value_range,
         "leave it None where data.mean and data.std are given: they replace it")


def value_range(cfg: ml_collections.ConfigDict) -> tuple[float, float] | None:
  """cfg.value_range; where it is None, the default, unless mean and std replace it (None)."""
  if cfg.value_range is not None:
    return tuple(cfg.value_range)
  return None if cfg.get("mean") is not None else DEFAULT_VALUE_RANGE
