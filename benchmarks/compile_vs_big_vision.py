r"""vit_jax's pre-training train step beside big_vision's, compiled for Cloud TPU slices
without a TPU (libtpu's compile-only devices; nothing runs): per-chip HBM, temporaries, the
bytes and FLOPs XLA counts, the analytic FLOPs and the roofline bound, for the same model,
batch (4096, ImageNet-21k's 21,843 sigmoid outputs) and precision. A markdown table on stdout.

    PYTHONPATH=. python benchmarks/compile_vs_big_vision.py --big_vision DIR \
        [--models b16,l16] [--slices v4-32,v5litepod-16] [--bv_pool tok] [--rows FILE]

DIR is a checkout of google-research/big_vision (not a dependency: its modules are imported
from DIR; they need tensorflow, einops and absl). Per model and slice, three rows:
  - big_vision bf16 and float32 (dtype_mm): big_vision.models.vit with token pooling and a
    tanh pre-logits layer of the model's width (--bv_pool gap: the mean of the patches, as
    configs/vit_i21k.py), big_vision.optax.make with vit_i21k.py's optimizer (scale_by_adam,
    bfloat16 first moment, global-norm clip 1), and train.py's update_fn (sigmoid_xent,
    l2 measurements); parameters and optimizer state replicated, the batch split over a 1-D
    'data' mesh. Without the mixup vit_i21k.py adds (p=0.2 for B/16, 0.5 for L/16), and
    with its head and pre-logits computed in float32 whatever dtype_mm is (big_vision's own).
  - vit_jax: `pretrain:MODEL,i21k` as compile_check compiles it (--vit_jax_overrides k=v,...);
    its compile time counts its evaluation step's too.
Each side takes its own input: big_vision float32 multi-hot labels (batch, 21843), vit_jax
int32 class indices (batch,). A step that does not fit the chip's HBM is a row too.

With --rows, each row is appended to FILE (one JSON object a line) as soon as it is compiled,
rows already there are not compiled again, and the table shows every row of the file.
"""
import argparse
import ast
import dataclasses
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiles only.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import optax  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from vit_jax import configs  # noqa: E402
from vit_jax.train import compile_check, run_setup  # noqa: E402
from vit_jax.train.tpu_specs import GiB  # noqa: E402

CLASSES = compile_check.KNOWN_CLASSES["imagenet21k"]
BATCH, IMAGE = 4096, 224
VARIANTS = {"b16": "B/16", "l16": "L/16"}
# The schedule's length (a constant in the step): 90 epochs of ImageNet-21k less the
# config's held-out 102,400 images.
TRAIN_IMAGES = 14_197_122 - 102_400


def big_vision_step(variant: str, dtype_mm: str, pool: str, mesh: Mesh) -> jax.stages.Lowered:
  """big_vision/train.py's update_fn for big_vision's ViT, lowered from abstract shapes."""
  import flax.linen as nn
  from big_vision import optax as bv_optax, utils as bv_utils
  from big_vision.models import vit
  model = vit.Model(num_classes=CLASSES, variant=variant, dtype_mm=dtype_mm, pool_type=pool,
                    rep_size=True, posemb="learn", head_zeroinit=True)
  config = ml_collections.ConfigDict(dict(
      optax_name="scale_by_adam", optax=dict(mu_dtype="bfloat16"), grad_clip_norm=1.0,
      lr=0.001, wd=0.0001, schedule=dict(warmup_steps=10_000, decay_type="linear")))
  params = jax.eval_shape(lambda rng: model.init(rng, jnp.zeros((1, IMAGE, IMAGE, 3)))["params"],
                          jax.random.PRNGKey(0))
  tx, _ = bv_optax.make(config, params, sched_kw=dict(
      total_steps=90 * TRAIN_IMAGES // BATCH, batch_size=BATCH, data_size=TRAIN_IMAGES))

  def update_fn(train_state, rng, batch):
    images, labels = batch["image"], batch["labels"]
    rng = jax.random.fold_in(rng, bv_optax.get_count(train_state["opt"], jittable=True))
    rng, rng_model = jax.random.split(rng, 2)

    def loss_fn(params):
      logits, _ = model.apply({"params": params}, images, train=True,
                              rngs={"dropout": rng_model})
      return bv_utils.sigmoid_xent(logits=logits, labels=labels)

    params, opt = train_state["params"], train_state["opt"]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    l2 = lambda tree: jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree)))
    measurements = dict(training_loss=loss, l2_params=l2(params), l2_updates=l2(updates),
                        l2_grads=l2(bv_optax.replace_frozen(config.schedule, grads, 0.)))
    return {"params": params, "opt": opt}, measurements

  repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  abstract = lambda tree, sharding: jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)
  state = abstract({"params": params, "opt": jax.eval_shape(tx.init, params)}, repl)
  batch = {"image": jax.ShapeDtypeStruct((BATCH, IMAGE, IMAGE, 3), jnp.float32, sharding=data),
           "labels": jax.ShapeDtypeStruct((BATCH, CLASSES), jnp.float32, sharding=data)}
  rng = abstract(jax.eval_shape(lambda: jax.random.PRNGKey(0)), repl)
  step = jax.jit(update_fn, donate_argnums=(0,), out_shardings=(
      jax.tree.map(lambda s: s.sharding, state), repl))
  # train.py's `with mesh` no longer sets the mesh flax reads its logical constraints against.
  with jax.set_mesh(mesh), nn.logical_axis_rules([("act_batch", "data")]):
    return step.lower(state, rng, batch)


def per_device(stats: compile_check.StepStats, topology: compile_check.Topology
               ) -> tuple[int, dict[str, Any]]:
  """How far a step exceeds a device's HBM, and its roofline: both against one device's
  figures (a TPU7x chip is two devices, each with half its HBM, FLOP/s and bandwidth), as
  --compile_only reports them."""
  device = topology.device
  return (stats.total_bytes - device.hbm_bytes,
          compile_check.roofline(stats, device, BATCH))


def row(model: str, slice_name: str, side: str, args: argparse.Namespace) -> dict[str, Any]:
  topology = compile_check.resolve_topology(slice_name)
  c = configs.get_config(f"pretrain:{model},i21k")
  overrides = {} if side.startswith("big_vision") else _overrides(args.vit_jax_overrides)
  if side.startswith("big_vision") and args.bv_pool == "gap":
    overrides = {"model.classifier": "gap"}  # For the analytic count only.
  cfg = compile_check.with_overrides(c, overrides)
  forward = compile_check.forward_flops(run_setup.build_model(cfg, CLASSES), IMAGE)
  out = dict(model=model, slice=slice_name, side=side, chips=topology.chips,
             analytic_flops=3 * forward * BATCH / topology.chips, train=None, over_bytes=0)
  t0 = time.time()
  if side.startswith("big_vision"):
    devices = mesh_utils.create_device_mesh((len(topology.devices),), topology.devices)
    try:
      stats = compile_check.step_stats(big_vision_step(
          VARIANTS[model], "bfloat16" if "bf16" in side else "float32", args.bv_pool,
          Mesh(devices, ("data",))).compile())
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      stats, out["over_bytes"] = None, compile_check._over_bytes_of(str(e))
  else:
    a = compile_check.attempt(c, topology, CLASSES, overrides)
    stats, out["over_bytes"], out["attention"] = a.train, max(a.over_bytes, 0), a.attention
  if stats is not None:
    over, out["roofline"] = per_device(stats, topology)
    out["over_bytes"] = max(out["over_bytes"], over)
    out["train"] = dataclasses.asdict(stats) | dict(total_bytes=stats.total_bytes,
                                                    total_flops=stats.total_flops)
  out["compile_s"] = time.time() - t0
  return out


def _overrides(text: str) -> dict[str, Any]:
  def value(v: str) -> Any:
    try:
      return ast.literal_eval(v)
    except (ValueError, SyntaxError):
      return v
  return {k: value(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv)}


def sides(args: argparse.Namespace) -> list[str]:
  vit_jax = " ".join(["vit_jax"] + args.vit_jax_overrides.split(",")).strip()
  return [f"big_vision bf16 ({args.bv_pool})", f"big_vision f32 ({args.bv_pool})", vit_jax]


HEADER = ["model", "slice", "step", "HBM/chip GiB", "temporaries GiB", "XLA GB accessed/chip",
          "TFLOP/chip (XLA + kernels)", "analytic TFLOP/chip", "ratio", "roofline ms (bound)",
          "HBM vs bv bf16", "accessed vs bv bf16", "compile s"]


def _cells(r: dict[str, Any], ref: dict[str, Any] | None) -> list[str]:
  side = r["side"] + (f" [attention: {r['attention']}]" if r.get("attention") else "")
  head, t = [r["model"], r["slice"], side], r["train"]
  if t is None:
    over = f"does not fit (over by {r['over_bytes'] / GiB:.2f} GiB)"
    return head + [over] + ["-"] * 8 + [f"{r['compile_s']:.0f}"]
  ratio = lambda k: f"{t[k] / ref['train'][k]:.2f}x" if ref and ref["train"] else "-"
  fits = " (does not fit)" if r["over_bytes"] > 0 else ""
  return head + [f"{t['total_bytes'] / GiB:.2f}{fits}", f"{t['temp_bytes'] / GiB:.2f}",
                 f"{t['bytes_accessed'] / 1e9:.0f}", f"{t.get('total_flops', t['flops']) / 1e12:.2f}",
                 f"{r['analytic_flops'] / 1e12:.2f}", f"{t.get('total_flops', t['flops']) / r['analytic_flops']:.2f}",
                 f"{r['roofline']['step_s'] * 1e3:.0f} ({r['roofline']['bound']})",
                 ratio("total_bytes"), ratio("bytes_accessed"), f"{r['compile_s']:.0f}"]


def table(rows: list[dict[str, Any]], bv_pool: str) -> str:
  """Rows by model and slice; the ratios are to that model and slice's big_vision bf16 row."""
  ref = f"big_vision bf16 ({bv_pool})"
  refs = {(r["model"], r["slice"]): r for r in rows if r["side"] == ref}
  lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
  for r in sorted(rows, key=lambda r: (r["model"], r["slice"])):
    lines.append("| " + " | ".join(_cells(r, refs.get((r["model"], r["slice"])))) + " |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--big_vision", required=True, help="a checkout of google-research/big_vision")
  p.add_argument("--models", default="b16,l16")
  p.add_argument("--slices", default="v4-32,v5litepod-16")
  p.add_argument("--bv_pool", default="tok", choices=("tok", "gap"))
  p.add_argument("--vit_jax_overrides", default="", help="config fields: k=v,...")
  p.add_argument("--rows", help="a JSON-lines file of rows: appended to, and read back")
  p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
  args = p.parse_args()
  if not os.path.isfile(os.path.join(args.big_vision, "big_vision", "models", "vit.py")):
    p.error(f"--big_vision {args.big_vision}: no big_vision/models/vit.py there")
  sys.path.insert(0, os.path.abspath(args.big_vision))
  rows = []
  if args.rows and os.path.exists(args.rows):
    with open(args.rows) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  done = {(r["model"], r["slice"], r["side"]) for r in rows}
  for model in args.models.split(","):
    for slice_name in args.slices.split(","):
      for side in sides(args):
        if (model, slice_name, side) in done:
          continue
        print(f"compiling {model} {slice_name} {side}...", file=sys.stderr, flush=True)
        rows.append(row(model, slice_name, side, args))
        r = rows[-1]
        print(f"  {r['compile_s']:.0f} s: " + (f"{r['train']['total_bytes'] / GiB:.2f} GiB/chip"
              if r["train"] else "does not fit"), file=sys.stderr, flush=True)
        if args.rows:
          with open(args.rows, "a") as f:
            f.write(json.dumps(r) + "\n")
  print(json.dumps(rows, indent=1) if args.json else table(rows, args.bv_pool))


if __name__ == "__main__":
  main()
