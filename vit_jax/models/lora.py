"""LoRA (Hu et al., 2021): a frozen kernel W adapted as W + alpha/rank * A @ B, with A
(in, rank) and B (rank, out) trained. The adapters sit beside the kernel they adapt
(`.../query/lora_a`, `.../query/lora_b`), and `merge` folds them into it, after which the
model is a plain ViT again (for export, few-shot, serving); `merged` does so to a checkpoint's
params and model fields, as the checkpoint readers take a LoRA run.
"""
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

# The kernels that can be adapted, by module name inside an encoder block: the attention
# projections and the MLP's two layers.
TARGETS = ("query", "key", "value", "out", "Dense_0", "Dense_1")
DEFAULT_TARGETS = ("query", "value")  # The LoRA paper's choice for attention.
# What a LoRA run trains: the adapters and the head; everything else is frozen.
TRAINED = (r".*/lora_[ab]", r"head/.*")
# VisionTransformer's fields of the adapters (Role.LORA), which a merged model no longer has.
FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
_ADAPTER = re.compile(r"(.*)/lora_([ab])$")


def check(rank: int, alpha: float | None, targets: Sequence[str]) -> None:
  """Raises ValueError for a rank < 0, an alpha <= 0 or an unknown target."""
  if rank < 0:
    raise ValueError(f"lora rank={rank}: expected >= 0 (0: off).")
  if alpha is not None and alpha <= 0:
    raise ValueError(f"lora alpha={alpha}: expected > 0 (None: the rank).")
  unknown = [t for t in targets if t not in TARGETS]
  if unknown or (rank and not targets):
    raise ValueError(f"lora targets={tuple(targets)}: expected one or more of {TARGETS}.")


def scale(rank: int, alpha: float | None) -> float:
  """alpha / rank, the factor of A @ B (alpha defaults to the rank: a factor of 1)."""
  return (alpha if alpha is not None else rank) / rank


class Adapted(nn.Module):
  """`base` (an nn.Dense or nn.DenseGeneral) plus its low-rank update, in base's scope: the
  parameters are base's `kernel` and `bias` and `lora_a`, `lora_b` beside them.

  A starts as in the reference implementation (uniform, bound 1/sqrt(in)), B at zero, so an
  adapted model computes what its base does until B is trained.
  """

  base: nn.Module
  rank: int
  factor: float

  def setup(self):
    nn.share_scope(self, self.base)

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    axis = getattr(self.base, "axis", -1)
    num_in = len(axis) if isinstance(axis, tuple) else 1
    features = self.base.features
    out_shape = features if isinstance(features, tuple) else (features,)
    flat_in = x.reshape(x.shape[:x.ndim - num_in] + (-1,))
    a = self.param("lora_a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                   (flat_in.shape[-1], self.rank))
    b = self.param("lora_b", nn.initializers.zeros, (self.rank, int(np.prod(out_shape))))
    dtype = self.base.dtype or jnp.float32
    update = (flat_in.astype(dtype) @ a.astype(dtype)) @ b.astype(dtype)
    update = update.reshape(flat_in.shape[:-1] + out_shape)
    return self.base(x) + (self.factor * update).astype(dtype)


def adapt(base: nn.Module, lora: "tuple[int, float, tuple[str, ...]] | None") -> nn.Module:
  """`base` wrapped in its adapter where `lora` = (rank, factor, targets) names it."""
  if lora is None or base.name not in lora[2]:
    return base
  return Adapted(base, lora[0], lora[1])


def is_adapter(name: str) -> bool:
  return bool(_ADAPTER.match(name))


def merge(flat: Mapping[str, Any], factor: float) -> dict[str, Any]:
  """Flat params ("/"-joined names) with every adapter folded into its kernel:
  kernel + factor * A @ B, in float32; the adapters are gone."""
  out = {k: v for k, v in flat.items() if not is_adapter(k)}
  for key in flat:
    if (m := _ADAPTER.match(key)) and m.group(2) == "a":
      kernel = np.asarray(out[f"{m.group(1)}/kernel"], np.float32)
      a = np.asarray(flat[key], np.float32)
      b = np.asarray(flat[f"{m.group(1)}/lora_b"], np.float32)
      out[f"{m.group(1)}/kernel"] = kernel + factor * (a @ b).reshape(kernel.shape)
  return out


def merged(flat: Mapping[str, Any], fields: Mapping[str, Any]
           ) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
  """A model with adapters, its flat params and model fields (as a checkpoint's description
  holds them), as the plain ViT it makes: adapters merged, the LoRA fields gone. A model
  without adapters (no `lora_rank`) comes back as it is."""
  rank = fields.get("lora_rank")
  if not rank:
    return flat, fields
  plain = {k: v for k, v in fields.items() if k not in FIELDS}
  return merge(flat, scale(rank, fields.get("lora_alpha"))), plain


def adapters(flat: Mapping[str, Any]) -> dict[str, Any]:
  """The arrays a LoRA run trains (adapters and head): what it adds to its base checkpoint."""
  return {k: v for k, v in flat.items() if any(re.fullmatch(p, k) for p in TRAINED)}
