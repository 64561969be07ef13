"""Exports a checkpoint: as a released-layout .npz, or for serving outside JAX.

vit-export CHECKPOINT OUT [--format npz|adapters|savedmodel|tflite|onnx]
    [--model NAME] [--image_size N]

CHECKPOINT: a training run's workdir (its latest step), one of its step directories, an
.npz in any layout the project reads (local or gs://), `hf-hub:ORG/NAME` or `augreg:NAME`
(`vit-export hf-hub:google/vit-base-patch16-224-in21k b16_i21k.npz`: the paper's ViT-B/16
pre-trained on ImageNet-21k, as a released-layout .npz). Every format carries the
checkpoint's description (model, resolution, input value range and crop, classes, origin),
which `vit-inspect` prints and predict, few-shot and fine-tuning read.
  npz (default): the params in the original layout, which `npz.load_npz`, timm's
    `_load_weights` and the official code read; its model is printed, for `--model`. A LoRA
    run's adapters come merged into their kernels.
  adapters: a LoRA run's adapters and head alone, a small .npz that every command reads
    as its base checkpoint (the run's config.pretrained, read again) with them merged.
  savedmodel: a folder; signature `serving_default`: uint8 images (batch, N, N, 3) ->
    `logits` float32 (batch, classes), `top5` int32 (batch, 5); the value range the model
    was trained with is applied inside.
  tflite: the same signature as a float32 TFLite model.  onnx: the same as ONNX
    (input `images`, outputs `logits`, `top5`), checked with onnx.checker.
N is the checkpoint's resolution unless --image_size resizes the position embedding.
A serving format is run in its own runtime (TensorFlow, LiteRT, onnxruntime) on 2 images
beside JAX before the export reports success; a model whose logits differ (by more than 1e-4
of their scale) is removed, and the command says by how much and exits with status 1.
TFLite and ONNX need the export extra (pip install 'vit_jax[export]'), the SavedModel only
TensorFlow; without it vit-export refuses them before any work, as vit-predict and vit-inspect
refuse to open such a model.
"""
import argparse
import os
import sys

import numpy as np

from vit_jax.checkpoint import description
from vit_jax.serving import formats
from vit_jax.tools import cli, logs

CHOICES = ("npz", "adapters", *formats.FORMATS)  # --format
# What a SavedModel folder holds (TensorFlow's layout; the description in assets.extra): a
# folder of anything else is a user's, not one to export into.
SAVEDMODEL_ENTRIES = ("saved_model.pb", "fingerprint.pb", "variables", "assets", "assets.extra")


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = cli.parser("vit-export", __doc__)
  parser.add_argument("checkpoint")
  parser.add_argument("out")
  parser.add_argument("--format", choices=CHOICES, default="npz")
  parser.add_argument("--model", default=None, help="registry name (checked against the file)")
  parser.add_argument("--image_size", type=int, default=None)
  cli.add_base_flag(parser)
  cli.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  cli.check_counts(args, dict(image_size=1))
  if args.format in ("npz", "adapters") and (args.model or args.image_size):
    parser.error("--model and --image_size apply to the serving formats; npz keeps the params "
                 "as they are.")
  return args


def written_by_export(path: str, fmt: str) -> bool:
  """Whether the file at `path` is one vit-export wrote in `fmt`: it carries the checkpoint's
  description where that format keeps it (a file a user made does not)."""
  try:
    if fmt in ("npz", "adapters"):
      with np.load(path) as arrays:  # Reads the zip's directory, not the arrays.
        return description.DESCRIPTION_KEY in arrays.files
    return formats.module(fmt).read_description(path) is not None
  except Exception:  # noqa: BLE001  Whatever its reader cannot parse is no file of ours.
    return False


@cli.command
def main(argv: list[str]) -> int:
  args = parse_args(argv)
  cli.check_checkpoints([args.checkpoint, args.base or ""])
  # Before minutes of conversion: where the file goes (a SavedModel is a folder itself).
  cli.check_output_dir("OUT", os.path.dirname(os.path.abspath(args.out)))
  cli.check_apart("OUT", args.out, {"CHECKPOINT": [args.checkpoint], "--base": [args.base]})
  if os.path.isdir(args.out) and args.format != "savedmodel":
    cli.fail(f"OUT {args.out} is a folder: give the {args.format} file's path")
  if os.path.exists(args.out) and not os.path.isdir(args.out) and args.format == "savedmodel":
    cli.fail(f"OUT {args.out} is a file, and a SavedModel is a folder: give a new or empty "
             "folder's path (the file is left as it is)")
  if args.format in formats.FORMATS:  # Before OUT is read as one of its files.
    formats.require(args.format, f"--format {args.format}")
  if args.format == "savedmodel":
    cli.check_owned("OUT", args.out, SAVEDMODEL_ENTRIES.__contains__, "a SavedModel")
  elif os.path.isfile(args.out) and not written_by_export(args.out, args.format):
    cli.fail(f"OUT {args.out}: the file is no {args.format} file that vit-export wrote (it "
             "carries no vit_jax description), and exporting would replace it: give another "
             "path, or delete it first")
  logs.route_logs(verbose=args.verbose)
  cli.check_not_exported([args.checkpoint, args.base or ""])
  from vit_jax.checkpoint import loader  # JAX and orbax: after the checks.
  if args.format == "npz":
    described = loader.export_npz(args.checkpoint, args.out, args.base)
  elif args.format == "adapters":
    described = loader.export_adapters(args.checkpoint, args.out)
  else:
    return export_serving(args)
  print(f"Wrote {args.out} ({args.format}): {described.summary()}")
  return 0


def export_serving(args: argparse.Namespace) -> int:
  """Writes a serving format, then runs it in its runtime beside JAX (convert.check): a
  model that gives other logits is removed and reported in one line, status 1."""
  logs.start_tensorflow(datasets=False)  # The serving formats': its C++ start-up lines.
  from vit_jax.serving import convert  # JAX and the converters: after the checks.
  try:
    with logs.native_logs():  # The converters' C++ lines.
      exported = convert.export(args.checkpoint, args.out, args.format, args.model,
                                args.image_size, base=args.base)
  except convert.Mismatch as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return cli.FAILED
  print(f"Wrote {args.out} ({args.format}): {exported.loaded.description.summary()}")
  print(f"Checked: run in its runtime, {exported.max_diff:.1e} from JAX's logits (max |diff| "
        f"on {convert.CHECK_IMAGES} images)")
  return 0


if __name__ == "__main__":
  main()
