r"""The paper's pre-training configs compiled for Cloud TPU slices without a TPU (libtpu's
compile-only devices; vit_jax/train/compile_check.py, what `vit-train --compile_only` runs):
does each fit (or the first change that does), HBM per chip, FLOPs per chip per step from
XLA beside the analytic count, and the roofline bound on images/s and on days for 90 epochs
of ImageNet-21k, beside the paper's own cost. A markdown table on stdout.

    PYTHONPATH=. python benchmarks/tpu_compile_table.py [--configs b32,b16] \
        [--slices v4-32,v5litepod-64] [--rows FILE] [--before OLD]

With --rows, each row is appended to FILE (one JSON object a line) as soon as it is compiled,
rows already there are not compiled again, and the table shows every row of the file: a long
table can be built over several runs. With --before OLD (an earlier run's rows file), a column
gives each row's change in HBM and in the roofline bound.

Each compile of a ViT-B takes minutes on 2 CPU cores, ViT-H longer; a config that does not
fit compiles its candidate fixes too (compile_check.MAX_CANDIDATES at most).
"""
import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiles only.

from vit_jax import configs  # noqa: E402
from vit_jax.train import compile_check  # noqa: E402
from vit_jax.train.tpu_specs import GiB  # noqa: E402

CONFIGS = ("b16", "l16", "h14", "b32", "r50_b16")  # pretrain:NAME,i21k: batch 4096, bf16.
SLICES = ("v4-32", "v5p-32", "v5litepod-64", "v5litepod-256", "v6e-64")
# ImageNet-21k (fall 2011): 14,197,122 images (image-net.org/about-stats), less the
# 102,400 the i21k config holds out for evaluation.
EPOCH_IMAGES = 14_197_122 - 102_400
EPOCHS = 90
# The paper's Table 2 (Dosovitskiy et al., 2021): pre-training cost in TPUv3-core-days (two
# cores a chip), on ImageNet-21k (the configs' dataset) and on JFT-300M.
PAPER_CORE_DAYS = {"l16": "0.23k (i21k); 0.68k (JFT)", "h14": "2.5k (JFT)"}


def row(name: str, slice_name: str) -> dict[str, Any]:
  c = configs.get_config(f"pretrain:{name},i21k")
  topology = compile_check.resolve_topology(slice_name)
  t0 = time.time()
  found = compile_check.search(c, topology, compile_check.KNOWN_CLASSES["imagenet21k"],
                               log=lambda line: print(f"  {name} {slice_name}: {line}",
                                                      file=sys.stderr, flush=True))
  shown = found.given if found.given.fits else found.found
  out = dict(config=name, slice=slice_name, chips=topology.chips, compile_s=time.time() - t0,
             fits=found.given.fits, fix=None if found.given.fits else (
                 shown.described() if shown else f"none of {len(found.tried)} fits"))
  if shown is not None:
    out["report"] = compile_check.report(c, topology, shown)
  return out


def _cells(r: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
  fits = "yes" if r["fits"] else f"no: `{r['fix']}`"
  rep = r.get("report")
  if rep is None:
    return [r["config"], r["slice"], str(r["chips"]), fits] + ["-"] * 7 + [
        PAPER_CORE_DAYS.get(r["config"], ""), f"{r['compile_s']:.0f}"]
  train = rep["train"]
  flops = train.get("total_flops", train["flops"])  # Rows from before kernels were counted.
  img_s = train["roofline"]["images_per_s"]
  days = EPOCH_IMAGES * EPOCHS / img_s / 86400
  return [r["config"], r["slice"], str(r["chips"]), fits,
          f"{train['total_bytes'] / GiB:.1f} / {rep['hbm_capacity_bytes'] / GiB:.0f}",
          f"{flops / 1e12:.2f}", f"{train['analytic_flops'] / 1e12:.2f}",
          f"{flops / train['analytic_flops']:.2f}", f"{img_s:,.0f}",
          f"{days:.1f} ({days * r['chips']:,.0f} chip-days)", _change(train, before),
          PAPER_CORE_DAYS.get(r["config"], ""), f"{r['compile_s']:.0f}"]


def _change(train: dict[str, Any], before: dict[str, Any] | None) -> str:
  """HBM and the roofline bound on images/s against the same row of --before: "HBM -32%,
  1.25x img/s"."""
  if before is None or before.get("report") is None:
    return ""
  if before["report"]["train"] == train:
    return "the same row (not compiled again)"
  old = before["report"]["train"]
  hbm = train["total_bytes"] / old["total_bytes"] - 1
  return f"HBM {hbm:+.0%}, {old['roofline']['step_s'] / train['roofline']['step_s']:.2f}x img/s"


HEADER = ["config (pretrain:_,i21k)", "slice", "chips", "fits (or the fix)",
          "train HBM/chip GiB", "TFLOP/chip/step (XLA + kernels)", "analytic", "ratio",
          "roofline img/s (bound)", f"days for {EPOCHS} epochs (bound)", "vs --before (bound)",
          "paper: TPUv3-core-days", "compile s"]


def _order(r: dict[str, Any]) -> tuple[int, int]:
  known = lambda names, name: names.index(name) if name in names else len(names)
  return known(CONFIGS, r["config"]), known(SLICES, r["slice"])


def table(rows: list[dict[str, Any]], before: list[dict[str, Any]] = ()) -> str:
  """Rows by config, then slice, in CONFIGS' and SLICES' order; beside each, the change from
  the same row in `before`."""
  old = {(r["config"], r["slice"]): r for r in before}
  lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
  return "\n".join(lines + ["| " + " | ".join(_cells(r, old.get((r["config"], r["slice"]))))
                            + " |" for r in sorted(rows, key=_order)])


def _read(path: str | None) -> list[dict[str, Any]]:
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--slices", default=",".join(SLICES))
  p.add_argument("--rows", help="a JSON-lines file of rows: appended to, and read back")
  p.add_argument("--before", help="rows of an earlier run (its --rows file), to compare with")
  args = p.parse_args()
  rows = _read(args.rows)
  done = {(r["config"], r["slice"]) for r in rows}
  for name in args.configs.split(","):
    for slice_name in args.slices.split(","):
      if (name, slice_name) in done:
        continue
      rows.append(row(name, slice_name))
      if args.rows:
        with open(args.rows, "a") as f:
          f.write(json.dumps(rows[-1]) + "\n")
  print(table(rows, _read(args.before)))


if __name__ == "__main__":
  main()
