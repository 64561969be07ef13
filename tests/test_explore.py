"""vit_jax/explore.py, whose numbers the notebook and vit-inspect draw: attention weights and
their rollout, token maps, position-embedding similarity, mosaics, the patch embedding's
filters, top-k labels, images read from files, the mean attention distance on known answers,
and the figures vit-inspect writes of a DINOv3 (registers, no learned position embedding). The
explore notebook is run top to bottom, on DINOv2 and CLIP repos too, by
test_e2e_explore_notebook.py."""
import itertools
import math

import jax
import numpy as np
import pytest
from PIL import Image

from helpers import TINY_CONFIG_VIT as TINY
from helpers import tiny_params
from vit_jax import explore, figures, models
from vit_jax.checkpoint import loader, npz


def test_attention_weights_sum_to_one_per_query():
  model, params = tiny_params()
  images = jax.random.normal(jax.random.key(2), (3, 28, 28, 3))
  logits, aux = model.apply({"params": params}, images, return_attention=True)
  assert logits.shape == (3, 10) and len(aux["attention"]) == TINY["num_layers"]
  for a in aux["attention"]:
    assert a.shape == (3, TINY["num_heads"], 17, 17)
    assert (np.asarray(a) >= 0).all()
    np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("classifier,tokens", [("token", 17), ("gap", 16)])
def test_rollout_rows_sum_to_one_and_maps_fill_the_grid(tmp_path, classifier, tokens):
  model, params = tiny_params(classifier=classifier)
  path = tmp_path / "ckpt.npz"
  npz.save_npz(str(path), params)
  ckpt = loader.load(str(path), "ViT-Ti_16", **TINY)
  assert ckpt.model.classifier == classifier and ckpt.grid == (4, 4)
  images = [np.full((28, 28, 1), 50, np.uint8), 255 * np.eye(28, dtype=np.uint8)[..., None]]
  batch = explore.preprocess(images, ckpt.image_size)
  _, attention = explore.predict(ckpt, batch)
  rollout = explore.attention_rollout(attention)
  assert rollout.shape == (2, tokens, tokens)
  assert (rollout >= 0).all()
  np.testing.assert_allclose(rollout.sum(-1), 1.0, atol=1e-6)
  prefix = ckpt.model.num_prefix_tokens
  maps = explore.token_maps(rollout, ckpt.grid, prefix, ckpt.has_class_token)
  heads = explore.token_maps(attention[-1], ckpt.grid, prefix, ckpt.has_class_token)
  assert maps.shape == (2, 4, 4) and heads.shape == (2, TINY["num_heads"], 4, 4)
  np.testing.assert_allclose(maps.sum((-2, -1)), 1.0, atol=1e-6)
  np.testing.assert_allclose(heads.sum((-2, -1)), 1.0, atol=1e-5)


def test_token_maps_leave_the_class_token_and_registers_out():
  """Tokens: the class token, 4 registers, 2x3 patches. The class token looks half at the
  registers, half at patch 2; every patch mostly at a register, the rest at patch 4."""
  prefix, grid = 5, (2, 3)
  t = prefix + 6
  attention = np.zeros((1, t, t))
  attention[0, 0, 1:prefix], attention[0, 0, prefix + 2] = 0.5 / 4, 0.5
  attention[0, prefix:, 1], attention[0, prefix:, prefix + 4] = 0.8, 0.2
  np.testing.assert_allclose(explore.token_maps(attention, grid, prefix, True)[0],
                             np.eye(6)[2].reshape(grid))
  # Mean pooling beside a class token (DINOv3): the patches' rows alone.
  np.testing.assert_allclose(explore.token_maps(attention, grid, prefix, False)[0],
                             np.eye(6)[4].reshape(grid))


def test_rollout_multiplies_later_layers_on_the_left():
  """Layer 1: every token attends to token 1; layer 2: to token 2 (T=4, one head)."""
  t = 4
  to = lambda j: np.tile(np.eye(t)[j], (1, 1, t, 1))  # (1, heads=1, T, T)
  rollout = explore.attention_rollout([to(1), to(2)])[0]
  # (I + E2)/2 @ (I + E1)/2: token 0 keeps 1/4 of itself, gets 1/2 from token 1 (via both
  # layers) and 1/4 from token 2. The reverse order would give [1/4, 1/4, 1/2, 0].
  np.testing.assert_allclose(rollout[0], [0.25, 0.5, 0.25, 0.0])
  uniform = [np.full((1, 3, t, t), 1 / t)] * 3
  expected = np.linalg.matrix_power((np.full((t, t), 1 / t) + np.eye(t)) / 2, 3)
  np.testing.assert_allclose(explore.attention_rollout(uniform)[0], expected)
  np.testing.assert_allclose(explore.attention_rollout([np.eye(t)[None, None]] * 5)[0],
                             np.eye(t))


def test_posemb_similarity_of_a_patch_with_itself_is_one():
  posemb = np.random.default_rng(0).normal(size=(5, 6, 16))
  sim = explore.posemb_similarity(posemb)
  assert sim.shape == (5, 6, 5, 6)
  diagonal = sim.reshape(30, 30).diagonal()
  np.testing.assert_allclose(diagonal, 1.0, atol=1e-12)
  np.testing.assert_allclose(sim.reshape(30, 30), sim.reshape(30, 30).T)
  assert np.abs(sim).max() <= 1 + 1e-12


def test_mosaic_tiles_the_maps_with_blank_gutters():
  maps = np.arange(2 * 3 * 4 * 5, dtype=float).reshape(2, 3, 4, 5)
  image = explore.mosaic(maps)
  assert image.shape == (2 * 5 - 1, 3 * 6 - 1)
  np.testing.assert_array_equal(image[5:9, 12:17], maps[1, 2])
  assert np.isnan(image[4]).all() and np.isnan(image[:, 5]).all()


def test_embedding_filters_pca_finds_the_main_direction():
  rng = np.random.default_rng(0)
  direction = rng.normal(size=7 * 7 * 3)
  direction /= np.linalg.norm(direction)
  kernel = (np.outer(direction, 5 * rng.normal(size=64)) +
            0.01 * rng.normal(size=(7 * 7 * 3, 64))).reshape(7, 7, 3, 64)
  components, explained = explore.embedding_filters_pca({"embedding": {"kernel": kernel}}, num=10)
  assert components.shape == (10, 7, 7, 3)
  flat = components.reshape(10, -1)
  np.testing.assert_allclose(flat @ flat.T, np.eye(10), atol=1e-10)
  assert abs(flat[0] @ direction) > 0.999 and explained[0] > 0.99
  assert (np.diff(explained) <= 0).all() and explained.sum() <= 1
  pictures = explore.to_unit_range(components)
  assert pictures.min() == 0 and pictures.max() == 1
  with pytest.raises(ValueError, match="ResNet features"):
    explore.embedding_filters_pca({"embedding": {"kernel": np.zeros((1, 1, 1024, 64))}})


def test_position_embeddings_are_the_patches_and_a_model_without_them_says_so():
  # EVA-02's: mean pooling beside a class token, whose embedding comes first.
  model, params = tiny_params(classifier="gap", class_token=True)
  stored = np.asarray(params["Transformer"]["posembed_input"]["pos_embedding"])[0]
  assert stored.shape == (17, TINY["hidden_size"])
  learned = explore.position_embeddings(loader.Loaded.from_model(model, params, 28, ""))
  np.testing.assert_array_equal(learned.reshape(16, -1), stored[1:])
  model, params = tiny_params(posemb="none", rope="dinov3")  # DINOv3's.
  rotary = loader.Loaded.from_model(model, params, 28, "")
  with pytest.raises(ValueError, match="no position embedding .posemb='none', rope='dinov3'"):
    explore.position_embeddings(rotary)
  assert figures.position_similarity(rotary) is None


def test_why_no_labels():
  assert explore.why_no_labels(models.create_model("ViT-Ti_16", num_classes=10)) is None
  assert explore.why_no_labels(models.create_model("ViT-Ti_16", num_classes=None)) == (
      "The checkpoint has no classification head: no labels to show.")
  clip = models.create_model("ViT-Ti_16", num_classes=512, head_bias=False)
  assert explore.why_no_labels(clip) == ("The head is CLIP's projection to 512-d image "
                                         "embeddings, not a classifier: no labels to show.")


def test_figures_of_dinov3(tmp_path):
  """vit-inspect's figures of a model with a class token beside mean pooling, storage tokens
  (registers) and a rotary embedding, without a learned one: all but the position embedding's."""
  model, params = tiny_params(classifier="gap", class_token=True, num_registers=4,
                              posemb="none", rope="dinov3", layer_scale=True)
  ckpt = loader.Loaded.from_model(model, params, 28, "")
  images = [np.full((28, 28, 1), 50, np.uint8), 255 * np.eye(28, dtype=np.uint8)[..., None]]
  paths, distances = figures.write(ckpt, str(tmp_path), explore.preprocess(images, 28))
  assert set(paths) == {"filters", "distance", "rollout"}
  assert distances.shape == (TINY["num_layers"], TINY["num_heads"]) and (distances > 0).all()


def test_top_k_and_label_names(tmp_path):
  logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
  top = explore.top_k(logits, ["a", "b", "c"], k=2)
  assert [[n for n, _ in row] for row in top] == [["b", "c"], ["a", "c"]]
  np.testing.assert_allclose([p for _, p in top[0]], [0.6, 0.3])
  sig = explore.top_k(np.array([[0.0, 2.0]]), ["a", "b"], k=1, sigmoid=True)
  np.testing.assert_allclose(sig[0][0][1], 1 / (1 + np.exp(-2.0)))
  (tmp_path / "labels.txt").write_text("cat\ndog\n")
  assert explore.label_names(2, str(tmp_path / "labels.txt")) == ["cat", "dog"]
  with pytest.raises(ValueError, match="names 2 classes; the model has 3"):
    explore.label_names(3, str(tmp_path / "labels.txt"))
  assert explore.label_names(2, None, ("x", "y")) == ["x", "y"]
  assert explore.label_names(3, None, ("x", "y")) == ["class 0", "class 1", "class 2"]


def test_load_images_from_files(tmp_path):
  Image.fromarray(np.full((20, 30), 200, np.uint8)).save(tmp_path / "gray.png")
  Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(tmp_path / "rgb.png")
  images, captions, names = explore.load_images(str(tmp_path / "*.png"))
  assert captions == ["gray.png", "rgb.png"] and names is None
  assert [im.shape for im in images] == [(20, 30, 3), (10, 10, 3)]
  batch = explore.preprocess(images, 28)
  assert batch.shape == (2, 28, 28, 3) and batch.dtype == np.float32
  np.testing.assert_allclose(batch[0], 200 / 255 * 2 - 1, atol=1e-5)
  np.testing.assert_allclose(batch[1], -1.0)
  with pytest.raises(FileNotFoundError, match="No image files match"):
    explore.load_images(str(tmp_path / "*.jpg"))
  with pytest.raises(ValueError, match="neither a TFDS dataset nor an existing directory"):
    explore.load_images("no_such_dataset")


# Mean attention distance on attention patterns with known answers.

def with_prefix(patch_attention: np.ndarray, prefix: int, to_prefix: float) -> np.ndarray:
  """(..., N, N) rows over the patches -> (..., P+N, P+N) with P prefix tokens (class token,
  registers): every patch row gives `to_prefix` of its attention to them; their own rows are
  uniform."""
  *lead, n, _ = patch_attention.shape
  out = np.zeros((*lead, prefix + n, prefix + n))
  out[..., :prefix, :] = 1 / (prefix + n)
  out[..., prefix:, :prefix] = to_prefix / prefix
  out[..., prefix:, prefix:] = (1 - to_prefix) * patch_attention
  return out


def mean_pairwise_distance(h: int, w: int, patch_px: float) -> float:
  """Over all ordered pairs of patches (a patch with itself included), by enumeration."""
  cells = list(itertools.product(range(h), range(w)))
  total = sum(math.hypot(a[0] - b[0], a[1] - b[1]) for a in cells for b in cells)
  return patch_px * total / len(cells)**2


@pytest.mark.parametrize("prefix", [0, 1, 5])  # None; a class token; and 4 registers.
def test_attending_only_to_itself_is_distance_zero(prefix):
  n = 12
  attention = np.tile(np.eye(n), (2, 3, 1, 1))  # (images, heads, N, N)
  if prefix:  # Most attention on the class token and registers does not move the answer.
    attention = with_prefix(attention, prefix, to_prefix=0.9)
  distances = explore.mean_attention_distance([attention] * 4, (3, 4), 16, prefix)
  assert distances.shape == (4, 3)
  np.testing.assert_array_equal(distances, 0)


@pytest.mark.parametrize("grid", [(2, 2), (4, 4), (3, 5)])
def test_uniform_attention_is_the_mean_pairwise_distance(grid):
  n = grid[0] * grid[1]
  patches_only = np.full((1, 2, n, n), 1 / n)
  uniform_over_tokens = np.full((1, 2, n + 1, n + 1), 1 / (n + 1))
  expected = mean_pairwise_distance(*grid, patch_px=16)
  for attention, prefix in ((patches_only, 0), (uniform_over_tokens, 1)):
    distances = explore.mean_attention_distance([attention], grid, 16, prefix)
    np.testing.assert_allclose(distances, expected, rtol=1e-12)
  # 2x2: from each patch, itself (0), two neighbours (1) and the diagonal (sqrt 2), x16 px.
  if grid == (2, 2):
    np.testing.assert_allclose(expected, 16 * (2 + math.sqrt(2)) / 4)


def test_heads_layers_and_images_are_kept_apart_and_averaged():
  """Head 0 attends to the patch on its right (itself in the last column): (w-1)/w patches
  away on average; head 1 to itself. Images: the two swap heads, so the mean is half."""
  h, w, px = 3, 4, 10
  right = np.zeros((h * w, h * w))
  for q in range(h * w):
    right[q, q + 1 if q % w < w - 1 else q] = 1
  image_0 = np.stack([right, np.eye(h * w)])
  image_1 = image_0[::-1]
  one = explore.mean_attention_distance([image_0[None]], (h, w), px, 0)
  np.testing.assert_allclose(one, [[px * (w - 1) / w, 0]])
  both = explore.mean_attention_distance(
      [np.stack([image_0, image_1]), np.stack([image_0, image_0])], (h, w), px, 0)
  np.testing.assert_allclose(both, [[px * (w - 1) / w / 2] * 2, [px * (w - 1) / w, 0]])
  with pytest.raises(ValueError, match="does not fit a 3x3 grid"):
    explore.mean_attention_distance([image_0[None]], (3, 3), px, 0)
