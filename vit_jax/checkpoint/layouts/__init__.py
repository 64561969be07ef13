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
                            every array through `arrays_source.Source`, which refuses, by name,
                            what the layout left unused; refuses with `CheckpointError`
                            whatever vit_jax's ViT cannot express
  describe(flat, fields, config, processor, origin) -> Description
                            the description the repo's config files give: `fields` are the
                            model fields read off `flat` (npz.infer_model_config) to complete
                            (e.g. `gelu`); processor is preprocessor_config.json ({} if none)

Helpers several layouts use: `arrays_source` (torch arrays taken by name, in flax's shapes)
and `repo_config` (what timm's and transformers' config files say: preprocessing, heads,
GELU, class names). `hub.read` fetches a repo's files and hands them to `find`.
"""
from typing import Any, Mapping

from vit_jax.checkpoint.errors import CheckpointError
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
