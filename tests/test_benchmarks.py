"""benchmarks/throughput.py: its FLOP count, its report, and a whole run on CPU."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO
from vit_jax import models

sys.path.insert(0, str(REPO / "benchmarks"))
import throughput  # noqa: E402


def test_analytic_flops_match_the_published_figure():
  # ViT-B/16 at 224 px: 17.6 GMACs (timm, fvcore) = 35.1 GFLOP.
  flops = throughput.forward_flops(models.model_config("ViT-B_16"), 224, 1000)
  assert abs(flops / 35.1e9 - 1) < 0.005
  assert throughput.forward_flops(models.model_config("R50+ViT-B_16"), 224, 1000) is None


def test_benchmark_runs_end_to_end_on_cpu(tmp_path):
  out = tmp_path / "throughput.json"
  throughput.main(["--model", "ViT-Ti_16", "--image_size", "32", "--batch_size", "8",
                   "--num_layers", "1", "--dtype", "float32", "--timm", "off",
                   "--warmup", "1", "--steps", "1", "--repeats", "1", "--json_out", str(out)])
  report = json.loads(out.read_text())
  assert {"device", "versions", "forward_flops_per_image", "flops_source", "peak_tflops",
          "attention_impl_resolved", "results"} <= set(report)
  assert report["peak_tflops"] is None  # CPU: MFU is n/a unless --peak_tflops is given.
  rows = {(r["framework"], r["phase"]): r for r in report["results"]}
  assert set(rows) == {("vit_jax", "infer"), ("vit_jax", "train")}
  for r in rows.values():
    assert set(throughput.RESULT_KEYS) <= set(r) and r["img_per_s"] > 0 and r["mfu"] is None
  assert np.isfinite(report["vit_jax"]["final_loss"])
  # The analytic count agrees with XLA's (which adds the elementwise work).
  xla = report["vit_jax"]["xla_forward_gflops"] * 1e9
  assert 0.8 < report["forward_flops_per_image"] / xla <= 1.0


def test_rows_give_mfu_and_ratio_to_timm_compile():
  step = lambda s: {"step_s": s, "compile_s": 0.0, "peak_bytes": 2**30}  # noqa: E731
  report = {"batch_size": 100, "forward_flops_per_image": 1e9, "peak_tflops": 1.0,
            "vit_jax": {"phases": {"train": step(0.5), "infer": step(0.1)}},
            "timm": {"compile": {"train": step(1.0), "infer": step(0.2)}}}
  rows = {(r["framework"], r["phase"]): r for r in throughput._rows(report)}
  train = rows[("vit_jax", "train")]
  assert train["img_per_s"] == 200 and train["ratio_to_timm_compile"] == 2.0
  assert train["mfu"] == pytest.approx(200 * 3e9 / 1e12) and train["peak_memory_gb"] == 1.0
  assert rows[("vit_jax", "infer")]["mfu"] == pytest.approx(1000 * 1e9 / 1e12)
  assert rows[("timm_compile", "infer")]["ratio_to_timm_compile"] == 1.0
  assert "timm_compile" in throughput._table(list(rows.values()))


def test_serving_benchmark_runs_every_format(tmp_path):
  import serving
  out = tmp_path / "serving.json"
  report = serving.main(["--model", "ViT-Ti_16", "--image_size", "32", "--num_layers", "1",
                         "--num_classes", "10", "--batch_size", "3", "--warmup", "0", "--steps",
                         "1", "--repeats", "1", "--json_out", str(out), "--set", "gelu=exact",
                         "--set", "layer_norm_eps=1e-5", "--perturb", "0.02"])
  assert json.loads(out.read_text())["results"] == report["results"]
  assert report["fields"] == {"gelu": "exact", "layer_norm_eps": 1e-5}
  rows = {r["format"]: r for r in report["results"]}
  assert list(rows) == ["jax", "savedmodel", "onnx", "tflite"]
  assert rows["jax"]["ratio_to_jax"] == 1.0 and rows["jax"]["export_s"] is None
  for fmt, r in rows.items():
    assert r["img_per_s"] > 0 and r["max_abs_logit_diff_vs_jax"] < 1e-4, (fmt, r)
  assert {"jax", "onnxruntime", "tf2onnx"} <= set(report["versions"])


def test_the_stress_script_runs_the_readmes_first_command():
  import quickstart_stress
  command = quickstart_stress.readme_command()
  assert command.startswith("python3 -m venv .venv && ")
  assert "install -r requirements.lock" in command
  assert command.endswith(".venv/bin/vit-train --config quickstart "
                          "--workdir /tmp/vit_quickstart")
  assert quickstart_stress.workdir_of(command) == "/tmp/vit_quickstart"


def test_the_stress_scripts_cpu_limit_holds_the_command_in_its_cgroup():
  import quickstart_stress
  if os.geteuid() != 0:
    pytest.skip("making a cgroup needs root")
  with quickstart_stress.cpu_limited(0.5) as argv:
    group = pathlib.Path(argv("")[-1])
    quota = group / "cpu.max" if (group / "cpu.max").exists() else group / "cpu.cfs_quota_us"
    assert quota.read_text().split()[0] == "50000"  # Half of each 100 ms period.
    out = subprocess.run(argv("cat /proc/self/cgroup"), check=True, capture_output=True,
                         text=True, timeout=60).stdout
    assert any(line.endswith(f"/{group.name}") for line in out.splitlines()), out
  assert not group.exists()
