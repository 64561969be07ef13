"""Named model configurations, with the official model zoo's names."""
import dataclasses
from typing import Any

from vit_jax.models.vit import Role, VisionTransformer


def _vit(patch: int, width: int, mlp: int, heads: int, layers: int, **kw) -> dict[str, Any]:
  return dict(patch_size=patch, hidden_size=width, mlp_dim=mlp, num_heads=heads,
              num_layers=layers, **kw)


_TI = (192, 768, 3, 12)
_S = (384, 1536, 6, 12)
_B = (768, 3072, 12, 12)
_L = (1024, 4096, 16, 24)
_H = (1280, 5120, 16, 32)
_G = (1408, 6144, 16, 40)  # big_vision's ViT-g.

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "ViT-Ti_16": _vit(16, *_TI),
    "ViT-S_16": _vit(16, *_S),
    "ViT-S_32": _vit(32, *_S),
    "ViT-B_8": _vit(8, *_B),
    "ViT-B_16": _vit(16, *_B),
    "ViT-B_32": _vit(32, *_B),
    "ViT-L_16": _vit(16, *_L),
    "ViT-L_32": _vit(32, *_L),
    "ViT-H_14": _vit(14, *_H),
    "ViT-g_14": _vit(14, *_G),
    # Hybrids: the ResNet-v2 stem downsamples by 4 * 2**(stages - 1), patches do the rest.
    "R+ViT-Ti_16": _vit(8, *_TI, resnet_layers=()),
    "R50+ViT-B_16": _vit(1, *_B, resnet_layers=(3, 4, 9)),
    "R26+ViT-B_32": _vit(1, *_B, resnet_layers=(2, 2, 2, 2)),
    "R26+ViT-S_32": _vit(1, *_S, resnet_layers=(2, 2, 2, 2)),
    "R50+ViT-L_32": _vit(1, *_L, resnet_layers=(3, 4, 6, 3)),
}
for _name in ("ViT-S_16", "ViT-B_16", "ViT-S_32", "ViT-B_32"):
  MODEL_CONFIGS[f"{_name}-gap-norep"] = dict(MODEL_CONFIGS[_name], classifier="gap")


def fields_of(*roles: Role) -> tuple[str, ...]:
  """The names of VisionTransformer's fields of these roles, in declaration order."""
  return tuple(f.name for f in dataclasses.fields(VisionTransformer)
               if f.metadata.get("role") in roles)


def fields_except(*roles: Role) -> tuple[str, ...]:
  """The names of VisionTransformer's fields of any other role."""
  return fields_of(*(set(Role) - set(roles)))


# What a model may be built with: all but the name it is built under.
FIELDS = fields_except(Role.INTERNAL)
# The fields a model name fixes; the others (pooling, pre-logits, position embedding, head,
# regularisation, numerics) vary between checkpoints of one architecture.
ARCHITECTURE = fields_of(Role.ARCHITECTURE)
# What a model must share with a checkpoint for its arrays to load: the architecture and which
# arrays there are beyond it (LayerScale, registers, pre-norm, ...). A fine-tuning run takes them
# from a checkpoint that describes them; for one that does not, vit-inspect prints them as flags.
SHAPE = fields_of(Role.ARCHITECTURE, Role.LAYOUT)
# What a checkpoint's description records of its model: the architecture and the fields that
# decide what its parameters mean (pooling, pre-logits, position embedding).
DESCRIBED = fields_of(Role.ARCHITECTURE, Role.LAYOUT, Role.COMPUTATION, Role.PRE_LOGITS)


def described_fields(model: VisionTransformer) -> dict[str, Any]:
  """The DESCRIBED fields of `model`, as JSON gives them back (tuples as lists)."""
  return {f: list(v) if isinstance(v, tuple) else v
          for f, v in ((f, getattr(model, f)) for f in DESCRIBED)}


def model_config(name: str, **overrides: Any) -> dict[str, Any]:
  """The constructor arguments of a named model, with overrides applied.

  Lists become tuples, as JSON and the command line give back a `resnet_layers` tuple.
  """
  if name not in MODEL_CONFIGS:
    raise ValueError(f"Unknown model {name!r}. Known models: {', '.join(MODEL_CONFIGS)}.")
  unknown = sorted(set(overrides) - set(FIELDS))
  if unknown:
    raise ValueError(f"Unknown model option(s) {unknown} for {name}. "
                     f"Valid options: {', '.join(FIELDS)}.")
  overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
  return {**MODEL_CONFIGS[name], **overrides}


def default(field: str) -> Any:
  """A VisionTransformer field's default (dataclasses.MISSING for one without)."""
  return VisionTransformer.__dataclass_fields__[field].default


def architecture(fields: dict[str, Any]) -> dict[str, Any]:
  """The ARCHITECTURE part of model fields, defaults filled in."""
  return {k: tuple(v) if isinstance(v, list) else v
          for k, v in ((k, fields.get(k, default(k))) for k in ARCHITECTURE)}


def match_name(fields: dict[str, Any], preferred: str | None = None) -> str | None:
  """`preferred` where it names the architecture of `fields`, else the first registry name
  that does; None where none does (a ViT-Ti_16 with another width is no ViT-Ti_16)."""
  want = architecture(fields)
  names = [n for n, c in MODEL_CONFIGS.items() if architecture(c) == want]
  return preferred if preferred in names else next(iter(names), None)


def create_model(name: str, num_classes: int | None = 1000, **overrides: Any) -> VisionTransformer:
  """Builds a named model, e.g. `create_model("ViT-B_16", num_classes=10, dtype=jnp.bfloat16)`;
  overrides that change its architecture leave it without a registry name."""
  fields = model_config(name, **overrides)
  return VisionTransformer(num_classes=num_classes,
                           name_in_registry=match_name(fields, preferred=name), **fields)


def short_name(name: str) -> str:
  """"ViT-B_16" -> "b16", "R50+ViT-B_16" -> "r50_b16": the names config args use."""
  return name.lower().replace("vit-", "").replace("_", "").replace("+", "_")


def resolve_name(name: str) -> str:
  """A registry name from itself or its short form."""
  if name in MODEL_CONFIGS:
    return name
  by_short = {short_name(n): n for n in MODEL_CONFIGS}
  if name.lower() not in by_short:
    raise ValueError(f"Unknown model {name!r}. Known models: {', '.join(MODEL_CONFIGS)} "
                     f"(or short: {', '.join(by_short)}).")
  return by_short[name.lower()]
