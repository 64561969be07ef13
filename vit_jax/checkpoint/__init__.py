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
"""
from vit_jax.checkpoint.description import (Description, DescriptionMismatch, Preprocessing,
                                            check_option, output_of_loss)
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.loader import (Loaded, describe, export_adapters, export_npz,
                                       from_arrays, load, load_params, read)
from vit_jax.checkpoint.npz import (POSEMB_KEY, arrays_sha256, fit_to_target, flatten,
                                    infer_model_config, load_npz, load_npz_flat, read_npz,
                                    resize_posemb, save_npz, unflatten)
from vit_jax.checkpoint.run import latest_step_dir, make_meta, read_params, read_step
from vit_jax.checkpoint import specs  # checkpoint.specs, the grammar the commands check.

__all__ = [
    "CheckpointError", "Description", "arrays_sha256", "DescriptionMismatch", "Loaded", "POSEMB_KEY",
    "Preprocessing", "check_option", "describe", "export_adapters", "export_npz", "fit_to_target", "flatten", "from_arrays",
    "infer_model_config", "latest_step_dir", "load", "load_npz", "load_npz_flat", "load_params",
    "make_meta", "output_of_loss", "read", "read_npz", "read_params", "read_step", "resize_posemb", "save_npz", "specs",
    "unflatten",
]
