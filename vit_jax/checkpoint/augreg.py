"""The AugReg checkpoints by name: copies on the Hugging Face Hub first, else the zoo's
index.csv and .npz files, a local cache, `augreg:` specs.

"How to train your ViT?" (Steiner et al., 2021) released ~50k checkpoints in
gs://vit_models/augreg, one `FILENAME.npz` per upstream (pre-training) run and per
fine-tuning ("adaptation") of it, described by `index.csv`: one row per adaptation,
columns `filename` (upstream) and `adapt_filename`. Since February 2026 the bucket refuses
anonymous reads (google-research/vision_transformer issue 321); timm publishes the
checkpoints it uses on the Hugging Face Hub as `timm/ARCH.TAG`. `augreg_hub.csv`, beside
this file, maps those filenames to their Hub copies (`build_hub_table` makes it from the
installed timm's pretrained cfgs and the vision_transformer README's recommended
checkpoints). Specs:

  augreg:S_16      the recommended upstream checkpoint of S_16 (the README's table; with
                   a zoo folder given, `best_checkpoint` of its index)
  augreg:FILENAME  any `filename` or `adapt_filename` of the index, `.npz` optional

`resolve` gives `hf-hub:timm/ARCH.TAG` for a file with a Hub copy, else the .npz copied
from the zoo folder (the bucket, or $VIT_JAX_AUGREG_DIR / `zoo_dir`: a copy the user
names is always read, Hub copy or not) into the cache; a cached .npz is used as it is.
The model comes from the name (`R26_S_32-...` -> `R26+ViT-S_32`), the resolution
from the file (`...-res_384` -> 384; upstream checkpoints were trained at 224).
"""
import csv
import dataclasses
import difflib
import functools
import io
import os
import re
import shlex
import tempfile
from typing import Any, Iterable, Sequence

from etils import epath

from vit_jax import models
from vit_jax.checkpoint import specs

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

# The table of AugReg files and their copies on the Hugging Face Hub, shipped with the
# package (setup.py's package_data); `write_hub_table` rebuilds it (CONTRIBUTING.md).
HUB_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "augreg_hub.csv")
HUB_COLUMNS = ("filename", "model", "ds", "adapt_ds", "adapt_resolution", "hub", "timm_tag",
               "recommended", "imagenet_top1", "source")
HUB_FILES = ("*.json", "*.safetensors")  # What `fetch_hub` downloads of a timm repository.
BUCKET_URL = "https://storage.googleapis.com/vit_models/augreg/"  # As timm's cfgs name files.
README = "google-research/vision_transformer README"
# That README's "We recommend using the following checkpoints": the upstream filename, the
# learning rate of its `--imagenet2012-steps_20k-lr_LR-res_384` fine-tuning, and that
# fine-tuning's ImageNet accuracy (%).
RECOMMENDED = (
    ("L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0", "0.01", 85.59),
    ("B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", "0.03", 85.49),
    ("S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", "0.03", 83.73),
    ("R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1", "0.01", 85.99),
    ("R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", "0.01", 83.85),
    ("Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", "0.03", 78.22),
    ("B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", "0.01", 83.59),
    ("S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0", "0.01", 79.58),
    ("R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", "0.03", 75.40),
)
# What a filename says about its checkpoint (the index's columns of the same names).
_FILENAME = re.compile(
    r"^(?P<model>[^-]+)-(?P<ds>[^-]+)-(?P<epochs>\d+)ep-lr_(?P<lr>[^-]+)-aug_(?P<aug>[^-]+)"
    r"-wd_(?P<wd>[^-]+)-do_(?P<do>[^-]+)-sd_(?P<sd>[^-]+)(?:--(?P<adapt_ds>.+)"
    r"-steps_(?P<adapt_steps>\d+)k-lr_(?P<adapt_lr>[^-]+)-res_(?P<adapt_resolution>\d+))?$")


class ZooError(ValueError):
  """An AugReg name, index or checkpoint that cannot be found or reached."""


@dataclasses.dataclass(frozen=True)
class Resolved:
  path: str                 # The local .npz (in the cache), or `hf-hub:timm/ARCH.TAG`.
  filename: str             # Without `.npz`.
  model: str                # AugReg name, e.g. "R26_S_32".
  model_name: str           # Registry name, e.g. "R26+ViT-S_32".
  image_size: int           # 224 upstream, N for an adapted `...-res_N`.
  adapt_ds: str | None      # The fine-tuning dataset of an adapted checkpoint.
  row: Row | None = None    # Its index row, when the index was read.
  source: str = "bucket"    # "hub": `path` is its Hub copy; "bucket": a .npz of the zoo.
  hub_id: str | None = None  # `timm/ARCH.TAG` where the table names a Hub copy.


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
    how = [f"  {shlex.join(['gsutil', 'cp', url, dest])}",
           f"  {shlex.join(['curl', '-fLo', dest, public_url(url)])}"]
  else:
    how = [f"  {shlex.join(['cp', url, dest])}"]
  if fetch_hint:
    fetch = ["vit-zoo", "fetch", os.path.basename(dest).removesuffix(".npz"), "--cache_dir",
             os.path.dirname(dest)]
    how.append(f"  {shlex.join(fetch)} --zoo_dir DIR   (DIR: a local folder holding the "
               "bucket's files)")
  else:
    how.append(f"A checkpoint named by its full filename ({specs.augreg('FILENAME')}) needs no "
               "index.")
  if url.startswith("gs://vit_models/"):
    how.append("The bucket refuses anonymous reads since February 2026 (google-research/"
               "vision_transformer issue 321): gsutil with a Google account, or a copy of the "
               "files, still works; `vit-zoo list` names the checkpoints with a Hugging Face "
               "Hub copy, which need neither.")
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


# The table of AugReg files and their Hub copies (augreg_hub.csv).

def parse_filename(filename: str) -> Row:
  """What an AugReg filename says, typed as the index's columns of the same names: ds,
  epochs, lr, aug, wd, do, sd and adapt_ds, adapt_steps (thousands, as the name rounds
  them), adapt_lr, adapt_resolution (None for an upstream file); {} for another name."""
  m = _FILENAME.match(filename.removesuffix(".npz"))
  if not m:
    return {}
  out = {}
  try:
    for key, text in m.groupdict().items():
      if key == "adapt_steps" and text is not None:
        out[key] = int(text) * 1000
      elif key != "model":
        out[key] = _number(key, text) if text and key in _INT_COLUMNS | _FLOAT_COLUMNS else text
  except ZooError:
    return {}
  return out


def index_name(model: str) -> str:
  """The index's `name` of a model (any spelling `model_key` takes): "R26_S_32" -> "R26+S/32"."""
  head, _, patch = model_key(model).rpartition("_")
  return f"{head.replace('_', '+', 1) if head.startswith('R') else head}/{patch}"


def _typed_entry(raw: dict[str, str]) -> Row:
  entry: Row = {c: raw.get(c) or None for c in HUB_COLUMNS}
  if entry["adapt_resolution"]:
    entry["adapt_resolution"] = int(entry["adapt_resolution"])
  if entry["imagenet_top1"]:
    entry["imagenet_top1"] = float(entry["imagenet_top1"])
  return entry


@functools.cache
def _read_hub_table() -> tuple[Row, ...]:
  try:
    with open(HUB_TABLE, encoding="utf-8", newline="") as f:
      return tuple(_typed_entry(raw) for raw in csv.DictReader(f))
  except OSError as e:
    raise ZooError(f"vit_jax's table of AugReg files cannot be read ({e}); reinstall "
                   "vit_jax, whose package data holds it.") from e


def hub_table() -> list[Row]:
  """The shipped table, one row per AugReg file that timm publishes on the Hugging Face Hub
  or that the vision_transformer README recommends: its columns are HUB_COLUMNS (`hub`
  `timm/ARCH.TAG` or None; `recommended` "pre-trained" / "fine-tuned" or None;
  `imagenet_top1` the README's accuracy in %; `source` where these facts come from)."""
  return [dict(e) for e in _read_hub_table()]


def hub_entry(filename: str) -> Row | None:
  """The table's row of `filename` (without `.npz`), None where it has none."""
  return next((dict(e) for e in _read_hub_table() if e["filename"] == filename), None)


def recommended(model: str) -> str | None:
  """The README's recommended upstream filename of `model`; None where it names none (B_8)."""
  key = model_key(model)
  return next((e["filename"] for e in _read_hub_table() if e["recommended"] == "pre-trained"
               and e["filename"].split("-")[0] == key), None)


def _new_entry(filename: str, **facts: Any) -> Row:
  said = parse_filename(filename)
  entry = dict.fromkeys(HUB_COLUMNS)
  entry.update(filename=filename, model=registry_name(filename.split("-")[0]), ds=said["ds"],
               adapt_ds=said["adapt_ds"], adapt_resolution=said["adapt_resolution"], **facts)
  return entry


def build_hub_table() -> list[Row]:
  """The table from its sources: every pretrained cfg of the installed timm whose `url` is a
  file of gs://vit_models/augreg (its `hf_hub_id` the Hub copy; in timm 1.0.31 every AugReg
  cfg has one, while its `augreg2_*` and `orig_*` cfgs name no AugReg file and are left
  out), and RECOMMENDED, the README's table (rows timm lacks get no Hub copy)."""
  import timm  # The test extra holds timm: only refreshing the table needs it.
  from timm.models import get_pretrained_cfg
  source = f"timm {timm.__version__} pretrained cfg"
  table = {}
  for name in timm.list_pretrained():
    cfg = get_pretrained_cfg(name)
    url = (cfg.url if cfg else None) or ""
    if url.startswith(BUCKET_URL):
      filename = url[len(BUCKET_URL):].removesuffix(".npz")
      table[filename] = _new_entry(filename, hub=cfg.hf_hub_id or None,
                                   timm_tag=name.partition(".")[2], source=source)
  for upstream, lr, top1 in RECOMMENDED:
    adapted = f"{upstream}--imagenet2012-steps_20k-lr_{lr}-res_384"
    for filename, kind, accuracy in ((upstream, "pre-trained", None),
                                     (adapted, "fine-tuned", top1)):
      entry = table.setdefault(filename, _new_entry(filename))
      entry.update(recommended=kind, imagenet_top1=accuracy,
                   source="; ".join(s for s in (entry["source"], README) if s))
  order = list(MODELS)
  return sorted(table.values(), key=lambda e: (order.index(e["filename"].split("-")[0]),
                                               e["filename"]))


def format_hub_table(entries: Iterable[Row]) -> str:
  """The table as augreg_hub.csv holds it (None as an empty cell)."""
  out = io.StringIO()
  writer = csv.DictWriter(out, HUB_COLUMNS, lineterminator="\n")
  writer.writeheader()
  writer.writerows({k: "" if v is None else f"{v:.2f}" if k == "imagenet_top1" else v
                    for k, v in e.items()} for e in entries)
  return out.getvalue()


def write_hub_table(path: str = HUB_TABLE) -> int:
  """Rebuilds the shipped table from the installed timm (CONTRIBUTING.md); its row count."""
  entries = build_hub_table()
  with open(path, "w", encoding="utf-8", newline="") as f:
    f.write(format_hub_table(entries))
  _read_hub_table.cache_clear()
  return len(entries)


# What `vit-zoo list` shows without an index: the table, in the index's columns.
CATALOG_COLUMNS = ("filename", "name", "model", "ds", "epochs", "lr", "aug", "wd", "do", "sd",
                   "adapt_ds", "adapt_steps", "adapt_lr", "adapt_resolution", "final_val",
                   "imagenet_top1", "hub", "timm_tag", "recommended", "source")


def catalog(cache_dir: str | None = None) -> tuple[list[Row], str | None]:
  """The table's files as rows (CATALOG_COLUMNS: the index's columns that their names say,
  the table's own, `final_val` from the zoo's index.csv where the cache holds one), read
  without network; and the path of that index.csv, or None."""
  index = os.path.join(_cache(cache_dir), "index.csv")
  final_val = {}
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      for r in parse_index(f.read()):
        final_val[r["filename"]] = final_val[r["adapt_filename"]] = r["final_val"]
  rows = []
  for e in _read_hub_table():
    row = dict.fromkeys(CATALOG_COLUMNS) | parse_filename(e["filename"]) | e
    rows.append(row | {"name": index_name(e["filename"].split("-")[0]),
                       "final_val": final_val.get(e["filename"])})
  return rows, index if final_val else None


def fetch_hub(repo_id: str) -> str:
  """The local folder of `repo_id`'s config and weights, downloaded by huggingface_hub into
  its own cache ($HF_HUB_CACHE, else $HF_HOME/hub) unless they are there already."""
  try:
    import huggingface_hub
  except ImportError as e:
    raise ZooError(f"Reading {repo_id} needs huggingface_hub: pip install huggingface_hub") from e
  try:
    return huggingface_hub.snapshot_download(repo_id, allow_patterns=list(HUB_FILES))
  except Exception as e:  # Offline, unreachable, not found: each its own huggingface_hub error.
    cause = (str(e).strip().splitlines() or [""])[0]
    raise ZooError(f"Cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: "
                   f"{cause}). Without network, only what huggingface_hub's cache holds can be "
                   "read; or set $VIT_JAX_AUGREG_DIR to a folder holding the bucket's "
                   "files.") from e


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


def _explicit_zoo(zoo_dir: str | None) -> str | None:
  """The zoo folder the user named (`zoo_dir`, else $VIT_JAX_AUGREG_DIR): a copy of theirs,
  read even for files with a Hub copy."""
  return zoo_dir or os.environ.get("VIT_JAX_AUGREG_DIR") or None


def _with_hub_copy(model: str) -> str:
  names = [e["filename"] for e in _read_hub_table() if e["hub"]
           and e["filename"].split("-")[0] == model]
  return ("Or name one with a Hugging Face Hub copy:\n  " + "\n  ".join(
      specs.augreg(n) for n in names)) if names else f"List them with: vit-zoo list --model {model}"


def _choose(model: str, explicit: str | None, cache_dir: str) -> tuple[str, Row | None]:
  """The file `augreg:MODEL` stands for: the README's recommended one, or with a zoo folder
  given (or none recommended) the index's `best_checkpoint`; and that index row."""
  if not explicit and (filename := recommended(model)):
    return filename, None
  try:
    rows = read_index(explicit, cache_dir)
  except ZooError as e:
    if explicit:
      raise
    raise ZooError(f"The {README} recommends no checkpoint of {model}, and the zoo's index, "
                   f"which would choose one, cannot be read: {e}\n{_with_hub_copy(model)}") from e
  row = upstream_row(best_checkpoint(rows, model))
  return row["filename"], row


def _close_in_table(filename: str) -> str:
  close = difflib.get_close_matches(filename, [e["filename"] for e in _read_hub_table()],
                                    n=3, cutoff=0.9)
  return ("\nIt is not in vit_jax's table of AugReg files either; close names there:\n  " +
          "\n  ".join(close)) if close else ""


def _hub_alternatives(filename: str) -> str:
  """The Hub copies of the same model's other files of the same kind (pre-trained or
  fine-tuned), for a file that has none."""
  model, adapted = filename.split("-")[0], "--" in filename
  others = [f"  {specs.hub(e['hub'])}   ({e['filename']})" for e in _read_hub_table()
            if e["hub"] and e["filename"].split("-")[0] == model
            and ("--" in e["filename"]) == adapted]
  return (f"\n{filename} has no Hugging Face Hub copy; these {model} files do:\n"
          + "\n".join(others)) if others else ""


def _from_zoo(name: str, row: Row | None, zoo_dir: str, cache_dir: str, progress: bool,
              in_table: bool) -> tuple[str, Row | None]:
  """The cached .npz of `name`, copied from `zoo_dir` unless it is there, and its index row
  (the index is read, where it can be, to check a name that is not cached)."""
  if row is None and not os.path.exists(os.path.join(cache_dir, f"{name}.npz")):
    try:
      rows = read_index(zoo_dir, cache_dir)
    except ZooError:
      rows = None  # Unreachable: fetch() names the file's own URL instead.
    if rows is not None:
      row = _find_row(rows, name)
      if row is None:
        raise _unknown_filename(rows, name)
      row = row if "--" in name else upstream_row(row)
  try:
    return fetch(name, zoo_dir, cache_dir, progress), row
  except ZooError as e:
    hint = _hub_alternatives(name) if in_table else _close_in_table(name)
    if not hint:
      raise
    raise ZooError(f"{e}{hint}") from e


def resolve(spec: str, zoo_dir: str | None = None, cache_dir: str | None = None,
            progress: bool = True) -> Resolved:
  """`augreg:S_16` or `augreg:FILENAME[.npz]` (the prefix is optional) -> where to read it,
  its model and resolution. A file with a Hub copy (`hub_table`) resolves to
  `hf-hub:timm/ARCH.TAG` (source "hub": nothing is read here), unless its .npz is in the
  cache or the user named a zoo folder (`zoo_dir`, $VIT_JAX_AUGREG_DIR); any other file to
  its .npz in the cache, copied there from the zoo folder (default: the bucket) once. A
  cached file needs no index and no network."""
  name = specs.augreg_name(spec).removesuffix(".npz")
  explicit, cache_dir = _explicit_zoo(zoo_dir), _cache(cache_dir)
  model = model_key(name.split("-")[0])
  row = None
  if "-" not in name:  # A model name: the README's table chooses, or a given zoo's index.
    name, row = _choose(model, explicit, cache_dir)
  entry = hub_entry(name)
  hub_id = entry["hub"] if entry else None
  if hub_id and not explicit and not os.path.exists(os.path.join(cache_dir, f"{name}.npz")):
    path, source = specs.hub(hub_id), "hub"
  else:
    path, row = _from_zoo(name, row, explicit or default_zoo_dir(), cache_dir, progress,
                          entry is not None)
    source = "bucket"
  adapt_ds = name.split("--")[1].split("-")[0] if "--" in name else None
  return Resolved(path=path, filename=name, model=model, model_name=MODELS[model],
                  image_size=image_size(name), adapt_ds=adapt_ds, row=row, source=source,
                  hub_id=hub_id)
