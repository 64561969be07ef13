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


@pytest.mark.parametrize("name, fields, size", [
    ("ViT-S_16", dict(patch_size=14, num_layers=2), 224),
    ("ViT-L_16", dict(patch_size=14, num_layers=2), 392),
    ("R+ViT-Ti_16", dict(num_layers=2), 224),
])
def test_the_training_count_bounds_xlas_within_3x(name, fields, size):
  model = models.create_model(name, num_classes=10, **fields)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]
  batch = 8
  images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
  memory = jax.jit(jax.grad(lambda p, x: model.apply({"params": p}, x, train=False).sum())
                   ).lower(params, images).compile().memory_analysis()
  weights = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
  measured = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
              + memory.output_size_in_bytes - 2 * weights) / batch
  counted = footprint.train_bytes_per_image(model, size)
  assert measured <= counted <= 3 * measured, (counted / 2**20, measured / 2**20)


def test_vit_transfer_accumulates_where_the_recipes_batch_does_not_fit(monkeypatch):
  """The recipe's 512 examples an update stay; a ViT-L/14 at 384 px takes them in micro-batches
  that fit (each split over the devices), a tiny model in one step (no override)."""
  from vit_jax.checkpoint import description
  from vit_jax.data import tasks
  from vit_jax.transfer import protocol
  big = models.create_model("ViT-L_16", num_classes=None, patch_size=14)
  steps = footprint.accum_steps_for(big, 384, 512, devices=2, free_bytes=64 * GiB)
  micro = 512 // steps
  assert steps > 1 and micro % 2 == 0
  assert micro * footprint.train_bytes_per_image(big, 384) <= footprint.SHARE * 64 * GiB
  assert footprint.accum_steps_for(big, 384, 512, devices=2, free_bytes=0) == 256  # Most.
  monkeypatch.setattr(footprint, "available_bytes", lambda device=None: 64 * GiB)
  ft = protocol.FineTune("x.npz", tasks.TASKS["vtab1k/cifar100"], protocol.FINAL, 0.01, "/w")
  described = description.Description(model=dict(patch_size=14, hidden_size=1024, mlp_dim=4096,
                                                 num_heads=16, num_layers=24),
                                      image_size=224, num_classes=None)
  assert protocol.overrides(ft, protocol.Settings(), described)["accum_steps"] == (
      footprint.accum_steps_for(big, 384, 512, free_bytes=64 * GiB))
  tiny = description.Description(model=dict(patch_size=16, hidden_size=16, mlp_dim=32,
                                           num_heads=2, num_layers=1),
                                  image_size=224, num_classes=None)
  assert "accum_steps" not in protocol.overrides(ft, protocol.Settings(), tiny)
