"""What the command lines share: their exit status and how a user's error is reported.

Exit status: 0 done; 1 a failure while running (an exception with its traceback, or work a
command reports it could not do, e.g. every checkpoint of a sweep failed); 2 a usage or input
error: a bad flag (argparse and absl print the usage), or an input the library refuses (a path
that holds no checkpoint, a dataset that cannot be read, a checkpoint that contradicts a
flag), reported as one line `error: MESSAGE` on stderr in the library's own words.
"""
import argparse
import functools
import sys
from typing import Callable, NoReturn, Sequence

FAILED, USAGE = 1, 2

# What the library raises for what a user gave it: ValueError (ConfigError, CheckpointError,
# DescriptionMismatch and ZooError among them) and OSError (a missing or unreadable file).
INPUT_ERRORS = (ValueError, OSError)

Main = Callable[[Sequence[str] | None], int]


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """A command's parser: its docstring's first paragraph is the description, the rest the
  epilog after the options, both as written."""
  summary, _, rest = doc.strip().partition("\n\n")
  return argparse.ArgumentParser(prog=prog, description=summary, epilog=rest or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def input_error(message: object) -> int:
  """Reports an input error as one line on stderr; returns its status, 2."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  return USAGE


def fail(message: object) -> NoReturn:
  """Ends the command on an input error."""
  sys.exit(input_error(message))


def command(main: Callable[[list[str]], int]) -> Main:
  """A command's `main(argv) -> status`, called with sys.argv's arguments when argv is None;
  an input error becomes one line on stderr and status 2."""

  @functools.wraps(main)
  def wrapped(argv: Sequence[str] | None = None) -> int:
    try:
      return main(list(sys.argv[1:] if argv is None else argv))
    except INPUT_ERRORS as e:
      return input_error(e)

  return wrapped


def run(main: Main) -> NoReturn:
  """The entry point of `python -m` and the console scripts: exits with main's status."""
  sys.exit(main())
