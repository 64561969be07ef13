"""models/rope.py against timm's rotary embeddings, applied as timm's EvaAttention applies them:
EVA-02's (`RotaryEmbeddingCat` with `ref_feat_shape`, `apply_rot_embed_cat`) and DINOv3's
(`RotaryEmbeddingDinoV3`), each at its trained grid and at another, prefix tokens untouched."""
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.models import rope, timm_models

HEAD_DIM = 16


def timm_embedding(kind: str, grid: tuple[int, int]):
  """timm's (tokens, 2 * head_dim) [sin, cos] and its apply_rot_embed_cat's `half`."""
  torch, _ = timm_models.import_torch()
  from timm.layers import pos_embed_sincos as sincos
  if kind == "eva":  # eva.py's arguments for EVA-02 (ref_feat_shape 16 = 224 / 14).
    module = sincos.RotaryEmbeddingCat(HEAD_DIM, in_pixels=False, feat_shape=None,
                                       ref_feat_shape=(16, 16), temperature=10000.)
  else:  # eva.py's DINOv3 models: rope_type='dinov3', temperature 100, rotate_half.
    module = sincos.RotaryEmbeddingDinoV3(HEAD_DIM, temperature=100, rotate_half=True)
  return module.get_embed(shape=list(grid)), module.rotate_half


@pytest.mark.parametrize("kind", ["eva", "dinov3"])
@pytest.mark.parametrize("grid", [(16, 16), (6, 9)])
def test_rotation_is_timms(kind, grid):
  torch, _ = timm_models.import_torch()
  from timm.layers import apply_rot_embed_cat
  emb, half = timm_embedding(kind, grid)
  prefix, tokens = 5, grid[0] * grid[1]
  x = np.random.default_rng(0).normal(size=(2, prefix + tokens, 3, HEAD_DIM)).astype(np.float32)
  # timm: (batch, heads, tokens, head_dim), the prefix left out (EvaAttention.forward).
  xt = torch.from_numpy(x.transpose(0, 2, 1, 3))
  theirs = torch.cat([xt[:, :, :prefix], apply_rot_embed_cat(xt[:, :, prefix:], emb, half=half)],
                     dim=2).numpy().transpose(0, 2, 1, 3)
  sin, cos = rope.embedding(kind, grid, HEAD_DIM, 16 if kind == "eva" else None)
  np.testing.assert_allclose(np.concatenate([sin, cos], -1), emb.numpy(), atol=1e-6)
  ours = rope.apply(jnp.asarray(x), sin, cos, kind)
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(ours[:, :prefix]), x[:, :prefix])


def test_eva_without_reference_grid_uses_indices():
  sin, _ = rope.embedding("eva", (3, 4), 8)
  # Patch (row 2, column 3): the row's angle 2 * band 0 = 2, the column's 3, each paired.
  np.testing.assert_allclose(sin[2 * 4 + 3], np.sin([2, 2, 2e-2, 2e-2, 3, 3, 3e-2, 3e-2]),
                             rtol=1e-6)


def test_rotation_keeps_norms_and_dtype():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 13, 2, 8)), jnp.bfloat16)
  sin, cos = rope.embedding("dinov3", (3, 4), 8)
  out = rope.apply(x, sin, cos, "dinov3")
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.linalg.norm(np.float32(out), axis=-1),
                             np.linalg.norm(np.float32(x), axis=-1), rtol=2e-2)


@pytest.mark.parametrize("kind,head_dim,message", [
    ("xpos", 8, r"rope='xpos', expected one of \('eva', 'dinov3'\)"),
    ("eva", 6, "head size divisible by 4, got 6")])
def test_bad_arguments_are_named(kind, head_dim, message):
  with pytest.raises(ValueError, match=message):
    rope.embedding(kind, (2, 2), head_dim)
