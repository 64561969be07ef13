"""Device mesh and sharding rules: batches split over (data, fsdp), parameters
(and optimizer state) split over fsdp along their largest divisible axis.

With fsdp > 1 the train step gathers the parameters whole once a step, in the dtype the model
computes in, and each device reduces the gradients of its part and updates only that part
(weight-update sharding, Xu et al. 2020, arXiv:2004.13336): the float32 parameters and Adam's
moments take 1/fsdp of a device's memory and of its optimizer traffic, for one gather of the
bf16 weights a step. Left to itself, XLA's partitioner gathers them where each layer uses
them, in the backward pass again, and on some slices splits the matmuls over fsdp instead
(ViT-B/16 on v4-32: 204 GB of HBM traffic a chip against 137; benchmarks/README.md)."""
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1, devices: Sequence[Any] | None = None,
              dcn_data: int = -1) -> Mesh:
  """A 2-D mesh over `devices` (default: all of JAX's); -1 takes what the other axis leaves,
  and with both -1 the data axis spans the slices (on CPU and GPU the processes) and fsdp the
  devices of each.

  `dcn_data` of the data axis spans slices joined by the data-center network (multislice),
  fsdp's gathers stay within one; -1: the slices the devices belong to (1 without multislice).
  Where devices have no slices (CPU, GPU), each process stands in for one.
  """
  n = len(devices) if devices is not None else jax.device_count()
  found = devices or jax.devices()
  slices = len({getattr(d, "slice_index", 0) for d in found})
  granules = slices if slices > 1 else len({d.process_index for d in found})
  if data == -1 and fsdp == -1:  # A TPU slice's hosts share its ICI: one granule, not many.
    data = slices if found[0].platform == "tpu" else granules
  if data == -1:
    data = n // fsdp
  if fsdp == -1:
    fsdp = n // data
  if data * fsdp != n:
    raise ValueError(f"config.mesh: data={data} x fsdp={fsdp} must equal the {n} devices; "
                     "use -1 for one axis to take the rest.")
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  dcn_data = slices if dcn_data == -1 else dcn_data
  if dcn_data == 1 and slices == 1:
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=axis_types, devices=devices)
  if dcn_data != granules or data % dcn_data:
    raise ValueError(f"config.mesh: dcn_data={dcn_data} must be the {granules} "
                     f"{'slices' if slices > 1 else 'processes'} the devices span, and divide "
                     f"data={data} (fsdp stays within a slice); -1 takes the slices found.")
  from jax.experimental import mesh_utils
  grid = mesh_utils.create_hybrid_device_mesh((data // dcn_data, fsdp), (dcn_data, 1), found,
                                              process_is_granule=slices == 1)
  return Mesh(grid, ("data", "fsdp"), axis_types=axis_types)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int, min_size: int = 2**14) -> P:
  """Shards the largest axis divisible by the fsdp size; small arrays stay replicated."""
  if fsdp_size == 1 or np.prod(shape, dtype=np.int64) < min_size:
    return P()
  for axis in np.argsort(shape)[::-1]:
    if shape[axis] % fsdp_size == 0:
      spec = [None] * len(shape)
      spec[axis] = "fsdp"
      return P(*spec)
  return P()


def state_shardings(mesh: Mesh, abstract_state: Any) -> Any:
  """A NamedSharding for every leaf of a (params / optimizer) state tree."""
  size = mesh.shape["fsdp"]
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), size)), abstract_state)
