"""Trains and evaluates a ViT: `python -m vit_jax.main --config configs/x.py:args --workdir DIR`.

Every config field can be overridden on the command line: `--config.batch_size=64`.
Multi-host: on Cloud TPU pod slices and SLURM `jax.distributed.initialize()` finds its
peers by itself (`--distributed`); elsewhere pass --coordinator_address, --num_processes
and --process_id (CPU processes then talk through gloo).
"""
import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, `path.py:arg`.", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard logs; resumed if present.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (TPU pods, SLURM).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process.")
flags.DEFINE_integer("num_processes", None, "Number of processes, with --coordinator_address.")
flags.DEFINE_integer("process_id", None, "This process's index, with --coordinator_address.")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(logging.Filter):
  """Keeps orbax's and TFDS's per-operation INFO lines out of the run's log."""

  def filter(self, record: logging.LogRecord) -> bool:
    noisy = any(f"/{lib}/" in record.pathname for lib in ("orbax", "tensorflow_datasets"))
    return record.levelno >= logging.WARNING or not noisy


def main(argv) -> None:
  del argv
  absl_logging.get_absl_handler().addFilter(_QuietLibraries())
  import jax  # After absl has parsed the flags, so XLA_FLAGS set by users apply.

  if FLAGS.config.get("cpu_devices"):
    jax.config.update("jax_num_cpu_devices", FLAGS.config.cpu_devices)

  if FLAGS.coordinator_address or FLAGS.distributed:
    if jax.config.jax_platforms in (None, "", "cpu") and FLAGS.coordinator_address:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from vit_jax.train import loop

  logging.info("JAX %s: process %d of %d, %d devices (%s).", jax.__version__, jax.process_index(),
               jax.process_count(), jax.device_count(), jax.devices()[0].platform)
  metrics = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  if metrics and jax.process_index() == 0:
    print("Final evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())),
          flush=True)


def run() -> None:
  app.run(main)


if __name__ == "__main__":
  run()
