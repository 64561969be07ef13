"""What verifying checkpoints costs: the checksums of a whole train state next to the save.

  python benchmarks/checkpoint_checksums.py --model ViT-B_16

Builds the model's AdamW train state (params and both moments) on this host's devices,
then times `run.checksums` (the work added to every save and restore) and an
orbax save of the same state, and prints both with their ratio.
"""
import argparse
import statistics
import tempfile
import time

import jax

from vit_jax import cpu_backend, models
from vit_jax.checkpoint import description, run
from vit_jax.train import optimizers, sharding, trainer

cpu_backend.skip_absent_tpu()  # As the commands: no TPU probed where there is none.


def _median_s(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="ViT-B_16")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  model = models.create_model(args.model, num_classes=1000)
  tx, _ = optimizers.make_optimizer(optimizers.default_config(), 1000, 100)
  mesh = sharding.make_mesh()
  state, _ = trainer.init_state(model, tx, mesh, (224, 224, 3), jax.random.key(0))
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  run.checksums(state)  # Compile.
  check_s = _median_s(lambda: run.checksums(state), args.repeats)
  with tempfile.TemporaryDirectory() as workdir:
    manager = run.make_manager(workdir, keep=1)
    steps = iter(range(1, 1000))

    described = description.Description(model=models.model_config(args.model), image_size=224,
                                       num_classes=1000, model_name=args.model)

    def save():
      run.save(manager, next(steps), state, {}, described)
      manager.wait_until_finished()
    save_s = _median_s(save, args.repeats)
    manager.close()
  print(f"{args.model} train state: {size / 2**30:.2f} GiB on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s)")
  print(f"checksums: {check_s:.2f} s; save with checksums: {save_s:.2f} s; "
        f"checksums / save: {check_s / save_s:.0%}")


if __name__ == "__main__":
  main()
