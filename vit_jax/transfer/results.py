"""A sweep's record: one rows file per (checkpoint, task), written by the one process that runs
that task, so that tasks run side by side (`vit-transfer --launch`) never write the same file;
`results.csv` is their merge. Paths may be local or gs:// (etils.epath)."""
import contextlib
import csv
import io
import re
import uuid
from typing import Iterator

from etils import epath

FIELDS = ("checkpoint", "model", "task", "suite", "group", "phase", "lr", "accuracy", "steps",
          "wall_s", "status", "workdir")
OK = "ok"
ROWS = "rows.csv"  # In a task's folder, out_dir/<checkpoint>/<task>/ (protocol.task_dir).
MERGED = "results.csv"

Row = dict[str, str]


def _read(path: epath.Path) -> list[Row]:
  return list(csv.DictReader(io.StringIO(path.read_text()))) if path.exists() else []


@contextlib.contextmanager
def replacing(path: str | epath.Path) -> Iterator[epath.Path]:
  """A file beside `path`, under a name of its own, that replaces `path` once the block has
  written it: a reader never sees half, and writers side by side do not mix. A block that fails
  leaves no such file, and its OSError names `path` where it named no file (a write or close
  on a full disk says only "[Errno 28] No space left on device")."""
  path = epath.Path(path)
  partial = path.parent / f".{path.name}.{uuid.uuid4().hex}"
  try:
    yield partial
  except BaseException as e:
    with contextlib.suppress(OSError):
      partial.unlink()
    if isinstance(e, OSError) and not e.filename and e.errno is not None:
      raise OSError(e.errno, e.strerror, str(path)) from e
    raise
  partial.replace(path)


def replaced(name: str) -> str:
  """The file a name of `replacing`'s stands in for (one a killed writer left), else `name`."""
  found = re.fullmatch(r"\.(.+)\.[0-9a-f]{32}", name)
  return found.group(1) if found else name


def _write(path: epath.Path, rows: list[dict[str, object]]) -> None:
  text = io.StringIO()
  writer = csv.DictWriter(text, FIELDS, lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  path.parent.mkdir(parents=True, exist_ok=True)
  with replacing(path) as partial:
    partial.write_text(text.getvalue())


def task_rows(task_dir: str) -> list[Row]:
  return _read(epath.Path(task_dir) / ROWS)


def _key(row: dict[str, object]) -> tuple[object, ...]:
  return tuple(row[k] for k in ("checkpoint", "task", "phase", "lr"))


def append(task_dir: str, row: dict[str, object]) -> None:
  """Adds a row to the task's file, in place of an earlier one for the same run (a rerun of a
  failed one): one row per (checkpoint, task, phase, rate). Rewritten whole: gs:// cannot
  append."""
  path = epath.Path(task_dir) / ROWS
  _write(path, [*(r for r in _read(path) if _key(r) != _key(row)), row])


def read(out_dir: str) -> list[Row]:
  """Every task's rows under out_dir, by checkpoint folder and task, each in the order run."""
  paths = sorted(epath.Path(out_dir).glob(f"*/*/{ROWS}"), key=str)
  return [row for path in paths for row in _read(path)]


def write_merged(out_dir: str, rows: list[Row]) -> None:
  _write(epath.Path(out_dir) / MERGED, rows)


def failures(rows: list[Row]) -> dict[tuple[str, str], str]:
  """(checkpoint, task) -> why, for each task whose last run failed."""
  last = {(r["checkpoint"], r["task"]): r["status"] for r in rows}
  return {key: status for key, status in last.items() if status != OK}
