"""train/sharding.py's mesh refusals, on stand-in devices: a mesh that does not cover the
devices, and a multislice data axis (mesh.dcn_data) that is not the slices (or, without
slices, the processes) the devices span or does not divide the data axis. A multislice mesh
that is accepted is compiled for two TPU slices in test_e2e_compile_only. With fsdp, the
compiled train step gathers each sharded parameter once (8 CPU devices)."""
import re
import types

import jax
import pytest

from helpers import TINY_CONFIG
from vit_jax import configs
from vit_jax.train import compile_check, run_setup, sharding, trainer


def devices(count: int, per_granule: int, slices: bool) -> list[types.SimpleNamespace]:
  """`count` devices, `per_granule` to a slice (TPU multislice) or, without slices, to a
  process."""
  return [types.SimpleNamespace(id=i, process_index=0 if slices else i // per_granule,
                                **({"slice_index": i // per_granule} if slices else {}))
          for i in range(count)]


@pytest.mark.parametrize("mesh, found, message", [
    (dict(data=3, fsdp=2), devices(8, 4, True),
     "data=3 x fsdp=2 must equal the 8 devices"),
    (dict(fsdp=4, dcn_data=4), devices(8, 4, True),
     "dcn_data=4 must be the 2 slices the devices span, and divide data=2"),
    (dict(fsdp=8), devices(8, 4, True),  # dcn_data -1: the 2 slices, which data=1 cannot take.
     "dcn_data=2 must be the 2 slices the devices span, and divide data=1"),
    (dict(fsdp=2, dcn_data=3), devices(8, 4, False),
     "dcn_data=3 must be the 2 processes the devices span"),
])
def test_a_mesh_that_does_not_fit_the_devices_is_refused(mesh, found, message):
  with pytest.raises(ValueError, match="^" + re.escape("config.mesh: " + message)):
    sharding.make_mesh(devices=found, **mesh)


def test_both_axes_at_minus_one_give_fsdp_the_devices_of_a_slice():
  """One process here: its 8 devices on fsdp (the TPU slices' case: test_e2e_compile_only)."""
  assert dict(sharding.make_mesh(-1, -1).shape) == {"data": 1, "fsdp": 8}


def test_fsdp_gathers_each_parameter_once_a_step():
  """The step gathers the sharded parameters whole once, for the forward and the backward pass
  both, and nothing else: left to XLA's partitioner (before), it gathered 28 arrays here, some
  of them activations, the parameters' own split over fsdp."""
  c = configs.get_config(TINY_CONFIG)
  c.model.update(hidden_size=256, mlp_dim=1024)  # Big enough to be sharded (fsdp_spec).
  c.mesh.update(data=1, fsdp=8)
  setup = run_setup.setup_on(c, 10, jax.devices())
  rng = jax.random.key(0)
  with setup.mesh_scope():
    state, shardings = trainer.abstract_state(setup.model, setup.tx, setup.mesh, (28, 28, 3),
                                              rng)
    batch = compile_check._abstract_batch(setup, 10, train=True)
    text = run_setup.train_step_fn(setup, shardings, rng).lower(state, batch).compile().as_text()
  gathered = sorted(tuple(int(d) for d in dims.split(",")) for dims in
                    re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text))
  sharded = sorted(x.shape for x in jax.tree.leaves(state.params) if any(x.sharding.spec))
  assert len(sharded) == 2 * 6 + 1  # Each block's q, k, v, out and MLP kernels; the patches'.
  assert gathered == sharded
