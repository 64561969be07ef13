"""The attention paths of a ViT block, and which one "auto" takes on a device.

- "xla": softmax(QK^T / sqrt(d)) V as XLA ops, the logits and the softmax in float32. In
  float32 it is jax.nn.dot_product_attention's XLA path itself. With 16-bit inputs (our VJP,
  `xla_attention`) the softmax's numerators are cast to
  that dtype for the AV product and the rows normalised after it (flash attention's order),
  and the backward pass keeps those 16-bit numerators: one (batch, heads, tokens, tokens)
  bf16 tensor a block, where autodiff of the float32 softmax keeps two float32 ones and a
  bf16 one (3x the HBM and most of the traffic).
- "cudnn": cuDNN's fused flash attention (NVIDIA GPU, 16-bit inputs).
- "pallas": Pallas kernels for TPU, no (batch, heads, tokens, tokens) tensor in HBM at all:
  up to resident_attention.MAX_TOKENS tokens our own, reading and writing the projections'
  arrays as they lie, each image's whole sequence in VMEM (resident_attention.py); longer
  sequences JAX's splash kernel, tokens padded to whole blocks of 128, the pad masked out.
  Both backward passes recompute the scores.
- "splash": the splash kernel whatever the length (the kernel "pallas" took before the resident
  one: to compare the two on a chip, or to run without the resident one).

`resolve` maps "auto" (and None, JAX's own default: XLA) to a path for a device.
"""
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = (None, "auto", "xla", "cudnn", "pallas", "splash")
# The paths of Pallas kernels: run per shard of the batch under the run's mesh, their FLOPs
# uncounted by XLA.
PALLAS_IMPLS = ("pallas", "splash")
PALLAS_BLOCK = 128  # The TPU kernel's tokens come in blocks of 128 (its lane width).


def resolve(impl: Optional[str], dtype: Any, head_dim: int, device: Any = None) -> str:
  """The path `impl` names on `device`: "auto" takes cuDNN on an NVIDIA GPU of compute
  capability >= 8.0 for 16-bit inputs and head sizes cuDNN takes, the Pallas kernel on a TPU
  whose compiler takes it for this head size and dtype, else XLA.

  Without `device` (a model applied as it is), JAX's first device; there, on several TPU
  chips with no mesh set (`jax.set_mesh`, as a run sets its own), XLA: the kernel is run per
  shard of the batch, and only the mesh says what the shards are."""
  if impl not in IMPLS:
    raise ValueError(f"attention_impl={impl!r}, expected one of {IMPLS}.")
  if impl in (None, "xla"):
    return "xla"
  if impl != "auto":
    return impl
  if device is None:
    device = jax.devices()[0]
    if (device.platform == "tpu" and jax.device_count() > 1
        and jax.sharding.get_abstract_mesh().empty):
      return "xla"
  if device.platform == "tpu":
    return "pallas" if pallas_compiles(device, head_dim, jnp.dtype(dtype).name) else "xla"
  try:  # CUDA devices report e.g. "9.0"; others have none or a non-numeric one.
    major = int(str(getattr(device, "compute_capability", "")).split(".")[0])
  except ValueError:
    return "xla"
  fits = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
  return "cudnn" if device.platform == "gpu" and major >= 8 and fits else "xla"


@functools.lru_cache(maxsize=None)
def pallas_compiles(device: Any, head_dim: int, dtype: str) -> bool:
  """Whether both TPU kernels, forward and backward, compile for `device` (a real or a
  compile-only TPU device): one head of the model's head size and dtype, one block of tokens
  for the splash kernel and the most the resident kernel takes."""
  from vit_jax.models import resident_attention
  for kernel, tokens in ((_splash, PALLAS_BLOCK),
                         (resident_attention.attention, resident_attention.MAX_TOKENS)):
    shape = jax.ShapeDtypeStruct((1, tokens, 1, head_dim), jnp.dtype(dtype),
                                 sharding=jax.sharding.SingleDeviceSharding(device))
    loss = lambda q, k, v, kernel=kernel: kernel(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    try:
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    except Exception:  # Mosaic's refusals are of many types; any of them means "not here".
      return False
  return True


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str) -> jax.Array:
  """Multi-head attention of (batch, tokens, heads, head_dim) inputs by the path `impl`
  (resolve's answer)."""
  if impl == "xla":
    # Float32 keeps JAX's own autodiff (the same values, the same gradients to the bit as ever):
    # the saving is in 16 bits.
    if q.dtype == jnp.float32:
      return jax.nn.dot_product_attention(q, k, v)
    return xla_attention(q, k, v)
  if impl in PALLAS_IMPLS:
    return pallas_attention(q, k, v, _pallas if impl == "pallas" else _splash)
  if impl == "cudnn":
    return _cudnn_attention(q, k, v)
  raise ValueError(f"attention path {impl!r}: resolve() first.")


def _precision(dtype: Any) -> Any:
  # jax.nn.dot_product_attention's choice: bf16 inputs, float32 products, on every backend.
  return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if dtype == jnp.bfloat16 else None


def _xla_forward(q, k, v):
  """The output, and the softmax's numerators exp(logit - row max) in the inputs' dtype and
  its float32 denominators (batch, heads, queries, 1)."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_precision(q.dtype),
                      preferred_element_type=jnp.promote_types(q.dtype, jnp.float32))
  logits *= jnp.array(1.0 / np.sqrt(q.shape[-1]), logits.dtype)
  # jax.nn.softmax's arithmetic, in float32.
  logits = logits.astype(jnp.float32)
  numerators = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  sums = jnp.sum(numerators, axis=-1, keepdims=True)
  # Normalised after the AV product (flash attention's order), so that only the 16-bit
  # numerators are written, not float32 probabilities as well.
  numerators = numerators.astype(v.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", numerators, v)
  return (out / jnp.swapaxes(sums, 1, 2)).astype(v.dtype), (numerators, sums)


@jax.custom_vjp
def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """The "xla" path: see the module's docstring."""
  return _xla_forward(q, k, v)[0]


def _xla_attention_fwd(q, k, v):
  out, softmax = _xla_forward(q, k, v)
  return out, (q, k, v, out, softmax)


def _xla_attention_bwd(residuals, d_out):
  q, k, v, out, (numerators, sums) = residuals
  f32 = jnp.promote_types(q.dtype, jnp.float32)
  d_out = d_out.astype(v.dtype)
  probs = numerators.astype(f32) / sums
  # The softmax's backward from its output, each row's sum(dP * P) taken as sum(dO * O) (the
  # same sum, as flash attention takes it): the pass over the scores is then one elementwise
  # epilogue of the dP product, with no reduction over them.
  rows = jnp.einsum("bqhd,bqhd->bhq", d_out, out, preferred_element_type=f32)[..., None]
  d_probs = jnp.einsum("bqhd,bkhd->bhqk", d_out, v, precision=_precision(v.dtype),
                       preferred_element_type=f32)
  scale = jnp.array(1.0 / np.sqrt(q.shape[-1]), f32)
  d_logits = (probs * (d_probs - rows) * scale).astype(q.dtype)
  dq = jnp.einsum("bhqk,bkhd->bqhd", d_logits, k)
  dk = jnp.einsum("bhqk,bqhd->bkhd", d_logits, q)
  dv = jnp.einsum("bhqk,bqhd->bkhd", probs.astype(q.dtype), d_out)
  return dq, dk, dv


xla_attention.defvjp(_xla_attention_fwd, _xla_attention_bwd)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     kernel: Callable[..., jax.Array]) -> jax.Array:
  """A Pallas path: `kernel` (`_pallas` or `_splash`) on (batch, tokens, heads, head_dim)
  inputs. Under a mesh (`jax.set_mesh`) it runs on each device's part of the batch (a Mosaic
  kernel is not partitioned by XLA); a batch the mesh cannot split (model.init's one example)
  takes the XLA path."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel(q, k, v)
  if q.shape[0] % mesh.size:
    return dot_product_attention(q, k, v, "xla")
  spec = jax.sharding.PartitionSpec(mesh.axis_names)  # The batch over every axis.
  return jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                       check_vma=False)(q, k, v)


def _pallas(q, k, v, interpret: bool = False):
  """The resident kernel where the sequences fit it, else the splash kernel."""
  from vit_jax.models import resident_attention
  if max(q.shape[1], k.shape[1]) <= resident_attention.MAX_TOKENS:
    return resident_attention.attention(q, k, v, interpret)
  return _splash(q, k, v, interpret)


def _splash(q, k, v, interpret: bool = False):
  """JAX's splash attention kernel on (batch, tokens, heads, head_dim) inputs, over tokens
  padded to whole blocks (`_splash_kernel`).

  The backward pass is of our own making: it keeps the output as the rest of the block has it,
  unpadded and tokens-major, and takes what the backward kernel needs of it (each row's
  sum(dO * O)) from that. The kernel's own VJP keeps it padded (197 -> 256 tokens) and
  lane-padded (a TPU tile is 128 wide, a head 64): 192 MiB a block for B/16 at 256 images. It
  is built of the kernel module's forward and fused backward kernels, with the log-sum-exp
  written narrow (splash_forward.py) and dq tokens-minor and scaled (splash_backward.py),
  composed as its own VJP composes them; tests/test_attention.py checks the values and
  gradients.
  """
  # Pallas' TPU modules: imported when used.
  from vit_jax.models import splash_backward, splash_forward
  (_, q_len, heads, _), kv_len = q.shape, k.shape[1]
  q_padded, kv_padded = (-(-n // PALLAS_BLOCK) * PALLAS_BLOCK for n in (q_len, kv_len))
  kernel = _splash_kernel(q_len, kv_len, q_padded, kv_padded, heads, interpret)
  kw = {k: v for k, v in kernel.kwargs.items() if k != "save_residuals"}

  def forward(fwd_info, dkv_info, q, k, v):
    q, k, v = _padded(_scaled(q), q_padded), _padded(k, kv_padded), _padded(v, kv_padded)
    one = functools.partial(
        splash_forward.forward, fwd_info, block_sizes=kw["block_sizes"],
        mask_value=kw["mask_value"], mask_function=kw["mask_function"],
        attn_logits_soft_cap=kw["attn_logits_soft_cap"], interpret=kw["interpret"])
    out, lse = jax.vmap(one)(q, k, v)
    # A barrier makes the unpadded output a buffer of its own (XLA would otherwise read the
    # kernel's, keeping it). One in the backward pass cost more (benchmarks/README.md).
    out = jax.lax.optimization_barrier(_unpadded(out, q_len))
    return out, (dkv_info, q, k, v, out, lse[:, :, 0])

  def backward(residuals, d_out):
    dkv_info, q, k, v, out, lse = residuals
    # The kernel module's backward takes each row's sum(dO * O) from the padded output; here
    # from the unpadded one, the pad's rows 0 as there: the output is never padded again.
    di = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    di = jnp.pad(di, ((0, 0), (0, 0), (0, q_padded - q_len)))
    one = functools.partial(
        splash_backward.backward, dkv_info, block_sizes=kw["block_sizes"],
        mask_value=kw["mask_value"], mask_function=kw["mask_function"],
        attn_logits_soft_cap=kw["attn_logits_soft_cap"], interpret=kw["interpret"],
        dq_scale=float(np.sqrt(q.shape[-1])))
    dq, dk, dv = jax.vmap(one)(q, k, v, lse, _padded(d_out, q_padded), di)
    dq = dq.transpose(0, 3, 1, 2)[:, :q_len]  # Tokens-minor, (batch, heads, head_dim, tokens).
    return None, None, dq, _unpadded(dk, kv_len), _unpadded(dv, kv_len)

  attend = jax.custom_vjp(lambda *args: forward(*args)[0])
  attend.defvjp(forward, backward)
  return attend(_collapsed(kernel.fwd_mask_info), _collapsed(kernel.dkv_mask_info), q, k, v)


def _splash_kernel(q_len: int, kv_len: int, q_padded: int, kv_padded: int, heads: int,
                   interpret: bool) -> Any:
  """The kernel for padded tokens: every real query attends to the real keys only; the pad's
  queries, dropped after, to every key (a row with no key would be 0/0)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  allowed = np.zeros((q_padded, kv_padded), bool)
  allowed[:, :kv_len] = True
  allowed[q_len:] = True
  # Tokens minor in memory: 64-dimensional heads minor would be padded to 128 lanes.
  minor = splash.QKVLayout.SEQ_MINOR
  # The fused backward kernel writes one partial dq per block of keys, in the inputs' dtype,
  # which XLA then sums: all keys in one block (up to 512) make it dq itself, accumulated in
  # float32 and rounded once.
  kv_dkv = kv_padded if kv_padded <= 4 * PALLAS_BLOCK else PALLAS_BLOCK
  sizes = splash.BlockSizes(
      block_q=PALLAS_BLOCK, block_kv=PALLAS_BLOCK, block_q_dkv=PALLAS_BLOCK,
      block_kv_dkv=kv_dkv, use_fused_bwd_kernel=True,
      q_layout=minor, k_layout=minor, v_layout=minor)
  return splash.make_splash_mha(masks.MultiHeadMask([masks.NumpyMask(allowed)] * heads),
                                block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret)


def _collapsed(info):
  """A mask's blocks as the kernel's own entry point passes them on."""
  blocks = info.partial_mask_blocks
  return info if blocks is None else info._replace(
      partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _padded(x, n):  # (batch, tokens, heads, d) -> (batch, heads, n tokens, d).
  return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _unpadded(x, n):
  return x.transpose(0, 2, 1, 3)[:, :n]


def _scaled(x):
  """The kernel takes the scale in the queries, and the queries' gradient takes it too (in
  splash_backward.py's kernel, by the same arithmetic).
  1/sqrt(head_dim) a power of two (1/8 for 64 dimensions): multiplied in x's dtype, where it
  is exact; else applied in float32 and rounded once. (Through float32 for 64 dimensions too,
  XLA kept and transposed the queries' gradient in float32 in the backward pass.)"""
  scale = 1.0 / np.sqrt(x.shape[-1])
  if np.log2(scale) == np.round(np.log2(scale)):
    return x * jnp.asarray(scale, x.dtype)
  return (x.astype(jnp.float32) / np.sqrt(x.shape[-1])).astype(x.dtype)


def _pad_tokens(x: jax.Array) -> jax.Array:
  """Pads the token axis (1) of (batch, tokens, heads, head_dim) to an even length."""
  return jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))


def _cudnn_attention(q, k, v):
  q_len, kv_lengths = q.shape[1], None
  if q_len % 2 or k.shape[1] % 2:
    # JAX's cuDNN gradient rule mistakes its empty bias placeholder for a bias and then
    # rejects odd lengths (197 tokens): pad to even ones, mask the pad keys out.
    kv_lengths = jnp.full(k.shape[:1], k.shape[1], jnp.int32)
    q, k, v = _pad_tokens(q), _pad_tokens(k), _pad_tokens(v)
  out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths,
                                     implementation="cudnn")
  return out[:, :q_len]


def explicit_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                       dropout: Any = None) -> tuple[jax.Array, jax.Array]:
  """The attention and its float32 weights, (batch, heads, queries, keys), materialised for a
  caller that returns them or drops them out (`dropout`: weights -> weights)."""
  logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  dropped = weights if dropout is None else dropout(weights)
  return jnp.einsum("...hqk,...khd->...qhd", dropped.astype(v.dtype), v), weights
