"""Fine-tuning recipe: `--config finetune:b16,cifar10 --config.pretrained=ViT-B_16.npz`.

SGD with momentum 0.9, batch 512, 500 warm-up steps then cosine decay, global-norm
clipping at 1, no weight decay, 384 px or the multiple of the model's patch stride nearest it
(378 for ViT-H/14; the position embeddings of the checkpoint are
resized to the new grid), the head re-initialised to zeros for the new classes.
"""
from vit_jax import models
from vit_jax.train.config import base_config

# Steps of the official fine-tuning runs, per dataset.
TOTAL_STEPS = {"cifar10": 10_000, "cifar100": 10_000, "imagenet2012": 20_000,
               "oxford_iiit_pet": 500, "oxford_flowers102": 500}
EVAL_SPLITS = {"imagenet2012": "validation"}
IMAGE_SIZE = 384
WARMUP_STEPS = 500
# What `--config finetune:ARG` takes (configs.accepted_forms).
ARG_FORMS = ("MODEL,DATASET (e.g. finetune:b16,cifar10; DATASET: a TFDS name or an image "
             "folder)",)


def image_size(stride: int) -> int:
  """IMAGE_SIZE, or the multiple of the model's patch stride nearest it (images split into
  whole tokens: 385 for patches of 7)."""
  return models.fitted_size(IMAGE_SIZE, stride)


def get_config(arg: str = "b16,cifar10"):
  model, dataset = arg.split(",")
  c = base_config()
  c.model_name = models.resolve_name(model)
  stride = models.create_model(c.model_name, num_classes=None).stride
  c.data.update(name=dataset, train_split="train", eval_split=EVAL_SPLITS.get(dataset, "test"),
                image_size=image_size(stride), train_crop="inception",
                inception_area=(0.05, 1.0), flip=True, eval_crop="resize")
  c.batch_size = 512
  c.total_steps = TOTAL_STEPS.get(dataset, 10_000)
  c.warmup_steps = WARMUP_STEPS
  c.optimizer.update(name="sgd", lr=0.03, momentum=0.9, weight_decay=0.0, decay="cosine",
                     grad_clip_norm=1.0)
  c.log_every_steps = 50
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 1000
  return c
