"""The position embeddings added to the patch tokens: learned (one per token, class token
included; resampled to the input's grid at run time with `dynamic`), or fixed 2-D sin-cos."""
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from vit_jax.models import posemb_resize


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.) -> np.ndarray:
  """Fixed 2-D sin-cos position embedding, (1, h*w, width), as in big_vision."""
  if width % 4:
    raise ValueError(f"sincos2d position embedding needs hidden_size % 4 == 0, got {width}.")
  y, x = np.mgrid[:h, :w]
  omega = np.arange(width // 4) / (width // 4 - 1)
  omega = 1. / (temperature**omega)
  y = np.einsum("m,d->md", y.flatten(), omega)
  x = np.einsum("m,d->md", x.flatten(), omega)
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return pe[None].astype(np.float32)


class AddPositionEmbs(nn.Module):
  """Adds a learned position embedding, one per token (class token included).

  With `dynamic`, the stored embedding's square patch grid is resampled (posemb_resize's
  `interpolation`) to the input's `grid`: any resolution at run time, as if the checkpoint
  had been loaded at that resolution.
  """

  grid: tuple[int, int]
  num_prefix: int = 0  # Tokens before the patches' (the class token).
  dynamic: bool = False
  interpolation: str = "bilinear"

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    shape = (1,) + x.shape[1:]
    if self.has_variable("params", "pos_embedding"):
      stored = self.get_variable("params", "pos_embedding")
      if stored.shape != shape:
        if not self.dynamic:
          raise ValueError(
              f"The position embedding has {stored.shape[1]} tokens, the input gives "
              f"{shape[1]} ({self.grid[0]}x{self.grid[1]} patches): load the checkpoint at "
              "this image_size, or build the model with dynamic_image_size=True.")
        return x + self._resampled(stored)
    return x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), shape)

  def _resampled(self, stored: jnp.ndarray) -> jnp.ndarray:
    prefix, grid = stored[:, :self.num_prefix], stored[0, self.num_prefix:]
    side = int(np.sqrt(grid.shape[0]))
    if side * side != grid.shape[0]:
      raise ValueError(f"dynamic_image_size: the position embedding's {grid.shape[0]} patches "
                       "are not a square grid.")
    grid = posemb_resize.resample(grid.reshape(side, side, -1), self.grid, self.interpolation)
    return jnp.concatenate([prefix, grid.reshape((1, -1, grid.shape[-1]))], axis=1)
