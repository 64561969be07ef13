"""launch/: the commands printed for Cloud TPU VMs and GPU clusters, refusals before anything
is created, and processes and jobs run to their first failure (a real two-process training job
on localhost: test_e2e_distributed.py)."""
import argparse
import json
import re
import shlex
import subprocess
import sys
import time

import pytest

from helpers import REPO, TINY_CONFIG, cpu_env, interrupted_at, launch, scripted_gcloud
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


def remote_train(job: list[str]) -> list[str]:
  """The `vit-train` command line that `start` starts on the workers."""
  remote = shlex.split(flag(job, "--command"))
  assert remote[:2] == ["cd", "vit_jax"]
  train, keep = remote[remote.index("-c") + 1].rsplit("; ", 1)  # The training job, its status kept.
  assert keep == "echo $? > logs/train.exit"
  assert remote[-5:] == ["&", "echo", "$!", ">", "logs/train.pid"]  # Whose end EXIT tells.
  return shlex.split(train)


def test_single_host_tpu():
  """A shipped config is installed with the package: named, not copied."""
  create, mkdir, copy, install, job = tpu_up("v4-8", "us-central2-b", "runs/b16")
  assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "vit",
                    "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base",
                    "--zone=us-central2-b"]
  assert all("--worker=all" not in cmd for cmd in (mkdir, copy, install, job))
  assert copy[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse"]
  assert copy[6:9] == [f"{REPO}/vit_jax", f"{REPO}/setup.py", "vit:vit_jax/"]
  assert "./vit_jax[tpu]" in flag(install, "--command")
  assert remote_train(job) == [".venv/bin/python", "-m", "vit_jax.tools.train", "--config",
                               "finetune:b16,cifar10", "--workdir", "runs/b16"]


def test_a_config_file_of_ones_own_is_copied_to_the_workers():
  *_, copy_config, job = tpu_up("v4-8", "us-central2-b", "runs/b16",
                                config="tests/tiny_config.py:anything")
  assert copy_config[4:7] == ["scp", TINY_CONFIG, "vit:vit_jax/run_configs/"]
  assert remote_train(job)[3:5] == ["--config", "run_configs/tiny_config.py:anything"]


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
                      "--project", "my-project")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "vit", "--quiet",
                    "--zone=us-central2-b", "--project=my-project"]


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
  assert multihost.execute_processes([sleeper, failing]) == 3
  killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
  assert multihost.execute_processes([sleeper, killed]) == 128 + 9


def test_independent_jobs_all_run_past_a_failure_then_the_last_step(tmp_path):
  """Three jobs on two slots: the one that fails stops none of the others, the --then
  command runs after all of them, and the first failure is the exit status."""
  from launch import jobs
  log = tmp_path / "order"
  job = lambda name, code: [sys.executable, "-c", (  # noqa: E731
      f"import sys, time; time.sleep(0.3); open({str(log)!r}, 'a').write('{name} '); "
      f"sys.exit({code})")]
  as_given = lambda host, cmd: cmd  # noqa: E731
  assert jobs.execute_on_hosts(["localhost"] * 2, [job("a", 0), job("b", 4), job("c", 0)],
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
  assert jobs.execute_on_hosts(["localhost"], [job("a", 255), job("b", 0)], lambda h, c: c,
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
  assert [c[4] for c in start] == ["ssh", "scp", "ssh", "ssh"]  # mkdir, copy, install, start.
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
  jobs = [c for c in start if "--command" in c and "vit_jax.tools.train" in flag(c, "--command")]
  assert [c[5] for c in jobs] == ["vit-0", "vit-1"]
  for slice_id, job in enumerate(jobs):
    env = remote_train(job)
    assert env[:5] == ["env", "MEGASCALE_COORDINATOR_ADDRESS=IP_OF_vit-0_WORKER_0",
                       "MEGASCALE_PORT=8080", "MEGASCALE_NUM_SLICES=2",
                       f"MEGASCALE_SLICE_ID={slice_id}"]


def test_single_host_slices_joined_make_a_distributed_run_on_a_bucket():
  """Two v5litepod-8 slices have one host each, yet the run is two processes on two machines:
  jax.distributed joins them, and only a bucket is a workdir both see."""
  two = ["up", "--queued", "--num-slices", "2", *QUEUED, "--accelerator-type", "v5litepod-8"]
  jobs = [c for c in dry_run("tpu_vm.py", *two, *RUN)
          if "--command" in c and "vit_jax.tools.train" in flag(c, "--command")]
  assert [remote_train(job)[-2:] for job in jobs] == [["gs://bucket/run", "--distributed"]] * 2
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
    (["--queued", "--valid-until-duration", "6 hours"], "expected a duration above 0 such as"),
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


def _executable(path, text: str):
  """A script at `path` (a stand-in for the workers' Python, or its wrapper)."""
  path.write_text(text)
  path.chmod(0o755)
  return path


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


def test_a_job_that_fails_the_same_way_again_is_a_bug_not_capacity(tmp_path):
  """The job (a stand-in that exits 3 at once) fails on a healthy slice: it runs again there,
  fails again, so new slices are asked for; failing there too, without progress, the launcher
  stops, exit 1, instead of asking for capacity for ever."""
  crash = _executable(tmp_path / "crash", "#!/bin/sh\nexit 3\n")
  result, calls = _queued_up(tmp_path, [{"states": ["ACTIVE"]}] * 3, "--recover",
                             python=str(crash))
  assert result.returncode == 1, result.stderr
  assert result.stdout.count("exited with status 3 at about step 0") == 3
  assert result.stdout.count("running the job again on the same slices") == 1
  [line] = result.stderr.splitlines()
  assert line.startswith("error: the job exited with status 3 three times in a row without "
                         "progress past step 0, on the same slices and on new ones: a failure "
                         "of the run, not of capacity")
  assert sum("queued-resources create" in c for c in calls) == 2
  assert sum("vit_jax.tools.train" in c for c in calls) == 3
  assert sum("uv pip install" in c for c in calls) == 2  # Not again on the same slice.
  more, _ = _queued_up(tmp_path / "again", [{"states": ["ACTIVE"]}] * 3, "--recover",
                       "--max-restarts", "0", python=str(crash))
  assert more.returncode == 1 and "gave up after 0 restarts (--max-restarts)" in more.stderr


def test_a_job_that_refuses_its_input_stops_at_once(tmp_path):
  """vit-train's exit status 2 (a flag, a config or the workdir refused in one line) is the
  same on any slice: no rerun, no new slice."""
  refuse = _executable(tmp_path / "refuse",
                       "#!/bin/sh\necho 'error: --config.batch_size: no' >&2\nexit 2\n")
  result, calls = _queued_up(tmp_path, [{"states": ["ACTIVE"]}] * 2, "--recover",
                             python=str(refuse))
  assert result.returncode == 1, result.stderr
  [line] = result.stderr.splitlines()
  assert line == ("error: the job refused its input (exit status 2), as it would on any slice; "
                  "its log says why: python launch/tpu_vm.py logs --name vit --zone us-west4-a")
  assert sum("queued-resources create" in c for c in calls) == 1
  assert sum("vit_jax.tools.train" in c for c in calls) == 1


def test_ctrl_c_leaves_the_queued_resource_as_it_is(tmp_path):
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["WAITING_FOR_RESOURCES"]}]))
  code, rest = interrupted_at(
      [sys.executable, str(REPO / "launch" / "tpu_vm.py"), "up", "--queued", "--recover",
       "--poll-seconds", "0.05", *QUEUED, "--accelerator-type", "v5litepod-8", "--config",
       "quickstart", "--workdir", str(tmp_path / "run")], "WAITING_FOR_RESOURCES", env=env)
  assert code == 130
  assert "stopped following: queued resource vit and its job are left as they are" in rest
  assert not any("delete" in c for c in (folder / "gcloud.log").read_text().splitlines())


@pytest.mark.parametrize("script,why", [
    ("print('starting', flush=True); time.sleep(60)", "within 2 s; it wrote:\nstarting\n"),
    ("print('starting')", "before its output ended; it wrote:\nstarting\n")],
    ids=["silent", "ends_first"])
def test_a_ctrl_c_test_whose_line_never_comes_fails_in_time_with_what_was_written(script, why):
  """helpers.interrupted_at: a child silent about the awaited text fails the test (within the
  bound) with its output, where a plain read of its pipe would wait for ever."""
  t0 = time.monotonic()
  with pytest.raises(pytest.fail.Exception, match=re.escape(why)):
    interrupted_at([sys.executable, "-c", f"import time; {script}"], "never said", timeout=2)
  assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("event,why,same_slice", [
    # The queued resource or its node seen first, whichever the poll reaches.
    ("preempt", "preempted (", False),
    ("delete", "deleted (", False),
    ("maintenance", "under maintenance (node vit)", False),
    ("unhealthy", "unhealthy (node vit: TIMEOUT)", False),
    ("crash", "exited with status 137", True),
    ("restart", "gone (no process and no exit status on vit: restarted?)", True),
])
def test_each_way_a_job_stops_short_is_told_and_the_slice_asked_for_again(
    tmp_path, event, why, same_slice):
  """The job (a stand-in that logs a step and sleeps) meets the event; the launcher names it,
  asks for the slice again, and ends where the next request fails. A job that ended on a
  healthy slice (a crash, a restart of the machine) runs there again first, and meets the
  event again."""
  job = _executable(tmp_path / "job", "#!/bin/sh\necho 'step 1/12 (8.3%)'\nsleep 60\n")
  history = [{"states": ["ACTIVE"], "then": {"at_step": 1, "event": event, "signal": "KILL"}},
             {"states": ["FAILED"], "error": "no capacity"}]
  result, calls = _queued_up(tmp_path, history, "--recover", python=str(job))
  assert result.returncode == 1, result.stderr
  told = re.findall(r"^\[[\d :-]+\] (.+) at about step 0$", result.stdout, re.M)
  assert len(told) == 1 + same_slice and all(t.startswith(why) for t in told)
  assert ("running the job again on the same slices" in result.stdout) == same_slice
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
  crash = _executable(tmp_path / "crash", "#!/bin/sh\nexit 3\n")
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


# Every flag of every launcher verb checked before the first cloud call: exit status 2, one
# `error:` line, nothing printed on stdout, no gcloud call (the fake records every call).
TPU = {"--name": "vit", "--zone": "us-west4-a"}
SLICE = {**TPU, "--accelerator-type": "v5litepod-8"}
JOB = {"--config": "quickstart", "--workdir": "gs://bucket/run", "--no-preflight": None}
VERBS = {
    "tpu_vm.py create": SLICE, "tpu_vm.py setup": SLICE, "tpu_vm.py start": {**SLICE, **JOB},
    "tpu_vm.py up": {**SLICE, **JOB}, "tpu_vm.py watch": {**SLICE, **JOB},
    "tpu_vm.py logs": TPU, "tpu_vm.py delete": TPU,
    "multihost.py slurm": {"--nodes": "2", "--config": "quickstart", "--workdir": "/w"},
    "multihost.py hosts": {"--hosts": "a,b", "--config": "quickstart", "--workdir": "/w"},
    "jobs.py slurm": {"--tool": "transfer"},
    "jobs.py hosts": {"--tool": "transfer", "--hosts": "localhost"},
    "jobs.py tpu_vm": {"--tool": "transfer", "--names": "a", "--zone": "us-west4-a",
                       "--accelerator-type": "v5litepod-8"},
}
BAD = {  # flag: (bad values, a part of the line that refuses them)
    "--name": (["Vit", "vit_1", "9vit", "vit-", "v" * 61], "is no Cloud TPU name"),
    "--project": (["My Project", "p_q"], "is no Google Cloud project ID"),
    "--zone": (["mars-north1-a"], "offers no"),
    "--poll-seconds": (["-1", "0", "nan", "inf", "soon"], "--poll-seconds"),
    "--max-restarts": (["-1", "1.5"], "--max-restarts"),
    "--num-slices": (["-2", "0"], "--num-slices"),
    "--valid-until-duration": (["0h", "6 hours", "-1h"], "--valid-until-duration"),
    "--lines": (["-5", "many"], "--lines"),
    "--worker": (["-1", "first"], "--worker"),
    "--nodes": (["0", "-2"], "--nodes"),
    "--gpus-per-node": (["0"], "--gpus-per-node"),
    "--port": (["0", "70000"], "--port"),
    "--time": (["tomorrow", "1:2:3:4"], "is no SLURM time limit"),
    "--config": (["", "finetun:b16"], "--config"),
    "--workdir": ([" "], "--workdir"),
    "--job-name": ([""], "--job-name"),
    "--tool": (["nonexistent", "../train"], "vit_jax.tools has no module"),
    "--hosts": ([",", " "], "--hosts is empty"),
    "--env": (["NCCL_DEBUG", "1X=2"], "expected NAME=VALUE"),
}


def _flags(script: str, command: str) -> set[str]:
  """The flags a launcher verb takes, from its parser."""
  from launch import jobs, multihost
  module = {"tpu_vm.py": tpu_vm, "multihost.py": multihost, "jobs.py": jobs}[script]
  [verbs] = [a for a in module.parser()._actions if isinstance(a, argparse._SubParsersAction)]
  return {o for a in verbs.choices[command]._actions for o in a.option_strings}


# tpu_vm.py's --python is the workers' Python version; multihost's and jobs', a program's path.
BAD_TPU_VM = {"--python": (["three", "3.x", "2.7"], "is no Python version uv takes")}


def _bad_cases():
  for verb, given in VERBS.items():
    script, command = verb.split()
    known = _flags(script, command)
    bad = {**BAD, **BAD_TPU_VM} if script == "tpu_vm.py" else BAD
    for flag_, (values, message) in bad.items():
      if flag_ in known:
        for value in values:
          yield pytest.param(script, command, given, flag_, value, message,
                             id=f"{verb}:{flag_}={value}")


@pytest.mark.parametrize("script,command,given,flag_,value,message", list(_bad_cases()))
def test_every_bad_flag_of_every_verb_is_one_line_before_any_cloud_call(
    fake_gcloud, monkeypatch, capsys, script, command, given, flag_, value, message):
  """In this process (the scripts' main, ~1 ms a case; test_bad_arguments_stop_before_anything
  _is_created runs the scripts themselves)."""
  import io

  from launch import jobs, multihost
  env, log = fake_gcloud
  monkeypatch.setenv("PATH", env["PATH"])
  monkeypatch.setattr(sys, "stdin", io.StringIO("--suite vtab1k/dtd\n"))
  args = {**given, flag_: value}
  argv = [command, *(x for k, v in args.items() for x in ((k,) if v is None else (k, v)))]
  main = {"tpu_vm.py": tpu_vm, "multihost.py": multihost, "jobs.py": jobs}[script].main
  try:
    code = main(argv)
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  assert code == 2, (out, err)
  [line] = err.splitlines()
  assert line.startswith("error: ") and message in line, line
  assert not log.exists() and not out


def test_every_verb_and_flag_of_the_table_is_covered():
  """The table above names every launcher verb, and each bad flag meets at least one."""
  flags = {c.values[3] for c in _bad_cases()}
  assert flags == set(BAD) | set(BAD_TPU_VM)
  commands = {f"{c.values[0]} {c.values[1]}" for c in _bad_cases()}
  assert commands == set(VERBS)
  for script, verbs in (("tpu_vm.py", 7), ("multihost.py", 2), ("jobs.py", 3)):
    assert sum(v.startswith(script) for v in VERBS) == verbs


@pytest.mark.parametrize("command,extra", [
    ("watch", [*QUEUED[6:], "--accelerator-type", "v5litepod-8", *RUN[:2], "--workdir",
               "/tmp/run", "--poll-seconds", "0.05"]),
    ("logs", []),
    ("delete", []),
    ("delete", ["--queued"]),
])
def test_watch_logs_and_delete_never_create_capacity(tmp_path, command, extra):
  """A typo in --name: `watch` finds no queued resource and says so (exit 2, one line) instead
  of asking for one; logs and delete fail on gcloud's NOT_FOUND. No `create` in any."""
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["ACTIVE"]}]))
  result = launch("tpu_vm.py", command, "--name", "vit-typo", "--zone", "us-west4-a", *extra,
                  env=env)
  calls = (folder / "gcloud.log").read_text().splitlines()
  assert result.returncode != 0
  assert not any(" create " in c for c in calls), calls
  if command == "watch":
    assert result.returncode == 2 and calls == [
        "compute tpus queued-resources describe vit-typo --format=json --zone=us-west4-a"]
    [line] = result.stderr.splitlines()
    assert line == ("error: --name vit-typo --zone us-west4-a: there is no such queued "
                    "resource, so no job to follow; start one with `up --queued --recover` "
                    "(watch asks for no capacity).")


def test_a_failed_queued_resource_is_deleted_so_running_again_asks_anew(tmp_path):
  """Its message says "run again": the name is free for it, and the same command asks anew."""
  history = [{"states": ["FAILED"], "error": "Quota exceeded"}, {"states": ["ACTIVE"]}]
  job = _executable(tmp_path / "job", "#!/bin/sh\nexit 0\n")
  result, calls = _queued_up(tmp_path, history, python=str(job))
  [line] = result.stderr.splitlines()
  assert result.returncode == 1 and "is FAILED (Quota exceeded) after 0s (deleted): " in line
  assert calls[-1].startswith("compute tpus queued-resources delete vit --force --quiet")
  again, calls = _queued_up(tmp_path, history, python=str(job))
  assert again.returncode == 0, again.stderr
  assert sum("queued-resources create" in c for c in calls) == 2


def test_up_replaces_a_failed_queued_resource_left_by_an_older_launcher(tmp_path):
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["FAILED"], "error": "stockout"},
                                                   {"states": ["ACTIVE"]}]))
  fake = [sys.executable, "-S", str(REPO / "tests" / "fake_gcloud.py")]
  subprocess.run([*fake, "compute", "tpus", "queued-resources", "create", "vit", "--node-id=vit"],
                 env=env, check=True, timeout=60)
  result = launch("tpu_vm.py", "create", "--queued", "--poll-seconds", "0.05", *QUEUED[:-1],
                  env=env)
  assert result.returncode == 0, result.stderr
  assert "queued resource vit is FAILED (stockout): replaced by this request" in result.stdout


def test_permission_denied_stops_at_once(tmp_path):
  """No retry mends a missing permission: one line at the first describe, nothing created
  (it was tried 10 times, a poll apart, ~9 minutes at the default --poll-seconds)."""
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps([{"states": ["ACTIVE"]}]))
  env["FAKE_GCLOUD_DENY"] = "queued-resources describe"
  result = launch("tpu_vm.py", "up", "--queued", "--recover", "--poll-seconds", "30", *QUEUED,
                  "--accelerator-type", "v5litepod-8", *RUN, env=env, timeout=20)
  assert result.returncode == 1
  [line] = result.stderr.splitlines()
  assert line.startswith("error: gcloud compute tpus queued-resources describe vit "
                         "--format=json --zone=us-west4-a failed, which no retry mends: ERROR: "
                         "(gcloud) PERMISSION_DENIED: Permission 'tpu.queuedResources.get'")
  assert (folder / "gcloud.log").read_text().count("\n") == 1


# A stand-in for vit-train that takes the workdir's lock as it does (a refusal is exit 2 and one
# line), records its attempt, and trains step 1 then waits (the first attempt) or to the end.
STAND_IN = """
import sys, time
from vit_jax import goodput
from vit_jax.checkpoint import workdir_lock
workdir = sys.argv[sys.argv.index("--workdir") + 1]
try:
  workdir_lock.check_free(workdir)
  lock = workdir_lock.take(workdir)
except workdir_lock.WorkdirInUse as e:
  sys.exit(f"error: {e}")
first = not goodput.read(workdir)["attempts"]
with lock, goodput.AttemptLog(workdir, 0 if first else 1, 12, min_interval_s=0) as log:
  for step in range(1 if first else 2, 13):
    # Recorded before it is printed: the fake gcloud plays its event once the step is printed,
    # and a kill between the two left the record at step 0 for the launcher's "at about step".
    log.step(step, saved=True)
    print(f"step {step}/12", flush=True)
    if first:
      time.sleep(120)
"""


def test_a_job_killed_on_a_vm_that_is_gone_resumes_on_the_next_one(tmp_path):
  """SIGKILL for maintenance on a workdir mounted on both (an absolute path): the lock names the
  first VM's host; the launcher, which deleted that VM, hands its holder to the restart on the
  next VM (another host name), which takes the lock over and finishes. It exited 2 ("in use by
  PID ... on host t1v-n-...") and the launcher called it a failure of the run."""
  job = tmp_path / "stand_in.py"
  job.write_text(STAND_IN)
  python = _executable(tmp_path / "python",
                       f"#!/bin/sh\nexec {sys.executable} {job} \"$@\"\n")
  history = [{"states": ["ACTIVE"], "then": {"at_step": 1, "event": "maintenance",
                                             "signal": "KILL"}},
             {"states": ["ACTIVE"]}]
  result, calls = _queued_up(tmp_path, history, "--recover", python=str(python))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr
  hosts = (tmp_path / "gcloud" / "hosts.log").read_text().split()
  first, second = hosts[2], hosts[5]
  assert re.fullmatch(r"t1v-n-[0-9a-f]{8}-w-0", first) and first != second
  log = (tmp_path / "gcloud" / "home" / "vit" / "vit_jax" / "logs" / "train.log").read_text()
  assert re.search(rf"^(WARNING:root:)?took over the lock of process \d+ on {first} \(.+/run/"
                   r"lock, held since .+\), which the launcher restarting this run says is "
                   r"gone$", log, re.M), log
  assert "under maintenance (node vit) at about step 1" in result.stdout
  assert re.search(r"^\[[\d :-]+\] finished at step 12", result.stdout, re.M)
  [_, restart] = [c for c in calls if "vit_jax.tools.train" in c]
  assert "VIT_WORKDIR_LOCK_HANDOVER=" in restart and first in restart
  assert not (tmp_path / "run" / "lock").exists()


def test_watch_waits_for_a_queued_resource_still_waiting_and_starts_the_job(tmp_path):
  """`up --queued --recover` stopped (Ctrl-C) while the request waited for capacity: `watch`
  waits for it too and starts the job, instead of deleting the request and queueing anew."""
  env, folder = scripted_gcloud(tmp_path)
  (folder / "history.json").write_text(json.dumps(
      [{"states": ["WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "ACTIVE"]}]))
  fake = [sys.executable, "-S", str(REPO / "tests" / "fake_gcloud.py")]
  subprocess.run([*fake, "compute", "tpus", "queued-resources", "create", "vit", "--node-id=vit"],
                 env=env, check=True, timeout=60)
  job = tmp_path / "job.py"
  job.write_text("import os, sys\nfrom vit_jax import goodput\n"
                 "workdir = sys.argv[sys.argv.index('--workdir') + 1]\n"
                 "os.makedirs(workdir, exist_ok=True)\n"
                 "with goodput.AttemptLog(workdir, 0, 2) as log:\n"
                 "  log.step(1)\n  log.step(2, saved=True)\n")
  python = _executable(tmp_path / "python",
                       f"#!/bin/sh\nexec {sys.executable} {job} \"$@\"\n")
  watched = launch("tpu_vm.py", "watch", "--poll-seconds", "0.05", *QUEUED, "--accelerator-type",
                   "v5litepod-8", "--config", "quickstart", "--workdir", str(tmp_path / "run"),
                   env=env | {"FAKE_GCLOUD_PYTHON": str(python)})
  assert watched.returncode == 0, watched.stdout + watched.stderr
  assert "queued resource vit is not active yet: waiting, then starting the job" in watched.stdout
  assert re.search(r"^\[[\d :-]+\] finished at step 2", watched.stdout, re.M)
  calls = (folder / "gcloud.log").read_text().splitlines()
  assert sum("queued-resources create" in c for c in calls) == 1  # The one made above.
  assert not any("delete" in c for c in calls)
