"""Flax modules of ViT and hybrid ResNet+ViT, and the registry of named models."""
from vit_jax.models.registry import MODEL_CONFIGS, create_model, model_config, resolve_name
from vit_jax.models.posemb import posemb_sincos_2d
from vit_jax.models.vit import Role, VisionTransformer, abstract_params, fitted_size
