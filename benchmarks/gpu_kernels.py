"""Where a GPU step's time goes, kernel by kernel, grouped by what each kernel computes.

Reads a profiler trace (perfetto JSON, `.json.gz`, as `jax.profiler` / throughput.py's
`--profile_dir` write it; GPU events carry `hlo_module` and `hlo_op`) and the compiled HLO of
the same process (`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`: the module's
`*.after_optimizations.txt`, gzipped or not). In one process a fusion's kernel is named after its
HLO instruction (`fusion_1368` runs `%fusion.1368`; deduplicated fusions share the kernel of
one of them); library kernels (cuBLAS, cuDNN) are recognised by name.

Prints, per step: each group's milliseconds and share of the GPU's busy time, the bytes it moves
(operands + outputs from the HLO's shapes, each buffer counted once a launch) and the achieved
GB/s against the HBM's bandwidth; the FLOP/s of the matmuls, attention and convolutions; then the
top fusions that run under half the bandwidth, with their HLO (shapes, what they fuse, the
model code they come from). Pure Python: gzip, json, re.

  python benchmarks/gpu_kernels.py ../shared/perf   # a folder with one trace and one HLO dump
  python benchmarks/gpu_kernels.py --trace T.trace.json.gz --hlo M.after_optimizations.txt.gz
"""
import argparse
import collections
import dataclasses
import gzip
import json
import pathlib
import re
import sys
from typing import Callable, Iterable, Optional

# HBM bandwidth (GB/s) by the device name's key word; --hbm_gbps overrides.
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1,
               "s4": 0.5, "u4": 0.5, "token": 0}
ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = ")
COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) ")


def array_bytes(dtype: str, dims: str) -> float:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n * DTYPE_BYTES.get(dtype, 0)


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape: an array (`bf16[256,197,768]{2,1,0}`) or a tuple of them."""
  return sum(array_bytes(t, d) for t, d in ARRAY.findall(shape) if t in DTYPE_BYTES)


def _split_top(text: str) -> list[str]:
  """`a, (b, c), d` -> ['a', '(b, c)', 'd']: commas outside brackets, comments dropped."""
  text = re.sub(r"/\*.*?\*/", "", text)
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    depth += c in "([{"
    depth -= c in ")]}"
    if c == "," and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  parts.append(text[start:].strip())
  return [p for p in parts if p]


def tuple_parts(shape: str) -> list[str]:
  """The top-level elements of a tuple shape; [shape] for an array."""
  shape = shape.strip()
  return _split_top(shape[1:-1]) if shape.startswith("(") else [shape]


def _balanced(text: str, start: int) -> int:
  """The index after the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] in "([{"
    depth -= text[i] in ")]}"
    if depth == 0:
      return i + 1
  raise ValueError(f"error: unbalanced brackets in HLO line {text[:120]!r}")


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str

  def attr(self, pattern: str) -> Optional[str]:
    m = re.search(pattern, self.attrs)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str:
    return self.attr(r'op_name="([^"]*)"') or ""

  @property
  def calls(self) -> list[str]:
    """The computations it runs (a fusion's body), not a reduction's `to_apply` lambda."""
    found = re.findall(r"\bcalls=(%[\w.\-]+(?:, %[\w.\-]+)*)", self.attrs)
    return [c.strip().lstrip("%") for group in found for c in group.split(",")]

  @property
  def target(self) -> str:
    return self.attr(r'custom_call_target="([^"]*)"') or ""


def parse_instruction(line: str) -> Optional[Instruction]:
  """One instruction line of HLO text: `  [ROOT ]%name = SHAPE opcode(OPERANDS), ATTRS`."""
  m = INSTRUCTION.match(line)
  if not m:
    return None
  rest = line[m.end():]
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  close = _balanced(rest, paren)
  operands = [o.split()[-1].lstrip("%") for o in _split_top(rest[paren + 1:close - 1])]
  return Instruction(m.group(1), shape, rest[:paren], operands, rest[close:])


@dataclasses.dataclass
class Module:
  """A compiled HLO module: its computations (instructions in schedule order), the entry's
  name, and the stack-frame tables that say which source line made an instruction."""
  computations: dict[str, list[Instruction]]
  entry: str
  frames: dict[int, tuple[str, int, str, int]]  # id -> (file, line, function, parent id)
  entry_module_name: str = ""  # `HloModule NAME`: the trace's hlo_module.

  def __post_init__(self):
    self.by_name = {i.name: i for body in self.computations.values() for i in body}
    self._kernels = {re.sub(r"[.\-]", "_", i.name): i for i in self.computations[self.entry]}

  def instruction_of_kernel(self, kernel: str) -> Optional[Instruction]:
    """The entry's instruction a kernel is named after (`fusion_1368` -> `%fusion.1368`)."""
    return self._kernels.get(re.sub(r"[.\-]", "_", kernel))

  def reachable(self, roots: Iterable[str],
                follow: Callable[[Instruction], Iterable[str]]) -> list[str]:
    """The computations named in `roots` and every one they reach through the callees
    `follow(instruction)` names (fused bodies, or control flow's), in the order first reached;
    names the module does not hold are passed over."""
    out, todo, seen = [], list(roots), set()
    while todo:
      name = todo.pop()
      if name in seen or name not in self.computations:
        continue
      seen.add(name)
      out.append(name)
      for i in self.computations[name]:
        todo.extend(follow(i))
    return out

  def fused(self, instr: Instruction) -> list[Instruction]:
    """Every instruction of the computations `instr` calls, nested ones included."""
    return [i for name in self.reachable(instr.calls, lambda i: i.calls)
            for i in self.computations[name]]

  def operand_shape(self, operand: str) -> str:
    name, _, index = operand.partition("#")
    instr = self.by_name.get(name)
    if instr is None:
      return ""
    return tuple_parts(instr.shape)[int(index)] if index else instr.shape


def _frame_tables(text: str) -> dict[int, tuple[str, int, str, int]]:
  """The dump's FileNames / FunctionNames / FileLocations / StackFrames tables: frame id ->
  (file, line, function, parent frame id; 0 for none)."""
  tables = {}
  for title in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    tables[title] = dict(re.findall(r"^(\d+) (.*)$", m.group(1), re.M)) if m else {}
  field = lambda text, key: int(re.search(rf"\b{key}=(\d+)", text).group(1))  # noqa: E731
  frames = {}
  for fid, frame in tables["StackFrames"].items():
    loc = tables["FileLocations"].get(str(field(frame, "file_location_id")), "")
    if not loc:
      continue
    file = tables["FileNames"].get(str(field(loc, "file_name_id")), '""').strip('"')
    func = tables["FunctionNames"].get(str(field(loc, "function_name_id")), '""').strip('"')
    # The printed parent id is one more than the parent's own number (0: none).
    frames[int(fid)] = (file, field(loc, "line"), func, field(frame, "parent_frame_id") - 1)
  return frames


def parse_hlo(text: str) -> Module:
  """An `after_optimizations.txt` dump: its computations, entry and stack frames."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if line.startswith("}"):
      current = None
      continue
    m = COMPUTATION.match(line)
    if m and line.rstrip().endswith("{"):
      current = computations.setdefault(m.group(2), [])
      entry = m.group(2) if m.group(1) else entry
    elif current is not None:
      instr = parse_instruction(line)
      if instr:
        current.append(instr)
  if entry is None:
    raise ValueError("error: no ENTRY computation in the HLO text: pass the module's "
                     "*.after_optimizations.txt dump (--xla_dump_hlo_as_text).")
  name = re.match(r"HloModule ([\w.\-]+)", text)
  return Module(computations, entry, _frame_tables(text), name.group(1) if name else "")


def read_text(path: str) -> str:
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def read_hlo(path: str) -> Module:
  return parse_hlo(read_text(path))


def source_line(module: Module, instr: Instruction, project: str = "vit_jax/") -> str:
  """The innermost frame of `instr`'s stack in a project file: `vit.py:171 Encoder1DBlock...`;
  else the innermost frame of all."""
  chain, fid = [], instr.attr(r"stack_frame_id=(\d+)")
  fid = int(fid) if fid else 0
  while fid in module.frames and len(chain) < 64:
    chain.append(module.frames[fid])
    fid = module.frames[fid][3]
  ours = [f for f in chain if f[0].startswith(project)] or chain
  if not ours:
    return ""
  file, line, func, _ = ours[0]
  return f"{file.rsplit('/', 1)[-1]}:{line} {func}"


def bytes_moved(module: Module, instr: Instruction) -> float:
  """Operand + output bytes of one launch, each operand buffer once; a library call's
  workspace (a trailing u8/s8 array of its output tuple) left out."""
  outputs = tuple_parts(instr.shape)
  if instr.opcode == "custom-call" and len(outputs) > 1 and re.match(r"[us]8\[", outputs[-1]):
    outputs = outputs[:-1]
  operands = set(instr.operands)
  return sum(map(shape_bytes, outputs)) + sum(shape_bytes(module.operand_shape(o))
                                              for o in operands)


@dataclasses.dataclass
class Kernel:
  name: str
  dur_us: float
  hlo_op: str  # The HLO instruction, or the command buffer (CUDA graph) that ran it.


def read_trace(path: str, module: Optional[str] = None) -> tuple[list[Kernel], str]:
  """The GPU's kernels (and memsets / memcpys) of one HLO module in a perfetto JSON trace, in
  time order, and that module's name (`module`, else the one with the most GPU time)."""
  events = json.loads(read_text(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
  ops = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpus
         and "hlo_module" in e.get("args", {})]
  if not ops:
    raise ValueError(f"error: {path} has no GPU events with an hlo_module: trace the step with "
                     "jax.profiler (throughput.py --profile_dir) on a GPU.")
  time = collections.Counter()
  for e in ops:
    time[e["args"]["hlo_module"]] += float(e.get("dur", 0))
  module = module or time.most_common(1)[0][0]
  ops.sort(key=lambda e: float(e["ts"]))
  return [Kernel(e["name"], float(e.get("dur", 0)), e["args"].get("hlo_op", ""))
          for e in ops if e["args"]["hlo_module"] == module], module


# Library kernels by name (first match): cuBLAS's, cuDNN's attention and convolutions.
LIBRARY = (
    ("attention bwd (cuDNN)", r"sdpa.*bprop|fmha.*(bprop|bwd|backward)|dot_do_o|convert_dq|dq_"),
    ("attention fwd (cuDNN)", r"sdpa.*fprop|fmha|flash_fprop"),
    ("convolution (cuDNN)", r"conv|fprop_implicit|nhwcAddPadding|s16816fprop|wgrad|dgrad"),
    ("matmul (cuBLAS)", r"nvjet|gemm|cublas|splitKreduce|sm\d+_xmma"),
    ("memset / memcpy", r"^memset|^memcpy"),
)
# The custom-call targets of each library group (their shapes give bytes and FLOPs).
TARGETS = {"matmul (cuBLAS)": r"__cublas",
           "attention fwd (cuDNN)": r"__cudnn\$fmha(?!.*Backward)",
           "attention bwd (cuDNN)": r"__cudnn\$fmha.*Backward",
           "convolution (cuDNN)": r"__cudnn\$conv"}
# What a fused instruction computes, by priority: a fusion is named for the first one it holds.
ROLES = ("collective", "matmul (Triton)", "pad / slice", "LayerNorm bwd", "LayerNorm fwd",
         "bias + GELU bwd", "bias + GELU fwd", "matmul split-K reduce", "optimizer (AdamW)",
         "gradient norm", "loss / softmax / head", "bias gradient", "residual add",
         "gradient sum", "copy / transpose", "cast", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
PLUMBING = ("parameter", "constant", "bitcast", "broadcast", "tuple", "get-tuple-element", "iota")


def library_group(kernel: Kernel) -> str:
  for group, pattern in LIBRARY:
    if re.search(pattern, kernel.name, re.I) or re.search(pattern, kernel.hlo_op, re.I):
      return group
  return "other library"


def _functions(module: Module, instr: Instruction) -> list[tuple[str, str]]:
  """(file, function) of each frame of `instr`'s stack, innermost first."""
  out, fid = [], instr.attr(r"stack_frame_id=(\d+)")
  fid = int(fid) if fid else 0
  while fid in module.frames and len(out) < 64:
    out.append(module.frames[fid][:3:2])
    fid = module.frames[fid][3]
  return out


def role(module: Module, instr: Instruction) -> Optional[str]:
  """What one fused instruction computes (ROLES), from its opcode, its op_name (the JAX
  scope: `transpose(jvp(...))` is the backward pass) and the functions that made it."""
  op, path = instr.opcode, instr.op_name
  if op in PLUMBING:
    return None
  if re.sub(r"-(start|done)$", "", op) in COLLECTIVES:
    return "collective"
  if op in ("dot", "convolution"):
    return "matmul (Triton)"
  if op in ("pad", "slice"):
    return "pad / slice"
  backward = "transpose(" in path
  frames = _functions(module, instr)
  if any("optax/" in f and "loss" not in f for f, _ in frames):
    norm = any(re.search(r"global_norm|tree_norm|_square|clip", fn) for _, fn in frames)
    return "gradient norm" if norm else "optimizer (AdamW)"
  if re.search(r"LayerNorm|_norm/", path):
    return "LayerNorm bwd" if backward else "LayerNorm fwd"
  if re.search(r"MlpBlock_\d+/(?!Dense)", path) or any(fn == "gelu" for _, fn in frames):
    return "bias + GELU bwd" if backward else "bias + GELU fwd"
  if op == "reduce" and path.endswith("/dot_general"):
    return "matmul split-K reduce"
  if any("losses" in f for f, _ in frames) or re.search(r"/head/|_pool/|softmax", path):
    return "loss / softmax / head"
  if op == "reduce" and backward and path.endswith("reduce_sum"):
    return "bias gradient"
  if op == "add" and re.search(r"encoderblock_\d+/add(_any)?$", path):
    return "residual add"
  if op == "add" and path.endswith("add_any"):  # A value used twice: its gradients summed.
    return "gradient sum"
  if op in ("transpose", "copy"):
    return "copy / transpose"
  if op == "convert":
    return "cast"
  return "other"


def fusion_roles(module: Module, instr: Instruction) -> list[str]:
  """The roles of a fusion's instructions, in ROLES order; a slice or pad counts only where it
  moves at least a quarter of the fusion's output (not the class token's [:, 0])."""
  big = shape_bytes(instr.shape) / 4
  found = set()
  for i in (module.fused(instr) or [instr]):
    r = role(module, i)
    if r == "pad / slice" and shape_bytes(i.shape) < big:
      r = "other"
    if r:
      found.add(r)
  return [r for r in ROLES if r in found] or ["other"]


def fusion_group(roles: list[str]) -> str:
  """A fusion's group in the table: what its first role says, XLA's kernel."""
  name = roles[0]
  return f"{name} (XLA)" if name != "pad / slice" else "pads / slices (XLA)"


def _dims(shape: str) -> list[int]:
  m = ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _prod(values) -> int:
  n = 1
  for v in values:
    n *= v
  return n


def flops(module: Module, instr: Instruction) -> float:
  """FLOPs of a library call (2 per multiply-add): a cuBLAS matmul, cuDNN's attention (the
  backward pass as 2.5 forwards), a convolution; 0 where the shapes do not say."""
  out = _dims(tuple_parts(instr.shape)[0])
  if "__cublas" in instr.target:
    lhs = _dims(module.operand_shape(instr.operands[0]))
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    if not contracting:
      return 0.0
    return 2.0 * _prod(out) * _prod(lhs[int(d.strip('"'))]
                                    for d in contracting.group(1).split(",") if d)
  if "__cudnn$fmha" in instr.target:
    scores = re.search(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]', instr.attrs)
    head = _dims(module.operand_shape(instr.operands[0]))[-1:]
    if not (scores and head):
      return 0.0
    forward = 4.0 * _prod(int(d.strip('"')) for d in scores.group(1).split(",")) * head[0]
    return forward * (2.5 if "Backward" in instr.target else 1.0)
  if "__cudnn$conv" in instr.target:
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    rhs = _dims(module.operand_shape(instr.operands[1]))
    if not labels or len(rhs) != len(labels.group(1)):
      return 0.0
    return 2.0 * _prod(out) * _prod(rhs) / rhs[labels.group(1).index("o")]
  return 0.0


@dataclasses.dataclass
class Row:
  """One group of the table, or one fusion, per step."""
  name: str
  ms: float = 0.0
  launches: float = 0.0
  bytes: float = 0.0
  flops: float = 0.0
  group: str = ""  # A fusion's group.
  detail: str = ""  # A fusion's roles.


def infer_steps(kernels: list[Kernel], module: Module) -> int:
  """How many executions of the module the trace holds: the most common count of launches per
  instruction among the kernels named after one (a deduplicated kernel runs for each of the
  instructions that share it)."""
  shared = collections.Counter(i.attr(r'deduplicated_name="([^"]*)"')
                               for i in module.computations[module.entry])
  launches = collections.Counter(k.name for k in kernels)
  counts = collections.Counter()
  for name, n in launches.items():
    instr = module.instruction_of_kernel(name)
    if instr is not None:
      group = instr.attr(r'deduplicated_name="([^"]*)"')
      counts[n / (shared[group] if group else 1)] += 1
  if not counts:
    raise ValueError("error: no kernel in the trace is named after an instruction of the HLO: "
                     "pass the trace and the HLO dump of the same process.")
  return max(1, round(counts.most_common(1)[0][0]))


def _library_totals(module: Module) -> dict[str, Row]:
  """Bytes and FLOPs of each library group's calls, once per execution of the module."""
  rows = {}
  for instr in module.computations[module.entry]:
    for group, pattern in TARGETS.items():
      if instr.opcode == "custom-call" and re.search(pattern, instr.target):
        row = rows.setdefault(group, Row(group))
        row.bytes += bytes_moved(module, instr)
        row.flops += flops(module, instr)
  return rows


def _sources(module: Module, instr: Instruction, n: int = 3) -> str:
  lines = collections.Counter(source_line(module, i) for i in module.fused(instr) or [instr]
                              if i.opcode not in PLUMBING)
  return ", ".join(line for line, _ in lines.most_common() if line)[:200] if n else ""


def tabulate(kernels: list[Kernel], module: Module, steps: int) -> tuple[dict, dict]:
  """Per step: a Row for each group (ms, launches, bytes, FLOPs) and one for each fusion."""
  groups, fusions, library = {}, {}, _library_totals(module)
  for k in kernels:
    instr = module.instruction_of_kernel(k.name)
    if instr is None or instr.opcode == "custom-call":
      group, moved = library_group(k), 0.0
    else:
      if instr.name not in fusions:
        roles = fusion_roles(module, instr)
        fusions[instr.name] = Row(instr.name, group=fusion_group(roles), detail=", ".join(roles))
      row = fusions[instr.name]
      group, moved = row.group, bytes_moved(module, instr)
      row.ms, row.launches, row.bytes = (row.ms + k.dur_us / 1e3 / steps,
                                         row.launches + 1 / steps, row.bytes + moved / steps)
    row = groups.setdefault(group, Row(group))
    row.ms, row.launches, row.bytes = (row.ms + k.dur_us / 1e3 / steps, row.launches + 1 / steps,
                                       row.bytes + moved / steps)
  for group, totals in library.items():
    if group in groups:
      groups[group].bytes, groups[group].flops = totals.bytes, totals.flops
  return groups, fusions


def _gbps(row: Row) -> float:
  return row.bytes / row.ms / 1e6 if row.ms else 0.0


def format_groups(groups: dict, hbm_gbps: float) -> str:
  busy = sum(r.ms for r in groups.values())
  lines = ["| group | ms/step | share | launches/step | GB/step | GB/s | of HBM | TFLOP/s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  xla = Row("all XLA fusions")
  for r in sorted(groups.values(), key=lambda r: -r.ms):
    tflops = f"{r.flops / r.ms / 1e9:.0f}" if r.flops else ""
    lines.append(f"| {r.name} | {r.ms:.2f} | {r.ms / busy:.1%} | {r.launches:.0f} | "
                 f"{r.bytes / 1e9:.2f} | {_gbps(r):,.0f} | {_gbps(r) / hbm_gbps:.0%} | {tflops} |")
    if r.name.endswith("(XLA)"):
      xla.ms, xla.launches = xla.ms + r.ms, xla.launches + r.launches
      xla.bytes += r.bytes
  lines.append(f"| **{xla.name}** | {xla.ms:.2f} | {xla.ms / busy:.1%} | {xla.launches:.0f} | "
               f"{xla.bytes / 1e9:.2f} | {_gbps(xla):,.0f} | {_gbps(xla) / hbm_gbps:.0%} | |")
  lines.append(f"| **GPU busy** | {busy:.2f} | 100% | "
               f"{sum(r.launches for r in groups.values()):.0f} | | | | |")
  return "\n".join(lines)


def _shapes(module: Module, instr: Instruction) -> str:
  """`out <- operands`, repeats counted: `f32[256,197,768] <- 3x f32[256,197,768], ...`."""
  strip = lambda s: re.sub(r"\{[^}]*\}", "", s)  # noqa: E731  (layouts)
  ins = collections.Counter(strip(module.operand_shape(o)) for o in dict.fromkeys(instr.operands))
  parts = [f"{n}x {s}" if n > 1 else s
           for s, n in sorted(ins.items(), key=lambda x: -shape_bytes(x[0]))]
  return f"{strip(instr.shape)} <- {', '.join(parts)}"


def format_slow_fusions(fusions: dict, module: Module, hbm_gbps: float, top: int) -> str:
  """The `top` fusions by time among those under half the HBM bandwidth."""
  slow = sorted((r for r in fusions.values() if _gbps(r) < hbm_gbps / 2), key=lambda r: -r.ms)
  lines = ["| fusion | ms/step | launches/step | MB/launch | GB/s | ms at HBM | computes | "
           "shapes (out <- operands) | model code |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
  for r in slow[:top]:
    instr = module.by_name[r.name]
    lines.append(f"| {r.name} | {r.ms:.2f} | {r.launches:.0f} | {r.bytes / r.launches / 1e6:.1f} | "
                 f"{_gbps(r):,.0f} | {r.bytes / hbm_gbps / 1e6:.2f} | {r.detail} | "
                 f"`{_shapes(module, instr)}` | {_sources(module, instr)} |")
  return "\n".join(lines)


def _one(folder: pathlib.Path, pattern: str, what: str) -> str:
  found = sorted(folder.glob(pattern))
  if len(found) != 1:
    raise ValueError(f"error: {folder} holds {len(found)} files matching {pattern}; name the "
                     f"{what} with --{what}.")
  return str(found[0])


def report(trace: str, hlo: str, hbm_gbps: float, top: int, module_name: Optional[str] = None,
           steps: Optional[int] = None) -> str:
  """The whole report: the grouped table and the slow fusions, as Markdown."""
  module = read_hlo(hlo)
  kernels, name = read_trace(trace, module_name or module.entry_module_name)
  steps = steps or infer_steps(kernels, module)
  groups, fusions = tabulate(kernels, module, steps)
  return "\n\n".join([
      f"Module `{name}`, {steps} steps traced, {len(kernels)} GPU events; "
      f"HBM {hbm_gbps:,.0f} GB/s.",
      format_groups(groups, hbm_gbps),
      f"Fusions under half the HBM bandwidth ({hbm_gbps / 2:,.0f} GB/s), by time (top {top}):",
      format_slow_fusions(fusions, module, hbm_gbps, top)])


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("folder", nargs="?", help="a folder with one *.trace.json.gz and one "
                      "*after_optimizations.txt[.gz]")
  parser.add_argument("--trace", help="the perfetto JSON trace (.json or .json.gz)")
  parser.add_argument("--hlo", help="the module's *.after_optimizations.txt[.gz] HLO dump")
  parser.add_argument("--module", help="the HLO module's name in the trace (default: the HLO's)")
  parser.add_argument("--steps", type=int, help="executions traced (default: from the trace)")
  parser.add_argument("--hbm_gbps", type=float, default=HBM_GBPS["H200"],
                      help="HBM bandwidth in GB/s (default: the H200's; H100 SXM: "
                      f"{HBM_GBPS['H100']:.0f})")
  parser.add_argument("--top", type=int, default=15, help="slow fusions to list")
  args = parser.parse_args(argv)
  try:
    folder = pathlib.Path(args.folder) if args.folder else None
    if not (args.trace or folder) or not (args.hlo or folder):
      raise ValueError("error: name a folder, or both --trace and --hlo.")
    trace = args.trace or _one(folder, "*.trace.json*", "trace")
    hlo = args.hlo or _one(folder, "*after_optimizations.txt*", "hlo")
    print(report(trace, hlo, args.hbm_gbps, args.top, args.module, args.steps))
  except (ValueError, OSError) as e:
    sys.exit(str(e) if str(e).startswith("error:") else f"error: {e}")


if __name__ == "__main__":
  main()
