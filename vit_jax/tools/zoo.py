"""The AugReg zoo from the command line.

  vit-zoo list --model S_16 --ds i21k --upstream --sort final_val
  vit-zoo list --adapt_ds imagenet2012 --adapt_resolution 384 --format csv
  vit-zoo fetch S_16 Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0

`--zoo_dir` (default $VIT_JAX_AUGREG_DIR or gs://vit_models/augreg) is any location
holding index.csv and the .npz files, a local folder included; fetched files go to
`--cache_dir` (default $VIT_JAX_CACHE/augreg or ~/.cache/vit_jax/augreg).
"""
import argparse
import csv
import json
import sys
from typing import Any, Mapping, Sequence

from vit_jax.checkpoint import augreg
from vit_jax.tools import cli

FILTERS = ("name", "ds", "epochs", "lr", "aug", "wd", "do", "sd", "adapt_ds", "adapt_lr",
           "adapt_steps", "adapt_resolution")
TABLE_COLUMNS = ("name", "ds", "aug", "wd", "do", "sd", "final_val", "adapt_ds",
                 "adapt_resolution", "adapt_steps", "adapt_lr", "adapt_final_test",
                 "adapt_filename")
UPSTREAM_TABLE_COLUMNS = ("name", "ds", "aug", "wd", "do", "sd", "best_val", "final_val",
                          "params", "filename")
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


def list_command(args: argparse.Namespace) -> int:
  rows = augreg.read_index(args.zoo_dir, args.cache_dir, refresh=args.refresh)
  equals = {f: getattr(args, f) for f in FILTERS if getattr(args, f) is not None}
  rows = augreg.filter_rows(rows, model=args.model, upstream=args.upstream, **equals)
  if args.sort:
    sort = args.sort.split(",")
    known = set().union(*(r.keys() for r in rows))
    unknown = [c for c in sort if rows and c not in known]
    if unknown:
      raise augreg.ZooError(f"Cannot sort by {unknown}: not a column of the listed rows "
                            f"({', '.join(sorted(known))}).")
    rows = augreg.sort_rows(rows, sort, descending=not args.ascending)
  limit = args.limit if args.limit is not None else TABLE_LIMIT if args.format == "table" else 0
  shown = rows[:limit] if limit > 0 else rows

  if args.format == "json":
    columns = _columns(args.columns, rows, ())
    json.dump([{c: r.get(c) for c in columns} if columns else r for r in shown], sys.stdout,
              indent=1)
    print()
  elif args.format == "csv":
    columns = _columns(args.columns, rows, list(rows[0]) if rows else augreg.COLUMNS)
    writer = csv.DictWriter(sys.stdout, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(shown)
  else:
    default = UPSTREAM_TABLE_COLUMNS if args.upstream else TABLE_COLUMNS
    print(format_table(shown, _columns(args.columns, rows, default)))
  if len(shown) < len(rows):
    print(f"... {len(rows) - len(shown)} more of {len(rows)} rows (--limit 0 shows all).",
          file=sys.stderr)
  return 0


def fetch_command(args: argparse.Namespace) -> int:
  for name in args.names:
    resolved = augreg.resolve(name, args.zoo_dir, args.cache_dir, progress=not args.quiet)
    print(f"{resolved.path}\t{resolved.model_name}\t{resolved.image_size}px")
  return 0


def parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--zoo_dir", default=None,
                      help=f"index.csv and .npz files (default: $VIT_JAX_AUGREG_DIR or "
                      f"{augreg.DEFAULT_ZOO_DIR}); a local folder works too")
  common.add_argument("--cache_dir", default=None,
                      help="the local cache (default: $VIT_JAX_CACHE/augreg or "
                      "~/.cache/vit_jax/augreg)")
  p = cli.parser("vit-zoo", __doc__)
  sub = p.add_subparsers(dest="command", required=True)

  ls = sub.add_parser("list", parents=[common], help="filter, sort and print the index")
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
                  help=f"rows to print, 0 for all (default: {TABLE_LIMIT} for the table, all "
                  "for csv/json)")
  ls.add_argument("--refresh", action="store_true", help="copy a remote index.csv again")
  ls.set_defaults(func=list_command)

  fe = sub.add_parser("fetch", parents=[common], help="copy checkpoints into the cache")
  fe.add_argument("names", nargs="+", metavar="NAME",
                  help="a model (S_16: the recommended i21k checkpoint) or a filename")
  fe.add_argument("--quiet", action="store_true", help="no progress bar")
  fe.set_defaults(func=fetch_command)
  return p


@cli.command
def main(argv: list[str]) -> int:
  args = parser().parse_args(argv)
  return args.func(args)


def run() -> None:
  cli.run(main)


if __name__ == "__main__":
  run()
