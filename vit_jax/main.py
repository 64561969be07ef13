r"""`python -m vit_jax.main`, the official google-research/vision_transformer repository's
command, runs `vit-train` with vit-train's flags:

  python -m vit_jax.main --config finetune:b16,cifar10 --workdir /tmp/vit_ft \
    --config.pretrained=hf-hub:google/vit-base-patch16-224-in21k

A command line, as vit_jax/tools' are: importing this module runs nothing.
"""

if __name__ == "__main__":
  from vit_jax.tools.train import main

  main()
