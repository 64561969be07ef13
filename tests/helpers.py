"""Helpers shared by the test modules (fixtures live in conftest.py).

TensorFlow and the notebook client are imported where used: importing TensorFlow before
torch (timm's cross-checks) crashes the process, so this module stays light.
"""
import glob
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# checkpoint.POSEMB_KEY, without importing vit_jax here.
POSEMB_KEY = "Transformer/posembed_input/pos_embedding"
TINY_CONFIG = str(REPO / "tests" / "tiny_config.py")
# A ViT small enough for unit tests on CPU: model fields over any registry name's.
TINY_VIT = dict(patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


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


def cpu_env(devices: int = 1) -> dict[str, str]:
  """The environment of a subprocess on `devices` CPU devices; it sizes XLA's pool itself."""
  env = {k: v for k, v in os.environ.items() if k != "NPROC"}
  return env | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                "JAX_PLATFORMS": "cpu"}


def run_cli(args, devices: int = 1, cwd=REPO, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(args, env=cpu_env(devices), cwd=cwd, capture_output=True, text=True,
                        timeout=600, **kw)


def run_notebook(path, monkeypatch, **params: str):
  """Executes a notebook top to bottom with VIT_* parameters in its environment."""
  import nbformat
  from nbclient import NotebookClient
  for name, value in params.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(REPO)}}).execute()
  return nb


def random_params(model, size: int, seed: int = 0):
  """Init, then perturb every array so that no parameter (head included) is trivial."""
  import jax
  import jax.numpy as jnp
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, size, size, 3)))["params"]
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [np.array(p + 0.02 * jax.random.normal(k, p.shape)) for p, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, leaves)


def new_flax_layout(flat):
  """Original-layout flat arrays renamed as newer Flax code names the block children."""
  names = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
           "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}
  rename = lambda m: m.group(1) + names.get(m.group(2), m.group(2))
  return {re.sub(r"(encoderblock_\d+/)(\w+)", rename, k): v for k, v in flat.items()}


def big_vision_layout(flat, scanned: bool):
  """Original-layout flat arrays as big_vision writes them: `params/` prefix, newer names,
  the position embedding without the class entry, optionally one scanned encoder block."""
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
}


def tiny_serving_checkpoint(path, kind: str, num_classes: int = 10, seed: int = 0) -> str:
  """A tiny model of TINY_SERVING_MODELS with random params (the head too, so that the
  logits differ by image and class), written as a released-layout .npz; returns the path."""
  import jax
  import jax.numpy as jnp
  from vit_jax import checkpoint, models
  name, size, overrides = TINY_SERVING_MODELS[kind]
  model = models.create_model(name, num_classes=num_classes, **overrides)
  params = model.init(jax.random.key(seed), jnp.zeros((1, size, size, 3)), train=False)["params"]
  head = params["head"]["kernel"]
  params["head"] = {"kernel": jax.random.normal(jax.random.key(seed + 1), head.shape) * 0.5,
                    "bias": jax.random.normal(jax.random.key(seed + 2), (num_classes,)) * 0.1}
  checkpoint.save_npz(str(path), params)
  return str(path)
