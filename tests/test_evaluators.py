"""Evaluators (config.evals, evaluators/registry.py; classification.py): ImageNet ReaL's scoring
of label sets on a hand-made case, its labels from a TFDS example, label sets through the eval
pipeline's padding, and the forms config.evals replaced refused with their translation (an
extra evaluation and a user's evaluator in a training run: test_e2e_train.py)."""
import sys
import textwrap

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from helpers import run_cli, tiny_config
from vit_jax import data
from vit_jax.config_errors import ConfigError
from vit_jax.data import pipeline, sources, tasks
from vit_jax.evaluators import classification, registry
from vit_jax.train import config as config_lib, sharding


def test_real_counts_a_prediction_in_the_set_and_leaves_out_empty_sets():
  logits = np.full((8, 6), -1.0, np.float32)
  logits[np.arange(8), [5, 3, 0, 0, 2, 1, 4, 4]] = 1.0
  sets = np.zeros((8, 6), np.int32)
  sets[0, [2, 5]] = 1  # Predicted 5: right.
  sets[1, 1] = 1  # Predicted 3: wrong (3 is in its top 5, so top-5 right).
  # Example 2: no right class at all, left out; 3: padding (mask 0), left out.
  sets[3, 0] = 1
  sets[4, 2] = sets[5, 1] = sets[6, 4] = sets[7, [0, 1]] = 1  # Right, right, right, wrong.
  mask = np.array([1, 1, 1, 0, 1, 1, 1, 1], np.float32)
  batch = {"image": np.zeros((8, 2, 2, 3), np.float32), "label": sets, "mask": mask}
  evaluator = classification.ClassificationEvaluator(lambda p, x: logits, lambda: [batch])
  assert evaluator.evaluate(None) == {"accuracy": 4 / 6, "top5_accuracy": 1.0, "num_examples": 6}


def _logits(kind: str, classes: int, rng: np.random.Generator) -> np.ndarray:
  shape = (64, classes)
  if kind == "distinct":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "ties":  # Few values: most rows tie at the label.
    return rng.integers(-2, 3, shape).astype(np.float32)
  if kind == "all equal":  # A zero-initialised head: top_k takes the first classes.
    return np.zeros(shape, np.float32)
  specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], np.float32)
  return rng.choice(specials, shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["distinct", "ties", "all equal", "nan, inf, signed zeros"])
def test_the_labels_rank_gives_jax_top_k(kind, dtype):
  """label_rank < k is `label in jax.lax.top_k(logits, k)` for k up to 6 on every input top_k
  orders: ties (the lower index first), NaNs of both signs, infinities, -0 below +0; rank 0 is
  argmax where no NaN is; a label out of range is in no top k."""
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(len(kind))
  for classes in (5, 7, 1000):
    logits = jnp.asarray(_logits(kind, classes, rng), dtype)
    label = jnp.asarray(rng.integers(0, classes, 64), jnp.int32).at[0].set(classes)
    rank = np.asarray(classification.label_rank(logits, label))
    for k in range(1, min(classes, 6) + 1):
      top = np.asarray(jax.lax.top_k(logits, k)[1])
      np.testing.assert_array_equal(rank < k, np.any(top == np.asarray(label)[:, None], -1),
                                    err_msg=f"{classes} classes, k={k}")
    if kind != "nan, inf, signed zeros":
      np.testing.assert_array_equal(rank == 0, np.argmax(logits, -1) == label)
    assert rank[0] == classes


def test_real_labels_are_the_raters_set():
  task = tasks.get("evals/imagenet_real")
  assert len(task.class_names) == 1000 and task.class_names[0] == "n01440764"
  for real, want in (([3, 7], {3, 7}), ([], set())):
    features = {"image": tf.constant(b"png"), "original_label": tf.constant(3, tf.int64),
                "real_label": tf.constant(real, tf.int64)}
    label = task.example(features)["label"].numpy()
    assert label.shape == (1000,) and set(np.flatnonzero(label)) == want


class _LabelSets:
  """A source of five 4x4 images whose labels are sets of 10 classes."""
  name, channels = "label sets", 3

  def meta(self, split):
    return sources.SplitMeta(5, (4, 4, 3), 0)

  def shard_sizes(self, split, process_count):
    return [5]

  def read(self, split, process_index, process_count):
    images = [tf.io.encode_png(tf.fill([4, 4, 3], tf.constant(i, tf.uint8))) for i in range(5)]
    sets = np.eye(10, dtype=np.int64)[:5] + np.eye(10, dtype=np.int64)[5:]
    return tf.data.Dataset.from_tensor_slices({"image": tf.stack(images), "label": sets})


def test_label_sets_go_through_the_eval_pipeline_padded(monkeypatch):
  monkeypatch.setattr(pipeline, "_source", lambda cfg: _LabelSets())
  cfg = data.get_data_config()
  cfg.update(image_size=4, value_range=(0.0, 1.0))
  batches = list(data.eval_iterator(cfg, global_batch_size=8, sharding=sharding.batch_sharding(
      sharding.make_mesh())))
  assert len(batches) == 1
  labels, mask = np.asarray(batches[0]["label"]), np.asarray(batches[0]["mask"])
  assert labels.shape == (8, 10) and mask.tolist() == [1] * 5 + [0] * 3
  np.testing.assert_array_equal(labels[:5].argmax(-1), range(5))
  np.testing.assert_array_equal(labels[:5, 5:], np.eye(5))
  assert not labels[5:].any()


def test_an_unknown_evaluator_type_is_named():
  c = tiny_config(("fashion_mnist", None))
  c.evals.reel = {"type": "imagenet_reel"}
  with pytest.raises(ConfigError, match=r"config.evals.reel.type='imagenet_reel': unknown "
                                        r"evaluator type 'imagenet_reel': one of \["):
    config_lib.validate(c)
  c.evals.reel = {"type": "imagenet_real", "splt": "test"}
  with pytest.raises(ConfigError, match="config.evals.reel.splt='test': unknown field; did you "
                                        "mean split?"):
    config_lib.validate(c)
  c.evals.reel = {"type": "fewshot"}
  with pytest.raises(ConfigError, match=r"config.evals.reel.datasets=\(\): name one or more"):
    config_lib.validate(c)


def test_every_row_of_the_registry_makes_a_valid_entry():
  for type_name, (_, fixed) in registry.EVALUATORS.items():
    entry = registry.entry_config(type_name)
    assert entry.type == type_name and entry.every_steps is None and entry.at_end
    assert all(entry[k] == v for k, v in fixed.items())
  assert set(config_lib.base_config().evals) == {registry.MAIN}


_WITHOUT_EVALUATE = """
import ml_collections

def default_config():
  return ml_collections.ConfigDict()

class _Old:
  def run(self, params):
    return {}

def create(cfg, context):
  return _Old()
"""


def test_an_evaluator_without_evaluate_is_refused_naming_its_entry(tmp_path, monkeypatch):
  """A user's create() whose object has no evaluate(params) (one written to the contract's
  earlier method name, `run`) is refused as the run builds its evaluators, in one line
  naming the entry, the module and the method."""
  (tmp_path / "old_contract").mkdir()
  (tmp_path / "old_contract" / "__init__.py").write_text("")
  (tmp_path / "old_contract" / "evals.py").write_text(_WITHOUT_EVALUATE)
  monkeypatch.syspath_prepend(str(tmp_path))
  evals = ml_collections.ConfigDict({"norm": {"type": "old_contract.evals"}})
  registry.validate(evals)
  with pytest.raises(ValueError, match=r"config.evals.norm: old_contract.evals.create\(\) "
                                       r"returned _Old, which has no evaluate\(params\)"):
    registry.build(evals, None, 10)


def test_the_forms_config_evals_replaced_are_refused_with_their_translation(tmp_path):
  """The tuple of names and triples, and config.fewshot, from a config file and from the
  command line: one line that gives the new form."""
  old = "('imagenet_real', ('minival', 'imagenet2012', 'train[99%:]'))"
  want = ("{'eval': {'type': 'classification'}, 'imagenet_real': {'type': 'imagenet_real'}, "
          "'minival': {'type': 'classification', 'dataset': 'imagenet2012', "
          "'split': 'train[99%:]'}}")
  config_file = tmp_path / "old.py"
  config_file.write_text(textwrap.dedent(f"""
      from vit_jax.configs import quickstart
      def get_config():
        c = quickstart.get_config()
        c.evals = {old}
        return c
      """))
  fewshot_file = tmp_path / "old_fewshot.py"
  fewshot_file.write_text(config_file.read_text().replace(f"c.evals = {old}",
                                                          "c.fewshot.datasets = ('mnist',)"))
  moved = "config.evals.NAME = {'type': 'fewshot'"
  for config, override, wanted in (("quickstart", f"--config.evals={old}", want),
                                   (str(config_file), None, want),
                                   ("quickstart", "--config.fewshot.datasets=mnist", moved),
                                   (str(fewshot_file), None, moved)):
    result = run_cli([sys.executable, "-m", "vit_jax.tools.train", "--config", config,
                      "--workdir", str(tmp_path / "w"), *([override] if override else [])])
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and wanted in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
