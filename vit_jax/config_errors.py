"""InputError, what the user gave being wrong; ConfigError and the one way every config field
is checked: the message names the field, the value and what would be right."""
import difflib
from collections.abc import Iterable
from typing import Any


class InputError(ValueError):
  """Something the user gave (a config field, a checkpoint, a dataset option, a workdir) is
  wrong: a command says it in one line, exit status 2, no traceback."""


class ConfigError(InputError):
  """A config field that is unknown or wrong, found before anything compiles."""


def check(ok: bool, field: str, value: Any, why: str) -> None:
  if not ok:
    raise ConfigError(f"config.{field}={value!r}: {why}")


def check_known(field: str, value: Any, known: Iterable[str]) -> None:
  """Fails on a field name that is not in `known`, suggesting the closest ones."""
  known = sorted(known)
  name = field.rsplit(".", 1)[-1]
  if name in known:
    return
  close = difflib.get_close_matches(name, known, n=3)
  hint = f"did you mean {' or '.join(close)}? " if close else ""
  raise ConfigError(f"config.{field}={value!r}: unknown field; {hint}known fields: "
                    f"{', '.join(known)}")
