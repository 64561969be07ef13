"""The fused-attention fast path equals the explicit one; the throughput benchmark runs on CPU."""
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.models import vit
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import throughput  # noqa: E402

TINY = dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=4, num_layers=1)


def random_params(model, images):
  """Random parameters of the model's shapes, made on the host (no init to compile).

  Random rather than initial values: the zero-initialised head would hide the attention.
  """
  shapes = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32), shapes)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_fused_attention_equals_explicit_softmax(dtype, tol):
  model = models.create_model("ViT-Ti_16", num_classes=5, dtype=dtype, attention_impl="auto",
                              **TINY)
  images = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype(np.float32)
  variables = {"params": random_params(model, images)}
  apply = jax.jit(model.apply, static_argnames=("return_aux", "return_attention"))
  fused, fused_aux = apply(variables, images, return_aux=True)
  explicit, aux = apply(variables, images, return_attention=True)
  assert aux["attention"][0].shape == (2, 4, 17, 17)  # The explicit path did run.
  for a, b in ((fused, explicit), (fused_aux["encoded"], aux["encoded"])):
    np.testing.assert_allclose(a, b, atol=tol * np.max(np.abs(b)), rtol=tol)


def test_auto_picks_cudnn_only_on_a_capable_gpu(monkeypatch):
  assert vit.resolve_attention_impl("auto", jnp.bfloat16, 64) is None  # This CPU.
  assert vit.resolve_attention_impl("xla", jnp.bfloat16, 64) == "xla"
  h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda: [h100])
  assert vit.resolve_attention_impl("auto", jnp.bfloat16, 64) == "cudnn"
  assert vit.resolve_attention_impl("auto", jnp.float16, 128) == "cudnn"
  assert vit.resolve_attention_impl("auto", jnp.float32, 64) is None
  assert vit.resolve_attention_impl("auto", jnp.bfloat16, 160) is None
  monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(
      platform="gpu", compute_capability="7.0")])
  assert vit.resolve_attention_impl("auto", jnp.bfloat16, 64) is None


def test_unknown_attention_impl_is_named():
  model = models.create_model("ViT-Ti_16", attention_impl="flash", **TINY)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


def test_analytic_flops_match_the_published_figure():
  # ViT-B/16 at 224 px: 17.6 GMACs (timm, fvcore) = 35.1 GFLOP.
  flops = throughput.forward_flops(models.model_config("ViT-B_16"), 224, 1000)
  assert abs(flops / 35.1e9 - 1) < 0.005
  assert throughput.forward_flops(models.model_config("R50+ViT-B_16"), 224, 1000) is None


def test_benchmark_runs_end_to_end_on_cpu(tmp_path):
  out = tmp_path / "throughput.json"
  throughput.main(["--model", "ViT-Ti_16", "--image_size", "32", "--batch_size", "8",
                   "--num_layers", "1", "--dtype", "float32", "--timm", "off",
                   "--warmup", "1", "--steps", "1", "--repeats", "1", "--json_out", str(out)])
  report = json.loads(out.read_text())
  assert {"device", "versions", "forward_flops_per_image", "flops_source", "peak_tflops",
          "attention_impl_resolved", "results"} <= set(report)
  assert report["peak_tflops"] is None  # CPU: MFU is n/a unless --peak_tflops is given.
  rows = {(r["framework"], r["phase"]): r for r in report["results"]}
  assert set(rows) == {("vit_jax", "infer"), ("vit_jax", "train")}
  for r in rows.values():
    assert set(throughput.RESULT_KEYS) <= set(r) and r["img_per_s"] > 0 and r["mfu"] is None
  assert np.isfinite(report["vit_jax"]["final_loss"])
  # The analytic count agrees with XLA's (which adds the elementwise work).
  xla = report["vit_jax"]["xla_forward_gflops"] * 1e9
  assert 0.8 < report["forward_flops_per_image"] / xla <= 1.0


def test_rows_give_mfu_and_ratio_to_timm_compile():
  step = lambda s: {"step_s": s, "compile_s": 0.0, "peak_bytes": 2**30}  # noqa: E731
  report = {"batch_size": 100, "forward_flops_per_image": 1e9, "peak_tflops": 1.0,
            "vit_jax": {"phases": {"train": step(0.5), "infer": step(0.1)}},
            "timm": {"compile": {"train": step(1.0), "infer": step(0.2)}}}
  rows = {(r["framework"], r["phase"]): r for r in throughput._rows(report)}
  train = rows[("vit_jax", "train")]
  assert train["img_per_s"] == 200 and train["ratio_to_timm_compile"] == 2.0
  assert train["mfu"] == pytest.approx(200 * 3e9 / 1e12) and train["peak_memory_gb"] == 1.0
  assert rows[("vit_jax", "infer")]["mfu"] == pytest.approx(1000 * 1e9 / 1e12)
  assert rows[("timm_compile", "infer")]["ratio_to_timm_compile"] == 1.0
  assert "timm_compile" in throughput._table(list(rows.values()))


def test_cudnn_padding_to_even_lengths_changes_nothing(monkeypatch):
  """The cuDNN path pads odd lengths (197 tokens) and masks the pad: same values, same grads.

  Run on CPU by handing the padded, masked call to XLA's implementation. 9 tokens
  (padded once for all blocks, remat'ed) and the MAP head's single probe (padded there).
  """
  model = models.create_model("ViT-Ti_16", num_classes=5, classifier="map", remat=True, **TINY)
  images = np.random.default_rng(1).normal(size=(2, 24, 24, 3)).astype(np.float32)
  params = random_params(model, images)

  def loss_and_grads():
    loss = lambda p: jnp.sum(model.apply({"params": p}, images)**2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  reference = loss_and_grads()
  seen = []
  dot_product_attention = jax.nn.dot_product_attention

  def as_xla(q, k, v, *, key_value_seq_lengths=None, implementation=None):
    assert implementation == "cudnn" and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0
    seen.append(key_value_seq_lengths)
    return dot_product_attention(q, k, v, key_value_seq_lengths=key_value_seq_lengths,
                                 implementation="xla")

  monkeypatch.setattr(vit, "resolve_attention_impl", lambda *_: "cudnn")
  monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
  padded = loss_and_grads()
  assert seen and all(lengths is not None for lengths in seen)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
  want = flat(reference)
  np.testing.assert_allclose(flat(padded), want, rtol=1e-4, atol=1e-5 * np.max(np.abs(want)))
