"""The README's contract, for every console script setup.py installs: an input error is exit
status 2 and one `error:` line on stderr (no traceback, no log lines above it). The table
below must name every command, so that a new one cannot go unchecked."""
import ast
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, cpu_env

MISSING = "/nonexistent/checkpoint.npz"


def console_scripts() -> dict[str, str]:
  """{command: module} from setup.py's entry points."""
  tree = ast.parse((REPO / "setup.py").read_text())
  [entries] = [v for node in ast.walk(tree) if isinstance(node, ast.Dict)
               for k, v in zip(node.keys, node.values)
               if isinstance(k, ast.Constant) and k.value == "console_scripts"]
  return {e.value.split("=")[0]: e.value.split("=")[1].split(":")[0] for e in entries.elts}


def input_errors(tmp) -> dict[str, list[tuple[str, list[str], str]]]:
  """Per command: (what is wrong, its arguments, what the one line must name)."""
  image = tmp / "image.png"
  from PIL import Image
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
  return {
      "vit-train": [
          ("missing checkpoint", ["--config", "quickstart", "--workdir", str(tmp / "w1"),
                                  f"--config.pretrained={MISSING}"], MISSING),
          ("malformed --config NAME:ARG", ["--config", "quickstart:fast", "--workdir",
                                           str(tmp / "w2")], "quickstart:fast")],
      "vit-fewshot": [("missing checkpoint", [MISSING, "--datasets=fashion_mnist"], MISSING)],
      "vit-transfer": [("missing checkpoint", [MISSING, "--suite", "fashion_mnist",
                                               "--out_dir", str(tmp / "t")], MISSING)],
      "vit-export": [("missing checkpoint", [MISSING, str(tmp / "out.npz")], MISSING)],
      "vit-predict": [("missing checkpoint", [MISSING, str(image)], MISSING)],
      "vit-zoo": [("missing checkpoint", ["fetch", "S_16", "no-such-file", "--zoo_dir",
                                          str(tmp / "zoo")], str(tmp / "zoo"))],
      "vit-inspect": [("missing checkpoint", [MISSING], MISSING)],
  }


@pytest.mark.slow
def test_every_command_answers_an_input_error_with_one_line_and_status_2(tmp_path):
  cases = input_errors(tmp_path)
  assert sorted(cases) == sorted(console_scripts()), "add the new command to input_errors()"
  bin_dir = pathlib.Path(sys.executable).parent  # The venv's, where the scripts are.
  procs = {(cmd, what): (subprocess.Popen([str(bin_dir / cmd), *args], env=cpu_env(),
                                          cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True), named)
           for cmd, errors in cases.items() for what, args, named in errors}
  wrong = []
  for (cmd, what), (proc, named) in procs.items():
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    if proc.returncode != 2 or len(lines) != 1 or not re.match(r"error: .*" + re.escape(named),
                                                               lines[0]):
      wrong.append(f"{cmd} ({what}): status {proc.returncode}, stderr:\n{err[-1500:]}")
  assert not wrong, "\n\n".join(wrong)

