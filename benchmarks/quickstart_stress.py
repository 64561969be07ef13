"""Runs the README's first command N times and says, per run, whether it finished or hung,
how long it took and the accuracy it printed; optionally beside a CPU-bound load.

  python3 benchmarks/quickstart_stress.py --runs 20
  python3 benchmarks/quickstart_stress.py --runs 10 --load 2    # 2 busy processes beside it
  python3 benchmarks/quickstart_stress.py --runs 1 --min_accuracy 0.9   # what .ci/run checks

The command is read from the README (the first bash block's line that runs vit-train,
with its continuation lines), so it is the one users copy. Each run starts from a new
--workdir; the venv the command makes is reused after the first run. Standard library only:
it runs before the venv exists.
"""
import argparse
import multiprocessing
import pathlib
import re
import shutil
import subprocess
import sys
import time

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


def run_once(command: str, timeout_s: float) -> tuple[str, float, float | None, str]:
  """(finished | hung | failed, seconds, accuracy, output tail) of one run of `command`."""
  shutil.rmtree(workdir_of(command), ignore_errors=True)
  t0 = time.time()
  try:
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
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
  parser.add_argument("--timeout_s", type=float, default=900)
  parser.add_argument("--min_accuracy", type=float, default=None,
                      help="exit 1 unless every run finished at this accuracy or more")
  args = parser.parse_args()
  command = readme_command()
  print(f"command: {command}\nruns: {args.runs}, load: {args.load} busy processes", flush=True)
  load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
  for p in load:
    p.start()
  results = []
  try:
    for i in range(1, args.runs + 1):
      status, seconds, accuracy, tail = run_once(command, args.timeout_s)
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
