"""losses.py: label smoothing (the AugReg recipe's) in both losses."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax import losses


@pytest.mark.parametrize("loss", losses.LOSSES)
def test_label_smoothing_moves_targets_towards_uniform(loss):
  logits = jax.random.normal(jax.random.key(0), (6, 5))
  labels = jnp.array([0, 1, 2, 3, 4, 0])
  targets = 0.9 * jax.nn.one_hot(labels, 5) + 0.1 / 5
  expected = (optax.softmax_cross_entropy(logits, targets) if loss == "softmax_xent" else
              optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1))
  np.testing.assert_allclose(losses.per_example_loss(loss, logits, labels, 0.1), expected,
                             rtol=1e-6)
  # Soft (mixup) targets are smoothed alike; 0 leaves the loss as it was.
  np.testing.assert_allclose(losses.per_example_loss(loss, logits, jax.nn.one_hot(labels, 5), 0.1),
                             expected, rtol=1e-6)
  np.testing.assert_array_equal(losses.per_example_loss(loss, logits, labels, 0.0),
                                losses.per_example_loss(loss, logits, labels))
