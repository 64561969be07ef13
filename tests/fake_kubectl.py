"""A `kubectl` (and the `gcloud container clusters get-credentials` before it) for the GKE
launcher's tests, installed first on PATH by `scripted_cluster`: a cluster with JobSet
installed, played on this machine from a scripted history, without a network.

What it does is what kubectl and the JobSet controller (kubernetes-sigs/jobset v0.12.0) are
documented to do, as far as launch/gke.py uses them:
- kubectl fails ("The connection to the server localhost:8080 was refused") until
  get-credentials has run.
- `apply -f -` validates the JobSet against the CRD's schema (tests/data/jobset-v0.12.0-crd.yaml.gz,
  unknown fields refused as `--validate=strict` does) and creates one pod per completion of
  each Job, named `JOBSET-RJOB-JOBINDEX-PODINDEX-xxxxx` and labelled as JobSet and Indexed
  Jobs label them (jobset-name, job-index, restart-attempt, job-completion-index).
- `get jobset NAME -o json`, `get pods -l jobset.sigs.k8s.io/jobset-name=NAME -o json`: each
  call moves the cluster on, as time does: a pod is Pending, unschedulable (PodScheduled False,
  Unschedulable, "Insufficient google.com/tpu") for the history's `pending` gets, then
  scheduled (ContainerCreating; or ErrImagePull, then ImagePullBackOff for ever), then Running:
  its container's command runs here, in the clone (the image's /vit_jax), `vit-train` as
  FAKE_KUBECTL_PYTHON -m vit_jax.tools.train, with the container's env (fieldRefs to the pod's
  labels and annotations resolved). It ends Succeeded (exit 0) or Failed (Error, its exit code).
  JobSet's failure policy: a failed pod fails its Job (backoffLimit 0); the controllers, two
  gets later,
  deletes every pod (SIGTERM, 30 s of grace, SIGKILL) and recreates them all, status.restarts
  + 1, while restarts < maxRestarts; else the JobSet gets the condition Failed
  (ReachedMaxRestarts). Every pod Succeeded: condition Completed (AllJobsCompleted).
- `delete jobset NAME` deletes it and its pods; `logs ... -l SELECTOR` prints the pods' logs.

FAKE_KUBECTL_DIR holds `history.json`, one entry per attempt of the JobSet (the first, then one
per restart; the last is kept):

  {"pending": 3,                # gets that find the pods unschedulable first (capacity)
   "image": "ErrImagePull",     # the image cannot be pulled
   "then": {"at_step": 5, "event": "preempt" | "evict" | "crash", "signal": "TERM"}}

An event plays once pod 0's log shows the step: `preempt`, a Spot VM's shutdown (the pod
Failed, reason Terminated, DisruptionTarget TerminationByKubelet, "Pod was terminated in
response to imminent node shutdown."); `evict`, the Eviction API (DisruptionTarget
EvictionByEvictionAPI); `crash`, the process alone is signalled. The fake keeps `state.json`,
`kubectl.log` (every call's arguments) and `pods/NAME.log`.
"""
import fcntl
import functools
import gzip
import json
import os
import pathlib
import random
import re
import shlex
import signal
import string
import subprocess
import sys
import time

import yaml

DIR = pathlib.Path(os.environ.get("FAKE_KUBECTL_DIR", "."))  # Set by the tests.
REPO = pathlib.Path(__file__).resolve().parents[1]
CRD = REPO / "tests" / "data" / "jobset-v0.12.0-crd.yaml.gz"
NODE_SHUTDOWN = "Pod was terminated in response to imminent node shutdown."
GRACE_S = 30.0


class State:
  """state.json, read and written under a lock (pods' supervisors and events write it too)."""

  def __enter__(self) -> dict:
    self.lock = open(DIR / "state.lock", "w")
    fcntl.flock(self.lock, fcntl.LOCK_EX)
    path = DIR / "state.json"
    self.state = json.loads(path.read_text()) if path.exists() else {"credentials": False,
                                                                      "jobset": None}
    return self.state

  def __exit__(self, *exc) -> None:
    (DIR / "state.json").write_text(json.dumps(self.state))
    self.lock.close()


def history(attempt: int) -> dict:
  entries = json.loads((DIR / "history.json").read_text())
  return entries[min(attempt, len(entries) - 1)]


def fail(message: str, code: int = 1) -> int:
  print(message, file=sys.stderr)
  return code


def strict(node):
  """The CRD's schema with unknown fields refused, as the API server's strict field
  validation does (kubectl's default, --validate=strict)."""
  if isinstance(node, list):
    return [strict(x) for x in node]
  if not isinstance(node, dict):
    return node
  out = {k: strict(v) for k, v in node.items()}
  if (isinstance(node.get("properties"), dict) and "additionalProperties" not in node
      and not node.get("x-kubernetes-preserve-unknown-fields")):
    out["additionalProperties"] = False
  return out


@functools.cache
def jobset_schema() -> dict:
  """Read once a process (the tests validate many manifests); by libyaml where PyYAML was
  built with it: the 1.3 MB CRD takes 0.4 s in PyYAML's pure-Python loader, 0.04 s in C."""
  loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
  crd = yaml.load(gzip.decompress(CRD.read_bytes()), Loader=loader)
  (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
  return strict(version["schema"]["openAPIV3Schema"])


def validation_errors(manifest: dict) -> list[str]:
  """What the API server would refuse in a JobSet: `field.path: message` each."""
  import jsonschema  # Only `apply` validates: ~0.1 s of each of the polls' ~170 starts.
  validator = jsonschema.Draft7Validator(jobset_schema())
  return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
          for e in validator.iter_errors(manifest)]


def _suffix() -> str:
  return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def new_pods(js: dict) -> dict:
  """Every pod of the JobSet's attempt `restarts`, Pending."""
  pods, name, restarts = {}, js["metadata"]["name"], js["status"]["restarts"]
  for rjob in js["spec"]["replicatedJobs"]:
    for j in range(rjob.get("replicas", 1)):
      for i in range(rjob["template"]["spec"]["parallelism"]):
        pod = f"{name}-{rjob['name']}-{j}-{i}-{_suffix()}"
        pods[pod] = {"labels": {
            "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name":
            rjob["name"], "jobset.sigs.k8s.io/job-index": str(j),
            "jobset.sigs.k8s.io/restart-attempt": str(restarts),
            "batch.kubernetes.io/job-completion-index": str(i)},
            "annotations": {"jobset.sigs.k8s.io/jobset-name": name},
            "rjob": rjob["name"], "gets": 0, "phase": "Pending", "pid": None, "end": None}
  return pods


def apply(argv: list[str]) -> int:
  manifest = yaml.safe_load(sys.stdin.read())
  errors = validation_errors(manifest)
  name = manifest.get("metadata", {}).get("name")
  if errors:
    return fail(f'The JobSet "{name}" is invalid: ' + "; ".join(errors))
  with State() as s:
    if s["jobset"] is not None:
      return fail(f'Error from server (Conflict): jobsets.jobset.x-k8s.io "{name}" exists')
    manifest["status"] = {"restarts": 0, "conditions": []}
    s["jobset"] = manifest
    s["pods"] = new_pods(manifest)
  print(f"jobset.jobset.x-k8s.io/{name} created")
  return 0


def container(js: dict, rjob: str) -> dict:
  (spec,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == rjob]
  return spec["template"]["spec"]["template"]["spec"]["containers"][0]


def _env(c: dict, pod: dict) -> dict[str, str]:
  env = {}
  for e in c.get("env", []):
    if "value" in e:
      env[e["name"]] = e["value"]
    else:  # metadata.labels['KEY'] or metadata.annotations['KEY'].
      path = e["valueFrom"]["fieldRef"]["fieldPath"]
      kind, key = path.split(".")[1].split("[")[0], path.split("'")[1]
      env[e["name"]] = pod[kind][key]
  return env


def start(name: str, pod: dict, c: dict) -> None:
  """The pod's container, run here under a detached supervisor that keeps its exit code."""
  command = list(c["command"])
  if command[0] == "vit-train":
    command = [os.environ["FAKE_KUBECTL_PYTHON"], "-m", "vit_jax.tools.train", *command[1:]]
  env = {**os.environ, **_env(c, pod), "FAKE_KUBE_POD": name}
  (DIR / "pods").mkdir(exist_ok=True)
  subprocess.Popen([sys.executable, __file__, "--supervise", name, json.dumps(command)],
                   env=env, cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def supervise(name: str, command: list[str]) -> None:
  with open(DIR / "pods" / f"{name}.log", "ab") as log:
    p = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with State() as s:
      pod = s.get("pods", {}).get(name)
      if pod is None:  # Deleted meanwhile: a process of no pod.
        p.kill()
      else:
        pod["pid"] = p.pid
    code = p.wait()
  with State() as s:
    pod = s.get("pods", {}).get(name)
    if pod is not None and pod["end"] is None:
      pod["end"] = {"exit": code if code >= 0 else 128 - code}


def stop(pid: int | None, signum: int, grace_s: float) -> None:
  """Signals a pod's process; after grace_s, SIGKILL (Kubernetes' terminationGracePeriod)."""
  if pid is None:
    return
  try:
    os.kill(pid, signum)
    deadline = time.time() + grace_s
    while time.time() < deadline and _alive(pid):
      time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def advance(s: dict) -> None:
  """One step of time for the pods and the JobSet controller."""
  js = s["jobset"]
  s["terminating"] = [pid for pid in s.get("terminating", []) if _alive(pid)]
  if js is None or js["status"].get("terminalState") or s["terminating"]:
    return  # Jobs are recreated once the old ones' pods are gone (foreground deletion).
  script = history(js["status"]["restarts"])
  # The controllers act on a failed pod a moment after it failed: two gets later.
  failed = any(p.get("failed_gets", 0) >= 2 for p in s["pods"].values())
  for name, pod in s["pods"].items():
    if pod["phase"] == "Failed":
      pod["failed_gets"] = pod.get("failed_gets", 0) + 1
    pod["gets"] += 1
    if pod["phase"] == "Pending" and pod["gets"] > script.get("pending", 0) + 1:
      if "image" not in script:
        pod["phase"] = "Running"
        start(name, pod, container(js, pod["rjob"]))
        if "then" in script and pod["labels"]["batch.kubernetes.io/job-completion-index"] == "0":
          subprocess.Popen([sys.executable, __file__, "--event", name], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if pod["phase"] == "Running" and pod["end"] is not None:
      pod["phase"] = "Succeeded" if pod["end"].get("exit") == 0 else "Failed"
  phases = [p["phase"] for p in s["pods"].values()]
  if phases and all(p == "Succeeded" for p in phases):
    _terminal(js, "Completed", "AllJobsCompleted", "jobset completed successfully")
  elif failed:
    _restart_or_fail(s, js)


def _terminal(js: dict, kind: str, reason: str, message: str) -> None:
  js["status"]["terminalState"] = kind
  js["status"]["conditions"].append({"type": kind, "status": "True", "reason": reason,
                                     "message": message})


def _restart_or_fail(s: dict, js: dict) -> None:
  """JobSet's failure policy: recreate every Job while restarts < maxRestarts."""
  running = [p["pid"] for p in s["pods"].values() if p["phase"] == "Running" and not p["end"]]
  subprocess.Popen([sys.executable, __file__, "--stop", json.dumps(running)],
                   start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  s["terminating"] = [p["pid"] for p in s["pods"].values() if p["pid"] is not None]
  if js["status"]["restarts"] < js["spec"].get("failurePolicy", {}).get("maxRestarts", 0):
    js["status"]["restarts"] += 1
    s["pods"] = new_pods(js)
  else:
    for pod in s["pods"].values():
      pod["phase"] = "Failed" if pod["phase"] != "Succeeded" else pod["phase"]
    _terminal(js, "Failed", "ReachedMaxRestarts",
              "jobset failed due to reaching max number of restarts")


def pod_object(name: str, pod: dict, js: dict, script: dict) -> dict:
  """The pod as `kubectl get pods -o json` shows it."""
  c = container(js, pod["rjob"])
  status: dict = {"phase": pod["phase"]}
  scheduled = pod["phase"] != "Pending" or pod["gets"] > script.get("pending", 0)
  status["conditions"] = [{"type": "PodScheduled", "status": "True"} if scheduled else {
      "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
      "message": "0/3 nodes are available: 3 Insufficient google.com/tpu. preemption: 0/3 "
                 "nodes are available: 3 No preemption victims found for incoming pod."}]
  if pod["phase"] == "Pending" and scheduled:
    pulls = pod["gets"] - script.get("pending", 0)
    reason = ("ContainerCreating" if "image" not in script else
              "ErrImagePull" if pulls <= 2 else "ImagePullBackOff")
    status["containerStatuses"] = [{"name": c["name"], "state": {"waiting": {
        "reason": reason, "message": f'Back-off pulling image "{c["image"]}"'
        if reason == "ImagePullBackOff" else ""}}}]
  end = pod["end"] or {}
  if "reason" in end:  # Taken away with its node, or evicted.
    status.update(reason=end["reason"], message=end["message"])
    status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                 "reason": end["disruption"], "message": end["message"]})
  elif pod["phase"] == "Failed" and "exit" in end:
    status["containerStatuses"] = [{"name": c["name"], "state": {"terminated": {
        "reason": "Error", "exitCode": end["exit"]}}}]
  return {"metadata": {"name": name, "labels": pod["labels"], "annotations": pod["annotations"]},
          "spec": {"containers": [c]}, "status": status}


def get(argv: list[str]) -> int:
  with State() as s:
    advance(s)
    js = s["jobset"]
    if argv[0] == "jobset":
      if js is None or js["metadata"]["name"] != argv[1]:
        return fail(f'Error from server (NotFound): jobsets.jobset.x-k8s.io "{argv[1]}" not '
                    "found")
      print(json.dumps(js))
      return 0
    selector = dict(kv.split("=") for kv in argv[argv.index("-l") + 1].split(","))
    items = [] if js is None else [
        pod_object(n, p, js, history(int(p["labels"]["jobset.sigs.k8s.io/restart-attempt"])))
        for n, p in s["pods"].items() if selector.items() <= p["labels"].items()]
  print(json.dumps({"kind": "List", "items": items}))
  return 0


def delete(argv: list[str]) -> int:
  with State() as s:
    js = s["jobset"]
    if js is None or js["metadata"]["name"] != argv[1]:
      return fail(f'Error from server (NotFound): jobsets.jobset.x-k8s.io "{argv[1]}" not found')
    pids = [p["pid"] for p in s["pods"].values()]
    s["jobset"], s["pods"] = None, {}
  for pid in pids:
    stop(pid, signal.SIGTERM, GRACE_S)
  print(f'jobset.jobset.x-k8s.io "{argv[1]}" deleted')
  return 0


def logs(argv: list[str]) -> int:
  selector = dict(kv.split("=") for kv in argv[argv.index("-l") + 1].split(","))
  with State() as s:
    names = [n for n, p in s.get("pods", {}).items() if selector.items() <= p["labels"].items()]
  for name in names:
    path = DIR / "pods" / f"{name}.log"
    for line in (path.read_text().splitlines() if path.exists() else []):
      print(f"[pod/{name}/vit] {line}")
  return 0


def play_event(name: str) -> None:
  """Waits for pod `name`'s log to show the step, then plays the event on it."""
  with State() as s:
    event = history(int(s["pods"][name]["labels"]["jobset.sigs.k8s.io/restart-attempt"]))["then"]
  log = DIR / "pods" / f"{name}.log"
  deadline = time.time() + 900  # A pod that never gets there (its test failed or was stopped).
  while not any(int(m) >= event["at_step"] for m in re.findall(
      r"^step (\d+)/", log.read_text() if log.exists() else "", re.M)):
    if time.time() > deadline or not DIR.exists():
      return
    time.sleep(0.01)
  kind = event["event"]
  with State() as s:  # The pod's status first, as the kubelet or the Eviction API writes it.
    pod = s["pods"][name]
    pid = pod["pid"]
    if kind != "crash":
      pod["end"] = ({"reason": "Terminated", "disruption": "TerminationByKubelet",
                     "message": NODE_SHUTDOWN} if kind == "preempt" else
                    {"reason": "Evicted", "disruption": "EvictionByEvictionAPI",
                     "message": "Eviction API: evicting"})
  stop(pid, getattr(signal, "SIG" + event.get("signal", "TERM")), GRACE_S)


def gcloud(argv: list[str]) -> int:
  if argv[:3] != ["container", "clusters", "get-credentials"]:
    return fail(f"ERROR: (gcloud) the fake gcloud does not know {shlex.join(argv)}", 2)
  with State() as s:
    s["credentials"] = True
  print(f"Fetching cluster endpoint and auth data.\nkubeconfig entry generated for {argv[3]}.",
        file=sys.stderr)
  return 0


def main(argv: list[str]) -> int:
  if argv[:1] == ["--supervise"]:
    supervise(argv[1], json.loads(argv[2]))
    return 0
  if argv[:1] == ["--event"]:
    play_event(argv[1])
    return 0
  if argv[:1] == ["--stop"]:
    for pid in json.loads(argv[1]):
      stop(pid, signal.SIGTERM, GRACE_S)
    return 0
  with open(DIR / "kubectl.log", "a") as log:
    log.write(shlex.join(argv) + "\n")
  if argv[:1] == ["--gcloud"]:
    return gcloud(argv[1:])
  with State() as s:
    connected = s["credentials"]
  if not connected:
    return fail("The connection to the server localhost:8080 was refused - did you specify "
                "the right host or port?")
  verbs = {"apply": apply, "get": get, "delete": delete, "logs": logs}
  if argv[0] not in verbs:
    return fail(f"error: the fake kubectl does not know {shlex.join(argv)}", 2)
  return verbs[argv[0]](argv[1:])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
