"""vit_jax/goodput.py: the record of a run's attempts and waits, and where its wall time went
(the record written by real runs: test_e2e_recovery.py)."""
import pytest

from vit_jax import goodput


def attempt(started, start_step, first_at, last_step, last_at, outcome, total=100):
  return {"started": started, "start_step": start_step, "total_steps": total,
          "first_step_at": first_at, "last_step": last_step, "last_step_at": last_at,
          "saved_step": last_step, "ended": last_at if outcome else None, "outcome": outcome}


def test_wall_time_splits_into_productive_repeated_waiting_and_other():
  """Attempt 1 trains steps 1-60 (1 s each) and dies unsaved past step 40; attempt 2 resumes
  at 40, so its first 20 steps are done again, and trains to 100."""
  record = {"capacity": [{"requested": 0.0, "active": 100.0, "why": "the first request"},
                         {"requested": 200.0, "active": 250.0, "why": "preempted"}],
            "attempts": [attempt(110.0, 0, 130.0, 60, 189.0, None),
                         attempt(260.0, 40, 270.0, 100, 329.0, "finished")]}
  s = goodput.summarize(record)
  assert (s.attempts, s.last_step, s.total_steps, s.finished) == (2, 100, 100, True)
  assert s.wall_s == 329.0 and s.waiting_s == 150.0 and s.training_s == 118.0
  assert s.repeated_steps == 20 and s.repeated_s == pytest.approx(20.0)
  assert s.productive_s == pytest.approx(98.0) and s.other_s == pytest.approx(61.0)
  lines = goodput.format_summary(s)
  assert lines[0] == "Goodput: 2 attempts, step 100 of 100, finished; wall time 5m 29s"
  assert lines[1] == "  productive training: 1m 38s (29.8%)"
  assert lines[3] == "  waiting for capacity: 2m 30s (45.6%)"


def test_attempts_are_written_as_the_run_goes_and_end_with_their_outcome(tmp_path):
  with goodput.AttemptLog(str(tmp_path), 0, 10, min_interval_s=3600) as log:
    log.step(1)
    log.step(2)  # Within the interval: not written yet.
    assert goodput.read(tmp_path)["attempts"][0]["last_step"] == 1
    log.step(4, saved=True)
    assert goodput.read(tmp_path)["attempts"][0]["saved_step"] == 4
  with pytest.raises(ValueError), goodput.AttemptLog(str(tmp_path), 4, 10):
    raise ValueError("a bug")
  goodput.record_capacity(tmp_path, 1.0, 2.0, "preempted")
  record = goodput.read(tmp_path)
  assert [a["outcome"] for a in record["attempts"]] == ["finished", "failed: ValueError"]
  assert record["capacity"] == [{"requested": 1.0, "active": 2.0, "why": "preempted"}]
  assert goodput.summarize({"attempts": [], "capacity": []}) is None


def test_a_record_that_could_not_be_read_is_not_written_over(tmp_path, monkeypatch):
  """A bucket's read error while the run writes its progress: that write is skipped, not made
  over an empty record, so the waits and attempts before stay (an unparsable file is
  replaced)."""
  goodput.record_capacity(tmp_path, 1.0, 2.0, "the first request")
  stored = type(goodput.path(tmp_path))
  read_text = stored.read_text

  def failing(self, *args, **kwargs):
    raise OSError("503 Service Unavailable")

  with goodput.AttemptLog(str(tmp_path), 0, 10, min_interval_s=0) as log:
    monkeypatch.setattr(stored, "read_text", failing)
    log.step(1)
    assert not goodput.record_capacity(tmp_path, 3.0, 4.0, "preempted")
    monkeypatch.setattr(stored, "read_text", read_text)
    log.step(2)
  record = goodput.read(tmp_path)
  assert [c["why"] for c in record["capacity"]] == ["the first request"]
  assert [(a["last_step"], a["outcome"]) for a in record["attempts"]] == [(2, "finished")]
  goodput.path(tmp_path).write_text("{not json")
  assert goodput.record_capacity(tmp_path, 5.0, 6.0, "preempted")
  assert goodput.read(tmp_path)["capacity"] == [{"requested": 5.0, "active": 6.0,
                                                 "why": "preempted"}]
