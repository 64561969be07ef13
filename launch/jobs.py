r"""Independent single-process jobs, one per SLURM node, host or TPU VM: the tasks of a transfer
sweep (`vit-transfer CKPT --suite vtab1k --out_dir DIR --launch slurm -- FLAGS` hands them
here), or any list of vit_jax command lines.

  # Each line of standard input: the arguments of one `python -m vit_jax.tools.TOOL` job,
  # e.g. `hf-hub:google/vit-base-patch16-224-in21k --suite cifar10 --out_dir /shared/vtab`.
  python launch/jobs.py slurm --tool transfer --gpus-per-node 8 --partition gpu < JOBS
  python launch/jobs.py hosts --tool transfer --hosts gpu0,gpu1 < JOBS
  python launch/jobs.py tpu_vm --tool transfer --names vit-a,vit-b --zone us-central2-b \
      --accelerator-type v4-8 < JOBS

slurm: one sbatch job per line, on one node with its GPUs, queued side by side.
hosts: each host takes the next job when its last one ends (name a host twice to run two
jobs on it at once); localhost runs here, other hosts over ssh, in --remote-repo. A host that
ssh cannot log in to is refused before any job starts; a job that could not run (ssh lost its
host) keeps --then from running on a partial result.
tpu_vm: single-host TPU VMs made by `launch/tpu_vm.py create` and `setup`; the lines are dealt
to them in turn, each VM runs its share one after another, detached, logging where
`launch/tpu_vm.py logs` reads.
--then ARGS: one more job of the tool once the jobs have ended (a sweep's report): on SLURM a
job that waits for them all, on hosts after them on the first host, on TPU VMs at the end of
each VM's share (the VM that finishes last runs it over everything).
Every job must see the same paths (a shared file system, or gs:// on TPU VMs).
--dry-run prints the commands (for slurm, a bash script that submits them).
"""
import argparse
import importlib.util
import pathlib
import queue
import shlex
import shutil
import subprocess
import sys
import threading
from typing import Callable, Sequence

if __package__ in (None, ""):  # Started as a file: python launch/jobs.py.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import common, tpu_vm  # noqa: E402
from launch.common import LaunchError  # noqa: E402


def read_jobs(lines: Sequence[str]) -> list[list[str]]:
  jobs = [shlex.split(line) for line in lines if line.strip()]
  if not jobs:
    raise LaunchError("no jobs: give one line of arguments per job on standard input.")
  return jobs


def _tool(name: str) -> str:
  """An argparse type: a command module of vit_jax.tools (fewshot, transfer, ...)."""
  if not (name.isidentifier() and importlib.util.find_spec(f"vit_jax.tools.{name}")):
    raise argparse.ArgumentTypeError(f"vit_jax.tools has no module {name!r}: e.g. transfer, "
                                     "fewshot, train")
  return name


def _module(args: argparse.Namespace) -> list[str]:
  return ["-m", f"vit_jax.tools.{args.tool}"]


def slurm_commands(args: argparse.Namespace, jobs: list[list[str]]
                   ) -> tuple[list[list[str]], list[str] | None]:
  """An sbatch per job, each printing its job id (--parsable); the --then job, whose
  --dependency the ids complete (see submit)."""
  env = common.env_pairs(args.env)
  sbatch = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", *common.slurm_options(args),
            f"--chdir={common.REPO}", f"--export={','.join(['ALL', *env])}",
            *shlex.split(args.sbatch_args or "")]
  commands = [[*sbatch, f"--gpus-per-node={args.gpus_per_node}",
               f"--job-name={args.job_name}-{i}", "--wrap",
               shlex.join([args.python, *_module(args), *job])] for i, job in enumerate(jobs)]
  then = None if args.then is None else [
      *sbatch, f"--job-name={args.job_name}-then", "--dependency=afterany:",
      "--wrap", shlex.join([args.python, *_module(args), *shlex.split(args.then)])]
  return commands, then


def _dependency(then: list[str], ids: Sequence[str]) -> list[str]:
  return [f"{a}{':'.join(ids)}" if a == "--dependency=afterany:" else a for a in then]


def submit(commands: list[list[str]], then: list[str] | None, dry_run: bool) -> None:
  """Submits the jobs, then the --then job after them; dry_run prints it as a bash script."""
  if dry_run:
    for i, cmd in enumerate(commands):
      print(f"JOB_{i}=$({shlex.join(cmd)})")
    if then is not None:
      # Unquoted, so that bash expands the ids.
      dependency = _dependency(["--dependency=afterany:"],
                               [f"${{JOB_{i}%;*}}" for i in range(len(commands))])[0]
      print(shlex.join(then).replace("--dependency=afterany:", dependency))
    return
  ids = []
  for cmd in commands:
    print("+ " + shlex.join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    ids.append(out.strip().split(";")[0])  # --parsable: "id" or "id;cluster".
    print(f"submitted job {ids[-1]}", flush=True)
  if then is not None:
    common.execute([_dependency(then, ids)], dry_run=False)
  print(f"Submitted {len(ids)} jobs{' and the --then job after them' if then else ''}: "
        "follow them with `squeue --me`; each logs to slurm-ID.out in "
        f"{common.REPO}.", flush=True)


def host_list(args: argparse.Namespace) -> list[str]:
  hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
  if not hosts:
    raise LaunchError("--hosts is empty: give host names separated by commas.")
  return hosts


def host_command(args: argparse.Namespace, host: str, job: list[str]) -> list[str]:
  """The job run on host: here for localhost, else over ssh in --remote-repo."""
  env = common.env_pairs(args.env)
  process = [*(["env", *env] if env else []), args.python, *_module(args), *job]
  if host in common.LOCAL_HOSTS:
    return process
  remote_repo = args.remote_repo or str(common.REPO)
  return ["ssh", "-o", "BatchMode=yes", host,
          f"cd {shlex.quote(remote_repo)} && {shlex.join(process)}"]


def check_reachable(hosts: Sequence[str]) -> None:
  """Refuses a remote host that ssh cannot log in to (without a password), before any job
  starts: a job there would fail, and the report step would run on what the others wrote."""
  for host in dict.fromkeys(h for h in hosts if h not in common.LOCAL_HOSTS):
    try:
      p = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", host, "true"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise LaunchError(f"--hosts: cannot reach {host} over ssh ({e}); nothing was started.")
    if p.returncode:
      why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
      raise LaunchError(f"--hosts: cannot reach {host} over ssh ({why}); nothing was "
                        "started.")


def _say(message: str) -> None:
  """One write per line: slots print from their own threads."""
  sys.stdout.write(f"[launch] {message}\n")
  sys.stdout.flush()


_SSH_FAILED, _NOT_STARTED = 255, 127


def _execute(prefix: str, cmd: list[str]) -> int:
  _say(f"{prefix}: {shlex.join(cmd)}")
  try:
    p = subprocess.Popen(cmd, cwd=common.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, errors="replace")
  except OSError as e:  # No such program (ssh, the Python): this job fails, the others go on.
    _say(f"{prefix} could not start: {e}")
    return _NOT_STARTED
  common.stream(f"[{prefix}] ", p.stdout)
  code = p.wait()
  _say(f"{prefix} exited with code {code}")
  return code


def execute_on_hosts(slots: list[str], jobs: list[list[str]],
                 command: Callable[[str, list[str]], list[str]],
                 then: list[str] | None = None) -> int:
  """Each slot (a host, as often as it is named) runs the next waiting job when free, as
  command(host, job); then `then` on the first. Returns the first nonzero exit code, or 0."""
  waiting: queue.SimpleQueue = queue.SimpleQueue()
  for i, job in enumerate(jobs):
    waiting.put((i, job))
  codes: dict[int, int] = {}

  def slot(host: str) -> None:
    while True:
      try:
        i, job = waiting.get_nowait()
      except queue.Empty:
        return
      codes[i] = _execute(f"job {i} on {host}", command(host, job))

  threads = [threading.Thread(target=slot, args=(h,), daemon=True) for h in slots]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  ordered = [codes[i] for i in range(len(jobs))]
  failed = [f"job {i} (exit status {c})" for i, c in enumerate(ordered) if c]
  # ssh's status when it lost its host, and ours when a job could not start: that job wrote
  # nothing, so a report would be silently partial.
  not_started = [i for i, c in enumerate(ordered) if c in (_SSH_FAILED, _NOT_STARTED)]
  if then is not None and not not_started:
    ordered.append(_execute("then", command(slots[0], then)))
  if failed:
    skipped = (f"; --then not run, since job(s) {', '.join(map(str, not_started))} could not run"
               if then is not None and not_started else "")
    print(f"error: {len(failed)} of {len(jobs)} jobs failed: {', '.join(failed)}{skipped}",
          file=sys.stderr, flush=True)
  return next((c for c in ordered if c), 0)


def tpu_commands(args: argparse.Namespace, jobs: list[list[str]]) -> list[list[str]]:
  """One detached chain of jobs per TPU VM (the jobs dealt in turn), --then at each end."""
  tpu = tpu_vm.resolve_slice(args.accelerator_type, args.zone, None, args.allow_unlisted)
  if tpu.hosts not in (1, None):
    raise LaunchError(
        f"--accelerator-type {args.accelerator_type}: a job is one process, and a pod slice "
        f"has {tpu.hosts} workers; give single-host TPU VMs (e.g. v4-8, v5litepod-8, v6e-8).")
  names = [n.strip() for n in args.names.split(",") if n.strip()]
  if not names:
    raise LaunchError("--names is empty: give TPU VM names separated by commas.")
  python = [".venv/bin/python", *_module(args)]
  then = [] if args.then is None else [shlex.join([*python, *shlex.split(args.then)])]
  log = tpu_vm.LOG.removeprefix(f"{tpu_vm.REMOTE_DIR}/")
  commands = []
  for k, name in enumerate(names):
    share = [shlex.join([*python, *job]) for job in jobs[k::len(names)]]
    if not share:
      continue
    chain = shlex.quote("; ".join(share + then))
    start = (f"cd {tpu_vm.REMOTE_DIR} && setsid nohup sh -c {chain} > {log} 2>&1 < /dev/null &")
    vm = argparse.Namespace(**{**vars(args), "name": name})
    commands.append(tpu_vm._ssh(vm, tpu.worker_flags, start))
  return commands


def handle(args: argparse.Namespace) -> int:
  jobs = read_jobs(sys.stdin.readlines())
  if args.target == "slurm":
    commands, then = slurm_commands(args, jobs)
    if not args.dry_run and not shutil.which("sbatch"):
      raise LaunchError("sbatch not found: run this on a SLURM login node (or use --dry-run).")
    submit(commands, then, args.dry_run)
    return 0
  if args.target == "tpu_vm":
    commands = tpu_commands(args, jobs)
    if not args.dry_run and not shutil.which("gcloud"):
      raise LaunchError("gcloud is not installed: see cloud.google.com/sdk/docs/install "
                        "(or look at the commands with --dry-run).")
    common.execute(commands, args.dry_run)
    if not args.dry_run:
      print(f"Started on {len(commands)} TPU VMs. Follow one: python launch/tpu_vm.py logs "
            f"--name NAME --zone {args.zone}", flush=True)
    return 0
  hosts, then = host_list(args), None if args.then is None else shlex.split(args.then)
  common.env_pairs(args.env)  # Checked before anything starts.
  if args.dry_run:  # The jobs as the queue deals them when they take equally long.
    dealt = [host_command(args, hosts[i % len(hosts)], job) for i, job in enumerate(jobs)]
    common.execute(dealt + ([host_command(args, hosts[0], then)] if then else []), True)
    return 0
  check_reachable(hosts)
  return execute_on_hosts(hosts, jobs, lambda host, job: host_command(args, host, job), then)


def parser() -> argparse.ArgumentParser:
  p = common.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="target", required=True)
  slurm = sub.add_parser("slurm", help="an sbatch job per line, one node each")
  common.add_slurm_flags(slurm)
  slurm.add_argument("--sbatch-args", help="more sbatch options, e.g. '--mem=0 --exclusive'")
  hosts = sub.add_parser("hosts", help="a queue of lines over hosts (ssh; localhost runs here)")
  hosts.add_argument("--hosts", required=True, help="host0,host1,...: a host named twice runs "
                                                    "two jobs at once")
  hosts.add_argument("--remote-repo", help="the repository on remote hosts (default: this "
                                           "one's path)")
  tpu = sub.add_parser("tpu_vm", help="lines dealt to single-host TPU VMs, detached")
  tpu.add_argument("--names", required=True, help="TPU VM names, comma-separated")
  tpu.add_argument("--zone", required=True)
  tpu.add_argument("--accelerator-type", required=True, help="the VMs' type, e.g. v4-8")
  tpu.add_argument("--project", type=common.project_id,
                   help="Google Cloud project (default: gcloud's)")
  tpu.add_argument("--allow-unlisted", action="store_true",
                   help="accept a zone or accelerator type missing from tpu_vm.GENERATIONS")
  for s in (slurm, hosts, tpu):
    s.add_argument("--tool", required=True, type=_tool,
                   help="the vit_jax.tools module each line runs, e.g. transfer")
    s.add_argument("--then", help="the arguments of one more job once the jobs have ended")
    common.add_common_flags(s)
    if s is not tpu:
      s.add_argument("--python", default=sys.executable,
                     help="Python with vit_jax installed, wherever a job runs (default: this one)")
      s.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="environment variable for every job (repeatable)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Submits (or with --dry-run prints) one job per line of standard input."""
  return common.main(parser(), argv, handle)


if __name__ == "__main__":
  sys.exit(main())
