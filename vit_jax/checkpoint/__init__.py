"""Checkpoints: any checkpoint path read to flat released-layout arrays and a description, or
to a model with its params. Import the module you need; this package's own import is empty,
so that `specs` (what the commands check a path's spelling with) loads no JAX:

  specs         the grammar of checkpoint paths: `hf-hub:`, `augreg:`, `ema:`, Hub folders
  errors        `CheckpointError`, what every reader here raises
  description   what a checkpoint records about itself
  loader        one read of any path: `open_checkpoint` (an `Opened`: description, source and
                arrays), `describe`, `load` (a model with its params), `fit_params`, exports
  npz           the released .npz layout: read, fit to a model, write
  run           a training run's orbax layout (`workdir_lock`: who owns the workdir)
  hub           Hub repos and local folders of their files, handed to ...
  layouts/      ... other frameworks' weight layouts: a module each, and their table
  augreg        the AugReg zoo by name
  patch_resize  a patch embedding resized to another patch size
"""
