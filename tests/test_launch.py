"""launch/: the commands printed for Cloud TPU VMs and GPU clusters, refusals before anything
is created, and processes and jobs run to their first failure (a real two-process training job
on localhost: test_e2e_distributed.py)."""
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, TINY_CONFIG, cpu_env, launch
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
  return remote[remote.index(".venv/bin/python"):remote.index(">")]


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
  assert remote[remote.index(">"):] == [">", "logs/train.log", "2>&1", "<", "/dev/null", "&"]


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
