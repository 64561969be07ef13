"""The AugReg checkpoints by name: the zoo's index.csv, a local cache, `augreg:` specs.

"How to train your ViT?" (Steiner et al., 2021) released ~50k checkpoints in
gs://vit_models/augreg, one `FILENAME.npz` per upstream (pre-training) run and per
fine-tuning ("adaptation") of it, described by `index.csv`: one row per adaptation,
columns `filename` (upstream) and `adapt_filename`. Specs:

  augreg:S_16      the recommended upstream checkpoint of S_16 (see `best_checkpoint`)
  augreg:FILENAME  any `filename` or `adapt_filename` of the index, `.npz` optional

The model comes from the name (`R26_S_32-...` -> `R26+ViT-S_32`), the resolution
from the file (`...-res_384` -> 384; upstream checkpoints were trained at 224).
"""
import csv
import dataclasses
import difflib
import io
import os
import re
import tempfile
from typing import Any, Iterable, Sequence

from etils import epath

from vit_jax import models

PREFIX = "augreg:"
DEFAULT_ZOO_DIR = "gs://vit_models/augreg"
UPSTREAM_RESOLUTION = 224

# The published order (the bucket's index.csv also has `epochs` after `ds`).
COLUMNS = ("name", "ds", "lr", "aug", "wd", "do", "sd", "best_val", "final_val", "final_test",
           "adapt_ds", "adapt_lr", "adapt_steps", "adapt_resolution", "adapt_final_val",
           "adapt_final_test", "params", "infer_samples_per_sec", "filename", "adapt_filename")
UPSTREAM_COLUMNS = ("name", "ds", "epochs", "lr", "aug", "wd", "do", "sd", "best_val",
                    "final_val", "final_test", "params", "infer_samples_per_sec", "filename")
_INT_COLUMNS = frozenset({"epochs", "adapt_steps", "adapt_resolution", "params"})
_FLOAT_COLUMNS = frozenset({"lr", "wd", "do", "sd", "best_val", "final_val", "final_test",
                            "adapt_lr", "adapt_final_val", "adapt_final_test",
                            "infer_samples_per_sec"})
_REQUIRED = ("name", "ds", "final_val", "filename", "adapt_filename")

# The first '-'-separated part of every published filename, and its registry model.
MODELS = {
    "Ti_16": "ViT-Ti_16", "S_16": "ViT-S_16", "S_32": "ViT-S_32", "B_8": "ViT-B_8",
    "B_16": "ViT-B_16", "B_32": "ViT-B_32", "L_16": "ViT-L_16",
    "R_Ti_16": "R+ViT-Ti_16", "R26_S_32": "R26+ViT-S_32", "R50_L_32": "R50+ViT-L_32",
}

Row = dict[str, Any]


class ZooError(ValueError):
  """An AugReg name, index or checkpoint that cannot be found or reached."""


@dataclasses.dataclass(frozen=True)
class Resolved:
  path: str                 # The local .npz, in the cache.
  filename: str             # Without `.npz`.
  model: str                # AugReg name, e.g. "R26_S_32".
  model_name: str           # Registry name, e.g. "R26+ViT-S_32".
  image_size: int           # 224 upstream, N for an adapted `...-res_N`.
  adapt_ds: str | None      # The fine-tuning dataset of an adapted checkpoint.
  row: Row | None = None    # Its index row, when the index was read.


def is_spec(path: str) -> bool:
  """Whether `path` names an AugReg checkpoint (`augreg:...`) rather than a file."""
  return isinstance(path, str) and path.startswith(PREFIX)


def default_zoo_dir() -> str:
  return os.environ.get("VIT_JAX_AUGREG_DIR") or DEFAULT_ZOO_DIR


def default_cache_dir() -> str:
  """$VIT_JAX_CACHE/augreg, else $XDG_CACHE_HOME/vit_jax/augreg, else ~/.cache/vit_jax/augreg."""
  root = os.environ.get("VIT_JAX_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vit_jax")
  return os.path.join(root, "augreg")


def _cache(cache_dir: str | None) -> str:
  return os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))


def _is_remote(location: str) -> bool:
  return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", location) is not None


def public_url(url: str) -> str:
  """gs://BUCKET/PATH -> https://storage.googleapis.com/BUCKET/PATH (readable without gsutil)."""
  return "https://storage.googleapis.com/" + url[len("gs://"):] if url.startswith("gs://") else url


def _unreachable(url: str, dest: str, cause: Exception, fetch_hint: bool = True) -> ZooError:
  if url.startswith("gs://"):
    how = [f"  gsutil cp {url} {dest}", f"  curl -fLo {dest} {public_url(url)}"]
  else:
    how = [f"  cp {url} {dest}"]
  if fetch_hint:
    how.append(f"  vit-zoo fetch {os.path.basename(dest).removesuffix('.npz')} "
               f"--cache_dir {os.path.dirname(dest)} --zoo_dir DIR   (DIR: a local folder "
               "holding the bucket's files)")
  else:
    how.append("A checkpoint named by its full filename (augreg:FILENAME) needs no index.")
  return ZooError(f"Cannot read {url} ({type(cause).__name__}: {cause}).\nPlace the file in the "
                  "cache by hand, with one of:\n" + "\n".join(how))


def _number(column: str, text: str) -> int | float | None:
  text = text.strip()
  if not text or text.lower() == "nan":
    return None
  try:
    return int(float(text)) if column in _INT_COLUMNS else float(text)
  except ValueError:
    raise ZooError(f"index.csv: column {column!r} holds {text!r}, not a number.") from None


def parse_index(text: str) -> list[Row]:
  """Typed rows of an index.csv: numbers as int/float, empty cells as None."""
  reader = csv.DictReader(io.StringIO(text))
  missing = [c for c in _REQUIRED if c not in (reader.fieldnames or ())]
  if missing:
    raise ZooError(f"index.csv lacks the column(s) {missing}; its header is "
                   f"{reader.fieldnames}. Expected the published columns: {', '.join(COLUMNS)}.")
  rows = []
  for raw in reader:
    rows.append({k: _number(k, v) if k in _INT_COLUMNS | _FLOAT_COLUMNS else (v or None)
                 for k, v in raw.items()})
  return rows


def read_index(zoo_dir: str | None = None, cache_dir: str | None = None,
               refresh: bool = False) -> list[Row]:
  """The zoo's index. A remote one is copied to `cache_dir/index.csv` once and reused
  from there (`refresh` copies it again); a local folder's is read in place."""
  zoo_dir = zoo_dir or default_zoo_dir()
  url = f"{zoo_dir.rstrip('/')}/index.csv"
  if not _is_remote(zoo_dir):
    if not os.path.isfile(url):
      raise ZooError(f"No index.csv in {zoo_dir}: --zoo_dir (or $VIT_JAX_AUGREG_DIR) must be a "
                     f"folder in the layout of {DEFAULT_ZOO_DIR}, index.csv beside the "
                     "FILENAME.npz files, or a URL such as the default.")
    path = url
  else:
    path = os.path.join(_cache(cache_dir), "index.csv")
    if refresh or not os.path.exists(path):
      copy_to_cache(url, path, progress=False, fetch_hint=False)
  with open(path, encoding="utf-8") as f:
    return parse_index(f.read())


def model_key(name: str) -> str:
  """The AugReg model of any of its spellings: "S_16", "S/16" (the index's `name`),
  "ViT-S_16", "s16", "R26+S/32", "R26+ViT-S_32" -> "S_16", ..., "R26_S_32"."""
  if name in MODELS:
    return name
  spelled = name.replace("+", "_").replace("/", "_")
  if spelled in MODELS:
    return spelled
  by_registry = {v: k for k, v in MODELS.items()}
  try:
    return by_registry[models.resolve_name(name)]
  except (ValueError, KeyError):
    close = difflib.get_close_matches(spelled, MODELS, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise ZooError(f"Unknown AugReg model {name!r}.{hint} AugReg models: "
                   f"{', '.join(MODELS)}.") from None


def registry_name(model: str) -> str:
  """"R26_S_32" (or any spelling `model_key` takes) -> "R26+ViT-S_32"."""
  return MODELS[model_key(model)]


def _wanted(column: str, value: Any) -> Any:
  if column not in _INT_COLUMNS | _FLOAT_COLUMNS:
    return str(value)
  try:
    return float(value)
  except ValueError:
    raise ZooError(f"{column} is a number column; {value!r} is not a number.") from None


def upstream_row(row: Row) -> Row:
  """Only the columns of the upstream (pre-training) checkpoint."""
  return {c: row[c] for c in UPSTREAM_COLUMNS if c in row}


def filter_rows(rows: Iterable[Row], *, model: str | None = None, upstream: bool = False,
                **equals: Any) -> list[Row]:
  """Rows of `model` (any spelling) whose columns equal `equals` (numbers compared as
  numbers: wd="0.1" matches 0.1). `upstream` keeps one row per upstream `filename`,
  with only the upstream columns."""
  key = model_key(model) if model else None
  wanted = {col: _wanted(col, value) for col, value in equals.items()}
  out, seen = [], set()
  for row in rows:
    if key and row["filename"].split("-")[0] != key:
      continue
    if any(row.get(col) != value for col, value in wanted.items()):
      continue
    if upstream:
      if row["filename"] in seen:
        continue
      seen.add(row["filename"])
      row = upstream_row(row)
    out.append(row)
  return out


def sort_rows(rows: Iterable[Row], columns: Sequence[str], descending: bool = True) -> list[Row]:
  """Sorted by `columns` in turn; rows without a value come last either way."""
  rows = list(rows)
  for col in reversed(columns):
    have = [r for r in rows if r.get(col) is not None]
    rows = sorted(have, key=lambda r: r[col], reverse=descending) + [
        r for r in rows if r.get(col) is None]
  return rows


def best_checkpoint(rows: Iterable[Row], model: str) -> Row:
  """The recommended upstream checkpoint of `model`: the best `final_val` among its
  rows with ds == "i21k". The official choice, google-research/vision_transformer
  vit_jax/train.py lines 104-115 (commit c6de1e5): rows whose filename.split('-')[0]
  is the model, `.query('ds=="i21k"').sort_values('final_val').iloc[-1]`.
  """
  key = model_key(model)
  candidates = [r for r in filter_rows(rows, model=key, ds="i21k") if r["final_val"] is not None]
  if not candidates:
    raise ZooError(f"The index has no i21k checkpoint of {key} with a final_val; "
                   f"name one by its full filename (vit-zoo list --model {key}).")
  return max(candidates, key=lambda r: r["final_val"])


def image_size(filename: str) -> int:
  """`...-res_384` (adapted) -> 384; an upstream checkpoint -> 224."""
  m = re.search(r"-res_(\d+)$", filename)
  return int(m.group(1)) if m else UPSTREAM_RESOLUTION


def copy_to_cache(url: str, dest: str, progress: bool = True, chunk_bytes: int = 1 << 22,
                  fetch_hint: bool = True) -> None:
  """Copies `url` (any epath location) to the local `dest` through a temporary file in
  the same folder, renamed on success: `dest` is whole or absent, never partial."""
  folder = os.path.dirname(dest) or "."
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(dest) + ".", suffix=".partial")
  try:
    src = epath.Path(url)
    with os.fdopen(fd, "wb") as out, src.open("rb") as f, _progress_bar(src, progress) as bar:
      while chunk := f.read(chunk_bytes):
        out.write(chunk)
        bar.update(len(chunk))
    os.replace(tmp, dest)
  except Exception as e:  # Unreachable buckets raise OSError, tf or google-auth errors alike.
    raise _unreachable(url, dest, e, fetch_hint) from e
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _progress_bar(src: epath.Path, enabled: bool):
  import tqdm  # Only copies draw one.
  return tqdm.tqdm(total=src.stat().length if enabled else None, unit="B", unit_scale=True,
                   unit_divisor=1024, desc=src.name, disable=not enabled)


def fetch(filename: str, zoo_dir: str | None = None, cache_dir: str | None = None,
          progress: bool = True) -> str:
  """The local path of `FILENAME.npz`, copied from `zoo_dir` into `cache_dir` unless
  it is there already."""
  filename = filename.removesuffix(".npz")
  dest = os.path.join(_cache(cache_dir), f"{filename}.npz")
  if not os.path.exists(dest):
    copy_to_cache(f"{(zoo_dir or default_zoo_dir()).rstrip('/')}/{filename}.npz", dest, progress)
  return dest


def _find_row(rows: Sequence[Row], filename: str) -> Row | None:
  col = "adapt_filename" if "--" in filename else "filename"
  return next((r for r in rows if r[col] == filename), None)


def _unknown_filename(rows: Sequence[Row], filename: str) -> ZooError:
  model = filename.split("-")[0]
  names = {r[c] for r in rows for c in ("filename", "adapt_filename")
           if r[c] and r[c].startswith(model + "-")}
  close = difflib.get_close_matches(filename, names, n=5, cutoff=0.6)
  hint = ("Close names:\n  " + "\n  ".join(close)) if close else (
      f"List the names with: vit-zoo list --model {model}")
  return ZooError(f"{filename!r} is not in the AugReg index. {hint}")


def resolve(spec: str, zoo_dir: str | None = None, cache_dir: str | None = None,
            progress: bool = True) -> Resolved:
  """`augreg:S_16` or `augreg:FILENAME[.npz]` (the prefix is optional) -> the cached
  .npz, its model and resolution. A cached file needs no index and no network."""
  name = spec.removeprefix(PREFIX).removesuffix(".npz")
  zoo_dir, cache_dir = zoo_dir or default_zoo_dir(), _cache(cache_dir)
  model = model_key(name.split("-")[0])
  row = None
  if "-" not in name:  # A model name: the index chooses.
    row = upstream_row(best_checkpoint(read_index(zoo_dir, cache_dir), model))
    name = row["filename"]
  elif not os.path.exists(os.path.join(cache_dir, f"{name}.npz")):
    try:
      rows = read_index(zoo_dir, cache_dir)
    except ZooError:
      rows = None  # Unreachable: fetch() names the file's own URL instead.
    if rows is not None:
      row = _find_row(rows, name)
      if row is None:
        raise _unknown_filename(rows, name)
      row = row if "--" in name else upstream_row(row)
  path = fetch(name, zoo_dir, cache_dir, progress)
  adapt_ds = name.split("--")[1].split("-")[0] if "--" in name else None
  return Resolved(path=path, filename=name, model=model, model_name=MODELS[model],
                  image_size=image_size(name), adapt_ds=adapt_ds, row=row)
