"""launch/gke.py: the JobSet manifest of every accelerator, validated against JobSet's own CRD
schema (kubernetes-sigs/jobset v0.12.0, tests/data/); refusals before anything runs; the
follower against a scripted cluster (tests/fake_kubectl.py: no network), through capacity
that comes late or never, an image that cannot be pulled, a Spot eviction and the restart
JobSet makes, and restarts exhausted; a real tiny vit-train run through a restart to the final
evaluation of a run never interrupted."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

import fake_kubectl
from helpers import (HEAD_TOO_BIG, REPO, TINY_CONFIG, cpu_env, finish, interrupted_at, launch,
                     needs_libtpu, read_scalars, read_until, run_inspect)
from launch import accelerators, gke

CLUSTER = ["--name", "vit", "--cluster", "c", "--location", "us-central1"]
TIME = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")


def up_args(tpu_type: str, *extra: str, workdir: str = "gs://bucket/run",
            config: str = "pretrain:b16,i21k") -> list[str]:
  return ["up", *CLUSTER, "--tpu-type", tpu_type, "--config", config, "--workdir", workdir,
          "--image", "us-docker.pkg.dev/p/r/vit_jax", "--no-preflight", *extra]


def dry_manifest(*args: str) -> tuple[list[str], dict]:
  """`up --dry-run`'s `#` lines (the commands) and its manifest."""
  result = launch("gke.py", *args, "--dry-run")
  assert result.returncode == 0, result.stderr
  comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
  return comments, yaml.safe_load(result.stdout)


def pod_of(manifest: dict) -> dict:
  return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


# GKE's plan-tpus page: accelerator label, machine type, topology, chips per VM, VMs.
@pytest.mark.parametrize("tpu_type,label,machine,topology,per_vm,vms", [
    ("tpu7x-8", "tpu7x", "tpu7x-standard-4t", "2x2x1", 4, 1),
    ("tpu7x-16", "tpu7x", "tpu7x-standard-4t", "2x2x2", 4, 2),
    ("tpu7x-128", "tpu7x", "tpu7x-standard-4t", "4x4x4", 4, 16),
    ("v6e-8", "tpu-v6e-slice", "ct6e-standard-8t", "2x4", 8, 1),
    ("v6e-64", "tpu-v6e-slice", "ct6e-standard-4t", "8x8", 4, 16),
    ("v5litepod-1", "tpu-v5-lite-podslice", "ct5lp-hightpu-1t", "1x1", 1, 1),
    ("v5litepod-16", "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", "4x4", 4, 4),
    ("v5p-8", "tpu-v5p-slice", "ct5p-hightpu-4t", "2x2x1", 4, 1),
    ("v5p-32", "tpu-v5p-slice", "ct5p-hightpu-4t", "2x2x4", 4, 4),
    ("v4-32", "tpu-v4-podslice", "ct4p-hightpu-4t", "2x2x4", 4, 4),
])
@pytest.mark.parametrize("extra", [[], ["--spot", "--num-slices", "2", "--max-restarts", "3"]])
def test_every_accelerators_manifest_is_a_valid_jobset(tpu_type, label, machine, topology,
                                                       per_vm, vms, extra):
  tpu = accelerators.resolve(tpu_type)
  assert (tpu.label, tpu.machine_type, tpu.topology, tpu.chips_per_vm, tpu.vms) == (
      label, machine, topology, per_vm, vms)
  args = gke.parser().parse_args(up_args(tpu_type, *extra))
  manifest = yaml.safe_load(yaml.safe_dump(gke.manifest(args, tpu)))  # As --dry-run prints it.
  assert fake_kubectl.validation_errors(manifest) == []
  assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
  assert manifest["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  [rjob] = manifest["spec"]["replicatedJobs"]
  slices = 2 if extra else 1
  assert rjob["replicas"] == slices
  job = rjob["template"]["spec"]
  assert job["parallelism"] == job["completions"] == vms and job["backoffLimit"] == 0
  pod = pod_of(manifest)
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                 "cloud.google.com/gke-tpu-topology": topology,
                                 **({"cloud.google.com/gke-spot": "true"} if extra else {})}
  assert bool(pod.get("tolerations")) == bool(extra)
  [container] = pod["containers"]
  assert container["resources"]["limits"] == {"google.com/tpu": per_vm}
  assert container["command"][:5] == ["vit-train", "--config", "pretrain:b16,i21k",
                                      "--workdir", "gs://bucket/run"]
  assert ("--distributed" in container["command"]) == (vms * slices > 1)
  env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
  assert ("JAX_COORDINATOR_ADDRESS" in env) == (vms * slices > 1)
  if slices > 1:
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "vit-slice-0-0.vit"
    assert env["MEGASCALE_NUM_SLICES"] == "2" and env["MEGASCALE_PORT"] == "8080"
    assert env["MEGASCALE_SLICE_ID"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/job-index']")
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] == (3 if extra else 20)


def test_the_dry_run_prints_the_manifest_under_the_commands():
  comments, manifest = dry_manifest(*up_args("tpu7x-16", "--spot"))
  assert comments == [
      "# gcloud container clusters get-credentials c --location=us-central1",
      "# kubectl get jobset vit -o json",
      "# kubectl apply -f -  (this manifest on its stdin)",
      "# kubectl get jobset vit -o json",
      "# kubectl get pods -l jobset.sigs.k8s.io/jobset-name=vit -o json"]
  assert fake_kubectl.validation_errors(manifest) == []
  assert pod_of(manifest)["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x2"


def test_the_schema_check_refuses_what_the_api_server_would():
  """The strict CRD schema catches a misspelt field and a wrong type, as `kubectl apply`
  would: the validation above means something."""
  _, manifest = dry_manifest(*up_args("v5litepod-16"))
  manifest["spec"]["failurePolicy"] = {"maxRestart": 3}
  manifest["spec"]["replicatedJobs"][0]["replicas"] = "2"
  errors = fake_kubectl.validation_errors(manifest)
  assert any("'maxRestart' was unexpected" in e for e in errors)
  assert "spec.replicatedJobs.0.replicas: '2' is not of type 'integer'" in errors


def test_the_crd_is_the_named_release():
  text = fake_kubectl.CRD.read_bytes()
  crd = yaml.safe_load(__import__("gzip").decompress(text))
  assert crd["metadata"]["name"] == "jobsets.jobset.x-k8s.io"
  assert "v1alpha2" in [v["name"] for v in crd["spec"]["versions"]]
  assert fake_kubectl.CRD.name == "jobset-v0.12.0-crd.yaml.gz"


def scripted_cluster(root, history: list[dict], python: str | None = None) -> tuple[dict, object]:
  """tests/fake_kubectl.py as `kubectl` and `gcloud` first on PATH, playing `history`."""
  folder = root / "cluster"
  bin_ = folder / "bin"
  bin_.mkdir(parents=True, exist_ok=True)
  fake = REPO / "tests" / "fake_kubectl.py"
  (bin_ / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
  (bin_ / "gcloud").write_text(f'#!/bin/sh\nexec {sys.executable} {fake} --gcloud "$@"\n')
  for tool in ("kubectl", "gcloud"):
    (bin_ / tool).chmod(0o755)
  (folder / "history.json").write_text(json.dumps(history))
  env = cpu_env() | {"PATH": f"{bin_}:{cpu_env()['PATH']}", "FAKE_KUBECTL_DIR": str(folder),
                     "FAKE_KUBECTL_PYTHON": python or sys.executable}
  return env, folder


def stand_in(tmp_path, script: str) -> str:
  """A stand-in for the pods' vit-train (shell)."""
  path = tmp_path / "job"
  path.write_text(f"#!/bin/sh\n{script}\n")
  path.chmod(0o755)
  return str(path)


def events(stdout: str) -> list[str]:
  return [TIME.sub("", line) for line in stdout.splitlines() if TIME.match(line)]


def calls(folder) -> list[str]:
  log = folder / "kubectl.log"
  return log.read_text().splitlines() if log.exists() else []


def test_a_dry_run_runs_nothing(tmp_path):
  env, folder = scripted_cluster(tmp_path, [{}])
  for args in (up_args("tpu7x-16"), ["watch", *CLUSTER], ["logs", *CLUSTER],
               ["delete", *CLUSTER], ["build", "--image", "img"]):
    result = launch("gke.py", *args, "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
  assert calls(folder) == []


def test_build_logs_and_delete_commands():
  build = launch("gke.py", "build", "--image", "img", "--dry-run").stdout.splitlines()
  assert build == [f"docker build --file {REPO}/launch/Dockerfile --tag img {REPO}",
                   "docker push img"]
  logs = launch("gke.py", "logs", *CLUSTER, "--worker", "1", "--dry-run").stdout.splitlines()
  assert logs[1] == ("kubectl logs --follow --tail=100 --prefix -l jobset.sigs.k8s.io/jobset-"
                     "name=vit,jobset.sigs.k8s.io/job-index=0,batch.kubernetes.io/job-completion"
                     "-index=1 -c vit")
  delete = launch("gke.py", "delete", *CLUSTER, "--project", "my-proj", "--dry-run").stdout
  assert delete.splitlines() == [
      "gcloud container clusters get-credentials c --location=us-central1 --project=my-proj",
      "kubectl delete jobset vit"]


def test_the_dockerfile_installs_the_lock_with_jax_tpu():
  text = (REPO / "launch" / "Dockerfile").read_text()
  assert 'uv pip install --system --no-cache -r requirements.lock -e ".[tpu]"' in text
  assert "FROM python:3.11" in text  # The lock's Python.
  ignored = (REPO / "launch" / "Dockerfile.dockerignore").read_text().split()
  assert ".venv" in ignored and ".git" in ignored


@pytest.mark.parametrize("change,message", [
    (["--tpu-type", "v9-8"], "--tpu-type 'v9-8': not a GKE TPU type; known: v4-N"),
    (["--tpu-type", "tpu7x-12"], "--tpu-type tpu7x-12: tpu7x slices count TensorCores: 8, 16"),
    (["--workdir", "runs/b16"], "--workdir runs/b16: a pod restarted on another node"),
    (["--config", "/tmp/elsewhere.py"], "--config /tmp/elsewhere.py"),
    (["--num-slices", "0"], "argument --num-slices: give 1 or more, not 0"),
    (["--poll-seconds", "0"], "argument --poll-seconds: give a number of seconds above 0"),
    (["--name", "Vit_B16"], "'Vit_B16' is no JobSet name here"),
])
def test_bad_arguments_stop_before_anything_runs(tmp_path, change, message):
  env, folder = scripted_cluster(tmp_path, [{}])
  (tmp_path / "elsewhere.py").write_text("")
  result = launch("gke.py", *up_args("v5litepod-16"), *change, env=env)
  assert result.returncode == 2, result.stderr
  assert message in result.stderr.splitlines()[-1]
  assert calls(folder) == []


def gke_up(tmp_path, history, *extra, python=None, timeout=120):
  env, folder = scripted_cluster(tmp_path, history, python)
  result = launch("gke.py", *up_args("v5litepod-8", "--poll-seconds", "0.05", *extra,
                                     workdir=str(tmp_path / "run"), config="quickstart"),
                  env=env, timeout=timeout)
  return result, folder


def test_pending_then_running_then_finished(tmp_path):
  job = stand_in(tmp_path, "echo 'step 1/12 (8.3%)' >&2; sleep 3")
  result, folder = gke_up(tmp_path, [{"pending": 3}], python=job)
  assert result.returncode == 0, result.stderr
  told = events(result.stdout)
  assert told[0] == ("pods: 1 pending for capacity (Unschedulable: 0/3 nodes are available: 3 "
                     "Insufficient google.com/tpu. preemption: 0/3 nodes are available: 3 No "
                     "preemption victims found for incoming pod.)")
  assert told[1:3] == ["pods: 1 scheduled", "pods: 1 running"]
  assert told[-1].startswith("finished at step 0")
  record = json.loads((tmp_path / "run" / "goodput.json").read_text())
  [wait] = record["capacity"]
  assert wait["why"] == "the first request" and wait["active"] > wait["requested"]
  assert "apply -f -" in calls(folder)


def test_an_image_that_cannot_be_pulled_ends_with_one_line(tmp_path):
  result, folder = gke_up(tmp_path, [{"image": "ErrImagePull"}])
  assert result.returncode == 1
  [line] = [e for e in result.stderr.splitlines() if e.startswith("error:")]
  assert line.startswith("error: the nodes cannot pull image us-docker.pkg.dev/p/r/vit_jax "
                         "(ImagePullBackOff: Back-off pulling image")
  assert "python launch/gke.py build --image us-docker.pkg.dev/p/r/vit_jax" in line
  assert "pods: 1 image not pulled (ErrImagePull)" in events(result.stdout)
  assert not any(c.startswith("delete") for c in calls(folder))


def test_a_job_exhausting_its_restarts_fails_with_the_reason(tmp_path):
  job = stand_in(tmp_path, "echo 'step 1/12 (8.3%)' >&2; exit 3")
  result, folder = gke_up(tmp_path, [{}], "--max-restarts", "1", python=job)
  assert result.returncode == 1
  told = events(result.stdout)
  assert "pods: 1 failed (Error: exit code 3)" in told
  assert ("JobSet restarting (restart 1 of 1): pod vit-slice-0-0-" in "\n".join(told))
  [line] = [e for e in result.stderr.splitlines() if e.startswith("error:")]
  assert line.startswith("error: JobSet vit failed (ReachedMaxRestarts: jobset failed due to "
                         "reaching max number of restarts) at step 0; the last pod: pod vit-")
  assert "(failed (Error: exit code 3))" not in line and "failed (Error: exit code 3)" in line


def test_an_eviction_mid_run_is_restarted_by_the_jobset(tmp_path):
  job = stand_in(tmp_path, "for i in 1 2 3; do echo \"step $i/3\" >&2; sleep 0.2; done")
  history = [{"then": {"at_step": 2, "event": "evict", "signal": "KILL"}}, {"pending": 2}]
  result, folder = gke_up(tmp_path, history, python=job)
  assert result.returncode == 0, result.stdout + result.stderr
  text = "\n".join(events(result.stdout))
  assert re.search(r"^pods: 1 evicted \(EvictionByEvictionAPI: Eviction API: evicting\)$",
                   text, re.M)
  assert re.search(r"^JobSet restarting \(restart 1 of 20\): pod vit-slice-0-0-\w{5} evicted "
                   r"\(EvictionByEvictionAPI: Eviction API: evicting\) at about step 0$", text,
                   re.M)
  assert text.index("JobSet restarting") < text.index("pending for capacity")
  record = json.loads((tmp_path / "run" / "goodput.json").read_text())
  assert [c["why"].split(" (")[0] for c in record["capacity"]] == [
      "the first request", "pod vit-slice-0-0-" + record["capacity"][1]["why"][18:23] + " evicted"]


def up_until(tmp_path, env: dict, text: str) -> tuple[int, str]:
  """`up` interrupted (Ctrl-C) once a line holds `text`: its exit status and what it said
  after."""
  return interrupted_at([sys.executable, str(REPO / "launch" / "gke.py"),
                         *up_args("v5litepod-8", "--poll-seconds", "0.05",
                                  workdir=str(tmp_path / "run"), config="quickstart")],
                        text, env=env, cwd=REPO)


def test_capacity_that_never_comes_ctrl_c_leaves_the_jobset_and_watch_picks_it_up(tmp_path):
  env, folder = scripted_cluster(tmp_path, [{"pending": 10**9}])
  code, rest = up_until(tmp_path, env, "pending for capacity")
  assert code == 130
  assert "stopped following: JobSet vit goes on. Follow it again: python launch/gke.py watch " \
         "--name vit --cluster c --location us-central1" in rest
  assert not any(c.startswith("delete") for c in calls(folder))
  (folder / "history.json").write_text(json.dumps([{"pending": 5}]))  # The capacity comes.
  state = json.loads((folder / "state.json").read_text())
  for pod in state["pods"].values():
    pod["gets"] = 0
  (folder / "state.json").write_text(json.dumps(state))
  env["FAKE_KUBECTL_PYTHON"] = stand_in(tmp_path, "echo 'step 1/1' >&2")
  watched = launch("gke.py", "watch", *CLUSTER, "--poll-seconds", "0.05", env=env, timeout=120)
  assert watched.returncode == 0, watched.stderr
  told = events(watched.stdout)
  assert told[0].startswith("pods: 1 pending for capacity") and "pods: 1 running" in told
  assert told[-1].startswith("finished at step 0")


def test_watch_over_a_running_jobset_records_no_wait_again(tmp_path, children):
  """Ctrl-C once the pods run, then `watch`: the first wait is in goodput.json once."""
  go = tmp_path / "go"  # The stand-in runs until the test creates it.
  env, folder = scripted_cluster(tmp_path, [{"pending": 2}], python=stand_in(
      tmp_path, f"while [ ! -e {go} ]; do sleep 0.1; done"))
  try:
    assert up_until(tmp_path, env, "pods: 1 running")[0] == 130
    watch = children(subprocess.Popen(
        [sys.executable, str(REPO / "launch" / "gke.py"), "watch", *CLUSTER, "--poll-seconds",
         "0.05"], env=env, stdout=subprocess.PIPE, cwd=REPO))
    first, _ = read_until(watch, TIME.match)
  finally:
    go.touch()  # Whatever happened: the stand-in would loop for ever.
  finish(watch, 120)
  assert watch.returncode == 0
  assert TIME.sub("", first).strip() == "pods: 1 running"
  record = json.loads((tmp_path / "run" / "goodput.json").read_text())
  assert [c["why"] for c in record["capacity"]] == ["the first request"]


HISTORY = [{"pending": 2, "then": {"at_step": 5, "event": "preempt", "signal": "TERM"}},
           {"pending": 3}]


@pytest.fixture(scope="module")
def recovered(tmp_path_factory, dataset, uninterrupted_run):
  """A real tiny vit-train run through a Spot preemption and JobSet's restart; and a run never
  interrupted's final evaluation."""
  root = tmp_path_factory.mktemp("gke")
  env, folder = scripted_cluster(root, HISTORY)
  workdir = root / "run"
  result = launch("gke.py", *up_args(
      "v5litepod-8", "--spot", "--poll-seconds", "0.5", "--", f"--config.data.name={dataset[0]}",
      f"--config.data.data_dir={dataset[1]}", workdir=str(workdir),
      config=str(REPO / "tests" / "tiny_config.py")), env=env, timeout=400)
  return result, workdir, uninterrupted_run


@pytest.mark.slow
def test_a_preempted_run_resumes_to_an_uninterrupted_runs_result(recovered, capsys):
  result, workdir, reference = recovered
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  final = read_scalars(workdir, "eval_accuracy")
  assert max(final) == 12 and final[12] == reference["accuracy"]
  np.testing.assert_allclose(read_scalars(workdir, "eval_loss")[12], reference["loss"],
                             atol=1e-5)
  text = "\n".join(events(result.stdout))
  assert re.search(r"^pods: 1 preempted \(TerminationByKubelet: Pod was terminated in response "
                   r"to imminent node shutdown\.\)$", text, re.M)
  restart = re.search(r"^JobSet restarting \(restart 1 of 20\): pod vit-slice-0-0-\w+ preempted "
                      r".* at about step (\d+)$", text, re.M)
  assert restart and 5 <= int(restart.group(1)) < 12
  assert re.search(r"^resumed at step (\d+)$", text.split("JobSet restarting")[1], re.M)
  assert text.splitlines()[-1].startswith("finished at step 12")
  record = json.loads((workdir / "goodput.json").read_text())
  assert [a["outcome"] for a in record["attempts"]] == ["stopped", "finished"]
  assert record["attempts"][1]["start_step"] == record["attempts"][0]["last_step"]
  assert [c["why"].split(" (")[0].split(" pod ")[0] for c in record["capacity"]] == [
      "the first request", "pod vit-slice-0-0-" + record["capacity"][1]["why"][18:23] +
      " preempted"]
  rc, out, _ = run_inspect(capsys, workdir)
  assert rc == 0 and re.search(r"^Goodput: 2 attempts, step 12 of 12, finished", out, re.M)
  assert re.search(r"^  waiting for capacity: .+ \(\d+\.\d%\)$", out, re.M)


@needs_libtpu
def test_the_preflight_compile_refuses_a_config_that_does_not_fit_before_any_kubectl(tmp_path):
  """`up` compiles the config for the slice here first (as tpu_vm.py up does): a head that does
  not fit TPU7x devices' 96 GiB is refused in one line; nothing applied."""
  env, folder = scripted_cluster(tmp_path, [{}])
  args = up_args("tpu7x-8", config=TINY_CONFIG, workdir=str(tmp_path / "run"))
  args.remove("--no-preflight")
  result = launch("gke.py", *args, "--", *HEAD_TOO_BIG, env=env, timeout=600)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "--compile_only --topology tpu7x-8" in result.stderr
  [line] = [e for e in result.stderr.splitlines() if e.startswith("error:")]
  assert line.startswith("error: preflight for tpu7x-8: config.model_name='ViT-Ti_16' with its "
                         "overrides and 134,217,728 classes") and "--no-preflight" in line
  assert calls(folder) == []
