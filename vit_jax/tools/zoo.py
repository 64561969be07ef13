"""The AugReg zoo from the command line.

  vit-zoo list                      # offline: files with a Hub copy, the recommended ones
  vit-zoo list --model S_16 --adapt_resolution 384
  vit-zoo list --zoo_dir DIR --model S_16 --ds i21k --upstream --sort final_val   # DIR's index.csv
  vit-zoo fetch S_16 Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0

Without --zoo_dir, `list` shows the table shipped with vit_jax (timm's Hugging Face Hub copies
of AugReg files, the vision_transformer README's recommended checkpoints, final_val where the
cache holds the zoo's index.csv), and `fetch` downloads a file with a Hub copy through
huggingface_hub, into its cache ($HF_HOME); other files come from gs://vit_models/augreg,
which refuses anonymous reads since February 2026. `--zoo_dir` (default $VIT_JAX_AUGREG_DIR)
is any location holding index.csv and the .npz files, a local folder included: `list` shows
its whole index and `fetch` copies from it, into `--cache_dir` (default $VIT_JAX_CACHE/augreg
or ~/.cache/vit_jax/augreg).
"""
import argparse
import csv
import json
import os
import sys
from typing import Any, Mapping, Sequence

from vit_jax.checkpoint import augreg, specs
from vit_jax.tools import cli

FILTERS = ("name", "ds", "epochs", "lr", "aug", "wd", "do", "sd", "adapt_ds", "adapt_lr",
           "adapt_steps", "adapt_resolution")
TABLE_COLUMNS = ("name", "ds", "aug", "wd", "do", "sd", "final_val", "adapt_ds",
                 "adapt_resolution", "adapt_steps", "adapt_lr", "adapt_final_test",
                 "adapt_filename")
UPSTREAM_TABLE_COLUMNS = ("name", "ds", "aug", "wd", "do", "sd", "best_val", "final_val",
                          "params", "filename")
# The shipped table's view (no --zoo_dir): every row unless --limit.
CATALOG_TABLE_COLUMNS = ("filename", "model", "ds", "final_val", "imagenet_top1", "hub")
TABLE_LIMIT = 30


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  cells = [[_cell(r.get(c)) for c in columns] for r in rows]
  widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
  return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip()
                   for line in [list(columns)] + cells)


def _cell(value: Any) -> str:
  if value is None:
    return "-"
  return str(value)


def _columns(arg: str | None, rows: Sequence[Mapping[str, Any]], default: Sequence[str]):
  if not arg:
    return list(default)
  columns = arg.split(",")
  known = set().union(*(r.keys() for r in rows)) if rows else set(columns)
  unknown = [c for c in columns if c not in known]
  if unknown:
    raise augreg.ZooError(f"Unknown column(s) {unknown} for --columns; the rows have: "
                          f"{', '.join(sorted(known))}.")
  return columns


def _index_mode(args: argparse.Namespace) -> bool:
  """Whether `list` reads a zoo's index.csv (a zoo named, or --refresh) or the shipped table."""
  return bool(args.zoo_dir or os.environ.get("VIT_JAX_AUGREG_DIR") or args.refresh)


def source_line(rows: Sequence[Mapping[str, Any]], index: str | None) -> str:
  """Where the shipped table's facts come from, as its rows name them."""
  parts = []
  for r in rows:
    parts += [p for p in (r.get("source") or "").split("; ") if p and p not in parts]
  parts = [f"{p}s" if p.endswith(" cfg") else p for p in parts]
  return (f"source: {'; '.join(parts) or 'no rows'} ({os.path.basename(augreg.HUB_TABLE)}"
          f"{'; final_val: ' + index if index else ''})")


def _rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
  """The filtered, sorted rows, and the source line of the shipped table (None: an index)."""
  footer = None
  if _index_mode(args):
    rows = augreg.read_index(args.zoo_dir, args.cache_dir, refresh=args.refresh)
  else:
    rows, index = augreg.catalog(args.cache_dir)
    footer = source_line(rows, index)
    rows = [r for r in rows if not (args.upstream and r["adapt_ds"])]
  equals = {f: getattr(args, f) for f in FILTERS if getattr(args, f) is not None}
  rows = augreg.filter_rows(rows, model=args.model, upstream=args.upstream and not footer,
                            **equals)
  if args.sort:
    sort = args.sort.split(",")
    known = set().union(*(r.keys() for r in rows))
    unknown = [c for c in sort if rows and c not in known]
    if unknown:
      raise augreg.ZooError(f"Cannot sort by {unknown}: not a column of the listed rows "
                            f"({', '.join(sorted(known))}).")
    rows = augreg.sort_rows(rows, sort, descending=not args.ascending)
  return rows, footer


def list_command(args: argparse.Namespace) -> int:
  rows, footer = _rows(args)
  default_limit = TABLE_LIMIT if args.format == "table" and not footer else 0
  limit = args.limit if args.limit is not None else default_limit
  shown = rows[:limit] if limit > 0 else rows

  if args.format == "json":
    columns = _columns(args.columns, rows, ())
    json.dump([{c: r.get(c) for c in columns} if columns else r for r in shown], sys.stdout,
              indent=1)
    print()
  elif args.format == "csv":
    empty = augreg.CATALOG_COLUMNS if footer else augreg.COLUMNS
    columns = _columns(args.columns, rows, list(rows[0]) if rows else empty)
    writer = csv.DictWriter(sys.stdout, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(shown)
  else:
    default = (CATALOG_TABLE_COLUMNS if footer else
               UPSTREAM_TABLE_COLUMNS if args.upstream else TABLE_COLUMNS)
    print(format_table(shown, _columns(args.columns, rows, default)))
  if len(shown) < len(rows):
    print(f"... {len(rows) - len(shown)} more of {len(rows)} rows (--limit 0 shows all).",
          file=sys.stderr)
  if footer:
    print(footer, file=sys.stdout if args.format == "table" else sys.stderr)
  return 0


def fetch_command(args: argparse.Namespace) -> int:
  for name in args.names:
    resolved = augreg.resolve(name, args.zoo_dir, args.cache_dir, progress=not args.quiet)
    path = resolved.path
    if resolved.source == "hub":
      spec = specs.augreg(name)
      print(f"{resolved.filename}: downloading its copy on the Hugging Face Hub, "
            f"{resolved.hub_id}, into huggingface_hub's cache ({spec} reads it from there).",
            file=sys.stderr, flush=True)
      path = augreg.fetch_hub(resolved.hub_id)
    print(f"{path}\t{resolved.model_name}\t{resolved.image_size}px")
  return 0


def parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--zoo_dir", default=None,
                      help="a copy of the bucket, index.csv beside the .npz files (a local "
                      "folder works too; default: $VIT_JAX_AUGREG_DIR): list shows its index, "
                      "fetch copies from it, Hub copy or not. Without either, list shows the "
                      "shipped table and fetch uses the Hugging Face Hub, else "
                      f"{augreg.DEFAULT_ZOO_DIR}")
  common.add_argument("--cache_dir", default=None,
                      help="the local cache (default: $VIT_JAX_CACHE/augreg or "
                      "~/.cache/vit_jax/augreg)")
  p = cli.parser("vit-zoo", __doc__)
  sub = p.add_subparsers(dest="command", required=True)

  ls = sub.add_parser("list", parents=[common],
                      help="filter, sort and print the shipped table, or a zoo's index")
  ls.add_argument("--model", help="S_16, R26_S_32, S/16, ViT-S_16, s16, ...")
  for f in FILTERS:
    ls.add_argument(f"--{f}", help=f"only rows whose {f} equals this")
  ls.add_argument("--upstream", action="store_true",
                  help="one row per pre-trained checkpoint, upstream columns only")
  ls.add_argument("--sort", help="column(s), comma-separated; largest first")
  ls.add_argument("--ascending", action="store_true", help="sort smallest first")
  ls.add_argument("--columns", help="comma-separated columns to print")
  ls.add_argument("--format", choices=("table", "csv", "json"), default="table")
  ls.add_argument("--limit", type=int, default=None,
                  help=f"rows to print, 0 for all (default: {TABLE_LIMIT} for an index's "
                  "table, else all)")
  ls.add_argument("--refresh", action="store_true",
                  help="copy a remote index.csv again (default zoo: the bucket)")
  ls.set_defaults(func=list_command)

  fe = sub.add_parser("fetch", parents=[common],
                      help="download checkpoints: via the Hub, else into the cache")
  fe.add_argument("names", nargs="+", metavar="NAME",
                  help="a model (S_16: the recommended i21k checkpoint) or a filename")
  fe.add_argument("--quiet", action="store_true", help="no progress bar")
  fe.set_defaults(func=fetch_command)
  return p


@cli.command
def main(argv: list[str]) -> int:
  args = parser().parse_args(argv)
  if args.command == "list":
    cli.check_counts(args, dict(limit=0))
  cli.check_apart("--cache_dir", args.cache_dir,
                  {"--zoo_dir": [args.zoo_dir or os.environ.get("VIT_JAX_AUGREG_DIR")]})
  return args.func(args)


if __name__ == "__main__":
  main()
