"""Serving formats (vit_jax.serving, `vit-export --format`): a SavedModel through jax2tf,
TFLite from it, ONNX from that, each run in its own runtime (TensorFlow, LiteRT, onnxruntime)
and giving JAX's logits within 1e-4 on real images (the handwritten digits of tests/data), at
batch sizes 1 and 7: the table of every format x every tiny model of TINY_SERVING_MODELS, which
holds every GELU form, pooling, norm and position embedding the model has (`vit-export` as a
user runs it, its check of what it wrote, and a training run exported: test_e2e_checkpoints.py)."""
import dataclasses
import glob
import os
import re
import shutil
import sys

import numpy as np
import pytest

from helpers import (REPO, TINY_SERVING_MODELS, TOLERANCE, jax_logits, run_cli,
                     tiny_serving_checkpoint)
from vit_jax.checkpoint import description, loader, npz as npz_lib
from vit_jax.serving import convert, formats, images, onnx, predictors, savedmodel, tflite


@pytest.fixture(scope="module")
def export_kind(tmp_path_factory, digits_folder):
  """kind -> (kind, loaded checkpoint, {format: path}, 7 real uint8 images at its resolution),
  each tiny model exported once for the module: SavedModel, TFLite from it, ONNX from that."""
  done = {}

  def export(kind):
    if kind not in done:
      tmp = tmp_path_factory.mktemp(f"serving_{kind}")
      loaded = loader.load(tiny_serving_checkpoint(tmp / "model.npz", kind))
      paths = {"savedmodel": savedmodel.save(loaded, str(tmp / "saved_model"))}
      paths["tflite"] = tflite.from_savedmodel(paths["savedmodel"], str(tmp / "model.tflite"))
      paths["onnx"] = onnx.from_tflite(paths["tflite"], str(tmp / "model.onnx"))
      assert sorted(paths) == sorted(formats.FORMATS), "export the new format here"
      files = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[::40][:7]
      batch = np.stack([images.read_image(f, loaded.image_size) for f in files])
      done[kind] = kind, loaded, paths, batch
    return done[kind]

  return export


@pytest.fixture(scope="module", params=sorted(TINY_SERVING_MODELS))
def exported(request, export_kind):
  return export_kind(request.param)


def test_the_tiny_models_hold_every_variant_of_the_exported_graph():
  """The table's rows: every GELU form, MLP, pooling, position embedding, rotary embedding and
  q/k/v bias of models/vit.py's CHOICES, and every norm and token of the model, in some row."""
  from vit_jax import models
  built = [models.create_model(name, num_classes=10, **fields)
           for name, _, fields in TINY_SERVING_MODELS.values()]
  # Not in an exported graph: the export runs at the model's own grid, and how a training step
  # executes (Role.EXECUTION: the residual stream's dtype) is not in a checkpoint's description.
  executes = models.registry.fields_of(models.Role.EXECUTION)
  for field, values in models.vit.CHOICES.items():
    if field != "posemb_interpolation" and field not in executes:
      assert {getattr(m, field) for m in built} == set(values), field
  for flag in ("pre_norm", "layer_scale", "fc_norm", "mlp_norm", "attention_norm", "class_token",
               "head_bias"):
    assert {bool(getattr(m, flag)) for m in built} == {True, False}, flag
  assert all(any(f(m) for m in built) for f in (
      lambda m: m.num_registers, lambda m: m.resnet_layers is not None,
      lambda m: m.representation_size, lambda m: m.layer_norm_eps != 1e-6))
  assert sorted(TOLERANCE) == sorted(formats.FORMATS)


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_format_gives_jax_logits_on_real_images(exported, fmt):
  kind, loaded, paths, batch = exported
  predictor = predictors.open_model(paths[fmt])
  assert (predictor.format, predictor.image_size, predictor.num_classes) == (
      fmt, loaded.image_size, 10)
  for batch_size in (1, 7):
    want = jax_logits(loaded, batch[:batch_size])
    assert want.std() > 0.1  # Logits that differ by image and class, not a zero head.
    got = predictor(batch[:batch_size])
    assert got.shape == want.shape == (batch_size, 10)
    diff = np.abs(got - want).max()
    assert diff <= TOLERANCE[fmt], f"{kind} {fmt} batch {batch_size}: max |diff| {diff:.2e}"


def test_the_jax_predictor_gives_the_models_logits(exported):
  """predictors.jax_predictor (a checkpoint's predictor, and what vit-export checks a written
  model against): the model under jax.jit with the serving signature's preprocessing."""
  _, loaded, _, batch = exported
  np.testing.assert_allclose(predictors.jax_predictor(loaded)(batch), jax_logits(loaded, batch),
                             atol=1e-5, rtol=0)


def test_onnx_select_ignores_the_branch_not_taken(tmp_path):
  """XLA's erfc, of which the exact GELU is made, selects between 1 - erf(x) and
  exp(-x^2) p(1 / x^2), which is inf near 0: tf2onnx wrote the select as
  cast(c) * a + cast(!c) * b, NaN there (0 * inf)."""
  import jax
  import tensorflow as tf
  from jax.experimental import jax2tf
  gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  serve = tf.function(jax2tf.convert(gelu, polymorphic_shapes=["(b, 8)"], with_gradient=False,
                                     native_serialization_platforms=("cpu",)),
                      autograph=False, input_signature=[tf.TensorSpec([None, 8], tf.float32)])
  model = tf.lite.TFLiteConverter.from_concrete_functions(
      [serve.get_concrete_function()], serve).convert()
  (tmp_path / "gelu.tflite").write_bytes(model)
  import onnxruntime as ort
  session = ort.InferenceSession(onnx.tflite_to_onnx(str(tmp_path / "gelu.tflite"))
                                 .SerializeToString())
  x = np.array([[0, 1e-30, -1e-6, 1e-3, -0.5, 1, -3, 8]], np.float32)
  got = session.run(None, {session.get_inputs()[0].name: x})[0]
  np.testing.assert_allclose(got, gelu(x), atol=1e-7, rtol=1e-6)


def test_signatures_take_uint8_images_of_any_batch_and_give_logits_and_top5(exported):
  _, loaded, paths, batch = exported
  size, want = loaded.image_size, jax_logits(loaded, batch)
  top5 = np.argsort(-want, axis=-1, kind="stable")[:, :5]
  serve = savedmodel.load(paths["savedmodel"])
  spec = serve.structured_input_signature[1][savedmodel.INPUT]
  assert spec.shape.as_list() == [None, size, size, 3] and spec.dtype.name == "uint8"
  out = {k: v.numpy() for k, v in serve(images=batch).items()}
  assert out["top5"].dtype == np.int32
  np.testing.assert_array_equal(out["top5"], top5)
  lite = tflite.signature_runner(paths["tflite"])
  assert list(lite.get_input_details()[savedmodel.INPUT]["shape_signature"]) == [-1, size, size, 3]
  np.testing.assert_array_equal(lite(images=batch[:3])["top5"], top5[:3])
  session = onnx.session(paths["onnx"])
  (inp,), outs = session.get_inputs(), session.get_outputs()
  assert (inp.name, inp.shape, inp.type) == ("images", ["batch", size, size, 3], "tensor(uint8)")
  assert [o.name for o in outs] == ["logits", "top5"]
  np.testing.assert_array_equal(session.run(["top5"], {"images": batch[:2]})[0], top5[:2])


def test_runner_names_the_input_it_takes(exported):
  _, loaded, paths, batch = exported
  predictor = predictors.open_model(paths["onnx"])
  with pytest.raises(ValueError, match=rf"takes uint8 images \(batch, {loaded.image_size}"):
    predictor(batch.astype(np.float32))
  with pytest.raises(ValueError, match="architecture and resolution are fixed"):
    predictors.open_model(paths["tflite"], image_size=64)


def test_onnx_segment_prod_leaves_out_negative_ids(tmp_path):
  """TFLite computes dynamic reshape targets as unsorted_segment_prod(shape, [-1, -1, 0]):
  tf2onnx's own handler counted the -1 elements into the last segment."""
  import tensorflow as tf

  @tf.function(input_signature=[tf.TensorSpec([None, 17, 32], tf.float32)])
  def target_shape(x):
    return tf.math.unsorted_segment_prod(tf.shape(x), tf.constant([-1, 0, 1]), 2)

  model = tf.lite.TFLiteConverter.from_concrete_functions(
      [target_shape.get_concrete_function()], target_shape).convert()
  (tmp_path / "seg.tflite").write_bytes(model)
  proto = onnx.tflite_to_onnx(str(tmp_path / "seg.tflite"))
  import onnxruntime as ort
  session = ort.InferenceSession(proto.SerializeToString())
  x = np.zeros((7, 17, 32), np.float32)
  assert session.run(None, {session.get_inputs()[0].name: x})[0].tolist() == [17, 32]
  assert target_shape(x).numpy().tolist() == [17, 32]


def test_savedmodel_and_jax_predictor_normalise_by_the_described_mean_and_std(tmp_path,
                                                                          digits_folder):
  """A checkpoint from the Hub states mean and std (and bicubic resizing): the exported
  signature and the JAX predictor both give the logits of (uint8 / 255 - mean) / std."""
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  plain = loader.load(tiny_serving_checkpoint(tmp_path / "plain.npz", "plain"))
  pre = description.Preprocessing(mean=tuple(mean), std=tuple(std), interpolation="bicubic")
  path = str(tmp_path / "hub.npz")
  npz_lib.save_npz(path, plain.params, plain.description.replace(preprocessing=pre,
                                                                     assumed=()))
  loaded = loader.load(path)
  assert loaded.description.preprocessing == pre
  files = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[::40][:7]
  batch = np.stack([images.read_image(f, loaded.image_size, pre) for f in files])
  x = ((batch / 255.0 - mean) / std).astype(np.float32)  # By hand.
  want = np.asarray(loaded.model.apply({"params": loaded.params}, x, train=False))
  as_value_range = jax_logits(plain, batch)  # What [0, 255] -> [-1, 1] would give.
  assert np.abs(as_value_range - want).max() > 0.1
  np.testing.assert_allclose(predictors.jax_predictor(loaded)(batch), want, atol=1e-5, rtol=0)
  serve = savedmodel.serving_module(loaded, platforms=("cpu",)).serve
  np.testing.assert_allclose(serve(batch)["logits"].numpy(), want, atol=TOLERANCE["savedmodel"],
                             rtol=0)


def test_headless_models_and_unknown_formats_are_refused(tmp_path):
  path = tiny_serving_checkpoint(tmp_path / "model.npz", "plain")
  with pytest.raises(ValueError, match="no classification head"):
    savedmodel.serving_module(loader.load(path, head=False))
  with pytest.raises(ValueError, match="use one of savedmodel, tflite, onnx"):
    convert.write(loader.load(path), str(tmp_path / "x"), "torchscript")


def test_inspect_opens_each_format_and_refuses_a_truncated_one(export_kind, tmp_path, capsys):
  """vit-inspect reports an exported model only once its runtime opened it: cut to half, each
  format is one `error:` line and status 2, not a healthy-looking report."""
  import shutil
  from vit_jax.tools import inspect_checkpoint
  _, loaded, paths, _ = export_kind("families")  # The formats' files, whatever their model.
  assert inspect_checkpoint.main([paths["savedmodel"]]) == 0  # The one with a description here.
  assert f"in savedmodel's runtime: {loaded.image_size} px input, 10 outputs" in (
      capsys.readouterr().out)
  for fmt, path in sorted(paths.items()):
    damaged = tmp_path / os.path.basename(path)
    if fmt == "savedmodel":
      shutil.copytree(path, damaged)
      files = [f for f in damaged.rglob("*") if f.is_file() and "assets.extra" not in f.parts]
      largest = max(files, key=lambda f: f.stat().st_size)  # The weights.
    else:
      largest = damaged
      shutil.copy(path, damaged)
    largest.write_bytes(largest.read_bytes()[:largest.stat().st_size // 2])
    assert inspect_checkpoint.main([str(damaged)]) == 2, fmt
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {damaged}: the exported {fmt} model "
                                               "cannot be opened"), (fmt, err)


def test_predict_on_a_tflite_model_says_only_its_summary(export_kind, digits_folder):
  """`vit-predict model.tflite IMAGES`, a process of its own (LiteRT says it once a process):
  the rows on stdout, the summary alone on stderr, not LiteRT's "INFO: Created TensorFlow Lite
  XNNPACK delegate for CPU." from its first call before it."""
  _, _, paths, _ = export_kind("families")
  images = sorted(glob.glob(os.path.join(digits_folder, "test", "0", "*.png")))[:3]
  done = run_cli([sys.executable, "-m", "vit_jax.tools.predict", paths["tflite"], *images])
  assert done.returncode == 0, done.stderr[-3000:]
  assert len(done.stdout.splitlines()) == 4
  assert done.stderr == "Classified 3 of 3 files; 0 unreadable, 0 not an image\n"


def _export_extra() -> list[str]:
  """The import names of setup.py's export extra (`EXPORT`), its version bounds left out."""
  listed = re.search(r"^EXPORT = \[(.*?)\]", (REPO / "setup.py").read_text(), re.M | re.S)[1]
  return [re.split(r"[<>=!~ ]", r)[0].replace("-", "_") for r in re.findall(r'"([^"]+)"', listed)]


def test_a_format_whose_packages_are_not_installed_is_refused_in_one_line(
    export_kind, tmp_path, monkeypatch, capsys):
  """The export extra left out (each of its packages made absent: `sys.modules[name] = None`,
  Python's own "no module" for import and find_spec): vit-export refuses TFLite and ONNX before
  converting, writing nothing (it wrote half a .tflite and a traceback before), vit-predict and
  vit-inspect refuse to open such a model (it was "truncated or damaged"), each in one `error:`
  line naming the packages and the extra, status 2. The SavedModel needs none of them: its
  model opens as before. Every package of the extra is some format's, and no format needs one
  outside it, so the line's `pip install` is the fix."""
  import sys
  from PIL import Image
  from vit_jax.tools import export, inspect_checkpoint, predict
  extra = _export_extra()
  needed = {fmt: formats.module(fmt).REQUIRES for fmt in formats.FORMATS}
  assert set().union(*needed.values()) == set(extra), (needed, extra)
  _, loaded, paths, batch = export_kind("plain")
  npz = tiny_serving_checkpoint(tmp_path / "model.npz", "plain")
  image = tmp_path / "image.png"
  Image.fromarray(batch[0]).save(image)
  for name in extra:
    monkeypatch.setitem(sys.modules, name, None)
  for fmt in sorted(formats.FORMATS):
    if not needed[fmt]:
      assert formats.not_installed(fmt) == [] and inspect_checkpoint.main([paths[fmt]]) == 0
      capsys.readouterr()
      continue
    out = tmp_path / f"out.{fmt}"
    line = (f"the {fmt} format needs {', '.join(needed[fmt])}, not installed here: pip "
            "install 'vit_jax[export]'")
    for command, argv, subject in (
        (export, [npz, str(out), "--format", fmt], f"--format {fmt}"),
        (predict, [paths[fmt], str(image)], paths[fmt]),
        (inspect_checkpoint, [paths[fmt]], paths[fmt])):
      assert command.main(argv) == 2, (fmt, command.__name__)
      captured = capsys.readouterr()
      assert captured.err == f"error: {subject}: {line}\n", (fmt, command.__name__, captured)
      assert not out.exists() and not captured.out, (fmt, command.__name__)


def test_an_export_that_fails_half_way_leaves_nothing_at_out(tmp_path, monkeypatch):
  """A conversion that raises after writing part of OUT (a converter's fault, Ctrl-C): OUT is
  removed, as a model its runtime disagrees with is; a SavedModel's folder that was there
  before is kept, empty, as vit-export found it."""
  npz = tiny_serving_checkpoint(tmp_path / "model.npz", "plain")
  (tmp_path / "saved").mkdir()
  for fmt, out in (("tflite", tmp_path / "half.tflite"), ("savedmodel", tmp_path / "saved")):
    def half(loaded, out, scratch, **kwargs):
      target = os.path.join(out, "saved_model.pb") if os.path.isdir(out) else out
      with open(target, "wb") as f:
        f.write(b"half")
      raise KeyboardInterrupt
    monkeypatch.setattr(formats.module(fmt), "write", half)
    with pytest.raises(KeyboardInterrupt):
      convert.export(npz, str(out), fmt)
    assert (not out.exists()) if fmt == "tflite" else (list(out.iterdir()) == []), fmt


def test_commands_that_read_parameters_refuse_an_exported_model_naming_its_checkpoint(
    export_kind, tmp_path, capsys):
  """vit-fewshot, vit-transfer and vit-export read a checkpoint's parameters: given a model
  that vit-export wrote, in any format, each refuses it in one line, status 2, writing nothing,
  and names the checkpoint it was exported from where its description records it (the loader
  called it no .npz file or no step directory, and vit-fewshot counted it a failed probe).
  vit-train's config.pretrained: tests/test_cli.py."""
  from vit_jax.tools import export, fewshot, transfer
  _, loaded, paths, _ = export_kind("plain")
  recorded = str(tmp_path / "recorded.tflite")
  shutil.copy(paths["tflite"], recorded)
  tflite.write_description(recorded, loaded.description.replace(exported_from="/runs/r/9"))
  out = tmp_path / "out"
  cases = [(path, fmt, "") for fmt, path in sorted(paths.items())] + [
      (recorded, "tflite", " (/runs/r/9)")]
  for path, fmt, origin in cases:
    for command, argv in (
        (fewshot, [path, "--datasets=fashion_mnist", "--out_dir", str(out)]),
        (transfer, [path, "--suite", "fashion_mnist", "--out_dir", str(out)]),
        (export, [path, str(out)])):
      assert command.main(argv) == 2, (fmt, command.__name__)
      err = capsys.readouterr().err
      assert err == (f"error: {path} is a model that vit-export wrote ({fmt}): a graph for "
                     "serving, not the parameters this command reads; give the checkpoint it "
                     f"was exported from{origin}\n"), (fmt, command.__name__, err)
      assert not out.exists(), (fmt, command.__name__)


def test_every_format_of_the_table_keeps_the_contract_and_every_command_offers_it():
  """formats.FORMATS drives conversion, prediction and vit-export's choices: each row's module
  has the four functions, tells only its own files, and is offered by every entry point."""
  import inspect as pyinspect
  from vit_jax.tools import export
  contract = {"holds": ["path"], "write": ["loaded", "out", "scratch", "kwargs"],
              "read_description": ["path"], "predictor": ["path", "num_threads"]}
  files = {"savedmodel": None, "tflite": "m.tflite", "onnx": "m.onnx"}
  assert sorted(files) == sorted(formats.FORMATS), "name a file of the new format here"
  for fmt in formats.FORMATS:
    module = formats.module(fmt)
    for name, params in contract.items():
      assert list(pyinspect.signature(getattr(module, name)).parameters) == params, (fmt, name)
    assert [f for f, name in files.items() if name and module.holds(name)] == (
        [fmt] if files[fmt] else [])
    assert fmt in export.CHOICES


def test_export_replaces_a_file_only_where_it_wrote_it(export_kind, tmp_path):
  """vit-export's check before it writes OUT: a file there is its own where it carries the
  description where the format keeps it; a user's file, or a model without one, is not."""
  import shutil
  from vit_jax.tools import export
  _, loaded, paths, _ = export_kind("families")
  ours = {"tflite": str(tmp_path / "model.tflite"), "onnx": str(tmp_path / "model.onnx"),
          "npz": str(tmp_path / "model.npz")}
  shutil.copy(paths["tflite"], ours["tflite"])
  tflite.write_description(ours["tflite"], loaded.description)
  onnx.from_tflite(paths["tflite"], ours["onnx"], loaded.description)
  npz_lib.save_npz(ours["npz"], loaded.params, loaded.description)
  assert all(export.written_by_export(path, fmt) for fmt, path in ours.items())
  users = tmp_path / "notes.npz"
  users.write_text("mine")
  np.savez(tmp_path / "arrays.npz", w=np.zeros(3))
  theirs = [(paths["tflite"], "tflite"), (paths["onnx"], "onnx"), (str(users), "npz"),
            (str(users), "onnx"), (str(tmp_path / "arrays.npz"), "adapters"),
            (ours["onnx"], "tflite")]
  assert not any(export.written_by_export(path, fmt) for path, fmt in theirs)


def test_export_runs_what_it_wrote_and_removes_a_model_that_differs(export_kind, tmp_path,
                                                                    monkeypatch, capsys):
  """vit-export checks each serving format in its runtime against JAX before it says Wrote: a
  real export of the exact GELU to ONNX passes (NaN before); a runtime made to give other logits
  (offset, NaN, failing) is one `error:` line with the difference, status 1, OUT removed."""
  from vit_jax.serving import convert
  from vit_jax.tools import export
  _, loaded, paths, _ = export_kind("exact")
  npz = tiny_serving_checkpoint(tmp_path / "exact.npz", "exact")
  out = tmp_path / "real.onnx"
  assert export.main([npz, str(out), "--format", "onnx"]) == 0
  printed = capsys.readouterr().out
  assert f"Wrote {out} (onnx): " in printed
  diff = float(re.search(r"Checked: run in its runtime, (\S+) from JAX's logits", printed)[1])
  assert out.exists() and diff <= TOLERANCE["onnx"]
  # The rest copies the module's files for `write`, and spoils what the runtime gives.
  monkeypatch.setattr(convert, "write", lambda loaded, out, fmt: (
      shutil.copytree if fmt == "savedmodel" else shutil.copy)(paths[fmt], out))
  real_open = predictors.open_model
  spoil = {"offset": lambda y: y + np.float32(0.25), "nan": lambda y: y * np.nan,
           "raises": lambda y: np.asarray(1 / 0)}
  for (fmt, how), said in zip(
      [("onnx", "offset"), ("tflite", "nan"), ("savedmodel", "offset"), ("onnx", "raises")],
      ["is 2.5e-01 from JAX's logits (max |diff|; tolerance ",
       "gives 20 NaN or inf logits of 20", "is 2.5e-01 from JAX's logits",
       "cannot be run in its runtime (ZeroDivisionError: division by zero)"]):
    predictor = real_open(paths[fmt])
    monkeypatch.setattr(predictors, "open_model", lambda path, predictor=predictor, how=how: (
        dataclasses.replace(predictor,
                            predict_fn=lambda x: spoil[how](predictor.predict_fn(x)))))
    out = tmp_path / ("saved" if fmt == "savedmodel" else f"spoilt.{fmt}")
    assert export.main([npz, str(out), "--format", fmt]) == 1, (fmt, how)
    captured = capsys.readouterr()
    assert "Wrote" not in captured.out and not out.exists(), (fmt, how)
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the {fmt} model at {out}"), err
    assert said in err[0] and "removed, not left as a good export" in err[0], err
