"""What a ViT holds in memory, counted from its shapes: the images a forward pass (feature
extraction, prediction) can take at once on the memory there is, the micro-batch a
fine-tuning step can (vit-transfer's accumulation steps), and the least that a training
step keeps for its backward pass (the compile check refuses a hopeless config with it before
any compile). Counts, not measurements: tests/test_footprint.py holds them against XLA's own
memory analysis of the compiled programs."""
from typing import Any

F32 = 4  # Bytes: the forward pass's activations and scores are float32 at least.
# Of the memory there is, what a forward pass's batch may take: the rest is for the parameters,
# the input pipeline's buffers and the allocator's slack.
SHARE = 0.5


def tokens(model: Any, image_size: int) -> int:
  """The encoder's sequence length at `image_size`: patches and prefix tokens."""
  return (image_size // model.stride) ** 2 + model.num_prefix_tokens


def forward_bytes_per_image(model: Any, image_size: int) -> int:
  """An upper count of one image's share of a forward pass's peak: the float32 image, a
  block's attention scores (heads x tokens x tokens, the softmax's steps), its MLP's hidden
  activations before and after the GELU, and a few copies of the token stream; the ResNet
  stem's widest feature map for a hybrid. At or above XLA's own count on the CPU, within 3x."""
  n, d = tokens(model, image_size), model.hidden_size
  attention = 4 * model.num_heads * n * n  # XLA's softmax keeps up to ~4 (measured).
  mlp = 2 * n * model.mlp_dim
  stream = 8 * n * d
  stem = 0
  if model.resnet_layers is not None:  # The root conv's output: 64 x width at a half side.
    stem = 2 * (image_size // 2) ** 2 * int(64 * model.resnet_width_factor)
  return F32 * (3 * image_size ** 2 + attention + mlp + stream + stem)


def batch_for(model: Any, image_size: int, wanted: int, devices: int = 1,
              free_bytes: int | None = None) -> int:
  """The images a forward pass takes at once: `wanted`, fewer where SHARE of the memory there
  is (`free_bytes`, per device; default: available_bytes()) cannot hold them; a multiple of
  `devices`, at least one per device."""
  free = available_bytes() if free_bytes is None else free_bytes
  fits = int(SHARE * free) // forward_bytes_per_image(model, image_size) * devices
  batch = max(min(wanted, fits), devices)
  return batch // devices * devices


def train_bytes_per_image(model: Any, image_size: int) -> int:
  """An upper count of one example's share of a training step without remat: every block's
  forward activations kept for the backward pass, and as much again while it runs. At or
  above XLA's own count on the CPU, within 3x."""
  return 2 * (model.num_layers + 1) * forward_bytes_per_image(model, image_size)


def accum_steps_for(model: Any, image_size: int, batch: int, devices: int = 1,
                    free_bytes: int | None = None) -> int:
  """The fewest gradient-accumulation steps (a power of two dividing `batch`, each micro-batch
  split over `devices`) whose training step fits SHARE of the memory there is; the most such
  steps where none does."""
  free = available_bytes() if free_bytes is None else free_bytes
  per = train_bytes_per_image(model, image_size)
  steps = [k for k in (2**i for i in range(batch.bit_length()))
           if batch % k == 0 and (batch // k) % devices == 0]
  return next((k for k in steps if batch // k * per <= SHARE * free), steps[-1])


def kept_for_backward_bytes(model: Any, image_size: int, dtype_bytes: int = 2) -> int:
  """A lower count of what a training step keeps per example for its backward pass, with
  rematerialisation at its strongest (each block's input only, in the compute dtype): no
  setting of mesh, remat or accumulation keeps less."""
  return model.num_layers * tokens(model, image_size) * model.hidden_size * dtype_bytes


def available_bytes(device: Any = None) -> int:
  """Memory a computation may still take on `device` (default: JAX's first): an accelerator's
  limit less what is in use, or, on the CPU, the host's available memory (within its cgroup's
  limit, where one is set)."""
  import jax  # Here: the counts above need no JAX.
  device = device or jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  import psutil
  free = psutil.virtual_memory().available
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read())
    if limit != "max":
      free = min(free, int(limit) - used)
  except (OSError, ValueError):  # No cgroup v2 limit here.
    pass
  return max(free, 0)


def gib(n: float) -> str:
  return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
