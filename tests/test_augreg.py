"""The AugReg recipe: label smoothing in the loss and the pre-training configs."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax import configs, losses
from vit_jax.train import config as config_lib


@pytest.mark.parametrize("loss", losses.LOSSES)
def test_label_smoothing_moves_targets_towards_uniform(loss):
  logits = jax.random.normal(jax.random.key(0), (6, 5))
  labels = jnp.array([0, 1, 2, 3, 4, 0])
  targets = 0.9 * jax.nn.one_hot(labels, 5) + 0.1 / 5
  expected = (optax.softmax_cross_entropy(logits, targets) if loss == "softmax_xent" else
              optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1))
  np.testing.assert_allclose(losses.per_example_loss(loss, logits, labels, 0.1), expected,
                             rtol=1e-6)
  # Soft (mixup) targets are smoothed alike; 0 leaves the loss as it was.
  np.testing.assert_allclose(losses.per_example_loss(loss, logits, jax.nn.one_hot(labels, 5), 0.1),
                             expected, rtol=1e-6)
  np.testing.assert_array_equal(losses.per_example_loss(loss, logits, labels, 0.0),
                                losses.per_example_loss(loss, logits, labels))


def test_label_smoothing_is_validated():
  c = config_lib.base_config()
  c.total_steps = 1
  c.label_smoothing = 1.0
  with pytest.raises(ValueError, match=r"config.label_smoothing=1.0: must be in \[0, 1\)"):
    config_lib.validate(c)



AUGREG = "augreg_pretrain"


def test_every_augreg_config_loads_and_validates():
  module = configs.load_module(AUGREG)
  for model, dataset, aug in itertools.product(module.MODELS, module.DATASETS, module.AUGS):
    c = module.get_config(f"{model},{dataset},{aug}")
    config_lib.validate(c)
    assert (c.data.randaug_layers, c.data.randaug_magnitude, c.data.mixup_alpha) == (
        module.AUGS[aug]), (model, dataset, aug)


def test_augreg_config_values():
  c = configs.get_config(f"{AUGREG}:b16,i21k,medium2")
  assert c.model_name == "ViT-B_16"
  assert (c.data.randaug_layers, c.data.randaug_magnitude, c.data.mixup_alpha) == (2, 15, 0.5)
  assert (c.batch_size, c.total_epochs, c.warmup_steps) == (4096, 300, 10_000)
  assert (c.optimizer.lr, c.optimizer.weight_decay, c.optimizer.decay) == (1e-3, 0.1, "cosine")
  assert (c.model.dropout, c.model.stochastic_depth, c.model.head_bias_init) == (0.0, 0.0, -10.0)
  assert c.loss == "sigmoid_xent" and c.label_smoothing == 0.0
  assert configs.get_config(f"{AUGREG}:s16,i1k,light1").model.head_bias_init == -6.9
  assert configs.get_config(f"{AUGREG}:r50_l32,i21k,none").model_name == "R50+ViT-L_32"


@pytest.mark.parametrize("arg,message", [
    ("b16,i1k", "takes <model>,<i1k|i21k>,<aug>"),
    ("b16,jft,none", "Unknown pre-training dataset 'jft'"),
    ("b16,i1k,heavy", "Unknown aug 'heavy'; known: none, light1"),
    ("q16,i1k,none", "Unknown model 'q16'"),
])
def test_augreg_config_bad_args_are_explained(arg, message):
  with pytest.raises(ValueError, match=message):
    configs.get_config(f"{AUGREG}:{arg}")
