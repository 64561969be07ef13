r"""Training and inference images/s of vit_jax against timm, on one device.

    python benchmarks/throughput.py --model ViT-B_16 --batch_size 256 --dtype bfloat16 \
        [--attention_impl auto] [--remat] [--timm both|eager|compile|off] [--json_out FILE]

vit_jax: the project's own train step (`trainer.init_state` + `make_train_step`,
AdamW with clipping from `optimizers.make_optimizer`) and `jit(model.apply)`.
timm: the same model through vit_jax/models/timm_models.py, eager and torch.compile,
bf16 autocast, fused AdamW with the same clipping. Synthetic data is put on the
device once; each figure is the median over repeats of `steps` timed steps after
`warmup` steps, synchronised at both ends. MFU counts 3x (training) or 1x
(inference) the forward FLOPs, computed analytically from the config (matmuls
and attention, 2 FLOPs per multiply-add; for hybrids, XLA's cost analysis of the
lowered forward pass).
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

# timm runs first in the same process: JAX must not grab 75% of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vit_jax import cpu_backend, models  # noqa: E402
from vit_jax.models import timm_models  # noqa: E402
from vit_jax.models import attention  # noqa: E402
from vit_jax.train import optimizers, sharding, trainer  # noqa: E402

cpu_backend.skip_absent_tpu()  # As the commands: no TPU probed where there is none.

# Dense tensor-core TFLOP/s (datasheet) by device-kind substring: bf16, and f32 (which JAX
# runs as TF32 on these GPUs by default).
PEAK_TFLOPS = {"H100 PCIe": (756.0, 378.0), "H100": (989.0, 494.5), "H200": (989.0, 494.5),
               "A100": (312.0, 156.0)}
RESULT_KEYS = ("framework", "phase", "img_per_s", "step_ms", "mfu", "peak_memory_gb",
               "ratio_to_timm_compile")


def forward_flops(cfg: dict[str, Any], image_size: int, num_classes: int) -> Optional[float]:
  """Forward FLOPs per image of a plain ViT (None for hybrids): matmuls + attention."""
  if cfg.get("resnet_layers") is not None:
    return None
  p, d, m, layers = cfg["patch_size"], cfg["hidden_size"], cfg["mlp_dim"], cfg["num_layers"]
  n = (image_size // p)**2
  classifier = cfg.get("classifier", "token")
  t = n + (classifier == "token")
  per_mac = 2
  flops = per_mac * n * p * p * 3 * d  # Patch embedding.
  # q, k, v, out projections; MLP; QK^T and AV.
  flops += layers * per_mac * (4 * t * d * d + 2 * t * d * m + 2 * t * t * d)
  if classifier == "map":
    flops += per_mac * (2 * d * d + 2 * t * d * d + 2 * t * d + 2 * d * m)
  width = cfg.get("representation_size") or d
  if cfg.get("representation_size"):
    flops += per_mac * d * width
  return float(flops + per_mac * width * num_classes)


def default_peak_tflops(device_kind: str, dtype: str) -> Optional[float]:
  for key, (bf16, f32) in PEAK_TFLOPS.items():
    if key in device_kind:
      return bf16 if dtype == "bfloat16" else f32
  return None


def _median_step_s(do_steps: Callable[[int], None], warmup: int, steps: int,
                   repeats: int) -> float:
  """`do_steps(n)` does n steps and returns once the device is done."""
  do_steps(warmup)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    do_steps(steps)
    times.append((time.perf_counter() - start) / steps)
  return statistics.median(times)


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _gb(nbytes: Optional[float]) -> Optional[float]:
  return None if nbytes is None else round(nbytes / 2**30, 3)


def _jax_peak_bytes() -> Optional[int]:
  stats = jax.devices()[0].memory_stats()  # None on CPU.
  return stats.get("peak_bytes_in_use") if stats else None


def _xla_estimate_bytes(compiled) -> Optional[int]:
  try:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
  except Exception:  # Not every backend reports it.
    return None


def _xla_flops(lowered) -> Optional[float]:
  """FLOPs of the whole (unpartitioned) program, before XLA hands dots to cuBLAS/cuDNN,
  after which the compiled program's count leaves them out."""
  try:
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:
    return None


def bench_vit_jax(args: argparse.Namespace, model: models.VisionTransformer) -> dict[str, Any]:
  """Inference first (its peak memory), then training, as the project runs them."""
  devices = jax.devices()[:args.devices]
  mesh = jax.make_mesh((len(devices) // args.fsdp, args.fsdp), ("data", "fsdp"), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch_sharding = sharding.batch_sharding(mesh)
  shape = (args.image_size, args.image_size, 3)
  rng = np.random.default_rng(0)
  batch = {
      "image": jax.device_put(rng.standard_normal((args.batch_size,) + shape, np.float32),
                              batch_sharding),
      "label": jax.device_put(rng.integers(0, args.num_classes, args.batch_size, np.int32),
                              batch_sharding)}
  out: dict[str, Any] = {"phases": {}}

  _log("vit_jax: init, compile inference")
  params = jax.jit(model.init)(jax.random.key(0), batch["image"][:1])["params"]
  start = time.perf_counter()
  lowered = jax.jit(lambda p, x: model.apply({"params": p}, x)).lower(params, batch["image"])
  infer = lowered.compile()
  compile_s = time.perf_counter() - start
  xla_flops = _xla_flops(lowered)
  out["xla_forward_gflops"] = None if xla_flops is None else xla_flops / args.batch_size / 1e9

  def infer_steps(n):
    for _ in range(n):
      logits = infer(params, batch["image"])
    jax.block_until_ready(logits)

  step_s = _median_step_s(infer_steps, args.warmup, args.steps, args.repeats)
  out["phases"]["infer"] = dict(step_s=step_s, compile_s=compile_s, peak_bytes=_jax_peak_bytes(),
                                xla_estimate_bytes=_xla_estimate_bytes(infer))
  del infer

  # Handed over in a list that the callee empties: no reference to the initial params stays
  # alive here while training is measured.
  handed, params = [params], None
  train = _bench_vit_jax_train(args, model, mesh, batch, handed)
  out["phases"]["train"] = train.pop("phase")
  return out | train


def _bench_vit_jax_train(args: argparse.Namespace, model: models.VisionTransformer,
                         mesh: jax.sharding.Mesh, batch: dict[str, jax.Array],
                         handed: list[Any]) -> dict[str, Any]:
  """The project's train step, from the params in `handed` (taken out of it): the phase's
  compile time, step time and memory, the final loss, whether cuDNN attention is used."""
  shape = (args.image_size, args.image_size, 3)
  params, out = handed.pop(), {}
  opt_cfg = optimizers.default_config()
  opt_cfg.mu_dtype = args.mu_dtype
  tx, _ = optimizers.make_optimizer(opt_cfg, total_steps=10_000, warmup_steps=100)
  _log("vit_jax: init state, compile train step")
  state, shardings = trainer.init_state(model, tx, mesh, shape, jax.random.key(0), params=params)
  del params
  step = trainer.make_train_step(model, tx, "softmax_xent", shardings, mesh, jax.random.key(1))
  start = time.perf_counter()
  step = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  _log(f"vit_jax: compiled in {compile_s:.0f}s, timing")
  hlo = step.as_text()
  out["cudnn_attention_in_hlo"] = "__cudnn$fmha" in hlo
  holder = {"state": state, "metrics": None}
  del state

  def train_steps(n):
    for _ in range(n):
      holder["state"], holder["metrics"] = step(holder["state"], batch)
    jax.block_until_ready(holder["state"])

  step_s = _median_step_s(train_steps, args.warmup, args.steps, args.repeats)
  if args.profile_dir:
    with jax.profiler.trace(args.profile_dir, create_perfetto_trace=True):
      train_steps(3)
  loss = float(holder["metrics"]["loss"])
  if not np.isfinite(loss):
    raise FloatingPointError(f"vit_jax training loss is {loss}")
  out["final_loss"] = loss
  out["phase"] = dict(step_s=step_s, compile_s=compile_s, peak_bytes=_jax_peak_bytes(),
                      xla_estimate_bytes=_xla_estimate_bytes(step))
  return out


def _has_timm() -> bool:
  try:
    timm_models.import_torch()
  except ImportError:
    return False
  return True


def _bench_timm_mode(args: argparse.Namespace, name: str, mode: str) -> dict[str, Any]:
  """One mode's inference then training phases, on a fresh model."""
  torch, _ = timm_models.import_torch()
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  torch.manual_seed(0)
  depth = {} if args.num_layers is None else {"depth": args.num_layers}
  model = timm_models.create(name, img_size=args.image_size, num_classes=args.num_classes,
                             **depth).to(dev)
  fwd = torch.compile(model) if mode == "compile" else model
  x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=dev)
  y = torch.randint(0, args.num_classes, (args.batch_size,), device=dev)
  autocast = lambda: torch.autocast(dev, dtype=torch.bfloat16,  # noqa: E731
                                    enabled=args.dtype == "bfloat16")

  def infer_steps(n):
    with torch.inference_mode(), autocast():
      for _ in range(n):
        fwd(x)
    sync()

  def measure(do_steps):
    if dev == "cuda":
      torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    do_steps(1)
    phase = dict(compile_s=time.perf_counter() - start)
    phase["step_s"] = _median_step_s(do_steps, args.warmup, args.steps, args.repeats)
    phase["peak_bytes"] = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    return phase

  model.eval()
  phases = {"infer": measure(infer_steps)}
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=dev == "cuda")

  def train_steps(n):
    for _ in range(n):
      with autocast():
        loss = torch.nn.functional.cross_entropy(fwd(x).float(), y)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
      opt.zero_grad(set_to_none=True)
    sync()

  phases["train"] = measure(train_steps)
  return phases


def bench_timm(args: argparse.Namespace, name: str, modes: Sequence[str]) -> dict[str, Any]:
  """timm eager and/or torch.compile, inference then training (fresh model per mode)."""
  torch, _ = timm_models.import_torch()
  out = {}
  for mode in modes:
    _log(f"timm {mode}")
    out[mode] = _bench_timm_mode(args, name, mode)
    if torch.cuda.is_available():
      torch.cuda.empty_cache()
  return out


def _versions() -> dict[str, str]:
  import importlib.metadata as md  # pylint: disable=g-import-not-at-top
  found = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "flax", "optax", "torch", "timm"):
    try:
      found[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      pass
  return found


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per (framework, phase), with img/s, MFU, memory and the ratio to timm+compile."""
  batch, peak = report["batch_size"], report["peak_tflops"]
  flops = report["forward_flops_per_image"]
  by_framework = {"vit_jax": report["vit_jax"].get("phases", {})}
  by_framework.update({f"timm_{m}": ph for m, ph in report.get("timm", {}).items()})
  rows = []
  for framework, phases in by_framework.items():
    for phase, r in phases.items():
      img_s = batch / r["step_s"]
      mfu = (img_s * flops * (3 if phase == "train" else 1) / (peak * 1e12)
             if flops and peak else None)
      ref = by_framework.get("timm_compile", {}).get(phase)
      ratio = img_s * ref["step_s"] / batch if ref else None
      rows.append(dict(framework=framework, phase=phase, img_per_s=round(img_s, 1),
                       step_ms=round(r["step_s"] * 1e3, 3),
                       mfu=None if mfu is None else round(mfu, 4),
                       peak_memory_gb=_gb(r.get("peak_bytes")),
                       xla_memory_estimate_gb=_gb(r.get("xla_estimate_bytes")),
                       compile_s=round(r["compile_s"], 1),
                       ratio_to_timm_compile=None if ratio is None else round(ratio, 3)))
  return rows


def _table(rows: list[dict[str, Any]]) -> str:
  fmt = lambda v, spec, scale=1: "n/a" if v is None else format(v * scale, spec)  # noqa: E731
  lines = [f"{'framework':<14}{'phase':<7}{'img/s':>10}{'ms/step':>10}{'vs timm+compile':>17}"
           f"{'MFU':>8}{'peak GiB':>10}"]
  for r in rows:
    lines.append(f"{r['framework']:<14}{r['phase']:<7}{fmt(r['img_per_s'], ',.0f'):>10}"
                 f"{fmt(r['step_ms'], '.1f'):>10}{fmt(r['ratio_to_timm_compile'], '.2f'):>17}"
                 f"{fmt(r['mfu'], '.1f', 100):>8}{fmt(r['peak_memory_gb'], '.2f'):>10}")
  return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="ViT-B_16", help="registry name (or short form, e.g. b16)")
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--image_size", type=int, default=224)
  p.add_argument("--num_classes", type=int, default=1000)
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  p.add_argument("--attention_impl", choices=[i for i in attention.IMPLS if i], default="auto",
                 help="model.attention_impl (models/attention.py)")
  p.add_argument("--num_layers", type=int, default=None,
                 help="override the model's depth (both frameworks), for quick runs")
  p.add_argument("--remat", action="store_true", help="rematerialise each encoder block")
  p.add_argument("--devices", type=int, default=1,
                 help="vit_jax devices (timm uses one); MFU counts the peak of all of them")
  p.add_argument("--fsdp", type=int, default=1, help="fsdp axis of the (data, fsdp) mesh")
  p.add_argument("--mu_dtype", choices=("bfloat16", "float32"), default=None,
                 help="Adam first-moment dtype (default: the parameters')")
  p.add_argument("--timm", choices=("both", "eager", "compile", "off"), default="both")
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="device peak for MFU; default from the device kind (H100 989 bf16), else n/a")
  p.add_argument("--json_out", default=None)
  p.add_argument("--profile_dir", default=None, help="trace 3 vit_jax train steps (perfetto) here")
  return p.parse_args(argv)


def _timm_report(args: argparse.Namespace, name: str) -> dict[str, Any]:
  """{"timm": figures} or {"timm_skipped": why}; {} with --timm off."""
  modes = {"both": ("eager", "compile"), "off": ()}.get(args.timm, (args.timm,))
  if not modes:
    return {}
  if not _has_timm():
    return {"timm_skipped": "torch/timm not installed"}
  if name not in timm_models.TIMM_NAMES:
    return {"timm_skipped": f"no timm mapping for {name}"}
  try:
    return {"timm": bench_timm(args, name, modes)}
  except Exception as e:  # pylint: disable=broad-except
    return {"timm_skipped": f"{type(e).__name__}: {e}"[:2000]}


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
  flops = report["forward_flops_per_image"]
  print(f"{report['model']} {args.image_size}px batch {args.batch_size} {args.dtype}, "
        f"remat={args.remat}, attention {args.attention_impl} -> "
        f"{report['attention_impl_resolved']} (cuDNN fMHA in train HLO: "
        f"{report['vit_jax'].get('cudnn_attention_in_hlo')}), on {report['device']}")
  gflops = f"{flops / 1e9:.2f}" if flops else "n/a"
  print(f"forward {gflops} GFLOP/img ({report['flops_source']}), "
        f"peak {report['peak_tflops'] or 'n/a'} TFLOP/s; {report['versions']}")
  print(_table(report["results"]))
  if "error" in report["vit_jax"]:
    print("vit_jax failed:", report["vit_jax"]["error"])
  if "timm_skipped" in report:
    print("timm skipped:", report["timm_skipped"])


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.devices > jax.device_count() or args.devices % args.fsdp:
    raise ValueError(f"--devices {args.devices} must be <= {jax.device_count()} (found) and a "
                     f"multiple of --fsdp {args.fsdp}.")
  name = models.resolve_name(args.model)
  dtype = jnp.dtype(args.dtype)
  impl = args.attention_impl
  overrides = dict(remat=args.remat, attention_impl=impl)
  if args.num_layers is not None:
    overrides["num_layers"] = args.num_layers
  model = models.create_model(name, num_classes=args.num_classes, dtype=dtype, **overrides)
  flops = forward_flops(models.model_config(name, **overrides), args.image_size, args.num_classes)
  report: dict[str, Any] = dict(
      model=name, num_layers=model.num_layers, batch_size=args.batch_size,
      image_size=args.image_size, dtype=args.dtype, remat=args.remat, devices=args.devices,
      fsdp=args.fsdp,
      attention_impl=args.attention_impl, versions=_versions(),
      command=" ".join(["python", "benchmarks/throughput.py", *(argv or sys.argv[1:])]))

  report |= _timm_report(args, name)  # Before JAX touches the GPU.

  device = jax.devices()[0]
  report["device"] = f"{device.platform}: {device.device_kind} (x{args.devices})"
  head_dim = model.hidden_size // model.num_heads
  report["attention_impl_resolved"] = attention.resolve(impl, dtype, head_dim)
  try:
    report["vit_jax"] = bench_vit_jax(args, model)
  except Exception as e:  # pylint: disable=broad-except  # E.g. out of memory: keep timm's figures.
    report["vit_jax"] = {"error": f"{type(e).__name__}: {e}"[:4000]}
  report["flops_source"] = "analytic from the config (matmuls + attention, 2 per MAC)"
  if flops is None:
    xla_gflops = report["vit_jax"].get("xla_forward_gflops")
    flops = xla_gflops and xla_gflops * 1e9
    report["flops_source"] = "XLA cost analysis of the lowered jit(model.apply)" if flops else "n/a"
  report["forward_flops_per_image"] = flops
  peak = args.peak_tflops or (
      default_peak_tflops(device.device_kind, args.dtype) if device.platform == "gpu" else None)
  report["peak_tflops"] = peak and peak * args.devices
  report["results"] = _rows(report)

  _print_report(report, args)
  if args.json_out:
    pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
  return report


if __name__ == "__main__":
  sys.exit(1 if "error" in main()["vit_jax"] else 0)
