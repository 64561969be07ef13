"""The command lines (`vit-train`, `vit-fewshot`, `vit-export`, `vit-predict`, `vit-zoo`,
`vit-inspect`, each also `python -m vit_jax.tools.NAME`): flags in, library calls, reports out.
Nothing in the library imports them."""
