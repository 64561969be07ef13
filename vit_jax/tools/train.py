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
import ast
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, NoReturn, TextIO

import tqdm
from absl import app, flags
from ml_collections import config_flags

from vit_jax import configs, cpu_backend
from vit_jax.config_errors import ConfigError, InputError, check_known
from vit_jax.tools import cli, logs
from vit_jax.train import stop_signals

if TYPE_CHECKING:  # The library is imported once the flags are parsed.
  from vit_jax.checkpoint import workdir_lock
  from vit_jax.train import compile_check, loop

_STARTED = time.time()
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "A config shipped with vit_jax by name (`quickstart`, `finetune:b16,cifar10`) "
    "or a config file, `path.py:arg`.", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard logs; resumed if present.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (TPU pods, SLURM).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process.")
flags.DEFINE_integer("num_processes", None, "Number of processes, with --coordinator_address.",
                     lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index, with --coordinator_address.",
                     lower_bound=0)
flags.DEFINE_bool("verbose", False, "Show the library's logs (absl INFO) on stderr too, besides "
                  "WORKDIR/train.log.")
flags.DEFINE_bool("compile_only", False, "Compile the run's train and eval steps for "
                  "--topology's TPUs (no TPU, data or workdir needed: libtpu only) and report "
                  "per-chip HBM, FLOPs, collectives and a roofline bound; exit 2 naming a fix "
                  "if it does not fit.")
flags.DEFINE_string("topology", None, "With --compile_only: JAX's spelling (v5e:4x4, v4:2x2x4) or "
                    "a Cloud TPU accelerator type (v4-32, v5litepod-16, v5p-64, v6e-16).")
flags.DEFINE_integer("num_slices", 1, "With --compile_only: slices of --topology (multislice).",
                     lower_bound=1)
flags.DEFINE_bool("plan", False, "With --topology: choose mesh.data x mesh.fsdp and model.remat "
                  "by compiling candidates; print the overrides to use.")
flags.DEFINE_integer("plan_timeout", 600, "With --plan: seconds the search may take; then it "
                     "ends with the closest candidate compiled so far.", lower_bound=1)
flags.DEFINE_bool("json", False, "With --compile_only or --plan: the report as JSON on stdout.")
flags.DEFINE_integer("num_classes", None, "With --compile_only: the dataset's classes, where "
                     "config.data.name is not one whose count vit_jax knows.", lower_bound=2)
flags.mark_flags_as_required(["config"])
flags.register_multi_flags_validator(
    ["workdir", "compile_only", "plan"],
    lambda f: f["workdir"] is not None or f["compile_only"] or f["plan"],
    "Flag --workdir must have a value other than None (only --compile_only and --plan go "
    "without one).")


# Durations given in one of two units: the unit set on the command line replaces the other.
_UNIT_PAIRS = (("total_steps", "total_epochs"), ("warmup_steps", "warmup_epochs"))


def _config_flag(argv: list[str]) -> tuple[int, str, str] | None:
  """(index, flag prefix, spec) of the argument that holds `--config SPEC` / `--config=SPEC`."""
  for i, a in enumerate(argv):
    if m := re.fullmatch(r"(--?config)(=(.*))?", a):
      if m.group(2):
        return i, m.group(1) + "=", m.group(3)
      if i + 1 < len(argv):
        return i + 1, "", argv[i + 1]
  return None


def resolve_config_flag(argv: list[str]) -> list[str]:
  """argv with the --config spec as a file path (absl's config flag takes a file), a shipped
  config's name replaced by its file; a spec that names no config file ends the run."""
  found = _config_flag(argv)
  if found is None:
    return argv
  i, prefix, spec = found
  try:
    path, arg = configs.resolve(spec)
  except ValueError as e:
    cli.fail(f"--config {spec}: {e}")
  return [*argv[:i], f"{prefix}{path}{'' if arg is None else ':' + arg}", *argv[i + 1:]]


def _config_file(argv: list[str]):
  """The config --config names, loaded without its overrides."""
  found = _config_flag(argv)
  return None if found is None else configs.get_config(found[2])


def _moved_field(path: list[str], value: str) -> None:
  """Raises ConfigError for an override of a field that moved (config.fewshot, the tuple
  form of config.evals), saying where to."""
  from vit_jax.train import config as config_lib
  config_lib.check_not_moved(path[0], value)
  if path == ["evals"]:
    try:
      old = ast.literal_eval(value)
    except (SyntaxError, ValueError):
      return
    if isinstance(old, (tuple, list)):
      config_lib.check_evals(old)


def _moved_in_file(e: Exception) -> str | None:
  """A config file's use of a field that moved, as the line that says where to: ml_collections
  refuses `c.fewshot.x = ...` (no such field) and `c.evals = (...)` (not a dict) itself."""
  old_evals = re.match(r"Could not override field 'evals' .*?\. (.*) is of original type", str(e))
  try:
    _moved_field([str(e).strip("'\"")], "...")
    if old_evals:
      _moved_field(["evals"], old_evals.group(1))
  except ConfigError as moved:
    return str(moved)
  return None


def _bad_override(argv: list[str]) -> str | None:
  """Names the first `--config.a.b=...` whose field the config does not have (or has moved),
  or what the config's get_config said of its ARG."""
  try:
    config = _config_file(argv)
  except ConfigError as e:  # Its get_config's refusal, in one line; or a field it moved.
    return (e.__cause__ is not None and _moved_in_file(e.__cause__)) or str(e)
  except Exception as e:  # Reported by absl's own message instead, unless a field moved.
    return _moved_in_file(e)
  for arg in (a for a in argv if a.startswith("--config.")):
    node, path = config, arg[len("--config."):].split("=", 1)[0].split(".")
    try:
      _moved_field(path, arg.split("=", 1)[-1])
    except ConfigError as e:
      return str(e)
    for i, key in enumerate(path):
      if not hasattr(node, "keys"):
        break
      try:
        check_known(".".join(path[:i + 1]), arg.split("=", 1)[-1], node.keys())
      except ConfigError as e:
        return str(e)
      node = node[key]
  return None


def usage() -> str:
  """This module's docstring and its flags (absl's own --help shows a console script none)."""
  flags_help = FLAGS.module_help(FLAGS.find_module_defining_flag("workdir"))
  return (f"{__doc__.strip()}\n\nflags:\n{flags_help.split(':', 1)[1].strip(chr(10))}\n\n"
          "absl's flags (logging among them): --helpfull")


def _parse(argv: list[str], given: list[str]) -> list[str]:
  """absl's parse of `argv` (the --config spec a file path); an error is told in the words of
  the command line as `given`."""
  try:
    rest = FLAGS(argv)
  except SystemExit:  # Only --helpfull and its kin exit here: absl prints them, exits 1.
    sys.exit(0)
  except Exception as e:  # absl and ml_collections raise several types for a bad override.
    cli.fail(_bad_override(given) or str(e))
  return rest


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with one-line errors for the config's fields, and the duration
  unit given on the command line winning over the config file's other unit."""
  if any(a in ("-h", "-help", "--help", "--helpshort", "-?") for a in argv[1:]):
    print(usage())
    sys.exit(0)
  logs.route_logs(hold=True)  # Until _train_or_compile knows the log file.
  logging.info("Command: %s", shlex.join(sys.orig_argv))
  # The shipped configs import no TensorFlow (seconds): a wrong flag is told before it loads.
  with logs.native_logs():  # A config file of the user's may import it: its C++ lines.
    rest = _parse(resolve_config_flag(argv), argv)
  if len(rest) > 1:  # absl hands back what is not a flag: nothing would read it.
    cli.fail(_leftover(rest[1]))
  given = config_flags.get_override_values(FLAGS["config"])
  for unit, other in _UNIT_PAIRS:
    for a, b in ((unit, other), (other, unit)):
      if a in given and b not in given and FLAGS.config.get(b) is not None:
        FLAGS.config[b] = None
  from vit_jax.train import config as config_lib
  try:
    config_lib.validate(FLAGS.config)
    cli.check_checkpoints([FLAGS.config.get("pretrained") or ""])
  except ConfigError as e:
    cli.fail(e)
  except FileNotFoundError as e:
    cli.fail(f"config.pretrained: {e}")
  _check_compile_flags()
  if FLAGS.config.get("pretrained"):
    try:  # Its description alone, before a workdir or a compile: seconds.
      config_lib.check_pretrained(FLAGS.config, given)
    except cli.INPUT_ERRORS as e:
      cli.fail(e)
  if _compiling():
    if not FLAGS.topology:
      cli.fail("--compile_only and --plan need --topology (e.g. v5e:4x4 or v5litepod-16)")
    return rest
  try:
    cli.check_output_dir("--workdir", FLAGS.workdir)
    c = FLAGS.config
    cli.check_apart("--workdir", FLAGS.workdir, {
        "config.pretrained": [c.get("pretrained")], "config.data.name": [c.data.get("name")],
        "config.data.data_dir": [c.data.get("data_dir")]})
    if not (FLAGS.distributed or FLAGS.coordinator_address):  # Else process 0's, in _train_or_compile.
      from vit_jax.checkpoint import workdir_lock
      workdir_lock.check_free(FLAGS.workdir)  # Before TensorFlow's and JAX's seconds.
  except (OSError, InputError) as e:
    cli.fail(e)
  logs.start_tensorflow()
  return rest


# The flags of a compile for a TPU slice: without --compile_only or --plan, nothing reads them.
_COMPILE_FLAGS = ("topology", "num_slices", "plan_timeout", "json", "num_classes")


def _check_compile_flags() -> None:
  """Refuses a compile flag given to a run that trains: it would train on this machine's
  devices as if the flag were not there."""
  given = [f"--{name}={FLAGS[name].value}" for name in _COMPILE_FLAGS if FLAGS[name].present]
  if given and not _compiling():
    cli.fail(f"{given[0]}: applies to a compile for a TPU slice (--compile_only or --plan); "
             "without either, vit-train trains here and reads no such flag: add --compile_only, "
             f"or drop {given[0].split('=')[0]}")


def _leftover(arg: str) -> str:
  """The line refusing an argument that is not a flag (absl leaves it to the program)."""
  hint = (f"; did you mean --{arg}?" if re.fullmatch(r"config\.[\w.]+=.*", arg) else
          "; pass config fields as --config.FIELD=VALUE" if "=" in arg else "")
  return (f"unexpected argument {arg!r}: vit-train takes flags only (--name=value), and reads "
          f"nothing else{hint}")


def _compiling() -> bool:
  return FLAGS.compile_only or FLAGS.plan


def log_path(workdir: str, process: int) -> str:
  """A process's log: WORKDIR/train.log for process 0, WORKDIR/train.processN.log for the
  others; a workdir in a bucket (gs://), where a file cannot be appended to, keeps it in this
  machine's temporary folder."""
  name = "train.log" if process == 0 else f"train.process{process}.log"
  if "://" in workdir:
    return os.path.join(tempfile.gettempdir(), re.sub(r"[^\w.-]+", "_", workdir) + "." + name)
  return os.path.join(workdir, name)


def _duration(seconds: float) -> str:
  s = int(round(seconds))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (
      f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _command(name: str) -> str:
  """How to run another installed command: its name where PATH finds this installation's,
  else its path beside vit-train (or beside this Python)."""
  script = sys.argv[0] if os.path.basename(sys.argv[0]) == "vit-train" else sys.executable
  path = os.path.join(os.path.dirname(script), name)
  found = shutil.which(name)
  if not os.path.exists(path) or (found and os.path.samefile(found, path)):
    return name
  return path


def _eval_text(m: dict[str, float]) -> str:
  shown = {"accuracy": "accuracy {:.2%}", "top5_accuracy": "top-5 {:.2%}", "loss": "loss {:.4f}"}
  parts = [f.format(m[k]) for k, f in shown.items() if k in m]
  parts += [f"{k} {v:.4f}" for k, v in sorted(m.items()) if k not in {*shown, "num_examples"}]
  images = f" ({m['num_examples']:,.0f} images)" if "num_examples" in m else ""
  return ", ".join(parts) + images


class Console:
  """vit-train's own output on process 0, told by the loop (loop.Report's hooks): a few lines
  and a progress bar on `stream` where it is a terminal, else a plain line per log interval;
  `summary` at the end, on stdout."""

  BAR = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

  def __init__(self, stream: TextIO, log_file: str):
    self.stream, self.log_file, self.bar, self.run = stream, log_file, None, None
    self.last: dict[str, float] = {}  # train_loss, img_per_sec, accuracy: the latest.
    self.first, self.step_at, self.eval_s, self.eval_t0 = None, 0, 0.0, 0.0
    self.train_s = 0.0  # First step's call to the latest log, evaluations left out.

  def say(self, text: str) -> None:
    with tqdm.tqdm.external_write_mode(file=self.stream):
      print(text, file=self.stream, flush=True)

  def started(self, run: "loop.RunInfo") -> None:
    self.run, self.step_at = run, run.start_step
    epochs = f" ({run.epochs:g} epochs)" if run.epochs else ""
    self.say(f"Training {run.model_name} ({run.parameters:,} parameters) on {run.dataset} "
             f"({run.num_classes} classes, {run.image_size} px): {run.total_steps:,} steps of "
             f"{run.batch_size} images{epochs}, {run.devices} devices ({run.platform}).")
    if run.trained_parameters < run.parameters:
      self.say(run.trained_line.capitalize() + ".")
    self.say(f"Workdir: {run.workdir} (checkpoints, TensorBoard events); library logs: "
             f"{self.log_file}")
    if run.start_step >= run.total_steps:
      self.say(f"The run in {run.workdir} is already complete at step {run.start_step}: "
               "evaluating its last checkpoint.")
    elif run.start_step:
      self.say(f"Resumed from {run.workdir} at step {run.start_step} of {run.total_steps}.")
    elif run.pretrained:
      self.say(f"Fine-tuning {run.pretrained}.")

  def step(self, step: int) -> None:
    self.step_at = step
    if self.first is None:
      self.first = (step - 1, time.time())
      if self.stream.isatty():
        self.bar = tqdm.tqdm(total=self.run.total_steps, initial=step - 1, file=self.stream,
                             bar_format=self.BAR, dynamic_ncols=True)
    if self.bar is not None:
      self.bar.update(step - self.bar.n)

  def _postfix(self) -> None:
    parts = [f"{self.last['img_per_sec']:,.0f} img/s" if "img_per_sec" in self.last else "",
             f"loss {self.last['train_loss']:.3f}" if "train_loss" in self.last else "",
             f"accuracy {self.last['accuracy']:.2%}" if "accuracy" in self.last else ""]
    self.bar.set_postfix_str(", ".join(p for p in parts if p))

  def logged(self, step: int, metrics: dict[str, float]) -> None:
    self.last |= metrics
    self.train_s = time.time() - self.first[1] - self.eval_s
    if self.bar is not None:
      self._postfix()
      return
    done, total = step - self.first[0], self.run.total_steps
    eta = self.train_s / max(done, 1) * (total - step)
    self.say(f"step {step}/{total} ({step / total:.1%})  loss {metrics['train_loss']:.3f}  "
             f"{metrics['img_per_sec']:,.0f} img/s  eta {_duration(eta)}")

  def evaluating(self, step: int) -> None:
    self.eval_t0 = time.time()
    if self.bar is not None:
      self.bar.set_description_str("evaluating ")

  def evaluated(self, step: int, metrics: dict[str, float]) -> None:
    self.eval_s += time.time() - self.eval_t0
    if "accuracy" in metrics:
      self.last["accuracy"] = metrics["accuracy"]
    if self.bar is not None:
      self.bar.set_description_str("")
      self._postfix()
    self.say(f"eval at step {step}: {_eval_text(metrics)}")

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None

  def summary(self, metrics: dict[str, float]) -> None:
    """The final evaluation, time, where the run's files are and what to run next."""
    self.close()
    r, lines = self.run, []
    complete = r.start_step >= r.total_steps
    if complete:
      lines.append(f"The run in {r.workdir} was already complete at step {r.start_step}.")
    if metrics and (complete or self.step_at >= r.total_steps):
      lines.append("Final evaluation: " + ", ".join(f"{k}={v:.4f}"
                                                    for k, v in sorted(metrics.items())))
    if self.first is not None:
      images = (self.step_at - self.first[0]) * r.batch_size
      rate = f", {images / self.train_s:,.0f} img/s" if self.train_s > 0 else ""
      lines.append(f"Trained steps {self.first[0] + 1}-{self.step_at} of {r.total_steps} in "
                   f"{_duration(self.train_s)}{rate}; {_duration(time.time() - _STARTED)} in all.")
    if self.step_at < r.total_steps:
      lines.append(f"Stopped at step {self.step_at} of {r.total_steps}, saved: rerun the same "
                   "command to resume.")
    print("\n".join(lines + self._where()), flush=True)

  def _where(self) -> list[str]:
    r, w = self.run, self.run.workdir
    data = f" --data_dir={r.data_dir}" if r.data_dir else ""
    return [f"Checkpoint:  {r.checkpoints}/{self.step_at}",
            f"TensorBoard: tensorboard --logdir {w}",
            f"Log:         {self.log_file}",
            "Next:",
            f"  {_command('vit-inspect')} {w}    # what the checkpoint holds",
            f"  {_command('vit-export')} {w} {w.rstrip('/')}.npz    # as a released-layout .npz",
            f"  {_command('vit-fewshot')} {w} --datasets={r.dataset}{data}    # few-shot probes"]


def _console_stream() -> TextIO:
  """Where vit-train's lines and bar go: stderr, or stdout where only that is a terminal."""
  return sys.stdout if sys.stdout.isatty() and not sys.stderr.isatty() else sys.stderr


def _start_jax():
  """JAX, its CPU devices split as the config asks, joined to the other processes."""
  # Before JAX starts, after absl has parsed the flags (so XLA_FLAGS set by users apply).
  cpu_backend.prepare(FLAGS.config.get("cpu_devices"))
  import jax

  if FLAGS.coordinator_address or FLAGS.distributed:
    if jax.config.jax_platforms in (None, "", "cpu") and FLAGS.coordinator_address:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  return jax


def _own_workdir() -> "workdir_lock.Lock | None":
  """The workdir's lock (checkpoint/workdir_lock.py), taken before anything is written there: a
  workdir in use by another run ends this one with one line naming its holder."""
  from vit_jax.checkpoint import workdir_lock
  try:
    return workdir_lock.take(FLAGS.workdir)
  except OSError as e:  # The workdir cannot be created, or its lock not written.
    cli.fail(f"--workdir {FLAGS.workdir}: {e}")
  except workdir_lock.WorkdirInUse as e:
    cli.fail(e)


def _train_or_compile(argv: list[str]) -> None:
  """absl's main: the run, or with --compile_only / --plan the compile for a TPU slice."""
  del argv
  verbose = FLAGS.verbose or FLAGS.alsologtostderr or FLAGS.logtostderr
  if _compiling():
    logs.route_logs(verbose=verbose)
    sys.exit(_compile_only())
  logs.route_logs(verbose=verbose, hold=True)  # Until this process knows its index.
  jax = _start_jax()
  created = "://" not in FLAGS.workdir and not os.path.exists(FLAGS.workdir)
  lock = _own_workdir()
  try:
    _train(jax, verbose)
  except (stop_signals.Interrupted, KeyboardInterrupt) as e:
    sys.exit(cli.stopped(e))  # After saving: the scheduler's restart resumes the run.
  except SystemExit as e:
    if e.code == cli.USAGE and created and lock:
      lock.release()
      lock = None
      _remove_refused_workdir(FLAGS.workdir)
    raise
  finally:
    if lock:
      lock.release()  # Not after a stall (the watchdog's os._exit): the next run takes it over.


def _num_classes() -> int:
  from vit_jax.train import compile_check
  name = FLAGS.config.data.name.split(":")[0]
  if FLAGS.num_classes is None and name not in compile_check.KNOWN_CLASSES:
    cli.fail(f"config.data.name={FLAGS.config.data.name!r}: its number of classes is not known "
             "without reading the data; give it with --num_classes")
  return FLAGS.num_classes or compile_check.KNOWN_CLASSES[name]


def _compile_only() -> int:
  """--compile_only / --plan: the report (or the plan) on stdout; a config that does not fit
  ends with one line naming the first change found that fits, status 2."""
  import jax
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")  # Nothing runs here: no accelerator is taken.
  # Programs compiled for a topology without its devices cannot be loaded back from JAX's
  # persistent cache (no TPU client to load them into): with a cache set, each rerun warned
  # once per program ("Error reading persistent compilation cache entry") and compiled anyway.
  jax.config.update("jax_enable_compilation_cache", False)
  with logs.native_logs():  # TensorFlow's start-up lines (the data modules' import).
    from vit_jax.train import compile_check
  num_classes = _num_classes()
  try:
    compile_check.take_pretrained_model(FLAGS.config)
    with logs.native_logs():  # libtpu's start-up lines, where there is no TPU.
      topology = compile_check.resolve_topology(FLAGS.topology, FLAGS.num_slices)
    compile_check.check_not_hopeless(FLAGS.config, topology, num_classes)
    found = _search(topology, num_classes)
  except (ValueError, ConfigError) as e:
    cli.fail(e)
  shown = found.found if FLAGS.plan else found.given
  if shown is not None and (shown.fits or FLAGS.json):
    report = compile_check.report(FLAGS.config, topology, shown)
    report |= dict(fix=found.found and found.found.flags(), candidates_compiled=len(found.tried))
    print(json.dumps(report, indent=1) if FLAGS.json else compile_check.format_report(report))
  if FLAGS.plan and found.found:
    if not FLAGS.json:
      print("Use: " + " ".join(found.found.flags()))
    return 0
  if shown is not None and shown.fits:
    return 0
  cli.fail(_no_fit_line(found, topology))


def _search(topology: "compile_check.Topology", num_classes: int) -> "compile_check.Search":
  """compile_check.search in a thread of its own, so that this one answers at once: SIGTERM or
  Ctrl-C ends the search with one line (libtpu's handler, which prints a stack trace, replaced),
  and --plan_timeout with the closest candidate so far."""
  from vit_jax.train import compile_check
  found, result = compile_check.Search(None, []), {}

  def work() -> None:
    try:
      result["search"] = compile_check.search(
          FLAGS.config, topology, num_classes, FLAGS.plan,
          lambda line: print(line, file=sys.stderr, flush=True), found)
    except BaseException as e:  # Raised again in the main thread.
      result["error"] = e

  worker = threading.Thread(target=work, name="compile search", daemon=True)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda n, _: _end_now(cli.stopped(stop_signals.Interrupted(
        n, resumable=False))))
  worker.start()
  worker.join(FLAGS.plan_timeout if FLAGS.plan else None)
  if worker.is_alive():
    _end_now(cli.input_error(_timeout_line(found)))
  if "error" in result:
    raise result["error"]
  return result["search"]


def _end_now(status: int) -> NoReturn:
  """Ends the process while the search's thread is inside a compile (nothing to save)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _timeout_line(found: "compile_check.Search") -> str:
  from vit_jax.train import tpu_specs
  line = (f"--plan_timeout={FLAGS.plan_timeout}: {len(found.tried)} candidate(s) compiled in "
          f"{FLAGS.plan_timeout} s, none fits yet")
  if found.tried:
    closest = min(found.tried, key=lambda a: a.over_bytes)
    line += (f"; the closest, {' '.join(closest.flags())}, is "
             f"{closest.over_bytes / tpu_specs.GiB:.2f} GiB per chip over")
  return line + ": give the search more time (--plan_timeout) or use a bigger slice"


def _no_fit_line(found: "compile_check.Search", topology: "compile_check.Topology") -> str:
  from vit_jax.train import tpu_specs
  spec = (_config_flag(sys.argv) or (0, "", "the config"))[2]
  head = f"--config {spec} does not fit {topology.name} ({topology.chips} {topology.unit}s)"
  if found.given is not None:
    over = found.given.over_bytes
    head += (f": at least {over / tpu_specs.GiB:.2f} GiB per {topology.unit} over its "
             f"{topology.device.hbm_bytes / tpu_specs.GiB:g} GiB")
  n = len(found.tried)
  if found.found is None:
    return (f"{head}; none of the {n} changes compiled fits (mesh.fsdp, model.remat, "
            "accum_steps): use a bigger slice")
  return (f"{head}; it fits with {' '.join(found.found.flags())} (the first that fit of {n} "
          "changes compiled, cheapest first)")


def _remove_refused_workdir(workdir: str) -> None:
  """Removes the workdir this run made, if it holds only its logs: a refused run (an input
  error, told on stderr) leaves nothing behind."""
  left = os.listdir(workdir)
  if all(re.fullmatch(r"train(\.process\d+)?\.log", name) for name in left):
    shutil.rmtree(workdir, ignore_errors=True)


def _train(jax, verbose: bool) -> None:
  from vit_jax.train import loop

  process = jax.process_index()
  log_file = log_path(FLAGS.workdir, process)
  log_stream = logs.route_logs(log_file, verbose)
  logging.info("JAX %s: process %d of %d, %d devices (%s).", jax.__version__, process,
               jax.process_count(), jax.device_count(), jax.devices()[0].platform)
  if process > 0:
    print(f"process {process} of {jax.process_count()}: its log is {log_file}; process 0 "
          "reports the run.", file=sys.stderr, flush=True)
  console = Console(_console_stream(), log_file) if process == 0 else None
  # What the library prints (TFDS's preparation notices) belongs in the log, not the console.
  quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(log_stream)
  try:
    with quiet:
      metrics = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir, console or loop.Report())
  except (InputError, FileNotFoundError) as e:  # What the user gave: one line.
    if console:
      console.close()  # The bar's line ends before the error's.
    cli.fail(str(e))
  finally:
    if console:
      console.close()
  if console:
    console.summary(metrics)


def main() -> NoReturn:
  """The console script: absl parses sys.argv (parse_flags), then the process ends with the
  run's status."""
  cli.exit_with(lambda: app.run(_train_or_compile, flags_parser=parse_flags))


if __name__ == "__main__":
  main()
