"""The ViT paper's published transfer accuracies, to print beside measured ones.

Source: Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale", ICLR 2021 (arXiv:2010.11929v2): Table 2 (comparison with the state of
the art), Table 5 (App. C: ViT-B/16 ... H/14 pre-trained on ImageNet, ImageNet-21k and
JFT-300M) and Table 9 (App. D.10: VTAB-1k per task). Numbers are copied as printed, in
percent. Table 9 prints the 19-task mean only, no group (natural / specialized / structured)
means, so none are recorded here.
"""
import dataclasses

CITATION = ("Dosovitskiy et al., 'An Image is Worth 16x16 Words', ICLR 2021 "
            "(arXiv:2010.11929v2)")
PRETRAININGS = ("imagenet2012", "imagenet21k", "jft300m")


@dataclasses.dataclass(frozen=True)
class PaperResult:
  """One published accuracy: a registry model, its pre-training data and a task."""
  model: str  # This repo's registry name: "ViT-B_16", "ViT-H_14", ...
  pretraining: str  # "imagenet21k" | "jft300m" | "imagenet2012"
  task: str  # vit_jax.data.tasks' name, "imagenet_real", or "vtab1k/mean"
  accuracy: float  # Percent, as printed.
  table: str  # E.g. "ViT paper, Table 2".
  note: str = ""  # Spread over runs, fine-tuning resolution.


# --- Table 2: mean ± std over three fine-tuning runs --------------------------------------

_T2_COLUMNS = (("ViT-H_14", "jft300m"), ("ViT-L_16", "jft300m"), ("ViT-L_16", "imagenet21k"))
_T2_ROWS = (  # task, then (mean, std) per column of _T2_COLUMNS.
    ("paper/imagenet2012", (88.55, 0.04), (87.76, 0.03), (85.30, 0.02)),
    ("imagenet_real", (90.72, 0.05), (90.54, 0.03), (88.62, 0.05)),
    ("paper/cifar10", (99.50, 0.06), (99.42, 0.03), (99.15, 0.03)),
    ("paper/cifar100", (94.55, 0.04), (93.90, 0.05), (93.25, 0.05)),
    ("paper/oxford_iiit_pet", (97.56, 0.03), (97.32, 0.11), (94.67, 0.15)),
    ("paper/oxford_flowers102", (99.68, 0.02), (99.74, 0.00), (99.61, 0.02)),
    ("vtab1k/mean", (77.63, 0.23), (76.28, 0.46), (72.72, 0.21)),
)
# Sec. 4.1: "For ImageNet results in Table 2, we fine-tuned at higher resolution: 512 for
# ViT-L/16 and 518 for ViT-H/14, and also used Polyak & Juditsky (1992) averaging".
_T2_IMAGENET_RES = {"ViT-H_14": 518, "ViT-L_16": 512}

# --- Table 5: fine-tuned at 384 px; H/14 has no ImageNet-pre-trained entry ("-") -----------

_T5_MODELS = ("ViT-B_16", "ViT-B_32", "ViT-L_16", "ViT-L_32", "ViT-H_14")
_T5_ROWS = {  # pretraining -> (task, accuracy per model of _T5_MODELS), in the printed order.
    "imagenet2012": (
        ("paper/cifar10", 98.13, 97.77, 97.86, 97.94, None),
        ("paper/cifar100", 87.13, 86.31, 86.35, 87.07, None),
        ("paper/imagenet2012", 77.91, 73.38, 76.53, 71.16, None),
        ("imagenet_real", 83.57, 79.56, 82.19, 77.83, None),
        ("paper/oxford_flowers102", 89.49, 85.43, 89.66, 86.36, None),
        ("paper/oxford_iiit_pet", 93.81, 92.04, 93.64, 91.35, None),
    ),
    "imagenet21k": (
        ("paper/cifar10", 98.95, 98.79, 99.16, 99.13, 99.27),
        ("paper/cifar100", 91.67, 91.97, 93.44, 93.04, 93.82),
        ("paper/imagenet2012", 83.97, 81.28, 85.15, 80.99, 85.13),
        ("imagenet_real", 88.35, 86.63, 88.40, 85.65, 88.70),
        ("paper/oxford_flowers102", 99.38, 99.11, 99.61, 99.19, 99.51),
        ("paper/oxford_iiit_pet", 94.43, 93.02, 94.73, 93.09, 94.82),
    ),
    "jft300m": (
        ("paper/cifar10", 99.00, 98.61, 99.38, 99.19, 99.50),
        ("paper/cifar100", 91.87, 90.49, 94.04, 92.52, 94.55),
        ("paper/imagenet2012", 84.15, 80.73, 87.12, 84.37, 88.04),
        ("imagenet_real", 88.85, 86.27, 89.99, 88.28, 90.33),
        ("paper/oxford_flowers102", 99.56, 99.27, 99.56, 99.45, 99.68),
        ("paper/oxford_iiit_pet", 95.80, 93.40, 97.11, 95.83, 97.56),
    ),
}
_T5_NOTE = ("fine-tuned at 384 px; ImageNet results without Table 2's Polyak averaging and "
            "512 px (Table 5 caption)")

# --- Table 9: VTAB-1k, one decimal, 384 px, lr 0.01, 2500 steps (App. B.1.1) ---------------

VTAB_TASKS = (  # Table 9's column order (short names of vit_jax.data.tasks' vtab1k/...).
    "caltech101", "cifar100", "dtd", "oxford_flowers102", "oxford_iiit_pet", "sun397", "svhn",
    "patch_camelyon", "eurosat", "resisc45", "diabetic_retinopathy", "clevr_count",
    "clevr_distance", "dmlab", "dsprites_location", "dsprites_orientation", "kitti_distance",
    "smallnorb_azimuth", "smallnorb_elevation")
_T9_ROWS = (  # model, pretraining, one accuracy per VTAB_TASKS, then the printed mean.
    ("ViT-H_14", "jft300m", (95.3, 85.5, 75.2, 99.7, 97.2, 65.0, 88.9, 83.3, 96.7, 91.4, 76.6,
                             91.7, 63.8, 53.1, 79.4, 63.3, 84.5, 33.2, 51.2), 77.6),
    ("ViT-L_16", "jft300m", (95.4, 81.9, 74.3, 99.7, 96.7, 63.5, 87.4, 83.6, 96.5, 89.7, 77.1,
                             86.4, 63.1, 49.7, 74.5, 60.5, 82.2, 36.2, 51.1), 76.3),
    ("ViT-L_16", "imagenet21k", (90.8, 84.1, 74.1, 99.3, 92.7, 61.0, 80.9, 82.5, 95.6, 85.2,
                                 75.3, 70.3, 56.1, 41.9, 74.7, 64.9, 79.9, 30.5, 41.7), 72.7),
)
_T9_NOTE = "VTAB-1k (1000 training examples), fine-tuned at 384 px"


def _table2() -> list[PaperResult]:
  results = []
  for task, *cells in _T2_ROWS:
    for (model, pretraining), (mean, std) in zip(_T2_COLUMNS, cells):
      note = f"± {std:.2f} over 3 fine-tuning runs"
      if task == "paper/imagenet2012":
        note += f"; fine-tuned at {_T2_IMAGENET_RES[model]} px with Polyak averaging"
      results.append(PaperResult(model, pretraining, task, mean, "ViT paper, Table 2", note))
  return results


def _table5() -> list[PaperResult]:
  return [PaperResult(model, pretraining, task, accuracy, "ViT paper, Table 5", _T5_NOTE)
          for pretraining, rows in _T5_ROWS.items() for task, *accuracies in rows
          for model, accuracy in zip(_T5_MODELS, accuracies) if accuracy is not None]


def _table9() -> list[PaperResult]:
  results = []
  for model, pretraining, accuracies, mean in _T9_ROWS:
    scores = list(zip((f"vtab1k/{t}" for t in VTAB_TASKS), accuracies)) + [("vtab1k/mean", mean)]
    results += [PaperResult(model, pretraining, task, accuracy, "ViT paper, Table 9", _T9_NOTE)
                for task, accuracy in scores]
  return results


RESULTS: tuple[PaperResult, ...] = tuple(_table2() + _table5() + _table9())


def lookup(model: str, task: str, pretraining: str | None = None) -> list[PaperResult]:
  """The paper's entries for a registry model name and a task, of every pre-training unless
  `pretraining` names one; Table 2's before Table 5's and Table 9's."""
  return [r for r in RESULTS if r.model == model and r.task == task and
          (pretraining is None or r.pretraining == pretraining)]
