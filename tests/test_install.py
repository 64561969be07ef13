"""Installing: setup.py against the lock files, the README's commands against .ci/run, the
repository URL wherever it is copied, the notebooks' Colab install cell (run here against a
stand-in `google.colab`), and defaults that an anonymous user can read (Hub specs, not the
gs://vit_models bucket; a bucket of one's own read straight from gs://: test_npz.py; the wheel
installed alone: test_e2e_install.py)."""
import ast
import os
import pathlib
import re
import subprocess
import sys
import types

import jax  # noqa: F401 (imported before any stand-in google.colab, which jax looks for)
import nbformat
import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from helpers import REPO


NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# What the locks are compiled for (CONTRIBUTING.md, "Refreshing the lock").
LOCK_ENV = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
  """The arguments setup.py passes to setuptools.setup, read by running it with a stand-in."""
  captured = {}
  stand_in = types.ModuleType("setuptools")
  stand_in.setup = lambda **kwargs: captured.update(kwargs)
  stand_in.find_packages = lambda **kwargs: []
  saved = sys.modules.get("setuptools")
  sys.modules["setuptools"] = stand_in
  try:
    exec(compile((REPO / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "setup"})
  finally:
    if saved is None:
      del sys.modules["setuptools"]
    else:
      sys.modules["setuptools"] = saved
  return captured


def read_lock(name: str) -> tuple[dict[str, Version], set[str]]:
  """A lock file's pins, and the packages uv annotated as asked for by setup.py itself."""
  pins, direct, current = {}, set(), None
  for line in (REPO / name).read_text().splitlines():
    if m := re.match(r"([A-Za-z0-9._-]+)==(\S+)$", line):
      current = canonicalize_name(m.group(1))
      pins[current] = Version(m.group(2))
    elif current and re.match(r"\s+#\s+(via\s+)?vit-jax \(setup\.py\)$", line):
      direct.add(current)
    elif line and not line.startswith(" "):
      assert line.startswith("#"), f"{name}: unexpected line {line!r}"
  return pins, direct


def requirements_for_lock(requirements: list[str]) -> list[Requirement]:
  reqs = [Requirement(r) for r in requirements]
  return [r for r in reqs if r.marker is None or r.marker.evaluate(LOCK_ENV)]


@pytest.mark.parametrize("lock,extras", [("requirements.lock", ()),
                                         ("requirements-test.lock", ("test",))])
def test_lock_matches_setup_py(setup_kwargs, lock, extras):
  wanted = setup_kwargs["install_requires"] + [
      r for e in extras for r in setup_kwargs["extras_require"][e]]
  pins, direct = read_lock(lock)
  reqs = requirements_for_lock(wanted)
  for req in reqs:
    name = canonicalize_name(req.name)
    assert name in pins, f"{lock} lacks {req}: refresh it (CONTRIBUTING.md, 'Refreshing the lock')"
    assert req.specifier.contains(pins[name], prereleases=True), (
        f"{lock} pins {name}=={pins[name]}, outside setup.py's {req}: refresh the lock")
  assert direct == {canonicalize_name(r.name) for r in reqs}, (
      f"{lock} was compiled from another setup.py: refresh it")


def test_locks_agree_with_each_other_and_hold_torch():
  core, _ = read_lock("requirements.lock")
  test, _ = read_lock("requirements-test.lock")
  assert {n: v for n, v in test.items() if n in core} == core
  held = (REPO / ".ci" / "lock-constraints.txt").read_text().splitlines()
  for req in requirements_for_lock([r for r in held if r and not r.startswith("#")]):
    assert req.specifier.contains(test[canonicalize_name(req.name)]), req


def test_readme_installs_from_the_locks_and_ci_runs_its_test_command():
  readme = (REPO / "README.md").read_text()
  first = re.search(r"^python3 -m venv \.venv .*$", readme, re.M).group(0)
  assert "install -r requirements.lock -e ." in first
  test_command = re.search(r"# 2\. Run the tests.*\n(.*)\n", readme).group(1)
  assert test_command.startswith(".venv/bin/uv pip install -r requirements-test.lock -e '.[test]'")
  ci = (REPO / ".ci" / "run").read_text()
  assert ci.split("# The README's test command, exactly.\n")[1].splitlines()[0] == test_command


def test_the_repository_url_is_recorded_once_and_followed(setup_kwargs):
  url = setup_kwargs["url"]
  assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url)
  readme = (REPO / "README.md").read_text()
  for path in NOTEBOOKS:
    colab = (f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}"
             f"/blob/main/notebooks/{path.name}")
    assert f"]({colab})" in readme, f"README: no 'Open in Colab' link to {colab}"
    cell = install_cell(path)
    assert f'REPO_URL = "{url}"' in cell, f"{path.name}: the install cell's URL is not {url}"


def test_the_notebooks_share_one_install_cell():
  """The cell is written once: every notebook carries the same text, URL and all."""
  first, *others = NOTEBOOKS
  for path in others:
    assert install_cell(path) == install_cell(first), (
        f"{path.name}'s install cell differs from {first.name}'s: make the change in one and "
        "copy that cell into the other")


def install_cell(path) -> str:
  code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
  assert "google.colab" in code[0].source and "parameters" in code[1].metadata.get("tags", [])
  return code[0].source


def run_install_cell(path, monkeypatch, in_colab: bool) -> tuple[dict, list]:
  """Executes the notebook's first code cell here; subprocess.run only records commands."""
  commands = []

  def fake_run(command, **kwargs):
    commands.append(command)
    return subprocess.CompletedProcess(command, 0, "", "")

  monkeypatch.setattr(subprocess, "run", fake_run)
  if in_colab:
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
  else:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
  namespace = {"__name__": "__main__"}
  exec(compile(install_cell(path), f"{path.name}[install]", "exec"), namespace)
  return namespace, commands


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_colab_cell_installs_the_project_for_the_runtime(path, setup_kwargs, monkeypatch,
                                                         capsys):
  namespace, commands = run_install_cell(path, monkeypatch, in_colab=True)
  extra = namespace["accelerator_extra"]()  # "" here: this machine has no accelerator.
  spec = f"vit_jax[{extra}]" if extra else "vit_jax"
  assert commands == [[sys.executable, "-m", "pip", "install", "--quiet",
                       f"{spec} @ git+{setup_kwargs['url']}"]]
  assert "jax " in capsys.readouterr().out and "CpuDevice" in str(namespace["jax"].devices())
  install = namespace["install_command"]
  assert install("https://github.com/vit-jax/vit_jax", "tpu") == [
      sys.executable, "-m", "pip", "install", "--quiet",
      "vit_jax[tpu] @ git+https://github.com/vit-jax/vit_jax"]
  assert install("https://github.com/o/r", "gpu-cuda12")[-1] == (
      "vit_jax[gpu-cuda12] @ git+https://github.com/o/r")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outside_colab_the_cell_installs_nothing(path, monkeypatch):
  _, commands = run_install_cell(path, monkeypatch, in_colab=False)
  assert commands == []


def test_outside_colab_the_cell_starts_jax_without_a_word_on_stderr():
  """A user's kernel where libtpu is installed (the `tpu` and test extras) and no TPU is: the
  cell shows the devices, and libtpu's errors (six lines: "Failed to find host bounds ...",
  "INVALID_ARGUMENT: Error: unexpected worker hostname ...") no longer follow. Its own process:
  they are written on file descriptor 2, which a kernel forwards to the cell only at times."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  done = subprocess.run([sys.executable, "-c", install_cell(NOTEBOOKS[0])], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and "CpuDevice" in done.stdout, done.stderr[-2000:]
  assert done.stderr == ""


def test_colab_cell_reads_the_accelerator_off_the_machine(setup_kwargs, monkeypatch, tmp_path):
  namespace, _ = run_install_cell(NOTEBOOKS[0], monkeypatch, in_colab=False)
  extra_of = namespace["accelerator_extra"]

  def machine(name, files):
    root = tmp_path / name
    for rel, text in files.items():
      (root / rel).parent.mkdir(parents=True, exist_ok=True)
      (root / rel).write_text(text)
    return extra_of(f"{root}/")

  gvnic = {"sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0\n",  # Google's network card.
           "sys/bus/pci/devices/0000:00:04.0/device": "0x0042\n"}
  v5e = {"sys/bus/pci/devices/0000:00:05.0/vendor": "0x1ae0\n",
         "sys/bus/pci/devices/0000:00:05.0/device": "0x0063\n"}
  old_driver = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 "
                "22:15:33 UTC 2024\nGCC version:  gcc version 12.3.0\n")
  new_driver = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release "
                "Build  (dvs-builder@U16-I3-B03-4-3)\nGCC version:  gcc version 13.3.0\n")
  assert machine("cpu", gvnic) == ""
  assert machine("tpu", {**gvnic, **v5e}) == "tpu"
  assert machine("tpu_v3", {"dev/accel0": ""}) == "tpu"
  assert machine("t4", {**gvnic, "proc/driver/nvidia/version": old_driver}) == "gpu-cuda12"
  assert machine("h100", {"proc/driver/nvidia/version": new_driver}) == "gpu"
  extras = setup_kwargs["extras_require"]
  assert {"tpu", "gpu", "gpu-cuda12"} <= set(extras)
  assert extras["gpu"] == ["jax[cuda13]"] and extras["gpu-cuda12"] == ["jax[cuda12]"]


HUB_I21K = "hf-hub:google/vit-base-patch16-224-in21k"  # The paper's ViT-B/16, ImageNet-21k.


def test_notebook_defaults_are_released_files_on_the_hub():
  sources = {p.name: [c for c in nbformat.read(p, as_version=4).cells
                      if c.cell_type == "code"][1].source for p in NOTEBOOKS}
  assert f'"VIT_CHECKPOINT", "{HUB_I21K}"' in sources["explore_checkpoint.ipynb"]
  assert '"VIT_IMAGES", "cifar10"' in sources["explore_checkpoint.ipynb"]
  assert f'"VIT_PRETRAINED", "{HUB_I21K}"' in sources["finetune_fewshot.ipynb"]
  assert '"VIT_DATASET", "cifar10"' in sources["finetune_fewshot.ipynb"]


# gs://vit_models has refused anonymous reads since February 2026 (google-research/
# vision_transformer issue 321): nothing a user copies or gets by default may name it. Prose
# may (README text outside code fences, comments, messages, docstrings' sentences), and so may
# these lines, each for its reason: (file, text on the line) -> why.
OLD_BUCKET = "gs://vit_models"
OLD_BUCKET_ALLOWED = {
    ("vit_jax/checkpoint/augreg.py", 'DEFAULT_ZOO_DIR = "gs://vit_models/augreg"'):
        "the AugReg zoo's explicit fallback for files without a Hub copy, read by those who "
        "can (credentials, a mirror: --zoo_dir / $VIT_JAX_AUGREG_DIR name another)",
}


def old_bucket_in_readme(text: str) -> list[tuple[str, str, str]]:
  """(file, where, line) of the lines inside README.md's code fences that name the old bucket."""
  found, fenced = [], False
  for i, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("```"):
      fenced = not fenced
    elif fenced and OLD_BUCKET in line:
      found.append(("README.md", f"line {i}", line))
  return found


def old_bucket_in_notebook(path: pathlib.Path) -> list[tuple[str, str, str]]:
  """The lines of a notebook's code cells that name the old bucket."""
  cells = nbformat.read(path, as_version=4).cells
  return [(f"notebooks/{path.name}", f"cell {c}, line {i}", line)
          for c, cell in enumerate(cells) if cell.cell_type == "code"
          for i, line in enumerate(cell.source.splitlines(), 1) if OLD_BUCKET in line]


def python_defaults(tree: ast.AST):
  """The expressions a module gives as defaults: parameters' defaults, `default=` keywords,
  `.get(key, DEFAULT)` / `os.getenv(key, DEFAULT)` fallbacks, string constants assigned."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      yield from node.args.defaults
      yield from (d for d in node.args.kw_defaults if d is not None)
    elif isinstance(node, ast.Call):
      yield from (k.value for k in node.keywords if k.arg == "default")
      if (isinstance(node.func, ast.Attribute) and len(node.args) > 1 and
          node.func.attr in ("get", "getenv", "setdefault")):
        yield node.args[1]
    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
      yield node.value


def docstring_commands(tree: ast.AST, lines: list[str]):
  """(line number, text) of the command lines in docstrings, as the source spells them: lines
  starting with `vit-` or `python`, and the lines a trailing backslash continues them onto."""
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if not (isinstance(body, list) and body and isinstance(body[0], ast.Expr) and
            isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      continue
    command, doc = False, body[0].value
    for i in range(doc.lineno, doc.end_lineno + 1):
      text = lines[i - 1].strip().lstrip('rRbuU').lstrip('"\'')
      command = text.startswith(("vit-", "python")) or command
      if command:
        yield i, lines[i - 1]
      command = command and text.endswith("\\")


def old_bucket_in_python(name: str, text: str) -> list[tuple[str, str, str]]:
  """A module's defaults and docstring command lines that name the old bucket."""
  tree, lines = ast.parse(text), text.splitlines()
  found = {(n.lineno, lines[n.lineno - 1]) for d in python_defaults(tree) for n in ast.walk(d)
           if isinstance(n, ast.Constant) and OLD_BUCKET in str(n.value)}
  found |= {(i, line) for i, line in docstring_commands(tree, lines) if OLD_BUCKET in line}
  return [(name, f"line {i}", line) for i, line in sorted(found)]


def test_no_default_or_example_reads_the_old_bucket():
  """README's code blocks, the notebooks' code, the launchers, and the package's defaults and
  docstrings' example commands name Hub specs (`hf-hub:ORG/NAME`, `augreg:NAME`), not
  gs://vit_models; a gs:// path of one's own still works (test below)."""
  found = old_bucket_in_readme((REPO / "README.md").read_text())
  for path in NOTEBOOKS:
    found += old_bucket_in_notebook(path)
  for path in sorted((REPO / "launch").glob("*.py")):  # All of it: what launching runs.
    found += [(f"launch/{path.name}", f"line {i}", line) for i, line in
              enumerate(path.read_text().splitlines(), 1) if OLD_BUCKET in line]
  for path in sorted((REPO / "vit_jax").rglob("*.py")):
    found += old_bucket_in_python(str(path.relative_to(REPO)), path.read_text())
  allowed = lambda name, line: any(name == f and snippet in line
                                   for f, snippet in OLD_BUCKET_ALLOWED)
  unexplained = [f"{name}, {where}: {line.strip()}" for name, where, line in found
                 if not allowed(name, line)]
  assert not unexplained, (
      f"{OLD_BUCKET} refuses anonymous reads since February 2026 (google-research/"
      "vision_transformer issue 321): name a Hub spec (hf-hub:ORG/NAME, augreg:NAME) instead, "
      "or add the line to OLD_BUCKET_ALLOWED with its reason:\n" + "\n".join(unexplained))
  stale = [(f, snippet) for f, snippet in OLD_BUCKET_ALLOWED
           if not any(name == f and snippet in line for name, _, line in found)]
  assert not stale, f"OLD_BUCKET_ALLOWED names lines that no longer exist: {stale}"


def test_the_old_bucket_check_sees_defaults_and_examples_not_prose():
  module = (
      '"""Reads gs://vit_models/x.npz, as prose says; an example:\n\n'
      '  vit-train --config finetune:b16,cifar10 \\\n'
      '    --config.pretrained=gs://vit_models/a.npz\n"""\n'
      'import os\n'
      'PATH = "gs://vit_models/b.npz"\n'
      'def f(p="gs://vit_models/c.npz"): raise ValueError("not gs://vit_models/d.npz")\n'
      'os.environ.get("X", "gs://vit_models/e.npz")\n'
      'parser.add_argument("--p", default="gs://vit_models/f.npz")\n')
  found = old_bucket_in_python("m.py", module)
  assert [(where, re.search(r"vit_models/(\w)", line)[1]) for _, where, line in found] == [
      ("line 4", "a"), ("line 7", "b"), ("line 8", "c"), ("line 9", "e"), ("line 10", "f")]
  readme = "gs://vit_models prose\n```bash\nvit-inspect gs://vit_models/x.npz\n```\n"
  assert old_bucket_in_readme(readme) == [
      ("README.md", "line 3", "vit-inspect gs://vit_models/x.npz")]
