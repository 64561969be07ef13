"""Classifies image files with a checkpoint or an exported model; writes a CSV.

vit-predict CKPT IMAGES... [--labels FILE] [--top_k 5] [--out preds.csv]
    [--batch_size 64] [--sigmoid] [--model NAME] [--image_size N]

CKPT: any checkpoint the project reads (a run's workdir or step dir, an .npz,
hf-hub:ORG/NAME such as hf-hub:timm/vit_base_patch16_224.augreg2_in21k_ft_in1k, augreg:NAME;
run with JAX on whatever device is present), or a model written by `vit-export`: a
SavedModel folder, a .tflite or an .onnx file. IMAGES: files, globs ('photos/**/*.jpg') or
folders (searched recursively for the formats TensorFlow or PIL decodes: JPEG, PNG, GIF's
first frame, BMP, WebP, TIFF, ...). Images are decoded as the input pipeline decodes them
(grayscale to RGB; PIL where TensorFlow cannot), resized (and cropped) to the model's
resolution as its evaluation did, and scaled to the value range it was trained with: all as
the checkpoint's description records. The CSV has one row per image: path, then label_1,
prob_1, ... label_k, prob_k (most likely first; the class names the checkpoint records, else
--labels, else "class N"; softmax, or per-class sigmoid for a model trained with sigmoid
cross-entropy or with --sigmoid). Without --out it goes to stdout. Unreadable images are
skipped and listed on stderr and in the summary (exit status 1), and so are a folder's files
of no image format (status 0); if no image is readable, that is the error.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
from collections.abc import Iterator

# TensorFlow's C++ log repeats every unreadable image's error; this command reports them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from vit_jax.tools import cli, jobs, logs  # noqa: E402

import numpy as np  # noqa: E402
import tqdm  # noqa: E402
from etils import epy  # noqa: E402

from vit_jax.checkpoint import description  # noqa: E402

with epy.lazy_imports():  # TensorFlow: started in main once the arguments are checked.
  from vit_jax.serving import images as image_files
  from vit_jax.serving import labels as label_lib
  from vit_jax.serving import predictors


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = cli.parser("vit-predict", __doc__)
  parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint or exported model")
  parser.add_argument("images", nargs="+", help="image files, globs or folders")
  parser.add_argument("--labels", default=None, help="class names, one per line")
  parser.add_argument("--top_k", type=int, default=5)
  parser.add_argument("--out", default=None, help="CSV file (default: stdout)")
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--sigmoid", action="store_true",
                      help="per-class sigmoid probabilities (ImageNet-21k checkpoints)")
  parser.add_argument("--model", dest="model_name", default=None,
                      help="registry name of a checkpoint's model (checked against it)")
  parser.add_argument("--image_size", type=int, default=None,
                      help="a checkpoint's input resolution (resizes its position embedding)")
  cli.add_base_flag(parser)
  cli.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  cli.check_counts(args, dict(top_k=1, batch_size=1, image_size=1))
  return args


def _read(path: str, size: int, preprocessing: description.Preprocessing) -> np.ndarray:
  """One image; what its decoder writes on stderr (libjpeg's "Improper call to JPEG library
  in state 201" before the error that this command reports) goes to the log."""
  with logs.native_logs(show_errors=False):
    return image_files.read_image(path, size, preprocessing)


def batches(paths: list[str], size: int, batch_size: int, unreadable: dict[str, str],
            progress: tqdm.tqdm, preprocessing: description.Preprocessing
            ) -> Iterator[tuple[list[str], np.ndarray]]:
  """(paths, uint8 images) of up to batch_size readable images; the others are reported
  on stderr (once an image was read: if none is, the caller says it in one line) and
  put in `unreadable` with why. Raises ValueError when no image is readable."""
  done, images, held, readable = [], [], [], False
  for path in paths:
    try:
      images.append(_read(path, size, preprocessing))
      done.append(path)
      readable = True
    except ValueError as e:
      unreadable[path] = str(e)
      held.append(f"Skipping unreadable image {path}: {e}")
    if readable:
      for line in held:
        progress.write(line, file=sys.stderr)
      held = []
    progress.update()
    if len(done) == batch_size:
      yield done, np.stack(images)
      done, images = [], []
  if done:
    yield done, np.stack(images)
  if not readable:
    first = held[0].removeprefix("Skipping unreadable image ")
    raise ValueError(f"no readable image: {first}" if len(paths) == 1 else
                     f"none of the {len(paths)} images is readable ({first}; ...)")


def predict(predictor: predictors.Predictor, paths: list[str], names: list[str], k: int,
            sigmoid: bool, batch_size: int, out: str | None) -> dict[str, str]:
  """Writes a row per readable image to `out` (stdout if None), the header with the first;
  returns the unreadable paths, with why."""
  unreadable = {}
  preprocessing = (predictor.description.preprocessing if predictor.description
                   else description.Preprocessing())
  with contextlib.ExitStack() as stack:
    progress = stack.enter_context(tqdm.tqdm(
        total=len(paths), unit="img", file=sys.stderr, disable=None,  # None: on a terminal.
        desc=f"{predictor.format} {predictor.image_size}px"))
    writer = None
    for i, (done, batch) in enumerate(batches(paths, predictor.image_size, batch_size,
                                              unreadable, progress, preprocessing)):
      if writer is None:  # Opened at the first readable image: a refused run writes nothing.
        writer = csv.writer(stack.enter_context(open(out, "w", newline="")) if out
                            else sys.stdout)
        writer.writerow(["path", *[f"{c}_{i}" for i in range(1, k + 1)
                                   for c in ("label", "prob")]])
      if predictor.format == "jax" and len(batch) < batch_size:  # One compiled shape.
        batch = np.concatenate([batch, np.zeros((batch_size - len(batch), *batch.shape[1:]),
                                                np.uint8)])
      # The runtime's first call says what it set up (LiteRT: "INFO: Created TensorFlow Lite
      # XNNPACK delegate for CPU."): the log's, not the console's.
      with logs.native_logs() if i == 0 else contextlib.nullcontext():
        logits = predictor(batch)
      top = label_lib.top_k(logits[:len(done)], names, k, sigmoid)
      for path, row in zip(done, top):
        writer.writerow([path, *[x for name, p in row for x in (name, f"{p:.6f}")]])
  return unreadable


def _names_and_output(predictor: predictors.Predictor, args: argparse.Namespace
                      ) -> tuple[list[str], bool]:
  """The class names and whether to use sigmoids: the checkpoint's description decides;
  --labels and --sigmoid fill in what it does not record and must agree with what it does."""
  described = predictor.description
  recorded_names = list(described.class_names) if described and described.class_names else None
  names = label_lib.label_names(predictor.num_classes, args.labels, recorded_names)
  if args.labels and recorded_names:
    description.check_option("the class names", "--labels", names, recorded_names,
                             predictor.source)
  output = described.output if described else None
  description.check_option("its output", "--sigmoid", "sigmoid" if args.sigmoid else None,
                           output, predictor.source)
  return names, args.sigmoid or output == "sigmoid"


@cli.command
def main(argv: list[str]) -> int:
  args = parse_args(argv)
  cli.check_checkpoints([args.checkpoint, args.base or ""])
  if args.out:
    cli.check_output_dir("--out", os.path.dirname(os.path.abspath(args.out)))
    cli.check_apart("--out", args.out, {"CKPT": [args.checkpoint], "IMAGES": args.images,
                                        "--labels": [args.labels], "--base": [args.base]},
                    file_out=True)
  logs.route_logs(verbose=args.verbose)
  logs.start_tensorflow(datasets=False)  # Images are found and decoded as the pipeline does.
  paths, unmatched, others = image_files.find_images(args.images)
  if not paths:  # One line, naming what matched nothing.
    return cli.input_error("No image files to classify" + (
        f": nothing at {', '.join(unmatched)}" if unmatched else "") + (
        f" ({len(others)} other files, e.g. {others[0]}: no image format PIL or TensorFlow "
        "reads)." if others else "."))
  for spec in unmatched:
    print(f"No images at {spec}", file=sys.stderr)
  load_kwargs = {k: v for k, v in (("model_name", args.model_name),
                                   ("image_size", args.image_size), ("base", args.base)) if v}
  predictor = predictors.open_model(args.checkpoint, **load_kwargs)
  if not predictor.num_classes:  # DINOv2's and DINOv3's repos: the encoder alone.
    return cli.input_error(
        f"{args.checkpoint} has no classifier head (a feature extractor, as DINOv2's and "
        "DINOv3's repos are), so there are no classes to rank: probe its features with "
        "vit-fewshot, fine-tune a head on your classes with vit-transfer or vit-train "
        "--config.pretrained, or take them in Python: loader.load(..., head=False) "
        "(vit_jax.checkpoint.loader)")
  if predictor.description and predictor.description.model.get("head_bias") is False:
    return cli.input_error(
        f"{args.checkpoint}'s head has no bias: it is CLIP's projection to "
        f"{predictor.num_classes}-d image embeddings, not a classifier, so there are no classes "
        "to rank; its embeddings: loader.load(...) in Python (vit_jax.checkpoint.loader), or "
        "vit-fewshot for probes.")
  names, sigmoid = _names_and_output(predictor, args)
  k = min(args.top_k, predictor.num_classes)
  unreadable = predict(predictor, paths, names, k, sigmoid, args.batch_size, args.out)
  print(f"Classified {len(paths) - len(unreadable)} of {len(paths) + len(others)} files"
        + (f" into {args.out}" if args.out else "") + f"; {len(unreadable)} unreadable, "
        f"{len(others)} not an image" + "".join(
            f"\n  {p}: skipped, no image format PIL or TensorFlow reads" for p in others),
        file=sys.stderr)
  return jobs.finish(unreadable, "images")


if __name__ == "__main__":
  main()
