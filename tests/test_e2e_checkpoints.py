"""A training run's workdir (and a step dir) as a checkpoint, end to end: loaded, inspected
(vit-inspect), exported to the serving formats; with config.ema_decay, the parameters' moving
average resumed exactly (frozen and scaled parameters, LoRA adapters) and read as `ema:RUN`;
`vit-export` run as a user runs it; a LoRA run's adapters exported alone and loaded on their
base."""
import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import sys

import jax
import numpy as np
import pytest

from helpers import (TOLERANCE, adapted_params, assert_finetuning_loads_the_file, jax_logits,
                     run_cli, run_inspect, tiny_config, tiny_serving_checkpoint)
from vit_jax import models
from vit_jax.checkpoint import errors, loader, npz, run
from vit_jax.models import lora
from vit_jax.serving import convert, images, predictors
from vit_jax.train import loop


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, dataset):
  """A 2-step run of tiny_config, trained once for the tests that read it (none writes into
  it), given its workdir as a relative path (orbax takes absolute paths only)."""
  workdir = tmp_path_factory.mktemp("two_steps")
  with contextlib.chdir(workdir.parent):
    loop.train_and_evaluate(tiny_config(dataset, total_steps=2), workdir.name)
  return workdir


@pytest.mark.slow
def test_a_training_run_loads_from_its_workdir_and_step_dir(two_steps):
  tmp_path = two_steps
  flat, meta = run.read_params(tmp_path / "checkpoints" / "2")
  assert meta["model_name"] == "ViT-Ti_16"
  for path in (tmp_path, tmp_path / "checkpoints" / "2"):
    ckpt = loader.load(str(path))
    # ViT-Ti_16 with tiny_config's overrides is no ViT-Ti_16: no registry name.
    assert ckpt.model.name_in_registry is None and ckpt.image_size == 28
    assert ckpt.source == str(tmp_path / "checkpoints" / "2")
    for key, value in npz.flatten(ckpt.params).items():
      np.testing.assert_array_equal(value, flat[key])
  for name in ("ViT-B_16", "ViT-Ti_16"):  # The config's name too: not what it trained.
    with pytest.raises(ValueError, match=rf"^model_name \(--model\) '{name}' disagrees with "
                       r".* records the model 'ViT with patch 7, width 32, depth 2, 2 heads, "
                       r"MLP 64'"):
      loader.load(str(tmp_path), name)
  # The config's name with its overrides names the model.
  assert loader.load(str(tmp_path), "ViT-Ti_16", patch_size=7, hidden_size=32, mlp_dim=64,
                     num_heads=2, num_layers=2).model.patch_size == 7
  with pytest.raises(FileNotFoundError, match="No checkpoint at"):
    loader.load(str(tmp_path / "missing"))


@pytest.mark.slow
def test_a_workdir_and_its_step_dir(two_steps, capsys, monkeypatch):
  tmp_path = two_steps
  step_dir = tmp_path / "checkpoints" / "2"
  for path in (tmp_path, step_dir):
    rc, out, _ = run_inspect(capsys, path, "--json")
    report = json.loads(out)
    assert rc == 0 and report["source"] == str(step_dir)
    assert report["model"] is None and report["run_model_name"] == "ViT-Ti_16"
    assert report["fields"]["patch_size"] == 7 and report["image_size"] == 28
    assert report["num_classes"] == 10 and report["head"] == "trained"
  c = assert_finetuning_loads_the_file(report["finetune_command"], monkeypatch)
  assert c.model_name == "ViT-Ti_16" and c.pretrained == str(step_dir)
  assert report["description"]["class_names"][:2] == ["T-shirt/top", "Trouser"]
  rc, out, _ = run_inspect(capsys, tmp_path)
  assert "no registry name fits (a run of ViT-Ti_16 with overrides)" in out
  assert f"read           {step_dir}" in out
  assert "input          28 px RGB, resized; [0, 255] -> [-1, 1]\n" in out
  assert "class names    T-shirt/top, Trouser, Pullover," in out
  assert "origin         trained on fashion_mnist; step 2\n" in out


@pytest.mark.slow
def test_a_training_run_exports_from_its_workdir_and_step_dir(two_steps, tmp_path,
                                                               digits_folder):
  files = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[:7]
  for path, fmt, out in ((two_steps, "savedmodel", tmp_path / "saved_model"),
                         (two_steps / "checkpoints" / "2", "tflite", tmp_path / "m.tflite")):
    loaded, checked = convert.export(str(path), str(out), fmt)
    assert checked <= convert.TOLERANCE  # What it measured in the runtime, on its own images.
    assert loaded.model.name_in_registry is None and loaded.image_size == 28
    batch = np.stack([images.read_image(f, 28) for f in files])
    diff = np.abs(predictors.open_model(str(out))(batch) - jax_logits(loaded, batch)).max()
    assert diff <= TOLERANCE[fmt], (fmt, diff)


@pytest.mark.slow
def test_a_run_with_an_average_resumes_exactly_and_reads_as_a_checkpoint(tmp_path, dataset):
  """With LoRA adapters, frozen and layer-decayed parameters too: every array of the state as
  an uninterrupted run's; read back, the adapters come merged."""
  from vit_jax.train import loop
  base = models.create_model("ViT-Ti_16", num_classes=10, patch_size=7, hidden_size=32,
                             mlp_dim=64, num_heads=2, num_layers=2)
  npz.save_npz(str(tmp_path / "base.npz"),
                      base.init(jax.random.key(3), np.zeros((1, 28, 28, 3), np.float32))["params"])
  fields = {"total_steps": 6, "checkpoint_every_steps": 2, "ema_decay": 0.8,
            "pretrained": str(tmp_path / "base.npz"),
            "optimizer.layer_decay": 0.7, "optimizer.lr_mults": (("head/.*", 5.0),),
            "optimizer.frozen": ("embedding/.*", "Transformer/encoderblock_0/.*"),
            "lora.rank": 2, "lora.alpha": 4.0, "lora.targets": ("query", "Dense_0")}
  metrics = loop.train_and_evaluate(tiny_config(dataset, **fields), str(tmp_path / "full"))
  assert {"accuracy", "loss", "ema_accuracy", "ema_loss"} <= set(metrics)
  assert metrics["ema_accuracy"] != metrics["accuracy"] or metrics["ema_loss"] != metrics["loss"]
  shutil.copytree(tmp_path / "full", tmp_path / "cut")  # The same run, in this process,
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "6")  # killed before its last save.
  loop.train_and_evaluate(tiny_config(dataset, **fields), str(tmp_path / "cut"))
  for ema in (False, True):
    full = run.read_params(tmp_path / "full" / "checkpoints" / "6", ema=ema)[0]
    resumed = run.read_params(tmp_path / "cut" / "checkpoints" / "6", ema=ema)[0]
    assert set(full) == set(resumed)
    for name, value in full.items():
      np.testing.assert_array_equal(resumed[name], value, err_msg=f"{name} (ema={ema})")

  ema = run.read_params(tmp_path / "full" / "checkpoints" / "6", ema=True)[0]
  raw = run.read_params(tmp_path / "full" / "checkpoints" / "6")[0]
  assert not np.array_equal(ema["head/kernel"], raw["head/kernel"])
  # Frozen parameters (LoRA's base included) did not move between steps 2 and 6; the others did.
  first = run.read_params(tmp_path / "full" / "checkpoints" / "2")[0]
  block = "Transformer/encoderblock_{}/MlpBlock_3/Dense_0/"
  for name in ("embedding/kernel", block.format(0) + "lora_b", block.format(1) + "kernel"):
    np.testing.assert_array_equal(first[name], raw[name])
  for name in ("head/kernel", block.format(1) + "lora_a", block.format(1) + "lora_b"):
    assert not np.array_equal(first[name], raw[name]), name
  loaded = loader.load(f"ema:{tmp_path / 'full'}")
  assert loaded.source == f"ema:{tmp_path / 'full' / 'checkpoints' / '6'}"
  assert loaded.model.lora_rank == 0 and "lora_rank" not in loaded.description.model
  merged = lora.merge(ema, 4.0 / 2)
  assert set(npz.flatten(loaded.params)) == set(merged)
  for name, value in npz.flatten(loaded.params).items():
    np.testing.assert_array_equal(value, merged[name], err_msg=name)
  described = loader.export_npz(f"ema:{tmp_path / 'full'}", str(tmp_path / "ema.npz"))
  assert described.exported_from == loaded.source
  for name, value in npz.load_npz_flat(str(tmp_path / "ema.npz")).items():
    np.testing.assert_array_equal(value, merged[name], err_msg=name)


@pytest.mark.slow
def test_a_run_without_an_average_says_so(two_steps, tmp_path):
  with pytest.raises(errors.CheckpointError, match="holds no moving average of the "
                     "parameters: its run had no config.ema_decay"):
    loader.load(f"ema:{two_steps}")
  with pytest.raises(errors.CheckpointError, match="`ema:` takes a training run's"):
    loader.load(f"ema:{tmp_path / 'none.npz'}")
  with pytest.raises(errors.CheckpointError, match="is not a LoRA run"):
    loader.export_adapters(str(two_steps), str(tmp_path / "lora.npz"))
  assert not (tmp_path / "lora.npz").exists()


def test_export_cli_writes_each_format(tmp_path, digits_folder):
  """`vit-export CKPT OUT --format F` end to end, the position embedding
  resized to another resolution on the way."""
  path = tiny_serving_checkpoint(tmp_path / "model.npz", "plain")
  out = tmp_path / "model.onnx"
  r = run_cli([sys.executable, "-m", "vit_jax.tools.export", path, str(out), "--format", "onnx",
               "--image_size", "48"])
  assert r.returncode == 0, r.stderr
  assert (f"Wrote {out} (onnx): ViT with patch 8, width 32, depth 1, 2 heads, MLP 64; 48px; "
          "10 classes") in r.stdout
  assert re.search(r"\nChecked: run in its runtime, \S+ from JAX's logits \(max \|diff\| on 2 "
                   r"images\)\n", r.stdout), r.stdout
  predictor = predictors.open_model(str(out))
  assert predictor.image_size == 48
  loaded = loader.load(path, image_size=48)
  files = sorted(glob.glob(os.path.join(digits_folder, "test", "*", "*.png")))[:3]
  batch = np.stack([images.read_image(f, 48) for f in files])
  assert np.abs(predictor(batch) - jax_logits(loaded, batch)).max() <= TOLERANCE["onnx"]
  r = run_cli([sys.executable, "-m", "vit_jax.tools.export", path, str(tmp_path / "x.npz"), "--model",
               "ViT-Ti_16"])
  assert r.returncode == 2 and "--model and --image_size apply to the serving formats" in r.stderr


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, dataset):
  """(folder, the run's merged model, the adapters file's description): fine-tuned with LoRA
  from base.npz, a checkpoint at another resolution and class count; adapters in lora.npz."""
  from vit_jax.train import loop
  tmp = tmp_path_factory.mktemp("lora_run")
  fields = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
  base = models.create_model("ViT-Ti_16", num_classes=3, **fields)
  npz.save_npz(str(tmp / "base.npz"), adapted_params(base, 14))
  npz.save_npz(str(tmp / "other.npz"), adapted_params(base, 14, seed=2))
  c = tiny_config(dataset, total_steps=3, pretrained=str(tmp / "base.npz"), **{
      "lora.rank": 4, "lora.targets": ("query", "value", "Dense_1")})
  loop.train_and_evaluate(c, str(tmp / "run"))
  described = loader.export_adapters(str(tmp / "run"), str(tmp / "lora.npz"))
  return tmp, loader.load(str(tmp / "run")), described


def assert_same_params(got, want):
  assert set(npz.flatten(got)) == set(npz.flatten(want))
  for name, value in npz.flatten(want).items():
    np.testing.assert_array_equal(npz.flatten(got)[name], value, err_msg=name)


@pytest.mark.slow
def test_a_lora_runs_adapters_export_alone_and_load_on_their_base(lora_run):
  """The adapters file is a fraction of the model, and read back on its base it is the run's
  merged model, array for array."""
  tmp, merged, described = lora_run
  assert merged.model.lora_rank == 0 and merged.model.num_classes == 10
  assert described.parent == str(tmp / "base.npz")
  stored = npz.load_npz_flat(str(tmp / "lora.npz"))
  assert set(stored) == {
      k for k in run.read_params(tmp / "run" / "checkpoints" / "3")[0]
      if lora.is_adapter(k) or k.startswith("head/")}
  size = lambda flat: sum(v.size for v in flat.values())
  assert size(stored) < 0.1 * size(npz.flatten(merged.params))
  on_base = loader.load(str(tmp / "lora.npz"))
  assert on_base.model == merged.model.clone(name_in_registry=on_base.model.name_in_registry)
  assert_same_params(on_base.params, merged.params)


@pytest.mark.slow
def test_vit_inspect_says_what_lora_made_and_which_base_a_file_needs(lora_run, tmp_path):
  """What each LoRA checkpoint is, on the report: the run's adapters merged; the adapters
  file's base (as recorded, or as --base moved it); nothing for a plain file, the merged
  export among them."""
  from vit_jax import inspection
  from vit_jax.tools import export, inspect_checkpoint
  tmp, _, _ = lora_run
  fields = {"lora_rank": 4, "lora_alpha": None, "lora_targets": ["query", "value", "Dense_1"]}
  os.symlink(tmp / "base.npz", tmp_path / "moved.npz")
  assert export.main([str(tmp / "run"), str(tmp_path / "whole.npz")]) == 0
  for path, base, lora_fields, base_read in (
      (tmp / "run", None, fields, None),
      (tmp / "lora.npz", None, fields, str(tmp / "base.npz")),
      (tmp / "lora.npz", tmp_path / "moved.npz", fields, str(tmp_path / "moved.npz")),
      (tmp / "base.npz", None, None, None),
      (tmp_path / "whole.npz", None, None, None)):
    r, _ = inspection.report(str(path), base=base and str(base))
    assert (r["lora"] and {**r["lora"], "lora_targets": list(r["lora"]["lora_targets"])},
            r["lora_base"]) == (lora_fields, base_read), path
    text = " ".join(inspect_checkpoint.format_text(r).split())
    lora = [line for line in text.split("LoRA ")[1:]]
    if not lora_fields:
      assert not lora, text
    elif base_read:
      assert lora[0].startswith(
          "rank 4 on query, value, Dense_1 (alpha = rank): this file holds the adapters and "
          f"the head alone, merged here onto their base {base_read} (the arrays they were "
          "trained on: checked by sha256), which must stay there or be given with --base"), text
    else:
      assert lora[0].startswith("rank 4 on query, value, Dense_1 (alpha = rank): the adapters "
                                "come merged into the kernels above"), text


@pytest.mark.slow
def test_adapters_refuse_another_base_and_find_a_moved_one(lora_run, tmp_path):
  """The adapters record their base by content: another file at the base's path is refused
  naming both, a missing one says how to point at it, and --base (the library's base=) finds
  a moved one, through a command too."""
  tmp, merged, described = lora_run
  sha = lambda name: npz.arrays_sha256(npz.load_npz_flat(str(tmp / name)))  # noqa
  assert described.parent_sha256 == sha("base.npz")
  adapters = tmp_path / "lora.npz"
  description = described.replace(parent=str(tmp_path / "base.npz"))
  npz.save_npz(str(adapters), npz.unflatten(npz.load_npz_flat(
      str(tmp / "lora.npz"))), description)
  os.symlink(tmp / "other.npz", tmp_path / "base.npz")
  with pytest.raises(errors.CheckpointError, match=re.escape(
      f"{adapters}: its LoRA adapters were trained on {tmp_path}/base.npz (arrays sha256 "
      f"{sha('base.npz')[:12]}), but {tmp_path}/base.npz holds other arrays (sha256 "
      f"{sha('other.npz')[:12]}); give the base they were trained on with --base PATH")):
    loader.load(str(adapters))
  os.remove(tmp_path / "base.npz")
  with pytest.raises(errors.CheckpointError, match=re.escape(
      f"the base checkpoint its LoRA adapters were trained on, {tmp_path}/base.npz, is not "
      "there; give the base")):
    loader.load(str(adapters))
  moved = loader.load(str(adapters), base=str(tmp / "base.npz"))
  assert_same_params(moved.params, merged.params)
  from vit_jax.tools import export
  assert export.main([str(adapters), str(tmp_path / "whole.npz"), "--base",
                      str(tmp / "base.npz")]) == 0
  assert loader.describe(str(tmp_path / "whole.npz")).parent_sha256 == sha("base.npz")


@pytest.mark.slow
def test_paths_a_checkpoint_records_hold_from_any_directory(lora_run, dataset, digits_folder,
                                                           tmp_path, monkeypatch):
  """Checkpoints given relative to the working directory are recorded by their absolute
  paths: the base a LoRA run was fine-tuned from (which its adapters file is opened on) and
  what each export was read from, through every way a checkpoint is read (a run's checkpoints
  folder standing for its workdir, unless it is a workdir itself); the files open from another
  directory, and a run on an image folder records where the folder is.
  (`config.pretrained=base.npz` made adapters that opened from nowhere else: 'the base
  checkpoint ..., base.npz, is not there'.)"""
  tmp, merged, _ = lora_run
  work = tmp_path / "work"
  shutil.copytree(tmp / "run", work / "run")
  shutil.copy(tmp / "base.npz", work)
  monkeypatch.chdir(work)
  c = tiny_config(dataset, total_steps=2, pretrained="base.npz", **{
      "lora.rank": 4, "lora.targets": ("query", "value", "Dense_1"),
      "data.name": os.path.relpath(digits_folder)})
  loop.train_and_evaluate(c, "lora_run")
  loader.export_adapters("lora_run", "adapters.npz")
  step = work / "run" / "checkpoints" / "3"
  shutil.copytree(work / "run", work / "a" / "checkpoints")  # A workdir of that name.
  sources = {"base.npz": work / "base.npz", "run": step, "run/checkpoints/3": step,
             "run/checkpoints": step, "adapters.npz": work / "adapters.npz",
             "a/checkpoints": work / "a" / "checkpoints" / "checkpoints" / "3"}
  for i, (path, source) in enumerate(sources.items()):
    assert loader.export_npz(path, f"export_{i}.npz").exported_from == str(source), path
  assert convert.export("run", "served", "savedmodel").loaded.description.exported_from == (
      str(step))
  monkeypatch.chdir(tmp_path)
  described = loader.describe(str(work / "lora_run"))
  assert (described.parent, described.dataset) == (str(work / "base.npz"), digits_folder)
  assert loader.describe(str(work / "adapters.npz")).parent == str(work / "base.npz")
  on_base = loader.load(str(work / "adapters.npz"))
  assert on_base.source == str(work / "adapters.npz")
  assert loader.describe(str(work / "export_0.npz")).exported_from == str(work / "base.npz")


def test_a_one_process_save_writes_what_orbaxs_default_save_writes(tmp_path):
  """On the CPU one process saves each replicated array whole (checkpoint/run.py), where
  orbax's default handler splits it among the replicas: the same files (the arrays' metadata
  among them) and, read back, the same arrays, for a replicated and a sharded array."""
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from orbax.checkpoint._src.metadata import array_metadata_store

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rng = np.random.default_rng(0)
  state = {"replicated": jax.device_put(rng.normal(size=(64, 48)).astype(np.float32),
                                        NamedSharding(mesh, P())),
           "sharded": jax.device_put(rng.normal(size=(64, 48)).astype(np.float32),
                                     NamedSharding(mesh, P("data")))}
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  try:
    saved = {}
    for name in ("default", "whole"):
      if name == "default":
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store()), override=True)
        manager = ocp.CheckpointManager(run.checkpoint_dir(tmp_path / name),
                                        item_names=run.ITEMS)
      else:
        manager = run.make_manager(tmp_path / name, keep=1)
      manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
      manager.wait_until_finished()
      saved[name] = manager.restore(1)["state"]
      manager.close()
    assert jax.device_count() == 8 and not ocp.type_handlers.get_type_handler(
        jax.Array)._use_replica_parallel
  finally:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  folders = {name: pathlib.Path(run.checkpoint_dir(tmp_path / name)) for name in saved}
  files = {name: sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                        if "ocdbt" not in str(p) and p.parent.name != "d")  # Content-named.
           for name, folder in folders.items()}
  assert files["whole"] == files["default"] and any("array_metadatas" in f
                                                    for f in files["whole"]), files
  for name in saved:
    for key, array in state.items():
      np.testing.assert_array_equal(np.asarray(saved[name][key]), np.asarray(array))
