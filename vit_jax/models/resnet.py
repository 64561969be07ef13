"""ResNet-v2 stem of the hybrid models: weight-standardised convs + GroupNorm.

Parameter names follow the released hybrid checkpoints: `conv_root`, `gn_root`,
`block{i}/unit{k}/{conv1,gn1,conv2,gn2,conv3,gn3,conv_proj,gn_proj}`.
"""
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp


def weight_standardize(w: jnp.ndarray, axis: Sequence[int], eps: float) -> jnp.ndarray:
  w = w - jnp.mean(w, axis=axis)
  return w / (jnp.std(w, axis=axis) + eps)


class StdConv(nn.Conv):
  """Conv whose kernel is standardised per output channel before use."""

  def param(self, name: str, *args, **kwargs):
    param = super().param(name, *args, **kwargs)
    if name == "kernel":
      param = weight_standardize(param, axis=[0, 1, 2], eps=1e-5)
    return param


class ResidualUnit(nn.Module):
  """Bottleneck unit: 1x1 -> 3x3 (strided) -> 1x1 with 4x expansion."""

  features: int
  strides: tuple[int, int] = (1, 1)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    conv = lambda f, k, s, name: StdConv(
        f, k, s, use_bias=False, dtype=self.dtype, name=name)
    norm = lambda name, **kw: nn.GroupNorm(dtype=self.dtype, name=name, **kw)
    residual = x
    if x.shape[-1] != self.features * 4 or self.strides != (1, 1):
      residual = conv(self.features * 4, (1, 1), self.strides, "conv_proj")(x)
      residual = norm("gn_proj")(residual)
    y = nn.relu(norm("gn1")(conv(self.features, (1, 1), (1, 1), "conv1")(x)))
    y = nn.relu(norm("gn2")(conv(self.features, (3, 3), self.strides, "conv2")(y)))
    y = norm("gn3", scale_init=nn.initializers.zeros)(
        conv(self.features * 4, (1, 1), (1, 1), "conv3")(y))
    return nn.relu(residual + y)


class ResNetStage(nn.Module):
  num_units: int
  features: int
  first_stride: tuple[int, int]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    for k in range(self.num_units):
      strides = self.first_stride if k == 0 else (1, 1)
      x = ResidualUnit(self.features, strides, self.dtype, name=f"unit{k + 1}")(x)
    return x


def resnet_stem(x: jnp.ndarray, num_layers: Sequence[int], width_factor: float,
                dtype: Any) -> jnp.ndarray:
  """Root conv + max-pool (/4), then stages; stages after the first halve the grid.

  Called from a compact method, so its parameters sit at the top level of the
  model, where the released hybrid checkpoints keep them.
  """
  width = int(64 * width_factor)
  x = StdConv(width, (7, 7), (2, 2), use_bias=False, dtype=dtype, name="conv_root")(x)
  x = nn.relu(nn.GroupNorm(dtype=dtype, name="gn_root")(x))
  x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
  for i, num_units in enumerate(num_layers):
    x = ResNetStage(num_units, width * 2**i, (1, 1) if i == 0 else (2, 2), dtype,
                    name=f"block{i + 1}")(x)
  return x
