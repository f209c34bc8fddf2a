"""Memory accounting: exact bytes on small configs, and sizing from a budget."""

from __future__ import annotations

import pytest

from attn_core.specs import LayerGroup, LayerSpec, group_layers
from attn_core.state import PersistentState, memory_required, size_for_budget

FULL = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=4, page_size=4)
MLA = LayerSpec(
    kind="mla",
    num_heads=2,
    num_kv_heads=1,
    head_dim=10,
    head_dim_v=8,
    kv_lora_rank=8,
    qk_rope_head_dim=2,
    qk_nope_head_dim=4,
    page_size=4,
)
LIN = LayerSpec(
    kind="linear",
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    head_dim_v=3,
    linear_variant="mamba2",
    conv_kernel_size=4,
    conv_channels=6,
    state_dtype="float32",
)
ENC = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=8, causal=False)
GROUPS = group_layers([FULL, LIN, FULL, MLA, ENC])  # 2 full, 1 linear, 1 mla


def storage_bytes(s: PersistentState) -> int:
    """Bytes of every storage tensor, counted from the tensors themselves."""
    n = 0
    for la in s.kv_cache.layers():
        n += sum(t.numel() * t.element_size() for t in la.tensors().values())
    for la in s.state_slots.layers():
        n += la.conv.numel() * la.conv.element_size() + la.ssm.numel() * la.ssm.element_size()
    return n


def test_memory_required_by_hand() -> None:
    est = memory_required(GROUPS, num_tokens=10, num_requests=3)
    pages = 3 * 3  # ceil(10 / 4) = 3 per request, rounded up per request
    # per token: full 2 heads x (8 + 4) x 2 bytes = 48 (two layers), mla (8 + 2) x 2 = 20
    page_bytes = 4 * (2 * 48 + 20)
    slot_bytes = 6 * 3 * 2 + 2 * 4 * 3 * 4  # conv [6, 3] bf16 + ssm [2, 4, 3] fp32
    assert (est.num_pages, est.num_slots) == (pages, 3)
    assert est.kv_bytes == pages * page_bytes == 4176
    assert est.state_bytes == 3 * slot_bytes == 396
    assert est.total == est.kv_bytes + est.state_bytes
    fp8 = memory_required(GROUPS, num_tokens=10, num_requests=3, kv_dtype="fp8_e4m3")
    assert fp8.kv_bytes * 2 == est.kv_bytes and fp8.state_bytes == est.state_bytes
    big_pages = memory_required(GROUPS, num_tokens=10, num_requests=3, page_size=16)
    assert big_pages.num_pages == 3 and big_pages.kv_bytes == 3 * 16 * (2 * 48 + 20)


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_estimate_matches_allocated_storage(kv_dtype) -> None:
    est = memory_required(GROUPS, num_tokens=7, num_requests=2, kv_dtype=kv_dtype)
    s = PersistentState(GROUPS, num_pages=est.num_pages, num_slots=est.num_slots, kv_dtype=kv_dtype)
    assert storage_bytes(s) == s.nbytes == est.total
    for r in range(2):  # exactly two 7-token requests fit
        s.add_request(r)
        s.ensure_capacity(r, 7)
    assert s.num_free_pages == 0 and s.num_free_slots == 0


def test_from_memory_budget() -> None:
    one = memory_required(GROUPS, num_tokens=4, num_requests=1)
    budget = 4 * one.slot_bytes + 10 * one.page_bytes + one.page_bytes - 1
    s = PersistentState.from_memory_budget(GROUPS, budget, num_slots=4)
    assert (s.num_pages, s.num_slots) == (10, 4) and s.nbytes <= budget
    with pytest.raises(ValueError, match="give num_slots"):
        size_for_budget(GROUPS, budget)
    with pytest.raises(ValueError, match="budget"):
        size_for_budget(GROUPS, 10, num_slots=4)
    kv_only = [LayerGroup("full", FULL, (0, 1))]
    est = size_for_budget(kv_only, 1000)
    assert est.num_slots == 0 and est.num_pages == 1000 // (4 * 48 * 2)
    lin_only = [LayerGroup("linear", LIN, (0,))]
    assert size_for_budget(lin_only, 1000).num_slots == 1000 // LIN.state_bytes_per_request()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        memory_required(GROUPS, num_tokens=-1, num_requests=1)
    two_sizes = [LayerGroup("full", FULL, (0,)), LayerGroup("mla", MLA.with_(page_size=8), (1,))]
    with pytest.raises(ValueError, match="'full': 4, 'mla': 8"):
        memory_required(two_sizes, num_tokens=1, num_requests=1)
