"""Pre-training recipe of the paper: `--config pretrain:b16,i1k` (or `:b16,i21k`).

Adam (0.9, 0.999), batch 4096, 10k warm-up steps then linear decay, global-norm
clipping at 1, a tanh pre-logits layer of the model's width. ImageNet-1k: weight
decay 0.1, softmax cross-entropy, 300 epochs, lr 3e-3, dropout 0.1. ImageNet-21k:
weight decay 0.03, sigmoid cross-entropy with head bias -10, 90 epochs, lr 1e-3.
"""
from vit_jax import models
from vit_jax.train.config import base_config

DATASETS = {
    "i1k": dict(name="imagenet2012", train_split="train[:99%]", eval_split="train[99%:]",
                num_epochs=300, lr=3e-3, weight_decay=0.1, loss="softmax_xent"),
    "i21k": dict(name="imagenet21k", train_split="full[102400:]", eval_split="full[:102400]",
                 num_epochs=90, lr=1e-3, weight_decay=0.03, loss="sigmoid_xent"),
}
ARG_FORMS = tuple(f"MODEL,{d}" for d in DATASETS)  # e.g. pretrain:b16,i21k.


def get_config(arg: str = "b16,i1k"):
  model, dataset = arg.split(",")
  if dataset not in DATASETS:
    raise ValueError(f"Unknown pre-training dataset {dataset!r}; known: {', '.join(DATASETS)}.")
  d = DATASETS[dataset]
  c = base_config()
  c.model_name = models.resolve_name(model)
  c.model.representation_size = models.model_config(c.model_name)["hidden_size"]
  c.model.dropout = 0.1 if dataset == "i1k" else 0.0
  if d["loss"] == "sigmoid_xent":
    c.model.head_bias_init = -10.0
  c.loss = d["loss"]
  c.data.update(name=d["name"], train_split=d["train_split"], eval_split=d["eval_split"],
                image_size=224, train_crop="inception", flip=True, eval_crop="central_crop")
  c.data.cache = False
  c.batch_size = 4096
  c.total_epochs = float(d["num_epochs"])
  c.warmup_steps = 10_000
  c.optimizer.update(name="adamw", lr=d["lr"], b1=0.9, b2=0.999, weight_decay=d["weight_decay"],
                     decay="linear", grad_clip_norm=1.0)
  c.dtype = "bfloat16"
  # The residual stream between the blocks in bf16 too, the tensor the blocks read and write
  # most: ViT-B/16 on v5e moves 10% fewer bytes a step (163.4 -> 146.4 GB a chip). Parameters,
  # optimizer state, logits and loss stay float32; the quick-start and the fine-tuning
  # end-to-end runs learn as with a float32 stream (benchmarks/README.md).
  c.model.residual_dtype = "bfloat16"
  # Parameters and optimizer state split over a slice's devices, the bf16 weights gathered
  # once a step (sharding.py): ViT-B/16 moves 5-8% fewer bytes a step on v4, v5e and v6e.
  c.mesh.fsdp = -1
  c.log_every_steps = 100
  c.eval_every_steps = 5000
  c.checkpoint_every_steps = 2000
  return c
