"""Named models: parameter counts, shapes, options, outputs, bad input, their fields' roles."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import EVERY_FIELD, noisy
from vit_jax import models
from vit_jax.models import timm_models


# From the paper's released models (DESIGN.md): 224 px, 1000 classes, no pre-logits.
PAPER_COUNTS = {
    "ViT-Ti_16": 5_717_416,
    "ViT-S_16": 22_050_664,
    "ViT-B_16": 86_567_656,
    "ViT-B_32": 88_224_232,
    "ViT-L_16": 304_326_632,
    "ViT-H_14": 632_045_800,
    "R50+ViT-B_16": 98_659_112,
    "R26+ViT-S_32": 36_431_912,
}

TINY = dict(hidden_size=32, mlp_dim=64, num_heads=4, num_layers=2)


def count_params(model, size=224) -> int:
  """Traced once a model for this file's two tables (models.abstract_params)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(models.abstract_params(model, size)))


def init_apply(model, images, **kw):
  variables = model.init(jax.random.key(0), images)
  return variables, model.apply(variables, images, **kw)


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_paper_parameter_counts(name):
  assert count_params(models.create_model(name, num_classes=1000)) == PAPER_COUNTS[name]


@pytest.mark.parametrize("name", sorted(models.MODEL_CONFIGS))
def test_every_registry_entry_matches_timm_count(name):
  torch, _ = timm_models.import_torch()
  with torch.device("meta"):
    reference = timm_models.create(name, num_classes=1000)
  expected = sum(p.numel() for p in reference.parameters())
  assert count_params(models.create_model(name, num_classes=1000)) == expected


def test_registry_has_the_official_names():
  expected = {"ViT-Ti_16", "ViT-S_16", "ViT-S_32", "ViT-B_8", "ViT-B_16", "ViT-B_32",
              "ViT-L_16", "ViT-L_32", "ViT-H_14", "ViT-g_14", "R+ViT-Ti_16", "R50+ViT-B_16",
              "R26+ViT-B_32", "R26+ViT-S_32", "R50+ViT-L_32", "ViT-B_16-gap-norep"}
  assert expected <= set(models.MODEL_CONFIGS)
  g = models.model_config("ViT-g_14")
  assert (g["hidden_size"], g["mlp_dim"], g["num_heads"], g["num_layers"]) == (1408, 6144, 16, 40)


def test_parameter_tree_uses_released_names():
  model = models.create_model("R26+ViT-S_32", num_classes=10, num_layers=1)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 64, 64, 3)))["params"]
  block = shapes["Transformer"]["encoderblock_0"]
  assert set(block) == {"LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"}
  assert block["MultiHeadDotProductAttention_1"]["query"]["kernel"].shape == (384, 6, 64)
  assert block["MultiHeadDotProductAttention_1"]["out"]["kernel"].shape == (6, 64, 384)
  assert shapes["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 5, 384)
  assert shapes["cls"].shape == (1, 1, 384)
  assert {"conv_root", "gn_root", "block1", "block4", "embedding", "head"} <= set(shapes)
  assert set(shapes["block1"]["unit1"]) == {
      "conv1", "conv2", "conv3", "gn1", "gn2", "gn3", "conv_proj", "gn_proj"}


@pytest.mark.parametrize("classifier,posemb,tokens", [
    ("token", "learn", 17), ("gap", "learn", 16), ("map", "learn", 16),
    ("token", "sincos2d", 17), ("gap", "sincos2d", 16)])
def test_options_and_aux_outputs(classifier, posemb, tokens):
  model = models.create_model("ViT-Ti_16", num_classes=5, classifier=classifier, posemb=posemb,
                              representation_size=24, patch_size=8, **TINY)
  images = jax.random.normal(jax.random.key(1), (3, 32, 32, 3))
  variables, (logits, aux) = init_apply(model, images, return_aux=True)
  assert logits.shape == (3, 5)
  assert aux["pre_logits"].shape == (3, 24)
  assert aux["encoded"].shape == (3, tokens, 32)
  assert ("posembed_input" in variables["params"]["Transformer"]) == (posemb == "learn")
  assert ("cls" in variables["params"]) == (classifier == "token")
  assert ("MAPHead_0" in variables["params"]) == (classifier == "map")
  # Zero-initialised head: logits equal the bias (0) at init.
  np.testing.assert_array_equal(logits, 0.0)


def test_attention_weights_are_returned_and_normalised():
  model = models.create_model("ViT-Ti_16", num_classes=5, patch_size=8, **TINY)
  images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  variables = model.init(jax.random.key(0), images)
  variables = noisy(variables, 0.1, 2)
  plain = model.apply(variables, images)
  logits, aux = model.apply(variables, images, return_attention=True)
  # The explicit-softmax path (needed for the weights) equals the fused path.
  np.testing.assert_allclose(logits, plain, atol=1e-5)
  attention = aux["attention"]
  assert len(attention) == 2 and attention[0].shape == (2, 4, 17, 17)
  np.testing.assert_allclose(np.sum(attention[-1], axis=-1), 1.0, atol=1e-5)


def test_hybrid_shapes_and_stride():
  model = models.create_model("R50+ViT-B_16", num_classes=3, **TINY)
  assert model.stride == 16
  images = jnp.zeros((1, 64, 64, 3))
  # Shapes only: abstract evaluation, not the full-width stem's hundreds of ops one by one.
  variables = jax.eval_shape(model.init, jax.random.key(0), images)
  logits, aux = jax.eval_shape(functools.partial(model.apply, return_aux=True), variables, images)
  assert logits.shape == (1, 3) and aux["encoded"].shape == (1, 1 + 16, 32)
  assert models.create_model("R+ViT-Ti_16").stride == 32
  assert models.create_model("R26+ViT-S_32").stride == 32


def test_bf16_computation_keeps_float32_params_and_is_close():
  kw = dict(num_classes=5, patch_size=8, **TINY)
  images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  f32 = models.create_model("ViT-Ti_16", **kw)
  variables = f32.init(jax.random.key(0), images)
  variables = noisy(variables, 0.05, 3)
  bf16 = models.create_model("ViT-Ti_16", dtype=jnp.bfloat16, **kw)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(
      bf16.init(jax.random.key(0), images)))
  out32, out16 = f32.apply(variables, images), bf16.apply(variables, images)
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(out16, out32, atol=3e-2, rtol=3e-2)


def test_remat_gives_identical_outputs_and_gradients():
  kw = dict(num_classes=5, patch_size=8, dropout=0.1, **TINY)
  images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  plain, remat = (models.create_model("ViT-Ti_16", remat=r, **kw) for r in (False, True))
  params = plain.init(jax.random.key(0), images)["params"]
  params = noisy(params, 0.05, 3)

  def loss(model, p):
    out = model.apply({"params": p}, images, train=True, rngs={"dropout": jax.random.key(4)})
    return jnp.sum(out**2)

  (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(functools.partial(loss, m)))(params)
                        for m in (plain, remat))
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  # Recomputation may fuse differently: equal up to float32 rounding.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g1, g2)


@pytest.mark.parametrize("fields", [{}, dict(layer_scale=True, classifier="gap", fc_norm=True)],
                         ids=["token", "LayerScale, gap + fc_norm"])
def test_a_bf16_residual_stream_is_the_float32_one_within_bf16_rounding(fields):
  """residual_dtype="bfloat16" (the pre-training configs'): the blocks' stream in 16 bits,
  the logits and every gradient within bf16 rounding of the float32 stream's; float32 the
  stream as ever, bit for bit."""
  kw = dict(num_classes=5, patch_size=8, dtype=jnp.bfloat16, **TINY, **fields)
  images = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
  f32, bf16 = (models.create_model("ViT-Ti_16", residual_dtype=r, **kw)
               for r in ("float32", "bfloat16"))
  params = noisy(f32.init(jax.random.key(0), images)["params"], 0.05, 3)
  stream = bf16.apply({"params": params}, images, mutable=["intermediates"])[1]
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(stream))

  def loss(model, p):
    return jnp.sum(model.apply({"params": p}, images) ** 2)

  (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(functools.partial(loss, m)))(params)
                        for m in (f32, bf16))
  assert l2.dtype == jnp.float32
  np.testing.assert_allclose(l2, l1, rtol=2e-2)
  # Each gradient within a few bf16 roundings in norm; the key bias's is zero but for
  # rounding (the softmax cancels it), in both.
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g2),
                        jax.tree.leaves(g1)):
    if "key" not in jax.tree_util.keystr(path[0]):
      assert np.linalg.norm(a - b) < 5e-2 * np.linalg.norm(b), jax.tree_util.keystr(path[0])
  with pytest.raises(ValueError, match="residual_dtype='float16', expected one of"):
    models.create_model("ViT-Ti_16", residual_dtype="float16", **kw).init(
        jax.random.key(0), images)


def test_dropout_is_active_only_in_training():
  model = models.create_model("ViT-Ti_16", num_classes=5, patch_size=8, dropout=0.5,
                              attention_dropout=0.5, **TINY)
  images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  variables = model.init(jax.random.key(0), images)
  variables = noisy(variables, 0.1, 2)
  np.testing.assert_array_equal(model.apply(variables, images), model.apply(variables, images))
  a, b = (model.apply(variables, images, train=True, rngs={"dropout": jax.random.key(k)})
          for k in (0, 1))
  assert not np.allclose(a, b)


def test_each_field_declares_its_role_and_the_lists_of_fields_follow():
  """A field of the model is declared once, with its Role: the training config's model group,
  checkpoint descriptions and a run's resume metadata hold the fields of their roles."""
  from vit_jax.checkpoint import loader
  from vit_jax.train import config as config_lib, run_setup
  Role, of = models.Role, lambda *roles: set(models.registry.fields_of(*roles))
  fields = dataclasses.fields(models.VisionTransformer)
  assert not [f.name for f in fields
              if f.name not in ("parent", "name") and not isinstance(f.metadata.get("role"), Role)]
  c = config_lib.base_config()
  c.model_name, c.lora.rank = "ViT-Ti_16", 4
  example = {int: 1, float: 0.5, bool: True, str: "x", tuple: (1,)}
  for field, kind in config_lib.MODEL_FIELDS.items():  # Typed as the command line sets them.
    c.model[field] = example[kind]
  assert set(c.model) == of(Role.ARCHITECTURE, Role.LAYOUT, Role.COMPUTATION, Role.PRE_LOGITS,
                            Role.INIT, Role.REGULARISATION, Role.EXECUTION)
  assert [config_lib.MODEL_FIELDS[f] for f in ("representation_size", "resnet_layers",
                                               "attention_impl")] == [int, tuple, str]
  meta = run_setup.run_meta(c, num_classes=10, total_steps=1, warmup_steps=0)
  assert set(meta["model"]) == of(Role.ARCHITECTURE, Role.LAYOUT, Role.COMPUTATION,
                                  Role.PRE_LOGITS, Role.INIT, Role.LORA)
  assert of(Role.REGULARISATION) <= set(meta["trajectory"])
  model = models.create_model("ViT-Ti_16", num_classes=10)
  described = loader.Loaded.from_model(model, {}, 224, "code").description
  assert set(described.model) == of(Role.ARCHITECTURE, Role.LAYOUT, Role.COMPUTATION,
                                    Role.PRE_LOGITS)


def test_unknown_model_lists_known_names():
  with pytest.raises(ValueError, match="Known models: .*ViT-B_16.*R50\\+ViT-B_16"):
    models.create_model("ViT-Q_16")


def test_unknown_option_is_named():
  with pytest.raises(ValueError, match="hiden_size"):
    models.create_model("ViT-B_16", hiden_size=3)


@pytest.mark.parametrize("shape,message", [
    ((32, 32, 3), "Expected images of shape \\(batch, height, width, 3\\)"),
    ((1, 32, 32, 1), "Expected images of shape \\(batch, height, width, 3\\)"),
    ((1, 36, 32, 3), "36x32 is not divisible by the model's patch stride 8: use a size that "
                     "is a multiple of 8, e.g. 32"),  # Unnamed: no "(model)" after the stride.
])
def test_bad_images_are_explained(shape, message):
  model = models.create_model("ViT-Ti_16", num_classes=5, patch_size=8, **TINY)
  with pytest.raises(ValueError, match=message):
    model.init(jax.random.key(0), jnp.zeros(shape))


@pytest.mark.parametrize("size, stride, fitted", [
    (384, 16, 384), (384, 14, 378), (384, 7, 385), (30, 7, 28), (3, 7, 7), (224, 32, 224)])
def test_a_size_is_fitted_to_the_nearest_multiple_of_the_stride(size, stride, fitted):
  """What every refusal of a size suggests and the fine-tuning recipe takes: one rule (the
  refusals suggested 378 for a patch-7 checkpoint at 384 px, vit-inspect and vit-transfer 385)."""
  assert models.fitted_size(size, stride) == fitted


def test_bad_classifier_is_explained():
  model = models.create_model("ViT-Ti_16", classifier="cls", patch_size=8, **TINY)
  with pytest.raises(ValueError, match="classifier='cls', expected one of"):
    model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


def test_stochastic_depth_keeps_the_parameter_tree_and_evaluation():
  images = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
  plain, deep = (models.create_model("ViT-Ti_16", num_classes=5, patch_size=8,
                                     stochastic_depth=r, **TINY) for r in (0.0, 0.5))
  variables = plain.init(jax.random.key(0), images)
  assert jax.tree.map(np.shape, deep.init(jax.random.key(0), images)) == jax.tree.map(
      np.shape, variables)
  variables = noisy(variables, 0.1, 2)
  np.testing.assert_array_equal(deep.apply(variables, images), plain.apply(variables, images))
  trained = deep.apply(variables, images, train=True, rngs={"dropout": jax.random.key(3)})
  assert not np.allclose(trained, plain.apply(variables, images))


def test_stochastic_depth_drops_whole_branches_per_example_at_linear_rates():
  layers, rate, n = 4, 0.4, 2048
  model = models.create_model("ViT-Ti_16", num_classes=2, patch_size=4, hidden_size=8,
                              mlp_dim=16, num_heads=2, num_layers=layers, stochastic_depth=rate)
  images = jax.random.normal(jax.random.key(1), (n, 8, 8, 3))
  variables = model.init(jax.random.key(0), images[:1])
  drop_paths = lambda m, _: isinstance(m, models.vit.DropPath)  # noqa: E731
  apply = jax.jit(functools.partial(  # 2,048 images: one program, not op by op.
      model.apply, train=True, capture_intermediates=drop_paths))
  _, state = apply(variables, images, rngs={"dropout": jax.random.key(2)})
  blocks = state["intermediates"]["Transformer"]
  for i in range(layers):
    branches = blocks[f"encoderblock_{i}"]
    assert len(branches) == 2  # Attention and MLP.
    for branch in branches.values():
      out = np.asarray(branch["__call__"][0]).reshape(n, -1)
      dropped = (out == 0).all(axis=1)
      assert ((out == 0).any(axis=1) == dropped).all()  # Whole examples, never parts.
      # Binomial(2048, p <= 0.4) has sd <= 0.011: 0.06 is > 5 sd (and the keys are fixed).
      assert abs(dropped.mean() - rate * (i + 1) / layers) < 0.06, (i, dropped.mean())
  with pytest.raises(ValueError, match=r"stochastic_depth=1.0, expected a rate in \[0, 1\)"):
    models.create_model("ViT-Ti_16", patch_size=8, stochastic_depth=1.0, **TINY).init(
        jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


# A model of each form the encoder takes (its blocks' arrays, the encoder's own), 3 blocks.
ENCODER_FORMS = {
    "plain": ("ViT-Ti_16", {}),
    "gap": ("ViT-S_16-gap-norep", {}),
    "hybrid": ("R+ViT-Ti_16", {}),
    "sincos2d": ("ViT-Ti_16", dict(posemb="sincos2d", fc_norm=True, classifier="gap")),
    "every_field": ("ViT-Ti_16", EVERY_FIELD),
    "lora": ("ViT-Ti_16", dict(lora_rank=2,
                               lora_targets=("query", "value", "out", "Dense_0", "Dense_1"))),
}


@pytest.mark.parametrize("form", ENCODER_FORMS)
def test_abstract_params_trace_one_block_and_give_the_whole_trace(form):
  """The same paths in the same order, shapes and dtypes as eval_shape of the whole model's
  init. Every registry entry's count goes through the same function in the timm-count test."""
  name, fields = ENCODER_FORMS[form]
  model = models.create_model(name, num_classes=10, num_layers=3, **fields)
  size = 4 * model.stride  # A 4x4 grid: rope's reference grid of 16 tokens.
  whole = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]
  traced = models.vit._trace_params(model, size)
  assert jax.tree_util.tree_flatten_with_path(traced) == (
      jax.tree_util.tree_flatten_with_path(whole))
  assert list(traced["Transformer"]) == list(whole["Transformer"])
  blocks = [traced["Transformer"][f"encoderblock_{i}"] for i in range(3)]
  assert blocks[1] is not blocks[0] and blocks[2] is not blocks[1]  # Each a tree of its own.


def test_abstract_params_are_traced_once_a_model_and_size_and_each_caller_gets_its_own():
  fields = dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1)
  model = models.create_model("R+ViT-Ti_16", num_classes=3, **fields)
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
  want = shapes(jax.eval_shape(model.init, jax.random.key(0),
                               jnp.zeros((1, 32, 32, 3)))["params"])
  cache = models.vit._traced_params
  first = models.abstract_params(model, 32)
  hits = cache.cache_info().hits
  first.pop("head")  # A caller's own tree: changing it changes no other caller's.
  again = models.abstract_params(dataclasses.replace(model), 32)  # An equal model.
  assert cache.cache_info().hits == hits + 1 and shapes(again) == want
  assert shapes(models.abstract_params(model, 64)) != want  # Another size: traced for it.
  # A list among the fields (a config's override) cannot key the cache: traced each time.
  listed = dataclasses.replace(model, resnet_layers=list(model.resnet_layers))
  assert shapes(models.abstract_params(listed, 32)) == want
