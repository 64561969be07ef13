"""JAX's fused splash attention backward kernel with the queries' gradient written tokens-minor.

The kernel module's backward (`splash_attention_kernel._splash_attention_bwd_dkv`, fused)
writes dq head-dim-minor, (heads, queries, head_dim), whatever layout q came in; the
projection's backward reads it tokens-minor, so XLA copied it to that layout first: for
ViT-B/16 at 256 images a chip, 201 MB read and written again a block, 2.4 GB a step on v5e.
Here the same kernel body (`_flash_attention_dkv_kernel`, JAX's) on the same grid writes each
block of dq transposed, (heads, head_dim, queries): the layout q itself comes in
(QKVLayout.SEQ_MINOR). It also divides dq by the queries' scale there, in float32 rounded once
(attention._scaled's arithmetic), which XLA otherwise did on a float32 copy of dq for heads
whose 1/sqrt(head_dim) is no power of two (ViT-H/14's 80). Only dq's out spec and its write
differ.
"""
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

from vit_jax.models import splash_forward


class _Transposed:
  """The body's dq ref as it writes it, (bq, head_dim), stored as the block (head_dim, bq),
  divided by `scale` in float32 and rounded once."""

  def __init__(self, ref: Any, scale: float):
    self.ref, self.shape, self.dtype, self.scale = ref, ref.shape[::-1], ref.dtype, scale

  def __setitem__(self, index: Any, value: jax.Array) -> None:
    self.ref[...] = (value.astype(jnp.float32) / self.scale).T.astype(self.dtype)


def backward(mask_info: Any, q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array,
             d_out: jax.Array, di: jax.Array, *, block_sizes: Any, mask_value: float,
             mask_function: Optional[Any], attn_logits_soft_cap: Optional[float] = None,
             dq_scale: float = 1.0,
             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One example's dq / dq_scale (heads, head_dim, queries), dk, dv (heads, keys, head_dim)
  of q, k, v, d_out (heads, tokens, head_dim), the log-sum-exp and each row's sum(dO * O)
  (heads, queries); `mask_info` a kernel's `dkv_mask_info` (`_collapsed`). Multi-head."""
  if mask_info.q_sequence is not None:
    raise ValueError("a mask of a mask function: the kernel module's backward takes it.")
  (heads, q_len, head_dim), kv_len, head_dim_v = q.shape, k.shape[1], v.shape[-1]
  bq, bkv = block_sizes.block_q_dkv, block_sizes.block_kv_dkv
  if block_sizes.block_kv_dkv_compute != bkv:  # Its scratch for dq: the module's backward.
    raise ValueError("block_kv_dkv_compute != block_kv_dkv: the kernel module's backward.")
  layouts = block_sizes.q_layout, block_sizes.k_layout, block_sizes.v_layout
  grid_width = (q_len // bq if mask_info.data_next is None else mask_info.data_next.shape[-2])

  def body(*refs):
    *rest, dq, dk, dv = refs
    splash._flash_attention_dkv_kernel(
        *rest[:-2], None, *rest[-2:], _Transposed(dq, dq_scale), dk, dv, num_q_heads=heads,
        num_kv_heads=heads, mask_value=mask_value, grid_width=grid_width, bq=bq,
        bkv_compute=bkv, is_mqa=False, attn_logits_soft_cap=attn_logits_soft_cap,
        q_layout=layouts[0], k_layout=layouts[1], v_layout=layouts[2], bkv=bkv,
        mask_function=mask_function)

  rows = lambda x: jnp.broadcast_to(x[:, None], (heads, splash.NUM_SUBLANES, q_len))  # noqa: E731
  name = splash.get_kernel_name(is_mqa=False, save_residuals=False, is_segmented=False,
                                phase="dkv")
  with jax.named_scope(name):
    *_, dq, dk, dv = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(kv_len // bkv, heads, grid_width),
            in_specs=_in_specs(head_dim, head_dim_v, block_sizes,
                               mask_info.partial_mask_blocks is not None),
            out_specs=_out_specs(head_dim, head_dim_v, bq, bkv)),
        out_shape=[jax.ShapeDtypeStruct((bkv, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((bkv, head_dim_v), jnp.float32),
                   jax.ShapeDtypeStruct((kv_len // bkv, heads, head_dim, q_len), q.dtype),
                   jax.ShapeDtypeStruct.like(k), jax.ShapeDtypeStruct.like(v)],
        # All arbitrary, as the kernel module's: its blocks reduce over heads and queries.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        name=name, interpret=interpret,
    )(*splash_forward.kernel_inputs(mask_info, block_sizes, q, k, v), None, None, None,
      rows(lse), d_out, rows(di), mask_info.partial_mask_blocks, None)
  return dq.sum(axis=0), dk, dv


def _in_specs(head_dim: int, head_dim_v: int, block_sizes: Any, partial_blocks: bool) -> list:
  """The kernel module's specs of q, k, v, the log-sum-exp, d_out, sum(dO * O) and the mask's
  partial blocks (segment ids, sinks and the query sequence absent): the queries' blocks skip
  those the mask leaves empty."""
  bq, bkv = block_sizes.block_q_dkv, block_sizes.block_kv_dkv

  def next_q(kv, h, i, data_next, block_mask, mask_next=None):
    return splash._next_nonzero(h, i, kv, data_next, block_mask, mask_next, next_i=True)

  q_layout, k_layout, v_layout = (block_sizes.q_layout, block_sizes.k_layout,
                                  block_sizes.v_layout)
  q_spec = pl.BlockSpec(splash.from_head_minor((None, bq, head_dim), q_layout),
                        lambda kv, h, i, *refs: splash.from_head_minor(
                            (h, next_q(kv, h, i, *refs)[0], 0), q_layout))
  k_spec, v_spec = (pl.BlockSpec(splash.from_head_minor((None, bkv, d), layout),
                                 lambda kv, h, *_, layout=layout: splash.from_head_minor(
                                     (h, kv, 0), layout))
                    for d, layout in ((head_dim, k_layout), (head_dim_v, v_layout)))
  rows_spec = pl.BlockSpec((None, splash.NUM_SUBLANES, bq),
                           lambda kv, h, i, *refs: (h, 0, next_q(kv, h, i, *refs)[0]))
  d_out_spec = pl.BlockSpec((None, bq, head_dim_v),
                            lambda kv, h, i, *refs: (h, next_q(kv, h, i, *refs)[0], 0))
  mask_spec = pl.BlockSpec((None, bkv, bq),
                           lambda kv, h, i, *refs: (next_q(kv, h, i, *refs)[1], 0, 0))
  return [q_spec, k_spec, v_spec, None, None, None, rows_spec, d_out_spec, rows_spec,
          mask_spec if partial_blocks else None, None]


def _out_specs(head_dim: int, head_dim_v: int, bq: int, bkv: int) -> list:
  """dk and dv's accumulators (one block each, kept), dq tokens-minor, dk and dv."""
  kept = lambda *_: (0, 0)  # noqa: E731
  dkv = lambda kv, h, *_: (h, kv, 0)  # noqa: E731
  return [pl.BlockSpec((bkv, head_dim), kept), pl.BlockSpec((bkv, head_dim_v), kept),
          pl.BlockSpec((None, None, head_dim, bq), lambda kv, h, i, *_: (kv, h, 0, i)),
          pl.BlockSpec((None, bkv, head_dim), dkv), pl.BlockSpec((None, bkv, head_dim_v), dkv)]
