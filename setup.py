"""vit_jax: Vision Transformer (ViT) and hybrid ResNet+ViT in JAX/Flax."""
import setuptools

# The one record of where the project lives: the notebooks' install cell and the README's
# "Open in Colab" links are checked against it (tests/test_install.py).
URL = "https://github.com/vit-jax/vit_jax"

# Ranges, not pins: requirements.lock / requirements-test.lock hold the exact versions the
# tests passed with (CONTRIBUTING.md, "Refreshing the lock"). An upper bound stands only where
# the maintainers have announced that their next major release breaks the API used here:
INSTALL_REQUIRES = [
    # JAX versions 0.X.Y by effort (docs.jax.dev, "API compatibility"): a new X "will
    # introduce major breaking changes". Tested: 0.10 (the newest for Python 3.11) and, for
    # the model, checkpoint and training tests, 0.12 with flax 0.12.12 (Python 3.12).
    "jax>=0.10,<0.13",
    "flax>=0.12",
    "optax",
    # orbax-checkpoint 1.0 moves its V1 API to the top-level package, replacing the
    # CheckpointManager / `args` API (V0) that vit_jax/train/loop.py uses.
    "orbax-checkpoint<1",
    "clu>=0.0.12",
    # clu imports tensorboard and TFDS writes with importlib_resources; neither is declared.
    "tensorboard",
    "importlib_resources",
    "ml-collections",
    # TensorFlow only feeds tf.data and reads gs:// paths (tf.io.gfile, through etils.epath):
    # the CPU build, where there is one.
    "tensorflow-cpu>=2.21; platform_system != 'Darwin'",
    "tensorflow>=2.21; platform_system == 'Darwin'",
    "tensorflow-datasets>=4.9",
    "numpy",
    "scipy",
    "pillow",
    "matplotlib>=3.6",  # vit_jax/figures.py: Figure(layout=...), matplotlib.colormaps, legend ncols.
    "tqdm",
    # Checkpoints from the Hugging Face Hub (`hf-hub:ORG/NAME`): its cache, tokens and offline
    # mode, and safetensors' numpy reader (no torch).
    "huggingface_hub",
    "safetensors",
]

# Serving outside JAX (vit_jax.serving, `vit-export --format`): the SavedModel
# needs only TensorFlow; ONNX comes from the TFLite model through tf2onnx, whose
# UnsortedSegmentProd handler vit_jax/serving/onnx.py replaces (1.17 tested), and is run
# with onnxruntime; LiteRT is the TFLite interpreter now that tf.lite.Interpreter is deprecated.
EXPORT = ["tf2onnx>=1.17", "onnx", "onnxruntime", "ai-edge-litert"]

EXTRAS = {
    "export": EXPORT,
    "test": [
        "pytest",
        # The suite runs on two workers (pytest.ini): CI's two cores, mostly waiting on processes.
        "pytest-xdist",
        # The notebooks are executed in the tests.
        "nbclient",
        "nbformat",
        "ipykernel",
        # timm is the reference the checkpoint tests compare against. torchvision pins the
        # torch release it was built with, so the two always come as a matching pair.
        "torch>=2.14",
        "torchvision>=0.29",
        "timm",
        # transformers' ViT: the Hub loader's transformers layout is checked against its forward.
        "transformers",
        # OpenCLIP's own layout (open_clip_model.safetensors) is checked against encode_image.
        "open-clip-torch",
        # The serving formats are tested against JAX.
        *EXPORT,
        # `vit-train --compile_only` and its tests compile for TPU slices on any Linux
        # machine: libtpu, at the release jax's tpu extra pins.
        "jax[tpu]",
    ],
    # JAX for NVIDIA GPUs: CUDA 13 needs driver 580 or newer; CUDA 12 runs on 525 and newer
    # (Colab's GPU runtimes had 550 in 2025). The notebooks' install cell picks by driver.
    "gpu": ["jax[cuda13]"],
    "gpu-cuda12": ["jax[cuda12]"],
    "tpu": ["jax[tpu]"],
}

setuptools.setup(
    name="vit_jax",
    version="0.1.0",
    description="Vision Transformer and hybrid ResNet+ViT in JAX/Flax: models, "
    "checkpoints, training, evaluation.",
    url=URL,
    # vit_jax.* takes in vit_jax.configs, which `--config NAME` reads from an installed
    # wheel as from a clone (tests/test_e2e_install.py builds one and checks).
    packages=setuptools.find_packages(include=["vit_jax", "vit_jax.*"]),
    # The AugReg files' Hub copies, which `augreg:NAME` and `vit-zoo` read (CONTRIBUTING.md).
    package_data={"vit_jax.checkpoint": ["augreg_hub.csv"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "vit-train=vit_jax.tools.train:main",
            "vit-fewshot=vit_jax.tools.fewshot:main",
            "vit-transfer=vit_jax.tools.transfer:main",
            "vit-export=vit_jax.tools.export:main",
            "vit-predict=vit_jax.tools.predict:main",
            "vit-zoo=vit_jax.tools.zoo:main",
            "vit-inspect=vit_jax.tools.inspect_checkpoint:main",
        ],
    },
)
