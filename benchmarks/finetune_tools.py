"""Fine-tuning one checkpoint plainly and with each of config.optimizer's and config's tools,
side by side: test accuracy, trainable parameters, peak memory (max RSS) and wall time.

  python benchmarks/finetune_tools.py /tmp/vit_quickstart --out_dir /tmp/ft_tools

The data: the tests' 1,797 real 8x8 handwritten digits (tests/data) as an image folder (1,500
train, 297 test), resized to the checkpoint's resolution by the input pipeline. Each variant is
one `vit-train` run with the finetune config, the checkpoint's architecture and the same steps
and seed.
"""
import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import helpers  # noqa: E402  (tests/helpers.py: the digits)

VARIANTS = {
    "plain": [],
    "layer_decay=0.75": ["--config.optimizer.layer_decay=0.75"],
    "ema_decay=0.99": ["--config.ema_decay=0.99"],
    "frozen: all but the last block and head": [
        "--config.optimizer.frozen=('embedding/.*', 'Transformer/posembed_input/.*', "
        "'Transformer/encoderblock_(?!{last}/).*')"],  # {last}: the checkpoint's last block.
    "lora: rank 8 on query, value": ["--config.lora.rank=8", "--config.optimizer.lr=0.05"],
}


def model_flags(described) -> list[str]:
  fields = {k: v for k, v in described.model.items() if v is not None and k in (
      "patch_size", "hidden_size", "mlp_dim", "num_heads", "num_layers", "classifier")}
  return ([f"--config.model.{k}={v}" for k, v in fields.items()]
          + [f"--config.data.image_size={described.image_size}"])


def trainable(workdir: pathlib.Path, flags: list[str]) -> int:
  """The run's parameters that its optimizer updates (the unmerged ones, adapters included)."""
  from vit_jax.checkpoint import run as run_lib
  from vit_jax.models import lora
  from vit_jax.train import optimizers
  frozen = next((ast.literal_eval(f.split("=", 1)[1]) for f in flags
                 if "optimizer.frozen" in f), ())
  trained_only = lora.TRAINED if any("lora.rank" in f for f in flags) else (".*",)
  flat = run_lib.read_params(run_lib.latest_step_dir(workdir))[0]
  return sum(v.size for k, v in flat.items() if optimizers.first_match(frozen, k) is None
             and optimizers.first_match(trained_only, k) is not None)


def train_variant(variant: str, flags: list[str], args, data: str, described) -> dict:
  last = described.model["num_layers"] - 1
  flags = [f.replace("{last}", str(last)) for f in flags]
  workdir = pathlib.Path(args.out_dir) / variant.split(":")[0].replace("=", "_")
  command = [sys.executable, "-m", "vit_jax.tools.train", "--config", "finetune:ti16," + data,
             "--workdir", str(workdir), f"--config.pretrained={args.pretrained}",
             *model_flags(described), "--config.data.train_crop=resize",
             "--config.data.flip=False", "--config.batch_size=128",
             f"--config.total_steps={args.steps}", "--config.warmup_steps=20",
             "--config.optimizer.lr=0.01", "--config.cpu_devices=1", *flags]
  t0 = time.time()
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  if status:
    raise SystemExit(f"{variant}: exit status {status}\n{out[-2000:]}")
  line = out.split("Final evaluation: ")[1].splitlines()[0]
  final = dict(kv.split("=") for kv in line.split(", "))
  return {"variant": variant, "accuracy": float(final["accuracy"]),
          "ema_accuracy": float(final["ema_accuracy"]) if "ema_accuracy" in final else None,
          "trainable_params": trainable(workdir, flags),
          "peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": time.time() - t0}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("pretrained", help="a checkpoint: run workdir, step dir, .npz")
  p.add_argument("--out_dir", default="/tmp/ft_tools")
  p.add_argument("--steps", type=int, default=300)
  args = p.parse_args(argv)
  from vit_jax import cpu_backend
  cpu_backend.skip_absent_tpu()  # As the commands: no TPU probed where there is none.
  from vit_jax.checkpoint import loader
  described = loader.describe(args.pretrained)
  data = helpers.write_digits_folder(pathlib.Path(args.out_dir) / "digits")
  rows = [train_variant(v, f, args, data, described) for v, f in VARIANTS.items()]
  plain = rows[0]
  print(f"{'variant':44s} {'accuracy':>8s} {'ema acc':>8s} {'trainable':>10s} "
        f"{'peak RSS MiB':>12s} {'x plain':>7s} {'wall s':>7s}")
  for r in rows:
    ema = f"{r['ema_accuracy']:.4f}" if r["ema_accuracy"] is not None else "-"
    print(f"{r['variant']:44s} {r['accuracy']:8.4f} {ema:>8s} {r['trainable_params']:10,d} "
          f"{r['peak_rss_mib']:12.0f} {r['peak_rss_mib'] / plain['peak_rss_mib']:7.2f} "
          f"{r['wall_s']:7.0f}")
  (pathlib.Path(args.out_dir) / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
