"""Exports a checkpoint: as a released-layout .npz, or for serving outside JAX.

python -m vit_jax.export CHECKPOINT OUT [--format npz|savedmodel|tflite|onnx]
    [--model NAME] [--image_size N]

CHECKPOINT: a training run's workdir (its latest step), one of its step directories, an
.npz in any layout the project reads, or `augreg:NAME`.
  npz (default): the params in the original layout, which `checkpoint.load_npz`, timm's
    `_load_weights` and the official code read; its model is printed, for `--model`.
  savedmodel: a folder; signature `serving_default`: uint8 images (batch, N, N, 3) ->
    `logits` float32 (batch, classes), `top5` int32 (batch, 5); preprocessing included.
  tflite: the same signature as a float32 TFLite model.  onnx: the same as ONNX
    (input `images`, outputs `logits`, `top5`), checked with onnx.checker.
N is the checkpoint's resolution unless --image_size resizes the position embedding.
The serving formats need the export extra: pip install 'vit_jax[export]'.
"""
import argparse
import sys
from typing import Any

from vit_jax import checkpoint
from vit_jax.serving import convert

FORMATS = ("npz", *convert.FORMATS)


def export(path: str, out: str) -> dict[str, Any] | None:
  """Writes `path`'s params to `out`; returns the run's metadata (None for an .npz)."""
  flat, meta, _ = checkpoint.read(path)
  checkpoint.save_npz(out, checkpoint.unflatten(flat))
  return meta


def export_serving(path: str, out: str, fmt: str, model_name: str | None = None,
                   image_size: int | None = None) -> checkpoint.Loaded:
  """Writes `path` as a SavedModel, TFLite or ONNX model; returns the model it loaded."""
  loaded = checkpoint.load(path, model_name, image_size=image_size)
  convert.write(loaded, out, fmt)
  return loaded


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m vit_jax.export", description=__doc__.split("\n\n")[0],
      epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("checkpoint")
  parser.add_argument("out")
  parser.add_argument("--format", choices=FORMATS, default="npz")
  parser.add_argument("--model", default=None, help="registry name (checked against the file)")
  parser.add_argument("--image_size", type=int, default=None)
  args = parser.parse_args(argv)
  if args.format == "npz" and (args.model or args.image_size):
    parser.error("--model and --image_size apply to the serving formats; npz keeps the params "
                 "as they are.")
  return args


def main(argv: list[str]) -> int:
  args = parse_args(argv[1:])
  if args.format == "npz":
    meta = export(args.checkpoint, args.out)
    model = f"{meta['model_name']} {meta['model']}" if meta else "the input's model"
  else:
    model = export_serving(args.checkpoint, args.out, args.format, args.model,
                           args.image_size).summary()
  print(f"Wrote {args.out} ({args.format}): {model}")
  return 0


def run() -> None:
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  run()
