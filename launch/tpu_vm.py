r"""Cloud TPU VMs: create one (a single host or a pod slice), install this project on every
worker, start a config's training job on all of them, follow the log, delete it.

  python launch/tpu_vm.py up --name vit --zone us-central2-b --accelerator-type v4-32 \
      --config pretrain:b16,i1k --workdir gs://BUCKET/vit_b16 -- --config.batch_size=4096
  python launch/tpu_vm.py up --name vit-ft --zone us-central2-b --accelerator-type v4-8 \
      --config finetune:b16,cifar10 --workdir gs://BUCKET/vit_b16_cifar10 \
      -- --config.pretrained=hf-hub:google/vit-base-patch16-224-in21k
  python launch/tpu_vm.py logs --name vit --zone us-central2-b
  python launch/tpu_vm.py delete --name vit --zone us-central2-b

`up` is `create`, `setup` and `start` in turn; each is also a command of its own. Every
command takes --dry-run, which prints the gcloud commands instead of running them. The
job runs detached (it survives the ssh session) with --distributed on pod slices, where
jax.distributed.initialize() finds the other workers by itself.

`up` and `start` first compile the config's steps for the accelerator type here (`vit-train
--compile_only`, libtpu without a TPU) and stop, before any gcloud command, if it does not fit
the chips' memory, naming the change that makes it fit; --no-preflight skips that.

Capacity that has to be waited for (launch/queued.py, launch/recover.py):

  python launch/tpu_vm.py up --queued --spot --recover --name vit --zone us-west4-a \
      --accelerator-type v5litepod-16 --config pretrain:b16,i1k --workdir gs://BUCKET/vit_b16
  python launch/tpu_vm.py delete --queued --name vit --zone us-west4-a

--queued asks for the slice through a queued resource (--spot, --reserved or --best-effort;
--valid-until-duration; --num-slices N for multislice) and waits for it, saying each state;
--recover then follows the job to its end, asking for the slice again and resuming the run
whenever it stops short; `watch`, with the same flags as `up`, follows a job already started
(and asks for no capacity where no queued resource stands under --name). Every flag is checked
before the first gcloud command: a bad one is exit status 2 and one `error:` line.
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

if __package__ in (None, ""):  # Started as a file: python launch/tpu_vm.py.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import common, queued, recover  # noqa: E402
from launch.common import LaunchError  # noqa: E402
from vit_jax.train import tpu_specs  # noqa: E402

REMOTE_DIR = "vit_jax"  # On each worker, relative to the home directory.
LOG = f"{REMOTE_DIR}/logs/train.log"
EXIT = f"{REMOTE_DIR}/logs/train.exit"  # The job's exit status, once it ended.
PID = f"{REMOTE_DIR}/logs/train.pid"  # The process that writes EXIT.
# Prints EXIT, or "gone" where neither it nor its process is there (a machine restarted).
JOB_STATUS = f"cat {EXIT} 2>/dev/null || kill -0 $(cat {PID} 2>/dev/null) 2>/dev/null || echo gone"
MEGASCALE_PORT = "8080"  # Slices' port for the megascale runtime, as MaxText and XPK use.


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


_gcloud = common.tpu_vm_command


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


def train_commands(args: argparse.Namespace, tpu: Slice,
                   env: dict[str, str] | None = None) -> list[list[str]]:
  """Copies a config file of the user's to every worker (a shipped config is installed there
  already) and starts the job there, detached, logging to LOG, with `env` set; its exit
  status goes to EXIT."""
  config, arg = common.check_config(args.config)
  # Slices of one host each still make a run of several processes, on machines of their own.
  slices = getattr(args, "num_slices", 1)
  if (tpu.hosts != 1 or slices > 1) and not args.workdir.startswith("gs://"):
    machines = "the workers of a pod slice" if tpu.hosts != 1 else f"the {slices} slices"
    raise LaunchError(
        f"--workdir {args.workdir}: {machines} share no disk, so checkpoints "
        "must go to a bucket: give --workdir gs://BUCKET/PATH.")
  distributed = [] if tpu.hosts == 1 and slices == 1 else ["--distributed"]
  spec = args.config if config is None else f"run_configs/{config.name}{arg}"
  train = [*(["env", *(f"{k}={v}" for k, v in env.items())] if env else []), ".venv/bin/python",
           "-m", "vit_jax.tools.train", "--config", spec, "--workdir", args.workdir,
           *distributed, *args.overrides]
  log, status, pid = (p.removeprefix(f"{REMOTE_DIR}/") for p in (LOG, EXIT, PID))
  script = shlex.quote(f"{shlex.join(train)}; echo $? > {status}")
  # Not one `&&` list: `&` would send the cd to the background with the job.
  start = (f"cd {REMOTE_DIR} && rm -f {status} {pid} || exit 1; setsid nohup sh -c {script} "
           f"> {log} 2>&1 < /dev/null & echo $! > {pid}")
  copy = [] if config is None else [
      _gcloud("scp", args, str(config), f"{args.name}:{REMOTE_DIR}/run_configs/",
              *tpu.worker_flags)]
  return [*copy, _ssh(args, tpu.worker_flags, start)]


def preflight(args: argparse.Namespace) -> None:
  """`vit-train --compile_only` for the accelerator type (and --num-slices), here, before any
  gcloud command (common.preflight), where tpu_specs has the chip's figures."""
  generation = args.accelerator_type.rsplit("-", 1)[0]
  if generation not in tpu_specs.BY_CLOUD_PREFIX:
    print(f"preflight: skipped, no chip figures for {generation} (vit_jax/train/tpu_specs.py)",
          file=sys.stderr, flush=True)
    return
  common.preflight(args.config, args.accelerator_type, args.overrides,
                   getattr(args, "num_slices", 1))


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
  return [_ssh(args, [f"--worker={args.worker}"], f"tail -n {args.lines} -F {LOG}")]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
  if args.queued:
    return [queued.delete_command(args)]
  return [_gcloud("delete", args, args.name, "--quiet")]


def _check_zone(zone: str, allow_unlisted: bool) -> None:
  zones = sorted({z for gen in GENERATIONS.values() for z in gen.zones})
  if zone not in zones and not allow_unlisted:
    raise LaunchError(f"--zone {zone!r} offers no Cloud TPUs; known zones: {', '.join(zones)}. "
                      "If that changed, pass --allow-unlisted.")


def _node(args: argparse.Namespace, name: str) -> argparse.Namespace:
  return argparse.Namespace(**{**vars(args), "name": name})


def _multislice_env(args: argparse.Namespace, slice_id: int, coordinator: str) -> dict[str, str]:
  """What JAX (libtpu's megascale runtime) needs to join slices over the data-center network:
  the coordinator is slice 0's worker 0."""
  return {"MEGASCALE_COORDINATOR_ADDRESS": coordinator, "MEGASCALE_PORT": MEGASCALE_PORT,
          "MEGASCALE_NUM_SLICES": str(args.num_slices), "MEGASCALE_SLICE_ID": str(slice_id)}


def coordinator_command(args: argparse.Namespace) -> list[str]:
  return _gcloud("describe", args, queued.node_names(args)[0],
                 "--format=value(networkEndpoints[0].ipAddress)")


def start_commands(args: argparse.Namespace, tpu: Slice, setup: bool,
                   coordinator: str | None = None,
                   env: dict[str, str] | None = None) -> list[list[str]]:
  """Setup (if asked) and the run on every node of a queued resource, with `env` set (a
  restart's lock handover): with --num-slices, each slice with its multislice environment."""
  commands = []
  for i, name in enumerate(queued.node_names(args)):
    node = _node(args, name)
    node_env = {**(_multislice_env(args, i, coordinator) if args.num_slices > 1 else {}),
                **(env or {})}
    commands += ((setup_commands(node, tpu) if setup else []) +
                 train_commands(node, tpu, node_env or None))
  return commands


def _queued_job(args: argparse.Namespace, tpu: Slice) -> recover.Job:
  def start(setup: bool, env: dict[str, str]) -> None:
    if args.command == "create":
      return
    coordinator = None
    if args.num_slices > 1:
      print("+ " + shlex.join(coordinator_command(args)), flush=True)
      coordinator = subprocess.run(coordinator_command(args), check=True, capture_output=True,
                                   text=True).stdout.strip()
    common.execute(start_commands(args, tpu, setup, coordinator, env), dry_run=False)

  return recover.Job(
      args, start, lambda node: _gcloud("describe", args, node, "--format=json"),
      lambda node: _gcloud("ssh", args, node, *tpu.worker_flags, "--command", JOB_STATUS),
      args.poll_seconds)


def _queued_dry_run(args: argparse.Namespace, tpu: Slice, job: recover.Job) -> None:
  """Every gcloud command the launch may run, in order: the request, the wait and the start;
  following the job (--recover, watch), the checks of each poll and, when the job stopped
  short, the deletion before the request again."""
  request = [queued.create_command(args, tpu.accelerator_type, tpu.version),
             queued.describe_command(args)]
  if args.command != "create":
    coordinator = None
    if args.num_slices > 1:
      request.append(coordinator_command(args))
      coordinator = f"IP_OF_{queued.node_names(args)[0]}_WORKER_0"  # Found once active.
    request += start_commands(args, tpu, True, coordinator)
  nodes = queued.node_names(args)
  polls = [queued.describe_command(args), *map(job.node_command, nodes),
           *map(job.exit_command, nodes), queued.delete_command(args)]
  following = getattr(args, "recover", False)
  commands = (polls + request if args.command == "watch" else
              request + polls if following else request)
  common.execute(commands, dry_run=True)


def handle_queued(args: argparse.Namespace, tpu: Slice) -> int:
  """create / up / watch through a queued resource."""
  args.version = tpu.version
  job = _queued_job(args, tpu)
  if args.dry_run:
    _queued_dry_run(args, tpu, job)
    return 0
  state = queued.describe(args)
  _check_existing(args, state)
  if getattr(args, "recover", False):  # up --recover, watch.
    first = ("request" if args.command != "watch" else
             "wait" if state.name in queued.WAITING else "watch")
    return recover.follow(job, first)
  try:
    recover.request(job, "the first request")
    job.start(True, {})
  except KeyboardInterrupt:
    return recover.left_as_is(args)
  if args.command == "up":
    print(f"Started. Follow it: python launch/tpu_vm.py logs --name "
          f"{queued.node_names(args)[0]} --zone {args.zone}")
  return 0


def _check_existing(args: argparse.Namespace, state: queued.State) -> None:
  """What stands under --name before anything is asked for. `watch` follows a queued resource
  that is there, and never asks for one that is not (a typo in --name would start a job).
  `create` and `up` ask for one anew: asking deletes what is there, which would take a
  running job's slice away, so they refuse any but a FAILED one (no capacity in it), which
  the request replaces."""
  where = f"--name {args.name} --zone {args.zone}"
  if args.command == "watch":
    if state.name == "NOT_FOUND":
      raise LaunchError(f"{where}: there is no such queued resource, so no job to follow; start "
                        "one with `up --queued --recover` (watch asks for no capacity).")
    if state.name == "FAILED":
      raise LaunchError(f"{where}: queued resource {args.name} is {state}, so no job runs "
                        f"there; ask anew with `up --queued --recover`.")
  elif state.name not in ("NOT_FOUND", "FAILED"):
    raise LaunchError(f"queued resource {args.name} exists already ({state}): follow its "
                      "job with `watch` (the same flags as `up`), or delete it first with "
                      "`delete --queued`.")
  elif state.name == "FAILED":
    common.say(f"queued resource {args.name} is {state}: replaced by this request")


def _check_flags(args: argparse.Namespace, tpu: Slice) -> None:
  """--queued's flags: refused without it, and checked against the slice."""
  if getattr(args, "queued", False):
    queued.check(args, args.accelerator_type.rsplit("-", 1)[0])
    # A relative path is under ~/vit_jax on the slice and under the cwd here.
    if getattr(args, "recover", False) and not (
        "://" in args.workdir or os.path.isabs(args.workdir)):
      raise LaunchError(
          f"--workdir {args.workdir}: following the job reads its progress there, from this "
          "machine, and a slice asked for again starts with an empty disk: give "
          "gs://BUCKET/PATH (or a file system mounted at one absolute path here and there).")
    return
  needs = [f for f in ("reserved", "best_effort", "valid_until_duration", "recover")
           if getattr(args, f, None)]
  needs += ["num_slices"] if getattr(args, "num_slices", 1) > 1 else []
  if needs:
    flag = "--" + needs[0].replace("_", "-")
    raise LaunchError(f"{flag} asks for a queued resource: add --queued.")


def handle(args: argparse.Namespace) -> int:
  if args.command in ("logs", "delete"):
    _check_zone(args.zone, args.allow_unlisted)
    commands = logs_commands(args) if args.command == "logs" else delete_commands(args)
  else:
    tpu = resolve_slice(args.accelerator_type, args.zone, args.version, args.allow_unlisted)
    _check_flags(args, tpu)
    # The training job's commands first: building them checks the config and workdir.
    train = train_commands(args, tpu) if args.command in ("start", "up", "watch") else []
    if train and not args.no_preflight and args.command != "watch":
      preflight(args)
    if getattr(args, "queued", False):
      _check_gcloud(args)
      return handle_queued(args, tpu)
    create = create_commands(args, tpu) if args.command in ("create", "up") else []
    setup = setup_commands(args, tpu) if args.command in ("setup", "up") else []
    commands = create + setup + train
  _check_gcloud(args)
  common.execute(commands, args.dry_run)
  if args.command in ("start", "up") and not args.dry_run:
    print(f"Started. Follow it: python launch/tpu_vm.py logs --name {args.name} --zone {args.zone}")
  return 0


def _check_gcloud(args: argparse.Namespace) -> None:
  if not args.dry_run and not shutil.which("gcloud"):
    raise LaunchError("gcloud is not installed: see cloud.google.com/sdk/docs/install "
                      "(or look at the commands with --dry-run).")


def main(argv: Sequence[str] | None = None) -> int:
  """Runs (or with --dry-run prints) one TPU VM subcommand; returns its exit status."""
  return common.main(parser(), argv, handle)


def parser() -> argparse.ArgumentParser:
  p = common.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  helps = {"up": "create + setup + start", "create": "create the TPU VM",
           "setup": "copy and install this project on every worker",
           "start": "start the config's training job on every worker",
           "logs": "follow a worker's log",
           "delete": "delete the TPU VM (--queued: the queued resource and its nodes)",
           "watch": "follow a job started by `up --queued`, bringing it back as --recover "
                    "does (the same flags as that `up`)"}
  for name, help_ in helps.items():
    s = sub.add_parser(name, help=help_)
    s.add_argument("--name", required=True, type=common.resource_name, help="TPU VM name")
    s.add_argument("--zone", required=True, help="e.g. us-central2-b")
    s.add_argument("--project", type=common.project_id,
                   help="Google Cloud project (default: gcloud's)")
    s.add_argument("--allow-unlisted", action="store_true",
                   help="accept a zone or accelerator type missing from GENERATIONS")
    common.add_common_flags(s)
    if name in ("logs", "delete"):
      if name == "logs":
        s.add_argument("--worker", type=_worker, default="0", help="worker index (or 'all')")
        s.add_argument("--lines", type=common.count(0), default=100,
                       help="lines of history to show")
      else:
        s.add_argument("--queued", action="store_true",
                       help="delete the queued resource --name and its nodes")
      continue
    s.add_argument("--accelerator-type", required=True, help="e.g. v4-8, v4-32, v6e-16")
    s.add_argument("--version", help="TPU software version (default: the one for the type)")
    if name in ("create", "up", "watch"):
      _add_capacity_flags(s, name)
    if name in ("setup", "up", "watch"):
      s.add_argument("--python", type=_python, default="3.12",
                     help="Python version of the workers' venv")
    if name in ("start", "up", "watch"):
      s.add_argument("--config", required=True, type=common.nonempty,
                     help="a config of vit_jax by name (pretrain:b16,i1k) or a file, path.py[:arg]")
      s.add_argument("--workdir", required=True, type=common.nonempty,
                     help="gs://BUCKET/PATH (any path on one host)")
      s.add_argument("--no-preflight", "--no_preflight", dest="no_preflight",
                     action="store_true",
                     help="skip compiling the config for the accelerator type here first "
                     "(vit-train --compile_only, which needs libtpu installed here)")
      common.add_overrides(s)
  return p


# The workers' venv Python, as uv takes it (3.12, 3.11.9, cpython@3.12).
_python = common.matching(r"((cpython|python)@?)?3\.\d+(\.\d+)?",
                          "{text} is no Python version uv takes: e.g. 3.12")


def _worker(text: str) -> str:
  return text if text == "all" else str(common.count(0)(text))


def _add_capacity_flags(s: argparse.ArgumentParser, name: str) -> None:
  """How the slice is obtained (create, up, watch) and, for up and watch, followed."""
  if name == "watch":
    s.set_defaults(queued=True, recover=True)
  else:
    s.add_argument("--queued", action="store_true",
                   help="through a queued resource: waits for the capacity, then goes on")
  tiers = s.add_mutually_exclusive_group()
  tiers.add_argument("--spot", action="store_true", help="Spot (preemptible) capacity")
  tiers.add_argument("--reserved", action="store_true",
                     help="with --queued: from your project's reservation")
  tiers.add_argument("--best-effort", dest="best_effort", action="store_true",
                     help="with --queued: the best-effort tier (gcloud alpha)")
  s.add_argument("--valid-until-duration", type=queued.duration,
                 help="with --queued: give up on the request if not filled within this long, "
                 "e.g. 6h")
  s.add_argument("--num-slices", type=common.count(1), default=1,
                 help="with --queued: slices of --accelerator-type, joined over the data-center "
                 "network (multislice); their nodes are NAME-0, NAME-1, ...")
  if name == "up":
    s.add_argument("--recover", action="store_true",
                   help="with --queued: follow the job to its end, asking for the slice again "
                   "and resuming the run whenever it stops short")
  if name in ("up", "watch"):
    s.add_argument("--max-restarts", type=common.count(0), default=20,
                   help="with --recover: restarts before giving up (default: %(default)s)")
  s.add_argument("--poll-seconds", type=common.seconds, default=60.0,
                 help="with --queued: seconds between checks of the queued resource, the slice "
                 "and the job (default: %(default)s)")


if __name__ == "__main__":
  sys.exit(main())
