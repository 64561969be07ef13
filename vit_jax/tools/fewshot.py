"""Few-shot sweeps over checkpoints: `vit-fewshot CKPT... --datasets a,b`.

Checkpoints: released ones on the Hugging Face Hub (`hf-hub:ORG/NAME`, e.g.
hf-hub:google/vit-base-patch16-224-in21k) or by AugReg name (`augreg:NAME`), .npz files (any
layout, local or gs://; `--model` names the architecture, else it is read off the arrays'
shapes), training runs' workdirs (their latest step) or step
directories (the model is read from the run), globs allowed. Each is probed at its own
resolution (unless --image_size) on images preprocessed as its description records (value
range, crop). Writes fewshot.csv, fewshot.md and fewshot.png to --out_dir:
checkpoint x dataset x shots, mean ± std over seeds. A checkpoint that fails to load is
reported and the sweep goes on (exit status 1).
"""
import argparse
import csv
import functools
import glob
import os
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from vit_jax import data  # Its names load when used: not before the checks.
from vit_jax.checkpoint import description
from vit_jax.evaluators import fewshot_lsr
from vit_jax.tools import cli, jobs, logs

if TYPE_CHECKING:  # Imported where used: the loader's JAX and orbax take seconds.
  from vit_jax.checkpoint import loader


OUTPUTS = ("fewshot.csv", "fewshot.md", "fewshot.png")


def write_reports(rows: list[dict], failures: dict[str, str], out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  fields = ["checkpoint", "dataset", "shots", "mean", "std", "l2", "accuracies", "representation"]
  with open(os.path.join(out_dir, OUTPUTS[0]), "w", newline="") as f:
    writer = csv.DictWriter(f, fields)
    writer.writeheader()
    writer.writerows(rows)
  datasets = sorted({r["dataset"] for r in rows})
  shots = sorted({r["shots"] for r in rows})
  lines = ["| checkpoint | dataset | " + " | ".join(f"{k}-shot" for k in shots) + " |",
           "|---|---|" + "---|" * len(shots)] if rows else ["No results: every checkpoint failed."]
  by_key = {(r["checkpoint"], r["dataset"], r["shots"]): r for r in rows}
  for ckpt in dict.fromkeys(r["checkpoint"] for r in rows):
    for ds in datasets:
      cells = [f"{100 * by_key[ckpt, ds, k]['mean']:.2f} ± {100 * by_key[ckpt, ds, k]['std']:.2f}"
               if (ckpt, ds, k) in by_key else "" for k in shots]
      lines.append(f"| {ckpt} | {ds} | " + " | ".join(cells) + " |")
  if failures:
    lines += ["", "Failed:"] + [f"- {job}: {e}" for job, e in failures.items()]
  with open(os.path.join(out_dir, OUTPUTS[1]), "w") as f:
    f.write("\n".join(lines) + "\n")
  _plot(rows, datasets, os.path.join(out_dir, OUTPUTS[2]))


def _plot(rows: list[dict], datasets: list[str], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(5 * max(len(datasets), 1), 4),
                           squeeze=False)
  for ax, ds in zip(axes[0], datasets):
    for ckpt in dict.fromkeys(r["checkpoint"] for r in rows):
      pts = sorted((r["shots"], r["mean"], r["std"]) for r in rows
                   if r["checkpoint"] == ckpt and r["dataset"] == ds)
      k, m, s = (np.array(v) for v in zip(*pts))
      ax.errorbar(k, 100 * m, yerr=100 * s, marker="o", capsize=3, label=ckpt)
    ax.set(xscale="log", xlabel="shots per class", ylabel="accuracy (%)", title=ds)
    ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _probe(path: str, model_name: str | None, image_size: int | None, datasets: Callable,
           shots: Sequence[int], seeds: int, l2_regs: Sequence[float], failures: dict[str, str],
           base: str | None = None, representation: str = "pre_logits",
           batch_size: int = 256) -> list[dict]:
  """One checkpoint's rows, on the datasets preprocessed as its description says (at
  `image_size`, else at its own resolution) in batches its forward pass fits in memory (up to
  `batch_size`); a job per dataset, its failures in `failures` (`CKPT on DATASET`, or `CKPT`
  where it cannot be loaded)."""
  from vit_jax import models
  from vit_jax.checkpoint import loader
  ckpt = jobs.attempt(path, lambda: loader.load(
      path, model_name and models.resolve_name(model_name), image_size=image_size, head=False,
      base=base), failures)
  if ckpt is None:
    return []
  features = jobs.attempt(
      path, lambda: fewshot_lsr.representation_fn(ckpt.model, representation), failures)
  if features is None:
    return []
  batch = _batch(ckpt, batch_size)
  evaluator = fewshot_lsr.FewShotEvaluator(
      features, datasets(ckpt.image_size, ckpt.description.preprocessing, batch), shots, seeds,
      l2_regs)
  rows = []
  for name in evaluator.datasets:
    for r in jobs.attempt(f"{path} on {name}", lambda: evaluator.dataset_results(ckpt.params, name),
                          failures) or []:
      rows.append(dict(checkpoint=path, dataset=r.dataset, shots=r.shots, mean=r.mean,
                       std=r.std, l2=r.l2, accuracies=" ".join(f"{a:.4f}" for a in r.accuracies),
                       representation=representation))
      print(f"  {r.dataset} {r.shots:>3}-shot: {100 * r.mean:.2f} ± {100 * r.std:.2f} "
            f"(l2={r.l2:g})", flush=True)
  return rows


def _batch(ckpt: "loader.Loaded", wanted: int) -> int:
  """The images a forward pass of the checkpoint's model takes at once here, said if fewer
  than `wanted` (--batch_size): 256 images of a ViT-L/14 at 518 px ran out of 24 GiB."""
  import jax
  from vit_jax.models import footprint
  free = footprint.available_bytes()
  batch = footprint.batch_for(ckpt.model, ckpt.image_size, wanted, jax.device_count(), free)
  if batch < wanted:
    each = footprint.forward_bytes_per_image(ckpt.model, ckpt.image_size)
    print(f"  batches of {batch} images (not --batch_size={wanted}): ~{footprint.gib(each)} "
          f"an image at {ckpt.image_size} px, {footprint.gib(free)} free", flush=True)
  return batch


def check_shots(datasets: Sequence[str], data_dir: str | None, train_split: str,
                shots: Sequence[int], download: bool) -> None:
  """Refuses shots that a class of a dataset's train split cannot give, with the examples held
  out to choose the l2 value on, before any checkpoint loads."""
  for name in datasets:
    try:
      fewshot_lsr.check_shots(name, data_dir, train_split, shots, download)
    except data.DataOptionError:
      raise
    except ValueError as e:
      raise ValueError(f"--shots={','.join(map(str, shots))}: {name} {train_split}: {e}, or "
                       "a larger --train_split") from None


def sweep(checkpoints: Sequence[str], model_name: str | None, datasets: Sequence[str],
          data_dir: str | None, train_split: str, test_split: str, image_size: int | None,
          batch_size: int, shots: Sequence[int], seeds: int, l2_regs: Sequence[float],
          out_dir: str, download: bool = False, base: str | None = None,
          representation: str = "pre_logits") -> tuple[list[dict], dict[str, str]]:
  """Probes every checkpoint on every dataset: jobs.py's rule, a job per (checkpoint, dataset);
  returns the rows and the failed jobs (see _probe) with why.

  `image_size` None probes each checkpoint at its own resolution."""
  from vit_jax.train import sharding
  fewshot_lsr.check_l2(l2_regs)
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())

  @functools.cache
  def batches(size: int, preprocessing: description.Preprocessing, batch: int) -> dict:
    return fewshot_lsr.fewshot_datasets(datasets, data_dir, train_split, test_split, size,
                                        batch, batch_sharding, preprocessing, download)

  # Reads only the datasets' metadata: a dataset that cannot be read fails here, once.
  batches(image_size or description.DEFAULT_IMAGE_SIZE, description.Preprocessing(),
          batch_size)
  check_shots(datasets, data_dir, train_split, shots, download)
  rows, failures = [], {}
  for i, path in enumerate(checkpoints):
    print(f"[{i + 1}/{len(checkpoints)}] {path}", flush=True)
    rows += _probe(path, model_name, image_size, batches, shots, seeds, l2_regs, failures, base,
                   representation, batch_size)
  write_reports(rows, failures, out_dir)
  return rows, failures


# How this command's flags set the data options that the data pipeline's errors name.
_DATA_OPTIONS = {"name": "--datasets", "data_dir": "--data_dir", "download": "pass --download",
                 "no_download": "no --download", "train_split": "--train_split",
                 "eval_split": "--test_split", "relax_class_mismatch": "",
                 "skip_bad_images": ""}


def _ints(s: str) -> list[int]:
  return [int(v) for v in s.split(",")]


def parser() -> argparse.ArgumentParser:
  p = cli.parser("vit-fewshot", __doc__)
  p.add_argument("checkpoints", nargs="+",
                 help="hf-hub:ORG/NAME, augreg:NAME, .npz files, orbax step dirs, or globs")
  p.add_argument("--model", help="architecture of .npz checkpoints, e.g. ViT-B_16 or b16 "
                 "(default: inferred from the arrays)")
  p.add_argument("--datasets", required=True,
                 help="comma-separated TFDS names or image folders (ROOT/<split>/<class>/*)")
  p.add_argument("--data_dir", default=None, help="TFDS data directory")
  p.add_argument("--download", action="store_true", help="let TFDS download missing datasets")
  p.add_argument("--train_split", default="train", help="pool the shots are drawn from")
  p.add_argument("--test_split", default="test")
  p.add_argument("--image_size", type=int, default=None,
                 help="resolution to probe at (default: each checkpoint's own)")
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--shots", type=_ints, default=list(fewshot_lsr.DEFAULT_SHOTS))
  p.add_argument("--seeds", type=int, default=fewshot_lsr.DEFAULT_SEEDS)
  p.add_argument("--l2", type=lambda s: [float(v) for v in s.split(",")],
                 default=list(fewshot_lsr.DEFAULT_L2))
  p.add_argument("--out_dir", default="fewshot_results")
  p.add_argument("--representation", choices=fewshot_lsr.REPRESENTATIONS, default="pre_logits",
                 help="what the probes see: the head's input, or the output tokens' class token, "
                 "patch mean or both (the DINOv2 paper's linear probe: class_token+patch_mean)")
  cli.add_base_flag(p)
  cli.add_verbose_flag(p)
  return p


@cli.command
def main(argv: list[str]) -> int:
  args = parser().parse_args(argv)
  paths = []
  for pattern in args.checkpoints:
    paths += sorted(glob.glob(pattern)) or [pattern]
  cli.check_checkpoints([*paths, args.base or ""])  # Before the library's imports: seconds.
  cli.check_counts(args, dict(shots=1, seeds=1, batch_size=1, image_size=1))
  fewshot_lsr.check_l2(args.l2)
  cli.check_output_dir("--out_dir", args.out_dir)
  cli.check_apart("--out_dir", args.out_dir, {
      "CKPT": paths, "--datasets": args.datasets.split(","), "--data_dir": [args.data_dir],
      "--base": [args.base]})
  cli.check_owned("--out_dir", args.out_dir, OUTPUTS.__contains__, ", ".join(OUTPUTS))
  logs.route_logs(verbose=args.verbose)
  logs.start_tensorflow()
  try:
    _, failures = sweep(paths, args.model, args.datasets.split(","), args.data_dir,
                        args.train_split, args.test_split, args.image_size, args.batch_size,
                        args.shots, args.seeds, args.l2, args.out_dir, args.download, args.base,
                        args.representation)
  except data.DataOptionError as e:  # A dataset that cannot be read: nothing to probe on.
    return cli.input_error(e.worded(_DATA_OPTIONS))
  print(f"Wrote {args.out_dir}/fewshot.{{csv,md,png}}", flush=True)
  return jobs.finish(failures, "probes")


if __name__ == "__main__":
  main()
