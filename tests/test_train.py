"""The training job end to end on real data: learning, resuming, sharding, processes, errors."""
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from helpers import REPO, cli, cpu_env, read_scalars, run_cli, tiny_config
from vit_jax import checkpoint
from vit_jax.train import config as config_lib
from vit_jax.train import loop

@pytest.mark.slow
def test_loss_goes_down_and_eval_counts_every_example(tmp_path, dataset):
  c = tiny_config(dataset, total_steps=150, **{"data.eval_split": "test[:1000]"})
  c.evals.fewshot = dict(type="fewshot", datasets=(dataset[0],), data_dir=dataset[1],
                         train_split="train[:1000]", test_split="test[:500]", shots=(1, 10),
                         seeds=2)
  metrics = loop.train_and_evaluate(c, str(tmp_path))
  name = dataset[0]
  assert metrics[f"fewshot_{name}_1shot"] < metrics[f"fewshot_{name}_10shot"]
  assert 150 in read_scalars(tmp_path, f"fewshot_{name}_10shot")  # Written to TensorBoard too.
  losses = read_scalars(tmp_path, "train_loss")
  assert len(losses) == 150
  first, last = (np.mean([losses[s] for s in steps]) for steps in (range(1, 6), range(141, 151)))
  assert last < 0.75 * first, (first, last)
  assert metrics["num_examples"] == 1000
  assert metrics["accuracy"] > 0.5
  assert os.path.isdir(tmp_path / "checkpoints" / "150")


def test_mesh_layouts_give_the_same_losses(tmp_path, dataset):
  """8 devices as data-parallel, fully sharded (fsdp) and mixed give the same losses."""
  runs = {}
  for data, fsdp in ((8, 1), (1, 8), (2, 4)):
    workdir = tmp_path / f"{data}x{fsdp}"
    loop.train_and_evaluate(tiny_config(dataset, total_steps=6, **{"mesh.data": data, "mesh.fsdp": fsdp}),
                            str(workdir))
    runs[(data, fsdp)] = read_scalars(workdir, "train_loss")
  for layout, losses in runs.items():
    np.testing.assert_allclose(list(losses.values()), list(runs[(8, 1)].values()), atol=1e-5,
                               err_msg=str(layout))


@pytest.mark.slow
def test_one_device_matches_eight(tmp_path, dataset):
  eight = tmp_path / "eight"
  loop.train_and_evaluate(tiny_config(dataset, total_steps=6), str(eight))
  one = run_cli(cli(tmp_path / "one", dataset, "--config.total_steps=6"), devices=1)
  assert one.returncode == 0, one.stderr[-3000:]
  np.testing.assert_allclose(list(read_scalars(tmp_path / "one", "train_loss").values()),
                             list(read_scalars(eight, "train_loss").values()), atol=1e-5)


def _wait_for(path, proc, timeout=300):
  t0 = time.time()
  while not os.path.isdir(path):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() - t0 < timeout, f"{path} never appeared"
    time.sleep(0.2)


# Every random AugReg ingredient on: RandAugment, mixup, label smoothing, stochastic depth.
AUGREG_FLAGS = ("--config.data.randaug_layers=2", "--config.data.randaug_magnitude=15",
                "--config.data.mixup_alpha=0.5", "--config.label_smoothing=0.1",
                "--config.model.stochastic_depth=0.1")


# SIGKILL, which resumes from an earlier step and replays the steps after it, is
# tests/test_resume.py's random-kills test.
@pytest.mark.slow
@pytest.mark.parametrize("sig,flags", [(signal.SIGTERM, AUGREG_FLAGS)], ids=["SIGTERM_augreg"])
def test_killed_run_resumes_to_the_same_losses(tmp_path, dataset, sig, flags):
  start = lambda workdir, stderr: subprocess.Popen(  # noqa: E731
      cli(workdir, dataset, "--config.total_steps=24", *flags), env=cpu_env(), cwd=REPO,
      stdout=subprocess.DEVNULL, stderr=stderr, text=True)
  # The uninterrupted reference, beside the killed run; its log in a file nobody reads until
  # the end (a pipe could fill and stop it).
  full_log = open(tmp_path / "full.log", "w")
  full = start(tmp_path / "full", full_log)
  workdir = tmp_path / "killed"
  proc = start(workdir, subprocess.PIPE)
  _wait_for(workdir / "checkpoints" / "8", proc)
  proc.send_signal(sig)
  _, stderr = proc.communicate(timeout=120)
  # Saved, then a non-zero status (128 + the signal's number), so a scheduler restarts it.
  assert proc.returncode == 128 + sig, stderr[-3000:]
  step = int(re.search(r"Stopped: saved step (\d+)", stderr)[1])
  assert stderr.strip().splitlines()[-1] == (
      f"stopped by {sig.name} after saving step {step} to {workdir}; rerun the same command to "
      "resume"), stderr[-3000:]
  full_log.close()  # The child writes to its own copy of the file.
  assert full.wait(timeout=600) == 0, (tmp_path / "full.log").read_text()[-3000:]
  expected = read_scalars(tmp_path / "full", "train_loss")
  resumed = run_cli(cli(workdir, dataset, "--config.total_steps=24", *flags))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  after = read_scalars(workdir, "train_loss", newest_file_only=True)
  assert after and min(after) > 8 and max(after) == 24
  np.testing.assert_array_equal([after[s] for s in sorted(after)], [expected[s] for s in sorted(after)])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, dataset):
  # Two data shards in both runs: the global batches do not depend on the process count.
  shards = "--config.data.num_shards=2"
  single = run_cli(cli(tmp_path / "single", dataset, "--config.total_steps=6", shards), devices=2)
  assert single.returncode == 0, single.stderr[-3000:]
  port = _free_port()
  procs = [subprocess.Popen(
      cli(tmp_path / "multi", dataset, "--config.total_steps=6", shards,
          f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"),
      env=cpu_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "process 1 of 2" in outs[1][1]
  np.testing.assert_allclose(list(read_scalars(tmp_path / "multi", "train_loss").values()),
                             list(read_scalars(tmp_path / "single", "train_loss").values()), atol=1e-5)


def test_nonfinite_loss_stops_naming_the_step_and_keeps_good_checkpoints(tmp_path, dataset):
  c = tiny_config(dataset, total_steps=40, checkpoint_every_steps=2, **{"optimizer.lr": 1e6,
                                                                          "optimizer.grad_clip_norm": 0.0})
  with pytest.raises(loop.NonFiniteLossError, match=r"NaN/inf at step \d+.*last good checkpoint"):
    loop.train_and_evaluate(c, str(tmp_path))
  steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert steps
  for step in steps:
    flat, _ = checkpoint.read_params(tmp_path / "checkpoints" / str(step))
    assert all(np.isfinite(x).all() for x in flat.values())


def test_workdir_of_another_model_refuses_to_resume(tmp_path, dataset):
  loop.train_and_evaluate(tiny_config(dataset, total_steps=4), str(tmp_path))
  other = tiny_config(dataset, total_steps=4, **{"model.hidden_size": 48})
  with pytest.raises(ValueError, match=r"different model.*\n  model.hidden_size: checkpoint 32, "
                     r"config 48\nUse a new --workdir"):
    loop.train_and_evaluate(other, str(tmp_path))
  # Even with the opt-in for other changes: the state would not fit.
  other.allow_resume_changes = True
  with pytest.raises(ValueError, match="different model"):
    loop.train_and_evaluate(other, str(tmp_path))


@pytest.mark.parametrize("field,value,message", [
    ("model_name", "ViT-Q_16", "config.model_name='ViT-Q_16': unknown model"),
    ("total_epochs", 1.0, "set exactly one of total_steps / total_epochs"),
    ("optimizer.name", "adamx", "config.optimizer.name='adamx': expected one of"),
    ("accum_steps", 5, "config.accum_steps=5: must be >= 1 and divide batch_size=32"),
    ("data.train_crop", "foo", "config.data.train_crop='foo': expected one of"),
    ("data.flipp", True, "config.data.flipp=True: unknown field; did you mean flip?"),
    ("optimizer.weight_decai", 0.0, "config.optimizer.weight_decai=0.0: unknown field; did you mean weight_decay"),
    ("cpu_devices", 0, "config.cpu_devices=0: must be None or >= 1"),
    ("model.stochastic_depth", 1.5, "config.model.stochastic_depth=1.5: must be in"),
])
def test_bad_config_names_the_field(field, value, message):
  c = tiny_config(("mnist", None), **{field: value})
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_lib.validate(c)


def test_config_covers_every_model_field():
  """config.model's fields, config.dtype and config.lora's set every field of the model."""
  from vit_jax import models
  lora_fields = {f"lora_{k}" for k in config_lib.base_config().lora}
  assert set(config_lib.MODEL_FIELDS) == (
      set(models.registry.FIELDS) - {"num_classes", "dtype"} - lora_fields)


def test_cli_overrides_model_fields(tmp_path, dataset):
  result = run_cli(cli(tmp_path, dataset, "--config.total_steps=2", "--config.model.num_layers=1",
                       "--config.model.classifier=gap", "--config.model.dropout=0.1",
                       "--config.model.remat=True", "--config.data.inception_area=(0.1, 1.0)",
                       "--config.evals.eval.every_steps=1"))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Final evaluation: accuracy=" in result.stdout


def test_unknown_cli_field_is_one_line_naming_close_fields(tmp_path):
  result = run_cli(cli(tmp_path, ("mnist", "/nonexistent"), "--config.batch_sise=3"))
  assert result.returncode == 2
  assert "error: config.batch_sise='3': unknown field; did you mean batch_size?" in result.stderr
  assert "Traceback" not in result.stderr
  bad_value = run_cli(cli(tmp_path, ("mnist", "/nonexistent"), "--config.optimizer.lr=fast"))
  assert bad_value.returncode == 2 and "--config.optimizer.lr=fast" in bad_value.stderr
  assert "Traceback" not in bad_value.stderr
