"""The protocol's splits of each task checked before any run (each would fail alike): an image
folder whose class folders differ or are too few, or a split of the protocol (the grid's
minitrain and minival, train, test) that holds no example, of a folder or of a prepared TFDS
dataset (its sizes from the builder's info: nothing read). A TFDS dataset not prepared here is
left to its task's run, which names it if it fails. Refusals are InputErrors in vit-transfer's
terms (--suite, --lr_grid).
"""
from vit_jax.config_errors import InputError
from vit_jax.data import config as data_config
from vit_jax.data import sources, tasks
from vit_jax.transfer import protocol


class _TooFewClasses(InputError):
  """A folder with fewer than two class folders: said as it is, not as a split's problem."""


def check(task_list: list[tasks.Task], settings: protocol.Settings) -> None:
  """Raises InputError for the first task of `task_list` the protocol cannot run."""
  for task in task_list:
    selecting = len(protocol.lr_grid(task, settings)) > 1
    splits = ([task.minitrain, task.minival] if selecting else []) + [task.train, task.test]
    try:
      if task.suite == "custom" and data_config.is_folder(task.tfds_name):
        _check_folder(task.tfds_name, splits)
      else:
        _check_tfds(task.tfds_name, settings.data_dir, splits)
    except _TooFewClasses:
      raise
    except sources.DataOptionError as e:
      raise InputError(e.worded(protocol.DATA_OPTIONS)) from None
    except ValueError as e:
      fix = (" Give one rate (e.g. --lr_grid=0.01: no rate to choose, no minival split) or "
             "a dataset with more examples." if selecting else "")
      raise InputError(f"--suite {task.name}: the protocol's {e}{fix}") from None


def _check_folder(root: str, splits: list[str]) -> None:
  source = sources.FolderSource(root, "fail")
  names = source.class_names
  if len(names) < 2:
    raise _TooFewClasses(f"--suite {root}: {len(names)} class folder(s) "
                     f"({', '.join(names) or 'none'}): a classifier needs two or more")
  for split in splits:
    source.meta(split)


def _check_tfds(name: str, data_dir: str | None, splits: list[str]) -> None:
  import tensorflow_datasets as tfds
  builder = tfds.builder(name, data_dir=data_dir)
  if not builder.is_prepared():
    return
  sizes = builder.info.splits
  for split in splits:
    whole = split.split("[")[0]
    try:
      n = sizes[split].num_examples
    except ValueError:  # TFDS reads no slice that reaches past its split's end.
      raise ValueError(f"split {split!r} of {name} reaches past the end of {whole!r}, which "
                       f"has {sizes[whole].num_examples} examples.") from None
    if not n:
      raise ValueError(f"split {split!r} of {name} is empty: {whole!r} has "
                       f"{sizes[whole].num_examples} examples.")
