"""The one rule of the commands that run several jobs (vit-fewshot: checkpoints x datasets,
vit-transfer: checkpoints x tasks, vit-predict: image files).

Every job that can run runs, and its results are written; a job that fails is told in one line
as it fails, with no traceback when a user's input explains it (a checkpoint that cannot be
read, an unreadable image: the library's ValueError and OSError); the summary names each failed
job in one line; the status is 1 when any failed, 0 only when all ran.
"""
import sys
import traceback
from typing import Callable, Mapping, TypeVar

from vit_jax.tools import cli

T = TypeVar("T")

# Failures a user's input explains: their message says all. FloatingPointError: a checkpoint
# whose representations hold NaN or inf.
EXPECTED = (*cli.INPUT_ERRORS, FloatingPointError)


def one_line(e: BaseException) -> str:
  """An error as one line: its type and its message, whitespace folded."""
  return f"{type(e).__name__}: {' '.join(str(e).split())}"


def attempt(job: str, work: Callable[[], T], failures: dict[str, str]) -> T | None:
  """work()'s result; if it raises an Exception, None, with `failures[job]` set to why and that
  line on stderr (an unexpected error's traceback too). Signals (stop_signals.Interrupted,
  KeyboardInterrupt) are not Exceptions: they end the command."""
  try:
    return work()
  except Exception as e:
    failures[job] = one_line(e)
    if not isinstance(e, EXPECTED):
      traceback.print_exc(file=sys.stderr)
    print(f"FAILED {job}: {failures[job]}", file=sys.stderr, flush=True)
    return None


def finish(failures: Mapping[str, str], noun: str) -> int:
  """Ends a command's jobs: the failed ones named on stderr, a line each, under `noun` (the
  jobs' name); the status, 1 if any failed, else 0."""
  if not failures:
    return 0
  lines = [f"{noun.capitalize()} that failed ({len(failures)}):"]
  lines += [f"  {job}: {why}" for job, why in failures.items()]
  print("\n".join(lines), file=sys.stderr, flush=True)
  return cli.FAILED
