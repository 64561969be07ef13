"""benchmarks/gpu_kernels.py: a tiny trace and HLO dump written in the real formats' shapes (a
perfetto JSON trace whose GPU events carry hlo_module / hlo_op, an after_optimizations HLO text
with tuple shapes, `#i` operands, deduplicated fusions and stack-frame tables), read back into
the per-kernel table; each figure is counted by hand below."""
import gzip
import json
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_kernels  # noqa: E402

BLOCK = "VisionTransformer._encode/Transformer/encoderblock_0"
LN = f"jit(step_fn)/transpose(jvp(VisionTransformer))/{BLOCK}/LayerNorm_0"
PAD = f"jit(step_fn)/jvp(VisionTransformer)/{BLOCK}/MultiHeadDotProductAttention_1/jit(_pad)/pad"
GEMM = ('{"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],'
        '"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],'
        '"rhs_contracting_dimensions":["0"]}}}')
HLO = f"""HloModule jit_step_fn, is_scheduled=true, entry_computation_layout={{(f32[64,256]{{1,0}})->f32[256]{{0}}}}

FileNames
1 "vit_jax/models/vit.py"
2 "vit_jax/models/layer_norm.py"
3 "site-packages/optax/_src/transform.py"

FunctionNames
1 "Encoder1DBlock.__call__"
2 "LayerNorm.__call__"
3 "scale_by_adam.<locals>.update_fn"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=166 end_line=166 column=8 end_column=71}}
2 {{file_name_id=2 function_name_id=2 line=34 end_line=34 column=17 end_column=57}}
3 {{file_name_id=3 function_name_id=3 line=300 end_line=300 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}
3 {{file_location_id=3 parent_frame_id=1}}

%region_add (a.1: f32[], b.1: f32[]) -> f32[] {{
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a.1, %b.1), metadata={{op_name="jit(step_fn)/optax/reduce_sum" stack_frame_id=3}}
}}

%fused_ln (param_0.1: f32[64,256], param_1.2: f32[256]) -> (f32[64], bf16[64,256]) {{
  %param_0.1 = f32[64,256]{{1,0}} parameter(0)
  %param_1.2 = f32[256]{{0}} parameter(1)
  %broadcast.1 = f32[64,256]{{1,0}} broadcast(%param_1.2), dimensions={{1}}
  %multiply.1 = f32[64,256]{{1,0}} multiply(%param_0.1, %broadcast.1), metadata={{op_name="{LN}/mul" stack_frame_id=2}}
  %constant.1 = f32[] constant(0)
  %reduce.1 = f32[64]{{0}} reduce(%multiply.1, %constant.1), dimensions={{1}}, to_apply=%region_add, metadata={{op_name="{LN}/reduce_sum" stack_frame_id=2}}
  %convert.1 = bf16[64,256]{{1,0}} convert(%multiply.1), metadata={{op_name="{LN}/convert_element_type" stack_frame_id=2}}
  ROOT %tuple.1 = (f32[64]{{0}}, bf16[64,256]{{1,0}}) tuple(%reduce.1, %convert.1)
}}

%fused_pad (param_0.3: bf16[2,5,4]) -> bf16[2,6,4] {{
  %param_0.3 = bf16[2,5,4]{{2,1,0}} parameter(0)
  %constant.2 = bf16[] constant(0)
  ROOT %pad.1 = bf16[2,6,4]{{2,1,0}} pad(%param_0.3, %constant.2), padding=0_0x0_1x0_0, metadata={{op_name="{PAD}"}}
}}

%fused_adam (param_0.5: f32[256], param_1.6: f32[256]) -> f32[256] {{
  %param_0.5 = f32[256]{{0}} parameter(0)
  %param_1.6 = f32[256]{{0}} parameter(1)
  ROOT %add.3 = f32[256]{{0}} add(%param_0.5, %param_1.6), metadata={{op_name="jit(step_fn)/add" stack_frame_id=3}}
}}

ENTRY %main.9 (p0: f32[64,256], p1: f32[256], p2: bf16[256,128], p3: bf16[2,5,4], p4: bf16[2,5,4]) -> (bf16[64,128], f32[256], bf16[2,6,4]) {{
  %p0 = f32[64,256]{{1,0}} parameter(0)
  %p1 = f32[256]{{0}} parameter(1)
  %p2 = bf16[256,128]{{1,0}} parameter(2)
  %p3 = bf16[2,5,4]{{2,1,0}} parameter(3)
  %p4 = bf16[2,5,4]{{2,1,0}} parameter(4)
  %input_reduce_fusion.7 = (f32[64]{{0}}, bf16[64,256]{{1,0}}) fusion(%p0, /*index=1*/%p1), kind=kInput, calls=%fused_ln, metadata={{op_name="{LN}/reduce_sum" stack_frame_id=2}}
  %custom-call.1 = (bf16[64,128]{{1,0}}, s8[1024]{{0}}) custom-call(%input_reduce_fusion.7#1, %p2), custom_call_target="__cublas$lt$matmul", backend_config={GEMM}
  %loop_pad_fusion.1 = bf16[2,6,4]{{2,1,0}} fusion(%p3), kind=kLoop, calls=%fused_pad, metadata={{op_name="{PAD}" deduplicated_name="loop_pad_fusion.1"}}
  %loop_pad_fusion.2 = bf16[2,6,4]{{2,1,0}} fusion(%p4), kind=kLoop, calls=%fused_pad, metadata={{op_name="{PAD}" deduplicated_name="loop_pad_fusion.1"}}
  %loop_add_fusion.3 = f32[256]{{0}} fusion(%p1, %p1), kind=kLoop, calls=%fused_adam, metadata={{op_name="jit(step_fn)/add" stack_frame_id=3}}
  ROOT %tuple.9 = (bf16[64,128]{{1,0}}, f32[256]{{0}}, /*index=2*/bf16[2,6,4]{{2,1,0}}) tuple(%custom-call.1#0, %loop_add_fusion.3, %loop_pad_fusion.2)
}}
"""
# One step's GPU events: (kernel, microseconds, hlo_op). The pad's two instructions share
# the kernel named after the second of them, as XLA names a deduplicated fusion's kernel.
STEP = [("input_reduce_fusion_7", 10.0, "command_buffer_1"),
        ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", 20.0, "command_buffer_1"),
        ("loop_pad_fusion_2", 1.0, "command_buffer_1"),
        ("loop_pad_fusion_2", 1.0, "command_buffer_1"),
        ("loop_add_fusion_3", 2.0, "command_buffer_1"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_kernel0_0", 5.0,
         "command_buffer_1"),
        ("Memset 3", 0.5, "command_buffer_1")]
# Hand counts, bytes of one launch: operands + outputs, each buffer once.
LN_BYTES = 64 * 256 * 4 + 256 * 4 + 64 * 4 + 64 * 256 * 2  # f32 in, scale, f32[64] + bf16 out.
PAD_BYTES = 2 * 5 * 4 * 2 + 2 * 6 * 4 * 2
ADAM_BYTES = 256 * 4 * 2  # %p1 twice is one buffer read, plus the output.
GEMM_BYTES = 64 * 256 * 2 + 256 * 128 * 2 + 64 * 128 * 2  # Its s8 workspace left out.
GEMM_FLOPS = 2 * 64 * 128 * 256


def write_trace(path, steps=2):
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 701, "tid": 5, "ts": 0.0, "dur": 999.0, "name": "BUFFER_FLUSH"},
            {"ph": "X", "pid": 1, "tid": 14, "ts": 1.0, "dur": 500.0, "name": "fusion_9",
             "args": {"hlo_module": "jit_other", "hlo_op": "fusion.9"}}]
  ts = 1000.0
  for _ in range(steps):
    for name, dur, op in STEP:
      events.append({"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name,
                     "args": {"hlo_module": "jit_step_fn", "hlo_op": op, "correlation_id": "1"}})
      ts += dur + 1
  with gzip.open(path, "wt") as f:
    json.dump({"displayTimeUnit": "ns", "metadata": {"highres-ticks": True},
               "traceEvents": events + [{}]}, f)


@pytest.fixture
def dump(tmp_path):
  write_trace(tmp_path / "step.trace.json.gz")
  name = "module_0001.jit_step_fn.sm_9.0_gpu_after_optimizations.txt.gz"
  with gzip.open(tmp_path / name, "wt") as f:
    f.write(HLO)
  return tmp_path


def test_the_hlo_parser_reads_shapes_operands_and_frames():
  module = gpu_kernels.parse_hlo(HLO)
  assert module.entry == "main.9" and module.entry_module_name == "jit_step_fn"
  fusion = module.by_name["input_reduce_fusion.7"]
  assert (fusion.opcode, fusion.operands, fusion.calls) == ("fusion", ["p0", "p1"], ["fused_ln"])
  assert module.operand_shape("input_reduce_fusion.7#1") == "bf16[64,256]{1,0}"
  assert module.by_name["custom-call.1"].target == "__cublas$lt$matmul"
  # The reduction's lambda is not part of what the fusion computes.
  assert [i.name for i in module.fused(fusion)][-1] == "tuple.1"
  assert "add.9" not in {i.name for i in module.fused(fusion)}
  assert gpu_kernels.source_line(module, fusion) == "layer_norm.py:34 LayerNorm.__call__"
  assert module.instruction_of_kernel("loop_pad_fusion_2").name == "loop_pad_fusion.2"
  assert module.instruction_of_kernel("custom_call_1").name == "custom-call.1"


def test_bytes_and_flops_are_the_hand_counts():
  module = gpu_kernels.parse_hlo(HLO)
  moved = {name: gpu_kernels.bytes_moved(module, module.by_name[name]) for name in
           ("input_reduce_fusion.7", "loop_pad_fusion.1", "loop_add_fusion.3", "custom-call.1")}
  assert moved == {"input_reduce_fusion.7": LN_BYTES, "loop_pad_fusion.1": PAD_BYTES,
                   "loop_add_fusion.3": ADAM_BYTES, "custom-call.1": GEMM_BYTES}
  assert gpu_kernels.flops(module, module.by_name["custom-call.1"]) == GEMM_FLOPS
  assert gpu_kernels.shape_bytes("(bf16[2,3]{1,0}, /*index=1*/f32[4]{0}, s4[2])") == 12 + 16 + 1


def test_kernels_are_grouped_by_what_they_compute(dump):
  module = gpu_kernels.read_hlo(str(next(dump.glob("*after_optimizations*"))))
  trace = str(dump / "step.trace.json.gz")
  assert gpu_kernels.read_trace(trace)[1] == "jit_other"  # Unnamed: the most GPU time.
  kernels, name = gpu_kernels.read_trace(trace, module.entry_module_name)
  assert name == "jit_step_fn" and len(kernels) == 2 * len(STEP)  # Host and jit_other left out.
  steps = gpu_kernels.infer_steps(kernels, module)
  assert steps == 2  # The pad's 4 launches are 2 instructions' 2 each.
  groups, fusions = gpu_kernels.tabulate(kernels, module, steps)
  per_step = {g: (round(r.ms * 1e3, 6), r.launches, r.bytes) for g, r in groups.items()}
  assert per_step == {
      "LayerNorm bwd (XLA)": (10.0, 1, LN_BYTES),
      "matmul (cuBLAS)": (20.0, 1, GEMM_BYTES),
      "pads / slices (XLA)": (2.0, 2, 2 * PAD_BYTES),
      "optimizer (AdamW) (XLA)": (2.0, 1, ADAM_BYTES),
      "attention bwd (cuDNN)": (5.0, 1, 0),  # No cuDNN call in this HLO to count bytes from.
      "memset / memcpy": (0.5, 1, 0)}
  assert groups["matmul (cuBLAS)"].flops == GEMM_FLOPS
  assert fusions["input_reduce_fusion.7"].detail == "LayerNorm bwd"  # Its convert too.
  assert set(fusions) == {"input_reduce_fusion.7", "loop_pad_fusion.2", "loop_add_fusion.3"}


def test_the_report_prints_the_table_and_the_slow_fusions(dump, capsys):
  gpu_kernels.main([str(dump), "--hbm_gbps", "100", "--top", "2"])
  out = capsys.readouterr().out
  assert "Module `jit_step_fn`, 2 steps traced, 14 GPU events; HBM 100 GB/s." in out
  # 99,584 bytes in 10 us: 9.96 GB/s, 10% of 100 GB/s; 4.19 MFLOP in 20 us: 0.21 TFLOP/s.
  assert "| LayerNorm bwd (XLA) | 0.01 | 25.3% | 1 | 0.00 | 10 | 10% |  |" in out
  assert "| matmul (cuBLAS) | 0.02 | 50.6% | 1 | 0.00 | 6 | 6% | 0 |" in out
  assert "| **GPU busy** | 0.04 | 100% | 7 | | | | |" in out
  slow = out.split("by time (top 2):")[1]
  assert ("| input_reduce_fusion.7 | 0.01 | 1 | 0.1 | 10 | 0.00 | LayerNorm bwd | "
          "`(f32[64], bf16[64,256]) <- f32[64,256], f32[256]` | "
          "layer_norm.py:34 LayerNorm.__call__ |") in slow
  assert len([l for l in slow.splitlines() if l.startswith("| ")]) == 2 + 2  # Header, rule, 2 rows.


def test_bad_inputs_are_one_line(dump, tmp_path_factory):
  with pytest.raises(ValueError, match="^error: no ENTRY computation"):
    gpu_kernels.parse_hlo("HloModule m\n")
  empty = tmp_path_factory.mktemp("empty")
  with gzip.open(empty / "x.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": [{"ph": "X", "pid": 3, "name": "k", "ts": 0, "dur": 1}]}, f)
  with pytest.raises(ValueError, match="has no GPU events with an hlo_module"):
    gpu_kernels.read_trace(str(empty / "x.trace.json.gz"))
  write_trace(dump / "second.trace.json.gz")
  with pytest.raises(SystemExit, match="holds 2 files matching .*name the trace with --trace"):
    gpu_kernels.main([str(dump)])
  other = tmp_path_factory.mktemp("other")
  (other / "m.after_optimizations.txt").write_text(HLO.replace("_fusion.", "_other."))
  with pytest.raises(SystemExit, match="no kernel in the trace is named after an instruction"):
    gpu_kernels.main(["--trace", str(dump / "step.trace.json.gz"),
                      "--hlo", str(other / "m.after_optimizations.txt")])
