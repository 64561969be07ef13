"""GKE's TPU slices by the names GKE and XPK give them (`tpu7x-16`, `v6e-64`, `v5litepod-16`,
`v5p-32`, `v4-32`): the node pool's accelerator label, machine type, topology and chips per VM.

One table: the chips' figures, what a type's number counts (chips, or TensorCores for v4,
v5p and TPU7x) and the slices' shapes come from vit_jax/train/tpu_specs.py, the planner's
table (`vit-train --compile_only --topology`); GKE's own names are added here, from
cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus (and /tpus for TPU7x).
"""
import dataclasses
import re

from launch.common import LaunchError
from vit_jax.train import tpu_specs


@dataclasses.dataclass(frozen=True)
class NodePool:
  """A generation's GKE node pools."""
  label: str  # cloud.google.com/gke-tpu-accelerator.
  machine: str  # Machine type; {} is the chips per VM.
  single_host: tuple[int, ...]  # Chips of the one-VM slices (one machine type each).
  max_chips: int  # The largest slice.
  per_vm: int = 4  # Chips per VM of a multi-host slice.


GKE = {
    "v4": NodePool("tpu-v4-podslice", "ct4p-hightpu-{}t", (4,), 2048),
    "v5litepod": NodePool("tpu-v5-lite-podslice", "ct5lp-hightpu-{}t", (1, 4, 8), 256),
    "v5p": NodePool("tpu-v5p-slice", "ct5p-hightpu-{}t", (4,), 8192),
    "v6e": NodePool("tpu-v6e-slice", "ct6e-standard-{}t", (1, 4, 8), 256),
    "tpu7x": NodePool("tpu7x", "tpu7x-standard-{}t", (4,), 8192),
}


@dataclasses.dataclass(frozen=True)
class Slice:
  """One slice of a --tpu-type: what its node selectors, machine and pods are."""
  tpu_type: str
  chip: tpu_specs.Chip
  label: str
  machine_type: str
  topology: str  # cloud.google.com/gke-tpu-topology, e.g. 4x4 or 2x2x2.
  chips: int
  chips_per_vm: int

  @property
  def vms(self) -> int:
    """The slice's TPU VMs: its pods, one each."""
    return self.chips // self.chips_per_vm


def known_types() -> str:
  return "; ".join(f"{g}-N" for g in GKE)


def resolve(tpu_type: str) -> Slice:
  """The slice a --tpu-type names; LaunchError naming the types known, or the sizes."""
  m = re.fullmatch(r"([a-z0-9]+?)-(\d+)", tpu_type)
  pool = GKE.get(m.group(1)) if m else None
  if pool is None:
    raise LaunchError(f"--tpu-type {tpu_type!r}: not a GKE TPU type; known: {known_types()} "
                      "(e.g. tpu7x-16, v6e-64, v5litepod-16, v5p-32, v4-32).")
  chip = tpu_specs.BY_CLOUD_PREFIX[m.group(1)]
  size = int(m.group(2))
  chips, rest = divmod(size, chip.cores_per_chip)
  counts = _chip_counts(pool)
  sizes = [n * chip.cores_per_chip for n in counts]
  if rest or chips not in counts:
    counted = "TensorCores" if chip.cores_per_chip > 1 else "chips"
    raise LaunchError(f"--tpu-type {tpu_type}: {m.group(1)} slices count {counted}: "
                      f"{', '.join(map(str, sizes[:8]))}, ... up to {sizes[-1]}.")
  per_vm = chips if chips in pool.single_host else pool.per_vm
  return Slice(tpu_type, chip, pool.label, pool.machine.format(per_vm),
               tpu_specs.topology_shape(chip, chips), chips, per_vm)


def _chip_counts(pool: NodePool) -> list[int]:
  """The slices' sizes in chips: the one-VM ones, then twice the largest, and so on."""
  out = list(pool.single_host)
  while out[-1] < pool.max_chips:
    out.append(out[-1] * 2)
  return out
