"""Where examples come from: a TFDS dataset, a transfer task's, or an image folder.

A source (`Source`) hands out one process's shard of a split as a tf.data.Dataset of
{'image': encoded image bytes, 'label': int64} in a fixed order, and the size
of every process's shard, so that no process needs to ask the others. `KINDS` says which
kind of source a data.name is: a new kind is a class with Source's members and a row there.
"""
import dataclasses
import difflib
import functools
import math
import os
import random
import re
from typing import Any, Callable, Mapping, Protocol

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.config_errors import InputError
from vit_jax.data import config as data_config
from vit_jax.data import fashion_mnist
from vit_jax.data import preprocess
from vit_jax.data import tasks

# How a user sets each data option, in the config's terms. A command line with flags of its
# own words the same errors in its terms: DataOptionError.worded (vit_jax/tools/fewshot.py).
CONFIG_OPTIONS = {"name": "data.name", "data_dir": "data.data_dir",
                  "download": "set data.download=True", "no_download": "data.download=False",
                  "train_split": "data.train_split", "eval_split": "data.eval_split",
                  "relax_class_mismatch": ", or set data.allow_class_mismatch=True to use those "
                                          "of the train split and skip files of other classes",
                  "skip_bad_images": ", or set data.on_bad_image='skip' to leave such files out"}

# data.name = "task:NAME": a transfer task of data/tasks.py (its TFDS builder, label, classes).
TASK_PREFIX = "task:"

_HOW_TO_SUPPLY = (
    "Supply the data in one of these ways: set {data_dir} to the TFDS data "
    "directory that holds it (e.g. after `tfds build {dataset} --data_dir=DIR` on a "
    "machine with network access); {download} to let TFDS download "
    "and prepare it; or set {name} to an image folder laid out as "
    "ROOT/<split>/<class>/<image>.")


class DataOptionError(InputError):
  """Data that its options do not let the pipeline read. The message names the options as
  the config does; `worded(options)` as the caller's user sets them (CONFIG_OPTIONS' keys)."""

  def __init__(self, template: str, **values: Any):
    self.template, self.values = template, values
    super().__init__(self.worded(CONFIG_OPTIONS))

  def worded(self, options: Mapping[str, str]) -> str:
    return self.template.format(**options, **self.values)


@dataclasses.dataclass(frozen=True)
class SplitMeta:
  num_examples: int
  image_shape: tuple[int, ...] | None  # When every image has this shape.
  num_bytes: int  # Encoded size.


class Source(Protocol):
  """One data.name's examples: every member the pipeline, the evaluators and vit-transfer's
  checks use (tests/test_data.py holds each row of KINDS to it, and the pipeline to it)."""
  name: str  # data.name as given: what messages name.
  channels: int  # Of the decoded images (1: grayscale, made RGB by the pipeline).

  @property
  def class_names(self) -> tuple[str, ...]:
    """The label's classes, by index."""

  def meta(self, split: str) -> SplitMeta:
    """The split's size; ValueError naming it where there is no such split."""

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    """Examples of each process's shard, known to every process without asking."""

  def read(self, split: str, process_index: int, process_count: int) -> tf.data.Dataset:
    """A process's shard: {'image': encoded bytes, 'label': int64}, in a fixed order."""

  def skipped_images(self, split: str) -> tuple[str, ...]:
    """The split's files left out (undecodable, outside a class folder); () if none can be."""

  def class_counts(self, split: str) -> np.ndarray:
    """Examples per class of the split, its images not decoded."""


def _supervised_keys(info: tfds.core.DatasetInfo, name: str) -> tuple[str, tuple[str, ...]]:
  """The image key and class names of a dataset with (image, class label) supervised keys."""
  keys = info.supervised_keys
  if (not keys or len(keys) != 2 or not isinstance(keys[0], str) or
      not isinstance(info.features[keys[0]], tfds.features.Image) or
      not isinstance(info.features[keys[1]], tfds.features.ClassLabel)):
    raise DataOptionError("{name}={value!r}: expected a TFDS dataset with (image, class "
                          "label) supervised keys, got {keys}.", value=name, keys=keys)
  return keys[0], tuple(info.features[keys[1]].names)


_MANUAL = (
    "TFDS dataset {full_name!r} is not prepared in {root!r} ({data_dir}={value!r}) and TFDS "
    "cannot download it: place its files in {manual_dir} and run `tfds build {builder} "
    "--data_dir={root}` (or set {data_dir} to a directory where it is prepared). Where to get "
    "them: {how}")


class TfdsSource:
  """A prepared TFDS dataset with an image and a class label, or a transfer task's
  (data/tasks.py: its builder, label function and classes)."""

  def __init__(self, name: str, data_dir: str | None, download: bool, task: Any = None):
    self.name, self._task = name, task
    if task is not None:
      name = task.tfds_name
    if name.split(":")[0] == "fashion_mnist":
      fashion_mnist.prepare_fashion_mnist(data_dir)
    try:
      self._builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      close = difflib.get_close_matches(name.split(":")[0], tasks.known_tfds_names())
      hint = f" Did you mean {close}?" if close else ""
      raise DataOptionError(
          "{name}={value!r} is neither a TFDS dataset nor an existing directory.{hint} "
          + _HOW_TO_SUPPLY, value=name, hint=hint, dataset="DATASET") from None
    except ValueError as e:  # A name TFDS cannot parse: `cifar10=3`.
      if "builder name" not in str(e):
        raise
      raise DataOptionError(
          "{name}={value!r} is neither a TFDS name (DATASET[/CONFIG][:VERSION]) nor an existing "
          "directory. " + _HOW_TO_SUPPLY, value=name, dataset="DATASET") from None
    if not self._builder.is_prepared():
      if getattr(self._builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None):
        root = str(self._builder.data_dir_root)
        raise DataOptionError(
            _MANUAL, value=data_dir, full_name=self._builder.info.full_name, root=root,
            manual_dir=os.path.join(root, "downloads", "manual"), builder=name.split(":")[0],
            how=" ".join(self._builder.MANUAL_DOWNLOAD_INSTRUCTIONS.split()))
      if not download:
        raise DataOptionError(
            "TFDS dataset {full_name!r} is not prepared in data_dir={root!r} ({data_dir}="
            "{value!r}) and {no_download}. " + _HOW_TO_SUPPLY,
            full_name=self._builder.info.full_name, root=str(self._builder.data_dir_root),
            value=data_dir, dataset=name)
      self._builder.download_and_prepare()

    info = self._builder.info
    if task is not None:
      self._image_key, self.class_names = task.image_key, task.class_names
    else:
      self._image_key, self.class_names = _supervised_keys(info, name)
    image_shape = info.features[self._image_key].shape
    self.channels = image_shape[-1] or 3
    self._image_shape = image_shape if None not in image_shape else None

  def meta(self, split: str) -> SplitMeta:
    try:
      split_info = self._builder.info.splits[split]
    except (KeyError, ValueError) as e:
      raise ValueError(f"{split!r} is not a split of {self.name}: {e} "
                       f"(splits: {list(self._builder.info.splits)})") from None
    return SplitMeta(split_info.num_examples, self._image_shape,
                     split_info.num_bytes)

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    splits = self._builder.info.splits
    return [splits[s].num_examples
            for s in tfds.even_splits(split, process_count)]

  def read(self, split: str, process_index: int,
           process_count: int) -> tf.data.Dataset:
    ds = self._builder.as_dataset(
        split=tfds.even_splits(split, process_count)[process_index],
        shuffle_files=False, as_supervised=self._task is None,
        decoders={self._image_key: tfds.decode.SkipDecoding()},
        # The pipeline caches what it wants itself.
        read_config=tfds.ReadConfig(try_autocache=False))
    if self._task is not None:
      return ds.map(self._task.example)
    return ds.map(preprocess.traced(lambda image, label: {"image": image, "label": label}))

  def skipped_images(self, split: str) -> tuple[str, ...]:
    del split
    return ()

  def class_counts(self, split: str) -> np.ndarray:
    """Examples per class of `split`. A dataset's own TFRecord files are read as records
    whose label alone is parsed, a batch at a time (0.7 s for Fashion-MNIST's 60,000 on two
    cores, 4.1 s through read(), which copies each image's bytes); a task's labels, which
    its function makes, through read()."""
    info, key = self._builder.info, (self._builder.info.supervised_keys or ("", ""))[1]
    serialized = info.features.get_serialized_info()
    if (self._task is not None or info.file_format != tfds.core.FileFormat.TFRECORD
        or not isinstance(key, str) or key not in serialized):
      labels = self.read(split, 0, 1).map(preprocess.traced(lambda e: e["label"]))
    else:
      parts = [tf.data.TFRecordDataset(f.filename)  # The shard's path, data_dir's included.
               .skip(f.skip).take(f.take) for f in info.splits[split].file_instructions]
      spec = {key: tf.io.FixedLenFeature([], serialized[key].dtype)}
      labels = functools.reduce(tf.data.Dataset.concatenate, parts).batch(1 << 12).map(
          lambda records: tf.io.parse_example(records, spec)[key]).unbatch()
    return _bincount(labels, len(self.class_names))


@dataclasses.dataclass(frozen=True)
class _Scan:
  examples: tuple[tuple[str, int], ...]  # (path, label), decodable, in reading order.
  skipped: tuple[str, ...]
  meta: SplitMeta


def _list_split(split_dir: str) -> tuple[dict[str, list[str]], list[str]]:
  """The files under each class folder of a split, and those lying directly in it."""
  classes, loose = {}, []
  for name in tf.io.gfile.listdir(split_dir):
    path = os.path.join(split_dir, name.rstrip("/"))
    if tf.io.gfile.isdir(path):
      classes[name.rstrip("/")] = sorted(
          os.path.join(d, f) for d, _, files in tf.io.gfile.walk(path) for f in files)
    else:
      loose.append(path)
  return classes, sorted(loose)


_SLICE = re.compile(r"(?P<folder>[^\[\]]+)(\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?")


def _parse_slice(split: str) -> tuple[str, tuple[str | None, str | None] | None]:
  m = _SLICE.fullmatch(split)
  if m is None:
    raise ValueError(f"split {split!r}: expected FOLDER or FOLDER[START:STOP] (examples or "
                     "percent, e.g. train[:800], train[10%:])")
  return m["folder"], None if m.group(2) is None else (m["start"], m["stop"])


def _absolute(bound: str | None, n: int) -> int | None:
  """A slice bound in examples; percent rounded to the closest example, as TFDS does."""
  if bound is None or not bound.endswith("%"):
    return None if bound is None else int(bound)
  return int(round(int(bound[:-1]) * n / 100))


class FolderSource:
  """Images in ROOT/<split>/<class>/, any format TF decodes; labels: sorted classes. A split
  is a folder or a slice of one in TFDS's syntax (train[:800], train[90%:]).

  The class folders of `class_split` (the train split) are the classes; every split
  must have the same ones, none empty, unless allow_class_mismatch. Every image of a
  split is decoded once, up front, so that undecodable files are found before training
  starts: with on_bad_image='fail' they are an error, with 'skip' they are left out.
  Whatever is left out is counted and logged with examples.
  """

  def __init__(self, root: str, on_bad_image: str, class_split: str = "train",
               allow_class_mismatch: bool = False):
    self.name = root
    root = os.path.expanduser(root)
    if not tf.io.gfile.isdir(root):
      raise DataOptionError("{name}={value!r} is not a directory. " + _HOW_TO_SUPPLY,
                            value=self.name, dataset="DATASET")
    self._on_bad_image = on_bad_image
    self._class_split = _parse_slice(class_split)[0]
    self._allow_mismatch = allow_class_mismatch
    self._splits = {name.rstrip("/"): _list_split(os.path.join(root, name))
                    for name in sorted(tf.io.gfile.listdir(root))
                    if tf.io.gfile.isdir(os.path.join(root, name))}
    self._scans: dict[str, _Scan] = {}
    self.channels = 3

  def _check_split(self, split: str) -> None:
    if split not in self._splits:
      raise ValueError(
          f"{split!r} is not a sub-folder of {self.name} (found: "
          f"{sorted(self._splits)}); expected images in "
          f"{os.path.join(self.name, split)}/<class>/")

  @functools.cached_property
  def class_names(self) -> tuple[str, ...]:
    self._check_split(self._class_split)
    names = tuple(sorted(self._splits[self._class_split][0]))
    differences = []
    for split, (classes, _) in self._splits.items():
      differences += [f"{split}/{c} (not in {self._class_split})"
                      for c in sorted(set(classes) - set(names))]
      differences += [f"{split}/{c} (missing)" for c in names if c not in classes]
      differences += [f"{split}/{c} (empty)" for c, files in classes.items() if not files]
    if differences and not self._allow_mismatch:
      raise DataOptionError(
          "{name}={value!r}: the class folders of the splits differ: {differences}. Give "
          "every split the same non-empty class folders{relax_class_mismatch}.",
          value=self.name, differences=", ".join(differences))
    if differences:
      logging.warning("%s: the class folders of the splits differ: %s; using the %d of %r "
                      "(data.allow_class_mismatch=True).", self.name,
                      ", ".join(differences), len(names), self._class_split)
    return names

  def _decodable_shapes(self, paths: list[str]) -> dict[str, tuple[int, ...]]:
    if not paths:
      return {}
    # Dataset.ignore_errors drops exactly the files that cannot be read or decoded.
    ds = tf.data.Dataset.from_tensor_slices(paths).map(preprocess.traced(
        lambda p: (p, tf.shape(preprocess.decode(tf.io.read_file(p), self.channels)))),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    return {p.decode(): tuple(s) for p, s in ds.ignore_errors().as_numpy_iterator()}

  def _scan(self, split: str) -> _Scan:
    """A split folder's examples, or a slice of them (TFDS's syntax: train[:800],
    train[800:1000], train[-10%:]) in the folder's reading order."""
    if split not in self._scans:
      folder, bounds = _parse_slice(split)
      whole = self._scan_folder(folder)
      if bounds is None:
        self._scans[split] = whole
      else:
        n = whole.meta.num_examples
        examples = whole.examples[slice(*(_absolute(b, n) for b in bounds))]
        if not examples:
          raise ValueError(f"split {split!r} of {self.name} is empty: {folder!r} has {n} "
                           "examples.")
        self._scans[split] = _Scan(examples, whole.skipped, dataclasses.replace(
            whole.meta, num_examples=len(examples),
            num_bytes=sum(tf.io.gfile.stat(p).length for p, _ in examples)))
    return self._scans[split]

  def _scan_folder(self, split: str) -> _Scan:
    if split in self._scans:
      return self._scans[split]
    self._check_split(split)
    labels = {c: i for i, c in enumerate(self.class_names)}
    classes, loose = self._splits[split]
    examples = [(p, labels[c]) for c in sorted(classes) if c in labels for p in classes[c]]
    random.Random(split).shuffle(examples)  # As tfds.ImageFolder: classes mixed when streamed.
    shapes = self._decodable_shapes([p for p, _ in examples])
    bad = [p for p, _ in examples if p not in shapes]
    split_dir = os.path.join(self.name, split)
    if bad and self._on_bad_image == "fail":
      raise DataOptionError(
          "Cannot decode image {path} ({n} undecodable in {split_dir}). Replace or delete "
          "it{skip_bad_images}.", path=bad[0], n=len(bad), split_dir=split_dir)
    left_out = {"undecodable": bad, "not in a class folder": loose,
               f"of a class not in {self._class_split!r}": [
                   p for c in sorted(classes) if c not in labels for p in classes[c]]}
    parts = [f"{len(paths)} {why} (e.g. {', '.join(paths[:5])})"
             for why, paths in left_out.items() if paths]
    skipped = tuple(p for paths in left_out.values() for p in paths)
    if parts:
      logging.warning("Skipping %d file(s) of %s: %s.", len(skipped), split_dir,
                      "; ".join(parts))
    examples = tuple((p, label) for p, label in examples if p in shapes)
    if not examples:
      raise ValueError(
          f"split folder {split_dir} is empty: no decodable images ({len(skipped)} "
          f"file(s) skipped). Put images in {split_dir}/<class>/, or choose another split.")
    distinct = set(shapes.values())
    meta = SplitMeta(
        num_examples=len(examples),
        image_shape=distinct.pop() if len(distinct) == 1 else None,
        num_bytes=sum(tf.io.gfile.stat(p).length for p, _ in examples))
    self._scans[split] = _Scan(examples, skipped, meta)
    return self._scans[split]

  def meta(self, split: str) -> SplitMeta:
    return self._scan(split).meta

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    n = self.meta(split).num_examples
    return [len(range(i, n, process_count)) for i in range(process_count)]

  def read(self, split: str, process_index: int,
           process_count: int) -> tf.data.Dataset:
    shard = self._scan(split).examples[process_index::process_count]  # i, i+n, ...
    paths = tf.constant([p for p, _ in shard], tf.string)
    labels = tf.constant([label for _, label in shard], tf.int64)
    return tf.data.Dataset.from_tensor_slices((paths, labels)).map(preprocess.traced(
        lambda p, label: {"image": tf.io.read_file(p), "label": label}),
        num_parallel_calls=tf.data.AUTOTUNE)

  def skipped_images(self, split: str) -> tuple[str, ...]:
    return self._scan(split).skipped

  def class_counts(self, split: str) -> np.ndarray:
    """Examples per class of `split`, off the scan's labels: no image read again."""
    return np.bincount([label for _, label in self._scan(split).examples],
                       minlength=len(self.class_names))


def _bincount(labels: tf.data.Dataset, num_classes: int) -> np.ndarray:
  batches = labels.batch(1 << 16).as_numpy_iterator()
  return np.bincount(np.concatenate([np.zeros(0, np.int64), *batches]), minlength=num_classes)


@dataclasses.dataclass(frozen=True)
class Options:
  """config.data's fields beside the name; each kind takes those it needs."""
  data_dir: str | None  # TFDS's.
  download: bool  # TFDS's.
  on_bad_image: str  # The rest: FolderSource's.
  class_split: str = "train"
  allow_class_mismatch: bool = False


@dataclasses.dataclass(frozen=True)
class Kind:
  """A row of KINDS."""
  claims: Callable[[str], bool]  # Whether a data.name is of this kind.
  open: Callable[[str, Options], Source]


def _folder(root: str, o: Options) -> FolderSource:
  return FolderSource(root, o.on_bad_image, o.class_split, o.allow_class_mismatch)


def _task(name: str, o: Options) -> TfdsSource:
  return TfdsSource(name, o.data_dir, o.download, tasks.get(name.removeprefix(TASK_PREFIX)))


def _tfds(name: str, o: Options) -> TfdsSource:
  return TfdsSource(name, o.data_dir, o.download)


# The kinds of data.name, in order: the first that claims a name opens it; TFDS takes the rest.
KINDS: dict[str, Kind] = {
    "folder": Kind(data_config.is_folder, _folder),
    "task": Kind(lambda name: name.startswith(TASK_PREFIX), _task),
    "tfds": Kind(lambda name: True, _tfds),
}


def kind_of(name: str) -> str:
  """The row of KINDS that opens data.name `name`."""
  return next(kind for kind, row in KINDS.items() if row.claims(name))


@functools.lru_cache(maxsize=None)
def get_source(name: str, data_dir: str | None, download: bool, on_bad_image: str,
               class_split: str = "train", allow_class_mismatch: bool = False) -> Source:
  """`on_bad_image`, `class_split` and `allow_class_mismatch`: see FolderSource."""
  options = Options(data_dir, download, on_bad_image, class_split, allow_class_mismatch)
  return KINDS[kind_of(name)].open(name, options)


@functools.lru_cache(maxsize=8)
def load_table(source: Source, split: str, process_index: int,
               process_count: int, decoded: bool) -> dict[str, np.ndarray]:
  """A process's shard of a split in memory: images decoded or still encoded."""
  ds = source.read(split, process_index, process_count).batch(1024)
  if decoded:
    # 1,024 images decoded to a call (a decoded table's images all have meta's shape): one by
    # one, tf.data's cost per image is twice the decoding's on 28 px images.
    decoded_image = tf.TensorSpec(source.meta(split).image_shape, tf.uint8)

    def decode(batch):
      images = tf.map_fn(lambda data: preprocess.decode(data, source.channels), batch["image"],
                         fn_output_signature=decoded_image)
      return {**batch, "image": images}
    ds = ds.map(preprocess.traced(decode), num_parallel_calls=tf.data.AUTOTUNE)
  parts = list(ds.as_numpy_iterator())
  if not parts:
    raise ValueError(f"Split {split!r} of {source.name} has no examples for "
                     f"process {process_index} of {process_count}.")
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def table_bytes(meta: SplitMeta, process_count: int, decoded: bool) -> int:
  """Memory a process's shard takes in a table."""
  per_example = (math.prod(meta.image_shape) if decoded else
                 meta.num_bytes / max(meta.num_examples, 1))
  return int(math.ceil(meta.num_examples / process_count) * per_example)
