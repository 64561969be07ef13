"""AugReg pre-training (Steiner et al. 2021, arXiv:2106.10270): `--config augreg_pretrain:b16,i21k,medium1`.

Arg: <model>,<i1k|i21k>,<aug>, aug one of AUGS. Sources: the paper's Sec. 3.3
(hyper-parameters) and 3.4 (the AugReg sweep), and big_vision's
configs/vit_i1k.py / vit_i21k.py, which reproduce it:
- Adam (0.9, 0.999), batch 4096, lr 1e-3, 10k warm-up steps then cosine decay,
  global-norm clipping at 1 (Sec. 3.3; big_vision `config.lr = 0.001`,
  `schedule = dict(warmup_steps=10_000, decay_type='cosine')`, `grad_clip_norm = 1.0`).
- 300 epochs (Sec. 3.3; big_vision `total_epochs = 300`; the paper also trains i21k
  for 30: `--config.total_epochs=30`).
- Weight decay 0.1; the sweep's other value is 0.03 (Sec. 3.4). big_vision's
  `wd = 0.0001` is the same decay: it is not multiplied by the lr, optax.adamw's is.
- No dropout or stochastic depth; the sweep's other setting is dropout 0.1 with
  stochastic depth 0.1 at the last block (Sec. 3.4): `--config.model.dropout=0.1
  --config.model.stochastic_depth=0.1`. The released files name all three
  (`...-wd_0.1-do_0.0-sd_0.0.npz`).
- (RandAugment layers, magnitude, mixup alpha) per aug: Sec. 3.4, big_vision's
  RANDAUG_DEF / MIXUP_DEF.
- Inception crop (5-100% of the area) and flips at 224 px; evaluation resizes to
  256 and crops 224 (big_vision `decode_jpeg_and_inception_crop(224)|flip_lr`,
  `resize_small(256)|central_crop(224)`).
- Sigmoid cross-entropy, head bias -6.9 (i1k) / -10 (i21k) (big_vision
  `loss = 'sigmoid_xent'`, `init_head_bias`); class token, no pre-logits layer, as
  the released AugReg checkpoints (the official repo's AUGREG_CONFIGS).
- Adam's first moment in bfloat16 (big_vision `optax = dict(mu_dtype='bfloat16')`).
- Splits: i1k trains on train[:99%] and evaluates on train[99%:]; i21k trains on
  full[51200:] and evaluates on full[:25600] (big_vision `split=...`, `evals.test`).
"""
from vit_jax import models
from vit_jax.train.config import base_config

DATASETS = {
    "i1k": dict(name="imagenet2012", train_split="train[:99%]", eval_split="train[99%:]",
                head_bias_init=-6.9),
    "i21k": dict(name="imagenet21k", train_split="full[51200:]", eval_split="full[:25600]",
                 head_bias_init=-10.0),
}
# aug: (RandAugment layers, magnitude, mixup alpha). light1 is not nothing: magnitude 0
# still inverts, equalises, posterizes to 1 bit and fades the colours.
AUGS = {
    "none": (0, 0, 0.0),
    "light1": (2, 0, 0.0),
    "light2": (2, 10, 0.2),
    "medium1": (2, 15, 0.2),
    "medium2": (2, 15, 0.5),
    "strong1": (2, 20, 0.5),
    "strong2": (2, 20, 0.8),
}
# The paper's models that the registry has (the zoo's file names use these).
MODELS = ("ti16", "s16", "s32", "b16", "b32", "b8", "l16", "r_ti16", "r26_s32", "r50_l32")
ARG_FORMS = (f"MODEL,{'|'.join(DATASETS)},{'|'.join(AUGS)} (e.g. augreg_pretrain:b16,i21k,"
             "medium1)",)


def get_config(arg: str = "b16,i21k,medium1"):
  try:
    model, dataset, aug = arg.split(",")
  except ValueError:
    raise ValueError(f"augreg_pretrain.py takes <model>,<i1k|i21k>,<aug>, got {arg!r}; "
                     f"e.g. b16,i21k,medium1.") from None
  if dataset not in DATASETS:
    raise ValueError(f"Unknown pre-training dataset {dataset!r}; known: {', '.join(DATASETS)}.")
  if aug not in AUGS:
    raise ValueError(f"Unknown aug {aug!r}; known: {', '.join(AUGS)}.")
  d, (randaug_layers, randaug_magnitude, mixup_alpha) = DATASETS[dataset], AUGS[aug]
  c = base_config()
  c.model_name = models.resolve_name(model)
  c.model.update(classifier="token", dropout=0.0, stochastic_depth=0.0,
                 head_bias_init=d["head_bias_init"])
  c.loss = "sigmoid_xent"
  c.data.update(name=d["name"], train_split=d["train_split"], eval_split=d["eval_split"],
                image_size=224, train_crop="inception", inception_area=(0.05, 1.0), flip=True,
                eval_crop="central_crop", central_crop_fraction=224 / 256,
                randaug_layers=randaug_layers, randaug_magnitude=float(randaug_magnitude),
                randaug_policy="augreg", mixup_alpha=mixup_alpha)
  c.data.cache = False
  c.batch_size = 4096
  c.total_epochs = 300.0
  c.warmup_steps = 10_000
  c.optimizer.update(name="adamw", lr=1e-3, b1=0.9, b2=0.999, weight_decay=0.1,
                     decay="cosine", grad_clip_norm=1.0, mu_dtype="bfloat16")
  c.dtype = "bfloat16"
  c.mesh.fsdp = -1  # Parameters and optimizer state split over a slice, as pretrain.py's.
  c.log_every_steps = 100
  c.eval_every_steps = 5000
  c.checkpoint_every_steps = 2000
  return c
