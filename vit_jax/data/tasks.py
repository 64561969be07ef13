"""The ViT paper's transfer tasks: VTAB-1k and the paper's five fine-tuning datasets.

VTAB-1k's 19 tasks are defined as google-research/task_adaptation defines them
(TFDS builder, splits, label function, pixel fixes; each task's `source` names
the file). A VTAB task trains on 1,000 examples (train800val200), selects the
learning rate by training on train800 and evaluating on val200, and is tested
on task_adaptation's `test` split.

The paper's suite (ImageNet, CIFAR-10/100, Pets, Flowers) selects the learning
rate on a held-out part of the train split and then trains on the whole split
(Dosovitskiy et al., ICLR 2021, App. B.1.1 and Table 4).

Split strings pin the builder's version: their absolute boundaries come from
that version's split sizes, written next to each task.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping

from etils import epy

from vit_jax.data import config as data_config

# Loaded at first use: the tasks' table is read while a command checks its arguments (config
# validation, --list), which should not wait for TensorFlow (seconds) to find a typo.
with epy.lazy_imports():
  import tensorflow as tf
  import tensorflow_datasets as tfds

Features = Mapping[str, Any]  # Of tf.Tensor, or of mappings of them.

# Steps and learning rates: ViT paper (ICLR 2021), Table 4. Its ImageNet row lists 0.06,
# which App. B.1.1's text says was added to the sweep for ResNets and hybrids.
VTAB_STEPS, VTAB_LR_GRID = 2_500, (0.01,)
_SMALL_LR_GRID = (0.001, 0.003, 0.01, 0.03)
_IMAGENET_LR_GRID = (0.003, 0.01, 0.03, 0.06)


@dataclasses.dataclass(frozen=True)
class Label:
  """How a task's label comes out of a TFDS example."""
  fn: Callable[[Features], tf.Tensor]
  text: str  # The label function in words, for describe().
  class_key: str | None = None  # The ClassLabel feature that names the classes, if any.


def feature_label(key: str = "label") -> Label:
  """The ClassLabel feature `key` as it is."""
  return Label(lambda f: f[key], key, class_key=key)


def binned_label(key: str, num_values: int, num_classes: int) -> Label:
  """task_adaptation's dsprites grouping: floor(value / (num_values / num_classes))."""
  factor = num_values / num_classes

  def fn(f: Features) -> tf.Tensor:
    return tf.cast(tf.math.floordiv(tf.cast(f[key], tf.float32), factor), tf.int64)

  return Label(fn, f"floor({key} / {factor:g}): {num_values} values -> {num_classes} classes")


def _last_below(thresholds: tuple[float, ...], value: tf.Tensor) -> tf.Tensor:
  """Index of the last threshold below `value`: task_adaptation's
  `tf.reduce_max(tf.where((thrs - dist) < 0))` (ascending thresholds)."""
  return tf.reduce_max(tf.where(tf.constant(thresholds, tf.float32) < value))


def _clevr_count(f: Features) -> tf.Tensor:
  return tf.size(f["objects"]["size"], out_type=tf.int64) - 3


# task_adaptation/data/clevr.py, _closest_object_preprocess_fn.
_CLEVR_DEPTHS = (0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0)


def _clevr_distance(f: Features) -> tf.Tensor:
  return _last_below(_CLEVR_DEPTHS, tf.reduce_min(f["objects"]["pixel_coords"][:, 2]))


# task_adaptation/data/kitti.py, _closest_vehicle_distance_pp: 1000 m stands for "no
# vehicle", which the last threshold turns into class 3.
_KITTI_DEPTHS, _KITTI_NO_VEHICLE = (-100.0, 8.0, 20.0, 999.0), 1000.0
_KITTI_VEHICLES = 3  # objects/type < 3: Car, Van, Truck.


def _kitti_distance(f: Features) -> tf.Tensor:
  objects = f["objects"]
  depths = tf.boolean_mask(objects["location"][:, 2], objects["type"] < _KITTI_VEHICLES)
  closest = tf.reduce_min(tf.concat([depths, [_KITTI_NO_VEHICLE]], axis=0))
  return _last_below(_KITTI_DEPTHS, closest)


CLEVR_COUNT = Label(_clevr_count, "number of objects - 3 (scenes hold 3..10 objects)")
CLEVR_DISTANCE = Label(
    _clevr_distance, "depth of the closest object, min(objects/pixel_coords[:, 2]), in bins "
    "(0, 8], (8, 8.5], (8.5, 9], (9, 9.5], (9.5, 10], (10, 100]")
KITTI_DISTANCE = Label(
    _kitti_distance, "depth of the closest vehicle (Car, Van, Truck), min(objects/location"
    "[:, 2]) in m, in bins (-100, 8], (8, 20], (20, 999]; class 3: no vehicle")


def _binary_to_255(image: tf.Tensor) -> tf.Tensor:
  """dsprites' 0/1 pixels as 0/255 (task_adaptation/data/dsprites.py, preprocess_fn)."""
  return image * 255


@dataclasses.dataclass(frozen=True)
class Task:
  """One transfer task: a TFDS builder, its splits, its label and its protocol."""
  name: str  # Suite-qualified: "vtab1k/clevr_count", "paper/cifar100".
  suite: str  # "vtab1k" | "paper"
  group: str  # "natural" | "specialized" | "structured" | "paper"
  tfds_name: str  # As tfds.builder takes it, version pinned.
  num_classes: int
  train: str  # The final run's training split (VTAB: train800val200).
  test: str  # Evaluated at the end.
  minitrain: str  # Learning-rate selection: trained on (VTAB: train800).
  minival: str  # Learning-rate selection: evaluated on (VTAB: val200).
  steps: int
  lr_grid: tuple[float, ...]
  manual_download: str | None = None  # Where to get the files TFDS cannot download itself.
  source: str = ""
  label: Label = feature_label()
  fix_pixels: Callable[[tf.Tensor], tf.Tensor] | None = None  # On decoded uint8 pixels.

  def example(self, features: Features) -> dict[str, tf.Tensor]:
    """A TFDS example, its image not decoded -> {"image": encoded bytes, "label": int64}."""
    image = features[self.image_key]
    if self.fix_pixels is not None:
      pixels = tf.io.decode_image(image, expand_animations=False)
      image = tf.io.encode_png(self.fix_pixels(pixels))
    return {"image": image, "label": tf.cast(self.label.fn(features), tf.int64)}

  @property
  def image_key(self) -> str:
    return "image"  # Every builder here (task_adaptation's ImageTfdsData default).

  @property
  def class_names(self) -> tuple[str, ...]:
    """The ClassLabel's names where the label is one, else "0".."num_classes-1"."""
    if self.label.class_key is None:
      return tuple(str(i) for i in range(self.num_classes))
    return _class_names(self.tfds_name, self.label.class_key)


@functools.lru_cache(maxsize=None)
def _class_names(tfds_name: str, key: str) -> tuple[str, ...]:
  return tuple(tfds.builder(tfds_name).info.features[key].names)


# --- VTAB-1k splits, as task_adaptation/data/*.py form train800 / val200 -------------


def _vtab_splits(minitrain: str, minival: str, test: str) -> dict[str, str]:
  return dict(minitrain=minitrain, minival=minival, train=f"{minitrain}+{minival}", test=test)


def _with_val(val: str = "validation", test: str = "test") -> dict[str, str]:
  """The builder has a validation split: val200 is its first 200 (dtd.py, dmlab.py, ...)."""
  return _vtab_splits("train[:800]", f"{val}[:200]", test)


def _held_out(num_train: int, train_percent: int, test: str = "test") -> dict[str, str]:
  """val200 is the first 200 after the train split's first train_percent% (cifar.py,
  caltech.py, ...), counted as task_adaptation does: train_percent * num_train // 100."""
  start = train_percent * num_train // 100
  return _vtab_splits("train[:800]", f"train[{start}:{start + 200}]", test)


def _train_only(num_train: int, train_percent: int, val_percent: int) -> dict[str, str]:
  """Only a train split (eurosat.py, resisc45.py, dsprites.py): train / val / test are
  its consecutive train_percent% / val_percent% / rest, each count rounded down."""
  end_of_val = train_percent * num_train // 100 + val_percent * num_train // 100
  return _held_out(num_train, train_percent, test=f"train[{end_of_val}:]")


_KAGGLE_DR = ("Kaggle's diabetic-retinopathy-detection files (https://www.kaggle.com/c/"
              "diabetic-retinopathy-detection/data), unpacked into TFDS's manual_dir")
_RESISC45 = ("NWPU-RESISC45.rar from https://1drv.ms/u/s!AmgKYzARBl5ca3HNaHIlzp_IXjs, "
             "extracted into TFDS's manual_dir")
_IMAGENET = ("ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
             "https://image-net.org/download-images (registration), in TFDS's manual_dir")


def _vtab(name: str, group: str, tfds_name: str, num_classes: int, splits: dict[str, str],
          source: str, **kwargs) -> Task:
  return Task(name=f"vtab1k/{name}", suite="vtab1k", group=group, tfds_name=tfds_name,
              num_classes=num_classes, steps=VTAB_STEPS, lr_grid=VTAB_LR_GRID,
              source=f"task_adaptation/data/{source}", **splits, **kwargs)


# The 19 tasks and their variants: task_adaptation/scripts/run_all_tasks.sh. task_adaptation
# pins major versions ("clevr:3.*.*"); here the version TFDS 4.9 resolves them to. Split
# sizes: task_adaptation/data/*_test.py expected_num_samples and the TFDS catalog for that
# version. num_classes: the ClassLabel's size where task_adaptation reads it from the builder
# (tests/test_tasks.py checks it), else clevr.py's and kitti.py's _TASK_DICT.
_VTAB = (
    # 3,060 train; 90% train (caltech.py _TRAIN_SPLIT_PERCENT).
    _vtab("caltech101", "natural", "caltech101:3.0.2", 102, _held_out(3_060, 90), "caltech.py"),
    # 50,000 train; 90% train (cifar.py TRAIN_SPLIT_PERCENT); cifar(num_classes=100).
    _vtab("cifar100", "natural", "cifar100:3.0.2", 100, _held_out(50_000, 90), "cifar.py"),
    _vtab("dtd", "natural", "dtd:3.0.1", 47, _with_val(), "dtd.py"),
    _vtab("oxford_flowers102", "natural", "oxford_flowers102:2.1.1", 102, _with_val(),
          "oxford_flowers102.py"),
    # 3,680 train; 80% train (oxford_iiit_pet.py TRAIN_SPLIT_PERCENT). task_adaptation asks
    # for 3.*.*, which TFDS 4.9 no longer has; 4.0.0 keeps the 3,680 / 3,669 examples.
    _vtab("oxford_iiit_pet", "natural", "oxford_iiit_pet:4.0.0", 37, _held_out(3_680, 80),
          "oxford_iiit_pet.py"),
    _vtab("sun397", "natural", "sun397/tfds:4.0.0", 397, _with_val(), "sun397.py"),
    # 73,257 train; 90% train (svhn.py TRAIN_SPLIT_PERCENT).
    _vtab("svhn", "natural", "svhn_cropped:3.1.0", 10, _held_out(73_257, 90), "svhn.py"),
    _vtab("patch_camelyon", "specialized", "patch_camelyon:2.0.0", 2, _with_val(),
          "patch_camelyon.py"),
    # 27,000 train only; 60 / 20 / 20% (eurosat.py); subset "rgb", data_key "image".
    _vtab("eurosat", "specialized", "eurosat/rgb:2.0.0", 10, _train_only(27_000, 60, 20),
          "eurosat.py"),
    # 31,500 train only; 60 / 20 / 20% (resisc45.py).
    _vtab("resisc45", "specialized", "resisc45:3.0.0", 45, _train_only(31_500, 60, 20),
          "resisc45.py", manual_download=_RESISC45),
    _vtab("diabetic_retinopathy", "specialized",
          "diabetic_retinopathy_detection/btgraham-300:3.0.0", 5, _with_val(),
          "diabetic_retinopathy.py", manual_download=_KAGGLE_DR),
    # 70,000 train; 90% train; the test split is TFDS's "validation" (clevr.py).
    _vtab("clevr_count", "structured", "clevr:3.1.0", 8,
          _held_out(70_000, 90, test="validation"), "clevr.py", label=CLEVR_COUNT),
    _vtab("clevr_distance", "structured", "clevr:3.1.0", 6,
          _held_out(70_000, 90, test="validation"), "clevr.py", label=CLEVR_DISTANCE),
    _vtab("dmlab", "structured", "dmlab:2.0.1", 6, _with_val(), "dmlab.py"),
    # 737,280 train only; 80 / 10 / 10% (dsprites.py); num_classes=16 (run_all_tasks.sh).
    _vtab("dsprites_location", "structured", "dsprites:2.0.0", 16,
          _train_only(737_280, 80, 10), "dsprites.py",
          label=binned_label("label_x_position", 32, 16), fix_pixels=_binary_to_255),
    _vtab("dsprites_orientation", "structured", "dsprites:2.0.0", 16,
          _train_only(737_280, 80, 10), "dsprites.py",
          label=binned_label("label_orientation", 40, 16), fix_pixels=_binary_to_255),
    # val: the first 50% of TFDS's test split, test: the rest (smallnorb.py VAL_SPLIT_PERCENT).
    # Gray images stay one channel: the pipeline repeats it, as smallnorb.py's tf.tile.
    _vtab("smallnorb_azimuth", "structured", "smallnorb:2.0.0", 18,
          _with_val(val="test", test="test[50%:]"), "smallnorb.py",
          label=feature_label("label_azimuth")),
    _vtab("smallnorb_elevation", "structured", "smallnorb:2.0.0", 9,
          _with_val(val="test", test="test[50%:]"), "smallnorb.py",
          label=feature_label("label_elevation")),
    _vtab("kitti_distance", "structured", "kitti:3.1.0", 4, _with_val(), "kitti.py",
          label=KITTI_DISTANCE),
)


def _paper(name: str, tfds_name: str, num_classes: int, held_out_percent: int, steps: int,
           lr_grid: tuple[float, ...], test: str = "test", **kwargs) -> Task:
  """Learning rate chosen on the train split's last held_out_percent%, then trained on it
  all (App. B.1.1); the percent slices as big_vision/configs/transfer.py writes them."""
  keep = 100 - held_out_percent
  return Task(name=f"paper/{name}", suite="paper", group="paper", tfds_name=tfds_name,
              num_classes=num_classes, train="train", test=test, minitrain=f"train[:{keep}%]",
              minival=f"train[{keep}%:]", steps=steps, lr_grid=lr_grid,
              source="ViT paper App. B.1.1 / Table 4; big_vision/configs/transfer.py",
              **kwargs)


# TFDS's Flowers `validation` split is left out, as big_vision/configs/transfer.py does.
_PAPER = (
    # ImageNet's labelled test set is its validation split.
    _paper("imagenet2012", "imagenet2012:5.1.0", 1000, 1, 20_000, _IMAGENET_LR_GRID,
           test="validation", manual_download=_IMAGENET),
    _paper("cifar10", "cifar10:3.0.2", 10, 2, 10_000, _SMALL_LR_GRID),
    _paper("cifar100", "cifar100:3.0.2", 100, 2, 10_000, _SMALL_LR_GRID),
    _paper("oxford_iiit_pet", "oxford_iiit_pet:4.0.0", 37, 10, 500, _SMALL_LR_GRID),
    _paper("oxford_flowers102", "oxford_flowers102:2.1.1", 102, 10, 500, _SMALL_LR_GRID),
)

TASKS: dict[str, Task] = {t.name: t for t in _VTAB + _PAPER}
SUITES: dict[str, tuple[str, ...]] = {
    "vtab1k": tuple(t.name for t in _VTAB),
    "paper": tuple(t.name for t in _PAPER),
    "imagenet": ("paper/imagenet2012",),
}


def _real_labels(f: Features) -> tf.Tensor:
  """The set of right classes as a multi-hot vector; all zeros where the raters found none."""
  hits = tf.reduce_sum(tf.one_hot(f["real_label"], 1000, dtype=tf.int32), axis=0)
  return tf.cast(hits > 0, tf.int64)


# Datasets evaluated beside a run's own (config.evals' presets), with no fine-tuning protocol.
_EVAL_ONLY = (
    Task(name="evals/imagenet_real", suite="evals", group="evals",
         tfds_name="imagenet2012_real:1.0.0", num_classes=1000, train="", test="validation",
         minitrain="", minival="", steps=0, lr_grid=(), manual_download=_IMAGENET,
         source="Beyer et al., 2020, 'Are we done with ImageNet?' (TFDS imagenet2012_real)",
         label=Label(_real_labels, "the raters' set of right classes (multi-hot)",
                     class_key="original_label")),
)
def get(name: str) -> Task:
  """A task by its full name, the evaluation-only ones included."""
  found = {t.name: t for t in _EVAL_ONLY} | TASKS
  if name not in found:
    raise ValueError(f"unknown task {name!r}; tasks: {list(found)}")
  return found[name]


def custom(data_name: str) -> Task:
  """Any TFDS classification dataset (image, label), or an image folder ROOT/{train,test}/
  <class>/, with VTAB-1k's protocol: the rate chosen from the paper's grid by train[:800] ->
  train[800:1000], then train[:1000] -> test. A folder's task is named by its absolute path,
  which every process of a launched sweep reads alike."""
  if data_config.is_folder(data_name):
    name = data_name if "://" in data_name else os.path.abspath(os.path.expanduser(data_name))
    data_name = name
  else:
    name = data_name.split(":")[0]
  return Task(name=name, suite="custom", group="custom",
              tfds_name=data_name, num_classes=0, train="train[:1000]",
              test="test", minitrain="train[:800]", minival="train[800:1000]",
              steps=VTAB_STEPS, lr_grid=_SMALL_LR_GRID,
              source="VTAB-1k's splits and steps, the paper's grid")


def known_tfds_names() -> list[str]:
  """TFDS's own datasets. (Its community index would be read from GCS: seconds, and an
  authentication warning on stderr where there are no Google credentials.)"""
  return tfds.list_builders(with_community_datasets=False)


def resolve_or_custom(spec: str) -> list[Task]:
  """`resolve`, where a name that is no task but a TFDS dataset becomes `custom`."""
  out = []
  for name in (n.strip() for n in spec.split(",") if n.strip()):
    try:
      out += resolve(name)
    except ValueError:
      if not data_config.is_folder(name) and name.split(":")[0] not in known_tfds_names():
        raise
      out.append(custom(name))
  if not out:
    raise ValueError(f"no task named in {spec!r}; suites: {sorted(SUITES)}")
  return list({t.name: t for t in out}.values())


def _lookup(name: str) -> list[Task]:
  if name in SUITES:
    return [TASKS[n] for n in SUITES[name]]
  if name in TASKS:
    return [TASKS[name]]
  matches = [t for t in TASKS.values() if t.name.split("/", 1)[1] == name]
  if len(matches) == 1:
    return matches
  if matches:
    raise ValueError(f"{name!r} is ambiguous: say one of {[t.name for t in matches]}")
  raise ValueError(f"unknown task or suite {name!r}; suites: {sorted(SUITES)}; "
                   f"tasks: {list(TASKS)}")


def resolve(spec: str) -> list[Task]:
  """A suite's tasks, or comma-separated task names (a VTAB or paper task's short name,
  e.g. "clevr_count", where only one task has it) and suites, in order, each once."""
  names = [n.strip() for n in spec.split(",") if n.strip()]
  if not names:
    raise ValueError(f"no task named in {spec!r}; suites: {sorted(SUITES)}; "
                     f"tasks: {list(TASKS)}")
  tasks = [t for n in names for t in _lookup(n)]
  return list({t.name: t for t in tasks}.values())


def as_dict(task: Task) -> dict:
  """The task as JSON-able values."""
  return {
      "name": task.name, "suite": task.suite, "group": task.group,
      "tfds_name": task.tfds_name, "num_classes": task.num_classes, "label": task.label.text,
      "train": task.train, "minitrain": task.minitrain, "minival": task.minival,
      "test": task.test, "steps": task.steps, "lr_grid": list(task.lr_grid),
      "manual_download": task.manual_download, "source": task.source,
  }
