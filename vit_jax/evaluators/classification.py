"""Top-1 / top-5 accuracy and loss over a full evaluation split (config.evals type
`classification`; `imagenet_real` and `imagenet_v2` are this on their datasets)."""
from typing import TYPE_CHECKING, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vit_jax import data, losses

if TYPE_CHECKING:
  from vit_jax.evaluators.registry import EvalContext


def label_set_sums(logits: jax.Array, label_sets: jax.Array, mask: jax.Array
                   ) -> dict[str, jax.Array]:
  """ImageNet ReaL's scoring (Beyer et al., 2020): a prediction is right when it is in the
  example's set of right classes (multi-hot `label_sets`); examples with an empty set are
  left out."""
  counted = (jnp.sum(label_sets, -1) > 0) * mask
  top1 = jnp.take_along_axis(label_sets, jnp.argmax(logits, -1)[:, None], -1)[:, 0] > 0
  out = {"count": jnp.sum(counted), "accuracy": jnp.sum(top1 * counted)}
  if logits.shape[-1] >= 5:
    top5 = jnp.any(jnp.take_along_axis(label_sets, jax.lax.top_k(logits, 5)[1], -1) > 0, -1)
    out["top5_accuracy"] = jnp.sum(top5 * counted)
  return out


def label_rank(logits: jax.Array, label: jax.Array) -> jax.Array:
  """Each row's label's place in the order `jax.lax.top_k` gives: XLA's total order of floats
  (NaN above inf, -0 below +0), ties by the lower index first. Top-5 is rank < 5, counted by
  a comparison a class instead of a sort (a 2**23-class head's top_k took half of a TPU
  compile)."""
  bits = jax.lax.bitcast_convert_type(logits.astype(jnp.float32), jnp.int32)
  key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # Ordered as the floats' total order.
  classes = jnp.arange(key.shape[-1])
  # The label's key by a masked max, not a gather: under mesh.fsdp the head's classes are
  # sharded, and a gather made XLA keep and move a second copy of the logits.
  at_label = jnp.max(jnp.where(classes == label[:, None], key, jnp.iinfo(jnp.int32).min), -1,
                     keepdims=True)
  return jnp.sum((key > at_label) | ((key == at_label) & (classes < label[:, None])), -1)


class ClassificationEvaluator:
  """Counts every real example once: padded examples carry mask 0.

  `predict_fn(params, images) -> logits` is jit-compiled here with the batch's
  sharding; the sums stay on device until the end of the pass. Batches whose labels are
  sets of right classes (multi-hot, (batch, classes)) are scored as ImageNet ReaL is
  (`label_set_sums`), without a loss.
  """

  def __init__(self, predict_fn: Callable, batches: Callable[[], Iterable[dict]],
               loss_name: str = "softmax_xent"):
    self.batches = batches

    def sums(params, batch):
      logits = predict_fn(params, batch["image"])
      if batch["label"].ndim == 2:
        return label_set_sums(logits, batch["label"], batch["mask"])
      mask, num_classes = batch["mask"], logits.shape[-1]
      label = jnp.argmax(losses.onehot_targets(batch["label"], num_classes), -1)
      out = {
          "count": jnp.sum(mask),
          "loss": jnp.sum(losses.per_example_loss(loss_name, logits, batch["label"]) * mask),
          "accuracy": jnp.sum((jnp.argmax(logits, -1) == label) * mask),
      }
      if num_classes >= 5:
        out["top5_accuracy"] = jnp.sum((label_rank(logits, label) < 5) * mask)
      return out

    self._sums = jax.jit(sums)

  def lower(self, params, batch) -> jax.stages.Lowered:
    """The step `evaluate` compiles for each batch, lowered for `params` and `batch` (arrays or
    abstract shapes with their shardings)."""
    return self._sums.lower(params, batch)

  def evaluate(self, params) -> dict[str, float]:
    total = None
    for batch in self.batches():
      s = self._sums(params, batch)
      total = s if total is None else jax.tree.map(jnp.add, total, s)
    if total is None:
      raise ValueError("The evaluation split yielded no batches.")
    total = jax.tree.map(lambda x: float(np.asarray(x)), total)
    count = total.pop("count")
    return {k: v / count for k, v in total.items()} | {"num_examples": count}


def default_config() -> ml_collections.ConfigDict:
  """A dataset and split (None: the run's config.data.name and eval_split), read as the
  run's evaluation reads its own."""
  return ml_collections.ConfigDict(dict(
      dataset=ml_collections.FieldReference(None, field_type=str),
      split=ml_collections.FieldReference(None, field_type=str)))


def create(cfg: ml_collections.ConfigDict, context: "EvalContext") -> ClassificationEvaluator:
  data_cfg = context.data.copy_and_resolve_references()
  data_cfg.update(name=cfg.dataset or data_cfg.name, eval_split=cfg.split or data_cfg.eval_split)
  return ClassificationEvaluator(
      context.predict, lambda: context.watch(data.eval_iterator(
          data_cfg, global_batch_size=context.batch_size, sharding=context.sharding)),
      context.loss)
