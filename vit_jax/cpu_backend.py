"""JAX's CPU backend split into several devices, set up so that it cannot deadlock.

Why (jaxlib 0.10.2; openxla/xla `xla/pjrt/common_pjrt_client.cc`,
`CommonPjRtLoadedExecutable::Execute`, and `xla/pjrt/cpu/cpu_client.cc`,
`CpuPjRtRawLoadedExecutable::Execute`): a program over D local CPU devices is launched as D
tasks on the client's one thread pool, which `GetPjRtCpuClient` sizes max(NPROC or the
number of cores, D). Each launch task takes one of its device's 32 in-flight slots
(`max_inflight_computations_semaphore`), blocking its pool thread while all 32 are taken; the
device's part of a program then runs on the same pool and keeps its thread until every device
has joined each collective. Once the host has dispatched 32 programs ahead of a device (a
training loop on an idle machine does within a few dozen steps), a launch blocked on the slots
and a program part waiting at an all-reduce for its peer hold all the threads: the peer's part,
which would free a slot, never gets one, and the process hangs. D launch tasks and the D parts
of the one collective program that runs at a time need 2 x D threads, so the pool is sized that
way. tests/test_cpu_backend.py runs a 40-line reproducer with and without the larger pool.
"""
import glob
import importlib.util
import os
import re
import sys

# XLA aborts a CPU collective whose devices have not all joined within 40 s. With several
# devices per core on a busy machine that is a slow step, not a deadlock: wait longer.
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
COLLECTIVE_TIMEOUT_S = 600
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def flagged_device_count() -> int:
  """The CPU device count that XLA_FLAGS asks for (1 if it asks for none)."""
  found = _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
  return int(found[-1]) if found else 1


def pool_threads(num_devices: int) -> int:
  """The threads of XLA's CPU client pool for `num_devices` devices, as the client sizes it."""
  nproc = os.environ.get("NPROC", "")
  threads = int(nproc) if nproc.isdigit() else len(os.sched_getaffinity(0))
  return max(threads, num_devices)


def safe_pool_threads(num_devices: int) -> int:
  return 2 * num_devices if num_devices > 1 else 1


def prepare(num_devices: int | None = None) -> int:
  """Sets up the CPU backend before JAX starts it; returns its device count.

  `num_devices` (None: what XLA_FLAGS asks for) devices, a client pool that cannot deadlock
  (NPROC raised to 2 per device), and collectives that wait for slow peers. Where JAX has
  started already, its devices stay as they are.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if COLLECTIVE_TIMEOUT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_S}".strip()
  n = num_devices or flagged_device_count()
  if pool_threads(n) < safe_pool_threads(n):
    os.environ["NPROC"] = str(safe_pool_threads(n))
  if num_devices:
    import jax  # Not at the top: XLA_FLAGS must be final before jax is first imported.
    try:
      jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
      pass  # JAX has started (a notebook's, a test's): a run takes its first devices (run_setup).
  return n


def skip_absent_tpu() -> None:
  """Where libtpu is installed (the test extra's, for TPU compile checks) but this machine has
  no TPU and no GPU plugin, JAX would still try a TPU at every start: a second, and lines of
  libtpu's errors on stderr. The CPU is then the platform, unless JAX_PLATFORMS says
  otherwise. Compiling for a TPU topology (compile_check) does not need the TPU platform."""
  if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
    return
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or any(
      importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    return
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  else:
    os.environ["JAX_PLATFORMS"] = "cpu"


def check_pool(num_devices: int) -> None:
  """Raises unless the CPU client that JAX started with `num_devices` devices is safe."""
  if pool_threads(num_devices) < safe_pool_threads(num_devices):
    raise RuntimeError(
        f"JAX's CPU backend has {num_devices} devices but XLA's CPU client pool has "
        f"{pool_threads(num_devices)} threads: multi-device programs can deadlock "
        f"(vit_jax/cpu_backend.py says why). Start the process with "
        f"NPROC={safe_pool_threads(num_devices)} in its environment, call "
        f"vit_jax.cpu_backend.prepare({num_devices}) before JAX starts, or use one CPU device.")
