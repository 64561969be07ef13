r"""Multi-host GPU (or CPU) jobs: one `vit-train` process per GPU under SLURM, or one per
host from a host list.

  # SLURM: 2 nodes x 8 GPUs; jax.distributed.initialize() reads SLURM's variables.
  python launch/multihost.py slurm --nodes 2 --gpus-per-node 8 --partition gpu \
      --config pretrain:b16,i1k --workdir /shared/vit_b16
  # Host list, torchrun-style: process i runs on host i (over ssh), host 0 coordinates.
  python launch/multihost.py hosts --hosts gpu0,gpu1 --port 29500 \
      --config pretrain:b16,i1k --workdir /shared/vit_b16 -- --config.batch_size=1024

Every process must see the same --workdir (a shared file system or gs://) and, for a host
list, the repository and Python at the same paths (override with --remote-repo, --python).
Hosts named localhost run here, without ssh, talking over 127.0.0.1; on CPU, vit-train
picks gloo for the collectives. --dry-run prints one command per process.
"""
import argparse
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from typing import Sequence

if __package__ in (None, ""):  # Started as a file: python launch/multihost.py.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import common  # noqa: E402
from launch.common import LaunchError  # noqa: E402


def _train_args(args: argparse.Namespace, config: str) -> list[str]:
  workdir = args.workdir if "://" in args.workdir else os.path.abspath(args.workdir)
  return ["-m", "vit_jax.tools.train", "--config", config, "--workdir", workdir]


def slurm_commands(args: argparse.Namespace) -> list[list[str]]:
  """One srun: a task per GPU, each seeing all of its node's GPUs.

  jax.distributed.initialize() gives task i the node's GPU SLURM_LOCALID, so tasks must
  not be bound to GPUs (--gpu-bind=none) and one task per node would use a single GPU.
  """
  config, arg = common.check_config(args.config)
  env = common.env_pairs(args.env)
  options = [*common.slurm_options(args), f"--job-name={args.job_name}"]
  srun = ["srun", f"--nodes={args.nodes}", f"--ntasks-per-node={args.gpus_per_node}",
          f"--gpus-per-node={args.gpus_per_node}", "--gpu-bind=none", "--kill-on-bad-exit=1",
          *options, f"--export={','.join(['ALL', *env])}", f"--chdir={common.REPO}",
          *shlex.split(args.srun_args or "")]
  train = _train_args(args, args.config if config is None else f"{config}{arg}")
  return [[*srun, args.python, *train, "--distributed", *args.overrides]]


def _remote_path(path: pathlib.Path, remote_repo: str) -> str:
  """The path on a remote host: under its repository if it is under ours."""
  try:
    return os.path.join(remote_repo, str(path.relative_to(common.REPO)))
  except ValueError:
    return str(path)


def hosts_commands(args: argparse.Namespace) -> list[list[str]]:
  """One command per host: local ones run directly, others through ssh."""
  config, arg = common.check_config(args.config)
  env = common.env_pairs(args.env)
  hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
  if not hosts:
    raise LaunchError("--hosts is empty: give host names separated by commas.")
  local = [h in common.LOCAL_HOSTS for h in hosts]
  if local[0] and not all(local):
    raise LaunchError(f"--hosts {args.hosts}: the remote hosts cannot reach host 0 as "
                      f"{hosts[0]}; name it as they know it.")
  coordinator = f"{'127.0.0.1' if local[0] else hosts[0]}:{args.port}"
  remote_repo = args.remote_repo or str(common.REPO)
  commands = []
  for i, (host, is_local) in enumerate(zip(hosts, local)):
    if config is None:  # Shipped in vit_jax: found by name on every host.
      spec = args.config
    else:
      spec = (str(config) if is_local else _remote_path(config, remote_repo)) + arg
    process = [*(["env", *env] if env else []), args.python,
               *_train_args(args, spec), f"--coordinator_address={coordinator}",
               f"--num_processes={len(hosts)}", f"--process_id={i}", *args.overrides]
    if is_local:
      commands.append(process)
    else:
      commands.append(["ssh", "-o", "BatchMode=yes", host,
                       f"cd {shlex.quote(remote_repo)} && {shlex.join(process)}"])
  return commands


def execute_processes(commands: Sequence[Sequence[str]]) -> int:
  """Starts all commands at once and prefixes their output with [i]; when one fails,
  stops the others. Returns the exit code of the first to fail (128 + N for signal N), or 0."""
  procs, threads = [], []
  for i, cmd in enumerate(commands):
    print(f"[launch] process {i}: {shlex.join(cmd)}", flush=True)
    p = subprocess.Popen(cmd, cwd=common.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, errors="replace")
    procs.append(p)
    threads.append(threading.Thread(target=common.stream, args=(f"[{i}] ", p.stdout), daemon=True))
    threads[-1].start()
  codes: dict[int, int] = {}
  first_failure = 0  # In the order the processes ended: those stopped after it do not count.
  try:
    while len(codes) < len(procs):
      for i, p in enumerate(procs):
        if i in codes or p.poll() is None:
          continue
        codes[i] = p.returncode
        threads[i].join()
        print(f"[launch] process {i} exited with code {p.returncode}", flush=True)
        if p.returncode and not first_failure:
          first_failure = p.returncode
          _stop(other for j, other in enumerate(procs) if j not in codes)
      if len(codes) < len(procs):
        threading.Event().wait(0.2)
  except KeyboardInterrupt:
    _stop(procs)
    raise
  return first_failure if first_failure >= 0 else 128 - first_failure  # Killed: as shells do.


def _stop(procs) -> None:
  procs = [p for p in procs if p.poll() is None]
  for p in procs:
    p.send_signal(signal.SIGTERM)
  for p in procs:
    try:
      p.wait(timeout=30)
    except subprocess.TimeoutExpired:
      p.kill()


def handle(args: argparse.Namespace) -> int:
  commands = slurm_commands(args) if args.mode == "slurm" else hosts_commands(args)
  if args.dry_run:
    common.execute(commands, dry_run=True)
    return 0
  if args.mode == "slurm":
    if not shutil.which("srun"):
      raise LaunchError("srun not found: run this on a SLURM login node (or use --dry-run).")
    common.execute(commands, dry_run=False)
    return 0
  return execute_processes(commands)


def parser() -> argparse.ArgumentParser:
  p = common.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="mode", required=True)
  slurm = sub.add_parser("slurm", help="srun, one task per GPU")
  slurm.add_argument("--nodes", type=common.count(1), required=True)
  common.add_slurm_flags(slurm)
  slurm.add_argument("--srun-args", help="more srun options, e.g. '--exclusive --mem=0'")
  hosts = sub.add_parser("hosts", help="one process per host (ssh; localhost runs here)")
  hosts.add_argument("--hosts", required=True, help="host0,host1,...: host 0 coordinates")
  hosts.add_argument("--port", type=common.port, default=29500, help="coordinator port on host 0")
  hosts.add_argument("--remote-repo", help="the repository on remote hosts (default: this one's "
                                           "path)")
  for s in (slurm, hosts):
    s.add_argument("--config", required=True, type=common.nonempty,
                   help="a config of vit_jax by name (pretrain:b16,i1k) or a file, path.py[:arg]")
    s.add_argument("--workdir", required=True, type=common.nonempty, help="shared by all processes")
    s.add_argument("--python", default=sys.executable,
                   help="Python with vit_jax installed, on every host (default: this one)")
    s.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for every process (repeatable)")
    common.add_common_flags(s)
    common.add_overrides(s)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Starts (or with --dry-run prints) one process per host, through SLURM or ssh."""
  return common.main(parser(), argv, handle)


if __name__ == "__main__":
  sys.exit(main())
