"""The paper's fine-tuning protocol (App. B.1.1) as runs: for each (checkpoint, task), one
fine-tuning run per learning rate of the task's grid on a held-out part of the train split
(minitrain -> minival), the best rate chosen on minival, then one run on the whole train
split with it, evaluated on test. Each run is `vit-train` with the finetune recipe (SGD
momentum 0.9, batch 512, cosine decay, clipping at 1, no weight decay, 384 px) and the
task's steps; a run (FineTune) is its config overrides, so the same run goes in-process,
prints as a command line (--dry_run) or goes to a launcher.
"""
import dataclasses
import hashlib
import os
import shlex
from typing import Any

import ml_collections

from vit_jax import configs, models
from vit_jax.checkpoint import description, loader
from vit_jax.checkpoint import specs
from vit_jax.configs import finetune
from vit_jax.data import config as data_config
from vit_jax.data import sources, tasks

SELECT, FINAL = "minival", "test"
# The registry name a checkpoint of an architecture no name has runs under: every field of
# its own overrides the name's.
_UNNAMED_BASE = "ViT-B_16"

# The data options that the pipeline's errors name, as a vit-transfer user sets them: the
# task's data by --suite and --data_dir; its splits, download and folder rules are the
# protocol's.
DATA_OPTIONS = {"name": "--suite", "data_dir": "--data_dir",
                "download": "run `tfds build` on this machine",
                "no_download": "vit-transfer does not download", "train_split": "split",
                "eval_split": "split", "relax_class_mismatch": "", "skip_bad_images": ""}
# Model fields a fine-tuning run takes from its checkpoint. Not representation_size: the
# paper replaces the whole head, pre-logits included, when fine-tuning.
_INHERITED = tuple(f for f in models.registry.DESCRIBED
                   if f not in models.registry.fields_of(models.Role.PRE_LOGITS))


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a sweep changes of the protocol (None: the paper's, or the task's)."""
  image_size: int | None = None  # None: 384 px, fitted to the patch stride (finetune.image_size).
  batch_size: int = 512
  steps: int | None = None  # None: the task's (the paper's Table 4).
  warmup_steps: int | None = None  # None: the recipe's 500, at most a tenth of the steps.
  lr_grid: tuple[float, ...] | None = None  # None: the task's.
  data_dir: str | None = None  # TFDS data_dir.
  cpu_devices: int | None = None


@dataclasses.dataclass(frozen=True)
class FineTune:
  checkpoint: str
  task: tasks.Task
  phase: str  # SELECT: minitrain -> minival; FINAL: train -> test.
  lr: float | None  # FINAL's is chosen by the SELECT runs: None until they are done.
  workdir: str

  @property
  def key(self) -> tuple[str, str, str, str]:
    return (self.checkpoint, self.task.name, self.phase, format_lr(self.lr))


def format_lr(lr: float | None) -> str:
  return "chosen" if lr is None else f"{lr:g}"


def lr_grid(task: tasks.Task, settings: Settings) -> tuple[float, ...]:
  return tuple(settings.lr_grid or task.lr_grid)


def task_dir(out_dir: str, ckpt: str, task: tasks.Task) -> str:
  """out_dir/<checkpoint's base name>-<hash of its path>/<task>: the task's runs and rows."""
  tag = hashlib.sha1(ckpt.encode()).hexdigest()[:8]
  name = os.path.basename(specs.without_ema(ckpt.rstrip("/"))) or "checkpoint"
  return os.path.join(out_dir, f"{name}-{tag}", task.name.replace("/", "_"))


def run_dir(out_dir: str, ckpt: str, task: tasks.Task, phase: str, lr: float | None) -> str:
  return os.path.join(task_dir(out_dir, ckpt, task), f"{phase}_lr{format_lr(lr)}")


def fine_tunes(ckpt: str, task: tasks.Task, settings: Settings, out_dir: str,
               chosen: float | None = None) -> list[FineTune]:
  """The selection runs, then the final run (with the `chosen` rate once known). A grid of
  one rate needs no selection."""
  grid = lr_grid(task, settings)
  select = [FineTune(ckpt, task, SELECT, lr, run_dir(out_dir, ckpt, task, SELECT, lr))
            for lr in grid] if len(grid) > 1 else []
  final_lr = grid[0] if len(grid) == 1 else chosen
  return select + [FineTune(ckpt, task, FINAL, final_lr,
                       run_dir(out_dir, ckpt, task, FINAL, final_lr))]


def choose_lr(accuracies: dict[float, float]) -> float:
  """The rate with the best minival accuracy; on a tie the smaller rate."""
  return max(sorted(accuracies), key=lambda lr: accuracies[lr])


def model_name(described: description.Description) -> str:
  return described.model_name or _UNNAMED_BASE


def _model_overrides(described: description.Description) -> dict[str, Any]:
  return {f"model.{k}": tuple(v) if isinstance(v, list) else v
          for k, v in described.model.items() if k in _INHERITED and v is not None}


def overrides(ft: FineTune, settings: Settings, described: description.Description
              ) -> dict[str, Any]:
  """The run's fields of the finetune config, by dotted name."""
  task = ft.task
  steps = settings.steps or task.steps
  warmup = settings.warmup_steps
  if warmup is None:
    warmup = min(finetune.WARMUP_STEPS, steps // 10) if settings.steps else finetune.WARMUP_STEPS
  train, evaluate = ((task.minitrain, task.minival) if ft.phase == SELECT
                     else (task.train, task.test))
  named = task.name in tasks.TASKS
  model = _model(described)
  # --image_size, else the recipe's 384 px fitted to the model's patch stride.
  image_size = settings.image_size or finetune.image_size(model.stride)
  return _accumulation(settings, model, image_size) | {
      "model_name": model_name(described), **_model_overrides(described),
      "pretrained": ft.checkpoint,
      "data.name": sources.TASK_PREFIX + task.name if named else task.tfds_name,
      "data.data_dir": settings.data_dir, "data.train_split": train,
      "data.eval_split": evaluate,
      "data.image_size": image_size,
      "batch_size": settings.batch_size, "total_steps": steps, "warmup_steps": warmup,
      "optimizer.lr": ft.lr, "eval_every_steps": None, "cpu_devices": settings.cpu_devices,
  }


def _model(described: description.Description) -> models.VisionTransformer:
  fields = {k.removeprefix("model."): v for k, v in _model_overrides(described).items()}
  return models.create_model(model_name(described), num_classes=None, **fields)


def _accumulation(settings: Settings, model: models.VisionTransformer,
                  image_size: int) -> dict[str, int]:
  """`accum_steps` where the recipe's batch of the checkpoint's model does not fit the memory
  here in one step (footprint.accum_steps_for): the same 512 examples an update, in
  micro-batches; nothing where it fits."""
  from vit_jax.models import footprint
  steps = footprint.accum_steps_for(model, image_size, settings.batch_size,
                                    settings.cpu_devices or 1)
  return {"accum_steps": steps} if steps > 1 else {}


def _recipe(task: tasks.Task, described: description.Description) -> str:
  """The finetune config the run starts from (an image folder's: a name of no dataset; the
  run's overrides set its data)."""
  dataset = "folder" if data_config.is_folder(task.tfds_name) else task.tfds_name.split(":")[0]
  return f"finetune:{models.registry.short_name(model_name(described))},{dataset}"


def config(ft: FineTune, settings: Settings, described: description.Description
           ) -> ml_collections.ConfigDict:
  """The finetune config with the run's overrides."""
  c = configs.get_config(_recipe(ft.task, described))
  c.update_from_flattened_dict(overrides(ft, settings, described))
  return c


def command(ft: FineTune, settings: Settings, described: description.Description) -> list[str]:
  """The run as a `vit-train` command line."""
  flags = [f"--config.{k}={v}" for k, v in overrides(ft, settings, described).items()
           if v is not None and k != "model_name"]
  return ["vit-train", "--config", _recipe(ft.task, described), "--workdir", ft.workdir,
          *flags]


def commands(checkpoints: list[str], task_list: list[tasks.Task], settings: Settings,
             out_dir: str) -> list[str]:
  """The runs of every checkpoint on every task as `vit-train` command lines (vit-transfer's
  dry run), a comment on each whose learning rate is the one chosen on minival."""
  lines = []
  for ckpt in checkpoints:
    described = loader.describe(ckpt)
    for task in task_list:
      for ft in fine_tunes(ckpt, task, settings, out_dir):
        lines.append(shlex.join(command(ft, settings, described)) + (
            "  # --config.optimizer.lr: the rate chosen on minival" if ft.lr is None else ""))
  return lines
