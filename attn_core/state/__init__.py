"""Persistent state owned by the core: paged KV (and MLA latent), linear-state slots, a prefix
cache, offload and export / import. Backends receive views of it, never own it."""

from __future__ import annotations

from attn_core.state.errors import (
    DoubleFreeError,
    OutOfPagesError,
    OutOfSlotsError,
    StaleprefixError,
    StateError,
)
from attn_core.state.kv_cache import FullKVLayer, KVCache, KVLayer, MLAKVLayer
from attn_core.state.layout import StateLayout, spec_hash
from attn_core.state.manager import PersistentState, PrefixHit
from attn_core.state.memory import MemoryEstimate, memory_required, size_for_budget
from attn_core.state.pages import PageAllocator
from attn_core.state.slots import LinearStateLayer, SlotAllocator, StateSlots
from attn_core.state.transfer import ExportMeta, LayerEntry, RequestExport, TensorEntry

__all__ = [
    "DoubleFreeError",
    "ExportMeta",
    "FullKVLayer",
    "KVCache",
    "KVLayer",
    "LayerEntry",
    "LinearStateLayer",
    "MLAKVLayer",
    "MemoryEstimate",
    "OutOfPagesError",
    "OutOfSlotsError",
    "PageAllocator",
    "PersistentState",
    "PrefixHit",
    "RequestExport",
    "SlotAllocator",
    "StaleprefixError",
    "StateError",
    "StateLayout",
    "StateSlots",
    "TensorEntry",
    "memory_required",
    "size_for_budget",
    "spec_hash",
]
