"""How many bytes persistent state needs, and how many pages / slots fit in a budget.

Counted: the page storage of every full and MLA layer and the slot storage of every linear
layer, exactly as :class:`~attn_core.state.PersistentState` allocates it. Not counted: the
per-layer scale scalars (4 bytes each) and Python-side bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attn_core.specs import LayerGroup
from attn_core.state.layout import StateLayout

__all__ = ["MemoryEstimate", "memory_required", "size_for_budget"]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes of KV pages and of linear-state slots, and the counts they come from."""

    kv_bytes: int
    state_bytes: int
    total: int
    num_pages: int = 0
    num_slots: int = 0
    page_bytes: int = 0  # one page across all KV layers
    slot_bytes: int = 0  # one slot across all linear layers


def memory_required(
    groups: Sequence[LayerGroup],
    *,
    num_tokens: int,
    num_requests: int,
    page_size: int | None = None,
    kv_dtype: str | None = None,
) -> MemoryEstimate:
    """Memory for ``num_requests`` requests of ``num_tokens`` tokens EACH.

    Pages are rounded up per request (``ceil(num_tokens / page_size)`` each: a request never
    shares its partial last page), and every request takes one state slot when the model has
    linear layers. No prefix sharing is assumed.

    :param page_size: tokens per page; ``None`` takes the one the KV groups' specs share.
    :param kv_dtype: overrides the KV dtype of full and MLA layers (e.g. ``"fp8_e4m3"``).
    """
    for name, value in (("num_tokens", num_tokens), ("num_requests", num_requests)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an integer >= 0")
    layout = StateLayout.from_groups(groups, page_size=page_size, kv_dtype=kv_dtype)
    num_pages = num_requests * layout.pages_for(num_tokens)
    num_slots = num_requests if layout.has_state else 0
    kv = num_pages * layout.page_bytes
    state = num_slots * layout.slot_bytes
    return MemoryEstimate(
        kv, state, kv + state, num_pages, num_slots, layout.page_bytes, layout.slot_bytes
    )


def size_for_budget(
    groups: Sequence[LayerGroup],
    budget_bytes: int,
    *,
    num_slots: int | None = None,
    page_size: int | None = None,
    kv_dtype: str | None = None,
) -> MemoryEstimate:
    """The most pages (and slots) that fit in ``budget_bytes``.

    Slots come first: ``num_slots`` of them when given (required when the model has both KV and
    linear layers: the split is a serving decision, requests plus cached snapshots); pages take
    the rest. A model without KV layers gets as many slots as fit when ``num_slots`` is None.
    Raises ``ValueError`` when the slots alone do not fit.
    """
    if not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r}: expected an integer >= 0")
    layout = StateLayout.from_groups(groups, page_size=page_size, kv_dtype=kv_dtype)
    if not layout.has_state:
        if num_slots:
            raise ValueError(f"num_slots={num_slots}: the model has no linear layers; give 0")
        num_slots = 0
    elif num_slots is None:
        if layout.has_kv:
            raise ValueError(
                "the model has KV and linear layers: give num_slots (concurrent requests plus "
                "cached prefix snapshots) so the rest of the budget can go to pages"
            )
        num_slots = budget_bytes // layout.slot_bytes
    state = num_slots * layout.slot_bytes
    if state > budget_bytes:
        raise ValueError(
            f"{num_slots} state slots need {state} bytes but the budget is {budget_bytes}"
        )
    num_pages = (budget_bytes - state) // layout.page_bytes if layout.has_kv else 0
    kv = num_pages * layout.page_bytes
    return MemoryEstimate(
        kv, state, kv + state, num_pages, num_slots, layout.page_bytes, layout.slot_bytes
    )
