"""What the launch scripts share: checks made before anything starts, and the
printing (--dry-run) or running of the commands."""
import argparse
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

from vit_jax import configs
from vit_jax.checkpoint import workdir_lock

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCAL_HOSTS = ("localhost", "127.0.0.1")  # Executed here, without ssh.


class LaunchError(ValueError):
  """A bad argument, found before anything was created or started."""


class Parser(argparse.ArgumentParser):
  """A launcher's command line: a bad argument is one `error:` line (exit status 2), as the
  refusals that follow (LaunchError) are, not argparse's usage text and its line."""

  def error(self, message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def count(minimum: int) -> Callable[[str], int]:
  """An argparse type: an integer of at least `minimum`, refused as the flag is read."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"give {minimum} or more, not {value}")
    return value
  return parse


def seconds(text: str) -> float:
  """An argparse type: a number of seconds above 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"give a number of seconds above 0, not {text}")
  return value


def port(text: str) -> int:
  value = count(1)(text)
  if value > 65535:
    raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {value}")
  return value


def matching(pattern: str, refusal: str) -> Callable[[str], str]:
  """An argparse type: a text that `pattern` matches whole; else `refusal` ({text} in it)."""
  def parse(text: str) -> str:
    if not re.fullmatch(pattern, text):
      raise argparse.ArgumentTypeError(refusal.format(text=repr(text)))
    return text
  return parse


# A Google Cloud resource name (a TPU VM, a queued resource; NAME-N for N slices).
resource_name = matching(r"[a-z]([-a-z0-9]{0,58}[a-z0-9])?",
                         "{text} is no Cloud TPU name: lowercase letters, digits and hyphens, "
                         "starting with a letter, not ending with a hyphen, at most 60 characters")
# A Google Cloud project ID (a domain-scoped one, example.com:p, too).
project_id = matching(r"[a-z][-a-z0-9.:]*[a-z0-9]", "{text} is no Google Cloud project ID")
# A SLURM time limit in one of sbatch's forms (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS).
slurm_time = matching(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE",
                      "{text} is no SLURM time limit: e.g. 90, 24:00:00 or 2-00:00:00")


def nonempty(text: str) -> str:
  if not text.strip():
    raise argparse.ArgumentTypeError("is empty")
  return text


class Failed(RuntimeError):
  """A launch that went wrong after it began (a queued resource that failed): one line on
  stderr, exit status 1."""


def tpu_vm_command(verb: str, args: argparse.Namespace, *rest: str) -> list[str]:
  """`gcloud compute tpus tpu-vm VERB ...` in --zone and --project."""
  project = [f"--project={args.project}"] if args.project else []
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}", *project]


def check_config(spec: str) -> tuple[pathlib.Path | None, str]:
  """Checks a --config spec without running it: (the config file, absolute, or None for a
  config shipped in vit_jax, which every worker has installed; ':arg' or '')."""
  try:
    path, arg = configs.resolve(spec)
  except ValueError as e:
    raise LaunchError(f"--config {spec}: {e}") from None
  return None if configs.is_name(spec) else path, "" if arg is None else f":{arg}"


def lock_handover(workdir: str) -> dict[str, str]:
  """The environment of a restarted job that lets it take over the workdir's lock from the job
  it replaces, which the launcher calling this knows is gone (its slice deleted or restarted,
  its process ended): WORKDIR/lock as it is now, read from this machine (a workdir on a file
  system mounted here and there); {} where there is none (a bucket takes none). The restart
  takes it over only if the lock still names that holder, so a run started meanwhile keeps it.
  A JobSet's restarted pods (launch/gke.py) need the same."""
  holder = workdir_lock.read_holder(workdir)
  return {} if holder is None else workdir_lock.handover_env(holder)


def env_pairs(env: Sequence[str]) -> list[str]:
  for pair in env:
    if "=" not in pair or not pair.split("=", 1)[0].isidentifier():
      raise LaunchError(f"--env {pair!r}: expected NAME=VALUE.")
  return list(env)


def stream(prefix: str, pipe) -> None:
  for line in pipe:
    sys.stdout.write(f"{prefix}{line}")
    sys.stdout.flush()


def add_common_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--dry-run", action="store_true",
                      help="print the commands, one per line, instead of running them")


def add_overrides(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("overrides", nargs="*", metavar="-- --config.FIELD=VALUE",
                      help="after `--`: more flags for vit-train, e.g. --config.batch_size=64")


def add_slurm_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--gpus-per-node", type=count(1), default=8)
  parser.add_argument("--partition")
  parser.add_argument("--account")
  parser.add_argument("--time", type=slurm_time, help="time limit, e.g. 24:00:00")
  parser.add_argument("--job-name", type=nonempty, default="vit_jax")


def slurm_options(args: argparse.Namespace) -> list[str]:
  """--partition, --account and --time as given (srun and sbatch take them alike)."""
  return [f"--{k}={v}" for k, v in (("partition", args.partition), ("account", args.account),
                                     ("time", args.time)) if v]


def preflight(config: str, topology: str, overrides: Sequence[str], num_slices: int = 1,
              skip_flag: str = "--no-preflight") -> None:
  """`vit-train --compile_only` for the slice, here, before anything is created or applied:
  the config's train and eval steps compiled for its TPUs (libtpu, no TPU). The report goes to
  stderr (a dry run's stdout stays what it prints); a config that does not fit, or does not
  compile, stops the launch with vit-train's one line."""
  slices = [f"--num_slices={num_slices}"] if num_slices > 1 else []
  check = [sys.executable, "-m", "vit_jax.tools.train", "--config", config, "--compile_only",
           "--topology", topology, *slices, *overrides]
  print(f"preflight: {shlex.join(check)}", file=sys.stderr, flush=True)
  path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
  result = subprocess.run(check, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path))  # This checkout's vit_jax.
  sys.stderr.write(result.stdout)
  if result.returncode != 0:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    why = lines[-1].removeprefix("error: ") if lines else (
        f"exited with status {result.returncode}: {result.stderr.strip()[-2000:]}")
    raise LaunchError(f"preflight for {topology}: {why} ({skip_flag} skips this check)")


def say(message: str) -> None:
  """An event of a launch, as one line with its time."""
  print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


def execute(commands: Sequence[Sequence[str]], dry_run: bool) -> None:
  """Prints each command (shell-quoted); unless dry_run, runs it and stops at a failure."""
  for cmd in commands:
    print(shlex.join(cmd) if dry_run else "+ " + shlex.join(cmd), flush=True)
    if not dry_run:
      subprocess.run(cmd, check=True)


def main(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
         handler: Callable[[argparse.Namespace], int | None]) -> int:
  """Parses argv and runs handler; a LaunchError becomes a usage error (exit 2)."""
  args = parser.parse_args(argv)
  try:
    return handler(args) or 0
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  except Failed as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 1
  except subprocess.CalledProcessError as e:
    print(f"error: {shlex.join(e.cmd)} exited with code {e.returncode}", file=sys.stderr)
    return e.returncode
