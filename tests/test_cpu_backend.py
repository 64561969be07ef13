"""Several CPU devices never deadlock: XLA's CPU client hangs with its own pool
(tests/deadlock_reproducer.py), and finishes with the pool vit_jax.cpu_backend gives it."""
import os
import subprocess
import sys

import pytest

from helpers import REPO
from vit_jax import cpu_backend


def reproduce(devices: int, steps: int, *flags: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
  return subprocess.run(
      [sys.executable, str(REPO / "tests" / "deadlock_reproducer.py"), "--devices", str(devices),
       "--steps", str(steps), *flags], env=env, cwd=REPO, capture_output=True, text=True,
      timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2])  # The README's machine; 8 deadlock alike.
def test_xla_still_deadlocks_with_its_own_pool(devices):
  """Why cpu_backend raises NPROC. Once this fails, XLA no longer hangs: drop the workaround."""
  run = reproduce(devices, 400)
  assert run.returncode != 0 and "finished" not in run.stdout, (
      "XLA's CPU client no longer deadlocks with a pool of one thread per device: "
      "vit_jax/cpu_backend.py's larger pool may go.")
  assert "Termination timeout" in run.stderr and "all reduce" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 8])
def test_the_larger_pool_finishes(devices):
  """100 steps: XLA's own pool hangs in the first few dozen, on 2 devices as on 8 (~1 s of CPU
  in; it hung within 100 steps in 3 tries of each), and 400 steps on 8 devices took 40 s of
  CPU."""
  run = reproduce(devices, 100, "--fixed")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "finished 100 steps" in run.stdout


def test_prepare_sizes_the_pool_and_keeps_a_larger_one(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  monkeypatch.setenv("NPROC", "2")
  assert cpu_backend.prepare() == 4
  assert os.environ["NPROC"] == "8"
  assert cpu_backend.COLLECTIVE_TIMEOUT_FLAG in os.environ["XLA_FLAGS"]
  monkeypatch.setenv("NPROC", "32")
  cpu_backend.prepare()
  assert os.environ["NPROC"] == "32"


def test_prepare_leaves_a_started_jax_as_it_is(monkeypatch):
  """A command's main called where JAX runs already (a notebook, vit-transfer's tests) with
  --cpu_devices: JAX's devices stay (a run takes its first so many: run_setup), no error."""
  import jax
  monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])
  started = jax.devices()
  assert cpu_backend.prepare(1) == 1
  assert jax.devices() == started and len(started) == 8


def test_a_pool_too_small_is_refused_with_the_fix(monkeypatch):
  monkeypatch.setenv("NPROC", "2")
  with pytest.raises(RuntimeError, match=r"2 threads.*NPROC=4.*prepare\(2\)"):
    cpu_backend.check_pool(2)
  cpu_backend.check_pool(1)
  monkeypatch.setenv("NPROC", "4")
  cpu_backend.check_pool(2)
