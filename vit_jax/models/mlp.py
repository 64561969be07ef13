"""The MLP of a ViT block: Dense-GELU-Dense, or SwiGLU (EVA-02, DINOv2-g, DINOv3-H+/7B);
optionally with a LayerNorm on its hidden layer (EVA-02's `scale_mlp`).

Parameters: `Dense_0` (in -> hidden; SwiGLU: in -> 2 * hidden, the gate's half first, then
the value's, as timm's packed `GluMlp` and transformers' `weights_in` hold them), the hidden
layer's `LayerNorm_0` where `norm`, and `Dense_1` (hidden -> in).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import lora as lora_lib
from vit_jax.models.layer_norm import LayerNorm

# The GELU of the MLPs: "tanh", the approximation the official code and big_vision train with
# (flax's `nn.gelu` default), "exact" (erf), the default of PyTorch, timm and transformers, or
# "quick", OpenAI CLIP's x * sigmoid(1.702 x).
GELUS = ("tanh", "exact", "quick")
# "gelu": Dense-GELU-Dense (the GELU of `gelu`); "swiglu": silu(gate) * value, then Dense.
KINDS = ("gelu", "swiglu")


def gelu(x: jax.Array, form: str) -> jax.Array:
  """The GELU `form` (GELUS) of x."""
  if form == "quick":
    return x * jax.nn.sigmoid(1.702 * x)
  return nn.gelu(x, approximate=form == "tanh")


class MlpBlock(nn.Module):
  """Dense-GELU-Dense, or SwiGLU (`kind`), with dropout after the hidden layer and the output."""

  mlp_dim: int
  dropout: float = 0.0
  dtype: Any = jnp.float32
  lora: Any = None  # (rank, factor, targets): LoRA adapters on the targeted layers.
  gelu: str = "tanh"  # GELUS.
  kind: str = "gelu"  # KINDS.
  norm: bool = False  # A LayerNorm on the hidden layer, before Dense_1.
  norm_epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
    dense = lambda features, name: lora_lib.adapt(nn.Dense(
        features, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6), name=name), self.lora)
    out_dim = x.shape[-1]
    if self.kind == "swiglu":
      gate, value = jnp.split(dense(2 * self.mlp_dim, "Dense_0")(x), 2, axis=-1)
      x = nn.silu(gate) * value
    else:
      x = gelu(dense(self.mlp_dim, "Dense_0")(x), self.gelu)
    x = nn.Dropout(self.dropout)(x, deterministic)
    if self.norm:
      x = LayerNorm(self.norm_epsilon, self.dtype, name="LayerNorm_0")(x)
    x = dense(out_dim, "Dense_1")(x)
    return nn.Dropout(self.dropout)(x, deterministic)
