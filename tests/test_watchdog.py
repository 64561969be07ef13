"""train/watchdog.py: the stall bound follows the step time (a stalled run end to end:
test_e2e_stop.py)."""
import time

from vit_jax.train import watchdog


def test_the_automatic_bound_follows_the_step_time():
  dog = watchdog.StallWatchdog(None, lambda step, reason: "")
  assert dog.bound() == watchdog.FLOOR_S
  dog._step_times.extend([20.0] * 10)  # Slow steps: 50 of them, not the floor.
  assert dog.bound() == 50 * 20.0
  assert watchdog.StallWatchdog(7.0, lambda step, reason: "").bound() == 7.0


def test_leaving_the_block_ends_the_thread_at_once():
  """Every run leaves the block as it ends: its thread, waiting on its pipe for signals, is
  woken, not left to its next second (up to 1 s more for each run)."""
  for _ in range(5):
    with watchdog.StallWatchdog(None, lambda step, reason: "") as dog:
      dog.beat(1)
      started = time.monotonic()
    assert time.monotonic() - started < 0.2
    assert not dog._thread.is_alive()
