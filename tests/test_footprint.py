"""models/footprint.py: its count of a forward pass's memory against XLA's own analysis of the
compiled program (at or above it, within 3x), over plain, hybrid, register and high-resolution
models; the batch it gives a ViT-L/14 at DINOv2's 518 px on this machine's 24 GiB; and the
lower count of what a training step keeps, against XLA's for the strongest remat."""
import jax
import jax.numpy as jnp
import pytest

from vit_jax import models
from vit_jax.models import footprint

GiB = 2**30


def xla_bytes_per_image(model, size: int, batch: int) -> float:
  """XLA's temporaries and input of a compiled forward pass, per image (no weights)."""
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]
  images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
  compiled = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False)).lower(
      params, images).compile()
  memory = compiled.memory_analysis()
  weights = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
  return (memory.temp_size_in_bytes + memory.argument_size_in_bytes - weights) / batch


@pytest.mark.parametrize("name, fields, size", [
    ("ViT-S_16", dict(patch_size=14, num_layers=2), 224),
    ("ViT-S_16", dict(patch_size=14, num_layers=2), 518),
    ("ViT-L_16", dict(patch_size=14, num_layers=1, layer_scale=True), 518),  # DINOv2's L/14.
    ("R+ViT-Ti_16", dict(num_layers=1), 224),
    ("ViT-Ti_16", dict(num_layers=2, num_registers=4, class_token=True, classifier="gap"), 224),
])
def test_the_forward_count_bounds_xlas_within_3x(name, fields, size):
  model = models.create_model(name, num_classes=10, **fields)
  counted, measured = footprint.forward_bytes_per_image(model, size), xla_bytes_per_image(
      model, size, 8)
  assert measured <= counted <= 3 * measured, (counted / 2**20, measured / 2**20)


def test_a_vit_l14_at_518_px_gets_a_batch_that_fits_24_gib():
  """vit-fewshot's default of 256 images took 37.8 GB in one buffer (the issue's OOM); the batch
  for 20 GiB free holds SHARE of it, per the count that bounds XLA's."""
  model = models.create_model("ViT-L_16", num_classes=None, patch_size=14, layer_scale=True)
  batch = footprint.batch_for(model, 518, 256, free_bytes=20 * GiB)
  assert 1 <= batch < 256
  assert batch * footprint.forward_bytes_per_image(model, 518) <= footprint.SHARE * 20 * GiB
  assert footprint.batch_for(model, 224, 256, free_bytes=20 * GiB) == 256  # Small images: all.
  # Split over devices: a multiple of them, one each at least, even with no memory to spare.
  assert footprint.batch_for(model, 518, 256, devices=8, free_bytes=20 * GiB) % 8 == 0
  assert footprint.batch_for(model, 518, 256, devices=8, free_bytes=0) == 8


def test_the_memory_there_is_is_positive_and_below_the_hosts():
  import psutil
  assert 0 < footprint.available_bytes() <= psutil.virtual_memory().total


def test_what_a_training_step_keeps_is_below_xlas_with_the_strongest_remat():
  model = models.create_model("ViT-S_16", num_classes=10, num_layers=2, remat=True)
  size, batch = 64, 8
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]

  def loss(p, x):
    return model.apply({"params": p}, x, train=False).sum()

  images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
  memory = jax.jit(jax.grad(loss)).lower(params, images).compile().memory_analysis()
  kept = footprint.kept_for_backward_bytes(model, size, dtype_bytes=4) * batch
  assert kept <= memory.temp_size_in_bytes
