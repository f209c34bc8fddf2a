"""Local virtual batches (attn_core.local_attention): chunked attention as causal attention over
requests cut at chunk boundaries.

Ground truths: a brute force written here (for every query row: the physical KV slots a causal,
end-aligned kernel reads through the virtual row, against the slots of positions
``p // C * C .. p`` through the real row), and the reference backend's own chunk mask (the
reference fed a virtual batch of an unchunked spec must equal the reference on the chunked spec).
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import attn_core.reference.plugin as ref_plugin
from attn_core.backend import Backend
from attn_core.batch import AttentionBatch, BatchBuilder, BatchMode
from attn_core.local_attention import (
    LocalVirtualBatcher,
    local_virtual_batch,
    max_virtual_requests,
)
from attn_core.specs import LayerSpec, group_layers
from attn_core.state.manager import PersistentState

PAGE = 4


def _spec(chunk: int | None, page: int = PAGE) -> LayerSpec:
    return LayerSpec(
        kind="full",
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=page,
        dtype="float32",
        attention_chunk_size=chunk,
    )


def _setup(chunk: int, page: int = PAGE, max_batch: int = 4):
    groups = group_layers([_spec(chunk, page)])
    state = PersistentState(groups, num_pages=256, num_slots=0)
    builder = BatchBuilder(state, max_batch_size=max_batch, max_num_tokens=256,
                           max_pages_per_request=48)  # fmt: skip
    return groups, state, builder


def _slot(page_table: np.ndarray, row: int, pos: int, page: int) -> int:
    return int(page_table[row, pos // page]) * page + pos % page


def _brute_force_check(batch: AttentionBatch, virt: AttentionBatch, chunk: int) -> None:
    """Every real query row reads, through its virtual request, exactly the slots of keys
    ``p // C * C .. p`` of its real request."""
    page = batch.page_size
    assert page is not None and batch.page_table is not None and virt.page_table is not None
    real_pt, virt_pt = batch.page_table.cpu().numpy(), virt.page_table.cpu().numpy()
    qsl, vqsl = batch.query_start_loc_cpu, virt.query_start_loc_cpu
    vseq, vctx = virt.seq_lens_cpu, virt.context_lens_cpu
    # the host mirrors agree with the device tensors
    assert np.array_equal(virt.query_start_loc.cpu().numpy(), vqsl[: virt.padded_reqs + 1])
    assert np.array_equal(virt.seq_lens.cpu().numpy(), vseq[: virt.padded_reqs])
    assert np.array_equal(virt.context_lens.cpu().numpy(), vctx[: virt.padded_reqs])
    assert np.array_equal(
        vseq[: virt.num_reqs] - vctx[: virt.num_reqs], np.diff(vqsl)[: virt.num_reqs]
    )
    assert vqsl[virt.num_reqs] == batch.num_tokens and virt.num_tokens == batch.num_tokens
    assert virt.slot_mapping is batch.slot_mapping and virt.positions is batch.positions
    assert virt.max_query_len == int(np.diff(vqsl[: virt.num_reqs + 1]).max())
    assert virt.max_seq_len == int(vseq[: virt.num_reqs].max())
    assert virt_pt.shape[1] <= chunk // page
    for b in range(batch.num_reqs):
        ctx = int(batch.context_lens_cpu[b])
        for t in range(int(qsl[b]), int(qsl[b + 1])):
            p = ctx + t - int(qsl[b])
            want = [_slot(real_pt, b, j, page) for j in range(p // chunk * chunk, p + 1)]
            (i,) = [i for i in range(virt.num_reqs) if vqsl[i] <= t < vqsl[i + 1]]
            assert virt.request_ids[i] == batch.request_ids[b]
            vpos = int(vseq[i]) - (int(vqsl[i + 1]) - t)  # end-aligned causal position
            got = [_slot(virt_pt, i, j, page) for j in range(vpos + 1)]
            assert got == want, (b, t, p)
    # padding rows stay padding rows (one query, one key, page 0's row)
    pad = batch.padded_reqs - batch.num_reqs
    assert virt.padded_reqs == virt.num_reqs + pad
    for r in range(pad):
        assert vseq[virt.num_reqs + r] == 1


def _steps(kind: str, rng: random.Random) -> list[list[tuple[str, int]]]:
    """Steps of ``(request, new tokens)``: the workloads named in the test ids."""
    if kind == "prefill":
        return [[("a", rng.randint(1, 60)), ("b", rng.randint(1, 60)), ("c", rng.randint(1, 9))]]
    if kind == "chunked_prefill":  # cached prefixes that end inside chunks, then more chunks
        return [[("a", rng.randint(1, 30)), ("b", rng.randint(1, 30))] for _ in range(4)]
    if kind == "mixed":
        return [
            [("a", rng.randint(5, 40)), ("b", rng.randint(5, 40))],
            [("a", 1), ("b", rng.randint(2, 30)), ("c", rng.randint(1, 40))],
            [("a", 1), ("b", 1), ("c", rng.randint(1, 20))],
        ]
    # decode at and across chunk boundaries
    return [[("a", 15), ("b", 16), ("c", 17)], *[[("a", 1), ("b", 1), ("c", 1)]] * 20]


@pytest.mark.parametrize("chunk", [4, 8, 16])
@pytest.mark.parametrize("kind", ["prefill", "chunked_prefill", "mixed", "decode"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_virtual_rows_read_exactly_the_chunk_of_each_query(chunk, kind, seed):
    rng = random.Random(seed * 100 + chunk)
    _, state, builder = _setup(chunk)
    batcher = LocalVirtualBatcher(chunk)
    for r in "abc":
        state.add_request(r)
    decode_seen = False
    for step in _steps(kind, rng):
        batch = builder.build(step)
        virt = batcher(batch)
        decode_seen |= batch.mode is BatchMode.DECODE
        _brute_force_check(batch, virt, chunk)
        assert virt.num_reqs <= max_virtual_requests(4, 256, chunk)
        if batch.mode is BatchMode.DECODE:
            assert virt.num_reqs == batch.num_reqs  # one virtual request each, fixed count
        for r, n in step:
            state.advance(r, n)
    assert decode_seen == (kind == "decode")


def _prefilled(state, builder, **tokens: int) -> None:
    """Requests named by ``tokens`` added, prefilled with that many tokens in one step and
    advanced past it."""
    for r in tokens:
        state.add_request(r)
    builder.build(list(tokens.items()))
    for r, n in tokens.items():
        state.advance(r, n)


def test_decode_buffers_keep_their_address_and_padding_rows_pass_through():
    _, state, builder = _setup(8)
    batcher = LocalVirtualBatcher(8)
    _prefilled(state, builder, a=7, b=9)
    addresses = None
    for _ in range(4):
        batch = builder.build([("a", 1), ("b", 1)], pad_to=4)
        virt = batcher(batch)
        _brute_force_check(batch, virt, 8)
        now = tuple(t.data_ptr() for t in (virt.seq_lens, virt.context_lens, virt.page_table))
        assert addresses in (None, now)
        addresses = now
        state.advance("a", 1)
        state.advance("b", 1)


def test_verify_step_cut_at_a_boundary_becomes_mixed():
    _, state, builder = _setup(8)
    _prefilled(state, builder, a=6, b=2)
    batch = builder.build([("a", 3), ("b", 3)], spec_tokens=2)
    assert batch.mode is BatchMode.VERIFY
    virt = local_virtual_batch(batch, 8)
    _brute_force_check(batch, virt, 8)
    assert virt.mode is BatchMode.MIXED and virt.num_reqs == 3 and virt.spec_tokens == 0


def test_a_chunk_that_is_not_a_multiple_of_the_page_size_is_refused():
    _, state, builder = _setup(8)
    state.add_request("a")
    batch = builder.build([("a", 5)])
    with pytest.raises(ValueError, match="attention_chunk_size 6 is not a multiple of the page"):
        local_virtual_batch(batch, 6)
    with pytest.raises(ValueError, match="positive int"):
        LocalVirtualBatcher(0)


def test_a_decode_batch_whose_page_table_changes_dtype_gets_buffers_of_that_dtype():
    """The decode buffers were keyed by shape and device only: an int64 page table after an
    int32 one of the same shape failed with torch's bare 'Expected out tensor to have dtype'."""
    import dataclasses

    _, state, builder = _setup(8)
    _prefilled(state, builder, a=7, b=9)
    batch = builder.build([("a", 1), ("b", 1)], pad_to=4)
    batcher = LocalVirtualBatcher(8)
    first = batcher(batch)
    wide = dataclasses.replace(batch, page_table=batch.page_table.long())
    virt = batcher(wide)
    assert virt.page_table.dtype == torch.int64
    assert torch.equal(virt.page_table, first.page_table.long())


@pytest.mark.parametrize("page_size", [0, -4])
def test_a_page_size_that_is_not_positive_is_refused_by_name(page_size):
    import dataclasses

    _, state, builder = _setup(8)
    state.add_request("a")
    batch = dataclasses.replace(builder.build([("a", 5)]), page_size=page_size)
    with pytest.raises(ValueError, match=rf"page size {page_size}: expected a positive int"):
        local_virtual_batch(batch, 8)


# ------------------------------------------------------------------------------------------
# The key equivalence: the reference's chunk mask == plain causal over the virtual batch
# ------------------------------------------------------------------------------------------
def _ref_backend(decode_path: str) -> Backend:
    return Backend(
        name="reference",
        capabilities=ref_plugin.CAPABILITIES,
        option_schema=ref_plugin.OPTION_SCHEMA,
        options=(("decode_path", decode_path),),
    )


@pytest.mark.parametrize("decode_path", ["fixed", "ragged"])
@pytest.mark.parametrize(("chunk", "page"), [(8, 4), (16, 16), (4, 4)])
@pytest.mark.parametrize("kind", ["prefill", "chunked_prefill", "mixed", "decode"])
def test_reference_over_virtual_batches_equals_reference_chunk_mask(kind, chunk, page, decode_path):
    torch.manual_seed(7)
    rng = random.Random(chunk + page)
    groups, state, builder = _setup(chunk, page)
    (group,) = groups
    backend = _ref_backend(decode_path)
    native = ref_plugin.FullContext(backend, group)
    plain_group = replace(group, spec=replace(group.spec, attention_chunk_size=None))
    plain = ref_plugin.FullContext(backend, plain_group)
    layer = SimpleNamespace(kv=state.kv_cache.layer(0), scale=0.3, sinks=None, layer_index=0)
    batcher = LocalVirtualBatcher(chunk)
    for r in "abc":
        state.add_request(r)
    for step in _steps(kind, rng):
        batch = builder.build(step)
        t = batch.num_tokens
        q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
        native.prepare(batch)
        want = native.forward(layer, q, k, v, None)
        plain.prepare(batcher(batch))
        got = plain.forward(layer, q, k, v, None)
        torch.testing.assert_close(got[:t], want[:t], atol=1e-5, rtol=1e-5)
        # the virtual batch changes the answer wherever a chunk boundary lies behind a query
        plain.prepare(batch)
        full = plain.forward(layer, q, k, v, None)
        crosses = (batch.seq_lens_cpu[: batch.num_reqs] > chunk).any()
        assert crosses == (not torch.allclose(full[:t], want[:t], atol=1e-5)), "test workload"
        for r, n in step:
            state.advance(r, n)


@pytest.mark.parametrize("chunk", [4, 8])
def test_the_virtual_request_bound_is_reached_and_never_exceeded(chunk):
    """The worst case: every request's cached prefix ends one token before a boundary and its
    new tokens run as far as the step's token budget allows."""
    _, state, builder = _setup(chunk, max_batch=4)
    for r in "abcd":
        state.add_request(r)
    builder.build([(r, chunk - 1) for r in "abcd"])
    for r in "abcd":
        state.advance(r, chunk - 1)
    budget = 2 * 4 + 3 * chunk  # every request crosses once, one crosses three more times
    step = [("a", 2 + 3 * chunk), ("b", 2), ("c", 2), ("d", 2)]
    virt = local_virtual_batch(builder.build(step), chunk)
    bound = max_virtual_requests(4, budget, chunk)
    assert virt.num_reqs == 4 + 4 + 3 <= bound
    assert bound - virt.num_reqs <= 4 + 1  # not loose by more than the min() and one chunk


@pytest.mark.parametrize(
    "args, name",
    [((-1, 256, 64), "max_batch_size"), ((4, -8, 64), "max_num_tokens"),
     ((4.0, 256, 64), "max_batch_size"), ((4, True, 64), "max_num_tokens")],
    ids=["negative-batch", "negative-tokens", "float-batch", "bool-tokens"],
)  # fmt: skip
def test_max_virtual_requests_refuses_sizes_that_are_not_counts(args, name):
    """A backend sizes its per-request buffers by this bound: a negative or float limit gave a
    negative or float bound in silence."""
    with pytest.raises(ValueError, match=name):
        max_virtual_requests(*args)
