"""A checkpoint describes itself, end to end: a training run's steps, and the .npz, SavedModel,
TFLite and ONNX exported from it, record its model, resolution, preprocessing, classes and
origin; export, predict and fine-tuning act on it (the description itself and released files'
defaults: test_description.py)."""
import csv
import glob
import io
import os

import numpy as np
import pytest

from helpers import IMAGENET_MEAN, IMAGENET_STD, VALUE_RANGE, tiny_config
from helpers import mean_std_npz as _mean_std_npz
from vit_jax.checkpoint import description, loader, npz, run
from vit_jax.tools import predict
from vit_jax.tools import inspect_checkpoint as inspect_cli
from vit_jax.checkpoint import run
from vit_jax.data import preprocess as pp
from vit_jax.serving import convert, formats, predictors
from vit_jax.train import loop, sharding


FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, dataset) -> str:
  workdir = str(tmp_path_factory.mktemp("described_run"))
  loop.train_and_evaluate(tiny_config(dataset, cpu_devices=1, **{"data.value_range": VALUE_RANGE}),
                          workdir)
  return workdir


@pytest.fixture(scope="module")
def test_images(dataset):
  """64 Fashion-MNIST test images: uint8 (as a client has them) and as the run's evaluation
  pipeline feeds them to the model."""
  from vit_jax import data
  cfg = tiny_config(dataset, **{"data.value_range": VALUE_RANGE}).data
  batch = next(data.eval_iterator(cfg, global_batch_size=64,
                                  sharding=sharding.batch_sharding(sharding.make_mesh())))
  x = np.asarray(batch["image"])
  uint8 = np.round(x * 255).astype(np.uint8)
  np.testing.assert_allclose(pp.value_range(uint8, *VALUE_RANGE).numpy(), x, atol=1e-6)
  return uint8, x


def test_a_run_step_records_its_description(workdir, dataset):
  described = loader.describe(workdir)
  # The config's ViT-Ti_16 with patches of 7 and 32 wide: a model with no registry name.
  assert described.model_name is None and described.model["patch_size"] == 7
  assert described.model_label == "ViT with patch 7, width 32, depth 2, 2 heads, MLP 64"
  assert (described.image_size, described.num_classes, described.step) == (28, 10, 12)
  assert described.preprocessing == description.Preprocessing(value_range=VALUE_RANGE)
  assert described.class_names == FASHION_MNIST_CLASSES
  assert (described.output, described.dataset, described.parent) == (
      "softmax", "fashion_mnist", None)
  assert described.config["data"]["value_range"] == list(VALUE_RANGE)
  assert described.assumed == ()
  step8 = loader.describe(os.path.join(workdir, "checkpoints", "8"))
  assert step8 == described.replace(step=8)


def test_a_step_saved_before_descriptions_is_described_from_its_metadata(workdir):
  _, meta = run.read_params(run.latest_step_dir(workdir))
  old = {k: v for k, v in meta.items() if k != "description"}
  described = run.step_description(old, 12)
  assert described == loader.describe(workdir).replace(
      class_names=(), config=None)


def test_export_npz_carries_the_description_and_only_the_released_arrays(workdir, tmp_path):
  out = str(tmp_path / "run.npz")
  described = loader.export_npz(workdir, out)
  step_dir = str(run.latest_step_dir(workdir))
  assert described == loader.describe(workdir).replace(exported_from=step_dir)
  assert loader.describe(out) == described
  flat, _ = run.read_params(step_dir)
  exported = npz.load_npz_flat(out)
  assert exported.keys() == flat.keys()  # The description is no parameter.
  for k, v in flat.items():
    np.testing.assert_array_equal(exported[k], v)
  # Readers of the released layout that load every entry (the official code) get a string.
  assert str(np.load(out)[description.DESCRIPTION_KEY]) == described.to_json()


@pytest.mark.slow
def test_exported_models_apply_the_value_range_the_run_was_trained_with(
    workdir, test_images, tmp_path, capsys):
  uint8, x = test_images
  loaded = loader.load(workdir)
  want = np.asarray(loaded.model.apply({"params": loaded.params}, x, train=False))
  wrong = pp.value_range(uint8, -1.0, 1.0).numpy()  # What exports used to feed the model.
  assert np.abs(np.asarray(loaded.model.apply({"params": loaded.params}, wrong)) - want).max() > 0.1
  for fmt, tolerance in (("savedmodel", 1e-4), ("tflite", 1e-3), ("onnx", 1e-4)):
    out = str(tmp_path / {"savedmodel": "saved_model"}.get(fmt, f"model.{fmt}"))
    convert.export(workdir, out, fmt)
    assert formats.format_of(out) == fmt
    assert formats.describe(out) == loaded.description.replace(exported_from=loaded.source)
    predictor = predictors.open_model(out)
    assert predictor.description.preprocessing.value_range == VALUE_RANGE
    np.testing.assert_allclose(predictor(uint8), want, atol=tolerance, rtol=0)
    assert np.mean(predictor(uint8).argmax(-1) == want.argmax(-1)) == 1.0
  np.testing.assert_allclose(predictors.jax_predictor(loaded)(uint8), want, atol=1e-5, rtol=0)
  assert inspect_cli.main([str(tmp_path / "model.onnx")]) == 0
  out = capsys.readouterr().out
  assert "input          28 px RGB, resized; [0, 255] -> [0, 1]\n" in out
  assert f"origin         trained on fashion_mnist; step 12; exported from {loaded.source}" in out


def _predict(capsys, *argv) -> tuple[int, list[dict[str, str]], str]:
  rc = predict.main([*argv])
  out, err = capsys.readouterr()
  return rc, list(csv.DictReader(io.StringIO(out))) if rc == 0 else [], err


def test_predict_prints_the_class_names_the_checkpoint_records(workdir, digits_folder, capsys,
                                                               tmp_path):
  images = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[:3]
  rc, rows, _ = _predict(capsys, workdir, *images, "--top_k=3")
  assert rc == 0 and len(rows) == 3
  assert {r[f"label_{i}"] for r in rows for i in (1, 2, 3)} <= set(FASHION_MNIST_CLASSES)
  labels = tmp_path / "labels.txt"
  labels.write_text("\n".join(f"digit {i}" for i in range(10)))
  rc, _, err = _predict(capsys, workdir, *images, f"--labels={labels}")
  assert rc == 2 and err.startswith("error: --labels ['digit 0'")
  assert "records the class names ['T-shirt/top'" in err and len(err.splitlines()) == 1
  rc, _, err = _predict(capsys, workdir, *images, "--sigmoid")
  assert rc == 2 and "--sigmoid 'sigmoid' disagrees with" in err and "'softmax'" in err


def test_fine_tuning_takes_the_value_range_of_its_starting_checkpoint(workdir, dataset,
                                                                      tmp_path):
  c = tiny_config(dataset, total_steps=2, pretrained=workdir, cpu_devices=1)
  loop.train_and_evaluate(c, str(tmp_path / "ft"))
  described = loader.describe(str(tmp_path / "ft"))
  assert described.preprocessing.value_range == VALUE_RANGE and described.parent == workdir
  c = tiny_config(dataset, total_steps=2, pretrained=workdir,
                  **{"data.value_range": (-1.0, 1.0)})
  with pytest.raises(description.DescriptionMismatch,
                     match=r"config.data.value_range \(-1.0, 1.0\) disagrees with .* \(0.0, 1.0\)"):
    loop.train_and_evaluate(c, str(tmp_path / "ft2"))


@pytest.mark.slow
def test_a_run_fine_tuned_from_mean_and_std_trains_and_is_described_so(tmp_path, dataset):
  path = _mean_std_npz(tmp_path, dataset)
  loop.train_and_evaluate(tiny_config(dataset, total_steps=2, pretrained=path, cpu_devices=1),
                          str(tmp_path / "ft"))
  described = loader.describe(str(tmp_path / "ft")).preprocessing
  assert (described.mean, described.std, described.value_range) == (IMAGENET_MEAN,
                                                                      IMAGENET_STD, None)
