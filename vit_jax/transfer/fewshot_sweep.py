"""`vit-fewshot`'s sweep: every checkpoint probed on every dataset by few-shot least-squares
probes (evaluators/fewshot_lsr.py), at the checkpoint's resolution on images preprocessed as its
description records, in batches its forward pass fits in memory; the rows written as
fewshot.csv, fewshot.md and fewshot.png. A job per (checkpoint, dataset) goes through the
caller's `attempt` (the commands' rule, tools/jobs.py: a failure recorded and told, the other
jobs go on).
"""
import contextlib
import csv
import fcntl
import functools
import os
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import numpy as np

from vit_jax import data  # Its names load when used.
from vit_jax.checkpoint import description
from vit_jax.evaluators import fewshot_lsr
from vit_jax.transfer import results

if TYPE_CHECKING:  # Imported where used: the loader's JAX and orbax take seconds.
  from vit_jax.checkpoint import loader

T = TypeVar("T")
# attempt(job, work, failures): work()'s result, or None with failures[job] set to why.
Attempt = Callable[[str, Callable[[], T], dict[str, str]], T | None]

OUTPUTS = ("fewshot.csv", "fewshot.md", "fewshot.png")


FIELDS = ("checkpoint", "dataset", "shots", "mean", "std", "l2", "accuracies", "representation")


def write_reports(rows: list[dict], failures: dict[str, str], out_dir: str) -> list[dict]:
  """fewshot.csv, fewshot.md and fewshot.png in `out_dir`: this sweep's rows merged into those
  already there (a checkpoint probed again on a dataset, with the same representation, has its
  rows replaced; the others are kept), under a lock on the folder, each file replaced whole, so
  that sweeps run one after another or side by side into one folder (a job a checkpoint) keep
  every row. The Markdown table names this sweep's failures. Returns the rows written."""
  os.makedirs(out_dir, exist_ok=True)
  with _locked(out_dir):
    probed = {_key(r) for r in rows}
    rows = [r for r in _read(out_dir) if _key(r) not in probed] + rows
    with results.replacing(os.path.join(out_dir, OUTPUTS[0])) as path, open(
        path, "w", newline="") as f:
      writer = csv.DictWriter(f, FIELDS)
      writer.writeheader()
      writer.writerows(rows)
    with results.replacing(os.path.join(out_dir, OUTPUTS[1])) as path:
      path.write_text(_markdown(rows, failures))
    with results.replacing(os.path.join(out_dir, OUTPUTS[2])) as path:
      _plot(rows, sorted({r["dataset"] for r in rows}), str(path))
  return rows


def _key(row: dict) -> tuple[str, str, str]:
  return row["checkpoint"], row["dataset"], row.get("representation") or "pre_logits"


def _read(out_dir: str) -> list[dict]:
  """The rows of the folder's fewshot.csv, typed as a sweep makes them; none without one."""
  try:
    with open(os.path.join(out_dir, OUTPUTS[0]), newline="") as f:
      return [dict(r, shots=int(r["shots"]), mean=float(r["mean"]), std=float(r["std"]),
                   l2=float(r["l2"]), representation=r.get("representation") or "pre_logits")
              for r in csv.DictReader(f)]
  except FileNotFoundError:
    return []


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
  """An exclusive lock on the folder (flock on its descriptor), for one sweep's merge."""
  fd = os.open(folder, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def _label(row: dict) -> str:
  """A row's checkpoint, with its representation where it is not the default one."""
  rep = row.get("representation") or "pre_logits"
  return row["checkpoint"] + ("" if rep == "pre_logits" else f" ({rep})")


def _markdown(rows: list[dict], failures: dict[str, str]) -> str:
  datasets = sorted({r["dataset"] for r in rows})
  shots = sorted({r["shots"] for r in rows})
  lines = ["| checkpoint | dataset | " + " | ".join(f"{k}-shot" for k in shots) + " |",
           "|---|---|" + "---|" * len(shots)] if rows else ["No results: every checkpoint failed."]
  by_key = {(_label(r), r["dataset"], r["shots"]): r for r in rows}
  for probe in dict.fromkeys(map(_label, rows)):
    for ds in datasets:
      found = [by_key.get((probe, ds, k)) for k in shots]
      cells = [f"{100 * r['mean']:.2f} ± {100 * r['std']:.2f}" if r else "" for r in found]
      if any(cells):
        lines.append(f"| {probe} | {ds} | " + " | ".join(cells) + " |")
  if failures:
    lines += ["", "Failed:"] + [f"- {job}: {e}" for job, e in failures.items()]
  return "\n".join(lines) + "\n"


def _plot(rows: list[dict], datasets: list[str], path: str) -> None:
  """Accuracy against shots, a panel a dataset, a line a checkpoint (and representation) that
  has results there."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(5 * max(len(datasets), 1), 4),
                           squeeze=False)
  for ax, ds in zip(axes[0], datasets):
    for probe in dict.fromkeys(map(_label, rows)):
      pts = sorted((r["shots"], r["mean"], r["std"]) for r in rows
                   if _label(r) == probe and r["dataset"] == ds)
      if pts:
        k, m, s = (np.array(v) for v in zip(*pts))
        ax.errorbar(k, 100 * m, yerr=100 * s, marker="o", capsize=3, label=probe)
    ax.set(xscale="log", xlabel="shots per class", ylabel="accuracy (%)", title=ds)
    ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100, format="png")
  plt.close(fig)


def _probe(path: str, model_name: str | None, image_size: int | None, datasets: Callable,
           shots: Sequence[int], seeds: int, l2_regs: Sequence[float], failures: dict[str, str],
           base: str | None, representation: str, batch_size: int, attempt: Attempt,
           log: Callable[[str], None]) -> list[dict]:
  """One checkpoint's rows, on the datasets preprocessed as its description says (at
  `image_size`, else at its own resolution) in batches its forward pass fits in memory (up to
  `batch_size`); a job per dataset, its failures in `failures` (`CKPT on DATASET`, or `CKPT`
  where it cannot be loaded)."""
  from vit_jax import models
  from vit_jax.checkpoint import loader
  ckpt = attempt(path, lambda: loader.load(
      path, model_name and models.resolve_name(model_name), image_size=image_size, head=False,
      base=base), failures)
  if ckpt is None:
    return []
  features = attempt(
      path, lambda: fewshot_lsr.representation_fn(ckpt.model, representation), failures)
  if features is None:
    return []
  batch = _batch(ckpt, batch_size, log)
  evaluator = fewshot_lsr.FewShotEvaluator(
      features, datasets(ckpt.image_size, ckpt.description.preprocessing, batch), shots, seeds,
      l2_regs)
  rows = []
  for name in evaluator.datasets:
    for r in attempt(f"{path} on {name}", lambda: evaluator.dataset_results(ckpt.params, name),
                          failures) or []:
      rows.append(dict(checkpoint=path, dataset=r.dataset, shots=r.shots, mean=r.mean,
                       std=r.std, l2=r.l2, accuracies=" ".join(f"{a:.4f}" for a in r.accuracies),
                       representation=representation))
      log(f"  {r.dataset} {r.shots:>3}-shot: {100 * r.mean:.2f} ± {100 * r.std:.2f} "
          f"(l2={r.l2:g})")
  return rows


def _batch(ckpt: "loader.Loaded", wanted: int, log: Callable[[str], None]) -> int:
  """The images a forward pass of the checkpoint's model takes at once here, said if fewer
  than `wanted` (--batch_size): 256 images of a ViT-L/14 at 518 px ran out of 24 GiB."""
  import jax
  from vit_jax.models import footprint
  free = footprint.available_bytes()
  batch = footprint.batch_for(ckpt.model, ckpt.image_size, wanted, jax.device_count(), free)
  if batch < wanted:
    each = footprint.forward_bytes_per_image(ckpt.model, ckpt.image_size)
    log(f"  batches of {batch} images (not --batch_size={wanted}): ~{footprint.gib(each)} "
        f"an image at {ckpt.image_size} px, {footprint.gib(free)} free")
  return batch


def check_shots(datasets: Sequence[str], reading: fewshot_lsr.Reading, train_split: str,
                shots: Sequence[int]) -> None:
  """Refuses shots that a class of a dataset's train split cannot give, with the examples held
  out to choose the l2 value on, before any checkpoint loads."""
  for name in datasets:
    try:
      fewshot_lsr.check_shots(name, reading, train_split, shots)
    except data.DataOptionError:
      raise
    except ValueError as e:
      raise ValueError(f"--shots={','.join(map(str, shots))}: {name} {train_split}: {e}, or "
                       "a larger --train_split") from None


def sweep(checkpoints: Sequence[str], model_name: str | None, datasets: Sequence[str],
          reading: fewshot_lsr.Reading, train_split: str, test_split: str,
          image_size: int | None,
          batch_size: int, shots: Sequence[int], seeds: int, l2_regs: Sequence[float],
          out_dir: str, base: str | None = None,
          representation: str = "pre_logits", *, attempt: Attempt,
          log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, str]]:
  """Probes every checkpoint on every dataset, a job per (checkpoint, dataset), each through
  `attempt`; writes the reports; returns the rows and the failed jobs (see _probe) with why.
  `log` hears of each checkpoint and result.

  `image_size` None probes each checkpoint at its own resolution."""
  from vit_jax.train import sharding
  fewshot_lsr.check_l2(l2_regs)
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())

  @functools.cache
  def batches(size: int, preprocessing: description.Preprocessing, batch: int) -> dict:
    return fewshot_lsr.fewshot_datasets(datasets, reading, train_split, test_split, size,
                                        batch, batch_sharding, preprocessing)

  # Reads only the datasets' metadata: a dataset that cannot be read fails here, once.
  batches(image_size or description.DEFAULT_IMAGE_SIZE, description.Preprocessing(),
          batch_size)
  check_shots(datasets, reading, train_split, shots)
  rows, failures = [], {}
  for i, path in enumerate(checkpoints):
    log(f"[{i + 1}/{len(checkpoints)}] {path}")
    rows += _probe(path, model_name, image_size, batches, shots, seeds, l2_regs, failures, base,
                   representation, batch_size, attempt, log)
  kept = len(write_reports(rows, failures, out_dir)) - len(rows)
  if kept:
    log(f"{os.path.join(out_dir, OUTPUTS[0])} keeps {kept} rows of earlier sweeps beside these.")
  return rows, failures
