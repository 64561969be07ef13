"""Trains and evaluates a ViT: `vit-train --config finetune:b16,cifar10 --workdir DIR`.

--config names a config shipped in vit_jax/configs/ (`quickstart`, `finetune:ARG`) or a config
file of your own (`path.py:ARG`).

Every config field can be overridden on the command line: `--config.batch_size=64`.
Multi-host: on Cloud TPU pod slices and SLURM `jax.distributed.initialize()` finds its
peers by itself (`--distributed`); elsewhere pass --coordinator_address, --num_processes
and --process_id (CPU processes then talk through gloo).
"""
import logging
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from vit_jax import configs, cpu_backend
from vit_jax.config_errors import ConfigError, check_known
from vit_jax.tools import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "A config shipped with vit_jax by name (`quickstart`, `finetune:b16,cifar10`) "
    "or a config file, `path.py:arg`.", lock_config=True)
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


# Durations given in one of two units: the unit set on the command line replaces the other.
_UNIT_PAIRS = (("total_steps", "total_epochs"), ("warmup_steps", "warmup_epochs"))


def _config_flag(argv: list[str]) -> tuple[int, str, str] | None:
  """(index, flag prefix, spec) of the argument that holds `--config SPEC` / `--config=SPEC`."""
  for i, a in enumerate(argv):
    if m := re.fullmatch(r"(--?config)(=(.*))?", a):
      if m.group(2):
        return i, m.group(1) + "=", m.group(3)
      if i + 1 < len(argv):
        return i + 1, "", argv[i + 1]
  return None


def resolve_config_flag(argv: list[str]) -> list[str]:
  """argv with the --config spec as a file path (absl's config flag takes a file), a shipped
  config's name replaced by its file; a spec that names no config file ends the run."""
  found = _config_flag(argv)
  if found is None:
    return argv
  i, prefix, spec = found
  try:
    path, arg = configs.resolve(spec)
  except ValueError as e:
    cli.fail(f"--config {spec}: {e}")
  return [*argv[:i], f"{prefix}{path}{'' if arg is None else ':' + arg}", *argv[i + 1:]]


def _config_file(argv: list[str]):
  """The config --config names, loaded without its overrides."""
  found = _config_flag(argv)
  return None if found is None else configs.get_config(found[2])


def _bad_override(argv: list[str]) -> str | None:
  """Names the first `--config.a.b=...` whose field the config does not have."""
  try:
    config = _config_file(argv)
  except Exception:  # Reported by absl's own message instead.
    return None
  for arg in (a for a in argv if a.startswith("--config.")):
    node, path = config, arg[len("--config."):].split("=", 1)[0].split(".")
    for i, key in enumerate(path):
      if not hasattr(node, "keys"):
        break
      try:
        check_known(".".join(path[:i + 1]), arg.split("=", 1)[-1], node.keys())
      except ConfigError as e:
        return str(e)
      node = node[key]
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with one-line errors for the config's fields, and the duration
  unit given on the command line winning over the config file's other unit."""
  argv = resolve_config_flag(argv)
  try:
    rest = FLAGS(argv)
  except SystemExit:  # Only --help and its kin exit here: absl prints the usage, exits 1.
    sys.exit(0)
  except Exception as e:  # absl and ml_collections raise several types for a bad override.
    cli.fail(_bad_override(argv) or str(e))
  given = config_flags.get_override_values(FLAGS["config"])
  for unit, other in _UNIT_PAIRS:
    for a, b in ((unit, other), (other, unit)):
      if a in given and b not in given and FLAGS.config.get(b) is not None:
        FLAGS.config[b] = None
  return rest


def main(argv) -> None:
  del argv
  absl_logging.get_absl_handler().addFilter(_QuietLibraries())
  # Before JAX starts, after absl has parsed the flags (so XLA_FLAGS set by users apply).
  cpu_backend.prepare(FLAGS.config.get("cpu_devices"))
  import jax

  if FLAGS.coordinator_address or FLAGS.distributed:
    if jax.config.jax_platforms in (None, "", "cpu") and FLAGS.coordinator_address:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from vit_jax.train import loop

  logging.info("JAX %s: process %d of %d, %d devices (%s).", jax.__version__, jax.process_index(),
               jax.process_count(), jax.device_count(), jax.devices()[0].platform)
  from vit_jax import checkpoint
  try:
    metrics = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (ConfigError, checkpoint.CheckpointError, checkpoint.DescriptionMismatch) as e:
    cli.fail(str(e))
  if metrics and jax.process_index() == 0:
    print("Final evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())),
          flush=True)


def run() -> None:
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
