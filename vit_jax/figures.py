"""The paper's analysis figures (figures 6 and 7 of "An Image is Worth 16x16 Words"): the
principal components of the patch-embedding filters, the similarity of the position
embeddings, the mean attention distance of every head against depth, and attention
rollout on images. `vit-inspect --figures` writes them as PNG; the explore
notebook shows them. `vit_jax.explore` computes what they draw.

Figures are built with matplotlib's object-oriented API (`Figure`, no pyplot): nothing is
shown or left open, `savefig` renders PNG with Agg on any machine, and a notebook shows a
figure left as a cell's value.
"""
from typing import Sequence

import matplotlib
import numpy as np
from etils import epath
from matplotlib.figure import Figure

from vit_jax import explore
from vit_jax.checkpoint import loader

FILES = {"filters": "embedding_filters.png", "posemb": "position_embedding_similarity.png",
         "distance": "mean_attention_distance.png", "rollout": "attention_rollout.png"}


def _title(ckpt: loader.Loaded) -> str:
  return ckpt.model.name_in_registry or "ViT"


def embedding_filters(ckpt: loader.Loaded, num: int = 28, cols: int = 7) -> Figure | None:
  """The principal components of the RGB patch-embedding filters, with the share of the
  variance each explains (figure 7, left); None for a hybrid, whose patch embedding sees
  ResNet features, not pixels."""
  if ckpt.model.resnet_layers is not None:
    return None
  components, explained = explore.embedding_filters_pca(ckpt.params, num)
  pictures = explore.to_unit_range(components)
  rows = -(-len(pictures) // cols)
  fig = Figure(figsize=(1.3 * cols, 1.4 * rows + 0.5), layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  for k, (ax, picture) in enumerate(zip(axes.flat, pictures)):
    ax.imshow(picture, interpolation="nearest")
    ax.set_title(f"{k}: {explained[k]:.1%}", fontsize=7)
  fig.suptitle(f"{_title(ckpt)}: principal components of the patch-embedding filters",
               fontsize=9)
  return fig


def position_similarity(ckpt: loader.Loaded) -> Figure | None:
  """Cosine similarity of each patch's position embedding with every other (figure 7,
  centre): tile (i, j) shows patch (i, j)'s similarity to all patches. None for a model
  without one (posemb 'none': DINOv3, whose rotary embedding turns the queries and keys)."""
  if ckpt.model.posemb == "none":
    return None
  similarity = explore.posemb_similarity(explore.position_embeddings(ckpt))
  side = min(8, 0.5 * ckpt.grid[0] + 2)
  fig = Figure(figsize=(side + 1, side), layout="constrained")
  ax = fig.subplots()
  image = ax.imshow(explore.mosaic(similarity), cmap="viridis", vmin=-1, vmax=1)
  fig.colorbar(image, ax=ax, label="cosine similarity", shrink=0.8)
  kind = "learned" if ckpt.model.posemb == "learn" else "fixed sin-cos"
  ax.set_title(f"{_title(ckpt)}: {kind} position embeddings, "
               f"{ckpt.grid[0]}x{ckpt.grid[1]} patches", fontsize=9)
  ax.axis("off")
  return fig


def attention_distance(distances: np.ndarray, ckpt: loader.Loaded,
                       num_images: int) -> Figure:
  """Mean attention distance (layers, heads) against depth, a dot per head (figure 7,
  right), and the distance of uniform attention over the grid for scale."""
  layers, heads = distances.shape
  depth = np.arange(1, layers + 1)
  colors = matplotlib.colormaps["viridis"](np.linspace(0, 1, heads))
  fig = Figure(figsize=(6.5, 4), layout="constrained")
  ax = fig.subplots()
  for h in range(heads):
    ax.scatter(depth, distances[:, h], s=16, color=colors[h], label=f"head {h + 1}")
  uniform = explore.patch_distances(ckpt.grid, ckpt.model.stride).mean()
  ax.axhline(uniform, color="gray", linestyle="--", linewidth=1, label="uniform attention")
  ax.set_xlabel("network depth (layer)")
  ax.set_ylabel("mean attention distance (pixels)")
  ax.set_ylim(0, 1.08 * max(uniform, distances.max()))
  ax.set_xticks(depth if layers <= 16 else depth[::2])
  ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5),
            ncols=1 + heads // 17)
  ax.set_title(f"{_title(ckpt)}: {ckpt.grid[0]}x{ckpt.grid[1]} tokens of "
               f"{ckpt.model.stride} px, {num_images} images", fontsize=9)
  return fig


def attention_rollout(batch: np.ndarray, attention: Sequence[np.ndarray],
                      ckpt: loader.Loaded, captions: Sequence[str] | None = None) -> Figure:
  """The images (preprocessed, as the model sees them) and, below, where the
  representation looks: attention rollout over all layers (figure 6)."""
  maps = explore.token_maps(explore.attention_rollout(attention), ckpt.grid,
                            ckpt.model.num_prefix_tokens, ckpt.has_class_token)
  shown = explore.to_unit_range(batch)
  extent = (-0.5, ckpt.image_size - 0.5, ckpt.image_size - 0.5, -0.5)  # Pixel edges.
  fig = Figure(figsize=(2.6 * len(batch), 5.4), layout="constrained")
  axes = fig.subplots(2, len(batch), squeeze=False)
  for i, image in enumerate(shown):
    axes[0, i].imshow(image)
    axes[1, i].imshow(image)
    axes[1, i].imshow(maps[i], extent=extent, cmap="inferno", alpha=0.6,
                      interpolation="bilinear")
    if captions is not None:
      axes[0, i].set_title(str(captions[i]), fontsize=9)
  for ax in axes.flat:
    ax.axis("off")
  return fig


def save(fig: Figure, path: str, dpi: int = 120) -> str:
  """Writes `fig` as PNG to `path` (local or any epath location, e.g. gs://)."""
  with epath.Path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=dpi)
  return str(path)


def images_batch(ckpt: loader.Loaded, images: str, split: str, data_dir: str | None,
                 num_images: int, download: bool) -> tuple[np.ndarray, list[str]]:
  """(`num_images` of a dataset or image folder preprocessed as `ckpt`'s description says,
  their captions): what `write` takes (`explore.load_images`, `explore.preprocess`)."""
  loaded, captions, _ = explore.load_images(images, split, data_dir, num_images, download)
  return explore.preprocess(loaded, ckpt.image_size, ckpt.description.preprocessing), captions


def write(ckpt: loader.Loaded, out_dir: str, batch: np.ndarray | None = None,
          captions: Sequence[str] | None = None, *, batch_size: int = 32,
          rollout_images: int = 4) -> tuple[dict[str, str], np.ndarray | None]:
  """Writes the figures as PNG into `out_dir`: the weights' own (filters, position
  embeddings) always, the attention distance over all of `batch` (preprocessed images) and
  the rollout of its first `rollout_images` when images are given. Returns ({figure: path},
  the mean attention distance (layers, heads) or None)."""
  figures = {"filters": embedding_filters(ckpt), "posemb": position_similarity(ckpt)}
  distances = None
  if batch is not None and len(batch):
    distances = explore.model_attention_distance(ckpt, batch, batch_size)
    figures["distance"] = attention_distance(distances, ckpt, len(batch))
    few = batch[:rollout_images]
    _, attention = explore.predict(ckpt, few)
    figures["rollout"] = attention_rollout(
        few, attention, ckpt, None if captions is None else captions[:rollout_images])
  epath.Path(out_dir).mkdir(parents=True, exist_ok=True)
  paths = {key: save(fig, str(epath.Path(out_dir) / FILES[key]))
           for key, fig in figures.items() if fig is not None}
  return paths, distances
