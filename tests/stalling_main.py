"""`vit-train` whose train step never ends from step STALL_AT on, the way a
deadlocked device never ends one: a host callback inside the step blocks for ever.

  python tests/stalling_main.py STALL_AT --config ... --workdir ...
"""
import sys
import threading

import jax

from vit_jax import losses
from vit_jax.tools import train as vit_main


def main() -> None:
  stall_at = int(sys.argv.pop(1))
  executed, never = [0], threading.Event()

  def count_step(_):
    executed[0] += 1
    if executed[0] >= stall_at:
      never.wait()

  mean_loss = losses.mean_loss

  def stalling_mean_loss(*args, **kwargs):
    loss = mean_loss(*args, **kwargs)
    jax.debug.callback(count_step, loss)
    return loss

  losses.mean_loss = stalling_mean_loss
  vit_main.main()


if __name__ == "__main__":
  main()
