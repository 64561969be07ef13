"""config.ema_decay: the parameters' moving average against hand computation (gradient
accumulation included), resumed exactly (with frozen and scaled parameters, config.optimizer,
and LoRA adapters, config.lora), evaluated beside the parameters, read as `ema:RUN`."""
import shutil

import jax
import numpy as np
import pytest

from helpers import TINY_VIT, tiny_config
from vit_jax import checkpoint, models
from vit_jax.models import lora
from vit_jax.train import optimizers, sharding, trainer


def test_the_average_moves_on_optimizer_updates_only():
  model = models.create_model("ViT-Ti_16", num_classes=10, **TINY_VIT)
  mesh = sharding.make_mesh()
  tx, _ = optimizers.make_optimizer(optimizers.default_config(), 10, 0, accum_steps=2)
  state, shardings = trainer.init_state(model, tx, mesh, (32, 32, 3), jax.random.key(0),
                                        ema=True)
  step = trainer.make_train_step(model, tx, "softmax_xent", shardings, mesh, jax.random.key(1),
                                 ema_decay=0.9, accum_steps=2)
  rng = np.random.default_rng(0)
  host = lambda tree: jax.tree.map(np.asarray, jax.device_get(tree))
  params, emas = [host(state.params)], [host(state.ema_params)]
  for _ in range(4):
    batch = {"image": rng.standard_normal((16, 32, 32, 3), np.float32),
             "label": rng.integers(0, 10, 16).astype(np.int32)}
    state, _ = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    params.append(host(state.params))
    emas.append(host(state.ema_params))

  def average(e, p):
    return jax.tree.map(lambda a, b: np.float32(0.9) * a + np.float32(0.1) * b, e, p)
  # Micro-batches 1 and 3 only accumulate: neither the parameters nor their average move.
  expected = [params[0], params[0], average(params[0], params[2])]
  expected += [expected[2], average(expected[2], params[4])]
  jax.tree.map(np.testing.assert_array_equal, params[1], params[0])
  assert not np.array_equal(params[2]["head"]["kernel"], params[0]["head"]["kernel"])
  for got, want in zip(emas, expected):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7), got, want)


@pytest.mark.slow
def test_a_run_with_an_average_resumes_exactly_and_reads_as_a_checkpoint(tmp_path, dataset):
  """With LoRA adapters, frozen and layer-decayed parameters too: every array of the state as
  an uninterrupted run's; read back, the adapters come merged."""
  from vit_jax.train import loop
  base = models.create_model("ViT-Ti_16", num_classes=10, patch_size=7, hidden_size=32,
                             mlp_dim=64, num_heads=2, num_layers=2)
  checkpoint.save_npz(str(tmp_path / "base.npz"),
                      base.init(jax.random.key(3), np.zeros((1, 28, 28, 3), np.float32))["params"])
  fields = {"total_steps": 6, "checkpoint_every_steps": 2, "ema_decay": 0.8,
            "pretrained": str(tmp_path / "base.npz"),
            "optimizer.layer_decay": 0.7, "optimizer.lr_mults": (("head/.*", 5.0),),
            "optimizer.frozen": ("embedding/.*", "Transformer/encoderblock_0/.*"),
            "lora.rank": 2, "lora.alpha": 4.0, "lora.targets": ("query", "Dense_0")}
  metrics = loop.train_and_evaluate(tiny_config(dataset, **fields), str(tmp_path / "full"))
  assert {"accuracy", "loss", "ema_accuracy", "ema_loss"} <= set(metrics)
  assert metrics["ema_accuracy"] != metrics["accuracy"] or metrics["ema_loss"] != metrics["loss"]
  loop.train_and_evaluate(tiny_config(dataset, **fields), str(tmp_path / "cut"))
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "6")  # Killed before its last save.
  loop.train_and_evaluate(tiny_config(dataset, **fields), str(tmp_path / "cut"))
  for ema in (False, True):
    full = checkpoint.read_params(tmp_path / "full" / "checkpoints" / "6", ema=ema)[0]
    resumed = checkpoint.read_params(tmp_path / "cut" / "checkpoints" / "6", ema=ema)[0]
    assert set(full) == set(resumed)
    for name, value in full.items():
      np.testing.assert_array_equal(resumed[name], value, err_msg=f"{name} (ema={ema})")

  ema = checkpoint.read_params(tmp_path / "full" / "checkpoints" / "6", ema=True)[0]
  raw = checkpoint.read_params(tmp_path / "full" / "checkpoints" / "6")[0]
  assert not np.array_equal(ema["head/kernel"], raw["head/kernel"])
  # Frozen parameters (LoRA's base included) did not move between steps 2 and 6; the others did.
  first = checkpoint.read_params(tmp_path / "full" / "checkpoints" / "2")[0]
  block = "Transformer/encoderblock_{}/MlpBlock_3/Dense_0/"
  for name in ("embedding/kernel", block.format(0) + "lora_b", block.format(1) + "kernel"):
    np.testing.assert_array_equal(first[name], raw[name])
  for name in ("head/kernel", block.format(1) + "lora_a", block.format(1) + "lora_b"):
    assert not np.array_equal(first[name], raw[name]), name
  loaded = checkpoint.load(f"ema:{tmp_path / 'full'}")
  assert loaded.source == f"ema:{tmp_path / 'full' / 'checkpoints' / '6'}"
  assert loaded.model.lora_rank == 0 and "lora_rank" not in loaded.description.model
  merged = lora.merge(ema, 4.0 / 2)
  assert set(checkpoint.flatten(loaded.params)) == set(merged)
  for name, value in checkpoint.flatten(loaded.params).items():
    np.testing.assert_array_equal(value, merged[name], err_msg=name)
  described = checkpoint.export_npz(f"ema:{tmp_path / 'full'}", str(tmp_path / "ema.npz"))
  assert described.exported_from == loaded.source
  for name, value in checkpoint.load_npz_flat(str(tmp_path / "ema.npz")).items():
    np.testing.assert_array_equal(value, merged[name], err_msg=name)


@pytest.mark.slow
def test_a_run_without_an_average_says_so(tmp_path, dataset):
  from vit_jax.train import loop
  loop.train_and_evaluate(tiny_config(dataset, total_steps=2), str(tmp_path))
  with pytest.raises(checkpoint.CheckpointError, match="holds no moving average of the "
                     "parameters: its run had no config.ema_decay"):
    checkpoint.load(f"ema:{tmp_path}")
  with pytest.raises(checkpoint.CheckpointError, match="`ema:` takes a training run's"):
    checkpoint.load(f"ema:{tmp_path / 'none.npz'}")
  with pytest.raises(checkpoint.CheckpointError, match="is not a LoRA run"):
    checkpoint.export_adapters(str(tmp_path), str(tmp_path / "lora.npz"))
