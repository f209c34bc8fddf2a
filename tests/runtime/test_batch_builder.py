"""BatchBuilder: every metadata tensor checked against values computed by hand from the state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_core.batch import BatchBuilder, BatchMode
from attn_core.specs import group_layers
from attn_core.state import PersistentState

PS = 4  # page size of the tiny specs


@pytest.fixture
def state(tiny_specs):
    groups = group_layers([tiny_specs["full"], tiny_specs["gdn"]])
    return PersistentState(groups, num_pages=64, num_slots=8)


@pytest.fixture
def builder(state):
    return BatchBuilder(state, max_batch_size=8, max_num_tokens=64, max_pages_per_request=8)


def _start(state, req, written):
    state.add_request(req)
    if written:
        state.ensure_capacity(req, written)
        state.advance(req, written)


def _expected_slots(state, req, start, n):
    pages = state.pages(req)
    return [pages[t // PS] * PS + t % PS for t in range(start, start + n)]


def _check_page_table(batch, state):
    for b, r in enumerate(batch.request_ids):
        pages = state.pages(r)
        assert batch.page_table[b, : len(pages)].tolist() == pages, f"row {b} ({r})"


def test_decode_batch(state, builder):
    _start(state, "a", 5)
    _start(state, "c", 3)
    batch = builder.build([("a", 1), ("c", 1)])
    assert batch.mode is BatchMode.DECODE and batch.is_decode
    assert (batch.num_reqs, batch.padded_reqs, batch.num_tokens) == (2, 2, 2)
    assert batch.query_start_loc.tolist() == [0, 1, 2]
    assert batch.seq_lens.tolist() == [6, 4]
    assert batch.context_lens.tolist() == [5, 3]
    assert batch.positions.tolist() == [5, 3]
    assert batch.slot_mapping.tolist() == _expected_slots(state, "a", 5, 1) + _expected_slots(
        state, "c", 3, 1
    )
    assert batch.state_indices.tolist() == [state.slot("a"), state.slot("c")]
    assert batch.has_initial_state.tolist() == [True, True]
    assert (batch.max_query_len, batch.max_seq_len) == (1, 6)
    assert batch.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert batch.seq_lens_cpu.tolist() == [6, 4] and batch.context_lens_cpu.tolist() == [5, 3]
    assert len(state.pages("a")) == 2 and len(state.pages("c")) == 1  # capacity reserved
    _check_page_table(batch, state)


def test_prefill_batch(state, builder):
    _start(state, "b", 0)
    _start(state, "d", 2)
    batch = builder.build([("b", 5), ("d", 7)])
    assert batch.mode is BatchMode.PREFILL
    assert batch.query_start_loc.tolist() == [0, 5, 12]
    assert batch.seq_lens.tolist() == [5, 9] and batch.context_lens.tolist() == [0, 2]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8]
    assert batch.slot_mapping.tolist() == _expected_slots(state, "b", 0, 5) + _expected_slots(
        state, "d", 2, 7
    )
    assert batch.has_initial_state.tolist() == [False, True]
    assert (batch.max_query_len, batch.max_seq_len) == (7, 9)
    # the host mirror backends plan from (the ragged prefill's K/V copies)
    assert batch.slot_mapping_cpu.tolist() == batch.slot_mapping.tolist()
    _check_page_table(batch, state)


def test_mixed_batch(state, builder):
    _start(state, "a", 5)
    _start(state, "b", 0)
    batch = builder.build([("a", 1), ("b", 3)])
    assert batch.mode is BatchMode.MIXED
    assert batch.query_start_loc.tolist() == [0, 1, 4]
    assert batch.positions.tolist() == [5, 0, 1, 2]
    assert batch.slot_mapping.tolist() == _expected_slots(state, "a", 5, 1) + _expected_slots(
        state, "b", 0, 3
    )
    assert batch.slot_mapping_cpu.tolist() == batch.slot_mapping.tolist()


def test_verify_batch(state, builder):
    _start(state, "a", 5)
    _start(state, "c", 3)
    batch = builder.build([("a", 3), ("c", 3)], spec_tokens=2)
    assert batch.mode is BatchMode.VERIFY and batch.spec_tokens == 2
    assert batch.query_start_loc.tolist() == [0, 3, 6]
    assert batch.positions.tolist() == [5, 6, 7, 3, 4, 5]
    assert batch.seq_lens.tolist() == [8, 6]
    with pytest.raises(ValueError, match=r"k=2 needs 3 new tokens per request, got \[3, 2\]"):
        builder.build([("a", 3), ("c", 2)], spec_tokens=2)


def test_padded_batch(state, builder):
    _start(state, "a", 5)
    batch = builder.build([("a", 1)], pad_to=4)
    assert (batch.num_reqs, batch.padded_reqs) == (1, 4)
    assert (batch.num_tokens, batch.padded_tokens) == (1, 4)
    assert batch.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert batch.seq_lens.tolist() == [6, 1, 1, 1]
    assert batch.context_lens.tolist() == [5, 0, 0, 0]
    assert batch.positions.tolist() == [5, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [*_expected_slots(state, "a", 5, 1), -1, -1, -1]
    assert batch.state_indices.tolist() == [state.slot("a"), -1, -1, -1]
    assert batch.page_table.shape == (4, 8)
    assert batch.page_table[1:, 0].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="pad_to=0: smaller than the batch"):
        builder.build([("a", 1)], pad_to=0)
    with pytest.raises(ValueError, match="exceeds max_batch_size=8"):
        builder.build([("a", 1)], pad_to=9)


def test_linear_only_model_has_no_pages(tiny_specs):
    """A model of linear layers only: no page table or slot mapping, state slots per request."""
    state = PersistentState(group_layers([tiny_specs["gdn"]]), num_pages=1, num_slots=4)
    builder = BatchBuilder(state, max_batch_size=4, max_num_tokens=8, max_pages_per_request=4)
    for req, written in (("a", 5), ("b", 0)):
        _start(state, req, written)
    batch = builder.build([("a", 1), ("b", 3)])
    assert batch.page_table is None and batch.slot_mapping is None
    assert batch.state_indices.tolist() == [state.slot("a"), state.slot("b")]
    assert batch.has_initial_state.tolist() == [True, False]
    assert batch.positions.tolist() == [5, 0, 1, 2]


def test_limits(state, builder):
    _start(state, "a", 0)
    with pytest.raises(ValueError, match="65 tokens exceeds max_num_tokens=64"):
        builder.build([("a", 65)])
    with pytest.raises(ValueError, match=r"new-token counts must be >= 0, got \[-1\]"):
        builder.build([("a", -1)])


def test_buffers_keep_their_address(state, builder):
    _start(state, "a", 5)
    _start(state, "c", 3)
    b1 = builder.build([("a", 1), ("c", 1)], pad_to=4)
    ptrs = [t.data_ptr() for t in (b1.query_start_loc, b1.seq_lens, b1.page_table, b1.positions)]
    state.advance("a", 1)
    state.advance("c", 1)
    b2 = builder.build([("c", 1), ("a", 1)], pad_to=4)
    assert ptrs == [
        t.data_ptr() for t in (b2.query_start_loc, b2.seq_lens, b2.page_table, b2.positions)
    ]
    assert b2.step == b1.step + 1
    assert b2.seq_lens.tolist() == [5, 7, 1, 1]
    _check_page_table(b2, state)


class _IndexCopySpy:
    """Counts page-table entries copied host -> device (BatchBuilder uses ``index_copy_``)."""

    def __init__(self, monkeypatch):
        self.entries: list[int] = []
        original = torch.Tensor.index_copy_

        def spy(t, dim, index, source):
            self.entries.append(int(index.numel()))
            return original(t, dim, index, source)

        monkeypatch.setattr(torch.Tensor, "index_copy_", spy)

    def take(self) -> int:
        n = sum(self.entries)
        self.entries.clear()
        return n


def test_page_table_copies_only_new_pages(state, builder, monkeypatch):
    spy = _IndexCopySpy(monkeypatch)
    _start(state, "a", 2)
    _start(state, "c", 0)
    batch = builder.build([("a", 1), ("c", 1)])
    assert spy.take() == 2  # one page each, first sight of both rows
    grown = 0
    for _ in range(6):  # decode both: a page appears every PS tokens
        state.advance("a", 1)
        state.advance("c", 1)
        before = {r: len(state.pages(r)) for r in ("a", "c")}
        batch = builder.build([("a", 1), ("c", 1)])
        _check_page_table(batch, state)
        new_pages = sum(len(state.pages(r)) - before[r] for r in ("a", "c"))
        assert spy.take() == new_pages
        grown += new_pages
    assert grown == 3  # 'a' 3 -> 10 tokens opens pages 2 and 3, 'c' 1 -> 8 opens page 2


def test_page_table_delta_counts(state, builder, monkeypatch):
    spy = _IndexCopySpy(monkeypatch)
    _start(state, "a", 3)
    builder.build([("a", 1)])  # 4 tokens: 1 page
    assert spy.take() == 1
    state.advance("a", 1)
    builder.build([("a", 1)])  # token 4 opens page 2: one new entry
    assert spy.take() == 1
    state.advance("a", 1)
    builder.build([("a", 1)])  # token 5 in page 2: nothing to copy
    assert spy.take() == 0
    state.advance("a", 1)
    batch = builder.build([("a", 1)])
    assert spy.take() == 0
    _check_page_table(batch, state)


def test_page_table_after_copy_on_write(tiny_specs, monkeypatch):
    state = PersistentState(group_layers([tiny_specs["full"]]), num_pages=32, num_slots=0)
    builder = BatchBuilder(state, max_batch_size=4, max_num_tokens=32, max_pages_per_request=8)
    tokens = list(range(100, 106))
    _start(state, "p", 6)
    assert state.cache_prefix("p", tokens) == 4  # one full page cached
    state.release("p")
    hit = state.match_prefix([*tokens[:4], 7, 8], max_tokens=3)  # ends inside the cached page
    assert hit.num_tokens == 3
    state.add_request("q", prefix=hit)
    shared = state.pages("q")
    batch = builder.build([("q", 0)])  # nothing written: the row holds the shared page
    assert batch.page_table[0, :1].tolist() == shared
    spy = _IndexCopySpy(monkeypatch)
    batch = builder.build([("q", 1)])  # writing token 3 copies the shared page first
    cow = state.pages("q")
    assert cow != shared
    assert batch.page_table[0, :1].tolist() == cow
    assert spy.take() >= 1
    assert batch.slot_mapping.tolist() == [cow[0] * PS + 3]


def test_rows_released_and_reused(state, builder):
    _start(state, "a", 6)
    _start(state, "b", 2)
    builder.build([("a", 1), ("b", 1)])
    state.release("a")
    _start(state, "d", 9)  # likely reuses a's freed pages, in row 0 now
    batch = builder.build([("d", 1), ("b", 1)])
    _check_page_table(batch, state)
    assert batch.slot_mapping.tolist() == _expected_slots(state, "d", 9, 1) + _expected_slots(
        state, "b", 2, 1
    )
    assert batch.state_indices.tolist() == [state.slot("d"), state.slot("b")]
    # the same request id coming back after a release gets its new pages
    state.release("d")
    _start(state, "x", 4)  # takes some freed pages first
    _start(state, "d", 9)
    batch = builder.build([("d", 1), ("b", 1)])
    _check_page_table(batch, state)
    # a shorter batch: rows beyond it are not read, a later longer batch rewrites them
    batch = builder.build([("b", 1)], pad_to=2)
    assert batch.page_table[1, 0].item() == 0
    batch = builder.build([("b", 1), ("x", 1)])
    _check_page_table(batch, state)


def test_encoder_batch():
    builder = BatchBuilder(None, max_batch_size=4, max_num_tokens=32)
    batch = builder.build_encoder([3, 5, 1])
    assert batch.mode is BatchMode.ENCODER
    assert batch.query_start_loc.tolist() == [0, 3, 8, 9]
    assert batch.seq_lens.tolist() == [3, 5, 1] and batch.context_lens.tolist() == [0, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert batch.page_table is None and batch.slot_mapping is None
    with pytest.raises(ValueError, match="33 tokens exceed max_num_tokens=32"):
        builder.build_encoder([30, 3])


@pytest.mark.parametrize(
    ("lens", "index", "value"), [([2.7, 3], 0, "2.7"), ([5, -2], 1, "-2"), ([3, True], 1, "True")]
)
def test_encoder_lengths_that_are_not_token_counts_are_refused_by_index(lens, index, value):
    """2.7 was cut to 2 tokens in silence, -2 raised numpy's bare "repeats may not contain
    negative values"."""
    builder = BatchBuilder(None, max_batch_size=4, max_num_tokens=32)
    with pytest.raises(ValueError, match=rf"seq_lens\[{index}\]={value}: expected a non-negative"):
        builder.build_encoder(lens)
    assert builder.build_encoder([3, 0]).query_start_loc.tolist() == [0, 3, 3]


def test_build_reads_nothing_back_from_device_tensors(state, builder, monkeypatch):
    """On CPU: build() must not call .item() / .tolist() / bool() / int() on torch tensors
    (on CUDA each of those would be a device-to-host synchronisation)."""
    _start(state, "a", 5)
    _start(state, "c", 0)
    calls = []

    def forbid(name):
        def f(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"BatchBuilder.build called Tensor.{name}")

        return f

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    builder.build([("a", 1), ("c", 4)], pad_to=3)
    builder.build([("a", 1), ("c", 1)])
    monkeypatch.undo()
    assert calls == []


@pytest.mark.gpu
def test_build_and_prepare_do_not_sync_on_cuda(tiny_specs, ref_registry):
    from attn_core.runtime import AttentionRuntime
    from attn_core.selector import select
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints

    groups = group_layers([tiny_specs["full"], tiny_specs["gdn"], tiny_specs["mla"]])
    device = torch.device("cuda")
    state = PersistentState(groups, num_pages=64, num_slots=8, device=device)
    plan = select(
        groups,
        ref_registry,
        DeviceCapabilities.detect(device),
        ExecutionConstraints(max_batch_size=8, max_num_tokens=64, downgrade="allow"),
    )
    runtime = AttentionRuntime(plan, ref_registry, state=state, device=device)
    builder = BatchBuilder(
        state, max_batch_size=8, max_num_tokens=64, max_pages_per_request=8, device=device
    )
    for r, n in (("a", 5), ("b", 0)):
        _start(state, r, n)
    builder.build([("a", 1), ("b", 3)])  # warm-up (first-use allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            batch = builder.build([("a", 1), ("b", 1)], pad_to=4)
            runtime.prepare(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert np.array_equal(batch.seq_lens_cpu[:2], [6, 1])


class _GeneralOnly(BatchBuilder):
    """The builder with its decode fast path turned off: every step takes the general path."""

    def _build_decode(self, ids, B, P, *_):  # never leaves a steady-decode memo either
        return self._build_general(ids, (1,) * B, B, P, 0)


_SCALARS = ("mode", "num_reqs", "padded_reqs", "num_tokens", "padded_tokens", "max_query_len")
_DEVICE = ("query_start_loc", "seq_lens", "context_lens", "slot_mapping", "positions")
_HOST = ("query_start_loc_cpu", "seq_lens_cpu", "context_lens_cpu")


def _assert_same_batch(a, b):
    for name in (*_SCALARS, "max_seq_len", "request_ids", "step", "state_epoch"):
        assert getattr(a, name) == getattr(b, name), name
    for name in (*_DEVICE, "state_indices", "has_initial_state"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
    for name in _HOST:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for bt in (a, b):
        assert bt.page_table.shape == (bt.padded_reqs, 16)
        assert bt.page_table[bt.num_reqs :, 0].tolist() == [0] * (bt.padded_reqs - bt.num_reqs)


@pytest.mark.parametrize("kinds", [("full",), ("full", "gdn")])
def test_decode_fast_path_and_page_table_deltas_over_a_long_run(tiny_specs, kinds):
    """Random run: requests join (sharing cached prefix pages, some ending inside a page, so
    their first write copies it), prefill in chunks, decode across page boundaries, leave and
    reorder; pad_to at random. Every step the decode fast path equals the general path, and
    the page table kept by deltas (some split in chunks) equals the state's pages."""
    rng = np.random.default_rng(7)
    linear = "gdn" in kinds
    state = PersistentState(
        group_layers([tiny_specs[k] for k in kinds]), num_pages=200, num_slots=16
    )
    kw = {"max_batch_size": 8, "max_num_tokens": 64, "max_pages_per_request": 16}
    fast, general = BatchBuilder(state, **kw), _GeneralOnly(state, **kw)
    fast._delta_cap = general._delta_cap = 5  # small: large deltas travel in several chunks
    prompt = list(range(1000, 1040))
    target: dict[str, int] = {}  # prompt length of each live request
    order: list[str] = []
    fast_steps = 0
    for step in range(400):
        if len(order) < 7 and rng.random() < 0.25:  # join
            r = f"r{step}"
            n = int(rng.integers(1, 14))
            hit = None
            if not linear and rng.random() < 0.6:
                hit = state.match_prefix(prompt[:n], max_tokens=int(rng.integers(0, n)))
            state.add_request(r, prefix=hit if hit is not None and hit.num_tokens else None)
            target[r] = n
            order.insert(int(rng.integers(0, len(order) + 1)), r)
        if order and rng.random() < 0.08:  # leave
            r = order.pop(int(rng.integers(0, len(order))))
            if not linear and state.num_tokens(r) >= 8:
                state.cache_prefix(r, prompt[: state.num_tokens(r)])
            state.release(r)
            del target[r]
        if len(order) > 1 and rng.random() < 0.1:
            rng.shuffle(order)
        if not order:
            continue
        prefilling = [r for r in order if state.num_tokens(r) < target[r]]
        if prefilling and rng.random() < 0.5:
            reqs = [(r, min(3, target[r] - state.num_tokens(r)) if r in prefilling else 1)
                    for r in order]  # fmt: skip
        else:
            reqs = [(r, 1) for r in order if r not in prefilling]
        if not reqs or any(state.num_tokens(r) + n > 16 * 4 for r, n in reqs):
            for r in [r for r in order if state.num_tokens(r) > 40]:  # long enough: finish
                order.remove(r)
                state.release(r)
                del target[r]
            continue
        pad = int(rng.integers(len(reqs), 9)) if rng.random() < 0.3 else None
        before_fast = fast._step
        a = fast.build(reqs, pad_to=pad)
        b = general.build(reqs, pad_to=pad)
        assert fast._step == before_fast + 1
        fast_steps += a.is_decode
        _assert_same_batch(a, b)
        _check_page_table(a, state)
        for r, n in reqs:
            state.advance(r, n)
    assert fast_steps > 100


def test_host_mirrors_survive_later_builds(state, builder):
    """Each step stages its metadata in the next buffer of a ring: a batch's host mirrors
    stay as built while the next builds write elsewhere (the previous step's copy may still
    be reading its buffer on a GPU)."""
    _start(state, "a", 5)
    _start(state, "c", 3)
    first = builder.build([("a", 1), ("c", 1)])
    seen = [first.seq_lens_cpu.copy(), first.context_lens_cpu.copy()]
    for _ in range(3):
        state.advance("a", 1)
        state.advance("c", 1)
        later = builder.build([("c", 1), ("a", 1)], pad_to=4)
    assert first.seq_lens_cpu.tolist() == seen[0].tolist() == [6, 4]
    assert first.context_lens_cpu.tolist() == seen[1].tolist()
    assert later.seq_lens_cpu.tolist() == [7, 9, 1, 1]


def test_large_page_table_delta_grows_the_staging_buffer(tiny_specs, monkeypatch):
    """A delta larger than the staging buffer holds (every row rewritten at once) grows it."""
    state = PersistentState(group_layers([tiny_specs["full"]]), num_pages=256, num_slots=0)
    builder = BatchBuilder(state, max_batch_size=8, max_num_tokens=8, max_pages_per_request=16)
    spy = _IndexCopySpy(monkeypatch)
    initial = builder._ring[0].raw.nbytes
    for i in range(8):
        _start(state, f"r{i}", 40)  # 10 pages each
    reqs = [(f"r{i}", 1) for i in range(8)]
    batch = builder.build(reqs)
    assert spy.take() == 8 * 11  # 11 pages each after reserving the 41st token
    _check_page_table(batch, state)
    for _ in range(len(builder._ring)):  # every ring buffer sees a full rewrite
        for r, _ in reqs:
            state.advance(r, 1)
        reqs = reqs[1:] + reqs[:1]  # every row changes request
        batch = builder.build(reqs)
        assert spy.take() == sum(len(state.pages(r)) for r, _ in reqs) >= 8 * 11
        _check_page_table(batch, state)
    assert all(slot.raw.nbytes > initial for slot in builder._ring)
