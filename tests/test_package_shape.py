"""The package's shape: imports flow one way (every module of vit_jax/ imports only from its
own part or from the layers below, as the README's code map writes them down), the code map
names every module, and functions stay short."""
import ast
import pathlib
import re
import sys

import pytest

from helpers import REPO

# Bottom to top; parts of one layer do not import each other.
LAYERS = (
    ("config_errors", "cpu_backend", "goodput"),
    ("models", "data", "losses"),
    ("checkpoint",),
    ("evaluators", "serving"),
    ("train",),
    ("configs",),  # The recipes: train's base config, filled in.
    ("transfer",),  # The paper's transfer protocol: runs of the finetune recipe.
    ("explore", "inspection"),  # Notebook and `inspect` support: what the analyses compute ...
    ("figures",),  # ... and how they are drawn.
    ("tools",),  # The command lines: nothing below imports them.
    ("main",),  # `python -m vit_jax.main`, the official repository's command: vit-train.
)
COMMAND_LINES = ("tools", "main")  # Nothing in the library imports them.
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
MODULES = sorted(p for p in (REPO / "vit_jax").rglob("*.py"))


def part(module: str) -> str | None:
  """'vit_jax.train.loop' -> 'train'; None outside the package or for the package itself."""
  names = module.split(".")
  return names[1] if names[0] == "vit_jax" and len(names) > 1 else None


def imported_modules(path: pathlib.Path) -> set[str]:
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      # `from vit_jax import checkpoint` imports the part named by the alias.
      out |= ({f"{node.module}.{a.name}" for a in node.names} if node.module == "vit_jax"
              else {node.module})
  return out


def test_every_part_has_a_layer():
  parts = {p.relative_to(REPO / "vit_jax").parts[0].removesuffix(".py") for p in MODULES}
  assert parts - {"__init__"} == set(LAYER_OF), "place new parts in LAYERS and the code map"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_flow_down(path):
  here = path.relative_to(REPO / "vit_jax").parts[0].removesuffix(".py")
  if here == "__init__":
    return
  upward = [m for m in imported_modules(path)
            if part(m) and part(m) != here and LAYER_OF[part(m)] >= LAYER_OF[here]]
  assert not upward, f"{path.relative_to(REPO)} ({here}, layer {LAYER_OF[here]}) imports {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("def f():\n  from vit_jax.train import loop\n  from vit_jax import tools\n")
  assert imported_modules(bad) == {"vit_jax.train", "vit_jax.tools"}


def test_the_library_imports_no_command_line():
  library = [p for p in MODULES
             if p.relative_to(REPO / "vit_jax").parts[0].removesuffix(".py") not in COMMAND_LINES]
  importers = [str(p.relative_to(REPO)) for p in library
               if any(part(m) in COMMAND_LINES for m in imported_modules(p))]
  assert library and not importers, importers


def test_no_module_shadows_the_standard_library():
  """A file of vit_jax/ run as a script puts its folder first on sys.path: a module named like
  one of the standard library's would then replace it for every import."""
  shadowing = [str(p.relative_to(REPO)) for p in MODULES
               if p.stem in sys.stdlib_module_names or p.parent.name in sys.stdlib_module_names]
  assert not shadowing, shadowing


def test_the_readme_code_map_names_every_module():
  readme = (REPO / "README.md").read_text()
  code_map = readme.split("## Code map", 1)[1].split("\n## ", 1)[0]
  missing = [str(p.relative_to(REPO)) for p in MODULES
             if p.name != "__init__.py" and f"`{p.relative_to(REPO)}`" not in code_map]
  assert not missing, f"add to the README's code map: {missing}"


def test_contributing_names_slowest_tests_that_exist():
  """CONTRIBUTING's list of the slowest tests names tests by file and function: a renamed or
  merged test must be renamed there too."""
  text = (REPO / "CONTRIBUTING.md").read_text()
  named = re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", text)
  assert len(named) >= 15, named
  gone = [f"{f}::{t}" for f, t in named
          if not (REPO / f).is_file() or f"def {t}(" not in (REPO / f).read_text()]
  assert not gone, f"CONTRIBUTING names tests that are not there: {gone}"


def test_functions_stay_short():
  """50 lines at most, in the package, tests, benchmarks and launchers: a longer function
  wants splitting where it changes subject."""
  files = MODULES + sorted(p for d in ("tests", "benchmarks", "launch")
                           for p in (REPO / d).rglob("*.py"))
  long = [f"{p.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
          for p in files for n in ast.walk(ast.parse(p.read_text()))
          if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 50]
  assert not long, long


MAX_PROJECT_IMPORTS = 10


def _is_module(name: str) -> bool:
  path = REPO.joinpath(*name.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def project_imports(path: pathlib.Path) -> set[str]:
  """The package's modules that `path` imports (`from vit_jax.train import a, b` is two),
  TYPE_CHECKING's and functions' imports included: what a reader must know to follow it."""
  here = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out |= {f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
              for a in node.names}
  return {m for m in out if part(m) and m != here}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_more_than_ten_of_the_package(path):
  found = project_imports(path)
  assert len(found) <= MAX_PROJECT_IMPORTS, sorted(found)


SOURCES = sorted(p for d in ("vit_jax", "launch", "benchmarks") for p in (REPO / d).rglob("*.py"))


def continued_lines_lost(source: str) -> list[int]:
  """Lines of docstrings in which a shell command's `\\` ends a line outside a raw string:
  Python joins the two lines, and --help shows one long line with a gap where the break was."""
  tree = ast.parse(source)
  docs = [n.body[0].value for n in ast.walk(tree)
          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
          and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
          and isinstance(n.body[0].value.value, str)]
  return [d.lineno for d in docs
          if "\\\n" in ast.get_source_segment(source, d)
          and not ast.get_source_segment(source, d).lower().startswith("r")]


def test_the_check_sees_a_continued_line_outside_a_raw_docstring():
  command = '"""Usage:\n\n  vit-train --config quickstart \\\n      --workdir /tmp/w\n"""\n'
  assert continued_lines_lost(command) == [1] and continued_lines_lost("r" + command) == []


def test_usage_examples_keep_their_line_breaks():
  """The launchers' and benchmarks' --help print their module docstring: its multi-line
  commands must read there as they do in the source, `\\` and all."""
  lost = {str(p.relative_to(REPO)): lines for p in SOURCES
          if (lines := continued_lines_lost(p.read_text()))}
  assert not lost, f"make these docstrings raw (r\"\"\"): {lost}"
