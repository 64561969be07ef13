"""models/mlp.py against timm's MLPs with the same random weights: SwiGLU with its hidden
LayerNorm (EVA-02 B/L: `SwiGLU`, separate gate and value layers), packed SwiGLU (`GluMlp`, EVA-02
Ti/S, DINOv2-g), Dense-GELU-Dense in each GELU form (QuickGELU: OpenAI CLIP's)."""
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import randomised_torch
from vit_jax.models import mlp, timm_models

WIDTH, HIDDEN = 24, 40


def dense(linear) -> dict:
  return {"kernel": linear.weight.detach().numpy().T, "bias": linear.bias.detach().numpy()}


def layer_norm(norm) -> dict:
  return {"scale": norm.weight.detach().numpy(), "bias": norm.bias.detach().numpy()}


def torch_apply(module, x: np.ndarray) -> np.ndarray:
  torch, _ = timm_models.import_torch()
  with torch.no_grad():
    return module(torch.from_numpy(x)).numpy()


def inputs() -> np.ndarray:
  return np.random.default_rng(0).normal(size=(2, 7, WIDTH)).astype(np.float32)


def test_swiglu_with_hidden_norm_is_timms():
  torch, _ = timm_models.import_torch()
  from timm.layers import SwiGLU
  ref = randomised_torch(SwiGLU(WIDTH, HIDDEN, norm_layer=torch.nn.LayerNorm))
  gate, value = dense(ref.fc1_g), dense(ref.fc1_x)
  params = {"Dense_0": {k: np.concatenate([gate[k], value[k]], -1) for k in gate},
            "LayerNorm_0": layer_norm(ref.norm), "Dense_1": dense(ref.fc2)}
  ours = mlp.MlpBlock(HIDDEN, kind="swiglu", norm=True, norm_epsilon=1e-5).apply(
      {"params": params}, inputs())
  np.testing.assert_allclose(np.asarray(ours), torch_apply(ref, inputs()), atol=1e-5, rtol=1e-5)


def test_packed_swiglu_is_timms():
  torch, _ = timm_models.import_torch()
  from timm.layers import SwiGLUPacked
  ref = randomised_torch(SwiGLUPacked(WIDTH, 2 * HIDDEN))  # timm's hidden_features: fc1's width.
  params = {"Dense_0": dense(ref.fc1), "Dense_1": dense(ref.fc2)}
  ours = mlp.MlpBlock(HIDDEN, kind="swiglu").apply({"params": params}, inputs())
  np.testing.assert_allclose(np.asarray(ours), torch_apply(ref, inputs()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", mlp.GELUS)
def test_gelu_mlp_is_timms_in_each_form(form):
  torch, _ = timm_models.import_torch()
  from timm.layers import Mlp, QuickGELU
  act = {"tanh": lambda: torch.nn.GELU(approximate="tanh"), "exact": torch.nn.GELU,
         "quick": QuickGELU}[form]
  ref = randomised_torch(Mlp(WIDTH, HIDDEN, act_layer=act))
  params = {"Dense_0": dense(ref.fc1), "Dense_1": dense(ref.fc2)}
  ours = mlp.MlpBlock(HIDDEN, gelu=form).apply({"params": params}, inputs())
  np.testing.assert_allclose(np.asarray(ours), torch_apply(ref, inputs()), atol=1e-5, rtol=1e-5)


def test_quick_gelu_is_clips_formula():
  x = np.linspace(-6, 6, 101, dtype=np.float32)
  np.testing.assert_allclose(np.asarray(mlp.gelu(jnp.asarray(x), "quick")),
                             x / (1 + np.exp(-1.702 * x)), rtol=1e-6, atol=1e-7)
