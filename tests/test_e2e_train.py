"""The training job end to end on real data: learning (the loss goes down, evaluations beside
the run's own, an evaluator of the user's), errors named, command-line overrides and the
run's record in TensorBoard. One run per workdir: tests/test_e2e_stop.py."""
import os

import numpy as np
import pytest

from helpers import PROBE, cli, read_scalars, run_cli, tiny_config
from vit_jax.checkpoint import run
from vit_jax.evaluators import registry
from vit_jax.train import loop


@pytest.mark.slow
def test_loss_goes_down_and_eval_counts_every_example(tmp_path, dataset):
  c = tiny_config(dataset, total_steps=150, checkpoint_every_steps=150,
                  **{"data.train_split": "train[:4800]", "data.eval_split": "test[:1000]"})
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


def test_nonfinite_loss_stops_naming_the_step_and_keeps_good_checkpoints(tmp_path, dataset):
  c = tiny_config(dataset, total_steps=40, checkpoint_every_steps=2, cpu_devices=1,
                  **{"optimizer.lr": 1e6, "optimizer.grad_clip_norm": 0.0})
  with pytest.raises(loop.NonFiniteLossError, match=r"NaN/inf at step \d+.*last good checkpoint"):
    loop.train_and_evaluate(c, str(tmp_path))
  steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert steps
  for step in steps:
    flat, _ = run.read_params(tmp_path / "checkpoints" / str(step))
    assert all(np.isfinite(x).all() for x in flat.values())


def test_cli_overrides_reach_the_run_and_its_tensorboard_record_with_no_keras_loaded(
    tmp_path, dataset):
  """A shipped config (quickstart), found by name from outside the clone, with model, data and
  evaluation fields overridden on the command line, trains: --config.total_steps replaces the
  config's total_epochs, and its config.cpu_devices outranks the 4 devices of XLA_FLAGS. The
  run's config, the overrides in it, is TensorBoard's hyperparameters (clu's writer,
  TensorBoard's hparams API), written with no Keras imported: the API's Keras callback is left
  out (logs.start_tensorflow), ~0.8 CPU-s of each start. 512 images, not the 60,000 a run
  decodes as it starts (~2.5 s)."""
  import tensorflow as tf
  from tensorboard.plugins.hparams import plugin_data_pb2
  args = cli(tmp_path, dataset, "--config.total_steps=2", "--config.warmup_steps=1",
             "--config.model.num_layers=1", "--config.model.classifier=token",
             "--config.model.dropout=0.1",
             "--config.model.remat=True", "--config.data.inception_area=(0.1, 1.0)",
             "--config.evals.eval.every_steps=1", "--config.batch_size=16",
             "--config.data.train_split=train[:512]", "--config.data.eval_split=test[:64]",
             config="quickstart")
  result = run_cli([args[0], "-c", PROBE, "vit_jax.tools.train:main", "vit-train", *args[3:]],
                   cwd=tmp_path, devices=4)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Final evaluation: accuracy=" in result.stdout
  assert result.stdout.strip().splitlines()[-1].endswith("keras loaded: False"), result.stdout
  assert "1 device (cpu)" in result.stderr
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
  [events] = tmp_path.glob("events.out.tfevents.*")
  [hparams] = [plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
               for e in tf.compat.v1.train.summary_iterator(str(events))
               for v in e.summary.value if v.metadata.plugin_data.plugin_name == "hparams"]
  recorded = {k: v.string_value for k, v in hparams.session_start_info.hparams.items()}
  assert (recorded["total_steps"], recorded["total_epochs"]) == ("2", "None"), recorded
  assert recorded["batch_size"] == "16" and recorded["model_name"] == "ViT-Ti_16", recorded
  assert "'num_layers': 1" in recorded["model"] and "'remat': True" in recorded["model"]
  assert "'classifier': 'token'" in recorded["model"], recorded["model"]
  assert "'inception_area': (0.1, 1.0)" in recorded["data"], recorded["data"]


@pytest.mark.slow
def test_an_extra_evaluation_runs_beside_the_runs_own(tmp_path, dataset):
  from vit_jax.train import loop
  c = tiny_config(dataset, total_steps=2, cpu_devices=1)
  c.evals.again = registry.entry_config("classification", dataset=dataset[0], split="test[:64]")
  metrics = loop.train_and_evaluate(c, str(tmp_path))
  assert metrics["again_num_examples"] == metrics["num_examples"] == 64
  assert metrics["again_accuracy"] == metrics["accuracy"]
  assert metrics["again_loss"] == pytest.approx(metrics["loss"], rel=1e-6)


_USER_EVALUATOR = """
import jax
import ml_collections
import numpy as np

CALLS = []

def default_config():
  return ml_collections.ConfigDict(dict(scale=1.0))

class _NormOfParams:
  def __init__(self, scale):
    self.scale = scale

  def evaluate(self, params):
    CALLS.append(1)
    norm = np.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(params)))
    return {"param_norm": self.scale * norm}

def create(cfg, context):
  assert context.batch_size > 0 and context.model.num_classes == 10
  return _NormOfParams(cfg.scale)
"""


@pytest.mark.slow
def test_an_evaluator_of_the_users_runs_in_a_training_run(tmp_path, dataset, monkeypatch):
  """A module of the user's, named by its path in config.evals, with no file of the package
  changed: built from its fields, run on its own schedule, its metrics written and returned."""
  package = tmp_path / "my_evals"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "norm.py").write_text(_USER_EVALUATOR)
  monkeypatch.syspath_prepend(str(tmp_path))
  from vit_jax.train import loop
  c = tiny_config(dataset, total_steps=4, cpu_devices=1, **{"data.eval_split": "test[:64]"})
  c.evals.norm = {"type": "my_evals.norm", "scale": 2.0, "every_steps": 2, "at_end": False}
  metrics = loop.train_and_evaluate(c, str(tmp_path / "run"))
  import my_evals.norm
  assert len(my_evals.norm.CALLS) == 2  # Steps 2 and 4; not again at the end.
  written = read_scalars(tmp_path / "run", "norm_param_norm")
  assert sorted(written) == [2, 4] and written[4] == pytest.approx(metrics["norm_param_norm"])
  assert metrics["norm_param_norm"] > 0 and metrics["num_examples"] == 64
