"""The train state and the jit-compiled train step."""
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vit_jax import losses
from vit_jax.train import sharding


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # Train-step calls so far (micro-batches with gradient accumulation).
  params: Any
  opt_state: optax.OptState


def init_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               image_shape: tuple[int, ...], rng: jax.Array,
               params: Any = None) -> tuple[TrainState, TrainState]:
  """Initialises (or takes `params` for) the state directly in its sharded layout.

  Returns the state and its shardings (a TrainState of NamedShardings).
  """

  def init(rng, params):
    if params is None:
      params = model.init(rng, jnp.zeros((1,) + tuple(image_shape), jnp.float32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  abstract = jax.eval_shape(init, rng, params)
  shardings = sharding.state_shardings(mesh, abstract)
  state = jax.jit(init, out_shardings=shardings)(rng, params)
  return state, shardings


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, loss_name: str,
                    state_shardings: TrainState, mesh: Mesh, rng: jax.Array,
                    label_smoothing: float = 0.0) -> Callable:
  """`(state, batch) -> (state, metrics)`, jit-compiled, the state donated.

  metrics: the batch's `loss` and the gradients' global norm, `grad_norm`.
  """

  def step_fn(state: TrainState, batch: dict[str, jax.Array]):
    dropout_rng = jax.random.fold_in(rng, state.step)

    def compute_loss(params):
      logits = model.apply({"params": params}, batch["image"], train=True,
                           rngs={"dropout": dropout_rng})
      return losses.mean_loss(loss_name, logits, batch["label"], label_smoothing)

    loss, grads = jax.value_and_grad(compute_loss)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

  replicated = NamedSharding(mesh, P())
  return jax.jit(step_fn, in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
