"""vit-train's console on process 0: a few lines (what is trained on what, a resume), then a
progress bar (step, %, ETA, img/s, last loss and eval accuracy) where the stream is a terminal,
else a plain line per log interval; at the end a summary: the final evaluation, time, where the
checkpoint and TensorBoard logs are, the commands to run next."""
import os
import shlex
import shutil
import sys
import time
from typing import TYPE_CHECKING, TextIO

import tqdm

from vit_jax.tools import cli
from vit_jax.train import stop_signals

if TYPE_CHECKING:  # The library is imported once the flags are parsed.
  from vit_jax.train import loop

_STARTED = time.time()  # This module is imported with vit-train's: its start.


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


# A classification metric's name ends in one of these (the longest first); what comes before is
# its evaluator's name, or `ema` for the moving average's: `ema_top5_accuracy`.
_SHOWN = {"top5_accuracy": "top-5 {:.2%}", "num_examples": None, "accuracy": "accuracy {:.2%}",
          "loss": "loss {:.4f}"}
_ORDER = ("accuracy", "top5_accuracy", "loss")


def eval_text(m: dict[str, float]) -> str:
  """`accuracy 88.55%, top-5 99.78%, loss 0.3176 (10,000 images)`, then each other
  evaluator's (and the average's) the same way after its name, its images where they differ;
  metrics of other kinds (few-shot means) as `name value`."""
  groups: dict[str, dict[str, float]] = {}
  other = {}
  for name, value in m.items():
    kind = next((k for k in _SHOWN if name == k or name.endswith("_" + k)), None)
    if kind is None:
      other[name] = value
    else:
      groups.setdefault(name[:-len(kind)].rstrip("_"), {})[kind] = value
  main = groups.pop("", {})

  def text(g: dict[str, float], run_images: float | None = None) -> str:
    n = g.get("num_examples")
    images = f" ({n:,.0f} images)" if n is not None and n != run_images else ""
    return ", ".join(_SHOWN[k].format(g[k]) for k in _ORDER if k in g) + images

  parts = [text(main)] if main else []
  parts += [f"{name}: {text(groups[name], main.get('num_examples'))}" for name in sorted(groups)]
  parts += [f"{name} {value:.4f}" for name, value in sorted(other.items())]
  return "; ".join(parts)


class Console:
  """vit-train's own output on process 0, told by the loop (loop.Report's hooks): a few lines
  and a progress bar on `stream` where it is a terminal, else a plain line per log interval;
  `summary` at the end, on stdout."""

  BAR = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

  def __init__(self, stream: TextIO, log_file: str):
    self.stream, self.log_file, self.bar, self.run = _Kept(stream), log_file, None, None
    self.last: dict[str, float] = {}  # train_loss, img_per_sec, accuracy: the latest.
    self.first, self.step_at, self.eval_s, self.eval_t0 = None, 0, 0.0, 0.0
    self.train_s = 0.0  # First step's call to the latest log, evaluations left out.

  def say(self, text: str) -> None:
    with tqdm.tqdm.external_write_mode(file=self.stream):
      print(text, file=self.stream, flush=True)

  def started(self, run: "loop.RunInfo") -> None:
    self.run, self.step_at = run, run.start_step
    epochs = f" ({run.epochs:g} epochs)" if run.epochs else ""
    self.say(f"Training {run.model} ({run.parameters:,} parameters) on {run.dataset} "
             f"({run.num_classes} classes, {run.image_size} px): {run.total_steps:,} steps of "
             f"{run.batch_size} images{epochs}, {run.devices} device{'s' * (run.devices != 1)} "
             f"({run.platform}).")
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
    self.say(f"eval at step {step}: {eval_text(metrics)}")

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
    print("\n".join(lines + self._where()), file=_Kept(sys.stdout), flush=True)

  def _where(self) -> list[str]:
    """Where the run's files are, and the commands to run next, quoted for a shell: a path
    with spaces or parentheses pastes as one argument."""
    r, w = self.run, self.run.workdir
    data = [f"--datasets={r.dataset}"] + ([f"--data_dir={r.data_dir}"] if r.data_dir else []) + (
        ["--on_bad_image=skip"] if r.skip_bad_images else [])
    return [f"Checkpoint:  {r.checkpoints}/{self.step_at}",
            f"TensorBoard: {shlex.join(['tensorboard', '--logdir', w])}",
            f"Log:         {self.log_file}",
            "Next:",
            f"  {shlex.join([_command('vit-inspect'), w])}    # what the checkpoint holds",
            f"  {shlex.join([_command('vit-export'), w, w.rstrip('/') + '.npz'])}    # as a "
            "released-layout .npz",
            f"  {shlex.join([_command('vit-fewshot'), w, *data])}    # few-shot probes"]


class _Kept:
  """A console stream whose reader may leave (`vit-train ... 2>&1 | head`): the first write
  that finds no reader points the stream's file at /dev/null and asks the run to save and stop
  (stop_signals.reader_gone), as Ctrl-C would; the rest of the run's lines go nowhere."""

  def __init__(self, stream: TextIO):
    self._stream = stream

  def __getattr__(self, name: str):
    return getattr(self._stream, name)

  def write(self, text: str) -> int:
    return self._kept(self._stream.write, text)

  def flush(self) -> None:
    self._kept(self._stream.flush)

  def _kept(self, call, *args):
    try:
      return call(*args)
    except BrokenPipeError:
      cli.discard(self._stream)
      stop_signals.reader_gone()
      return 0


def default_stream() -> TextIO:
  """Where vit-train's lines and bar go: stderr, or stdout where only that is a terminal."""
  return sys.stdout if sys.stdout.isatty() and not sys.stderr.isatty() else sys.stderr
