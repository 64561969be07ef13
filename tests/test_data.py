"""vit_jax.data's API (data.dataset_info, train_iterator, eval_iterator; pipeline.py): the data
config's checks, sources (Fashion-MNIST through TFDS, image folders), train/eval iterators
(preprocessing ops: test_preprocess.py; Debian's Fashion-MNIST files: test_fashion_mnist.py)."""
import collections
import hashlib
import os
import re

import jax
import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax import data
from vit_jax.data import config as data_config
from vit_jax.data import pipeline
from vit_jax.data import preprocess as pp
from vit_jax.data import sources, tasks


BATCH = 64
# timm's / transformers' ImageNet normalisation, as the Hub's checkpoints state it.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _real_config(dataset, **overrides):
  """`dataset` (Fashion-MNIST, the conftest fixture) with small splits."""
  cfg = data.get_data_config()
  cfg.name, cfg.data_dir = dataset
  cfg.train_split = "train[:1000]"  # A 1,000-example epoch: ~16 steps.
  cfg.eval_split = "test[:1001]"  # Not a multiple of BATCH.
  cfg.shuffle_buffer = 1000
  cfg.update(overrides)
  return cfg


def _sharding():
  mesh = jax.sharding.Mesh(jax.devices(), ("data",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def _take(ds, n):
  return [jax.tree.map(np.asarray, b) for _, b in zip(range(n), ds.as_numpy_iterator())]


def _train(cfg, seed=0, start_step=0, process_index=0, process_count=1):
  return pipeline._train_dataset(
      cfg, local_batch=BATCH, seed=seed, start_step=start_step,
      process_index=process_index, process_count=process_count)


def _digest(image) -> str:
  """Identity of a preprocessed eval image (value range [-1, 1], RGB)."""
  pixels = np.round((np.asarray(image)[..., 0] + 1) * 127.5).astype(np.uint8)
  return hashlib.sha1(pixels.tobytes()).hexdigest()


def _real_examples(batches):
  return [(_digest(image), int(label))
          for b in batches
          for image, label, m in zip(b["image"], b["label"], b["mask"]) if m]


def _write_folder(root, bad=(), uniform=False):
  """root/{train,test}/{cat,dog}/*.png and *.jpg (varied sizes unless `uniform`), plus files
  in `bad`."""
  rng = np.random.default_rng(0)
  for split, count in (("train", 6), ("test", 5)):
    for label in ("cat", "dog"):
      os.makedirs(root / split / label)
      for i in range(count):
        image = rng.integers(0, 256, (20 + (not uniform) * i, 24, 3), np.uint8)
        encoded = tf.io.encode_png(image) if i % 2 else tf.io.encode_jpeg(image)
        suffix = ".png" if i % 2 else ".jpg"
        (root / split / label / f"{i}{suffix}").write_bytes(encoded.numpy())
  for path, content in bad:
    (root / path).write_bytes(content)


# --- config -------------------------------------------------------------


def test_config_errors_name_the_field():
  cfg = data.get_data_config()
  cfg.train_crop = "foo"
  with pytest.raises(ValueError, match=r"config.data.train_crop='foo': expected one of"):
    data.dataset_info(cfg)
  cfg = data.get_data_config()
  cfg.value_range = (1.0, -1.0)
  with pytest.raises(ValueError, match=r"data.value_range"):
    data.dataset_info(cfg)
  cfg = data.get_data_config()
  cfg.flipp = True
  with pytest.raises(ValueError, match=r"config.data.flipp=.*unknown field; did you mean flip"):
    data.dataset_info(cfg)
  for field, value, message in (
      ("randaug_layers", -1, r"config.data.randaug_layers=-1: must be an integer >= 0"),
      ("randaug_magnitude", 31.0, r"config.data.randaug_magnitude=31.0: must be a number in \[0, 30\]"),
      ("randaug_policy", "timm", r"config.data.randaug_policy='timm': expected one of")):
    cfg = data.get_data_config()
    cfg[field] = value
    with pytest.raises(ValueError, match=message):
      data.dataset_info(cfg)


def test_unknown_tfds_name(tmp_path):
  cfg = data.get_data_config()
  cfg.name, cfg.data_dir = "mnistt", str(tmp_path)
  with pytest.raises(ValueError, match=r"neither a TFDS dataset.*'mnist'.*data_dir"):
    data.dataset_info(cfg)


def test_unprepared_tfds_dataset_says_how_to_supply_it(tmp_path):
  cfg = data.get_data_config()
  cfg.name, cfg.data_dir = "cifar10", str(tmp_path)
  with pytest.raises(ValueError, match=r"not prepared.*data.data_dir.*image folder"):
    data.dataset_info(cfg)


# --- train iterator (Fashion-MNIST, the `dataset` fixture) --------------


@pytest.mark.parametrize("overrides", [
    {},  # Decoded in memory, batched augmentation.
    {"train_crop": "inception", "mixup_alpha": 0.2, "image_size": 16},
    {"cache": False},  # Streamed from disk through a shuffle buffer.
    {"randaug_layers": 2, "randaug_magnitude": 15.0},
], ids=["in_memory", "inception_mixup", "streamed", "randaug"])
def test_train_is_deterministic_and_resumable(dataset, overrides):
  cfg = _real_config(dataset, **overrides)
  run = _take(_train(cfg, seed=1), 20)  # Crosses the first epoch boundary.
  again = _take(_train(_real_config(dataset, threads=4, **overrides), seed=1), 20)
  resumed = _take(_train(cfg, seed=1, start_step=14), 6)
  other_seed = _take(_train(cfg, seed=2), 1)
  for a, b in zip(run, again):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  for a, b in zip(run[14:], resumed):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(run[0]["image"], other_seed[0]["image"])
  size = cfg.image_size
  assert run[0]["image"].shape == (BATCH, size, size, 3)
  assert run[0]["image"].dtype == np.float32
  assert -1 <= run[0]["image"].min() < run[0]["image"].max() <= 1
  if cfg.mixup_alpha:
    assert run[0]["label"].shape == (BATCH, 10)
    np.testing.assert_allclose(run[0]["label"].sum(-1), 1, rtol=1e-5)
  else:
    assert run[0]["label"].dtype == np.int32


def test_train_epoch_is_a_permutation(dataset):
  cfg = _real_config(dataset, train_split="train[:640]", train_crop="resize",
                     flip=False)
  epoch = _take(_train(cfg), 10)
  seen = collections.Counter(_digest(i) for b in epoch for i in b["image"])
  raw = tfds.load(dataset[0], data_dir=dataset[1], split="train[:640]",
                  as_supervised=True, download=False)
  expected = collections.Counter(
      hashlib.sha1(image[..., 0].tobytes()).hexdigest()
      for image, _ in tfds.as_numpy(raw))
  assert seen == expected


def test_train_iterator_gives_global_arrays(dataset):
  sharding = _sharding()
  it = data.train_iterator(_real_config(dataset), global_batch_size=BATCH,
                           sharding=sharding, seed=0)
  batch = next(it)
  assert isinstance(batch["image"], jax.Array)
  assert batch["image"].shape == (BATCH, 28, 28, 3)
  assert batch["image"].sharding == sharding
  assert len(batch["label"].addressable_shards) == jax.device_count()
  with pytest.raises(ValueError, match="global_batch_size=60"):
    data.train_iterator(_real_config(dataset), global_batch_size=60,
                        sharding=sharding, seed=0)


# --- eval iterator ------------------------------------------------------


def test_eval_covers_every_example_once(dataset):
  cfg = _real_config(dataset)
  batches = [jax.tree.map(np.asarray, b) for b in data.eval_iterator(
      cfg, global_batch_size=BATCH, sharding=_sharding())]
  assert len(batches) == -(-1001 // BATCH)
  masks = np.concatenate([b["mask"] for b in batches])
  np.testing.assert_array_equal(masks, np.arange(len(masks)) < 1001)
  raw = tfds.load(dataset[0], data_dir=dataset[1], split="test[:1001]",
                  as_supervised=True, download=False)
  expected = collections.Counter(
      (hashlib.sha1(image[..., 0].tobytes()).hexdigest(), int(label))
      for image, label in tfds.as_numpy(raw))
  assert collections.Counter(_real_examples(batches)) == expected
  again = [jax.tree.map(np.asarray, b) for b in data.eval_iterator(
      cfg, global_batch_size=BATCH, sharding=_sharding())]
  assert _real_examples(again) == _real_examples(batches)  # A fresh pass.


def _raw_images(dataset, split: str) -> np.ndarray:
  raw = tfds.load(dataset[0], data_dir=dataset[1], split=split, as_supervised=True,
                  download=False)
  return np.stack([image for image, _ in tfds.as_numpy(raw)])


def test_eval_and_train_normalise_by_mean_and_std_as_numpy(dataset):
  mean, std = np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)
  cfg = _real_config(dataset, mean=IMAGENET_MEAN, std=IMAGENET_STD, eval_split="test[:64]",
                     train_split="train[:64]", train_crop="resize", flip=False)
  batch = next(data.eval_iterator(cfg, global_batch_size=BATCH, sharding=_sharding()))
  by_hand = lambda gray: (np.repeat(gray, 3, -1) / 255.0 - mean) / std  # noqa: E731
  want = by_hand(_raw_images(dataset, "test[:64]").astype(np.float64))
  np.testing.assert_allclose(np.asarray(batch["image"]), want, atol=1e-5, rtol=0)
  # Training's batch is the 64 train images in some order, normalised the same way.
  want = by_hand(_raw_images(dataset, "train[:64]").astype(np.float64))
  (train,) = _take(_train(cfg), 1)
  for image in train["image"]:
    assert np.abs(want - image).max(axis=(1, 2, 3)).min() < 1e-5


def test_config_mean_and_std_are_checked():
  for fields, message in (
      (dict(mean=IMAGENET_MEAN), r"config.data.std=None: give data.mean and data.std together"),
      (dict(mean=(0.5, 0.5), std=(0.5, 0.5)), r"config.data.mean=\(0.5, 0.5\): must be three"),
      (dict(mean=IMAGENET_MEAN, std=(0.2, 0.0, 0.2)), r"config.data.std=.*must be > 0"),
      (dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, value_range=(-1.0, 1.0)),
       r"config.data.value_range=\(-1.0, 1.0\): leave it None where data.mean")):
    cfg = data.get_data_config()
    cfg.update(fields)
    with pytest.raises(ValueError, match=message):
      data.dataset_info(cfg)


def _by_tf_resize(images: np.ndarray, size: int, crop: str, method: str) -> np.ndarray:
  """What the evaluation should give: tf.image.resize's own `method` (bicubic clipped)."""
  if crop == "central_crop":  # Square images, big_vision's resize_small and central_crop.
    side = round(size / 0.875)
    resized = tf.image.resize(images, [side, side], method, antialias=True)
    top = (side - size) // 2
    resized = resized[:, top:top + size, top:top + size]
  else:
    resized = tf.image.resize(images, [size, size], method, antialias=size < images.shape[1])
  resized = tf.clip_by_value(resized, 0, 255) if method == "bicubic" else resized
  return np.repeat(resized.numpy(), 3, -1)


@pytest.mark.parametrize("crop", ["resize", "central_crop"])
def test_bicubic_and_bilinear_differ_and_are_tf_resize_own(dataset, crop):
  raw = _raw_images(dataset, "test[:8]")
  for size in (40, 20):  # Enlarged and shrunk.
    cfg = _real_config(dataset, eval_split="test[:8]", image_size=size)
    got = {}
    for method in pp.INTERPOLATIONS:
      # value_range (0, 255): the model's input is the resized pixels themselves.
      preprocessing = pp.Preprocessing(value_range=(0.0, 255.0), crop=crop,
                                       interpolation=method)
      ds, _ = pipeline._eval_dataset(cfg, local_batch=8, process_index=0, process_count=1,
                                     preprocessing=preprocessing)
      got[method] = _take(ds, 1)[0]["image"]
      np.testing.assert_allclose(got[method], _by_tf_resize(raw, size, crop, method),
                                 atol=1e-4, rtol=0)
    assert np.abs(got["bicubic"] - got["bilinear"]).max() > 5


@pytest.mark.parametrize("cache", [True, False])
def test_two_processes_partition_the_eval_split(dataset, cache):
  cfg = _real_config(dataset, cache=cache)
  per_process = []
  for index in range(2):
    ds, num_batches = pipeline._eval_dataset(
        cfg, local_batch=BATCH // 2, process_index=index, process_count=2)
    batches = _take(ds, 1000)
    assert len(batches) == num_batches == -(-501 // (BATCH // 2))
    per_process.append(_real_examples(batches))
  assert [len(p) for p in per_process] == [501, 500]
  whole, _ = pipeline._eval_dataset(cfg, local_batch=BATCH, process_index=0,
                                    process_count=1)
  assert collections.Counter(per_process[0] + per_process[1]) == (
      collections.Counter(_real_examples(_take(whole, 1000))))


@pytest.mark.parametrize("source", ["fashion_mnist", "folder"])
def test_in_memory_eval_pass_is_the_streamed_one(dataset, tmp_path, source):
  """A decoded table (its images decoded 1,024 to a call) holds the split's images as streaming
  decodes them one by one, in the same order."""
  if source == "folder":
    _write_folder(tmp_path, uniform=True)  # PNG and JPEG, all 20x24: held decoded.
    cfg = _real_config(dataset, name=str(tmp_path), data_dir=None, image_size=16)
  else:
    cfg = _real_config(dataset, eval_split="test[:1500]")  # A batch of 1,024 and the rest.
  meta = pipeline._meta(pipeline._source(cfg), cfg, "eval_split")
  assert pipeline._table_mode(cfg, meta, 1) == "decoded"
  passes = [_take(pipeline._eval_dataset(_real_config(dataset, **{**cfg, "cache": cache}),
                                         local_batch=BATCH, process_index=0,
                                         process_count=1)[0], 1000)
            for cache in (True, False)]
  assert sum(int(b["mask"].sum()) for b in passes[0]) == meta.num_examples
  assert len(passes[0]) == len(passes[1])
  for in_memory, streamed in zip(*passes):
    jax.tree.map(np.testing.assert_array_equal, in_memory, streamed)


def test_two_processes_train_on_disjoint_shards(dataset):
  cfg = _real_config(dataset, train_split="train[:256]", train_crop="resize",
                     flip=False)
  shards = [{_digest(i) for b in _take(_train(cfg, process_index=p, process_count=2), 2)
             for i in b["image"]} for p in range(2)]
  assert len(shards[0]) == len(shards[1]) == 128 and not shards[0] & shards[1]


def test_dataset_info(dataset):
  info = data.dataset_info(_real_config(dataset, train_split="train"))
  assert (info.num_classes, info.num_train_examples, info.num_eval_examples) == (
      10, 60000, 1001)


# --- image folders ------------------------------------------------------


def test_image_folder_skips_bad_images_and_reports_them(tmp_path, caplog):
  _write_folder(tmp_path, bad=[("train/cat/broken.png", b"not an image"),
                               ("test/dog/truncated.jpg", b"\xff\xd8\xff\xe0")])
  cfg = data.get_data_config()
  cfg.update(name=str(tmp_path), on_bad_image="skip", image_size=16,
             train_crop="inception")
  info = data.dataset_info(cfg)
  assert info.class_names == ("cat", "dog")
  assert (info.num_train_examples, info.num_eval_examples) == (12, 10)
  assert sorted(os.path.basename(p) for p in info.skipped_images) == [
      "broken.png", "truncated.jpg"]
  assert "broken.png" in caplog.text and "Skipping 1 file(s)" in caplog.text
  assert "1 undecodable" in caplog.text

  batches = [jax.tree.map(np.asarray, b) for b in data.eval_iterator(
      cfg, global_batch_size=8, sharding=_sharding())]
  assert sum(b["mask"].sum() for b in batches) == 10
  assert sorted(l for b in batches for l, m in zip(b["label"], b["mask"]) if m) == (
      [0] * 5 + [1] * 5)
  train = _take(_train(cfg), 3)  # Batch 64 > 12 images: several epochs.
  assert train[0]["image"].shape == (BATCH, 16, 16, 3)
  assert collections.Counter(train[0]["label"][:12].tolist()) == {0: 6, 1: 6}


def test_image_folder_fails_on_bad_image_naming_it(tmp_path):
  _write_folder(tmp_path, bad=[("train/dog/broken.png", b"not an image")])
  cfg = data.get_data_config()
  cfg.update(name=str(tmp_path))
  with pytest.raises(ValueError, match=r"Cannot decode image .*train/dog/broken\.png"):
    data.dataset_info(cfg)


def test_image_folder_split_must_exist(tmp_path):
  _write_folder(tmp_path)
  cfg = data.get_data_config()
  cfg.update(name=str(tmp_path), eval_split="val")
  with pytest.raises(ValueError, match=r"data.eval_split='val'.*not a sub-folder"):
    data.dataset_info(cfg)


def _folder_config(root, **kw):
  cfg = data.get_data_config()
  cfg.update(name=str(root), image_size=16, **kw)
  return cfg


def test_image_folder_empty_class_folder_is_an_error(tmp_path):
  _write_folder(tmp_path)
  os.makedirs(tmp_path / "train" / "emu")
  os.makedirs(tmp_path / "test" / "emu")
  with pytest.raises(ValueError, match=r"class folders of the splits differ: test/emu \(empty\), "
                     r"train/emu \(empty\).*data.allow_class_mismatch=True"):
    data.dataset_info(_folder_config(tmp_path))


def test_an_image_folder_of_one_class_is_refused(tmp_path):
  """A one-class "classifier" would report 100% accuracy on anything."""
  _write_folder(tmp_path)
  for split in ("train", "test"):
    for f in (tmp_path / split / "dog").iterdir():
      f.unlink()
    (tmp_path / split / "dog").rmdir()
  with pytest.raises(ValueError, match=re.escape(
      f"data.name={str(tmp_path)!r} has 1 class (cat): a classifier needs two or more")):
    data.dataset_info(_folder_config(tmp_path))


def test_image_folder_class_only_in_test_is_an_error_unless_allowed(tmp_path, caplog):
  _write_folder(tmp_path)
  os.makedirs(tmp_path / "test" / "emu")
  (tmp_path / "test" / "emu" / "0.png").write_bytes(
      tf.io.encode_png(np.zeros((8, 8, 3), np.uint8)).numpy())
  with pytest.raises(ValueError, match=r"test/emu \(not in train\).*allow_class_mismatch"):
    data.dataset_info(_folder_config(tmp_path))

  cfg = _folder_config(tmp_path, allow_class_mismatch=True)
  info = data.dataset_info(cfg)
  assert info.class_names == ("cat", "dog") and info.num_eval_examples == 10
  assert [os.path.relpath(p, tmp_path) for p in info.skipped_images] == ["test/emu/0.png"]
  assert "test/emu (not in train)" in caplog.text and "1 of a class not in 'train'" in caplog.text
  assert _take(_train(cfg), 1)[0]["image"].shape == (BATCH, 16, 16, 3)
  cfg = ml_collections.ConfigDict({**cfg.to_dict(), "allow_class_mismatch": 1})
  with pytest.raises(ValueError, match=r"data.allow_class_mismatch=1: must be True or False"):
    data.dataset_info(cfg)


def test_image_folder_reads_every_format_tf_decodes_and_reports_the_rest(tmp_path, caplog):
  from PIL import Image
  _write_folder(tmp_path)
  image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (16, 16, 3), np.uint8))
  for fmt in ("bmp", "gif", "webp", "tif"):
    image.save(tmp_path / "train" / "cat" / f"extra.{fmt}")
  image.save(tmp_path / "train" / "stray.png")  # Not in a class folder.
  cfg = _folder_config(tmp_path, on_bad_image="skip")
  info = data.dataset_info(cfg)
  assert info.num_train_examples == 12 + 3  # .bmp, .gif, .webp; TF decodes no TIFF.
  assert sorted(os.path.basename(p) for p in info.skipped_images) == ["extra.tif", "stray.png"]
  assert "Skipping 2 file(s)" in caplog.text and "1 undecodable (e.g. " in caplog.text
  assert "1 not in a class folder (e.g. " in caplog.text
  labels = np.concatenate([b["label"][b["mask"] > 0] for b in data.eval_iterator(
      _folder_config(tmp_path, on_bad_image="skip", eval_split="train"), global_batch_size=8,
      sharding=_sharding())])
  assert collections.Counter(labels.tolist()) == {0: 9, 1: 6}


def test_image_folder_split_with_no_decodable_image_is_named_empty(tmp_path):
  _write_folder(tmp_path)
  for path in (tmp_path / "train").glob("*/*"):
    path.write_bytes(b"not an image")
  with pytest.raises(ValueError, match=r"data.train_split='train': split folder .*/train is "
                     r"empty: no decodable images \(12 file\(s\) skipped\)"):
    data.dataset_info(_folder_config(tmp_path, on_bad_image="skip"))


@pytest.mark.parametrize("cache,randaug", [(True, 0), (False, 0), (True, 2)],
                         ids=["in_memory", "streamed", "in_memory_randaug"])
def test_image_folder_resume_and_process_shards(tmp_path, cache, randaug):
  """Needs no downloaded data: a fresh clone runs it."""
  _write_folder(tmp_path)
  cfg = data.get_data_config()
  cfg.update(name=str(tmp_path), image_size=16, cache=cache, shuffle_buffer=4,
             randaug_layers=randaug, randaug_magnitude=15.0)
  train = lambda **kw: pipeline._train_dataset(
      cfg, local_batch=8, seed=3, process_index=0, process_count=1, **kw)
  run, resumed = _take(train(start_step=0), 8), _take(train(start_step=5), 3)
  for a, b in zip(run[5:], resumed):  # 12 images: an epoch is 1.5 steps.
    jax.tree.map(np.testing.assert_array_equal, a, b)
  shards = [_real_examples(_take(pipeline._eval_dataset(
      cfg, local_batch=4, process_index=i, process_count=2)[0], 100)) for i in range(2)]
  whole = _real_examples(_take(pipeline._eval_dataset(
      cfg, local_batch=4, process_index=0, process_count=1)[0], 100))
  assert [len(s) for s in shards] == [5, 5] and len(whole) == 10
  assert collections.Counter(shards[0] + shards[1]) == collections.Counter(whole)


@pytest.mark.parametrize("split, data_dir", [
    ("train[:1000]", "absolute"), ("test[90%:]", "absolute"), ("train[59990:]", "absolute"),
    ("test[90%:]", "relative")])
def test_class_counts_of_a_tfds_split_are_those_of_its_labels(dataset, split, data_dir):
  """data.class_counts parses a TFDS split's records for their label alone (few-shot's check
  before work, on splits of any size): the counts of the labels tfds.load gives, with
  data.data_dir as given (`--data_dir=../data` read its files at ../data/NAME/V/../data/...)."""
  cfg = data.get_data_config()
  cfg.name, cfg.data_dir = dataset
  if data_dir == "relative":
    cfg.data_dir = os.path.relpath(dataset[1])
  cfg.train_split = split
  raw = tfds.load(dataset[0], data_dir=dataset[1], split=split, as_supervised=True,
                  download=False)
  labels = np.array([label for _, label in tfds.as_numpy(raw)])
  np.testing.assert_array_equal(data.class_counts(cfg), np.bincount(labels, minlength=10))


# --- sources: the kinds of data.name ----------------------------------------


# The Protocol's members: what every kind of source has, and all the pipeline may use.
_MEMBERS = {n for n in vars(sources.Source) if not n.startswith("_")} | set(
    sources.Source.__annotations__)


def _fashion_task() -> tasks.Task:
  """A transfer task on the Fashion-MNIST the tests build: data.name `task:test/fashion`."""
  return tasks.Task(name="test/fashion", suite="test", group="test", tfds_name="fashion_mnist",
                    num_classes=10, train="train", test="test", minitrain="train[:800]",
                    minival="train[800:1000]", steps=1, lr_grid=(0.01,),
                    label=tasks.Label(lambda f: f["label"], "label"))


def test_every_kind_of_source_keeps_the_contract(dataset, tmp_path, monkeypatch):
  """Each row of sources.KINDS claims a name of its kind and opens a Source with every member
  of the Protocol, their signatures its own and their answers consistent: sizes, shards,
  class counts and the labels read."""
  import inspect
  monkeypatch.setitem(tasks.TASKS, "test/fashion", _fashion_task())
  _write_folder(tmp_path)
  names = {"folder": (str(tmp_path), "test"), "task": ("task:test/fashion", "test[:50]"),
           "tfds": ("fashion_mnist", "test[:50]")}
  assert sorted(names) == sorted(sources.KINDS), "give the new kind a name here"
  methods = _MEMBERS - set(sources.Source.__annotations__) - {"class_names"}
  for kind, (name, split) in names.items():
    assert sources.kind_of(name) == kind
    source = sources.get_source(name, dataset[1], False, "fail")
    assert isinstance(source.name, str) and source.channels in (1, 3), kind
    for method in methods:
      want = list(inspect.signature(getattr(sources.Source, method)).parameters)[1:]
      assert list(inspect.signature(getattr(source, method)).parameters) == want, (kind, method)
    meta, counts = source.meta(split), source.class_counts(split)
    assert sum(source.shard_sizes(split, 3)) == meta.num_examples == counts.sum(), kind
    assert len(counts) == len(source.class_names) == (2 if kind == "folder" else 10), kind
    labels = [int(e["label"]) for e in source.read(split, 0, 1).as_numpy_iterator()]
    np.testing.assert_array_equal(np.bincount(labels, minlength=len(counts)), counts)
    assert source.skipped_images(split) == (), kind


class _ProtocolOnly:
  """A source that lets the pipeline use the members of sources.Source and no other."""

  def __init__(self, source):
    self._source = source

  def __getattr__(self, name):
    if name not in _MEMBERS:
      raise AttributeError(f"the pipeline used {name}, which sources.Source lacks")
    return getattr(self._source, name)


@pytest.mark.parametrize("cache", [True, False], ids=["in_memory", "streamed"])
def test_the_pipeline_uses_no_member_beyond_the_protocol(dataset, monkeypatch, cache):
  """dataset_info, class_counts, a train batch and an eval pass, on a source that has the
  Protocol's members alone: what CONTRIBUTING says a new kind needs is all the pipeline asks."""
  real = pipeline._source
  monkeypatch.setattr(pipeline, "_source", lambda cfg: _ProtocolOnly(real(cfg)))
  cfg = _real_config(dataset, train_split="train[:128]", eval_split="test[:70]", cache=cache)
  assert data.dataset_info(cfg).num_classes == 10 and data.class_counts(cfg).sum() == 128
  assert _take(_train(cfg), 1)[0]["image"].shape[0] == BATCH
  batches = list(data.eval_iterator(cfg, global_batch_size=BATCH, sharding=_sharding()))
  assert sum(float(np.asarray(b["mask"]).sum()) for b in batches) == 70


@pytest.mark.parametrize("name, kind", [
    ("./no_such_folder", "folder"), ("/no/such/folder", "folder"), ("~/no_such", "folder"),
    ("gs://bucket/images", "folder"), ("task:vtab1k/cifar100", "task"),
    ("fashion_mnist", "tfds"), ("mnist:3.0.1", "tfds")])
def test_a_name_spelled_as_a_path_is_a_folder_there_or_not(name, kind):
  """One folder test for every caller (data/config.is_folder): a path, there or not, is a
  folder, so that a missing one is refused as a folder (not looked up as a dataset); a bare
  name is a dataset unless it is a directory here."""
  assert sources.kind_of(name) == kind
  assert data_config.is_folder(name) == (kind == "folder")
  # What a run's checkpoints record as their dataset: a local folder wherever it is read.
  local = {"./no_such_folder": os.path.abspath("no_such_folder"),
           "~/no_such": os.path.join(os.path.expanduser("~"), "no_such")}
  assert data.located(name) == local.get(name, name)


def test_a_transfer_task_of_a_missing_folder_is_refused_as_a_folder(tmp_path):
  """vit-transfer --suite ./no_such_folder: a custom task named by the folder's absolute path,
  whose source says the directory is not there (tasks.py asked the file system, unlike the
  sources: it called the name an unknown task or suite)."""
  missing = str(tmp_path / "no_such_folder")
  [task] = tasks.resolve_or_custom(missing)
  assert (task.name, task.suite, task.tfds_name) == (missing, "custom", missing)
  with pytest.raises(data.DataOptionError, match="is not a directory"):
    sources.get_source(task.tfds_name, None, False, "fail")
