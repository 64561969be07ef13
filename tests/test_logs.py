"""tools/logs.py's start of TensorFlow without Keras: TensorBoard's hparams API registered as
summary_v2's functions and classes, its Keras callback the real one when asked for, and another
TensorBoard's layout left to its own API. A whole run's record and its Keras-free process:
test_e2e_train's command-line overrides test."""
import sys

import pytest
from tensorboard.plugins import hparams
from tensorboard.plugins.hparams import api as real_api  # noqa: F401  (with Keras, restored)
from tensorboard.plugins.hparams import _keras, summary_v2

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
