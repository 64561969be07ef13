"""Vision Transformer (Dosovitskiy et al., 2021) and its hybrid ResNet+ViT form.

Parameter names follow the released checkpoints (gs://vit_models), so an .npz
from there maps onto `model.init(...)["params"]` key for key.
"""
import dataclasses
import enum
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import attention, lora as lora_lib, posemb_resize, resnet
from vit_jax.models.layer_norm import LayerNorm

CLASSIFIERS = ("token", "gap", "map")
POSEMBS = ("learn", "sincos2d")
# The GELU of the MLPs: "tanh", the approximation the official code and big_vision train with
# (flax's `nn.gelu` default), or "exact" (erf), the default of PyTorch, timm and transformers.
GELUS = ("tanh", "exact")


class Role(enum.Enum):
  """What a `VisionTransformer` field is to the rest of the package, declared with the field:
  the registry, checkpoint descriptions, the training config and a run's resume metadata list
  the fields of their roles (registry.fields_of)."""
  ARCHITECTURE = "architecture"  # What a model name fixes.
  LAYOUT = "layout"  # Which arrays there are beyond the architecture's.
  COMPUTATION = "computation"  # What the same arrays compute; no array shape tells.
  PRE_LOGITS = "pre_logits"  # The head's hidden layer: described; fine-tuning replaces it.
  INIT = "init"  # How parameters start: a new head's, a loaded position embedding's resizing.
  REGULARISATION = "regularisation"  # A run's trajectory, not its model.
  RUNTIME = "runtime"  # How it runs: a resumed run may change it.
  CLASSES = "classes"  # The head's outputs: the data's class count.
  PRECISION = "precision"  # The computation dtype: config.dtype, not config.model.
  LORA = "lora"  # Adapters: config.lora, not config.model.
  INTERNAL = "internal"  # The registry name it was built from, for messages.


def _field(role: Role, default: Any = dataclasses.MISSING) -> Any:
  return dataclasses.field(default=default, metadata={"role": role})


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.) -> np.ndarray:
  """Fixed 2-D sin-cos position embedding, (1, h*w, width), as in big_vision."""
  if width % 4:
    raise ValueError(f"sincos2d position embedding needs hidden_size % 4 == 0, got {width}.")
  y, x = np.mgrid[:h, :w]
  omega = np.arange(width // 4) / (width // 4 - 1)
  omega = 1. / (temperature**omega)
  y = np.einsum("m,d->md", y.flatten(), omega)
  x = np.einsum("m,d->md", x.flatten(), omega)
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return pe[None].astype(np.float32)


class MlpBlock(nn.Module):
  """Dense-GELU-Dense."""

  mlp_dim: int
  dropout: float = 0.0
  dtype: Any = jnp.float32
  lora: Any = None  # (rank, factor, targets): LoRA adapters on the targeted layers.
  gelu: str = "tanh"  # GELUS.

  @nn.compact
  def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
    dense = lambda features, name: lora_lib.adapt(nn.Dense(
        features, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6), name=name), self.lora)
    out_dim = x.shape[-1]
    x = nn.gelu(dense(self.mlp_dim, "Dense_0")(x), approximate=self.gelu == "tanh")
    x = nn.Dropout(self.dropout)(x, deterministic)
    x = dense(out_dim, "Dense_1")(x)
    return nn.Dropout(self.dropout)(x, deterministic)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with the parameter layout of `flax.linen`'s.

  Runs the path `implementation` names (models/attention.py; "auto": the fused kernel of the
  device where one runs) unless the attention weights are needed: returned to the caller, or
  dropped out.
  """

  num_heads: int
  dropout: float = 0.0
  dtype: Any = jnp.float32
  implementation: Optional[str] = None
  lora: Any = None  # (rank, factor, targets): LoRA adapters on the targeted projections.

  @nn.compact
  def __call__(self, inputs_q: jnp.ndarray, inputs_kv: jnp.ndarray, *,
               deterministic: bool = True, return_weights: bool = False):
    features = inputs_q.shape[-1]
    if features % self.num_heads:
      raise ValueError(f"hidden_size {features} is not divisible by num_heads {self.num_heads}.")
    head_dim = features // self.num_heads
    impl = attention.resolve(self.implementation, self.dtype, head_dim)
    dense = lambda name: lora_lib.adapt(nn.DenseGeneral(
        features=(self.num_heads, head_dim), dtype=self.dtype,
        kernel_init=nn.initializers.xavier_uniform(), name=name), self.lora)
    q = dense("query")(inputs_q)
    k = dense("key")(inputs_kv)
    v = dense("value")(inputs_kv)

    weights = None
    if return_weights or (self.dropout > 0 and not deterministic):
      out, weights = attention.explicit_attention(
          q, k, v, lambda w: nn.Dropout(self.dropout)(w, deterministic))
    else:
      out = attention.dot_product_attention(q, k, v, impl)

    out = lora_lib.adapt(nn.DenseGeneral(
        features, axis=(-2, -1), dtype=self.dtype,
        kernel_init=nn.initializers.xavier_uniform(), name="out"), self.lora)(out)
    return out, weights


class DropPath(nn.Module):
  """Stochastic depth (Huang et al. 2016) on a residual branch: zeroes the whole branch
  of each example with probability `rate` in training, scaling kept ones by 1/(1-rate)."""

  rate: float

  @nn.compact
  def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
    return nn.Dropout(self.rate, broadcast_dims=tuple(range(1, x.ndim)))(x, deterministic)


class Encoder1DBlock(nn.Module):
  """Pre-LN block: z' = MSA(LN(z)) + z; z = MLP(LN(z')) + z'."""

  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  attention_dropout: float = 0.0
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  drop_path: float = 0.0  # This block's stochastic-depth rate.
  lora: Any = None
  gelu: str = "tanh"

  @nn.compact
  def __call__(self, x: jnp.ndarray, deterministic: bool = True,
               return_weights: bool = False):
    y = LayerNorm(dtype=self.dtype, name="LayerNorm_0")(x)
    y, weights = MultiHeadDotProductAttention(
        self.num_heads, self.attention_dropout, self.dtype, self.attention_impl, self.lora,
        name="MultiHeadDotProductAttention_1")(
            y, y, deterministic=deterministic, return_weights=return_weights)
    y = nn.Dropout(self.dropout)(y, deterministic)
    x = x + DropPath(self.drop_path)(y, deterministic)
    y = LayerNorm(dtype=self.dtype, name="LayerNorm_2")(x)
    y = MlpBlock(self.mlp_dim, self.dropout, self.dtype, self.lora, self.gelu, name="MlpBlock_3")(
        y, deterministic)
    return x + DropPath(self.drop_path)(y, deterministic), weights


class AddPositionEmbs(nn.Module):
  """Adds a learned position embedding, one per token (class token included).

  With `dynamic`, the stored embedding's square patch grid is resampled (posemb_resize's
  `interpolation`) to the input's `grid`: any resolution at run time, as if the checkpoint
  had been loaded at that resolution.
  """

  grid: tuple[int, int]
  num_prefix: int = 0  # Tokens before the patches' (the class token).
  dynamic: bool = False
  interpolation: str = "bilinear"

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    shape = (1,) + x.shape[1:]
    if self.has_variable("params", "pos_embedding"):
      stored = self.get_variable("params", "pos_embedding")
      if stored.shape != shape:
        if not self.dynamic:
          raise ValueError(
              f"The position embedding has {stored.shape[1]} tokens, the input gives "
              f"{shape[1]} ({self.grid[0]}x{self.grid[1]} patches): load the checkpoint at "
              "this image_size, or build the model with dynamic_image_size=True.")
        return x + self._resampled(stored)
    return x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), shape)

  def _resampled(self, stored: jnp.ndarray) -> jnp.ndarray:
    prefix, grid = stored[:, :self.num_prefix], stored[0, self.num_prefix:]
    side = int(np.sqrt(grid.shape[0]))
    if side * side != grid.shape[0]:
      raise ValueError(f"dynamic_image_size: the position embedding's {grid.shape[0]} patches "
                       "are not a square grid.")
    grid = posemb_resize.resample(grid.reshape(side, side, -1), self.grid, self.interpolation)
    return jnp.concatenate([prefix, grid.reshape((1, -1, grid.shape[-1]))], axis=1)


class Encoder(nn.Module):
  """Learned position embedding (if any), register tokens (if any), the blocks, and the final
  LayerNorm."""

  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  attention_dropout: float = 0.0
  learned_posemb: bool = True
  remat: bool = False
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  stochastic_depth: float = 0.0  # The last block's rate; block i has (i + 1) / L of it.
  lora: Any = None
  dynamic_image_size: bool = False
  posemb_interpolation: str = "bilinear"
  gelu: str = "tanh"
  final_norm: bool = True  # False: the model normalises after pooling (`fc_norm`).

  @nn.compact
  def __call__(self, x: jnp.ndarray, grid: tuple[int, int], registers: Optional[jnp.ndarray],
               deterministic: bool = True, return_weights: bool = False):
    num_prefix = x.shape[1] - grid[0] * grid[1]
    if self.learned_posemb:
      x = AddPositionEmbs(grid, num_prefix, self.dynamic_image_size, self.posemb_interpolation,
                          name="posembed_input")(x)
    if registers is not None:
      # After the class token, with no position embedding (Darcet et al., 2024).
      registers = jnp.tile(registers, [x.shape[0], 1, 1])
      x = jnp.concatenate([x[:, :num_prefix], registers, x[:, num_prefix:]], axis=1)
    x = nn.Dropout(self.dropout)(x, deterministic)
    block = Encoder1DBlock
    if self.remat:
      block = nn.remat(Encoder1DBlock, static_argnums=(2, 3))
    all_weights = []
    for i in range(self.num_layers):
      x, weights = block(
          self.mlp_dim, self.num_heads, self.dropout, self.attention_dropout,
          self.dtype, self.attention_impl,
          drop_path=self.stochastic_depth * (i + 1) / self.num_layers, lora=self.lora,
          gelu=self.gelu, name=f"encoderblock_{i}")(
              x, deterministic, return_weights)
      # Kept only where the caller asks (mutable=["intermediates"]): models.features.
      self.sow("intermediates", f"block_{i}_out", x)
      all_weights.append(weights)
    if self.final_norm:
      x = LayerNorm(dtype=self.dtype, name="encoder_norm")(x)
    return x, (tuple(all_weights) if return_weights else None)


class MAPHead(nn.Module):
  """Multihead attention pooling with a learned probe (big_vision's `MAPHead`)."""

  mlp_dim: int
  num_heads: int
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  gelu: str = "tanh"

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, x.shape[-1]))
    probe = jnp.tile(probe, [x.shape[0], 1, 1])
    x, _ = MultiHeadDotProductAttention(
        self.num_heads, dtype=self.dtype, implementation=self.attention_impl,
        name="MultiHeadDotProductAttention_0")(probe, x)
    y = LayerNorm(dtype=self.dtype, name="LayerNorm_0")(x)
    x = x + MlpBlock(self.mlp_dim, dtype=self.dtype, gelu=self.gelu, name="MlpBlock_0")(y)
    return x[:, 0]


class VisionTransformer(nn.Module):
  """ViT, or ResNet-v2 stem + ViT when `resnet_layers` is not None.

  `__call__` returns the logits; with `return_aux=True` it returns
  `(logits, aux)` where aux holds what evaluators need from the same forward
  pass: `pre_logits` (the representation the head sees), `encoded` (all tokens
  after the final LayerNorm) and, with `return_attention=True`, `attention`:
  one (batch, heads, tokens, tokens) array per layer.
  """

  # Each field's Role decides which lists name it (registry.fields_of), in this order.
  num_classes: Optional[int] = _field(Role.CLASSES)
  patch_size: int = _field(Role.ARCHITECTURE)
  hidden_size: int = _field(Role.ARCHITECTURE)
  mlp_dim: int = _field(Role.ARCHITECTURE)
  num_heads: int = _field(Role.ARCHITECTURE)
  num_layers: int = _field(Role.ARCHITECTURE)
  resnet_layers: Optional[Sequence[int]] = _field(Role.ARCHITECTURE, None)
  resnet_width_factor: float = _field(Role.ARCHITECTURE, 1.0)
  classifier: str = _field(Role.LAYOUT, "token")
  # timm's `fc_norm`: the final LayerNorm after pooling (`fc_norm`) instead of before it.
  fc_norm: bool = _field(Role.COMPUTATION, False)
  representation_size: Optional[int] = _field(Role.PRE_LOGITS, None)
  posemb: str = _field(Role.LAYOUT, "learn")
  # Register tokens (Darcet et al., 2024): learned tokens after the class token, without a
  # position embedding, dropped before pooling.
  num_registers: int = _field(Role.LAYOUT, 0)
  gelu: str = _field(Role.COMPUTATION, "tanh")  # GELUS: what the weights were trained with.
  dropout: float = _field(Role.REGULARISATION, 0.0)
  attention_dropout: float = _field(Role.REGULARISATION, 0.0)
  # Stochastic depth: the rate rises linearly to this at the last block (0: off).
  stochastic_depth: float = _field(Role.REGULARISATION, 0.0)
  head_bias_init: float = _field(Role.INIT, 0.0)
  # LoRA adapters (models/lora.py) on the encoder blocks' `lora_targets` (0: none).
  lora_rank: int = _field(Role.LORA, 0)
  lora_alpha: Optional[float] = _field(Role.LORA, None)
  lora_targets: Sequence[str] = _field(Role.LORA, lora_lib.DEFAULT_TARGETS)
  # Any input resolution: the position embedding resampled in the forward pass.
  dynamic_image_size: bool = _field(Role.RUNTIME, False)
  # Or "bicubic" (posemb_resize.METHODS); also how a loaded embedding is resized to the grid.
  posemb_interpolation: str = _field(Role.INIT, "bilinear")
  remat: bool = _field(Role.RUNTIME, False)
  dtype: Any = _field(Role.PRECISION, jnp.float32)
  # attention.IMPLS; "auto": the device's fused kernel (cuDNN, Pallas on TPU) where it runs.
  attention_impl: Optional[str] = _field(Role.RUNTIME, "auto")
  name_in_registry: Optional[str] = _field(Role.INTERNAL, None)

  @property
  def stride(self) -> int:
    """Input pixels per token along each side."""
    if self.resnet_layers is None:
      return self.patch_size
    return 4 * 2**max(len(self.resnet_layers) - 1, 0) * self.patch_size

  def _check_inputs(self, images: jnp.ndarray) -> None:
    if images.ndim != 4 or images.shape[-1] != 3:
      raise ValueError(
          f"Expected images of shape (batch, height, width, 3) (NHWC, RGB), got "
          f"{images.shape}. Grayscale inputs must be converted to 3 channels.")
    h, w = images.shape[1:3]
    if h % self.stride or w % self.stride:
      raise ValueError(
          f"Image size {h}x{w} is not divisible by the model's patch stride "
          f"{self.stride} ({self.name_in_registry or 'model'}): use a size that is a "
          f"multiple of {self.stride}, e.g. {max(h // self.stride, 1) * self.stride}.")

  @property
  def num_prefix_tokens(self) -> int:
    """Tokens before the patches' in the encoder's output: the class token, the registers."""
    return int(self.classifier == "token") + self.num_registers

  def _pool(self, encoded: jnp.ndarray) -> jnp.ndarray:
    """The tokens to one vector: the class token, the patches' mean, or attention pooling."""
    if self.classifier == "token":
      # Not encoded[:, 0]: with a symbolic batch (jax2tf, jax.export) that indexing becomes a
      # dynamic gather, which the TFLite converter cannot lower; this is a plain slice.
      return jax.lax.index_in_dim(encoded, 0, axis=1, keepdims=False)
    if self.num_registers:
      encoded = encoded[:, self.num_prefix_tokens:]
    if self.classifier == "gap":
      return jnp.mean(encoded, axis=1)
    return MAPHead(self.mlp_dim, self.num_heads, self.dtype, self.attention_impl, self.gelu,
                   name="MAPHead_0")(encoded)

  def _check_fields(self) -> None:
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f"classifier={self.classifier!r}, expected one of {CLASSIFIERS}.")
    if self.gelu not in GELUS:
      raise ValueError(f"gelu={self.gelu!r}, expected one of {GELUS}.")
    if self.posemb not in POSEMBS:
      raise ValueError(f"posemb={self.posemb!r}, expected one of {POSEMBS}.")
    if not 0 <= self.stochastic_depth < 1:
      raise ValueError(f"stochastic_depth={self.stochastic_depth!r}, expected a rate in [0, 1).")
    if self.num_registers < 0:
      raise ValueError(f"num_registers={self.num_registers!r}, expected >= 0.")
    if self.posemb_interpolation not in posemb_resize.METHODS:
      raise ValueError(f"posemb_interpolation={self.posemb_interpolation!r}, expected one of "
                       f"{posemb_resize.METHODS}.")
    lora_lib.check(self.lora_rank, self.lora_alpha, self.lora_targets)

  @property
  def _lora(self) -> Optional[tuple[int, float, tuple[str, ...]]]:
    if not self.lora_rank:
      return None
    return (self.lora_rank, lora_lib.scale(self.lora_rank, self.lora_alpha),
            tuple(self.lora_targets))

  def _embed(self, images: jnp.ndarray) -> tuple[jnp.ndarray, tuple[int, int]]:
    """The patches' tokens (after the hybrids' stem), class token first; and the patch grid."""
    x = images.astype(self.dtype)
    if self.resnet_layers is not None:
      x = resnet.resnet_stem(x, self.resnet_layers, self.resnet_width_factor, self.dtype)
    x = nn.Conv(self.hidden_size, (self.patch_size, self.patch_size),
                strides=(self.patch_size, self.patch_size), padding="VALID",
                dtype=self.dtype, name="embedding")(x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if self.posemb == "sincos2d":
      # Fixed embedding of the patches only; the class token, if any, gets none.
      x = x + posemb_sincos_2d(h, w, c)
    # The residual stream stays float32; only the matmul inputs are cast to dtype.
    x = x.astype(jnp.float32)
    if self.classifier == "token":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
      x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
    return x, (h, w)

  @nn.compact
  def __call__(self, images: jnp.ndarray, *, train: bool = False,
               return_aux: bool = False, return_attention: bool = False):
    self._check_fields()
    self._check_inputs(images)
    x, (h, w) = self._embed(images)
    registers = None
    if self.num_registers:  # timm's initialisation of its `reg_token`.
      registers = self.param("reg", nn.initializers.normal(stddev=1e-6),
                             (1, self.num_registers, self.hidden_size))

    encoded, attention = Encoder(
        self.num_layers, self.mlp_dim, self.num_heads, self.dropout,
        self.attention_dropout, learned_posemb=self.posemb == "learn",
        remat=self.remat, dtype=self.dtype, attention_impl=self.attention_impl,
        stochastic_depth=self.stochastic_depth, lora=self._lora,
        dynamic_image_size=self.dynamic_image_size,
        posemb_interpolation=self.posemb_interpolation, gelu=self.gelu,
        final_norm=not self.fc_norm,
        name="Transformer")(x, (h, w), registers, not train, return_attention)

    x = self._pool(encoded)
    if self.fc_norm:
      x = LayerNorm(dtype=self.dtype, name="fc_norm")(x)
    if self.representation_size is not None:
      x = nn.tanh(nn.Dense(self.representation_size, dtype=self.dtype, name="pre_logits")(x))
    pre_logits = x.astype(jnp.float32)

    logits = pre_logits
    if self.num_classes:
      logits = nn.Dense(
          self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros,
          bias_init=nn.initializers.constant(self.head_bias_init), name="head")(x)
      logits = logits.astype(jnp.float32)

    if not (return_aux or return_attention):
      return logits
    aux = {"pre_logits": pre_logits, "encoded": encoded.astype(jnp.float32)}
    if return_attention:
      aux["attention"] = attention
    return logits, aux
