"""The AugReg zoo by name (checkpoint/augreg.py, and `vit-zoo`, tools/zoo.py): the shipped table
of Hub copies (rebuilt from the installed timm), `augreg:` specs resolved to the Hub first and
to a zoo folder laid out like gs://vit_models/augreg otherwise, index, list, fetch into the
cache, offline errors (a fine-tune / few-shot start from `augreg:Ti_16`:
test_e2e_pretrained.py). No network: HF_HUB_OFFLINE=1 throughout."""
import csv
import json
import os
import re

import pytest

from helpers import AUGREG_TINY as TINY
from helpers import HEADER, IMNET_384, R26, R_TI, ROWS, S16, TI, TI_I1K, TI_LIGHT
from vit_jax import models
from vit_jax.checkpoint import loader, npz as npz_lib
from vit_jax.tools import zoo
from vit_jax.checkpoint import augreg, specs
from vit_jax.models import timm_models  # torch before TensorFlow: see conftest.py

pytestmark = pytest.mark.usefixtures("hub_offline")  # conftest.py's, for every test here.


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("VIT_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("VIT_JAX_AUGREG_DIR", raising=False)
  return str(tmp_path / "cache" / "augreg")


@pytest.fixture
def no_bucket(monkeypatch):
  """Any read of a zoo location (gs:// or not) fails, as the bucket does without network."""
  def offline(url):
    raise OSError("Could not resolve host: www.googleapis.com")
  monkeypatch.setattr(augreg.epath, "Path", offline)


def run_zoo(capsys, *argv):
  rc = zoo.main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


# The index and the names.

def test_index_rows_are_typed(zoo_dir):
  rows = augreg.read_index(zoo_dir)
  assert len(rows) == len(ROWS)
  first = rows[0]
  assert first["final_val"] == 0.3702 and first["adapt_steps"] == 20000
  assert first["params"] == 5717416 and first["epochs"] == 300
  assert rows[1]["infer_samples_per_sec"] is None and first["adapt_filename"] == TI + IMNET_384


@pytest.mark.parametrize("name,key,registry", [
    ("Ti_16", "Ti_16", "ViT-Ti_16"), ("S/16", "S_16", "ViT-S_16"), ("B_8", "B_8", "ViT-B_8"),
    ("B_32", "B_32", "ViT-B_32"), ("L/16", "L_16", "ViT-L_16"), ("S_32", "S_32", "ViT-S_32"),
    ("R+Ti/16", "R_Ti_16", "R+ViT-Ti_16"), ("R26_S_32", "R26_S_32", "R26+ViT-S_32"),
    ("R50+L/32", "R50_L_32", "R50+ViT-L_32"), ("ViT-B_16", "B_16", "ViT-B_16"),
    ("r26_s32", "R26_S_32", "R26+ViT-S_32")])
def test_model_names_map_to_the_registry(name, key, registry):
  assert augreg.model_key(name) == key
  assert augreg.registry_name(name) == registry
  assert registry in models.MODEL_CONFIGS


def test_image_size_from_the_filename():
  assert augreg.image_size(TI) == 224
  assert augreg.image_size(TI + IMNET_384) == 384
  assert augreg.image_size(TI + "--imagenet2012-steps_20k-lr_0.03-res_224") == 224


def test_best_checkpoint_is_the_best_i21k_final_val(zoo_dir):
  rows = augreg.read_index(zoo_dir)
  assert augreg.best_checkpoint(rows, "Ti_16")["filename"] == TI
  with pytest.raises(augreg.ZooError, match="no i21k checkpoint of B_16"):
    augreg.best_checkpoint(rows, "B_16")


# list

def test_list_table_filters_and_sorts(zoo_dir, cache_dir, capsys):
  rc, out, _ = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--model", "Ti_16",
                       "--ds", "i21k", "--sort", "adapt_final_test")
  assert rc == 0
  lines = out.splitlines()
  assert lines[0].split()[:3] == ["name", "ds", "aug"]
  assert len(lines) == 4  # Header + the three i21k Ti_16 rows, best adaptation first.
  assert lines[1].endswith(TI_LIGHT + "--cifar100-steps_10k-lr_0.01-res_224")
  assert lines[3].endswith(TI + "--imagenet2012-steps_20k-lr_0.03-res_224")

  rc, out, _ = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--adapt_ds", "imagenet2012",
                       "--adapt_resolution", "384", "--wd", "0.03", "--sort", "params",
                       "--ascending", "--columns", "name,adapt_filename")
  assert [line.split()[0] for line in out.splitlines()] == ["name", "Ti/16", "R+Ti/16", "S/16"]


def test_list_upstream_csv_and_json(zoo_dir, cache_dir, capsys):
  rc, out, _ = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--upstream", "--format", "csv",
                       "--sort", "final_val")
  rows = list(csv.DictReader(out.splitlines()))
  assert rc == 0 and [r["filename"] for r in rows] == [TI_I1K, S16, R26, TI, TI_LIGHT, R_TI]
  assert "adapt_ds" not in rows[0] and rows[0]["params"] == "5717416"

  rc, out, _ = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--format", "json",
                       "--aug", "light1", "--limit", "2")
  data = json.loads(out)
  assert len(data) == 2 and data[0]["adapt_steps"] == 10000
  assert set(data[0]) == set(HEADER)


def test_list_errors_name_the_fix(zoo_dir, cache_dir, capsys):
  rc, _, err = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--model", "S16x")
  assert rc == 2 and "Unknown AugReg model 'S16x'. Did you mean S_16" in err
  rc, _, err = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--wd", "heavy")
  assert rc == 2 and "wd is a number column" in err
  rc, _, err = run_zoo(capsys, "list", "--zoo_dir", zoo_dir, "--sort", "accuracy")
  assert rc == 2 and "Cannot sort by ['accuracy']" in err


# fetch and resolve

def test_fetch_copies_once_with_progress(zoo_dir, cache_dir, capsys, monkeypatch):
  rc, out, err = run_zoo(capsys, "fetch", "--zoo_dir", zoo_dir, TI + ".npz")
  cached = os.path.join(cache_dir, TI + ".npz")
  assert rc == 0 and out.split("\t") == [cached, "ViT-Ti_16", "224px\n"]
  assert "100%" in err and TI in err  # tqdm's bar, named after the file.
  assert open(cached, "rb").read() == open(os.path.join(zoo_dir, TI + ".npz"), "rb").read()
  assert [f for f in os.listdir(cache_dir)] == [TI + ".npz"]  # No temporary file left.

  copies = []
  monkeypatch.setattr(augreg, "copy_to_cache", lambda *a, **k: copies.append(a))
  rc, out, _ = run_zoo(capsys, "fetch", "--zoo_dir", zoo_dir, TI)
  assert rc == 0 and out.startswith(cached) and copies == []


def test_resolve_model_name_picks_the_recommended_checkpoint(zoo_dir, cache_dir):
  r = augreg.resolve("augreg:Ti_16", zoo_dir=zoo_dir, progress=False)
  assert (r.filename, r.model, r.model_name, r.image_size, r.adapt_ds) == (
      TI, "Ti_16", "ViT-Ti_16", 224, None)
  assert r.path == os.path.join(cache_dir, TI + ".npz") and os.path.isfile(r.path)
  assert r.row["final_val"] == 0.3702 and "adapt_ds" not in r.row

  hybrid = augreg.resolve(f"augreg:{R_TI}", zoo_dir=zoo_dir, progress=False)
  assert (hybrid.model_name, hybrid.image_size) == ("R+ViT-Ti_16", 224)


def test_resolve_adapted_filename_gives_its_resolution(zoo_dir, cache_dir):
  r = augreg.resolve(f"augreg:{TI}{IMNET_384}.npz", zoo_dir=zoo_dir, progress=False)
  assert (r.model_name, r.image_size, r.adapt_ds) == ("ViT-Ti_16", 384, "imagenet2012")
  assert r.row["adapt_resolution"] == 384
  flat = npz_lib.load_npz_flat(r.path)
  assert flat[npz_lib.POSEMB_KEY].shape == (1, 24 * 24 + 1, TINY["hidden_size"])
  assert flat["head/kernel"].shape == (TINY["hidden_size"], 1000)


def test_an_augreg_file_is_described_with_the_index_resolution(zoo_dir, cache_dir, monkeypatch):
  monkeypatch.setenv("VIT_JAX_AUGREG_DIR", zoo_dir)
  described = loader.describe(f"augreg:{TI}{IMNET_384}")
  assert (described.model_name, described.image_size, described.num_classes) == (
      "ViT-Ti_16", 384, 1000)
  assert described.assumed == ("model", "preprocessing")  # The resolution is known.
  assert described.preprocessing.value_range == (-1.0, 1.0)


def test_cached_file_resolves_without_the_zoo(zoo_dir, cache_dir, request):
  augreg.resolve(f"augreg:{TI}", zoo_dir=zoo_dir, progress=False)
  r = augreg.resolve(f"augreg:{TI}", zoo_dir="/nonexistent/augreg", progress=False)
  assert r.path == os.path.join(cache_dir, TI + ".npz") and r.row is None
  request.getfixturevalue("no_bucket")  # From here on, no zoo can be read.
  # A cached file is read as it is, even where the Hub has a copy.
  r = augreg.resolve("augreg:Ti_16", progress=False)
  assert (r.path, r.source, r.hub_id) == (os.path.join(cache_dir, TI + ".npz"), "bucket",
                                          "timm/vit_tiny_patch16_224.augreg_in21k")


def test_misspelled_filename_lists_close_names(zoo_dir, cache_dir):
  typo = TI.replace("wd_0.03", "wd_0.3")
  with pytest.raises(augreg.ZooError, match="is not in the AugReg index. Close names") as e:
    augreg.resolve(f"augreg:{typo}", zoo_dir=zoo_dir, progress=False)
  assert TI in str(e.value)
  with pytest.raises(augreg.ZooError, match="Did you mean R26_S_32"):
    augreg.resolve("augreg:R_26_S_32", zoo_dir=zoo_dir)


def test_unreachable_zoo_names_the_url_and_the_fix(tmp_path, cache_dir, capsys):
  missing = str(tmp_path / "offline")
  os.makedirs(missing)
  rc, _, err = run_zoo(capsys, "fetch", "--zoo_dir", missing, TI)
  dest = os.path.join(cache_dir, TI + ".npz")
  assert rc == 2
  assert f"Cannot read {missing}/{TI}.npz" in err
  assert f"cp {missing}/{TI}.npz {dest}" in err
  assert f"vit-zoo fetch {TI} --cache_dir {cache_dir} --zoo_dir DIR" in err
  assert not os.path.exists(cache_dir) or os.listdir(cache_dir) == []

  rc, _, err = run_zoo(capsys, "list", "--zoo_dir", missing)
  assert rc == 2 and f"No index.csv in {missing}" in err


def test_unreachable_bucket_names_the_url_and_the_fix(cache_dir, no_bucket, monkeypatch):
  """The bucket named as the zoo, offline (as on this machine): epath fails to connect."""
  monkeypatch.setenv("VIT_JAX_AUGREG_DIR", augreg.DEFAULT_ZOO_DIR)
  index = f"{augreg.DEFAULT_ZOO_DIR}/index.csv"
  with pytest.raises(augreg.ZooError) as e:
    augreg.resolve("augreg:S_16")
  assert str(e.value).startswith(f"Cannot read {index} (OSError: Could not resolve host")
  assert f"gsutil cp {index} {cache_dir}/index.csv" in str(e.value)
  assert "https://storage.googleapis.com/vit_models/augreg/index.csv" in str(e.value)
  assert "augreg:FILENAME" in str(e.value) and "refuses anonymous reads" in str(e.value)

  npz = f"{augreg.DEFAULT_ZOO_DIR}/{TI}.npz"
  with pytest.raises(augreg.ZooError) as e:
    augreg.resolve(f"augreg:{TI}")
  assert str(e.value).startswith(f"Cannot read {npz} (OSError")
  assert f"gsutil cp {npz} {cache_dir}/{TI}.npz" in str(e.value)
  assert f"curl -fLo {cache_dir}/{TI}.npz https://storage.googleapis.com/vit_models/augreg/" in (
      str(e.value))
  assert os.listdir(cache_dir) == []  # No partial file.
  assert specs.is_augreg(f"augreg:{TI}") and not specs.is_augreg(f"{TI}.npz")


# The table of Hub copies, and resolving to them first.

AUGREG_TAGS = ("augreg_in21k", "augreg_in21k_ft_in1k", "augreg_in1k")


def test_the_shipped_table_is_what_installed_timm_publishes():
  """augreg_hub.csv equals what build_hub_table makes from this timm (the version it names
  aside); refresh it as CONTRIBUTING.md says when this fails."""
  _, timm = timm_models.import_torch()
  def facts(entries):
    return [e | {"source": re.sub(r"timm [^ ]+ ", "timm ", e["source"])} for e in entries]
  shipped = augreg.hub_table()
  assert facts(augreg.build_hub_table()) == facts(shipped)
  # Every AugReg cfg of timm names its bucket file (none is left out for lack of a url).
  from timm.models import get_pretrained_cfg
  augreg_cfgs = [n for n in timm.list_pretrained() if n.partition(".")[2] in AUGREG_TAGS]
  assert augreg_cfgs and all((get_pretrained_cfg(n).url or "").startswith(augreg.BUCKET_URL)
                             for n in augreg_cfgs)
  assert {e["hub"] for e in shipped if e["hub"]} == {f"timm/{n}" for n in augreg_cfgs}
  # The README's nine recommendations, each pre-trained file and its fine-tuning at 384 px.
  fine_tuned = [e for e in shipped if e["recommended"] == "fine-tuned"]
  accuracy = {e["filename"].split("--")[0]: e["imagenet_top1"] for e in fine_tuned}
  assert [accuracy[upstream] for upstream, _, _ in augreg.RECOMMENDED] == [
      85.59, 85.49, 83.73, 85.99, 83.85, 78.22, 83.59, 79.58, 75.40]
  assert all(e["adapt_resolution"] == 384 and e["adapt_ds"] == "imagenet2012" for e in fine_tuned)
  assert sum(e["recommended"] == "pre-trained" for e in shipped) == 9
  no_copy = [e["filename"] for e in shipped if not e["hub"]]
  assert "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0" in no_copy and R26 in no_copy
  row = augreg.hub_entry(S16 + IMNET_384)
  assert row == {"filename": S16 + IMNET_384, "model": "ViT-S_16", "ds": "i21k",
                 "adapt_ds": "imagenet2012", "adapt_resolution": 384,
                 "hub": "timm/vit_small_patch16_384.augreg_in21k_ft_in1k",
                 "timm_tag": "augreg_in21k_ft_in1k", "recommended": "fine-tuned",
                 "imagenet_top1": 83.73, "source": row["source"]}
  assert re.fullmatch(r"timm [^ ]+ pretrained cfg; google-research/vision_transformer README",
                      row["source"])


def test_a_model_name_resolves_to_the_hub_copy_of_the_recommended_file(cache_dir, no_bucket):
  r = augreg.resolve("augreg:S_16")  # No index, no zoo read: the README's choice.
  assert (r.path, r.source, r.hub_id) == ("hf-hub:timm/vit_small_patch16_224.augreg_in21k", "hub",
                                          "timm/vit_small_patch16_224.augreg_in21k")
  assert (r.filename, r.model_name, r.image_size, r.adapt_ds, r.row) == (
      S16, "ViT-S_16", 224, None, None)
  hybrid = augreg.resolve(f"augreg:{R_TI}")
  assert (hybrid.path, hybrid.model_name) == (
      "hf-hub:timm/vit_tiny_r_s16_p8_224.augreg_in21k", "R+ViT-Ti_16")
  for upstream, _, _ in augreg.RECOMMENDED:
    model = upstream.split("-")[0]
    assert augreg.recommended(model) == upstream
  assert not os.path.exists(cache_dir)  # Nothing was copied.


def test_an_adapted_file_resolves_to_its_hub_copy_at_its_resolution(cache_dir, no_bucket):
  r = augreg.resolve(f"augreg:{S16}{IMNET_384}.npz")
  assert (r.path, r.source, r.model_name, r.image_size, r.adapt_ds) == (
      "hf-hub:timm/vit_small_patch16_384.augreg_in21k_ft_in1k", "hub", "ViT-S_16", 384,
      "imagenet2012")
  r = augreg.resolve(f"augreg:{R_TI}{IMNET_384}")
  assert (r.path, r.image_size) == ("hf-hub:timm/vit_tiny_r_s16_p8_384.augreg_in21k_ft_in1k", 384)


def test_a_named_zoo_is_read_even_for_a_file_with_a_hub_copy(zoo_dir, cache_dir, monkeypatch):
  r = augreg.resolve(f"augreg:{TI}{IMNET_384}", zoo_dir=zoo_dir, progress=False)
  assert (r.source, r.path) == ("bucket", os.path.join(cache_dir, f"{TI}{IMNET_384}.npz"))
  assert r.hub_id == "timm/vit_tiny_patch16_384.augreg_in21k_ft_in1k" and r.row is not None
  monkeypatch.setenv("VIT_JAX_AUGREG_DIR", zoo_dir)
  assert augreg.resolve(f"augreg:{R_TI}", progress=False).source == "bucket"


def test_a_file_without_a_hub_copy_falls_back_to_the_bucket(zoo_dir, cache_dir, monkeypatch):
  """R26_S_32's recommended file is not on the Hub: the bucket (here a local copy) has it."""
  monkeypatch.setattr(augreg, "DEFAULT_ZOO_DIR", zoo_dir)
  r = augreg.resolve("augreg:R26_S_32", progress=False)
  assert (r.filename, r.source, r.hub_id, r.model_name, r.image_size) == (
      R26, "bucket", None, "R26+ViT-S_32", 224)
  assert r.path == os.path.join(cache_dir, R26 + ".npz") and os.path.isfile(r.path)
  assert r.row["final_val"] == 0.4385  # The index, readable here, checked the name.


def test_a_bucket_only_file_offline_names_the_url_and_close_names(cache_dir, no_bucket):
  b32 = "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0"  # Recommended, not on the Hub.
  with pytest.raises(augreg.ZooError) as e:
    augreg.resolve("augreg:B_32")
  assert str(e.value).startswith(f"Cannot read {augreg.DEFAULT_ZOO_DIR}/{b32}.npz (OSError")
  assert "refuses anonymous reads since February 2026" in str(e.value)
  # The same model's files that the Hub has, to use instead.
  assert f"{b32} has no Hugging Face Hub copy; these B_32 files do:" in str(e.value)
  assert ("  hf-hub:timm/vit_base_patch32_224.augreg_in21k   "
          "(B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0)") in str(e.value)
  assert "ft_in1k" not in str(e.value)  # Pre-trained ones only, as the file asked for.
  typo = S16.replace("light1", "light2")
  with pytest.raises(augreg.ZooError, match="not in vit_jax's table of AugReg files") as e:
    augreg.resolve(f"augreg:{typo}")
  assert f"\n  {S16}" in str(e.value)
  with pytest.raises(augreg.ZooError, match="recommends no checkpoint of B_8") as e:
    augreg.resolve("augreg:B_8")  # Choosing one needs the index.
  assert "augreg:B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0\n" in str(e.value)


# list and fetch without a zoo: the shipped table, the Hub.

def test_list_offline_prints_the_shipped_table_and_its_source(cache_dir, zoo_dir, no_bucket,
                                                              capsys):
  rc, out, err = run_zoo(capsys, "list")
  lines = out.splitlines()
  assert rc == 0 and err == ""
  assert lines[0].split() == ["filename", "model", "ds", "final_val", "imagenet_top1", "hub"]
  assert len(lines) == len(augreg.hub_table()) + 2  # Every row, then the source.
  assert re.fullmatch(r"source: timm [^ ]+ pretrained cfgs; google-research/vision_transformer "
                      r"README \(augreg_hub.csv\)", lines[-1])
  by_name = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
  assert by_name[S16] == ["ViT-S_16", "i21k", "-", "-", "timm/vit_small_patch16_224.augreg_in21k"]
  assert by_name[R26] == ["R26+ViT-S_32", "i21k", "-", "-", "-"]  # No Hub copy: listed.
  assert by_name[S16 + IMNET_384][3] == "83.73"

  os.makedirs(cache_dir)  # An index.csv fetched earlier gives final_val.
  with open(os.path.join(zoo_dir, "index.csv")) as f, open(f"{cache_dir}/index.csv", "w") as g:
    g.write(f.read())
  rc, out, err = run_zoo(capsys, "list", "--model", "R26+S/32", "--upstream", "--format", "csv")
  rows = list(csv.DictReader(out.splitlines()))
  assert rc == 0 and [(r["filename"], r["hub"], r["final_val"]) for r in rows] == [
      (R26, "", "0.4385"), (R26.replace("light1-wd_0.1", "medium2-wd_0.03"),
                            "timm/vit_small_r26_s32_224.augreg_in21k", "")]
  assert err.startswith("source: timm") and f"final_val: {cache_dir}/index.csv" in err
  rc, out, _ = run_zoo(capsys, "list", "--adapt_resolution", "384", "--name", "Ti/16",
                       "--format", "json")
  assert [r["filename"] for r in json.loads(out)] == [TI + IMNET_384]


def test_fetch_downloads_a_hub_copy_into_huggingface_hubs_cache(cache_dir, hub_offline,
                                                                 no_bucket, capsys):
  repo = hub_offline / "models--timm--vit_small_patch16_224.augreg_in21k"
  snapshot = repo / "snapshots" / ("0" * 40)
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text("0" * 40)
  (snapshot / "config.json").write_text("{}")
  rc, out, err = run_zoo(capsys, "fetch", "S_16")
  assert rc == 0 and out == f"{snapshot}\tViT-S_16\t224px\n"
  assert "Hugging Face Hub, timm/vit_small_patch16_224.augreg_in21k" in err
  rc, out, err = run_zoo(capsys, "fetch", "Ti_16")  # Not in the cache, and offline.
  assert rc == 2 and out == ""
  assert err.splitlines()[-1].startswith(
      "error: Cannot download timm/vit_tiny_patch16_224.augreg_in21k from the Hugging Face Hub "
      "(LocalEntryNotFoundError")
  assert len([line for line in err.splitlines() if "Cannot download" in line]) == 1
