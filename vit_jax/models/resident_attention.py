"""Attention on TPU with each image's whole sequence in VMEM, read and written tokens-minor.

The projections before and after attention keep q, k, v and the output tokens-minor in HBM,
(batch, heads * head_dim, tokens): the layout XLA gives a matmul's (batch, tokens, features)
there, unless the images a chip fill the 128 lanes better than the tokens do (256 on v5e: it
lays them out batch-minor and copies them to this layout). The splash kernel takes (batch,
heads, tokens, head_dim) padded to whole blocks of 128 tokens (197 -> 256), so each block
wrote q, k, v twice, once as the projection left them and
once transposed and padded for the kernel, and the kernel's outputs were copied back. This
kernel reads the projection's arrays as they are: a grid step takes one image and a group of
heads, `(heads_in_group * head_dim, tokens)`, holds each head's (keys, queries) float32 scores
in VMEM, and writes its output in the same layout. No padding, no copies, no log-sum-exp: the
backward kernel recomputes the softmax from q and k (one more QK^T, as flash attention's
backward does) and takes each row's sum(dP * P) over the whole row it holds, so the forward
pass keeps nothing but its inputs.

Scores of a whole sequence bound its length: up to MAX_TOKENS it compiles on every TPU libtpu
compiles for (v4, v5e, v5p, v6e, TPU7x; tests/test_attention.py); longer sequences take the
splash kernel (attention._pallas). Its numerics are the "xla" path's: logits and softmax in
float32, the numerators in the inputs' dtype for the AV product, rows normalised after it.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# 384-px images of 16-px patches with the class token. At 785 tokens float32 heads of 64
# dimensions exhaust v4's VMEM (16 MiB) and at 1,025 v5e's and v5p's scoped VMEM.
MAX_TOKENS = 577
# A grid step's rows (heads * head_dim): up to v6e's 256-wide MXU, fewer steps per image.
GROUP_ROWS = 256


def attention(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool = False) -> jax.Array:
  """Multi-head attention of (batch, tokens, heads, head_dim) q, k, v; the queries' and the
  keys' token counts may differ (a MAP head's one query)."""
  batch, q_len, heads, head_dim = q.shape
  tokens_minor = lambda x: x.reshape(x.shape[:2] + (-1,)).transpose(0, 2, 1)  # noqa: E731
  out = _attend(tokens_minor(q), tokens_minor(k), tokens_minor(v), head_dim, interpret)
  return out.transpose(0, 2, 1).reshape(batch, q_len, heads, v.shape[-1])


def heads_in_group(heads: int, head_dim: int) -> int:
  """The most heads a grid step takes: they divide `heads` and span at most GROUP_ROWS rows,
  a multiple of 8 (a TPU tile's sublanes) unless they are all the heads."""
  fits = [g for g in range(1, heads + 1) if heads % g == 0
          and (g * head_dim % 8 == 0 or g == heads)]
  return max([g for g in fits if g * head_dim <= GROUP_ROWS] or fits[:1])


def _dot(a: jax.Array, b: jax.Array, contracting: tuple) -> jax.Array:
  return jax.lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=jnp.float32)


def _numerators(q: jax.Array, k: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """One head's softmax numerators exp(logit - column max), transposed (keys, queries), and
  their sums (1, queries), in float32, of q and k (head_dim, tokens)."""
  logits = _dot(k, q, ((0,), (0,))) * scale
  numerators = jnp.exp(logits - logits.max(axis=0, keepdims=True))
  return numerators, numerators.sum(axis=0, keepdims=True)


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, *, head_dim: int):
  scale = 1 / math.sqrt(head_dim)
  for h in range(q_ref.shape[0] // head_dim):
    rows = pl.ds(h * head_dim, head_dim)
    numerators, sums = _numerators(q_ref[rows, :], k_ref[rows, :], scale)
    v = v_ref[rows, :]
    out = _dot(v, numerators.astype(v.dtype), ((1,), (0,))) / sums
    out_ref[rows, :] = out.astype(out_ref.dtype)


def _backward_kernel(q_ref, k_ref, v_ref, d_out_ref, dq_ref, dk_ref, dv_ref, *, head_dim: int):
  scale = 1 / math.sqrt(head_dim)
  for h in range(q_ref.shape[0] // head_dim):
    rows = pl.ds(h * head_dim, head_dim)
    q, k, v, d_out = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], d_out_ref[rows, :]
    numerators, sums = _numerators(q, k, scale)
    probs = numerators / sums
    dv_ref[rows, :] = _dot(d_out, probs.astype(d_out.dtype), ((1,), (1,))).astype(dv_ref.dtype)
    d_probs = _dot(v, d_out, ((0,), (0,)))
    # The softmax's backward; each query's sum(dP * P) over the whole row of keys held here.
    d_logits = probs * (d_probs - jnp.sum(probs * d_probs, axis=0, keepdims=True)) * scale
    d_logits = d_logits.astype(q.dtype)
    dq_ref[rows, :] = _dot(k, d_logits, ((1,), (0,))).astype(dq_ref.dtype)
    dk_ref[rows, :] = _dot(q, d_logits, ((1,), (1,))).astype(dk_ref.dtype)


def _call(kernel, inputs: tuple, outputs: tuple, head_dim: int, interpret: bool) -> list:
  """`kernel` on a grid of (image, group of heads), each array's block its rows of the group
  and all its tokens."""
  batch, features, _ = inputs[0].shape
  rows = heads_in_group(features // head_dim, head_dim) * head_dim
  spec = lambda x: pl.BlockSpec((None, rows, x.shape[2]), lambda i, g: (i, g, 0))  # noqa: E731
  return pl.pallas_call(
      functools.partial(kernel, head_dim=head_dim),
      grid=(batch, features // rows),
      in_specs=[spec(x) for x in inputs], out_specs=[spec(x) for x in outputs],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      name=kernel.__name__.strip("_"), interpret=interpret)(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend(q, k, v, head_dim, interpret):
  """Attention of tokens-minor (batch, heads * head_dim, tokens) q, k, v."""
  out = jax.ShapeDtypeStruct(v.shape[:2] + q.shape[2:], v.dtype)
  return _call(_forward_kernel, (q, k, v), (out,), head_dim, interpret)[0]


def _attend_forward(q, k, v, head_dim, interpret):
  return _attend(q, k, v, head_dim, interpret), (q, k, v)


def _attend_backward(head_dim, interpret, inputs, d_out):
  return tuple(_call(_backward_kernel, (*inputs, d_out), inputs, head_dim, interpret))


_attend.defvjp(_attend_forward, _attend_backward)
