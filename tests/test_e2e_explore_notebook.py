"""notebooks/explore_checkpoint.ipynb run top to bottom on a checkpoint made here, on a tiny
DINOv2 with registers and a tiny CLIP tower from an offline Hub cache (random weights), with real
images (the handwritten digits of tests/data), and the position-embedding similarity it draws
of that checkpoint. The runs share one kernel, its namespace emptied before each
(helpers.notebook_kernel); the .npz's run first, in the new kernel, as a user's would be."""
import json
import os

import nbformat
import numpy as np
import pytest
from nbclient.exceptions import CellExecutionError

from helpers import REPO, notebook_kernel
from helpers import TINY_CONFIG_VIT as TINY
from helpers import tiny_params, write_repo
from vit_jax import explore, figures, models
from vit_jax.checkpoint import loader, npz
from vit_jax.models import timm_models  # noqa: F401  (conftest: torch before TensorFlow)

NOTEBOOK = REPO / "notebooks" / "explore_checkpoint.ipynb"
# Each checkpoint's line in the notebook's output, and whether its head names classes (CLIP's is
# its projection). The Hub repos are test_layouts_dinov2_clip.py's timm models.
# ViT-Ti_16 with TINY's overrides is no ViT-Ti_16: named by its shape.
SUMMARIES = {"npz": ("ViT with patch 7, width 32, depth 2, 2 heads, MLP 64 from",
                     "28px input, 4x4 patches of 7px", True),
             "dinov2_reg4": ("hf-hub:timm/dinov2_reg4", "98px input, 7x7 patches of 14px", True),
             "clip_openai": ("hf-hub:timm/clip_openai", "64px input, 4x4 patches of 16px", False)}


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt") / "tiny.npz"
  npz.save_npz(str(path), tiny_params()[1])
  return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """The kernel's Hub cache (offline), where the tests write the repos they explore."""
  return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def kernel(hub):
  with notebook_kernel(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1") as run:
    yield run


@pytest.fixture(scope="module")
def real_images(digits_folder) -> dict[str, str]:
  """Notebook parameters naming real images: the digits of tests/data, as an image folder."""
  return {"VIT_IMAGES": digits_folder}


def checkpoint_params(kind: str, tiny_npz, hub, tmp_path) -> dict[str, str]:
  """The notebook's CHECKPOINT and MODEL parameters for `kind` (SUMMARIES)."""
  if kind == "npz":
    return dict(VIT_CHECKPOINT=str(tiny_npz), VIT_MODEL="ViT-Ti_16",
                VIT_MODEL_OVERRIDES=json.dumps(TINY))
  import test_layouts_dinov2_clip
  _, folder, _ = test_layouts_dinov2_clip.timm_repo(tmp_path, kind)
  write_repo(hub, f"timm/{kind}", {f: folder / f for f in os.listdir(folder)})
  return dict(VIT_CHECKPOINT=f"hf-hub:timm/{kind}", VIT_MODEL="")


@pytest.mark.parametrize("kind", list(SUMMARIES))
def test_explore_notebook_runs_top_to_bottom(kind, kernel, tiny_npz, real_images, hub, tmp_path):
  nb = kernel(NOTEBOOK, VIT_NUM_IMAGES="3", VIT_SPLIT="test", VIT_DOWNLOAD="0",
              **checkpoint_params(kind, tiny_npz, hub, tmp_path), **real_images)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  source, geometry, classes = SUMMARIES[kind]
  assert source in text and geometry in text
  top5 = [line for line in text.splitlines() if line.count("%)") == 5]
  assert len(top5) == (3 if classes else 0)
  assert ("The head is CLIP's projection" in text) == (not classes)
  pictures = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(pictures) == 6  # Top-5, rollout, heads, attention distance, posemb, filters.


def test_position_cell_of_a_model_without_a_position_embedding(capsys):
  """The notebook's position-similarity cell on DINOv3's form (a rotary embedding, no learned
  one): one line, no figure."""
  cell = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
              if c.cell_type == "code" and "figures.position_similarity" in c.source)
  model = models.create_model("ViT-Ti_16", posemb="none", rope="dinov3")
  namespace = dict(figures=figures, ckpt=loader.Loaded.from_model(model, {}, 224, ""))
  exec(cell, namespace)
  assert namespace["similarity"] is None
  assert capsys.readouterr().out == ("No position embedding to compare (posemb='none', "
                                     "rope='dinov3').\n")


def test_explore_notebook_names_the_known_models(kernel, tiny_npz):
  with pytest.raises(CellExecutionError, match="Known models: ViT-Ti_16, ViT-S_16"):
    kernel(NOTEBOOK, VIT_CHECKPOINT=str(tiny_npz), VIT_MODEL="ViT-Q_16")


def test_posemb_similarity_of_a_checkpoint(tiny_npz):
  ckpt = loader.load(str(tiny_npz), "ViT-Ti_16", **TINY)
  learned = explore.position_embeddings(ckpt)
  stored = ckpt.params["Transformer"]["posembed_input"]["pos_embedding"][0, 1:]
  np.testing.assert_array_equal(learned.reshape(16, 32), stored)
  # Fixed sin-cos embeddings: nearer patches are more alike, as learned ones become.
  sincos = explore.posemb_similarity(explore.position_embeddings(
      loader.Loaded.from_model(models.create_model("ViT-Ti_16", posemb="sincos2d"), {}, 224,
                                   "")))
  assert sincos.shape == (14, 14, 14, 14)
  assert sincos[3, 3, 3, 3] > sincos[3, 3, 3, 4] > sincos[3, 3, 3, 8]
  assert sincos[3, 3, 4, 3] > sincos[3, 3, 8, 3]
