"""vit_jax/tools/console.py's lines (the console of a whole run: test_e2e_console.py)."""
import shlex

import pytest

from vit_jax.tools import console

MAIN = {"accuracy": 0.8855, "top5_accuracy": 0.9978, "loss": 0.31764, "num_examples": 10000.0}
LINES = {  # The metrics an evaluation returns: its console line.
    "the run's own": (MAIN, "accuracy 88.55%, top-5 99.78%, loss 0.3176 (10,000 images)"),
    "with the moving average's, on the same images": (
        MAIN | {"ema_accuracy": 0.6566, "ema_top5_accuracy": 0.9811, "ema_loss": 0.93771,
                "ema_num_examples": 10000.0},
        "accuracy 88.55%, top-5 99.78%, loss 0.3176 (10,000 images); "
        "ema: accuracy 65.66%, top-5 98.11%, loss 0.9377"),
    "another evaluator's, on other images, and few-shot means": (
        MAIN | {"imagenet_real_accuracy": 0.9012, "imagenet_real_num_examples": 49454.0,
                "fewshot_fashion_mnist_10shot": 0.86691},
        "accuracy 88.55%, top-5 99.78%, loss 0.3176 (10,000 images); "
        "imagenet_real: accuracy 90.12% (49,454 images); fewshot_fashion_mnist_10shot 0.8669"),
    "an evaluator's alone": (
        {"minival_accuracy": 0.5, "minival_num_examples": 128.0},
        "minival: accuracy 50.00% (128 images)"),
}


@pytest.mark.parametrize("metrics, line", LINES.values(), ids=LINES)
def test_each_evaluators_metrics_read_alike_under_its_name(metrics, line):
  """Every evaluator's accuracy as a percentage, its top-5 and loss beside it, its images
  where they are not the run's: not `ema_accuracy 0.6566, ema_num_examples 10000.0000`."""
  assert console.eval_text(metrics) == line


NEXT = {  # A run's data: vit-train's suggested few-shot command, which must read it as the run did.
    "a TFDS dataset": (dict(dataset="fashion_mnist", data_dir=None, skip_bad_images=False),
                       "--datasets=fashion_mnist"),
    "in its own data_dir": (dict(dataset="mnist", data_dir="../data", skip_bad_images=False),
                            "--datasets=mnist --data_dir=../data"),
    "an image folder whose undecodable files the run left out": (
        dict(dataset="./photos", data_dir=None, skip_bad_images=True),
        "--datasets=./photos --on_bad_image=skip"),
    "a folder whose name a shell splits": (
        dict(dataset="/data/my photos (2)", data_dir=None, skip_bad_images=False),
        "'--datasets=/data/my photos (2)'"),
}


def _console(workdir: str, **data) -> console.Console:
  from vit_jax.train import loop
  out = console.Console(None, f"{workdir}/train.log")
  out.run = loop.RunInfo(
      workdir=workdir, checkpoints=f"{workdir}/checkpoints", model="ViT-Ti_16", parameters=1,
      trained_parameters=1, num_classes=10, image_size=28, batch_size=64, total_steps=10,
      start_step=0, epochs=None, pretrained=None, devices=1, platform="cpu", processes=1, **data)
  return out


@pytest.mark.parametrize("data, flags", NEXT.values(), ids=NEXT)
def test_the_suggested_fewshot_command_reads_the_data_as_the_run_did(data, flags):
  [line] = [x for x in _console("/tmp/w", **data)._where() if "vit-fewshot" in x]
  assert line.split("vit-fewshot ", 1)[1] == f"/tmp/w {flags}    # few-shot probes"


def test_the_suggested_commands_paste_into_a_shell_with_any_workdir():
  """A workdir with a space and parentheses: each command line splits back into its arguments
  (they were joined unquoted: `vit-inspect /tmp/my run (1)`, a syntax error in bash)."""
  workdir = "/tmp/my run (1)"
  lines = _console(workdir, **NEXT["a TFDS dataset"][0])._where()
  commands = [shlex.split(x.split("#")[0].removeprefix("TensorBoard:")) for x in lines
              if x.startswith(("  ", "TensorBoard:"))]
  assert [c[1:] for c in commands] == [
      ["--logdir", workdir], [workdir], [workdir, workdir + ".npz"],
      [workdir, "--datasets=fashion_mnist"]]
