"""Images/s of the training iterator alone, Fashion-MNIST at batch 128.

    python benchmarks/input_pipeline.py [--data_dir DIR] [--steps 300] [--randaug 2,15]

Prints, per image size, the iterator's images/s and the CPU time it spends per
image (all threads), which is what it takes away from the training step. With
--randaug N,M each size is measured without and with RandAugment (N layers,
magnitude M), and the ratio is printed.
"""
import argparse
import time

import jax

from vit_jax import cpu_backend, data

cpu_backend.skip_absent_tpu()  # As the commands: no TPU probed where there is none.


def measure(cfg, batch_size: int, steps: int) -> tuple[float, float, float]:
  mesh = jax.sharding.Mesh(jax.devices(), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  start = time.perf_counter()
  batches = data.train_iterator(cfg, global_batch_size=batch_size,
                                sharding=sharding, seed=0)
  jax.block_until_ready(next(batches))
  first = time.perf_counter() - start
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(steps):
    jax.block_until_ready(next(batches))
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  images = steps * batch_size
  return images / wall, cpu / images * 1e6, first


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default=None, help="TFDS data_dir")
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--sizes", default="28,224")
  parser.add_argument("--randaug", default=None, metavar="N,M",
                      help="also measure with RandAugment: N layers at magnitude M")
  args = parser.parse_args()
  settings = [(0, 0.0)]
  if args.randaug:
    layers, magnitude = args.randaug.split(",")
    settings.append((int(layers), float(magnitude)))
  for size in map(int, args.sizes.split(",")):
    rates = []
    for layers, magnitude in settings:
      cfg = data.get_data_config()
      cfg.update(name="fashion_mnist", data_dir=args.data_dir, image_size=size,
                 randaug_layers=layers, randaug_magnitude=magnitude)
      steps = args.steps if size <= 64 else max(args.steps // 10, 10)
      rate, cpu_us, first = measure(cfg, args.batch_size, steps)
      rates.append(rate)
      randaug = f"randaug({layers},{magnitude:g})" if layers else "no randaug"
      print(f"fashion_mnist {size}px batch {args.batch_size} {randaug}: {rate:,.0f} img/s, "
            f"{cpu_us:.0f} us CPU/img, first batch {first:.1f}s "
            f'(tf.data threads: {cfg.threads or "auto"})')
    if len(rates) == 2:
      print(f"  with / without RandAugment: {rates[1] / rates[0]:.2f}x")


if __name__ == "__main__":
  main()
