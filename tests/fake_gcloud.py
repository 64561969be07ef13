"""A `gcloud` for the launcher's tests (installed first on PATH by helpers.scripted_gcloud):
it plays a scripted history of queued resources on this machine, without a network.

FAKE_GCLOUD_DIR holds `history.json`, one entry per `queued-resources create`, in order:

  {"states": ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"],  # one per describe, the
                                                                   # last one kept
   "error": "why a FAILED state failed",
   "node": {"state": "PREEMPTED"},  # the nodes once ACTIVE (default READY and HEALTHY)
   "install_exit": 1,               # the install's exit status on them (default 0)
   "unavailable": 2,                # describes of it that fail first (the API down a while)
   "then": {"at_step": 6,
            "event": "preempt" | "maintenance" | "unhealthy" | "delete" | "crash" | "restart",
            "signal": "TERM" | "KILL"}}                            # once the job logs the step

and what the fake keeps: `state.json`, `gcloud.log` (the arguments of every call) and each
node's home folder, `home/NODE`, where `tpu-vm ssh` runs the commands it is given (the
install excepted: FAKE_GCLOUD_PYTHON, the tests' Python, stands in for the workers' venv) and
`tpu-vm scp` copies files. An event kills the node's processes (those whose environment
names the node) with its signal, as the TPU service's would: a preemption or a deletion takes
the slice away, maintenance or a fault leaves it unhealthy, a crash only ends the job, a
restart ends every process of the node, which comes back healthy.

Each VM that a request brings has a host name of its own, as TPU VMs name themselves
(t1v-n-XXXXXXXX-w-0, new with each request; `hosts.log` lists them), which the processes its
ssh starts see (socket.gethostname, through a sitecustomize on their PYTHONPATH): a lock left
on one VM names another host on the next. FAKE_GCLOUD_DENY (a part of a command line) makes
the calls it names fail with PERMISSION_DENIED, from the first.
"""
import fcntl
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
import zlib

DIR = pathlib.Path(os.environ["FAKE_GCLOUD_DIR"])
NODE_ENV = "FAKE_TPU_NODE"


class State:
  """state.json, read and written under a lock (the event watcher writes it too)."""

  def __enter__(self) -> dict:
    self.lock = open(DIR / "state.lock", "w")
    fcntl.flock(self.lock, fcntl.LOCK_EX)
    path = DIR / "state.json"
    self.state = json.loads(path.read_text()) if path.exists() else {"creates": 0, "qr": None}
    return self.state

  def __exit__(self, *exc) -> None:
    (DIR / "state.json").write_text(json.dumps(self.state))
    self.lock.close()


def history() -> list[dict]:
  return json.loads((DIR / "history.json").read_text())


def flag(argv: list[str], name: str) -> str | None:
  return next((a.split("=", 1)[1] for a in argv if a.startswith(name + "=")), None)


def fail(message: str, code: int = 1) -> int:
  print(f"ERROR: (gcloud) {message}", file=sys.stderr)
  return code


def queued_resources(verb: str, argv: list[str]) -> int:
  with State() as s:
    qr = s["qr"]
    if verb == "create":
      if qr is not None:
        return fail("ALREADY_EXISTS: the queued resource exists")
      count = int(flag(argv, "--node-count") or 1)
      nodes = ([flag(argv, "--node-id")] if count == 1 else
               [f"{flag(argv, '--node-prefix')}-{i}" for i in range(count)])
      s["qr"] = {"request": s["creates"], "describes": 0, "nodes": nodes, "fixed": None,
                 "hosts": {n: host_name(n, s["creates"]) for n in nodes}}
      with open(DIR / "hosts.log", "a") as log:
        log.writelines(f"{s['creates']} {n} {h}\n" for n, h in s["qr"]["hosts"].items())
      s["creates"] += 1
      return 0
    if qr is None:
      return fail("NOT_FOUND: queued resource not found")
    if verb == "delete":
      kill(qr["nodes"], signal.SIGKILL)
      s["qr"] = None
      return 0
    if qr.setdefault("failing", history()[qr["request"]].get("unavailable", 0)):
      qr["failing"] -= 1
      return fail("UNAVAILABLE: The service is currently unavailable.")
    print(json.dumps({"state": describe(qr)}))
    return 0


DENIED = ("PERMISSION_DENIED: Permission 'tpu.queuedResources.get' denied on resource "
          "'projects/p/locations/us-west4-a/queuedResources/vit' (or it may not exist).")


def host_name(node: str, request: int) -> str:
  """Worker 0's host name on a node that request `request` brought."""
  return f"t1v-n-{zlib.crc32(f'{node}/{request}'.encode()):08x}-w-0"


def describe(qr: dict) -> dict:
  """The next state of the request's history (or the state an event left)."""
  if qr["fixed"]:
    return qr["fixed"]
  request = history()[qr["request"]]
  name = request["states"][min(qr["describes"], len(request["states"]) - 1)]
  qr["describes"] += 1
  if name == "ACTIVE" and "health" not in qr:
    found = request.get("node", {"state": "READY", "health": "HEALTHY"})
    qr["health"] = {n: dict(found) for n in qr["nodes"]}
  if name == "FAILED":
    return {"state": name, "failedData": {"error": {"code": 9, "message": request["error"]}}}
  return {"state": name}


def node(name: str) -> dict | None:
  with State() as s:
    qr = s["qr"]
    return None if qr is None else qr.get("health", {}).get(name)


def tpu_vm(verb: str, argv: list[str]) -> int:
  paths = [a for a in argv if not a.startswith("--")]
  name = paths[-1].split(":")[0] if verb == "scp" else argv[0]
  found = node(name)
  if found is None:
    return fail(f"NOT_FOUND: node {name} not found")
  if verb == "describe":
    print("127.0.0.1" if "ipAddress" in (flag(argv, "--format") or "") else json.dumps(found))
    return 0
  if found["state"] != "READY":
    return fail(f"ssh: connect to {name}: the node is {found['state']}", 255)
  home = DIR / "home" / name
  if verb == "scp":
    *sources, target = paths
    dest = home / target.split(":", 1)[1]
    dest.mkdir(parents=True, exist_ok=True)
    for source in map(pathlib.Path, sources):
      if source.is_file():
        (dest / source.name).write_bytes(source.read_bytes())
    return 0
  return ssh(name, home, argv[argv.index("--command") + 1])


def ssh(name: str, home: pathlib.Path, command: str) -> int:
  """Runs the command in the node's home; the install is the tests' venv already there."""
  if "uv pip install" in command:
    with State() as s:
      return history()[s["qr"]["request"]].get("install_exit", 0)
  python = home / "vit_jax" / ".venv" / "bin" / "python"
  if not python.exists():
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(os.environ["FAKE_GCLOUD_PYTHON"])} "$@"\n')
    python.chmod(0o755)
  site = DIR / "site"  # The node's host name, for the processes started here.
  site.mkdir(exist_ok=True)
  (site / "sitecustomize.py").write_text(
      "import os, socket\nsocket.gethostname = lambda: os.environ['FAKE_TPU_HOSTNAME']\n")
  with State() as s:
    host = s["qr"]["hosts"][name]
  path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
  env = {**os.environ, NODE_ENV: _mark(name), "FAKE_TPU_HOSTNAME": host, "PYTHONPATH": path}
  code = subprocess.run(["sh", "-c", command], cwd=home, env=env).returncode
  if "vit_jax.tools.train" in command:
    with State() as s:
      event = history()[s["qr"]["request"]].get("then")
    if event:  # Watches the job's log, detached, to play the event at its step.
      subprocess.Popen([sys.executable, __file__, "--event", name], start_new_session=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  return code


def _mark(node: str) -> str:
  """What the node's processes carry: its name in this fake's Cloud, so that a test's event
  kills its own processes, not those of a test beside it whose node has the same name."""
  return f"{DIR}/{node}"


def _is_job(cmdline: bytes) -> bool:
  """vit-train's process, not the shell around it that keeps its exit status."""
  return b"vit_jax.tools.train" in cmdline and b"train.exit" not in cmdline


def _processes(nodes: list[str], job_only: bool = False) -> list[int]:
  """The processes whose environment names one of the nodes (`job_only`: vit-train's)."""
  marks, found = {f"{NODE_ENV}={_mark(n)}".encode() for n in nodes}, []
  for proc in pathlib.Path("/proc").iterdir():
    try:
      if (proc.name.isdigit() and set((proc / "environ").read_bytes().split(b"\0")) & marks
          and (not job_only or _is_job((proc / "cmdline").read_bytes()))):
        found.append(int(proc.name))
    except OSError:
      continue
  return found


def kill(nodes: list[str], signum: int, grace_s: float = 0.0, job_only: bool = False) -> None:
  """Signals the nodes' processes; waits up to grace_s for them to end (a Spot VM's ACPI
  shutdown, in which a run saves), then kills what is left."""
  for pid in _processes(nodes, job_only):
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass
  deadline = time.time() + grace_s
  while _processes(nodes, job_only) and time.time() < deadline:
    time.sleep(0.05)
  if signum != signal.SIGKILL and _processes(nodes, job_only):
    kill(nodes, signal.SIGKILL, job_only=job_only)


def play_event(name: str) -> None:
  """Waits for the job on node `name` to log the event's step, then plays the event: the
  slice's new state, the signal, 30 s of grace; a preempted slice is SUSPENDED after that."""
  with State() as s:
    event, nodes = history()[s["qr"]["request"]]["then"], s["qr"]["nodes"]
  log = DIR / "home" / name / "vit_jax" / "logs" / "train.log"
  deadline = time.time() + 900  # A job that never gets there (its test failed or was stopped).
  while not any(int(m) >= event["at_step"] for m in re.findall(
      r"^step (\d+)/", log.read_text() if log.exists() else "", re.M)):
    if time.time() > deadline or not DIR.exists():
      return
    time.sleep(0.01)
  kind = event["event"]
  with State() as s:  # The service says so first, as it takes the machines away.
    qr = s["qr"]
    if kind == "preempt":
      qr["fixed"] = {"state": "SUSPENDING", "stateInitiator": "SERVICE"}
      qr["health"] = {n: {"state": "STOPPING", "health": "HEALTHY"} for n in nodes}
    elif kind == "maintenance":
      qr["health"][name] = {"state": "READY", "health": "UNHEALTHY_MAINTENANCE",
                            "upcomingMaintenance": {"maintenanceStatus": "ONGOING"}}
    elif kind == "unhealthy":
      qr["health"][name] = {"state": "READY", "health": "TIMEOUT"}
    elif kind == "delete":
      s["qr"] = None
  kill(nodes if kind in ("preempt", "delete") else [name],
       getattr(signal, "SIG" + event.get("signal", "TERM")), 30.0, kind == "crash")
  if kind == "preempt":
    with State() as s:
      s["qr"]["fixed"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}
      s["qr"]["health"] = {n: {"state": "PREEMPTED", "health": "HEALTHY"} for n in nodes}


def main(argv: list[str]) -> int:
  if argv[:1] == ["--event"]:
    play_event(argv[1])
    return 0
  with open(DIR / "gcloud.log", "a") as log:
    log.write(shlex.join(argv) + "\n")
  deny = os.environ.get("FAKE_GCLOUD_DENY")
  if deny and deny in shlex.join(argv):
    return fail(DENIED)
  argv = argv[1:] if argv[:1] == ["alpha"] else argv
  if argv[:3] == ["compute", "tpus", "queued-resources"]:
    return queued_resources(argv[3], argv[4:])
  if argv[:3] == ["compute", "tpus", "tpu-vm"]:
    return tpu_vm(argv[3], argv[4:])
  return fail(f"the fake gcloud does not know {shlex.join(argv)}", 2)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
