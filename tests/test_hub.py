"""Checkpoints from the Hugging Face Hub (`hf-hub:ORG/NAME`, checkpoint/hub.py), offline: a Hub
cache written in huggingface_hub's own layout from timm and transformers models with random
weights, read with HF_HUB_OFFLINE=1. Each layout's logits equal its own framework's (run with
the GELU and the LayerNorm epsilon the weights were trained with), its description equals its
config files, and every way a Hub checkpoint fails ends with exit 2 and one line (fine-tuning
from the Hub: test_e2e_pretrained.py)."""
import http.server
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from helpers import COMMIT, REPO, SIZE, TIMM, cpu_env, perturbed, timm_repo, write_repo
from vit_jax.checkpoint import loader
from vit_jax.checkpoint import layouts
from vit_jax.models import timm_models
from vit_jax.tools import inspect_checkpoint as inspect_cli


def images(size: int) -> np.ndarray:
  return np.random.RandomState(0).randn(2, size, size, 3).astype(np.float32)


@pytest.mark.parametrize("kind", list(TIMM))
def test_timm_layouts_match_timm(kind, tmp_path, hub_cache):
  assert_timm_repo_reads_as_timm(kind, tmp_path, hub_cache)


@pytest.mark.parametrize("fc_norm", [True, False])
def test_timm_patch_mean_beside_a_class_token_matches_timm(fc_norm, tmp_path, hub_cache,
                                                          monkeypatch):
  """timm's global_pool="avg" beside its class token (MAE's pooling; EVA-02's ImageNet heads'
  with fc_norm): classifier="gap" with class_token=True, the final norm before the mean or
  after it."""
  kind = f"avg_beside_cls_fc_norm_{fc_norm}"
  monkeypatch.setitem(TIMM, kind, ("vit_tiny_patch16_224", "augreg2_in21k_ft_in1k",
                                   dict(depth=2, global_pool="avg", fc_norm=fc_norm), "exact"))
  d = assert_timm_repo_reads_as_timm(kind, tmp_path, hub_cache).description
  assert (d.model["classifier"], d.model["class_token"]) == ("gap", True)
  assert d.model.get("fc_norm", False) == fc_norm


def test_map_head_beside_a_class_token_is_refused(capsys, tmp_path, hub_cache, monkeypatch):
  monkeypatch.setitem(TIMM, "map_beside_cls", ("vit_tiny_patch16_224", "augreg_in21k",
                                               dict(depth=2, global_pool="map"), "tanh"))
  _, folder, _ = timm_repo(tmp_path, "map_beside_cls")
  assert_one_line_error(capsys, [str(folder)], "MAP head beside a class token")


def assert_timm_repo_reads_as_timm(kind: str, tmp_path, hub_cache) -> loader.Loaded:
  """helpers.TIMM's `kind` saved by timm into the Hub cache gives timm's logits at its native
  size, and the description its config.json's; the loaded checkpoint."""
  model, folder, config = timm_repo(tmp_path, kind)
  write_repo(hub_cache, f"timm/{kind}", {f: folder / f for f in os.listdir(folder)})
  loaded = loader.load(f"hf-hub:timm/{kind}")
  x = images(loaded.image_size)
  ours = jax.jit(loaded.model.apply)({"params": loaded.params}, x)
  np.testing.assert_allclose(ours, timm_models.logits(model, x), atol=1e-4)
  d, cfg = loaded.description, config["pretrained_cfg"]
  assert d.image_size == cfg["input_size"][-1] and d.num_classes == 5
  assert d.class_names == tuple(config["label_names"])
  assert d.model["gelu"] == TIMM[kind][3] and loaded.model.gelu == TIMM[kind][3]
  pre = d.preprocessing
  assert (pre.mean, pre.std) == (tuple(cfg["mean"]), tuple(cfg["std"]))
  assert (pre.interpolation, pre.crop, pre.central_crop_fraction) == (
      cfg["interpolation"], "central_crop", cfg["crop_pct"])
  # A local folder of the same files reads the same.
  again = loader.load(str(folder))
  np.testing.assert_array_equal(jax.jit(again.model.apply)({"params": again.params}, x), ours)
  return loaded


def transformers_repo(tmp_path, head: bool, act: str):
  """(transformers model, its saved folder with preprocessor_config.json)."""
  torch, _ = timm_models.import_torch()
  import transformers
  # The weights' own epsilon: Google's uploads say 1e-12, their JAX training used flax's 1e-6,
  # which vit_jax keeps (a difference of up to 8e-5 on these small random weights).
  config = transformers.ViTConfig(
      image_size=SIZE, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=128, hidden_act=act, layer_norm_eps=1e-6, num_labels=5,
      id2label={i: f"digit {i}" for i in range(5)}, label2id={f"digit {i}": i for i in range(5)})
  cls = transformers.ViTForImageClassification if head else transformers.ViTModel
  model = perturbed(cls(config), torch, 0.02)
  folder = tmp_path / f"vit_{head}_{act}"
  model.save_pretrained(folder)
  transformers.ViTImageProcessor(size={"height": SIZE, "width": SIZE}, resample=3).save_pretrained(
      folder)
  return model, folder


@pytest.mark.parametrize("repo,head,act,gelu", [
    ("google/vit-tiny-in21k", False, "gelu_pytorch_tanh", "tanh"),  # As ViTModel + pooler.
    ("google/vit-tiny", True, "gelu_pytorch_tanh", "tanh"),  # Google's: JAX-trained.
    ("someone/vit-tiny", True, "gelu", "exact"),  # Trained in PyTorch: its config's GELU.
])
def test_transformers_layout_matches_transformers(repo, head, act, gelu, tmp_path, hub_cache):
  torch, _ = timm_models.import_torch()
  model, folder = transformers_repo(tmp_path, head, act)
  if repo.startswith("google/"):  # Google's configs say the exact GELU of their weights.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
  write_repo(hub_cache, repo, {f: folder / f for f in os.listdir(folder)})
  loaded = loader.load(f"hf-hub:{repo}")
  x = images(SIZE)
  with torch.no_grad():
    out = model(pixel_values=torch.from_numpy(x.transpose(0, 3, 1, 2)))
  want = (out.logits if head else out.pooler_output).numpy()
  np.testing.assert_allclose(jax.jit(loaded.model.apply)({"params": loaded.params}, x), want,
                             atol=1e-4)
  d = loaded.description
  assert d.model["gelu"] == gelu and d.image_size == SIZE
  assert d.num_classes == (5 if head else None) and d.model["representation_size"] == (
      None if head else 64)
  assert d.class_names == (tuple(f"digit {i}" for i in range(5)) if head else ())
  pre = d.preprocessing
  assert (pre.mean, pre.std, pre.crop, pre.interpolation) == (
      (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "resize", "bicubic")


def test_inspect_reads_a_hub_spec_in_a_fresh_process(tmp_path, hub_cache):
  """The console script, with huggingface_hub's own environment variables."""
  _, folder, _ = timm_repo(tmp_path, "token")
  write_repo(hub_cache, "timm/tiny", {f: folder / f for f in os.listdir(folder)})
  env = cpu_env() | {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
  r = subprocess.run([sys.executable, "-m", "vit_jax.tools.inspect_checkpoint",
                      "hf-hub:timm/tiny@main", "--json"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  report = json.loads(r.stdout)
  assert report["description"]["preprocessing"]["interpolation"] == "bicubic"
  assert report["description"]["model"]["gelu"] == "tanh"


def assert_one_line_error(capsys, argv, *words: str) -> str:
  rc = inspect_cli.main(argv)
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
  assert "Traceback" not in err and all(w in err for w in words), err
  return err


def test_missing_repo_offline(capsys, hub_cache):
  assert_one_line_error(capsys, ["hf-hub:timm/not_downloaded"], "HF_HUB_OFFLINE",
                        "hf download timm/not_downloaded")
  assert_one_line_error(capsys, ["hf-hub:not-a-spec"], "hf-hub:ORG/NAME")


def test_truncated_safetensors_and_qk_norm(capsys, tmp_path, hub_cache):
  torch, timm = timm_models.import_torch()
  from timm.models import _hub
  _, folder, _ = timm_repo(tmp_path, "token")
  weights = (folder / "model.safetensors").read_bytes()
  (folder / "model.safetensors").write_bytes(weights[:len(weights) // 2])
  write_repo(hub_cache, "timm/truncated", {f: folder / f for f in os.listdir(folder)})
  assert_one_line_error(capsys, ["hf-hub:timm/truncated"], "damaged", "download it again")
  model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=SIZE,
                            qk_norm=True, reg_tokens=4, no_embed_class=True)
  _hub.save_for_hf(model, tmp_path / "qk", safe_serialization=True)
  write_repo(hub_cache, "timm/qk_norm", {f: tmp_path / "qk" / f for f in os.listdir(
      tmp_path / "qk")})
  assert_one_line_error(capsys, ["hf-hub:timm/qk_norm"], "query/key normalisation", "q_norm")


def test_unknown_arrays_are_refused_by_name(capsys, tmp_path, hub_cache):
  from safetensors.numpy import load_file, save_file
  _, folder, _ = timm_repo(tmp_path, "token")
  arrays = load_file(folder / "model.safetensors")
  save_file(arrays | {"blocks.0.attn.extra.weight": np.ones((2, 2), np.float32)},
            folder / "model.safetensors")
  assert_one_line_error(capsys, [str(folder)], "blocks.0.attn.extra.weight", "Nothing was loaded")


def test_an_eva_model_whose_arrays_read_as_a_vits_is_refused_by_name(capsys, tmp_path):
  """The Perception Encoder's arrays are a ViT's; its rotary embedding shows only in the name."""
  _, folder, config = timm_repo(tmp_path, "token")
  config["architecture"] = "vit_pe_core_base_patch16_224"
  (folder / "config.json").write_text(json.dumps(config))
  assert_one_line_error(capsys, [str(folder)], "vit_pe_core_base_patch16_224", "eva.py")


def test_every_layout_keeps_the_contract():
  """Each row of the table holds what hub.read calls (layouts/__init__.py's contract)."""
  import inspect
  names = [m.NAME for m in layouts.LAYOUTS]
  assert len(set(names)) == len(names) and all(isinstance(n, str) and n for n in names)
  for m in layouts.LAYOUTS:
    assert list(inspect.signature(m.matches).parameters) == ["keys"], m.__name__
    assert list(inspect.signature(m.to_released).parameters) == ["arrays", "config", "source"]
    assert list(inspect.signature(m.declared).parameters) == ["config"], m.__name__
    assert list(inspect.signature(m.describe).parameters) == [
        "flat", "fields", "config", "processor", "origin"], m.__name__


def test_arrays_of_no_layout_are_refused_naming_the_layouts(capsys, tmp_path):
  from safetensors.numpy import save_file
  save_file({"encoder.weight": np.ones((2, 2), np.float32)}, tmp_path / "model.safetensors")
  assert_one_line_error(capsys, [str(tmp_path)], "none of the layouts", "encoder.weight",
                        *(m.NAME for m in layouts.LAYOUTS))


class _Hub(http.server.BaseHTTPRequestHandler):
  """The Hub's answers for a gated repo and a missing one (huggingface_hub reads the
  X-Error-Code header), on loopback."""

  def do_HEAD(self):  # noqa: N802 (http.server's name)
    code = "GatedRepo" if "/gated/" in self.path else "RepoNotFound"
    self.send_response(401 if code == "GatedRepo" else 404)
    self.send_header("X-Error-Code", code)
    self.send_header("X-Error-Message", "Access to this repo is restricted." if code == "GatedRepo"
                     else "Repository not found")
    self.end_headers()

  do_GET = do_HEAD  # noqa: N815

  def log_message(self, *args):
    pass


def test_gated_and_missing_repos_online(capsys, hub_cache, monkeypatch):
  from huggingface_hub import constants
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # What HF_ENDPOINT sets at import.
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hub_cache / "no-token"))
    assert_one_line_error(capsys, ["hf-hub:org/gated"], "gated", "HF_TOKEN",
                          "https://huggingface.co/org/gated")
    assert_one_line_error(capsys, ["hf-hub:org/missing"], "no such repository")
  finally:
    server.shutdown()


def test_an_unreachable_hub_is_waited_for_once(capsys, tmp_path, hub_cache, monkeypatch):
  """Without network and without HF_HUB_OFFLINE (a compute node), huggingface_hub tries each
  file for ~23 s (five retries) before it looks in its cache: a cached repo opens after the
  first file's wait, the rest asked for at the commit that file's snapshot is (which the cache
  answers alone), and an uncached one fails after one (vit-inspect of an uncached repo waited
  70 s, three files' worth). The Hub here is a port nothing listens on; the retries' sleeps
  are counted, not slept."""
  import socket
  import huggingface_hub
  from huggingface_hub import constants
  from huggingface_hub.utils import _http
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # Closed once the block ends.
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", endpoint)
  monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                      endpoint + "/{repo_id}/resolve/{revision}/{filename}")
  waits, asked = [], []
  monkeypatch.setattr(_http.time, "sleep", waits.append)
  download = huggingface_hub.hf_hub_download
  monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, filename, **k: asked.append(
      (filename, k.get("revision"), k.get("local_files_only", False))) or download(
          repo, filename, **k))
  _, folder, _ = timm_repo(tmp_path, "token")
  write_repo(hub_cache, "timm/cached", {f: folder / f for f in os.listdir(folder)})
  assert loader.load("hf-hub:timm/cached").model.num_classes == 5
  assert sum(waits) == 23, (waits, asked)  # One file's retries: 1 + 2 + 4 + 8 + 8 s.
  assert asked[0] == ("config.json", None, False) and len(asked) > 1, asked
  assert all(revision == COMMIT for _, revision, _ in asked[1:]), asked
  waits.clear(), asked.clear()
  assert inspect_cli.main(["hf-hub:timm/uncached"]) == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]  # After huggingface_hub's warnings.
  assert last.startswith("error: hf-hub:timm/uncached: config.json is not in the Hugging Face "
                         "cache") and "could not be reached" in last, last
  assert sum(waits) == 23 and asked[0][2] is False and all(a[2] for a in asked[1:]), asked
