"""Input pipelines: TFDS datasets and image folders -> global jax.Array batches.

The names below load their module (and TensorFlow) on first use, so that the TensorFlow-free
parts (`config`, `input_contract`) import without it: reading a checkpoint needs no TF.
"""
import importlib
from typing import Any

_EXPORTS = {
    "DataOptionError": "sources",
    "ON_BAD_IMAGE": "config",
    "class_counts": "pipeline",
    "DatasetInfo": "pipeline",
    "dataset_info": "pipeline",
    "eval_iterator": "pipeline",
    "get_data_config": "config",
    "located": "config",
    "prepare_fashion_mnist": "fashion_mnist",
    "train_iterator": "pipeline",
    "value_range": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name not in _EXPORTS:
    raise AttributeError(f"module 'vit_jax.data' has no attribute {name!r}")
  return getattr(importlib.import_module(f"vit_jax.data.{_EXPORTS[name]}"), name)
