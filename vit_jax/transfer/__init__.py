"""The paper's transfer evaluation: the fine-tuning protocol as runs (`protocol`), a sweep
that runs them over checkpoints and tasks and records each result (`sweep`), and its report
(`report`). The tasks themselves: vit_jax/data/tasks.py."""
