"""vit-fewshot's reports in one --out_dir add up: each sweep's rows merged into those already
there, a checkpoint probed again on a dataset replacing its rows, sweeps side by side (a job a
checkpoint) losing none. A second sweep used to replace the folder's fewshot.csv with its own
rows, and of two at once the last to end kept its rows alone."""
import csv
import fcntl
import os
import subprocess
import sys
import time

from helpers import REPO
from vit_jax.transfer import fewshot_sweep


def rows(ckpt: str, dataset: str = "digits", shots=(1, 5), representation="pre_logits",
         mean: float = 0.5) -> list[dict]:
  return [dict(checkpoint=ckpt, dataset=dataset, shots=k, mean=mean + k / 100, std=0.01,
               l2=0.25, accuracies=f"{mean:.4f}", representation=representation) for k in shots]


def written(out_dir) -> list[tuple]:
  with open(out_dir / "fewshot.csv", newline="") as f:
    return [(r["checkpoint"], r["dataset"], int(r["shots"]), float(r["mean"]),
             r["representation"]) for r in csv.DictReader(f)]


def test_sweeps_into_one_folder_add_up_and_a_probe_again_replaces_its_rows(tmp_path):
  out = tmp_path / "out"
  assert len(fewshot_sweep.write_reports(rows("a.npz"), {}, str(out))) == 2
  fewshot_sweep.write_reports(rows("b.npz", mean=0.7), {"c.npz": "CheckpointError: no"}, str(out))
  assert written(out) == [("a.npz", "digits", 1, 0.51, "pre_logits"),
                          ("a.npz", "digits", 5, 0.55, "pre_logits"),
                          ("b.npz", "digits", 1, 0.71, "pre_logits"),
                          ("b.npz", "digits", 5, 0.75, "pre_logits")]
  # a.npz again on the same dataset, other shots: its old rows go; on another dataset and with
  # another representation its rows join.
  fewshot_sweep.write_reports(rows("a.npz", shots=(10,), mean=0.6)
                              + rows("a.npz", dataset="pets", shots=(1,))
                              + rows("a.npz", shots=(1,), representation="class_token"), {},
                              str(out))
  assert written(out) == [("b.npz", "digits", 1, 0.71, "pre_logits"),
                          ("b.npz", "digits", 5, 0.75, "pre_logits"),
                          ("a.npz", "digits", 10, 0.7, "pre_logits"),
                          ("a.npz", "pets", 1, 0.51, "pre_logits"),
                          ("a.npz", "digits", 1, 0.51, "class_token")]
  table = (out / "fewshot.md").read_text()
  assert "| b.npz | digits | 71.00 ± 1.00 |" in table and "| a.npz | pets | 51.00" in table
  assert "c.npz" not in table  # The failures named are the last sweep's.
  assert sorted(os.listdir(out)) == ["fewshot.csv", "fewshot.md", "fewshot.png"]
  assert (out / "fewshot.png").read_bytes().startswith(b"\x89PNG")


# Writes the reports of `n` checkpoints, one sweep each, into argv[1]; argv[2] names them.
SWEEPS = """
import sys
sys.path.insert(0, "tests")
from test_fewshot_sweep import rows
from vit_jax.transfer import fewshot_sweep
for i in range(int(sys.argv[3])):
  fewshot_sweep.write_reports(rows(f"{sys.argv[2]}{i}.npz"), {}, sys.argv[1])
"""


def test_sweeps_side_by_side_keep_every_row(tmp_path):
  """Two processes, five sweeps each, one folder: every sweep's rows are there at the end
  (the merge holds a lock on the folder)."""
  out = tmp_path / "out"
  out.mkdir()
  procs = [subprocess.Popen([sys.executable, "-c", SWEEPS, str(out), name, "5"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True) for name in "xy"]
  for p in procs:
    assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
  got = {ckpt for ckpt, *_ in written(out)}
  assert got == {f"{n}{i}.npz" for n in "xy" for i in range(5)}, sorted(got)
  assert len(written(out)) == 20


def test_a_sweep_waits_for_the_folder_another_is_merging_into(tmp_path):
  """While another holds the folder (its merge between reading fewshot.csv and replacing it), a
  sweep writes nothing; once it is let go, the sweep's rows join. Side by side the overlap is a
  matter of timing (the test above); here it is held for a second."""
  out = tmp_path / "out"
  fewshot_sweep.write_reports(rows("a.npz"), {}, str(out))
  held = os.open(out, os.O_RDONLY)
  fcntl.flock(held, fcntl.LOCK_EX)
  try:
    proc = subprocess.Popen([sys.executable, "-c", SWEEPS, str(out), "b", "1"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert proc.poll() is None and {c for c, *_ in written(out)} == {"a.npz"}
  finally:
    os.close(held)
  assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
  assert {c for c, *_ in written(out)} == {"a.npz", "b0.npz"}
