"""vit_jax.configs: the one loader of `--config` specs (a shipped config's name or a file's
path, `:ARG`), and main's use of it before absl parses the flags; the AugReg pre-training
configs (configs/augreg_pretrain.py)."""
import itertools

import pytest

from helpers import REPO
from vit_jax import configs, models
from vit_jax.tools import train_flags
from vit_jax.train import config as config_lib, run_setup

SHIPPED = ["augreg_pretrain", "finetune", "pretrain", "quickstart"]
KNOWN = "Configs shipped with vit_jax: augreg_pretrain, finetune, pretrain, quickstart"
ARG_ECHO = ("import ml_collections\n\ndef get_config(arg='default'):\n"
            "  return ml_collections.ConfigDict(dict(arg=arg))\n")


def test_every_shipped_config_loads_by_name_and_validates():
  assert configs.names() == SHIPPED
  for name in SHIPPED:
    assert configs.config_path(name) == REPO / "vit_jax" / "configs" / f"{name}.py"
    config_lib.validate(configs.get_config(name))


@pytest.mark.parametrize("spec,stream", [
    ("pretrain:b16,i21k", "bfloat16"), ("pretrain:h14,i1k", "bfloat16"),
    ("augreg_pretrain:b16,i21k,medium1", "float32"), ("finetune:b16,cifar10", "float32"),
    ("quickstart", "float32")])
def test_only_the_pretraining_configs_keep_the_residual_stream_in_bf16(spec, stream):
  """A pre-training step's bf16 stream (its bytes, benchmarks/README.md); fine-tuning and the
  quick-start keep the float32 stream of the released checkpoints' logits."""
  assert run_setup.build_model(configs.get_config(spec), num_classes=2).residual_dtype == stream


def test_a_name_a_relative_and_an_absolute_path_give_the_same_config(monkeypatch):
  monkeypatch.chdir(REPO)
  by_name = configs.get_config("finetune:ti16,mnist").to_dict()
  assert by_name["model_name"] == "ViT-Ti_16" and by_name["data"]["name"] == "mnist"
  for path in ("vit_jax/configs/finetune.py", REPO / "vit_jax" / "configs" / "finetune.py"):
    assert configs.get_config(f"{path}:ti16,mnist").to_dict() == by_name
  assert configs.load_module("finetune:anything").TOTAL_STEPS["cifar10"] == 10_000


@pytest.mark.parametrize("suffix,arg", [("", "default"), (":", ""), (":a,b", "a,b"),
                                        (":a:b", "a:b")])
def test_the_arg_is_passed_as_ml_collections_passes_it(tmp_path, monkeypatch, suffix, arg):
  (tmp_path / "echo.py").write_text(ARG_ECHO)
  monkeypatch.chdir(tmp_path)
  assert configs.get_config(f"echo.py{suffix}").arg == arg
  assert configs.resolve(f"echo.py{suffix}") == (tmp_path / "echo.py",
                                                 None if suffix == "" else arg)


@pytest.mark.parametrize("spec,message", [
    ("finetun:b16", "vit_jax ships no config named 'finetun'."),
    ("my_configs/x.py:b16", "no file my_configs/x.py (relative to "),
    ("README.md", "README.md is not a readable Python file"),
    ("vit_jax/tools/train.py", "vit_jax/tools/train.py defines no get_config(arg), so it is not a config file."),
])
def test_a_spec_that_names_no_config_says_what_would(spec, message, monkeypatch):
  monkeypatch.chdir(REPO)
  with pytest.raises(ValueError) as error:
    configs.get_config(spec)
  assert message in str(error.value)
  assert str(error.value).endswith(
      f"{KNOWN} (e.g. finetune:b16,cifar10); or give the path of a .py file that defines "
      "get_config(arg), e.g. my_configs/x.py:arg.")


def test_resolving_runs_nothing_of_the_file(tmp_path):
  """The launchers check a config on a machine that may not run it."""
  (tmp_path / "c.py").write_text("raise SystemExit('ran')\n\ndef get_config(arg):\n  pass\n")
  assert configs.resolve(f"{tmp_path}/c.py:x") == (tmp_path / "c.py", "x")


def test_main_hands_absl_the_file_of_a_name(tmp_path):
  path = REPO / "vit_jax" / "configs" / "finetune.py"
  rest = ["--workdir", "w", "--config.batch_size=8"]
  assert train_flags.resolve_config_flag(["m", "--config", "finetune:b16,cifar10", *rest]) == [
      "m", "--config", f"{path}:b16,cifar10", *rest]
  assert train_flags.resolve_config_flag(["m", "--config=quickstart", *rest]) == [
      "m", f"--config={path.with_name('quickstart.py')}", *rest]
  (tmp_path / "echo.py").write_text(ARG_ECHO)
  assert train_flags.resolve_config_flag(["m", "--config", f"{tmp_path}/echo.py:x"]) == [
      "m", "--config", f"{tmp_path}/echo.py:x"]
  assert train_flags.resolve_config_flag(["m", "--workdir", "w"]) == ["m", "--workdir", "w"]


def test_main_fails_in_one_line_on_an_unknown_name(capsys):
  with pytest.raises(SystemExit) as exit_:
    train_flags.resolve_config_flag(["m", "--config", "finetun:b16", "--workdir", "w"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --config finetun:b16: vit_jax ships no config named 'finetun'.")
  assert KNOWN in err and len(err.splitlines()) == 1


AUGREG = "augreg_pretrain"


def test_every_augreg_config_loads_and_validates():
  module = configs.load_module(AUGREG)
  for model, dataset, aug in itertools.product(module.MODELS, module.DATASETS, module.AUGS):
    c = module.get_config(f"{model},{dataset},{aug}")
    config_lib.validate(c)
    assert (c.data.randaug_layers, c.data.randaug_magnitude, c.data.mixup_alpha) == (
        module.AUGS[aug]), (model, dataset, aug)


def test_augreg_config_values():
  c = configs.get_config(f"{AUGREG}:b16,i21k,medium2")
  assert c.model_name == "ViT-B_16"
  assert (c.data.randaug_layers, c.data.randaug_magnitude, c.data.mixup_alpha) == (2, 15, 0.5)
  assert (c.batch_size, c.total_epochs, c.warmup_steps) == (4096, 300, 10_000)
  assert (c.optimizer.lr, c.optimizer.weight_decay, c.optimizer.decay) == (1e-3, 0.1, "cosine")
  assert (c.model.dropout, c.model.stochastic_depth, c.model.head_bias_init) == (0.0, 0.0, -10.0)
  assert c.loss == "sigmoid_xent" and c.label_smoothing == 0.0
  assert configs.get_config(f"{AUGREG}:s16,i1k,light1").model.head_bias_init == -6.9
  assert configs.get_config(f"{AUGREG}:r50_l32,i21k,none").model_name == "R50+ViT-L_32"


@pytest.mark.parametrize("arg,message", [
    ("b16,i1k", "takes <model>,<i1k|i21k>,<aug>"),
    ("b16,jft,none", "Unknown pre-training dataset 'jft'"),
    ("b16,i1k,heavy", "Unknown aug 'heavy'; known: none, light1"),
    ("q16,i1k,none", "Unknown model 'q16'"),
])
def test_augreg_config_bad_args_are_explained(arg, message):
  with pytest.raises(ValueError, match=message):
    configs.get_config(f"{AUGREG}:{arg}")


@pytest.mark.parametrize("name", sorted(models.MODEL_CONFIGS))
def test_every_config_of_every_model_splits_its_images_into_whole_tokens(name):
  """The recipes' resolution for each registry model is a multiple of its patch stride (the
  fine-tuning recipe's 384 refused every run of ViT-H/14, 384 % 14 = 6: it is 378 there)."""
  short = models.registry.short_name(name)
  specs = [f"finetune:{short},cifar10", f"pretrain:{short},i21k", f"pretrain:{short},i1k"]
  checked = 0
  for spec in specs:
    try:
      c = configs.get_config(spec)
    except ValueError:  # A recipe that does not take this model (ConfigError).
      continue
    stride = run_setup.build_model(c, num_classes=2).stride
    assert c.data.image_size % stride == 0, (spec, c.data.image_size, stride)
    checked += 1
  assert checked, specs
