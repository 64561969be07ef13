"""A checkpoint describes itself: every checkpoint the project writes (a run's steps, an
exported .npz, SavedModel, TFLite, ONNX) records its model, resolution, preprocessing,
classes and origin; `checkpoint.describe` reads it back for any of them, with documented
defaults for released files; export, predict, few-shot and fine-tuning act on it."""
import csv
import glob
import io
import os

import numpy as np
import pytest

from helpers import tiny_config, tiny_serving_checkpoint
from vit_jax import checkpoint, models
from vit_jax.tools import predict
from vit_jax.tools import inspect_checkpoint as inspect_cli
from vit_jax.checkpoint import run
from vit_jax.data import preprocess as pp
from vit_jax.evaluators import fewshot_lsr
from vit_jax.serving import convert, formats, runners
from vit_jax.train import config as config_lib, loop, run_setup, sharding

# A run trained on [0, 255] -> [0, 1], not the default [-1, 1]: what exports used to ignore.
VALUE_RANGE = (0.0, 1.0)
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, dataset) -> str:
  workdir = str(tmp_path_factory.mktemp("described_run"))
  loop.train_and_evaluate(tiny_config(dataset, **{"data.value_range": VALUE_RANGE}), workdir)
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
  described = checkpoint.describe(workdir)
  assert described.model_name == "ViT-Ti_16" and described.model["patch_size"] == 7
  assert (described.image_size, described.num_classes, described.step) == (28, 10, 12)
  assert described.preprocessing == checkpoint.Preprocessing(value_range=VALUE_RANGE)
  assert described.class_names == FASHION_MNIST_CLASSES
  assert (described.output, described.dataset, described.parent) == (
      "softmax", "fashion_mnist", None)
  assert described.config["data"]["value_range"] == list(VALUE_RANGE)
  assert described.assumed == ()
  step8 = checkpoint.describe(os.path.join(workdir, "checkpoints", "8"))
  assert step8 == described.replace(step=8)


def test_a_step_saved_before_descriptions_is_described_from_its_metadata(workdir):
  _, meta = checkpoint.read_params(checkpoint.latest_step_dir(workdir))
  old = {k: v for k, v in meta.items() if k != "description"}
  described = run.step_description(old, 12)
  assert described == checkpoint.describe(workdir).replace(
      class_names=(), config=None)


def test_export_npz_carries_the_description_and_only_the_released_arrays(workdir, tmp_path):
  out = str(tmp_path / "run.npz")
  described = checkpoint.export_npz(workdir, out)
  step_dir = str(checkpoint.latest_step_dir(workdir))
  assert described == checkpoint.describe(workdir).replace(exported_from=step_dir)
  assert checkpoint.describe(out) == described
  flat, _ = checkpoint.read_params(step_dir)
  exported = checkpoint.load_npz_flat(out)
  assert exported.keys() == flat.keys()  # The description is no parameter.
  for k, v in flat.items():
    np.testing.assert_array_equal(exported[k], v)
  # Readers of the released layout that load every entry (the official code) get a string.
  assert str(np.load(out)[checkpoint.description.DESCRIPTION_KEY]) == described.to_json()


@pytest.mark.slow
def test_exported_models_apply_the_value_range_the_run_was_trained_with(
    workdir, test_images, tmp_path, capsys):
  uint8, x = test_images
  loaded = checkpoint.load(workdir)
  want = np.asarray(loaded.model.apply({"params": loaded.params}, x, train=False))
  wrong = pp.value_range(uint8, -1.0, 1.0).numpy()  # What exports used to feed the model.
  assert np.abs(np.asarray(loaded.model.apply({"params": loaded.params}, wrong)) - want).max() > 0.1
  for fmt, tolerance in (("savedmodel", 1e-4), ("tflite", 1e-3), ("onnx", 1e-4)):
    out = str(tmp_path / {"savedmodel": "saved_model"}.get(fmt, f"model.{fmt}"))
    convert.export(workdir, out, fmt)
    assert formats.format_of(out) == fmt
    assert formats.describe(out) == loaded.description.replace(exported_from=loaded.source)
    runner = runners.open_model(out)
    assert runner.description.preprocessing.value_range == VALUE_RANGE
    np.testing.assert_allclose(runner(uint8), want, atol=tolerance, rtol=0)
    assert np.mean(runner(uint8).argmax(-1) == want.argmax(-1)) == 1.0
  np.testing.assert_allclose(runners.jax_runner(loaded)(uint8), want, atol=1e-5, rtol=0)
  assert inspect_cli.main([str(tmp_path / "model.onnx")]) == 0
  out = capsys.readouterr().out
  assert "input          28 px RGB, resized; [0, 255] -> [0, 1]\n" in out
  assert f"origin         trained on fashion_mnist; step 12; exported from {loaded.source}" in out


def test_a_released_file_is_described_by_documented_defaults(tmp_path):
  path = tiny_serving_checkpoint(tmp_path / "released.npz", "plain")
  described = checkpoint.describe(path)
  assert (described.model["patch_size"], described.model["hidden_size"]) == (8, 32)
  # No registry model is this small; the resolution is the position embedding's 4x4 grid.
  assert (described.model_name, described.image_size, described.num_classes) == (None, 32, 10)
  assert described.preprocessing == checkpoint.Preprocessing(value_range=(-1.0, 1.0))
  assert described.assumed == ("model", "preprocessing") and described.class_names == ()
  assert "assumed (not recorded in the file): model, preprocessing" in described.summary()


def test_description_round_trips_and_refuses_inconsistency():
  d = checkpoint.Description(model={"patch_size": 7, "resnet_layers": (3, 4)}, image_size=28,
                             num_classes=2, class_names=("cat", "dog"), output="sigmoid",
                             preprocessing=checkpoint.Preprocessing((0.0, 1.0), "central_crop"))
  assert checkpoint.Description.from_json(d.to_json()) == d
  with pytest.raises(ValueError, match="3 class names for 2 classes"):
    d.replace(class_names=("a", "b", "c"))
  with pytest.raises(ValueError, match="newer vit_jax"):
    checkpoint.Description.from_dict(dict(d.to_dict(), format=99))


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
  c = tiny_config(dataset, total_steps=2, pretrained=workdir)
  loop.train_and_evaluate(c, str(tmp_path / "ft"))
  described = checkpoint.describe(str(tmp_path / "ft"))
  assert described.preprocessing.value_range == VALUE_RANGE and described.parent == workdir
  c = tiny_config(dataset, total_steps=2, pretrained=workdir,
                  **{"data.value_range": (-1.0, 1.0)})
  with pytest.raises(checkpoint.DescriptionMismatch,
                     match=r"config.data.value_range \(-1.0, 1.0\) disagrees with .* \(0.0, 1.0\)"):
    loop.train_and_evaluate(c, str(tmp_path / "ft2"))


def test_fewshot_batches_are_preprocessed_as_the_checkpoint_was(dataset):
  mesh = sharding.make_mesh()
  for value_range in (VALUE_RANGE, (-1.0, 1.0)):
    batches, _ = fewshot_lsr.dataset_batches(
        *dataset, "test[:32]", 28, 32, sharding.batch_sharding(mesh),
        checkpoint.Preprocessing(value_range))
    images = np.asarray(next(batches())["image"])
    assert (images.min(), images.max()) == pytest.approx(value_range, abs=0.01)


# timm's / transformers' ImageNet normalisation, as the Hub's checkpoints state it.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HUB_PREPROCESSING = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop="central_crop",
                         central_crop_fraction=0.875, interpolation="bicubic")


def test_preprocessing_states_mean_std_and_interpolation_and_round_trips():
  pre = checkpoint.Preprocessing(**HUB_PREPROCESSING)
  assert pre.value_range is None and pre.mean == IMAGENET_MEAN
  scale, offset = pre.affine()  # uint8 * scale + offset == (uint8 / 255 - mean) / std.
  pixels = np.array([0.0, 128.0, 255.0])[:, None]
  np.testing.assert_allclose(pixels * scale + offset,
                             (pixels / 255 - IMAGENET_MEAN) / IMAGENET_STD, rtol=1e-12)
  assert checkpoint.Preprocessing().affine() == ((2 / 255,) * 3, (-1.0,) * 3)
  d = checkpoint.Description(model={"patch_size": 16}, image_size=224, num_classes=1000,
                             preprocessing=pre)
  assert d.to_dict()["format"] == 2
  assert checkpoint.Description.from_json(d.to_json()) == d
  assert ("input mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225) of [0, 1] pixels, "
          "central_crop, bicubic") in d.summary()
  # A value range description is written as before (format 1, no new keys) ...
  old = d.replace(preprocessing=checkpoint.Preprocessing((0.0, 1.0))).to_dict()
  assert old["format"] == 1 and set(old["preprocessing"]) == {
      "value_range", "crop", "central_crop_fraction", "channels"}
  # ... and one written before mean, std and interpolation existed reads.
  old["preprocessing"]["value_range"] = [0, 1]
  loaded = checkpoint.Description.from_dict(old)
  assert loaded.preprocessing == checkpoint.Preprocessing(value_range=(0.0, 1.0))
  assert (loaded.preprocessing.mean, loaded.preprocessing.interpolation) == (None, "bilinear")


@pytest.mark.parametrize("fields,message", [
    (dict(mean=(0.5, 0.5), std=(0.5, 0.5)), r"Preprocessing.mean=\(0.5, 0.5\): expected 3"),
    (dict(mean=(0.5,) * 3), r"Preprocessing.std=None: .* give std"),
    (dict(mean=(0.5,) * 3, std=(0.5, 0.0, 0.5)), r"Preprocessing.std=.*must be > 0"),
    (dict(value_range=(0.0, 1.0), mean=(0.5,) * 3, std=(0.5,) * 3), r"not both"),
    (dict(value_range=(1.0, -1.0)), r"low < high"),
    (dict(interpolation="lanczos"), r"Preprocessing.interpolation='lanczos': expected one of"),
])
def test_preprocessing_refuses_invalid_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    checkpoint.Preprocessing(**fields)


def _mean_std_npz(tmp_path, dataset) -> str:
  """A checkpoint of the tiny run's model whose description states the Hub's mean and std."""
  import jax
  c = tiny_config(dataset)
  model = run_setup.build_model(c, 10)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3), np.float32))["params"]
  described = checkpoint.Description(
      model=models.registry.described_fields(model), model_name=c.model_name, image_size=28,
      num_classes=10, preprocessing=checkpoint.Preprocessing(**HUB_PREPROCESSING))
  checkpoint.save_npz(str(tmp_path / "hub.npz"), params, described)
  return str(tmp_path / "hub.npz")


def test_fine_tuning_takes_mean_and_std_of_its_starting_checkpoint(tmp_path):
  dataset = ("fashion_mnist", str(tmp_path / "tfds"))  # Only the configs: nothing is read.
  path = _mean_std_npz(tmp_path, dataset)
  c = tiny_config(dataset, pretrained=path)
  run_setup.resolve_value_range(c)
  assert (c.data.value_range, c.data.mean, c.data.std) == (None, IMAGENET_MEAN, IMAGENET_STD)
  config_lib.validate(c)
  # The run's own checkpoints describe what it trained with (its eval crop, bilinear).
  assert checkpoint.Preprocessing.from_data_config(c.data) == checkpoint.Preprocessing(
      mean=IMAGENET_MEAN, std=IMAGENET_STD)
  c = tiny_config(dataset, pretrained=path, **{"data.mean": IMAGENET_MEAN,
                                               "data.std": IMAGENET_STD})
  run_setup.resolve_value_range(c)  # The same values, given: agreed.
  for field, value, records in (("value_range", (-1.0, 1.0), r"normalisation 'mean \(0.485"),
                                ("mean", (0.5, 0.5, 0.5), r"mean \(0.485, 0.456, 0.406\)")):
    c = tiny_config(dataset, pretrained=path, **{f"data.{field}": value})
    if field == "mean":
      c.data.std = IMAGENET_STD
    with pytest.raises(checkpoint.DescriptionMismatch,
                       match=rf"config.data.{field} .* disagrees with .*{records}"):
      run_setup.resolve_value_range(c)


@pytest.mark.slow
def test_a_run_fine_tuned_from_mean_and_std_trains_and_is_described_so(tmp_path, dataset):
  path = _mean_std_npz(tmp_path, dataset)
  loop.train_and_evaluate(tiny_config(dataset, total_steps=2, pretrained=path),
                          str(tmp_path / "ft"))
  described = checkpoint.describe(str(tmp_path / "ft")).preprocessing
  assert (described.mean, described.std, described.value_range) == (IMAGENET_MEAN,
                                                                      IMAGENET_STD, None)
