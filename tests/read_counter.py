"""Counts the reads of a checkpoint's files, at the doors the readers open them through:
Python's `open` (an .npz: audit events, which see every open however it is reached) and
safetensors' `safe_open` (a Hub repo's weights, opened in Rust, where no audit event fires) for
a watched file; orbax's `PyTreeCheckpointer.restore` (a run's state, which tensorstore reads in
C++) for a watched folder, a run's step directory (whose small JSON files are not its arrays).

In this process (`counting`), or around a command in a child process:
  python tests/read_counter.py OUT.json PATH[,PATH...] MODULE ARGS...
runs `python -m MODULE ARGS...` and writes {path: reads} to OUT.json as it exits.
"""
import atexit
import collections
import contextlib
import json
import os
import runpy
import sys
from typing import Iterator

_ACTIVE: list[collections.Counter] = []  # The counters open now (audit hooks stay for good).


def _real(path) -> str | None:
  if isinstance(path, bytes):
    path = os.fsdecode(path)
  if not isinstance(path, (str, os.PathLike)):
    return None
  return os.path.realpath(os.path.abspath(os.fspath(path)))


def _seen(path, folders: bool) -> None:
  """One read of `path`, counted where it is a watched file (`folders`: under a watched
  folder)."""
  path = _real(path)
  if path is None:
    return
  for counter in _ACTIVE:
    for root in counter:
      if os.path.isdir(root) == folders and (path == root or path.startswith(root + os.sep)):
        counter[root] += 1


def _audit(event: str, args: tuple) -> None:
  if event == "open" and _ACTIVE and isinstance(args[1], str) and not set("wax+") & set(args[1]):
    _seen(args[0], folders=False)


_HOOKED = False


def _install() -> None:
  """The audit hook (once a process: hooks cannot be removed) and the two library doors."""
  global _HOOKED
  if _HOOKED:
    return
  _HOOKED = True
  sys.addaudithook(_audit)
  import orbax.checkpoint as ocp
  import safetensors
  import safetensors.numpy

  real_open, real_restore = safetensors.safe_open, ocp.PyTreeCheckpointer.restore

  def safe_open(filename, *args, **kwargs):
    _seen(filename, folders=False)
    return real_open(filename, *args, **kwargs)

  def restore(self, directory, *args, **kwargs):
    _seen(directory, folders=True)
    return real_restore(self, directory, *args, **kwargs)

  safetensors.numpy.safe_open = safe_open
  ocp.PyTreeCheckpointer.restore = restore


@contextlib.contextmanager
def counting(*paths) -> Iterator[collections.Counter]:
  """{watched path: reads} of the files at or under `paths` while the block runs (a Hub
  repo's weights file, an .npz, a run's step directory)."""
  _install()
  counter = collections.Counter({_real(p): 0 for p in paths})
  _ACTIVE.append(counter)
  try:
    yield counter
  finally:
    _ACTIVE.pop()


def main() -> None:
  out, paths, module, *args = sys.argv[1:]
  context = counting(*paths.split(","))
  counter = context.__enter__()
  atexit.register(lambda: open(out, "w").write(json.dumps(counter)))
  sys.argv = [module, *args]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
