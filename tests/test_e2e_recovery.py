"""A pre-emptible run brought back to its end by `launch/tpu_vm.py up --queued --recover`,
against a scripted Cloud (tests/fake_gcloud.py, no network): queued a while, active, preempted
mid-run (SIGTERM: the run saves), asked for again, a maintenance event (SIGKILL: the run goes
back to its last checkpoint), asked for again, finished with the final evaluation of a run
never interrupted; the record of its attempts and `vit-inspect`'s goodput lines."""
import json
import re
import time

import numpy as np
import pytest

from helpers import TINY_CONFIG, launch, read_scalars, run_inspect, scripted_gcloud

HISTORY = [
    {"states": ["WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"],
     "then": {"at_step": 5, "event": "preempt", "signal": "TERM"}},
    {"states": ["WAITING_FOR_RESOURCES", "ACTIVE"],
     "then": {"at_step": 9, "event": "maintenance", "signal": "KILL"}},
    {"states": ["ACTIVE"]},
]


def _exit_status(folder, timeout_s: float = 120.0) -> str:
  """The job's exit status on the fake node, once its process ended."""
  status = folder / "home" / "vit" / "vit_jax" / "logs" / "train.exit"
  deadline = time.time() + timeout_s
  while not status.exists() and time.time() < deadline:
    time.sleep(0.1)
  return status.read_text().strip()


@pytest.fixture(scope="module")
def recovered(tmp_path_factory, dataset, uninterrupted_run):
  """The launcher's run through HISTORY, and an uninterrupted run's final evaluation."""
  root = tmp_path_factory.mktemp("recovery")
  env, folder = scripted_gcloud(root)
  (folder / "history.json").write_text(json.dumps(HISTORY))
  workdir = root / "run"
  result = launch(
      "tpu_vm.py", "up", "--queued", "--spot", "--recover", "--poll-seconds", "0.5",
      "--name", "vit", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-8",
      "--config", TINY_CONFIG, "--workdir", str(workdir), "--no-preflight", "--",
      f"--config.data.name={dataset[0]}", f"--config.data.data_dir={dataset[1]}",
      env=env, timeout=400)
  return result, workdir, folder, uninterrupted_run


@pytest.mark.slow
def test_the_run_is_brought_back_to_an_uninterrupted_runs_result(recovered):
  result, workdir, folder, reference = recovered
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert _exit_status(folder) == "0"
  final = read_scalars(workdir, "eval_accuracy")
  assert max(final) == 12
  assert final[12] == reference["accuracy"]
  np.testing.assert_allclose(read_scalars(workdir, "eval_loss")[12], reference["loss"],
                             atol=1e-5)


@pytest.mark.slow
def test_each_event_is_one_line_with_its_time(recovered):
  result = recovered[0]
  events = [re.sub(r"^\[[\d-]+ [\d:]+\] ", "", line) for line in result.stdout.splitlines()
            if re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", line)]
  text = "\n".join(events)
  assert events[0] == "requested v5litepod-8 as queued resource vit (spot)"
  for state in ("WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"):
    assert f"queued resource vit: {state}, after" in text
  assert "started at step 0" in events
  # The queued resource SUSPENDING or SUSPENDED, or its node PREEMPTED: what the poll saw first.
  preempted = re.search(r"^preempted \((queued resource SUSPEND|node vit).*\) at about step "
                        r"(\d+)$", text, re.M)
  resumed = re.search(r"^resumed at step (\d+)$", text, re.M)  # Saved at SIGTERM: none again.
  assert preempted and resumed and 5 <= int(resumed.group(1)) < 12
  assert re.search(r"^under maintenance \(node vit\) at about step \d+$", text, re.M)
  # KILL: back to the last checkpoint written in full, with the steps trained past it (as far
  # as the record had them) to do again.
  assert re.search(r"^resumed at step \d+(, \d+ steps to do again)?$", text.split(
      "under maintenance")[1], re.M)
  assert events[-1].startswith("finished at step 12; the slice is still yours")
  assert text.count("requested v5litepod-8") == 3


@pytest.mark.slow
def test_the_workdir_records_the_attempts_and_vit_inspect_shows_the_goodput(recovered, capsys):
  workdir = recovered[1]
  record = json.loads((workdir / "goodput.json").read_text())
  attempts = record["attempts"]
  assert [a["outcome"] for a in attempts] == ["stopped", None, "finished"]  # KILL: no word.
  assert attempts[1]["start_step"] == attempts[0]["last_step"] > 0
  assert attempts[2]["start_step"] <= attempts[1]["last_step"]
  assert [c["why"].split(" (")[0] for c in record["capacity"]] == [
      "the first request", "preempted", "under maintenance"]
  assert all(c["active"] >= c["requested"] for c in record["capacity"])
  rc, out, _ = run_inspect(capsys, workdir)
  assert rc == 0
  assert re.search(r"^Goodput: 3 attempts, step 12 of 12, finished; wall time ", out, re.M)
  for part in ("productive training", "repeated steps", "waiting for capacity", "other"):
    assert re.search(rf"^  {part}.*: .+ \(\d+\.\d%\)$", out, re.M), part
