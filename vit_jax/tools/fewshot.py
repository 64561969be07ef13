"""Few-shot sweeps over checkpoints: `vit-fewshot CKPT... --datasets a,b`.

Checkpoints: released ones on the Hugging Face Hub (`hf-hub:ORG/NAME`, e.g.
hf-hub:google/vit-base-patch16-224-in21k) or by AugReg name (`augreg:NAME`), .npz files (any
layout, local or gs://; `--model` names the architecture, else it is read off the arrays'
shapes), training runs' workdirs (their latest step) or step
directories (the model is read from the run), globs allowed. Each is probed at its own
resolution (unless --image_size) on images preprocessed as its description records (value
range, crop). Writes fewshot.csv, fewshot.md and fewshot.png to --out_dir:
checkpoint x dataset x shots, mean ± std over seeds, beside the rows of earlier sweeps there
(a checkpoint and dataset probed again replaced), so that sweeps one after another or side by
side into one folder add up. A checkpoint that fails to load is reported and the sweep goes on
(exit status 1).
"""
import argparse
import glob

from vit_jax import data  # Its names load when used: not before the checks.
from vit_jax.evaluators import fewshot_lsr
from vit_jax.tools import cli, jobs, logs
from vit_jax.transfer import fewshot_sweep, results


# How this command's flags set the data options that the data pipeline's errors name.
_DATA_OPTIONS = {"name": "--datasets", "data_dir": "--data_dir", "download": "pass --download",
                 "no_download": "no --download", "train_split": "--train_split",
                 "eval_split": "--test_split", "relax_class_mismatch": "",
                 "skip_bad_images": ", or pass --on_bad_image=skip to leave such files out"}


def _ints(s: str) -> list[int]:
  return [int(v) for v in s.split(",")]


def parser() -> argparse.ArgumentParser:
  p = cli.parser("vit-fewshot", __doc__)
  p.add_argument("checkpoints", nargs="+",
                 help="hf-hub:ORG/NAME, augreg:NAME, .npz files, orbax step dirs, or globs")
  p.add_argument("--model", help="architecture of .npz checkpoints, e.g. ViT-B_16 or b16 "
                 "(default: inferred from the arrays)")
  p.add_argument("--datasets", required=True,
                 help="comma-separated TFDS names or image folders (ROOT/<split>/<class>/*)")
  p.add_argument("--data_dir", default=None, help="TFDS data directory")
  p.add_argument("--download", action="store_true", help="let TFDS download missing datasets")
  p.add_argument("--on_bad_image", choices=data.ON_BAD_IMAGE, default="fail",
                 help="image folders' undecodable files: an error, or left out with a warning")
  p.add_argument("--train_split", default="train", help="pool the shots are drawn from")
  p.add_argument("--test_split", default="test")
  p.add_argument("--image_size", type=int, default=None,
                 help="resolution to probe at (default: each checkpoint's own)")
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--shots", type=_ints, default=list(fewshot_lsr.DEFAULT_SHOTS))
  p.add_argument("--seeds", type=int, default=fewshot_lsr.DEFAULT_SEEDS)
  p.add_argument("--l2", type=lambda s: [float(v) for v in s.split(",")],
                 default=list(fewshot_lsr.DEFAULT_L2))
  p.add_argument("--out_dir", default="fewshot_results")
  p.add_argument("--representation", choices=fewshot_lsr.REPRESENTATIONS, default="pre_logits",
                 help="what the probes see: the head's input, or the output tokens' class token, "
                 "patch mean or both (the DINOv2 paper's linear probe: class_token+patch_mean)")
  cli.add_base_flag(p)
  cli.add_verbose_flag(p)
  return p


@cli.command
def main(argv: list[str]) -> int:
  args = parser().parse_args(argv)
  paths = []
  for pattern in args.checkpoints:
    paths += sorted(glob.glob(pattern)) or [pattern]
  cli.check_checkpoints([*paths, args.base or ""])  # Before the library's imports: seconds.
  cli.check_counts(args, dict(shots=1, seeds=1, batch_size=1, image_size=1))
  fewshot_lsr.check_l2(args.l2)
  cli.check_output_dir("--out_dir", args.out_dir)
  cli.check_apart("--out_dir", args.out_dir, {
      "CKPT": paths, "--datasets": args.datasets.split(","), "--data_dir": [args.data_dir],
      "--base": [args.base]})
  outputs = fewshot_sweep.OUTPUTS
  cli.check_owned("--out_dir", args.out_dir, lambda name: results.replaced(name) in outputs,
                  ", ".join(outputs))
  logs.route_logs(verbose=args.verbose)
  logs.start_tensorflow()
  cli.check_not_exported([*paths, args.base or ""])
  try:
    reading = fewshot_lsr.Reading(args.data_dir, args.download, args.on_bad_image)
    _, failures = fewshot_sweep.sweep(
        paths, args.model, args.datasets.split(","), reading, args.train_split,
        args.test_split, args.image_size, args.batch_size, args.shots, args.seeds, args.l2,
        args.out_dir, args.base, args.representation, attempt=jobs.attempt,
        log=lambda line: print(line, flush=True))
  except data.DataOptionError as e:  # A dataset that cannot be read: nothing to probe on.
    return cli.input_error(e.worded(_DATA_OPTIONS))
  print(f"Wrote {args.out_dir}/fewshot.{{csv,md,png}}", flush=True)
  return jobs.finish(failures, "probes")


if __name__ == "__main__":
  main()
