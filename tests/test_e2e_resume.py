"""A run is resumed exactly or refused with a reason: damaged checkpoints are set aside and the
run goes on from the newest step that verifies; changed configs are refused field by field,
another model's workdir even with the opt-in; a finished run reports its result; kill -9 and
damage at random moments lose nothing (SIGTERM and stalls: test_e2e_stop.py)."""
import contextlib
import errno
import gc
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import REPO, cli, cpu_env, read_scalars, run_cli, tiny_config
from vit_jax.checkpoint import errors, run
from vit_jax.train import loop


def steps_in(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def array_data_files(step_dir) -> list:
  """Every file of a step's saved state that holds array data (OCDBT's `d/` folders), in a
  fixed order. Orbax reads only the merged `state/d/` files back, not the per-process copies
  beside them, so damaging just one file could miss what a restore reads."""
  return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def damage(step_dir, how: str, rng: random.Random) -> None:
  targets = array_data_files(step_dir)
  assert targets, f"no array data under {step_dir}"
  for target in targets:
    data = bytearray(target.read_bytes())
    if how == "bitflip":
      for _ in range(4):
        i = rng.randrange(len(data) // 4, len(data))
        data[i] ^= 1 << rng.randrange(8)
      target.write_bytes(bytes(data))
    elif how == "truncate":
      target.write_bytes(bytes(data[:len(data) // 2]))
    else:
      target.unlink()


def losses_by_step(workdir) -> dict[int, float]:
  """Every step's train loss; a step logged again after a resume keeps its latest value."""
  return read_scalars(workdir, "train_loss")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
  """An uninterrupted 24-step run: checkpoints every 4 steps, the last 3 kept."""
  workdir = tmp_path_factory.mktemp("reference")
  loop.train_and_evaluate(tiny_config(dataset, total_steps=24), str(workdir))
  return workdir, losses_by_step(workdir)


@contextlib.contextmanager
def nothing_more_on_the_console(capfd, caplog, monkeypatch):
  """Fails the test if, while the block runs and for a second after (the reads a failed restore
  left in flight end, and failed ones are collected), anything is raised as unraisable, a
  traceback reaches fd 2, or asyncio logs a record."""
  unraisable = []  # Python's default hook prints them on stderr; pytest's turns them into warnings.
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  capfd.readouterr()
  yield
  time.sleep(1.0)
  gc.collect()
  assert not unraisable, [repr(u.exc_value) for u in unraisable[:5]]
  err = capfd.readouterr().err
  assert "Traceback" not in err, err[:3000]
  noise = [r.getMessage()[:200] for r in caplog.records if r.name == "asyncio"]
  assert not noise, noise


@pytest.mark.parametrize("how", ["bitflip", "truncate", "delete"])
def test_a_damaged_step_is_set_aside_with_one_warning_and_nothing_more_on_the_console(
    tmp_path, dataset, reference, how, capfd, caplog, monkeypatch):
  """The newest step damaged (flipped bits: the damage only checksums see), the run sets it
  aside, kept for a look, and resumes from the one before; the bit-flipped case on one device,
  what eight wrote. A failed restore leaves orbax's reads of the other arrays in flight on an
  event loop it has closed; each ending read was an 'Event loop is closed' traceback, and each
  failed read's task an asyncio error once collected (~45 KB for this ViT-Ti, enough to fill a
  pipe that is read only at the end, where the run then blocked). The one warning naming the
  step is all. A `vit-train` process's console: the random-kills test below."""
  ref_dir, expected = reference
  workdir = tmp_path / "run"
  shutil.copytree(ref_dir, workdir)
  for f in workdir.glob("events.out.tfevents.*"):  # The resume's own losses, below.
    f.unlink()
  damage(workdir / "checkpoints" / "24", how, random.Random(0))
  devices = {"cpu_devices": 1} if how == "bitflip" else {}
  with nothing_more_on_the_console(capfd, caplog, monkeypatch):
    loop.train_and_evaluate(tiny_config(dataset, total_steps=24, **devices), str(workdir))
  warned = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
  assert len(warned) == 1 and "Checkpoint step 24 in" in warned[0], warned
  assert "set aside as" in warned[0], warned
  assert (workdir / "checkpoints" / "24.corrupt").is_dir()
  assert steps_in(workdir) == [16, 20, 24]  # 24 written again, from 20.
  after = losses_by_step(workdir)
  assert sorted(after) == [21, 22, 23, 24]  # Resumed from 20.
  np.testing.assert_allclose([after[s] for s in after], [expected[s] for s in after], atol=1e-5)


def rewrite_one_param(step_dir) -> None:
  """Damage that reads back without an error: the state written again by orbax, one bias
  changed, the step's metadata (its checksums) kept."""
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(step_dir / "state").item_metadata.tree
  state = checkpointer.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
      restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
  state["params"]["head"]["bias"] = state["params"]["head"]["bias"] + 1.0
  shutil.rmtree(step_dir / "state")
  checkpointer.save(step_dir / "state", state)


@pytest.mark.parametrize("how", ["rewritten", "bitflip", "truncate", "delete"])
def test_reading_a_damaged_steps_params_raises_one_error_and_nothing_more(
    tmp_path, reference, how, capfd, caplog, monkeypatch):
  """What fine-tuning from a run's step, vit-export and vit-inspect read: values that differ
  from the step's checksums are refused, not returned; damage that orbax sees is one error."""
  step_dir = tmp_path / "24"
  shutil.copytree(reference[0] / "checkpoints" / "24", step_dir)
  assert run.read_params(step_dir)[0]  # Undamaged, it reads.
  if how == "rewritten":
    rewrite_one_param(step_dir)
  else:
    damage(step_dir, how, random.Random(0))
  with nothing_more_on_the_console(capfd, caplog, monkeypatch):
    with pytest.raises(errors.CheckpointError) as e:
      run.read_params(step_dir)
  assert str(step_dir) in str(e.value)
  if how == "rewritten":
    assert "1 array(s) differ from the checksums" in str(e.value), e.value
    assert ".params['head']['bias']" in str(e.value)


def test_a_changed_optimizer_or_batch_is_refused_naming_each_field(tmp_path, dataset, reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  changed = tiny_config(dataset, total_steps=28, batch_size=16,
                        **{"optimizer.name": "sgd", "optimizer.lr": 0.1})
  with pytest.raises(errors.CheckpointError) as e:
    loop.train_and_evaluate(changed, str(workdir))
  message = str(e.value)
  for line in ("trajectory.batch_size: checkpoint 32, config 16",
               "trajectory.optimizer.name: checkpoint 'adamw', config 'sgd'",
               "trajectory.optimizer.lr: checkpoint 0.003, config 0.1",
               "trajectory.total_steps: checkpoint 24, config 28"):
    assert line in message
  assert "new --workdir" in message and "--config.allow_resume_changes=True" in message
  changed.allow_resume_changes = True
  changed.optimizer.name = "adamw"  # The same state; another learning rate, batch and length.
  metrics = loop.train_and_evaluate(changed, str(workdir))
  assert metrics["num_examples"] == 64
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["20", "24", "28"]


@pytest.mark.parametrize("field, value", [
    ("optimizer.name", "sgd"), ("ema_decay", 0.9), ("accum_steps", 2),
    ("optimizer.frozen", ("embedding/.*",))])
def test_a_state_laid_out_otherwise_is_refused_even_with_the_opt_in_and_every_step_kept(
    tmp_path, dataset, reference, field, value):
  """No step restores into the state of another optimizer, a moving average turned on,
  gradient accumulation or frozen parameters: the resume is refused, not taken for damage (each
  step had been set aside and the run started again from step 0)."""
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  changed = tiny_config(dataset, total_steps=24, allow_resume_changes=True, **{field: value})
  with pytest.raises(errors.CheckpointError, match="laid out otherwise than the config's"):
    loop.train_and_evaluate(changed, str(workdir))
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["16", "20", "24"]


def test_rerunning_a_finished_run_reports_its_result(tmp_path, dataset, reference):
  shutil.copytree(reference[0], tmp_path / "run")
  again = run_cli(cli(tmp_path / "run", dataset, "--config.total_steps=24"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert "already complete at step 24" in again.stdout
  final = again.stdout.split("Final evaluation: ")[1].splitlines()[0]
  accuracy = read_scalars(reference[0], "eval_accuracy")[24]
  assert f"accuracy={accuracy:.4f}" in final, (final, accuracy)


def set_aside_steps(workdir) -> list[str]:
  """The names of the steps a run set aside (`STEP.corrupt`, `STEP.corruptN`)."""
  folder = workdir / "checkpoints"
  return [p.name for p in folder.glob("*.corrupt*")] if folder.is_dir() else []


def resumed_from(console: str) -> int | None:
  found = re.findall(r"^Resumed from \S+ at step (\d+) of \d+\.$", console, re.M)
  assert len(found) <= 1, console
  return int(found[0]) if found else None


def newest_kept(workdir, at_start: list[int], set_aside_before: set[str]) -> int | None:
  """Of the steps there when a run started, the newest it did not set aside."""
  now_set_aside = {int(name.split(".")[0]) for name in
                   set(set_aside_steps(workdir)) - set_aside_before}
  return max(set(at_start) - now_set_aside, default=None)


def kill_damage_and_rerun(workdir, dataset, flags, rng, children) -> tuple:
  """Runs `vit-train` on `workdir` again and again: each run killed at a random moment after
  it saved a step, the newest step then damaged, three times; the last run to its end.
  (kills, damaged (step, how), steps lost per interruption, a line per run)."""
  saved = lambda: steps_in(workdir) if (workdir / "checkpoints").is_dir() else []  # noqa: E731
  kills, damaged, lost, story = 0, [], [], []  # story: each run, for a failure's message.
  while True:
    at_start, set_aside = saved(), set(set_aside_steps(workdir))
    before = (at_start or [0])[-1]
    err_path = workdir.parent / f"run{len(story) + 1}.err"
    with open(err_path, "w") as err:  # A file: a pipe read only at the end could fill and block.
      proc = children(subprocess.Popen(cli(workdir, dataset, *flags), env=cpu_env(), cwd=REPO,
                                       stdout=subprocess.DEVNULL, stderr=err))
    killed = False
    if len(damaged) < 3:
      # Once this run has saved a step (start-up speed varies), a random moment in the
      # steps and saves that follow.
      t0 = time.time()
      while proc.poll() is None and (saved() or [0])[-1] <= before:
        assert time.time() - t0 < 300, (story, err_path.read_text()[-3000:])
        time.sleep(0.05)
      time.sleep(rng.uniform(0.0, 1.0))
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        kills, killed = kills + 1, True
    proc.wait(timeout=600)
    steps, err = saved(), err_path.read_text()
    story.append(f"run {len(story) + 1}: found {before}, killed {killed}, status "
                 f"{proc.returncode}, left {steps}")
    assert "Traceback" not in err, (story, err[:3000])  # A set-aside step is one warning.
    assert resumed_from(err) == newest_kept(workdir, at_start, set_aside), (story, err[-3000:])
    if proc.returncode == 0:
      break
    # Only a kill ends a run early: a run that fails by itself is a failure of the resume.
    assert killed and len(story) < 40, (story, err[-3000:])
    lost.append(max(0, before - (steps or [0])[-1]))
    if steps:
      how = ("bitflip", "truncate", "delete")[len(damaged)]
      damage(workdir / "checkpoints" / str(steps[-1]), how, rng)
      damaged.append((steps[-1], how))
  return kills, damaged, lost, story


@pytest.mark.slow
def test_random_kills_and_damage_lose_nothing(tmp_path, dataset, children):
  """kill -9 at three seeded random moments (mid-save included), each followed by a damage to
  the newest step: every rerun resumes from the newest step that verifies, and the per-step
  losses end equal to an uninterrupted run's (run beside the first)."""
  flags = "--config.total_steps=100", "--config.checkpoint_every_steps=5", "--config.log_every_steps=1"
  full_log = open(tmp_path / "full.log", "w")  # Not a pipe: nobody reads it until the end.
  full = children(subprocess.Popen(  # Saves its last step alone: saving changes no loss.
      cli(tmp_path / "full", dataset, *flags, "--config.checkpoint_every_steps=100"),
      env=cpu_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=full_log))
  rng = random.Random(1234)
  workdir = tmp_path / "run"
  kills, damaged, lost, story = kill_damage_and_rerun(workdir, dataset, flags, rng, children)
  full_log.close()  # The child writes to its own copy of the file.
  assert full.wait(timeout=600) == 0, (tmp_path / "full.log").read_text()[-3000:]
  expected = losses_by_step(tmp_path / "full")
  corrupt = sorted(p.name for p in (workdir / "checkpoints").iterdir() if ".corrupt" in p.name)
  assert len(corrupt) == 3, corrupt
  after = losses_by_step(workdir)
  assert sorted(after) == sorted(expected) == list(range(1, 101))
  np.testing.assert_array_equal([after[s] for s in range(1, 101)],
                                [expected[s] for s in range(1, 101)])
  print("\n" + "\n".join(story))
  print(f"kills: {kills}, damaged (step, how): {damaged}, set aside: {corrupt}, "
        f"newest checkpoint lost per interruption (steps): {lost}")


# A full device in each library's words, as they were raised in the test below, and the file
# each names; {w} is the workdir.
NO_SPACE = {
    "goodput's record (Python)": (
        lambda w: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{w}/goodput.json"),
        "{w}/goodput.json"),
    "a save (tensorstore)": (
        lambda w: ValueError(
            f'RESOURCE_EXHAUSTED: Error writing "step/0" in OCDBT database at local file "{w}/'
            'checkpoints/12.orbax-checkpoint-tmp/state/": Failed writing: "{w}/checkpoints/12.'
            "orbax-checkpoint-tmp/state/d/ad58\": Failed to write 186883 bytes to file 9: No "
            "space left on device [os_error_code='28'] [tensorstore_spec='{\"driver\":\"zarr"
            "\"}']"),
        "{w}/checkpoints/12.orbax-checkpoint-tmp/state/"),
    "TensorBoard's events (clu over TensorFlow)": (
        lambda w: RuntimeError(
            "Error '{{function_node __wrapped__FlushSummaryWriter_device_/job:localhost/replica:0"
            f"/task:0/device:CPU:0}}}} {w}/events.out.tfevents.1.v2; No space left on device\n"
            f"\tFailed to flush 4 events to {w}/events.out.tfevents.1.v2' occurred "
            "ASYNCHRONOUSLY."),
        "{w}/events.out.tfevents.1.v2"),
}


@pytest.mark.parametrize("kind", NO_SPACE)
def test_a_full_device_is_told_by_the_file_it_stopped(kind, tmp_path):
  """DiskFull names the file each library failed to write (tensorstore's temporary step folder,
  not the `/job:localhost/...` of TensorFlow's op name), the deepest of a chain first (clu's
  error on the events file, raised as the writer closes, over the save's that came first); an
  error of another kind is none."""
  w = str(tmp_path)
  error, path = NO_SPACE[kind][0](w), NO_SPACE[kind][1].format(w=w)
  told = f"no space left on device writing {path}: the run stopped; it saved no checkpoint; " \
         "the same command starts it again once there is room."
  assert str(loop.disk_full(error, w)) == told and loop.disk_full(error, w).errno == errno.ENOSPC
  over = RuntimeError(NO_SPACE["TensorBoard's events (clu over TensorFlow)"][0](w))
  over.__context__ = error
  assert str(loop.disk_full(over, w)) == told
  assert loop.disk_full(ValueError("a config field is wrong"), w) is None


# Makes a file system of $SIZE at $1 in this mount namespace, runs the command (the rest of the
# arguments) there, makes room and runs it again; each run's output and status go to $2.
FULL_DISK = """
mount -t tmpfs -o size=$SIZE tmpfs "$1" || exit 99
d=$1 out=$2; shift 2
"$@" > "$out/first.out" 2> "$out/first.err"; echo $? > "$out/first.status"
ls "$d/run/checkpoints" > "$out/first.steps"
mount -o remount,size=64m "$d"
"$@" > "$out/second.out" 2> "$out/second.err"; echo $? > "$out/second.status"
cp "$d/run/goodput.json" "$out"
"""


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_same_command_resumes(tmp_path, dataset):
  """The last save finds the disk full (a 1.1 MB tmpfs in a mount namespace of its own: steps 4
  and 8 fit, 12 does not): the run ends with status 1 and one line saying what it kept, where
  the console had ~840 lines of orbax's, asyncio's and logging's tracebacks (the last clu's,
  on the TensorBoard file, masking the save's), and the log file it can no longer write is
  one warning. Once there is room the same command resumes from step 8 and finishes."""
  disk, out = tmp_path / "disk", tmp_path / "out"
  disk.mkdir(), out.mkdir()
  # A mount namespace of root's, else one of a user namespace's (a root without CAP_SYS_ADMIN,
  # or another user): the tmpfs goes with the process.
  for unshare in (["unshare", "-m"], ["unshare", "-rm"])[0 if os.geteuid() == 0 else 1:]:
    done = subprocess.run([*unshare, "sh", "-c", FULL_DISK, "sh", str(disk), str(out),
                           *cli(disk / "run", dataset)], env=dict(cpu_env(), SIZE="1100k"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if (out / "first.status").exists():
      break
  else:
    pytest.skip(f"no mount namespace to make a small file system in: {done.stderr[-300:]}")
  assert done.returncode == 0, done.stderr[-3000:]
  err = (out / "first.err").read_text()
  assert (out / "first.status").read_text().strip() == "1", err[-3000:]
  assert "Traceback" not in err and err.count("error: ") == 1, err[-3000:]
  assert err.endswith("the run stopped; its newest checkpoint is step 8, from which the same "
                      "command resumes once there is room.\n"), err[-3000:]
  assert err.splitlines()[-1].startswith("error: no space left on device")
  assert len(err.splitlines()) <= 18, err  # Two opening lines, 12 steps, the eval, a warning.
  assert [n for n in (out / "first.steps").read_text().split() if n.isdigit()] == ["4", "8"]
  second = (out / "second.err").read_text()
  assert (out / "second.status").read_text().strip() == "0", second[-3000:]
  assert "Resumed from" in second and "at step 8 of 12." in second, second
  # The record reads and holds both attempts: the first one's end, if the full disk let it be
  # written, says it failed.
  attempts = json.loads((out / "goodput.json").read_text())["attempts"]
  assert len(attempts) == 2 and attempts[0]["outcome"] in (None, "failed: ValueError")
  assert attempts[1]["outcome"] == "finished", attempts


def test_a_resume_restores_into_shapes_and_a_run_without_a_good_step_starts_again(
    tmp_path, dataset, reference, monkeypatch):
  """A resume restores into the state's shapes and shardings: trainer.init_state, which
  compiles and computes an initial state, is not called. With every step set aside the run
  starts again from its initialisation, step for step the uninterrupted run."""
  from vit_jax.train import trainer
  ref_dir, expected = reference
  resumed, again = tmp_path / "resumed", tmp_path / "again"
  for workdir in (resumed, again):
    shutil.copytree(ref_dir, workdir)
    for f in workdir.glob("events.out.tfevents.*"):
      f.unlink()
  shutil.rmtree(resumed / "checkpoints" / "24")
  for step in (16, 20, 24):  # Each step's record of its arrays' checksums, one value off.
    meta = again / "checkpoints" / str(step) / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["checksums"][".step"] += 1
    meta.write_text(json.dumps(record))
  init_state = trainer.init_state
  with monkeypatch.context() as m:
    m.setattr(trainer, "init_state", lambda *a, **k: pytest.fail("initialised to resume"))
    loop.train_and_evaluate(tiny_config(dataset, total_steps=24), str(resumed))
  assert sorted(losses_by_step(resumed)) == [21, 22, 23, 24]
  calls = []
  monkeypatch.setattr(trainer, "init_state", lambda *a, **k: calls.append(1) or init_state(*a, **k))
  loop.train_and_evaluate(tiny_config(dataset, total_steps=24), str(again))
  assert len(calls) == 1 and sorted(p.name for p in (again / "checkpoints").iterdir()) == [
      "16", "16.corrupt", "20", "20.corrupt", "24", "24.corrupt"]
  assert sorted(losses_by_step(again)) == sorted(expected) == list(range(1, 25))
  for workdir in (resumed, again):
    after = losses_by_step(workdir)
    np.testing.assert_allclose([after[s] for s in after], [expected[s] for s in after], atol=1e-5)


def test_workdir_of_another_model_refuses_to_resume(tmp_path, dataset, reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  other = tiny_config(dataset, total_steps=24, **{"model.hidden_size": 48})
  with pytest.raises(ValueError, match=r"different model.*\n  model.hidden_size: checkpoint 32, "
                     r"config 48\nUse a new --workdir"):
    loop.train_and_evaluate(other, str(workdir))
  # Even with the opt-in for other changes: the state would not fit.
  other.allow_resume_changes = True
  with pytest.raises(ValueError, match="different model"):
    loop.train_and_evaluate(other, str(workdir))
  assert steps_in(workdir) == [16, 20, 24]  # Nothing written over.
