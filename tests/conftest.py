"""Test set-up: 8 simulated CPU devices, set before jax is first imported."""
import importlib.util
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> pathlib.Path:
  """../shared/data (TFDS-format MNIST); a user's clone lacks it, so skip then."""
  if not (SHARED_DATA / "mnist").is_dir():
    pytest.skip(f"{SHARED_DATA} is missing (only the project's own machines have it)")
  return SHARED_DATA


def load_config_module(path: str):
  """A config file (relative to the repository) as a module: its tables and get_config."""
  module_spec = importlib.util.spec_from_file_location("config_module", REPO / path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_config(spec: str):
  """A config file's `get_config(arg)`, as `--config path.py:arg` would load it."""
  path, _, arg = spec.partition(":")
  module = load_config_module(path)
  return module.get_config(arg) if arg else module.get_config()
