"""models/attention.py's paths and models/layer_norm.py, against independent references:

- "xla" in float32 is jax.nn.dot_product_attention's XLA path exactly, forward and gradients
  within float32 rounding; in bfloat16 it is as close to the float32 values as JAX's own.
- "pallas" (run here in Pallas' interpreter) equals "xla" forward and backward: the resident
  kernel for every head grouping the models have and one query (the MAP head), the splash
  kernel at 197 tokens (padded to 256 and masked) and for one query, and in a whole ViT under
  a mesh of 8 devices too. Each takes the sequences it should, and the resident kernel
  compiles for every TPU chip at the most tokens it takes.
- "cudnn"'s padding of odd lengths changes no value or gradient.
- "auto": cuDNN on a capable GPU, the Pallas kernel on a TPU chip it compiles for (v5e, through
  libtpu), XLA where it does not (v3) and on CPU.
- LayerNorm is flax's in float32 (values and gradients, to the bit); in bfloat16 its values are
  about as close to float64 as flax's own and its gradients within bf16 rounding of flax's.
"""
import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import needs_libtpu
from vit_jax import models
from vit_jax.models import attention, resident_attention
from vit_jax.models.layer_norm import LayerNorm

def qkv(shape=(2, 197, 3, 64), kv_tokens=None, seed=0):
  rng = np.random.default_rng(seed)
  kv_shape = shape if kv_tokens is None else (shape[0], kv_tokens) + shape[2:]
  return (rng.normal(size=shape).astype(np.float32),
          rng.normal(size=kv_shape).astype(np.float32),
          rng.normal(size=kv_shape).astype(np.float32))


def value_and_grads(fn, q, k, v, dtype):
  """fn's output and the gradients of a random projection of it, as float64 arrays."""
  w = np.random.default_rng(9).normal(size=q.shape[:-1] + v.shape[-1:]).astype(np.float32)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):
    out = jax.jit(fn)(*args)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, *grads)]


def max_errors(got, want):
  return [float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want)]


def test_xla_path_in_float32_is_jax_own():
  """The released checkpoints' logits stay those of the official code to the bit."""
  q, k, v = qkv()
  xla = functools.partial(attention.dot_product_attention, impl="xla")
  ours = value_and_grads(xla, q, k, v, jnp.float32)
  jax_own = value_and_grads(jax.nn.dot_product_attention, q, k, v, jnp.float32)
  for a, b in zip(ours, jax_own):
    np.testing.assert_array_equal(a, b)


def test_xla_path_in_bfloat16_is_as_close_to_float32_as_jax_own():
  q, k, v = qkv()
  reference = value_and_grads(jax.nn.dot_product_attention, q, k, v, jnp.float32)
  ours = max_errors(value_and_grads(attention.xla_attention, q, k, v, jnp.bfloat16), reference)
  jax_own = max_errors(
      value_and_grads(jax.nn.dot_product_attention, q, k, v, jnp.bfloat16), reference)
  assert max(ours) < 2e-2
  for a, b in zip(ours, jax_own):  # Output, dq, dk, dv: no worse than JAX's autodiff path.
    assert a < 1.5 * b


INTERPRETED = functools.partial(attention._splash, interpret=True)


@pytest.mark.parametrize("tokens,kv_tokens", [(197, None), (1, 197)], ids=["197", "MAP head"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_pallas_kernel_equals_the_xla_path(tokens, kv_tokens, dtype, tol):
  q, k, v = qkv((2, tokens, 2, 64), kv_tokens)
  want = value_and_grads(attention.xla_attention, q, k, v, dtype)
  assert max(max_errors(value_and_grads(INTERPRETED, q, k, v, dtype), want)) < tol


RESIDENT = functools.partial(resident_attention.attention, interpret=True)


@pytest.mark.parametrize("shape,kv_tokens", [
    ((2, 197, 12, 64), None), ((2, 1, 12, 64), 197), ((2, 257, 16, 80), None),
    ((2, 50, 3, 64), None)], ids=["B/16: 4 heads a step", "MAP head", "H/14: 2 heads a step",
                                  "Ti/16: 3 heads, all"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_resident_kernel_equals_the_xla_path(shape, kv_tokens, dtype):
  """Values and gradients. In float32 equal within float32 rounding; in bfloat16 no further
  from the float32 values than the XLA path's own bfloat16 arithmetic."""
  q, k, v = qkv(shape, kv_tokens)
  got = value_and_grads(RESIDENT, q, k, v, dtype)
  if dtype == jnp.float32:
    assert max(max_errors(got, value_and_grads(attention.xla_attention, q, k, v, dtype))) < 1e-5
    return
  reference = value_and_grads(attention.xla_attention, q, k, v, jnp.float32)
  xla = max_errors(value_and_grads(attention.xla_attention, q, k, v, dtype), reference)
  for ours, theirs in zip(max_errors(got, reference), xla):  # Output, dq, dk, dv.
    assert ours < 1.5 * theirs


@pytest.mark.parametrize("heads,head_dim,group", [
    (12, 64, 4), (16, 64, 4), (16, 80, 2), (3, 64, 3), (12, 72, 3), (5, 20, 5), (7, 100, 7)])
def test_a_grid_step_takes_whole_tiles_of_heads(heads, head_dim, group):
  """At most 256 rows a step, a multiple of 8 (a tile's sublanes) unless all heads."""
  assert resident_attention.heads_in_group(heads, head_dim) == group


@pytest.mark.parametrize("q_len,kv_len,kernel", [
    (197, 197, "forward_kernel"), (1, 577, "forward_kernel"), (577, 577, "forward_kernel"),
    (578, 578, "splash"), (1, 578, "splash"), (1025, 1025, "splash")])
def test_the_pallas_path_takes_the_resident_kernel_up_to_its_limit(q_len, kv_len, kernel):
  q = jax.ShapeDtypeStruct((1, q_len, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, kv_len, 2, 64), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(functools.partial(attention._pallas, interpret=True))(q, kv, kv))
  assert kernel in jaxpr and ("splash" in jaxpr) == (kernel == "splash")


@pytest.mark.parametrize("impl,kernel", [("pallas", "forward_kernel"), ("splash", "splash")])
def test_each_pallas_path_takes_its_kernel_at_197_tokens(monkeypatch, impl, kernel):
  for name in ("_pallas", "_splash"):
    monkeypatch.setattr(attention, name,
                        functools.partial(getattr(attention, name), interpret=True))
  x = jax.ShapeDtypeStruct((2, 197, 2, 64), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(functools.partial(attention.dot_product_attention, impl=impl))(
      x, x, x))
  assert kernel in jaxpr and ("splash" in jaxpr) == (impl == "splash")


@needs_libtpu
@pytest.mark.parametrize("chip", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_the_resident_kernel_compiles_at_its_limit_on_every_chip(chip):
  """Forward and backward at MAX_TOKENS, heads of 64 and 80 dimensions (grouped as the models
  group them), bfloat16 and float32: the scores of a whole sequence fit each chip's VMEM."""
  from jax.experimental import topologies
  device = topologies.get_topology_desc(platform="tpu", topology_name=chip).devices[0]
  for heads, head_dim in ((12, 64), (16, 80)):
    for dtype in (jnp.bfloat16, jnp.float32):
      x = jax.ShapeDtypeStruct((2, resident_attention.MAX_TOKENS, heads, head_dim), dtype,
                               sharding=jax.sharding.SingleDeviceSharding(device))
      loss = lambda q, k, v: resident_attention.attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_kernels_query_scale_is_rounded_once_and_stays_16_bit_where_exact(head_dim):
  """1/sqrt(64) = 1/8: multiplied in bf16, exactly the float32 product rounded once, with no
  float32 array (which XLA kept for the queries' gradient); 1/sqrt(80) through float32."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 197, 3, head_dim)), jnp.bfloat16)
  want = (x.astype(jnp.float32) / np.sqrt(head_dim)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(attention._scaled(x), np.float32),
                                np.asarray(want, np.float32))
  float32_inside = "f32[" in str(jax.make_jaxpr(attention._scaled)(x))
  assert float32_inside == (head_dim == 80)


@pytest.mark.parametrize("tokens,kv_tokens", [(256, 256), (128, 256)], ids=["197", "MAP head"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_narrow_log_sum_exp_forward_is_the_kernels_own_to_the_bit(tokens, kv_tokens, dtype):
  """splash_forward.py writes one float32 a query where JAX's forward writes 128 copies: the
  same output and log-sum-exp, bit for bit, on padded ViT shapes (197 real keys of 256)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from vit_jax.models import splash_forward
  kernel = attention._splash_kernel(tokens, 197, tokens, kv_tokens, 2, True)
  info, kw = attention._collapsed(kernel.fwd_mask_info), kernel.kwargs
  q, k, v = (jnp.asarray(x[0].transpose(1, 0, 2), dtype)
             for x in qkv((1, kv_tokens, 2, 64), seed=3))
  q = q[:, :tokens]
  out, (lse,) = splash._splash_attention_forward(
      info, q, k, v, None, None, **{**kw, "save_residuals": True})
  narrow_out, narrow_lse = splash_forward.forward(
      info, q, k, v, block_sizes=kw["block_sizes"], mask_value=kw["mask_value"],
      mask_function=kw["mask_function"], interpret=True)
  assert narrow_lse.shape == (2, 1, tokens) and narrow_lse.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(narrow_out), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(narrow_lse[:, 0]), np.asarray(lse))


@pytest.mark.parametrize("tokens,kv_tokens,head_dim", [
    (256, 256, 64), (128, 256, 64), (256, 640, 64), (256, 256, 80)],
    ids=["197", "MAP head", "3 blocks of keys", "ViT-H's 80-dim heads"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_tokens_minor_dq_backward_is_the_kernels_own_to_the_bit(tokens, kv_tokens,
                                                                      head_dim, dtype):
  """splash_backward.py writes dq (heads, head_dim, queries), divided by sqrt(head_dim), where
  JAX's fused backward writes (heads, queries, head_dim) and attention._scaled divides it
  after: the same dq transposed, and the same dk and dv, bit for bit in bf16; in float32
  within its rounding (XLA's CPU dot accumulates in the order of its output layout, and the
  transpose changed it)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from vit_jax.models import splash_backward
  kernel = attention._splash_kernel(tokens, kv_tokens - 59, tokens, kv_tokens, 2, True)
  info, kw = attention._collapsed(kernel.dkv_mask_info), kernel.kwargs
  sizes = kw["block_sizes"]
  q, k, v = (jnp.asarray(x[0].transpose(1, 0, 2), dtype)
             for x in qkv((1, kv_tokens, 2, head_dim), seed=4))
  q, rng = q[:, :tokens], np.random.default_rng(5)
  d_out = jnp.asarray(rng.normal(size=q.shape), dtype)
  logits = np.einsum("hqd,hkd->hqk", np.float64(q), np.float64(k))
  logits[:, :, kv_tokens - 59:] = -np.inf  # The pad's keys, masked out.
  lse = jnp.asarray(np.log(np.exp(logits).sum(-1)), jnp.float32)
  di = jnp.asarray(rng.normal(size=(2, tokens)), jnp.float32)
  want = splash._splash_attention_bwd_dkv(
      q, k, v, None, None, lse, d_out, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, is_mqa=False, mask_info=info,
      mask_value=kw["mask_value"], attn_logits_soft_cap=None, use_fused_bwd_kernel=True,
      q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
      mask_function=kw["mask_function"], interpret=True)
  got = splash_backward.backward(info, q, k, v, lse, d_out, di, block_sizes=sizes,
                                 mask_value=kw["mask_value"], mask_function=kw["mask_function"],
                                 dq_scale=float(np.sqrt(head_dim)), interpret=True)
  assert got[0].shape == (2, head_dim, tokens)
  for g, w in zip((got[0].swapaxes(1, 2), *got[1:]), (attention._scaled(want[0]), *want[1:])):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if dtype == jnp.bfloat16:
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max())


def test_the_fused_backward_kernel_takes_all_keys_in_one_block():
  """One block of keys (ViT's 197, padded to 256): the kernel's dq is whole, accumulated in
  float32, not per-block bf16 partials XLA sums after it; longer sequences keep 128."""
  sizes = lambda n: attention._splash_kernel(n, n, n, n, 2, True).kwargs["block_sizes"]  # noqa: E731
  assert sizes(256).block_kv_dkv == 256 and sizes(640).block_kv_dkv == 128


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_pallas_in_a_vit_under_a_mesh_equals_xla(monkeypatch, impl):
  """The kernel per device's part of the batch (shard_map over the run's mesh of 8): a ViT's
  loss and every gradient as the XLA path gives them (17 tokens: "pallas" takes the resident
  kernel, "splash" pads them to 128)."""
  for name in ("_pallas", "_splash"):
    monkeypatch.setattr(attention, name,
                        functools.partial(getattr(attention, name), interpret=True))
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  images = np.random.default_rng(1).normal(size=(8, 32, 32, 3)).astype(np.float32)
  labels = np.arange(8) % 5

  def loss_and_grads(impl):
    model = models.create_model("ViT-Ti_16", num_classes=5, patch_size=8, hidden_size=32,
                                mlp_dim=64, num_heads=2, num_layers=2, attention_impl=impl)
    params = jax.eval_shape(model.init, jax.random.key(0), images[:1])["params"]
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32), params)

    def loss(p, images):
      logits = model.apply({"params": p}, images)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    with jax.set_mesh(mesh):
      return jax.jit(jax.value_and_grad(loss))(params, jax.device_put(images, batch))

  def flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])

  want, got = flat(loss_and_grads("xla")), flat(loss_and_grads(impl))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.max(np.abs(want)))


def test_cudnn_padding_to_even_lengths_changes_nothing(monkeypatch):
  """The cuDNN path pads odd lengths (197 tokens, the MAP head's 1) and masks the pad: the
  same values and gradients. Run on CPU by handing the padded, masked call to XLA's."""
  seen = []
  dot_product_attention = jax.nn.dot_product_attention

  def as_xla(q, k, v, *, key_value_seq_lengths=None, implementation=None):
    assert implementation == "cudnn" and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0
    seen.append(key_value_seq_lengths)
    return dot_product_attention(q, k, v, key_value_seq_lengths=key_value_seq_lengths,
                                 implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
  for shape, kv_tokens in (((2, 197, 3, 64), None), ((2, 1, 3, 64), 197)):
    q, k, v = qkv(shape, kv_tokens)
    want = value_and_grads(dot_product_attention, q, k, v, jnp.float32)
    got = value_and_grads(functools.partial(attention.dot_product_attention, impl="cudnn"),
                          q, k, v, jnp.float32)
    assert max(max_errors(got, want)) < 1e-5
  assert seen and all(lengths is not None for lengths in seen)


def test_auto_picks_cudnn_only_on_a_capable_gpu():
  h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
  v100 = types.SimpleNamespace(platform="gpu", compute_capability="7.0")
  assert attention.resolve("auto", jnp.bfloat16, 64, h100) == "cudnn"
  assert attention.resolve("auto", jnp.float16, 128, h100) == "cudnn"
  assert attention.resolve("auto", jnp.float32, 64, h100) == "xla"
  assert attention.resolve("auto", jnp.bfloat16, 160, h100) == "xla"
  assert attention.resolve("auto", jnp.bfloat16, 64, v100) == "xla"
  assert attention.resolve("auto", jnp.bfloat16, 64) == "xla"  # This CPU.
  assert attention.resolve(None, jnp.bfloat16, 64, h100) == "xla"  # JAX's default.
  assert attention.resolve("pallas", jnp.bfloat16, 64) == "pallas"  # Asked for: taken.
  assert attention.resolve("splash", jnp.bfloat16, 64) == "splash"


@needs_libtpu
def test_auto_picks_pallas_where_the_kernel_compiles_for_the_chip():
  from jax.experimental import topologies
  chip = lambda name: topologies.get_topology_desc(  # noqa: E731
      platform="tpu", topology_name=name).devices[0]
  assert attention.resolve("auto", jnp.bfloat16, 64, chip("v5e:2x2")) == "pallas"
  assert attention.resolve("auto", jnp.bfloat16, 64, chip("v3:2x2")) == "xla"  # No Mosaic.
  assert attention.pallas_compiles(chip("v6e:2x2"), 80, "bfloat16")  # ViT-H/14's heads.


def layer_norm_values_and_grads(norm, x, params, w):
  loss = lambda p, x: jnp.sum(norm.apply(p, x).astype(jnp.float32) * w)  # noqa: E731
  return [np.asarray(a, np.float64) for a in [norm.apply(params, x)] + jax.tree.leaves(
      jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))]


def test_layer_norm_in_float32_is_flax_own():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(4, 9, 32)) * 3 + 1).astype(np.float32)
  params = {"params": {"scale": rng.normal(size=32).astype(np.float32),
                       "bias": rng.normal(size=32).astype(np.float32)}}
  w = rng.normal(size=x.shape).astype(np.float32)
  ours = layer_norm_values_and_grads(LayerNorm(), x, params, w)
  flax_own = layer_norm_values_and_grads(nn.LayerNorm(), x, params, w)
  for a, b in zip(ours, flax_own):
    np.testing.assert_array_equal(a, b)


def test_layer_norm_in_bfloat16_is_as_close_to_float64_as_flax_own():
  """One rounding more than flax's (of the normalised input): its output's error against
  float64 at most 1.5x flax's own bf16 output's; gradients within bf16 rounding of flax's."""
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(8, 197, 64)) * 3 + rng.normal(size=64) * 5).astype(np.float32)
  params = {"params": {"scale": rng.normal(size=64).astype(np.float32),
                       "bias": rng.normal(size=64).astype(np.float32) * 0.1}}
  w = rng.normal(size=x.shape).astype(np.float32)
  x64 = x.astype(np.float64)
  exact = ((x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6)
           * params["params"]["scale"] + params["params"]["bias"])
  ours = layer_norm_values_and_grads(LayerNorm(dtype=jnp.bfloat16), x, params, w)
  flax_own = layer_norm_values_and_grads(nn.LayerNorm(dtype=jnp.bfloat16), x, params, w)
  rms = lambda y: np.sqrt(np.mean((y - exact) ** 2))  # noqa: E731
  assert 0 < rms(ours[0]) <= 1.5 * rms(flax_own[0]), (rms(ours[0]), rms(flax_own[0]))
  errors = max_errors(ours[1:], flax_own[1:])
  assert max(errors) < 3e-3, errors
