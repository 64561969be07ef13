"""Checkpoints: any checkpoint path read to flat released-layout arrays and a description,
or to a model with its params (`loader`: `load`, `read`, `describe`).

  specs         the grammar of checkpoint paths: `hf-hub:`, `augreg:`, `ema:`, Hub folders
  errors        `CheckpointError`, what every reader here raises
  description   what a checkpoint records about itself
  npz           the released .npz layout: read, fit to a model, write
  run           a training run's orbax layout (`workdir_lock`: who owns the workdir)
  hub           Hub repos and local folders of their files, handed to ...
  layouts/      ... other frameworks' weight layouts: a module each, and their table
  augreg        the AugReg zoo by name
  patch_resize  a patch embedding resized to another patch size

The names below are imported when first used (PEP 562): the commands import `specs` to check
a path before they start work, and the modules behind `load` take seconds to import (JAX,
Flax, orbax), which a refused path should not wait for.
"""
import importlib
from typing import Any

# Each public name, by the module that defines it.
_EXPORTS = {
    "description": ("Description", "DescriptionMismatch", "Preprocessing", "check_option",
                    "output_of_loss"),
    "errors": ("CheckpointError",),
    "loader": ("Loaded", "Opened", "describe", "export_adapters", "export_npz", "fit_params",
               "from_opened", "load", "load_params", "open_checkpoint",
               "posemb_interpolation_of"),
    "npz": ("POSEMB_KEY", "arrays_sha256", "fit_to_target", "flatten", "infer_model_config",
            "load_npz", "load_npz_flat", "read_npz", "resize_posemb", "save_npz", "unflatten"),
    "run": ("latest_step_dir", "read_params", "read_step"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("augreg", "description", "errors", "hub", "layouts", "loader", "npz",
               "patch_resize", "run", "specs", "workdir_lock")

__all__ = sorted([*_MODULE_OF, "specs"])


def __getattr__(name: str) -> Any:
  if name in _MODULE_OF:
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value  # Once: the next lookup finds it without this function.
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_MODULE_OF, *_SUBMODULES})
