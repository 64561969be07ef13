"""Exports a checkpoint's params as a released-layout .npz.

python -m vit_jax.export CHECKPOINT OUT.npz

CHECKPOINT: a training run's workdir (its latest step), one of its step directories, or
an .npz in any layout the project reads. The output loads with `checkpoint.load_npz`,
timm's `_load_weights` and the official code; its model is printed, for `--model`.
"""
import sys
from typing import Any

from vit_jax import checkpoint


def export(path: str, out: str) -> dict[str, Any] | None:
  """Writes `path`'s params to `out`; returns the run's metadata (None for an .npz)."""
  flat, meta, _ = checkpoint.read(path)
  checkpoint.save_npz(out, checkpoint.unflatten(flat))
  return meta


def main(argv: list[str]) -> int:
  if len(argv) != 3:
    print(__doc__, file=sys.stderr)
    return 2
  meta = export(argv[1], argv[2])
  model = f"{meta['model_name']} {meta['model']}" if meta else "the input's model"
  print(f"Wrote {argv[2]}: {model}")
  return 0


def run() -> None:
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  run()
