"""Loading a Hub checkpoint: vit_jax's `loader.load("hf-hub:...")` beside timm's
`create_model(..., pretrained=True)`, both from the same local Hugging Face cache, offline;
with --finetune, the start of a fine-tuning run from it instead.

  python benchmarks/hub_load.py [--models vit_base_patch16_224 vit_large_patch14_dinov2.lvd142m]
  python benchmarks/hub_load.py --finetune --models vit_large_patch16_224 [--tree CHECKOUT]

Writes each timm model (random weights) once into a Hub cache in huggingface_hub's own layout
(`models--timm--NAME/snapshots/REV`, `refs/main`), then loads it in fresh processes, each
measuring its own wall time (from before the first import of the loading library to usable
params) and its peak RSS, `--repeats` times; prints the medians side by side.

--finetune: `vit-train --config finetune:l16,fashion_mnist --config.pretrained=hf-hub:timm/NAME`
(32 px, batch 4, Fashion-MNIST from Debian's files, which TFDS's builder prepares once) in a
fresh process: seconds from its start to its first step's line, its CPU seconds and peak RSS
(VmHWM) then;
the run is killed there. --tree runs another checkout's vit_jax (e.g. a `git worktree` of an
older commit) in this venv, for a before/after.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

COMMIT = "0" * 40

# Run in a child process: times the load, prints {"seconds", "peak_rss_mb"} as JSON.
_CHILD = {
    "vit_jax": """
import time; t0 = time.perf_counter()
import jax
from vit_jax.checkpoint import loader
loaded = loader.load("hf-hub:timm/{name}")
jax.block_until_ready(loaded.params)
seconds = time.perf_counter() - t0
""",
    "timm": """
import time; t0 = time.perf_counter()
import timm
model = timm.create_model("{name}", pretrained=True,
                          pretrained_cfg_overlay=dict(hf_hub_id="timm/{name}"))
seconds = time.perf_counter() - t0
""",
}
_REPORT = """
import json, resource
print(json.dumps({"seconds": seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_cache(cache: str, name: str) -> None:
  """timm's `name` with random weights, saved as timm pushes to the Hub, into the cache."""
  import timm
  from timm.models import _hub
  snapshot = os.path.join(cache, f"models--timm--{name}", "snapshots", COMMIT)
  if os.path.isdir(snapshot):
    return
  folder = tempfile.mkdtemp()
  _hub.save_for_hf(timm.create_model(name, pretrained=False), folder, safe_serialization=True)
  os.makedirs(os.path.join(cache, f"models--timm--{name}", "refs"))
  with open(os.path.join(cache, f"models--timm--{name}", "refs", "main"), "w") as f:
    f.write(COMMIT)
  shutil.copytree(folder, snapshot)
  shutil.rmtree(folder)


def measure(loader: str, name: str, cache: str) -> dict[str, float]:
  env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="2")
  code = _CHILD[loader].format(name=name) + _REPORT
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


# The registry name vit-train's finetune config takes for each timm model it is run with.
_FINETUNE_MODELS = {"vit_base_patch16_224": "b16", "vit_large_patch16_224": "l16"}
_FIRST_STEP = re.compile(r"^step 1/")


def _peak_rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _cpu_seconds(pid: int) -> float:
  """The process's CPU time so far, all its threads (user + system): steadier than wall time
  on a shared machine."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_finetune(name: str, cache: str, data_dir: str, tree: str) -> dict[str, float]:
  """Seconds from `vit-train`'s start to its first step's line, and its peak RSS then."""
  workdir = tempfile.mkdtemp(prefix="hub_finetune_")
  shutil.rmtree(workdir)
  args = [sys.executable, "-m", "vit_jax.tools.train",
          f"--config=finetune:{_FINETUNE_MODELS[name]},fashion_mnist", f"--workdir={workdir}",
          f"--config.pretrained=hf-hub:timm/{name}", f"--config.data.data_dir={data_dir}",
          "--config.data.image_size=32", "--config.batch_size=4", "--config.total_steps=2",
          "--config.warmup_steps=1", "--config.log_every_steps=1",
          "--config.data.train_split=train[:256]", "--config.data.eval_split=test[:64]",
          "--config.data.train_crop=resize", "--config.data.flip=False"]
  env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.path.abspath(tree))
  t0 = time.perf_counter()
  child = subprocess.Popen(args, env=env, cwd=tree, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    for line in child.stdout:
      if _FIRST_STEP.match(line):
        return {"seconds": time.perf_counter() - t0, "cpu_seconds": _cpu_seconds(child.pid),
                "peak_rss_mb": _peak_rss_mb(child.pid)}
    raise RuntimeError(f"vit-train ended (status {child.wait()}) before its first step")
  finally:
    os.killpg(child.pid, signal.SIGKILL)  # Before its last step's save: GBs of ViT-L state.
    child.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def finetune(args: argparse.Namespace, cache: str) -> None:
  for name in args.models:
    write_cache(cache, name)  # timm (torch) before TensorFlow: the other order crashes.
  from vit_jax.data import fashion_mnist
  data_dir = os.path.join(cache, "tfds")
  fashion_mnist.prepare_fashion_mnist(data_dir)
  w = max(24, *map(len, args.models))
  print(f"{'model':{w}} {'tree':24} {'s to step 1':>12} {'CPU s':>8} {'peak RSS MB':>12}")
  for name in args.models:
    runs = [measure_finetune(name, cache, data_dir, args.tree) for _ in range(args.repeats)]
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{name:{w}} {args.tree[-24:]:24} {row['seconds']:12.2f} {row['cpu_seconds']:8.1f} "
          f"{row['peak_rss_mb']:12.0f}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="+", help="timm names (default: ViT-B/16, ViT-L/16, "
                 "DINOv2-L/14, CLIP-L/14; with --finetune the first two)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--cache", default=None, help="Hub cache to write and read (default: a temp dir)")
  p.add_argument("--finetune", action="store_true",
                 help="Time the start of a fine-tuning run (vit-train) instead of a load.")
  p.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 help="With --finetune: the checkout whose vit_jax runs (default: this one).")
  args = p.parse_args()
  args.models = args.models or (list(_FINETUNE_MODELS) if args.finetune else [
      "vit_base_patch16_224", "vit_large_patch16_224", "vit_large_patch14_dinov2.lvd142m",
      "vit_large_patch14_clip_224.openai"])
  unknown = [m for m in args.models if m not in _FINETUNE_MODELS]
  if args.finetune and unknown:
    p.error(f"--finetune times {', '.join(_FINETUNE_MODELS)} (the models whose finetune config "
            f"it knows), not {', '.join(unknown)}")
  with tempfile.TemporaryDirectory(prefix="hub_load_") as temporary:  # GBs: ViT-Ls' weights.
    (finetune if args.finetune else load)(args, args.cache or temporary)


def load(args: argparse.Namespace, cache: str) -> None:
  w = max(24, *map(len, args.models))
  print(f"{'model':{w}} {'loader':8} {'seconds':>8} {'peak RSS MB':>12}")
  for name in args.models:
    write_cache(cache, name)
    rows = {}
    for loader in ("vit_jax", "timm"):
      runs = [measure(loader, name, cache) for _ in range(args.repeats)]
      rows[loader] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
      print(f"{name:{w}} {loader:8} {rows[loader]['seconds']:8.2f} "
            f"{rows[loader]['peak_rss_mb']:12.0f}")
    print(f"{name:{w}} {'ratio':8} {rows['vit_jax']['seconds'] / rows['timm']['seconds']:8.2f} "
          f"{rows['vit_jax']['peak_rss_mb'] / rows['timm']['peak_rss_mb']:12.2f}"
          "   (vit_jax / timm)")


if __name__ == "__main__":
  main()
