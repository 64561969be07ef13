"""Train state, losses and the jit-compiled train step."""
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vit_jax.train import sharding

TrainState = dict[str, Any]  # {"step", "params", "opt_state", "first_nonfinite_step"}
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


def loss_fn(name: str, logits: jnp.ndarray, labels: jnp.ndarray,
            label_smoothing: float = 0.0) -> jnp.ndarray:
  return jnp.mean(per_example_loss(name, logits, labels, label_smoothing))


def init_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               image_shape: tuple[int, ...], rng: jax.Array,
               params: Any = None) -> tuple[TrainState, Any]:
  """Initialises (or takes `params` for) the state directly in its sharded layout.

  Returns the state and its shardings.
  """

  def init(rng, params):
    if params is None:
      params = model.init(rng, jnp.zeros((1,) + tuple(image_shape), jnp.float32))["params"]
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
            "first_nonfinite_step": jnp.full((), -1, jnp.int32)}

  abstract = jax.eval_shape(init, rng, params)
  shardings = sharding.state_shardings(mesh, abstract)
  state = jax.jit(init, out_shardings=shardings)(rng, params)
  return state, shardings


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, loss_name: str,
                    state_shardings: Any, mesh: Mesh, rng: jax.Array,
                    label_smoothing: float = 0.0) -> Callable:
  """`(state, batch) -> (state, metrics)`, jit-compiled, the state donated."""

  def step_fn(state: TrainState, batch: dict[str, jax.Array]):
    dropout_rng = jax.random.fold_in(rng, state["step"])

    def compute_loss(params):
      logits = model.apply({"params": params}, batch["image"], train=True,
                           rngs={"dropout": dropout_rng})
      return loss_fn(loss_name, logits, batch["label"], label_smoothing)

    loss, grads = jax.value_and_grad(compute_loss)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    first_bad = jnp.where((state["first_nonfinite_step"] < 0) & ~finite,
                          state["step"], state["first_nonfinite_step"])
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
                 "first_nonfinite_step": first_bad}
    return new_state, {"loss": loss, "grad_norm": grad_norm}

  replicated = NamedSharding(mesh, P())
  return jax.jit(step_fn, in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
