"""Input pipeline: config.data -> global jax.Array batches.

Each process reads its own shard of a split and builds its part of every batch
(global_batch_size // process_count examples); the parts become one global
jax.Array per field with jax.make_array_from_process_local_data.

Training is an endless stream of per-process positions p = epoch * n + i, where
position p holds example permutation_{seed, epoch}(i). Random augmentation is
keyed by (seed, process, step) for batched ops and by (seed, process, p) for
per-example ones, so step k's batch depends only on (seed, k): resuming at step
k starts the stream at p = k * local_batch and yields the same batches as the
run that was never interrupted.
"""
from collections.abc import Iterator
import dataclasses
import functools
import os
from typing import Callable

import jax
import ml_collections
import numpy as np
import tensorflow as tf

from vit_jax.data import config as config_lib
from vit_jax.data import preprocess as pp
from vit_jax.data import randaugment
from vit_jax.data import sources

# Keep TensorFlow off accelerators: they belong to JAX.
try:
  tf.config.set_visible_devices([], "GPU")
except RuntimeError:  # TF already initialised its devices.
  pass

_INT64_MAX = 2**63 - 1
# Tags that make the shuffle, augmentation, RandAugment and mixup randomness independent.
_SHUFFLE, _AUGMENT, _AUGMENT_BATCH, _MIXUP, _RANDAUG = 1, 2, 3, 4, 5

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  num_classes: int
  num_train_examples: int  # Whole train split, all processes together.
  num_eval_examples: int
  class_names: tuple[str, ...] = ()
  skipped_images: tuple[str, ...] = ()  # Image-folder files left out (see FolderSource).


def _source(cfg: ml_collections.ConfigDict) -> sources.Source:
  config_lib.validate(cfg)
  return sources.get_source(cfg.name, cfg.data_dir, cfg.download, cfg.on_bad_image,
                            cfg.train_split, cfg.allow_class_mismatch)


def _meta(source: sources.Source, cfg: ml_collections.ConfigDict,
          field: str) -> sources.SplitMeta:
  try:
    return source.meta(cfg[field])
  except sources.DataOptionError as e:  # Worded in the caller's terms, as its own template.
    raise sources.DataOptionError("{" + field + "}={split!r}: " + e.template, split=cfg[field],
                                  **e.values) from None
  except ValueError as e:
    raise sources.DataOptionError("{" + field + "}={value!r}: {detail}", value=cfg[field],
                                  detail=e) from None


def dataset_info(cfg: ml_collections.ConfigDict) -> DatasetInfo:
  """Sizes of the configured dataset (for steps <-> epochs and the head)."""
  source = _source(cfg)
  train, test = _meta(source, cfg, "train_split"), _meta(source, cfg, "eval_split")
  if len(source.class_names) < 2:
    raise sources.DataOptionError(
        "{name}={value!r} has {n} class{s} ({names}): a classifier needs two or more",
        value=cfg.name, n=len(source.class_names), s="" if len(source.class_names) == 1 else "es",
        names=", ".join(source.class_names) or "none")
  return DatasetInfo(
      num_classes=len(source.class_names),
      num_train_examples=train.num_examples,
      num_eval_examples=test.num_examples,
      class_names=source.class_names,
      skipped_images=(source.skipped_images(cfg.train_split) +
                      source.skipped_images(cfg.eval_split)))


def class_counts(cfg: ml_collections.ConfigDict) -> np.ndarray:
  """Examples per class of cfg.train_split: its labels read, no image decoded (checks that need
  them, such as few-shot's shots a class, come before any model runs)."""
  return _source(cfg).class_counts(cfg.train_split)


def _rng(key: tf.Tensor, *data) -> tf.Tensor:
  for d in data:
    key = tf.random.experimental.stateless_fold_in(key, tf.cast(d, tf.int64))
  return key


def _options(cfg: ml_collections.ConfigDict) -> tf.data.Options:
  options = tf.data.Options()
  options.deterministic = True
  # A small private pool leaves the cores to the JAX step.
  options.threading.private_threadpool_size = (
      cfg.threads or max(1, (os.cpu_count() or 2) // 2))
  options.threading.max_intra_op_parallelism = 1
  # Without the autotuner, AUTOTUNE parallelism is the private pool's size. The autotuner
  # only re-picks within it, and freeing an iterator joins its optimisation thread, which
  # took 9 to 60 s at the end of runs on 2 loaded cores.
  options.autotune.enabled = False
  return options


def _table_mode(cfg: ml_collections.ConfigDict, meta: sources.SplitMeta,
                process_count: int) -> str | None:
  """'decoded' or 'encoded' to hold the shard in memory, None to stream it."""
  if not cfg.cache:
    return None
  budget = cfg.cache_max_mb * 2**20
  if meta.image_shape and sources.table_bytes(meta, process_count, True) <= budget:
    return "decoded"
  # num_bytes is 0 where TFDS did not record it: then the size is unknown.
  if meta.num_bytes and sources.table_bytes(meta, process_count, False) <= budget:
    return "encoded"
  return None


def _fit(cfg: ml_collections.ConfigDict):
  """Crops and resizes one decoded image to image_size, so that images of
  different sizes can be batched."""
  def fn(image, rng):
    if cfg.train_crop == "inception":
      return pp.inception_crop(image[None], rng, cfg.image_size,
                               cfg.inception_area)[0]
    if cfg.train_crop == "random_crop":
      image = pp.random_crop(image[None], rng, cfg.crop_padding)[0]
    return pp.resize(image, cfg.image_size)
  return fn


def _augment(cfg: ml_collections.ConfigDict, fitted: bool):
  """Training preprocessing of a batch; cropped and resized if `fitted`.

  Unfitted batches hold equally sized images at their stored resolution; they
  are cropped before resizing, so that little images stay cheap.
  """
  def fn(batch, rng, randaug_rng):
    crop_rng, flip_rng = tf.unstack(
        tf.random.experimental.stateless_split(rng, 2))
    images = batch["image"]
    if cfg.train_crop == "inception" and not fitted:
      images = pp.inception_crop(images, crop_rng, cfg.image_size,
                                 cfg.inception_area)
    elif cfg.train_crop == "random_crop" and not fitted:
      images = pp.random_crop(images, crop_rng, cfg.crop_padding)
    if cfg.flip:
      images = pp.random_flip(images, flip_rng)
    images = pp.gray_to_rgb(pp.resize(images, cfg.image_size))
    if cfg.randaug_layers:
      images = randaugment.randaugment(images, randaug_rng, cfg.randaug_layers,
                                       cfg.randaug_magnitude, cfg.randaug_policy)
    # The affine map of evaluation (value range or mean and std), on the augmented images.
    return {"image": pp.apply_preprocessing(images, pp.Preprocessing.from_data_config(cfg)),
            "label": tf.cast(batch["label"], tf.int32)}
  return fn


def _eval_preprocess(cfg: ml_collections.ConfigDict, preprocessing: pp.Preprocessing):
  def fn(example):
    return {"image": pp.apply_preprocessing(example["image"], preprocessing, cfg.image_size),
            "label": tf.cast(example["label"], tf.int32),
            "mask": tf.constant(1.0)}
  return fn


def _decoder(source: sources.Source, mode: str | None):
  if mode == "decoded":
    return lambda example: example
  return lambda example: {
      **example, "image": pp.decode(example["image"], source.channels)}


def _epochs(first_epoch: int, one_epoch) -> tf.data.Dataset:
  return tf.data.Dataset.range(first_epoch, _INT64_MAX).flat_map(pp.traced(one_epoch))


def _shuffled_epochs(source: sources.Source, cfg: ml_collections.ConfigDict, mode: str | None,
                     key: tf.Tensor, first_epoch: int, process_index: int,
                     process_count: int, n: int) -> tuple[tf.data.Dataset, Callable]:
  """The shard's examples epoch after epoch from `first_epoch`, each epoch in its own order,
  and the function that turns an element into an example (an index into the table, or the
  streamed example itself)."""
  if mode:  # In memory: index_shuffle gives each epoch's exact permutation.
    table = sources.load_table(source, cfg.train_split, process_index,
                               process_count, mode == "decoded")
    table = {k: tf.constant(v) for k, v in table.items()}
    ds = _epochs(first_epoch, lambda epoch: tf.data.Dataset.from_tensor_slices(
        tf.random.experimental.index_shuffle(
            tf.range(n, dtype=tf.int64), _rng(key, _SHUFFLE, epoch), n - 1)))
    return ds, lambda i: {k: tf.gather(v, i) for k, v in table.items()}
  # Streamed from disk through a shuffle buffer seeded per epoch.
  examples = source.read(cfg.train_split, process_index, process_count)
  ds = _epochs(first_epoch, lambda epoch: examples.shuffle(
      cfg.shuffle_buffer, seed=tf.random.stateless_uniform(
          [], _rng(key, _SHUFFLE, epoch), minval=None, maxval=None,
          dtype=tf.int64)))
  return ds, lambda example: example


def _train_dataset(cfg: ml_collections.ConfigDict, *, local_batch: int,
                   seed: int, start_step: int, process_index: int,
                   process_count: int) -> tf.data.Dataset:
  """This process's endless stream of augmented local batches."""
  source = _source(cfg)
  meta = _meta(source, cfg, "train_split")
  n = source.shard_sizes(cfg.train_split, process_count)[process_index]
  if n == 0:
    raise sources.DataOptionError("{train_split}={value!r} has no examples for process "
                                  "{index} of {count}.", value=cfg.train_split,
                                  index=process_index, count=process_count)
  key = tf.constant([seed, process_index], tf.int64)
  start = start_step * local_batch  # Position of this run's first example.
  mode = _table_mode(cfg, meta, process_count)
  ds, gather = _shuffled_epochs(source, cfg, mode, key, start // n, process_index,
                                process_count, n)
  # Skip what an interrupted run consumed, before any decoding.
  ds = ds.skip(start % n)

  if mode == "decoded":  # Equal shapes: gather and augment whole batches.
    ds = ds.batch(local_batch, drop_remainder=True).map(pp.traced(gather))
  else:
    decode, fit = _decoder(source, mode), _fit(cfg)
    def fit_one(position, example):
      example = decode(gather(example))
      return {**example, "image": fit(example["image"],
                                      _rng(key, _AUGMENT, position))}
    ds = ds.enumerate(start).map(pp.traced(fit_one), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(local_batch, drop_remainder=True)

  augment, num_classes = _augment(cfg, fitted=mode != "decoded"), len(
      source.class_names)
  def finish(step, batch):
    batch = augment(batch, _rng(key, _AUGMENT_BATCH, step),
                    _rng(key, _RANDAUG, step))
    if cfg.mixup_alpha > 0:
      batch = pp.mixup(batch, _rng(key, _MIXUP, step), cfg.mixup_alpha,
                       num_classes)
    return batch
  ds = ds.enumerate(start_step).map(pp.traced(finish), num_parallel_calls=tf.data.AUTOTUNE)
  return ds.prefetch(cfg.prefetch).with_options(_options(cfg))


def _eval_dataset(cfg: ml_collections.ConfigDict, *, local_batch: int,
                  process_index: int, process_count: int,
                  preprocessing: pp.Preprocessing | None = None
                  ) -> tuple[tf.data.Dataset, int]:
  """This process's local batches of one eval pass, and their number.

  Every process yields the same number of batches: the largest shard's,
  padded with mask=0 examples. `preprocessing`: a checkpoint's, in place of the config's.
  """
  source = _source(cfg)
  meta = _meta(source, cfg, "eval_split")
  sizes = source.shard_sizes(cfg.eval_split, process_count)
  num_batches = -(-max(sizes) // local_batch)
  mode = _table_mode(cfg, meta, process_count)
  if mode and sizes[process_index]:
    ds = tf.data.Dataset.from_tensor_slices(sources.load_table(
        source, cfg.eval_split, process_index, process_count,
        mode == "decoded"))
  else:
    ds = source.read(cfg.eval_split, process_index, process_count)
  decode = _decoder(source, mode)
  preprocess = _eval_preprocess(
      cfg, preprocessing or pp.Preprocessing.from_data_config(cfg))
  ds = ds.map(pp.traced(lambda ex: preprocess(decode(ex))),
              num_parallel_calls=tf.data.AUTOTUNE)
  # A label is a class, or a set of right classes as a multi-hot vector (ImageNet ReaL).
  padding = {"image": tf.zeros([cfg.image_size, cfg.image_size, 3]),
             "label": tf.zeros(ds.element_spec["label"].shape, tf.int32),
             "mask": tf.constant(0.0)}
  ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat())
  ds = ds.take(num_batches * local_batch).batch(local_batch)
  return ds.prefetch(cfg.prefetch).with_options(_options(cfg)), num_batches


def _local_batch_size(global_batch_size: int,
                      sharding: jax.sharding.NamedSharding) -> int:
  if global_batch_size % jax.process_count():
    raise ValueError(f"global_batch_size={global_batch_size} is not divisible "
                     f"by the number of processes ({jax.process_count()}).")
  try:
    sharding.shard_shape((global_batch_size,))
  except ValueError as e:
    raise ValueError(
        f"global_batch_size={global_batch_size} does not split evenly over the "
        f"batch sharding {sharding.spec} of mesh {dict(sharding.mesh.shape)}: "
        f"{e}") from None
  return global_batch_size // jax.process_count()


def _global_batches(ds: tf.data.Dataset,
                    sharding: jax.sharding.NamedSharding) -> Iterator[Batch]:
  to_global = functools.partial(jax.make_array_from_process_local_data,
                                sharding)
  for batch in ds.as_numpy_iterator():
    yield {k: to_global(v) for k, v in batch.items()}


def train_iterator(cfg: ml_collections.ConfigDict, *, global_batch_size: int,
                   sharding: jax.sharding.NamedSharding, seed: int,
                   start_step: int = 0) -> Iterator[Batch]:
  """Endless shuffled, augmented training batches from step `start_step` on.

  Batches: 'image' float32 (B, H, W, 3) normalised by data.value_range (or data.mean and
  data.std); 'label' int32
  (B,), or float32 (B, num_classes) soft targets with mixup.
  """
  if start_step < 0:
    raise ValueError(f"start_step={start_step} must be >= 0.")
  num_shards = cfg.num_shards or jax.process_count()
  local_batch = _local_batch_size(global_batch_size, sharding)
  per_process, rest = divmod(num_shards, jax.process_count())
  if rest or local_batch % per_process:
    raise ValueError(
        f"data.num_shards={num_shards} must be a multiple of the {jax.process_count()} "
        f"processes and divide the per-process batch {local_batch}.")
  streams = [_train_dataset(
      cfg, local_batch=local_batch // per_process, seed=seed, start_step=start_step,
      process_index=jax.process_index() * per_process + j, process_count=num_shards)
             for j in range(per_process)]
  ds = streams[0] if per_process == 1 else tf.data.Dataset.zip(tuple(streams)).map(
      pp.traced(lambda *parts: {k: tf.concat([p[k] for p in parts], 0) for k in parts[0]}))
  return _global_batches(ds, sharding)


def eval_iterator(cfg: ml_collections.ConfigDict, *, global_batch_size: int,
                  sharding: jax.sharding.NamedSharding,
                  preprocessing: pp.Preprocessing | None = None) -> Iterator[Batch]:
  """One pass over data.eval_split: every example exactly once, in order, preprocessed by
  `pp.apply_preprocessing` as the config's evaluation (`preprocessing`: as a checkpoint's).

  The last batches are padded; 'mask' (B,) float32 is 1 for real examples.
  """
  ds, _ = _eval_dataset(
      cfg, local_batch=_local_batch_size(global_batch_size, sharding),
      process_index=jax.process_index(), process_count=jax.process_count(),
      preprocessing=preprocessing)
  return _global_batches(ds, sharding)
