"""The AugReg recipe: label smoothing in the loss."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax.train import config as config_lib
from vit_jax.train import trainer


@pytest.mark.parametrize("loss", trainer.LOSSES)
def test_label_smoothing_moves_targets_towards_uniform(loss):
  logits = jax.random.normal(jax.random.key(0), (6, 5))
  labels = jnp.array([0, 1, 2, 3, 4, 0])
  targets = 0.9 * jax.nn.one_hot(labels, 5) + 0.1 / 5
  expected = (optax.softmax_cross_entropy(logits, targets) if loss == "softmax_xent" else
              optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1))
  np.testing.assert_allclose(trainer.per_example_loss(loss, logits, labels, 0.1), expected,
                             rtol=1e-6)
  # Soft (mixup) targets are smoothed alike; 0 leaves the loss as it was.
  np.testing.assert_allclose(trainer.per_example_loss(loss, logits, jax.nn.one_hot(labels, 5), 0.1),
                             expected, rtol=1e-6)
  np.testing.assert_array_equal(trainer.per_example_loss(loss, logits, labels, 0.0),
                                trainer.per_example_loss(loss, logits, labels))


def test_label_smoothing_is_validated():
  c = config_lib.base_config()
  c.total_steps = 1
  c.label_smoothing = 1.0
  with pytest.raises(ValueError, match=r"config.label_smoothing=1.0: must be in \[0, 1\)"):
    config_lib.validate(c)

