"""config.evals: named evaluators, each `{type, every_steps, at_end, ...its own fields}`.

A type is a row of EVALUATORS (its module, and defaults of that module's fields that the row
fixes) or the dotted path of a module of the user's. An evaluator module has:

  default_config() -> ConfigDict               its own fields and their defaults;
  create(cfg, context: EvalContext) -> object  with `evaluate(params) -> {metric: float}`;
  validate(cfg, field) -> None                 optional: raises ConfigError naming
                                               `{field}.{key}`.

The run's own evaluation is the entry named `eval`: its metrics keep their names where the
run returns them (accuracy, loss); every other entry's are prefixed by its name.
"""
import dataclasses
import importlib
import types
from typing import Any, Callable, Iterable, Iterator, Protocol

import jax
import ml_collections

from vit_jax import models
from vit_jax.config_errors import ConfigError, check, check_known
from vit_jax.data.input_contract import Preprocessing

# type -> (module, that module's fields fixed by the type).
EVALUATORS: dict[str, tuple[str, dict[str, Any]]] = {
    "classification": ("vit_jax.evaluators.classification", {}),
    # ImageNet ReaL (Beyer et al., 2020): the raters' label sets (classification scores them).
    "imagenet_real": ("vit_jax.evaluators.classification",
                      dict(dataset="task:evals/imagenet_real", split="validation")),
    "imagenet_v2": ("vit_jax.evaluators.classification",
                    dict(dataset="imagenet_v2/matched-frequency:3.0.0", split="test")),
    "fewshot": ("vit_jax.evaluators.fewshot_lsr", {}),
}
MAIN = "eval"  # The entry whose metrics are the run's own (unprefixed).


class Evaluator(Protocol):
  def evaluate(self, params: Any) -> dict[str, float]:
    ...


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """What a training run hands its evaluators."""
  model: models.VisionTransformer
  data: ml_collections.ConfigDict  # The run's config.data (dataset, splits, image size).
  loss: str
  batch_size: int  # Global images per batch.
  sharding: jax.sharding.NamedSharding
  preprocessing: Preprocessing  # The run's input contract, as its checkpoints record it.
  watch: Callable[[Iterable[Any]], Iterator[Any]] = iter  # A sign of life per batch.

  def predict(self, params: Any, images: jax.Array) -> jax.Array:
    return self.model.apply({"params": params}, images)


@dataclasses.dataclass(frozen=True)
class Scheduled:
  evaluator: Evaluator
  every_steps: int | None  # None: at the end only.
  at_end: bool

  def due(self, step: int, last_step: int) -> bool:
    return bool((self.at_end and step == last_step) or
                (self.every_steps and step % self.every_steps == 0))


def _common_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      type="classification",
      every_steps=ml_collections.FieldReference(None, field_type=int),  # None: config's.
      at_end=True))


def module_of(type_name: str) -> tuple[types.ModuleType, dict[str, Any]]:
  """An evaluator type's module and the fields its row fixes."""
  if type_name in EVALUATORS:
    path, fixed = EVALUATORS[type_name]
    return importlib.import_module(path), fixed
  if "." not in type_name:
    raise ValueError(f"unknown evaluator type {type_name!r}: one of {sorted(EVALUATORS)}, or "
                     "the dotted path of a module with default_config() and create()")
  module = importlib.import_module(type_name)
  if not all(callable(getattr(module, f, None)) for f in ("default_config", "create")):
    raise ValueError(f"evaluator module {type_name!r} needs default_config() and create()")
  return module, {}


def entry_config(type_name: str, **fields: Any) -> ml_collections.ConfigDict:
  """A config.evals entry of `type_name` with every field at its default, `fields` set."""
  module, fixed = module_of(type_name)
  c = _common_config()
  c.update(module.default_config())
  c.update(fixed, type=type_name, **fields)
  return c


def _merged(entry: Any, field: str) -> tuple[types.ModuleType, ml_collections.ConfigDict]:
  check(hasattr(entry, "get") and entry.get("type"), field, entry,
        f"expected a dict with a 'type': one of {sorted(EVALUATORS)} or a module's path")
  try:
    module, _ = module_of(entry["type"])
  except (ValueError, ImportError) as e:
    raise ConfigError(f"config.{field}.type={entry['type']!r}: {e}") from None
  c = entry_config(entry["type"])
  for key in entry.keys():
    check_known(f"{field}.{key}", entry[key], c.keys())
  c.update(dict(entry))
  return module, c


def validate(evals: Any) -> None:
  """Raises ConfigError naming the first wrong field of config.evals."""
  check(isinstance(evals, ml_collections.ConfigDict), "evals", evals,
        "expected a dict of named evaluators, {name: {'type': ..., ...}}")
  for name in evals.keys():
    field = f"evals.{name}"
    module, c = _merged(evals[name], field)
    check(c.every_steps is None or c.every_steps >= 1, f"{field}.every_steps", c.every_steps,
          "must be None (config.eval_every_steps) or >= 1")
    check(isinstance(c.at_end, bool), f"{field}.at_end", c.at_end, "must be True or False")
    if hasattr(module, "validate"):
      module.validate(c, field)


def build(evals: ml_collections.ConfigDict, context: EvalContext,
          every_steps: int | None) -> dict[str, Scheduled]:
  """The evaluators of a validated config.evals, by name; `every_steps` is the cadence of
  those that set none (config.eval_every_steps)."""
  out = {}
  for name in evals.keys():
    module, c = _merged(evals[name], f"evals.{name}")
    evaluator = module.create(c, context)
    if not callable(getattr(evaluator, "evaluate", None)):
      raise ValueError(f"config.evals.{name}: {module.__name__}.create() returned "
                       f"{type(evaluator).__name__}, which has no evaluate(params) -> "
                       "{metric: float}: give it that method (registry.py's contract)")
    out[name] = Scheduled(evaluator,
                          c.every_steps if c.every_steps is not None else every_steps, c.at_end)
  return out


def metric_names(name: str, metrics: dict[str, float]) -> dict[str, float]:
  """An evaluator's metrics as the run returns them: the main one's as they are."""
  return dict(metrics) if name == MAIN else {f"{name}_{k}": v for k, v in metrics.items()}


def from_old_form(evals: Iterable[Any]) -> dict[str, dict[str, str]]:
  """The config.evals dict for the tuple form it replaced (names of EVALUATORS' presets, or
  (name, data.name, split)), for the message that refuses the latter."""
  out = {MAIN: {"type": "classification"}}
  for spec in evals:
    if isinstance(spec, str):
      out[spec] = {"type": spec}
    else:
      name, dataset, split = spec
      out[name] = {"type": "classification", "dataset": dataset, "split": split}
  return out
