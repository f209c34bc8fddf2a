"""Hypothesis state machine over BatchBuilder + PersistentState + AttentionRuntime together.

The machine runs a small hybrid model (layer 0 full attention, layer 1 Gated DeltaNet, layer 2
full attention; page size 4, few pages and slots) on the reference backend, on the CPU, in
float32, and drives it the way a server does: add requests (with prefix hits), build steps for
random subsets of them (prefill chunks, mixed, decode, padded decode, repeated decode on the
builder's steady path), ``runtime.prepare`` the batch, ``forward`` (and ``conv1d``) every layer,
``advance``. In between it does what a server or a misbehaving caller may do: release a request
between build and forward, build with duplicate / unknown / offloaded ids, offload and restore,
export and import (also a tampered export), take snapshots, cache prefixes, run out of pages.

Every token's inputs are a deterministic function of the request's token prefix (as in a real
model), so a cached prefix block must hold the KV its tokens demand. A shadow model keeps, per
request, the exact k / v it was given for every written position of every KV layer, the conv
state those inputs leave (computed independently: the last ``K - 1`` inputs) and the SSM state
(taken from the state after each step that legitimately wrote it, once checked against an
independent recurrence). After every rule each live request's KV, conv and SSM contents must equal
its shadow bitwise, cached blocks and snapshots must hold what their prefix demands and
``check_invariants()`` must hold; every refused operation must raise a clear error (not a raw
one) and change nothing: no request's pages, slot or length, no free count, no cached block.
Each step's batch metadata is checked against the state, and its outputs against independent
float64 math over the shadow (causal attention, the causal conv, the gated delta rule), so a
backend reading the wrong pages or slot is caught as well as one writing them.

About 5000 steps (100 examples of up to 50); derandomized, no example database, so a run is
reproducible and hypothesis prints the minimal failing sequence of rules.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import attn_core.reference.plugin as reference_plugin
from attn_core.batch import BatchBuilder
from attn_core.errors import BackendInputError
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerKind,
    LayerSpec,
    group_layers,
)
from attn_core.state import (
    OutOfPagesError,
    OutOfSlotsError,
    PersistentState,
    StaleprefixError,
    StateError,
)

PS = 4  # page size
NUM_PAGES = 10
NUM_SLOTS = 6
MAX_BATCH = 4
MAX_TOKENS = 24
MAX_PAGES_PER_REQUEST = 4  # 16 tokens: requests do reach it
MAX_REQUESTS = 4  # the add rules stop there (imports may go past it)
MAX_CHUNK = 8  # new tokens of one request in one prefill chunk

FULL = LayerSpec(
    kind="full", num_heads=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype="float32"
)
GDN = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    head_dim_v=4,
    conv_kernel_size=4,
    conv_channels=8,
    qk_l2norm=True,
    dtype="float32",
)
SPECS = (FULL, GDN, FULL)
KV_LAYERS = tuple(i for i, s in enumerate(SPECS) if s.kind is LayerKind.FULL)
LIN_LAYERS = tuple(i for i, s in enumerate(SPECS) if s.kind is LayerKind.LINEAR)
ATOL, RTOL = 1e-4, 1e-4  # outputs / SSM state against the independent math (float32 vs float64)

# Errors that count as a clean refusal: the caller is told, with a message, and nothing changed.
# A raw RuntimeError / IndexError / AttributeError is not one (StateError is a RuntimeError).
REFUSED = (ValueError, KeyError, StateError)
STALE_REFUSED = (BackendInputError, StateError)

_CACHE: dict[str, object] = {}


def _plan():
    """The reference registry and plan, made once (the plan does not depend on the state)."""
    if not _CACHE:
        registry = Registry(strict=True)
        registry.register_plugin(reference_plugin, name="attn_core")
        groups = group_layers(SPECS)
        constraints = ExecutionConstraints(max_batch_size=MAX_BATCH, max_num_tokens=MAX_TOKENS)
        plan = select(groups, registry, DeviceCapabilities.target("cpu"), constraints)
        _CACHE.update(registry=registry, groups=groups, plan=plan)
    return _CACHE["registry"], _CACHE["groups"], _CACHE["plan"]


# ----------------------------------------------------------------------------------------------
# Token inputs: a function of the token prefix (its chained hash) and the layer
# ----------------------------------------------------------------------------------------------
_ROOT = 0x5EED


def _sizes(spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    if spec.kind is LayerKind.FULL:
        return {"q": (H, D), "k": (Hkv, D), "v": (Hkv, Dv)}
    return {
        "q": (Hkv, D),
        "k": (Hkv, D),
        "v": (H, Dv),
        "x": (spec.conv_channels,),
        "g": (H,),
        "beta": (H,),
    }


SIZES = [_sizes(s) for s in SPECS]


class Inputs:
    """Per-token inputs of every layer, memoised by (prefix hash, layer)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def __call__(self, h: int, layer: int) -> dict[str, torch.Tensor]:
        got = self._memo.get((h, layer))
        if got is None:
            gen = torch.Generator().manual_seed((h * 7 + layer) & (2**62 - 1))
            sizes = SIZES[layer]
            flat = torch.randn(sum(math.prod(s) for s in sizes.values()), generator=gen)
            got, o = {}, 0
            for name, shape in sizes.items():
                n = math.prod(shape)
                got[name] = flat[o : o + n].view(shape)
                o += n
            if "g" in got:  # log-sigmoid and sigmoid, written out (see _softmax)
                g = got["g"]
                got["g"] = (torch.clamp(g, max=0) - torch.log1p(torch.exp(-g.abs()))) * 0.5
                got["beta"] = 1 / (1 + torch.exp(-got["beta"]))
            self._memo[(h, layer)] = got
        return got


# ----------------------------------------------------------------------------------------------
# Independent math (float64): what each layer must compute from the shadow's contents
# ----------------------------------------------------------------------------------------------
def attention_ref(q, k_all, v_all, ctx: int, scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q [L, H, D]`` (positions ctx..ctx+L-1) over ``k_all [ctx+L]``."""
    q, k_all, v_all = q.double(), k_all.double(), v_all.double()
    H, Hkv = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(H // Hkv, 1)
    v = v_all.repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    L, S = q.shape[0], k.shape[0]
    mask = torch.arange(S)[None, :] <= (ctx + torch.arange(L))[:, None]
    probs = _softmax(scores.masked_fill(~mask, float("-inf")))
    return torch.einsum("hts,shd->thd", probs, v)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, written out: on a small CPU host torch's own (like
    log_sigmoid) can take milliseconds on a tensor this small (its thread pool wakes up)."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def conv_ref(prev, x, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + silu of ``x [L, C]`` after ``prev [C, K-1]``; (out, new state)."""
    xpad = torch.cat([prev.double(), x.double().T], dim=1)
    K = w.shape[1]
    out = torch.stack([(xpad[:, t : t + K] * w.double()).sum(-1) for t in range(x.shape[0])])
    return out * (1 / (1 + torch.exp(-out))), xpad[:, -(K - 1) :]  # silu


def gdn_ref(S0, q, k, v, g, beta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token by token, from state ``S0 [Hv, Dk, Dv]``; (out, new state)."""
    S = S0.double().clone()
    Hv, Hk = v.shape[1], q.shape[1]
    outs = []
    for t in range(q.shape[0]):
        qt = q[t].double().repeat_interleave(Hv // Hk, 0)
        kt = k[t].double().repeat_interleave(Hv // Hk, 0)
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        S = S * torch.exp(g[t].double())[:, None, None]
        u = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", S, kt))
        S = S + torch.einsum("hk,hv->hkv", kt, u)
        outs.append(torch.einsum("hkv,hk->hv", S, qt * scale))
    return torch.stack(outs), S


# ----------------------------------------------------------------------------------------------
# Shadow model
# ----------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Shadow:
    """What one request must hold: its tokens (extended on demand), written length, the k / v
    of every written position per KV layer, and conv / SSM state per linear layer."""

    tokens: list[int]
    rng: random.Random
    n: int = 0
    hashes: list[int] = field(default_factory=list)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    offloaded: bool = False

    def hash_at(self, p: int) -> int:
        """The chained hash of tokens ``0..p`` (new tokens drawn from ``rng`` as needed)."""
        while len(self.hashes) <= p:
            j = len(self.hashes)
            while len(self.tokens) <= j:
                self.tokens.append(self.rng.randrange(1 << 20))
            prev = self.hashes[-1] if self.hashes else _ROOT
            # (a tuple of ints hashes the same in every process: the inputs are reproducible)
            self.hashes.append(hash((prev, int(self.tokens[j]))))
        return self.hashes[p]

    def prefix(self, n: int) -> list[int]:
        if n:
            self.hash_at(n - 1)
        return self.tokens[:n]

    def copy(self, rng: random.Random) -> Shadow:
        return Shadow(
            self.prefix(self.n),
            rng,
            self.n,
            self.hashes[: self.n],
            {i: t.clone() for i, t in self.k.items()},
            {i: t.clone() for i, t in self.v.items()},
            {i: t.clone() for i, t in self.conv.items()},
            {i: t.clone() for i, t in self.ssm.items()},
        )


def _has_live(machine: RuntimeStateMachine) -> bool:
    return any(not sh.offloaded for sh in machine.shadows.values())


class RuntimeStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        registry, groups, plan = _plan()
        self.state = PersistentState(groups, num_pages=NUM_PAGES, num_slots=NUM_SLOTS)
        self.runtime = AttentionRuntime(plan, registry, state=self.state)
        self.builder = BatchBuilder(
            self.state,
            max_batch_size=MAX_BATCH,
            max_num_tokens=MAX_TOKENS,
            max_pages_per_request=MAX_PAGES_PER_REQUEST,
        )
        self.inputs = Inputs()
        gen = torch.Generator().manual_seed(1)
        self.conv_w = {
            i: torch.randn(SPECS[i].conv_channels, SPECS[i].conv_kernel_size, generator=gen) * 0.5
            for i in LIN_LAYERS
        }
        self.shadows: dict[Hashable, Shadow] = {}
        self.next_id = 0
        # prefix tokens -> SSM states (one per linear layer) a snapshot of that prefix may hold
        self.snapshots: dict[tuple[int, ...], list[dict[int, torch.Tensor]]] = {}
        self.cached: list[tuple[int, ...]] = []  # token prefixes given to cache_prefix
        self.last_decode: tuple[tuple, int | None] | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _live(self) -> list[Hashable]:
        return [r for r, sh in self.shadows.items() if not sh.offloaded]

    def _pick(self, data: st.DataObject, rids: Sequence[Hashable], label: str = "rid"):
        return data.draw(st.sampled_from(list(rids)), label=label) if rids else None

    def _expected_kv(self, sh: Shadow, layer: int, start: int, end: int):
        rows = [self.inputs(sh.hash_at(p), layer) for p in range(start, end)]
        spec = SPECS[layer]
        if not rows:
            return (
                torch.zeros(0, spec.num_kv_heads, spec.head_dim),
                torch.zeros(0, spec.num_kv_heads, spec.head_dim_v),
            )
        return torch.stack([r["k"] for r in rows]), torch.stack([r["v"] for r in rows])

    def _expected_conv(self, sh: Shadow, layer: int, n: int) -> torch.Tensor:
        """The conv state after ``n`` tokens: their last ``K - 1`` inputs (zeros before 0)."""
        spec = SPECS[layer]
        km1 = spec.conv_kernel_size - 1
        state = torch.zeros(spec.conv_channels, km1)
        for j, p in enumerate(range(n - km1, n)):
            if p >= 0:
                state[:, j] = self.inputs(sh.hash_at(p), layer)["x"]
        return state

    def _fill_shadow(self, sh: Shadow, n: int) -> None:
        """Shadow contents of a request whose first ``n`` tokens come from the prefix cache
        (or a fresh request, n = 0): KV and conv from the inputs, SSM zero (set by caller)."""
        sh.n = n
        for i in KV_LAYERS:
            sh.k[i], sh.v[i] = self._expected_kv(sh, i, 0, n)
        for i in LIN_LAYERS:
            sh.conv[i] = self._expected_conv(sh, i, n)
            sh.ssm[i] = torch.zeros(SPECS[i].ssm_state_shape)

    def _book(self) -> tuple:
        """Everything a refused operation must leave as it was."""
        s = self.state
        reqs = {}
        for rid in s.request_ids():
            if s.is_offloaded(rid):
                reqs[rid] = ("offloaded", s.num_tokens(rid))
            else:
                reqs[rid] = (s.num_tokens(rid), tuple(s.pages(rid)), s.slot(rid))
        blocks = sorted((b.key, b.page, b.snapshot) for b in s.prefix_cache.blocks())
        return reqs, s.num_free_pages, s.num_free_slots, blocks

    def _assert_unchanged(self, before: tuple, what: str) -> None:
        after = self._book()
        names = ("requests (tokens, pages, slot)", "free pages", "free slots", "cached blocks")
        for name, b, a in zip(names, before, after, strict=True):
            assert b == a, f"{what}: {name} changed: before {b}, after {a}"
        self.state.check_invariants()

    def _refused(self, fn: Callable[[], object], what: str, errors=REFUSED) -> str | None:
        """``fn()`` must raise one of ``errors`` and change nothing. Returns None when it did,
        or what went wrong when ``fn()`` was accepted: the caller asserts, so that hypothesis
        tells the rules' failures apart (it keys them by where the assertion is raised)."""
        before = self._book()
        try:
            fn()
        except errors:
            self._assert_unchanged(before, what)
            return None
        except Exception as exc:
            raise AssertionError(f"{what}: raised a raw {type(exc).__name__}: {exc}") from exc
        seen = []  # what the accepted call did to the others, for the report
        for check in (lambda: self._assert_unchanged(before, what), self.check_contents):
            try:
                check()
            except AssertionError as exc:
                seen.append(str(exc))
        return f"{what}: accepted (expected one of {[e.__name__ for e in errors]}); " + (
            "; ".join(seen) or "nothing else visibly changed"
        )

    def _release(self, rid: Hashable) -> None:
        self.state.release(rid)
        del self.shadows[rid]

    # -- adding requests -------------------------------------------------------------------------
    def _add(self, sh: Shadow, *, prefix_len: int, clear_between: bool) -> None:
        s = self.state
        rid = self._new_id()
        hit = (
            s.match_prefix(sh.prefix(prefix_len + 4), max_tokens=prefix_len) if prefix_len else None
        )
        if clear_between:
            s.clear_prefix_cache()
        before = self._book()
        try:
            s.add_request(rid, prefix=hit)
        except (OutOfSlotsError, StaleprefixError) as exc:
            self._assert_unchanged(before, f"add_request refused ({type(exc).__name__})")
            if isinstance(exc, StaleprefixError):
                assert clear_between and hit, f"a fresh hit called stale: {exc}"
            return
        # clear_prefix_cache drops every snapshot: a hybrid model's hit is stale then
        assert not (clear_between and hit), "add_request accepted a stale prefix hit"
        n = hit.num_tokens if hit else 0
        assert s.num_tokens(rid) == n
        assert n % PS == 0 and n <= prefix_len  # hybrid model: hits end on a snapshot
        self._fill_shadow(sh, n)
        if n:
            key = tuple(sh.prefix(n))
            slot = s.slot(rid)
            got = {i: s.state_slots.layer(i).ssm[slot].clone() for i in LIN_LAYERS}
            assert any(
                all(torch.equal(got[i], snap[i]) for i in LIN_LAYERS)
                for snap in self.snapshots.get(key, [])
            ), f"prefix hit of {n} tokens: its SSM state is no snapshot taken of that prefix"
            sh.ssm = got
        self.shadows[rid] = sh

    @precondition(lambda self: len(self.shadows) < MAX_REQUESTS)
    @rule(seed=st.integers(0, 2**16))
    def new_request(self, seed: int) -> None:
        self._add(Shadow([], random.Random(seed)), prefix_len=0, clear_between=False)

    def _add_with_prefix(self, data: st.DataObject, seed: int, clear_between: bool) -> None:
        tokens = data.draw(st.sampled_from(self.cached), label="cached prefix")
        cut = data.draw(st.one_of(st.just(len(tokens)), st.integers(0, len(tokens))), label="cut")
        sh = Shadow(list(tokens[:cut]), random.Random(seed))
        self._add(sh, prefix_len=cut, clear_between=clear_between)

    @precondition(lambda self: self.cached and len(self.shadows) < MAX_REQUESTS)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def new_request_with_prefix(self, data: st.DataObject, seed: int) -> None:
        """A request whose tokens start with a prefix that was snapshotted and cached: it gets
        the cached pages and a copy of the snapshot."""
        self._add_with_prefix(data, seed, clear_between=False)

    @precondition(lambda self: self.cached and len(self.shadows) < MAX_REQUESTS)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def new_request_with_stale_prefix(self, data: st.DataObject, seed: int) -> None:
        """As new_request_with_prefix, with the prefix cache cleared between match and add:
        the hit is stale and must be refused."""
        self._add_with_prefix(data, seed, clear_between=True)

    # -- steps -----------------------------------------------------------------------------------
    def _draw_step(
        self, data: st.DataObject, kind: str
    ) -> tuple[list[tuple[Hashable, int]], int | None]:
        """A step: distinct live requests and their new-token counts (``kind``: ``decode``, one
        each, maybe padded; ``chunks``, random prefill chunks; ``to page end``, up to the next
        page boundary; ``big``, every live request with one to two pages' worth)."""
        live = self._live()
        if kind == "big":
            ids = live[:MAX_BATCH]
        else:
            ids = data.draw(
                st.lists(
                    st.sampled_from(live),
                    min_size=1,
                    max_size=min(MAX_BATCH, len(live)),
                    unique=True,
                ),
                label="requests",
            )
        if kind == "decode":
            counts = [1] * len(ids)
        elif kind in ("chunks", "big"):
            # chunks: prefill chunks mixed with decodes (one token)
            one = st.one_of(st.just(1), st.integers(2, MAX_CHUNK))
            count = one if kind == "chunks" else st.integers(PS, 2 * PS)
            counts = data.draw(
                st.lists(count, min_size=len(ids), max_size=len(ids)), label="counts"
            )
        else:
            counts = [PS - self.shadows[r].n % PS for r in ids]
        pad_to = None
        if kind == "decode" and len(ids) < MAX_BATCH:
            pad_to = data.draw(st.one_of(st.none(), st.integers(len(ids), MAX_BATCH)), label="pad")
        return list(zip(ids, counts, strict=True)), pad_to

    def _predict(self, requests: Sequence[tuple[Hashable, int]], pad_to: int | None) -> dict:
        """Whether the build must be refused: too long for the page table, too many tokens, or
        not enough pages (free + evictable) for the whole step."""
        s = self.state
        need, too_long, cow = 0, False, False
        refcount = s.page_allocator.refcount
        for rid, q in requests:
            n, pages = s.num_tokens(rid), s.pages(rid)
            want = -(-(n + q) // PS)
            too_long |= want > MAX_PAGES_PER_REQUEST
            need += max(0, want - len(pages))
            for j in range(n // PS, min(len(pages), want)):
                if refcount(pages[j]) > 1:
                    need, cow = need + 1, True
        tokens = sum(q for _, q in requests) + (pad_to - len(requests) if pad_to else 0)
        avail = s.num_free_pages + s.prefix_cache.evictable_pages(refcount)
        return {
            "too long": too_long,
            "too many tokens": tokens > MAX_TOKENS,
            "out of pages": need > avail,
            "cow": cow,
        }

    def _build(self, requests, pad_to=None):
        """Build a step; on a refusal check that it had to be refused and changed nothing."""
        want = self._predict(requests, pad_to)
        refuse = want["too long"] or want["too many tokens"] or want["out of pages"]
        before = self._book()
        try:
            batch = self.builder.build(requests, pad_to=pad_to)
        except REFUSED as exc:
            self._assert_unchanged(before, f"refused build {requests} ({type(exc).__name__})")
            if isinstance(exc, OutOfPagesError):
                assert want["out of pages"] or want["cow"], (
                    f"build {requests}: OutOfPagesError though the step fits: {exc}"
                )
            else:
                assert refuse, f"build {requests}: refused a valid step: {exc!r}"
            return None
        assert not refuse, (
            f"build {requests} (pad_to={pad_to}) accepted, expected a refusal: {want}"
        )
        self._check_batch(batch, requests, pad_to)
        return batch

    def _check_batch(self, batch, requests, pad_to) -> None:
        """The metadata a backend reads agrees with the state."""
        s = self.state
        ids = tuple(r for r, _ in requests)
        assert tuple(batch.request_ids) == ids
        B, P = len(ids), pad_to or len(ids)
        T = sum(q for _, q in requests)
        assert (batch.num_reqs, batch.padded_reqs, batch.num_tokens) == (B, P, T)
        assert batch.padded_tokens == T + P - B
        sm, pt = batch.slot_mapping.tolist(), batch.page_table
        ctx = batch.context_lens.tolist()
        seq = batch.seq_lens.tolist()
        qsl = batch.query_start_loc.tolist()
        slots = batch.state_indices.tolist()
        o = 0
        for b, (rid, q) in enumerate(requests):
            n = s.num_tokens(rid)
            assert (ctx[b], seq[b], qsl[b + 1] - qsl[b]) == (n, n + q, q), f"{rid} lengths"
            assert sm[o : o + q] == s.slot_mapping(rid, n, n + q), f"{rid}: slot mapping"
            used = -(-(n + q) // PS)
            assert pt[b, :used].tolist() == s.pages(rid)[:used], f"{rid}: page table"
            assert slots[b] == s.slot(rid), f"{rid}: state index"
            o += q
        assert all(x == -1 for x in sm[T : T + P - B]), "padding tokens write KV"
        assert all(x == -1 for x in slots[B:P]), "padding rows touch a state slot"

    def _layer_inputs(self, batch, toks, layer) -> dict[str, torch.Tensor]:
        rows = [self.inputs(sh.hash_at(p), layer) for sh, p in toks]
        pad = batch.padded_tokens - len(rows)
        return {
            name: torch.stack([r[name] for r in rows] + [torch.zeros_like(rows[0][name])] * pad)
            for name in SIZES[layer]
        }

    def _run_layers(self, batch, toks) -> dict[int, dict[str, torch.Tensor]]:
        results = {}
        for layer, spec in enumerate(SPECS):
            inp = self._layer_inputs(batch, toks, layer)
            binding = self.runtime.binding(layer)
            res = {}
            if spec.kind is LayerKind.LINEAR:
                res["conv"] = binding.conv1d(inp["x"], self.conv_w[layer])
            out = torch.full((batch.padded_tokens, spec.num_heads, spec.head_dim_v), float("nan"))
            extra = {"g": inp["g"], "beta": inp["beta"]} if "g" in inp else {}
            res["out"] = binding.forward(inp["q"], inp["k"], inp["v"], out=out, **extra)
            results[layer] = res
        return results

    def _step(self, requests, pad_to=None) -> bool:
        batch = self._build(requests, pad_to)
        if batch is None:
            return False
        self.runtime.prepare(batch)
        toks = [
            (self.shadows[r], p)
            for r, q in requests
            for p in range(self.shadows[r].n, self.shadows[r].n + q)
        ]
        results = self._run_layers(batch, toks)
        o = 0
        for rid, q in requests:
            sh = self.shadows[rid]
            n = sh.n
            for layer, spec in enumerate(SPECS):
                res = {name: t[o : o + q] for name, t in results[layer].items()}
                new = [self.inputs(sh.hash_at(p), layer) for p in range(n, n + q)]
                new = {name: torch.stack([r[name] for r in new]) for name in SIZES[layer]}
                scale = self.runtime.binding(layer).scale
                if spec.kind is LayerKind.FULL:
                    k_all = torch.cat([sh.k[layer], new["k"]])
                    v_all = torch.cat([sh.v[layer], new["v"]])
                    want = attention_ref(new["q"], k_all, v_all, n, scale)
                    _close(res["out"], want, f"{rid} layer {layer} attention out")
                    sh.k[layer], sh.v[layer] = k_all, v_all
                else:
                    want_conv, conv_state = conv_ref(sh.conv[layer], new["x"], self.conv_w[layer])
                    _close(res["conv"], want_conv, f"{rid} layer {layer} conv1d out")
                    want_out, want_ssm = gdn_ref(
                        sh.ssm[layer], new["q"], new["k"], new["v"], new["g"], new["beta"], scale
                    )
                    _close(res["out"], want_out, f"{rid} layer {layer} GDN out")
                    slot = self.state.slot(rid)
                    got_ssm = self.state.state_slots.layer(layer).ssm[slot].clone()
                    _close(got_ssm, want_ssm, f"{rid} layer {layer} SSM state")
                    sh.conv[layer] = conv_state.float()
                    assert torch.equal(sh.conv[layer], self._expected_conv(sh, layer, n + q))
                    sh.ssm[layer] = got_ssm
            assert self.state.advance(rid, q) == n + q
            sh.n = n + q
            o += q
        return True

    def _run_step(self, data: st.DataObject, kind: str) -> list[tuple[Hashable, int]]:
        """One step of ``kind``; returns its requests, or [] when the build was refused."""
        requests, pad_to = self._draw_step(data, kind)
        ok = self._step(requests, pad_to)
        self.last_decode = None
        if ok and all(q == 1 for _, q in requests):
            self.last_decode = (tuple(requests), pad_to)
        return requests if ok else []

    @precondition(_has_live)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._run_step(data, "decode")

    @precondition(_has_live)
    @rule(data=st.data())
    def prefill_chunks(self, data: st.DataObject) -> None:
        self._run_step(data, "chunks")

    @precondition(_has_live)
    @rule(data=st.data(), cache=st.booleans())
    def to_page_end(self, data: st.DataObject, cache: bool) -> None:
        """Run requests up to their next page boundary; with ``cache``, then snapshot them and
        register their prefixes (what new_request_with_prefix finds later)."""
        requests = self._run_step(data, "to page end")
        for rid, _ in requests if cache else ():
            self._snapshot(rid)
            self._remember_cached(rid)

    @precondition(_has_live)
    @rule(data=st.data())
    def step_all_big(self, data: st.DataObject) -> None:
        """Every live request at once, a page or two each: often more than the pages left, or
        than a request's page-table row holds (the whole build must then be refused)."""
        self._run_step(data, "big")

    @precondition(lambda self: self.last_decode is not None)
    @rule()
    def decode_again(self) -> None:
        """The same decode step as the last one (the builder's steady path)."""
        requests, pad_to = self.last_decode
        if any(r not in self.shadows or self.shadows[r].offloaded for r, _ in requests):
            self.last_decode = None
            return
        if not self._step(requests, pad_to):
            self.last_decode = None

    @precondition(_has_live)
    @rule(data=st.data(), then=st.sampled_from(["nothing", "add", "import"]))
    def release_between_build_and_forward(self, data: st.DataObject, then: str) -> None:
        """Build and prepare a step, release one of its requests, then (``then``) add a request
        or import a copy of another one (either may take the released slot and pages): every
        forward and conv1d of the stale batch must be refused and change nothing."""
        kind = data.draw(st.sampled_from(["decode", "chunks", "to page end"]), label="kind")
        requests, pad_to = self._draw_step(data, kind)
        batch = self._build(requests, pad_to)
        if batch is None:
            return
        self.runtime.prepare(batch)
        victim = self._pick(data, [r for r, _ in requests], "released")
        toks = [
            (self.shadows[r], p)
            for r, q in requests
            for p in range(self.shadows[r].n, self.shadows[r].n + q)
        ]
        self._release(victim)
        if then == "add":
            self.new_request(data.draw(st.integers(0, 2**16), label="seed"))
        elif then == "import":
            src = self._pick(data, self._live(), "copied")
            if src is not None:
                self._export_import(src)
        self.last_decode = None
        for layer, spec in enumerate(SPECS):
            inp = self._layer_inputs(batch, toks, layer)
            binding = self.runtime.binding(layer)
            if spec.kind is LayerKind.LINEAR:
                problem = self._refused(
                    lambda b=binding, i=inp, w=self.conv_w[layer]: b.conv1d(i["x"], w),
                    f"layer {layer} conv1d of a stale batch (released {victim!r})",
                    STALE_REFUSED,
                )
                assert problem is None, problem  # conv1d of a stale batch
                self.check_contents()
            extra = {"g": inp["g"], "beta": inp["beta"]} if "g" in inp else {}
            problem = self._refused(
                lambda b=binding, i=inp, e=extra: b.forward(i["q"], i["k"], i["v"], **e),
                f"layer {layer} forward of a stale batch (released {victim!r})",
                STALE_REFUSED,
            )
            assert problem is None, problem  # forward of a stale batch
            self.check_contents()

    @precondition(lambda self: self.shadows)
    @rule(data=st.data(), how=st.sampled_from(["duplicate", "unknown", "offloaded", "negative"]))
    def bad_build(self, data: st.DataObject, how: str) -> None:
        """A build naming a request twice, an unknown or offloaded request, or a negative token
        count: refused, nothing changed (pages reserved for its other requests included)."""
        live = self._live()
        count = st.integers(1, 5)
        others = data.draw(
            st.lists(st.sampled_from(live), max_size=min(2, len(live)), unique=True)
            if live
            else st.just([]),
            label="others",
        )
        requests = [(r, data.draw(count, label="count")) for r in others]
        if how == "duplicate":
            if not live:
                return
            rid = self._pick(data, live, "duplicated")
            first, second = data.draw(count, label="count"), data.draw(count, label="count")
            requests = [(rid, first), *(x for x in requests if x[0] != rid), (rid, second)]
        elif how == "unknown":
            requests.append(("no such request", 1))
        elif how == "offloaded":
            off = [r for r, sh in self.shadows.items() if sh.offloaded]
            if not off:
                return
            requests.append((self._pick(data, off, "offloaded id"), 1))
        else:
            if not requests:
                return
            requests[-1] = (requests[-1][0], -1)
        self.last_decode = None
        problem = self._refused(lambda: self.builder.build(requests), f"build {requests} ({how})")
        if how == "duplicate":
            assert problem is None, problem  # a request twice in one build
        else:
            assert problem is None, problem

    # -- release, offload, export / import --------------------------------------------------------
    @precondition(lambda self: self.shadows)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._release(self._pick(data, list(self.shadows)))

    @precondition(lambda self: len(self.shadows) >= 3)
    @rule()
    def release_all(self) -> None:
        for rid in list(self.shadows):
            self._release(rid)
        self.state.clear_prefix_cache()
        self.state.check_invariants()
        assert self.state.num_free_pages == NUM_PAGES, "pages leaked"
        assert self.state.num_free_slots == NUM_SLOTS, "slots leaked"

    @precondition(_has_live)
    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        rid = self._pick(data, self._live())
        self.state.offload(rid)
        self.shadows[rid].offloaded = True
        assert self.state.is_offloaded(rid)

    @precondition(lambda self: any(sh.offloaded for sh in self.shadows.values()))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        rid = self._pick(data, [r for r, sh in self.shadows.items() if sh.offloaded])
        before = self._book()
        try:
            self.state.restore(rid)
        except (OutOfPagesError, OutOfSlotsError) as exc:
            self._assert_unchanged(before, f"restore({rid!r}) refused ({type(exc).__name__})")
            assert self.state.is_offloaded(rid)
            return
        self.shadows[rid].offloaded = False  # check_contents: the same bytes as before

    def _export_import(self, src: Hashable) -> None:
        export = self.state.export_request(src)
        new = self._new_id()
        before = self._book()
        try:
            self.state.import_request(new, export)
        except (OutOfPagesError, OutOfSlotsError) as exc:
            self._assert_unchanged(before, f"import of {src!r} refused ({type(exc).__name__})")
            assert new not in self.state
            return
        self.shadows[new] = self.shadows[src].copy(random.Random(self.next_id))

    @precondition(_has_live)
    @rule(data=st.data())
    def export_import(self, data: st.DataObject) -> None:
        self._export_import(self._pick(data, self._live()))

    @precondition(_has_live)
    @rule(
        data=st.data(),
        how=st.sampled_from(["tokens +", "tokens -", "tensor shape", "tensor nbytes", "offset"]),
        d=st.integers(1, 5),
    )
    def import_tampered(self, data: st.DataObject, how: str, d: int) -> None:
        """An export whose metadata disagrees with its buffer or with itself: refused with a
        clear error, no page or slot reserved, nothing changed."""
        src = self._pick(data, self._live())
        export = self.state.export_request(src)
        meta = export.meta
        if how == "tokens +":
            meta = dataclasses.replace(meta, num_tokens=meta.num_tokens + d)
        elif how == "tokens -":
            if meta.num_tokens < d:
                return
            meta = dataclasses.replace(meta, num_tokens=meta.num_tokens - d)
        else:
            li = data.draw(st.integers(0, len(meta.layers) - 1), label="layer entry")
            entry = meta.layers[li]
            ti = data.draw(st.integers(0, len(entry.tensors) - 1), label="tensor entry")
            t = entry.tensors[ti]
            if how == "tensor shape":
                t = dataclasses.replace(t, shape=(t.shape[0] + d, *t.shape[1:]))
            elif how == "tensor nbytes":
                t = dataclasses.replace(t, nbytes=t.nbytes + 4 * d)
            else:
                t = dataclasses.replace(t, offset=meta.nbytes + 16 * d)
            tensors = (*entry.tensors[:ti], t, *entry.tensors[ti + 1 :])
            layers = list(meta.layers)
            layers[li] = dataclasses.replace(entry, tensors=tensors)
            meta = dataclasses.replace(meta, layers=tuple(layers))
        bad = dataclasses.replace(export, meta=meta)
        new = self._new_id()
        problem = self._refused(
            lambda: self.state.import_request(new, bad),
            f"import_request of a tampered export of {src!r} ({how} {d})",
            (ValueError, StateError),
        )
        if problem is not None:
            if new in self.state:  # accepted: take it back, so that teardown sees no leak
                self.state.release(new)
            raise AssertionError(problem)
        assert new not in self.state

    # -- prefix cache ----------------------------------------------------------------------------
    def _snapshot(self, rid: Hashable) -> None:
        sh = self.shadows[rid]
        before = self._book()
        try:
            assert self.state.take_snapshot(rid) == sh.n
        except OutOfSlotsError:
            self._assert_unchanged(before, f"take_snapshot({rid!r}) refused")
            return
        key = tuple(sh.prefix(sh.n))
        self.snapshots.setdefault(key, []).append({i: sh.ssm[i].clone() for i in LIN_LAYERS})

    def _cache(self, rid: Hashable) -> None:
        sh = self.shadows[rid]
        assert self.state.cache_prefix(rid, sh.prefix(sh.n)) == sh.n // PS * PS

    @precondition(_has_live)
    @rule(data=st.data(), what=st.sampled_from(["snapshot and cache", "snapshot", "cache"]))
    def prefix_cache(self, data: st.DataObject, what: str) -> None:
        """Snapshot a request at a block boundary and / or register its prefix in the cache."""
        live = self._live()
        if "snapshot" in what:
            live = [r for r in live if self.shadows[r].n and self.shadows[r].n % PS == 0]
        rid = self._pick(data, live)
        if rid is None:
            return
        if "snapshot" in what:
            self._snapshot(rid)
        if "cache" in what:
            self._remember_cached(rid)

    def _remember_cached(self, rid: Hashable) -> None:
        self._cache(rid)
        sh = self.shadows[rid]
        key = tuple(sh.prefix(sh.n))
        if key in self.snapshots and key not in self.cached:
            self.cached = [*self.cached[-15:], key]

    @precondition(lambda self: len(self.state.prefix_cache))
    @rule()
    def clear_prefix_cache(self) -> None:
        self.state.clear_prefix_cache()

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self) -> None:
        s = self.state
        s.check_invariants()
        assert set(s.request_ids()) == set(self.shadows), "requests known to the state"
        held = {p for r in self._live() for p in s.pages(r)}
        held |= {b.page for b in s.prefix_cache.blocks()}
        assert not held & set(s.page_allocator.free_ids()), "a held page is free"
        assert s.num_free_pages + len(held) == NUM_PAGES, "pages neither held nor free"
        slots = [s.slot(r) for r in self._live()]
        assert len(set(slots)) == len(slots), "two live requests share a slot"

    @invariant()
    def check_contents(self) -> None:
        """Every live request holds exactly its shadow; cached blocks hold their prefix's KV."""
        s = self.state
        for rid, sh in self.shadows.items():
            assert s.num_tokens(rid) == sh.n, f"{rid}: length"
            assert s.is_offloaded(rid) == sh.offloaded, f"{rid}: offloaded"
            if sh.offloaded:
                continue
            rows = torch.tensor(s.slot_mapping(rid, 0, sh.n), dtype=torch.long)
            for i in KV_LAYERS:
                kv = s.kv_cache.layer(i)
                spec = SPECS[i]
                k = kv.k.view(-1, spec.num_kv_heads, spec.head_dim)[rows]
                v = kv.v.view(-1, spec.num_kv_heads, spec.head_dim_v)[rows]
                assert torch.equal(k, sh.k[i]), f"{rid}: layer {i} K differs from its shadow"
                assert torch.equal(v, sh.v[i]), f"{rid}: layer {i} V differs from its shadow"
            slot = s.slot(rid)
            for i in LIN_LAYERS:
                lin = s.state_slots.layer(i)
                assert torch.equal(lin.conv[slot], sh.conv[i]), f"{rid}: layer {i} conv state"
                assert torch.equal(lin.ssm[slot], sh.ssm[i]), f"{rid}: layer {i} SSM state"
        for block in s.prefix_cache.blocks():
            prefix: list[int] = []
            b = block
            while b is not None:
                prefix[:0] = b.tokens
                b = s.prefix_cache.get(b.parent) if b.parent is not None else None
            sh = Shadow(prefix, random.Random(0))
            n = len(prefix)
            for i in KV_LAYERS:
                want_k, want_v = self._expected_kv(sh, i, n - PS, n)
                kv = s.kv_cache.layer(i)
                assert torch.equal(kv.k[block.page], want_k), f"cached block {n}: layer {i} K"
                assert torch.equal(kv.v[block.page], want_v), f"cached block {n}: layer {i} V"
            if block.snapshot is not None:
                for i in LIN_LAYERS:
                    lin = s.state_slots.layer(i)
                    want = self._expected_conv(sh, i, n)
                    assert torch.equal(lin.conv[block.snapshot], want), f"snapshot {n}: conv"
                    assert any(
                        torch.equal(lin.ssm[block.snapshot], snap[i])
                        for snap in self.snapshots.get(tuple(prefix), [])
                    ), f"snapshot of {n} tokens: SSM state is none taken of that prefix"

    def teardown(self) -> None:
        """Release everything (requests the machine lost track of too): nothing may leak. After
        a failed rule (hypothesis calls this from a ``finally``) only clean up, so that the
        report shows the rule's failure."""
        failed = sys.exc_info()[0] is not None
        try:
            for rid in self.state.request_ids():
                self.state.release(rid)
            self.state.clear_prefix_cache()
        except Exception:
            if not failed:
                raise
        if failed:
            return
        self.state.check_invariants()
        assert self.state.num_free_pages == NUM_PAGES, "pages leaked"
        assert self.state.num_free_slots == NUM_SLOTS, "slots leaked"


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got.double(), want.double(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}"
    )


RuntimeStateMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestRuntimeStateMachine = RuntimeStateMachine.TestCase
