"""models/vit.py's fields for the DINOv2, DINOv3, CLIP and EVA-02 families, against timm with the
same random weights (not init values):

- An encoder block with LayerScale, each query/key/value bias form, SwiGLU (packed, separate,
  with its hidden LayerNorm), the attention's inner LayerNorm and each rotary embedding is
  timm's `EvaBlock` (DINOv3, EVA-02) or `Block` (DINOv2), prefix tokens left unrotated.
- Whole models: CLIP's (pre-norm, QuickGELU, LayerNorm epsilon 1e-5, no patch bias) and
  DINOv2's (LayerScale), SigLIP's MAP head and DINOv2-g's SwiGLUPacked through timm_vit.to_npz
  give timm's logits; timm's DINOv3 and EVA-02
  (`Eva`, read by the Hub's layout, layouts/timm_eva.py) theirs and their blocks' features, at
  two sizes; transformers' Dinov2Model with SwiGLU its pooled output and tokens, at two sizes.
- The parameter tree and count of a small model with every field on, its attention paths,
  bf16, remat and LoRA; bad field values named.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import EVERY_FIELD, apply, random_like, randomised_torch
from vit_jax import models
from vit_jax.checkpoint import errors, npz
from vit_jax.checkpoint.layouts import timm_eva, timm_vit
from vit_jax.models import features, rope as rope_lib, timm_models, vit

WIDTH, HEADS, HIDDEN, PREFIX, GRID = 32, 2, 80, 5, (4, 6)


def t(x) -> np.ndarray:
  return x.detach().numpy()


def heads(w: np.ndarray, b) -> dict:
  """A torch Linear's (out, in) weight and bias as a (in, heads, head_dim) DenseGeneral."""
  out = {"kernel": w.T.reshape(w.shape[1], HEADS, -1)}
  if b is not None:
    out["bias"] = b.reshape(HEADS, -1)
  return out


def block_params(block) -> dict:
  """A timm block's weights as our block's, as the Hub's layouts read block 0 of a model of its
  family (placeholders around it): an EvaBlock's as layouts/timm_eva.py, a VisionTransformer
  Block's as layouts/timm_vit.py (which timm_vit.to_npz uses)."""
  zeros = np.zeros((1, 1, WIDTH), np.float32)
  arrays = {f"blocks.0.{k}": t(v) for k, v in block.state_dict().items()} | {
      "patch_embed.proj.weight": np.zeros((WIDTH, 3, 1, 1), np.float32),
      "patch_embed.proj.bias": zeros[0, 0], "norm.weight": zeros[0, 0], "norm.bias": zeros[0, 0]}
  if type(block).__name__ != "EvaBlock":  # No class token, one patch's learned embedding.
    flat = timm_vit.to_released(arrays | {"pos_embed": zeros},
                                {"model_args": {"num_heads": HEADS}}, "a timm Block")
    return npz.unflatten(flat)["Transformer"]["encoderblock_0"]
  # DINOv3's blocks rotate the halves of each head, EVA-02's adjacent pairs.
  family = "vit_small_patch16_dinov3" if block.attn.rotate_half else "eva02_base_patch14_224"
  return eva_tree(arrays | {"cls_token": zeros}, family)["Transformer"]["encoderblock_0"]


def eva_tree(arrays: dict, architecture: str) -> dict:
  """An Eva's state dict (numpy; avg pooling) as our tree, as the Hub's layout reads it."""
  config = {"architecture": architecture, "global_pool": "avg",
            "model_args": {"num_heads": HEADS}}
  return npz.unflatten(timm_eva.to_released(arrays, config, architecture))


def eva_block(**kw):
  torch, _ = timm_models.import_torch()
  from timm.models.eva import EvaBlock
  norm = functools.partial(torch.nn.LayerNorm, eps=kw.pop("eps", 1e-6))
  return randomised_torch(EvaBlock(WIDTH, HEADS, mlp_ratio=HIDDEN / WIDTH,
                                   num_prefix_tokens=PREFIX, norm_layer=norm, **kw))


def vit_block(**kw):
  torch, _ = timm_models.import_torch()
  from timm.models.vision_transformer import Block
  return randomised_torch(Block(WIDTH, HEADS, mlp_ratio=HIDDEN / WIDTH, init_values=1e-5,
                                qkv_bias=True,
                          norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6), **kw))


# Our block's fields and timm's block, one row per family's form.
BLOCKS = {
    "EVA-02 B/L: separate q/v biases, SwiGLU with hidden norm, eva rope": (
        dict(qkv_bias="qv", mlp="swiglu", mlp_norm=True, rope="eva", gelu="exact"),
        lambda: eva_block(qkv_fused=False, swiglu_mlp=True, scale_mlp=True)),
    "EVA-02 Ti/S: fused q/v biases, packed SwiGLU": (
        dict(qkv_bias="qv", mlp="swiglu", rope="eva"),
        lambda: eva_block(swiglu_mlp=True)),
    "EVA-02 CLIP: attention's inner norm": (
        dict(qkv_bias="qv", mlp="swiglu", mlp_norm=True, attention_norm=True, rope="eva"),
        lambda: eva_block(qkv_fused=False, swiglu_mlp=True, scale_mlp=True,
                          scale_attn_inner=True)),
    "DINOv3: LayerScale, no qkv bias, dinov3 rope, eps 1e-5": (
        dict(qkv_bias="none", layer_scale=True, rope="dinov3", gelu="exact", norm_epsilon=1e-5),
        lambda: eva_block(qkv_bias=False, init_values=1e-5, rotate_half=True, eps=1e-5)),
    "DINOv3 _qkvb, H+ SwiGLU": (
        dict(qkv_bias="qv", layer_scale=True, rope="dinov3", mlp="swiglu", norm_epsilon=1e-5),
        lambda: eva_block(qkv_bias=True, init_values=1e-5, rotate_half=True, eps=1e-5,
                          swiglu_mlp=True, swiglu_align_to=8)),
    "DINOv2: LayerScale, qkv biases": (
        dict(qkv_bias="qkv", layer_scale=True, gelu="exact"), vit_block),
}


def timm_rope(kind: str):
  torch, _ = timm_models.import_torch()
  from timm.layers import pos_embed_sincos as sincos
  if kind == "eva":
    return sincos.RotaryEmbeddingCat(WIDTH // HEADS, in_pixels=False, ref_feat_shape=(16, 16),
                                     temperature=10000.).get_embed(shape=list(GRID))
  return sincos.RotaryEmbeddingDinoV3(WIDTH // HEADS, temperature=100).get_embed(
      shape=list(GRID))


@pytest.mark.parametrize("form", BLOCKS)
def test_block_is_timms(form):
  torch, _ = timm_models.import_torch()
  fields, make = BLOCKS[form]
  reference = make()
  x = np.random.default_rng(0).normal(size=(2, PREFIX + GRID[0] * GRID[1], WIDTH))
  x = x.astype(np.float32)
  kind = fields.get("rope", "none")
  with torch.no_grad():
    kw = {} if kind == "none" else {"rope": timm_rope(kind)}
    theirs = reference(torch.from_numpy(x), **kw).numpy()
  rope = None if kind == "none" else rope_lib.embedding(kind, GRID, WIDTH // HEADS,
                                                        16 if kind == "eva" else None)
  ours, _ = apply(vit.Encoder1DBlock(HIDDEN, HEADS, **fields),
                  {"params": block_params(reference)}, x, rope)
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)


def images(h: int, w: int) -> np.ndarray:
  return np.random.default_rng(1).uniform(-1, 1, (2, h, w, 3)).astype(np.float32)


TINY = dict(patch_size=8, hidden_size=WIDTH, mlp_dim=HIDDEN, num_heads=HEADS, num_layers=2)
TIMM_TINY = dict(img_size=32, patch_size=8, embed_dim=WIDTH, depth=2, num_heads=HEADS,
                 mlp_ratio=HIDDEN / WIDTH, num_classes=8)


def tiny_timm_vit(**kw):
  torch, timm = timm_models.import_torch()
  from timm.models.vision_transformer import VisionTransformer
  return randomised_torch(VisionTransformer(**TIMM_TINY, **kw))


def test_clip_form_is_timms():
  """OpenAI CLIP's image tower as timm builds it (`vit_*_clip_quickgelu_*`): pre-norm, no patch
  bias, QuickGELU, torch's LayerNorm epsilon; the projection as a head without bias."""
  torch, _ = timm_models.import_torch()
  from timm.layers import QuickGELU
  reference = tiny_timm_vit(pre_norm=True, norm_layer=torch.nn.LayerNorm, act_layer=QuickGELU)
  with torch.no_grad():
    reference.head.bias.zero_()
  arrays = timm_vit.to_npz(reference)
  assert "embedding/bias" not in arrays and "Transformer/pre_norm/scale" in arrays
  del arrays["head/bias"]
  model = vit.VisionTransformer(num_classes=8, pre_norm=True, gelu="quick", layer_norm_eps=1e-5,
                                head_bias=False, **TINY)
  ours = apply(model, {"params": npz.unflatten(arrays)}, images(32, 32))
  np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(32, 32)),
                             atol=1e-4, rtol=1e-4)


def test_dinov2_form_is_timms():
  """DINOv2's (`vit_*_patch14_dinov2`): LayerScale on both branches, exact GELU."""
  torch, _ = timm_models.import_torch()
  reference = tiny_timm_vit(init_values=1e-5)
  model = vit.VisionTransformer(num_classes=8, layer_scale=True, gelu="exact", **TINY)
  params = npz.unflatten(timm_vit.to_npz(reference))
  assert set(params["Transformer"]["encoderblock_1"]) >= {"LayerScale_0", "LayerScale_1"}
  ours = apply(model, {"params": params}, images(32, 32))
  np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(32, 32)),
                             atol=1e-4, rtol=1e-4)


def test_patch_mean_beside_a_class_token_with_fc_norm_is_timms():
  """timm's global_pool="avg" with its class token and fc_norm (EVA-02's ImageNet heads'
  pooling): to_npz moves fc_norm across, the class token stays out of the mean."""
  reference = tiny_timm_vit(global_pool="avg", fc_norm=True)
  params = npz.unflatten(timm_vit.to_npz(reference))
  assert "fc_norm" in params and "encoder_norm" not in params["Transformer"]
  model = vit.VisionTransformer(num_classes=8, classifier="gap", class_token=True,
                                fc_norm=True, gelu="exact", **TINY)
  ours = apply(model, {"params": params}, images(32, 32))
  np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(32, 32)),
                             atol=1e-4, rtol=1e-4)


# What to_npz reads now that it is the Hub layout's reader (it refused both before):
# (timm VisionTransformer arguments, given timm.layers; our model's fields).
CONVERTED = {
    "SigLIP's MAP head": (lambda layers: dict(global_pool="map", class_token=False),
                          dict(classifier="map")),
    "DINOv2-g's SwiGLUPacked MLP": (
        lambda layers: dict(mlp_layer=layers.SwiGLUPacked, act_layer="silu"),
        dict(mlp="swiglu", mlp_dim=HIDDEN // 2)),
}


@pytest.mark.parametrize("form", CONVERTED)
def test_to_npz_converts_what_the_layout_reads(form):
  _, timm = timm_models.import_torch()
  timm_kwargs, fields = CONVERTED[form]
  reference = tiny_timm_vit(**timm_kwargs(timm.layers))
  model = vit.VisionTransformer(num_classes=8, gelu="exact", **TINY | fields)
  ours = apply(model, {"params": npz.unflatten(timm_vit.to_npz(reference))}, images(32, 32))
  np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(32, 32)),
                             atol=1e-4, rtol=1e-4)


# What to_npz refuses, one line each: (timm VisionTransformer arguments, given timm.layers;
# what the refusal says).
REFUSED = {
    "a MAP head beside a class token": (lambda layers: dict(global_pool="map"),
                                        "MAP head beside a class token"),
    "a MAP head over the registers too": (
        lambda layers: dict(global_pool="map", class_token=False, reg_tokens=1,
                            pool_include_prefix=True), "pool_include_prefix"),
    "q/k norms": (lambda layers: dict(qk_norm=True), "query/key normalisation"),
    "the attention's inner norm": (lambda layers: dict(scale_attn_norm=True),
                                   "does not understand: blocks.0.attn.norm.bias"),
    "a GELU GluMlp, gate last": (lambda layers: dict(mlp_layer=layers.GluMlp),
                                 "GluMlp gated by GELU, gate last"),
    "a SwiGLU of separate fc1_g, fc1_x": (lambda layers: dict(mlp_layer=layers.SwiGLU),
                                          "neither timm's Mlp nor its SwiGLUPacked"),
}


@pytest.mark.parametrize("form", REFUSED)
def test_to_npz_refuses_in_one_line_what_it_cannot_convert(form):
  _, timm = timm_models.import_torch()
  timm_kwargs, says = REFUSED[form]
  with pytest.raises(errors.CheckpointError, match=re.escape(says)) as refused:
    timm_vit.to_npz(tiny_timm_vit(**timm_kwargs(timm.layers)))
  assert "\n" not in str(refused.value)


def test_to_npz_refuses_an_eva_naming_the_layout_that_reads_it():
  _, timm = timm_models.import_torch()
  eva = timm.create_model("vit_small_patch16_dinov3", pretrained=False, **TIMM_TINY)
  with pytest.raises(errors.CheckpointError,
                     match="not its Eva: save it .* layouts/timm_eva.py") as refused:
    timm_vit.to_npz(eva)
  assert "\n" not in str(refused.value)


# Our model's fields and timm's Eva arguments (eva.py's for the family's architecture, tiny).
EVAS = {
    "vit_small_patch16_dinov3": (
        dict(classifier="gap", class_token=True, num_registers=4, posemb="none", rope="dinov3",
             layer_scale=True, qkv_bias="none", layer_norm_eps=1e-5, gelu="exact"),
        dict(qkv_bias=False, init_values=1e-5, rope_type="dinov3", rope_temperature=100,
             rope_rotate_half=True, use_rot_pos_emb=True, use_abs_pos_emb=False,
             num_reg_tokens=4, use_fc_norm=False, eps=1e-5)),
    "eva02_base_patch14_224": (
        dict(classifier="gap", class_token=True, fc_norm=True, rope="eva", rope_ref_grid=16,
             qkv_bias="qv", mlp="swiglu", mlp_norm=True, posemb_interpolation="bicubic"),
        dict(qkv_fused=False, swiglu_mlp=True, scale_mlp=True, use_rot_pos_emb=True,
             ref_feat_shape=(16, 16))),
}


@pytest.mark.parametrize("architecture", EVAS)
def test_eva_forms_are_timms_at_two_sizes(architecture):
  """timm's eva.py models of the family (tiny): logits at the trained size and another (the
  rotary grid at the new size, EVA-02's learned embedding resampled as timm does), and the
  blocks' features (patches and prefix tokens, normed as timm's `forward_intermediates`)."""
  torch, _ = timm_models.import_torch()
  from timm.models.eva import Eva
  ours_fields, kw = EVAS[architecture]
  norm = functools.partial(torch.nn.LayerNorm, eps=kw.pop("eps", 1e-6))
  reference = randomised_torch(Eva(**TIMM_TINY, global_pool="avg", dynamic_img_size=True,
                             norm_layer=norm, **kw))
  model = vit.VisionTransformer(num_classes=8, dynamic_image_size=True, **ours_fields, **TINY)
  params = eva_tree({k: t(v) for k, v in reference.state_dict().items()}, architecture)
  for h, w in ((32, 32), (48, 40)):
    ours = apply(model, {"params": params}, images(h, w))
    np.testing.assert_allclose(np.asarray(ours), timm_models.logits(reference, images(h, w)),
                               atol=1e-4, rtol=1e-4)
  maps, prefix = features.forward_intermediates(model, params, images(48, 40), [0, 1],
                                                norm=True, prefix_tokens=True, output_fmt="NLC")
  with torch.no_grad():
    theirs = reference.forward_intermediates(
        torch.from_numpy(images(48, 40).transpose(0, 3, 1, 2)), indices=[0, 1], norm=True,
        intermediates_only=True, return_prefix_tokens=True, output_fmt="NLC")
  for m, p, (tm, tp) in zip(maps, prefix, theirs):
    np.testing.assert_allclose(np.asarray(m), tm.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(p), tp.numpy(), atol=1e-4, rtol=1e-4)


def every_field_model(**kw) -> vit.VisionTransformer:
  return vit.VisionTransformer(num_classes=8, **(EVERY_FIELD | TINY | kw))


def test_every_field_on_gives_its_arrays():
  shapes = jax.eval_shape(every_field_model().init, jax.random.key(0), images(32, 32))["params"]
  flat = {k: v.shape for k, v in npz.flatten(shapes).items()}
  block = {k.split("/", 2)[2]: v for k, v in flat.items()
           if k.startswith("Transformer/encoderblock_0/")}
  attn, mlp = "MultiHeadDotProductAttention_1/", "MlpBlock_3/"
  assert block == {
      "LayerNorm_0/scale": (32,), "LayerNorm_0/bias": (32,),
      attn + "query/kernel": (32, 2, 16), attn + "query/bias": (2, 16),
      attn + "key/kernel": (32, 2, 16),
      attn + "value/kernel": (32, 2, 16), attn + "value/bias": (2, 16),
      attn + "LayerNorm_0/scale": (32,), attn + "LayerNorm_0/bias": (32,),
      attn + "out/kernel": (2, 16, 32), attn + "out/bias": (32,),
      "LayerScale_0/scale": (32,), "LayerNorm_2/scale": (32,), "LayerNorm_2/bias": (32,),
      mlp + "Dense_0/kernel": (32, 160), mlp + "Dense_0/bias": (160,),
      mlp + "LayerNorm_0/scale": (80,), mlp + "LayerNorm_0/bias": (80,),
      mlp + "Dense_1/kernel": (80, 32), mlp + "Dense_1/bias": (32,),
      "LayerScale_1/scale": (32,)}
  rest = {k: v for k, v in flat.items() if "/encoderblock_" not in k}
  assert rest == {
      "embedding/kernel": (8, 8, 3, 32), "cls": (1, 1, 32), "reg": (1, 2, 32),
      "Transformer/posembed_input/pos_embedding": (1, 17, 32),
      "Transformer/pre_norm/scale": (32,), "Transformer/pre_norm/bias": (32,),
      "Transformer/encoder_norm/scale": (32,), "Transformer/encoder_norm/bias": (32,),
      "head/kernel": (32, 8)}
  per_block = 4 * 32 + 2 * (32 * 32 + 32) + 32 * 32 + (32 * 32 + 32) + 2 * 32 + 2 * 32 \
      + (32 * 160 + 160) + 2 * 80 + (80 * 32 + 32)
  assert sum(int(np.prod(s)) for s in flat.values()) == (
      8 * 8 * 3 * 32 + 32 + 2 * 32 + 17 * 32 + 2 * 32 + 2 * per_block + 2 * 32 + 32 * 8)


def test_every_field_on_runs_every_way():
  """The attention paths (the explicit one for the weights), bf16, remat, LoRA and the
  features of blocks, each on the same random weights."""
  torch, _ = timm_models.import_torch()  # Before anything imports TensorFlow.
  model = every_field_model()
  x = images(40, 32)
  params = random_like(jax.eval_shape(model.init, jax.random.key(0), x)["params"], 0.3, 0)
  want = apply(model, {"params": params}, x)
  for other in (model.clone(attention_impl="xla"), model.clone(remat=True)):
    np.testing.assert_allclose(apply(other, {"params": params}, x), want, atol=1e-5, rtol=1e-5)
  logits, aux = apply(model, {"params": params}, x, return_attention=True)
  assert aux["attention"][0].shape == (2, 2, 23, 23)  # cls, 2 registers, 5x4 patches.
  np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5)
  bf16 = apply(model.clone(dtype=jnp.bfloat16), {"params": params}, x)
  np.testing.assert_allclose(bf16, want, atol=0.05 * np.abs(want).max())
  lora = model.clone(lora_rank=2, lora_targets=("query", "key", "Dense_0", "Dense_1"))
  adapters = npz.flatten(lora.init(jax.random.key(1), x)["params"])
  assert "Transformer/encoderblock_0/MlpBlock_3/Dense_0/lora_a" in adapters
  adapted = npz.unflatten(adapters | npz.flatten(params))
  # B starts at zero: the adapted model computes what its base does.
  np.testing.assert_allclose(apply(lora, {"params": adapted}, x), want, atol=1e-5, rtol=1e-5)
  maps, prefix = features.forward_intermediates(model, params, x, [0, 1], norm=True,
                                                prefix_tokens=True)
  assert maps[1].shape == (2, 5, 4, 32) and prefix[1].shape == (2, 3, 32)


@pytest.mark.parametrize("fields,message", [
    (dict(qkv_bias="k"), r"qkv_bias='k', expected one of \('qkv', 'qv', 'none'\)"),
    (dict(mlp="geglu"), r"mlp='geglu', expected one of \('gelu', 'swiglu'\)"),
    (dict(rope="xpos"), r"rope='xpos', expected one of \('none', 'eva', 'dinov3'\)"),
    (dict(gelu="fast"), r"gelu='fast', expected one of \('tanh', 'exact', 'quick'\)"),
    (dict(posemb="rope"), r"posemb='rope', expected one of \('learn', 'sincos2d', 'none'\)"),
    (dict(rope="dinov3", rope_ref_grid=16), "rope_ref_grid=16 is rope='eva''s pre-training"),
    (dict(rope="eva", rope_ref_grid=0), "rope_ref_grid=0 is rope='eva''s"),
    (dict(rope="eva", num_heads=16), "rope='eva' needs a head size divisible by 4, got 2"),
    (dict(class_token=True, classifier="token"), "class_token=True is for classifier='gap'.*"
     "has its own"),
    (dict(class_token=True, classifier="map"), "pools without"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps=0.0, expected > 0")])
def test_bad_fields_are_named(fields, message):
  model = vit.VisionTransformer(num_classes=8, **(TINY | fields))
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(model.init, jax.random.key(0), images(32, 32))


def test_fields_have_their_roles():
  layout = models.registry.fields_of(models.Role.LAYOUT)
  computation = models.registry.fields_of(models.Role.COMPUTATION)
  assert {"class_token", "pre_norm", "layer_scale", "qkv_bias", "mlp", "mlp_norm",
          "attention_norm"} <= set(layout)
  assert {"gelu", "layer_norm_eps", "rope", "rope_ref_grid"} <= set(computation)
  assert "head_bias" in models.registry.fields_of(models.Role.PRE_LOGITS)


def test_transformers_dinov2_with_swiglu_is_ours_at_two_sizes():
  """transformers' Dinov2Model (DINOv2-g's SwiGLU, LayerScale) on random weights: its pooled
  output is our pre-logits, at its size and at another, where it resizes the position
  embedding with torch's plain bicubic ("bicubic_no_antialias")."""
  torch, _ = timm_models.import_torch()
  from transformers import Dinov2Config, Dinov2Model
  reference = randomised_torch(Dinov2Model(Dinov2Config(
      hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, image_size=32,
      patch_size=8, use_swiglu_ffn=True)))
  sd = {k: v.numpy() for k, v in reference.state_dict().items()}
  lin = lambda k: {"kernel": sd[k + ".weight"].T, "bias": sd[k + ".bias"]}  # noqa: E731
  norm = lambda k: {"scale": sd[k + ".weight"], "bias": sd[k + ".bias"]}  # noqa: E731
  encoder = {"posembed_input": {"pos_embedding": sd["embeddings.position_embeddings"]},
             "encoder_norm": norm("layernorm")}
  for i in range(2):
    p = f"encoder.layer.{i}."
    gate, up = lin(p + "mlp.gate_proj"), lin(p + "mlp.up_proj")
    attn = {n: heads(sd[f"{p}attention.{s}.weight"], sd[f"{p}attention.{s}.bias"])
            for n, s in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))}
    attn["out"] = {"kernel": sd[p + "attention.o_proj.weight"].T.reshape(HEADS, -1, WIDTH),
                   "bias": sd[p + "attention.o_proj.bias"]}
    encoder[f"encoderblock_{i}"] = {
        "LayerNorm_0": norm(p + "norm1"), "LayerNorm_2": norm(p + "norm2"),
        "MultiHeadDotProductAttention_1": attn,
        "MlpBlock_3": {"Dense_0": {k: np.concatenate([gate[k], up[k]], -1) for k in gate},
                       "Dense_1": lin(p + "mlp.down_proj")},
        "LayerScale_0": {"scale": sd[p + "layer_scale1.lambda1"]},
        "LayerScale_1": {"scale": sd[p + "layer_scale2.lambda1"]}}
  params = {"cls": sd["embeddings.cls_token"], "Transformer": encoder,
            "embedding": {"kernel": sd["embeddings.patch_embeddings.projection.weight"].transpose(
                2, 3, 1, 0), "bias": sd["embeddings.patch_embeddings.projection.bias"]}}
  model = vit.VisionTransformer(
      num_classes=None, layer_scale=True, mlp="swiglu", gelu="exact", dynamic_image_size=True,
      posemb_interpolation="bicubic_no_antialias", **(TINY | {"mlp_dim": 88}))
  for h, w in ((32, 32), (48, 64)):
    _, aux = apply(model, {"params": params}, images(h, w), return_aux=True)
    with torch.no_grad():
      out = reference(torch.from_numpy(images(h, w).transpose(0, 3, 1, 2)))
    np.testing.assert_allclose(aux["pre_logits"], out.pooler_output.numpy(), atol=1e-4,
                               rtol=1e-4)
    np.testing.assert_allclose(aux["encoded"], out.last_hidden_state.numpy(), atol=1e-4,
                               rtol=1e-4)
