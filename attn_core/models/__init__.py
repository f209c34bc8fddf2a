"""Model descriptions: per-layer attention specs derived from Hugging Face configs."""

from __future__ import annotations

from attn_core.models.hf_config import (
    MODEL_TYPE_FAMILIES,
    SUPPORTED_MODEL_TYPES,
    ModelLayout,
    load_sample,
    sample_names,
    specs_from_hf_config,
)

__all__ = [
    "MODEL_TYPE_FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "ModelLayout",
    "load_sample",
    "sample_names",
    "specs_from_hf_config",
]
