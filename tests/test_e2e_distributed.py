"""A run whatever its layout, end to end on real data: 8 devices as data-parallel, fully
sharded and mixed meshes, one device against eight, and two processes started by the
multi-host launcher (launch/multihost.py) on localhost against one."""
import re
import socket

import numpy as np
import pytest

from helpers import TINY_CONFIG, launch, read_scalars, tiny_config, xla_flags
from vit_jax.train import loop


@pytest.mark.slow
def test_mesh_layouts_and_one_device_give_the_same_losses(tmp_path, dataset):
  """8 devices as data-parallel, fully sharded (fsdp) and mixed, and one device, give the same
  losses. (One device in a process of its own: the random-kills test's and the launcher's.)"""
  runs = {}
  for name, fields in {"8x1": {"mesh.data": 8}, "1x8": {"mesh.data": 1, "mesh.fsdp": 8},
                       "2x4": {"mesh.data": 2, "mesh.fsdp": 4}, "one device": {"cpu_devices": 1}
                       }.items():
    loop.train_and_evaluate(tiny_config(dataset, total_steps=6, checkpoint_every_steps=6,
                                        **fields), str(tmp_path / name))
    runs[name] = read_scalars(tmp_path / name, "train_loss")
  for layout, losses in runs.items():
    assert sorted(losses) == list(range(1, 7)), layout
    np.testing.assert_allclose([losses[s] for s in losses], [runs["8x1"][s] for s in losses],
                               atol=1e-5, err_msg=layout)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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
def test_two_processes_started_by_the_launcher_train_to_the_end_as_one_does(tmp_path, dataset):
  """Two processes on localhost, started by launch/multihost.py, end with the losses of one
  process on as many devices. Two data shards in both runs: the global batches do not depend
  on the process count. The processes stand in for two slices (mesh.dcn_data=2: the
  multislice mesh, whose data axis spans them, fsdp staying within each). The one process is
  this test's own, on two of its devices: the launcher and its processes are what is tested."""
  shards = "--config.data.num_shards=2"
  loop.train_and_evaluate(tiny_config(dataset, cpu_devices=2, checkpoint_every_steps=12,
                                      **{"data.num_shards": 2}), str(tmp_path / "single"))
  result = launch(
      "multihost.py", "hosts", "--hosts", "localhost,localhost", "--port", str(_free_port()),
      "--config", TINY_CONFIG, "--workdir", str(tmp_path / "multi"), "--env",
      "JAX_PLATFORMS=cpu", "--env", f"XLA_FLAGS={xla_flags(1)}", "--",
      f"--config.data.name={dataset[0]}", f"--config.data.data_dir={dataset[1]}", shards,
      "--config.mesh.dcn_data=2", "--config.checkpoint_every_steps=12", timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]
  for i in range(2):
    assert f"[launch] process {i} exited with code 0" in result.stdout
  assert "process 1 of 2" in result.stdout
  assert (tmp_path / "multi" / "checkpoints" / "12").is_dir()
  multi, single = (read_scalars(tmp_path / run, "train_loss") for run in ("multi", "single"))
  assert sorted(multi) == sorted(single) == list(range(1, 13))
  np.testing.assert_allclose([multi[s] for s in multi], [single[s] for s in multi], atol=1e-5)
