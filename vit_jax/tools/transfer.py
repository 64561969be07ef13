"""The paper's transfer evaluation of checkpoints: `vit-transfer CKPT... --suite S --out_dir D`.

For each checkpoint and task: fine-tuned once per learning rate of the task's grid on a
held-out part of its train split (the paper's minival; VTAB-1k's 800/200), the best rate
chosen there, then fine-tuned on the whole train split (VTAB-1k: the 1,000 examples) and
evaluated on test, with the finetune recipe (SGD momentum 0.9, batch 512, cosine decay,
clipping at 1, no weight decay, 384 px or the multiple of the patch stride nearest it) and
the paper's steps per task.

--suite: vtab1k (the 19 VTAB-1k tasks), paper (ImageNet, CIFAR-10/100, Pets, Flowers),
imagenet, or task names separated by commas (`--list all` prints them). Any other TFDS
classification dataset, or an image folder ROOT/{train,test}/<class>/, runs with VTAB-1k's
protocol (train[:800] / train[800:1000] to choose the rate from the paper's grid, then
train[:1000] -> test, 2,500 steps).
CHECKPOINT: anything the project loads (a run's workdir, an .npz, hf-hub:ORG/NAME such as
hf-hub:google/vit-base-patch16-224-in21k, augreg:NAME, ema:RUN).

Writes OUT_DIR/results.csv (one row per run: checkpoint, task, phase, rate, accuracy, wall
time), results.md (test accuracy at the chosen rate; VTAB-1k group means) and results.png.
A rerun skips the runs recorded there and resumes a run killed midway; a task that fails
(e.g. data TFDS cannot download) is named and the others go on (exit status 1). A folder or
a prepared TFDS dataset too small for the protocol's splits is refused before any run.

--launch slurm|hosts|tpu_vm -- FLAGS: one job per (checkpoint, task), each this command for
that task alone, handed to launch/jobs.py of the repository with FLAGS (e.g. `--partition
gpu`; `python launch/jobs.py TARGET --help` lists them), then a --report_only run once all
have ended. The jobs share OUT_DIR (a shared file system; gs:// on TPU VMs), each task
writing its own rows, so they run side by side.
"""
import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING

from etils import epath

import vit_jax
from vit_jax import cpu_backend
from vit_jax.tools import cli, jobs, logs

if TYPE_CHECKING:  # The library is imported in main, after the CPU backend's set-up.
  from vit_jax.transfer import protocol


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = cli.parser("vit-transfer", __doc__)
  p.add_argument("checkpoints", nargs="*")
  p.add_argument("--suite", help="vtab1k | paper | imagenet | NAME[,NAME...]")
  p.add_argument("--out_dir", default="/tmp/vit_transfer")
  p.add_argument("--list", metavar="SUITE", help="print the tasks of a suite (or `all`)")
  p.add_argument("--format", choices=("text", "json"), default="text", help="of --list")
  p.add_argument("--dry_run", action="store_true", help="print the runs, run none")
  p.add_argument("--image_size", type=int, default=None,
                 help="default: 384, or the multiple of the patch stride nearest it")
  p.add_argument("--batch_size", type=int, default=512)
  p.add_argument("--steps", type=int, default=None, help="default: the task's (the paper's)")
  p.add_argument("--warmup_steps", type=int, default=None)
  p.add_argument("--lr_grid", default=None, help="e.g. 0.001,0.01 (default: the task's)")
  p.add_argument("--data_dir", default=None, help="TFDS data_dir")
  p.add_argument("--cpu_devices", type=int, default=None)
  p.add_argument("--report_only", action="store_true",
                 help="merge the rows under --out_dir into results.csv, .md and .png; run nothing")
  p.add_argument("--launch", choices=("slurm", "hosts", "tpu_vm"),
                 help="a job per (checkpoint, task) through launch/jobs.py; its flags after --")
  cli.add_verbose_flag(p)
  argv, launcher = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
      argv, [])
  args = p.parse_args(argv)
  args.launcher_flags = launcher
  if launcher and not args.launch:
    p.error(f"flags after -- ({shlex.join(launcher)}) are the launcher's: give --launch")
  if args.list is None and not args.report_only and not (args.checkpoints and args.suite):
    p.error("give CHECKPOINT... and --suite (or --list SUITE, or --report_only)")
  return args


def lr_grid(args: argparse.Namespace) -> tuple[float, ...] | None:
  """--lr_grid's rates (None: the tasks'); ValueError unless each is a number above 0."""
  if args.lr_grid is None:
    return None
  try:
    grid = tuple(float(x) for x in args.lr_grid.split(","))
  except ValueError:
    grid = ()
  if not (grid and all(lr > 0 for lr in grid)):
    raise ValueError(f"--lr_grid={args.lr_grid}: give learning rates above 0, separated by "
                     "commas (e.g. --lr_grid=0.001,0.01)")
  return grid


def settings_of(args: argparse.Namespace) -> "protocol.Settings":
  from vit_jax.transfer import protocol
  return protocol.Settings(args.image_size, args.batch_size, args.steps, args.warmup_steps,
                           lr_grid(args), args.data_dir, args.cpu_devices)


def print_list(suite: str, fmt: str) -> None:
  from vit_jax.data import tasks
  chosen = list(tasks.TASKS.values()) if suite == "all" else tasks.resolve(suite)
  if fmt == "json":
    print(json.dumps([tasks.as_dict(t) for t in chosen], indent=1))
    return
  for t in chosen:
    print(f"{t.name:36s} {t.tfds_name:48s} {t.num_classes:4d} classes  "
          f"{t.minitrain} -> {t.minival}; {t.train} -> {t.test}")


def dry_run(checkpoints: list[str], task_list: list, settings: "protocol.Settings",
            out_dir: str) -> None:
  from vit_jax.transfer import protocol
  for line in protocol.commands(checkpoints, task_list, settings, out_dir):
    print(line)


_FORWARDED = ("image_size", "batch_size", "steps", "warmup_steps", "lr_grid", "data_dir",
              "cpu_devices")


def task_jobs(args: argparse.Namespace, task_names: list[str]) -> tuple[list[list[str]],
                                                                        list[str]]:
  """The arguments of one vit-transfer run per (checkpoint, task), and of the report's."""
  from vit_jax.checkpoint import specs
  if args.launch == "tpu_vm":
    local = [p for p in args.checkpoints + task_names + [args.out_dir]
             if "://" not in p and os.path.exists(specs.without_ema(p))]
    if local or not args.out_dir.startswith("gs://"):
      raise ValueError("--launch tpu_vm: the TPU VMs share no disk with this machine: give "
                       "--out_dir gs://BUCKET/PATH, and checkpoints and image folders on "
                       "gs:// (or zoo names)"
                       + (f" (on this machine: {', '.join(local)})" if local else ""))
  out_dir = args.out_dir if "://" in args.out_dir else os.path.abspath(args.out_dir)
  flags = [f"--{k}={getattr(args, k)}" for k in _FORWARDED if getattr(args, k) is not None]
  # Every job reads a checkpoint alike: a file or folder here as its absolute path.
  jobs = [[specs.absolute(c), "--suite", t, "--out_dir", out_dir, *flags]
          for c in args.checkpoints for t in task_names]
  return jobs, ["--report_only", "--out_dir", out_dir]


def launch(args: argparse.Namespace, task_names: list[str]) -> int:
  """Hands the jobs to the repository's launch/jobs.py; its exit status."""
  script = pathlib.Path(vit_jax.__file__).resolve().parents[1] / "launch" / "jobs.py"
  if not script.exists():
    raise OSError(f"--launch runs {script}, which a clone of the repository has (pip "
                  "installs the package alone): run vit-transfer from a clone's install "
                  "(`pip install -e .`), or put each `vit-transfer CKPT --suite TASK` in a job "
                  "of your own, then `vit-transfer --report_only --out_dir DIR`.")
  jobs, report_args = task_jobs(args, task_names)
  cmd = [sys.executable, str(script), args.launch, "--tool", "transfer",
         f"--then={shlex.join(report_args)}", *(["--dry-run"] if args.dry_run else []),
         *args.launcher_flags]
  done = subprocess.run(cmd, input="".join(shlex.join(j) + "\n" for j in jobs), text=True,
                        stderr=subprocess.PIPE)
  if done.returncode == cli.USAGE:  # Refused before it started a job: argparse's usage, error.
    errors = [line.split("error: ", 1)[1] for line in done.stderr.splitlines()
              if "error: " in line]
    return cli.input_error(f"--launch {args.launch}: {errors[-1] if errors else done.stderr}")
  sys.stderr.write(done.stderr)
  return done.returncode


def owned(name: str) -> bool:
  """Whether an entry of --out_dir is one a sweep writes: the report's files, a checkpoint's
  folder of task runs (protocol.task_dir)."""
  return name in ("results.csv", "results.md", "results.png") or bool(
      re.fullmatch(r".+-[0-9a-f]{8}", name))


@cli.command
def main(argv: list[str]) -> int:
  args = parse_args(argv)
  cli.check_checkpoints(args.checkpoints)  # Before the library's imports: seconds.
  cli.check_counts(args, dict(image_size=1, batch_size=1, steps=1, warmup_steps=0,
                              cpu_devices=1))
  lr_grid(args)
  if args.list is None and not args.dry_run and not args.launch:
    cli.check_output_dir("--out_dir", args.out_dir)
    cli.check_apart("--out_dir", args.out_dir, {
        "CHECKPOINT": args.checkpoints, "--suite": (args.suite or "").split(","),
        "--data_dir": [args.data_dir]})
    cli.check_owned("--out_dir", args.out_dir, owned,
                    "results.csv, .md, .png and a folder per checkpoint")
  logs.route_logs(verbose=args.verbose)
  from vit_jax.data import tasks  # Its TensorFlow and TFDS load when used.
  if args.list is None and not args.report_only:  # A task or suite misspelt: refused at once.
    task_list = tasks.resolve_or_custom(args.suite)
  cpu_backend.prepare(args.cpu_devices)  # Before JAX starts.
  logs.start_tensorflow()
  if args.list is None and not args.report_only:
    cli.check_not_exported(args.checkpoints)
  from vit_jax.transfer import report, sweep, task_splits
  if args.list is not None:
    print_list(args.list, args.format)
    return 0
  if args.report_only:
    failures = report.write(args.out_dir)
  else:
    settings = settings_of(args)
    task_splits.check(task_list, settings)
    if args.launch:
      return launch(args, [t.name for t in task_list])
    if args.dry_run:
      dry_run(args.checkpoints, task_list, settings, args.out_dir)
      return 0
    failures = sweep.transfer(args.checkpoints, task_list, settings, args.out_dir)
  print((epath.Path(args.out_dir) / "results.md").read_text(), end="")
  return jobs.finish({f"{c} on {t}": why.removeprefix("failed: ")
                      for (c, t), why in failures.items()}, "tasks")


if __name__ == "__main__":
  main()
