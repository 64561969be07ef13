"""JAX's splash attention forward kernel with its log-sum-exp written narrow.

The kernel's own forward (`splash_attention_kernel._splash_attention_forward`) writes each
query's log-sum-exp as 128 lanes of copies, float32 (heads, queries, 128), and then slices
lane 0 out: for ViT-B/16 at 256 images a chip, 402 MB written and read again a block, 2.7% of
the step's HBM traffic on v5e. Here the same kernel body (`flash_attention_kernel`, JAX's) on
the same grid writes one float32 a query, (heads, 1, queries): the layout the backward
kernels read it in. Only the out spec of the log-sum-exp and its last write differ.
"""
from typing import Any, Optional

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash


class _Row:
  """The body's log-sum-exp ref as it writes it, (bq, 128) with the value in every lane,
  stored as the one row (1, bq) of the block of a (heads, 1, queries) array."""

  def __init__(self, ref: Any, bq: int):
    self.ref, self.shape, self.dtype = ref, (bq, splash.NUM_LANES), ref.dtype

  def __setitem__(self, index: Any, value: jax.Array) -> None:
    self.ref[...] = value.T[:1]


def forward(mask_info: Any, q: jax.Array, k: jax.Array, v: jax.Array, *,
            block_sizes: Any, mask_value: float, mask_function: Optional[Any],
            attn_logits_soft_cap: Optional[float] = None,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """One example's attention: q, k, v (heads, tokens, head_dim), multi-head, no segments or
  sinks, `mask_info` a kernel's `fwd_mask_info` (`_collapsed`). Returns the output (heads,
  queries, head_dim_v) and the log-sum-exp (heads, 1, queries), both as the kernel's."""
  if mask_info.q_sequence is not None:
    raise ValueError("a mask of a mask function: the kernel's own forward takes it.")
  heads, q_len, _ = q.shape
  bq, bkv, head_dim_v = block_sizes.block_q, block_sizes.block_kv, v.shape[-1]
  layouts = block_sizes.q_layout, block_sizes.k_layout, block_sizes.v_layout
  grid_width = (k.shape[1] // bkv if mask_info.data_next is None
                else mask_info.data_next.shape[-1])

  def body(*refs):
    splash.flash_attention_kernel(
        *refs[:-1], _Row(refs[-1], bq), mask_value=mask_value, grid_width=grid_width, bq=bq,
        bkv=bkv, bkv_compute=block_sizes.block_kv_compute, head_dim_v=head_dim_v,
        q_layout=layouts[0], k_layout=layouts[1], v_layout=layouts[2],
        attn_logits_soft_cap=attn_logits_soft_cap, mask_function=mask_function)

  f32 = jax.numpy.float32
  out_shapes = [jax.ShapeDtypeStruct((bq, splash.NUM_LANES), f32)] * 2 + [
      jax.ShapeDtypeStruct((bq, head_dim_v), f32),
      jax.ShapeDtypeStruct((heads, q_len, head_dim_v), q.dtype),
      jax.ShapeDtypeStruct((heads, 1, q_len), f32)]
  name = splash.get_kernel_name(is_mqa=False, save_residuals=True, is_segmented=False,
                                phase="fwd")
  with jax.named_scope(name):
    *_, out, lse = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(heads, q_len // bq, grid_width),
            in_specs=_in_specs(q.shape[-1], head_dim_v, block_sizes,
                               mask_info.partial_mask_blocks is not None),
            out_specs=_out_specs(head_dim_v, bq)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=out_shapes, name=name, interpret=interpret,
    )(*kernel_inputs(mask_info, block_sizes, q, k, v), None, None, None,
      mask_info.partial_mask_blocks, None)
  return out, lse


def kernel_inputs(mask_info: Any, block_sizes: Any, q: jax.Array, k: jax.Array,
                  v: jax.Array) -> tuple:
  """The splash kernels' first arguments, as the kernel module passes them: the mask's
  prefetched block tables, then q, k, v each in its layout (`block_sizes`)."""
  layouts = block_sizes.q_layout, block_sizes.k_layout, block_sizes.v_layout
  return (mask_info.data_next, mask_info.block_mask, mask_info.mask_next,
          *(x if layout == splash.QKVLayout.HEAD_DIM_MINOR else x.swapaxes(-1, -2)
            for x, layout in zip((q, k, v), layouts)))


def _in_specs(head_dim: int, head_dim_v: int, block_sizes: Any, partial_blocks: bool) -> list:
  """The kernel's own specs of q, k, v and the mask's partial blocks (segment ids, sinks and
  the query sequence absent): k and v's blocks skip those the mask leaves empty."""
  bq, bkv = block_sizes.block_q, block_sizes.block_kv

  def kv_map(layout):
    def index(h, i, j, data_next, block_mask, mask_next=None):
      next_j, *_ = splash._next_nonzero(h, i, j, data_next, block_mask, mask_next)
      return splash.from_head_minor((h, next_j, 0), layout)
    return index

  def mask_map(h, i, j, data_next, block_mask, mask_next=None):
    return splash._next_nonzero(h, i, j, data_next, block_mask, mask_next)[1], 0, 0

  q_layout = block_sizes.q_layout
  q_spec = pl.BlockSpec(splash.from_head_minor((None, bq, head_dim), q_layout),
                        lambda h, i, *_: splash.from_head_minor((h, i, 0), q_layout))
  k_spec, v_spec = (pl.BlockSpec(splash.from_head_minor((None, bkv, d), layout), kv_map(layout))
                    for d, layout in ((head_dim, block_sizes.k_layout),
                                      (head_dim_v, block_sizes.v_layout)))
  mask_spec = pl.BlockSpec((None, bq, bkv), mask_map) if partial_blocks else None
  return [q_spec, k_spec, v_spec, None, None, None, mask_spec, None]


def _out_specs(head_dim_v: int, bq: int) -> list:
  """The body's accumulators (one block each, kept), the output, and the log-sum-exp's row."""
  kept = lambda *_: (0, 0)  # noqa: E731
  return [pl.BlockSpec((bq, splash.NUM_LANES), kept)] * 2 + [
      pl.BlockSpec((bq, head_dim_v), kept),
      pl.BlockSpec((None, bq, head_dim_v), lambda h, i, *_: (h, i, 0)),
      pl.BlockSpec((None, 1, bq), lambda h, i, *_: (h, 0, i))]
