"""Weight layouts: the state dicts other frameworks write (timm's, transformers', ...), each
converted to the released .npz layout and described from its repo's config files.

A layout is one module of this package, and one row of `LAYOUTS`. The module holds:

  NAME: str                 what the refusal of an unknown file names ("timm", ...)
  matches(keys) -> bool     whether arrays of these names are this layout's (a cheap test of
                            a key or two; the first row that matches reads the file)
  to_released(arrays, config, source) -> flat
                            the arrays (numpy, the framework's names) as flat released-layout
                            arrays ('/'-joined, as npz.read_npz gives them); config is the
                            repo's config.json, source its spec or folder, for messages. Takes
                            every array through `state_dict.StateDict`, which refuses, by name,
                            what the layout left unused; refuses with `CheckpointError`
                            whatever vit_jax's ViT cannot express
  declared(config) -> dict  what the repo's config says its arrays are, where it says it:
                            model fields that infer_model_config reads off the arrays
                            (patch_size, hidden_size, mlp_dim, num_layers, posemb,
                            num_registers) and `image_size`, the resolution the position
                            embedding's grid is for. `check_declared` refuses a repo whose
                            arrays say otherwise (another family's, another grid, widths)
  describe(flat, fields, config, processor, origin) -> Description
                            the description the repo's config files give: `fields` are the
                            model fields read off `flat` (npz.infer_model_config) to complete
                            (e.g. `gelu`); processor is preprocessor_config.json ({} if none)

Helpers several layouts use: `state_dict` (torch arrays taken by name, in flax's shapes)
and `repo_config` (what timm's and transformers' config files say: preprocessing, heads,
GELU, class names). `hub.read` fetches a repo's files and hands them to `find`.
"""
import math
from typing import Any, Mapping

from vit_jax import models
from vit_jax.checkpoint.errors import CheckpointError
from vit_jax.checkpoint.npz import POSEMB_KEY
from vit_jax.checkpoint.layouts import (open_clip, timm_eva, timm_vit, transformers_clip,
                                        transformers_dinov2, transformers_vit)

# In order: the first whose `matches` is true reads the file (transformers_dinov2 before
# transformers_vit, whose names a Dinov2Model shares).
LAYOUTS = (timm_eva, timm_vit, transformers_dinov2, transformers_vit, transformers_clip,
           open_clip)


def find(arrays: Mapping[str, Any], origin: str):
  """The layout module of `arrays`; refuses, naming a few of them, arrays of none."""
  layout = next((m for m in LAYOUTS if m.matches(arrays)), None)
  if layout is None:
    sample = ", ".join(sorted(arrays)[:4])
    raise CheckpointError(f"{origin} is in none of the layouts vit_jax reads "
                          f"({', '.join(m.NAME for m in LAYOUTS)} ViTs); its arrays: {sample}, ...")
  return layout


def check_declared(flat: Mapping[str, Any], fields: Mapping[str, Any],
                   declared: Mapping[str, Any], origin: str) -> None:
  """Refuses, in one line naming both, a repo whose config (`declared`, the layout's reading
  of it) says otherwise than its arrays (`flat`, and the model `fields` read off them), as
  timm's and transformers' strict loads refuse it: the config describes another model."""
  found = {k: fields.get(k, models.registry.default(k)) for k in declared if k != "image_size"}
  if "posemb" in found:  # Learned or none: arrays without one read as sincos2d's, or RoPE's.
    found["posemb"] = "learn" if POSEMB_KEY in flat else "none"
  wrong = [f"{k} {declared[k]!r} in its config, {v!r} in its arrays"
           for k, v in found.items() if declared[k] != v]
  size = declared.get("image_size")
  if size and POSEMB_KEY in flat and not wrong:
    stride = models.VisionTransformer(num_classes=None, **fields).stride
    side = math.isqrt(flat[POSEMB_KEY].shape[1] - ("cls" in flat))
    if size // stride != side:
      wrong.append(f"image_size {size} in its config ({size // stride}x{size // stride} "
                   f"patches of {stride} px), a {side}x{side} position-embedding grid "
                   f"({side * stride} px) in its arrays")
  if wrong:
    raise CheckpointError(f"{origin}: its config and its arrays are not of one model: "
                          f"{'; '.join(wrong)}. timm and transformers refuse it too: fix the "
                          "config, or download the repo again.")
