"""A sweep's rows merged into results.csv, a Markdown table and a figure: each (checkpoint,
task)'s test accuracy at the learning rate chosen on minival, beside the paper's number for the
same model (paper_results; every pre-training the paper gives, with its table), and VTAB-1k's
group means (natural, specialized, structured) and overall mean, unweighted over tasks as the
paper reports its mean."""
import os
from typing import BinaryIO

from etils import epath
from matplotlib.figure import Figure

from vit_jax.data import tasks
from vit_jax.transfer import paper_results, protocol, results

VTAB_GROUPS = ("natural", "specialized", "structured")


def final_accuracies(rows: list[dict[str, str]]) -> dict[tuple[str, str], tuple[float, str]]:
  """(checkpoint, task) -> (test accuracy, the rate it was trained with)."""
  return {(r["checkpoint"], r["task"]): (float(r["accuracy"]), r["lr"]) for r in rows
          if r["status"] == results.OK and r["phase"] == protocol.FINAL}


def vtab_means(finals: dict[tuple[str, str], tuple[float, str]], ckpt: str) -> dict[str, float]:
  """The groups (and the 19-task mean) whose every task has a result."""
  means = {}
  for group in VTAB_GROUPS + ("vtab1k",):
    names = [n for n in tasks.SUITES["vtab1k"] if group == "vtab1k" or
             tasks.TASKS[n].group == group]
    if all((ckpt, n) in finals for n in names):
      means[group] = sum(finals[ckpt, n][0] for n in names) / len(names)
  return means


def paper(model: str, task: str) -> str:
  """The paper's numbers for a model and task: "88.04 (jft300m, Table 5); ..."."""
  found = paper_results.lookup(model, task) if model else []
  return "; ".join(f"{r.accuracy:.2f} ({r.pretraining}, {r.table.removeprefix('ViT paper, ')})"
                   for r in found)


def markdown(rows: list[dict[str, str]], failures: dict[tuple[str, str], str]) -> str:
  finals = final_accuracies(rows)
  model = {r["checkpoint"]: r.get("model", "") for r in rows}
  group = {r["task"]: r["group"] for r in rows}
  lines = ["| checkpoint | task | group | chosen lr | test accuracy | paper |",
           "|---|---|---|---:|---:|---|"]
  for (ckpt, name), (accuracy, lr) in finals.items():
    lines.append(f"| {ckpt} | {name} | {group[name]} | {lr} | {100 * accuracy:.2f} | "
                 f"{paper(model[ckpt], name)} |")
  for ckpt in dict.fromkeys(c for c, _ in finals):
    for g, mean in vtab_means(finals, ckpt).items():
      cited = paper(model[ckpt], "vtab1k/mean") if g == "vtab1k" else ""
      lines.append(f"| {ckpt} | VTAB-1k {g} mean | | | {100 * mean:.2f} | {cited} |")
  if failures:
    lines += ["", "Failed:"] + [f"- {c} on {t}: {why}" for (c, t), why in failures.items()]
  lines += ["", f"paper: {paper_results.CITATION}, by pre-training data."]
  return "\n".join(lines) + "\n"


def figure(rows: list[dict[str, str]], file: BinaryIO) -> None:
  """Test accuracy per task, one bar per checkpoint."""
  finals = final_accuracies(rows)
  names = list(dict.fromkeys(t for _, t in finals))
  ckpts = list(dict.fromkeys(c for c, _ in finals))
  fig = Figure(figsize=(max(4, 0.6 * len(names) * max(len(ckpts), 1)), 4))
  ax = fig.add_subplot()
  width = 0.8 / max(len(ckpts), 1)
  for i, ckpt in enumerate(ckpts):
    xs = [j + i * width for j, n in enumerate(names) if (ckpt, n) in finals]
    ys = [100 * finals[ckpt, n][0] for n in names if (ckpt, n) in finals]
    ax.bar(xs, ys, width, label=os.path.basename(ckpt.rstrip("/")) or ckpt)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45,
                ha="right")
  ax.set_ylabel("test accuracy (%)")
  if ckpts:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, "no test accuracy yet", ha="center", transform=ax.transAxes)
  fig.tight_layout()
  fig.savefig(file, format="png", dpi=100)


def write(out_dir: str, failures: dict[tuple[str, str], str] | None = None
          ) -> dict[tuple[str, str], str]:
  """results.csv (every task's rows), results.md and results.png in out_dir, from the rows
  there now; failures: more than the rows tell (a checkpoint that could not be read).
  Returns every failure, those of the rows (a task whose last run failed) included."""
  rows = results.read(out_dir)
  if not rows and not failures:
    raise ValueError(f"{out_dir} holds no sweep's rows (<checkpoint>/<task>/{results.ROWS})")
  failures = results.failures(rows) | (failures or {})
  results.write_merged(out_dir, rows)
  with results.replacing(epath.Path(out_dir) / "results.md") as md:
    md.write_text(markdown(rows, failures))
  with results.replacing(epath.Path(out_dir) / "results.png") as png, png.open("wb") as f:
    figure(rows, f)
  return failures
