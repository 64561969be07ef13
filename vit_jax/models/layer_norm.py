"""LayerNorm as `flax.linen.LayerNorm` computes it (the same parameters, the same values), whose
backward pass, with a 16-bit output dtype, keeps the normalised input in that dtype.

Autodiff of flax's LayerNorm keeps its float32 input: in a bf16 ViT the residual stream, two
float32 (batch, tokens, width) tensors a block. This one keeps (x - mean) * rstd in bf16 and
rstd in float32 (one number a token); the block's projections, whose weight gradients need
the norm's output, recompute it from them (XLA fuses scale and bias into those products).
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
      return _flax_layer_norm(x, scale, bias, self.epsilon, self.dtype)
    return _layer_norm(x, scale, bias, self.epsilon, self.dtype)


def _flax_layer_norm(x, scale, bias, epsilon, dtype):
  return nn.LayerNorm(epsilon=epsilon, dtype=dtype).apply(
      {"params": {"scale": scale, "bias": bias}}, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer_norm(x, scale, bias, epsilon, dtype):
  return _flax_layer_norm(x, scale, bias, epsilon, dtype)


def _layer_norm_fwd(x, scale, bias, epsilon, dtype):
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean)
  rstd = jax.lax.rsqrt(var + epsilon)
  normalised = ((x32 - mean) * rstd).astype(dtype)
  # A barrier with the output: otherwise XLA fuses the normalisation into its uses in the
  # backward pass, which then read, and keep, the float32 input after all.
  y, normalised = jax.lax.optimization_barrier(
      (_flax_layer_norm(x, scale, bias, epsilon, dtype), normalised))
  # An empty array of x's dtype: a residual must be an array, and dx must be of x's dtype.
  return y, (normalised, rstd, scale, jnp.empty((0,), x.dtype))


def _layer_norm_bwd(epsilon, dtype, residuals, dy):
  del epsilon, dtype
  normalised, rstd, scale, like_x = residuals
  dy, normalised = dy.astype(jnp.float32), normalised.astype(jnp.float32)
  rows = tuple(range(dy.ndim - 1))
  d_scale = jnp.sum(dy * normalised, axis=rows)
  d_bias = jnp.sum(dy, axis=rows)
  g = dy * scale
  dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
               - normalised * jnp.mean(g * normalised, axis=-1, keepdims=True))
  return dx.astype(like_x.dtype), d_scale, d_bias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)
