"""`vit-predict`: image files, globs and folders to a CSV of top-k labels,
with a checkpoint (JAX) or an exported model; unreadable images listed, never dropped."""
import csv
import glob
import io
import os
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from helpers import run_cli, tiny_serving_checkpoint
from vit_jax.checkpoint import description, loader
from vit_jax.tools import predict
from vit_jax.serving import convert, images, labels, predictors


@pytest.fixture(scope="module")
def model_npz(tmp_path_factory) -> str:
  return tiny_serving_checkpoint(tmp_path_factory.mktemp("predict") / "model.npz", "plain")


@pytest.fixture
def photo_dir(tmp_path, digits_folder):
  """Five real digits (one a JPEG, one in a subfolder, one RGB at another size, one a TIFF,
  which only PIL decodes), a broken PNG, a truncated JPEG and a text file, which a folder scan
  names as no image."""
  files = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[:5]
  (tmp_path / "sub").mkdir()
  for i, f in enumerate(files[:3]):
    shutil.copy(f, tmp_path / f"digit{i}.png")
  Image.open(files[3]).convert("RGB").resize((40, 30)).save(tmp_path / "sub" / "digit3.jpg")
  Image.open(files[4]).save(tmp_path / "sub" / "digit4.tiff")
  (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
  jpeg = (tmp_path / "sub" / "digit3.jpg").read_bytes()
  (tmp_path / "sub" / "cut.jpg").write_bytes(jpeg[:len(jpeg) // 2])
  (tmp_path / "notes.txt").write_text("not an image")
  return tmp_path


def read_csv(text: str) -> list[dict[str, str]]:
  return list(csv.DictReader(io.StringIO(text)))


def test_find_images_from_files_globs_and_folders(photo_dir):
  found, unmatched, others = images.find_images([
      str(photo_dir), str(photo_dir / "digit0.png"), str(photo_dir / "*.png"),
      str(photo_dir / "none_*.jpg"), str(photo_dir / "missing.png")])
  names = [os.path.relpath(p, photo_dir) for p in found]
  assert names == ["broken.png", "digit0.png", "digit1.png", "digit2.png",
                   os.path.join("sub", "cut.jpg"), os.path.join("sub", "digit3.jpg"),
                   os.path.join("sub", "digit4.tiff")]
  assert unmatched == [str(photo_dir / "none_*.jpg"), str(photo_dir / "missing.png")]
  assert others == [str(photo_dir / "notes.txt")]


def test_read_image_decodes_and_resizes_as_the_pipeline(photo_dir):
  gray = images.read_image(str(photo_dir / "digit0.png"), 8)  # Stored 8x8: values kept.
  stored = np.asarray(Image.open(photo_dir / "digit0.png"))
  assert gray.dtype == np.uint8 and gray.shape == (8, 8, 3)
  np.testing.assert_array_equal(gray, np.repeat(stored[..., None], 3, axis=-1))
  assert images.read_image(str(photo_dir / "sub" / "digit3.jpg"), 32).shape == (32, 32, 3)
  tiff = images.read_image(str(photo_dir / "sub" / "digit4.tiff"), 8)  # PIL's, as the PNG's.
  np.testing.assert_array_equal(tiff, np.repeat(np.asarray(Image.open(
      photo_dir / "sub" / "digit4.tiff"))[..., None], 3, axis=-1))
  for bad in ("broken.png", "notes.txt", "missing.png", "sub/cut.jpg"):
    with pytest.raises(ValueError):
      images.read_image(str(photo_dir / bad), 32)


def test_read_image_resizes_with_the_described_interpolation(photo_dir):
  import tensorflow as tf
  path = str(photo_dir / "sub" / "digit3.jpg")  # 40 x 30: shrunk to 32, antialiased.
  decoded = tf.io.decode_image(tf.io.read_file(path), 3)
  got = {}
  for method in ("bilinear", "bicubic"):
    got[method] = images.read_image(path, 32, description.Preprocessing(interpolation=method))
    want = images.to_uint8(tf.image.resize(decoded, [32, 32], method, antialias=True))
    np.testing.assert_array_equal(got[method], want.numpy())
  assert (got["bilinear"] != got["bicubic"]).any()


def test_labels_probabilities_and_top_k():
  logits = np.log(np.array([[0.1, 0.6, 0.3]]))
  assert [n for n, _ in labels.top_k(logits, ["a", "b", "c"], k=3)[0]] == ["b", "c", "a"]
  np.testing.assert_allclose(labels.probabilities(logits), [[0.1, 0.6, 0.3]])
  np.testing.assert_allclose(labels.probabilities(np.zeros((1, 2)), sigmoid=True), [[0.5, 0.5]])


def test_predict_writes_top_k_and_lists_unreadable_images(model_npz, photo_dir, tmp_path,
                                                          capfd):
  """Every readable image classified, every other file named with why, in the count too; the
  unreadable ones fail the run (jobs.py's rule), with no line from the JPEG decoder."""
  (tmp_path / "labels.txt").write_text("\n".join(f"digit {i}" for i in range(10)))
  out = tmp_path / "preds.csv"
  code = predict.main([model_npz, str(photo_dir), str(photo_dir / "nothing*.png"),
                       "--labels", str(tmp_path / "labels.txt"), "--top_k", "3",
                       "--batch_size", "4", "--out", str(out)])
  err = capfd.readouterr().err
  assert code == 1, err
  rows = read_csv(out.read_text())
  assert list(rows[0]) == ["path", "label_1", "prob_1", "label_2", "prob_2", "label_3", "prob_3"]
  assert len(rows) == 5 and not any("broken" in r["path"] for r in rows)
  broken, cut = photo_dir / "broken.png", photo_dir / "sub" / "cut.jpg"
  lines = err.splitlines()
  assert lines[0] == f"No images at {photo_dir / 'nothing*.png'}", err
  assert lines[1].startswith(f"Skipping unreadable image {broken}: Invalid PNG"), err
  assert lines[2] == (f"Skipping unreadable image {cut}: jpeg::Uncompress failed. Invalid JPEG "
                      "data or crop window."), err  # libjpeg's own lines before it: gone.
  skipped = ": skipped, no image format PIL or TensorFlow reads"
  assert lines[3:] == [
      f"Classified 5 of 9 files into {out}; 2 unreadable, 2 not an image",
      f"  {tmp_path / 'labels.txt'}{skipped}", f"  {photo_dir / 'notes.txt'}{skipped}",
      "Images that failed (2):", lines[1].replace("Skipping unreadable image", " ", 1),
      lines[2].replace("Skipping unreadable image", " ", 1)], err
  # The rows hold the model's own top-3, in order, with softmax probabilities.
  loaded = loader.load(model_npz)
  batch = np.stack([images.read_image(r["path"], loaded.image_size) for r in rows])
  probs = labels.probabilities(predictors.jax_predictor(loaded)(batch))
  for row, p in zip(rows, probs):
    top = np.argsort(-p)[:3]
    assert [row[f"label_{i + 1}"] for i in range(3)] == [f"digit {j}" for j in top]
    np.testing.assert_allclose([float(row[f"prob_{i + 1}"]) for i in range(3)], p[top], atol=1e-5)


def test_predict_with_an_exported_model_matches_jax(model_npz, photo_dir, tmp_path, capsys):
  onnx_file = convert.write(loader.load(model_npz), str(tmp_path / "model.onnx"), "onnx")
  results = {}
  for model in (model_npz, onnx_file):
    assert predict.main([model, str(photo_dir / "digit*.png"), "--sigmoid"]) == 0
    results[model] = read_csv(capsys.readouterr().out)
  jax_rows, onnx_rows = results[model_npz], results[onnx_file]
  assert [r["path"] for r in jax_rows] == [str(photo_dir / f"digit{i}.png") for i in range(3)]
  assert [r["label_1"] for r in onnx_rows] == [r["label_1"] for r in jax_rows]
  np.testing.assert_allclose([float(r["prob_1"]) for r in onnx_rows],
                             [float(r["prob_1"]) for r in jax_rows], atol=1e-5)
  assert jax_rows[0]["label_1"].startswith("class ")


def test_predict_cli_fails_clearly_without_images(model_npz, tmp_path, capsys):
  r = run_cli([sys.executable, "-m", "vit_jax.tools.predict", model_npz, str(tmp_path / "*.jpg")])
  assert r.returncode == 2 and not r.stdout, r.stderr
  assert r.stderr == f"error: No image files to classify: nothing at {tmp_path / '*.jpg'}.\n"
  (tmp_path / "bad.jpg").write_bytes(b"no")  # In this process: the start-up is checked above.
  capsys.readouterr()
  assert predict.main([model_npz, str(tmp_path), "--out", str(tmp_path / "p.csv")]) == 2
  out, err = capsys.readouterr()
  assert err.startswith(f"error: no readable image: {tmp_path / 'bad.jpg'}: ")
  assert len(err.splitlines()) == 1 and not out and not (tmp_path / "p.csv").exists()
