"""The configs shipped with vit_jax, and the one loader of `--config` specs.

A spec is `NAME[:ARG]`, a config of this package (`quickstart`, `finetune:b16,cifar10`), or
`PATH[:ARG]`, a config file of your own (`my_configs/x.py:arg`, relative to the working
directory or absolute). Either way the file's `get_config(ARG)` builds the config, or
`get_config()` when there is no `:ARG`, as ml_collections' `--config` flag calls it.
"""
import ast
import importlib
import importlib.util
import pathlib
import re
import types

import ml_collections

from vit_jax.config_errors import ConfigError

_DIR = pathlib.Path(__file__).resolve().parent


def names() -> list[str]:
  """The configs shipped with vit_jax, by name."""
  return sorted(p.stem for p in _DIR.glob("*.py") if p.stem != "__init__")


def _hint() -> str:
  return (f"Configs shipped with vit_jax: {', '.join(names())} (e.g. finetune:b16,cifar10); "
          "or give the path of a .py file that defines get_config(arg), e.g. my_configs/x.py:arg.")


def is_name(spec: str) -> bool:
  """Whether `spec` names a shipped config (an identifier before any `:`), not a file."""
  return spec.partition(":")[0].isidentifier()


def config_path(name: str) -> pathlib.Path:
  """The file of the config shipped as `name`."""
  if name not in names():
    raise ValueError(f"vit_jax ships no config named {name!r}. {_hint()}")
  return _DIR / f"{name}.py"


def _check_defines_get_config(path: pathlib.Path, shown: str) -> None:
  """Reads the file without running it: launchers check a config before anything starts."""
  try:
    tree = ast.parse(path.read_text(), str(path))
  except (SyntaxError, UnicodeDecodeError) as e:
    raise ValueError(f"{shown} is not a readable Python file ({e}). {_hint()}") from None
  bound = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef):
      bound.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      bound |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Assign):
      bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  if "get_config" not in bound:
    raise ValueError(f"{shown} defines no get_config(arg), so it is not a config file. {_hint()}")


def resolve(spec: str) -> tuple[pathlib.Path, str | None]:
  """`NAME[:ARG]` or `PATH[:ARG]` -> (the config file, absolute; ARG, None without `:`),
  once the file is known to define get_config. Nothing of the file is run."""
  head, sep, arg = spec.partition(":")
  if is_name(spec):
    path = config_path(head)
  else:
    path = pathlib.Path(head).expanduser()
    if not path.is_file():
      raise ValueError(f"no file {head} (relative to {pathlib.Path.cwd()}). {_hint()}")
  _check_defines_get_config(path, head)
  return path.resolve(), (arg if sep else None)


def _load(path: pathlib.Path) -> types.ModuleType:
  if path.parent == _DIR:
    return importlib.import_module(f"{__name__}.{path.stem}")
  module_spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_module(spec: str) -> types.ModuleType:
  """The config file of `spec` as a module: its get_config and its tables (the ARG is unused)."""
  return _load(resolve(spec)[0])


def get_config(spec: str) -> ml_collections.ConfigDict:
  """The config `--config SPEC` gives, before any `--config.FIELD=VALUE` override."""
  path, arg = resolve(spec)
  module = _load(path)
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"{path} defines no get_config(arg), so it is not a config file. {_hint()}")
  try:
    return module.get_config() if arg is None else module.get_config(arg)
  except Exception as e:  # noqa: BLE001  Whatever a config's get_config says of its ARG.
    raise ConfigError(f"--config {spec}: {_reason(e)}; {accepted_forms(spec)}") from e


def accepted_forms(spec: str) -> str:
  """What `--config` takes for the config of `spec`: a shipped config's ARG_FORMS, else how a
  file's get_config is called."""
  head = spec.partition(":")[0]
  path = resolve(head)[0]
  forms = getattr(_load(path), "ARG_FORMS", None)
  name = path.stem if path.parent == _DIR else head
  if forms:
    return "accepted: " + ", ".join(f"{name}:{f}" if f else name for f in forms)
  return f"the file's get_config(ARG) is called with what follows the ':' ({name}:ARG)"


def _reason(e: Exception) -> str:
  """An exception of a config's get_config in a few words: its message, else its type."""
  message = " ".join(str(e).split()).removeprefix(f"{type(e).__name__}: ").rstrip(".")
  if isinstance(e, ConfigError):
    return re.sub(r"^--config \S+: ", "", message)
  return f"{type(e).__name__}: {message}" if message else type(e).__name__
