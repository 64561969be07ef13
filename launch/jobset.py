"""Follows a run's JobSet on GKE to its end, through `kubectl get`: one line per change of its
pods (pending for capacity, scheduled, running, preempted or evicted, failed with the reason
in the pod's status), each restart JobSet makes after a pod failed (it recreates every Job;
vit-train resumes from the workdir), and the end: the JobSet's Completed condition (exit 0,
with the run's goodput), its Failed condition (its reason, and the last pod's: exit 1), or an
image the nodes cannot pull (exit 1).

WORKDIR/goodput.json gets each wait for capacity, as on TPU VMs (launch/recover.py): from the
JobSet's start or restart until every pod of the new attempt is scheduled on a node. Ctrl-C
leaves the JobSet running (exit 130); `gke.py watch` follows it again.
"""
import collections
import dataclasses
import json
import time
from typing import Any

from launch import common, queued, recover
from launch.common import say
from vit_jax import goodput

# Labels and annotations JobSet (sigs.k8s.io/jobset, v1alpha2) and Kubernetes' Indexed Jobs
# put on the pods.
NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
RESTART_KEY = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
EXCLUSIVE_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# A pod taken away with its node (a Spot VM's shutdown, a node drained or deleted), by
# the DisruptionTarget condition's reason, or the pod's own status.reason.
PREEMPTED = ("TerminationByKubelet", "DeletionByTaintManager", "PreemptionByScheduler",
             "DeletionByPodGC", "Terminated", "Shutdown", "NodeShutdown", "NodeLost")
EVICTED = ("EvictionByEvictionAPI", "Evicted")
PULL_FAILED = ("ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  workdir: str
  max_restarts: int
  poll_s: float
  where: str  # --name, --cluster and --location, for the commands it prints.
  watching: bool = False  # Picked up by `watch`: a wait already over is not recorded again.


def jobset_command(name: str) -> list[str]:
  return ["kubectl", "get", "jobset", name, "-o", "json"]


def pods_command(name: str) -> list[str]:
  return ["kubectl", "get", "pods", "-l", f"{NAME_KEY}={name}", "-o", "json"]


def get(command: list[str], poll_s: float) -> dict[str, Any] | None:
  """kubectl get's object; None where it is not found. A failing API is said and tried again
  a poll later, as queued.py's describes are."""
  text = queued.described(command, poll_s)
  return None if text is None else json.loads(text)


def workdir_and_restarts(found: dict[str, Any]) -> tuple[str, int]:
  """The run's --workdir and the JobSet's maxRestarts, from a JobSet that gke.py applied."""
  job = found["spec"]["replicatedJobs"][0]["template"]["spec"]
  command = job["template"]["spec"]["containers"][0]["command"]
  return (command[command.index("--workdir") + 1],
          found["spec"].get("failurePolicy", {}).get("maxRestarts", 0))


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
  return next((c for c in obj.get("status", {}).get("conditions", [])
               if c.get("type") == kind and c.get("status") == "True"), None)


def _why(reason: str | None, message: str | None) -> str:
  return ": ".join(filter(None, (reason, message))) or "no reason given"


def pod_state(pod: dict[str, Any]) -> tuple[str, str]:
  """(what the pod is doing, the detail its status gives)."""
  status = pod.get("status", {})
  phase = status.get("phase")
  if phase in ("Succeeded", "Running"):
    return phase.lower(), ""
  if phase == "Failed":
    disruption = _condition(pod, "DisruptionTarget") or {}
    reason = disruption.get("reason") or status.get("reason")
    message = disruption.get("message") or status.get("message")
    if reason in PREEMPTED:
      return "preempted", _why(reason, message)
    if reason in EVICTED:
      return "evicted", _why(reason, message)
    ended = [c["state"]["terminated"] for c in status.get("containerStatuses", [])
             if "terminated" in c.get("state", {})]
    if ended:
      return "failed", _why(ended[0].get("reason"), f"exit code {ended[0].get('exitCode')}")
    return "failed", _why(reason, message)
  scheduled = next((c for c in status.get("conditions", []) if c["type"] == "PodScheduled"), {})
  if scheduled.get("status") != "True":
    return "pending for capacity", _why(scheduled.get("reason"), scheduled.get("message"))
  waiting = [c["state"]["waiting"] for c in status.get("containerStatuses", [])
             if "waiting" in c.get("state", {})]
  if waiting and waiting[0].get("reason") in (*PULL_FAILED, "ErrImagePull"):
    return "image not pulled", _why(waiting[0]["reason"], waiting[0].get("message"))
  return "scheduled", ""


def pods_line(states: list[tuple[str, str]]) -> str:
  """`pods: 2 running, 1 preempted (TerminationByKubelet: ...)`."""
  counts = collections.Counter(states)
  return "pods: " + ", ".join(f"{n} {kind}" + (f" ({detail})" if detail else "")
                              for (kind, detail), n in sorted(counts.items()))


@dataclasses.dataclass
class Attempt:
  """What the follower knows of the JobSet's current attempt."""
  restarts: int
  requested: float
  why: str
  scheduled: bool = False
  line: str = ""
  said_at: float = 0.0
  failure: str | None = None  # The first pod failure seen: why JobSet will restart.


def _pods(target: Target, attempt: Attempt) -> list[dict[str, Any]]:
  found = get(pods_command(target.name), target.poll_s) or {"items": []}
  return [p for p in found["items"] if p["metadata"].get("labels", {}).get(
      RESTART_KEY, str(attempt.restarts)) == str(attempt.restarts)]


def _observe(target: Target, attempt: Attempt, pods: list[dict[str, Any]]) -> None:
  """Says the pods' line where it changed (or every 15 minutes the same); records the wait
  for capacity once they are all scheduled; raises Failed for an image not pulled."""
  states = [pod_state(p) for p in pods]
  if pods and not attempt.scheduled and "pending for capacity" not in (k for k, _ in states):
    attempt.scheduled = True  # Recorded before it is said: a Ctrl-C then loses nothing.
    if not goodput.record_capacity(target.workdir, attempt.requested, time.time(), attempt.why):
      say(f"this wait is not in {goodput.path(target.workdir)}: it could not be read just now")
  line = pods_line(states) if pods else "no pods yet"
  if line != attempt.line or time.time() - attempt.said_at >= queued.STILL_WAITING_S:
    say(line)
    attempt.line, attempt.said_at = line, time.time()
  for pod, (kind, detail) in zip(pods, states):
    if kind in ("preempted", "evicted", "failed") and attempt.failure is None:
      attempt.failure = f"pod {pod['metadata']['name']} {kind} ({detail})"
    if kind == "image not pulled" and detail.startswith(PULL_FAILED):
      image = pod["spec"]["containers"][0]["image"]
      raise common.Failed(
          f"the nodes cannot pull image {image} ({detail}): build and push it with `python "
          f"launch/gke.py build --image {image}`, or fix --image; the JobSet is left as it is: "
          f"python launch/gke.py delete {target.where}")


def _run_outcome(workdir: str) -> str:
  """Why the run's last attempt ended, as it recorded it: a pod ended between two looks."""
  attempts = goodput.read(workdir)["attempts"]
  outcome = attempts[-1]["outcome"] if attempts else None
  if outcome == "stopped":
    return "a pod ended (the run was signalled to stop: preempted or evicted)"
  if outcome and outcome.startswith("failed"):
    return f"a pod ended (the run {outcome})"
  return "a pod ended (the run ended without a word: killed, or it never started)"


def _restarted(target: Target, attempt: Attempt, restarts: int) -> Attempt:
  step = recover.Progress.read(target.workdir).step
  why = f"{attempt.failure or _run_outcome(target.workdir)} at about step {step}"
  say(f"JobSet restarting (restart {restarts} of {target.max_restarts}): {why}")
  return Attempt(restarts, time.time(), why)


def follow(target: Target) -> int:
  """Follows the JobSet to its end; the exit status."""
  try:
    return _follow(target)
  except KeyboardInterrupt:
    say(f"stopped following: JobSet {target.name} goes on. Follow it again: python "
        f"launch/gke.py watch {target.where}; delete it: python launch/gke.py delete "
        f"{target.where}")
    return 130


def _follow(target: Target) -> int:
  before = recover.Progress.read(target.workdir)
  seen, attempt = before.attempts, None
  while True:
    found = get(jobset_command(target.name), target.poll_s)
    if found is None:
      raise common.Failed(f"JobSet {target.name} is gone (deleted?); the run stopped at step "
                          f"{recover.Progress.read(target.workdir).step}")
    restarts = found.get("status", {}).get("restarts", 0)
    pods = None
    if attempt is None:
      why = "the first request" if restarts == 0 else f"restart {restarts}, before `watch`"
      attempt = Attempt(restarts, time.time(), why)
      pods = _pods(target, attempt)
      # Scheduled before `watch` began: when is not known, so not recorded.
      attempt.scheduled = target.watching and bool(pods) and all(
          pod_state(p)[0] != "pending for capacity" for p in pods)
    elif restarts > attempt.restarts:
      attempt = _restarted(target, attempt, restarts)
    _observe(target, attempt, pods if pods is not None else _pods(target, attempt))
    seen = recover._announce(target.workdir, seen, before)
    if _condition(found, "Completed"):
      return _finished(target)
    if failed := _condition(found, "Failed"):
      raise common.Failed(
          f"JobSet {target.name} failed ({_why(failed.get('reason'), failed.get('message'))}) "
          f"at step {recover.Progress.read(target.workdir).step}; the last pod: "
          f"{attempt.failure or 'none failed'}; its log: python launch/gke.py logs "
          f"{target.where}")
    time.sleep(target.poll_s)


def _finished(target: Target) -> int:
  record = goodput.read(target.workdir)
  say(f"finished at step {recover.Progress.read(target.workdir).step}; the JobSet's pods have "
      f"ended (their nodes go back to the node pool): python launch/gke.py delete "
      f"{target.where} removes it")
  summary = goodput.summarize(record)
  if summary is not None:
    print("\n".join(goodput.format_summary(summary)), flush=True)
  return 0
