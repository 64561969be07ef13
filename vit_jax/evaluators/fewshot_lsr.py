"""Few-shot linear probes: the paper's closed-form L2-regularised least squares.

Frozen representations are standardised (with the few-shot set's statistics), a
constant column of 100 is appended so that the bias is all but unregularised, and
{-1, +1}^K targets are fitted by ridge regression. One eigendecomposition (float64,
on host) serves every l2 value: with n examples and d features, the n x n Gram
matrix is decomposed when n <= d (the dual form), the d x d covariance otherwise.
"""
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import ml_collections
import numpy as np

from vit_jax import data
from vit_jax.checkpoint.description import Preprocessing
from vit_jax.config_errors import check

if TYPE_CHECKING:  # JAX is imported where it runs: vit-fewshot checks its flags without it.
  from jax.sharding import Sharding

  from vit_jax.evaluators.registry import EvalContext

BIAS_CONSTANT = 100.0
# The defaults of every few-shot entry point (config.evals, vit-fewshot, the notebook).
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_SEEDS = 3
DEFAULT_L2 = tuple(2.0**k for k in range(-10, 20, 2))


def check_l2(l2_regs: Sequence[float]) -> None:
  """Raises ValueError unless there are l2 regularisers and all are > 0."""
  if not l2_regs or min(l2_regs) <= 0:
    raise ValueError(f"few-shot l2 values must be > 0, got {list(l2_regs)}.")


def standardise(x_train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
  """Zero mean, unit variance per feature (train statistics), plus the bias column."""
  mean = x_train.mean(0, keepdims=True)
  std = x_train.std(0, keepdims=True) + 1e-5
  return [np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)
          for x in (x_train, *others)]


def ridge_weights(x: np.ndarray, y: np.ndarray, l2_regs: Sequence[float],
                  num_classes: int) -> list[np.ndarray]:
  """argmin_W |XW - T|^2 + l2 |W|^2 for each l2, T = 2 * onehot(y) - 1. x: (n, d)."""
  check_l2(l2_regs)
  x = x.astype(np.float64)
  targets = 2.0 * np.eye(num_classes)[y] - 1.0
  n, d = x.shape
  if n <= d:  # W = X^T (X X^T + l2 I)^-1 T
    s, u = np.linalg.eigh(x @ x.T)
    ut_t = u.T @ targets
    return [x.T @ (u @ (ut_t / (s + l2)[:, None])) for l2 in l2_regs]
  s, v = np.linalg.eigh(x.T @ x)  # W = (X^T X + l2 I)^-1 X^T T
  vt_xt_t = v.T @ (x.T @ targets)
  return [v @ (vt_xt_t / (s + l2)[:, None]) for l2 in l2_regs]


def sample_shots(labels: np.ndarray, shots: int, seed: int, num_classes: int,
                 exclude: np.ndarray | None = None) -> np.ndarray:
  """Indices of `shots` examples per class; for a seed, smaller shots are subsets of larger."""
  rng = np.random.default_rng(seed)
  chosen = []
  for c in range(num_classes):
    idx = np.flatnonzero(labels == c)
    if exclude is not None:
      idx = np.setdiff1d(idx, exclude)
    if len(idx) < shots:
      raise ValueError(f"Class {c} has {len(idx)} examples available for few-shot training, "
                       f"fewer than the {shots} shots asked for. Use fewer shots or a larger "
                       "train split.")
    chosen.append(rng.permutation(idx)[:shots])
  return np.concatenate(chosen)


def held_out_per_class(counts: Sequence[int], shots: Sequence[int], val_per_class: int = 10,
                       class_names: Sequence[str] = ()) -> int:
  """How many examples of each class are held out of the shots' pool to choose the l2 value on:
  `val_per_class`, fewer where the smallest class (`counts`: examples per class) has fewer to
  spare beyond the largest shot count (a folder of a few images a class), at least 1. Raises
  ValueError naming that class when it has none to spare."""
  smallest = int(np.argmin(counts))
  n, k = int(counts[smallest]), max(shots)
  if n - k < 1:
    name = repr(class_names[smallest]) if class_names else str(smallest)
    fix = f"use at most {n - 1} shots" if n > 1 else "give that class 2 examples or more"
    raise ValueError(f"class {name} has {n} example{'s' * (n != 1)}: {k} shots take {k} of "
                     f"them, and 1 more is held out to choose the l2 value on; {fix}")
  return min(val_per_class, n - k)


def compute_features(repr_fn: Callable, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray]:
  """Representations and labels of the real (mask 1) examples, in order."""
  import jax
  feats, labels = [], []
  for batch in batches:
    f = repr_fn(batch["image"])
    f, y, m = (np.asarray(jax.device_get(a)) for a in (f, batch["label"], batch["mask"]))
    feats.append(f[m > 0])
    labels.append(y[m > 0])
  return np.concatenate(feats), np.concatenate(labels)


@dataclasses.dataclass(frozen=True)
class Reading:
  """Where and how the probes' datasets are read: config.data's fields of those names."""
  data_dir: str | None = None  # TFDS's.
  download: bool = False  # TFDS's.
  on_bad_image: str = "fail"  # Image folders' undecodable files: 'fail' or 'skip'.


def _data_config(name: str, reading: Reading, split: str, **fields) -> ml_collections.ConfigDict:
  cfg = data.get_data_config()
  cfg.update(name=name, eval_split=split, train_split=split, **dataclasses.asdict(reading),
             **fields)
  return cfg


def check_shots(name: str, reading: Reading, split: str, shots: Sequence[int],
                val_per_class: int = 10) -> None:
  """Raises ValueError (held_out_per_class's) where a class of `split` has too few examples
  for the shots and the held-out ones: before any model runs, for a split of any size. Its
  labels are counted without an image decoded (data.class_counts: a folder's listing, a TFDS
  split's records with their label alone parsed, ~11 us each on two cores)."""
  cfg = _data_config(name, reading, split)
  held_out_per_class(data.class_counts(cfg), shots, val_per_class,
                     data.dataset_info(cfg).class_names)


def dataset_batches(name: str, reading: Reading, split: str, image_size: int,
                    batch_size: int, sharding: "Sharding",
                    preprocessing: Preprocessing = Preprocessing()) -> tuple[Callable, int]:
  """A callable giving one masked pass over `split` of a dataset, preprocessed as the model
  expects, and its class count. Batches hold no more than the split (padded to split over the
  devices): 20 images are not padded to a batch of 256, each of which the model would compute."""
  cfg = _data_config(name, reading, split, image_size=image_size)
  info = data.dataset_info(cfg)
  devices = len(sharding.device_set)
  batch_size = min(batch_size, -(-info.num_eval_examples // devices) * devices)
  return (lambda: data.eval_iterator(cfg, global_batch_size=batch_size, sharding=sharding,
                                     preprocessing=preprocessing), info.num_classes)


def fewshot_datasets(names: Sequence[str], reading: Reading, train_split: str,
                     test_split: str, image_size: int, batch_size: int, sharding: "Sharding",
                     preprocessing: Preprocessing = Preprocessing()
                     ) -> dict[str, tuple[Callable, Callable, int]]:
  """What FewShotEvaluator takes: per dataset, (train batches, test batches, class count)."""
  out = {}
  for name in names:
    train, num_classes = dataset_batches(name, reading, train_split, image_size, batch_size,
                                         sharding, preprocessing)
    test, _ = dataset_batches(name, reading, test_split, image_size, batch_size, sharding,
                              preprocessing)
    out[name] = (train, test, num_classes)
  return out


# What the probes are fitted on: the head's input (the model's own pooling), or the encoder's
# output tokens (after its final norm, where it has one) as the DINOv2 paper's linear probe
# reads them: the class token, the patch tokens' mean, or the two side by side.
REPRESENTATIONS = ("pre_logits", "class_token", "patch_mean", "class_token+patch_mean")


def representation_fn(model, representation: str = "pre_logits") -> Callable:
  """`(params, images) -> (batch, features)`: the `representation` (REPRESENTATIONS) the probes
  are fitted on. Raises ValueError for one the model does not have."""
  if representation not in REPRESENTATIONS:
    raise ValueError(f"representation {representation!r}: expected one of {REPRESENTATIONS}.")
  if "class_token" in representation and not (model.classifier == "token" or model.class_token):
    raise ValueError(f"representation {representation!r}: the model has no class token; use "
                     "patch_mean or pre_logits.")

  def features(params, images):
    import jax.numpy as jnp  # Here: the command's checks run before JAX loads.
    aux = model.apply({"params": params}, images, return_aux=True)[1]
    if representation == "pre_logits":
      return aux["pre_logits"]
    tokens = aux["encoded"]  # The class token first, then the registers, then the patches.
    parts = {"class_token": tokens[:, 0],
             "patch_mean": tokens[:, model.num_prefix_tokens:].mean(axis=1)}
    return jnp.concatenate([parts[k] for k in representation.split("+")], axis=-1)
  return features


@dataclasses.dataclass
class FewShotResult:
  dataset: str
  shots: int
  accuracies: list[float]  # One per seed, at the chosen l2.
  l2: float

  @property
  def mean(self) -> float:
    return float(np.mean(self.accuracies))

  @property
  def std(self) -> float:
    return float(np.std(self.accuracies))


def evaluate_dataset(name: str, train: tuple[np.ndarray, np.ndarray],
                     test: tuple[np.ndarray, np.ndarray], num_classes: int,
                     shots: Sequence[int] = DEFAULT_SHOTS, seeds: int = DEFAULT_SEEDS,
                     l2_regs: Sequence[float] = DEFAULT_L2,
                     val_per_class: int = 10) -> list[FewShotResult]:
  """Few-shot accuracies on one dataset's cached features.

  The l2 value is chosen per shot count on `val_per_class` examples per class (fewer where a
  class is small: held_out_per_class) held out from the train features (never from the test
  split), then the test accuracy at that l2 is reported.
  """
  x_pool, y_pool = train
  x_test, y_test = test
  for what, x in (("train", x_pool), ("test", x_test)):
    if not np.all(np.isfinite(x)):
      raise FloatingPointError(f"{name}: the {what} representations contain NaN or inf.")
  counts = np.bincount(y_pool, minlength=num_classes)
  val_idx = sample_shots(y_pool, held_out_per_class(counts, shots, val_per_class), seed=10_000,
                         num_classes=num_classes)
  results = []
  for k in shots:
    test_acc = np.zeros((seeds, len(l2_regs)))
    val_acc = np.zeros((seeds, len(l2_regs)))
    for seed in range(seeds):
      idx = sample_shots(y_pool, max(shots), seed, num_classes, exclude=val_idx)
      idx = idx.reshape(num_classes, max(shots))[:, :k].ravel()  # Nested across shots.
      x, xv, xt = standardise(x_pool[idx], x_pool[val_idx], x_test)
      for j, w in enumerate(ridge_weights(x, y_pool[idx], l2_regs, num_classes)):
        val_acc[seed, j] = np.mean(np.argmax(xv @ w, -1) == y_pool[val_idx])
        test_acc[seed, j] = np.mean(np.argmax(xt @ w, -1) == y_test)
    best = int(np.argmax(val_acc.mean(0)))
    results.append(FewShotResult(
        dataset=name, shots=k, accuracies=test_acc[:, best].tolist(), l2=float(l2_regs[best])))
  return results


class FewShotEvaluator:
  """Few-shot accuracy on several datasets, for a function of (params, images).

  `datasets` maps a name to `(train_batches, test_batches, num_classes)` where the
  batch callables give one masked pass (as `vit_jax.data.eval_iterator` does).
  Features are computed once per dataset and run; the solves reuse them.
  """

  def __init__(self, repr_fn: Callable, datasets: dict[str, tuple[Callable, Callable, int]],
               shots: Sequence[int] = DEFAULT_SHOTS, seeds: int = DEFAULT_SEEDS,
               l2_regs: Sequence[float] = DEFAULT_L2, val_per_class: int = 10):
    import jax
    check_l2(l2_regs)
    self.repr_fn = jax.jit(repr_fn)
    self.datasets, self.shots, self.seeds = datasets, tuple(shots), seeds
    self.l2_regs, self.val_per_class = tuple(l2_regs), val_per_class

  def dataset_results(self, params, name: str) -> list[FewShotResult]:
    """The results on one of the datasets."""
    fn = lambda images: self.repr_fn(params, images)
    train_batches, test_batches, num_classes = self.datasets[name]
    train = compute_features(fn, train_batches())
    test = compute_features(fn, test_batches())
    return evaluate_dataset(name, train, test, num_classes, self.shots, self.seeds,
                            self.l2_regs, self.val_per_class)

  def results(self, params) -> list[FewShotResult]:
    return [r for name in self.datasets for r in self.dataset_results(params, name)]

  def evaluate(self, params) -> dict[str, float]:
    return {f"{r.dataset}_{r.shots}shot": r.mean for r in self.results(params)}


def default_config() -> ml_collections.ConfigDict:
  """config.evals type `fewshot`: probes on `datasets` (TFDS names or image folders) at
  the run's image size and input contract."""
  return ml_collections.ConfigDict(dict(
      datasets=(), data_dir=ml_collections.FieldReference(None, field_type=str),
      train_split="train", test_split="test", shots=DEFAULT_SHOTS, seeds=DEFAULT_SEEDS,
      l2=DEFAULT_L2))


def validate(cfg: ml_collections.ConfigDict, field: str) -> None:
  check(bool(cfg.datasets), f"{field}.datasets", cfg.datasets, "name one or more datasets")
  check(bool(cfg.l2) and min(cfg.l2) > 0, f"{field}.l2", cfg.l2, "values must be > 0")
  check(bool(cfg.shots) and all(isinstance(k, int) and k > 0 for k in cfg.shots),
        f"{field}.shots", cfg.shots, "must be positive integers")
  check(cfg.seeds >= 1, f"{field}.seeds", cfg.seeds, "must be >= 1")


def create(cfg: ml_collections.ConfigDict, context: "EvalContext") -> FewShotEvaluator:
  # Image folders' undecodable files are treated as the run's own data treats them.
  reading = Reading(cfg.data_dir, on_bad_image=context.data.on_bad_image)
  datasets = fewshot_datasets(cfg.datasets, reading, cfg.train_split, cfg.test_split,
                              context.data.image_size, context.batch_size, context.sharding,
                              context.preprocessing)
  watched = {name: (lambda train=train: context.watch(train()),
                    lambda test=test: context.watch(test()), classes)
             for name, (train, test, classes) in datasets.items()}
  return FewShotEvaluator(representation_fn(context.model), watched, cfg.shots, cfg.seeds,
                          cfg.l2)
