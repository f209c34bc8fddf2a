"""The storage layout of a model's persistent state, resolved from its layer groups.

One place decides the effective per-layer specs (``kv_dtype`` / ``page_size`` overrides applied)
and the shared page size, so the cache, the memory estimate and the transfer format agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from attn_core.specs import LayerGroup, LayerKind, LayerSpec, layer_ops

__all__ = ["DEFAULT_PAGE_SIZE", "StateLayout", "spec_hash"]

#: Page size used when no layer keeps a paged KV cache (only the prefix-cache block size then).
DEFAULT_PAGE_SIZE = 16


def spec_hash(spec: LayerSpec) -> str:
    """A stable short hash of everything in ``spec`` that decides what its KV / state means.

    ``page_size`` is left out: exported KV is token-major, so page sizes may differ.
    """
    fields = spec.with_(page_size=DEFAULT_PAGE_SIZE) if spec.has_kv_cache else spec
    text = repr(tuple((name, str(getattr(fields, name))) for name in fields.__slots__))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Effective per-layer specs of the layers that keep persistent state, and the page size.

    :ivar kv_specs: layer index -> spec of every full and MLA layer (sorted by index).
    :ivar linear_specs: layer index -> spec of every linear layer (sorted by index).
    :ivar page_size: tokens per KV page, shared by all full and MLA layers; also the block size
        of the prefix cache.
    """

    kv_specs: dict[int, LayerSpec]
    linear_specs: dict[int, LayerSpec]
    page_size: int

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[LayerGroup],
        *,
        page_size: int | None = None,
        kv_dtype: str | None = None,
    ) -> StateLayout:
        """Resolve the layout; ``page_size`` / ``kv_dtype`` override the specs of KV layers.

        A layer may be in two groups when they hold one attention op and one linear op of it
        (a parallel hybrid such as Falcon-H1): it then has KV pages and a conv / SSM slot.
        Raises ``ValueError`` if a layer is in two groups otherwise, or if the KV groups
        disagree on the page size and no ``page_size`` is given.
        """
        groups = list(groups)
        for g in groups:
            if not isinstance(g, LayerGroup):
                raise TypeError(f"groups: expected LayerGroup items, got {type(g).__name__}")
        if page_size is not None and (
            not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0
        ):
            raise ValueError(f"page_size={page_size!r}: expected a positive integer or None")
        # a layer may be in two groups only as a parallel hybrid: one attention op (its KV
        # pages) and one linear op (its conv / SSM slot); layer_ops refuses anything else
        layer_ops(groups)
        kv_groups = [g for g in groups if g.spec.has_kv_cache]
        if page_size is None:
            sizes = {g.spec.page_size for g in kv_groups}
            if len(sizes) > 1:
                listing = ", ".join(f"{g.group_id!r}: {g.spec.page_size}" for g in kv_groups)
                raise ValueError(
                    f"all KV groups must share one page_size, got {listing}; pass page_size= "
                    "to choose one"
                )
            page_size = sizes.pop() if sizes else DEFAULT_PAGE_SIZE
        kv_specs: dict[int, LayerSpec] = {}
        linear_specs: dict[int, LayerSpec] = {}
        for g in groups:
            spec = g.spec
            if spec.has_kv_cache:
                changes: dict[str, object] = {"page_size": page_size}
                if kv_dtype is not None:
                    changes["kv_dtype"] = kv_dtype
                spec = spec.with_(**changes)
                kv_specs.update(dict.fromkeys(g.layer_indices, spec))
            elif spec.kind is LayerKind.LINEAR:
                linear_specs.update(dict.fromkeys(g.layer_indices, spec))
        return cls(dict(sorted(kv_specs.items())), dict(sorted(linear_specs.items())), page_size)

    @property
    def has_kv(self) -> bool:
        return bool(self.kv_specs)

    @property
    def has_state(self) -> bool:
        return bool(self.linear_specs)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every full and MLA layer."""
        return self.page_size * sum(s.kv_bytes_per_token for s in self.kv_specs.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state slot across every linear layer (conv + SSM)."""
        return sum(s.state_bytes_per_request() for s in self.linear_specs.values())

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens (0 when the model keeps no paged KV)."""
        if not self.kv_specs:
            return 0
        return -(-num_tokens // self.page_size)
