"""What a checkpoint holds: its model, resolution, head and size, and the fine-tuning
command that fits it; with --figures, the paper's analyses of it as PNG.

  vit-inspect hf-hub:google/vit-base-patch16-224-in21k
  vit-inspect augreg:S_16 --json
  vit-inspect /tmp/vit_quickstart --figures /tmp/figures --images mnist

CKPT: a Hugging Face Hub checkpoint (`hf-hub:ORG/NAME[@REVISION]`), a released .npz (any
layout: original, newer Flax names, big_vision; local or gs://), an AugReg name
(`augreg:S_16`), a training run's workdir (its latest step) or one of its step
directories; or a model `vit-export` wrote (SavedModel, .tflite, .onnx), of which only
the description is shown. The report includes the checkpoint's description: input
resolution, crop and value range, class names, origin. The figures: principal components of the patch-embedding filters, position-
embedding similarity, and, over the images of --images (a TFDS dataset or an image
folder, its evaluation split; or a glob of image files), the mean attention distance per
head against depth and attention rollout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from typing import Any

import numpy as np
from etils import epy

from vit_jax.checkpoint import description
from vit_jax.tools import cli, logs

from vit_jax.serving import formats

with epy.lazy_imports():  # TensorFlow, for --figures and exported models only.
  from vit_jax import figures
with epy.lazy_imports():  # JAX and Flax, once the arguments are checked.
  from vit_jax import goodput, inspection
  from vit_jax.models import registry


POOLING = {"token": "the class token", "gap": "mean of the patch tokens",
           "map": "attention pooling (MAP head)"}
ZERO_HEAD = (
    "The ImageNet-21k releases ship their head zeroed like this: every image gets the same "
    "logits, so the file predicts nothing as it is. Use its representation (pre-logits: "
    "vit_jax.checkpoint.loader.load(..., head=False), vit-fewshot), or fine-tune it: "
    "fine-tuning starts a new zero-initialised head anyway. For ImageNet labels, take a "
    "fine-tuned file (imagenet21k+imagenet2012_*.npz, an AugReg ...--imagenet2012-... one).")


def _model_line(r: dict[str, Any]) -> str:
  if r["model"]:
    return r["model"]
  hybrid = r["resnet_layers"] is not None
  fields = " ".join(f"{k}={v}" for k, v in r["fields"].items()
                    if k in registry.ARCHITECTURE and (hybrid or not k.startswith("resnet")))
  run = f" (a run of {r['run_model_name']} with overrides)" if r["run_model_name"] else ""
  return f"no registry name fits{run}: {fields}"


def _patch_line(r: dict[str, Any]) -> str:
  if r["resnet_layers"] is None:
    return f"{r['patch_size']} px"
  return (f"{r['patch_size']} on the features of a ResNet stem with stages "
          f"{tuple(r['resnet_layers'])}: tokens of {r['token_px']} px")


def _posemb_line(r: dict[str, Any]) -> str:
  rope = r["fields"].get("rope", "none")
  rotary = "" if rope == "none" else f", rotary ({rope}) in the attention"
  if r["posemb"] == "learn":
    h, w = r["posemb_grid"]
    return f"learned, {h}x{w} grid{rotary}: native resolution {r['image_size']} px"
  if r["posemb"] == "none":
    return f"none{rotary}: any resolution ({r['image_size']} px trained)"
  return f"fixed 2-D sin-cos{rotary}: any resolution (224 px assumed here)"


def _head_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
  classes = r["num_classes"]
  known = {21843: " (ImageNet-21k's count)", 1000: " (ImageNet-1k's count)"}
  lines = [("classes", f"{classes}{known.get(classes, '')}" if classes else "none")]
  if r["head"] == "zeros":
    lines += [("head", "all zeros"), ("", textwrap.fill(ZERO_HEAD, 75))]
  elif r["head"] == "zero kernel":
    lines += [("head", "kernel all zeros, bias not: the same logits for every image"),
              ("", textwrap.fill(ZERO_HEAD, 75))]
  else:
    lines.append(("head", "trained (not zero)" if r["head"] == "trained"
                  else "none: the representation is the output"))
  return lines


def _lora_line(r: dict[str, Any]) -> str:
  fields = r["lora"]
  rank, alpha = fields["lora_rank"], fields.get("lora_alpha")
  line = (f"rank {rank} on {', '.join(fields['lora_targets'])} "
          f"({f'alpha {alpha:g}' if alpha is not None else 'alpha = rank'}): ")
  if not r["lora_base"]:
    return _fill(line + "the adapters come merged into the kernels above")
  checked = (" (the arrays they were trained on: checked by sha256)"
             if r["description"]["parent_sha256"] else "")
  return _fill(
      f"{line}this file holds the adapters and the head alone, merged here onto their base "
      f"{r['lora_base']}{checked}, which must stay there or be given with --base")


def _fill(text: str) -> str:
  """Lines of 75 characters at most that break no path."""
  return textwrap.fill(text, 75, break_on_hyphens=False, break_long_words=False)


# Preprocessing.crop in words ({} is central_crop_fraction).
_CROP_WORDS = {"resize": "resized",
               "central_crop": "shorter side to size / {:g}, central crop",
               "squash_central_crop": "both sides to size / {:g}, central crop",
               "letterbox_central_crop": "longer side to size / {:g}, padded, central crop"}


def _description_lines(d: dict[str, Any]) -> list[tuple[str, str]]:
  """What the checkpoint records about its input, classes and origin."""
  pre, assumed = description.Preprocessing(**d["preprocessing"]), set(d["assumed"])
  note = lambda field: " (assumed: the file does not record it)" if field in assumed else ""  # noqa: E731
  crop = _CROP_WORDS[pre.crop].format(pre.central_crop_fraction)
  crop += f" in {pre.geometry}'s rounding" if pre.crop != "resize" else ""
  crop += f" ({pre.interpolation})" if pre.interpolation != "bilinear" else ""
  rows = [("input", f"{d['image_size']} px RGB, {crop}; {pre.normalisation()}"
           + note("preprocessing"))]
  if d["class_names"]:
    rows.append(("class names", textwrap.fill(", ".join(d["class_names"]), 75)))
  if d["output"]:
    rows.append(("output", d["output"]))
  origin = [f"trained on {d['dataset']}" if d["dataset"] else "",
            f"step {d['step']}" if d["step"] is not None else "",
            f"fine-tuned from {d['parent']}" if d["parent"] else "",
            f"exported from {d['exported_from']}" if d["exported_from"] else ""]
  if any(origin):
    rows.append(("origin", "; ".join(o for o in origin if o)))
  return rows


def format_description(path: str, d: dict[str, Any], opened: dict[str, Any]) -> str:
  """The report on an exported model: its description (it holds no arrays to inspect) and
  what its runtime found when it opened it."""
  # Named only where the registry's model of that name is its architecture (`loader._named`).
  name = registry.match_name(d["model"], preferred=d["model_name"])
  rows = [("checkpoint", path), ("model", description.model_label(name, d["model"])),
          ("classes", str(d["num_classes"])),
          ("opens", f"in {opened['format']}'s runtime: {opened['image_size']} px input, "
                    f"{opened['num_classes']} outputs")] + _description_lines(d)
  return "\n".join(f"{name:<15}{line}" if i == 0 else f"{'':<15}{line}"
                   for name, value in rows for i, line in enumerate(value.splitlines()))


def format_text(r: dict[str, Any]) -> str:
  """The report as aligned `name  value` lines."""
  pre_logits = (f"{r['pre_logits']} (tanh); the fine-tuning command drops it with the head"
                if r["pre_logits"] else "none")
  rows = [("checkpoint", r["checkpoint"])]
  if r["source"] != r["checkpoint"]:
    rows.append(("read", r["source"]))
  rows += [("model", _model_line(r)), ("patch size", _patch_line(r)),
           ("width", str(r["width"])), ("depth", f"{r['depth']} layers"),
           ("heads", str(r["heads"])), ("MLP size", str(r["mlp_dim"])),
           ("pooling", f"{r['pooling']} ({POOLING[r['pooling']]})"),
           ("position emb.", _posemb_line(r)), ("pre-logits", pre_logits)]
  rows += _head_lines(r) + [("parameters", f"{r['parameters']:,} ({r['dtype']})")]
  if r["lora"]:
    rows.append(("LoRA", _lora_line(r)))
  rows += _description_lines(r["description"]) + [("fine-tune", r["finetune_command"])]
  if r.get("figures"):
    rows += [("figures", "\n".join(r["figures"].values()))]
  return "\n".join(f"{name:<15}{line}" if i == 0 else f"{'':<15}{line}"
                   for name, value in rows for i, line in enumerate(value.splitlines()))


def _eval_split(images: str) -> str:
  return "validation" if images.split(":")[0] == "imagenet2012" else "test"


def _figures(ckpt: figures.loader.Loaded, args: argparse.Namespace) -> dict[str, Any]:
  batch = captions = None
  if args.images:
    batch, captions = figures.images_batch(ckpt, args.images,
                                           args.split or _eval_split(args.images),
                                           args.data_dir, args.num_images, args.download)
  paths, distances = figures.write(ckpt, args.figures, batch, captions,
                                   batch_size=args.batch_size)
  out = {"figures": paths}
  if distances is not None:
    out["mean_attention_distance_px"] = np.round(distances, 3).tolist()
    out["images"] = len(batch)
  return out


def parser() -> argparse.ArgumentParser:
  p = cli.parser("vit-inspect", __doc__)
  p.add_argument("checkpoint", metavar="CKPT", help="hf-hub:ORG/NAME, augreg:NAME, .npz, workdir or step dir")
  p.add_argument("--model", help="registry name to check the file against (default: read "
                 "off the file)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--dataset", default="cifar10",
                 help="the dataset of the fine-tuning command (default: %(default)s)")
  p.add_argument("--figures", metavar="DIR", help="write the analysis figures here as PNG")
  p.add_argument("--images", help="for the attention figures: a TFDS dataset, an image "
                 "folder (ROOT/<split>/<class>/*) or a glob of image files")
  p.add_argument("--split", help="split of --images (default: its evaluation split, "
                 "test; validation for imagenet2012)")
  p.add_argument("--data_dir", help="TFDS data_dir")
  p.add_argument("--download", action="store_true", help="let TFDS download --images")
  p.add_argument("--num_images", type=int, default=128,
                 help="images the attention distance averages over (default: %(default)s)")
  p.add_argument("--batch_size", type=int, default=32, help="images per forward pass")
  cli.add_base_flag(p)
  cli.add_verbose_flag(p)
  return p


@cli.command
def main(argv: list[str]) -> int:
  args = parser().parse_args(argv)
  cli.check_checkpoints([args.checkpoint, args.base or ""])
  cli.check_counts(args, dict(num_images=1, batch_size=1))
  if args.figures:
    cli.check_output_dir("--figures", args.figures)
    cli.check_apart("--figures", args.figures, {
        "CKPT": [args.checkpoint], "--images": [args.images], "--data_dir": [args.data_dir],
        "--base": [args.base]})
  logs.route_logs(verbose=args.verbose)
  if formats.format_of(args.checkpoint):
    logs.start_tensorflow(datasets=False)
    with logs.native_logs():
      from vit_jax.serving import predictors
      predictor = predictors.open_model(args.checkpoint)  # Reported if its runtime opens it.
    described = formats.describe(args.checkpoint).to_dict()
    opened = {"format": predictor.format, "image_size": predictor.image_size,
              "num_classes": predictor.num_classes}
    print(json.dumps({"checkpoint": args.checkpoint, "description": described,
                      "opened": opened}, indent=1)
          if args.json else format_description(args.checkpoint, described, opened))
    return 0
  if args.figures:
    logs.start_tensorflow()
    cli.check_owned("--figures", args.figures, set(figures.FILES.values()).__contains__,
                    ", ".join(figures.FILES.values()))
  found, ckpt = inspection.report(args.checkpoint, args.model, args.dataset, args.base)
  summary = goodput.summarize(goodput.read(args.checkpoint))
  if summary is not None:  # A training run's workdir, with the record of its attempts.
    found["goodput"] = dataclasses.asdict(summary)
  if args.figures:
    found.update(_figures(ckpt, args))
  if args.json:
    print(json.dumps(found, indent=1))
  else:
    print(format_text(found))
    if summary is not None:
      print("\n".join(goodput.format_summary(summary)))
    if args.figures and not args.images:
      print("(The attention distance and rollout figures need --images.)")
  return 0


if __name__ == "__main__":
  main()
