"""train/compile_check.py: accelerator types in JAX's spelling, and a multi-host slice's steps
compiled for TPU without a TPU (the command line's compiles: test_e2e_compile_only.py)."""
import types

import pytest

from helpers import TINY_CONFIG, needs_libtpu


@pytest.mark.parametrize("name,jax_name", [
    ("v4-32", "v4:2x2x4"), ("v4-8", "v4:2x2x1"), ("v5p-64", "v5p:2x4x4"),
    ("v5p-256", "v5p:4x4x8"), ("v5litepod-16", "v5e:4x4"), ("v5litepod-8", "v5e:2x4"),
    ("v5litepod-256", "v5e:16x16"), ("v6e-16", "v6e:4x4"), ("v6e-64", "v6e:8x8"),
    ("v5e:2x2", "v5e:2x2"), ("tpu7x-8", "tpu7x:2x2x1"), ("tpu7x-16", "tpu7x:2x2x2"),
    ("tpu7x-64", "tpu7x:2x4x4"), ("tpu7x-128", "tpu7x:4x4x4"), ("tpu7x:2x2x1", "tpu7x:2x2x1"),
])
def test_accelerator_types_in_jax_spelling(name, jax_name):
  from vit_jax.train import compile_check
  assert compile_check.jax_topology_name(name)[0] == jax_name


@needs_libtpu
def test_multi_host_compile():
  from vit_jax import configs
  from vit_jax.train import compile_check
  topology = compile_check.resolve_topology("v5e:4x4")
  assert (topology.chips, topology.hosts) == (16, 4)
  a = compile_check.attempt(configs.get_config(TINY_CONFIG), topology, 10, {})
  assert a.fits and a.train.flops > 0 and a.micro_batch == 32
  assert compile_check.resolve_topology("v4-16").chips == 8  # A device per chip (megacore).


@needs_libtpu
def test_tpu7x_counts_hbm_and_peaks_per_device():
  """TPU7x's two TensorCores are two JAX devices: the mesh spans 16 on tpu7x-16 (8 chips, 2
  hosts), each with half the chip's 192 GiB, 2,307 TFLOP/s and 7,380 GB/s
  (cloud.google.com/tpu/docs/tpu7x)."""
  from vit_jax import configs
  from vit_jax.train import compile_check, tpu_specs
  topology = compile_check.resolve_topology("tpu7x-16")
  assert (topology.chips, topology.hosts, topology.unit) == (16, 2, "device")
  assert topology.chip.hbm_bytes == 192 * tpu_specs.GiB
  assert (topology.device.hbm_bytes, topology.device.peak_bf16_flops,
          topology.device.hbm_bytes_per_s) == (96 * tpu_specs.GiB, 2307e12 / 2, 7380e9 / 2)
  a = compile_check.attempt(configs.get_config(TINY_CONFIG), topology, 10, {"batch_size": 32})
  report = compile_check.report(configs.get_config(TINY_CONFIG), topology, a)
  assert report["hbm_capacity_bytes"] == 96 * tpu_specs.GiB and report["per_chip_batch"] == 2
  assert "HBM per device:" in compile_check.format_report(report)


@needs_libtpu
def test_a_shape_libtpu_refuses_is_answered_with_the_sizes_that_exist():
  from vit_jax.train import compile_check
  with pytest.raises(ValueError, match=r"^--topology v5e:3x3: no v5e slice is laid out 3x3; the "
                     r"sizes that exist: v5e:1x1, v5e:1x2, v5e:2x2, v5e:2x4, v5e:4x4, v5e:4x8, "
                     r"v5e:8x8, \.\.\. \(or the accelerator type, v5litepod-N\)$"):
    compile_check.resolve_topology("v5e:3x3")


def test_a_plan_tries_fsdp_remat_and_accumulation_together_last():
  from vit_jax import configs
  from vit_jax.train import compile_check
  c = configs.get_config(TINY_CONFIG)
  c.batch_size = 256
  found = compile_check.candidates(c, 16, plan=True)
  assert len(found) == compile_check.MAX_CANDIDATES
  assert found[-1] == {"mesh.data": -1, "mesh.fsdp": 8, "model.remat": True, "accum_steps": 4}


@pytest.mark.parametrize("remat, first", [(None, {}), (False, {}), (True, {"model.remat": False})])
def test_a_plan_starts_from_the_config_turning_remat_off_only_where_it_is_on(remat, first):
  """A plan's first compile is the config's mesh without remat; where the config has none,
  `Use: --config.model.remat=False` said nothing the config did not."""
  from vit_jax import configs
  from vit_jax.train import compile_check
  c = configs.get_config("pretrain:b16,i21k")
  c.model.remat = remat
  found = compile_check.candidates(c, 16, plan=True)
  assert found[0] == first
  if not remat:
    assert not any(o.get("model.remat") is False for o in found)


@pytest.mark.parametrize("overrides, named", [
    ({}, "the config as given"),  # A plan's first compile.
    ({"model.remat": True}, "--config.model.remat=True"),
    ({"mesh.data": -1, "mesh.fsdp": 1}, "--config.mesh.data=-1 --config.mesh.fsdp=1")])
def test_every_line_that_names_a_compile_names_it(overrides, named):
  """A plan's first compile changes nothing: its flags are none, and the timeout line read
  "the closest, , is 1.00 GiB per chip over"."""
  from vit_jax.train import compile_check, compile_search, tpu_specs
  over = compile_check.Attempt(overrides, 1, (1, 1), "xla", over_bytes=tpu_specs.GiB)
  fits = compile_check.Attempt(overrides, 1, (1, 1), "xla")
  assert f"the closest, {named}, is 1.00 GiB per chip over" in compile_search._timeout_line(
      compile_check.Search(None, [over]), 60)
  slice_ = types.SimpleNamespace(name="v5e:2x2", chips=4, unit="chip")
  assert f"it fits with {named} (the first" in compile_search.no_fit_line(
      compile_check.Search(None, [over, fits]), slice_, "tiny")


@pytest.mark.parametrize("config, chips, whole_at", [
    ("pretrain:h14,i21k", 16, 0),  # The state split over the slice: nothing to split further.
    ("pretrain:b16,i21k", 64, 0),
    ("finetune:b16,cifar10", 16, None)])  # The state whole already.
def test_a_split_state_is_tried_whole_before_remat(config, chips, whole_at):
  """ViT-H/14 on tpu7x-16: the step with its state split over the slice needs remat by the
  check's count (271 ms a step, bound by compute), the same step with the state whole fits
  without (223 ms); the search tried remat only."""
  from vit_jax import configs
  from vit_jax.train import compile_check
  c = configs.get_config(config)
  for plan in (False, True):
    found = compile_check.candidates(c, chips, plan)
    whole = {"mesh.data": -1, "mesh.fsdp": 1}
    if whole_at is None:
      assert all(o.get("mesh.fsdp") != 1 for o in found)
      continue
    assert found.index(whole) == whole_at + plan
    assert found.index(whole) < next(i for i, o in enumerate(found) if o.get("model.remat"))


@needs_libtpu
@pytest.mark.parametrize("name, chips", [("v5e:1x1", 1), ("v5litepod-1", 1), ("v5e:1x2", 2),
                                         ("v6e-1", 1)])
def test_slices_below_a_host_of_four_chips_exist(name, chips):
  """libtpu's default host is 2x2x1: v5litepod-1 and v5litepod-2 were refused, with a message
  that listed v5e:1x1 among the sizes that exist."""
  from vit_jax.train import compile_check
  topology = compile_check.resolve_topology(name)
  assert (topology.chips, topology.hosts) == (chips, 1)


@needs_libtpu
def test_a_hopeless_batch_is_refused_from_its_shapes_before_any_compile(monkeypatch):
  """A 16M-image batch: `--compile_only` took 101 s of compiles to say "use a bigger slice";
  the count of what the backward pass keeps refuses it at once, naming a batch to use."""
  import time
  from vit_jax import configs
  from vit_jax.config_errors import ConfigError
  from vit_jax.train import compile_check
  c = configs.get_config("finetune:b16,cifar10")
  c.batch_size = 16_777_216
  topology = compile_check.resolve_topology("v5e:2x2")
  monkeypatch.setattr(compile_check, "attempt", lambda *a, **k: pytest.fail("compiled"))
  start = time.perf_counter()
  with pytest.raises(ConfigError, match=r"^config\.batch_size=16777216: at least [\d,]+ GiB per "
                     r"device \([\d,]+x its 16 GiB of HBM\).*use a smaller batch \(above "
                     r"[\d,]+ images cannot fit v5e:2x2\), e\.g\. --config\.batch_size=\d+$"):
    compile_check.check_not_hopeless(c, topology, 10)
  assert time.perf_counter() - start < 5
  c.batch_size = 512  # The recipe's: left to the compiles.
  compile_check.check_not_hopeless(c, topology, 10)


@needs_libtpu
@pytest.mark.parametrize("topology, classes, hopeless", [
    ("tpu7x-8", 134_217_728, True),  # 137.6G parameters: 128 GiB a device over 8 devices.
    ("tpu7x-8", 16_777_216, False),  # 17.2G: 16 GiB a device, left to the compiles.
    ("v5e:2x2", 16_777_216, True),  # The same over 4 chips of 16 GiB: 32 GiB a chip.
    ("v5e:2x2", 4_194_304, False)])  # 4.3G: 8 GiB a chip.
def test_parameters_and_gradients_over_every_devices_hbm_are_refused_before_any_compile(
    monkeypatch, topology, classes, hopeless):
  """A head no mesh can hold: the parameters and their gradients, sharded over every device,
  are over a device's HBM. Refused from the shapes in a second (8 compiles, 80 s, before)."""
  import time
  from vit_jax.config_errors import ConfigError
  from vit_jax.train import compile_check
  from tiny_config import get_config
  c = get_config()
  c.model.hidden_size = 1024
  resolved = compile_check.resolve_topology(topology)
  monkeypatch.setattr(compile_check, "attempt", lambda *a, **k: pytest.fail("compiled"))
  start = time.perf_counter()
  if not hopeless:
    compile_check.check_not_hopeless(c, resolved, classes)
    return
  with pytest.raises(ConfigError, match=rf"^config\.model_name='ViT-Ti_16' with its overrides "
                     rf"and {classes:,} classes: [\d.]+G parameters, which with their gradients "
                     rf"take at least [\d,]+ GiB per device even sharded over all \d+ devices of "
                     rf"{topology} \([\d.]+x its \d+ GiB of HBM\): use a smaller model or head, "
                     "or a bigger slice$"):
    compile_check.check_not_hopeless(c, resolved, classes)
  assert time.perf_counter() - start < 5
