"""Runs the README's first command N times and says, per run, whether it finished or hung,
how long it took and the accuracy it printed; optionally beside a CPU-bound load.

  python3 benchmarks/quickstart_stress.py --runs 20
  python3 benchmarks/quickstart_stress.py --runs 10 --load 2    # 2 busy processes beside it
  python3 benchmarks/quickstart_stress.py --runs 1 --min_accuracy 0.9   # what .ci/run checks
  sudo python3 benchmarks/quickstart_stress.py --runs 1 --cpus 1.2   # a slower machine's stand-in

The command is read from the README (the first bash block's line that runs vit-train,
with its continuation lines), so it is the one users copy. Each run starts from a new
--workdir; the venv the command makes is reused after the first run. Standard library only:
it runs before the venv exists.

--cpus N runs each command in a cgroup whose CPU quota is N CPUs' time (root, with cgroup
v1's cpu controller or v2's cpu.max): install, imports and training all slowed together, a
stand-in for a slower machine (benchmarks/README.md says how it was matched to one).
"""
import argparse
import contextlib
import multiprocessing
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Iterator

REPO = pathlib.Path(__file__).resolve().parents[1]
ACCURACY = re.compile(r"Final evaluation: accuracy=([0-9.]+)")


def readme_command(readme: pathlib.Path = REPO / "README.md") -> str:
  """The README's first command: in its first bash block, the command that runs vit-train."""
  block = readme.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
  commands = re.sub(r"\\\n\s*", "", block).splitlines()
  found = [c.strip() for c in commands if "vit-train" in c and not c.lstrip().startswith("#")]
  if not found:
    raise SystemExit(f"{readme}: no command running vit-train in the first bash block")
  return found[0]


def workdir_of(command: str) -> str:
  match = re.search(r"--workdir[= ](\S+)", command)
  if not match:
    raise SystemExit(f"the README's first command names no --workdir: {command}")
  return match.group(1)


def _busy() -> None:
  while True:
    pass


def in_shell(command: str) -> list[str]:
  return ["bash", "-c", command]


@contextlib.contextmanager
def cpu_limited(cpus: float | None) -> Iterator[Callable[[str], list[str]]]:
  """The function that makes a command's argv: run by bash inside a new cgroup held to `cpus`
  CPUs' time (None: by bash alone). The cgroup is removed on exit."""
  if cpus is None:
    yield in_shell
    return
  quota = int(cpus * 100_000)  # Per period of 100 ms.
  for root in (pathlib.Path("/sys/fs/cgroup/cpu"), pathlib.Path("/sys/fs/cgroup")):
    group = root / f"quickstart_stress_{os.getpid()}"
    try:
      group.mkdir()
    except OSError:
      continue
    if (group / "cpu.max").exists():
      (group / "cpu.max").write_text(f"{quota} 100000")
    elif (group / "cpu.cfs_quota_us").exists():
      (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
      group.rmdir()
      continue
    # The shell joins the group, then becomes the command: all its processes are in it.
    script = 'echo $$ > "$1/cgroup.procs" && exec bash -c "$0"'
    try:
      yield lambda command: ["bash", "-c", script, command, str(group)]
    finally:
      time.sleep(0.5)  # Lets the group's last processes leave it.
      group.rmdir()
    return
  raise SystemExit("--cpus needs root and a cgroup CPU controller (cgroup v1's "
                   "/sys/fs/cgroup/cpu, or v2 with cpu.max)")


def run_once(command: str, timeout_s: float, argv: Callable[[str], list[str]] = in_shell
             ) -> tuple[str, float, float | None, str]:
  """(finished | hung | failed, seconds, accuracy, output tail) of one run of `command`, run
  as `argv(command)`."""
  shutil.rmtree(workdir_of(command), ignore_errors=True)
  t0 = time.time()
  try:
    proc = subprocess.run(argv(command), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return "hung", time.time() - t0, None, out[-2000:]
  seconds, output = time.time() - t0, proc.stdout + proc.stderr
  found = ACCURACY.findall(proc.stdout)
  accuracy = float(found[-1]) if found else None
  if proc.returncode != 0:
    return ("hung" if "stalled at step" in output else "failed"), seconds, accuracy, output[-3000:]
  return "finished", seconds, accuracy, output[-3000:]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--runs", type=int, default=20)
  parser.add_argument("--load", type=int, default=0, help="busy-looping processes beside it")
  parser.add_argument("--cpus", type=float, default=None,
                      help="run each command held to this many CPUs' time (a cgroup; root)")
  parser.add_argument("--timeout_s", type=float, default=900)
  parser.add_argument("--min_accuracy", type=float, default=None,
                      help="exit 1 unless every run finished at this accuracy or more")
  args = parser.parse_args()
  if args.cpus is not None and not 0.01 <= args.cpus <= os.cpu_count():
    parser.error(f"--cpus {args.cpus}: expected a number of CPUs in [0.01, {os.cpu_count()}]")
  command = readme_command()
  print(f"command: {command}\nruns: {args.runs}, load: {args.load} busy processes"
        + (f", held to {args.cpus} CPUs" if args.cpus else ""), flush=True)
  load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
  for p in load:
    p.start()
  results = []
  try:
    with cpu_limited(args.cpus) as argv:
      for i in range(1, args.runs + 1):
        status, seconds, accuracy, tail = run_once(command, args.timeout_s, argv)
        results.append((status, seconds, accuracy))
        shown = "-" if accuracy is None else f"{accuracy:.4f}"
        print(f"run {i:2d}: {status:8s} {seconds:7.1f} s  accuracy {shown}", flush=True)
        if status != "finished":
          print(tail, flush=True)
  finally:
    for p in load:
      p.terminate()
  finished = [r for r in results if r[0] == "finished"]
  accuracies = [r[2] for r in finished if r[2] is not None]
  seconds = sorted(r[1] for r in finished)
  print(f"finished {len(finished)} of {len(results)}"
        + (f"; seconds {seconds[0]:.1f}-{seconds[-1]:.1f} (median {seconds[len(seconds) // 2]:.1f})"
           if seconds else "")
        + (f"; accuracy {min(accuracies):.4f}-{max(accuracies):.4f}" if accuracies else ""),
        flush=True)
  if args.min_accuracy is not None and (
      len(finished) < len(results) or len(accuracies) < len(results)
      or min(accuracies) < args.min_accuracy):
    print(f"error: not every run finished at accuracy >= {args.min_accuracy}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
