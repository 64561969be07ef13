"""data/fashion_mnist.py: Fashion-MNIST as TFDS's own builder makes it, from Debian's IDX
files (the README's set-up), and the fix named where they and the network are missing."""
import collections
import gzip
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from vit_jax.data import fashion_mnist


def _idx(name):
  with gzip.open(os.path.join(fashion_mnist.DEBIAN_DIR, name)) as f:
    content = f.read()
  if "images" in name:
    return np.frombuffer(content, np.uint8, offset=16).reshape(-1, 28, 28)
  return np.frombuffer(content, np.uint8, offset=8)


def _assert_same_examples(ds, images, labels):
  """Every TFDS example is one of the IDX examples, with its label."""
  reference = {images[i].tobytes(): labels[i] for i in range(len(labels))}
  for image, label in tfds.as_numpy(ds):
    assert reference[image[..., 0].tobytes()] == label


@pytest.fixture
def debian_files() -> str:
  """Debian's Fashion-MNIST files, which the README's set-up installs: a failure, not a skip,
  where they are missing (as the `dataset` fixture)."""
  if not os.path.isdir(fashion_mnist.DEBIAN_DIR):
    pytest.fail(f"{fashion_mnist.DEBIAN_DIR} is missing: `sudo apt-get install "
                "dataset-fashion-mnist` (the README's set-up).")
  return fashion_mnist.DEBIAN_DIR


def test_fashion_mnist_from_debian_files(tmp_path, debian_files):
  fashion_mnist.prepare_fashion_mnist(str(tmp_path), max_examples_per_split=200)
  builder = tfds.builder("fashion_mnist", data_dir=str(tmp_path))
  assert builder.is_prepared() and str(builder.version) == "3.0.1"
  assert builder.info.features["image"].shape == (28, 28, 1)
  assert builder.info.features["label"].names[:2] == ["T-shirt/top", "Trouser"]
  assert builder.info.supervised_keys == ("image", "label")
  ds = tfds.load("fashion_mnist", data_dir=str(tmp_path), split="test",
                 as_supervised=True, download=False)
  _assert_same_examples(ds, _idx("t10k-images-idx3-ubyte.gz")[:200],
                        _idx("t10k-labels-idx1-ubyte.gz")[:200])
  fashion_mnist.prepare_fashion_mnist(str(tmp_path))  # Prepared: a no-op.


@pytest.mark.slow
def test_fashion_mnist_full_splits(dataset):
  """The session's copy, which prepare_fashion_mnist made for the other tests (conftest.py)."""
  name, data_dir = dataset
  splits = tfds.builder(name, data_dir=data_dir).info.splits
  assert (splits["train"].num_examples, splits["test"].num_examples) == (60000, 10000)
  ds = tfds.load(name, data_dir=data_dir, split="test", as_supervised=True, download=False)
  images, labels = _idx("t10k-images-idx3-ubyte.gz"), _idx("t10k-labels-idx1-ubyte.gz")
  _assert_same_examples(ds, images, labels)
  assert collections.Counter(int(l) for _, l in tfds.as_numpy(ds)) == (
      collections.Counter(labels.tolist()))


def test_fashion_mnist_without_files_or_network(tmp_path, monkeypatch):
  def no_network(self, **kwargs):
    raise ConnectionError("no network")
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_network)
  with pytest.raises(RuntimeError, match="apt-get install dataset-fashion-mnist"):
    fashion_mnist.prepare_fashion_mnist(str(tmp_path),
                                        files_dir=str(tmp_path / "nothing"))
