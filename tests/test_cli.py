"""tools/cli.py: the README's contract, for every console script setup.py installs: an input
error is exit status 2 and one `error:` line on stderr (no traceback, no log lines above it),
nothing is left where the refused run would have written, and an error in the arguments
themselves is told before TensorFlow loads (seconds). The table below must name every command,
so that a new one cannot go unchecked. And `python -m vit_jax.main`, the official repository's
command, as vit-train."""
import ast
import dataclasses
from concurrent import futures
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from helpers import PROBE, REPO, cpu_env, tiny_serving_checkpoint
from vit_jax.data import fashion_mnist

MISSING = "/nonexistent/checkpoint.npz"

def console_scripts() -> dict[str, str]:
  """{command: module:function} from setup.py's entry points."""
  tree = ast.parse((REPO / "setup.py").read_text())
  [entries] = [v for node in ast.walk(tree) if isinstance(node, ast.Dict)
               for k, v in zip(node.keys, node.values)
               if isinstance(k, ast.Constant) and k.value == "console_scripts"]
  return dict(e.value.split("=") for e in entries.elts)


@dataclasses.dataclass
class Case:
  command: str
  what: str
  args: list[str]
  named: str  # What the one line must name.
  arguments_only: bool = True  # Found in the arguments: refused before TensorFlow loads.
  not_written: tuple[str, ...] = ()  # Where the refused run must leave nothing.


def _folder(root: pathlib.Path, classes: dict[str, list[str]], broken: str = "") -> str:
  rng = np.random.default_rng(0)
  for split, names in classes.items():
    for name in names:
      (root / split / name).mkdir(parents=True)
      for i in range(2):
        Image.fromarray(rng.integers(0, 255, (28, 28, 3), np.uint8)).save(
            root / split / name / f"{i}.png")
  if broken:
    (root / broken).write_bytes(b"\x89PNG\r\n\x1a\n not really")
  return str(root)


@dataclasses.dataclass
class Files:
  """What the cases read: an image, a broken one, a regular file where a folder is asked
  for, truncated exported models, and image folders whose classes differ or hold a broken
  image."""
  root: pathlib.Path

  def __post_init__(self):
    t = self.root
    self.image, self.broken, self.a_file = t / "image.png", t / "broken.png", t / "a_file"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(self.image)
    self.broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    self.a_file.write_text("not a folder")
    (t / "truncated.onnx").write_bytes(b"\x08\x07\x12\x04abc")
    (t / "truncated.tflite").write_bytes(b"TFL3 not really")
    self.differ = _folder(t / "differ", dict(train=["a", "b"], test=["a", "c"]))
    self.bad_image = _folder(t / "bad_image", dict(train=["a", "b"], test=["a", "b"]),
                             broken="train/a/0.png")
    self.small = _folder(t / "small", dict(train=["a", "b"], test=["a", "b"]))  # 2 a class.
    self.users = t / "users"  # A folder of a user's files.
    self.users.mkdir()
    (self.users / "notes.txt").write_text("mine")
    self.in_use = t / "in_use"  # A workdir whose lock this (live) process holds.
    self.in_use.mkdir()
    (self.in_use / "lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "since": "now"}))


def train_errors(f: Files) -> list[Case]:
  tmp, a_file = f.root, f.a_file

  def train(what: str, overrides: list[str], named: str, arguments_only: bool = True) -> Case:
    workdir = str(tmp / re.sub(r"\W+", "_", what))  # One per case: they run side by side.
    return Case("vit-train", what, ["--config", "tests/tiny_config.py", "--workdir", workdir,
                                    *overrides], named, arguments_only, (workdir,))

  return [
      train("missing checkpoint", [f"--config.pretrained={MISSING}"], MISSING),
      Case("vit-train", "malformed --config NAME:ARG",
           ["--config", "quickstart:fast", "--workdir", str(tmp / "w")], "quickstart:fast",
           not_written=(str(tmp / "w"),)),
      train("negative registers", ["--config.model.num_registers=-2"],
            "model.num_registers=-2"),
      Case("vit-train", "workdir is a file",
           ["--config", "tests/tiny_config.py", "--workdir", str(a_file)],
           f"--workdir {a_file}: cannot create this folder: {a_file} is a file"),
      Case("vit-train", "workdir under a file",
           ["--config", "tests/tiny_config.py", "--workdir", f"{a_file}/run"],
           f"{a_file} is a file"),
      train("unknown dataset", ["--config.data.name=nosuch"],
            "data.name='nosuch' is neither a TFDS dataset", False),
      train("missing folder", [f"--config.data.name={tmp}/nowhere"],
            f"data.name='{tmp}/nowhere' is not a directory", False),
      train("image size not divisible by the patch",
            ["--config.data.image_size=30", "--config.model.dynamic_image_size=True"],
            "data.image_size=30: not divisible by the model's patch stride 7 (ViT with patch "
            "7, width 32, depth 2, 2 heads, MLP 64); use a multiple of 7, e.g. 28", False),
      train("broken image", [f"--config.data.name={f.bad_image}",
                             "--config.data.eval_split=test"],
            f"Cannot decode image {f.bad_image}/train/a/0.png", False),
      train("a positional argument (its -- forgotten)", ["config.total_steps=10"],
            "unexpected argument 'config.total_steps=10': vit-train takes flags only "
            "(--name=value), and reads nothing else; did you mean --config.total_steps=10?"),
      train("an exported model as config.pretrained",
            [f"--config.pretrained={tmp}/truncated.tflite"],
            f"{tmp}/truncated.tflite is a model that vit-export wrote (tflite): a graph for "
            "serving, not the parameters this command reads"),
      Case("vit-train", "workdir in use (refused before TensorFlow loads)",
           ["--config", "tests/tiny_config.py", "--workdir", str(f.in_use)],
           f"{f.in_use} is in use by PID {os.getpid()}",
           not_written=(str(f.in_use / "train.log"), str(f.in_use / "checkpoints"))),
  ]


def _users_folder_line(flag: str, f: Files, writes: str) -> str:
  return (f"{flag} {f.users}: the folder holds files this command did not write (notes.txt); "
          f"it writes {writes}: give a new or empty folder")


def tfds_too_small(f: Files, model: str, dataset: tuple[str, str],
                   tiny_tfds: str) -> list[Case]:
  """A TFDS dataset's class or split too small for what is asked: refused before any work,
  from its labels (few-shot, any split size) or its builder's split sizes (transfer)."""
  out = str(f.root / "never")
  name, data_dir = dataset
  return [
      Case("vit-fewshot", "shots a class of a TFDS split cannot give (counted off its labels)",
           [model, f"--datasets={name}", f"--data_dir={data_dir}", "--shots=1,6000",
            "--out_dir", out],
           "--shots=1,6000: fashion_mnist train: class 'T-shirt/top' has 6000 examples: 6000 "
           "shots take 6000 of them, and 1 more is held out to choose the l2 value on; use at "
           "most 5999 shots, or a larger --train_split", False, (out,)),
      Case("vit-transfer", "a TFDS dataset too small for the protocol's splits",
           [model, "--suite", "fashion_mnist", "--data_dir", tiny_tfds, "--out_dir", out],
           "--suite fashion_mnist: the protocol's split 'train[:800]' of fashion_mnist reaches "
           "past the end of 'train', which has 200 examples. Give one rate", False, (out,)),
  ]


def refusals_before_work(f: Files, model: str) -> list[Case]:
  """Counts out of range, shots a class cannot give, splits a folder cannot fill, output
  paths holding a user's files: refused before any work, in one line naming the flag."""
  out, users = str(f.root / "never"), str(f.users)
  return [
      Case("vit-fewshot", "non-positive shots", [model, "--datasets=x", "--shots=0,-5"],
           "--shots=0,-5: each value must be a whole number of 1 or more"),
      Case("vit-fewshot", "shots a class cannot give",
           [model, f"--datasets={f.small}", "--shots=1,2", "--out_dir", out],
           f"--shots=1,2: {f.small} train: class 'a' has 2 examples: 2 shots take 2 of them, "
           "and 1 more is held out to choose the l2 value on; use at most 1 shots, or a "
           "larger --train_split", False, (out,)),
      Case("vit-fewshot", "--out_dir holding a user's files",
           [model, "--datasets=x", "--out_dir", users],
           _users_folder_line("--out_dir", f, "fewshot.csv, fewshot.md, fewshot.png"),
           not_written=(f"{users}/fewshot.csv",)),
      Case("vit-transfer", "zero steps", [model, "--suite", "x", "--steps=0"],
           "--steps=0: must be a whole number of 1 or more"),
      Case("vit-transfer", "a task misspelt (no task, TFDS dataset or folder)",
           [model, "--suite", "vtab1k/cifar100,vtab1k/dtdd", "--out_dir", out],
           "unknown task or suite 'vtab1k/dtdd'", not_written=(out,)),
      Case("vit-transfer", "a folder too small for the protocol's splits",
           [model, "--suite", f.small, "--out_dir", out],
           f"--suite {f.small}: the protocol's split 'train[800:1000]' of {f.small} is empty: "
           "'train' has 4 examples. Give one rate (e.g. --lr_grid=0.01", False, (out,)),
      Case("vit-transfer", "--out_dir holding a user's files",
           [model, "--suite", "x", "--out_dir", users],
           _users_folder_line("--out_dir", f, "results.csv, .md, .png and a folder per "
                                              "checkpoint")),
      Case("vit-export", "a SavedModel into a user's folder",
           [model, users, "--format", "savedmodel"],
           _users_folder_line("OUT", f, "a SavedModel"),
           not_written=(f"{users}/saved_model.pb",)),
      Case("vit-export", "a file over a user's file", [model, f"{users}/notes.txt"],
           f"OUT {users}/notes.txt: the file is no npz file that vit-export wrote (it carries "
           "no vit_jax description), and exporting would replace it: give another path, or "
           "delete it first"),
      Case("vit-export", "zero image size", [model, out, "--format", "onnx", "--image_size=0"],
           "--image_size=0: must be a whole number of 1 or more", not_written=(out,)),
      Case("vit-predict", "zero top-k", [model, str(f.image), "--top_k=0"],
           "--top_k=0: must be a whole number of 1 or more"),
      Case("vit-inspect", "zero images", [model, "--num_images=0"],
           "--num_images=0: must be a whole number of 1 or more"),
      Case("vit-zoo", "a negative limit", ["list", "--limit=-1"],
           "--limit=-1: must be a whole number of 0 or more"),
  ]


def other_errors(f: Files, model: str) -> list[Case]:
  tmp, a_file, image = f.root, f.a_file, str(f.image)
  return [
      Case("vit-fewshot", "missing checkpoint", [MISSING, "--datasets=fashion_mnist"], MISSING),
      Case("vit-fewshot", "unknown dataset", [model, "--datasets=nosuch", "--out_dir",
                                              str(tmp / "f")],
           "--datasets='nosuch' is neither a TFDS dataset", False, (str(tmp / "f"),)),
      Case("vit-fewshot", "broken image", [model, f"--datasets={f.bad_image}", "--out_dir",
                                           str(tmp / "f2")],
           f"Cannot decode image {f.bad_image}/train/a/0.png (1 undecodable in "
           f"{f.bad_image}/train). Replace or delete it, or pass --on_bad_image=skip to leave "
           "such files out.", False, (str(tmp / "f2"),)),
      Case("vit-transfer", "missing checkpoint", [MISSING, "--suite", "fashion_mnist",
                                                  "--out_dir", str(tmp / "t1")], MISSING,
           not_written=(str(tmp / "t1"),)),
      Case("vit-transfer", "--out_dir under a file",
           [model, "--suite", "fashion_mnist", "--out_dir", f"{a_file}/t"],
           f"--out_dir {a_file}/t: cannot create this folder"),
      # vit-transfer cannot relax the folder rules: the line must not name a config field.
      Case("vit-transfer", "class folders that differ",
           [model, "--suite", f.differ, "--out_dir", str(tmp / "t2")],
           f"--suite='{f.differ}': the class folders of the splits differ: test/c (not in "
           "train), test/b (missing). Give every split the same non-empty class folders.",
           False, (str(tmp / "t2"),)),
      Case("vit-export", "missing checkpoint", [MISSING, str(tmp / "out.npz")], MISSING),
      Case("vit-export", "unwritable output", [model, f"{a_file}/out.onnx", "--format", "onnx"],
           f"OUT {a_file}: cannot create this folder: {a_file} is a file"),
      Case("vit-predict", "missing checkpoint", [MISSING, image], MISSING),
      Case("vit-predict", "unwritable output", [model, image, "--out", f"{a_file}/p.csv"],
           f"--out {a_file}: cannot create this folder"),
      Case("vit-predict", "broken image", [model, str(f.broken), "--out", str(tmp / "p.csv")],
           f"no readable image: {f.broken}: ", False, (str(tmp / "p.csv"),)),
      Case("vit-predict", "truncated .onnx", [str(tmp / "truncated.onnx"), image],
           "the exported onnx model cannot be opened", False),
      Case("vit-predict", "no image matches", [model, str(tmp / "nothing*.png")],
           f"No image files to classify: nothing at {tmp / 'nothing*.png'}.", False),
      Case("vit-inspect", "missing checkpoint", [MISSING], MISSING),
      Case("vit-inspect", "truncated .tflite", [str(tmp / "truncated.tflite")],
           "the exported tflite model cannot be opened", False),
      Case("vit-zoo", "missing checkpoint", ["fetch", "S_16", "no-such-file", "--zoo_dir",
                                             str(tmp / "zoo")], str(tmp / "zoo")),
  ]


def _run(case: Case, entry: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", PROBE, entry, case.command, *case.args],
                        env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=300)


def _in_this_process(case: Case, capfd) -> subprocess.CompletedProcess:
  """`case` run by the command's main in this process, where TensorFlow is loaded already: its
  status and what it wrote, as _run's (stdout says nothing of TensorFlow or Keras)."""
  capfd.readouterr()
  status = _main(case.command)(case.args)
  out, err = capfd.readouterr()
  return subprocess.CompletedProcess(case.args, status, out, err)


def in_a_process(cases: list[Case]) -> list[bool]:
  """Whether each case runs in a process of its own, as a user meets it (TensorFlow's start-up
  lines kept off the console, TensorFlow loaded only where the error is in the data, no Keras):
  every case found in the arguments, and each command's first that loads TensorFlow. The
  others load TensorFlow (~4.5 CPU-s a process) for an error in their data: their line and
  status are the question, read in this process. vit-train's all: its data is read after its
  flags, where _train_main stops."""
  own, loaded_by = [], set()  # The commands whose first case that loads TensorFlow is seen.
  for c in cases:
    own.append(c.arguments_only or c.command == "vit-train" or c.command not in loaded_by)
    if not c.arguments_only:
      loaded_by.add(c.command)
  return own


@pytest.mark.slow
def test_every_command_answers_an_input_error_with_one_line_and_status_2(tmp_path, dataset,
                                                                         capfd):
  model = tiny_serving_checkpoint(tmp_path / "model.npz", "plain")
  files = Files(tmp_path)
  tiny_tfds = str(tmp_path / "tfds")  # Fashion-MNIST as TFDS prepares it, 200 a split.
  fashion_mnist.prepare_fashion_mnist(tiny_tfds, max_examples_per_split=200)
  cases = (train_errors(files) + other_errors(files, model) + refusals_before_work(files, model)
           + tfds_too_small(files, model, dataset, tiny_tfds))
  scripts = console_scripts()
  assert sorted({c.command for c in cases}) == sorted(scripts), "add the command to the table"
  own = in_a_process(cases)
  with futures.ThreadPoolExecutor(2) as pool:  # Each waits seconds for imports: two cores.
    results = list(pool.map(lambda c, o: _run(c, scripts[c.command]) if o else None,
                            cases, own))
  results = [r or _in_this_process(c, capfd) for c, r in zip(cases, results)]
  wrong = []
  for case, r in zip(cases, results):
    lines = r.stderr.strip().splitlines()
    tf_loaded = "tensorflow loaded: True" in r.stdout
    # Keras, which TensorFlow and clu's TensorBoard writer import (~1 CPU-s), is left out by
    # every command: logs.start_tensorflow.
    keras_loaded = "keras loaded: True" in r.stdout
    left = [p for p in case.not_written if pathlib.Path(p).exists()]
    if (r.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: ")
        or case.named not in lines[0] or (case.arguments_only and tf_loaded) or left
        or keras_loaded):
      wrong.append(f"{case.command} ({case.what}): status {r.returncode}, TensorFlow loaded: "
                   f"{tf_loaded}, Keras loaded: {keras_loaded}, left behind: {left}, "
                   f"stderr:\n{r.stderr[-1500:]}")
  assert not wrong, "\n\n".join(wrong)
  assert len(own) - sum(own) == 7  # fewshot's 3, transfer's 2, predict's 2.
  assert (files.users / "notes.txt").read_text() == "mine"  # vit-export refused to replace it.


@pytest.mark.parametrize("command", ["vit-zoo", "vit-predict"])
def test_a_reader_that_stops_early_ends_the_command_quietly(command, tmp_path):
  """`vit-predict CKPT FOLDER | head`: the command ends as one killed by SIGPIPE would, status
  141 and nothing on stderr (it said 'error: [Errno 32] Broken pipe', status 2: an input
  error)."""
  image = tmp_path / "image.png"
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
  args = {"vit-zoo": ["list"],
          "vit-predict": [tiny_serving_checkpoint(tmp_path / "model.npz", "plain"), str(image)]}
  proc = subprocess.Popen([sys.executable, "-c", "import sys; from " + " import ".join(
      console_scripts()[command].split(":")) + "; sys.argv = sys.argv[1:]; main()",
                           command, *args[command]], env=cpu_env(), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  proc.stdout.close()  # Gone before the first line, as `head -0` is.
  stderr = proc.stderr.read()
  assert (proc.wait(timeout=300), stderr) == (141, "")


@pytest.mark.parametrize("command, args", [
    ("vit-fewshot", ["--datasets=x"]), ("vit-transfer", ["--suite", "x"]),
    ("vit-export", ["out.npz"]), ("vit-predict", ["image.png"]), ("vit-inspect", [])])
def test_a_missing_checkpoint_is_refused_before_jax_loads(command, args):
  """checkpoint.specs, which the commands check paths with, loads no JAX (the checkpoint
  package imports its names when used): a wrong path is refused at once, not after seconds
  of imports (~6 s on two cores, 0.4 s without them)."""
  probe = PROBE.replace('"tensorflow loaded:", "tensorflow" in', '"jax loaded:", "jax" in')
  r = subprocess.run([sys.executable, "-c", probe, console_scripts()[command], command, MISSING,
                      *args], env=cpu_env(), cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert (r.returncode, r.stderr) == (2, f"error: No checkpoint at {MISSING}.\n"), r.stderr
  assert "jax loaded: False" in r.stdout, r.stdout


def test_python_m_vit_jax_main_is_vit_train(tmp_path):
  usage = subprocess.run([sys.executable, "-m", "vit_jax.main", "--help"], cwd=REPO,
                         env=cpu_env(), capture_output=True, text=True, timeout=300)
  assert usage.returncode == 0, usage.stderr[-3000:]
  for flag in ("--config", "--workdir", "--verbose", "--distributed"):
    assert flag in usage.stdout, usage.stdout
  assert usage.stdout.startswith("Trains and evaluates a ViT")
  # An argument absl leaves over: refused, not a quick-start run that ignores it.
  extra = subprocess.run([sys.executable, "-m", "vit_jax.main", "--config", "quickstart",
                          "--workdir", str(tmp_path / "w"), "extra"], cwd=REPO, env=cpu_env(),
                         capture_output=True, text=True, timeout=300)
  assert (extra.returncode, extra.stderr) == (2, "error: unexpected argument 'extra': "
                                                 "vit-train takes flags only (--name=value), "
                                                 "and reads nothing else\n"), extra.stderr
  assert not (tmp_path / "w").exists()


def test_a_command_ends_with_its_status_past_idle_pools_and_with_its_atexit_work_done():
  """cli.exit_with skips the interpreter's finalisation only: a thread pool left idle (as TFDS
  and orbax leave theirs) is shut down, not waited on forever, and atexit handlers still run."""
  script = """
import atexit, concurrent.futures
from vit_jax.tools import cli
atexit.register(lambda: print("atexit ran", flush=True))
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(print, "pool ran")
cli.exit_with(lambda: 3)
"""
  run = subprocess.run([sys.executable, "-c", script], env=cpu_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 3, run.stderr[-3000:]
  assert run.stdout.splitlines() == ["pool ran", "atexit ran"], run.stdout


# No command writes over a path it reads (cli.check_apart): every command's output flag, set
# to an input, inside one or over one, in this process (the refusal, not the process boundary,
# is what is tested). The table must name every console script.

def _tree(root: pathlib.Path) -> dict[str, bytes]:
  return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _train_main(argv: list[str]) -> int:
  """vit-train's argument checks as its entry point runs them (absl's flags reset around)."""
  from absl import flags
  from vit_jax.tools import train
  flags.FLAGS.unparse_flags()
  saved, sys.argv = sys.argv, ["vit-train", *argv]  # Where ml_collections finds overrides.
  try:
    train.parse_flags(sys.argv)
    return 0
  except SystemExit as e:
    return e.code
  finally:
    sys.argv = saved
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # Defined per parse.
      delattr(flags.FLAGS, name)


def _main(command: str):
  """The command's main(argv) -> status; a cli.fail's SystemExit as the status it carries."""
  if command == "vit-train":
    return _train_main
  import importlib
  main = importlib.import_module(console_scripts()[command].split(":")[0]).main

  def status(argv: list[str]) -> int:
    try:
      return main(argv)
    except SystemExit as e:
      return e.code
  return status


def overwrite_cases(t: pathlib.Path, model: str) -> list[tuple[str, list[str], str]]:
  """(command, argv, what the one line names) per output flag and way of meeting an input."""
  photos, digits = t / "photos", t / "digits"
  run = t / "run"
  return [
      ("vit-predict", [model, str(photos), "--out", str(photos / "cat.png")],
       f"--out {photos / 'cat.png'} lies inside IMAGES {photos}"),
      ("vit-predict", [model, str(photos / "cat.png"), "--out", str(photos / "cat.png")],
       f"--out {photos / 'cat.png'} is IMAGES {photos / 'cat.png'}"),
      ("vit-predict", [model, f"{photos}/*.png", "--out", model], f"--out {model} is CKPT"),
      ("vit-export", [model, model], f"OUT {model} is CHECKPOINT {model}"),
      ("vit-export", [model, str(t / "userfile.txt"), "--format", "savedmodel"],
       f"OUT {t / 'userfile.txt'} is a file, and a SavedModel is a folder"),
      ("vit-fewshot", [model, f"--datasets={digits}", "--out_dir", str(digits / "train" / "r")],
       f"--out_dir {digits / 'train' / 'r'} lies inside --datasets {digits}"),
      ("vit-fewshot", [model, "--datasets=x", "--out_dir", str(t)], f"--out_dir {t} holds CKPT"),
      ("vit-transfer", [model, "--suite", str(digits), "--out_dir", str(digits / "sweep")],
       f"--out_dir {digits / 'sweep'} lies inside --suite {digits}"),
      ("vit-train", ["--config", "tests/tiny_config.py", f"--config.data.name={digits}",
                     "--workdir", str(digits / "train" / "run")],
       f"--workdir {digits / 'train' / 'run'} lies inside config.data.name {digits}"),
      ("vit-train", ["--config", "tests/tiny_config.py", f"--config.pretrained={run}/model.npz",
                     "--config.model.num_layers=1", "--workdir", str(run)], f"--workdir {run} holds config.pretrained"),
      ("vit-inspect", [model, "--figures", str(photos / "figs"), "--images", str(photos)],
       f"--figures {photos / 'figs'} lies inside --images {photos}"),
      ("vit-zoo", ["fetch", "S_16", "--zoo_dir", str(t / "zoo"), "--cache_dir",
                   str(t / "zoo" / "cache")],
       f"--cache_dir {t / 'zoo' / 'cache'} lies inside --zoo_dir {t / 'zoo'}"),
  ]


def test_no_command_writes_over_what_it_reads(tmp_path, capsys):
  t = tmp_path
  model = tiny_serving_checkpoint(t / "model.npz", "plain")
  (t / "photos").mkdir()
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(t / "photos" / "cat.png")
  _folder(t / "digits", dict(train=["a", "b"], test=["a", "b"]))
  (t / "run").mkdir()
  shutil.copy(model, t / "run" / "model.npz")
  (t / "userfile.txt").write_text("mine")
  (t / "zoo").mkdir()
  (t / "zoo" / "index.csv").write_text("name\n")
  cases = overwrite_cases(t, model)
  assert sorted({c for c, _, _ in cases}) == sorted(console_scripts()), "add the command"
  before, wrong = _tree(t), []
  for command, argv, named in cases:
    start = time.perf_counter()
    status = _main(command)(argv)
    seconds = time.perf_counter() - start
    lines = capsys.readouterr().err.strip().splitlines()
    if (status != 2 or len(lines) != 1 or not lines[0].startswith("error: ")
        or named not in lines[0] or seconds > 5 or _tree(t) != before):
      wrong.append(f"{command} {argv}: status {status} in {seconds:.1f} s, files changed: "
                   f"{_tree(t) != before}, stderr: {lines}")
  assert not wrong, "\n".join(wrong)


def _headless_repo(tmp_path, hub_cache, reg: int = 0) -> str:
  """A tiny timm DINOv2 in the offline Hub cache, without a head as timm's lvd142m repos are
  (num_classes=0), or with one and `reg` registers."""
  from helpers import write_repo
  from vit_jax.models import timm_models  # (conftest: torch before TensorFlow.)
  _, timm = timm_models.import_torch()
  from timm.models import _hub
  kwargs = dict(img_size=28, embed_dim=32, depth=1, num_heads=2, num_classes=5 if reg else 0)
  arch = f"vit_small_patch14_reg{reg}_dinov2" if reg else "vit_small_patch14_dinov2"
  folder = tmp_path / f"dinov2_{reg}"
  _hub.save_for_hf(timm.create_model(arch, pretrained=False, **kwargs), folder,
                   model_args=kwargs, safe_serialization=True)
  write_repo(hub_cache, f"org/dinov2_{reg}", {f: folder / f for f in os.listdir(folder)})
  return f"hf-hub:org/dinov2_{reg}"


def test_vit_predict_names_what_works_on_a_model_without_a_head(tmp_path, hub_cache, capsys):
  spec = _headless_repo(tmp_path, hub_cache)
  Image.new("RGB", (40, 40)).save(tmp_path / "a.png")
  status = _main("vit-predict")([spec, str(tmp_path / "a.png")])
  [line] = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and line.startswith(f"error: {spec} has no classifier head"), line
  assert "vit-fewshot" in line and "vit-transfer" in line and "head=False" in line


def run_refusals(tmp_path: pathlib.Path, repo: str) -> list[tuple[list[str], str]]:
  """vit-train's arguments refused before its workdir, each (argv, what the line names)."""
  return [
      (["--config", "finetune:b16"], "--config finetune:b16: ValueError: not enough values to "
       "unpack (expected 2, got 1); accepted: finetune:MODEL,DATASET (e.g. finetune:b16,"),
      (["--config", "pretrain:b16,nosuch"], "--config pretrain:b16,nosuch: ValueError: Unknown "
       "pre-training dataset 'nosuch'; known: i1k, i21k; accepted: pretrain:MODEL,i1k, "
       "pretrain:MODEL,i21k"),
      (["--config", "augreg_pretrain:b16"], "accepted: augreg_pretrain:MODEL,i1k|i21k,none|"),
      (["--config", "tests/tiny_config.py", "--topology", "v5e:2x2"],
       "--topology=v5e:2x2: applies to a compile for a TPU slice (--compile_only or --plan)"),
      (["--config", "tests/tiny_config.py", "--num_slices=2"], "add --compile_only, or drop "
       "--num_slices"),
      (["--config", "tests/tiny_config.py", f"--config.pretrained={repo}",
        "--config.model.num_registers=2"], f"--config.model.num_registers=2: {repo}'s arrays "
       "have num_registers=4, so they cannot load into this model; leave "
       "config.model.num_registers unset (the run takes the checkpoint's model) or set it to 4"),
      (["--config", "tests/tiny_config.py", f"--config.pretrained={repo}"],
       f"config.model.mlp_dim=64: {repo}'s arrays have mlp_dim=128"),  # The config file's.
  ]


def test_vit_train_refuses_before_its_workdir_in_one_line(tmp_path, hub_cache, capsys):
  repo = _headless_repo(tmp_path, hub_cache, reg=4)
  wrong = []
  for argv, named in run_refusals(tmp_path, repo):
    workdir = tmp_path / "w"
    start = time.perf_counter()
    status = _train_main([*argv, "--workdir", str(workdir)])
    seconds = time.perf_counter() - start
    lines = capsys.readouterr().err.strip().splitlines()
    if (status != 2 or len(lines) != 1 or named not in lines[0] or workdir.exists()
        or seconds > 5):
      wrong.append(f"{argv}: status {status} in {seconds:.1f} s, workdir left: "
                   f"{workdir.exists()}, stderr: {lines}")
  assert not wrong, "\n".join(wrong)
