r"""GKE: a training run as a JobSet, one pod per TPU VM of each slice, as XPK and MaxText
launch JAX: on a cluster with a TPU node pool, for TPU7x (used through GKE only) or any of
GKE's v4, v5e, v5p and v6e node pools.

  python launch/gke.py build --image us-docker.pkg.dev/PROJECT/REPO/vit_jax
  python launch/gke.py up --name vit --cluster C --location us-central1 --tpu-type tpu7x-16 \
      --config pretrain:b16,i21k --workdir gs://BUCKET/vit_b16 \
      --image us-docker.pkg.dev/PROJECT/REPO/vit_jax --spot -- --config.batch_size=4096
  python launch/gke.py watch --name vit --cluster C --location us-central1
  python launch/gke.py logs --name vit --cluster C --location us-central1
  python launch/gke.py delete --name vit --cluster C --location us-central1

`up` compiles the config for the slice here first (`vit-train --compile_only`, as
`tpu_vm.py up` does), applies the JobSet and follows it: one line per change of its pods
(pending for capacity, scheduled, running, preempted or evicted, failed with the pod's reason),
each restart JobSet makes after a pod fails (up to --max-restarts; the run resumes from the
workdir), the end and the run's goodput. Ctrl-C leaves the JobSet running; `watch` follows it
again. Every command takes --dry-run: `up` then prints the manifest as YAML, the commands it
would run as `#` lines above it, and runs nothing.
"""
import argparse
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
from typing import Any, Sequence

if __package__ in (None, ""):  # Started as a file: python launch/gke.py.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import yaml  # noqa: E402

from launch import accelerators, common, jobset, tpu_vm  # noqa: E402
from launch.common import LaunchError  # noqa: E402

IMAGE_DIR = "/vit_jax"  # The clone in the image (launch/Dockerfile).
CONTAINER = "vit"
REPLICATED_JOB = "slice"
COORDINATOR_PORT = "8482"  # jax.distributed's on Cloud TPU.
SPOT = "cloud.google.com/gke-spot"
# A JobSet's name is a DNS label in its pods' host names (NAME-slice-J-P) and Job names; XPK
# keeps workload names to 40 characters for the same reason.
_name = common.matching(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?",
                        "{text} is no JobSet name here: lowercase letters, digits and hyphens, "
                        "starting with a letter, not ending with a hyphen, at most 40 characters")


def credentials_command(args: argparse.Namespace) -> list[str]:
  """kubectl's credentials for the cluster (its current context from then on)."""
  project = [f"--project={args.project}"] if args.project else []
  return ["gcloud", "container", "clusters", "get-credentials", args.cluster,
          f"--location={args.location}", *project]


def train_command(args: argparse.Namespace, tpu: accelerators.Slice) -> list[str]:
  """vit-train in the image: a shipped config by name, a file of the clone by its path there."""
  config, arg = common.check_config(args.config)
  spec = args.config
  if config is not None:
    if not config.is_relative_to(common.REPO):
      raise LaunchError(f"--config {args.config}: the pods run the image's clone "
                        f"({common.REPO} as built by `build`); put the file in it and build "
                        "again, or use a config of vit_jax by name.")
    spec = f"{config.relative_to(common.REPO)}{arg}"
  if "://" not in args.workdir and not os.path.isabs(args.workdir):
    raise LaunchError(f"--workdir {args.workdir}: a pod restarted on another node starts with "
                      "an empty disk, and this machine follows the run there: give "
                      "gs://BUCKET/PATH.")
  distributed = ["--distributed"] if tpu.vms * args.num_slices > 1 else []
  return ["vit-train", "--config", spec, "--workdir", args.workdir, *distributed,
          *args.overrides]


def _field(path: str) -> dict[str, Any]:
  return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def environment(args: argparse.Namespace, tpu: accelerators.Slice) -> list[dict[str, Any]]:
  """What JAX needs: the coordinator (slice 0's first pod, through the JobSet's headless
  service; GKE sets each pod's TPU_WORKER_ID and TPU_WORKER_HOSTNAMES); for several slices the
  megascale variables, as tpu_vm.py sets them."""
  first = f"{args.name}-{REPLICATED_JOB}-0-0.{args.name}"
  env = [{"name": "JOBSET_NAME", **_field(f"metadata.annotations['{jobset.NAME_KEY}']")}]
  if tpu.vms * args.num_slices > 1:
    env.append({"name": "JAX_COORDINATOR_ADDRESS", "value": f"{first}:{COORDINATOR_PORT}"})
  if args.num_slices > 1:
    env += [{"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": first},
            {"name": "MEGASCALE_PORT", "value": tpu_vm.MEGASCALE_PORT},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(args.num_slices)},
            {"name": "MEGASCALE_SLICE_ID", **_field(f"metadata.labels['{jobset.JOB_INDEX}']")}]
  return env


def pod_spec(args: argparse.Namespace, tpu: accelerators.Slice) -> dict[str, Any]:
  """A TPU VM's pod: on the slice's node pool, all its chips, Spot where asked."""
  selector = {"cloud.google.com/gke-tpu-accelerator": tpu.label,
              "cloud.google.com/gke-tpu-topology": tpu.topology}
  spot = {}
  if args.spot:
    selector[SPOT] = "true"
    spot = {"tolerations": [{"key": SPOT, "operator": "Equal", "value": "true",
                             "effect": "NoSchedule"}]}
  container = {"name": CONTAINER, "image": args.image, "workingDir": IMAGE_DIR,
               "command": train_command(args, tpu), "env": environment(args, tpu),
               "ports": [{"containerPort": int(COORDINATOR_PORT)},
                         {"containerPort": int(tpu_vm.MEGASCALE_PORT)}],
               "resources": {"limits": {"google.com/tpu": tpu.chips_per_vm}}}
  # A Spot VM's notice is 30 s: the run saves on SIGTERM within it.
  return {"restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
          "nodeSelector": selector, **spot, "containers": [container]}


def manifest(args: argparse.Namespace, tpu: accelerators.Slice) -> dict[str, Any]:
  """The JobSet: a Job per slice, a pod per TPU VM, each slice on a node pool of its own;
  a failed pod fails its Job (backoffLimit 0) and JobSet restarts them all."""
  job = {"parallelism": tpu.vms, "completions": tpu.vms, "completionMode": "Indexed",
         "backoffLimit": 0, "template": {"spec": pod_spec(args, tpu)}}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {"name": args.name, "annotations": {
          jobset.EXCLUSIVE_KEY: "cloud.google.com/gke-nodepool"}},
      "spec": {"failurePolicy": {"maxRestarts": args.max_restarts},
               "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
               "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": args.num_slices,
                                   "template": {"spec": job}}]}}


def build_commands(args: argparse.Namespace) -> list[list[str]]:
  return [["docker", "build", "--file", str(common.REPO / "launch" / "Dockerfile"), "--tag",
           args.image, str(common.REPO)], ["docker", "push", args.image]]


def _comments(commands: Sequence[Sequence[str]]) -> str:
  return "".join(f"# {shlex.join(c)}\n" for c in commands)


def _check(args: argparse.Namespace, *programs: str) -> None:
  for program in programs:
    if not args.dry_run and not shutil.which(program):
      raise LaunchError(f"{program} is not installed: see cloud.google.com/kubernetes-engine/"
                        "docs/how-to/cluster-access-for-kubectl (or look at the commands with "
                        "--dry-run).")


def up(args: argparse.Namespace) -> int:
  tpu = accelerators.resolve(args.tpu_type)
  text = yaml.safe_dump(manifest(args, tpu), sort_keys=False)  # Checks config and workdir.
  if not args.no_preflight:
    common.preflight(args.config, args.tpu_type, args.overrides, args.num_slices)
  apply = ["kubectl", "apply", "-f", "-"]
  if args.dry_run:
    polls = [jobset.jobset_command(args.name), jobset.pods_command(args.name)]
    print(_comments([credentials_command(args), jobset.jobset_command(args.name)]) +
          f"# {shlex.join(apply)}  (this manifest on its stdin)\n" + _comments(polls) + text,
          end="", flush=True)
    return 0
  _check(args, "gcloud", "kubectl")
  common.execute([credentials_command(args)], dry_run=False)
  if jobset.get(jobset.jobset_command(args.name), args.poll_seconds) is not None:
    raise LaunchError(f"JobSet {args.name} exists already: follow it with `watch`, or delete it "
                      "first with `delete`.")
  print("+ " + shlex.join(apply), flush=True)
  subprocess.run(apply, input=text, text=True, check=True)
  return jobset.follow(_target(args, args.workdir, args.max_restarts))


def _target(args: argparse.Namespace, workdir: str, max_restarts: int) -> jobset.Target:
  where = f"--name {args.name} --cluster {args.cluster} --location {args.location}"
  return jobset.Target(args.name, workdir, max_restarts, args.poll_seconds, where,
                       watching=args.command == "watch")


def watch(args: argparse.Namespace) -> int:
  """Follows a JobSet that `up` applied: its workdir and restarts read from its spec."""
  if args.dry_run:
    print(_comments([credentials_command(args), jobset.jobset_command(args.name),
                     jobset.pods_command(args.name)]), end="")
    return 0
  _check(args, "gcloud", "kubectl")
  common.execute([credentials_command(args)], dry_run=False)
  found = jobset.get(jobset.jobset_command(args.name), args.poll_seconds)
  if found is None:
    raise common.Failed(f"JobSet {args.name} not found on cluster {args.cluster}: start it "
                        "with `up`.")
  workdir, max_restarts = jobset.workdir_and_restarts(found)
  return jobset.follow(_target(args, workdir, max_restarts))


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
  """kubectl logs of one pod: slice --slice's TPU VM --worker."""
  selector = (f"{jobset.NAME_KEY}={args.name},{jobset.JOB_INDEX}={args.slice},"
              f"{jobset.COMPLETION_INDEX}={args.worker}")
  return [credentials_command(args),
          ["kubectl", "logs", "--follow", f"--tail={args.lines}", "--prefix", "-l", selector,
           "-c", CONTAINER]]


def handle(args: argparse.Namespace) -> int:
  if args.command == "up":
    return up(args)
  if args.command == "watch":
    return watch(args)
  if args.command == "build":
    _check(args, "docker")
    commands = build_commands(args)
  elif args.command == "logs":
    _check(args, "gcloud", "kubectl")
    commands = logs_commands(args)
  else:
    _check(args, "gcloud", "kubectl")
    commands = [credentials_command(args), ["kubectl", "delete", "jobset", args.name]]
  common.execute(commands, args.dry_run)
  return 0


def parser() -> argparse.ArgumentParser:
  p = common.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  helps = {"up": "compile here, apply the JobSet and follow it to its end",
           "watch": "follow a JobSet that `up` applied (after Ctrl-C, or from elsewhere)",
           "logs": "follow one pod's log", "delete": "delete the JobSet and its pods",
           "build": "build the image (launch/Dockerfile) and push it"}
  for name, help_ in helps.items():
    s = sub.add_parser(name, help=help_)
    common.add_common_flags(s)
    if name == "build":
      s.add_argument("--image", required=True, help="e.g. us-docker.pkg.dev/PROJECT/REPO/vit_jax")
      continue
    s.add_argument("--name", required=True, type=_name, help="the JobSet's name")
    s.add_argument("--cluster", required=True, help="the GKE cluster")
    s.add_argument("--location", required=True, help="its region or zone")
    s.add_argument("--project", type=common.project_id,
                   help="Google Cloud project (default: gcloud's)")
    if name in ("up", "watch"):
      s.add_argument("--poll-seconds", type=common.seconds, default=30.0,
                     help="seconds between looks at the JobSet (default: %(default)s)")
    if name == "logs":
      s.add_argument("--slice", type=common.count(0), default=0, help="which slice (default 0)")
      s.add_argument("--worker", type=common.count(0), default=0,
                     help="which TPU VM of it (default 0)")
      s.add_argument("--lines", type=common.count(0), default=100,
                     help="lines of history to show")
    if name == "up":
      _add_up_flags(s)
  return p


def _add_up_flags(s: argparse.ArgumentParser) -> None:
  s.add_argument("--tpu-type", required=True,
                 help=f"GKE's name of the slice: {accelerators.known_types()} (e.g. tpu7x-16)")
  s.add_argument("--config", required=True,
                 help="a config of vit_jax by name (pretrain:b16,i1k) or a file of this clone")
  s.add_argument("--workdir", required=True, help="gs://BUCKET/PATH")
  s.add_argument("--image", required=True, help="the image `build` pushed")
  s.add_argument("--spot", action="store_true", help="on a Spot node pool")
  s.add_argument("--num-slices", type=common.count(1), default=1,
                 help="slices of --tpu-type joined over the data-center network (multislice)")
  s.add_argument("--max-restarts", type=common.count(0), default=20,
                 help="JobSet's restarts after a pod fails, before the JobSet fails "
                 "(default: %(default)s)")
  s.add_argument("--no-preflight", action="store_true",
                 help="skip compiling the config for the slice here first (vit-train "
                 "--compile_only, which needs libtpu installed here)")
  common.add_overrides(s)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs (or with --dry-run prints) one GKE subcommand; returns its exit status."""
  return common.main(parser(), argv, handle)


if __name__ == "__main__":
  sys.exit(main())
