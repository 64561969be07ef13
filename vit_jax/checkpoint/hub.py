"""Checkpoints on the Hugging Face Hub, `hf-hub:ORG/NAME[@REVISION]` (timm's spelling), and
local folders holding the same files: `config.json` beside `model.safetensors` (or its sharded
index), `preprocessor_config.json` where transformers wrote one; or OpenCLIP's own,
`open_clip_config.json` beside `open_clip_model.safetensors`, where there is no
`model.safetensors`.

huggingface_hub downloads them, with its own cache and settings (`HF_HOME`, `HF_HUB_CACHE`,
`HF_HUB_OFFLINE`, `HF_TOKEN` for gated repos); safetensors' numpy reader opens them (no
torch). The layout is told from the arrays' names (`layouts.LAYOUTS`: timm's ViT,
transformers' ViT), converted in memory to the released one, and described from the repo's
config files.
"""
import dataclasses
import json
import os
import pathlib
from typing import Any

import numpy as np

from vit_jax.checkpoint import layouts, npz, specs
from vit_jax.checkpoint.description import Description
from vit_jax.checkpoint.errors import CheckpointError

CONFIG = "config.json"
PROCESSOR = "preprocessor_config.json"
OPEN_CLIP_CONFIG = "open_clip_config.json"  # Beside specs.OPEN_CLIP_WEIGHTS.


def _hub_error(e: Exception, repo: str, filename: str) -> CheckpointError | None:
  """One line saying what to do, for each way huggingface_hub fails; None: re-raise."""
  from huggingface_hub import constants, errors
  page, spec = f"https://huggingface.co/{repo}", specs.hub(repo)
  if isinstance(e, errors.GatedRepoError):
    return CheckpointError(f"{spec} is gated: accept its terms at {page} while logged "
                           "in, then set HF_TOKEN (or run `hf auth login`) and retry.")
  if isinstance(e, errors.RepositoryNotFoundError):
    return CheckpointError(f"{spec}: no such repository on the Hugging Face Hub (a "
                           "private one needs HF_TOKEN): check the name at " + page)
  if isinstance(e, errors.RevisionNotFoundError):
    return CheckpointError(f"{spec}: no such revision; see {page}/tree/main for branches.")
  if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
    how = ("HF_HUB_OFFLINE is set: unset it, or download it first where the Hub is reachable "
           f"(`hf download {repo}`)" if constants.HF_HUB_OFFLINE else
           f"the Hub could not be reached: retry, or `hf download {repo}` where it can")
    return CheckpointError(f"{spec}: {filename} is not in the Hugging Face cache "
                           f"({constants.HF_HUB_CACHE}) and {how}.")
  if isinstance(e, errors.EntryNotFoundError):
    return CheckpointError(f"{spec} has no {filename}: vit_jax reads timm's and "
                           "transformers' ViT repos holding model.safetensors and config.json, "
                           "and OpenCLIP's holding open_clip_model.safetensors and "
                           "open_clip_config.json.")
  if isinstance(e, errors.HfHubHTTPError):
    return CheckpointError(f"{spec}: the Hub answered {e}".splitlines()[0])
  return None


@dataclasses.dataclass
class _Repo:
  """A Hub repo's files, each found in the cache or fetched, all of one commit: the first
  file found pins the rest to its snapshot's, which huggingface_hub serves from its cache
  without asking the Hub again. Once the Hub has not answered (huggingface_hub tries each
  file for ~23 s: five retries) and nothing is pinned, the rest are looked up in the cache
  alone. On a machine without network, a repo opens or fails after one wait, not one a file."""
  repo: str
  revision: str | None
  cache_only: bool = False

  def download(self, filename: str, absent_ok: bool = False,
               uncached_ok: bool = False) -> str | None:
    """The file's local path. None where the repo lacks it (`absent_ok`), or where it is not
    in the cache and the Hub cannot be asked (`uncached_ok`)."""
    import huggingface_hub
    from huggingface_hub import constants, errors
    try:
      path = huggingface_hub.hf_hub_download(self.repo, filename, revision=self.revision,
                                             local_files_only=self.cache_only)
      # SNAPSHOT/COMMIT/FILENAME: later files are asked for at COMMIT.
      self.revision = pathlib.Path(path).parents[len(pathlib.PurePosixPath(filename).parts)
                                                 - 1].name
      return path
    except Exception as e:  # Mapped to a one-line CheckpointError, or re-raised.
      uncached = isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled))
      self.cache_only |= uncached and not constants.HF_HUB_OFFLINE
      if (uncached and uncached_ok) or (
          absent_ok and not uncached and isinstance(e, errors.EntryNotFoundError)):
        return None
      error = _hub_error(e, self.repo, filename)
      if error is None:
        raise
      raise error from e

  def open_clip_weights(self) -> list[str]:
    """OpenCLIP's weight file, where the repo holds its config; [] where it does not."""
    if self.download(OPEN_CLIP_CONFIG, absent_ok=True, uncached_ok=True) is None:
      return []
    return [self.download(specs.OPEN_CLIP_WEIGHTS)]


def _weight_files(folder: str, get=None) -> list[str]:
  """model.safetensors, the shards its index names (each fetched with `get` if given), or
  OpenCLIP's file."""
  if os.path.isfile(os.path.join(folder, specs.HUB_WEIGHTS)):
    return [os.path.join(folder, specs.HUB_WEIGHTS)]
  index = os.path.join(folder, specs.HUB_WEIGHTS_INDEX)
  if not os.path.isfile(index) and os.path.isfile(os.path.join(folder, specs.OPEN_CLIP_WEIGHTS)):
    return [os.path.join(folder, specs.OPEN_CLIP_WEIGHTS)]
  with open(index, encoding="utf-8") as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  return [get(s) if get else os.path.join(folder, s) for s in shards]


def fetch(spec: str) -> tuple[str, list[str]]:
  """Downloads (or finds in the cache) what `read` needs: (snapshot folder, weight files)."""
  hub = _Repo(*specs.parse_hub(spec))
  config = hub.download(CONFIG, absent_ok=True, uncached_ok=True)
  weights = [] if config else hub.open_clip_weights()
  if weights:
    return os.path.dirname(weights[0]), weights
  # Where neither config is there, huggingface_hub's own error says why (offline, absent).
  folder = os.path.dirname(config or hub.download(CONFIG))
  hub.download(PROCESSOR, absent_ok=True, uncached_ok=True)
  if specs.is_hub_folder(folder):
    return folder, _weight_files(folder, hub.download)
  if hub.download(specs.HUB_WEIGHTS, absent_ok=True):
    return folder, [os.path.join(folder, specs.HUB_WEIGHTS)]
  if hub.download(specs.HUB_WEIGHTS_INDEX, absent_ok=True) is None:
    weights = hub.open_clip_weights()
    if weights:
      return folder, weights
    raise CheckpointError(f"{spec} holds no {specs.HUB_WEIGHTS} (nor a sharded index): vit_jax "
                          "reads safetensors weights; a repo with pytorch_model.bin only needs "
                          "converting first.")
  return folder, _weight_files(folder, hub.download)


def _json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, OSError) as e:
    raise CheckpointError(f"{path} is not readable JSON ({e}): download it again.") from e


def read_arrays(files: list[str]) -> dict[str, np.ndarray]:
  """Every tensor of the .safetensors files, as numpy arrays."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  arrays = {}
  for path in files:
    try:
      arrays.update(load_file(path))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
      raise CheckpointError(
          f"{path} is damaged ({str(e).splitlines()[0]}), e.g. truncated by an interrupted "
          "download: delete it and download it again (`hf download REPO --force-download`)."
      ) from e
  return arrays


def read(path: str) -> tuple[dict[str, np.ndarray], Description, str]:
  """(flat original-layout arrays, the description its config files give, `path`) of a
  Hub spec or a local folder holding a Hub repo's files."""
  if specs.is_hub(path):
    folder, weights = fetch(path)
  else:
    folder = os.fspath(path)
    weights = _weight_files(folder)
  open_clip = os.path.basename(weights[0]) == specs.OPEN_CLIP_WEIGHTS
  config = _json(os.path.join(folder, OPEN_CLIP_CONFIG if open_clip else CONFIG))
  processor = _json(os.path.join(folder, PROCESSOR))
  arrays = read_arrays(weights)
  layout = layouts.find(arrays, path)
  flat = layout.to_released(arrays, config, path)
  fields = npz.infer_model_config(flat)
  layouts.check_declared(flat, fields, layout.declared(config), path)
  return flat, layout.describe(flat, fields, config, processor, path), str(path)
