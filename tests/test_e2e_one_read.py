"""One read (issue 63): a command opens and decodes a checkpoint's arrays once, for every kind
of checkpoint path: a bare .npz, a Hub repo (`hf-hub:`, written by timm's own writer into an
offline cache), `augreg:`, a training run's workdir, `ema:` of it, and LoRA adapters on their
base. The reads are counted at the readers' doors (tests/read_counter.py) while
`vit-train --config.pretrained=` starts (one step), `vit-fewshot`, `vit-export` and
`vit-inspect` run, in this process; `vit-train` once more as a command of its own, through
the checks it makes before the workdir. Before: `vit-train` read an .npz or a Hub repo three
times (four with a LoRA run), for its checks, its set-up's description and its first step."""
import json
import logging
import os
import subprocess
import sys
import types

import pytest

from helpers import AUGREG_TINY, REPO, cli, cpu_env, run_inspect, tiny_config, write_repo
from read_counter import counting
from vit_jax.checkpoint import augreg, loader, run
from vit_jax.tools import export, fewshot
from vit_jax.train import loop


def _timm_tiny(folder) -> None:
  """A tiny timm ViT (random weights) as timm writes it for the Hub."""
  from vit_jax.models import timm_models
  _, timm = timm_models.import_torch()
  from timm.models import _hub
  args = dict(img_size=32, num_classes=5, embed_dim=32, depth=2, num_heads=2,
              act_layer="gelu_tanh")
  model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
  _hub.save_for_hf(model, folder, model_args=args, safe_serialization=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_npz, dataset):
  """What the kinds are made of: the tiny .npz, a Hub repo's files, a run trained from the
  .npz with a moving average, a LoRA run from it and its adapters file (in `.tmp`); and the
  reads of the .npz that these two runs made (`.reads`)."""
  tmp = tmp_path_factory.mktemp("one_read")
  _timm_tiny(tmp / "repo")
  reads = {}
  for name, extra in (("run", {"ema_decay": 0.9}), ("lora", {"lora.rank": 2})):
    with counting(tiny_npz) as reads[name]:
      loop.train_and_evaluate(_config(dataset, tiny_npz, 28, **extra), str(tmp / name))
  loader.export_adapters(str(tmp / "lora"), str(tmp / "adapters.npz"))
  return types.SimpleNamespace(tmp=tmp, reads=reads)


# The settings of a one-step fine-tuning run, as dotted config keys; on one of the session's
# 8 devices (its reads are the question, not its sharding).
ONE_STEP = {"total_steps": 1, "warmup_steps": 0, "data.train_split": "train[:64]",
            "data.eval_split": "test[:32]", "cpu_devices": 1}
# The model fields that differ from tiny_config's (the .npz's, and so the runs') by kind.
FIELDS = {"hf-hub": {"patch_size": 16, "mlp_dim": 128},
          "augreg": dict(AUGREG_TINY, patch_size=16)}


def _config(dataset, pretrained: str, size: int, **overrides):
  """A one-step fine-tuning run of `pretrained` at `size` px."""
  c = tiny_config(dataset, pretrained=pretrained, **ONE_STEP, **{"data.image_size": size},
                  **overrides)
  c.evals = {}  # Its reads are the question, not its accuracy.
  return c


def _step(folder) -> str:
  return str(run.latest_step_dir(folder))


# kind: (the path, the files whose reads are counted, the model's input size). `made`'s tmp
# folder, the Hub cache and the AugReg cache are filled in by `_kind`.
KINDS = {
    "npz": lambda m, npz: (npz, [npz], 28),
    "hf-hub": lambda m, npz: ("hf-hub:timm/tiny", [m["weights"]], 32),
    "augreg": lambda m, npz: ("augreg:Ti_16", [m["augreg"]], 32),
    "run": lambda m, npz: (str(m["tmp"] / "run"), [_step(m["tmp"] / "run")], 28),
    "ema": lambda m, npz: ("ema:" + str(m["tmp"] / "run"), [_step(m["tmp"] / "run")], 28),
    "lora_adapters": lambda m, npz: (str(m["tmp"] / "adapters.npz"),
                                     [str(m["tmp"] / "adapters.npz"), npz], 28),
}


def _kind(kind, made, tiny_npz, hub_cache, zoo_dir, monkeypatch, tmp_path):
  write_repo(hub_cache, "timm/tiny", {f: made.tmp / "repo" / f
                                      for f in os.listdir(made.tmp / "repo")})
  monkeypatch.setenv("VIT_JAX_AUGREG_DIR", zoo_dir)
  monkeypatch.setenv("VIT_JAX_CACHE", str(tmp_path / "cache"))
  fetched = augreg.resolve("augreg:Ti_16").path  # Copied into the cache once, before counting.
  where = {"tmp": made.tmp, "augreg": fetched,
           "weights": next(hub_cache.glob("models--timm--tiny/snapshots/*/model.safetensors"))}
  return KINDS[kind](where, tiny_npz)


def _once(counts, what: str) -> None:
  assert counts and all(n == 1 for n in counts.values()), f"{what}: {dict(counts)}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_command_reads_a_checkpoint_once(kind, made, tiny_npz, hub_cache, zoo_dir,
                                               dataset, digits_folder, monkeypatch, tmp_path,
                                               capsys):
  path, files, size = _kind(kind, made, tiny_npz, hub_cache, zoo_dir, monkeypatch, tmp_path)
  c = _config(dataset, path, size, **{f"model.{k}": v for k, v in FIELDS.get(kind, {}).items()})
  with counting(*files) as counts:
    loop.train_and_evaluate(c, str(tmp_path / "ft"))
  _once(counts, "vit-train")
  with counting(*files) as counts:
    assert fewshot.main([path, f"--datasets={digits_folder}", f"--image_size={size}",
                         "--train_split=train[:200]", "--test_split=test[:50]", "--shots=1",
                         "--seeds=1", f"--out_dir={tmp_path / 'fs'}"]) == 0
  _once(counts, "vit-fewshot")
  with counting(*files) as counts:
    assert export.main([path, str(tmp_path / "out.npz")]) == 0
  _once(counts, "vit-export")
  with counting(*files) as counts:
    assert run_inspect(capsys, path)[0] == 0
  _once(counts, "vit-inspect")


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_loaded_in_python_logs_no_warning(kind, made, tiny_npz, hub_cache, zoo_dir,
                                                       monkeypatch, tmp_path, caplog):
  """`loader.load` in a notebook or a script, where no command sends the libraries' logs to a
  file: a checkpoint that reads well is read without a word. orbax warned on every read of a
  run's step ("Metadata file does not exist: .../state/_CHECKPOINT_METADATA", a file a manager
  writes only beside the items)."""
  path, _, _ = _kind(kind, made, tiny_npz, hub_cache, zoo_dir, monkeypatch, tmp_path)
  with caplog.at_level(logging.WARNING):
    loader.load(path)
  assert not [f"{r.name}: {r.getMessage()}" for r in caplog.records
              if r.levelno >= logging.WARNING]


def test_a_lora_run_reads_its_base_once(made):
  """Its set-up's description, its base's sha256 (what its adapters need) and its first step
  from one read; a run with a moving average the same."""
  _once(made.reads["lora"], "vit-train, config.lora.rank=2")
  _once(made.reads["run"], "vit-train, config.ema_decay=0.9")


def test_a_lora_runs_adapters_export_reads_the_run_once(made, tmp_path):
  """`vit-export --format adapters`: the run's state, once; its base not at all (the run
  recorded its content)."""
  with counting(_step(made.tmp / "lora")) as counts:
    assert export.main([str(made.tmp / "lora"), str(tmp_path / "a.npz"), "--format=adapters"]) == 0
  _once(counts, "vit-export --format adapters")


def test_vit_train_reads_a_hub_checkpoint_once(made, hub_cache, dataset, tmp_path):
  """The command: its checks before the workdir hand what they read to the run."""
  write_repo(hub_cache, "timm/tiny", {f: made.tmp / "repo" / f
                                      for f in os.listdir(made.tmp / "repo")})
  weights = next(hub_cache.glob("models--timm--tiny/snapshots/*/model.safetensors"))
  out = tmp_path / "reads.json"
  command = cli(tmp_path / "ft", dataset, "--config.pretrained=hf-hub:timm/tiny",
                "--config.data.image_size=32", *[f"--config.{k}={v}" for k, v in ONE_STEP.items()],
                *[f"--config.model.{k}={v}" for k, v in FIELDS["hf-hub"].items()])
  assert command[1:3] == ["-m", "vit_jax.tools.train"]
  args = [sys.executable, str(REPO / "tests" / "read_counter.py"), str(out), str(weights),
          *command[2:]]
  env = dict(cpu_env(), HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
  done = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  _once(json.loads(out.read_text()), "vit-train (its own process)")
