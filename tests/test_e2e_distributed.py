"""A run whatever its layout, end to end on real data: 8 devices as data-parallel, fully
sharded and mixed meshes, one device against eight, two processes against one, and two
processes started by the multi-host launcher (launch/multihost.py) on localhost."""
import re
import socket
import subprocess

import numpy as np
import pytest

from helpers import REPO, TINY_CONFIG, cli, cpu_env, launch, read_scalars, run_cli, tiny_config
from vit_jax.train import loop


def test_mesh_layouts_give_the_same_losses(tmp_path, dataset):
  """8 devices as data-parallel, fully sharded (fsdp) and mixed give the same losses."""
  runs = {}
  for data, fsdp in ((8, 1), (1, 8), (2, 4)):
    workdir = tmp_path / f"{data}x{fsdp}"
    loop.train_and_evaluate(tiny_config(dataset, total_steps=6, **{"mesh.data": data, "mesh.fsdp": fsdp}),
                            str(workdir))
    runs[(data, fsdp)] = read_scalars(workdir, "train_loss")
  for layout, losses in runs.items():
    np.testing.assert_allclose(list(losses.values()), list(runs[(8, 1)].values()), atol=1e-5,
                               err_msg=str(layout))


@pytest.mark.slow
def test_one_device_matches_eight(tmp_path, dataset):
  eight = tmp_path / "eight"
  loop.train_and_evaluate(tiny_config(dataset, total_steps=6), str(eight))
  one = run_cli(cli(tmp_path / "one", dataset, "--config.total_steps=6"), devices=1)
  assert one.returncode == 0, one.stderr[-3000:]
  np.testing.assert_allclose(list(read_scalars(tmp_path / "one", "train_loss").values()),
                             list(read_scalars(eight, "train_loss").values()), atol=1e-5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, dataset):
  # Two data shards in both runs: the global batches do not depend on the process count.
  shards = "--config.data.num_shards=2"
  single = run_cli(cli(tmp_path / "single", dataset, "--config.total_steps=6", shards), devices=2)
  assert single.returncode == 0, single.stderr[-3000:]
  port = _free_port()
  procs = [subprocess.Popen(
      cli(tmp_path / "multi", dataset, "--config.total_steps=6", shards,
          f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"),
      env=cpu_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "process 1 of 2" in outs[1][1]
  np.testing.assert_allclose(list(read_scalars(tmp_path / "multi", "train_loss").values()),
                             list(read_scalars(tmp_path / "single", "train_loss").values()), atol=1e-5)


def test_a_failing_process_fails_the_launch(tmp_path):
  result = launch("multihost.py", "hosts", "--hosts", "localhost,localhost", "--config",
                  TINY_CONFIG, "--workdir", str(tmp_path), "--env", "JAX_PLATFORMS=cpu", "--",
                  "--config.batch_sise=3", timeout=300)
  assert result.returncode == 2  # A config error's status, from the first process to fail.
  # The first to fail is reported; the other either fails too or is stopped (SIGTERM).
  exits = re.findall(r"\[launch\] process (\d) exited with code (-?\d+)", result.stdout)
  assert sorted(i for i, _ in exits) == ["0", "1"] and exits[0][1] == "2"
  assert {code for _, code in exits} <= {"2", "-15"}
  assert "batch_sise" in result.stdout


@pytest.mark.slow
def test_two_local_processes_train_to_the_end(tmp_path, dataset):
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  result = launch(
      "multihost.py", "hosts", "--hosts", "localhost,localhost", "--port", str(port),
      "--config", TINY_CONFIG, "--workdir", str(tmp_path), "--env", "JAX_PLATFORMS=cpu",
      "--env", "XLA_FLAGS=--xla_force_host_platform_device_count=1", "--",
      f"--config.data.name={dataset[0]}", f"--config.data.data_dir={dataset[1]}", timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]
  for i in range(2):
    assert f"[launch] process {i} exited with code 0" in result.stdout
  assert "process 1 of 2" in result.stdout
  assert (tmp_path / "checkpoints" / "12").is_dir()
