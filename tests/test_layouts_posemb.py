"""Every layout x every path that resizes a position embedding, against the framework's own
resize (issue 58): random weights in tiny models, saved by each framework's own writer into an
offline Hub cache (the released .npz layouts: np.savez, as the official code and big_vision
write them), then

  described   loader.load at the size the description gives (transformers' DINOv2: the
              processor's crop, not the embedding's grid)
  load        loader.load(image_size=...) at a smaller and a larger size
  dynamic     loader.load(dynamic_image_size=True), run at both sizes: the embedding is
              kept at its own grid and resampled once, in the forward pass
  finetune    the start of a fine-tuning run at both sizes (run_setup: the config's model
              fields from the description, load_pretrained)
  (and npz.load_npz of the checkpoint exported as an .npz, fitted to a model at 24 px)

each compared with the framework's resized embedding (timm's resample_abs_pos_embed, as its
dynamic_img_size forward calls it; transformers' interpolate_pos_encoding; open_clip's
resize_pos_embed as create_model(force_image_size=...) applies it; scipy.ndimage.zoom(order=1),
the official code's and big_vision's resample_posemb) within 1e-5, and with the framework's
forward at that size within 1e-4 (the released layouts have no forward but ours). A config
field set for the resize is honoured; a repo whose config says otherwise than its arrays
(another family's, another grid, other widths) is refused in one line naming both.

`pytest tests/test_layouts_posemb.py -n 0 -s` prints the largest difference of each row and
path (README's fidelity table).
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IMAGENET_MEAN, IMAGENET_STD, big_vision_layout, perturbed, write_repo
from vit_jax import models
from vit_jax.checkpoint import errors, loader, npz
from vit_jax.models import timm_models
from vit_jax.models.posemb import AddPositionEmbs

NATIVE, PATCH, SIZES = 32, 8, (24, 48)  # A 4x4 grid, resized down to 3x3 and up to 6x6.
TIMM_TINY = dict(patch_size=PATCH, embed_dim=32, depth=1, num_heads=2, img_size=NATIVE,
                 num_classes=0)
EMBEDDING_TOL, LOGITS_TOL = 1e-5, 1e-4
PATHS = ("described", "load", "dynamic", "finetune")
MEASURED = {}  # (row, path) -> (embedding difference, output difference): the printed table.


def _torch():
  return timm_models.import_torch()[0]


def _nchw(x: np.ndarray):
  return _torch().from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


class Framework:
  """A row: its checkpoint spec, the size its description gives, and the framework's own
  resized embedding grid (tokens, D) and forward at any size (None: no forward but ours)."""

  def __init__(self, spec, embedding, forward=None, described=NATIVE):
    self.spec, self.embedding, self.forward, self.described = spec, embedding, forward, described


# timm: (architecture, create_model kwargs beyond TIMM_TINY).
TIMM_ROWS = {
    # The tag save_for_hf writes is Google's augreg, trained with the tanh GELU: timm runs that.
    "timm ViT": ("vit_tiny_patch16_224", dict(act_layer="gelu_tanh")),
    "timm DINOv2": ("vit_small_patch14_dinov2", {}),
    "timm DINOv2 reg4": ("vit_small_patch14_reg4_dinov2", {}),
    "timm CLIP": ("vit_base_patch16_clip_224", {}),
    "timm EVA-02": ("eva02_tiny_patch14_224", {}),
    "timm DINOv3": ("vit_small_patch16_dinov3", {}),
}


def timm_row(root, cache, row: str) -> Framework:
  torch, timm = timm_models.import_torch()
  from timm.layers import resample_abs_pos_embed
  from timm.models import _hub
  arch, kwargs = TIMM_ROWS[row]
  model = perturbed(timm.create_model(arch, pretrained=False, dynamic_img_size=True,
                                      **TIMM_TINY, **kwargs), torch, 0.05)
  folder = root / row.replace(" ", "_")
  _hub.save_for_hf(model, folder, model_args=TIMM_TINY | kwargs, safe_serialization=True,
                   data_config=dict(input_size=(3, NATIVE, NATIVE)))
  write_repo(cache, f"timm/{folder.name}", {f: folder / f for f in os.listdir(folder)})

  def embedding(size):  # As timm's _pos_embed resamples it for a dynamic_img_size forward.
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    with torch.no_grad():
      grid = resample_abs_pos_embed(model.pos_embed, (size // PATCH,) * 2,
                                    num_prefix_tokens=prefix)
    return grid[0, prefix:].detach().numpy()

  return Framework(f"hf-hub:timm/{folder.name}",
                   embedding if getattr(model, "pos_embed", None) is not None else None,
                   lambda x: timm_models.logits(model, x))


def _transformers_embedding(embeddings, width: int):
  """transformers' interpolate_pos_encoding, what its forward adds at another size."""
  def embedding(size):
    tokens = _torch().zeros(1, (size // PATCH) ** 2 + 1, width)
    with _torch().no_grad():
      return embeddings.interpolate_pos_encoding(tokens, size, size)[0, 1:].numpy()
  return embedding


def _save_transformers(model, processor, cache, repo: str, root) -> str:
  folder = root / repo.replace("/", "_")
  model.save_pretrained(folder)
  processor.save_pretrained(folder)
  write_repo(cache, repo, {f: folder / f for f in os.listdir(folder)})
  return f"hf-hub:{repo}"


def transformers_row(root, cache, row: str) -> Framework:
  import transformers
  torch = _torch()
  tiny = dict(image_size=NATIVE, patch_size=PATCH, hidden_size=32, num_hidden_layers=1,
              num_attention_heads=2, layer_norm_eps=1e-6)
  if row == "transformers ViT":
    model = transformers.ViTModel(transformers.ViTConfig(intermediate_size=64, **tiny))
    processor = transformers.ViTImageProcessor(size={"height": NATIVE, "width": NATIVE})
    embeddings, out, described = model.embeddings, "pooler_output", NATIVE
  elif row == "transformers CLIP":
    model = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        intermediate_size=64, projection_dim=16, **tiny))
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": NATIVE},
                                                crop_size={"height": NATIVE, "width": NATIVE})
    embeddings, out, described = model.vision_model.embeddings, "image_embeds", NATIVE
  else:  # DINOv2, its processor cropping 24 px of the 32 px its embedding is for.
    registers = row.endswith("registers")
    name = "Dinov2WithRegisters" if registers else "Dinov2"
    config = getattr(transformers, name + "Config")(
        mlp_ratio=2, **tiny, **(dict(num_register_tokens=2) if registers else {}))
    model = getattr(transformers, name + "Model")(config)
    processor = transformers.BitImageProcessor(
        size={"shortest_edge": NATIVE}, crop_size={"height": 24, "width": 24}, resample=3,
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    embeddings, out, described = model.embeddings, "pooler_output", 24
  model = perturbed(model, torch, 0.05)
  spec = _save_transformers(model, processor, cache, "org/" + row.split()[-1].lower() +
                            ("-registers" if row.endswith("registers") else ""), root)

  def forward(x):
    with torch.no_grad():
      kw = {} if row.startswith("transformers DINOv2") else dict(interpolate_pos_encoding=True)
      return getattr(model(pixel_values=_nchw(x), **kw), out).numpy()

  return Framework(spec, _transformers_embedding(embeddings, 32), forward, described)


def open_clip_row(root, cache, row: str) -> Framework:
  import open_clip
  from test_layouts_open_clip import open_clip_repo
  folder = open_clip_repo(root)  # image_size 32, patch 8.
  write_repo(cache, "laion/tiny-open-clip", {f: folder / f for f in os.listdir(folder)})
  models_at = {}

  def model_at(size):  # create_model loads at `size` through open_clip's resize_pos_embed.
    if size not in models_at:
      models_at[size] = open_clip.create_model(f"local-dir:{folder}",
                                               force_image_size=size).eval()
    return models_at[size]

  def forward(x):
    with _torch().no_grad():
      return model_at(x.shape[1]).encode_image(_nchw(x)).numpy()

  return Framework("hf-hub:laion/tiny-open-clip",
                   lambda size: model_at(size).visual.positional_embedding[1:].detach().numpy(),
                   forward)


def released_row(root, cache, row: str) -> Framework:
  """A bare .npz as the official code (np.savez of its flat params) or big_vision writes it."""
  import scipy.ndimage
  del cache
  model = models.create_model("ViT-Ti_16", num_classes=5, patch_size=PATCH, hidden_size=32,
                              mlp_dim=64, num_heads=2, num_layers=1)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, NATIVE, NATIVE, 3)))
  rng = np.random.default_rng(0)
  flat = {k: rng.normal(0, 0.1, v.shape).astype(np.float32)
          for k, v in npz.flatten(shapes["params"]).items()}
  path = root / (row.split()[0] + ".npz")
  np.savez(path, **(big_vision_layout(flat, scanned=True) if row.startswith("big_vision")
                    else flat))
  side = NATIVE // PATCH
  grid = flat[npz.POSEMB_KEY][0, 1:].reshape(side, side, -1)

  def embedding(size):  # The official code's and big_vision's resample_posemb.
    zoom = (size // PATCH) / side
    return scipy.ndimage.zoom(grid, (zoom, zoom, 1), order=1).reshape(-1, grid.shape[-1])

  return Framework(str(path), embedding)


ROWS = {**{r: timm_row for r in TIMM_ROWS},
        "transformers ViT": transformers_row, "transformers DINOv2": transformers_row,
        "transformers DINOv2 registers": transformers_row, "transformers CLIP": transformers_row,
        "OpenCLIP": open_clip_row, "released .npz": released_row,
        "big_vision .npz": released_row}


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory):
  """Each row built once, on first use, into one Hub cache the module's tests share."""
  root = tmp_path_factory.mktemp("posemb")
  (root / "hub").mkdir()
  built = {}

  def get(row: str) -> Framework:
    if row not in built:
      built[row] = ROWS[row](root, root / "hub", row)
    return built[row]

  yield get, root / "hub"
  if MEASURED:
    print("\nrow | path | embedding | output")
    for (row, path), (emb, out) in sorted(MEASURED.items()):
      print(f"{row} | {path} | {emb:.1e} | " + ("-" if out is None else f"{out:.1e}"))


@pytest.fixture
def framework(frameworks, request, monkeypatch):
  """The row's Framework, with huggingface_hub offline on the module's cache."""
  from huggingface_hub import constants
  get, cache = frameworks
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return get(request.param)


def _grid(posemb: np.ndarray, size: int) -> np.ndarray:
  """The patch rows of a (1, tokens, D) embedding."""
  return np.asarray(posemb)[0, -(size // PATCH) ** 2:]


def _stored(params) -> np.ndarray | None:
  return npz.flatten(params).get(npz.POSEMB_KEY)


def _runtime_embedding(loaded: loader.Loaded, size: int) -> np.ndarray:
  """What the dynamic model adds at `size`: its AddPositionEmbs on the params it holds."""
  stored = jnp.asarray(_stored(loaded.params))
  prefix = int("cls" in loaded.params)
  side = size // loaded.model.stride
  module = AddPositionEmbs((side, side), prefix, dynamic=True,
                           interpolation=loaded.model.posemb_interpolation)
  return _grid(module.apply({"params": {"pos_embedding": stored}},
                            jnp.zeros((1, prefix + side * side, stored.shape[-1]))), size)


def _images(size: int) -> np.ndarray:
  return np.random.default_rng(size).uniform(-1, 1, (2, size, size, 3)).astype(np.float32)


def _compare(fw: Framework, embedding, loaded, size: int) -> tuple[float, float | None]:
  """The differences from the framework at `size`: the embedding's grid and the output."""
  emb = 0.0
  if fw.embedding is not None:
    emb = float(np.abs(embedding - fw.embedding(size)).max())
  out = None
  if fw.forward is not None and loaded is not None:
    x = _images(size)
    ours = np.asarray(jax.jit(loaded.model.apply)({"params": loaded.params}, x))
    out = float(np.abs(ours - fw.forward(x)).max())
  return emb, out


def _finetune_params(spec: str, size: int, **model_fields):
  """config.pretrained's params as a fine-tuning run starts from them at `size`."""
  from vit_jax.train import config as config_lib, run_setup
  c = config_lib.base_config()
  c.model_name, c.pretrained, c.data.image_size = "ViT-Ti_16", spec, size
  c.model.update(model_fields)
  opened = loader.open_checkpoint(spec)
  parent = opened.description
  if "model" in parent.assumed:  # A bare .npz: its architecture as vit-inspect prints it.
    c.model.update({k: v for k, v in parent.model.items() if k in models.registry.SHAPE})
  run_setup.inherit_model_fields(c, parent)
  model = run_setup.build_model(c, 3)
  return run_setup.load_pretrained(model, opened, jax.random.key(0), size)


# The size each path runs the forward at (the embedding is compared at both): one forward
# (one compile) each, as the embedding is what the paths differ in.
_OUTPUT_SIZE = {"load": SIZES[0], "dynamic": SIZES[1]}


def _measure(fw: Framework, path: str) -> list[tuple[int, float, float | None]]:
  """(size, embedding difference, output difference) of `path` at each size it resizes to."""
  if path == "described":  # A resize where the description's size is not the grid's.
    loaded = loader.load(fw.spec)
    assert loaded.image_size == fw.described
    return [(fw.described, *_compare(fw, _grid(_stored(loaded.params), fw.described)
                                     if fw.embedding else None,
                                     loaded if fw.described != NATIVE else None, fw.described))]
  rows = []
  if path == "dynamic":
    loaded = loader.load(fw.spec, dynamic_image_size=True)
    if fw.embedding is not None:  # Kept at its own grid: one resample, at run time.
      assert _stored(loaded.params).shape[1] - ("cls" in loaded.params) == (NATIVE // PATCH)**2
  for size in SIZES:
    if path == "load":
      loaded = loader.load(fw.spec, image_size=size)
      embedding = fw.embedding and _grid(_stored(loaded.params), size)
    elif path == "dynamic":
      embedding = fw.embedding and _runtime_embedding(loaded, size)
    else:
      params, loaded = _finetune_params(fw.spec, size), None
      embedding = fw.embedding and _grid(_stored(params), size)
    rows.append((size, *_compare(fw, embedding, loaded if size == _OUTPUT_SIZE.get(path)
                                 else None, size)))
  return rows


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("framework", list(ROWS), indirect=True)
def test_every_resize_path_is_the_frameworks(framework, path, request):
  row = request.node.callspec.params["framework"]
  measured = _measure(framework, path)
  emb = max(m[1] for m in measured)
  outs = [m[2] for m in measured if m[2] is not None]
  MEASURED[(row, path)] = (emb, max(outs) if outs else None)
  for size, emb, out in measured:
    assert emb <= EMBEDDING_TOL, f"{row}, {path} at {size} px: embedding {emb:.2e} off"
    assert out is None or out <= LOGITS_TOL, f"{row}, {path} at {size} px: output {out:.2e} off"


@pytest.mark.parametrize("framework", [r for r in ROWS if r != "timm DINOv3"], indirect=True)
def test_an_exported_npz_resizes_as_its_framework(framework, tmp_path):
  """vit-export's .npz of the checkpoint, fitted to a model at another size by npz.load_npz:
  the resize its description records (it was bilinear whatever the file said)."""
  loader.export_npz(framework.spec, str(tmp_path / "out.npz"))
  loaded = loader.load(framework.spec, image_size=SIZES[0])
  target = jax.eval_shape(loaded.model.init, jax.random.key(0),
                          jnp.zeros((1, SIZES[0], SIZES[0], 3)))["params"]
  params = npz.load_npz(str(tmp_path / "out.npz"), target)
  np.testing.assert_allclose(_grid(_stored(params), SIZES[0]), framework.embedding(SIZES[0]),
                             atol=EMBEDDING_TOL)


@pytest.mark.parametrize("framework", ["timm DINOv2", "released .npz"], indirect=True)
def test_a_fine_tuning_config_interpolation_is_honoured(framework):
  """config.model.posemb_interpolation, set, is the start of the run's resize (was ignored)."""
  import scipy.ndimage
  torch = _torch()
  side, size = NATIVE // PATCH, SIZES[1]
  stored = _grid(_stored(loader.load(framework.spec).params), NATIVE).reshape(side, side, -1)
  for method in ("bilinear", "bicubic_no_antialias"):
    got = _grid(_stored(_finetune_params(framework.spec, size, posemb_interpolation=method)),
                size)
    if method == "bilinear":
      want = scipy.ndimage.zoom(stored, (size / NATIVE, size / NATIVE, 1), order=1)
    else:
      want = torch.nn.functional.interpolate(
          torch.from_numpy(stored).permute(2, 0, 1)[None], size=(size // PATCH,) * 2,
          mode="bicubic", align_corners=False, antialias=False)[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(got, want.reshape(got.shape), atol=EMBEDDING_TOL, err_msg=method)


def _rewrite(cache, repo: str, name: str, change) -> None:
  """The cached repo's config file `name` rewritten by `change` (a dict -> dict)."""
  snapshot = next((cache / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir())
  path = snapshot / name
  config = json.loads(path.read_text())
  path.unlink()  # write_repo copied it: no symlink into a blob to write through.
  path.write_text(json.dumps(change(config)))


@pytest.mark.parametrize("framework,name,change,words", [
    # DINOv3's arrays under EVA-02's name: timm refuses them (no pos_embed, reg_token unused).
    ("timm DINOv3", "config.json",
     lambda c: c | {"architecture": "eva02_small_patch14_224"},
     ("posemb 'learn' in its config, 'none' in its arrays", "num_registers 0")),
    # CLIP's config says 64 px, its embedding holds a 4x4 grid (32 px): transformers refuses.
    ("transformers CLIP", "config.json", lambda c: c | {"image_size": 64},
     ("image_size 64 in its config (8x8", "4x4 position-embedding grid (32 px)")),
    ("transformers ViT", "config.json", lambda c: c | {"hidden_size": 64},
     ("hidden_size 64 in its config, 32 in its arrays",)),
    # DINOv2's arrays under its registers' name, and another patch size in model_args.
    ("timm DINOv2", "config.json",
     lambda c: c | {"architecture": "vit_small_patch14_reg4_dinov2",
                    "model_args": c["model_args"] | {"patch_size": 16}},
     ("patch_size 16 in its config, 8 in its arrays", "num_registers 4 in its config, 0")),
    ("OpenCLIP", "open_clip_config.json",
     lambda c: c | {"model_cfg": c["model_cfg"] | {"vision_cfg": c["model_cfg"]["vision_cfg"]
                                                   | {"layers": 3}}},
     ("num_layers 3 in its config, 2 in its arrays",)),
], indirect=["framework"])
def test_a_config_that_disagrees_with_its_arrays_is_refused(framework, name, change, words,
                                                            frameworks, tmp_path):
  cache = frameworks[1]
  repo = framework.spec.removeprefix("hf-hub:")
  backup = tmp_path / name
  snapshot = next((cache / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir())
  backup.write_bytes((snapshot / name).read_bytes())
  try:
    _rewrite(cache, repo, name, change)
    with pytest.raises(errors.CheckpointError) as refused:
      loader.describe(framework.spec)
    err = str(refused.value)
    assert "\n" not in err and all(w in err for w in ("not of one model", *words)), err
  finally:
    (snapshot / name).unlink()
    (snapshot / name).write_bytes(backup.read_bytes())
