"""`vit-train --compile_only` and `--plan`, end to end: a run's steps compiled for TPU slices
without a TPU (libtpu's compile-only devices), tiny models so that each compile takes seconds;
the launcher's preflight, through its dry run."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import HEAD_TOO_BIG, REPO, TINY_CONFIG, finish, needs_libtpu, wait_for


# Params big enough to be sharded (sharding.fsdp_spec leaves arrays under 2**14 whole).
MEDIUM = ["--config.model.hidden_size=256", "--config.model.mlp_dim=1024"]
# A head of 2**23 classes, 1 G parameters: with Adam and its gradients more than a v5e chip's
# 16 GiB unsharded, half of it with mesh.fsdp=2 (small shapes compile in seconds; a wide
# encoder as big takes minutes).
HUGE = ["--num_classes=8388608", "--config.model.hidden_size=128", "--config.model.mlp_dim=256"]


def train_cli(*args: str, timeout: int = 300, env: dict | None = None
              ) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "vit_jax.tools.train", "--config", TINY_CONFIG,
                         *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        env=env)


def compile_json(topology: str, *overrides: str) -> dict:
  result = train_cli("--compile_only", "--topology", topology, "--json", *overrides)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory) -> dict:
  """`--compile_only --json` of the MEDIUM config on v5litepod-4 (v5e:2x2's other name), data
  parallel, with a compilation cache set: its report. JAX's persistent cache cannot load a
  program compiled for devices this machine lacks, and a rerun that read the first run's
  entries warned once a program that it could not, then compiled anyway: --compile_only
  leaves the cache alone (it writes none, so a rerun reads none), and the run's one line on
  stderr is its progress."""
  cache = tmp_path_factory.mktemp("jit")
  result = train_cli("--compile_only", "--topology", "v5litepod-4", "--json", *MEDIUM,
                     env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache)))
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 0 and len(lines) == 1, result.stderr
  assert lines[0].startswith("compiled the config in "), result.stderr
  assert not list(cache.iterdir())
  return json.loads(result.stdout)


@needs_libtpu
def test_single_host_compile_reports_memory_flops_collectives_and_a_bound(data_parallel):
  r = data_parallel
  assert (r["chips"], r["hosts"], r["device_kind"]) == (4, 1, "TPU v5 lite")
  assert r["fits"] and r["mesh"] == {"data": 4, "fsdp": 1} and r["per_chip_batch"] == 8
  train, evaluate = r["train"], r["eval"]
  assert 0 < train["total_bytes"] < r["hbm_capacity_bytes"] and evaluate["total_bytes"] > 0
  assert r["attention"] == {"asked": "auto", "took": "pallas"}
  assert train["kernel_flops"] > 0  # Pallas attention: XLA counts none of its FLOPs.
  assert train["total_flops"] == train["flops"] + train["kernel_flops"]
  assert train["total_flops"] > train["analytic_flops"] > 0
  assert abs(evaluate["analytic_flops"] * 3 - train["analytic_flops"]) < 1
  assert train["collectives"]["all-reduce"]["ops"] >= 1  # The gradients' mean.
  assert train["roofline"]["images_per_s"] > 0


@needs_libtpu
@pytest.mark.parametrize("mesh", [["--config.mesh.fsdp=4", "--config.mesh.dcn_data=2"],
                                  ["--config.mesh.fsdp=-1"]])  # Both -1: pretrain:'s mesh.
def test_multislice_splits_data_over_the_slices(mesh):
  """The run's multislice mesh: its data axis spans the slices (mesh.dcn_data, by default the
  slices found; one that is not is refused: test_sharding.py), fsdp stays within each."""
  r = compile_json("v5litepod-4", "--num_slices=2", *MEDIUM, *mesh)
  assert (r["chips"], r["hosts"], r["num_slices"]) == (8, 2, 2)
  assert r["fits"] and r["mesh"] == {"data": 2, "fsdp": 4} and r["dcn_data"] == 2


@needs_libtpu
def test_fsdp_shards_parameters_and_optimizer_state(data_parallel):
  """Data parallelism keeps every parameter on every chip (no all-gather); mesh.fsdp=4 keeps
  about a quarter of them, and of Adam's state, per chip, gathered as the step needs them."""
  data = data_parallel
  fsdp = compile_json("v5e:2x2", *MEDIUM, "--config.mesh.fsdp=4")
  assert "all-gather" not in data["train"]["collectives"]
  assert fsdp["train"]["collectives"]["all-gather"]["ops"] > 0
  assert fsdp["mesh"] == {"data": 1, "fsdp": 4}
  state = lambda r: r["train"]["alias_bytes"]  # The donated state: params, Adam's mu and nu.
  assert 0.2 < state(fsdp) / state(data) < 0.3


@needs_libtpu
def test_a_config_too_big_for_its_slice_exits_2_naming_the_fix():
  result = train_cli("--compile_only", "--topology", "v5e:2x2", *HUGE)
  assert result.returncode == 2, result.stderr
  (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
  assert "does not fit v5e:2x2 (4 chips)" in line and "GiB per chip over" in line
  assert "it fits with --config.mesh.data=-1 --config.mesh.fsdp=" in line
  assert not result.stdout


@needs_libtpu
def test_plan_chooses_the_mesh_and_remat():
  result = train_cli("--plan", "--topology", "v5e:2x2", *HUGE)
  assert result.returncode == 0, result.stderr
  use = result.stdout.splitlines()[-1]
  assert use.startswith("Use: --config.mesh.data=-1 --config.mesh.fsdp=")


@needs_libtpu
def test_a_plan_where_the_config_fits_says_so():
  result = train_cli("--plan", "--topology", "v5e:2x2")
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines()[-1] == "Use: the config as given"


@needs_libtpu
def test_a_plan_out_of_time_ends_with_its_verdict_and_sigterm_with_one_line(tmp_path, children):
  """--plan_timeout: one line, the closest candidate so far; SIGTERM during a compile: one line,
  not libtpu's stack trace, at once."""
  result = train_cli("--plan", "--topology", "v5e:2x2", *HUGE, "--plan_timeout=1")
  assert result.returncode == 2, result.stderr
  assert re.fullmatch(r"error: --plan_timeout=1: \d candidate\(s\) compiled in 1 s, none fits "
                      r"yet.*: give the search more time \(--plan_timeout\) or use a bigger "
                      r"slice", result.stderr.strip().splitlines()[-1]), result.stderr
  wide = ["--config.model.hidden_size=1024", "--config.model.mlp_dim=4096",
          "--config.model.num_layers=24", "--config.model.num_heads=16"]  # Compiles for minutes.
  proc = children(subprocess.Popen(
      [sys.executable, "-m", "vit_jax.tools.train", "--config", TINY_CONFIG, "--plan",
       "--topology", "v5e:2x2", *wide], cwd=REPO, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE))
  wait_for(lambda: "libtpu" in pathlib.Path(f"/proc/{proc.pid}/maps").read_text(), proc, 120,
           "libtpu loaded")
  time.sleep(3)  # The topology made, the search compiling.
  proc.send_signal(signal.SIGTERM)
  sent = time.time()
  _, stderr = finish(proc, 60)
  assert proc.returncode == 143, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == "stopped by SIGTERM", stderr[-3000:]
  assert "stack trace" not in stderr and time.time() - sent < 5, stderr[-3000:]


@needs_libtpu
def test_a_plan_for_a_config_that_cannot_run_names_its_field_not_the_slice():
  result = train_cli("--plan", "--topology", "v5e:2x2", "--config.total_steps=1",
                     "--config.warmup_steps=5")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      "error: config.warmup_steps=5: must be in [0, total steps=1]")


def test_compile_only_needs_a_topology_and_no_workdir():
  result = train_cli("--compile_only")
  assert result.returncode == 2
  assert result.stderr.strip().endswith("need --topology (e.g. v5e:4x4 or v5litepod-16)")
  result = train_cli()
  assert result.returncode == 2 and "--workdir must have a value" in result.stderr


def tpu_up(config_overrides: list[str], gcloud_env: dict | None = None, dry_run: bool = True):
  args = ["up", "--name", "vit", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-4",
          "--config", TINY_CONFIG, "--workdir", "runs/tiny", *(["--dry-run"] * dry_run),
          "--", *config_overrides]
  return subprocess.run([sys.executable, str(REPO / "launch" / "tpu_vm.py"), *args], cwd=REPO,
                        env=gcloud_env, capture_output=True, text=True, timeout=300)


@needs_libtpu
def test_launcher_preflight_runs_before_any_gcloud_command(fake_gcloud):
  fits = tpu_up([])
  assert fits.returncode == 0, fits.stderr
  assert "preflight:" in fits.stderr and "--compile_only --topology v5litepod-4" in fits.stderr
  assert fits.stdout.splitlines()[0].startswith("gcloud compute tpus tpu-vm create vit")
  # Not a dry run: a gcloud on PATH that records its calls is never called. The config is
  # refused by its parameter count, before a compile: the launcher passes on vit-train's line
  # whatever the reason (the search for a fix, which test_a_config_too_big_for_its_slice...
  # runs, took 36 s more of a 2-core machine here).
  env, log = fake_gcloud
  refused = tpu_up(HEAD_TOO_BIG, env, dry_run=False)
  assert refused.returncode == 2 and not refused.stdout and not log.exists()
  (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error: ")]
  assert line.startswith("error: preflight for v5litepod-4: config.model_name='ViT-Ti_16' with "
                         "its overrides and 134,217,728 classes"), refused.stderr
  assert "even sharded over all 4 devices of v5litepod-4" in line and "--no-preflight" in line
