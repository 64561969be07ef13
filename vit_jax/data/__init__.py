"""Input pipelines: TFDS datasets and image folders -> global jax.Array batches."""
from vit_jax.data.config import get_data_config
from vit_jax.data.fashion_mnist import prepare_fashion_mnist
from vit_jax.data.pipeline import DatasetInfo
from vit_jax.data.pipeline import dataset_info
from vit_jax.data.pipeline import eval_iterator
from vit_jax.data.pipeline import train_iterator
from vit_jax.data.sources import DataOptionError

__all__ = [
    "DataOptionError",
    "DatasetInfo",
    "dataset_info",
    "eval_iterator",
    "get_data_config",
    "prepare_fashion_mnist",
    "train_iterator",
]
