"""Trains and evaluates a ViT: `vit-train --config finetune:b16,cifar10 --workdir DIR`.

--config names a config shipped in vit_jax/configs/ (`quickstart`, `finetune:ARG`) or a config
file of your own (`path.py:ARG`).

Every config field can be overridden on the command line: `--config.batch_size=64`.
Multi-host: on Cloud TPU pod slices and SLURM `jax.distributed.initialize()` finds its
peers by itself (`--distributed`); elsewhere pass --coordinator_address, --num_processes
and --process_id (CPU processes then talk through gloo).

The console: on a terminal, a progress bar (step, %, ETA, img/s, last loss and eval accuracy)
below a few lines (what is trained on what, a resume); otherwise a plain line per
config.log_every_steps. Then a summary: the final evaluation, time, where the checkpoint and
TensorBoard logs are, the commands to run next. The library's logs (absl's INFO lines,
metrics, data preparation) go to WORKDIR/train.log, appended to on a resume; --verbose (or
absl's --alsologtostderr) shows them on stderr too. Warnings and errors reach the console.
Only process 0 of a multi-process run reports; the others log to WORKDIR/train.processN.log.

One run at a time per workdir: WORKDIR/lock names the process that holds it, from before the
run writes there to its end; another run on the same workdir ends with status 2 and one line
naming that process, before TensorFlow loads (seconds).
"""
import contextlib
import errno
import json
import logging
import os
import sys
from typing import NoReturn

from absl import app, flags

from vit_jax.config_errors import InputError
from vit_jax.tools import cli, console, logs, train_flags
from vit_jax.train import startup, stop_signals

FLAGS = flags.FLAGS


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flags_parser: vit-train's flags and the checks before any work (train_flags)."""
  return train_flags.parse(argv, __doc__)


def _train_or_compile(argv: list[str]) -> None:
  """absl's main: the run, or with --compile_only / --plan the compile for a TPU slice."""
  del argv
  verbose = FLAGS.verbose or FLAGS.alsologtostderr or FLAGS.logtostderr
  if train_flags.compiling():
    logs.route_logs(verbose=verbose)
    try:
      sys.exit(_compile_only())
    except stop_signals.Interrupted as e:
      _end_now(cli.stopped(e))
  logs.route_logs(verbose=verbose, hold=True)  # Until this process knows its index.
  jax = startup.start_jax(FLAGS.config.get("cpu_devices"), FLAGS.coordinator_address,
                          FLAGS.num_processes, FLAGS.process_id, FLAGS.distributed)
  try:
    with startup.owned_workdir(FLAGS.workdir):
      _train(jax, verbose)
  except (stop_signals.Interrupted, KeyboardInterrupt) as e:
    sys.exit(cli.stopped(e))  # After saving: the scheduler's restart resumes the run.
  except (InputError, FileNotFoundError) as e:  # What the user gave: one line.
    cli.fail(e)
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    print(f"error: {e}", file=sys.stderr, flush=True)  # A full disk: loop.DiskFull says it.
    sys.exit(cli.FAILED)


def _compile_only() -> int:
  """--compile_only / --plan: the report (or the plan) on stdout; a config that does not fit
  ends with one line naming the first change found that fits, status 2. SIGTERM, Ctrl-C
  and --plan_timeout end it at once (compile_search), inside a compile or not."""
  startup.start_jax_for_compiling()
  with logs.native_logs():  # TensorFlow's start-up lines (the data modules' import).
    from vit_jax.train import compile_check, compile_search
  try:
    classes = compile_search.num_classes(FLAGS.config, FLAGS.num_classes)
    opened = _pretrained()  # Its description: the compile reads no arrays.
    compile_check.take_pretrained_model(FLAGS.config, opened and opened.description)
    with logs.native_logs():  # libtpu's start-up lines, where there is no TPU.
      topology = compile_check.resolve_topology(FLAGS.topology, FLAGS.num_slices)
    found = compile_search.search(
        FLAGS.config, topology, classes, FLAGS.plan, FLAGS.plan_timeout if FLAGS.plan else None,
        lambda line: print(line, file=sys.stderr, flush=True))
  except compile_search.TimedOut as e:
    _end_now(cli.input_error(e))
  except ValueError as e:  # ConfigError among them.
    cli.fail(e)
  shown = found.found if FLAGS.plan else found.given
  if shown is not None and (shown.fits or FLAGS.json):
    report = compile_check.report(FLAGS.config, topology, shown)
    report |= dict(fix=found.found and found.found.flags(), candidates_compiled=len(found.tried))
    print(json.dumps(report, indent=1) if FLAGS.json else compile_check.format_report(report))
  if FLAGS.plan and found.found:
    if not FLAGS.json:
      print("Use: " + found.found.described())
    return 0
  if shown is not None and shown.fits:
    return 0
  spec = (train_flags.config_spec(sys.argv) or (0, "", "the config"))[2]
  cli.fail(compile_search.no_fit_line(found, topology, spec))


def _pretrained():
  """config.pretrained as the flags' checks opened it (None without one): read no more."""
  return train_flags.opened_pretrained.pop() if train_flags.opened_pretrained else None


def _end_now(status: int) -> NoReturn:
  """Ends the process while the search's thread may be inside a compile (nothing to save):
  the interpreter's exit would wait for it."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _train(jax, verbose: bool) -> None:
  """The run on this process: its log file, the console on process 0, the loop, the summary."""
  from vit_jax.train import loop

  process = jax.process_index()
  log_file = startup.log_path(FLAGS.workdir, process)
  log_stream = logs.route_logs(log_file, verbose)
  logging.info("JAX %s: process %d of %d, %d devices (%s).", jax.__version__, process,
               jax.process_count(), jax.device_count(), jax.devices()[0].platform)
  if process > 0:
    print(f"process {process} of {jax.process_count()}: its log is {log_file}; process 0 "
          "reports the run.", file=sys.stderr, flush=True)
  shown = console.Console(console.default_stream(), log_file) if process == 0 else None
  # What the library prints (TFDS's preparation notices) belongs in the log, not the console.
  quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(log_stream)
  try:
    with quiet:
      metrics = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir, shown or loop.Report(),
                                        _pretrained())
  finally:
    if shown:
      shown.close()  # The bar's line ends before an error's.
  if shown:
    shown.summary(metrics)


def main() -> NoReturn:
  """The console script: absl parses sys.argv (parse_flags), then the process ends with the
  run's status."""
  cli.exit_with(lambda: app.run(_train_or_compile, flags_parser=parse_flags))


if __name__ == "__main__":
  main()
