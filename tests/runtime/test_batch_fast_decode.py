"""BatchBuilder steady decode: a step with the same requests as the last decode step reuses its
rows and page checks. Every test changes the state between steps in a way that must defeat that
memo, and checks each built batch against the state itself and against a fresh BatchBuilder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_core.batch import BatchBuilder
from attn_core.specs import group_layers
from attn_core.state import PersistentState

PS = 4  # page size of the tiny specs
KW = {"max_batch_size": 8, "max_num_tokens": 64, "max_pages_per_request": 16}


class _Counting(BatchBuilder):
    """Counts the steps that took the steady path to the end."""

    hits = 0

    def _build_steady(self, steady):
        batch = super()._build_steady(steady)
        self.hits += batch is not None
        return batch


def _state(tiny_specs, kinds=("full", "gdn"), num_pages=96):
    groups = group_layers([tiny_specs[k] for k in kinds])
    return PersistentState(groups, num_pages=num_pages, num_slots=16)


def _start(state, req, written, prefix=None):
    state.add_request(req, prefix=prefix)
    if written > state.num_tokens(req):
        state.ensure_capacity(req, written)
        state.advance(req, written - state.num_tokens(req))


_FIELDS = ("query_start_loc", "seq_lens", "context_lens", "positions", "slot_mapping")
_OPTIONAL = ("state_indices", "has_initial_state")


def _snapshot(batch):
    """The batch's device tensors, copied (the builder's buffers are rewritten next step)."""
    out = {}
    for name in (*_FIELDS, *_OPTIONAL, "page_table"):
        t = getattr(batch, name)
        out[name] = None if t is None else t.clone()
    for name in ("query_start_loc_cpu", "seq_lens_cpu", "context_lens_cpu"):
        out[name] = getattr(batch, name).copy()
    return out


def _check(builder, state, reqs, pad_to=None):
    """Build one step; assert it equals the state's own answer and a fresh builder's batch."""
    batch = builder.build(reqs, pad_to=pad_to)
    got = _snapshot(batch)
    B, P = len(reqs), batch.padded_reqs
    assert batch.num_reqs == B and batch.is_decode
    assert batch.request_ids == tuple(r for r, _ in reqs)
    # against the state
    ctx = [state.num_tokens(r) for r, _ in reqs]
    assert got["positions"][:B].tolist() == ctx
    assert got["context_lens"][:B].tolist() == ctx
    assert got["seq_lens"][:B].tolist() == [c + 1 for c in ctx]
    assert batch.max_seq_len == max(ctx) + 1
    if got["slot_mapping"] is not None:
        want = [state.slot_mapping(r, c, c + 1)[0] for (r, _), c in zip(reqs, ctx, strict=True)]
        assert got["slot_mapping"][:B].tolist() == want
        refs = state.page_allocator.refcount_array
        for r, c in zip((r for r, _ in reqs), ctx, strict=True):
            pages = state.pages(r)
            assert refs[pages[c // PS]] == 1, f"{r} writes into a shared page"
        for b, (r, _) in enumerate(reqs):
            pages = state.pages(r)
            assert got["page_table"][b, : len(pages)].tolist() == pages, f"row {b} ({r})"
    if got["state_indices"] is not None:
        assert got["state_indices"][:B].tolist() == [state.slot(r) for r, _ in reqs]
        assert got["has_initial_state"][:B].tolist() == [c > 0 for c in ctx]
    # against a fresh builder, which must find nothing left to reserve
    free = state.num_free_pages
    fresh = _snapshot(BatchBuilder(state, **KW).build(reqs, pad_to=pad_to))
    assert state.num_free_pages == free, "a fresh builder had to reserve or copy pages"
    for name, want in fresh.items():
        have = got[name]
        assert (have is None) == (want is None), name
        if name == "page_table" and have is not None:
            # rows of the fresh builder hold each request's pages then zeros; ours may keep
            # stale entries past a request's pages (never read), so compare the used part
            for b, (r, _) in enumerate(reqs):
                n = len(state.pages(r))
                assert torch.equal(have[b, :n], want[b, :n]), f"page_table row {b}"
            assert have[B:P, 0].tolist() == want[B:P, 0].tolist() == [0] * (P - B)
        elif isinstance(have, torch.Tensor):
            assert torch.equal(have, want), f"{name}: {have.tolist()} != {want.tolist()}"
        elif have is not None:
            assert np.array_equal(have, want), name
    return batch


def _advance(state, reqs):
    for r, _ in reqs:
        state.advance(r, 1)


def _steady_run(builder, state, reqs, steps, pad_to=None):
    for _ in range(steps):
        _check(builder, state, reqs, pad_to)
        _advance(state, reqs)


def test_steady_steps_hit_and_page_crossings_miss(tiny_specs):
    """(a) Same requests many steps in a row: most steps take the steady path, and the steps
    whose requests cross a page boundary (new pages) are right too."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 9), ("c", 1)):  # all cross page boundaries together
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1), ("c", 1)]
    _steady_run(builder, state, reqs, 20)
    assert builder.hits >= 8  # not the two steps after a crossing
    _start(state, "d", 6)  # crosses at other steps: fewer hits, still right
    _steady_run(builder, state, [*reqs, ("d", 1)], 8)
    before = builder.hits
    _steady_run(builder, state, reqs, 10, pad_to=6)  # padded: the memo is per pad_to
    assert builder.hits > before


def test_staggered_page_crossings_stay_on_the_steady_path(tiny_specs):
    """Requests at every offset within a page: some cross a page boundary on every step (what
    a server sees). Those steps stay on the steady path, which appends the crossing requests'
    pages itself, and every batch matches the state and a fresh builder."""
    state = _state(tiny_specs)
    reqs = []
    for i in range(8):
        _start(state, f"s{i}", 5 + i)  # offsets 1, 2, 3, 0, ... within a page of 4
        reqs.append((f"s{i}", 1))
    builder = _Counting(state, **KW)
    steps = 4 * PS
    _steady_run(builder, state, reqs, steps)
    assert builder.hits >= steps - 2, builder.hits
    assert builder.path_counts["steady"] == builder.hits
    _steady_run(builder, state, reqs[:5], steps, pad_to=8)  # padded rows alike
    assert builder.hits >= 2 * steps - 4, builder.hits
    counts = builder.path_counts
    assert counts["steady"] == builder.hits and counts["general"] == 0
    assert counts["steady"] + counts["decode"] == 2 * steps
    state.check_invariants()


def test_steady_crossing_into_a_shared_reserved_page(tiny_specs):
    """A request crosses into a page it reserved ahead, and that page is shared: the steady
    path leaves the step to the full path (no page appended for another crossing request
    before it gives up), which copies the page before the write."""
    state = _state(tiny_specs, kinds=("full",))
    _start(state, "a", 5)
    _start(state, "b", 9)
    reqs = [("a", 1), ("b", 1)]
    builder = _Counting(state, **KW)
    _steady_run(builder, state, reqs, 1)
    state.ensure_capacity("a", 12)  # page 2 reserved ahead by the caller
    _steady_run(builder, state, reqs, 2)  # a at 8, b at 12: both cross next step
    assert builder._steady is not None
    page = state.pages("a")[2]
    # White box: a shared page reserved ahead, as if shared when the step was remembered
    # (no public API shares a page past a request's tokens; the check is there for one).
    state.page_allocator.incref([page])
    builder._steady.alloc_changes = state.page_allocator.changes
    hits, b_pages = builder.hits, len(state.pages("b"))
    try:
        _check(builder, state, reqs)
        assert builder.hits == hits  # not the steady path
        assert state.pages("a")[2] != page  # copied on write
        assert len(state.pages("b")) == b_pages + 1  # appended once, by the full path
    finally:
        state.page_allocator.decref([page])
    _advance(state, reqs)
    _steady_run(builder, state, reqs, 2 * PS)
    state.check_invariants()


def test_steady_crossing_out_of_pages_keeps_every_request(tiny_specs):
    """A steady step whose crossing requests find no free page raises OutOfPagesError naming
    a request, with every request's pages and the page table as before; once a request is
    released the same step goes through."""
    from attn_core.state.errors import OutOfPagesError

    state = _state(tiny_specs, kinds=("full",), num_pages=6)
    _start(state, "a", 6)  # 2 pages
    _start(state, "b", 5)  # 2 pages
    _start(state, "c", 4)
    state.ensure_capacity("c", 8)  # 2 pages: none left
    assert state.num_free_pages == 0
    reqs = [("a", 1), ("b", 1)]
    builder = _Counting(state, **KW)
    _steady_run(builder, state, reqs, 2)  # a at 8, b at 7: a crosses next step
    assert builder.hits == 1
    before = {r: state.pages(r) for r in "abc"}
    with pytest.raises(OutOfPagesError, match="'a'"):
        builder.build(reqs)
    assert {r: state.pages(r) for r in "abc"} == before
    state.check_invariants()
    state.release("c")  # two pages free: one each for a and b
    _steady_run(builder, state, reqs, PS)
    state.check_invariants()


def test_tuple_input_and_new_tuple_objects_both_hit(tiny_specs):
    state = _state(tiny_specs)
    for r, n in (("a", 1), ("b", 2)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    for i in range(6):  # a tuple of requests, then fresh (id, 1) tuples each step
        reqs = (("a", 1), ("b", 1)) if i % 2 else [(r, 1) for r in ("a", "b")]
        _check(builder, state, reqs)
        _advance(state, reqs)
    assert builder.hits >= 1


def test_cache_prefix_and_shared_pages_force_copy_on_write(tiny_specs):
    """(b) Between steady steps, a request's full blocks are cached and a new request joins
    on them ending inside a shared page (its first write must copy the page); and a page a
    request writes next is shared behind the builder's back (refcount > 1)."""
    state = _state(tiny_specs, kinds=("full",))
    prompt = list(range(100, 140))
    _start(state, "a", 9)
    builder = _Counting(state, **KW)
    _steady_run(builder, state, [("a", 1)], 2)  # a at 11 tokens, writing page 2
    assert state.cache_prefix("a", prompt[:11]) == 8
    _check(builder, state, [("a", 1)])  # refcounts changed: the full check, still right
    _advance(state, [("a", 1)])
    hit = state.match_prefix(prompt[:9], max_tokens=6)
    assert hit.num_tokens == 6
    state.add_request("b", prefix=hit)  # shares a's page 1, ends inside it
    shared = state.pages("b")[1]
    reqs = [("a", 1), ("b", 1)]
    _check(builder, state, reqs)
    assert state.pages("b")[1] != shared  # copied on write
    _advance(state, reqs)
    _steady_run(builder, state, reqs, 3)
    # another holder appears on the very page "a" writes next step (white box: an incref
    # the way a new sharer would take it; undone below so the pool stays consistent)
    only_a = [("a", 1)]
    for _ in range(2 * PS):  # to a step that writes the page the last step wrote, remembered
        if builder._steady is not None and state.num_tokens("a") % PS:
            break
        _steady_run(builder, state, only_a, 1)
    assert builder._steady is not None and state.num_tokens("a") % PS
    page = state.pages("a")[state.num_tokens("a") // PS]
    hits = builder.hits
    state.page_allocator.incref([page])
    try:
        _check(builder, state, only_a)
        assert builder.hits == hits  # not the steady path
        assert state.pages("a")[state.num_tokens("a") // PS] != page
    finally:
        state.page_allocator.decref([page])
    _advance(state, only_a)
    _steady_run(builder, state, reqs, 3)


def test_release_and_add_again_under_the_same_id(tiny_specs):
    """(c) A request released and added again under the same id (same dense row, same length)
    holds other pages and another state slot."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 9)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 2)  # b at 11, writing page 2
    old_pages, old_slot = state.pages("b"), state.slot("b")
    n = state.num_tokens("b")
    state.release("b")
    _start(state, "x", 8)  # takes b's freed pages and slot
    _start(state, "b", n)
    assert state.pages("b") != old_pages[: len(state.pages("b"))]
    assert state.slot("b") != old_slot
    _steady_run(builder, state, reqs, 4)
    hits = builder.hits
    _steady_run(builder, state, reqs, 2)
    assert builder.hits > hits


def test_reordered_and_mutated_request_lists(tiny_specs):
    """(d) Reordered ids; a list reordered in place; lists of [id, n] mutated in place."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 9), ("c", 2)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1), ("c", 1)]
    _steady_run(builder, state, reqs, 2)
    reqs.reverse()  # the same list object, reordered in place
    _steady_run(builder, state, reqs, 2)
    _steady_run(builder, state, [("b", 1), ("a", 1), ("c", 1)], 2)
    _steady_run(builder, state, [("b", 1), ("a", 1)], 2)  # a subset
    mutable = [["a", 1], ["c", 1]]
    _steady_run(builder, state, mutable, 2)  # the second step is in sync (no crossing)
    mutable[0][0], mutable[1][0] = "c", "a"  # the same inner lists now name other requests
    _check(builder, state, mutable)


def test_offload_and_restore(tiny_specs):
    """(e) A request offloaded between steady steps cannot be built; restored, it holds new
    pages and a new slot."""
    from attn_core.state.errors import StateError

    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 6)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 2)
    old = state.pages("b")
    state.offload("b")
    with pytest.raises(StateError, match="offloaded"):
        builder.build(reqs)
    _start(state, "x", 8)  # takes b's pages
    _steady_run(builder, state, [("a", 1)], 2)
    state.restore("b")
    assert state.pages("b") != old
    _steady_run(builder, state, reqs, 4)


def test_capacity_reserved_by_the_caller_between_steps(tiny_specs):
    """(f) The caller reserves pages ahead: the steps then cross into pages the builder has
    not seen yet, with no reservation of its own."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 2)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 2)
    for r, _ in reqs:
        state.ensure_capacity(r, state.num_tokens(r) + 3 * PS)
    _steady_run(builder, state, reqs, 3 * PS)
    assert builder.hits >= 6


def test_other_builds_in_between(tiny_specs):
    """A prefill step, a verify step, an encoder step or invalidate() between decode steps of
    the same requests; and a model of linear layers only (no page table)."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 2)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 2)
    builder.build([("b", 3), ("a", 2)])  # prefill in another order, pages reserved
    state.advance("b", 3)
    state.advance("a", 2)
    _steady_run(builder, state, reqs, 2)
    builder.build(reqs, spec_tokens=0, pad_to=5)
    _steady_run(builder, state, reqs, 2)
    builder.build_encoder([3, 2])
    _steady_run(builder, state, reqs, 2)
    builder.invalidate()
    _steady_run(builder, state, reqs, 2)


def test_general_step_that_reserves_nothing_in_between(tiny_specs):
    """A prefill step in another order that needs no new page (no state counter moves)
    rewrites the page-table rows: the next decode step must not trust the last one's."""
    state = _state(tiny_specs)
    for r, n in (("a", 5), ("b", 9)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 2)  # a at 7 of 8, b at 11 of 12
    changes = (state.changes, state.page_allocator.changes)
    builder.build([("b", 1), ("a", 0)])  # mixed step, the rows swapped, nothing reserved
    assert (state.changes, state.page_allocator.changes) == changes
    _steady_run(builder, state, reqs, 1)


def test_linear_only_model(tiny_specs):
    """No page table: the state counter alone guards the remembered state slots (a request
    added again under the same id gets another slot)."""
    state = _state(tiny_specs, kinds=("gdn",))
    for r, n in (("a", 0), ("b", 3)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    _steady_run(builder, state, reqs, 4, pad_to=3)
    assert builder.hits >= 2
    old = state.slot("b")
    state.release("b")
    _start(state, "x", 0)  # takes b's slot
    _start(state, "b", 3)
    assert state.slot("b") != old
    _steady_run(builder, state, reqs, 3, pad_to=3)


def test_random_run_against_a_fresh_builder(tiny_specs):
    """Random state changes between decode steps of mostly the same requests."""
    rng = np.random.default_rng(3)
    state = _state(tiny_specs, kinds=("full",), num_pages=160)
    prompt = list(range(500, 600))
    builder = _Counting(state, **KW)
    order = []
    for i in range(4):
        _start(state, f"r{i}", int(rng.integers(1, 12)))
        order.append(f"r{i}")
    offloaded: list[str] = []
    for step in range(160):
        u = rng.random()
        if u < 0.04 and len(order) > 1:
            r = order.pop(int(rng.integers(0, len(order))))
            state.release(r)
        elif u < 0.08 and len(order) < 6:
            n = int(rng.integers(1, 20))
            hit = state.match_prefix(prompt[:n], max_tokens=n - 1)
            r = f"n{step}"
            _start(state, r, n, prefix=hit if hit.num_tokens else None)
            order.insert(int(rng.integers(0, len(order) + 1)), r)
        elif u < 0.11:
            r = order[int(rng.integers(0, len(order)))]
            state.cache_prefix(r, prompt[: state.num_tokens(r)])
        elif u < 0.13 and len(order) > 1:
            r = order.pop(int(rng.integers(0, len(order))))
            state.offload(r)
            offloaded.append(r)
        elif u < 0.16 and offloaded:
            r = offloaded.pop()
            state.restore(r)
            order.append(r)
        elif u < 0.19:
            r = order[int(rng.integers(0, len(order)))]
            state.ensure_capacity(r, state.num_tokens(r) + int(rng.integers(1, 9)))
        elif u < 0.21:
            rng.shuffle(order)
        for r in [r for r in order if state.num_tokens(r) > 50]:
            order.remove(r)
            state.release(r)
        if not order:
            _start(state, f"m{step}", 3)
            order.append(f"m{step}")
        reqs = [(r, 1) for r in order]
        _check(builder, state, reqs, pad_to=6 if step % 40 >= 30 else None)
        _advance(state, reqs)
        state.check_invariants()
    assert builder.hits > 30


@pytest.mark.gpu
def test_events_ride_the_current_stream_on_cuda(tiny_specs):
    """On CUDA the ring's events are recorded on the current stream, found by its raw pointer:
    builds under a side stream for several turns of the ring stay right."""
    device = torch.device("cuda")
    groups = group_layers([tiny_specs["full"]])
    state = PersistentState(groups, num_pages=64, num_slots=0, device=device)
    builder = BatchBuilder(state, device=device, **KW)
    _start(state, "a", 5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert builder._current_stream() == torch.cuda.current_stream()
        for _ in range(3 * len(builder._ring)):
            batch = builder.build([("a", 1)])
            n = state.num_tokens("a")
            assert batch.positions.tolist() == [n]
            assert batch.slot_mapping.tolist() == state.slot_mapping("a", n, n + 1)
            state.advance("a", 1)
    assert builder._current_stream() == torch.cuda.current_stream()


def test_ring_buffers_rewritten_by_other_builds(tiny_specs):
    """A ring buffer keeps a steady step's static content (query_start_loc, slots, padding)
    for the next steady step of that shape, unless another build wrote into it meanwhile."""
    state = _state(tiny_specs)
    for r, n in (("a", 1), ("b", 5)):
        _start(state, r, n)
    builder = _Counting(state, **KW)
    reqs = [("a", 1), ("b", 1)]
    ring = len(builder._ring)
    _steady_run(builder, state, reqs, ring + 2, pad_to=4)  # every buffer staged
    for n in (2, 3):  # prefill steps (other query_start_loc, padding) in two buffers
        builder.build([("a", n), ("b", n)], pad_to=4)
        builder.build_encoder([3, 1, 2])
    _steady_run(builder, state, reqs, ring + 2, pad_to=4)
