"""A ViT as a backbone: the outputs of chosen blocks, as token sequences or feature maps, and
the model cut after the last block needed (timm's `forward_intermediates` and
`prune_intermediate_layers`, on the same weights the same values)."""
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models.vit import VisionTransformer

OUTPUT_FMTS = ("NHWC", "NLC")  # forward_intermediates' output_fmt, as timm names them.


def take_indices(num_layers: int, indices: int | Sequence[int] | None) -> list[int]:
  """Block indices: all for None, the last n for an int n, else the given ones (negative
  ones count from the end)."""
  if indices is None:
    return list(range(num_layers))
  if isinstance(indices, int):
    if not 0 < indices <= num_layers:
      raise ValueError(f"indices={indices}: the last n blocks need 0 < n <= {num_layers}.")
    return list(range(num_layers - indices, num_layers))
  bad = [i for i in indices if not -num_layers <= i < num_layers]
  if bad:
    raise ValueError(f"indices {bad}: the model has blocks 0 to {num_layers - 1}.")
  return [i % num_layers for i in indices]


def prune(model: VisionTransformer, params: Any, last_block: int
          ) -> tuple[VisionTransformer, Any]:
  """The model and params cut after block `last_block`: no later blocks, no head."""
  if not 0 <= last_block < model.num_layers:
    raise ValueError(f"last_block={last_block}: the model has blocks 0 to "
                     f"{model.num_layers - 1}.")
  encoder = {k: v for k, v in params["Transformer"].items()
             if not k.startswith("encoderblock_") or int(k.split("_")[1]) <= last_block}
  kept = {k: v for k, v in params.items() if k != "head"} | {"Transformer": encoder}
  return model.clone(num_layers=last_block + 1, num_classes=None), kept


def forward_intermediates(model: VisionTransformer, params: Any, images: jax.Array,
                          indices: int | Sequence[int] | None = None, *, norm: bool = False,
                          prefix_tokens: bool = False, output_fmt: str = "NHWC",
                          stop_early: bool = False) -> Any:
  """The outputs of the blocks `indices` (see take_indices), in block order.

  Each is (batch, H/stride, W/stride, width) ("NHWC") or (batch, tokens, width) ("NLC"),
  patch tokens only; with `prefix_tokens`, (features, prefix) where prefix holds each block's
  class token and registers, (batch, prefix tokens, width) (gap/map pooling: no class token
  unless `class_token`). `norm`: each through the final LayerNorm (none with `fc_norm`, as in
  timm). `stop_early`: the blocks after the last one asked for are not computed.
  """
  if output_fmt not in OUTPUT_FMTS:
    raise ValueError(f"output_fmt={output_fmt!r}, expected one of {OUTPUT_FMTS}.")
  take = sorted(set(take_indices(model.num_layers, indices)))
  if stop_early:
    model, params = prune(model, params, max(take))
  _, state = model.apply({"params": params}, images, mutable=["intermediates"])
  outputs = [state["intermediates"]["Transformer"][f"block_{i}_out"][0] for i in take]
  if norm and not model.fc_norm:  # With fc_norm there is no norm before pooling (timm's too).
    layer_norm = nn.LayerNorm(epsilon=model.layer_norm_eps, dtype=model.dtype)
    ln = {"params": params["Transformer"]["encoder_norm"]}
    outputs = [layer_norm.apply(ln, y) for y in outputs]
  outputs = [y.astype(jnp.float32) for y in outputs]
  n = model.num_prefix_tokens
  prefix, outputs = [y[:, :n] for y in outputs], [y[:, n:] for y in outputs]
  if output_fmt == "NHWC":
    h, w = images.shape[1] // model.stride, images.shape[2] // model.stride
    outputs = [y.reshape(y.shape[0], h, w, y.shape[-1]) for y in outputs]
  return (outputs, prefix) if prefix_tokens else outputs
