r"""Where a compiled TPU train step's bytes go: each instruction of the optimized HLO
(`compiled.as_text()`, or a dump's `*.after_optimizations.txt`) with its operands' and outputs'
bytes, grouped by the kind of work, beside XLA's own `bytes accessed` (cost_analysis), which the
`--compile_only` roofline divides by the HBM bandwidth.

The count follows XLA's HloCostAnalysis: a top-level instruction moves its distinct operands and
its outputs; parameters, constants, bitcasts and tuple plumbing move nothing; a fusion's operand
that the fusion only slices counts the slice; an async op counts at its start. Arrays are
counted at their logical size (no tile padding), as XLA does. What it cannot see: the share of
an operand a fusion reads twice (counted once) and where the compiler keeps a small operand in
VMEM (counted as moved, as XLA counts it). A fusion is named for the first role of what it computes
(gpu_kernels.ROLES: `transpose(jvp(...))` in an op's name is the backward pass), with the roles
it also fuses beside it. Its HBM side counts only the arrays in HBM (the layout names no other
memory space: S(1) is VMEM), a copy between HBM and VMEM once and an async slice of an array
in HBM at the slice's size: what the HBM's bandwidth carries, which XLA's figure overstates
where libtpu keeps activations in VMEM and reads them into it in slices.

  PYTHONPATH=. python benchmarks/tpu_hbm_bytes.py --config pretrain:b16,i21k \
      --topology v5litepod-16 [--set model.num_layers=2 ...] [--hlo_out step.hlo.txt]
  python benchmarks/tpu_hbm_bytes.py --hlo step.hlo.txt [--bytes_accessed 1.94e11]
"""
import argparse
import collections
import dataclasses
import json
import re
import sys
from typing import Any, Optional

import gpu_kernels as g

# A fusion's role (gpu_kernels.role) -> its kind in the table.
KINDS = {"collective": "collectives", "matmul (Triton)": "matmul", "pad / slice": "pad / slice",
         "LayerNorm bwd": "LayerNorm bwd", "LayerNorm fwd": "LayerNorm fwd",
         "bias + GELU bwd": "bias + GELU bwd", "bias + GELU fwd": "bias + GELU fwd",
         "matmul split-K reduce": "matmul", "optimizer (AdamW)": "optimizer update",
         "gradient norm": "gradient norm", "loss / softmax / head": "loss / head",
         "bias gradient": "bias gradient", "residual add": "residual add",
         "gradient sum": "gradient sum", "copy / transpose": "layout copy / transpose",
         "cast": "cast", "other": "other"}
# libtpu's memory-space assignment: copies between HBM and VMEM (copy-start/-done, async
# slices of an operand), counted by XLA at the start and again at the end of a copy.
PREFETCH = "HBM<->VMEM copies (prefetch, evict)"
ZERO = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
        "partition-id", "replica-id", "opt-barrier")
# Custom calls that move nothing: ConcatBitcast views adjacent buffers as one (XLA counts none).
NO_BYTES = ("ConcatBitcast",)
ASYNC_DONE = re.compile(r"-done$")
MEMORY_SPACE = re.compile(r"S\([1-9]\d*\)")
_NEW_LINE = re.compile(r"^(\s+(ROOT )?%|%|ENTRY |HloModule|\}$|\S+\n?$|$)")


def join_lines(text: str) -> str:
  """HLO text with one instruction a line: TPU custom calls' configs hold newlines (a Pallas
  kernel's metadata), whose continuation lines would read as the end of a computation."""
  out = []
  for line in text.splitlines():
    if out and not _NEW_LINE.match(line) and not re.match(r"^\d+ ", line):
      out[-1] += " " + line
    else:
      out.append(line)
  return "\n".join(out)


def parse(text: str) -> g.Module:
  return g.parse_hlo(join_lines(text))


def _sliced_bytes(module: g.Module, instr: g.Instruction, index: int) -> Optional[float]:
  """The bytes a fusion reads of operand `index` where its body reads it only through slices
  (XLA's FusionParameterReadBytes); None where it reads all of it."""
  body = module.computations.get(instr.calls[0]) if instr.calls else None
  if not body:
    return None
  param = next((i for i in body if i.opcode == "parameter" and i.operands == [str(index)]),
               None)
  if param is None:
    return None
  users = [i for i in body if param.name in i.operands]
  if users and all(u.opcode in ("slice", "dynamic-slice") for u in users):
    return sum(g.shape_bytes(u.shape) for u in users)
  return None


def _hbm_bytes(shape: str) -> float:
  """An array's bytes where it lives in HBM; none where its layout names another memory space
  (S(1): VMEM; S(2), S(6): scalars in SMEM and semaphores)."""
  return 0.0 if MEMORY_SPACE.search(shape) else g.shape_bytes(shape)


def moved(module: g.Module, instr: g.Instruction, hbm_side: bool = False) -> float:
  """Operand + output bytes of one top-level instruction, as XLA's cost analysis counts them;
  `hbm_side`: only those of arrays in HBM, a copy between HBM and VMEM once (what the HBM's
  bandwidth carries; XLA's count also charges what is read from and written to VMEM)."""
  op, size = instr.opcode, _hbm_bytes if hbm_side else g.shape_bytes
  if op == "copy-done":  # XLA counts a copy twice: at its start and, again, at its end.
    return 0.0 if hbm_side else 2 * g.shape_bytes(instr.shape)
  if op == "copy-start" and hbm_side:
    return size(module.operand_shape(instr.operands[0])) or size(g.tuple_parts(instr.shape)[0])
  if op in ZERO or ASYNC_DONE.search(op) or instr.target in NO_BYTES:
    return 0.0
  outputs = g.tuple_parts(instr.shape)
  if op.endswith("-start"):  # (operands..., results..., contexts): the results once.
    arrays = [s for s in outputs if not re.match(r"(u32|s32)\[\]", s)]
    outputs = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
  if op == "slice-start" and hbm_side:  # HBM gives the slice, not the whole operand.
    part = sum(map(g.shape_bytes, outputs))
    return sum(map(size, outputs)) + (part if size(module.operand_shape(instr.operands[0])) else 0)
  total = sum(map(size, outputs))
  seen = set()
  for k, operand in enumerate(instr.operands):
    if operand in seen:
      continue
    seen.add(operand)
    whole = size(module.operand_shape(operand))
    part = _sliced_bytes(module, instr, k) if op == "fusion" and whole else None
    total += whole if part is None else part
  return total


def kind(module: g.Module, instr: g.Instruction) -> tuple[str, str]:
  """(kind, what else it fuses) of one top-level instruction."""
  if instr.opcode == "custom-call":
    path = instr.op_name
    if "splash" in path or "MultiHeadDotProductAttention" in path:
      return "attention kernel (Pallas)", ""
    return f"custom call {instr.target}", ""
  if instr.opcode in ("copy-start", "copy-done") or instr.opcode.endswith("-start"):
    return PREFETCH, ""
  if instr.opcode == "copy":
    return "layout copy / transpose", ""
  roles = g.fusion_roles(module, instr)
  return KINDS[roles[0]], ", ".join(KINDS[r] for r in roles[1:])


@dataclasses.dataclass
class Group:
  name: str
  ops: int = 0
  bytes: float = 0.0
  hbm: float = 0.0  # Of `bytes`, those of arrays in HBM (moved(..., hbm_side=True)).
  fused: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _control_callees(instr: g.Instruction) -> list[str]:
  """The computations a while, call or conditional runs; none for other instructions."""
  if instr.opcode not in ("while", "call", "conditional"):
    return []
  return instr.calls + re.findall(
      r"(?:body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", instr.attrs)


def tabulate(module: g.Module) -> dict[str, Group]:
  groups = {}
  # The entry and what it runs outside fusions (while bodies, calls, conditionals).
  for name in module.reachable([module.entry], _control_callees):
    for instr in module.computations[name]:
      b = moved(module, instr)
      if not b:
        continue
      k, fused = kind(module, instr)
      row = groups.setdefault(k, Group(k))
      row.ops, row.bytes = row.ops + 1, row.bytes + b
      row.hbm += moved(module, instr, hbm_side=True)
      row.fused[fused] += b
  return dict(sorted(groups.items(), key=lambda kv: -kv[1].bytes))


def format_table(groups: dict[str, Group], bytes_accessed: Optional[float]) -> str:
  total = sum(r.bytes for r in groups.values())
  hbm = sum(r.hbm for r in groups.values())
  lines = ["| kind of work | ops | GB a chip | share | HBM side GB | of it fused with |",
           "| --- | ---: | ---: | ---: | ---: | --- |"]
  for r in groups.values():
    fused = "; ".join(f"{f} {b / 1e9:.1f}" for f, b in r.fused.most_common(3) if f)
    lines.append(f"| {r.name} | {r.ops} | {r.bytes / 1e9:.2f} | {r.bytes / total:.1%} | "
                 f"{r.hbm / 1e9:.2f} | {fused} |")
  lines.append(f"| **total** | {sum(r.ops for r in groups.values())} | {total / 1e9:.2f} | | "
               f"{hbm / 1e9:.2f} | |")
  if bytes_accessed:
    lines.append(f"\nXLA's cost_analysis bytes accessed: {bytes_accessed / 1e9:.2f} GB; "
                 f"this count is {total / bytes_accessed:.4f}x it, its HBM side "
                 f"{hbm / bytes_accessed:.4f}x.")
  return "\n".join(lines)


def compile_step(config: str, topology: str, sets: list[str]) -> tuple[str, float, dict]:
  """The train step of `config` compiled for `topology` as `vit-train --compile_only` compiles
  it: its optimized HLO text, XLA's bytes accessed and the compile report's figures."""
  from vit_jax import configs
  from vit_jax.train import compile_check
  c = configs.get_config(config)
  compile_check.take_pretrained_model(c)
  overrides = {}
  for s in sets:
    key, _, value = s.partition("=")
    try:
      overrides[key] = json.loads(value)
    except json.JSONDecodeError:
      overrides[key] = value
  c = compile_check.with_overrides(c, overrides)
  top = compile_check.resolve_topology(topology)
  classes = compile_check.KNOWN_CLASSES.get(c.data.name, 1000)
  _, train, _ = compile_check.compile_steps(c, top, classes)
  stats = compile_check.step_stats(train)
  cost = train.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return train.as_text(), stats.bytes_accessed, dict(
      temp_gib=stats.temp_bytes / 2**30, total_gib=stats.total_bytes / 2**30,
      flops=stats.flops, bytes_accessed=stats.bytes_accessed,
      cost={k: v for k, v in cost.items() if k.startswith("bytes accessed")})


def main(argv: Optional[list[str]] = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--hlo", help="an optimized HLO text (as_text() or *.after_optimizations.txt)")
  p.add_argument("--bytes_accessed", type=float, help="XLA's figure, to compare with --hlo")
  p.add_argument("--config", help="e.g. pretrain:b16,i21k (compiles it)")
  p.add_argument("--topology", default="v5litepod-16")
  p.add_argument("--set", action="append", default=[], help="config.KEY=VALUE, repeatable")
  p.add_argument("--hlo_out", help="where to write the compiled step's HLO text")
  p.add_argument("--json_out")
  a = p.parse_args(argv)
  if bool(a.hlo) == bool(a.config):
    p.error("give --hlo or --config")
  extra: dict[str, Any] = {}
  if a.config:
    text, a.bytes_accessed, extra = compile_step(a.config, a.topology, a.set)
    if a.hlo_out:
      with open(a.hlo_out, "w") as f:
        f.write(text)
  else:
    text = g.read_text(a.hlo)
  groups = tabulate(parse(text))
  print(format_table(groups, a.bytes_accessed))
  if extra:
    print(json.dumps({k: v for k, v in extra.items() if k != "cost"}))
  if a.json_out:
    with open(a.json_out, "w") as f:
      json.dump(dict(extra, bytes_accessed=a.bytes_accessed, groups={
          k: dict(ops=r.ops, bytes=r.bytes, hbm_bytes=r.hbm, fused=dict(r.fused))
          for k, r in groups.items()}),
          f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
