"""train/config.py: a run's config checked field by field (a bad field named, on the command
line in one line), and config.model covering every field of the model."""
import pytest

from helpers import cli, run_cli, tiny_config
from vit_jax.train import config as config_lib


def test_label_smoothing_is_validated():
  c = config_lib.base_config()
  c.total_steps = 1
  c.label_smoothing = 1.0
  with pytest.raises(ValueError, match=r"config.label_smoothing=1.0: must be in \[0, 1\)"):
    config_lib.validate(c)


def test_steps_from_epochs_that_a_batch_leaves_too_few_name_the_batch_size():
  """The batch size is the cause, not the warm-up the run becomes too short for."""
  c = config_lib.base_config()
  c.total_epochs, c.warmup_steps, c.batch_size = 6.0, 400, 16_777_216
  with pytest.raises(ValueError, match=r"^config.batch_size=16777216: total_epochs=6 of this "
                     "batch make 358 steps, fewer than the 400 of warm-up: use a smaller batch"):
    config_lib.resolve_steps(c, 1_000_000_000)
  c.batch_size = 1_000_000
  with pytest.raises(ValueError, match="total_epochs=6 of this batch make no whole step"):
    config_lib.resolve_steps(c, 60_000)
  c.total_epochs, c.total_steps = None, 300  # Given in steps: the warm-up's own line.
  with pytest.raises(ValueError, match=r"config.warmup_steps=400: must be in \[0, total steps"):
    config_lib.resolve_steps(c, 60_000)


@pytest.mark.parametrize("field,value,message", [
    ("model_name", "ViT-Q_16", "config.model_name='ViT-Q_16': unknown model"),
    ("total_epochs", 1.0, "set exactly one of total_steps / total_epochs"),
    ("optimizer.name", "adamx", "config.optimizer.name='adamx': expected one of"),
    ("accum_steps", 5, "config.accum_steps=5: must be >= 1 and divide batch_size=32"),
    ("data.train_crop", "foo", "config.data.train_crop='foo': expected one of"),
    ("data.flipp", True, "config.data.flipp=True: unknown field; did you mean flip?"),
    ("optimizer.weight_decai", 0.0, "config.optimizer.weight_decai=0.0: unknown field; did you mean weight_decay"),
    ("cpu_devices", 0, "config.cpu_devices=0: must be None or >= 1"),
    ("model.stochastic_depth", 1.5, "config.model.stochastic_depth=1.5: must be in"),
    ("model.rope", "xpos", "config.model.rope='xpos': expected one of ('none', 'eva', 'dinov3')"),
    ("model.gelu", "fast", "config.model.gelu='fast': expected one of ('tanh', 'exact', 'quick')"),
])
def test_bad_config_names_the_field(field, value, message):
  c = tiny_config(("mnist", None), **{field: value})
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_lib.validate(c)


def test_config_covers_every_model_field():
  """config.model's fields, config.dtype and config.lora's set every field of the model."""
  from vit_jax import models
  lora_fields = {f"lora_{k}" for k in config_lib.base_config().lora}
  assert set(config_lib.MODEL_FIELDS) == (
      set(models.registry.FIELDS) - {"num_classes", "dtype"} - lora_fields)


def test_unknown_cli_field_is_one_line_naming_close_fields(tmp_path):
  result = run_cli(cli(tmp_path, ("mnist", "/nonexistent"), "--config.batch_sise=3"))
  assert result.returncode == 2
  assert "error: config.batch_sise='3': unknown field; did you mean batch_size?" in result.stderr
  assert "Traceback" not in result.stderr
  bad_value = run_cli(cli(tmp_path, ("mnist", "/nonexistent"), "--config.optimizer.lr=fast"))
  assert bad_value.returncode == 2 and "--config.optimizer.lr=fast" in bad_value.stderr
  assert "Traceback" not in bad_value.stderr


def test_cpu_devices_in_a_process_whose_jax_has_started_takes_its_first_so_many(tmp_path):
  """A notebook's or a test's JAX has its devices already (8 here): config.cpu_devices=2 trains
  on the first 2, as vit-train would start with 2; more than there are is refused."""
  import jax
  from vit_jax.train import run_setup
  c = tiny_config(("fashion_mnist", "/nonexistent"), cpu_devices=2)
  setup = run_setup.RunSetup.build(c, str(tmp_path), 10, 1000, tuple("abcdefghij"))
  assert list(setup.mesh.devices.flat) == jax.devices()[:2]
  assert setup.micro_batch == c.batch_size
  c.cpu_devices = None
  assert run_setup.RunSetup.build(c, str(tmp_path), 10, 1000, ()).mesh.size == 8
  c.cpu_devices = 9
  with pytest.raises(ValueError, match=r"^config.cpu_devices=9: this process's JAX has started "
                     "with 8 CPU devices"):
    run_setup.RunSetup.build(c, str(tmp_path), 10, 1000, ())
