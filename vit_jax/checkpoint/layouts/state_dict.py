"""A framework's state dict, its arrays taken by name, each once, so that a layout reader can
refuse, by name, every array it did not use: no weight is dropped without a word. torch's
shapes of a Linear and a Conv2d come out in flax's."""
import re
from typing import Any, Iterator, Mapping

from absl import logging
import numpy as np

from vit_jax.checkpoint.errors import CheckpointError

_SHOWN = 8  # Unused names listed in the error; the rest counted.


class StateDict:
  """`take` hands out an array and marks it used; `check_all_used` refuses the rest."""

  def __init__(self, arrays: Mapping[str, Any], name: str):
    self.name = name
    self._left = dict(arrays)
    self._left_out = []  # leave_out's lines.

  def has(self, key: str) -> bool:
    return key in self._left

  def numbered(self, prefix: str, suffix: str) -> Iterator[int]:
    """0, 1, ... while `prefix`{i}`suffix` is left: the numbered layers (blocks, stages) a
    checkpoint holds, in order, up to the first one missing."""
    i = 0
    while self.has(f"{prefix}{i}{suffix}"):
      yield i
      i += 1

  def take(self, key: str) -> np.ndarray:
    if key not in self._left:
      raise CheckpointError(f"{self.name} lacks {key}, which its layout needs: the file is "
                            "incomplete or of a model this reader does not know.")
    return np.asarray(self._left.pop(key))

  def take_pair(self, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A norm's (weight, bias) as (scale, bias)."""
    return self.take(prefix + ".weight"), self.take(prefix + ".bias")

  def conv(self, key: str) -> np.ndarray:
    """A torch Conv2d weight (out, in, h, w) as a flax kernel (h, w, in, out)."""
    return self.take(key).transpose(2, 3, 1, 0)

  def linear(self, prefix: str, to: str) -> dict[str, np.ndarray]:
    """A torch Linear (weight (out, in), bias) as a flax Dense's `to`kernel (in, out), bias."""
    return {to + "kernel": self.take(prefix + ".weight").T,
            to + "bias": self.take(prefix + ".bias")}

  def leave_out(self, prefixes: tuple[str, ...], why: str) -> list[str]:
    """Sets aside the arrays under `prefixes` (a name ending in "." is a group, e.g. a CLIP
    repo's text tower): what the layout knows and does not load, named in one logged line
    once `check_all_used` passes (a refused file says only why it is refused). Returns their
    names."""
    names = sorted(k for k in self._left if k.startswith(prefixes))
    counts = {p: sum(n.startswith(p) for n in names) for p in prefixes}
    groups = [f"{p}* ({n} array{'s' * (n != 1)})" if p.endswith(".") else p
              for p, n in counts.items() if n]
    if groups:
      self._left_out.append(f"{why}; left out: {', '.join(groups)}")
    for name in names:
      del self._left[name]
    return names

  def check_all_used(self) -> None:
    if self._left:
      names = sorted(self._left)
      more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
      raise CheckpointError(f"{self.name} holds arrays this reader does not understand: "
                            f"{', '.join(names[:_SHOWN])}{more}. Nothing was loaded.")
    for line in self._left_out:
      logging.warning("%s: %s.", self.name, line)


def refuse_unsupported(keys: Any, unsupported: Mapping[str, str], source: str) -> None:
  """Refuses, by the first of their names, arrays matching a pattern of `unsupported` (regex ->
  what they hold): parts vit_jax's ViT has no place for, which no reader may drop."""
  for pattern, what in unsupported.items():
    found = sorted(k for k in keys if re.search(pattern, k))
    if found:
      raise CheckpointError(
          f"{source} uses {what} ({found[0]}{', ...' if len(found) > 1 else ''}), which vit_jax's "
          "ViT does not have: it cannot be loaded without changing its outputs.")
