"""Token slicing that stays exportable: the encoder's prefix tokens (class token, registers)
and its patch tokens taken apart."""
import jax
import jax.numpy as jnp


def split(x: jnp.ndarray, n: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(batch, tokens, ...) -> the first n tokens and the rest, as plain slices: x[:, n:] with a
  symbolic batch (jax2tf, jax.export) becomes a dynamic gather, which the TFLite converter
  cannot lower."""
  return (jax.lax.slice_in_dim(x, 0, n, axis=1),
          jax.lax.slice_in_dim(x, n, x.shape[1], axis=1))
