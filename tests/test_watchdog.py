"""train/watchdog.py: the stall bound follows the step time (a stalled run end to end:
test_e2e_stop.py)."""
from vit_jax.train import watchdog


def test_the_automatic_bound_follows_the_step_time():
  dog = watchdog.StallWatchdog(None, lambda step, reason: "")
  assert dog.bound() == watchdog.FLOOR_S
  dog._step_times.extend([20.0] * 10)  # Slow steps: 50 of them, not the floor.
  assert dog.bound() == 50 * 20.0
  assert watchdog.StallWatchdog(7.0, lambda step, reason: "").bound() == 7.0
