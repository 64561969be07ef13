"""Classification losses, shared by the train step and the evaluators."""
import jax
import jax.numpy as jnp
import optax

LOSSES = ("softmax_xent", "sigmoid_xent")


def onehot_targets(labels: jnp.ndarray, num_classes: int) -> jnp.ndarray:
  """Integer labels to one-hot; soft targets (e.g. mixup) pass through."""
  if labels.ndim == 2:
    return labels.astype(jnp.float32)
  return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)


def per_example_loss(name: str, logits: jnp.ndarray, labels: jnp.ndarray,
                     label_smoothing: float = 0.0) -> jnp.ndarray:
  """Softmax cross-entropy, or sigmoid cross-entropy summed over classes.

  `label_smoothing` a moves targets to (1 - a) * targets + a / num_classes.
  """
  targets = onehot_targets(labels, logits.shape[-1])
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  if name == "sigmoid_xent":
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)
  return optax.softmax_cross_entropy(logits, targets)


def mean_loss(name: str, logits: jnp.ndarray, labels: jnp.ndarray,
              label_smoothing: float = 0.0) -> jnp.ndarray:
  return jnp.mean(per_example_loss(name, logits, labels, label_smoothing))
