"""Cloud TPU queued resources: the request for a slice (or several, multislice) that the TPU
service fills when it has the capacity, in a tier (Spot, reserved, best-effort), and what
becomes of it: WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED (with its reason), and
SUSPENDING / SUSPENDED once its nodes are taken away (a Spot slice's preemption).

The queued resource is named as the TPU VM (--name); its node is too, or, for --num-slices N,
its nodes are NAME-0 ... NAME-(N-1).
"""
import argparse
import dataclasses
import json
import re
import shlex
import subprocess
import time
from typing import Callable

from launch import common
from vit_jax import goodput

# The generations queued resources serve (cloud.google.com/tpu/docs/queued-resources).
QUEUEABLE = ("v4", "v5litepod", "v5p", "v6e")
TIERS = {"spot": "--spot", "reserved": "--reserved", "best_effort": "--best-effort"}
WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")
# How often the wait for capacity says it still waits, besides each change of state.
STILL_WAITING_S = 15 * 60
DESCRIBE_TRIES = 10  # A poll apart: 10 minutes of a failing API at the default --poll-seconds.
# gcloud's errors that no wait mends: the caller lacks a permission, the API is off in the
# project, or the request is malformed (a project that does not exist).
HOPELESS = re.compile(r"PERMISSION_DENIED|INVALID_ARGUMENT|SERVICE_DISABLED|FAILED_PRECONDITION|"
                      r"has not been used in project|is disabled")


class CapacityError(common.Failed):
  """The queued resource failed, or was taken away before it became active: exit status 1."""


def tier(args: argparse.Namespace) -> str | None:
  return next((t for t in TIERS if getattr(args, t, False)), None)


def check(args: argparse.Namespace, generation: str) -> None:
  """Refuses, before anything is created, a request the TPU service would refuse."""
  if generation not in QUEUEABLE:
    raise common.LaunchError(
        f"--accelerator-type {args.accelerator_type}: queued resources serve "
        f"{', '.join(QUEUEABLE)} slices, not {generation}; drop --queued (a TPU VM created "
        "at once) or choose one of those.")


def duration(text: str) -> str:
  """An argparse type: --valid-until-duration, as gcloud takes it (30m, 6h, 2d, 1h30m)."""
  parts = re.fullmatch(r"(\d+[smhd])+", text) and re.findall(r"(\d+)([smhd])", text)
  if not parts or not sum(int(n) for n, _ in parts):
    raise argparse.ArgumentTypeError(f"expected a duration above 0 such as 30m, 6h or 2d, not "
                                     f"{text!r}")
  return text


def _gcloud(verb: str, args: argparse.Namespace, *rest: str, alpha: bool = False) -> list[str]:
  project = [f"--project={args.project}"] if args.project else []
  return ["gcloud", *(["alpha"] if alpha else []), "compute", "tpus", "queued-resources", verb,
          *rest, f"--zone={args.zone}", *project]


def node_names(args: argparse.Namespace) -> list[str]:
  slices = getattr(args, "num_slices", 1)
  return [args.name] if slices == 1 else [f"{args.name}-{i}" for i in range(slices)]


def create_command(args: argparse.Namespace, accelerator_type: str, version: str) -> list[str]:
  nodes = ([f"--node-id={args.name}"] if args.num_slices == 1 else
           [f"--node-count={args.num_slices}", f"--node-prefix={args.name}"])
  chosen = tier(args)
  flags = [TIERS[chosen]] if chosen else []
  if args.valid_until_duration:
    flags.append(f"--valid-until-duration={args.valid_until_duration}")
  # The best-effort tier is in gcloud's alpha commands only.
  return _gcloud("create", args, args.name, *nodes, f"--accelerator-type={accelerator_type}",
                 f"--runtime-version={version}", *flags, alpha=chosen == "best_effort")


def describe_command(args: argparse.Namespace) -> list[str]:
  return _gcloud("describe", args, args.name, "--format=json")


def delete_command(args: argparse.Namespace) -> list[str]:
  """Deletes the queued resource and, --force, its nodes first."""
  return _gcloud("delete", args, args.name, "--force", "--quiet")


@dataclasses.dataclass(frozen=True)
class State:
  name: str  # The service's state, or NOT_FOUND.
  reason: str = ""  # Why it failed, or who suspended it.

  def __str__(self) -> str:
    return f"{self.name} ({self.reason})" if self.reason else self.name


def parse_state(text: str) -> State:
  """The state of `describe --format=json`'s output."""
  state = json.loads(text).get("state", {})
  name = state.get("state", "STATE_UNSPECIFIED")
  if name == "FAILED":
    error = state.get("failedData", {}).get("error", {})
    return State(name, error.get("message", "no reason given"))
  if name in ("SUSPENDING", "SUSPENDED"):
    by = state.get("stateInitiator", "")
    return State(name, {"SERVICE": "by the TPU service", "USER": "by a user"}.get(by, ""))
  return State(name)


def described(command: list[str], poll_s: float) -> str | None:
  """What a gcloud `describe` prints; None where it finds nothing. Another failure (the API
  unavailable a while, a token that did not refresh) is said and tried again a poll later,
  DESCRIBE_TRIES times in all before the launcher stops: a blip does not end a days-long
  follow."""
  for tries_left in reversed(range(DESCRIBE_TRIES)):
    p = subprocess.run(command, capture_output=True, text=True)
    if p.returncode == 0:
      return p.stdout
    if re.search(r"NOT_FOUND|not found", p.stderr):
      return None
    why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
    if HOPELESS.search(p.stderr):
      raise common.Failed(f"{shlex.join(command)} failed, which no retry mends: {why}")
    if not tries_left:
      raise common.Failed(f"{shlex.join(command)} failed {DESCRIBE_TRIES} times in a row, a "
                          f"poll apart; the last time: {why}")
    common.say(f"{' '.join(command[3:6])} failed ({why}); trying again in "
               f"{goodput.duration(poll_s)} ({tries_left} more tries)")
    time.sleep(poll_s)


def describe(args: argparse.Namespace) -> State:
  """The queued resource's state now; NOT_FOUND where there is none."""
  text = described(describe_command(args), getattr(args, "poll_seconds", 60.0))
  return State("NOT_FOUND") if text is None else parse_state(text)


def advice(args: argparse.Namespace, state: State) -> str:
  """What to change after a queued resource failed (and was deleted: the same name is free)."""
  if "valid" in state.reason.lower() or "expired" in state.reason.lower():
    return ("the capacity did not come within --valid-until-duration: give it longer, "
            "another zone, or another tier (--reserved with a reservation)")
  return (f"change what the reason names (--accelerator-type {args.accelerator_type}, "
          f"--zone {args.zone}, the tier or quota) and run again")


def wait_active(args: argparse.Namespace, say: Callable[[str], None], poll_s: float) -> None:
  """Waits for ACTIVE, saying each state it passes; CapacityError where it fails."""
  start, shown, told = time.time(), None, 0.0
  while True:
    state = describe(args)
    waited = goodput.duration(time.time() - start)
    if state != shown or time.time() - told >= STILL_WAITING_S:
      say(f"queued resource {args.name}: {state}, after {waited}")
      shown, told = state, time.time()
    if state.name == "ACTIVE":
      return
    if state.name not in WAITING:
      raise CapacityError(f"queued resource {args.name} is {state} after {waited}"
                          f"{_deleted(args, state)}: {advice(args, state)}.")
    time.sleep(poll_s)


def _deleted(args: argparse.Namespace, state: State) -> str:
  """Deletes a FAILED queued resource, which holds no capacity, so that running the same
  command again asks anew instead of finding the name taken; what the message says of it."""
  if state.name != "FAILED":
    return ""
  p = subprocess.run(delete_command(args), capture_output=True, text=True)
  if p.returncode:
    return f" (deleting it failed: run {shlex.join(delete_command(args))} first)"
  return " (deleted)"
