"""attn-core: a plugin registry for the attention layers of LLM inference servers."""

from __future__ import annotations

from attn_core.specs import (
    DeviceCapabilities,
    DowngradePolicy,
    ExecutionConstraints,
    GraphMode,
    LayerGroup,
    LayerKind,
    LayerSpec,
    LinearVariant,
    group_layers,
)

__version__ = "0.1.0"

__all__ = [
    "DeviceCapabilities",
    "DowngradePolicy",
    "ExecutionConstraints",
    "GraphMode",
    "LayerGroup",
    "LayerKind",
    "LayerSpec",
    "LinearVariant",
    "__version__",
    "group_layers",
]
