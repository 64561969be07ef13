"""launch/: the commands printed for Cloud TPU VMs and GPU clusters, refusals before anything
is created, and processes and jobs run to their first failure (a real two-process training job
on localhost: test_e2e_distributed.py)."""
import json
import re
import shlex
import signal
import subprocess
import sys

import pytest

from helpers import REPO, TINY_CONFIG, cpu_env, launch, scripted_gcloud
from launch import tpu_vm


def dry_run(script: str, *args: str) -> list[list[str]]:
  """The printed commands, each split as a shell would."""
  command, *rest = args
  result = launch(script, command, "--dry-run", *rest)
  assert result.returncode == 0, result.stderr
  return [shlex.split(line) for line in result.stdout.splitlines()]


def flag(cmd: list[str], name: str) -> str:
  """The value of `--name VALUE` or `--name=VALUE` in cmd."""
  for i, arg in enumerate(cmd):
    if arg == name:
      return cmd[i + 1]
    if arg.startswith(name + "="):
      return arg.split("=", 1)[1]
  raise AssertionError(f"{name} not in {cmd}")


def tpu_up(accelerator_type: str, zone: str, workdir: str, *extra: str,
           config: str = "finetune:b16,cifar10") -> list[list[str]]:
  """The dry run's commands, without the preflight compile (test_e2e_compile_only.py's)."""
  return dry_run("tpu_vm.py", "up", "--name", "vit", "--zone", zone, "--accelerator-type",
                 accelerator_type, "--config", config, "--workdir", workdir, "--no-preflight",
                 *extra)


def remote_train(run: list[str]) -> list[str]:
  """The `vit-train` command line that `run` starts on the workers."""
  remote = shlex.split(flag(run, "--command"))
  assert remote[:2] == ["cd", "vit_jax"]
  train, keep = remote[remote.index("-c") + 1].rsplit("; ", 1)  # The run, its status kept.
  assert keep == "echo $? > logs/train.exit"
  assert remote[-5:] == ["&", "echo", "$!", ">", "logs/train.pid"]  # Whose end EXIT tells.
  return shlex.split(train)


def test_single_host_tpu():
  """A shipped config is installed with the package: named, not copied."""
  create, mkdir, copy, install, run = tpu_up("v4-8", "us-central2-b", "runs/b16")
  assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "vit",
                    "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base",
                    "--zone=us-central2-b"]
  assert all("--worker=all" not in cmd for cmd in (mkdir, copy, install, run))
  assert copy[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse"]
  assert copy[6:9] == [f"{REPO}/vit_jax", f"{REPO}/setup.py", "vit:vit_jax/"]
  assert "./vit_jax[tpu]" in flag(install, "--command")
  assert remote_train(run) == [".venv/bin/python", "-m", "vit_jax.tools.train", "--config",
                               "finetune:b16,cifar10", "--workdir", "runs/b16"]


def test_a_config_file_of_ones_own_is_copied_to_the_workers():
  *_, copy_config, run = tpu_up("v4-8", "us-central2-b", "runs/b16",
                                config="tests/tiny_config.py:anything")
  assert copy_config[4:7] == ["scp", TINY_CONFIG, "vit:vit_jax/run_configs/"]
  assert remote_train(run)[3:5] == ["--config", "run_configs/tiny_config.py:anything"]


def test_pod_slice_runs_on_every_worker():
  commands = tpu_up("v4-32", "us-central2-b", "gs://bucket/b16", "--", "--config.batch_size=1024")
  create, *on_workers = commands
  assert "--accelerator-type=v4-32" in create
  assert all("--worker=all" in cmd for cmd in on_workers)
  assert remote_train(on_workers[-1])[-4:] == [
      "--workdir", "gs://bucket/b16", "--distributed", "--config.batch_size=1024"]
  remote = shlex.split(flag(on_workers[-1], "--command"))
  assert remote[remote.index(">"):remote.index("&") + 1] == [
      ">", "logs/train.log", "2>&1", "<", "/dev/null", "&"]


@pytest.mark.parametrize("accelerator_type,zone,version,hosts", [
    ("v2-8", "us-central1-b", "tpu-ubuntu2204-base", 1),
    ("v3-32", "europe-west4-a", "tpu-ubuntu2204-base", 4),
    ("v4-16", "us-central2-b", "tpu-ubuntu2204-base", 2),
    ("v5litepod-8", "us-west4-a", "v2-alpha-tpuv5-lite", 1),
    ("v5litepod-16", "us-west4-a", "v2-alpha-tpuv5-lite", 4),
    ("v5p-128", "us-east5-a", "v2-alpha-tpuv5", 16),
    ("v6e-8", "us-east1-d", "v2-alpha-tpuv6e", 1),
    ("v6e-256", "europe-west4-a", "v2-alpha-tpuv6e", 64),
])
def test_slice_table(accelerator_type, zone, version, hosts):
  tpu = tpu_vm.resolve_slice(accelerator_type, zone)
  assert (tpu.version, tpu.hosts) == (version, hosts)


def test_logs_and_delete():
  (logs,) = dry_run("tpu_vm.py", "logs", "--name", "vit", "--zone", "us-central2-b")
  assert logs[4:7] == ["ssh", "vit", "--worker=0"]
  assert flag(logs, "--command") == "tail -n 100 -F vit_jax/logs/train.log"
  (delete,) = dry_run("tpu_vm.py", "delete", "--name", "vit", "--zone", "us-central2-b",
                      "--project", "p")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "vit", "--quiet",
                    "--zone=us-central2-b", "--project=p"]


def test_unlisted_types_and_zones_need_the_override():
  args = ["create", "--name", "vit", "--zone", "us-central9-z", "--accelerator-type", "v9-8"]
  assert launch("tpu_vm.py", *args, "--dry-run").returncode == 2
  (create,) = dry_run("tpu_vm.py", *args, "--allow-unlisted", "--version", "v2-alpha-tpuv9")
  assert "--accelerator-type=v9-8" in create and "--version=v2-alpha-tpuv9" in create


def test_commands_run_are_those_printed(fake_gcloud):
  env, log = fake_gcloud
  args = ["create", "--name", "vit", "--zone", "us-central2-b", "--accelerator-type", "v4-32"]
  result = launch("tpu_vm.py", *args, env=env)
  assert result.returncode == 0, result.stderr
  assert [" ".join(c[1:]) for c in dry_run("tpu_vm.py", *args)] == log.read_text().splitlines()


@pytest.mark.parametrize("change,message", [
    ({"--zone": "us-central1-a"}, "'us-central1-a' offers no v4 TPUs; v4 zones: us-central2-b"),
    ({"--zone": "mars-north1-a"}, "offers no v4 TPUs"),
    ({"--accelerator-type": "v4-12"}, "--accelerator-type 'v4-12' is not a known Cloud TPU type"),
    ({"--accelerator-type": "tpu-8"}, "Known: v2-{8,32,128,256,512}"),
    ({"--config": "configs/nonexistent.py:b16"}, "no file configs/nonexistent.py"),
    ({"--config": "finetun:b16"}, "vit_jax ships no config named 'finetun'. Configs shipped with "
                                  "vit_jax: augreg_pretrain, finetune, pretrain, quickstart"),
    ({"--config": "README.md"}, "README.md is not a readable Python file"),
    ({"--config": "vit_jax/tools/train.py"}, "defines no get_config(arg)"),
    ({"--workdir": "/tmp/vit"}, "the workers of a pod slice share no disk"),
])
def test_bad_arguments_stop_before_anything_is_created(fake_gcloud, change, message):
  env, log = fake_gcloud
  args = {"--name": "vit", "--zone": "us-central2-b", "--accelerator-type": "v4-32",
          "--config": "finetune:b16,cifar10", "--workdir": "gs://bucket/b16", **change}
  result = launch("tpu_vm.py", "up", *[x for kv in args.items() for x in kv], env=env)
  assert result.returncode == 2
  assert message in result.stderr
  assert not log.exists() and not result.stdout


@pytest.mark.parametrize("config,passed", [
    ("finetune:b16,cifar10", "finetune:b16,cifar10"),  # Shipped: every task finds it by name.
    ("tests/tiny_config.py:x", f"{TINY_CONFIG}:x"),  # A file: its absolute path.
])
def test_slurm(config, passed):
  (srun,) = dry_run("multihost.py", "slurm", "--nodes", "2", "--gpus-per-node", "8",
                    "--partition", "gpu", "--env", "NCCL_DEBUG=WARN", "--config",
                    config, "--workdir", "/shared/b16", "--", "--config.batch_size=1024")
  python = srun.index(sys.executable)
  assert srun[:python] == [
      "srun", "--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--gpu-bind=none",
      "--kill-on-bad-exit=1", "--partition=gpu", "--job-name=vit_jax",
      "--export=ALL,NCCL_DEBUG=WARN", f"--chdir={REPO}"]
  assert srun[python + 1:] == [
      "-m", "vit_jax.tools.train", "--config", passed, "--workdir", "/shared/b16", "--distributed",
      "--config.batch_size=1024"]


@pytest.mark.parametrize("config,passed", [
    ("finetune:b16,cifar10", "finetune:b16,cifar10"),
    ("tests/tiny_config.py:x", "/home/me/vit/tests/tiny_config.py:x"),  # In the remote clone.
])
def test_host_list_over_ssh(config, passed):
  commands = dry_run("multihost.py", "hosts", "--hosts", "gpu0,gpu1", "--port", "1234",
                     "--remote-repo", "/home/me/vit", "--env", "NCCL_DEBUG=WARN", "--config",
                     config, "--workdir", "/shared/b16")
  assert len(commands) == 2
  for i, (cmd, host) in enumerate(zip(commands, ("gpu0", "gpu1"))):
    assert cmd[:4] == ["ssh", "-o", "BatchMode=yes", host]
    remote = shlex.split(cmd[4])
    assert remote[:4] == ["cd", "/home/me/vit", "&&", "env"]
    assert remote[4:] == [
        "NCCL_DEBUG=WARN", sys.executable, "-m", "vit_jax.tools.train", "--config", passed,
        "--workdir", "/shared/b16",
        "--coordinator_address=gpu0:1234", "--num_processes=2", f"--process_id={i}"]


def test_localhost_runs_here_with_a_loopback_coordinator():
  commands = dry_run("multihost.py", "hosts", "--hosts", "localhost,localhost", "--config",
                     TINY_CONFIG, "--workdir", "/tmp/w")
  assert [c[:3] for c in commands] == [[sys.executable, "-m", "vit_jax.tools.train"]] * 2
  assert all("--coordinator_address=127.0.0.1:29500" in c for c in commands)


@pytest.mark.parametrize("args,message", [
    (["--hosts", "a,b", "--config", "configs/nope.py"], "no file configs/nope.py"),
    (["--hosts", "a,b", "--env", "NCCL_DEBUG"], "--env 'NCCL_DEBUG': expected NAME=VALUE"),
    (["--hosts", "localhost,gpu1"], "the remote hosts cannot reach host 0 as localhost"),
    (["--hosts", ","], "--hosts is empty"),
])
def test_host_list_refusals(args, message):
  base = {"--config": TINY_CONFIG, "--workdir": "/tmp/w"}
  result = launch("multihost.py", "hosts", *[x for k, v in base.items() if k not in args
                                             for x in (k, v)], *args)
  assert result.returncode == 2
  assert message in result.stderr and not result.stdout


def test_the_first_failure_is_the_exit_status_whatever_the_order():
  """Process 1 fails first; process 0, stopped by the launch (SIGTERM), does not count."""
  from launch import multihost
  sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
  failing = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"]
  assert multihost.run_processes([sleeper, failing]) == 3
  killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
  assert multihost.run_processes([sleeper, killed]) == 128 + 9


def test_independent_jobs_all_run_past_a_failure_then_the_last_step(tmp_path):
  """Three jobs on two slots: the one that fails stops none of the others, the --then
  command runs after all of them, and the first failure is the exit status."""
  from launch import jobs
  log = tmp_path / "order"
  job = lambda name, code: [sys.executable, "-c", (  # noqa: E731
      f"import sys, time; time.sleep(0.3); open({str(log)!r}, 'a').write('{name} '); "
      f"sys.exit({code})")]
  as_given = lambda host, cmd: cmd  # noqa: E731
  assert jobs.run_on_hosts(["localhost"] * 2, [job("a", 0), job("b", 4), job("c", 0)],
                           as_given, then=job("then", 0)) == 4
  order = log.read_text().split()
  assert sorted(order[:3]) == ["a", "b", "c"] and order[3] == "then"
  empty = subprocess.run([sys.executable, str(REPO / "launch" / "jobs.py"), "hosts", "--tool",
                          "transfer", "--hosts", "localhost"], input="\n", capture_output=True,
                         text=True, timeout=60)
  assert empty.returncode == 2 and "no jobs" in empty.stderr


def test_a_job_that_could_not_run_keeps_the_last_step_from_a_partial_report(tmp_path, capsys):
  """ssh's 255 (its host lost): the other jobs run, --then does not, and stderr says why."""
  from launch import jobs
  log = tmp_path / "ran"
  job = lambda name, code: [sys.executable, "-c", (  # noqa: E731
      f"import sys; open({str(log)!r}, 'a').write('{name} '); sys.exit({code})")]
  assert jobs.run_on_hosts(["localhost"], [job("a", 255), job("b", 0)], lambda h, c: c,
                           then=job("then", 0)) == 255
  assert sorted(log.read_text().split()) == ["a", "b"]
  [line] = capsys.readouterr().err.splitlines()
  assert line == ("error: 1 of 2 jobs failed: job 0 (exit status 255); --then not run, since "
                  "job(s) 0 could not run")


def test_an_unreachable_host_is_refused_before_any_job_starts(tmp_path):
  """Through vit-transfer --launch hosts: one line naming the host, exit 2, nothing run or
  written (ssh cannot resolve a name under .invalid, RFC 2606; without ssh installed, the
  same refusal)."""
  out_dir = tmp_path / "out"
  r = subprocess.run([sys.executable, "-m", "vit_jax.tools.transfer", str(tmp_path),
                      "--suite", "vtab1k/dtd", "--out_dir", str(out_dir), "--launch", "hosts",
                      "--", "--hosts", "localhost,gpu0.invalid"], env=cpu_env(),
                     capture_output=True, text=True, timeout=300)
  [line] = r.stderr.splitlines()
  assert r.returncode == 2 and line.startswith(
      "error: --launch hosts: --hosts: cannot reach gpu0.invalid over ssh (")
  assert line.endswith("nothing was started.") and "[launch]" not in r.stdout
  assert not out_dir.exists()


# Queued resources, against tests/fake_gcloud.py's scripted histories (no training here: the
# recovery of a real run is test_e2e_recovery.py's).

QUEUED = ["--name", "vit", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-16",
          "--no-preflight"]
RUN = ["--config", "quickstart", "--workdir", "gs://bucket/run"]


def test_queued_up_with_recovery_prints_every_command_it_may_run():
  create, wait, *start, poll_qr, poll_node, poll_job, delete = dry_run(
      "tpu_vm.py", "up", "--queued", "--spot", "--recover", "--valid-until-duration", "6h",
      *QUEUED, *RUN)
  assert create == ["gcloud", "compute", "tpus", "queued-resources", "create", "vit",
                    "--node-id=vit", "--accelerator-type=v5litepod-16",
                    "--runtime-version=v2-alpha-tpuv5-lite", "--spot",
                    "--valid-until-duration=6h", "--zone=us-west4-a"]
  assert wait == poll_qr == ["gcloud", "compute", "tpus", "queued-resources", "describe", "vit",
                             "--format=json", "--zone=us-west4-a"]
  assert [c[4] for c in start] == ["ssh", "scp", "ssh", "ssh"]  # mkdir, copy, install, run.
  assert remote_train(start[-1])[3:] == ["--config", "quickstart", "--workdir", "gs://bucket/run",
                                         "--distributed"]
  assert poll_node[4:6] == ["describe", "vit"] and flag(poll_job, "--command") == (
      "cat vit_jax/logs/train.exit 2>/dev/null || kill -0 $(cat vit_jax/logs/train.pid "
      "2>/dev/null) 2>/dev/null || echo gone")
  assert delete == ["gcloud", "compute", "tpus", "queued-resources", "delete", "vit", "--force",
                    "--quiet", "--zone=us-west4-a"]


def test_multislice_asks_for_one_queued_resource_and_joins_its_slices():
  create, _, coordinator, *start = dry_run(
      "tpu_vm.py", "up", "--queued", "--best-effort", "--num-slices", "2", *QUEUED, *RUN)
  assert create[:6] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create"]
  assert "--node-count=2" in create and "--node-prefix=vit" in create
  assert "--best-effort" in create
  assert coordinator[4:6] == ["describe", "vit-0"]
  runs = [c for c in start if "--command" in c and "vit_jax.tools.train" in flag(c, "--command")]
  assert [c[5] for c in runs] == ["vit-0", "vit-1"]
  for slice_id, run in enumerate(runs):
    env = remote_train(run)
    assert env[:5] == ["env", "MEGASCALE_COORDINATOR_ADDRESS=IP_OF_vit-0_WORKER_0",
                       "MEGASCALE_PORT=8080", "MEGASCALE_NUM_SLICES=2",
                       f"MEGASCALE_SLICE_ID={slice_id}"]


def test_single_host_slices_joined_make_a_distributed_run_on_a_bucket():
  """Two v5litepod-8 slices have one host each, yet the run is two processes on two machines:
  jax.distributed joins them, and only a bucket is a workdir both see."""
  two = ["up", "--queued", "--num-slices", "2", *QUEUED, "--accelerator-type", "v5litepod-8"]
  runs = [c for c in dry_run("tpu_vm.py", *two, *RUN)
          if "--command" in c and "vit_jax.tools.train" in flag(c, "--command")]
  assert [remote_train(run)[-2:] for run in runs] == [["gs://bucket/run", "--distributed"]] * 2
  local = launch("tpu_vm.py", *two, "--config", "quickstart", "--workdir", "/tmp/run",
                 "--dry-run")
  assert local.returncode == 2 and "--workdir /tmp/run: the 2 slices share no disk" in (
      local.stderr) and not local.stdout


def test_queued_delete_takes_the_nodes_with_it():
  (delete,) = dry_run("tpu_vm.py", "delete", "--queued", "--name", "vit", "--zone", "us-west4-a")
  assert delete[3:7] == ["queued-resources", "delete", "vit", "--force"]


@pytest.mark.parametrize("flags,message", [
    (["--queued", "--accelerator-type=v3-8", "--zone=us-central1-a"],
     "queued resources serve v4, v5litepod, v5p, v6e slices, not v3"),
    (["--reserved"], "--reserved asks for a queued resource: add --queued"),
    (["--num-slices", "2"], "--num-slices asks for a queued resource: add --queued"),
    (["--queued", "--valid-until-duration", "6 hours"], "expected a duration such as 30m"),
    (["--queued", "--spot", "--reserved"], "not allowed with argument --spot"),
    (["--queued", "--recover", "--accelerator-type", "v5litepod-8", "--workdir", "runs/b16"],
     "--workdir runs/b16: following the job reads its progress there, from this machine"),
])
def test_requests_the_tpu_service_would_refuse_stop_before_any_gcloud_command(
    fake_gcloud, flags, message):
  env, log = fake_gcloud
  result = launch("tpu_vm.py", "up", *QUEUED, *RUN, *flags, env=env)  # The last flag given wins.
  assert result.returncode == 2 and message in result.stderr, result.stderr
  assert not log.exists()


def _queued_up(tmp_path, history, *extra, python: str | None = None):
  """`up --queued` against a scripted history; (result, the gcloud calls)."""
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps(history))
  if python:
    env["FAKE_GCLOUD_PYTHON"] = python
  result = launch("tpu_vm.py", "up", "--queued", "--poll-seconds", "0.05", *QUEUED,
                  "--accelerator-type", "v5litepod-8", "--config", "quickstart", "--workdir",
                  str(tmp_path / "run"), *extra, env=env)
  return result, (folder / "gcloud.log").read_text().splitlines()


@pytest.mark.parametrize("states,error,why", [
    (["WAITING_FOR_RESOURCES", "FAILED"], "Quota 'TPUV5sLitepodPerProjectPerZone' exceeded",
     "change what the reason names (--accelerator-type v5litepod-8, --zone us-west4-a, the "
     "tier or quota) and run again"),
    (["WAITING_FOR_RESOURCES"] * 3 + ["FAILED"], "not provisioned before its valid until time",
     "the capacity did not come within --valid-until-duration: give it longer, another zone, "
     "or another tier"),
])
def test_a_queued_resource_that_fails_ends_with_one_line_naming_why(tmp_path, states, error, why):
  result, calls = _queued_up(tmp_path, [{"states": states, "error": error}],
                             "--valid-until-duration", "1h")
  assert result.returncode == 1
  [line] = result.stderr.splitlines()
  assert line.startswith(f"error: queued resource vit is FAILED ({error}) after ")
  assert why in line
  assert "queued resource vit: WAITING_FOR_RESOURCES, after 0s" in result.stdout
  assert not any("tpu-vm" in c for c in calls)  # Nothing set up on a slice it never had.


def test_a_job_that_fails_the_same_way_twice_is_a_bug_not_capacity(tmp_path):
  """The job (a stand-in that exits 3 at once) fails on a fresh slice, and again on the next:
  no progress, so the launcher stops, exit 1, instead of asking for capacity for ever."""
  crash = tmp_path / "crash"
  crash.write_text("#!/bin/sh\nexit 3\n")
  crash.chmod(0o755)
  result, calls = _queued_up(tmp_path, [{"states": ["ACTIVE"]}] * 3, "--recover",
                             python=str(crash))
  assert result.returncode == 1, result.stderr
  assert result.stdout.count("exited with status 3 at about step 0") == 2
  [line] = result.stderr.splitlines()
  assert line.startswith("error: the job exited with status 3 twice in a row without progress "
                         "past step 0: a failure of the run, not of capacity")
  assert sum("queued-resources create" in c for c in calls) == 2
  more, _ = _queued_up(tmp_path / "again", [{"states": ["ACTIVE"]}] * 3, "--recover",
                       "--max-restarts", "0", python=str(crash))
  assert more.returncode == 1 and "gave up after 0 restarts (--max-restarts)" in more.stderr


def test_ctrl_c_leaves_the_queued_resource_as_it_is(tmp_path):
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["WAITING_FOR_RESOURCES"]}]))
  p = subprocess.Popen([sys.executable, str(REPO / "launch" / "tpu_vm.py"), "up", "--queued",
                        "--recover", "--poll-seconds", "0.05", *QUEUED, "--accelerator-type",
                        "v5litepod-8", "--config", "quickstart", "--workdir",
                        str(tmp_path / "run")], env=env,
                       stdout=subprocess.PIPE, text=True)
  for line in p.stdout:
    if "WAITING_FOR_RESOURCES" in line:
      p.send_signal(signal.SIGINT)
      break
  rest = p.stdout.read()
  assert p.wait(timeout=60) == 130
  assert "stopped following: queued resource vit and its job are left as they are" in rest
  assert not any("delete" in c for c in (folder / "gcloud.log").read_text().splitlines())


@pytest.mark.parametrize("event,why", [
    # The queued resource or its node seen first, whichever the poll reaches.
    ("preempt", "preempted ("),
    ("delete", "deleted ("),
    ("maintenance", "under maintenance (node vit)"),
    ("unhealthy", "unhealthy (node vit: TIMEOUT)"),
    ("crash", "exited with status 137"),
    ("restart", "gone (no process and no exit status on vit: restarted?)"),
])
def test_each_way_a_job_stops_short_is_told_and_the_slice_asked_for_again(tmp_path, event, why):
  """The job (a stand-in that logs a step and sleeps) meets the event; the launcher names it,
  asks for the slice again, and ends where the next request fails."""
  job = tmp_path / "job"
  job.write_text("#!/bin/sh\necho 'step 1/12 (8.3%)'\nsleep 60\n")
  job.chmod(0o755)
  history = [{"states": ["ACTIVE"], "then": {"at_step": 1, "event": event, "signal": "KILL"}},
             {"states": ["FAILED"], "error": "no capacity"}]
  result, calls = _queued_up(tmp_path, history, "--recover", python=str(job))
  assert result.returncode == 1, result.stderr
  [told] = re.findall(r"^\[[\d :-]+\] (.+) at about step 0$", result.stdout, re.M)
  assert told.startswith(why)
  assert sum("queued-resources create" in c for c in calls) == 2
  assert "queued resource vit is FAILED (no capacity)" in result.stderr


def test_a_slice_taken_away_during_its_set_up_is_asked_for_again(tmp_path):
  """A Spot slice preempted between ACTIVE and the job's start (its ssh refused): a
  preemption like any other, not the launcher's end."""
  history = [{"states": ["ACTIVE", "SUSPENDED"], "node": {"state": "PREEMPTED"}},
             {"states": ["FAILED"], "error": "no capacity"}]
  result, calls = _queued_up(tmp_path, history, "--recover")
  assert result.returncode == 1, result.stderr
  assert re.search(r"^\[[\d :-]+\] preempted \(queued resource SUSPENDED\) at about step 0$",
                   result.stdout, re.M)
  assert sum("queued-resources create" in c for c in calls) == 2
  assert "queued resource vit is FAILED (no capacity)" in result.stderr


def test_a_set_up_failing_twice_on_healthy_slices_stops(tmp_path):
  """The install fails on a fresh slice and on the next: not capacity, so exit 1 instead of
  asking for slices for ever."""
  result, calls = _queued_up(tmp_path, [{"states": ["ACTIVE"], "install_exit": 1}] * 3,
                             "--recover")
  assert result.returncode == 1, result.stderr
  why = "set-up failed (tpu-vm ssh vit exited with code 1)"
  assert result.stdout.count(f"{why} at about step 0") == 2
  [line] = result.stderr.splitlines()
  assert line == (f"error: {why} twice in a row, on slices the TPU service called healthy: not "
                  "a lack of capacity; gcloud's output is above")
  assert sum("queued-resources create" in c for c in calls) == 2


@pytest.mark.parametrize("node,after,why", [
    ("STOPPING", "SUSPENDING", "preempted (queued resource SUSPENDING (by the TPU service))"),
    ("STOPPING", "ACTIVE", "deleted (node vit is STOPPING)"),
    ("REPAIRING", "ACTIVE", "unhealthy (node vit is REPAIRING)"),
])
def test_a_node_stopping_is_a_preemption_once_its_queued_resource_says_so(
    monkeypatch, node, after, why):
  """The poll read the queued resource ACTIVE, then its node STOPPING: it asks the queued
  resource again, which names the cause. A node under repair is there still: unhealthy."""
  from launch import queued, recover
  states = iter([queued.State("ACTIVE"), queued.State(after, "by the TPU service" * (
      after != "ACTIVE"))])
  monkeypatch.setattr(queued, "describe", lambda args: next(states))
  monkeypatch.setattr(queued, "node_names", lambda args: ["vit"])
  described = [sys.executable, "-c", f"print('{{\"state\": \"{node}\"}}')"]
  job = recover.Job(args=None, start=lambda: None, node_command=lambda name: described,
                    exit_command=lambda name: [])
  assert recover.slice_trouble(job) == why


def test_watch_follows_a_job_started_before(tmp_path):
  """`up --queued` starts the job and returns; `watch`, with the same flags, finds it ended
  short (a stand-in exiting 3) and, with no restart allowed, says so."""
  crash = tmp_path / "crash"
  crash.write_text("#!/bin/sh\nexit 3\n")
  crash.chmod(0o755)
  started, calls = _queued_up(tmp_path, [{"states": ["ACTIVE"]}], python=str(crash))
  assert started.returncode == 0 and "Started. Follow it:" in started.stdout
  env, folder = scripted_gcloud(tmp_path)  # The same fake Cloud, in the state `up` left.
  # `up --recover` again (not `watch`) would delete the running job's slice to ask anew.
  again = launch("tpu_vm.py", "up", "--queued", "--recover", *QUEUED, "--accelerator-type",
                 "v5litepod-8", "--config", "quickstart", "--workdir", str(tmp_path / "run"),
                 env=env)
  assert again.returncode == 2 and "queued resource vit exists already (ACTIVE): follow its " \
      "job with `watch`" in again.stderr
  assert not any("delete" in c for c in (folder / "gcloud.log").read_text().splitlines())
  watched = launch("tpu_vm.py", "watch", "--poll-seconds", "0.05", "--max-restarts", "0",
                   *QUEUED, "--accelerator-type", "v5litepod-8", "--config", "quickstart",
                   "--workdir", str(tmp_path / "run"), env=env | {"FAKE_GCLOUD_PYTHON": str(crash)})
  assert watched.returncode == 1
  assert "exited with status 3 at about step 0" in watched.stdout
  assert "gave up after 0 restarts" in watched.stderr
  calls = (folder / "gcloud.log").read_text().splitlines()
  assert sum("queued-resources create" in c for c in calls) == 1  # Only `up`'s.


@pytest.mark.parametrize("failing,code", [(2, 0), (10, 1)])
def test_a_describe_failing_a_while_is_said_and_tried_again(tmp_path, failing, code):
  """The API unavailable for two polls: each failure one line, and the wait goes on; for ten
  in a row (ten minutes at the default --poll-seconds): one line, exit 1."""
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps(
      [{"states": ["PROVISIONING", "ACTIVE"], "unavailable": failing}]))
  result = launch("tpu_vm.py", "create", "--queued", "--poll-seconds", "0.05", *QUEUED[:-1],
                  env=env)
  assert result.returncode == code, result.stderr
  unavailable = "ERROR: (gcloud) UNAVAILABLE: The service is currently unavailable."
  said = re.escape(f"queued-resources describe vit failed ({unavailable}); trying again in 0s")
  tries = re.findall(rf"^\[[\d :-]+\] {said} \((\d) more tries\)$", result.stdout, re.M)
  assert tries == ["9", "8", "7", "6", "5", "4", "3", "2", "1"][:failing]
  if code == 0:
    assert "queued resource vit: ACTIVE, after" in result.stdout
  else:
    [line] = result.stderr.splitlines()
    assert line == ("error: gcloud compute tpus queued-resources describe vit --format=json "
                    f"--zone=us-west4-a failed 10 times in a row, a poll apart; the last time: "
                    f"{unavailable}")


def test_create_queued_waits_for_the_slice_and_starts_nothing(tmp_path):
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["PROVISIONING", "ACTIVE"]}]))
  result = launch("tpu_vm.py", "create", "--queued", "--reserved", "--poll-seconds", "0.05",
                  *QUEUED[:-1], env=env)
  assert result.returncode == 0, result.stderr
  assert "queued resource vit: ACTIVE, after" in result.stdout
  calls = (folder / "gcloud.log").read_text().splitlines()
  [create] = [c for c in calls if "queued-resources create" in c]
  assert "--reserved" in create and not any("tpu-vm" in c for c in calls)
  watch = dry_run("tpu_vm.py", "watch", *QUEUED, *RUN)
  assert watch[0][3:5] == ["queued-resources", "describe"]  # Follows first, asks again after.
