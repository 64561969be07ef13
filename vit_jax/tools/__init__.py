"""The command lines (`vit-train`, `vit-fewshot`, `vit-transfer`, `vit-export`, `vit-predict`,
`vit-zoo`, `vit-inspect`, each also `python -m vit_jax.tools.NAME`): arguments, checks, one
library call, its output. Each module's `main` is its console script; cli.py, logs.py, jobs.py,
console.py and train_flags.py are what they share or split out. Nothing in the library imports
them."""
