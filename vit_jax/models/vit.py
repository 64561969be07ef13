"""Vision Transformer (Dosovitskiy et al., 2021) and its hybrid ResNet+ViT form, with the
pieces of the families built on it as fields: DINOv2, DINOv3, CLIP / OpenCLIP, EVA-02.

Parameter names follow the released checkpoints (gs://vit_models), so an .npz
from there maps onto `model.init(...)["params"]` key for key; the fields' arrays are named
beside them, Flax-style (VisionTransformer's field comments say where).
"""
import dataclasses
import enum
import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import (attention, lora as lora_lib, posemb_resize, resnet, rope as rope_lib,
                            tokens)
from vit_jax.models.layer_norm import LayerNorm
from vit_jax.models.mlp import GELUS, KINDS as MLPS, MlpBlock
from vit_jax.models.posemb import AddPositionEmbs, posemb_sincos_2d

CLASSIFIERS = ("token", "gap", "map")
POSEMBS = ("learn", "sincos2d", "none")
# The learned position embedding's '/'-joined name among the params (the encoder's
# `posembed_input`), as the released .npz files and every layout converted to theirs hold it.
POSEMB_KEY = "Transformer/posembed_input/pos_embedding"
# Which of the query, key and value projections have a bias: all three, the query's and the
# value's (EVA-02, DINOv3's `_qkvb` models: a key bias is a constant of each query's logits,
# which the softmax cancels), or none (DINOv3).
QKV_BIASES = ("qkv", "qv", "none")
# The residual stream's dtype between the blocks: float32 (the paper's), or bfloat16, which
# halves its HBM traffic and rounds each block's sums to 8 bits of mantissa.
RESIDUAL_DTYPES = ("float32", "bfloat16")

# The fields that take one of a few values, and those values.
CHOICES = {"classifier": CLASSIFIERS, "gelu": GELUS, "posemb": POSEMBS,
           "posemb_interpolation": posemb_resize.METHODS, "qkv_bias": QKV_BIASES, "mlp": MLPS,
           "rope": rope_lib.KINDS, "residual_dtype": RESIDUAL_DTYPES}


class Role(enum.Enum):
  """What a `VisionTransformer` field is to the rest of the package, declared with the field:
  the registry, checkpoint descriptions, the training config and a run's resume metadata list
  the fields of their roles (registry.fields_of)."""
  ARCHITECTURE = "architecture"  # What a model name fixes.
  LAYOUT = "layout"  # Which arrays there are beyond the architecture's.
  COMPUTATION = "computation"  # What the same arrays compute; no array shape tells.
  # The head beyond its outputs (its hidden layer, its bias): described; fine-tuning replaces it.
  PRE_LOGITS = "pre_logits"
  INIT = "init"  # How parameters start: a new head's, a loaded position embedding's resizing.
  REGULARISATION = "regularisation"  # A run's trajectory, not its model.
  EXECUTION = "execution"  # How it executes (memory, kernels): a resumed run may change it.
  CLASSES = "classes"  # The head's outputs: the data's class count.
  PRECISION = "precision"  # The computation dtype: config.dtype, not config.model.
  LORA = "lora"  # Adapters: config.lora, not config.model.
  INTERNAL = "internal"  # The registry name it was built from, for messages.


def _field(role: Role, default: Any = dataclasses.MISSING) -> Any:
  return dataclasses.field(default=default, metadata={"role": role})


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with the parameter layout of `flax.linen`'s.

  Runs the path `implementation` names (models/attention.py; "auto": the fused kernel of the
  device where one runs) unless the attention weights are needed: returned to the caller, or
  dropped out. With `rope` (sin, cos of rope.embedding), the patches' queries and keys are
  rotated before it (`rope_kind`); with `norm`, the heads' outputs are layer-normalised
  together before `out` (EVA-02 CLIP's `scale_attn_inner`: parameters `LayerNorm_0`).
  """

  num_heads: int
  dropout: float = 0.0
  dtype: Any = jnp.float32
  implementation: Optional[str] = None
  lora: Any = None  # (rank, factor, targets): LoRA adapters on the targeted projections.
  qkv_bias: str = "qkv"  # QKV_BIASES.
  rope_kind: str = "none"  # rope.KINDS.
  norm: bool = False
  norm_epsilon: float = 1e-6

  @nn.compact
  def __call__(self, inputs_q: jnp.ndarray, inputs_kv: jnp.ndarray, *,
               deterministic: bool = True, return_weights: bool = False, rope: Any = None):
    features = inputs_q.shape[-1]
    if features % self.num_heads:
      raise ValueError(f"hidden_size {features} is not divisible by num_heads {self.num_heads}.")
    head_dim = features // self.num_heads
    impl = attention.resolve(self.implementation, self.dtype, head_dim)
    dense = lambda name, bias: lora_lib.adapt(nn.DenseGeneral(
        features=(self.num_heads, head_dim), dtype=self.dtype, use_bias=bias,
        kernel_init=nn.initializers.xavier_uniform(), name=name), self.lora)
    q = dense("query", self.qkv_bias != "none")(inputs_q)
    k = dense("key", self.qkv_bias == "qkv")(inputs_kv)
    v = dense("value", self.qkv_bias != "none")(inputs_kv)
    if rope is not None:
      q, k = (rope_lib.apply(x, *rope, self.rope_kind) for x in (q, k))

    weights = None
    if return_weights or (self.dropout > 0 and not deterministic):
      out, weights = attention.explicit_attention(
          q, k, v, lambda w: nn.Dropout(self.dropout)(w, deterministic))
    else:
      out = attention.dot_product_attention(q, k, v, impl)
    if self.norm:
      normed = LayerNorm(self.norm_epsilon, self.dtype, name="LayerNorm_0")(
          out.reshape(out.shape[:-2] + (-1,)))
      out = normed.reshape(out.shape)

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


class LayerScale(nn.Module):
  """A residual branch scaled per channel (Touvron et al., 2021; DINOv2, DINOv3): `scale`,
  (width,), starting at 1e-5 as timm's and DINOv2's `init_values`."""

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    return x * self.param("scale", nn.initializers.constant(1e-5), (x.shape[-1],))


class Encoder1DBlock(nn.Module):
  """Pre-LN block: z' = MSA(LN(z)) + z; z = MLP(LN(z')) + z'. With `layer_scale`, each branch
  is scaled per channel before it is added (`LayerScale_0`: attention's, `LayerScale_1`: the
  MLP's)."""

  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  attention_dropout: float = 0.0
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  drop_path: float = 0.0  # This block's stochastic-depth rate.
  lora: Any = None
  gelu: str = "tanh"
  mlp: str = "gelu"  # mlp.KINDS.
  mlp_norm: bool = False
  attention_norm: bool = False
  qkv_bias: str = "qkv"
  layer_scale: bool = False
  rope: str = "none"
  norm_epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jnp.ndarray, rope: Any = None, deterministic: bool = True,
               return_weights: bool = False):
    y = LayerNorm(self.norm_epsilon, self.dtype, name="LayerNorm_0")(x)
    y, weights = MultiHeadDotProductAttention(
        self.num_heads, self.attention_dropout, self.dtype, self.attention_impl, self.lora,
        self.qkv_bias, self.rope, self.attention_norm, self.norm_epsilon,
        name="MultiHeadDotProductAttention_1")(
            y, y, deterministic=deterministic, return_weights=return_weights, rope=rope)
    y = nn.Dropout(self.dropout)(y, deterministic)
    if self.layer_scale:
      y = LayerScale(name="LayerScale_0")(y)
    x = x + DropPath(self.drop_path)(y, deterministic).astype(x.dtype)
    y = LayerNorm(self.norm_epsilon, self.dtype, name="LayerNorm_2")(x)
    y = MlpBlock(self.mlp_dim, self.dropout, self.dtype, self.lora, self.gelu, self.mlp,
                 self.mlp_norm, self.norm_epsilon, name="MlpBlock_3")(y, deterministic)
    if self.layer_scale:
      y = LayerScale(name="LayerScale_1")(y)
    return x + DropPath(self.drop_path)(y, deterministic).astype(x.dtype), weights


class Encoder(nn.Module):
  """Learned position embedding (if any), register tokens (if any), the pre-norm (if any), the
  blocks with their rotary embedding (if any), and the final LayerNorm."""

  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  attention_dropout: float = 0.0
  learned_posemb: bool = True
  remat: bool = False
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  residual_dtype: str = "float32"  # RESIDUAL_DTYPES: the stream's between the blocks.
  stochastic_depth: float = 0.0  # The last block's rate; block i has (i + 1) / L of it.
  lora: Any = None
  dynamic_image_size: bool = False
  posemb_interpolation: str = "bilinear"
  final_norm: bool = True  # False: the model normalises after pooling (`fc_norm`).
  pre_norm: bool = False
  norm_epsilon: float = 1e-6
  rope_ref_grid: Optional[int] = None
  # Encoder1DBlock's fields of the model's form: gelu, mlp, mlp_norm, attention_norm,
  # qkv_bias, layer_scale, rope.
  block: Any = None

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
      prefix, patches = tokens.split(x, num_prefix)
      x = jnp.concatenate([prefix, registers, patches], axis=1)
    x = nn.Dropout(self.dropout)(x, deterministic)
    if self.pre_norm:  # In float32: its output is the residual stream.
      x = LayerNorm(self.norm_epsilon, jnp.float32, name="pre_norm")(x)
    x = x.astype(self.residual_dtype)
    block_fields = dict(self.block or {})
    rope = None
    if block_fields.get("rope", "none") != "none":
      rope = rope_lib.embedding(block_fields["rope"], grid, x.shape[-1] // self.num_heads,
                                self.rope_ref_grid)
    block_cls = Encoder1DBlock
    if self.remat:
      block_cls = nn.remat(Encoder1DBlock, static_argnums=(3, 4))
    all_weights = []
    for i in range(self.num_layers):
      x, weights = block_cls(
          self.mlp_dim, self.num_heads, self.dropout, self.attention_dropout,
          self.dtype, self.attention_impl,
          drop_path=self.stochastic_depth * (i + 1) / self.num_layers, lora=self.lora,
          norm_epsilon=self.norm_epsilon, **block_fields, name=f"encoderblock_{i}")(
              x, rope, deterministic, return_weights)
      # Kept only where the caller asks (mutable=["intermediates"]): models.features.
      self.sow("intermediates", f"block_{i}_out", x)
      all_weights.append(weights)
    x = x.astype(jnp.float32)
    if self.final_norm:
      x = LayerNorm(self.norm_epsilon, self.dtype, name="encoder_norm")(x)
    return x, (tuple(all_weights) if return_weights else None)


class MAPHead(nn.Module):
  """Multihead attention pooling with a learned probe (big_vision's `MAPHead`)."""

  mlp_dim: int
  num_heads: int
  dtype: Any = jnp.float32
  attention_impl: Optional[str] = None
  gelu: str = "tanh"
  norm_epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, x.shape[-1]))
    probe = jnp.tile(probe, [x.shape[0], 1, 1])
    x, _ = MultiHeadDotProductAttention(
        self.num_heads, dtype=self.dtype, implementation=self.attention_impl,
        name="MultiHeadDotProductAttention_0")(probe, x)
    y = LayerNorm(self.norm_epsilon, self.dtype, name="LayerNorm_0")(x)
    x = x + MlpBlock(self.mlp_dim, dtype=self.dtype, gelu=self.gelu, name="MlpBlock_0")(y)
    return jax.lax.index_in_dim(x, 0, axis=1, keepdims=False)


def fitted_size(size: int, stride: int) -> int:
  """The multiple of `stride` nearest `size` (at least `stride`): images of whole tokens."""
  return max(1, round(size / stride)) * stride


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
  # A class token under "gap" pooling too, left out of the mean like the registers (timm's
  # `class_token` with global_pool="avg": EVA-02's ImageNet heads, DINOv3's timm default).
  class_token: bool = _field(Role.LAYOUT, False)
  # A LayerNorm on the tokens before the first block (`Transformer/pre_norm`; CLIP's `ln_pre`),
  # and a patch embedding without bias, as timm, open_clip and transformers make it then.
  pre_norm: bool = _field(Role.LAYOUT, False)
  # LayerScale on both residual branches of every block (`LayerScale_0`, `LayerScale_1`).
  layer_scale: bool = _field(Role.LAYOUT, False)
  qkv_bias: str = _field(Role.LAYOUT, "qkv")  # QKV_BIASES.
  # MLPS: "gelu" (Dense-GELU-Dense) or "swiglu" (Dense_0 holds the gate and the value:
  # (width, 2 * mlp_dim)); with mlp_norm, a LayerNorm on its hidden layer (EVA-02's `scale_mlp`).
  mlp: str = _field(Role.LAYOUT, "gelu")
  mlp_norm: bool = _field(Role.LAYOUT, False)
  # A LayerNorm on the attention's heads before `out` (EVA-02 CLIP's `scale_attn_inner`).
  attention_norm: bool = _field(Role.LAYOUT, False)
  gelu: str = _field(Role.COMPUTATION, "tanh")  # GELUS: what the weights were trained with.
  # Every LayerNorm's epsilon: 1e-6 in the official code, big_vision and timm's ViT; 1e-5 in
  # torch's default (CLIP, transformers, DINOv3).
  layer_norm_eps: float = _field(Role.COMPUTATION, 1e-6)
  # 2-D rotary embedding of the patches' queries and keys in every block (rope.KINDS): "eva"
  # (EVA-02) or "dinov3"; the learned embedding stays as `posemb` says ("none": DINOv3).
  rope: str = _field(Role.COMPUTATION, "none")
  # "eva": the patch-grid side the rotary positions are scaled to (timm's `ref_feat_shape`;
  # EVA-02: 16); None: the patches' indices.
  rope_ref_grid: Optional[int] = _field(Role.COMPUTATION, None)
  dropout: float = _field(Role.REGULARISATION, 0.0)
  attention_dropout: float = _field(Role.REGULARISATION, 0.0)
  # Stochastic depth: the rate rises linearly to this at the last block (0: off).
  stochastic_depth: float = _field(Role.REGULARISATION, 0.0)
  # False: a head without bias (CLIP's projection kept as the head).
  head_bias: bool = _field(Role.PRE_LOGITS, True)
  head_bias_init: float = _field(Role.INIT, 0.0)
  # LoRA adapters (models/lora.py) on the encoder blocks' `lora_targets` (0: none).
  lora_rank: int = _field(Role.LORA, 0)
  lora_alpha: Optional[float] = _field(Role.LORA, None)
  lora_targets: Sequence[str] = _field(Role.LORA, lora_lib.DEFAULT_TARGETS)
  # Any input resolution: the position embedding resampled in the forward pass.
  dynamic_image_size: bool = _field(Role.EXECUTION, False)
  # Or "bicubic" (timm's), "bicubic_no_antialias" (transformers') (posemb_resize.METHODS);
  # also how a loaded embedding is resized to the grid.
  posemb_interpolation: str = _field(Role.INIT, "bilinear")
  remat: bool = _field(Role.EXECUTION, False)
  # RESIDUAL_DTYPES: "bfloat16" keeps the stream between the blocks in 16 bits, halving the
  # traffic of the tensor every block reads and writes most (benchmarks/README.md, "Where a
  # TPU step's bytes go"); it changes the sums, so only the pre-training configs take it.
  residual_dtype: str = _field(Role.EXECUTION, "float32")
  dtype: Any = _field(Role.PRECISION, jnp.float32)
  # attention.IMPLS; "auto": the device's fused kernel (cuDNN, Pallas on TPU) where it runs.
  attention_impl: Optional[str] = _field(Role.EXECUTION, "auto")
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
          f"Image size {h}x{w} is not divisible by the model's patch stride {self.stride}"
          f"{f' ({self.name_in_registry})' if self.name_in_registry else ''}: use a size that is a "
          f"multiple of {self.stride}, e.g. {fitted_size(h, self.stride)}.")

  @property
  def num_prefix_tokens(self) -> int:
    """Tokens before the patches' in the encoder's output: the class token, the registers."""
    return int(self.classifier == "token" or self.class_token) + self.num_registers

  def _pool(self, encoded: jnp.ndarray) -> jnp.ndarray:
    """The tokens to one vector: the class token, the patches' mean, or attention pooling."""
    if self.classifier == "token":
      return jax.lax.index_in_dim(encoded, 0, axis=1, keepdims=False)  # See tokens.split.
    encoded = tokens.split(encoded, self.num_prefix_tokens)[1]
    if self.classifier == "gap":
      return jnp.mean(encoded, axis=1)
    return MAPHead(self.mlp_dim, self.num_heads, self.dtype, self.attention_impl, self.gelu,
                   self.layer_norm_eps, name="MAPHead_0")(encoded)

  def _check_fields(self) -> None:
    for field, allowed in CHOICES.items():
      if getattr(self, field) not in allowed:
        raise ValueError(f"{field}={getattr(self, field)!r}, expected one of {allowed}.")
    if not 0 <= self.stochastic_depth < 1:
      raise ValueError(f"stochastic_depth={self.stochastic_depth!r}, expected a rate in [0, 1).")
    if self.num_registers < 0:
      raise ValueError(f"num_registers={self.num_registers!r}, expected >= 0.")
    if self.class_token and self.classifier != "gap":
      raise ValueError(f"class_token=True is for classifier='gap' (a class token beside the "
                       f"patches' mean); classifier={self.classifier!r} "
                       + ("has its own." if self.classifier == "token" else "pools without."))
    if not self.layer_norm_eps > 0:
      raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r}, expected > 0.")
    head_dim = self.hidden_size // self.num_heads
    if self.rope != "none" and head_dim % 4:
      raise ValueError(f"rope={self.rope!r} needs a head size divisible by 4, got {head_dim} "
                       f"(hidden_size {self.hidden_size} / num_heads {self.num_heads}).")
    if self.rope_ref_grid is not None and (self.rope != "eva" or self.rope_ref_grid < 1):
      raise ValueError(f"rope_ref_grid={self.rope_ref_grid!r} is rope='eva''s pre-training grid "
                       f"side (>= 1); rope={self.rope!r}.")
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
                use_bias=not self.pre_norm, dtype=self.dtype, name="embedding")(x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if self.posemb == "sincos2d":
      # Fixed embedding of the patches only; the class token, if any, gets none.
      x = x + posemb_sincos_2d(h, w, c)
    # The residual stream stays float32; only the matmul inputs are cast to dtype.
    x = x.astype(jnp.float32)
    if self.classifier == "token" or self.class_token:
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
      x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
    return x, (h, w)

  def _encode(self, x: jnp.ndarray, grid: tuple[int, int], deterministic: bool,
              return_attention: bool):
    """The tokens through the encoder: (all tokens, each block's attention weights or None)."""
    registers = None
    if self.num_registers:  # timm's initialisation of its `reg_token`.
      registers = self.param("reg", nn.initializers.normal(stddev=1e-6),
                             (1, self.num_registers, self.hidden_size))
    block = dict(gelu=self.gelu, mlp=self.mlp, mlp_norm=self.mlp_norm,
                 attention_norm=self.attention_norm, qkv_bias=self.qkv_bias,
                 layer_scale=self.layer_scale, rope=self.rope)
    return Encoder(
        self.num_layers, self.mlp_dim, self.num_heads, self.dropout,
        self.attention_dropout, learned_posemb=self.posemb == "learn",
        remat=self.remat, dtype=self.dtype, attention_impl=self.attention_impl,
        residual_dtype=self.residual_dtype,
        stochastic_depth=self.stochastic_depth, lora=self._lora,
        dynamic_image_size=self.dynamic_image_size,
        posemb_interpolation=self.posemb_interpolation, final_norm=not self.fc_norm,
        pre_norm=self.pre_norm, norm_epsilon=self.layer_norm_eps,
        rope_ref_grid=self.rope_ref_grid, block=block,
        name="Transformer")(x, grid, registers, deterministic, return_attention)

  @nn.compact
  def __call__(self, images: jnp.ndarray, *, train: bool = False,
               return_aux: bool = False, return_attention: bool = False):
    self._check_fields()
    self._check_inputs(images)
    x, grid = self._embed(images)
    encoded, attention = self._encode(x, grid, not train, return_attention)

    x = self._pool(encoded)
    if self.fc_norm:
      x = LayerNorm(self.layer_norm_eps, self.dtype, name="fc_norm")(x)
    if self.representation_size is not None:
      x = nn.tanh(nn.Dense(self.representation_size, dtype=self.dtype, name="pre_logits")(x))
    pre_logits = x.astype(jnp.float32)

    logits = pre_logits
    if self.num_classes:
      logits = nn.Dense(
          self.num_classes, dtype=self.dtype, use_bias=self.head_bias,
          kernel_init=nn.initializers.zeros,
          bias_init=nn.initializers.constant(self.head_bias_init), name="head")(x)
      logits = logits.astype(jnp.float32)

    if not (return_aux or return_attention):
      return logits
    aux = {"pre_logits": pre_logits, "encoded": encoded.astype(jnp.float32)}
    if return_attention:
      aux["attention"] = attention
    return logits, aux


def abstract_params(model: VisionTransformer, image_size: int) -> Any:
  """The model's parameters at `image_size` as shapes and dtypes: nothing computed or
  allocated. Traced once a model and size (a module's fields are its identity): loading,
  fine-tuning and planning ask again for the same model (a sweep, a notebook, the tests)."""
  try:
    hash(model)
  except TypeError:  # A list among its fields (a config's override): traced every time.
    return _trace_params(model, image_size)
  return jax.tree.map(lambda x: x, _traced_params(model, image_size))  # The caller's own.


def _trace_params(model: VisionTransformer, image_size: int) -> Any:
  """The encoder's blocks are alike (Encoder: every field but the block's index is shared, and
  the index sets only a rate): a model of one block is traced and the others take its shapes,
  in the order a whole trace gives. ViT-H/14 at 224 px: 1.1 CPU-s traced whole, 0.1-0.2 so."""
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  one_block = model.clone(num_layers=min(model.num_layers, 1))
  params = jax.eval_shape(one_block.init, jax.random.key(0), images)["params"]
  if model.num_layers > 1:
    encoder = params["Transformer"]
    encoder.update({f"encoderblock_{i}": encoder["encoderblock_0"]
                    for i in range(1, model.num_layers)})
  # Each block its own dicts, the keys in eval_shape's (sorted) order.
  return jax.tree.map(lambda x: x, params)


_traced_params = functools.lru_cache(maxsize=32)(_trace_params)
