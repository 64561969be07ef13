"""One way from any checkpoint path to arrays, and to a model with its params.

A path is a released-layout .npz (any of the layouts `npz` reads, local or gs://), an
AugReg name (`augreg:S_16`, `augreg:FILENAME`, fetched into the cache), a training run's
workdir (its latest step) or one of its step directories. The architecture comes from
the run's metadata, from a model name (checked against the arrays), or from the arrays'
shapes; the head, pre-logits, pooling and position embedding always come from the file.
"""
import dataclasses
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from vit_jax import models
from vit_jax.checkpoint import augreg, npz, run

DEFAULT_IMAGE_SIZE = 224  # For models without a learned position embedding to read it from.


@dataclasses.dataclass
class Loaded:
  model: models.VisionTransformer
  params: dict[str, Any]
  image_size: int  # The resolution `params` are fitted to.
  source: str  # The file or step directory read.

  @property
  def grid(self) -> tuple[int, int]:
    side = self.image_size // self.model.stride
    return side, side

  @property
  def has_class_token(self) -> bool:
    return self.model.classifier == "token"

  def summary(self) -> str:
    n = sum(np.size(x) for x in jax.tree.leaves(self.params))
    return (f"{self.model.name_in_registry or 'custom ViT'} from {self.source}: {n:,} "
            f"parameters, {self.model.num_classes or 'no'} classes, {self.image_size}px input, "
            f"{self.grid[0]}x{self.grid[1]} patches of {self.model.stride}px, "
            f"classifier={self.model.classifier!r}")


def read(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any] | None, str]:
  """(flat original-layout arrays, run metadata or None, the file or step dir read)."""
  if augreg.is_spec(path):
    path = augreg.resolve(path).path
  p = epath.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  if p.is_dir():
    step_dir = run.latest_step_dir(p)
    flat, meta = run.read_params(step_dir)
    return flat, meta, str(step_dir)
  return npz.load_npz_flat(path), None, str(path)


def load_params(path: str, target: npz.Params) -> dict[str, Any]:
  """Params of any checkpoint path fitted to `target` (e.g. a model to fine-tune):
  position embedding resized, head reset if the class count differs."""
  flat, _, _ = read(path)
  return npz.fit_to_target(flat, target)


def _checked_name(flat: dict[str, np.ndarray], model_name: str,
                  overrides: dict[str, Any]) -> dict[str, Any]:
  """The fields of `model_name`, after checking that the arrays hold that architecture."""
  fields = models.model_config(model_name)  # Raises, listing the known names.
  named = models.registry.architecture(fields)
  found = npz.infer_model_config(flat)
  wrong = {k: v for k, v in models.registry.architecture(found).items()
           if k not in overrides and named[k] != v}
  if wrong:
    raise npz.CheckpointError(
        f"The checkpoint is not a {model_name}: it has "
        + ", ".join(f"{k}={v} ({model_name}: {named[k]})" for k, v in wrong.items())
        + f". Name the right model, or pass these as overrides: {json.dumps(wrong)}.")
  return fields | {k: v for k, v in found.items() if k not in models.registry.ARCHITECTURE}


def _model_fields(flat, meta, model_name, overrides, source) -> tuple[str | None, dict]:
  if meta is not None:
    if model_name and model_name != meta["model_name"]:
      raise npz.CheckpointError(f"{source} holds a {meta['model_name']}, not a {model_name}: "
                                f"pass model_name={meta['model_name']!r} (or None).")
    return meta["model_name"], dict(meta["model"])
  if model_name:
    return model_name, _checked_name(flat, model_name, overrides)
  fields = npz.infer_model_config(flat)
  return models.registry.match_name(fields), fields


def _native_image_size(flat: dict[str, np.ndarray], model: models.VisionTransformer) -> int:
  if npz.POSEMB_KEY not in flat:
    return DEFAULT_IMAGE_SIZE
  tokens = flat[npz.POSEMB_KEY].shape[1] - (model.classifier == "token")
  return math.isqrt(tokens) * model.stride


def load(path: str, model_name: str | None = None, *, image_size: int | None = None,
         head: bool = True, **overrides: Any) -> Loaded:
  """A model and its params from any checkpoint path.

  `model_name` is checked against the file (a run's own name, or the .npz's shapes);
  without it the architecture is read off the file. `overrides` are VisionTransformer
  fields (e.g. a custom patch_size, dtype). `image_size` defaults to the resolution the
  position embedding was trained at; other sizes resize it. `head=False` drops the
  classification head, leaving the representation (pre-logits) as the output.
  """
  return from_arrays(*read(path), model_name, image_size=image_size, head=head, **overrides)


def from_arrays(flat: dict[str, np.ndarray], meta: dict[str, Any] | None, source: str,
                model_name: str | None = None, *, image_size: int | None = None,
                head: bool = True, **overrides: Any) -> Loaded:
  """`load` of what `read` returned: for callers that also look at the file's own arrays
  (their dtypes, a zeroed head) without reading it twice."""
  name, fields = _model_fields(flat, meta, model_name, overrides, source)
  fields = models.model_config(name, **fields) if name else dict(fields)
  fields.update(overrides)
  if head:
    fields["num_classes"] = meta["num_classes"] if meta else (
        flat["head/kernel"].shape[-1] if "head/kernel" in flat else None)
  else:
    fields["num_classes"] = None
    flat = {k: v for k, v in flat.items() if not k.startswith("head/")}
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  model = models.VisionTransformer(name_in_registry=name, **fields)
  image_size = image_size or _native_image_size(flat, model)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, image_size, image_size, 3)))["params"]
  return Loaded(model, npz.fit_to_target(flat, abstract), image_size, source)
