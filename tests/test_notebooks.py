"""notebooks/: committed without outputs and run top to bottom on a checkpoint made here; and
vit_jax/explore.py, whose numbers the notebook draws."""
import json

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from nbclient.exceptions import CellExecutionError
from PIL import Image

from helpers import REPO, run_notebook
from vit_jax import checkpoint, explore, models

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
TINY = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


def tiny_params(seed: int = 0, **overrides) -> tuple[models.VisionTransformer, dict]:
  model = models.create_model("ViT-Ti_16", num_classes=10, **{**TINY, **overrides})
  params = model.init(jax.random.key(seed), jnp.zeros((1, 28, 28, 3)))["params"]
  # A random head, so that the top-5 are not a tie.
  params["head"]["kernel"] = jax.random.normal(jax.random.key(seed + 1),
                                               params["head"]["kernel"].shape)
  return model, params


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt") / "tiny.npz"
  checkpoint.save_npz(str(path), tiny_params()[1])
  return path


@pytest.fixture(scope="module")
def real_images(digits_folder) -> dict[str, str]:
  """Notebook parameters naming real images: scikit-learn's digits, as an image folder."""
  return {"VIT_IMAGES": digits_folder}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs_and_a_parameters_cell(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs == [] and c.execution_count is None for c in code)
  assert "parameters" in code[1].metadata.get("tags", [])


def test_explore_notebook_runs_top_to_bottom(tiny_npz, real_images, monkeypatch):
  nb = run_notebook(REPO / "notebooks" / "explore_checkpoint.ipynb", monkeypatch,
                    VIT_CHECKPOINT=str(tiny_npz), VIT_MODEL="ViT-Ti_16",
                    VIT_MODEL_OVERRIDES=json.dumps(TINY), VIT_NUM_IMAGES="3", VIT_SPLIT="test",
                    VIT_DOWNLOAD="0", **real_images)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "ViT-Ti_16 from" in text and "28px input, 4x4 patches of 7px" in text
  top5 = [line for line in text.splitlines() if line.count("%)") == 5]
  assert len(top5) == 3
  pictures = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(pictures) == 6  # Top-5, rollout, heads, attention distance, posemb, filters.


def test_explore_notebook_names_the_known_models(tiny_npz, monkeypatch):
  with pytest.raises(CellExecutionError, match="Known models: ViT-Ti_16, ViT-S_16"):
    run_notebook(REPO / "notebooks" / "explore_checkpoint.ipynb", monkeypatch,
                 VIT_CHECKPOINT=str(tiny_npz), VIT_MODEL="ViT-Q_16")


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
  checkpoint.save_npz(str(path), params)
  ckpt = checkpoint.load(str(path), "ViT-Ti_16", **TINY)
  assert ckpt.model.classifier == classifier and ckpt.grid == (4, 4)
  images = [np.full((28, 28, 1), 50, np.uint8), 255 * np.eye(28, dtype=np.uint8)[..., None]]
  batch = explore.preprocess(images, ckpt.image_size)
  _, attention = explore.predict(ckpt, batch)
  rollout = explore.attention_rollout(attention)
  assert rollout.shape == (2, tokens, tokens)
  assert (rollout >= 0).all()
  np.testing.assert_allclose(rollout.sum(-1), 1.0, atol=1e-6)
  maps = explore.token_maps(rollout, ckpt.grid, ckpt.has_class_token)
  heads = explore.token_maps(attention[-1], ckpt.grid, ckpt.has_class_token)
  assert maps.shape == (2, 4, 4) and heads.shape == (2, TINY["num_heads"], 4, 4)
  np.testing.assert_allclose(maps.sum((-2, -1)), 1.0, atol=1e-6)
  np.testing.assert_allclose(heads.sum((-2, -1)), 1.0, atol=1e-5)


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


def test_posemb_similarity_of_a_checkpoint(tiny_npz):
  ckpt = checkpoint.load(str(tiny_npz), "ViT-Ti_16", **TINY)
  learned = explore.position_embeddings(ckpt)
  stored = ckpt.params["Transformer"]["posembed_input"]["pos_embedding"][0, 1:]
  np.testing.assert_array_equal(learned.reshape(16, 32), stored)
  # Fixed sin-cos embeddings: nearer patches are more alike, as learned ones become.
  sincos = explore.posemb_similarity(explore.position_embeddings(
      checkpoint.Loaded.from_model(models.create_model("ViT-Ti_16", posemb="sincos2d"), {}, 224,
                                   "")))
  assert sincos.shape == (14, 14, 14, 14)
  assert sincos[3, 3, 3, 3] > sincos[3, 3, 3, 4] > sincos[3, 3, 3, 8]
  assert sincos[3, 3, 4, 3] > sincos[3, 3, 8, 3]


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
