"""PersistentState: layout, per-request pages and slots, prefix cache with copy-on-write, OOM."""

from __future__ import annotations

import pytest
import torch

from attn_core.specs import LayerGroup, LayerSpec, group_layers
from attn_core.state import (
    FullKVLayer,
    MLAKVLayer,
    OutOfPagesError,
    OutOfSlotsError,
    PersistentState,
    StaleprefixError,
    StateError,
)

PS = 4


def full_spec(**kw) -> LayerSpec:
    return LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=8, page_size=PS, **kw)


def mla_spec(**kw) -> LayerSpec:
    return LayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_dim=12,
        head_dim_v=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        page_size=PS,
        **kw,
    )


def linear_spec(**kw) -> LayerSpec:
    return LayerSpec(
        kind="linear",
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        head_dim_v=3,
        linear_variant="gated_deltanet",
        conv_kernel_size=4,
        conv_channels=6,
        **kw,
    )


ENCODER = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=8, causal=False)


def hybrid(**kw) -> list[LayerGroup]:
    """Layers: 0 full, 1 linear, 2 mla, 3 linear, 4 encoder."""
    lin = linear_spec()
    return group_layers([full_spec(), lin, mla_spec(), lin, ENCODER])


def kv_only() -> list[LayerGroup]:
    return group_layers([full_spec(), mla_spec()])


# -- helpers that read and write storage directly (independent of transfer.py) -------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(t.shape[0] * t.shape[1], -1)


def write_kv(state: PersistentState, rid, start: int, end: int, seed: int) -> None:
    """Random bytes into tokens start..end-1 of every KV layer of ``rid``."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor(state.slot_mapping(rid, start, end), dtype=torch.long)
    for layer in state.kv_cache.layers():
        for t in layer.tensors().values():
            r = _rows(t)
            r[rows] = torch.randint(0, 256, (len(rows), r.shape[1]), generator=g, dtype=torch.uint8)


def write_state(state: PersistentState, rid, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slot = state.slot(rid)
    for layer in state.state_slots.layers():
        for t in layer.tensors().values():
            t[slot] = torch.randn(t[slot].shape, generator=g).to(t.dtype)


def read_request(state: PersistentState, rid) -> list[torch.Tensor]:
    """Bytes of every written KV token and of the state slot of ``rid``."""
    out = []
    rows = torch.tensor(state.slot_mapping(rid, 0, state.num_tokens(rid)), dtype=torch.long)
    for layer in state.kv_cache.layers():
        for t in layer.tensors().values():
            out.append(_rows(t)[rows].clone())
    if state.has_state:
        for layer in state.state_slots.layers():
            for t in layer.tensors().values():
                out.append(t[state.slot(rid)].reshape(-1).view(torch.uint8).clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def fill(state: PersistentState, rid, n: int, seed: int) -> None:
    state.add_request(rid)
    state.ensure_capacity(rid, n)
    write_kv(state, rid, 0, n, seed)
    if state.has_state:
        write_state(state, rid, seed)
    state.advance(rid, n)


# -- layout ----------------------------------------------------------------------------------
def test_storage_shapes_dtypes_and_accessors_by_layer_index() -> None:
    s = PersistentState(hybrid(), num_pages=5, num_slots=3, kv_dtype="fp8_e4m3")
    k0 = s.kv_cache.layer(0)
    assert isinstance(k0, FullKVLayer)
    assert k0.k.shape == (5, PS, 2, 8) and k0.v.shape == (5, PS, 2, 8)
    assert k0.k.dtype == torch.float8_e4m3fn
    m2 = s.kv_cache.layer(2)
    assert isinstance(m2, MLAKVLayer) and m2.latent.shape == (5, PS, 12)
    assert m2.latent.dtype == torch.float8_e4m3fn
    for i in (1, 3):
        st = s.state_slots.layer(i)
        assert st.conv.shape == (3, 6, 3) and st.conv.dtype == torch.bfloat16
        assert st.ssm.shape == (3, 2, 4, 3) and st.ssm.dtype == torch.float32
    assert k0.k_scale.shape == () and k0.k_scale.dtype == torch.float32
    assert float(k0.k_scale) == 1.0 and float(k0.v_scale) == 1.0
    s.kv_cache.set_scale(0, k=0.5, v=0.25)
    assert (float(k0.k_scale), float(k0.v_scale)) == (0.5, 0.25)
    assert s.layer_spec(0).kv_dtype == "fp8_e4m3" and s.has_kv and s.has_state
    with pytest.raises(KeyError, match="layer 4"):
        s.kv_cache.layer(4)  # the encoder keeps nothing
    with pytest.raises(KeyError, match="layer 0"):
        s.state_slots.layer(0)


def test_groups_must_share_page_size_and_error_names_them() -> None:
    groups = [
        LayerGroup("full", full_spec(), (0,)),
        LayerGroup("full.1", full_spec(sliding_window=8).with_(page_size=8), (1,)),
    ]
    with pytest.raises(ValueError, match=r"'full': 4, 'full.1': 8"):
        PersistentState(groups, num_pages=2, num_slots=0)
    s = PersistentState(groups, num_pages=2, num_slots=0, page_size=8)
    assert s.page_size == 8 and s.kv_cache.layer(0).k.shape[1] == 8


# -- pages and tokens ---------------------------------------------------------------------------
def test_append_across_page_boundaries_and_slot_mapping() -> None:
    s = PersistentState(kv_only(), num_pages=6, num_slots=0)
    s.add_request("a")
    assert s.pages("a") == [] and s.num_tokens("a") == 0
    assert len(s.ensure_capacity("a", 3)) == 1
    assert s.ensure_capacity("a", 4) == []  # still fits in the first page
    p0 = s.pages("a")[0]
    s.advance("a", 4)
    new = s.ensure_capacity("a", 5)
    assert len(new) == 1 and s.pages("a") == [p0, new[0]]
    assert s.slot_mapping("a", 2, 6) == [p0 * PS + 2, p0 * PS + 3, new[0] * PS, new[0] * PS + 1]
    assert s.page_table_row("a") == s.pages("a")
    with pytest.raises(StateError, match="ensure_capacity"):
        s.advance("a", 5)  # 9 tokens > capacity 8
    assert s.advance("a", 4) == 8
    with pytest.raises(ValueError, match="ensure_capacity"):
        s.slot_mapping("a", 0, 9)
    with pytest.raises(StateError, match="no linear layers"):
        s.slot("a")
    s.check_invariants()


def test_append_pages_gives_each_full_request_one_fresh_page_or_changes_nothing() -> None:
    s = PersistentState(kv_only(), num_pages=5, num_slots=0)
    for r, n in (("a", PS), ("b", 2 * PS), ("c", 3)):
        s.add_request(r)
        s.ensure_capacity(r, n)
        s.advance(r, n)
    with pytest.raises(StateError, match="last page is not full"):
        s.append_pages(["a", "c"])  # c holds 3 tokens in a page of PS
    assert len(s.pages("a")) == 1 and s.num_free_pages == 1  # nothing changed
    with pytest.raises(OutOfPagesError) as err:
        s.append_pages(["a", "b"])  # two pages wanted, one free
    # the step's requests, not the first one alone (a server preempts by it)
    assert tuple(err.value.requests) == ("a", "b") and err.value.req_id is None
    assert len(s.pages("a")) == 1 and len(s.pages("b")) == 2 and s.num_free_pages == 1
    before = s.pages("b")
    (page,) = s.append_pages(["b"])
    assert s.pages("b") == [*before, int(page)] and s.num_free_pages == 0
    assert int(s.rows.num_pages[s.step_rows(["b"])[0]]) == 3
    s.check_invariants()


def test_release_frees_everything_and_unknown_id_is_keyerror() -> None:
    s = PersistentState(hybrid(), num_pages=6, num_slots=3)
    fill(s, "a", 9, seed=1)
    assert s.num_free_pages == 3 and s.num_free_slots == 2
    s.release("a")
    assert s.num_free_pages == 6 and s.num_free_slots == 3
    with pytest.raises(KeyError, match="'a'"):
        s.release("a")
    with pytest.raises(KeyError, match="'zz'"):
        s.pages("zz")
    s.add_request("b")
    with pytest.raises(ValueError, match="already exists"):
        s.add_request("b")
    s.check_invariants()


def test_an_unhashable_request_id_is_refused_by_name_and_changes_nothing() -> None:
    s = PersistentState(hybrid(), num_pages=6, num_slots=3)
    fill(s, "a", 5, seed=1)
    free = (s.num_free_pages, s.num_free_slots)
    with pytest.raises(TypeError, match=r"req_id \['b'\] is not hashable"):
        s.add_request(["b"])
    with pytest.raises(TypeError, match=r"req_id \['b'\] is not hashable"):
        s.import_request(["b"], s.export_request("a"))
    with pytest.raises(TypeError, match=r"req_id \['b'\] is not hashable"):
        ["b"] in s  # noqa: B015
    assert (s.num_free_pages, s.num_free_slots) == free
    assert s.request_ids() == ["a"]
    s.check_invariants()


def test_new_request_slot_is_zeroed_even_when_reused() -> None:
    s = PersistentState(hybrid(), num_pages=4, num_slots=1)
    fill(s, "a", 2, seed=3)
    s.release("a")
    s.add_request("b")
    for layer in s.state_slots.layers():
        assert not layer.conv[s.slot("b")].any() and not layer.ssm[s.slot("b")].any()


def test_out_of_pages_names_request_and_changes_nothing() -> None:
    s = PersistentState(hybrid(), num_pages=5, num_slots=3)
    fill(s, "a", 7, seed=1)
    fill(s, "b", 5, seed=2)
    before = {r: read_request(s, r) for r in ("a", "b")}
    pages_b = s.pages("b")
    with pytest.raises(OutOfPagesError) as info:
        s.ensure_capacity("b", 17)  # needs 5 pages, holds 2, 1 free
    msg = str(info.value)
    assert "'b'" in msg and "17 tokens" in msg and "3 more KV pages" in msg and "1 are free" in msg
    assert info.value.req_id == "b" and info.value.needed == 3 and info.value.free == 1
    assert s.pages("b") == pages_b and s.num_free_pages == 1 and s.num_tokens("b") == 5
    assert all(same(read_request(s, r), before[r]) for r in ("a", "b"))
    fill(s, "c", 1, seed=3)
    with pytest.raises(OutOfSlotsError, match="'d'"):
        s.add_request("d")
    assert "d" not in s and s.num_free_slots == 0
    s.check_invariants()


# -- prefix cache and copy-on-write ------------------------------------------------------------
def test_prefix_sharing_and_copy_on_write() -> None:
    s = PersistentState(kv_only(), num_pages=10, num_slots=0)
    tokens = list(range(100, 110))
    fill(s, "a", 10, seed=1)
    assert s.cache_prefix("a", tokens) == 8  # two full pages; the partial third is not cached
    a_bytes = read_request(s, "a")
    hit = s.match_prefix([*tokens[:8], 7, 7])
    assert hit.num_tokens == 8 and list(hit.pages) == s.pages("a")[:2]

    s.add_request("b", prefix=hit)
    assert s.pages("b") == s.pages("a")[:2] and s.num_tokens("b") == 8
    assert [s.page_allocator.refcount(p) for p in hit.pages] == [3, 3]  # a, cache, b
    assert len(s.ensure_capacity("b", 10)) == 1  # appends, no copy: the shared pages are full
    assert s.pages("b")[:2] == s.pages("a")[:2]
    write_kv(s, "b", 8, 10, seed=2)
    s.advance("b", 2)

    # A hit that ends inside a page: the partial page is shared, then copied on the first write.
    hit7 = s.match_prefix(tokens, max_tokens=7)
    assert hit7.num_tokens == 7 and len(hit7.pages) == 2
    s.add_request("c", prefix=hit7)
    s.ensure_capacity("c", 8)
    pa, pc = s.pages("a"), s.pages("c")
    assert pc[0] == pa[0] and pc[1] != pa[1]  # page 1 copied for c, page 0 still shared
    assert s.page_allocator.refcount(pa[1]) == 3  # a, cache, b
    write_kv(s, "c", 7, 8, seed=3)
    s.advance("c", 1)
    c_bytes = read_request(s, "c")
    assert all(torch.equal(x[:7], y[:7]) for x, y in zip(c_bytes, a_bytes, strict=True))
    assert not all(torch.equal(x[7], y[7]) for x, y in zip(c_bytes, a_bytes, strict=True))
    assert same(read_request(s, "a"), a_bytes)  # the diverging write did not reach a

    # Rewriting an early shared token (divergence) copies that page too.
    b_before = read_request(s, "b")
    s.prepare_write("b", 1, 2)
    assert s.pages("b")[0] != pa[0] and s.pages("b")[1] == pa[1]
    assert same(read_request(s, "b"), b_before)  # the copy is exact
    write_kv(s, "b", 1, 2, seed=4)
    assert same(read_request(s, "a"), a_bytes) and same(read_request(s, "c"), c_bytes)
    for r in ("a", "b", "c"):
        s.release(r)
    assert s.num_free_pages == 8  # only the two cached pages stay held
    s.check_invariants()
    assert s.clear_prefix_cache() == 2 and s.num_free_pages == 10


def test_snapshot_restores_linear_state_at_prefix_length() -> None:
    s = PersistentState(hybrid(), num_pages=10, num_slots=4)
    tokens = list(range(12))
    s.add_request("a")
    s.ensure_capacity("a", 8)
    write_kv(s, "a", 0, 8, seed=1)
    write_state(s, "a", seed=1)
    s.advance("a", 8)
    s.ensure_capacity("a", 9)
    s.advance("a", 1)
    with pytest.raises(ValueError, match="multiple of page_size"):
        s.take_snapshot("a")  # 9 tokens: not a block boundary
    s.release("a")

    s.add_request("a")
    s.ensure_capacity("a", 8)
    write_kv(s, "a", 0, 8, seed=1)
    write_state(s, "a", seed=1)
    s.advance("a", 8)
    assert s.take_snapshot("a") == 8
    at_8 = read_request(s, "a")
    s.ensure_capacity("a", 10)
    write_kv(s, "a", 8, 10, seed=2)
    write_state(s, "a", seed=2)  # the state moves on past the snapshot
    s.advance("a", 2)
    a_now = read_request(s, "a")
    assert s.cache_prefix("a", tokens[:10]) == 8
    assert s.match_prefix(tokens, max_tokens=7).num_tokens == 0  # no snapshot below 8
    hit = s.match_prefix(tokens)
    assert hit.num_tokens == 8 and hit.snapshot is not None
    s.add_request("b", prefix=hit)
    assert s.num_tokens("b") == 8 and s.pages("b") == s.pages("a")[:2]
    assert same(read_request(s, "b"), at_8)  # KV and state as they were at 8 tokens
    write_state(s, "b", seed=9)
    assert same(read_request(s, "a"), a_now)
    hit2 = s.match_prefix(tokens)
    s.add_request("c", prefix=hit2)
    assert same(read_request(s, "c"), at_8)  # b's updates did not touch the snapshot
    s.check_invariants()


def test_lru_eviction_of_unused_prefixes() -> None:
    s = PersistentState(kv_only(), num_pages=6, num_slots=0)
    t1, t2 = [1] * 8, [2] * 8
    for rid, toks, seed in (("x", t1, 1), ("y", t2, 2)):
        fill(s, rid, 8, seed)
        s.cache_prefix(rid, toks)
        s.release(rid)
    assert s.num_free_pages == 2
    s.match_prefix(t1)  # t1 is now the most recently used
    fill(s, "z", 12, seed=3)  # needs 3 pages: evicts one block of t2 (leaf first)
    assert s.match_prefix(t1).num_tokens == 8 and s.match_prefix(t2).num_tokens == 4
    s.check_invariants()
    # Pages a running request shares with the cache are not evictable.
    hit = s.match_prefix(t1)
    s.add_request("w", prefix=hit)
    with pytest.raises(OutOfPagesError, match="1 more can be evicted"):
        s.ensure_capacity("w", 8 + 4 * 3)
    s.check_invariants()


def test_a_hit_listing_pages_in_a_model_without_paged_kv_is_refused_without_changes() -> None:
    """The slot was reserved before the hit's pages were checked (they were not, without paged
    KV), and incref of a page the model does not have raised after it: the slot leaked."""
    import dataclasses

    s = PersistentState(
        group_layers([linear_spec(), linear_spec()]), num_pages=0, num_slots=3, page_size=PS
    )
    tokens = list(range(8))
    fill(s, "a", 8, seed=1)
    s.take_snapshot("a")
    s.cache_prefix("a", tokens)
    hit = s.match_prefix(tokens)
    assert hit.num_tokens == 8 and hit.pages == ()
    free = s.num_free_slots
    with pytest.raises(StaleprefixError):
        s.add_request("b", prefix=dataclasses.replace(hit, pages=(0,)))
    assert "b" not in s and s.num_free_slots == free
    s.check_invariants()


def test_an_export_with_a_snapshot_tensor_on_a_kv_layer_is_refused_before_anything_moves():
    """'snapshot.' marks a linear layer's carried snapshot; on a KV entry it passed every
    check and the import then failed with a bare KeyError, after evicting a cached prefix."""
    import dataclasses

    from attn_core.state.transfer import layout_differences

    src = PersistentState(kv_only(), num_pages=4, num_slots=0)
    fill(src, "a", 8, seed=1)
    exp = src.export_request("a")
    e0 = exp.meta.layers[0]
    extra = dataclasses.replace(e0.tensors[0], name=f"snapshot.{e0.tensors[0].name}")
    layers = (dataclasses.replace(e0, tensors=(*e0.tensors, extra)), *exp.meta.layers[1:])
    bad = type(exp)(dataclasses.replace(exp.meta, layers=layers), exp.buffer)
    dst = PersistentState(kv_only(), num_pages=4, num_slots=0)
    diffs = layout_differences(bad.meta, dst.layout, dst.kv_cache, dst.state_slots)
    assert f"layer 0: tensor {extra.name!r} in the export is not kept here" in diffs
    free = dst.num_free_pages
    with pytest.raises(ValueError, match="not kept here"):
        dst.import_request("b", bad)
    assert "b" not in dst and dst.num_free_pages == free
    dst.check_invariants()


def test_stale_hit_is_refused_without_changes() -> None:
    s = PersistentState(hybrid(), num_pages=6, num_slots=3)
    tokens = [5] * 8
    fill(s, "a", 8, seed=1)
    s.take_snapshot("a")
    s.cache_prefix("a", tokens)
    s.release("a")
    hit = s.match_prefix(tokens)
    assert hit.num_tokens == 8
    s.clear_prefix_cache()
    free = (s.num_free_pages, s.num_free_slots)
    with pytest.raises(StaleprefixError):
        s.add_request("b", prefix=hit)
    assert "b" not in s and (s.num_free_pages, s.num_free_slots) == free
    s.check_invariants()


def test_slot_pressure_evicts_cached_snapshots_but_not_the_hit() -> None:
    s = PersistentState(hybrid(), num_pages=8, num_slots=2)
    tokens = [3] * 4
    fill(s, "a", 4, seed=1)
    s.take_snapshot("a")
    s.cache_prefix("a", tokens)
    hit = s.match_prefix(tokens)
    # a holds one slot, the snapshot the other: the hit's snapshot must not be evicted for b.
    with pytest.raises(OutOfSlotsError):
        s.add_request("b", prefix=hit)
    s.add_request("c")  # a plain request may evict the snapshot
    assert s.match_prefix(tokens).num_tokens == 0
    s.check_invariants()


def test_linear_only_model_prefix_cache() -> None:
    groups = group_layers([linear_spec(state_dtype="bfloat16")])
    s = PersistentState(groups, num_pages=3, num_slots=3, page_size=PS)
    assert not s.has_kv and s.num_pages == 0 and s.page_size == PS
    tokens = list(range(9))
    s.add_request("a")
    assert s.ensure_capacity("a", 100) == [] and s.pages("a") == []
    write_state(s, "a", seed=1)
    s.advance("a", 4)
    s.take_snapshot("a")
    snap = read_request(s, "a")
    s.advance("a", 5)
    write_state(s, "a", seed=2)
    assert s.cache_prefix("a", tokens) == 4
    s.release("a")
    hit = s.match_prefix(tokens)
    assert hit.num_tokens == 4 and hit.pages == ()
    s.add_request("b", prefix=hit)
    assert same(read_request(s, "b"), snap)
    s.add_request("c")
    s.add_request("d")  # evicts the snapshot and prunes its blocks
    assert len(s.prefix_cache) == 0
    s.check_invariants()


def test_offloaded_request_rejects_live_access() -> None:
    s = PersistentState(hybrid(), num_pages=4, num_slots=2)
    fill(s, "a", 5, seed=1)
    s.offload("a")
    assert s.is_offloaded("a") and s.num_tokens("a") == 5
    with pytest.raises(StateError, match="offloaded"):
        s.pages("a")
    s.restore("a")
    with pytest.raises(StateError, match="not offloaded"):
        s.restore("a")
    s.release("a")
    assert s.num_free_pages == 4 and s.num_free_slots == 2


def test_token_ids_as_a_tensor_cache_and_match_as_the_same_ints_do() -> None:
    """A tensor's elements hash by identity: keys from tensor ids matched nothing, and the
    request's pages then belonged to blocks no later request could hit."""
    s = PersistentState(kv_only(), num_pages=8, num_slots=0)
    fill(s, "a", 12, seed=1)
    ids = torch.arange(100, 112)
    assert s.cache_prefix("a", ids) == 12
    assert s.match_prefix(ids).num_tokens == 12
    assert s.match_prefix(ids.tolist()).num_tokens == 12
    s.check_invariants()


def test_cache_prefix_with_changed_tokens_does_not_double_register_a_page() -> None:
    s = PersistentState(kv_only(), num_pages=4, num_slots=0)
    fill(s, "a", 8, seed=1)
    assert s.cache_prefix("a", [1] * 8) == 8
    # The same pages under other tokens would make one page back two prefixes (never evictable).
    assert s.cache_prefix("a", [2] * 8) == 0
    assert len(s.prefix_cache) == 2
    s.release("a")
    assert s.clear_prefix_cache() == 2 and s.num_free_pages == 4
    s.check_invariants()
