"""A patch-embedding kernel for another patch size: FlexiViT's pseudo-inverse resize (Beyer et
al., 2023, "FlexiViT", Sec. 3.4; big_vision's `resample_patchemb`).

A patch of the new size that is the bilinear resize of an old-size patch gives the same token
through the new kernel as the old patch through the old kernel: for upsampling exactly, for
downsampling in the least-squares sense. So a checkpoint runs at another patch size on images
resized by the same factor.
"""
import functools

import jax
import numpy as np


@functools.lru_cache(maxsize=16)
def resize_matrix(old_hw: tuple[int, int], new_hw: tuple[int, int]) -> np.ndarray:
  """(new_h * new_w, old_h * old_w): bilinear resize (half-pixel centres, no antialiasing, as
  tf.image.resize) of a flattened old-size patch."""
  basis = np.eye(old_hw[0] * old_hw[1], dtype=np.float32).reshape(-1, *old_hw)
  resized = jax.vmap(lambda b: jax.image.resize(b, new_hw, "bilinear", antialias=False))(basis)
  return np.asarray(resized, np.float64).reshape(len(basis), -1).T


def pi_resize(kernel: np.ndarray, new_hw: tuple[int, int]) -> np.ndarray:
  """A (h, w, in, out) patch-embedding kernel resampled to (new_h, new_w, in, out)."""
  old_hw, new_hw = tuple(kernel.shape[:2]), tuple(new_hw)
  if old_hw == new_hw:
    return kernel
  pinv = np.linalg.pinv(resize_matrix(old_hw, new_hw).T)  # (new, old)
  flat = np.asarray(kernel, np.float64).reshape(old_hw[0] * old_hw[1], -1)
  return (pinv @ flat).reshape(*new_hw, *kernel.shape[2:]).astype(kernel.dtype)
