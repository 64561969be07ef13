"""Cloud TPU VMs: create one (a single host or a pod slice), install this project on every
worker, run a config on all of them, follow the log, delete it.

  python launch/tpu_vm.py up --name vit --zone us-central2-b --accelerator-type v4-32 \
      --config pretrain:b16,i1k --workdir gs://BUCKET/vit_b16 -- --config.batch_size=4096
  python launch/tpu_vm.py up --name vit-ft --zone us-central2-b --accelerator-type v4-8 \
      --config finetune:b16,cifar10 --workdir gs://BUCKET/vit_b16_cifar10 \
      -- --config.pretrained=hf-hub:google/vit-base-patch16-224-in21k
  python launch/tpu_vm.py logs --name vit --zone us-central2-b
  python launch/tpu_vm.py delete --name vit --zone us-central2-b

`up` is `create`, `setup` and `run` in turn; each is also a command of its own. Every
command takes --dry-run, which prints the gcloud commands instead of running them. The
job runs detached (it survives the ssh session) with --distributed on pod slices, where
jax.distributed.initialize() finds the other workers by itself.

`up` and `run` first compile the config's steps for the accelerator type here (`vit-train
--compile_only`, libtpu without a TPU) and stop, before any gcloud command, if it does not fit
the chips' memory, naming the change that makes it fit; --no-preflight skips that.
"""
import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from typing import Sequence

if __package__ in (None, ""):  # Run as a file: python launch/tpu_vm.py.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import common  # noqa: E402
from launch.common import LaunchError  # noqa: E402
from vit_jax.train import tpu_specs  # noqa: E402

REMOTE_DIR = "vit_jax"  # On each worker, relative to the home directory.
LOG = f"{REMOTE_DIR}/logs/train.log"


@dataclasses.dataclass(frozen=True)
class Generation:
  sizes: tuple[int, ...]  # TensorCores (v2-v5p) or chips (v5e, v6e), as in the type names.
  zones: tuple[str, ...]
  version: str  # TPU software version for JAX.
  per_host: int  # Cores or chips per worker in a multi-host slice.
  max_single_host: int = 8


# From cloud.google.com/tpu/docs/regions-zones and /runtimes (2025). Types or zones not
# listed yet are accepted with --allow-unlisted.
GENERATIONS = {
    "v2": Generation((8, 32, 128, 256, 512), ("us-central1-a", "us-central1-b", "us-central1-c",
                                             "us-central1-f", "europe-west4-a", "asia-east1-c"),
                     "tpu-ubuntu2204-base", 8),
    "v3": Generation((8, 32, 64, 128, 256, 512, 1024, 2048),
                     ("us-central1-a", "us-central1-b", "us-central1-f", "europe-west4-a"),
                     "tpu-ubuntu2204-base", 8),
    "v4": Generation((8, 16, 32, 64, 128, 256, 384, 512, 1024, 1536, 2048, 3072, 4096),
                     ("us-central2-b",), "tpu-ubuntu2204-base", 8),
    "v5litepod": Generation((1, 4, 8, 16, 32, 64, 128, 256),
                            ("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a",
                             "us-east1-c", "us-east5-a", "us-east5-b", "us-east5-c",
                             "europe-west4-b", "asia-southeast1-b"), "v2-alpha-tpuv5-lite", 4),
    "v5p": Generation((8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 6144, 8192, 12288),
                      ("us-central1-a", "us-east5-a", "europe-west4-b"), "v2-alpha-tpuv5", 8),
    "v6e": Generation((1, 4, 8, 16, 32, 64, 128, 256),
                      ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "europe-west4-a",
                       "asia-northeast1-b", "southamerica-west1-a"), "v2-alpha-tpuv6e", 4),
}


@dataclasses.dataclass(frozen=True)
class Slice:
  accelerator_type: str
  zone: str
  version: str
  hosts: int | None  # None: not in the table, so unknown.

  @property
  def worker_flags(self) -> list[str]:
    return [] if self.hosts == 1 else ["--worker=all"]


def known_types() -> str:
  return "; ".join(f"{g}-{{{','.join(map(str, gen.sizes))}}}" for g, gen in GENERATIONS.items())


def resolve_slice(accelerator_type: str, zone: str, version: str | None = None,
                  allow_unlisted: bool = False) -> Slice:
  """Checks the type and zone against GENERATIONS; works out hosts and software version."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
  gen = GENERATIONS.get(m.group(1)) if m else None
  if gen is None or int(m.group(2)) not in gen.sizes:
    if not allow_unlisted:
      raise LaunchError(
          f"--accelerator-type {accelerator_type!r} is not a known Cloud TPU type. Known: "
          f"{known_types()}. If it is a new one, pass --allow-unlisted (and --version).")
    if gen is None and version is None:
      raise LaunchError(f"--accelerator-type {accelerator_type!r} is unlisted: give --version.")
    return Slice(accelerator_type, zone, version or gen.version, None)
  if zone not in gen.zones and not allow_unlisted:
    raise LaunchError(
        f"--zone {zone!r} offers no {m.group(1)} TPUs; {m.group(1)} zones: "
        f"{', '.join(gen.zones)}. If that changed, pass --allow-unlisted.")
  size = int(m.group(2))
  hosts = 1 if size <= gen.max_single_host else size // gen.per_host
  return Slice(accelerator_type, zone, version or gen.version, hosts)


def _gcloud(verb: str, args: argparse.Namespace, *rest: str) -> list[str]:
  project = [f"--project={args.project}"] if args.project else []
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}", *project]


def _ssh(args: argparse.Namespace, workers: list[str], command: str) -> list[str]:
  return _gcloud("ssh", args, args.name, *workers, "--command", command)


def create_commands(args: argparse.Namespace, tpu: Slice) -> list[list[str]]:
  spot = ["--spot"] if args.spot else []
  return [_gcloud("create", args, args.name, f"--accelerator-type={tpu.accelerator_type}",
                  f"--version={tpu.version}", *spot)]


def setup_commands(args: argparse.Namespace, tpu: Slice) -> list[list[str]]:
  """Copies the package (its configs with it) and setup.py to every worker and installs them
  in a venv."""
  workers = tpu.worker_flags
  sources = [str(common.REPO / p) for p in ("vit_jax", "setup.py")]
  venv = f"{REMOTE_DIR}/.venv"
  # jax needs a newer Python than the TPU images' 3.10: uv fetches one for the venv.
  install = ("python3 -m pip install --user --quiet --upgrade uv && "
             f"python3 -m uv venv --allow-existing --python {shlex.quote(args.python)} {venv} && "
             f"python3 -m uv pip install --python {venv}/bin/python "
             f'--editable "./{REMOTE_DIR}[tpu]"')
  return [
      _ssh(args, workers, f"mkdir -p {REMOTE_DIR}/run_configs {REMOTE_DIR}/logs"),
      _gcloud("scp", args, "--recurse", *sources, f"{args.name}:{REMOTE_DIR}/", *workers),
      _ssh(args, workers, install),
  ]


def run_commands(args: argparse.Namespace, tpu: Slice) -> list[list[str]]:
  """Copies a config file of the user's to every worker (a shipped config is installed there
  already) and starts the job there, detached, logging to LOG."""
  config, arg = common.check_config(args.config)
  if tpu.hosts != 1 and not args.workdir.startswith("gs://"):
    raise LaunchError(
        f"--workdir {args.workdir}: the workers of a pod slice share no disk, so checkpoints "
        "must go to a bucket: give --workdir gs://BUCKET/PATH.")
  distributed = [] if tpu.hosts == 1 else ["--distributed"]
  spec = args.config if config is None else f"run_configs/{config.name}{arg}"
  train = [".venv/bin/python", "-m", "vit_jax.tools.train", "--config", spec,
           "--workdir", args.workdir, *distributed, *args.overrides]
  log = LOG.removeprefix(f"{REMOTE_DIR}/")
  start = (f"cd {REMOTE_DIR} && setsid nohup {shlex.join(train)} > {log} 2>&1 < /dev/null &")
  copy = [] if config is None else [
      _gcloud("scp", args, str(config), f"{args.name}:{REMOTE_DIR}/run_configs/",
              *tpu.worker_flags)]
  return [*copy, _ssh(args, tpu.worker_flags, start)]


def preflight(args: argparse.Namespace) -> None:
  """`vit-train --compile_only` for the accelerator type, here, before any gcloud command: the
  config's train and eval steps compiled for the slice's TPUs (libtpu, no TPU). Its report
  goes to stderr (a dry run's stdout stays the commands); a config that does not fit, or
  does not compile, stops the launch with vit-train's one line."""
  generation = args.accelerator_type.rsplit("-", 1)[0]
  if generation not in tpu_specs.BY_CLOUD_PREFIX:
    print(f"preflight: skipped, no chip figures for {generation} (vit_jax/train/tpu_specs.py)",
          file=sys.stderr, flush=True)
    return
  check = [sys.executable, "-m", "vit_jax.tools.train", "--config", args.config,
           "--compile_only", "--topology", args.accelerator_type, *args.overrides]
  print(f"preflight: {shlex.join(check)}", file=sys.stderr, flush=True)
  path = os.pathsep.join(filter(None, [str(common.REPO), os.environ.get("PYTHONPATH")]))
  result = subprocess.run(check, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path))  # This checkout's vit_jax.
  sys.stderr.write(result.stdout)
  if result.returncode != 0:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    why = lines[-1].removeprefix("error: ") if lines else (
        f"exited with status {result.returncode}: {result.stderr.strip()[-2000:]}")
    raise LaunchError(f"preflight for {args.accelerator_type}: {why} (--no-preflight skips "
                      "this check)")


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
  return [_ssh(args, [f"--worker={args.worker}"], f"tail -n {args.lines} -F {LOG}")]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
  return [_gcloud("delete", args, args.name, "--quiet")]


def _check_zone(zone: str, allow_unlisted: bool) -> None:
  zones = sorted({z for gen in GENERATIONS.values() for z in gen.zones})
  if zone not in zones and not allow_unlisted:
    raise LaunchError(f"--zone {zone!r} offers no Cloud TPUs; known zones: {', '.join(zones)}. "
                      "If that changed, pass --allow-unlisted.")


def handle(args: argparse.Namespace) -> int:
  if args.command in ("logs", "delete"):
    _check_zone(args.zone, args.allow_unlisted)
    commands = logs_commands(args) if args.command == "logs" else delete_commands(args)
  else:
    tpu = resolve_slice(args.accelerator_type, args.zone, args.version, args.allow_unlisted)
    # The run's commands first: building them checks the config and workdir.
    run = run_commands(args, tpu) if args.command in ("run", "up") else []
    if run and not args.no_preflight:
      preflight(args)
    create = create_commands(args, tpu) if args.command in ("create", "up") else []
    setup = setup_commands(args, tpu) if args.command in ("setup", "up") else []
    commands = create + setup + run
  if not args.dry_run and not shutil.which("gcloud"):
    raise LaunchError("gcloud is not installed: see cloud.google.com/sdk/docs/install "
                      "(or look at the commands with --dry-run).")
  common.execute(commands, args.dry_run)
  if args.command in ("run", "up") and not args.dry_run:
    print(f"Started. Follow it: python launch/tpu_vm.py logs --name {args.name} --zone {args.zone}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs (or with --dry-run prints) one TPU VM subcommand; returns its exit status."""
  return common.main(parser(), argv, handle)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  helps = {"up": "create + setup + run", "create": "create the TPU VM",
           "setup": "copy and install this project on every worker",
           "run": "run a config on every worker", "logs": "follow a worker's log",
           "delete": "delete the TPU VM"}
  for name, help_ in helps.items():
    s = sub.add_parser(name, help=help_)
    s.add_argument("--name", required=True, help="TPU VM name")
    s.add_argument("--zone", required=True, help="e.g. us-central2-b")
    s.add_argument("--project", help="Google Cloud project (default: gcloud's)")
    s.add_argument("--allow-unlisted", action="store_true",
                   help="accept a zone or accelerator type missing from GENERATIONS")
    common.add_common_flags(s)
    if name in ("logs", "delete"):
      if name == "logs":
        s.add_argument("--worker", default="0", help="worker index (or 'all')")
        s.add_argument("--lines", type=int, default=100, help="lines of history to show")
      continue
    s.add_argument("--accelerator-type", required=True, help="e.g. v4-8, v4-32, v6e-16")
    s.add_argument("--version", help="TPU software version (default: the one for the type)")
    if name in ("create", "up"):
      s.add_argument("--spot", action="store_true", help="a Spot (preemptible) TPU VM")
    if name in ("setup", "up"):
      s.add_argument("--python", default="3.12", help="Python version of the workers' venv")
    if name in ("run", "up"):
      s.add_argument("--config", required=True,
                     help="a config of vit_jax by name (pretrain:b16,i1k) or a file, path.py[:arg]")
      s.add_argument("--workdir", required=True, help="gs://BUCKET/PATH (any path on one host)")
      s.add_argument("--no-preflight", "--no_preflight", dest="no_preflight",
                     action="store_true",
                     help="skip compiling the config for the accelerator type here first "
                     "(vit-train --compile_only, which needs libtpu installed here)")
      common.add_overrides(s)
  return p


if __name__ == "__main__":
  sys.exit(main())
