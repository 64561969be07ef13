"""notebooks/explore_checkpoint.ipynb run top to bottom on a checkpoint made here and real
images (the handwritten digits of tests/data), and the position-embedding similarity it draws
of that checkpoint."""
import json

import numpy as np
import pytest
from nbclient.exceptions import CellExecutionError

from helpers import REPO, run_notebook
from helpers import TINY_CONFIG_VIT as TINY
from helpers import tiny_params
from vit_jax import checkpoint, explore, models


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt") / "tiny.npz"
  checkpoint.save_npz(str(path), tiny_params()[1])
  return path


@pytest.fixture(scope="module")
def real_images(digits_folder) -> dict[str, str]:
  """Notebook parameters naming real images: the digits of tests/data, as an image folder."""
  return {"VIT_IMAGES": digits_folder}


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
