"""A checkpoint describes itself: description.Description and its Preprocessing round-trip and
refuse what is inconsistent, released files are described by documented defaults, and a run
fine-tuned from a checkpoint takes its normalisation (a run's own checkpoints and exports, end to
end: test_e2e_description.py)."""
import dataclasses
import json

import numpy as np
import pytest

from helpers import (HUB_PREPROCESSING, IMAGENET_MEAN, IMAGENET_STD, tiny_config,
                     tiny_serving_checkpoint)
from helpers import mean_std_npz as _mean_std_npz
from vit_jax.checkpoint import description, loader, run
from vit_jax.train import config as config_lib, run_setup


def test_a_released_file_is_described_by_documented_defaults(tmp_path):
  path = tiny_serving_checkpoint(tmp_path / "released.npz", "plain")
  described = loader.describe(path)
  assert (described.model["patch_size"], described.model["hidden_size"]) == (8, 32)
  # No registry model is this small; the resolution is the position embedding's 4x4 grid.
  assert (described.model_name, described.image_size, described.num_classes) == (None, 32, 10)
  assert described.preprocessing == description.Preprocessing(value_range=(-1.0, 1.0))
  assert described.assumed == ("model", "preprocessing") and described.class_names == ()
  assert "assumed (not recorded in the file): model, preprocessing" in described.summary()


def test_description_round_trips_and_refuses_inconsistency():
  d = description.Description(model={"patch_size": 7, "resnet_layers": (3, 4)}, image_size=28,
                             num_classes=2, class_names=("cat", "dog"), output="sigmoid",
                             preprocessing=description.Preprocessing((0.0, 1.0), "central_crop"))
  assert description.Description.from_json(d.to_json()) == d
  with pytest.raises(ValueError, match="3 class names for 2 classes"):
    d.replace(class_names=("a", "b", "c"))
  with pytest.raises(ValueError, match="newer vit_jax"):
    description.Description.from_dict(dict(d.to_dict(), format=99))


def test_preprocessing_states_mean_std_and_interpolation_and_round_trips():
  pre = description.Preprocessing(**HUB_PREPROCESSING)
  assert pre.value_range is None and pre.mean == IMAGENET_MEAN
  scale, offset = pre.affine()  # uint8 * scale + offset == (uint8 / 255 - mean) / std.
  pixels = np.array([0.0, 128.0, 255.0])[:, None]
  np.testing.assert_allclose(pixels * scale + offset,
                             (pixels / 255 - IMAGENET_MEAN) / IMAGENET_STD, rtol=1e-12)
  assert description.Preprocessing().affine() == ((2 / 255,) * 3, (-1.0,) * 3)
  d = description.Description(model={"patch_size": 16}, image_size=224, num_classes=1000,
                             preprocessing=pre)
  assert d.to_dict()["format"] == 2
  assert description.Description.from_json(d.to_json()) == d
  timm = d.replace(preprocessing=dataclasses.replace(pre, geometry="torchvision"))
  assert timm.to_dict()["format"] == 4
  assert description.Description.from_json(timm.to_json()) == timm
  assert ("input mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225) of [0, 1] pixels, "
          "central_crop, bicubic") in d.summary()
  # A value range description is written as before (format 1, no new keys) ...
  old = d.replace(preprocessing=description.Preprocessing((0.0, 1.0))).to_dict()
  assert old["format"] == 1 and set(old["preprocessing"]) == {
      "value_range", "crop", "central_crop_fraction", "channels"}
  # ... and one written before mean, std and interpolation existed reads.
  old["preprocessing"]["value_range"] = [0, 1]
  loaded = description.Description.from_dict(old)
  assert loaded.preprocessing == description.Preprocessing(value_range=(0.0, 1.0))
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
    description.Preprocessing(**fields)


def test_fine_tuning_takes_mean_and_std_of_its_starting_checkpoint(tmp_path):
  dataset = ("fashion_mnist", str(tmp_path / "tfds"))  # Only the configs: nothing is read.
  path = _mean_std_npz(tmp_path, dataset)
  c = tiny_config(dataset, pretrained=path)
  run_setup.resolve_value_range(c)
  assert (c.data.value_range, c.data.mean, c.data.std) == (None, IMAGENET_MEAN, IMAGENET_STD)
  config_lib.validate(c)
  # The run's own checkpoints describe what it trained with (its eval crop, bilinear).
  assert description.Preprocessing.from_data_config(c.data) == description.Preprocessing(
      mean=IMAGENET_MEAN, std=IMAGENET_STD)
  c = tiny_config(dataset, pretrained=path, **{"data.mean": IMAGENET_MEAN,
                                               "data.std": IMAGENET_STD})
  run_setup.resolve_value_range(c)  # The same values, given: agreed.
  for field, value, records in (("value_range", (-1.0, 1.0), r"normalisation 'mean \(0.485"),
                                ("mean", (0.5, 0.5, 0.5), r"mean \(0.485, 0.456, 0.406\)")):
    c = tiny_config(dataset, pretrained=path, **{f"data.{field}": value})
    if field == "mean":
      c.data.std = IMAGENET_STD
    with pytest.raises(description.DescriptionMismatch,
                       match=rf"config.data.{field} .* disagrees with .*{records}"):
      run_setup.resolve_value_range(c)


# Stored descriptions that no vit_jax wrote: each read is one line or a fall-back, never a
# traceback from deep inside the reader.
_NOT_DESCRIPTIONS = {
    "not JSON": "{model: ",
    "a list": "[]",
    "a number": "3",
    "no model": '{"image_size": 32, "num_classes": 10}',
    "model a list": '{"model": [], "image_size": 32, "num_classes": 10}',
    "unknown field": '{"model": {}, "image_size": 32, "num_classes": 10, "colour": 1}',
    "bad preprocessing": '{"model": {}, "image_size": 32, "num_classes": 10, '
                         '"preprocessing": {"crop": "sideways"}}',
    "class names off": '{"model": {}, "image_size": 32, "num_classes": 3, '
                       '"class_names": ["a"]}',
}


@pytest.mark.parametrize("text", _NOT_DESCRIPTIONS.values(), ids=_NOT_DESCRIPTIONS.keys())
def test_a_stored_description_no_vit_jax_wrote_is_one_line_or_a_fallback(tmp_path, text,
                                                                          caplog):
  with pytest.raises(description.UnreadableDescription) as raised:
    description.Description.from_json(text)
  assert "\n" not in str(raised.value)
  # An .npz: one warning, and its arrays described as a released file's are.
  path = tiny_serving_checkpoint(tmp_path / "released.npz", "plain")
  arrays = dict(np.load(path, allow_pickle=False))
  arrays[description.DESCRIPTION_KEY] = np.array(text)
  np.savez(tmp_path / "odd.npz", **arrays)
  described = loader.describe(str(tmp_path / "odd.npz"))
  assert described.assumed == ("model", "preprocessing") and described.image_size == 32
  assert sum("no description vit_jax wrote" in r.getMessage() for r in caplog.records) == 1
  # A run's step: described from its resume record, or one line where it has none.
  meta = {"description": json.loads(text) if text != "{model: " else text,
          "model": described.model, "model_name": None, "num_classes": 10,
          "trajectory": {"loss": "softmax_xent",
                         "data": {"name": "digits", "image_size": 32, "eval_crop": "resize",
                                  "central_crop_fraction": 1.0, "value_range": (-1, 1)}}}
  from_record = run.step_description(meta, 7)
  assert (from_record.step, from_record.image_size, from_record.output) == (7, 32, "softmax")
  del meta["trajectory"]
  with pytest.raises(description.UnreadableDescription, match="step 7's") as raised:
    run.step_description(meta, 7)
  assert "\n" not in str(raised.value)
