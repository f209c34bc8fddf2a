"""Batches of graph mode ``full``'s captured mixed step (``build(..., pad_to=P,
pad_tokens_to=T)``): every split of prefill chunks and decodes is laid out at the same device
addresses, with the same padded sizes, so a graph captured on one replays the others."""

from __future__ import annotations

import pytest

from attn_core.batch import BatchBuilder, BatchMode
from attn_core.specs import group_layers
from attn_core.state import PersistentState

PS = 4  # the tiny specs' page size
P, T = 4, 16


@pytest.fixture
def state(tiny_specs):
    groups = group_layers([tiny_specs["full"], tiny_specs["gdn"]])
    return PersistentState(groups, num_pages=64, num_slots=8)


@pytest.fixture
def builder(state):
    return BatchBuilder(state, max_batch_size=8, max_num_tokens=T, max_pages_per_request=8)


def _start(state, req, written):
    state.add_request(req)
    if written:
        state.ensure_capacity(req, written)
        state.advance(req, written)


def _tensors(batch):
    return (
        batch.query_start_loc,
        batch.seq_lens,
        batch.context_lens,
        batch.page_table,
        batch.slot_mapping,
        batch.positions,
        batch.state_indices,
        batch.has_initial_state,
    )


SPLITS = [
    [],  # the capture: padding only
    [("a", 1), ("b", 1)],  # pure decode, replayed in the mixed graph
    [("a", 1), ("c", 5)],  # mixed
    [("c", 6), ("b", 3), ("a", 1)],  # three requests, one padding row
    [("a", 3), ("b", 4), ("c", 2), ("d", 7)],  # no padding row: tokens past the requests
]


def test_every_split_has_the_captured_sizes_and_addresses(state, builder):
    for req, written in (("a", 5), ("b", 2), ("c", 0), ("d", 9)):
        _start(state, req, written)
    ptrs = None
    for split in SPLITS:
        batch = builder.build(split, pad_to=P, pad_tokens_to=T)
        assert batch.full_graph and batch.mode is BatchMode.MIXED
        assert (batch.padded_reqs, batch.padded_tokens) == (P, T)
        assert [tuple(t.shape) for t in (batch.positions, batch.slot_mapping)] == [(T,), (T,)]
        now = [t.data_ptr() for t in _tensors(batch)]
        assert ptrs is None or now == ptrs, f"split {split}: a device tensor moved"
        ptrs = now
        B = len(split)
        n = sum(q for _, q in split)
        qsl = batch.query_start_loc.tolist()
        assert batch.query_start_loc_cpu.tolist() == qsl
        assert qsl[: B + 1] == [0, *[sum(q for _, q in split[: i + 1]) for i in range(B)]]
        if B < P:  # padding rows: one token each, the last every other padding token
            assert qsl[B + 1 : P] == [n + i for i in range(1, P - B)]
            assert qsl[P] == T
            assert batch.seq_lens.tolist()[B:] == [1] * (P - B)
            assert batch.state_indices.tolist()[B:] == [-1] * (P - B)
        else:
            assert qsl[P] == n
        # padding tokens write nothing and sit at position 0
        assert batch.slot_mapping.tolist()[n:] == [-1] * (T - n)
        assert batch.positions.tolist()[n:] == [0] * (T - n)


def test_the_real_rows_equal_an_unpadded_build(state, builder):
    for req, written in (("a", 5), ("c", 0)):
        _start(state, req, written)
    split = [("a", 1), ("c", 5)]
    padded = builder.build(split, pad_to=P, pad_tokens_to=T)
    n = 6
    got = (
        padded.query_start_loc.tolist()[:3],
        padded.seq_lens.tolist()[:2],
        padded.positions.tolist()[:n],
        padded.slot_mapping.tolist()[:n],
        padded.page_table[:2].tolist(),
    )
    builder.invalidate()
    plain = builder.build(split)
    assert plain.mode is BatchMode.MIXED and not plain.full_graph
    assert got == (
        plain.query_start_loc.tolist(),
        plain.seq_lens.tolist(),
        plain.positions.tolist(),
        plain.slot_mapping.tolist(),
        plain.page_table.tolist(),
    )


def test_limits(state, builder):
    _start(state, "a", 5)
    with pytest.raises(ValueError, match="pad_tokens_to=16 needs pad_to"):
        builder.build([("a", 1)], pad_tokens_to=T)
    with pytest.raises(ValueError, match=r"pad_tokens_to=3: expected 4 \(the step's 1 tokens"):
        builder.build([("a", 1)], pad_to=4, pad_tokens_to=3)
    with pytest.raises(ValueError, match="max_num_tokens=16"):
        builder.build([("a", 1)], pad_to=4, pad_tokens_to=17)
    with pytest.raises(ValueError, match="a verify step is captured as a uniform one"):
        builder.build([("a", 3)], pad_to=4, pad_tokens_to=T, spec_tokens=2)


def test_a_verify_step_padded_for_its_graph_has_the_same_sizes_and_addresses_at_any_batch(
    state,
):
    """A verify step is captured as a uniform one: ``pad_to=P`` gives every padding request
    ``k + 1`` tokens too (``seq_len = k + 1``, no context, no KV written, no state), so the
    step has ``P * (k + 1)`` tokens at the same device addresses whatever the number of real
    requests, and one graph captured at P requests replays every smaller batch. With one
    token per padding request the token count, and with it the slot mapping's address,
    moved with the batch: the graph's KV write would have read a stale slot mapping."""
    k, P = 2, 4
    builder = BatchBuilder(state, max_batch_size=8, max_num_tokens=32, max_pages_per_request=8)
    for req in "abcd":
        _start(state, req, 5)
    ptrs = None
    for reqs in ("", "ab", "abc", "abcd"):
        batch = builder.build([(r, k + 1) for r in reqs], spec_tokens=k, pad_to=P)
        B = len(reqs)
        assert batch.mode is BatchMode.VERIFY and batch.padded_reqs == P
        assert batch.padded_tokens == P * (k + 1), (reqs, batch.padded_tokens)
        assert batch.query_lens_cpu.tolist() == [k + 1] * P
        assert batch.seq_lens_cpu[B:P].tolist() == [k + 1] * (P - B)
        assert batch.context_lens_cpu[B:P].tolist() == [0] * (P - B)
        assert batch.seq_lens.cpu().tolist()[B:P] == [k + 1] * (P - B)
        assert (batch.slot_mapping[B * (k + 1) :] == -1).all()
        assert (batch.state_indices[B:P] == -1).all()
        addresses = [t.data_ptr() for t in _tensors(batch)]
        assert ptrs is None or addresses == ptrs, reqs
        ptrs = addresses
