"""LayerNorm with `flax.linen.LayerNorm`'s parameters and values, whose backward pass, with a
16-bit output dtype, keeps one 16-bit tensor: the normalised input.

Autodiff of flax's LayerNorm keeps its float32 input: in a bf16 ViT the residual stream, two
float32 (batch, tokens, width) tensors a block; and the projection after it keeps the norm's
output as well. In 16 bits this one rounds (x - mean) * rstd to that dtype and applies scale
and bias to it, so that the output is a function of the one tensor the backward keeps (with
rstd, one float32 number a token): XLA recomputes the output from it inside the projections'
weight gradients instead of keeping both. The price is one more rounding: the output is within
one 16-bit ulp of flax's (tests/test_attention.py); in float32 it is flax's LayerNorm itself.
"""
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class LayerNorm(nn.Module):
  """`nn.LayerNorm(epsilon, dtype)`, parameters `scale` and `bias`."""

  epsilon: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (width,))
    bias = self.param("bias", nn.initializers.zeros, (width,))
    if jnp.dtype(self.dtype).itemsize >= 4:
      return nn.LayerNorm(epsilon=self.epsilon, dtype=self.dtype).apply(
          {"params": {"scale": scale, "bias": bias}}, x)
    normalised = _normalised(x, self.epsilon, self.dtype)
    return (normalised.astype(jnp.float32) * scale + bias).astype(self.dtype)


def _normalise(x, epsilon, dtype):
  """(x - mean) * rstd in `dtype`, and rstd: flax's arithmetic (mean of squares minus the
  squared mean, in float32)."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean)
  rstd = jax.lax.rsqrt(var + epsilon)
  return ((x32 - mean) * rstd).astype(dtype), rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _normalised(x, epsilon, dtype):
  return _normalise(x, epsilon, dtype)[0]


def _normalised_fwd(x, epsilon, dtype):
  normalised, rstd = _normalise(x, epsilon, dtype)
  # An empty array of x's dtype: a residual must be an array, and dx must be of x's dtype.
  return normalised, (normalised, rstd, jnp.empty((0,), x.dtype))


def _normalised_bwd(epsilon, dtype, residuals, d_normalised):
  del epsilon, dtype
  normalised, rstd, like_x = residuals
  g, n = d_normalised.astype(jnp.float32), normalised.astype(jnp.float32)
  dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
               - n * jnp.mean(g * n, axis=-1, keepdims=True))
  return (dx.astype(like_x.dtype),)


_normalised.defvjp(_normalised_fwd, _normalised_bwd)
