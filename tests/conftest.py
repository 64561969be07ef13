"""Test set-up: 8 simulated CPU devices, set before jax is first imported; caches that the
session's processes share; shared fixtures."""
import gc
import os
import signal
import sys
import tempfile

# Python's garbage collection, rarer than its default (every 700 allocations) from before the
# imports of TensorFlow, JAX and torch, as the commands make it (vit_jax/tools/cli.py); once
# the tests are collected, what is loaded is frozen (pytest_collection_finish): no collection
# walks the libraries' millions of objects again. test_models.py and test_vit.py in one
# process: 79.4 -> 74.2 CPU-s.
gc.set_threshold(50_000, 20, 20)

# Started in the background by a shell without job control (`pytest &` in a script), the
# session's processes would ignore Ctrl-C, and so would every command a test starts: the tests
# that stop one with SIGINT would wait for ever. They get Python's own handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The test extra installs libtpu (the TPU compile checks, which need no TPU platform): JAX
# would try a TPU at each start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite starts ~100 Python processes (xdist workers, vit-train and the other commands).
# Where PYTHONDONTWRITEBYTECODE is set and the venv holds no bytecode (uv installs none), each
# would compile TensorFlow's, Keras' and JAX's sources again: ~9 s of a 15 s start-up. Their
# bytecode goes to a folder of the session's instead, outside the source tree as asked.
_SESSION = None
if sys.dont_write_bytecode and not os.environ.get("PYTHONPYCACHEPREFIX"):
  _SESSION = tempfile.mkdtemp(prefix="vit_jax_tests_")
  sys.dont_write_bytecode, sys.pycache_prefix = False, os.path.join(_SESSION, "pycache")
  os.environ.pop("PYTHONDONTWRITEBYTECODE")
  os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
# The processes a test starts compile the same tiny programs many times: they share a JAX
# compilation cache (bounded, which turns on its file lock), with the test processes too.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _SESSION = _SESSION or tempfile.mkdtemp(prefix="vit_jax_tests_")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(_SESSION, "jit"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 * 2**30))
from helpers import xla_flags  # noqa: E402  (imports no JAX)
from vit_jax import cpu_backend  # noqa: E402

os.environ.setdefault("XLA_FLAGS", xla_flags(8))

cpu_backend.prepare()  # 8 devices whose programs cannot deadlock, before JAX starts.

import collections  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from typing import Iterator  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import DEBIAN_FASHION_MNIST, TINY_CONFIG_VIT, tiny_config, write_digits_folder  # noqa: E402

TESTS = pathlib.Path(__file__).parent
# Each file's seconds in a whole run on two workers, for the order of the files (refresh with
# `pytest --record-file-seconds` after adding or changing a slow test).
FILE_SECONDS = TESTS / "file_seconds.json"
_file_seconds: collections.Counter = collections.Counter()


def pytest_configure(config: pytest.Config) -> None:
  """In a process that runs tests: JAX's cache setting, and torch and timm (the cross-checks'
  reference) loaded first where a chosen test module uses them: after TensorFlow, which most
  test modules import, their import crashes the process."""
  if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
    return  # pytest-xdist's controller runs no test: its workers import these (~13 s).
  import jax
  # A test process writes only programs that took 0.3 s or more to compile: the tiny runs'
  # steps (~2 s each, compiled again by every run in the process: 6 s of a 4-step run, 2 s with
  # the cache). The eager ops of the full-size models' tests, many small programs each compiled
  # once, would cost more to write than to compile (test_npz.py: 94 s without the cache, 115 s
  # with all).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
  paths = [config.invocation_params.dir / a.split("::")[0] for a in config.args] or [TESTS]
  modules = [m for p in paths for m in (sorted(p.rglob("test_*.py")) if p.is_dir() else [p])]
  if any(m.is_file() and "timm_models" in m.read_text() for m in modules):
    from vit_jax.models import timm_models
    timm_models.import_torch()


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption("--record-file-seconds", action="store_true",
                   help=f"write each test file's seconds in this run to {FILE_SECONDS.name}")
  parser.addoption("--record-test-cpu", metavar="FILE",
                   help="append a JSON line a test to FILE: its CPU seconds in the test "
                        "process and in the children it waited for, and its wall seconds "
                        "(CONTRIBUTING's slowest tests)")


def _cpu_seconds() -> tuple[float, float]:
  """(this process's, its waited-for children's) user + system seconds."""
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                        resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> Iterator[None]:
  out = item.config.getoption("record_test_cpu")
  if not out:
    yield
    return
  (own, children), start = _cpu_seconds(), time.time()
  yield
  (own_after, children_after), wall = _cpu_seconds(), time.time() - start
  with open(out, "a") as f:  # One short line an append: the workers' lines stay whole.
    f.write(json.dumps({"id": item.nodeid, "self": own_after - own,
                        "children": children_after - children, "wall": wall, "start": start,
                        "worker": os.environ.get("PYTEST_XDIST_WORKER", "master")}) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """The longest files first, each file's own order kept (pytest.ini keeps xdist from sorting
  them by their number of tests): xdist hands files to its workers in this order, and the
  shortest, last, even out the end. A file not yet timed counts as the longest."""
  seconds = json.loads(FILE_SECONDS.read_text())
  items.sort(key=lambda item: -seconds.get(item.path.name, math.inf))


def pytest_collection_finish(session: pytest.Session) -> None:
  gc.collect()
  gc.freeze()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
  _file_seconds[report.nodeid.split("::")[0].rsplit("/", 1)[-1]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
  if session.config.getoption("record_file_seconds") and not hasattr(session.config,
                                                                    "workerinput"):
    seconds = json.loads(FILE_SECONDS.read_text())  # The files this run left out keep theirs.
    seconds.update((name, round(s, 1)) for name, s in _file_seconds.items())
    ranked = dict(sorted(((n, s) for n, s in seconds.items() if (TESTS / n).is_file()),
                         key=lambda kv: -kv[1]))
    FILE_SECONDS.write_text(json.dumps(ranked, indent=1) + "\n")


def pytest_unconfigure(config: pytest.Config) -> None:
  if _SESSION and not hasattr(config, "workerinput"):  # The session's, once its workers end.
    shutil.rmtree(_SESSION, ignore_errors=True)


@contextlib.contextmanager
def shared_by_workers(tmp_path_factory: pytest.TempPathFactory, worker_id: str,
                      name: str) -> Iterator[pathlib.Path]:
  """The folder that all the session's workers share (pytest-xdist's recipe: their temporary
  folders share a parent; the session's own under `-n 0`), held under the lock `NAME.lock`
  there for the block: the first worker builds NAME in it, the others wait and find it done."""
  root = tmp_path_factory.getbasetemp()
  root = root if worker_id == "master" else root.parent
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield root


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, worker_id) -> tuple[str, str]:
  """(name, data_dir) of Fashion-MNIST, built by TFDS's own builder from Debian's files,
  which the README's set-up installs: the same real data on every machine. Built once for all
  the session's workers."""
  if not os.path.isdir(DEBIAN_FASHION_MNIST):
    pytest.fail(f"{DEBIAN_FASHION_MNIST} is missing: `sudo apt-get install "
                "dataset-fashion-mnist` (the README's set-up) gives the tests their real data.")
  from vit_jax import data
  with shared_by_workers(tmp_path_factory, worker_id, "tfds") as root:
    data.prepare_fashion_mnist(str(root / "tfds"))
  return "fashion_mnist", str(root / "tfds")


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory, worker_id, dataset) -> dict[str, float]:
  """The final evaluation of tiny_config's run (12 steps, 8 devices), never interrupted: what
  the launchers' interrupted runs must end with (test_e2e_recovery.py, test_gke.py). Trained
  once for all the session's workers, as `dataset` is prepared."""
  from vit_jax.train import loop
  with shared_by_workers(tmp_path_factory, worker_id, "uninterrupted_run") as root:
    result = root / "uninterrupted_run.json"
    if not result.exists():
      metrics = loop.train_and_evaluate(tiny_config(dataset), str(root / "uninterrupted_run"))
      result.write_text(json.dumps({k: float(v) for k, v in metrics.items()}))
  return json.loads(result.read_text())


@pytest.fixture
def children():
  """children(proc) -> proc: a process the test started, killed at the test's end whatever
  happens (a failed wait leaves none running behind it)."""
  started = []
  yield lambda proc: started.append(proc) or proc
  for proc in started:
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def digits_folder(tmp_path_factory) -> str:
  """The 1,797 real 8x8 handwritten digits of tests/data as an image folder (helpers.py)."""
  return write_digits_folder(tmp_path_factory.mktemp("digits"))


@pytest.fixture
def fake_gcloud(tmp_path):
  """A `gcloud` first on PATH that records its arguments: what would reach Google Cloud."""
  log = tmp_path / "gcloud.log"
  script = tmp_path / "bin" / "gcloud"
  script.parent.mkdir()
  script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
  script.chmod(0o755)
  return dict(os.environ, PATH=f"{script.parent}:{os.environ['PATH']}"), log


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory) -> str:
  """A randomly initialised tiny ViT at 28 px, written without a description (test_vit.py and
  test_e2e_explore_notebook.py have a tiny_npz of their own)."""
  import jax

  from vit_jax import models
  from vit_jax.checkpoint import npz
  model = models.create_model("ViT-Ti_16", num_classes=3, **TINY_CONFIG_VIT)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3), np.float32))["params"]
  path = str(tmp_path_factory.mktemp("transfer") / "tiny.npz")
  npz.save_npz(path, params)
  return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
  """An empty Hub cache, offline, as HF_HUB_CACHE / HF_HUB_OFFLINE set it."""
  from huggingface_hub import constants
  cache = tmp_path / "hub"
  cache.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return cache


@pytest.fixture
def hub_offline(tmp_path, monkeypatch):
  """huggingface_hub offline, on an empty cache of its own (its constants are read at import):
  test_zoo.py's, for each of its tests."""
  from huggingface_hub import constants
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_hub"))
  return tmp_path / "hf_hub"


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
  """An AugReg zoo folder laid out like gs://vit_models/augreg: index.csv and four tiny files."""
  from helpers import HEADER, IMNET_384, R26, R_TI, ROWS, TI, write_checkpoint
  root = tmp_path_factory.mktemp("augreg")
  with open(root / "index.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(HEADER)
    writer.writerows(ROWS)
  for filename in (TI, TI + IMNET_384, R_TI, R26):
    write_checkpoint(root, filename)
  return str(root)
