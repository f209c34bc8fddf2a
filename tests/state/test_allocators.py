"""PageAllocator / SlotAllocator: refcounts, all-or-nothing allocation, double-free detection."""

from __future__ import annotations

import pytest

from attn_core.state import (
    DoubleFreeError,
    OutOfPagesError,
    OutOfSlotsError,
    PageAllocator,
    SlotAllocator,
    StateError,
)


def test_allocate_distinct_then_free_and_reuse() -> None:
    pa = PageAllocator(5)
    a = pa.allocate(3)
    assert len(set(a)) == 3 and all(0 <= p < 5 for p in a)
    assert (pa.num_free, pa.num_used) == (2, 3)
    assert all(pa.refcount(p) == 1 for p in a)
    assert pa.decref(a[:2]) == a[:2]
    assert (pa.num_free, pa.num_used) == (4, 1)
    b = pa.allocate(4)
    assert set(b) | {a[2]} == set(range(5))


def test_oom_is_all_or_nothing() -> None:
    pa = PageAllocator(4)
    held = pa.allocate(3)
    with pytest.raises(OutOfPagesError) as info:
        pa.allocate(2)
    assert isinstance(info.value, StateError) and isinstance(info.value, RuntimeError)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert pa.num_free == 1 and pa.free_ids() == [p for p in range(4) if p not in held]
    assert pa.allocate(0) == []


def test_incref_decref_frees_at_zero() -> None:
    pa = PageAllocator(3)
    (p,) = pa.allocate(1)
    pa.incref([p, p])
    assert pa.refcount(p) == 3
    assert pa.decref([p]) == []
    assert pa.decref([p, p]) == [p]
    assert pa.is_free(p) and pa.num_free == 3


def test_double_free_detected_and_changes_nothing() -> None:
    pa = PageAllocator(3)
    a, b = pa.allocate(2)
    pa.decref([a])
    with pytest.raises(DoubleFreeError, match=f"page {a}"):
        pa.decref([a])
    # A batch with one bad id changes no id of the batch.
    with pytest.raises(DoubleFreeError):
        pa.decref([b, b])
    assert pa.refcount(b) == 1 and pa.num_free == 2


def test_incref_of_free_page_and_bad_ids_rejected() -> None:
    pa = PageAllocator(2)
    with pytest.raises(StateError, match="free page 0"):
        pa.incref([0])
    with pytest.raises(ValueError, match="out of range"):
        pa.decref([7])
    with pytest.raises(ValueError, match="allocate"):
        pa.allocate(-1)
    with pytest.raises(ValueError, match="pool size"):
        PageAllocator(-1)


def test_slot_allocator_same_contract() -> None:
    sa = SlotAllocator(2)
    s = sa.allocate(2)
    with pytest.raises(OutOfSlotsError) as info:
        sa.allocate(1)
    assert (info.value.needed, info.value.free) == (1, 0)
    sa.decref(s)
    with pytest.raises(DoubleFreeError, match="slot"):
        sa.decref([s[0]])
    assert sa.num_free == 2 and sa.num_slots == 2
