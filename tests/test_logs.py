"""tools/logs.py's start of TensorFlow without Keras: TensorBoard's hparams API registered as
summary_v2's functions and classes, its Keras callback the real one when asked for, and another
TensorBoard's layout left to its own API. A whole run's record and its Keras-free process:
test_e2e_train's command-line overrides test. The log file on a full disk."""
import os
import subprocess
import sys

import pytest
from tensorboard.plugins import hparams
from tensorboard.plugins.hparams import api as real_api  # noqa: F401  (with Keras, restored)
from tensorboard.plugins.hparams import _keras, summary_v2

from helpers import REPO
from vit_jax.tools import logs


@pytest.fixture
def unregistered(monkeypatch):
  """The hparams API as no command has imported it yet; the real one back after the test."""
  monkeypatch.delitem(sys.modules, logs._HPARAMS_API)
  monkeypatch.setattr(hparams, "api", real_api)


def test_the_hparams_api_is_summary_v2s_with_the_real_keras_callback(unregistered):
  logs._hparams_api_without_keras()
  api = sys.modules[logs._HPARAMS_API]
  assert api is not real_api and hparams.api is api
  for name in ("hparams", "hparams_pb", "hparams_config", "HParam", "Metric", "Discrete"):
    assert getattr(api, name) is getattr(real_api, name) is getattr(summary_v2, name)
  assert api.KerasCallback is real_api.KerasCallback is _keras.Callback
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    api.nothing  # noqa: B018


def test_another_tensorboards_layout_is_left_to_its_own_api(unregistered, monkeypatch):
  monkeypatch.delattr(summary_v2, "hparams_config_pb")
  logs._hparams_api_without_keras()
  assert logs._HPARAMS_API not in sys.modules  # Its import then loads its own module.


# Three records to a log file on a full device (/dev/full), then a warning, in a process of its
# own (route_logs takes over the root logger), then one the file cannot format.
FULL_LOG = """
import logging, sys
from vit_jax.tools import logs
logs.route_logs(sys.argv[1])
for i in range(3):
  logging.info("record %d", i)
logging.warning("still on the console")
logging.info("a bug: %s %s", 1)
"""


def test_a_log_file_that_cannot_be_written_is_one_warning(tmp_path):
  """A full disk under the workdir: one warning naming the file, the first time, where each
  record was logging's traceback and the record ('--- Logging error ---'); the console's own
  warnings still shown; a record that cannot be formatted still reported as logging does."""
  os.symlink("/dev/full", tmp_path / "train.log")
  done = subprocess.run([sys.executable, "-c", FULL_LOG, str(tmp_path / "train.log")], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  lines = done.stderr.splitlines()
  assert lines[:2] == [f"warning: cannot write {tmp_path / 'train.log'} ([Errno 28] No space "
                       "left on device): the library's logs are not kept from here",
                       "warning: still on the console"], done.stderr
  assert lines[2] == "--- Logging error ---" and done.stderr.count("Logging error") == 1
