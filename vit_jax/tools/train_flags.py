"""vit-train's flags (absl's, and ml_collections' --config with its `--config.FIELD=VALUE`
overrides) and the checks before any work: a wrong flag, an unknown or moved config field, a
config that contradicts config.pretrained, a workdir that cannot be written or is in use, each
told in one line, before TensorFlow loads where it can (seconds).
"""
import logging
import re
import shlex
import sys
from typing import TYPE_CHECKING

from absl import flags
from ml_collections import config_flags

from vit_jax import configs
from vit_jax.config_errors import ConfigError, InputError
from vit_jax.tools import cli, logs

if TYPE_CHECKING:  # JAX's seconds: after the flags are checked.
  from vit_jax.checkpoint import loader

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "A config shipped with vit_jax by name (`quickstart`, `finetune:b16,cifar10`) "
    "or a config file, `path.py:arg`.", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard logs; resumed if present.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (TPU pods, SLURM).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process.")
flags.DEFINE_integer("num_processes", None, "Number of processes, with --coordinator_address.",
                     lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index, with --coordinator_address.",
                     lower_bound=0)
flags.DEFINE_bool("verbose", False, "Show the library's logs (absl INFO) on stderr too, besides "
                  "WORKDIR/train.log.")
flags.DEFINE_bool("compile_only", False, "Compile the run's train and eval steps for "
                  "--topology's TPUs (no TPU, data or workdir needed: libtpu only) and report "
                  "per-chip HBM, FLOPs, collectives and a roofline bound; exit 2 naming a fix "
                  "if it does not fit.")
flags.DEFINE_string("topology", None, "With --compile_only: JAX's spelling (v5e:4x4, v4:2x2x4) or "
                    "a Cloud TPU accelerator type (v4-32, v5litepod-16, v5p-64, v6e-16).")
flags.DEFINE_integer("num_slices", 1, "With --compile_only: slices of --topology (multislice).",
                     lower_bound=1)
flags.DEFINE_bool("plan", False, "With --topology: choose mesh.data x mesh.fsdp and model.remat "
                  "by compiling candidates; print the overrides to use.")
flags.DEFINE_integer("plan_timeout", 600, "With --plan: seconds the search may take; then it "
                     "ends with the closest candidate compiled so far.", lower_bound=1)
flags.DEFINE_bool("json", False, "With --compile_only or --plan: the report as JSON on stdout.")
flags.DEFINE_integer("num_classes", None, "With --compile_only: the dataset's classes, where "
                     "config.data.name is not one whose count vit_jax knows.", lower_bound=2)
flags.mark_flags_as_required(["config"])
flags.register_multi_flags_validator(
    ["workdir", "compile_only", "plan"],
    lambda f: f["workdir"] is not None or f["compile_only"] or f["plan"],
    "Flag --workdir must have a value other than None (only --compile_only and --plan go "
    "without one).")


# config.pretrained as `parse` opened it to check the config against (config.check_pretrained):
# the run starts from it, reading it no more.
opened_pretrained: list["loader.Opened"] = []


def config_spec(argv: list[str]) -> tuple[int, str, str] | None:
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
  found = config_spec(argv)
  if found is None:
    return argv
  i, prefix, spec = found
  try:
    path, arg = configs.resolve(spec)
  except ValueError as e:
    cli.fail(f"--config {spec}: {e}")
  return [*argv[:i], f"{prefix}{path}{'' if arg is None else ':' + arg}", *argv[i + 1:]]


def _bad_override(argv: list[str]) -> str | None:
  """Names the first `--config.a.b=...` whose field the config does not have (or has moved),
  or what the config's get_config said of its ARG."""
  from vit_jax.train import config_overrides
  found = config_spec(argv)
  try:
    config = None if found is None else configs.get_config(found[2])
  except ConfigError as e:  # Its get_config's refusal, in one line; or a field it moved.
    return (e.__cause__ is not None and config_overrides.moved_in_file(e.__cause__)) or str(e)
  except Exception as e:  # Reported by absl's own message instead, unless a field moved.
    return config_overrides.moved_in_file(e)
  try:
    config_overrides.check(config, [a for a in argv if a.startswith("--config.")])
  except ConfigError as e:
    return str(e)
  return None


def usage(doc: str) -> str:
  """The command's docstring and its flags (absl's own --help shows a console script none)."""
  flags_help = FLAGS.module_help(FLAGS.find_module_defining_flag("workdir"))
  return (f"{doc.strip()}\n\nflags:\n{flags_help.split(':', 1)[1].strip(chr(10))}\n\n"
          "absl's flags (logging among them): --helpfull")


def _parse(argv: list[str], given: list[str]) -> list[str]:
  """absl's parse of `argv` (the --config spec a file path); an error is told in the words of
  the command line as `given`."""
  try:
    rest = FLAGS(argv)
  except SystemExit:  # Only --helpfull and its kin exit here: absl prints them, exits 1.
    sys.exit(0)
  except Exception as e:  # absl and ml_collections raise several types for a bad override.
    cli.fail(_bad_override(given) or str(e))
  return rest


def parse(argv: list[str], doc: str) -> list[str]:
  """absl's flag parsing (`doc`: the command's, for --help), with one-line errors for the
  config's fields, and the checks before any work: before TensorFlow loads where they can."""
  if any(a in ("-h", "-help", "--help", "--helpshort", "-?") for a in argv[1:]):
    print(usage(doc))
    sys.exit(0)
  logs.route_logs(hold=True)  # Until the run knows its log file.
  logging.info("Command: %s", shlex.join(sys.orig_argv))
  # The shipped configs import no TensorFlow (seconds): a wrong flag is told before it loads.
  with logs.native_logs():  # A config file of the user's may import it: its C++ lines.
    rest = _parse(resolve_config_flag(argv), argv)
  if len(rest) > 1:  # absl hands back what is not a flag: nothing would read it.
    cli.fail(_leftover(rest[1]))
  given = config_flags.get_override_values(FLAGS["config"])
  from vit_jax.train import config as config_lib
  from vit_jax.train import config_overrides
  config_overrides.prefer_given_units(FLAGS.config, given)
  try:
    config_lib.validate(FLAGS.config)
    cli.check_checkpoints([FLAGS.config.get("pretrained") or ""])
  except ConfigError as e:
    cli.fail(e)
  except FileNotFoundError as e:
    cli.fail(f"config.pretrained: {e}")
  _check_compile_flags()
  if FLAGS.config.get("pretrained"):
    try:  # Before a workdir or a compile; the run starts from what it opened.
      cli.check_not_exported([FLAGS.config.pretrained])
      opened_pretrained[:] = [config_lib.check_pretrained(FLAGS.config, given)]
    except cli.INPUT_ERRORS as e:
      cli.fail(e)
  if compiling():
    if not FLAGS.topology:
      cli.fail("--compile_only and --plan need --topology (e.g. v5e:4x4 or v5litepod-16)")
    return rest
  try:
    cli.check_output_dir("--workdir", FLAGS.workdir)
    c = FLAGS.config
    cli.check_apart("--workdir", FLAGS.workdir, {
        "config.pretrained": [c.get("pretrained")], "config.data.name": [c.data.get("name")],
        "config.data.data_dir": [c.data.get("data_dir")]})
    if not (FLAGS.distributed or FLAGS.coordinator_address):  # Else process 0's, as it starts.
      from vit_jax.checkpoint import workdir_lock
      workdir_lock.check_free(FLAGS.workdir)  # Before TensorFlow's and JAX's seconds.
  except (OSError, InputError) as e:
    cli.fail(e)
  logs.start_tensorflow()
  return rest


# The flags of a compile for a TPU slice: without --compile_only or --plan, nothing reads them.
_COMPILE_FLAGS = ("topology", "num_slices", "plan_timeout", "json", "num_classes")


def _check_compile_flags() -> None:
  """Refuses a compile flag given to a run that trains: it would train on this machine's
  devices as if the flag were not there."""
  given = [f"--{name}={FLAGS[name].value}" for name in _COMPILE_FLAGS if FLAGS[name].present]
  if given and not compiling():
    cli.fail(f"{given[0]}: applies to a compile for a TPU slice (--compile_only or --plan); "
             "without either, vit-train trains here and reads no such flag: add --compile_only, "
             f"or drop {given[0].split('=')[0]}")


def _leftover(arg: str) -> str:
  """The line refusing an argument that is not a flag (absl leaves it to the program)."""
  hint = (f"; did you mean --{arg}?" if re.fullmatch(r"config\.[\w.]+=.*", arg) else
          "; pass config fields as --config.FIELD=VALUE" if "=" in arg else "")
  return (f"unexpected argument {arg!r}: vit-train takes flags only (--name=value), and reads "
          f"nothing else{hint}")


def compiling() -> bool:
  """Whether the flags ask for a compile for a TPU slice (--compile_only, --plan)."""
  return FLAGS.compile_only or FLAGS.plan
