r"""Inference images/s of a ViT in JAX and as the exported SavedModel, ONNX and TFLite models.

    PYTHONPATH=. python benchmarks/serving.py --model ViT-B_16 --image_size 224 --batch_size 8 \
        [--formats jax,savedmodel,onnx,tflite] [--checkpoint CKPT] [--json_out FILE] \
        [--set FIELD=VALUE ...] [--perturb STD]

The model (random parameters, or --checkpoint) is exported with vit_jax.serving as
`vit-export --format` writes it, then each form runs the same uint8 batch
through its serving signature (preprocessing and all): JAX `jit(model.apply)` on the
default device, the SavedModel in TensorFlow, ONNX in onnxruntime (CPU), TFLite in LiteRT.
Each figure is the median over `--repeats` runs of `--steps` calls after `--warmup` calls,
with every framework at its default thread count. The report also gives each format's
max |logit difference| from JAX on that batch, and the seconds each export step took
(SavedModel; TFLite from it; ONNX from the TFLite model). `--set` overrides a model field
(`--set gelu=exact --set classifier=gap`: any variant of the model, e.g. a family's fields), and
`--perturb` adds Gaussian noise of that std to every parameter, so that biases, norms and
LayerScale are away from their init as in a trained model.
"""
import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import cpu_backend, models
from vit_jax.checkpoint import loader
from vit_jax.serving import formats, onnx, predictors, savedmodel, tflite

cpu_backend.skip_absent_tpu()  # As the commands: no TPU probed where there is none.

CHOICES = ("jax", *formats.FORMATS)  # --formats
PACKAGES = ("jax", "jaxlib", "tensorflow-cpu", "tensorflow", "onnxruntime", "tf2onnx",
            "ai-edge-litert")


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_call_s(fn: Callable[[], Any], warmup: int, steps: int, repeats: int) -> float:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      fn()
    times.append((time.perf_counter() - start) / steps)
  return statistics.median(times)


def load_model(args: argparse.Namespace) -> loader.Loaded:
  if args.checkpoint:
    return loader.load(args.checkpoint, image_size=args.image_size)
  overrides = {"num_layers": args.num_layers} if args.num_layers else {}
  model = models.create_model(args.model, num_classes=args.num_classes,
                              **overrides | dict(args.set))
  size = args.image_size or 224
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]
  if args.perturb:
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + args.perturb * jax.random.normal(k, x.shape, x.dtype)
                                       for x, k in zip(leaves, keys)])
  # A random head (initialised to zeros), so that the logits differ and their diffs mean something.
  kernel = params["head"]["kernel"]
  params["head"]["kernel"] = jax.random.normal(jax.random.key(1), kernel.shape) / kernel.shape[0]**.5
  return loader.Loaded.from_model(model, params, size, f"random {args.model}")


def export(loaded: loader.Loaded, formats: Sequence[str], tmp: str) -> dict[str, Any]:
  """{format: (path, seconds to write)}: SavedModel, then TFLite from it, ONNX from that."""
  out, start = {}, time.perf_counter()
  saved = savedmodel.save(loaded, f"{tmp}/saved_model")
  out["savedmodel"] = (saved, time.perf_counter() - start)
  if {"tflite", "onnx"} & set(formats):
    start = time.perf_counter()
    lite = tflite.from_savedmodel(saved, f"{tmp}/model.tflite")
    out["tflite"] = (lite, time.perf_counter() - start)
    if "onnx" in formats:
      start = time.perf_counter()
      out["onnx"] = (onnx.from_tflite(lite, f"{tmp}/model.onnx"), time.perf_counter() - start)
  return out


def bench(args: argparse.Namespace, loaded: loader.Loaded, tmp: str) -> list[dict[str, Any]]:
  size = loaded.image_size
  images = np.random.default_rng(0).integers(0, 256, (args.batch_size, size, size, 3), np.uint8)
  _log(f"exporting {loaded.summary()}")
  written = export(loaded, args.formats, tmp)
  rows, reference = [], None
  for fmt in args.formats:
    predictor = (predictors.jax_predictor(loaded) if fmt == "jax"
                 else predictors.open_model(written[fmt][0]))
    _log(f"timing {fmt}")
    logits = predictor(images)
    reference = logits if reference is None else reference
    step_s = median_call_s(lambda: predictor(images), args.warmup, args.steps, args.repeats)
    rows.append({"format": fmt, "img_per_s": args.batch_size / step_s,
                 "ms_per_batch": 1e3 * step_s,
                 "max_abs_logit_diff_vs_jax": float(np.abs(logits - reference).max()),
                 "export_s": written[fmt][1] if fmt in written else None})
  for row in rows:
    row["ratio_to_jax"] = row["img_per_s"] / rows[0]["img_per_s"]
  return rows


def table(rows: list[dict[str, Any]]) -> str:
  lines = ["| format | img/s | ms/batch | vs JAX | max abs logit diff | export s |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    export_s = "" if r["export_s"] is None else f"{r['export_s']:.1f}"
    lines.append(f"| {r['format']} | {r['img_per_s']:,.1f} | {r['ms_per_batch']:.1f} | "
                 f"{r['ratio_to_jax']:.2f} | {r['max_abs_logit_diff_vs_jax']:.1e} | {export_s} |")
  return "\n".join(lines)


def versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def _field_value(text: str) -> tuple[str, Any]:
  field, sep, value = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"--set {text}: give FIELD=VALUE, e.g. gelu=exact")
  try:
    return field, json.loads(value)
  except json.JSONDecodeError:
    return field, value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="ViT-B_16", help="registry name (random parameters)")
  p.add_argument("--checkpoint", default=None, help="a checkpoint instead of --model")
  p.add_argument("--image_size", type=int, default=None, help="default: 224 / the checkpoint's")
  p.add_argument("--num_classes", type=int, default=1000)
  p.add_argument("--num_layers", type=int, default=None, help="fewer layers, for a quick run")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--formats", default="jax,savedmodel,onnx,tflite")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json_out", default=None)
  p.add_argument("--set", action="append", type=_field_value, default=[], metavar="FIELD=VALUE",
                 help="a model field (VALUE read as JSON, else as a string); repeatable")
  p.add_argument("--perturb", type=float, default=0.0, help="std of noise added to every param")
  args = p.parse_args(argv)
  args.formats = ["jax"] + [f for f in args.formats.split(",") if f and f != "jax"]
  unknown = set(args.formats) - set(CHOICES)
  if unknown:
    p.error(f"unknown --formats {sorted(unknown)}: choose from {', '.join(CHOICES)}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  loaded = load_model(args)
  with tempfile.TemporaryDirectory(prefix="vit_serving_bench_") as tmp:
    rows = bench(args, loaded, tmp)
  report = {"model": loaded.summary(), "fields": dict(args.set), "perturb": args.perturb,
            "batch_size": args.batch_size,
            "device": str(jax.devices()[0].device_kind), "cpu": platform.processor(),
            "versions": versions(), "results": rows}
  print(table(rows))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(report, f, indent=2)
  return report


if __name__ == "__main__":
  main()
