"""Few-shot linear probes (evaluators/fewshot_lsr.py): the solver against SciPy's least squares,
sampling, errors, batches preprocessed as the checkpoint records; and vit-fewshot's sweep
(tools/fewshot.py) reporting in its own flags."""
import ml_collections
import numpy as np
import pytest
import scipy.linalg
from PIL import Image

from helpers import VALUE_RANGE, tiny_serving_checkpoint
from vit_jax.checkpoint import description, loader
from vit_jax.evaluators import fewshot_lsr
from vit_jax.train import sharding


@pytest.mark.parametrize("n,d", [(40, 65), (300, 17)])  # Dual (n <= d) and primal forms.
def test_ridge_matches_least_squares_on_the_augmented_system(n, d):
  """Ridge is least squares on X stacked over sqrt(l2) I, targets over zeros: solved by LAPACK's
  SVD-based solver, not the eigendecompositions of the Gram matrices that ridge_weights uses."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + rng.normal(size=d)
  y = rng.integers(0, 5, size=n)
  x_test = rng.normal(size=(200, d))
  xs, xts = fewshot_lsr.standardise(x, x_test)
  l2s = [2.0**-3, 1.0, 2.0**6]
  for l2, w in zip(l2s, fewshot_lsr.ridge_weights(xs, y, l2s, num_classes=5)):
    a = np.concatenate([xs, np.sqrt(l2) * np.eye(xs.shape[1])])
    t = np.concatenate([2.0 * np.eye(5)[y] - 1.0, np.zeros((xs.shape[1], 5))])
    reference = scipy.linalg.lstsq(a, t, lapack_driver="gelsd")[0]
    np.testing.assert_allclose(w, reference, atol=1e-5, rtol=1e-6)
    ours = np.mean(np.argmax(xts @ w, -1) == np.argmax(xts @ reference, -1))
    assert ours == pytest.approx(1.0, abs=1e-4)


def test_standardise_uses_train_statistics_and_adds_bias_column():
  x = np.array([[1.0, 10.0], [3.0, 30.0]])
  xs, xt = fewshot_lsr.standardise(x, np.array([[2.0, 20.0]]))
  np.testing.assert_allclose(xs[:, :2].mean(0), 0.0, atol=1e-12)
  np.testing.assert_allclose(xs[:, 2], 100.0)
  np.testing.assert_allclose(xt, [[0.0, 0.0, 100.0]], atol=1e-12)


def test_shots_are_nested_and_balanced():
  labels = np.repeat(np.arange(4), 30)
  big = fewshot_lsr.sample_shots(labels, 10, seed=3, num_classes=4).reshape(4, 10)
  again = fewshot_lsr.sample_shots(labels, 10, seed=3, num_classes=4).reshape(4, 10)
  np.testing.assert_array_equal(big, again)
  assert all(set(labels[row]) == {c} for c, row in enumerate(big))
  other_seed = fewshot_lsr.sample_shots(labels, 10, seed=4, num_classes=4)
  assert set(other_seed) != set(big.ravel())


def test_too_many_shots_names_the_class_and_counts():
  labels = np.array([0] * 30 + [1] * 3 + [2] * 30)
  with pytest.raises(ValueError, match="Class 1 has 3 examples .* fewer than the 5 shots"):
    fewshot_lsr.sample_shots(labels, 5, seed=0, num_classes=3)


def test_nonpositive_l2_is_rejected():
  with pytest.raises(ValueError, match="must be > 0"):
    fewshot_lsr.ridge_weights(np.ones((3, 2)), np.zeros(3, int), [1.0, 0.0], 2)
  with pytest.raises(ValueError, match="must be > 0"):
    fewshot_lsr.FewShotEvaluator(lambda p, x: x, {}, l2_regs=(-1.0,))


def _clusters(n_train, n_test, num_classes=5, d=32):
  """Gaussian blobs around shared class centres: (train, test)."""
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(num_classes, d)) * 0.5
  out = []
  for n in (n_train, n_test):
    y = np.repeat(np.arange(num_classes), n)
    out.append((centers[y] + rng.normal(size=(len(y), d)), y))
  return out


def test_accuracy_rises_with_shots_and_l2_is_chosen_on_train_data():
  train, test = _clusters(60, 100)
  results = fewshot_lsr.evaluate_dataset("blobs", train, test, 5, shots=(1, 5, 25), seeds=3,
                                     l2_regs=(0.01, 1.0, 100.0, 1e4))
  means = [r.mean for r in results]
  assert means[0] < means[1] < means[2]
  assert all(len(r.accuracies) == 3 and r.l2 in (0.01, 1.0, 100.0, 1e4) for r in results)
  assert results[-1].mean > 0.8


def test_nan_features_are_reported():
  (x, y), test = _clusters(30, 10)
  x[3, 4] = np.nan
  with pytest.raises(FloatingPointError, match="train representations contain NaN"):
    fewshot_lsr.evaluate_dataset("blobs", (x, y), test, 5, shots=(1,))


def test_sweep_reports_in_its_own_flags(tmp_path, capsys):
  from vit_jax.tools import fewshot
  (tmp_path / "none.npz").write_bytes(b"")  # There: the datasets are checked before reading.
  code = fewshot.main([str(tmp_path / "none.npz"), "--datasets=cifar11",
                       f"--out_dir={tmp_path / 'out'}"])
  assert code == 2
  err = capsys.readouterr().err
  assert "--datasets='cifar11' is neither a TFDS dataset" in err and "pass --download" in err
  assert "data.download" not in err


def test_a_sweep_where_every_checkpoint_fails_writes_a_well_formed_report(tmp_path, digits_folder):
  from vit_jax.tools import fewshot
  out = tmp_path / "out"
  (tmp_path / "broken.npz").write_bytes(b"not a checkpoint")
  code = fewshot.main([str(tmp_path / "broken.npz"), f"--datasets={digits_folder}",
                       "--image_size=16", f"--out_dir={out}"])
  assert code == 1
  report = (out / "fewshot.md").read_text()
  assert report.startswith("No results: every checkpoint failed.\n\nFailed:\n- ")
  assert "broken.npz: " in report


def test_a_failed_checkpoint_fails_the_sweep_after_the_others_ran(tmp_path, capsys):
  """jobs.py's rule: the good checkpoint's rows are written, the bad one is named in one line
  (no traceback), the status is 1."""
  from vit_jax.tools import fewshot
  good = tiny_serving_checkpoint(tmp_path / "good.npz", "plain")
  (tmp_path / "broken.npz").write_bytes(b"not a checkpoint")
  images = np.random.default_rng(0).integers(0, 255, (3, 4, 16, 16, 3), np.uint8)
  for split, n in (("train", 4), ("test", 1)):  # Two to spare a class beyond 2 shots.
    for c, name in enumerate("abc"):
      (tmp_path / "small" / split / name).mkdir(parents=True)
      for i in range(n):
        Image.fromarray(images[c, i]).save(tmp_path / "small" / split / name / f"{i}.png")
  out = tmp_path / "out"
  code = fewshot.main([str(tmp_path / "broken.npz"), good, f"--datasets={tmp_path / 'small'}",
                       "--image_size=16", "--shots=1,2", "--seeds=1", f"--out_dir={out}"])
  err = capsys.readouterr().err
  assert code == 1, err
  assert "Traceback" not in err
  assert err.splitlines()[-2:] == ["Probes that failed (1):",
                                   f"  {tmp_path / 'broken.npz'}: CheckpointError: "
                                   f"{tmp_path / 'broken.npz'} is not an .npz file (no zip "
                                   "header). Released ViT checkpoints are .npz files with "
                                   "'/'-joined keys."]
  assert (out / "fewshot.csv").read_text().count(good) == 2  # Its 1- and 2-shot rows.


def _folder_with_a_broken_image(root):
  images = np.random.default_rng(0).integers(0, 255, (2, 13, 16, 16, 3), np.uint8)
  for split, n in (("train", 12), ("test", 1)):
    for c, name in enumerate("ab"):
      (root / split / name).mkdir(parents=True)
      for i in range(n):
        Image.fromarray(images[c, i]).save(root / split / name / f"{i}.png")
  (root / "train" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
  return str(root)


def test_a_folders_undecodable_files_are_left_out_where_asked(tmp_path, capsys, monkeypatch):
  """vit-fewshot --on_bad_image=skip probes a folder that holds a file no decoder reads (what
  a run trained with data.on_bad_image='skip' suggests next); a run's few-shot evaluator reads
  its folders as the run's data option says."""
  from vit_jax.evaluators import registry
  from vit_jax.tools import fewshot
  folder = _folder_with_a_broken_image(tmp_path / "photos")
  good = tiny_serving_checkpoint(tmp_path / "good.npz", "plain")
  args = [good, f"--datasets={folder}", "--image_size=16", "--shots=1,2", "--seeds=1"]
  assert fewshot.main([*args, f"--out_dir={tmp_path / 'refused'}"]) == 2
  assert "pass --on_bad_image=skip" in capsys.readouterr().err
  assert fewshot.main([*args, "--on_bad_image=skip", f"--out_dir={tmp_path / 'out'}"]) == 0
  assert (tmp_path / "out" / "fewshot.csv").read_text().count(good) == 2
  read = []
  monkeypatch.setattr(fewshot_lsr, "fewshot_datasets", lambda names, reading, *a: read.append(
      reading) or {})
  for on_bad_image in ("fail", "skip"):
    run_data = ml_collections.ConfigDict(dict(on_bad_image=on_bad_image, image_size=16))
    context = registry.EvalContext(None, run_data, "softmax_xent", 8, None,
                                   description.Preprocessing())
    fewshot_lsr.create(ml_collections.ConfigDict(dict(
        datasets=(folder,), data_dir=None, train_split="train", test_split="test", shots=(1,),
        seeds=1, l2=(1.0,))), context)
  assert read == [fewshot_lsr.Reading(on_bad_image="fail"), fewshot_lsr.Reading(
      on_bad_image="skip")]


def test_the_examples_held_out_for_l2_shrink_to_what_small_classes_spare():
  assert fewshot_lsr.held_out_per_class([50, 40, 60], (1, 5, 25)) == 10
  assert fewshot_lsr.held_out_per_class([3, 5, 4], (1, 2)) == 1
  with pytest.raises(ValueError, match="class 'b' has 2 examples: 2 shots take 2 of them, and "
                     "1 more is held out to choose the l2 value on; use at most 1 shots"):
    fewshot_lsr.held_out_per_class([5, 2, 4], (1, 2), class_names=("a", "b", "c"))
  train, test = _clusters(3, 10)  # Three examples a class: two shots, one held out.
  results = fewshot_lsr.evaluate_dataset("blobs", train, test, 5, shots=(1, 2), seeds=2)
  assert [r.shots for r in results] == [1, 2]


def test_fewshot_batches_are_preprocessed_as_the_checkpoint_was(dataset):
  mesh = sharding.make_mesh()
  for value_range in (VALUE_RANGE, (-1.0, 1.0)):
    batches, _ = fewshot_lsr.dataset_batches(
        dataset[0], fewshot_lsr.Reading(dataset[1]), "test[:32]", 28, 32,
        sharding.batch_sharding(mesh),
        description.Preprocessing(value_range))
    images = np.asarray(next(batches())["image"])
    assert (images.min(), images.max()) == pytest.approx(value_range, abs=0.01)


def test_the_representations_read_the_output_tokens_as_the_dinov2_probe_does(tmp_path):
  """Class token first, registers after it, patches last: the patch mean leaves the class token
  and the registers out; a model without a class token refuses to give one."""
  loaded = loader.load(tiny_serving_checkpoint(tmp_path / "families.npz", "families"))
  images = np.random.default_rng(0).uniform(-1, 1, (3, 32, 32, 3)).astype(np.float32)
  fn = lambda r: np.asarray(fewshot_lsr.representation_fn(loaded.model, r)(  # noqa: E731
      loaded.params, images))
  _, aux = loaded.model.apply({"params": loaded.params}, images, return_aux=True)
  tokens = np.asarray(aux["encoded"])
  assert loaded.model.num_prefix_tokens == 3  # The class token and two registers.
  np.testing.assert_array_equal(fn("pre_logits"), aux["pre_logits"])
  np.testing.assert_array_equal(fn("class_token"), tokens[:, 0])
  np.testing.assert_allclose(fn("patch_mean"), tokens[:, 3:].mean(axis=1), rtol=1e-6, atol=1e-6)
  both = fn("class_token+patch_mean")
  assert both.shape == (3, 64)
  np.testing.assert_array_equal(both, np.concatenate([fn("class_token"), fn("patch_mean")], -1))
  gap = loader.load(tiny_serving_checkpoint(tmp_path / "plain.npz", "plain")).model.clone(
      classifier="gap")
  with pytest.raises(ValueError, match="no class token; use patch_mean"):
    fewshot_lsr.representation_fn(gap, "class_token+patch_mean")


def test_a_split_smaller_than_the_batch_is_one_batch_of_its_size(digits_folder):
  """20 images are not padded to a batch of 256 (each padded image ran the model, at 518 px
  ~0.5 GB apiece): the batch is the split's size, split over the devices."""
  mesh = sharding.make_mesh()
  batches, _ = fewshot_lsr.dataset_batches(digits_folder, fewshot_lsr.Reading(), "test[:20]",
                                           16, 256, sharding.batch_sharding(mesh))
  [batch] = list(batches())
  assert batch["image"].shape[0] == -(-20 // mesh.size) * mesh.size
  assert int(np.sum(batch["mask"])) == 20
