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
  ema_params: Any = None  # The parameters' moving average, with config.ema_decay.


def init_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               image_shape: tuple[int, ...], rng: jax.Array,
               params: Any = None, ema: bool = False) -> tuple[TrainState, TrainState]:
  """Initialises (or takes `params` for) the state directly in its sharded layout; with
  `ema`, the moving average starts as a copy of the parameters.

  Returns the state and its shardings (a TrainState of NamedShardings).
  """

  init = _init_fn(model, tx, image_shape, ema)
  _, shardings = abstract_state(model, tx, mesh, image_shape, rng, params, ema)
  state = jax.jit(init, out_shardings=shardings)(rng, params)
  return state, shardings


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, image_shape: tuple[int, ...],
             ema: bool) -> Callable:
  def init(rng, params):
    if params is None:
      params = model.init(rng, jnp.zeros((1,) + tuple(image_shape), jnp.float32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      ema_params=jax.tree.map(jnp.copy, params) if ema else None)
  return init


def abstract_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                   image_shape: tuple[int, ...], rng: jax.Array, params: Any = None,
                   ema: bool = False) -> tuple[TrainState, TrainState]:
  """The state `init_state` makes, as shapes and dtypes only (nothing is computed), each leaf
  with its sharding; and the shardings."""
  abstract = jax.eval_shape(_init_fn(model, tx, image_shape, ema), rng, params)
  shardings = sharding.state_shardings(mesh, abstract)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings), shardings


def update_ema(ema: Any, params: Any, decay: float, updated: jax.Array) -> Any:
  """`decay * ema + (1 - decay) * params` where the optimizer `updated` the parameters (every
  accum_steps-th micro-batch), else `ema` as it was."""
  return jax.tree.map(lambda e, p: jnp.where(updated, decay * e + (1 - decay) * p, e), ema,
                      params)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, loss_name: str,
                    state_shardings: TrainState, mesh: Mesh, rng: jax.Array,
                    label_smoothing: float = 0.0, ema_decay: float | None = None,
                    accum_steps: int = 1) -> Callable:
  """`(state, batch) -> (state, metrics)`, jit-compiled, the state donated.

  metrics: the batch's `loss` and the gradients' global norm, `grad_norm`.
  """

  replicated = NamedSharding(mesh, P())
  sharded = mesh.shape["fsdp"] > 1

  def step_fn(state: TrainState, batch: dict[str, jax.Array]):
    dropout_rng = jax.random.fold_in(rng, state.step)

    def compute_loss(params):
      if sharded:  # The weights whole for the step, gathered once (sharding.py says why).
        params = jax.lax.with_sharding_constraint(params, replicated)
      logits = model.apply({"params": params}, batch["image"], train=True,
                           rngs={"dropout": dropout_rng})
      return losses.mean_loss(loss_name, logits, batch["label"], label_smoothing)

    loss, grads = jax.value_and_grad(compute_loss)(state.params)
    if sharded:  # Each device reduces and updates its own part.
      grads = jax.lax.with_sharding_constraint(grads, state_shardings.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = state.ema_params
    if ema_decay is not None:
      ema = update_ema(ema, params, ema_decay, (state.step + 1) % accum_steps == 0)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           ema_params=ema)
    return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

  return jax.jit(step_fn, in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
