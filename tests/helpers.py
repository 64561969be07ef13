"""Helpers shared by the test modules (fixtures live in conftest.py).

TensorFlow, torch and the notebook client are imported where used: importing TensorFlow before
torch (timm's cross-checks) crashes the process, so this module stays light.
"""
import contextlib
import glob
import json
import os
import pathlib
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import pytest

if TYPE_CHECKING:
  from vit_jax import models

REPO = pathlib.Path(__file__).resolve().parents[1]
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# UCI's optical recognition of handwritten digits (CC BY 4.0), its test set as scikit-learn
# ships it (`sklearn.datasets.load_digits`): a row per image, 64 pixels in 0-16, then the label.
DIGITS_CSV = REPO / "tests" / "data" / "digits.csv.gz"
TINY_CONFIG = str(REPO / "tests" / "tiny_config.py")

# Runs a console script's entry point as the script does (`python -c PROBE MODULE:FUNCTION
# COMMAND ARGS...`), then says on stdout whether TensorFlow and Keras were imported.
PROBE = """
import atexit, importlib, sys
atexit.register(lambda: print("tensorflow loaded:", "tensorflow" in sys.modules,
                              "keras loaded:", "keras" in sys.modules, flush=True))
module, function = sys.argv[1].split(":")
sys.argv = [sys.argv[2], *sys.argv[3:]]
getattr(importlib.import_module(module), function)()
"""

# A 128M-class head of width 1024 on tiny_config: 137.6 G parameters, refused by their count for
# any slice the tests name (512 GiB, more than a tpu7x-8 or a v5litepod-4 holds), before a
# compile: the launchers' preflight refusals.
HEAD_TOO_BIG = ["--num_classes=134217728", "--config.model.hidden_size=1024"]
# A ViT small enough for unit tests on CPU: model fields over any registry name's.
TINY_VIT = dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
# XLA's CPU compiler set for the session's tiny programs, which are compiled far more than run
# (every process of the session, the commands the tests start included): LLVM's optimisation
# off (the library's matmuls and convolutions are precompiled; no fast-math either way: -17%
# of the CPU of test_e2e_train, test_npz, test_models and test_vit), fusions by the elemental
# IR emitters instead of the MLIR fusion emitters (half the compile time of each program, most
# of them one eager op), and no splitting of a module for codegen threads. The whole suite:
# 1,568 passed in 1,275 s instead of ~1,510 s on two AVX2 cores. LLVM's level 1 runs a tiny
# ViT's train step 1.7x as fast but compiles slower: test_e2e_finetune 86 -> 76 CPU-s, but
# test_vit, test_models and test_serving 116 -> 157; and the commands' processes alone at
# level 1 would round otherwise than the in-process runs they are compared with.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")
# Every optional field of a ViT on at once (the Hub families' forms together).
EVERY_FIELD = dict(classifier="gap", class_token=True, num_registers=2, pre_norm=True,
                   layer_scale=True, qkv_bias="qv", mlp="swiglu", mlp_norm=True,
                   attention_norm=True, rope="eva", rope_ref_grid=16, head_bias=False,
                   layer_norm_eps=1e-5)
# tests/tiny_config.py's model: 28 px images in a 4x4 grid of 7 px patches.
TINY_CONFIG_VIT = dict(patch_size=7, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


def write_digits_folder(root: pathlib.Path) -> str:
  """DIGITS_CSV's 1,797 real 8x8 digits as an image folder under `root` (kept if there):
  ROOT/<split>/<class>/*.png, 1,500 in `train` and 297 in `test`, pixels scaled from 0-16 to
  0-255."""
  from PIL import Image
  if not (root / "test").is_dir():
    rows = np.loadtxt(DIGITS_CSV, delimiter=",")
    for i, row in enumerate(rows):
      folder = root / ("train" if i < 1500 else "test") / str(int(row[-1]))
      folder.mkdir(parents=True, exist_ok=True)
      image = (row[:-1].reshape(8, 8) * 255 / 16).round().astype(np.uint8)
      Image.fromarray(image).save(folder / f"{i:04d}.png")
  return str(root)


def tiny_config(dataset, **overrides):
  """tests/tiny_config.py on `dataset` (name, data_dir), with dotted-key overrides."""
  from vit_jax import configs
  c = configs.get_config(TINY_CONFIG)
  c.data.name, c.data.data_dir = dataset
  c.update_from_flattened_dict(overrides)
  return c


def read_scalars(workdir, tag: str, newest_file_only: bool = False) -> dict[int, float]:
  """{step: value} of a scalar in a run's TensorBoard event files."""
  import tensorflow as tf
  files = sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*")), key=os.path.getmtime)
  values = {}
  for f in files[-1:] if newest_file_only else files:
    for event in tf.compat.v1.train.summary_iterator(f):
      for v in event.summary.value:
        if v.tag == tag:
          values[event.step] = float(tf.make_ndarray(v.tensor))
  return values


def cli(workdir, dataset, *extra, config: str = TINY_CONFIG) -> list[str]:
  """The command line of `vit-train` on `dataset` (name, data_dir); `config` is a
  --config spec: a shipped config's name or a file's path."""
  name, data_dir = dataset
  return [sys.executable, "-m", "vit_jax.tools.train", "--config", config,
          "--workdir", str(workdir), f"--config.data.name={name}",
          f"--config.data.data_dir={data_dir}", *extra]


def xla_flags(devices: int) -> str:
  """XLA_FLAGS of a test process on `devices` CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"


def cpu_env(devices: int = 1) -> dict[str, str]:
  """The environment of a subprocess on `devices` CPU devices; it sizes XLA's pool itself."""
  env = {k: v for k, v in os.environ.items() if k != "NPROC"}
  return env | {"XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu"}


def run_cli(args, devices: int = 1, cwd=REPO, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(args, env=cpu_env(devices), cwd=cwd, capture_output=True, text=True,
                        timeout=600, **kw)


def launch(script: str, *args: str, env: dict | None = None, timeout: int = 60):
  """`python launch/SCRIPT ARGS` from the clone, its output captured."""
  return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


def read_until(proc: subprocess.Popen, found: Callable[[str], bool],
               timeout: float = 120) -> tuple[str, str]:
  """Reads the pipe of `proc`'s stdout until a line for which `found(line)` holds, waiting
  `timeout` seconds at most in all: (that line, what came after it in the same reads). A
  child that never writes such a line fails the test with what it wrote, not a wait for ever.
  It reads the pipe's file descriptor, not its Python buffer: read on with communicate()."""
  fd, partial, seen = proc.stdout.fileno(), b"", []
  deadline = time.monotonic() + timeout
  while True:
    left = deadline - time.monotonic()
    chunk = os.read(fd, 1 << 16) if left > 0 and select.select([fd], [], [], left)[0] else None
    if not chunk:
      why = f"within {timeout} s" if chunk is None else "before its output ended"
      pytest.fail(f"no line as awaited {why}; it wrote:\n"
                  + (b"".join(seen) + partial).decode(errors="replace")[-3000:])
    *lines, partial = (partial + chunk).split(b"\n")
    for k, line in enumerate(lines):
      if found(line.decode(errors="replace")):
        rest = b"\n".join(lines[k + 1:] + [partial])
        return line.decode(errors="replace"), rest.decode(errors="replace")
    seen.extend(line + b"\n" for line in lines)


def stderr_tail(proc: subprocess.Popen) -> str:
  """The last 3,000 characters of a child's stderr (a pipe), for a failed test's message: the
  child is killed first where it still runs, so that the read ends (30 s at most)."""
  proc.kill()
  try:
    err = proc.communicate(timeout=30)[1]
  except subprocess.TimeoutExpired as e:  # Something it started holds the pipe open.
    err = e.stderr
  err = err or ""
  return (err.decode(errors="replace") if isinstance(err, bytes) else err)[-3000:]


def finish(proc: subprocess.Popen, timeout: float) -> tuple:
  """proc.communicate(timeout=timeout); a child still running then fails the test with its
  stderr so far, and is killed."""
  try:
    return proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"still running after {timeout} s (killed); its stderr ends:\n"
                + stderr_tail(proc))


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float,
             what: str) -> None:
  """Polls `ready()` every 0.2 s while `proc` runs: where `proc` ends first or `timeout`
  seconds pass, fails the test with its stderr (a pipe; the child killed)."""
  deadline = time.monotonic() + timeout
  while not ready():
    if proc.poll() is not None or time.monotonic() > deadline:
      why = (f"not within {timeout} s" if proc.returncode is None else
             f"the child exited with status {proc.returncode} first")
      pytest.fail(f"{what}: {why}; its stderr ends:\n{stderr_tail(proc)}")
    time.sleep(0.2)


def interrupted_at(args: list[str], text: str, timeout: float = 120,
                   **popen) -> tuple[int, str]:
  """Starts `args` (Popen keywords in `popen`) and presses Ctrl-C (SIGINT) once a line of its
  stdout holds `text` (within `timeout` s): its exit status and what it wrote after that line
  (within 60 s of the signal). The child is killed at the end whatever happens."""
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, **popen)
  try:
    _, rest = read_until(proc, lambda line: text in line, timeout)
    proc.send_signal(signal.SIGINT)
    try:
      more, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired as e:
      pytest.fail(f"still running 60 s after Ctrl-C; it wrote after {text!r}:\n{rest}"
                  + (e.output or b"").decode(errors="replace")[-3000:])
  finally:
    proc.kill()
  return proc.returncode, rest + more.decode(errors="replace")


def scripted_gcloud(root: pathlib.Path) -> tuple[dict[str, str], pathlib.Path]:
  """tests/fake_gcloud.py first on PATH, playing the history written to ROOT/gcloud/
  history.json: (the environment of a launch, that folder, whose state later calls keep)."""
  folder = root / "gcloud"
  script = folder / "bin" / "gcloud"
  script.parent.mkdir(parents=True, exist_ok=True)
  fake = REPO / "tests" / "fake_gcloud.py"
  script.write_text(f'#!/bin/sh\nexec {sys.executable} -S {fake} "$@"\n')  # -S: stdlib only.
  script.chmod(0o755)
  env = cpu_env() | {"PATH": f"{script.parent}:{os.environ['PATH']}",
                     "FAKE_GCLOUD_DIR": str(folder), "FAKE_GCLOUD_PYTHON": sys.executable}
  return env, folder


# What a notebook's cells may write on stderr, none of it vit_jax's to quiet: TensorFlow's C++
# notices as it loads (oneDNN's, which no setting turns off), and tqdm's where Jupyter has no
# ipywidgets (TFDS and huggingface_hub import tqdm.auto).
_OTHERS_NOTICES = re.compile(
    r"I\d{4} .*\] oneDNN custom operations are on|WARNING: All log messages before "
    r"absl::InitializeLog\(\) is called|.*TqdmWarning: IProgress not found|  from "
    r"\.autonotebook import tqdm as notebook_tqdm")


@contextlib.contextmanager
def notebook_kernel(**env: str) -> Iterator[Callable[..., Any]]:
  """One Jupyter kernel for several top-to-bottom runs of notebooks: `run(path, **params)`
  empties the kernel's namespace (IPython's %reset), makes the parameters its only VIT_*
  environment variables and executes every cell, returning the notebook with its outputs (a
  cell's error raises nbclient's CellExecutionError). A run finds nothing of the one before
  but the modules it imported, whose imports are most of a kernel's seconds. `env` joins the
  kernel's environment from its start (read by libraries as they are imported: HF_HUB_CACHE)."""
  import nbformat
  from jupyter_client.manager import KernelManager
  from nbclient import NotebookClient
  manager = KernelManager(kernel_name="python3")
  # A user's kernel: what the session sets to keep libtpu and TensorFlow quiet is not set there.
  user = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")}
  manager.start_kernel(cwd=str(REPO), env=dict(user, **env))

  def run(path, **params: str):
    nb = nbformat.read(path, as_version=4)
    fresh = ("%reset -f\nimport os\n[os.environ.pop(k) for k in list(os.environ) if "
             f"k.startswith('VIT_')]\nos.environ.update({params!r})\ndel os")
    nb.cells.insert(0, nbformat.v4.new_code_cell(fresh))
    try:
      NotebookClient(nb, km=manager, timeout=600, kernel_name="python3").execute()
    finally:
      del nb.cells[0]
    said = [line for c in nb.cells for o in c.get("outputs", [])
            if o.output_type == "stream" and o.name == "stderr"
            for line in o.text.splitlines() if line and not _OTHERS_NOTICES.match(line)]
    assert not said, f"{path.name}: the cells wrote on stderr:\n" + "\n".join(said[:20])
    return nb

  try:
    yield run
  finally:
    manager.shutdown_kernel(now=True)


def random_params(model, size: int, seed: int = 0):
  """Random parameters of an initialisation's scale, none trivial, drawn on the host from the
  shapes alone (a full-size hybrid's jitted `init` took 17 CPU-s to compile and run):
  normalisation scales 1 + noise; biases, embeddings and the head (zero-initialised) noise;
  other kernels fan-in scaled (an attention output's fan-in is its heads x head width)."""
  import jax
  from vit_jax import models
  shapes = models.abstract_params(model, size)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    names = [getattr(k, "key", "") for k in path]
    noise = rng.standard_normal(leaf.shape, np.float32)
    if names[-1] == "scale":
      return 1 + np.float32(0.02) * noise
    if names[-1] != "kernel" or names[0] == "head":
      return np.float32(0.02) * noise
    if leaf.ndim == 3:  # Attention's: query/key/value (in, heads, width), out (heads, width, out).
      fan_in = np.prod(leaf.shape[:2]) if names[-2] == "out" else leaf.shape[0]
    else:  # Dense (in, out) and convolutions (height, width, in, out).
      fan_in = np.prod(leaf.shape[:-1])
    return noise / np.float32(np.sqrt(fan_in))
  return jax.tree_util.tree_map_with_path(draw, shapes)


def random_like(tree, scale: float, seed: int):
  """`scale` x standard normal float32 NumPy arrays of the shapes of `tree`'s leaves (arrays or
  jax.ShapeDtypeStruct): drawn on the host, as JAX's would compile a program per array shape
  (~100 programs, ~7 s, for a hybrid)."""
  import jax
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: np.float32(scale) * rng.standard_normal(p.shape, np.float32), tree)


def randomised_torch(module, scale: float = 0.3):
  """A torch module with every parameter drawn from `scale` x standard normal (seed 0), in eval
  mode: random weights, not its initialisation (LayerScale's 1e-5 would hide its branch)."""
  import torch
  torch.manual_seed(0)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(scale * torch.randn_like(p))
  return module.eval()


def noisy(tree, scale: float, seed: int):
  """Every array of `tree` plus random_like's noise, as NumPy arrays."""
  import jax
  return jax.tree.map(lambda p, z: np.asarray(p) + z, tree, random_like(tree, scale, seed))


def new_flax_layout(flat):
  """Original-layout flat arrays renamed as newer Flax code names the block children."""
  names = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
           "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}
  rename = lambda m: m.group(1) + names.get(m.group(2), m.group(2))
  return {re.sub(r"(encoderblock_\d+/)(\w+)", rename, k): v for k, v in flat.items()}


def big_vision_layout(flat, scanned: bool):
  """Original-layout flat arrays as big_vision writes them: `params/` prefix, newer names,
  the position embedding without the class entry, optionally one scanned encoder block."""
  from vit_jax.models.vit import POSEMB_KEY
  flat = new_flax_layout(flat)
  flat["pos_embedding"] = flat.pop(POSEMB_KEY)[:, 1:]
  if scanned:
    blocks = sorted({k.split("/")[1] for k in flat if k.startswith("Transformer/encoderblock_")},
                    key=lambda b: int(b.split("_")[1]))
    for rest in {k.split("/", 2)[2] for k in flat if k.startswith("Transformer/encoderblock_0/")}:
      flat[f"Transformer/encoderblock/{rest}"] = np.stack(
          [flat.pop(f"Transformer/{b}/{rest}") for b in blocks])
  return {f"params/{k}": v for k, v in flat.items()}


# Tiny models for the serving tests: a plain ViT and a hybrid (ResNet root + ViT), each
# (registry name, input size, overrides).
TINY_SERVING_MODELS = {
    "plain": ("ViT-Ti_16", 32, dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2,
                                     num_layers=1)),
    "hybrid": ("R+ViT-Ti_16", 64, dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1)),
    # The pieces of DINOv2 / DINOv3 / CLIP / EVA-02 that change what an exported graph computes.
    "families": ("ViT-Ti_16", 32, dict(
        patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1, classifier="gap",
        class_token=True, num_registers=2, posemb="none", rope="dinov3", pre_norm=True,
        layer_scale=True, qkv_bias="qv", gelu="quick", layer_norm_eps=1e-5, head_bias=False)),
    # The exact (erf) GELU: DINOv2 and CLIP's towers (a class token, registers, LayerScale,
    # ln_pre, a head without bias), and EVA-02's blocks (mean pooling without a class token,
    # fc_norm, its rotary embedding, the attention's and the MLP's inner norms).
    "exact": ("ViT-Ti_16", 32, dict(
        patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1, gelu="exact",
        num_registers=1, layer_scale=True, pre_norm=True, layer_norm_eps=1e-5, head_bias=False)),
    "eva": ("ViT-Ti_16", 32, dict(
        patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1, gelu="exact",
        classifier="gap", fc_norm=True, rope="eva", rope_ref_grid=16, attention_norm=True,
        mlp_norm=True, qkv_bias="qv")),
    # SwiGLU blocks under SigLIP's MAP head (whose MLP has the GELU), fixed sin-cos position
    # embeddings, no q/k/v bias, a pre-logits layer.
    "map": ("ViT-Ti_16", 32, dict(
        patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1, mlp="swiglu",
        classifier="map", gelu="exact", posemb="sincos2d", qkv_bias="none",
        representation_size=16)),
}


def tiny_serving_checkpoint(path, kind: str, num_classes: int = 10, seed: int = 0) -> str:
  """A tiny model of TINY_SERVING_MODELS with random params (random_params; the head larger, so
  that the logits differ by image and class), written as a released-layout .npz; returns the
  path."""
  import jax
  import jax.numpy as jnp
  from vit_jax import models
  from vit_jax.checkpoint import description, loader, npz
  name, size, overrides = TINY_SERVING_MODELS[kind]
  model = models.create_model(name, num_classes=num_classes, **overrides)
  params = jax.tree.map(jnp.asarray, random_params(model, size, seed))
  head = params["head"]["kernel"]
  params["head"] = {"kernel": jax.random.normal(jax.random.key(seed + 1), head.shape) * 0.5,
                    "bias": jax.random.normal(jax.random.key(seed + 2), (num_classes,)) * 0.1}
  if not model.head_bias:
    del params["head"]["bias"]
  if "layer_scale" in overrides:  # Scales far from their 1e-5 start, or the blocks vanish.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.5 if "LayerScale" in jax.tree_util.keystr(p) else x, params)
  # A hidden unit of every MLP at 0 for every input (its weights and bias zeroed): a real model's
  # millions of pre-activations always include some near 0, where a GELU's lowering may take
  # another branch (the exact GELU's erfc did, NaN in ONNX); a tiny model's few hundred may not.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x.at[..., 0].set(0) if re.search(r"Mlp\w*'\]\['Dense_0", jax.tree_util.keystr(p))
      else x, params)
  # What no array shows (the rotary embedding, the GELU, the epsilon) the description tells.
  described = description.Description(
      model={k: overrides[k] for k in models.registry.DESCRIBED if k in overrides},
      image_size=size, num_classes=num_classes)
  npz.save_npz(str(path), params, None if kind in ("plain", "hybrid") else described)
  return str(path)


# The TPU compile checks': libtpu's compile-only devices need no TPU.
try:
  import libtpu  # noqa: F401  The test extra installs it; the checks need nothing else.
  HAS_LIBTPU = True
except ImportError:
  HAS_LIBTPU = False
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu is not installed (pip install libtpu, the test extra's): "
    "TPU compiles need it")


# vit-inspect's, run in this process, and the fine-tuning command it prints.

def run_inspect(capsys, *argv: str) -> tuple[int, str, str]:
  """`vit-inspect ARGV` in this process: (exit status, stdout, stderr)."""
  from vit_jax.tools import inspect_checkpoint as inspect_cli
  rc = inspect_cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return rc, out, err


def parse_finetune_command(command: str, monkeypatch):
  """The config `vit-train` would build from `command`, validated."""
  from absl import flags
  from ml_collections import config_flags
  from vit_jax.tools import train_flags
  from vit_jax.train import config as config_lib
  argv = shlex.split(command)
  assert argv[0] == "vit-train"
  monkeypatch.chdir(tempfile.gettempdir())  # The command runs from any working directory.
  argv = train_flags.resolve_config_flag(argv)  # As vit-train: a config's name to its file.
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  values(argv)
  config_lib.validate(values.config)
  return values.config


def assert_finetuning_loads_the_file(command: str, monkeypatch, num_classes: int = 10):
  """The command's model takes the file's arrays: what `main` does before its first step."""
  import jax
  import jax.numpy as jnp
  from vit_jax.checkpoint import description, loader, npz
  from vit_jax.train import run_setup
  c = parse_finetune_command(command, monkeypatch)
  run_setup.inherit_model_fields(c, loader.describe(c.pretrained))
  model = run_setup.build_model(c, num_classes)
  size = c.data.image_size
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))
  params = loader.load_params(c.pretrained, abstract["params"], model.posemb_interpolation)
  assert params["head"]["kernel"].shape[-1] == num_classes
  return c


# The serving formats'.

# Max |logit difference| from JAX's, float32 throughout.
TOLERANCE = {"savedmodel": 1e-4, "tflite": 1e-4, "onnx": 1e-4}


def apply(module, variables, *args, **static):
  """module.apply(variables, *args, **static) compiled as one program, as a user runs a model:
  applied op by op, each apply compiled every operation on its own (6.6 s of CPU against 2.4
  for four applies of test_vit_fields' model). `static`: Python values (train=,
  return_attention=, rngs=...), closed over."""
  import jax
  return jax.jit(lambda v, *a: module.apply(v, *a, **static))(variables, *args)


def jax_logits(loaded, batch: np.ndarray) -> np.ndarray:
  """The reference: the model applied to the input pipeline's preprocessing of `batch`."""
  from vit_jax.data import preprocess as pp
  x = pp.apply_preprocessing(batch, loaded.description.preprocessing).numpy()
  return np.asarray(apply(loaded.model, {"params": loaded.params}, x, train=False))


# LoRA's.

IMAGES = np.random.default_rng(0).uniform(-1, 1, (8, 32, 32, 3)).astype(np.float32)


def adapted_params(model, size: int = 32, seed: int = 1):
  """`model`'s initial params with every array (B included) moved away from its init."""
  import jax
  params = model.init(jax.random.key(0), IMAGES[:1, :size, :size])["params"]
  return noisy(params, 0.1, seed)


# explore's and the explore notebook's.

def tiny_params(seed: int = 0, **overrides) -> tuple["models.VisionTransformer", dict]:
  """A ViT of TINY_CONFIG_VIT (10 classes) and its initial params, the head random."""
  import jax
  import jax.numpy as jnp
  from vit_jax import models
  model = models.create_model("ViT-Ti_16", num_classes=10, **{**TINY_CONFIG_VIT, **overrides})
  params = model.init(jax.random.key(seed), jnp.zeros((1, 28, 28, 3)))["params"]
  # A random head, so that the top-5 are not a tie.
  params["head"]["kernel"] = jax.random.normal(jax.random.key(seed + 1),
                                               params["head"]["kernel"].shape)
  return model, params


# Descriptions' preprocessing.

# A run trained on [0, 255] -> [0, 1], not the default [-1, 1]: what exports used to ignore.
VALUE_RANGE = (0.0, 1.0)
# timm's / transformers' ImageNet normalisation, as the Hub's checkpoints state it.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HUB_PREPROCESSING = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop="central_crop",
                         central_crop_fraction=0.875, interpolation="bicubic")


def mean_std_npz(tmp_path, dataset) -> str:
  """A checkpoint of the tiny run's model whose description states the Hub's mean and std."""
  import jax
  from vit_jax import models
  from vit_jax.checkpoint import description, loader, npz
  from vit_jax.train import run_setup
  c = tiny_config(dataset)
  model = run_setup.build_model(c, 10)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3), np.float32))["params"]
  described = description.Description(
      model=models.registry.described_fields(model), model_name=c.model_name, image_size=28,
      num_classes=10, preprocessing=description.Preprocessing(**HUB_PREPROCESSING))
  npz.save_npz(str(tmp_path / "hub.npz"), params, described)
  return str(tmp_path / "hub.npz")


# Hugging Face Hub repos, written offline in huggingface_hub's cache layout.

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SIZE = 32


# (timm architecture, pretrained tag, create_model kwargs, the GELU its description records):
# the tag alone decides the GELU where, as on the Hub's timm repos, the config has no act_layer.
# Two blocks (depth=2) show a layout's mapping of each block as twelve do, in a fifth of the time.
TIMM = {
    "token": ("vit_tiny_patch16_224", "augreg_in21k", dict(depth=2), "tanh"),
    "gap_fc_norm": ("vit_tiny_patch16_224", "augreg2_in21k_ft_in1k",
                    dict(depth=2, class_token=False, global_pool="avg", fc_norm=True), "exact"),
    "registers": ("vit_tiny_patch16_224", "augreg_in21k",
                  dict(depth=2, reg_tokens=4, no_embed_class=True), "tanh"),
    "hybrid": ("vit_tiny_r_s16_p8_224", "augreg_in21k", {}, "tanh"),
    "hybrid_r26": ("vit_small_r26_s32_224", "augreg_in21k", dict(depth=2), "tanh"),
    "siglip_map": ("vit_base_patch16_siglip_224", "webli", dict(depth=2), "tanh"),
}
_IMG = {"hybrid": 64, "hybrid_r26": 64}


def write_repo(cache, repo: str, files: dict[str, str]) -> None:
  """`files` (name -> local path) as huggingface_hub's cache holds a repo at COMMIT."""
  root = cache / f"models--{repo.replace('/', '--')}"
  snapshot = root / "snapshots" / COMMIT
  snapshot.mkdir(parents=True)
  (root / "refs").mkdir()
  (root / "refs" / "main").write_text(COMMIT)
  for name, path in files.items():
    shutil.copy(path, snapshot / name)


def perturbed(model, torch, scale: float = 0.01):
  """The model's weights moved off their initial values (zero heads, unit norms)."""
  torch.manual_seed(0)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * scale)
  return model.eval()


def timm_repo(tmp_path, kind: str):
  """(timm model, its folder as the Hub holds it: model.safetensors and config.json without
  model_args, as timm's uploads of Google's weights are)."""
  from vit_jax.models import timm_models
  torch, timm = timm_models.import_torch()
  from timm.models import _hub
  arch, tag, kwargs, gelu = TIMM[kind]
  size = _IMG.get(kind, SIZE)
  act = "gelu_tanh" if gelu == "tanh" else "gelu"
  model = perturbed(timm.create_model(arch, pretrained=False, img_size=size,
                                      num_classes=5, act_layer=act, **kwargs), torch)
  folder = tmp_path / kind
  _hub.save_for_hf(model, folder, model_args=dict(img_size=size, num_classes=5, **kwargs),
                   safe_serialization=True)
  config = json.loads((folder / "config.json").read_text())
  config.pop("model_args")
  config["pretrained_cfg"]["tag"] = tag
  config["label_names"] = [f"n0{i}" for i in range(5)]
  (folder / "config.json").write_text(json.dumps(config))
  return model, folder, config


# The AugReg zoo's: an index.csv laid out like gs://vit_models/augreg's, tiny files.

# The bucket's header (the published columns, with `epochs` after `ds`).
HEADER = ["name", "ds", "epochs", "lr", "aug", "wd", "do", "sd", "best_val", "final_val",
          "final_test", "adapt_ds", "adapt_lr", "adapt_steps", "adapt_resolution",
          "adapt_final_val", "adapt_final_test", "params", "infer_samples_per_sec",
          "filename", "adapt_filename"]
# Real filenames (the official README and Colab, timm's configs); the numbers are made up
# except where the Colab prints them (adapt_final_test of the recommended ImageNet
# adaptations, infer_samples_per_sec).
TI = "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"        # Recommended.
TI_LIGHT = "Ti_16-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0"
TI_I1K = "Ti_16-i1k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0"
R_TI = "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"
R26 = "R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0"
S16 = "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0"
IMNET_384 = "--imagenet2012-steps_20k-lr_0.03-res_384"
ROWS = [
    # name, ds, epochs, lr, aug, wd, do, sd, best_val, final_val, final_test,
    # adapt_ds, adapt_lr, adapt_steps, adapt_resolution, adapt_final_val, adapt_final_test,
    # params, infer_samples_per_sec, filename, adapt_filename
    ["Ti/16", "i21k", 300, 0.001, "none", 0.03, 0.0, 0.0, 0.3712, 0.3702, 0.3671,
     "imagenet2012", 0.03, 20000, 384, 0.7891, 0.7822, 5717416, 609.58, TI, TI + IMNET_384],
    ["Ti/16", "i21k", 300, 0.001, "none", 0.03, 0.0, 0.0, 0.3712, 0.3702, 0.3671,
     "imagenet2012", 0.03, 20000, 224, 0.7541, 0.7510, 5717416, "",
     TI, TI + "--imagenet2012-steps_20k-lr_0.03-res_224"],
    ["Ti/16", "i21k", 300, 0.001, "light1", 0.1, 0.0, 0.0, 0.3601, 0.3598, 0.3560,
     "cifar100", 0.01, 10000, 224, 0.8702, 0.8655, 5717416, "",
     TI_LIGHT, TI_LIGHT + "--cifar100-steps_10k-lr_0.01-res_224"],
    # Higher final_val than any i21k row (another label space): must not be chosen.
    ["Ti/16", "i1k", 300, 0.001, "light0", 0.1, 0.0, 0.0, 0.7301, 0.7288, 0.7102,
     "imagenet2012", 0.01, 20000, 224, 0.7321, 0.7299, 5717416, "",
     TI_I1K, TI_I1K + "--imagenet2012-steps_20k-lr_0.01-res_224"],
    ["R+Ti/16", "i21k", 300, 0.001, "none", 0.03, 0.0, 0.0, 0.3530, 0.3521, 0.3499,
     "imagenet2012", 0.03, 20000, 384, 0.7602, 0.7540, 6337704, 2425.77, R_TI, R_TI + IMNET_384],
    ["R26+S/32", "i21k", 300, 0.001, "light1", 0.1, 0.0, 0.0, 0.4391, 0.4385, 0.4350,
     "oxford_iiit_pet", 0.03, 500, 384, 0.953804, 0.941128, 36431912, 560.40,
     R26, R26 + "--oxford_iiit_pet-steps_0k-lr_0.03-res_384"],
    ["S/16", "i21k", 300, 0.001, "light1", 0.03, 0.0, 0.0, 0.4502, 0.4497, 0.4468,
     "imagenet2012", 0.03, 20000, 384, 0.8401, 0.83728, 22050664, 300.12, S16, S16 + IMNET_384],
]


AUGREG_TINY = dict(hidden_size=16, mlp_dim=32, num_heads=2, num_layers=2)
CLASSES = {"i21k": 21843, "imagenet2012": 1000, "cifar100": 100, "oxford_iiit_pet": 37}


def write_checkpoint(path, filename: str) -> None:
  """A small .npz with the real key layout, class count and position-embedding grid."""
  import jax
  import jax.numpy as jnp
  from vit_jax import models
  from vit_jax.checkpoint import description, loader, npz
  from vit_jax.checkpoint import augreg
  adapted = "--" in filename
  ds = filename.split("--")[1].split("-")[0] if adapted else "i21k"
  model = models.create_model(augreg.registry_name(filename.split("-")[0]),
                              num_classes=CLASSES[ds], **AUGREG_TINY)
  size = augreg.image_size(filename)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]
  rng = np.random.default_rng(len(filename))
  params = jax.tree.map(lambda s: rng.normal(0, 0.02, s.shape).astype(np.float32), shapes)
  npz.save_npz(str(path / f"{filename}.npz"), params)
