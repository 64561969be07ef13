"""train/sharding.py's mesh refusals, on stand-in devices: a mesh that does not cover the
devices, and a multislice data axis (mesh.dcn_data) that is not the slices (or, without
slices, the processes) the devices span or does not divide the data axis. A multislice mesh
that is accepted is compiled for two TPU slices in test_e2e_compile_only."""
import re
import types

import pytest

from vit_jax.train import sharding


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
