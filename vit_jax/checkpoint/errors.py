"""`CheckpointError`: what every reader of the checkpoint package raises for a checkpoint
that cannot be read, or does not fit the model (an `InputError`: the commands report it as
one line and exit with status 2)."""
from vit_jax.config_errors import InputError


class CheckpointError(InputError):
  """A checkpoint that cannot be read, or does not fit the model."""
