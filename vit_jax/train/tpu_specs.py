"""Cloud TPU chips: peak bfloat16 FLOP/s, HBM capacity and bandwidth per chip, for the
compile check's memory limit and its roofline bound; and how their accelerator types name
slices."""
import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str  # JAX's topology prefix: "v5e" in "v5e:4x4".
  cloud_prefix: str  # The accelerator types': "v5litepod" in "v5litepod-16".
  cores_per_chip: int  # What the type's number counts per chip (v4, v5p: TensorCores).
  dims: int  # The topology's dimensions: 3 (torus) or 2.
  peak_bf16_flops: float  # Per chip, FLOP/s.
  hbm_bytes: int  # Per chip.
  hbm_bytes_per_s: float  # Per chip.
  source: str
  devices_per_chip: int = 1  # JAX devices: TPU7x runs its two TensorCores as two.


CHIPS = {c.name: c for c in (
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, 1,200 GB/s.
    Chip("v4", "v4", 2, 3, 275e12, 32 * GiB, 1200e9, "https://cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2, 819 GB/s.
    Chip("v5e", "v5litepod", 1, 2, 197e12, 16 * GiB, 819e9,
         "https://cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM2e, 2,765 GB/s.
    Chip("v5p", "v5p", 2, 3, 459e12, 95 * GiB, 2765e9, "https://cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, 1,640 GB/s.
    Chip("v6e", "v6e", 1, 2, 918e12, 32 * GiB, 1640e9, "https://cloud.google.com/tpu/docs/v6e"),
    # cloud.google.com/tpu/docs/tpu7x: 2,307 TFLOP/s bf16, 192 GiB HBM, 7,380 GB/s; two
    # TensorCores a chip, each a JAX device. Used through GKE only (launch/gke.py).
    Chip("tpu7x", "tpu7x", 2, 3, 2307e12, 192 * GiB, 7380e9,
         "https://cloud.google.com/tpu/docs/tpu7x", devices_per_chip=2),
)}
BY_CLOUD_PREFIX = {c.cloud_prefix: c for c in CHIPS.values()}


def per_device(chip: Chip) -> Chip:
  """The chip's figures for one of its JAX devices (TPU7x: a TensorCore, half the chip's
  FLOP/s, HBM and bandwidth), what a compiled program's per-device statistics compare with."""
  n = chip.devices_per_chip
  return dataclasses.replace(chip, peak_bf16_flops=chip.peak_bf16_flops / n,
                             hbm_bytes=chip.hbm_bytes // n,
                             hbm_bytes_per_s=chip.hbm_bytes_per_s / n)


def topology_shape(chip: Chip, chips: int) -> str:
  """The chips' arrangement in a slice of `chips` (a power of two), as Cloud TPU lays them
  out: 3-D from 2x2x1 (v4-8) doubling the smallest side (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...), or
  2-D from 1x1 (1x2, 2x2, 2x4, 4x4, 4x8, ...)."""
  if chips < 1 or chips & (chips - 1) or (chip.dims == 3 and chips < 4):
    raise ValueError(f"{chips} chips: no standard {chip.name} slice shape; give the topology "
                     f"in JAX's spelling ({chip.name}:AxB{'xC' if chip.dims == 3 else ''}).")
  shape = [2, 2, 1] if chip.dims == 3 else [1, 1]
  while _product(shape) < chips:
    i = len(shape) - 1 - shape[::-1].index(min(shape))  # The last of the smallest sides.
    shape[i] *= 2
  return "x".join(map(str, shape))


def _product(xs: list[int]) -> int:
  out = 1
  for x in xs:
    out *= x
  return out
