"""The fused-attention fast path (cuDNN on capable GPUs) equals the explicit softmax one."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.models import vit

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
  device = jax.devices()[0]  # The backend the suite runs on: cuDNN only on sm80 and newer.
  capable = device.platform == "gpu" and int(str(device.compute_capability).split(".")[0]) >= 8
  assert vit.resolve_attention_impl("auto", jnp.bfloat16, 64) == ("cudnn" if capable else None)
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
