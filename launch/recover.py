"""Follows a job on queued-resource TPU slices until its workdir says it finished, and brings it
back when it stops short: a slice preempted, deleted, under maintenance or unhealthy (while
the job runs or while it is set up), or the job's process gone without finishing. Then it
deletes the queued resource, asks for the same one again, sets the slices up and reruns the
same command, which resumes from the last step saved in the workdir. A job that ended on
slices the TPU service calls healthy is run again there first; failing the same way again
without progress, on new slices; a third time, it is the run's failure (a bug, not capacity:
exit status 1). A restart hands the new job the workdir's lock that the stopped one left
(common.lock_handover): its machine may be gone, and the lock would name it for ever.

It gives up on a set-up that fails twice in a row on healthy slices, on a job that refuses its
input (vit-train's exit status 2, the same on any slice), after --max-restarts restarts, and on
Ctrl-C, which leaves the slices and their job as they are. Each event is one line with its
time. The workdir's goodput.json (vit_jax/goodput.py) tells the job's progress, and records
each wait for capacity.
"""
import argparse
import dataclasses
import json
import subprocess
import time
from typing import Callable

from launch import common, queued
from launch.common import say
from vit_jax import goodput

_NODE_GONE = ("PREEMPTED", "TERMINATED", "STOPPING", "STOPPED", "DELETING", "DELETED")
_NODE_DOWN = ("REPAIRING", "RESTARTING")  # There still, but not running the job.
_HEALTHY = (None, "", "HEALTHY", "HEALTH_UNSPECIFIED")


@dataclasses.dataclass(frozen=True)
class Job:
  """What following a job needs of the launcher (launch/tpu_vm.py)."""
  args: argparse.Namespace  # --name, --zone, --project, --workdir, --num-slices and the spec.
  # Starts the run on every node, with the environment given; set up first if asked.
  start: Callable[[bool, dict[str, str]], None]
  node_command: Callable[[str], list[str]]  # A node's description as JSON.
  exit_command: Callable[[str], list[str]]  # Prints the run's exit status once it ended.
  poll_s: float = 60.0


def _node_trouble(job: Job, node: str) -> str | None:
  text = queued.described(job.node_command(node), job.poll_s)
  if text is None:
    return f"deleted (node {node} is gone)"
  d = json.loads(text)
  state, health = d.get("state"), d.get("health")
  maintenance = d.get("upcomingMaintenance", {}).get("maintenanceStatus") == "ONGOING"
  if state == "PREEMPTED":
    return f"preempted (node {node})"
  if state in _NODE_GONE:
    return f"deleted (node {node} is {state})"
  if maintenance or health == "UNHEALTHY_MAINTENANCE":
    return f"under maintenance (node {node})"
  if state in _NODE_DOWN:
    return f"unhealthy (node {node} is {state})"
  if health not in _HEALTHY:
    return f"unhealthy (node {node}: {health})"
  return None


def _queued_trouble(state: queued.State) -> str | None:
  if state.name in ("SUSPENDING", "SUSPENDED"):
    return f"preempted (queued resource {state})"
  return None if state.name == "ACTIVE" else f"deleted (queued resource {state})"


def slice_trouble(job: Job) -> str | None:
  """What keeps the slices from running the job, or None."""
  trouble = _queued_trouble(queued.describe(job.args))
  if trouble:
    return trouble
  trouble = next(filter(None, (_node_trouble(job, n) for n in queued.node_names(job.args))), None)
  if trouble and trouble.startswith("deleted"):
    # A preempted node is STOPPING before it is PREEMPTED, and may be so already when the
    # queued resource was still ACTIVE a moment before: it says SUSPENDING by now.
    return _queued_trouble(queued.describe(job.args)) or trouble
  return trouble


def job_ended(job: Job) -> str | None:
  """How the job ended on the first node where it did (its exit status, or its process gone
  without one), or None while it runs."""
  for node in queued.node_names(job.args):
    out = subprocess.run(job.exit_command(node), capture_output=True, text=True).stdout.split()
    if codes := [int(word) for word in out if word.isdigit()]:
      return f"exited with status {codes[0]}"
    if "gone" in out:
      return f"gone (no process and no exit status on {node}: restarted?)"
  return None


@dataclasses.dataclass
class Progress:
  """What the workdir's record says: attempts seen, the step reached, finished or not."""
  attempts: int = 0
  step: int = 0
  finished: bool = False

  @classmethod
  def read(cls, workdir: str) -> "Progress":
    attempts = goodput.read(workdir)["attempts"]
    return cls(len(attempts), max((a["last_step"] for a in attempts), default=0),
               bool(attempts) and attempts[-1]["outcome"] == "finished")


def _announce(workdir: str, seen: int, before: Progress) -> int:
  """Says each attempt that started since `seen`; returns the attempts seen now."""
  attempts = goodput.read(workdir)["attempts"]
  for a in attempts[seen:]:
    k = a["start_step"]
    again = f", {before.step - k} steps to do again" if before.step > k else ""
    say(f"started at step {k}{again}" if k == 0 else f"resumed at step {k}{again}")
  return len(attempts)


def watch(job: Job, seen: int) -> tuple[str | None, int]:
  """Polls until the job finished (None) or stopped short (why); and the attempts seen."""
  workdir, before = job.args.workdir, Progress.read(job.args.workdir)
  while True:
    seen = _announce(workdir, seen, before)
    if Progress.read(workdir).finished:
      return None, seen
    trouble = slice_trouble(job)
    if trouble:
      return trouble, seen
    ended = job_ended(job)
    if ended:
      if Progress.read(workdir).finished:
        return None, _announce(workdir, seen, before)
      return ended, seen
    time.sleep(job.poll_s)


def request(job: Job, why: str) -> None:
  """Deletes what is left of the queued resource, asks for it again, waits for it and records
  the wait in the workdir."""
  args = job.args
  state = queued.describe(args)
  while state.name in ("SUSPENDING", "DELETING"):  # A preempted job saves meanwhile.
    time.sleep(job.poll_s)
    state = queued.describe(args)
  if state.name != "NOT_FOUND":
    common.execute([queued.delete_command(args)], dry_run=False)
  requested = time.time()
  common.execute([queued.create_command(args, args.accelerator_type, args.version)], False)
  say(f"requested {args.accelerator_type}{_slices(args)} as queued resource {args.name}"
      f" ({queued.tier(args) or 'on-demand'})")
  queued.wait_active(args, say, job.poll_s)
  say(f"active after {goodput.duration(time.time() - requested)}")
  if getattr(args, "workdir", None) and not goodput.record_capacity(  # `create` has none.
      args.workdir, requested, time.time(), why):
    say(f"this wait is not in {goodput.path(args.workdir)}: it could not be read just now")


def start(job: Job, setup: bool = True, env: dict[str, str] | None = None) -> str | None:
  """Sets up the slices (if asked) and starts the job; None, or why it did not start: the
  slices taken away meanwhile (a Spot slice can go during its set-up), or the command that
  failed."""
  try:
    job.start(setup, env or {})
  except subprocess.CalledProcessError as e:
    return slice_trouble(job) or (
        f"set-up failed ({' '.join(e.cmd[3:6])} exited with code {e.returncode})")
  return None


def _slices(args: argparse.Namespace) -> str:
  return f" x {args.num_slices} slices" if args.num_slices > 1 else ""


def left_as_is(args: argparse.Namespace) -> int:
  """After Ctrl-C: what is left, and how to follow it again or delete it; exit status 130."""
  say(f"stopped following: queued resource {args.name} and its job are left as they are. "
      f"Follow it again: python launch/tpu_vm.py watch (with `up`'s flags); delete it: "
      f"python launch/tpu_vm.py delete --queued --name {args.name} --zone {args.zone}")
  return 130


def follow(job: Job, first: str) -> int:
  """Runs the job to its end through every restart it needs; the exit status. `first`: "request"
  the slices, "wait" for the queued resource there to become active (then start the job), or
  "watch" the job running there."""
  try:
    return _follow(job, first)
  except KeyboardInterrupt:
    return left_as_is(job.args)


def _not_capacity(job: Job, trouble: str, step: int) -> str:
  """Why a run or its set-up failing the same way again stops the launcher."""
  if trouble.startswith("set-up"):
    return (f"{trouble} twice in a row, on slices the TPU service called healthy: not a lack "
            "of capacity; gcloud's output is above")
  node = queued.node_names(job.args)[0]
  log = f"python launch/tpu_vm.py logs --name {node} --zone {job.args.zone}"
  if trouble == "exited with status 2":  # vit-train's refusal of its input, in one line.
    return (f"the job refused its input (exit status 2), as it would on any slice; its log "
            f"says why: {log}")
  return (f"the job {trouble} three times in a row without progress past step {step}, on the "
          f"same slices and on new ones: a failure of the run, not of capacity; read its log: "
          f"{log}")


@dataclasses.dataclass
class _Next:
  """What the follower does after the job stopped short."""
  fresh: bool  # New slices (else the same ones, the job run again there).
  handover: dict[str, str]  # The restart's environment: the stopped job's lock.


def _next(job: Job, trouble: str, times: int) -> _Next:
  """After the job stopped short for `trouble`, the same way `times` times in a row without
  progress: where to run it again, or Failed."""
  ended = trouble.startswith(("exited", "gone"))  # On slices the poll found healthy.
  if trouble.startswith("set-up") and times >= 2 or trouble == "exited with status 2" or (
      ended and times >= 3):
    raise common.Failed(_not_capacity(job, trouble, Progress.read(job.args.workdir).step))
  return _Next(fresh=not ended or times == 2,
               handover=common.lock_handover(job.args.workdir))


def _follow(job: Job, first: str) -> int:
  restarts, last, times = 0, None, 0
  # A queued resource waiting (a follower stopped in the wait) holds no slice: no job runs.
  then = _Next(True, common.lock_handover(job.args.workdir) if first == "wait" else {})
  why = "the first request"
  seen = Progress.read(job.args.workdir).attempts
  while True:
    trouble = None
    if first != "watch" or restarts:
      if first == "wait" and not restarts:
        say(f"queued resource {job.args.name} is not active yet: waiting, then starting the job")
        queued.wait_active(job.args, say, job.poll_s)
      elif then.fresh:
        request(job, why)
      else:
        say("running the job again on the same slices, which the TPU service calls healthy")
      trouble = start(job, setup=then.fresh, env=then.handover)
    if trouble is None:
      trouble, seen = watch(job, seen)
    progress = Progress.read(job.args.workdir)
    if trouble is None:
      return _finished(job.args, progress)
    why = f"{trouble} at about step {progress.step}"
    say(why)
    times = times + 1 if last == (trouble, progress.step) else 1
    last = (trouble, progress.step)
    then = _next(job, trouble, times)
    restarts += 1
    if restarts > job.args.max_restarts:
      raise common.Failed(f"gave up after {job.args.max_restarts} restarts (--max-restarts); "
                          f"the job stopped at step {progress.step}: {trouble}")


def _finished(a: argparse.Namespace, progress: Progress) -> int:
  say(f"finished at step {progress.step}; the slice is still yours (and billed): python "
      f"launch/tpu_vm.py delete --queued --name {a.name} --zone {a.zone}")
  summary = goodput.summarize(goodput.read(a.workdir))
  if summary is not None:
    print("\n".join(goodput.format_summary(summary)), flush=True)
  return 0
