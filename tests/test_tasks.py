"""Tests of vit_jax.data.tasks: VTAB-1k as google-research/task_adaptation defines it, and
the ViT paper's fine-tuning suite. No data is downloaded: builders come from TFDS's code,
split sizes from the table below, examples from tfds.testing.mock_data."""
import json

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.testing import mocking

from vit_jax.data import tasks

# num_examples of each pinned builder's splits: the TFDS catalog page of that version, and
# the sizes task_adaptation/data/*_test.py expect (caltech101 3,060 train is 2,754 + 306).
SPLIT_SIZES = {
    "caltech101:3.0.2": {"train": 3_060, "test": 6_084},
    "cifar10:3.0.2": {"train": 50_000, "test": 10_000},
    "cifar100:3.0.2": {"train": 50_000, "test": 10_000},
    "dtd:3.0.1": {"train": 1_880, "validation": 1_880, "test": 1_880},
    "oxford_flowers102:2.1.1": {"train": 1_020, "validation": 1_020, "test": 6_149},
    "oxford_iiit_pet:4.0.0": {"train": 3_680, "test": 3_669},
    "sun397/tfds:4.0.0": {"train": 76_128, "validation": 10_875, "test": 21_750},
    "svhn_cropped:3.1.0": {"train": 73_257, "test": 26_032, "extra": 531_131},
    "patch_camelyon:2.0.0": {"train": 262_144, "validation": 32_768, "test": 32_768},
    "eurosat/rgb:2.0.0": {"train": 27_000},
    "resisc45:3.0.0": {"train": 31_500},
    "diabetic_retinopathy_detection/btgraham-300:3.0.0":
        {"train": 35_126, "validation": 10_906, "test": 42_670},
    "clevr:3.1.0": {"train": 70_000, "validation": 15_000, "test": 15_000},
    "dmlab:2.0.1": {"train": 65_550, "validation": 22_628, "test": 22_735},
    "dsprites:2.0.0": {"train": 737_280},
    "smallnorb:2.0.0": {"train": 24_300, "test": 24_300},
    "kitti:3.1.0": {"train": 6_347, "validation": 423, "test": 711},
    "imagenet2012:5.1.0": {"train": 1_281_167, "validation": 50_000, "test": 100_000},
}
# Size of task_adaptation's "test" split: expected_num_samples["test"] in its *_test.py.
VTAB_TEST_SIZES = {
    "caltech101": 6_084, "cifar100": 10_000, "dtd": 1_880, "oxford_flowers102": 6_149,
    "oxford_iiit_pet": 3_669, "sun397": 21_750, "svhn": 26_032, "patch_camelyon": 32_768,
    "eurosat": 5_400, "resisc45": 6_300, "diabetic_retinopathy": 42_670,
    "clevr_count": 15_000, "clevr_distance": 15_000, "dmlab": 22_735,
    "dsprites_location": 73_728, "dsprites_orientation": 73_728,
    "smallnorb_azimuth": 12_150, "smallnorb_elevation": 12_150, "kitti_distance": 711,
}
# task_adaptation's num_classes: its *_test.py, clevr.py / kitti.py _TASK_DICT, and
# num_classes=16 for dsprites in scripts/run_all_tasks.sh.
VTAB_NUM_CLASSES = {
    "caltech101": 102, "cifar100": 100, "dtd": 47, "oxford_flowers102": 102,
    "oxford_iiit_pet": 37, "sun397": 397, "svhn": 10, "patch_camelyon": 2, "eurosat": 10,
    "resisc45": 45, "diabetic_retinopathy": 5, "clevr_count": 8, "clevr_distance": 6,
    "dmlab": 6, "dsprites_location": 16, "dsprites_orientation": 16, "smallnorb_azimuth": 18,
    "smallnorb_elevation": 9, "kitti_distance": 4,
}
# Where val200 starts: the first example of task_adaptation's "val" split, which follows
# its "train" split (expected_num_samples["train"]) where the builder has no validation split.
VAL200_AT = {
    "caltech101": ("train", 2_754), "cifar100": ("train", 45_000),
    "oxford_iiit_pet": ("train", 2_944), "svhn": ("train", 65_931),
    "eurosat": ("train", 16_200), "resisc45": ("train", 18_900),
    "clevr_count": ("train", 63_000), "clevr_distance": ("train", 63_000),
    "dsprites_location": ("train", 589_824), "dsprites_orientation": ("train", 589_824),
    "smallnorb_azimuth": ("test", 0), "smallnorb_elevation": ("test", 0),
}
VTAB_ORDER = (
    "caltech101", "cifar100", "dtd", "oxford_flowers102", "oxford_iiit_pet", "sun397", "svhn",
    "patch_camelyon", "eurosat", "resisc45", "diabetic_retinopathy",
    "clevr_count", "clevr_distance", "dmlab", "dsprites_location", "dsprites_orientation",
    "smallnorb_azimuth", "smallnorb_elevation", "kitti_distance")
# TFDS needs these files handed to it (task_adaptation's README: Retinopathy and Resisc45).
MANUAL = {"vtab1k/resisc45", "vtab1k/diabetic_retinopathy", "paper/imagenet2012"}
ALL = sorted(tasks.TASKS)
VTAB = [n for n in ALL if n.startswith("vtab1k/")]
PAPER = [n for n in ALL if n.startswith("paper/")]


def _builder(task: tasks.Task) -> tfds.core.DatasetBuilder:
  """The task's builder, its split sizes (unknown before it is prepared) from SPLIT_SIZES."""
  builder = tfds.builder(task.tfds_name)
  builder.info.set_splits(tfds.core.SplitDict([
      tfds.core.SplitInfo(name=name, shard_lengths=[n], num_bytes=0)
      for name, n in SPLIT_SIZES[task.tfds_name].items()]))
  return builder


Ranges = list[tuple[str, int, int]]


def _ranges(builder: tfds.core.DatasetBuilder, split: str) -> Ranges:
  """(split name, start, stop) of each part a split string reads."""
  out = []
  for part in tfds.core.ReadInstruction.from_spec(split).to_absolute(builder.info.splits):
    n = builder.info.splits[part.splitname].num_examples
    out.append((part.splitname, *slice(part.from_, part.to).indices(n)[:2]))
  return out


def _size(a: Ranges) -> int:
  return sum(stop - start for _, start, stop in a)


def _overlap(a: Ranges, b: Ranges) -> int:
  return sum(max(0, min(stop, stop2) - max(start, start2))
             for name, start, stop in a for name2, start2, stop2 in b if name == name2)


# --- the registry ----------------------------------------------------------------------


def test_suites():
  assert tasks.SUITES["vtab1k"] == tuple(f"vtab1k/{n}" for n in VTAB_ORDER)
  groups = [tasks.TASKS[n].group for n in tasks.SUITES["vtab1k"]]
  assert groups == ["natural"] * 7 + ["specialized"] * 4 + ["structured"] * 8
  assert tasks.SUITES["paper"] == tuple(f"paper/{n}" for n in (
      "imagenet2012", "cifar10", "cifar100", "oxford_iiit_pet", "oxford_flowers102"))
  assert tasks.SUITES["imagenet"] == ("paper/imagenet2012",)
  assert {n: tasks.TASKS[f"vtab1k/{n}"].num_classes for n in VTAB_ORDER} == VTAB_NUM_CLASSES
  assert [tasks.TASKS[n].num_classes for n in tasks.SUITES["paper"]] == [1000, 10, 100, 37, 102]
  assert {n for names in tasks.SUITES.values() for n in names} == set(tasks.TASKS)
  assert all(name == t.name and name.startswith(t.suite + "/")
             for name, t in tasks.TASKS.items())


def test_protocol_is_the_papers():
  """ViT paper, Table 4 / App. B.1.1."""
  for name in VTAB:
    assert (tasks.TASKS[name].steps, tasks.TASKS[name].lr_grid) == (2_500, (0.01,))
  small = (0.001, 0.003, 0.01, 0.03)
  assert {n: (tasks.TASKS[n].steps, tasks.TASKS[n].lr_grid) for n in PAPER} == {
      "paper/imagenet2012": (20_000, (0.003, 0.01, 0.03, 0.06)),
      "paper/cifar10": (10_000, small), "paper/cifar100": (10_000, small),
      "paper/oxford_iiit_pet": (500, small), "paper/oxford_flowers102": (500, small)}


@pytest.mark.parametrize("name", ALL)
def test_builder_resolves_and_fits_the_task(name):
  task = tasks.TASKS[name]
  builder = tfds.builder(task.tfds_name)
  assert builder.info.full_name == task.tfds_name.replace(":", "/")
  features = builder.info.features
  assert isinstance(features[task.image_key], tfds.features.Image)
  if task.label.class_key is not None:
    assert isinstance(features[task.label.class_key], tfds.features.ClassLabel)
    assert features[task.label.class_key].num_classes == task.num_classes
    assert task.class_names == tuple(features[task.label.class_key].names)
  else:
    assert task.class_names == tuple(str(i) for i in range(task.num_classes))
  assert bool(builder.MANUAL_DOWNLOAD_INSTRUCTIONS) == (name in MANUAL)
  assert (task.manual_download is not None) == (name in MANUAL)


@pytest.mark.parametrize("name", VTAB)
def test_vtab_splits(name):
  """train800, val200 and their union, disjoint from each other and from the test split,
  which holds as many examples as task_adaptation's."""
  task = tasks.TASKS[name]
  builder = _builder(task)
  minitrain, minival = _ranges(builder, task.minitrain), _ranges(builder, task.minival)
  train, test = _ranges(builder, task.train), _ranges(builder, task.test)
  assert (_size(minitrain), _size(minival), _size(train)) == (800, 200, 1_000)
  assert (_overlap(train, minitrain), _overlap(train, minival)) == (800, 200)
  assert _overlap(minitrain, minival) == 0 and _overlap(train, test) == 0
  assert _size(test) == VTAB_TEST_SIZES[name.split("/")[1]]
  split, start = VAL200_AT.get(name.split("/")[1], ("validation", 0))
  assert minitrain == [("train", 0, 800)] and minival == [(split, start, start + 200)]
  assert builder.info.splits[task.train].num_examples == 1_000


@pytest.mark.parametrize("name", PAPER)
def test_paper_splits(name):
  """The whole train split, its held-out minival (App. B.1.1: 10% Pets and Flowers, 2% CIFAR,
  1% ImageNet) and the rest; tested on the labelled test data."""
  task = tasks.TASKS[name]
  builder = _builder(task)
  n = SPLIT_SIZES[task.tfds_name]["train"]
  minitrain, minival = _ranges(builder, task.minitrain), _ranges(builder, task.minival)
  assert task.train == "train" and _ranges(builder, task.train) == [("train", 0, n)]
  assert _size(minitrain) + _size(minival) == n and _overlap(minitrain, minival) == 0
  assert {name for name, _, _ in minitrain + minival} == {"train"}
  held_out = {"imagenet2012": 1, "cifar10": 2, "cifar100": 2}.get(name.split("/")[1], 10)
  assert abs(_size(minival) - held_out * n / 100) < 1
  assert task.test == ("validation" if name == "paper/imagenet2012" else "test")


def test_split_check_sees_a_bad_split():
  builder = _builder(tasks.TASKS["vtab1k/kitti_distance"])
  with pytest.raises(ValueError, match="incompatible"):
    _ranges(builder, "validation[300:500]")
  with pytest.raises(ValueError, match="Unknown split"):
    _ranges(builder, "val[:200]")


# --- examples from mocked data ---------------------------------------------------------


def _fake_as_dataset(self, split, decoders=None, read_config=None, shuffle_files=False):
  """mock_data's random examples as as_dataset reads them with the image not decoded: the
  image encoded as its feature encodes it, every other feature decoded. Variable lengths
  are 10 (images 10x10, 10 objects), pixels 0 or 1 (max_value=2). mock_data's default runs
  every feature's encoder, which rejects its random boxes (Pets' head_bbox) and Sequences
  (clevr's and kitti's objects: it draws each member a length of its own)."""
  del split, read_config, shuffle_files
  features, key = self.info.features, "image"
  assert set(decoders) == {key} and isinstance(decoders[key], tfds.decode.SkipDecoding)
  fake = mocking.RandomFakeGenerator(features, num_examples=3, max_value=2,
                                     constant_dynamic_shape=True)
  examples = [{**ex, key: features[key].encode_example(ex[key])} for ex in fake]
  signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.tf_dtype),
                                    features.get_tensor_info())
  signature[key] = tf.TensorSpec((), tf.string)
  return tf.data.Dataset.from_generator(lambda: iter(examples), output_signature=signature)


@pytest.mark.parametrize("name", ALL)
def test_mocked_examples(name):
  task = tasks.TASKS[name]
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE,
                              as_dataset_fn=_fake_as_dataset):
    builder = tfds.builder(task.tfds_name)
    ds = builder.as_dataset(split=task.minitrain,
                            decoders={task.image_key: tfds.decode.SkipDecoding()})
    pairs = list(ds.map(lambda f: (f[task.image_key], task.example(f))).as_numpy_iterator())
  shape = tuple(10 if d is None else d for d in builder.info.features[task.image_key].shape)
  assert len(pairs) == 3 and shape[-1] in (1, 3)
  for encoded, ex in pairs:
    assert set(ex) == {"image", "label"}
    image = tf.io.decode_image(ex["image"], expand_animations=False).numpy()
    assert image.shape == shape
    assert ex["label"].dtype == np.int64 and ex["label"].shape == ()
    assert 0 <= ex["label"] < task.num_classes
    if task.fix_pixels is None:
      assert ex["image"] == encoded
    else:  # dsprites: 0/1 -> 0/255.
      assert set(np.unique(image)) <= {0, 255} and image.max() == 255


# --- label functions, against task_adaptation's --------------------------------------


def _png(pixels) -> tf.Tensor:
  return tf.io.encode_png(np.asarray(pixels, np.uint8))


def _label(name: str, **features) -> int:
  features.setdefault("image", _png(np.zeros((2, 2, 3))))
  return int(tasks.TASKS[f"vtab1k/{name}"].example(features)["label"])


def _clevr(depths) -> dict:
  depths = np.asarray(depths, np.float32)
  return {"objects": {"size": tf.zeros([len(depths)], tf.int64),
                      "pixel_coords": tf.constant(
                          np.stack([np.ones_like(depths), np.ones_like(depths), depths], 1))}}


def _kitti(*objects) -> dict:
  """objects: (type, depth); type 0 Car, 1 Van, 2 Truck, 3 Pedestrian, 5 Cyclist, 6 Tram."""
  types = np.array([t for t, _ in objects], np.int64)
  location = np.array([[1.0, 1.5, z] for _, z in objects], np.float32).reshape(-1, 3)
  return {"objects": {"type": tf.constant(types), "location": tf.constant(location)}}


def test_clevr_labels():
  """clevr.py: count_all is len(objects) - 3; closest_object_distance bins the smallest
  pixel_coords depth at thresholds (0, 8, 8.5, 9, 9.5, 10, 100), label = last one below."""
  assert [_label("clevr_count", **_clevr(np.ones(n))) for n in (3, 6, 10)] == [0, 3, 7]
  depths = [7.9, 8.0, 8.25, 8.5, 8.75, 9.25, 9.75, 10.0, 10.5, 20.0]
  assert [_label("clevr_distance", **_clevr([d])) for d in depths] == [
      0, 0, 1, 1, 2, 3, 4, 4, 5, 5]
  assert _label("clevr_distance", **_clevr([12.0, 8.25, 9.9])) == 1


def test_kitti_closest_vehicle_distance():
  """kitti.py closest_vehicle_distance: the smallest depth among Car/Van/Truck (type < 3),
  1000 without one; thresholds (-100, 8, 20, 999), label = last one below."""
  cases = {
      (): 3, ((3, 4.0), (5, 6.0)): 3, ((0, 5.0),): 0, ((1, 8.0),): 0, ((2, 8.5),): 1,
      ((0, 20.0),): 1, ((0, 20.5),): 2, ((0, 60.0), (3, 3.0)): 2,
      ((0, 30.0), (1, 12.0)): 1, ((6, 3.0), (0, 25.0)): 2,
  }
  assert {objects: _label("kitti_distance", **_kitti(*objects)) for objects in cases} == cases


def test_dsprites_labels_and_pixels():
  """dsprites.py with num_classes=16: floor(value / (32 / 16)) for x position, floor(value /
  (40 / 16)) for orientation; images * 255."""
  x = {v: _label("dsprites_location", label_x_position=tf.constant(v, tf.int64))
       for v in (0, 1, 2, 3, 30, 31)}
  assert x == {0: 0, 1: 0, 2: 1, 3: 1, 30: 15, 31: 15}
  o = {v: _label("dsprites_orientation", label_orientation=tf.constant(v, tf.int64))
       for v in (0, 2, 3, 5, 7, 8, 39)}
  assert o == {0: 0, 2: 0, 3: 1, 5: 2, 7: 2, 8: 3, 39: 15}
  pixels = np.array([[0, 1], [1, 0]], np.uint8)[..., None]
  ex = tasks.TASKS["vtab1k/dsprites_location"].example(
      {"image": _png(pixels), "label_x_position": tf.constant(4, tf.int64)})
  np.testing.assert_array_equal(tf.io.decode_png(ex["image"]).numpy(), pixels * 255)


def test_feature_labels():
  """smallnorb.py predicts the named attribute; dmlab.py, diabetic_retinopathy.py `label`."""
  norb = {"label_azimuth": tf.constant(17, tf.int64), "label_elevation": tf.constant(8, tf.int64),
          "label_category": tf.constant(2, tf.int64), "image": _png(np.zeros((2, 2, 1)))}
  assert (_label("smallnorb_azimuth", **norb), _label("smallnorb_elevation", **norb)) == (17, 8)
  assert _label("dmlab", label=tf.constant(5, tf.int64)) == 5
  assert _label("diabetic_retinopathy", label=tf.constant(4, tf.int64)) == 4


# --- resolve, describe -----------------------------------------------------------------


def test_resolve():
  assert [t.name for t in tasks.resolve("vtab1k")] == list(tasks.SUITES["vtab1k"])
  assert [t.name for t in tasks.resolve("paper")] == list(tasks.SUITES["paper"])
  assert [t.name for t in tasks.resolve("imagenet")] == ["paper/imagenet2012"]
  got = tasks.resolve(" clevr_count,vtab1k/cifar100 , paper/cifar100,clevr_count")
  assert [t.name for t in got] == ["vtab1k/clevr_count", "vtab1k/cifar100", "paper/cifar100"]
  assert tasks.resolve("kitti_distance") == [tasks.TASKS["vtab1k/kitti_distance"]]


@pytest.mark.parametrize("spec, match", [
    ("clevr_counts", r"unknown task or suite 'clevr_counts'.*vtab1k/clevr_count"),
    ("dmlab,nope", r"unknown task or suite 'nope'.*suites: \['imagenet', 'paper', 'vtab1k'\]"),
    ("cifar100", r"ambiguous.*vtab1k/cifar100.*paper/cifar100"),
    (" , ", r"no task named"),
])
def test_resolve_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    tasks.resolve(spec)


@pytest.mark.parametrize("name", ALL)
def test_describe_is_json(name):
  task = tasks.TASKS[name]
  described = json.loads(json.dumps(tasks.as_dict(task)))
  assert set(described) == {
      "name", "suite", "group", "tfds_name", "num_classes", "label", "train", "minitrain",
      "minival", "test", "steps", "lr_grid", "manual_download", "source"}
  assert described["lr_grid"] == list(task.lr_grid) and described["label"]
  assert described["source"] == task.source and task.source
