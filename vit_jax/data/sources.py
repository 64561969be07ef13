"""Where examples come from: a TFDS dataset or an image folder.

A source hands out one process's shard of a split as a tf.data.Dataset of
{'image': encoded image bytes, 'label': int64} in a fixed order, and the size
of every process's shard, so that no process needs to ask the others.
"""
import dataclasses
import difflib
import functools
import math
import os

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import fashion_mnist
from vit_jax.data import preprocess

_HOW_TO_SUPPLY = (
    "Supply the data in one of these ways: set data.data_dir to the TFDS data "
    "directory that holds it (e.g. after `tfds build NAME --data_dir=DIR` on a "
    "machine with network access); set data.download=True to let TFDS download "
    "and prepare it; or set data.name to an image folder laid out as "
    "ROOT/<split>/<class>/<image>.{jpg,png}.")


@dataclasses.dataclass(frozen=True)
class SplitMeta:
  num_examples: int
  image_shape: tuple[int, ...] | None  # When every image has this shape.
  num_bytes: int  # Encoded size.


def is_folder(name: str) -> bool:
  """Whether data.name names a directory rather than a TFDS dataset."""
  return name.startswith(("/", ".", "~")) or "://" in name or os.path.isdir(name)


class TfdsSource:
  """A prepared TFDS dataset with an image and a class label."""

  def __init__(self, name: str, data_dir: str | None, download: bool):
    self.name = name
    if name.split(":")[0] == "fashion_mnist":
      fashion_mnist.prepare_fashion_mnist(data_dir)
    try:
      self._builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      close = difflib.get_close_matches(name.split(":")[0], tfds.list_builders())
      hint = f" Did you mean {close}?" if close else ""
      raise ValueError(
          f"data.name={name!r} is neither a TFDS dataset nor an existing directory.{hint} "
          + _HOW_TO_SUPPLY.replace("NAME", "DATASET")) from None
    if not self._builder.is_prepared():
      if not download:
        raise ValueError(
            f"TFDS dataset {self._builder.info.full_name!r} is not prepared in "
            f"data_dir={self._builder.data_dir_root!r} (data.data_dir="
            f"{data_dir!r}) and data.download=False. "
            + _HOW_TO_SUPPLY.replace("NAME", name))
      self._builder.download_and_prepare()

    info = self._builder.info
    keys = info.supervised_keys
    if (not keys or len(keys) != 2 or not isinstance(keys[0], str) or
        not isinstance(info.features[keys[0]], tfds.features.Image) or
        not isinstance(info.features[keys[1]], tfds.features.ClassLabel)):
      raise ValueError(f"data.name={name!r}: expected a TFDS dataset with "
                       f"(image, class label) supervised keys, got {keys}.")
    self._image_key, label_key = keys
    self.class_names = tuple(info.features[label_key].names)
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
        shuffle_files=False, as_supervised=True,
        decoders={self._image_key: tfds.decode.SkipDecoding()},
        # The pipeline caches what it wants itself.
        read_config=tfds.ReadConfig(try_autocache=False))
    return ds.map(lambda image, label: {"image": image, "label": label})

  def skipped_images(self, split: str) -> tuple[str, ...]:
    del split
    return ()


@dataclasses.dataclass(frozen=True)
class _Scan:
  bad: tuple[str, ...]
  meta: SplitMeta


class FolderSource:
  """Images in ROOT/<split>/<class>/*.{jpg,jpeg,png}; labels: sorted classes.

  Every image of a split is decoded once, up front, so that undecodable files
  are found before training starts: with on_bad_image='fail' the first is an
  error naming it, with 'skip' they are all logged and left out of the split.
  """

  def __init__(self, root: str, on_bad_image: str):
    self.name = root
    root = os.path.expanduser(root)
    if not tf.io.gfile.isdir(root):
      raise ValueError(f"data.name={self.name!r} is not a directory. "
                       + _HOW_TO_SUPPLY.replace("NAME", "DATASET"))
    self._builder = tfds.ImageFolder(root)
    self._on_bad_image = on_bad_image
    self._scans: dict[str, _Scan] = {}
    self.class_names = tuple(self._builder.info.features["label"].names)
    self.channels = 3

  def _images(self, split: str) -> tf.data.Dataset:
    return self._builder.as_dataset(
        split=split, decoders={"image": tfds.decode.SkipDecoding()})

  def _scan(self, split: str) -> _Scan:
    if split in self._scans:
      return self._scans[split]
    if split not in self._builder.info.splits:
      raise ValueError(
          f"{split!r} is not a sub-folder of {self.name} (found: "
          f"{sorted(self._builder.info.splits)}); expected images in "
          f"{os.path.join(self.name, split)}/<class>/*.{{jpg,png}}")
    ds = self._images(split)
    paths = [p.decode() for p in ds.map(
        lambda ex: ex["image/filename"]).as_numpy_iterator()]
    # Dataset.ignore_errors drops exactly the files that fail to decode.
    decodable = ds.map(
        lambda ex: (ex["image/filename"],
                    tf.shape(preprocess.decode(ex["image"], self.channels))),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    shapes = {p.decode(): tuple(s)
              for p, s in decodable.ignore_errors().as_numpy_iterator()}
    bad = tuple(p for p in paths if p not in shapes)
    if bad and self._on_bad_image == "fail":
      raise ValueError(
          f"Cannot decode image {bad[0]} ({len(bad)} undecodable in "
          f"{os.path.join(self.name, split)}). Replace or delete it, or set "
          "data.on_bad_image='skip' to leave such files out.")
    if bad:
      logging.warning("Skipping %d undecodable image(s) in %s: %s", len(bad),
                      os.path.join(self.name, split), ", ".join(bad))
    distinct = set(shapes.values())
    meta = SplitMeta(
        num_examples=len(shapes),
        image_shape=distinct.pop() if len(distinct) == 1 else None,
        num_bytes=sum(tf.io.gfile.stat(p).length for p in shapes))
    self._scans[split] = _Scan(bad, meta)
    return self._scans[split]

  def meta(self, split: str) -> SplitMeta:
    return self._scan(split).meta

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    n = self.meta(split).num_examples
    return [len(range(i, n, process_count)) for i in range(process_count)]

  def read(self, split: str, process_index: int,
           process_count: int) -> tf.data.Dataset:
    bad = self._scan(split).bad
    ds = self._images(split)
    if bad:
      bad_paths = tf.constant(bad)
      ds = ds.filter(
          lambda ex: ~tf.reduce_any(tf.equal(ex["image/filename"], bad_paths)))
    ds = ds.shard(process_count, process_index)  # Files i, i+n, i+2n, ...
    return ds.map(lambda ex: {"image": ex["image"], "label": ex["label"]})

  def skipped_images(self, split: str) -> tuple[str, ...]:
    return self._scan(split).bad


Source = TfdsSource | FolderSource


@functools.lru_cache(maxsize=None)
def get_source(name: str, data_dir: str | None, download: bool,
               on_bad_image: str) -> Source:
  if is_folder(name):
    return FolderSource(name, on_bad_image)
  return TfdsSource(name, data_dir, download)


@functools.lru_cache(maxsize=8)
def load_table(source: Source, split: str, process_index: int,
               process_count: int, decoded: bool) -> dict[str, np.ndarray]:
  """A process's shard of a split in memory: images decoded or still encoded."""
  ds = source.read(split, process_index, process_count)
  if decoded:
    ds = ds.map(lambda ex: {**ex, "image": preprocess.decode(
        ex["image"], source.channels)}, num_parallel_calls=tf.data.AUTOTUNE)
  parts = list(ds.batch(1024).as_numpy_iterator())
  if not parts:
    raise ValueError(f"Split {split!r} of {source.name} has no examples for "
                     f"process {process_index} of {process_count}.")
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def table_bytes(meta: SplitMeta, process_count: int, decoded: bool) -> int:
  """Memory a process's shard takes in a table."""
  per_example = (math.prod(meta.image_shape) if decoded else
                 meta.num_bytes / max(meta.num_examples, 1))
  return int(math.ceil(meta.num_examples / process_count) * per_example)
