"""A few-step run of a tiny ViT, for the tests that drive `vit-train`."""
from vit_jax.train.config import base_config


def get_config(arg=None):
  del arg
  c = base_config()
  c.model_name = "ViT-Ti_16"
  c.model.update(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
  c.data.image_size = 28
  c.data.train_crop = "resize"  # Augmentation only slows a run this short.
  c.data.flip = False
  # What the 12 steps of 32 read, and two evaluation batches: a run decodes its split into
  # memory as it starts, and a tiny run took ~0.5 CPU-s more with 4,800 and 256 (of its ~4).
  # Longer runs go round it again, epoch by epoch; the runs that show learning take more.
  c.data.train_split = "train[:384]"
  c.data.eval_split = "test[:64]"
  c.batch_size = 32
  c.total_steps = 12
  c.warmup_steps = 2
  c.optimizer.update(lr=3e-3, weight_decay=0.01)
  c.log_every_steps = 1
  c.checkpoint_every_steps = 4
  return c
