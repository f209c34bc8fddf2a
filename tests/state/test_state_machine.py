"""Hypothesis state machine over PersistentState: random add / ensure+write / advance / release /
snapshot / cache_prefix / match / rewrite (copy-on-write) / offload / restore.

The KV of token ``p`` is a function of the prefix ``tokens[:p+1]`` (as in a real model), so every
request and every cached block can be checked against the value it must hold. Invariants: page
and slot refcounts equal their holders, nothing both free and used, every live request and every
cached block reads the right values, and nothing leaks once everything is released.
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attn_core.specs import LayerSpec, group_layers
from attn_core.state import OutOfPagesError, OutOfSlotsError, PersistentState, PrefixHit

PS = 2
FULL = LayerSpec(
    kind="full", num_heads=1, num_kv_heads=1, head_dim=1, dtype="float32", page_size=PS
)
LIN = LayerSpec(
    kind="linear",
    num_heads=1,
    num_kv_heads=1,
    head_dim=1,
    head_dim_v=1,
    linear_variant="gated_deltanet",
    conv_kernel_size=2,
    conv_channels=1,
    dtype="float32",
)
GROUPS = group_layers([FULL, LIN])  # layer 0 full, layer 1 linear

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=10)


def kv_value(prefix) -> float:
    h = 7
    for t in prefix:
        h = (h * 3 + t + 1) % 251
    return float(h)


def state_value(prefix) -> float:
    return float(len(prefix) * 1000) + kv_value(prefix)


class StateMachine(RuleBasedStateMachine):
    """A hybrid model: hits end on snapshots (block boundaries)."""

    groups = GROUPS

    def __init__(self) -> None:
        super().__init__()
        self.s = PersistentState(self.groups, num_pages=14, num_slots=7)
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}
        self.offloaded: set[int] = set()

    # -- helpers --------------------------------------------------------------------------------
    def _k(self) -> torch.Tensor:
        return self.s.kv_cache.layer(0).k.view(-1)

    def _v(self) -> torch.Tensor:
        return self.s.kv_cache.layer(0).v.view(-1)

    def _write(self, rid: int, start: int, end: int) -> None:
        toks = self.tokens[rid]
        rows = self.s.slot_mapping(rid, start, end)
        for p, row in zip(range(start, end), rows, strict=True):
            self._k()[row] = kv_value(toks[: p + 1])
            self._v()[row] = -kv_value(toks[: p + 1])

    def _live(self) -> list[int]:
        return [r for r in self.tokens if r not in self.offloaded]

    def _snapshot_free(self) -> tuple[int, int]:
        return self.s.num_free_pages, self.s.num_free_slots

    # -- rules ----------------------------------------------------------------------------------
    @rule(rid=st.integers(0, 4), tokens=TOKENS, use_prefix=st.booleans())
    def add(self, rid: int, tokens: list[int], use_prefix: bool) -> None:
        if rid in self.tokens:
            return
        hit = self.s.match_prefix(tokens, max_tokens=len(tokens) - 1) if use_prefix else None
        before = self._snapshot_free()
        try:
            self.s.add_request(rid, prefix=hit)
        except OutOfSlotsError:
            assert rid not in self.s and self.s.num_free_pages == before[0]
            return
        self.tokens[rid] = tokens
        self.written[rid] = hit.num_tokens if hit else 0
        assert self.written[rid] < len(tokens)

    def _pick(self, data: st.DataObject, rids: list[int]) -> int | None:
        return data.draw(st.sampled_from(sorted(rids)), label="rid") if rids else None

    @rule(data=st.data(), tokens=TOKENS)
    def add_related(self, data: st.DataObject, tokens: list[int]) -> None:
        """A new request that shares a prefix with an existing one, matched in the cache."""
        src = self._pick(data, list(self.tokens))
        rid = self._pick(data, [r for r in range(5) if r not in self.tokens])
        if src is None or rid is None:
            return
        cut = data.draw(st.integers(0, len(self.tokens[src])), label="cut")
        self.add(rid, self.tokens[src][:cut] + tokens, True)

    @rule(data=st.data(), n=st.integers(1, 5))
    def step(self, data: st.DataObject, n: int) -> None:
        rid = self._pick(data, [r for r in self._live() if self.written[r] < len(self.tokens[r])])
        if rid is None:
            return
        self._step(rid, n)

    @rule(data=st.data())
    def prefill_and_cache(self, data: st.DataObject) -> None:
        """Run a request to its end, snapshotting at every block boundary, then cache it."""
        rid = self._pick(data, self._live())
        if rid is None:
            return
        while self.written[rid] < len(self.tokens[rid]):
            if not self._step(rid, PS - self.written[rid] % PS):
                break
            if self.written[rid] % PS == 0:
                self.snapshot_of(rid)
                self.s.cache_prefix(rid, self.tokens[rid])

    def _step(self, rid: int, n: int) -> bool:
        start = self.written[rid]
        end = min(start + n, len(self.tokens[rid]))
        pages = self.s.pages(rid)
        before = self._snapshot_free()
        try:
            self.s.ensure_capacity(rid, end)
        except OutOfPagesError as e:
            assert e.req_id == rid
            assert self.s.pages(rid) == pages and self._snapshot_free() == before
            return False
        self._write(rid, start, end)
        if self.s.has_state:
            self.s.state_slots.layer(1).ssm[self.s.slot(rid)] = state_value(self.tokens[rid][:end])
        assert self.s.advance(rid, end - start) == end
        self.written[rid] = end
        return True

    @rule(data=st.data())
    def rewrite(self, data: st.DataObject) -> None:
        """Overwrite one written token with garbage (after copy-on-write), check that nobody
        else sees it, then put the right value back."""
        rid = self._pick(data, [r for r in self._live() if self.written[r]])
        if rid is None:
            return
        pos = data.draw(st.integers(0, self.written[rid] - 1), label="pos")
        try:
            self.s.prepare_write(rid, pos, pos + 1)
        except OutOfPagesError:
            return
        (row,) = self.s.slot_mapping(rid, pos, pos + 1)
        assert self.s.page_allocator.refcount(self.s.pages(rid)[pos // PS]) == 1
        self._k()[row] = -1.0
        self._check_contents(skip=(rid, pos))
        self._write(rid, pos, pos + 1)

    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        rid = self._pick(data, [r for r in self._live() if self.written[r] % PS == 0])
        if rid is not None and self.written[rid]:
            self.snapshot_of(rid)

    def snapshot_of(self, rid: int) -> None:
        if not self.s.has_state:
            return
        with contextlib.suppress(OutOfSlotsError):  # slots full of running requests: fine
            assert self.s.take_snapshot(rid) == self.written[rid]

    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        rid = self._pick(data, self._live())
        if rid is not None:
            n = self.s.cache_prefix(rid, self.tokens[rid])
            assert n == self.written[rid] // PS * PS

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        hit = self.s.match_prefix(tokens)
        assert isinstance(hit, PrefixHit) and hit.num_tokens <= len(tokens)
        if self.s.has_state:
            assert hit.num_tokens % PS == 0  # snapshot boundaries only
        if hit:
            k = self._k()
            for p in range(hit.num_tokens):
                assert k[hit.pages[p // PS] * PS + p % PS] == kv_value(tokens[: p + 1])
            if self.s.has_state:
                ssm = self.s.state_slots.layer(1).ssm
                assert float(ssm[hit.snapshot]) == state_value(tokens[: hit.num_tokens])

    @rule(data=st.data())
    def release_one(self, data: st.DataObject) -> None:
        rid = self._pick(data, list(self.tokens))
        if rid is not None:
            self.release(rid)

    def release(self, rid: int) -> None:
        if rid in self.tokens:
            self.s.release(rid)
            del self.tokens[rid], self.written[rid]
            self.offloaded.discard(rid)

    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        rid = self._pick(data, self._live())
        if rid is not None:
            self.s.offload(rid)
            self.offloaded.add(rid)

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        rid = self._pick(data, list(self.offloaded))
        if rid is None:
            return
        before = self._snapshot_free()
        try:
            self.s.restore(rid)
        except (OutOfPagesError, OutOfSlotsError):
            assert self.s.is_offloaded(rid) and self._snapshot_free() == before
            return
        self.offloaded.discard(rid)

    @precondition(lambda self: len(self.tokens) > 3)
    @rule()
    def release_all(self) -> None:
        for rid in list(self.tokens):
            self.release(rid)
        self.s.clear_prefix_cache()
        assert self.s.num_free_pages == self.s.num_pages
        assert self.s.num_free_slots == self.s.num_slots

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self) -> None:
        self.s.check_invariants()  # refcounts == holders, free <=> refcount 0, no duplicates
        held = {p for r in self._live() for p in self.s.pages(r)}
        held |= {b.page for b in self.s.prefix_cache.blocks()}
        assert not held & set(self.s.page_allocator.free_ids())
        assert self.s.num_free_pages + len(held) == self.s.num_pages

    @invariant()
    def check_contents(self) -> None:
        self._check_contents()

    def _check_contents(self, skip: tuple[int, int] | None = None) -> None:
        """Every live request and cached block holds the values its prefix demands (``skip``:
        one (request, position) deliberately overwritten)."""
        k, v = self._k(), self._v()
        ssm = self.s.state_slots.layer(1).ssm if self.s.has_state else None
        for rid in self._live():
            toks, n = self.tokens[rid], self.written[rid]
            assert self.s.num_tokens(rid) == n
            for p, row in enumerate(self.s.slot_mapping(rid, 0, n)):
                if (rid, p) == skip:
                    assert k[row] == -1.0
                    continue
                assert k[row] == kv_value(toks[: p + 1]) and v[row] == -k[row]
            if n and ssm is not None:
                assert float(ssm[self.s.slot(rid)]) == state_value(toks[:n])
        for block in self.s.prefix_cache.blocks():
            prefix: list[int] = []
            b = block
            while b is not None:
                prefix[:0] = b.tokens
                b = self.s.prefix_cache.get(b.parent) if b.parent is not None else None
            assert len(prefix) == block.depth * PS
            for o in range(PS):
                assert k[block.page * PS + o] == kv_value(prefix[: len(prefix) - PS + o + 1])
            if block.snapshot is not None:
                assert float(ssm[block.snapshot]) == state_value(prefix)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.s.release(rid)
        self.s.clear_prefix_cache()
        self.s.check_invariants()
        assert self.s.num_free_pages == self.s.num_pages  # no leak
        assert self.s.num_free_slots == self.s.num_slots


class KVOnlyStateMachine(StateMachine):
    """A model without linear layers: hits may end inside a page, shared until written (CoW)."""

    groups = group_layers([FULL])


_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
StateMachine.TestCase.settings = _SETTINGS
KVOnlyStateMachine.TestCase.settings = _SETTINGS
TestHybridStateMachine = StateMachine.TestCase
TestKVOnlyStateMachine = KVOnlyStateMachine.TestCase
