"""vit_jax: Vision Transformer (ViT) and hybrid ResNet+ViT in JAX/Flax."""
import setuptools

INSTALL_REQUIRES = [
    "jax>=0.10",
    "flax>=0.12",
    "optax",
    "orbax-checkpoint",
    "clu>=0.0.12",
    # clu imports tensorboard and TFDS writes with importlib_resources; neither is declared.
    "tensorboard",
    "importlib_resources",
    "ml-collections",
    "tensorflow-cpu>=2.21; platform_system != 'Darwin'",
    "tensorflow>=2.21; platform_system == 'Darwin'",
    "tensorflow-datasets>=4.9",
    "einops",
    "numpy",
    "scipy",
    "pillow",
    "matplotlib",
    "tqdm",
]

EXTRAS = {
    "test": [
        "pytest",
        "scikit-learn",
        # The notebooks are executed in the tests.
        "nbclient",
        "nbformat",
        "ipykernel",
        # pip takes these two from this machine's disk; a CPU-only torch alone breaks torchvision.
        "torch==2.14.1",
        "torchvision==0.29.1",
        "timm",
    ],
    "gpu": ["jax[cuda13]"],
    "tpu": ["jax[tpu]"],
}

setuptools.setup(
    name="vit_jax",
    version="0.1.0",
    description="Vision Transformer and hybrid ResNet+ViT in JAX/Flax: models, "
    "checkpoints, training, evaluation.",
    packages=setuptools.find_packages(include=["vit_jax", "vit_jax.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "vit-train=vit_jax.main:run",
            "vit-fewshot=vit_jax.fewshot:run",
            "vit-export=vit_jax.export:run",
            "vit-zoo=vit_jax.zoo:run",
        ],
    },
)
