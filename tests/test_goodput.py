"""vit_jax/goodput.py: the record of a run's attempts and waits, and where its wall time went
(the record written by real runs: test_e2e_recovery.py)."""
import json
import logging

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


# Attempt 1 trains steps 1-60 (1 s each) and ends at 100 s; attempt 2 starts an hour later.
GAPS = {  # How attempt 1 ended, the waits recorded: the seconds of the gap left out.
    "finished, started again later (the quick-start's command run twice)": ("finished", [], 3500),
    "stopped by Ctrl-C, resumed by hand": ("stopped", [], 3500),
    "stopped by a preemption's SIGTERM, the launcher's wait": (
        "stopped", [{"requested": 150.0, "active": 3500.0, "why": "preempted"}], 0),
    "killed without a word (kill -9, a lost machine)": (None, [], 0),
    "failed, run again on the same slices": ("failed: RuntimeError", [], 0),
}


@pytest.mark.parametrize("outcome, capacity, unasked", GAPS.values(), ids=GAPS)
def test_time_between_attempts_when_no_run_was_asked_for_is_left_out(outcome, capacity, unasked):
  """A run that ended with its word (finished, or stopped) and that no launcher brought back:
  until it is started again nobody asked for it, and that hour is not its wall time (a rerun
  of a finished quick-start read as 10% productive). After a kill, a failure or a wait for
  capacity the gap is the interruption's, and stays in."""
  first = attempt(0.0, 0, 40.0, 60, 99.0, outcome)
  first["ended"] = 100.0
  second = attempt(3600.0, 60, 3610.0, 100, 3649.0, "finished") | {"ended": 3650.0}
  s = goodput.summarize({"capacity": capacity, "attempts": [first, second]})
  assert s.unasked_s == unasked and s.wall_s == 3650.0 - unasked
  assert s.productive_s == pytest.approx(98.0)
  assert s.other_s == pytest.approx(s.wall_s - 98.0 - s.waiting_s)
  head = goodput.format_summary(s)[0]
  assert s.finished and "step 100 of 100, finished;" in head
  assert head.endswith("wall time 2m 30s (58m 20s between attempts, when no run was asked "
                       "for, left out)" if unasked else f"wall time {goodput.duration(3650.0)}")


def test_a_finished_run_stays_finished_when_a_later_start_is_cut_short():
  """`vit-train` on a finished run evaluates its last step; killed meanwhile (its console piped
  into `head`), that attempt ends without a word: the run is still finished. One that has
  not saved its last step is not."""
  done = attempt(0.0, 0, 10.0, 100, 109.0, "finished")
  again = attempt(500.0, 100, None, 100, 500.0, None)
  assert goodput.summarize({"attempts": [done, again], "capacity": []}).finished
  cut = attempt(0.0, 0, 10.0, 100, 109.0, None) | {"saved_step": 90}
  assert not goodput.summarize({"attempts": [cut], "capacity": []}).finished


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


FIRST_VERSION = {  # As the first version wrote it (b5751e9): a wait, an attempt cut short.
    "attempts": [{"started": 10.5, "start_step": 0, "total_steps": 12, "first_step_at": 20.0,
                  "last_step": 7, "last_step_at": 27.0, "saved_step": 4, "ended": None,
                  "outcome": None}],
    "capacity": [{"requested": 1.0, "active": 9.0, "why": "the first request"}]}
ATTEMPT = FIRST_VERSION["attempts"][0]
NOT_RECORDS = {
    "not JSON": "{not json",
    "a list": "[]",
    "null": "null",
    "a string": '"goodput"',
    "attempts not a list": json.dumps({"attempts": {}, "capacity": []}),
    "an attempt missing keys": json.dumps({"attempts": [{"started": 1.0}], "capacity": []}),
    "an attempt not an object": json.dumps({"attempts": [7]}),
    "a step that is text": json.dumps({"attempts": [{**ATTEMPT, "last_step": "7"}]}),
    "a step that is true": json.dumps({"attempts": [{**ATTEMPT, "start_step": True}]}),
    "a wait without why": json.dumps({"capacity": [{"requested": 1.0, "active": 2.0}]}),
}


def test_the_first_version_of_the_record_is_read_as_it_was(tmp_path, caplog):
  goodput.path(tmp_path).write_text(json.dumps(FIRST_VERSION))
  with caplog.at_level(logging.WARNING):
    assert goodput.read(tmp_path) == FIRST_VERSION
    goodput.record_capacity(tmp_path, 30.0, 40.0, "preempted")
  assert not caplog.records
  assert goodput.read(tmp_path)["attempts"] == FIRST_VERSION["attempts"]
  assert goodput.summarize(goodput.read(tmp_path)).last_step == 7


@pytest.mark.parametrize("text", NOT_RECORDS.values(), ids=NOT_RECORDS)
def test_a_file_that_is_no_record_is_one_warning_and_a_fresh_record(tmp_path, caplog, text):
  """Readers (vit-inspect, the launcher) leave it out with one line; the run's first write moves
  it aside (nothing lost) and begins anew: never a traceback, never a blocked run."""
  goodput.path(tmp_path).write_text(text)
  with caplog.at_level(logging.WARNING):
    assert goodput.read(tmp_path) == {"attempts": [], "capacity": []}
  [warning] = [r.getMessage() for r in caplog.records]
  assert warning.startswith(f"{goodput.path(tmp_path)} is not a record this program wrote (")
  assert warning.endswith("): its attempts are left out") and "\n" not in warning
  caplog.clear()
  with caplog.at_level(logging.WARNING), goodput.AttemptLog(str(tmp_path), 0, 10) as log:
    log.step(1)
  [warning] = [r.getMessage() for r in caplog.records]
  assert warning.endswith(f": moved to {tmp_path}/goodput.json.unreadable; a new record begins")
  assert (tmp_path / "goodput.json.unreadable").read_text() == text
  [attempt] = goodput.read(tmp_path)["attempts"]
  assert (attempt["last_step"], attempt["outcome"]) == (1, "finished")
  assert goodput.summarize(goodput.read(tmp_path)).finished


def test_saved_step_is_what_orbax_has_written_in_full(tmp_path):
  """A save begun at step 4 is not a save made: the record says 4 once the checkpoint is
  committed, and stays at the step before where a kill cuts the save short."""
  committed = [2]
  log = goodput.AttemptLog(str(tmp_path), 2, 10, min_interval_s=0,
                           committed=lambda: committed[-1])
  log.step(3)
  log.step(4, saved=True)  # Written in the background from here on.
  assert goodput.read(tmp_path)["attempts"][0]["saved_step"] == 2
  committed.append(4)
  log.step(5)
  assert goodput.read(tmp_path)["attempts"][0]["saved_step"] == 4
  committed.append(None)  # No step folder at all: the restored one (start_step) stands.
  log.step(6)
  assert goodput.read(tmp_path)["attempts"][0]["saved_step"] == 2
