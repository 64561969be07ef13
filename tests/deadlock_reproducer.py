"""XLA's CPU-client deadlock (vit_jax/cpu_backend.py says why), shown without vit_jax's model
or training code: a data-parallel step over several CPU devices, dispatched again and again
without waiting.

  python tests/deadlock_reproducer.py --devices 2          # XLA's pool as on 2 cores: hangs
  python tests/deadlock_reproducer.py --devices 2 --fixed  # cpu_backend.prepare: finishes

A hang ends after 11 s: XLA warns of a collective that has waited 1 s for its peers, and
aborts it 10 s later.
"""
import argparse
import os


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--fixed", action="store_true", help="size the pool as vit_jax does")
  args = parser.parse_args()
  from vit_jax import cpu_backend  # Imports no JAX.
  os.environ["XLA_FLAGS"] = (f"{cpu_backend.COLLECTIVE_TIMEOUT_FLAG}=10 "
                             "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1")
  if args.fixed:
    cpu_backend.prepare(args.devices)
  else:
    os.environ["NPROC"] = str(args.devices)  # The pool XLA makes on a machine of so many cores.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  jax.config.update("jax_num_cpu_devices", args.devices)
  mesh = jax.make_mesh((args.devices,), ("data",))
  batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  def step(w, x):
    loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)
    return w - 0.01 * jax.grad(loss)(w)

  step = jax.jit(step, in_shardings=(replicated, batch), out_shardings=replicated,
                 donate_argnums=0)
  w = jax.device_put(jnp.full((1024, 1024), 0.01), replicated)
  x = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
  for _ in range(args.steps):
    w = step(w, jax.make_array_from_process_local_data(batch, x))
  print(f"finished {args.steps} steps: {float(jnp.sum(w)):.4f}", flush=True)


if __name__ == "__main__":
  main()
