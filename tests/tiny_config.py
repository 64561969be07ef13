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
  # 4,800 images, what the tests' longest run reads (150 steps of 32): a run decodes its split
  # into memory as it starts, which took ~2.5 s of each for all 60,000, 0.5 s for 12,800.
  c.data.train_split = "train[:4800]"
  c.data.eval_split = "test[:256]"
  c.batch_size = 32
  c.total_steps = 12
  c.warmup_steps = 2
  c.optimizer.update(lr=3e-3, weight_decay=0.01)
  c.log_every_steps = 1
  c.checkpoint_every_steps = 4
  return c
