"""Loading a Hub checkpoint: vit_jax's `checkpoint.load("hf-hub:...")` beside timm's
`create_model(..., pretrained=True)`, both from the same local Hugging Face cache, offline.

  python benchmarks/hub_load.py [--models vit_base_patch16_224 vit_large_patch14_dinov2.lvd142m]

Writes each timm model (random weights) once into a Hub cache in huggingface_hub's own layout
(`models--timm--NAME/snapshots/REV`, `refs/main`), then loads it in fresh processes, each
measuring its own wall time (from before the first import of the loading library to usable
params) and its peak RSS, `--repeats` times; prints the medians side by side.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

COMMIT = "0" * 40

# Run in a child process: times the load, prints {"seconds", "peak_rss_mb"} as JSON.
_CHILD = {
    "vit_jax": """
import time; t0 = time.perf_counter()
import jax
from vit_jax import checkpoint
loaded = checkpoint.load("hf-hub:timm/{name}")
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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="+", default=[
      "vit_base_patch16_224", "vit_large_patch16_224", "vit_large_patch14_dinov2.lvd142m",
      "vit_large_patch14_clip_224.openai"])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--cache", default=None, help="Hub cache to write and read (default: a temp dir)")
  args = p.parse_args()
  cache = args.cache or tempfile.mkdtemp(prefix="hub_load_")
  print(f"{'model':24} {'loader':8} {'seconds':>8} {'peak RSS MB':>12}")
  for name in args.models:
    write_cache(cache, name)
    rows = {}
    for loader in ("vit_jax", "timm"):
      runs = [measure(loader, name, cache) for _ in range(args.repeats)]
      rows[loader] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
      print(f"{name:24} {loader:8} {rows[loader]['seconds']:8.2f} "
            f"{rows[loader]['peak_rss_mb']:12.0f}")
    print(f"{name:24} {'ratio':8} {rows['vit_jax']['seconds'] / rows['timm']['seconds']:8.2f} "
          f"{rows['vit_jax']['peak_rss_mb'] / rows['timm']['peak_rss_mb']:12.2f}"
          "   (vit_jax / timm)")


if __name__ == "__main__":
  main()
