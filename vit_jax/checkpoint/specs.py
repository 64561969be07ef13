"""The grammar of checkpoint paths: what names a checkpoint besides a file or folder.

  hf-hub:ORG/NAME[@REVISION]  a Hugging Face Hub repo (timm's spelling; `hub` reads it)
  a folder holding model.safetensors (or its sharded index): a Hub repo's files, local
  augreg:NAME                 an AugReg checkpoint by name (`augreg` resolves it)
  ema:RUN                     the moving average of a run's parameters (config.ema_decay),
                              RUN being its workdir (the latest step) or a step directory
  gs://..., other URLs        read where they are

Anything else is a local file or folder (an .npz, a run's workdir or step directory). The
command lines check paths with it before they start work, the library reads with it: no
other module spells a prefix.
"""
import os
from typing import Any

from vit_jax.checkpoint.errors import CheckpointError

HUB_PREFIX = "hf-hub:"
AUGREG_PREFIX = "augreg:"
EMA_PREFIX = "ema:"
# The weights of a Hub repo: one file, or shards named by an index.
HUB_WEIGHTS = "model.safetensors"
HUB_WEIGHTS_INDEX = "model.safetensors.index.json"
# OpenCLIP's own file (beside open_clip_config.json), read where a repo has no model.safetensors.
OPEN_CLIP_WEIGHTS = "open_clip_model.safetensors"


def is_hub(path: Any) -> bool:
  return isinstance(path, str) and path.startswith(HUB_PREFIX)


def is_hub_folder(path: Any) -> bool:
  """A local folder laid out as a Hub repo (what `hub.read` takes besides `hf-hub:` specs)."""
  return isinstance(path, (str, os.PathLike)) and any(
      os.path.isfile(os.path.join(path, f))
      for f in (HUB_WEIGHTS, HUB_WEIGHTS_INDEX, OPEN_CLIP_WEIGHTS))


def is_augreg(path: Any) -> bool:
  """Whether `path` names an AugReg checkpoint (`augreg:...`) rather than a file."""
  return isinstance(path, str) and path.startswith(AUGREG_PREFIX)


def is_ema(path: Any) -> bool:
  return isinstance(path, str) and path.startswith(EMA_PREFIX)


def without_ema(path: str) -> str:
  """`ema:RUN` -> RUN; any other path as it is."""
  return path.removeprefix(EMA_PREFIX)


def is_local(path: str) -> bool:
  """Whether `path` (through `ema:`) names a local file or folder: no spec, no URL."""
  return not is_hub(path) and not is_augreg(path) and "://" not in without_ema(path)


def absolute(path: str) -> str:
  """An existing local file or folder (through `ema:`) as an absolute path; any other path
  (a spec, a URL, nothing there) as it is."""
  bare = without_ema(path)
  if not os.path.exists(bare):
    return path
  return (EMA_PREFIX if is_ema(path) else "") + os.path.abspath(bare)


def hub(repo: str) -> str:
  """The spec of a Hub repo id (`ORG/NAME[@REVISION]`)."""
  return HUB_PREFIX + repo


def parse_hub(spec: str) -> tuple[str, str | None]:
  """`hf-hub:ORG/NAME[@REVISION]` -> (repo id, revision or None)."""
  repo, _, revision = spec.removeprefix(HUB_PREFIX).partition("@")
  if repo.count("/") != 1 or not all(repo.split("/")):
    raise CheckpointError(f"{spec!r} is not a Hub checkpoint: write {HUB_PREFIX}ORG/NAME[@REVISION], "
                          f"e.g. {HUB_PREFIX}timm/vit_base_patch16_224.augreg2_in21k_ft_in1k.")
  return repo, revision or None


def augreg(name: str) -> str:
  """The spec of an AugReg name or filename, prefixed or not."""
  return AUGREG_PREFIX + augreg_name(name)


def augreg_name(spec: str) -> str:
  """`augreg:NAME` (the prefix optional) -> NAME."""
  return spec.removeprefix(AUGREG_PREFIX)
