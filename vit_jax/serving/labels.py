"""Class names and the k most likely of them, from logits: what predictions print."""
from collections.abc import Sequence

import numpy as np
from etils import epath


def label_names(num_classes: int, labels_file: str | None = None,
                dataset_names: Sequence[str] | None = None) -> list[str]:
  """Class names from a file (one per line), else the dataset's if the counts agree."""
  if labels_file:
    names = epath.Path(labels_file).read_text().splitlines()
    if len(names) != num_classes:
      raise ValueError(f"{labels_file} names {len(names)} classes; the model has {num_classes}.")
    return names
  if dataset_names is not None and len(dataset_names) == num_classes:
    return list(dataset_names)
  return [f"class {i}" for i in range(num_classes)]


def probabilities(logits: np.ndarray, sigmoid: bool = False) -> np.ndarray:
  """Softmax over the classes, or per-class sigmoids (models trained with sigmoid
  cross-entropy, the ImageNet-21k checkpoints), in float64."""
  logits = np.asarray(logits, np.float64)
  if sigmoid:
    return 1 / (1 + np.exp(-logits))
  e = np.exp(logits - logits.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def top_k(logits: np.ndarray, names: Sequence[str], k: int = 5,
          sigmoid: bool = False) -> list[list[tuple[str, float]]]:
  """Per image, the k most likely (name, probability), most likely first."""
  probs = probabilities(logits, sigmoid)
  order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
  return [[(names[j], float(p[j])) for j in row] for p, row in zip(probs, order)]
