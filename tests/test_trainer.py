"""train/trainer.py: config.ema_decay's moving average of the parameters against hand
computation, gradient accumulation included (a run with it, resumed and read back:
test_e2e_checkpoints.py)."""
import jax
import numpy as np

from helpers import TINY_VIT
from vit_jax import models
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
