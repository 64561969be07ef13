"""What notebooks/explore_checkpoint.ipynb and `vit-inspect` compute: from a
loaded checkpoint (`loader.load`) and images, top-k labels, attention maps (rollout and
per head), the mean attention distance per head, position-embedding similarity and the
principal components of the patch-embedding filters (figures 6 and 7 of the ViT paper).
`vit_jax.figures` draws them.
"""
import glob
import json
import os
from typing import Any, Sequence

import jax
import numpy as np
import tensorflow as tf
from etils import epath

from vit_jax import models
from vit_jax.checkpoint import description, loader
from vit_jax.data import preprocess as pp
from vit_jax.data import sources
from vit_jax.serving.images import IMAGE_SUFFIXES
from vit_jax.serving.labels import label_names, top_k  # noqa: F401 (the notebook's names)


def load_images(source: str, split: str = "test", data_dir: str | None = None,
                limit: int = 8, download: bool = False
                ) -> tuple[list[np.ndarray], list[str], tuple[str, ...] | None]:
  """Up to `limit` images as uint8 (H, W, C), their captions and the dataset's class names.

  `source`: a glob of image files (captions: file names), or what config.data.name takes,
  a TFDS dataset or an image folder (captions: the true labels, from `split`).
  """
  files = sorted(f for f in glob.glob(os.path.expanduser(source)) if os.path.isfile(f))
  if files:
    files = files[:limit]
    images = [pp.decode(tf.io.read_file(f), 3).numpy() for f in files]
    return images, [os.path.basename(f) for f in files], None
  if any(c in source for c in "*?[") or source.lower().endswith(IMAGE_SUFFIXES):
    raise FileNotFoundError(f"No image files match {source!r}.")
  src = sources.get_source(source, data_dir, download, "skip", split, True)
  images, captions = [], []
  for ex in src.read(split, 0, 1).take(limit).as_numpy_iterator():
    images.append(pp.decode(ex["image"], src.channels).numpy())
    captions.append(src.class_names[ex["label"]])
  if not images:
    raise ValueError(f"No images in split {split!r} of {source}.")
  return images, captions, src.class_names


def preprocess(images: Sequence[np.ndarray], image_size: int,
               preprocessing: description.Preprocessing | tuple[float, float] = (
                   description.Preprocessing())) -> np.ndarray:
  """As the evaluation pipeline (`pp.apply_preprocessing`): fitted to image_size,
  grayscale to RGB, normalised as the checkpoint's description says
  (`ckpt.description.preprocessing`); a (low, high) pair stands for its value range."""
  if preprocessing is None:  # A description's value_range where it states mean and std.
    raise ValueError("explore.preprocess takes the checkpoint's Preprocessing "
                     "(ckpt.description.preprocessing): it normalises by mean and std.")
  if not isinstance(preprocessing, description.Preprocessing):
    preprocessing = description.Preprocessing(value_range=tuple(preprocessing))
  return np.stack([pp.apply_preprocessing(tf.constant(im), preprocessing, image_size).numpy()
                   for im in images])


def predict(ckpt: loader.Loaded, batch: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
  """(logits (B, classes), attention weights: per layer (B, heads, tokens, tokens))."""
  logits, aux = jax.jit(lambda params, x: ckpt.model.apply(
      {"params": params}, x, return_attention=True))(ckpt.params, batch)
  return np.asarray(logits), [np.asarray(a) for a in aux["attention"]]


def why_no_labels(model: models.VisionTransformer) -> str | None:
  """One line saying why the model's outputs name no classes, or None where they do: it has
  no head, or a head without bias, CLIP's projection into its image-text space."""
  if not model.num_classes:
    return "The checkpoint has no classification head: no labels to show."
  if not model.head_bias:
    return (f"The head is CLIP's projection to {model.num_classes}-d image embeddings, not a "
            "classifier: no labels to show.")
  return None


def attention_rollout(attention: Sequence[np.ndarray]) -> np.ndarray:
  """Attention rollout (Abnar & Zuidema, 2020): per layer, average the heads, add the
  identity for the residual path and renormalise the rows; multiply through the layers.

  attention: per layer (B, heads, T, T). Returns (B, T, T), each row a distribution over
  the input tokens.
  """
  rollout = None
  for a in attention:
    a = np.asarray(a, np.float64).mean(axis=1)
    a = a + np.eye(a.shape[-1])
    a = a / a.sum(axis=-1, keepdims=True)
    rollout = a if rollout is None else a @ rollout
  return rollout


def token_maps(matrix: np.ndarray, grid: tuple[int, int], num_prefix_tokens: int,
               from_class_token: bool) -> np.ndarray:
  """Where the representation looks: from (..., T, T) attention, the class token's row
  (`from_class_token`: the model pools by it) or else the mean of the patches' rows, over the
  patches, renormalised, as (..., h, w) maps. The first `num_prefix_tokens` (class token,
  registers: `model.num_prefix_tokens`) have no place in the image and are left out."""
  n = int(num_prefix_tokens)
  keys = matrix[..., n:]
  rows = keys[..., 0, :] if from_class_token else keys[..., n:, :].mean(axis=-2)
  if rows.shape[-1] != grid[0] * grid[1]:
    raise ValueError(f"{rows.shape[-1]} patch tokens do not fill a {grid[0]}x{grid[1]} grid.")
  rows = rows / rows.sum(axis=-1, keepdims=True)
  return rows.reshape(*rows.shape[:-1], *grid)


def patch_distances(grid: tuple[int, int], patch_px: float) -> np.ndarray:
  """(N, N) distances in pixels between the centres of a grid's N = h*w patches (row-major,
  the token order), `patch_px` pixels apart."""
  h, w = grid
  yx = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 2)
  return patch_px * np.linalg.norm(yx[:, None] - yx[None], axis=-1)


def mean_attention_distance(attention: Sequence[np.ndarray], grid: tuple[int, int],
                            patch_px: float, num_prefix_tokens: int) -> np.ndarray:
  """Mean attention distance (paper, figure 7 right and appendix D.7): per layer and head,
  the attention-weighted distance in pixels from a query patch to the patches it attends
  to, averaged over the query patches and the images. Returns (layers, heads).

  attention: per layer (B, heads, T, T), rows summing to 1. `patch_px` is the side of a
  token in input pixels (`model.stride`: the patch size, or what a hybrid's token covers).
  The first `num_prefix_tokens` (class token, registers: `model.num_prefix_tokens`) have no
  place in the image, so they are left out as queries and as keys, and each query's
  attention is renormalised over the patches: its distance is that of where it looks in the
  image. (Common re-implementations drop the class column without renormalising, which
  shrinks a head's distance by the share of attention it gives the class token. The paper
  does not say; neither the official code nor big_vision ships the computation.)
  """
  distances = patch_distances(grid, patch_px)
  n = int(num_prefix_tokens)
  out = []
  for a in attention:
    a = np.asarray(a)[..., n:, n:]
    if a.shape[-2:] != distances.shape:
      raise ValueError(f"Attention over {a.shape[-1]} patch tokens does not fit a "
                       f"{grid[0]}x{grid[1]} grid (num_prefix_tokens={n}).")
    mass = np.maximum(a.sum(axis=-1, dtype=np.float64), np.finfo(np.float64).tiny)
    weighted = np.einsum("bhqk,qk->bhq", a, distances.astype(a.dtype), dtype=np.float64)
    out.append((weighted / mass).mean(axis=(0, 2)))
  return np.stack(out)


def model_attention_distance(ckpt: loader.Loaded, batch: np.ndarray,
                             batch_size: int = 32) -> np.ndarray:
  """`mean_attention_distance` of the model over all of `batch` (preprocessed images), run
  `batch_size` images at a time: all layers' attention for many images at once would not
  fit (ViT-L/16 at 224 px: 24 layers x 16 heads x 197^2 floats = 60 MB per image)."""
  attend = jax.jit(lambda params, x: ckpt.model.apply(
      {"params": params}, x, return_attention=True)[1]["attention"])
  total = 0.0
  for start in range(0, len(batch), batch_size):
    part = batch[start:start + batch_size]
    attention = [np.asarray(a) for a in attend(ckpt.params, part)]
    total = total + len(part) * mean_attention_distance(
        attention, ckpt.grid, ckpt.model.stride, ckpt.model.num_prefix_tokens)
  return total / len(batch)


def position_embeddings(ckpt: loader.Loaded) -> np.ndarray:
  """The patches' position embeddings, (h, w, D): learned, or the fixed sin-cos ones. Raises
  ValueError for a model without one (posemb 'none', as DINOv3, whose rotary embedding turns
  the queries and keys instead)."""
  h, w = ckpt.grid
  if ckpt.model.posemb == "none":
    raise ValueError(f"The model has no position embedding (posemb='none', "
                     f"rope={ckpt.model.rope!r}).")
  if ckpt.model.posemb == "sincos2d":
    return models.posemb_sincos_2d(h, w, ckpt.model.hidden_size)[0].reshape(h, w, -1)
  pe = np.asarray(ckpt.params["Transformer"]["posembed_input"]["pos_embedding"])[0]
  return pe[len(pe) - h * w:].reshape(h, w, -1)  # After the class token's, if it has one.


def posemb_similarity(posemb: np.ndarray) -> np.ndarray:
  """Cosine similarity of each patch's position embedding to every other: (h, w, D) ->
  (h, w, h, w), [i, j] the map of patch (i, j)'s similarities (paper, figure 7 centre)."""
  h, w, d = posemb.shape
  e = posemb.reshape(h * w, d).astype(np.float64)
  e = e / np.linalg.norm(e, axis=-1, keepdims=True)
  return (e @ e.T).reshape(h, w, h, w)


def mosaic(maps: np.ndarray, pad: int = 1) -> np.ndarray:
  """(rows, cols, h, w) small maps -> one (rows*(h+pad)-pad, cols*(w+pad)-pad) image with
  NaN gutters, which imshow leaves blank: a grid of grids in a single draw call."""
  rows, cols, h, w = maps.shape
  out = np.full((rows * (h + pad) - pad, cols * (w + pad) - pad), np.nan)
  for i in range(rows):
    for j in range(cols):
      out[i * (h + pad):i * (h + pad) + h, j * (w + pad):j * (w + pad) + w] = maps[i, j]
  return out


def embedding_filters_pca(params: dict[str, Any], num: int = 28) -> tuple[np.ndarray, np.ndarray]:
  """Principal components of the patch-embedding filters (paper, figure 7 left).

  The D filters of the (P, P, C, D) embedding kernel are points in P*P*C dimensions;
  returns their top `num` principal directions as (num, P, P, C) and the fraction of the
  variance each explains.
  """
  kernel = np.asarray(params["embedding"]["kernel"], np.float64)
  p1, p2, c, d = kernel.shape
  if c != 3:
    raise ValueError(f"The patch embedding sees {c} channels (a hybrid's ResNet features), "
                     "not RGB pixels: its filters are not pictures.")
  filters = kernel.reshape(p1 * p2 * c, d).T
  filters = filters - filters.mean(axis=0)
  _, s, vt = np.linalg.svd(filters, full_matrices=False)
  num = min(num, len(s))
  explained = s**2 / np.sum(s**2)
  return vt[:num].reshape(num, p1, p2, c), explained[:num]


def to_unit_range(x: np.ndarray, axes: tuple[int, ...] = (-3, -2, -1)) -> np.ndarray:
  """Min-max scales each item to [0, 1] over `axes`, for imshow."""
  lo, hi = x.min(axis=axes, keepdims=True), x.max(axis=axes, keepdims=True)
  return (x - lo) / np.maximum(hi - lo, 1e-12)


def parse_overrides(text: str | None) -> dict[str, Any]:
  """Model field overrides from JSON text (a notebook parameter / environment variable)."""
  overrides = json.loads(text or "{}")
  if not isinstance(overrides, dict):
    raise ValueError(f"Model overrides must be a JSON object, got {text!r}.")
  return overrides
