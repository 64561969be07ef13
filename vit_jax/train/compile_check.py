"""Compiles a run's train and evaluation steps for a TPU slice without one (`vit-train
--compile_only --topology v5e:4x4`): from abstract shapes, on the slice's compile-only
devices (libtpu), with the config's mesh, dtype and batch. Reports per-chip HBM, FLOPs beside
an analytic count, collectives, and a roofline lower bound on step time; and, for a config
that does not fit, the first of a bounded list of changes that does, found by compiling it.
"""
import dataclasses
import math
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections

from vit_jax import models
from vit_jax.checkpoint import description, loader
from vit_jax.models import attention, footprint
from vit_jax.config_errors import ConfigError
from vit_jax.evaluators.classification import ClassificationEvaluator
from vit_jax.train import run_setup, trainer, tpu_specs

# Classes of the datasets the shipped configs name: the compile check reads no data, and the
# head's width is all it needs of the dataset (vit-train --num_classes sets it for others).
KNOWN_CLASSES = {"imagenet21k": 21843, "imagenet2012": 1000, "cifar10": 10, "cifar100": 100,
                 "oxford_iiit_pet": 37, "oxford_flowers102": 102, "fashion_mnist": 10,
                 "mnist": 10, "svhn_cropped": 10}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ATTENTION_PATHS = {"pallas": "Pallas kernels (resident; splash for long sequences), no "
                             "(batch, heads, tokens, tokens) tensor",
                   "splash": "Pallas splash attention, tokens padded to blocks of 128",
                   "xla": "XLA ops, bf16 probabilities kept for the backward pass",
                   "cudnn": "cuDNN flash attention"}
MAX_CANDIDATES = 8  # Compiles the fit search may spend, the config's own not counted.


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice (or `num_slices` of them) of compile-only TPU devices: one per chip, two on
  TPU7x, whose figures (`device`) and counts (`chips`) are then per TensorCore."""
  name: str  # As given.
  jax_name: str  # JAX's spelling: "v5e:4x4".
  num_slices: int
  chip: tpu_specs.Chip
  devices: tuple[Any, ...]

  @property
  def chips(self) -> int:
    """The devices the mesh spans: the chips, or TPU7x's TensorCores."""
    return len({(getattr(d, "slice_index", 0), tuple(d.coords), getattr(d, "core_on_chip", 0))
                for d in self.devices})

  @property
  def device(self) -> tpu_specs.Chip:
    """The figures of one device: the chip's, or half of a TPU7x chip's."""
    return tpu_specs.per_device(self.chip)

  @property
  def unit(self) -> str:
    return "chip" if self.chip.devices_per_chip == 1 else "device"

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  @property
  def device_kind(self) -> str:
    return self.devices[0].device_kind


def jax_topology_name(name: str) -> tuple[str, tpu_specs.Chip]:
  """JAX's spelling (`v5e:4x4`, `tpu7x:2x2x2`) of a topology given so or as a Cloud (or GKE)
  accelerator type (`v4-32`, `v5litepod-16`, `v5p-64`, `v6e-16`, `tpu7x-16`), and its chip."""
  if m := re.fullmatch(r"(v\w+?|tpu\w+?):(\d+(?:x\d+)+)", name):
    chip = tpu_specs.CHIPS.get(m.group(1))
    if chip is None:
      raise ValueError(f"--topology {name}: unknown TPU {m.group(1)!r}; known: "
                       f"{', '.join(tpu_specs.CHIPS)}")
    return name, chip
  m = re.fullmatch(r"(v\w+?|tpu\w+?)-(\d+)", name)
  chip = tpu_specs.BY_CLOUD_PREFIX.get(m.group(1)) if m else None
  if chip is None:
    known = ", ".join(f"{c.cloud_prefix}-N" for c in tpu_specs.CHIPS.values())
    raise ValueError(f"--topology {name}: expected JAX's spelling (v5e:4x4, v4:2x2x4) or a "
                     f"Cloud TPU accelerator type ({known})")
  size = int(m.group(2))
  if size % chip.cores_per_chip:
    raise ValueError(f"--topology {name}: {chip.cloud_prefix} sizes count TensorCores, "
                     f"{chip.cores_per_chip} per chip")
  return f"{chip.name}:{tpu_specs.topology_shape(chip, size // chip.cores_per_chip)}", chip


def resolve_topology(name: str, num_slices: int = 1) -> Topology:
  """The compile-only devices of a topology (needs libtpu; no TPU)."""
  from jax.experimental import topologies
  jax_name, chip = jax_topology_name(name)
  # Compile-only devices drive no chip: other compiles (a fit search's, tests') may share
  # libtpu's lock on this machine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # JAX runs a v4 chip's two TensorCores as one device (megacore); libtpu's compile-only
  # topology would otherwise give one device per core.
  extra = {"chip_config_name": "megacore"} if chip.name == "v4" else {}
  shape = tuple(int(x) for x in jax_name.split(":")[1].split("x"))
  if chip.dims == 2 and math.prod(shape) < 4:  # Below libtpu's default host, 2x2x1: v5e:1x1.
    extra["chips_per_host_bounds"] = (*shape, 1)
  if num_slices > 1:
    extra["num_slices"] = num_slices
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=jax_name, **extra)
  except RuntimeError as e:  # No libtpu, or a shape libtpu refuses: one line either way.
    if "INVALID_ARGUMENT" not in str(e):
      raise ValueError(f"--topology {name} ({jax_name}): {str(e).splitlines()[0]}") from None
    raise ValueError(f"--topology {name}: no {chip.name} slice is laid out {jax_name.split(':')[1]}"
                     f"; the sizes that exist: {_standard_shapes(chip)}, ... (or the accelerator "
                     f"type, {chip.cloud_prefix}-N)") from None
  return Topology(name, jax_name, num_slices, chip, tuple(desc.devices))


def _standard_shapes(chip: tpu_specs.Chip) -> str:
  first = 2 if chip.dims == 3 else 0  # 3-D slices start at four chips.
  return ", ".join(f"{chip.name}:{tpu_specs.topology_shape(chip, 2**k)}"
                   for k in range(first, first + 7))


@dataclasses.dataclass(frozen=True)
class StepStats:
  """One compiled step, per chip."""
  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # Outputs written into their (donated) arguments' buffers.
  temp_bytes: int
  flops: float  # XLA's count.
  bytes_accessed: float
  collectives: dict[str, dict[str, int]]  # kind -> {"ops", "bytes"}.
  # The analytic FLOPs of the Pallas attention kernels, which XLA's count leaves out.
  kernel_flops: float = 0.0

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def total_flops(self) -> float:
    return self.flops + self.kernel_flops


def _shape_bytes(text: str) -> list[int]:
  """The bytes of each array in an HLO shape (`f32[8,128]{1,0}` or a tuple of them)."""
  out = []
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
    bits = int(re.sub(r"\D", "", dtype) or 8) if dtype != "pred" else 8
    out.append(math.prod(int(d) for d in dims.split(",") if d) * bits // 8)
  return out


_COLLECTIVE_RE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Collective ops of an optimized HLO module by kind: how many, and their results' bytes.
  An async op counts at its `-start`, whose tuple holds its operands before its results
  (all-gather, collective-permute) and scalar contexts after; a loop body's ops count once."""
  out = {k: {"ops": 0, "bytes": 0} for k in COLLECTIVES}
  for line in hlo_text.splitlines():
    if not (m := _COLLECTIVE_RE.search(line)):
      continue
    sizes = [b for b in _shape_bytes(m.group(1)) if b > 4] or _shape_bytes(m.group(1))
    if m.group(3) and m.group(2) != "all-reduce" and len(sizes) > 1:
      sizes = sizes[len(sizes) // 2:]
    out[m.group(2)]["ops"] += 1
    out[m.group(2)]["bytes"] += sum(sizes)
  return {k: v for k, v in out.items() if v["ops"]}


def step_stats(compiled: jax.stages.Compiled, kernel_flops: float = 0.0) -> StepStats:
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return StepStats(mem.argument_size_in_bytes, mem.output_size_in_bytes,
                   mem.alias_size_in_bytes, mem.temp_size_in_bytes,
                   float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                   collectives(compiled.as_text()), kernel_flops)


def _resnet_flops(model: models.VisionTransformer, size: int) -> tuple[float, int, int]:
  """The ResNet-v2 stem's convolution FLOPs per image, and its output's side and channels
  (resnet.resnet_stem: a 7x7/2 root, a 3x3/2 max pool, bottleneck units)."""
  if model.resnet_layers is None:
    return 0.0, size, 3
  width = int(64 * model.resnet_width_factor)
  side = -(-size // 2)
  flops, side, cin = 2.0 * side * side * 49 * 3 * width, -(-side // 2), width
  for i, units in enumerate(model.resnet_layers):
    f = width * 2**i
    for k in range(units):
      stride = 2 if i > 0 and k == 0 else 1
      out = -(-side // stride)
      if cin != 4 * f or stride != 1:
        flops += 2.0 * out * out * cin * 4 * f  # conv_proj
      flops += 2.0 * (side * side * cin * f + out * out * (9 * f * f + 4 * f * f))
      side, cin = out, 4 * f
  return flops, side, cin


def forward_flops(model: models.VisionTransformer, image_size: int) -> float:
  """Analytic FLOPs of one image's forward pass: the matmuls and convolutions (2 per
  multiply-add) of the ResNet stem, the patch embedding, each block's QKV, attention, output
  projection and MLP, a MAP head's, the pre-logits and the head (benchmarks/throughput.py's
  count, with the stem). Norms, softmax, GELU and the loss are left out."""
  stem, side, channels = _resnet_flops(model, image_size)
  d, m, p = model.hidden_size, model.mlp_dim, model.patch_size
  patches = (side // p) ** 2
  n = patches + model.num_prefix_tokens
  block = 2.0 * n * d * 4 * d + 2 * 2.0 * n * d * m
  width = model.representation_size or d
  head = 2.0 * d * width * (model.representation_size is not None) + 2.0 * width * model.num_classes
  if model.classifier == "map":  # One query's projections over the tokens, and its MLP.
    head += 2.0 * (2 * d * d + 2 * n * d * d + 2 * d * m)
  return (stem + 2.0 * patches * p * p * channels * d + model.num_layers * block + head
          + attention_flops(model, image_size))


def attention_flops(model: models.VisionTransformer, image_size: int) -> float:
  """Analytic FLOPs of one image's attention products (QK^T and AV), every block's and a MAP
  head's: what a fused attention kernel computes."""
  side = _resnet_flops(model, image_size)[1]
  n = (side // model.patch_size) ** 2 + model.num_prefix_tokens
  d = model.hidden_size
  return model.num_layers * 2 * 2.0 * n * n * d + (model.classifier == "map") * 2 * 2.0 * n * d


@dataclasses.dataclass
class Attempt:
  """One compile of a config on a topology."""
  overrides: dict[str, Any]  # Config fields changed from the config given.
  micro_batch: int
  mesh: tuple[int, int]  # (data, fsdp).
  attention: str  # The path the blocks' attention took (models/attention.py).
  train: StepStats | None = None
  eval: StepStats | None = None
  error: str | None = None  # The compiler's refusal (out of memory).
  over_bytes: int = 0  # How far the biggest step exceeds the chip's HBM.
  analytic_forward: float = 0.0  # Per image.
  compile_s: float = 0.0

  @property
  def fits(self) -> bool:
    return self.error is None and self.over_bytes <= 0

  def flags(self) -> list[str]:
    return [f"--config.{k}={v}" for k, v in self.overrides.items()]

  def described(self) -> str:
    """Its flags, or what no flags mean (a plan's first compile is the config itself)."""
    return " ".join(self.flags()) or "the config as given"


def take_pretrained_model(c: ml_collections.ConfigDict,
                          parent: description.Description | None = None) -> None:
  """config.pretrained's model fields set in `c` as a run takes them, from its description
  (`parent`: where the caller has read it already, as vit-train's checks have)."""
  if c.pretrained:
    run_setup.inherit_model_fields(c, parent or loader.describe(c.pretrained))


def with_overrides(c: ml_collections.ConfigDict, overrides: dict[str, Any]
                   ) -> ml_collections.ConfigDict:
  c = c.copy_and_resolve_references()
  c.update_from_flattened_dict(overrides)
  return c


def _abstract_batch(setup: "run_setup.RunSetup", num_classes: int, train: bool) -> dict[str, Any]:
  """A batch as data.train_iterator / eval_iterator give it: images float32, labels int32
  (float32 soft targets with mixup), eval's mask float32."""
  c, n, sharding = setup.config, setup.micro_batch, setup.batch_sharding
  size = c.data.image_size
  batch = {"image": jax.ShapeDtypeStruct((n, size, size, 3), jnp.float32, sharding=sharding)}
  if train and c.data.mixup_alpha:
    batch["label"] = jax.ShapeDtypeStruct((n, num_classes), jnp.float32, sharding=sharding)
  else:
    batch["label"] = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding)
  if not train:
    batch["mask"] = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
  return batch


def compile_steps(c: ml_collections.ConfigDict, topology: Topology, num_classes: int
                  ) -> tuple["run_setup.RunSetup", jax.stages.Compiled, jax.stages.Compiled]:
  """The run's train step and evaluation step (run_setup's own functions, as the loop runs them), compiled for the
  topology from abstract shapes: no data, no weights."""
  setup = run_setup.setup_on(c, num_classes, topology.devices)
  init_rng, dropout_rng = jax.random.split(jax.random.key(c.seed))
  size = c.data.image_size
  with setup.mesh_scope():
    state, shardings = trainer.abstract_state(setup.model, setup.tx, setup.mesh,
                                              (size, size, 3), init_rng,
                                              ema=c.ema_decay is not None)
    train = run_setup.train_step_fn(setup, shardings, dropout_rng).lower(
        state, _abstract_batch(setup, num_classes, train=True)).compile()
    evaluator = ClassificationEvaluator(run_setup.predict_fn(setup.model), lambda: (), c.loss)
    evaluate = evaluator.lower(state.params, _abstract_batch(setup, num_classes, train=False))
    return setup, train, evaluate.compile()


_SIZE = r"([\d.]+)([KMGT]?)"
# libtpu's two ways of saying it: the temporaries alone exceed the HBM left, or the total.
_OVER_RES = (re.compile(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)"),
             re.compile(rf"[Ee]xceeded (?:hbm )?capacity by {_SIZE}"))


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def _over_bytes_of(message: str) -> int:
  """How far over the HBM the compiler's out-of-memory message says the step is (at least);
  1 where it says no number."""
  if m := _OVER_RES[0].search(message):
    return _bytes(*m.group(1, 2)) - _bytes(*m.group(3, 4))
  if m := _OVER_RES[1].search(message):
    return _bytes(*m.group(1, 2))
  return 1


def attempt(c: ml_collections.ConfigDict, topology: Topology, num_classes: int,
            overrides: dict[str, Any]) -> Attempt:
  """Compiles `c` with `overrides` on the topology; an out-of-memory refusal is a result."""
  import time
  t0 = time.time()
  cfg = with_overrides(c, overrides)
  setup = run_setup.setup_on(cfg, num_classes, topology.devices)  # Config errors raise here.
  out = Attempt(overrides, setup.micro_batch, (setup.mesh.shape["data"], setup.mesh.shape["fsdp"]),
                setup.model.attention_impl,
                analytic_forward=forward_flops(setup.model, cfg.data.image_size))
  try:
    _, train, evaluate = compile_steps(cfg, topology, num_classes)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    out.error = next((line.strip() for line in str(e).splitlines()
                      if any(r.search(line) for r in _OVER_RES)), str(e).splitlines()[0])
    out.over_bytes = _over_bytes_of(str(e))
  else:
    # XLA counts no FLOPs of a Pallas kernel: the attention's, analytic, added to its count.
    kernel = 0.0
    if out.attention in attention.PALLAS_IMPLS:
      kernel = attention_flops(setup.model, cfg.data.image_size) * setup.micro_batch / len(
          topology.devices)
    out.train, out.eval = step_stats(train, 3 * kernel), step_stats(evaluate, kernel)
    out.over_bytes = max(out.train.total_bytes, eval_resident_bytes(out.train, out.eval)
                         ) - topology.device.hbm_bytes
  out.compile_s = time.time() - t0
  return out


def eval_resident_bytes(train: StepStats, evaluate: StepStats) -> int:
  """HBM in use while the evaluation step runs: the whole train state stays resident (the
  train step's arguments), beside the evaluation's own temporaries and outputs."""
  return train.argument_bytes + evaluate.temp_bytes + evaluate.output_bytes


def candidates(c: ml_collections.ConfigDict, chips: int, plan: bool = False
               ) -> list[dict[str, Any]]:
  """Changes to try, cheapest first: the parameters and optimizer state split over more
  chips (mesh.fsdp x2, x4, x8: a smaller part of the update each, one gather of the weights a
  step), then, where the config splits them, whole on every chip (the same FLOPs; libtpu's
  scheduler fills the HBM a split frees, so a split step can need more: ViT-H/14 on tpu7x-16),
  then rematerialisation (about a third more FLOPs), then both, then smaller micro-batches
  (accum_steps x2, x4: the chips less busy per step), then all of it. `plan` starts from the
  config's mesh without remat, so that the first fit is the mesh and remat to use."""
  base = {"model.remat": False} if plan and c.model.remat else {}
  fsdp0 = _fsdp_of(c, chips)
  fsdps = [f for f in (2 * fsdp0, 4 * fsdp0, 8 * fsdp0) if f <= chips and chips % f == 0]
  sharded = [{"mesh.data": -1, "mesh.fsdp": f} | base for f in fsdps]
  whole = [{"mesh.data": -1, "mesh.fsdp": 1} | base] if fsdp0 > 1 else []
  remat = [] if c.model.remat and not plan else [base | {"model.remat": True}]
  both = [s | {"model.remat": True} for s in sharded[-1:]] if remat else []
  accums = [base | {"accum_steps": c.accum_steps * k} for k in (2, 4)
            if c.batch_size % (c.accum_steps * k) == 0
            and (c.batch_size // (c.accum_steps * k)) % chips == 0]
  last = ([(both or sharded or remat or [base])[-1] | {"accum_steps": accums[-1]["accum_steps"]}]
          if accums else [])
  found = ([base] if plan else []) + sharded + whole + remat + both + accums
  # All of it is always tried: a search that cuts it never tried what fits last.
  return found[:MAX_CANDIDATES - len(last)] + last


def _fsdp_of(c: ml_collections.ConfigDict, chips: int) -> int:
  if c.mesh.fsdp != -1:
    return c.mesh.fsdp
  return chips // c.mesh.data if c.mesh.data != -1 else chips  # Both -1: the slice's chips.


@dataclasses.dataclass
class Search:
  """The config's own compile and, where it does not fit (or for a plan), the candidates
  compiled in turn until one fits."""
  given: Attempt | None
  tried: list[Attempt]

  @property
  def found(self) -> Attempt | None:
    return next((a for a in self.tried if a.fits), None)


def check_not_hopeless(c: ml_collections.ConfigDict, topology: Topology,
                       num_classes: int) -> None:
  """Raises ConfigError for a config that no change of the search (candidates: fsdp, remat,
  accum_steps) brings under a device's HBM: its parameters and their gradients, sharded over
  every device, are over it (naming the model); or what the backward pass must keep of the
  smallest micro-batch per device, at its least (footprint.kept_for_backward_bytes), is
  (naming config.batch_size and the largest batch that could fit). From shapes alone, before any
  compile (a 16M-image batch took 101 s of compiles to be refused)."""
  model = run_setup.build_model(c, num_classes)
  accum = max([c.accum_steps] + [o.get("accum_steps", 0) for o in candidates(c, topology.chips)])
  devices = len(topology.devices)
  _check_state_fits(c, model, topology)
  per_example = footprint.kept_for_backward_bytes(model, c.data.image_size,
                                                  jnp.dtype(c.dtype).itemsize)
  kept = c.batch_size / (accum * devices) * per_example
  hbm = topology.device.hbm_bytes
  if kept <= hbm:
    return
  largest = int(hbm // per_example) * accum * devices
  raise ConfigError(
      f"config.batch_size={c.batch_size}: at least {kept / tpu_specs.GiB:,.0f} GiB per device "
      f"({kept / hbm:,.0f}x its {hbm / tpu_specs.GiB:g} GiB of HBM) for what the backward pass "
      f"keeps at {c.data.image_size} px, whatever mesh, remat or accum_steps (up to {accum}): "
      f"use a smaller batch (above {largest:,} images cannot fit {topology.name}), e.g. "
      f"--config.batch_size={_smaller_batch(largest, devices * c.accum_steps)}")


def _check_state_fits(c: ml_collections.ConfigDict, model: models.VisionTransformer,
                      topology: Topology) -> None:
  """Raises ConfigError where the parameters and their gradients alone, sharded over every
  device (mesh.fsdp at its widest), are over a device's HBM: no batch, mesh, remat or
  accum_steps fits such a model, and each candidate's compile would say so only after
  seconds (a 137M-class head on tpu7x-8: 8 compiles, 46 s of CPU)."""
  leaves = jax.tree.leaves(models.abstract_params(model, c.data.image_size))
  count, param_bytes = sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)
  devices, hbm = len(topology.devices), topology.device.hbm_bytes
  per_device = 2 * param_bytes / devices
  if per_device <= hbm:
    return
  raise ConfigError(
      f"config.model_name={c.model_name!r} with its overrides and {model.num_classes:,} "
      f"classes: {count / 1e9:,.1f}G parameters, which with their gradients take at "
      f"least {per_device / tpu_specs.GiB:,.0f} GiB per device even sharded over all "
      f"{devices} devices of {topology.name} ({per_device / hbm:,.1f}x its "
      f"{hbm / tpu_specs.GiB:g} GiB of HBM): use a smaller model or head, or a bigger slice")


def _smaller_batch(largest: int, multiple: int) -> int:
  """A power of two at most `largest`, split evenly over `multiple` (at least it)."""
  batch = 1 << max(largest, 1).bit_length() - 1
  return max(batch // multiple * multiple, multiple)


def search(c: ml_collections.ConfigDict, topology: Topology, num_classes: int,
           plan: bool = False, log: Callable[[str], None] = lambda _: None,
           out: Search | None = None) -> Search:
  """Compiles the config (unless `plan`), then, if it does not fit, each candidate until one
  does; `log` hears of each compile. `out`, filled in as the compiles end, is what a caller
  that stops the search early has of it."""
  out = out or Search(None, [])
  given = out.given = None if plan else attempt(c, topology, num_classes, {})
  if given is not None:
    log(f"compiled the config in {given.compile_s:.0f} s: "
        f"{'fits' if given.fits else 'does not fit'}")
    if given.fits:
      return out
  refused = []
  for overrides in candidates(c, topology.chips, plan):
    try:
      a = attempt(c, topology, num_classes, overrides)
    except ConfigError as e:  # A mesh or batch this slice cannot take: not a candidate.
      refused.append(e)
      continue
    out.tried.append(a)
    log(f"tried {a.described()} in {a.compile_s:.0f} s: "
        f"{'fits' if a.fits else 'does not fit'}")
    if a.fits:
      break
  if given is None and refused and not out.tried:  # A plan: the config itself is refused.
    raise refused[0]
  return out


def roofline(stats: StepStats, chip: tpu_specs.Chip, images: int) -> dict[str, Any]:
  """A lower bound on the step's time per chip: its FLOPs at the chip's peak bfloat16 rate,
  or its HBM traffic at the chip's bandwidth, whichever is longer (collectives and
  everything else that overlaps or stalls left out). Not a measurement."""
  compute_s = stats.total_flops / chip.peak_bf16_flops
  memory_s = stats.bytes_accessed / chip.hbm_bytes_per_s
  step_s = max(compute_s, memory_s)
  return dict(step_s=step_s, compute_s=compute_s, memory_s=memory_s,
              bound="compute" if compute_s >= memory_s else "HBM bandwidth",
              images_per_s=images / step_s if step_s else None)


def _step_dict(stats: StepStats | None, analytic: float, chip: tpu_specs.Chip,
               images: int) -> dict[str, Any] | None:
  if stats is None:
    return None
  return dataclasses.asdict(stats) | dict(
      total_bytes=stats.total_bytes, total_flops=stats.total_flops, analytic_flops=analytic,
      roofline=roofline(stats, chip, images))


def report(c: ml_collections.ConfigDict, topology: Topology, a: Attempt) -> dict[str, Any]:
  """What `--compile_only` prints (`--json`: as it is), per chip unless named otherwise."""
  chip, cfg = topology.device, with_overrides(c, a.overrides)
  forward = a.analytic_forward * a.micro_batch / topology.chips
  out = dict(
      topology=topology.name, jax_topology=topology.jax_name, num_slices=topology.num_slices,
      chips=topology.chips, hosts=topology.hosts, device_kind=topology.device_kind,
      unit=topology.unit, devices_per_chip=topology.chip.devices_per_chip,
      model=cfg.model_name, pretrained=cfg.pretrained,
      model_fields={k: v for k, v in cfg.model.items() if v is not None},
      dtype=cfg.dtype, batch_size=cfg.batch_size,
      accum_steps=cfg.accum_steps, micro_batch=a.micro_batch,
      per_chip_batch=a.micro_batch / topology.chips,
      mesh=dict(data=a.mesh[0], fsdp=a.mesh[1]), remat=bool(cfg.model.remat),
      dcn_data=topology.num_slices,  # Of the data axis, across slices (mesh.dcn_data).
      attention=dict(asked=cfg.model.get("attention_impl") or "auto", took=a.attention),
      hbm_capacity_bytes=chip.hbm_bytes, peak_bf16_flops=chip.peak_bf16_flops,
      hbm_bytes_per_s=chip.hbm_bytes_per_s, chip_source=chip.source,
      fits=a.fits, over_bytes=max(a.over_bytes, 0), error=a.error,
      overrides=a.flags(), compile_s=a.compile_s,
      train=_step_dict(a.train, 3 * forward, chip, a.micro_batch),
      eval=_step_dict(a.eval, forward, chip, a.micro_batch))
  if a.train is not None:
    out["eval"]["resident_bytes"] = eval_resident_bytes(a.train, a.eval)
  return out


def _gib(n: float) -> str:
  return f"{n / tpu_specs.GiB:.2f} GiB" if n >= tpu_specs.GiB / 10 else f"{n / 2**20:.1f} MiB"


def _hbm_line(name: str, s: dict[str, Any], capacity: int, total: int) -> str:
  aliased = (f" ({_gib(s['alias_bytes'])} of them its donated arguments)"
             if s["alias_bytes"] else "")
  return (f"  {name}: arguments {_gib(s['argument_bytes'])}, outputs {_gib(s['output_bytes'])}"
          f"{aliased}, temporaries {_gib(s['temp_bytes'])}; total {_gib(total)} "
          f"({total / capacity:.0%} of {_gib(capacity)})")


def _flops_line(name: str, s: dict[str, Any], remat: bool, capacity: int) -> str:
  ratio = s["total_flops"] / s["analytic_flops"] if s["analytic_flops"] else float("nan")
  why = " (remat recomputes the forward: ~4/3 expected)" if remat and name == "train" else ""
  if not why and ratio > 1.05:
    why = (" (HBM nearly full: XLA's own rematerialisation recomputes activations to fit)"
           if s["total_bytes"] > 0.8 * capacity else
           " (elementwise work the analytic count leaves out: norms, softmax, GELU, the loss)")
  kernels = (f" + {s['kernel_flops'] / 1e12:.3f} in the Pallas attention kernels (analytic; XLA "
             "counts none)" if s["kernel_flops"] else "")
  return (f"  {name}: {s['flops'] / 1e12:.3f} TFLOP (XLA){kernels} vs "
          f"{s['analytic_flops'] / 1e12:.3f} analytic, {ratio:.2f}x{why}")


def _collective_line(name: str, s: dict[str, Any]) -> str:
  parts = [f"{k} {v['ops']} ops {v['bytes'] / 2**20:,.1f} MiB"
           for k, v in s["collectives"].items()]
  return f"  {name}: {', '.join(parts) or 'none'}"


def _header(r: dict[str, Any]) -> list[str]:
  slices = f", {r['num_slices']} slices" if r["num_slices"] > 1 else ""
  over = f" (over {r['dcn_data']} slices)" if r["dcn_data"] > 1 else ""
  hosts = f"{r['hosts']} host{'s' * (r['hosts'] > 1)}"
  model = r["model"] + (f" as {r['pretrained']} describes it" if r.get("pretrained") else "")
  unit = r.get("unit", "chip")
  kind = (f"{r['device_kind']}, {r['devices_per_chip']} a chip, HBM and peaks counted per "
          "device" if unit == "device" else r["device_kind"])
  return [f"{r['topology']} ({r['jax_topology']}{slices}): {r['chips']} {unit}s ({kind}), "
          f"{hosts}",
          f"{model} in {r['dtype']}, batch {r['batch_size']} (micro-batch "
          f"{r['micro_batch']}, {r['per_chip_batch']:g} per {unit}), mesh data="
          f"{r['mesh']['data']}{over} x fsdp={r['mesh']['fsdp']}, "
          f"remat {'on' if r['remat'] else 'off'}",
          _attention_line(r["attention"], r["device_kind"])]


def _attention_line(a: dict[str, Any], device_kind: str) -> str:
  line = f"attention: {a['took']} ({ATTENTION_PATHS[a['took']]})"
  if a["asked"] == "auto" and a["took"] != "pallas" and device_kind.startswith("TPU"):
    line += f"; \"auto\" fell back: the Pallas kernel does not compile for {device_kind} here"
  return line


def format_report(r: dict[str, Any]) -> str:
  """The report as lines for a person."""
  lines = _header(r)
  if r["train"] is None:
    return "\n".join(lines + [f"does not compile within HBM: {r['error']}"])
  cap, unit = r["hbm_capacity_bytes"], r.get("unit", "chip")
  lines += [f"HBM per {unit}:", _hbm_line("train", r["train"], cap, r["train"]["total_bytes"]),
            _hbm_line("eval ", r["eval"], cap, r["eval"]["total_bytes"]),
            "  while evaluating, with the train state resident: "
            + _gib(r["eval"]["resident_bytes"]),
            f"FLOPs per {unit} per step:", _flops_line("train", r["train"], r["remat"], cap),
            _flops_line("eval", r["eval"], False, cap),
            "Collectives per step (ops in the compiled program, their results' bytes):",
            _collective_line("train", r["train"]), _collective_line("eval", r["eval"])]
  roof = r["train"]["roofline"]
  lines += [f"Roofline bound, not a measurement (peak {r['peak_bf16_flops'] / 1e12:g} TFLOP/s "
            f"bf16, {r['hbm_bytes_per_s'] / 1e9:,.0f} GB/s HBM per {unit}; {r['chip_source']}):",
            f"  train step >= {roof['step_s'] * 1e3:,.1f} ms ({roof['bound']} bound: compute "
            f"{roof['compute_s'] * 1e3:,.1f} ms, HBM {roof['memory_s'] * 1e3:,.1f} ms for the "
            "bytes XLA counts accessed), "
            f"<= {roof['images_per_s']:,.0f} images/s",
            f"Compiled train and eval steps in {r['compile_s']:.0f} s."]
  return "\n".join(lines)
