"""The wheel, as `pip install "vit_jax @ git+URL"` (the Colab cell) builds and installs it,
end to end: built offline from a copy of the working tree, installed alone in a new venv, it
runs configs by name and the finetune notebook's config cell from any working directory."""
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import nbformat
import pytest

from helpers import REPO, cpu_env


def build_wheel(out: pathlib.Path) -> pathlib.Path:
  """vit_jax's wheel, built offline (setuptools and wheel are in the lock) from a copy of the
  working tree, where the build may leave its build/ and *.egg-info."""
  src = out / "src"
  shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
      ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "workdir*", ".whl",
      ".gl"))
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                         "--no-index", "--wheel-dir", str(out), str(src)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  (wheel,) = out.glob("vit_jax-*.whl")
  return wheel


def venv_with(wheel: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
  """A new venv holding the wheel; the packages of this environment are visible to it (a .pth
  line naming their folder, where the editable vit_jax's own .pth hook does not run), the clone
  is not. Returns its python."""
  venv = root / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=300)
  python = venv / "bin" / "python"
  # Installed before the .pth exists, so that pip does not find the editable install there.
  done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                         "--no-deps", "--no-index", str(wheel)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
  pathlib.Path(site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
  return python


# Run in the venv: a config by name, and the finetune notebook's config cell (its training call
# stood in for), each file named on the command line being a cell's source.
IN_THE_VENV = """
import json, pathlib, sys, types
import vit_jax
from vit_jax import configs
print("vit_jax", pathlib.Path(vit_jax.__file__).resolve())
print("config", configs.get_config("finetune:ti16,fashion_mnist").model_name)
ran = {}
loop = types.SimpleNamespace(train_and_evaluate=lambda c, workdir: ran.update(config=c) or {})
checkpoint_model = types.SimpleNamespace(classifier="token", posemb="learn")
namespace = dict(configs=configs, json=json, loop=loop, overrides={},
                 pretrained=types.SimpleNamespace(model=checkpoint_model))
for cell in sys.argv[1:]:
  exec(pathlib.Path(cell).read_text(), namespace)
print("notebook", ran["config"].model_name, ran["config"].data.name, ran["config"].total_steps)
"""


@pytest.mark.slow
def test_the_wheel_alone_runs_configs_by_name_from_anywhere(tmp_path):
  wheel = build_wheel(tmp_path / "dist")
  with zipfile.ZipFile(wheel) as z:
    held = set(z.namelist())
  shipped = (REPO / "vit_jax" / "configs").glob("*.py")
  missing = sorted({f"vit_jax/configs/{p.name}" for p in shipped} - held)
  assert not missing, (f"{wheel.name} lacks {missing}: setup.py's packages must include "
                       "vit_jax.configs (find_packages(include=['vit_jax', 'vit_jax.*']))")
  python = venv_with(wheel, tmp_path)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  code = [c.source for c in nbformat.read(REPO / "notebooks" / "finetune_fewshot.ipynb",
                                          as_version=4).cells if c.cell_type == "code"]
  cells = [code[1], next(c for c in code if "configs.get_config(" in c)]  # Parameters, config.
  for i, source in enumerate(cells):
    (elsewhere / f"cell{i}.py").write_text(source)
  env = {k: v for k, v in cpu_env().items() if k != "PYTHONPATH"} | {
      "VIT_MODEL": "ViT-Ti_16", "VIT_DATASET": "fashion_mnist"}
  run = lambda *args: subprocess.run([python, *args], cwd=elsewhere, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=300)
  done = run("-c", IN_THE_VENV, "cell0.py", "cell1.py")
  assert done.returncode == 0, done.stderr[-3000:]
  out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
  assert pathlib.Path(out["vit_jax"]).is_relative_to(python.parents[1]), (
      f"vit_jax was imported from {out['vit_jax']}, not from the wheel in {python.parents[1]}")
  assert out["config"] == "ViT-Ti_16"
  assert out["notebook"] == "ViT-Ti_16 fashion_mnist 500"
  usage = run("-m", "vit_jax.tools.train", "--help")
  assert usage.returncode == 0, usage.stderr[-3000:]
  assert "--config" in usage.stdout and "--workdir" in usage.stdout
