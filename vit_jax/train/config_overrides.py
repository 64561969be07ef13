"""`--config.FIELD=VALUE` overrides checked against the config they override, in one line
before absl's parse refuses them in its own words: an unknown field named with the closest
known ones, a moved field (config.fewshot, the tuple form of config.evals) with its new form,
as a config file's own use of a moved field is; and the duration unit given on the command
line winning over the config file's other unit.
"""
import ast
import re
from typing import Iterable

import ml_collections

from vit_jax.config_errors import ConfigError, check_known
from vit_jax.train import config as config_lib

# Durations given in one of two units: the unit set on the command line replaces the other.
_UNIT_PAIRS = (("total_steps", "total_epochs"), ("warmup_steps", "warmup_epochs"))


def _check_not_moved(path: list[str], value: str) -> None:
  """Raises ConfigError for an override of a field that moved, saying where to."""
  config_lib.check_not_moved(path[0], value)
  if path == ["evals"]:
    try:
      old = ast.literal_eval(value)
    except (SyntaxError, ValueError):
      return
    if isinstance(old, (tuple, list)):
      config_lib.check_evals(old)


def moved_in_file(e: Exception) -> str | None:
  """A config file's use of a field that moved, as the line that says where to: ml_collections
  refuses `c.fewshot.x = ...` (no such field) and `c.evals = (...)` (not a dict) itself."""
  old_evals = re.match(r"Could not override field 'evals' .*?\. (.*) is of original type", str(e))
  try:
    _check_not_moved([str(e).strip("'\"")], "...")
    if old_evals:
      _check_not_moved(["evals"], old_evals.group(1))
  except ConfigError as moved:
    return str(moved)
  return None


def check(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
  """Raises ConfigError naming the first `--config.a.b=VALUE` of `overrides` whose field
  `config` does not have, or that has moved."""
  for arg in overrides:
    node, path = config, arg[len("--config."):].split("=", 1)[0].split(".")
    value = arg.split("=", 1)[-1]
    _check_not_moved(path, value)
    for i, key in enumerate(path):
      if not hasattr(node, "keys"):
        break
      check_known(".".join(path[:i + 1]), value, node.keys())
      node = node[key]


def prefer_given_units(config: ml_collections.ConfigDict, given: Iterable[str]) -> None:
  """Where the command line gives a duration in one unit (`given`: the fields it overrides)
  and the config file in the other, the file's is dropped."""
  given = set(given)
  for unit, other in _UNIT_PAIRS:
    for a, b in ((unit, other), (other, unit)):
      if a in given and b not in given and config.get(b) is not None:
        config[b] = None
