"""Exports a training run's params as a released-layout .npz.

python -m vit_jax.export WORKDIR_OR_STEP_DIR OUT.npz

WORKDIR takes its latest checkpoint. The .npz loads with `checkpoint.load_npz`,
timm's `_load_weights` and the official code; its model is printed, for `--model`.
"""
import sys

from etils import epath

from vit_jax import checkpoint


def latest_step_dir(path: str) -> epath.Path:
  path = epath.Path(path)
  if (path / "checkpoints").is_dir():
    steps = [p for p in (path / "checkpoints").iterdir() if p.name.isdigit()]
    if not steps:
      raise checkpoint.CheckpointError(f"{path}/checkpoints holds no finished checkpoint.")
    return max(steps, key=lambda p: int(p.name))
  return path


def export(path: str, out: str) -> dict:
  flat, meta = checkpoint.load_orbax_params(str(latest_step_dir(path)))
  checkpoint.save_npz(out, checkpoint.unflatten(flat))
  return meta


def main(argv: list[str]) -> int:
  if len(argv) != 3:
    print(__doc__, file=sys.stderr)
    return 2
  meta = export(argv[1], argv[2])
  print(f"Wrote {argv[2]}: {meta['model_name']} {meta['model']}")
  return 0


def run() -> None:
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  run()
