"""One way from any checkpoint path to arrays and its description, and to a model with its
params.

A path is a released-layout .npz (any of the layouts `npz` reads, local or gs://), a Hugging
Face Hub checkpoint (`hf-hub:ORG/NAME[@REVISION]`, timm's or transformers' ViT) or a local
folder of the same files (`hub`), an AugReg name (`augreg:S_16`, `augreg:FILENAME`: the Hub's
copy, or the bucket's file fetched into the cache), a training run's
workdir (its latest step) or one of its step directories, or `ema:` and either of the two
for the moving average of the run's parameters (config.ema_decay). The model, resolution, input
preprocessing and classes come from the checkpoint's description (`description`); a file
released without one has its architecture read off the arrays' shapes (or checked against
a model name), its resolution off the position embedding or the AugReg index.
"""
import dataclasses
import json
from typing import Any, Callable

import jax
import numpy as np
from etils import epath

from vit_jax import models
from vit_jax.checkpoint import augreg, description as desc_lib, hub, npz, run, specs
from vit_jax.checkpoint.description import Description
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.models import lora


@dataclasses.dataclass
class Loaded:
  model: models.VisionTransformer
  params: dict[str, Any]
  # Of the loaded model: `image_size` is the one params fit (a model with dynamic_image_size
  # keeps the checkpoint's grid and runs at any size; this is the default it was asked for).
  description: Description
  source: str  # The file or step directory read (a local one by its absolute path).

  @classmethod
  def from_model(cls, model: models.VisionTransformer, params: dict[str, Any], image_size: int,
                 source: str) -> "Loaded":
    """A model built in code, described with the default preprocessing (assumed)."""
    described = desc_lib.Description(model=models.registry.described_fields(model),
                                     image_size=image_size,
                                     num_classes=model.num_classes,
                                     model_name=model.name_in_registry, assumed=("preprocessing",))
    return cls(model, params, described, source)

  @property
  def image_size(self) -> int:
    return self.description.image_size

  @property
  def grid(self) -> tuple[int, int]:
    side = self.image_size // self.model.stride
    return side, side

  @property
  def has_class_token(self) -> bool:
    return self.model.classifier == "token"

  def summary(self) -> str:
    n = sum(np.size(x) for x in jax.tree.leaves(self.params))
    return (f"{model_label(self.model)} from {self.source}: {n:,} "
            f"parameters, {self.model.num_classes or 'no'} classes, {self.image_size}px input, "
            f"{self.grid[0]}x{self.grid[1]} patches of {self.model.stride}px, "
            f"classifier={self.model.classifier!r}")


def model_label(model: models.VisionTransformer) -> str:
  """description.model_label of a built model: its registry name, or its shape."""
  return desc_lib.model_label(model.name_in_registry, models.registry.described_fields(model))


def _checked_name(flat: dict[str, np.ndarray], model_name: str,
                  overrides: dict[str, Any]) -> dict[str, Any]:
  """The fields of `model_name`, after checking that the arrays hold that architecture."""
  fields = models.model_config(model_name)  # Raises, listing the known names.
  named = models.registry.architecture(fields)
  found = npz.infer_model_config(flat)
  wrong = {k: v for k, v in models.registry.architecture(found).items()
           if k not in overrides and named[k] != v}
  if wrong:
    raise CheckpointError(
        f"The checkpoint is not a {model_name}: it has "
        + ", ".join(f"{k}={v} ({model_name}: {named[k]})" for k, v in wrong.items())
        + f". Name the right model, or pass these as overrides: {json.dumps(wrong)}.")
  return fields | {k: v for k, v in found.items() if k not in models.registry.ARCHITECTURE}


def _released(flat: dict[str, np.ndarray], image_size: int | None = None,
              model_name: str | None = None) -> Description:
  """The description of a file that carries none (the official and big_vision releases);
  the AugReg index names the model and resolution of its files."""
  fields = npz.infer_model_config(flat)
  name = model_name or models.registry.match_name(fields)
  if image_size is None and npz.POSEMB_KEY in flat:
    stride = models.VisionTransformer(num_classes=None, **fields).stride
    image_size = desc_lib.grid_image_size(flat[npz.POSEMB_KEY].shape[1],
                                          fields.get("classifier", "token") == "token", stride)
  num_classes = flat["head/kernel"].shape[-1] if "head/kernel" in flat else None
  return desc_lib.released(fields, name, num_classes, image_size)


@dataclasses.dataclass
class Opened:
  """A checkpoint opened once (`open_checkpoint`): what it records about itself, the file or
  step directory read, and its flat original-layout arrays. A command that needs both the
  description and the arrays takes them from one Opened, so that the files are decoded once.

  A run's step is described by its metadata: its arrays are restored when `flat` is first
  asked for. `release()` drops the arrays once they are fitted to a model (a training run
  keeps its set-up, and a ViT-g's arrays are GBs); asked for again, they are read again."""
  path: str  # As asked for: a spec (`hf-hub:`, `augreg:`, `ema:`) or a file or folder.
  description: Description
  source: str  # The file or step directory read (a local one by its absolute path).
  reread: Callable[[], dict[str, np.ndarray]] = dataclasses.field(repr=False)
  arrays: dict[str, np.ndarray] | None = dataclasses.field(default=None, repr=False)
  # A LoRA run's or adapters file's `lora.FIELDS`, whose adapters came merged into the
  # kernels; for an adapters file, the base checkpoint read with them (the file holds no
  # other arrays).
  lora: dict[str, Any] | None = None
  base: str | None = None

  @property
  def flat(self) -> dict[str, np.ndarray]:
    if self.arrays is None:
      self.arrays = self.reread()
    return self.arrays

  def release(self) -> None:
    self.arrays = None

  @property
  def located(self) -> str:
    """`path` as a record names it: a local file or folder by its absolute path."""
    return specs.absolute(self.path)

  def sha256(self) -> str:
    """The arrays' identity by content (`npz.arrays_sha256`): what LoRA adapters record."""
    return npz.arrays_sha256(self.flat)


def open_checkpoint(path: str, base: str | None = None) -> Opened:
  """Any checkpoint path, opened: its reader chosen here, once. A LoRA adapters file comes
  merged onto its base: the checkpoint its description names, or `base` where that has
  moved; either must hold the arrays the adapters were trained on."""
  opened = _open(path, base)
  opened.description = _named(opened.description)
  return opened


def _named(described: Description) -> Description:
  """The description naming its model only where the registry's model of that name is its
  architecture: runs before 2026-11-30 recorded their config's model_name whatever their
  overrides (the quick-start, 64 wide with patches of 7, as ViT-Ti_16). A file whose model
  is assumed is named by its index or its shapes already."""
  if "model" in described.assumed:
    return described
  name = models.registry.match_name(described.model, preferred=described.model_name)
  return described if name == described.model_name else described.replace(model_name=name)


def _open(path: str, base: str | None) -> Opened:
  if specs.is_ema(path):
    return _open_run(path, ema=True)
  if specs.is_augreg(path):
    return _open_augreg(path)
  if specs.is_hub(path) or specs.is_hub_folder(path):
    return _opened(path, lambda: hub.read(specs.absolute(path)))
  p = epath.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  if p.is_dir():
    return _open_run(path, ema=False)
  return _open_npz(str(path), base)


def _opened(path: str, read_all: Callable[[], tuple[dict, Description, str]]) -> Opened:
  """An Opened of a reader that gives arrays and description together (files whose
  description is told from their arrays): read now, and again only after `release`."""
  flat, described, source = read_all()
  return Opened(path, described, source, lambda: read_all()[0], flat)


def _open_run(path: str, ema: bool) -> Opened:
  """A run's workdir (its latest step) or step directory: described by its metadata, its
  arrays restored on first use. A LoRA run's adapters come merged: a plain ViT."""
  run_dir = epath.Path(specs.without_ema(path))
  if ema and not run_dir.is_dir():
    raise CheckpointError(f"{path}: `{specs.EMA_PREFIX}` takes a training run's workdir or "
                          "step directory.")
  step_dir = run.latest_step_dir(run_dir)
  described = run.read_step_description(step_dir)
  fields = _lora_fields(described)
  described = described.replace(model=lora.merged({}, described.model)[1])
  source = f"{specs.EMA_PREFIX if ema else ''}{run.absolute(step_dir)}"
  return Opened(path, described, source, lambda: run.read_step(step_dir, ema)[0], lora=fields)


def _lora_fields(described: Description | None) -> dict[str, Any] | None:
  if described is None or not described.model.get("lora_rank"):
    return None
  return {k: described.model[k] for k in lora.FIELDS if k in described.model}


def _open_augreg(path: str) -> Opened:
  """`augreg:NAME`: the Hub's copy, or the bucket's file described by the AugReg index."""
  resolved = augreg.resolve(path)
  if specs.is_hub(resolved.path):
    return _opened(path, lambda: hub.read(resolved.path))

  def read_all() -> tuple[dict, Description, str]:
    flat = npz.load_npz_flat(resolved.path)
    return flat, _released(flat, resolved.image_size, resolved.model_name), resolved.path
  return _opened(path, read_all)


def _open_npz(path: str, base: str | None) -> Opened:
  """An .npz: a released or exported checkpoint, or a LoRA adapters file merged onto its
  base (`base`, else the one it records), both read again by `reread`."""
  def read_all() -> tuple[dict, Description, dict | None, str | None]:
    flat, described = npz.split_description(npz.read_npz(path))
    if not (fields := _lora_fields(described)):
      return flat, described or _released(flat), None, None
    on = base or described.parent
    return *_on_base(flat, described, path, on), fields, on

  flat, described, fields, on = read_all()
  return Opened(path, described, specs.absolute(path), lambda: read_all()[0], flat, fields, on)


def _on_base(adapters: dict[str, np.ndarray], described: Description, path: str,
             base_path: str | None) -> tuple[dict[str, np.ndarray], Description]:
  """A LoRA adapters file (`export_adapters`) on its base checkpoint, the run's
  config.pretrained (or `base_path`), fitted as the run fitted it; merged."""
  if not base_path:
    raise CheckpointError(f"{path} holds LoRA adapters but names no base checkpoint.")
  point = "give the base they were trained on with --base PATH (loader.load(..., base=PATH))"
  try:
    base = open_checkpoint(base_path).flat
  except FileNotFoundError:
    raise CheckpointError(
        f"{path}: the base checkpoint its LoRA adapters were trained on, {base_path}, is not "
        f"there; {point}.") from None
  found = npz.arrays_sha256(base)
  if described.parent_sha256 and found != described.parent_sha256:
    raise CheckpointError(
        f"{path}: its LoRA adapters were trained on {described.parent} (arrays sha256 "
        f"{described.parent_sha256[:12]}), but {base_path} holds other arrays (sha256 "
        f"{found[:12]}); {point}.")
  base = {k: v for k, v in base.items() if not k.startswith("head/")}
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in described.model.items()}
  model = models.VisionTransformer(num_classes=described.num_classes, **fields)
  size = described.image_size
  abstract = npz.flatten(models.abstract_params(model, size))
  target = npz.unflatten({k: v for k, v in abstract.items() if k not in adapters})
  fitted = npz.flatten(npz.fit_to_target(base, target, model.posemb_interpolation))
  merged, model = lora.merged(fitted | adapters, described.model)
  return merged, described.replace(model=model)


def export_adapters(path: str, out: str) -> Description:
  """Writes a LoRA run's adapters and head alone (what it trained, a small file) with its
  description, whose `parent` names the base checkpoint that `open_checkpoint` puts them on."""
  step_dir = run.latest_step_dir(specs.without_ema(path))
  flat, meta = run.read_params(step_dir, ema=specs.is_ema(path))
  described = run.step_description(meta, int(step_dir.name))
  if not described.model.get("lora_rank"):
    raise CheckpointError(f"{path} is not a LoRA run (config.lora.rank): export it whole.")
  if not described.parent_sha256:  # A run from before its base was recorded by content.
    described = described.replace(parent_sha256=open_checkpoint(described.parent).sha256())
  described = described.replace(exported_from=str(step_dir))
  npz.save_npz(out, npz.unflatten(lora.adapters(flat)), described)
  return described


def describe(path: str, base: str | None = None) -> Description:
  """The description of any checkpoint `open_checkpoint` takes (`base`: its). A run's is read
  from its metadata alone; a file's that its arrays tell (a Hub repo, a bare .npz) needs
  them: where a command also needs the arrays, `open_checkpoint` gives both from one read.
  That of a model `vit-export` wrote in a serving format: vit_jax.serving.formats.describe."""
  return open_checkpoint(path, base).description


def export_npz(path: str, out: str, base: str | None = None) -> Description:
  """Writes any checkpoint's params in the released layout, with its description (the
  checkpoint it was read from in `exported_from`), to `out`; returns the description."""
  opened = open_checkpoint(path, base)
  described = opened.description.replace(exported_from=opened.source)
  npz.save_npz(out, npz.unflatten(opened.flat), described)
  return described


def fit_params(opened: Opened, target: npz.Params,
               posemb_interpolation: str | None = None) -> dict[str, Any]:
  """An opened checkpoint's params fitted to `target` (e.g. a model to fine-tune):
  position embedding resized with `posemb_interpolation` (None: the one the checkpoint's
  description names, its framework's; bilinear, the official code's, where it names none),
  head reset if the class count differs. The target's LoRA adapters, which no checkpoint
  has, are kept as the target holds them (a new run's initial values)."""
  method = posemb_interpolation or posemb_interpolation_of(opened.description)
  flat_target = npz.flatten(target)
  adapters = {k: v for k, v in flat_target.items() if lora.is_adapter(k)}
  if not adapters:
    return npz.fit_to_target(opened.flat, target, method)
  base = npz.unflatten({k: v for k, v in flat_target.items() if k not in adapters})
  return npz.unflatten(npz.flatten(npz.fit_to_target(opened.flat, base, method)) | adapters)


def load_params(path: str, target: npz.Params,
                posemb_interpolation: str | None = None) -> dict[str, Any]:
  """`fit_params` of the checkpoint at `path`."""
  return fit_params(open_checkpoint(path), target, posemb_interpolation)


def posemb_interpolation_of(described: Description) -> str:
  """How the checkpoint's framework resizes its position embedding (models/posemb_resize)."""
  return described.model.get("posemb_interpolation") or models.registry.default(
      "posemb_interpolation")


def _name_and_fields(flat: dict[str, np.ndarray], described: Description, model_name: str | None,
                  overrides: dict[str, Any], source: str) -> tuple[str | None, dict]:
  if "model" not in described.assumed:  # Written by this project: the description says.
    # Named as this function's argument and as the flag every command passes it by. A model
    # without a registry name is a name's with overrides: the name must come with them.
    recorded = described.model_name
    if recorded is None and model_name and (
        models.registry.architecture(models.model_config(model_name, **overrides))
        != models.registry.architecture(described.model)):
      recorded = described.model_label
    desc_lib.check_option("the model", "model_name (--model)", model_name, recorded, source)
    return described.model_name, dict(described.model)
  if model_name:
    return model_name, _checked_name(flat, model_name, overrides)
  return described.model_name, dict(described.model)


def _native_size(flat: dict[str, np.ndarray], model: models.VisionTransformer) -> int | None:
  """The resolution the arrays' learned position embedding is for (None: it has none)."""
  if npz.POSEMB_KEY not in flat or model.posemb != "learn":
    return None
  return desc_lib.grid_image_size(flat[npz.POSEMB_KEY].shape[1], "cls" in flat, model.stride)


def load(path: str, model_name: str | None = None, *, image_size: int | None = None,
         head: bool = True, base: str | None = None, **overrides: Any) -> Loaded:
  """A model and its params from any checkpoint path.

  `model_name` is checked against the file (its description, or the .npz's shapes);
  without it the architecture is read off the file. `overrides` are VisionTransformer
  fields (e.g. a custom patch_size, dtype). `image_size` defaults to the resolution the
  checkpoint was trained at; other sizes resize the position embedding. `head=False` drops
  the classification head, leaving the representation (pre-logits) as the output. `base`
  points a LoRA adapters file at its moved base checkpoint (`open_checkpoint`).
  """
  return from_opened(open_checkpoint(path, base), model_name, image_size=image_size,
                     head=head, **overrides)


def from_opened(opened: Opened, model_name: str | None = None, *, image_size: int | None = None,
                head: bool = True, **overrides: Any) -> Loaded:
  """`load` of an opened checkpoint: for callers that also look at the file's own arrays
  (their dtypes, a zeroed head) without reading it twice."""
  flat, described, source = opened.flat, opened.description, opened.source
  name, fields = _name_and_fields(flat, described, model_name, overrides, source)
  fields = models.model_config(name, **fields) if name else dict(fields)
  fields.update(overrides)
  if head:
    fields["num_classes"] = (flat["head/kernel"].shape[-1] if "head/kernel" in flat
                             else described.num_classes)
  else:
    fields["num_classes"] = None
    flat = {k: v for k, v in flat.items() if not k.startswith("head/")}
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  model = models.VisionTransformer(
      name_in_registry=models.registry.match_name(fields, preferred=name), **fields)
  image_size = image_size or described.image_size
  # A model that resamples its embedding at run time keeps the checkpoint's own grid: one
  # resize, from the grid it was trained at, as its framework's forward does.
  fit_size = (_native_size(flat, model) or image_size) if model.dynamic_image_size else image_size
  abstract = models.abstract_params(model, fit_size)
  built = dict(described.model) | models.registry.described_fields(model)  # Overrides too.
  loaded = described.replace(image_size=image_size, num_classes=model.num_classes, model=built,
                             model_name=name, class_names=described.class_names if head else ())
  return Loaded(model, npz.fit_to_target(flat, abstract, model.posemb_interpolation), loaded,
                source)
