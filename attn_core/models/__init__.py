"""Model descriptions: per-layer attention specs derived from Hugging Face configs."""

from __future__ import annotations

from attn_core.models.hf_config import (
    MODEL_TYPE_FAMILIES,
    MULTI_STACK_MODEL_TYPES,
    SAMPLE_STACKS,
    SUPPORTED_MODEL_TYPES,
    ModelLayout,
    load_sample,
    sample_names,
    specs_from_hf_config,
    stack_families,
)

__all__ = [
    "MODEL_TYPE_FAMILIES",
    "MULTI_STACK_MODEL_TYPES",
    "SAMPLE_STACKS",
    "SUPPORTED_MODEL_TYPES",
    "ModelLayout",
    "load_sample",
    "sample_names",
    "specs_from_hf_config",
    "stack_families",
]
