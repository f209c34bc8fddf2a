"""Mamba1 kernels (``kernels/mamba1.py``) against attn-core's reference selective scan, itself
checked against transformers' Mamba scan / state update and fla's naive GLA
(tests/reference/test_ops_linear.py).

Without CUDA the kernels run in Triton's CPU interpreter (see ``kernel_device``); with CUDA the
same small-shape tests run compiled. Shapes: ``D`` inner channels not a multiple of the channel
block (two and a half blocks of 8), ``N = 8`` state entries.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA

from attn_core.reference.ops import mamba1_selective_scan

Dn, N, S = 20, 8, 6
BLOCK_D = 8
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "A_log": (torch.arange(1, N + 1).float().log().expand(Dn, -1)
                  + torch.randn(Dn, N, generator=gen) * 0.3).contiguous(),
        "D": torch.randn(Dn, generator=gen),
        "dt_bias": torch.randn(Dn, generator=gen),
    }  # fmt: skip


def _tokens(T: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(T, Dn, generator=gen),
        "dt": torch.randn(T, Dn, generator=gen),
        "B": torch.randn(T, N, generator=gen),
        "C": torch.randn(T, N, generator=gen),
        "z": torch.randn(T, Dn, generator=gen),
    }


def _dev(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(DEV) for k, v in d.items()}


def _reference(t, p, pool, lens, slots, initial, *, intermediate=None):
    """attn-core's reference op in its layout ([T, D, 1], [T, 1, N], pool [S, D, N, 1]),
    gated by silu(z) as the kernels do; updates ``pool`` (CPU, float32) in place."""
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    y = mamba1_selective_scan(
        t["x"][..., None], t["dt"], p["A_log"], t["B"][:, None], t["C"][:, None], p["D"],
        p["dt_bias"], pool, qsl, torch.tensor(slots, dtype=torch.int32),
        torch.tensor(initial), mode="recurrent", intermediate_states=intermediate,
    )[..., 0]  # fmt: skip
    return y * F.silu(t["z"])


# requests_per_program 3: four requests, the second program gets one; with the streaming hints,
# and as a pipelined loop
@pytest.mark.parametrize(
    "tuning",
    [{}, {"requests_per_program": 3, "cache_hints": True},
     {"requests_per_program": 3, "pipeline": 2}, {"requests_per_program": 3, "loads_first": True}],
    ids=["default", "rpp3-hints", "rpp3-pipelined", "rpp3-loads-first"],
)  # fmt: skip
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dims", [3, 4])
def test_decode_matches_reference(state_dtype: torch.dtype, pool_dims: int, tuning: dict) -> None:
    gen = _gen(0)
    p, t = _params(gen), _tokens(4, gen)
    pool = (torch.randn(S, Dn, N, 1, generator=gen) * 0.3).to(state_dtype)
    slots = [3, -1, 0, 5]
    ref_pool = pool.float().clone()
    want = _reference(t, p, ref_pool, [1] * 4, slots, [True] * 4)
    st = pool.clone().to(DEV)
    got = K.mamba1_decode(
        *(_dev(t)[k] for k in ("x", "dt")), p["A_log"].to(DEV), *(_dev(t)[k] for k in "BC"),
        st if pool_dims == 4 else st.squeeze(-1), torch.tensor(slots, dtype=torch.int32).to(DEV),
        D=p["D"].to(DEV), dt_bias=p["dt_bias"].to(DEV), z=t["z"].to(DEV),
        **{"block_d": BLOCK_D, **tuning},
    ).cpu()  # fmt: skip
    tol = TOL if state_dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    live = [b for b, s in enumerate(slots) if s >= 0]
    torch.testing.assert_close(got[live], want[live], **TOL)
    assert torch.count_nonzero(got[1]) == 0  # the padding row writes zeros
    used = [s for s in slots if s >= 0]
    torch.testing.assert_close(st.cpu()[used].float(), ref_pool[used], **tol)
    untouched = [s for s in range(S) if s not in used]
    assert torch.equal(st.cpu()[untouched], pool[untouched])


@pytest.mark.parametrize(
    "tuning",
    [{"lanes": False}, {"lanes": False, "requests_per_program": 2}, {"block_d": None}],
    ids=["tiles", "tiles-rpp2", "default"],
)
def test_varlen_prefill_with_fresh_and_continued_requests(tuning: dict) -> None:
    """Lengths 7, 1, 0, 12 (a zero-length request, a decode among prefills); request 1 is fresh
    (its slot holds NaN garbage that must never be read); a padding request rides along."""
    gen = _gen(1)
    p = _params(gen)
    lens, slots, initial = [7, 1, 0, 12, 3], [2, 4, 1, 0, -1], [True, False, True, True, True]
    t = _tokens(sum(lens), gen)
    pool = torch.randn(S, Dn, N, 1, generator=gen) * 0.3
    pool[4] = float("nan")
    ref_pool = pool.clone()
    ref_pool[4] = 0.0  # the reference never reads a fresh slot either; keep NaN out of it
    want = _reference(t, p, ref_pool, lens, slots, initial)
    st = pool.clone().to(DEV)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    got = K.mamba1_scan(
        *(_dev(t)[k] for k in ("x", "dt")), p["A_log"].to(DEV), *(_dev(t)[k] for k in "BC"),
        st, torch.tensor(slots, dtype=torch.int32).to(DEV), cu_seqlens=cu.to(DEV),
        has_initial_state=torch.tensor(initial).to(DEV), D=p["D"].to(DEV),
        dt_bias=p["dt_bias"].to(DEV), z=t["z"].to(DEV), **{"block_d": BLOCK_D, **tuning},
    ).cpu()  # fmt: skip
    real = sum(lens[:-1])
    torch.testing.assert_close(got[:real], want[:real], **TOL)
    assert torch.count_nonzero(got[real:]) == 0
    torch.testing.assert_close(st.cpu()[[2, 4, 1, 0]], ref_pool[[2, 4, 1, 0]], **TOL)
    assert torch.equal(st.cpu()[[3, 5]], pool[[3, 5]])


def test_prefill_split_equals_whole() -> None:
    """State carry: a 13-token request in chunks 5 + 1 + 7 equals one call (no D, dt_bias, z)."""
    gen = _gen(2)
    p = _params(gen)
    t = _tokens(13, gen)

    def args(a: int, b: int) -> tuple[torch.Tensor, ...]:
        x, dt, B, C = (t[k][a:b].to(DEV) for k in ("x", "dt", "B", "C"))
        return x, dt, p["A_log"].to(DEV), B, C

    idx = torch.tensor([0], dtype=torch.int32, device=DEV)
    whole_state = torch.zeros(1, Dn, N, device=DEV)
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device=DEV)  # noqa: E731
    whole = K.mamba1_scan(*args(0, 13), whole_state, idx, cu_seqlens=cu(13))
    state = torch.zeros(1, Dn, N, device=DEV)
    parts = [K.mamba1_scan(*args(a, b), state, idx, cu_seqlens=cu(b - a))
             for a, b in ((0, 5), (5, 6), (6, 13))]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts).cpu(), whole.cpu(), **TOL)
    torch.testing.assert_close(state.cpu(), whole_state.cpu(), **TOL)


def test_verify_native_commit_and_replay_commit_agree_for_every_accepted_count() -> None:
    gen = _gen(3)
    p = _params(gen)
    Bt, K1 = 3, 4
    t = _tokens(Bt * K1, gen)
    slots = [5, -1, 2]
    pool = torch.randn(S, Dn, N, 1, generator=gen) * 0.3
    ref_pool = pool.clone()
    ref_inter = torch.full((Bt, K1, Dn, N, 1), float("nan"))
    want = _reference(t, p, ref_pool, [K1] * Bt, slots, [True] * Bt, intermediate=ref_inter)
    st = pool.clone().to(DEV)
    inter = torch.full((Bt, K1, Dn, N, 1), float("nan"), device=DEV)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
    cu = torch.arange(0, Bt * K1 + 1, K1, dtype=torch.int32, device=DEV)
    common = dict(D=p["D"].to(DEV), dt_bias=p["dt_bias"].to(DEV))
    toks = (*(_dev(t)[k] for k in ("x", "dt")), p["A_log"].to(DEV), *(_dev(t)[k] for k in "BC"))
    got = K.mamba1_scan(*toks, st, idx, cu_seqlens=cu, z=t["z"].to(DEV),
                        intermediate_states=inter, update_state=False, **common)  # fmt: skip
    assert torch.equal(st.cpu(), pool), "update_state=False must leave every slot"
    live = [0, 2]
    rows = torch.cat([torch.arange(b * K1, (b + 1) * K1) for b in live])
    torch.testing.assert_close(got.cpu()[rows], want[rows], **TOL)
    torch.testing.assert_close(inter.cpu()[live], ref_inter[live], **TOL)
    for n in range(K1 + 1):
        acc = torch.tensor([n, K1, max(n - 1, 0)], dtype=torch.int32, device=DEV)
        native, replay = pool.clone().to(DEV), pool.clone().to(DEV)
        K.mamba1_commit(inter, acc, native, idx)
        K.mamba1_replay_commit(*toks, acc, replay, idx, **common)
        for b, s in enumerate(slots):
            if s < 0:
                continue
            a = int(acc[b])
            expected = pool[s] if a == 0 else ref_inter[b, a - 1]
            torch.testing.assert_close(native.cpu()[s], expected, **TOL)
            torch.testing.assert_close(replay.cpu()[s], expected, **TOL)
        others = [s for s in range(S) if s not in (5, 2)]
        assert torch.equal(native.cpu()[others], pool[others])
        assert torch.equal(replay.cpu()[others], pool[others])


def test_shapes_are_checked_with_names() -> None:
    gen = _gen(4)
    p, t = _params(gen), _dev(_tokens(2, gen))
    st = torch.zeros(S, Dn, N, device=DEV)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    a_log = p["A_log"].to(DEV)
    with pytest.raises(ValueError, match=r"ssm_state: expected shape \[\*, 20, 8\]"):
        K.mamba1_decode(t["x"], t["dt"], a_log, t["B"], t["C"], st[:, :, :4], idx)
    with pytest.raises(ValueError, match=r"B: expected shape \[2, 8\]"):
        K.mamba1_decode(t["x"], t["dt"], a_log, t["B"][:, :4], t["C"], st, idx)
    with pytest.raises(ValueError, match="one token per request"):
        K.mamba1_decode(t["x"], t["dt"], a_log, t["B"], t["C"], st, idx[:1])
    with pytest.raises(ValueError, match="requests_per_program"):
        K.mamba1_decode(t["x"], t["dt"], a_log, t["B"], t["C"], st, idx, requests_per_program=0)
    for stages in (1, -2, True):  # one stage is no pipeline: refused rather than taken as 0
        with pytest.raises(ValueError, match="pipeline: expected 0"):
            K.mamba1_decode(t["x"], t["dt"], a_log, t["B"], t["C"], st, idx, pipeline=stages)
    with pytest.raises(TypeError, match="A_log: expected dtype"):
        K.mamba1_decode(t["x"], t["dt"], a_log.double(), t["B"], t["C"], st, idx)


def test_strided_x_z_and_out() -> None:
    """attn-core hands ``v [T, D, 1]`` and ``out`` as views of wider buffers (channel stride
    > 1): the kernels read and write through the strides, and touch nothing in between."""
    gen = _gen(5)
    p, t = _params(gen), _tokens(3, gen)
    wide = {k: torch.randn(3, Dn, 3, generator=gen) for k in ("x", "z")}
    for k in wide:
        wide[k][:, :, 0] = t[k]
    pool = torch.randn(S, Dn, N, 1, generator=gen) * 0.3
    slots = [1, 4, 0]
    ref_pool = pool.clone()
    want = _reference(t, p, ref_pool, [1] * 3, slots, [True] * 3)
    out_buf = torch.full((3, Dn, 3), 7.0, device=DEV)
    st = pool.clone().to(DEV)
    x, z = (wide[k].to(DEV)[:, :, 0] for k in ("x", "z"))
    got = K.mamba1_decode(
        x, t["dt"].to(DEV), p["A_log"].to(DEV), t["B"].to(DEV), t["C"].to(DEV), st,
        torch.tensor(slots, dtype=torch.int32, device=DEV), D=p["D"].to(DEV),
        dt_bias=p["dt_bias"].to(DEV), z=z, out=out_buf[:, :, 0], block_d=BLOCK_D,
    )  # fmt: skip
    assert got.data_ptr() == out_buf.data_ptr()
    torch.testing.assert_close(out_buf[:, :, 0].cpu(), want, **TOL)
    assert bool((out_buf[:, :, 1:] == 7.0).all())
    torch.testing.assert_close(st.cpu()[slots], ref_pool[slots], **TOL)


def _varlen(t, p, st, slots, lens, initial, **kw) -> torch.Tensor:
    """``mamba1_scan`` over ``lens`` with D and dt_bias (``kw``: z, time_chunk, out, ...;
    the tile kernel (``lanes=False``) with ``block_d`` BLOCK_D unless given)."""
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)
    return K.mamba1_scan(
        *(_dev(t)[k] for k in ("x", "dt")), p["A_log"].to(DEV), *(_dev(t)[k] for k in "BC"),
        st, torch.tensor(slots, dtype=torch.int32, device=DEV), cu_seqlens=cu,
        has_initial_state=None if initial is None else torch.tensor(initial, device=DEV),
        D=p["D"].to(DEV), dt_bias=p["dt_bias"].to(DEV),
        **{"block_d": BLOCK_D, "lanes": False, **kw},
    )  # fmt: skip


#: Lengths 7, 1, 0, 12, 3 and 9: a zero-length request, a decode among prefills, a padding
#: request (slot -1) between live ones; request 1 is fresh (NaN garbage in its slot).
CHUNK_LENS, CHUNK_SLOTS = [7, 1, 0, 12, 3, 9], [2, 4, 1, 0, -1, 5]
CHUNK_INITIAL = [True, False, True, True, True, True]


F32, BF16 = torch.float32, torch.bfloat16


# L = 1 (a chunk per token), 4 (divides only the 12), 5 (divides none), 16 (longer than every
# request); each with both pool dtypes, z and has_initial_state on in one and off in the other
@pytest.mark.parametrize(
    ("L", "state_dtype", "gate", "with_initial"),
    [(1, F32, True, True), (1, BF16, False, False), (4, F32, False, False),
     (4, BF16, True, True), (5, F32, True, True), (5, BF16, False, False),
     (16, F32, False, False), (16, BF16, True, True)],
)  # fmt: skip
def test_time_chunked_prefill_matches_sequential_and_reference(
    L: int, state_dtype: torch.dtype, gate: bool, with_initial: bool
) -> None:
    """``time_chunk=L`` (chunks from a zero state, carry, re-scan): see
    :func:`_check_against_sequential`."""
    _check_against_sequential({"time_chunk": L}, state_dtype, gate, with_initial)


def _check_against_sequential(
    variant: dict, state_dtype: torch.dtype, gate: bool, with_initial: bool
) -> None:
    """``mamba1_scan(**variant)`` against the sequential kernel (``time_chunk=0``) and
    attn-core's reference: outputs, final states, untouched slots and the ``out`` buffer's
    other columns. ``with_initial`` False: no ``has_initial_state`` (every request continues
    its slot)."""
    gen = _gen(6)
    p = _params(gen)
    lens, slots = CHUNK_LENS, CHUNK_SLOTS
    initial = CHUNK_INITIAL if with_initial else None
    t = _tokens(sum(lens), gen)
    if not gate:
        t["z"] = torch.full_like(t["z"], 30.0)  # silu(30) = 30 to 1e-13: the reference's gate off
    pool = (torch.randn(S + 1, Dn, N, 1, generator=gen) * 0.3).to(state_dtype)
    if with_initial:
        pool[4] = float("nan")
    ref_pool = pool.float().clone()
    if with_initial:
        ref_pool[4] = 0.0
    want = _reference(t, p, ref_pool, lens, slots, initial if with_initial else [True] * 6)
    if not gate:
        want = want / 30.0
    kw = {"z": t["z"].to(DEV)} if gate else {}
    seq_st = pool.clone().to(DEV)
    seq = _varlen(t, p, seq_st, slots, lens, initial, time_chunk=0, lanes=False, **kw).cpu()
    T = sum(lens)
    out_buf = torch.full((T, Dn, 2), 7.0, device=DEV)
    st = pool.clone().to(DEV)
    got = _varlen(t, p, st, slots, lens, initial, out=out_buf[:, :, 0], **variant, **kw)
    assert got.data_ptr() == out_buf.data_ptr()
    got = got.cpu()
    assert bool((out_buf[:, :, 1] == 7.0).all())
    pad = slice(sum(lens[:4]), sum(lens[:5]))  # the padding request's tokens: zeros
    assert torch.count_nonzero(got[pad]) == 0
    live = torch.cat([torch.arange(sum(lens[:b]), sum(lens[: b + 1]))
                      for b in range(len(lens)) if slots[b] >= 0])  # fmt: skip
    torch.testing.assert_close(got, seq, **TOL)
    torch.testing.assert_close(got[live], want[live], **TOL)
    used = [s for s in slots if s >= 0]
    tol = TOL if state_dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(st.cpu()[used].float(), seq_st.cpu()[used].float(), **tol)
    torch.testing.assert_close(st.cpu()[used].float(), ref_pool[used], **tol)
    others = [s for s in range(S + 1) if s not in used]
    assert torch.equal(st.cpu()[others], pool[others])


#: Two requests of 10 and 6 tokens in slots 1 and 3, the second fresh.
TWO_LENS, TWO_SLOTS, TWO_INITIAL = [10, 6], [1, 3], [True, False]


def _two_requests(seed: int) -> tuple:
    """``(gen, params, tokens, pool [S, D, N, 1] CPU, the pool on DEV)`` for TWO_LENS."""
    gen = _gen(seed)
    p = _params(gen)
    t = _tokens(sum(TWO_LENS), gen)
    pool = torch.randn(S, Dn, N, 1, generator=gen) * 0.3
    return gen, p, t, pool, pool.clone().to(DEV)


# The lanes kernel: one program of 32 channels (D = 20: 12 masked), two channels a thread (64 on
# one warp), the default tiling (128 channels on 4 warps), and as both scans of time_chunk
@pytest.mark.parametrize(
    ("variant", "state_dtype", "gate", "with_initial"),
    [({"time_chunk": 0, "block_d": 32, "num_warps": 1}, F32, True, True),
     ({"time_chunk": 0, "block_d": 64, "num_warps": 1}, BF16, False, False),
     ({"time_chunk": 0, "block_d": None}, F32, False, True),
     ({"time_chunk": 4, "block_d": 32, "num_warps": 1}, BF16, True, True),
     ({"time_chunk": 5, "block_d": 32, "num_warps": 1}, F32, False, False),
     ({"time_chunk": 1, "block_d": 64, "num_warps": 2}, F32, True, True)],
    ids=["walk-32", "walk-64x2", "walk-default", "chunk4", "chunk5", "chunk1-64"],
)  # fmt: skip
def test_lanes_prefill_matches_sequential_and_reference(
    monkeypatch, variant: dict, state_dtype: torch.dtype, gate: bool, with_initial: bool
) -> None:
    """``lanes=True`` (a channel a thread, its states a tuple of registers): see
    :func:`_check_against_sequential`; the lanes launcher runs, twice where chunked."""
    calls = _record_launches(monkeypatch, "launch_lanes", "write_state")
    _check_against_sequential({"lanes": True, **variant}, state_dtype, gate, with_initial)
    assert len(calls) == (2 if variant["time_chunk"] else 1)


def test_lanes_without_state_update_and_argument_checks() -> None:
    """``lanes=True`` with ``update_state=False`` leaves every slot; it refuses
    ``intermediate_states`` and tilings that do not give each thread whole channels."""
    _, p, t, pool, st = _two_requests(10)
    lens, slots, initial = TWO_LENS, TWO_SLOTS, TWO_INITIAL
    seq = _varlen(t, p, st.clone(), slots, lens, initial, time_chunk=0, lanes=False).cpu()
    got = _varlen(t, p, st, slots, lens, initial, time_chunk=0, lanes=True, block_d=32,
                  num_warps=1, update_state=False).cpu()  # fmt: skip
    assert torch.equal(st.cpu(), pool)
    torch.testing.assert_close(got, seq, **TOL)
    inter = torch.zeros(2, 10, Dn, N, device=DEV)
    with pytest.raises(
        ValueError, match=r"lanes: .*no per-token states.*intermediate_states=given"
    ):
        _varlen(t, p, st, slots, lens, initial, lanes=True, intermediate_states=inter)
    for block_d, warps in ((48, 1), (32, 2), (16, None)):
        with pytest.raises(ValueError, match=rf"block_d: the lanes kernel.*got {block_d}"):
            _varlen(t, p, st, slots, lens, initial, lanes=True, block_d=block_d,
                    num_warps=warps)  # fmt: skip
    with pytest.raises(ValueError, match="num_warps: expected a power of two, got 3"):
        _varlen(t, p, st, slots, lens, initial, lanes=True, block_d=128, num_warps=3)


def test_default_scan_takes_the_lanes_kernel_where_it_was_measured(monkeypatch) -> None:
    """``lanes=None``: the lanes kernel for varlen calls without per-token states at d_state up
    to ``LANES_MAX_D_STATE``; the tile kernel with ``intermediate_states``, above that d_state
    and for decode. The tile kernel's knobs (``requests_per_program``, ``cache_hints``) on a
    varlen call the lanes kernel serves are refused, not ignored."""
    from attn_plugin_triton_ssm.kernels import mamba1 as m1

    calls = _record_launches(monkeypatch, "launch_lanes", "write_state")
    gen, p, t, pool, st = _two_requests(12)
    lens, slots, initial = TWO_LENS, TWO_SLOTS, TWO_INITIAL
    want_st = st.clone()
    want = _varlen(t, p, want_st, slots, lens, initial, lanes=False).cpu()
    got = _varlen(t, p, st, slots, lens, initial, lanes=None, block_d=None).cpu()
    assert calls == [True]
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(st.cpu(), want_st.cpu(), **TOL)
    inter = torch.zeros(2, 10, Dn, N, device=DEV)
    _varlen(t, p, pool.clone().to(DEV), slots, lens, initial, lanes=None, intermediate_states=inter)
    monkeypatch.setattr(m1, "LANES_MAX_D_STATE", N - 1)
    _varlen(t, p, pool.clone().to(DEV), slots, lens, initial, lanes=None)
    _assert_decode_ignores(gen, p, pool, lanes=None)
    assert calls == [True]
    monkeypatch.setattr(m1, "LANES_MAX_D_STATE", N)
    for knob in ({"requests_per_program": 2}, {"cache_hints": True}):
        for lanes in (None, True):
            with pytest.raises(ValueError, match=rf"{next(iter(knob))}: .*pass lanes=False"):
                _varlen(t, p, st, slots, lens, initial, lanes=lanes, block_d=None, **knob)
    assert calls == [True]


def _record_launches(monkeypatch, launcher: str, key: str) -> list:
    """Wrap ``mamba1.<launcher>`` so that each call appends its keyword ``key`` to the list
    returned (the path runs, and only where asked: else the comparisons against the sequential
    kernel could pass on the sequential kernel itself)."""
    from attn_plugin_triton_ssm.kernels import mamba1 as m1

    calls: list = []
    real = getattr(m1, launcher)

    def spy(*a, **kw):
        calls.append(kw[key])
        return real(*a, **kw)

    monkeypatch.setattr(m1, launcher, spy)
    return calls


def _assert_decode_ignores(gen, p, pool, **kw) -> None:
    """A decode call (no ``cu_seqlens``) gives the same outputs and states with ``kw``."""
    d = _dev(_tokens(2, gen))
    idx = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    a, b = pool.clone().to(DEV), pool.clone().to(DEV)
    args = (d["x"], d["dt"], p["A_log"].to(DEV), d["B"], d["C"])
    y0 = K.mamba1_decode(*args, a, idx, block_d=BLOCK_D)
    y1 = K.mamba1_decode(*args, b, idx, block_d=BLOCK_D, **kw)
    assert torch.equal(y0, y1) and torch.equal(a, b)


def test_a_lanes_decode_is_refused_before_any_slot_is_touched() -> None:
    """``lanes=True`` without ``cu_seqlens``: a ValueError that says the tile kernel serves
    decode; the pool is left as it was."""
    gen, p, _, pool, _ = _two_requests(9)
    d = _dev(_tokens(2, gen))
    idx = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    st = pool.clone().to(DEV)
    with pytest.raises(ValueError, match=r"lanes: .*serves varlen calls; a decode .*tile kernel"):
        K.mamba1_decode(d["x"], d["dt"], p["A_log"].to(DEV), d["B"], d["C"], st, idx, lanes=True)
    assert torch.equal(st.cpu(), pool)


def test_time_chunked_prefill_without_state_update_and_argument_checks(monkeypatch) -> None:
    """``update_state=False`` leaves every slot and gives the same outputs; ``time_chunk`` is
    checked, refuses ``intermediate_states`` and is ignored by decode calls; the chunked path
    runs exactly where asked."""
    calls = _record_launches(monkeypatch, "_launch_chunked", "L")
    gen, p, t, pool, st = _two_requests(7)
    lens, slots, initial = TWO_LENS, TWO_SLOTS, TWO_INITIAL
    seq = _varlen(t, p, st.clone(), slots, lens, initial, time_chunk=0).cpu()
    got = _varlen(t, p, st, slots, lens, initial, time_chunk=4, update_state=False).cpu()
    assert torch.equal(st.cpu(), pool)
    torch.testing.assert_close(got, seq, **TOL)
    _varlen(t, p, st.clone(), slots, lens, initial)  # None: automatic, off off CUDA
    assert calls == [4]
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="time_chunk: expected None or an int >= 0"):
            _varlen(t, p, st, slots, lens, initial, time_chunk=bad)
    inter = torch.zeros(2, 10, Dn, N, device=DEV)
    with pytest.raises(ValueError, match="keeps no per-token states"):
        _varlen(t, p, st, slots, lens, initial, time_chunk=4, intermediate_states=inter)
    _assert_decode_ignores(gen, p, pool, time_chunk=8)
    assert calls == [4]


def test_automatic_time_chunk_switches_on_where_the_walk_leaves_sms_idle(monkeypatch) -> None:
    """``auto_time_chunk``: chunks below the programs-per-SM threshold when the requests are
    long enough for two chunks on average; never off CUDA. ``decode_defaults`` by batch."""
    from attn_plugin_triton_ssm.kernels import mamba1 as m1

    monkeypatch.setattr(m1, "_num_sms", lambda index: 132)
    cuda, L = torch.device("cuda"), m1.AUTO_TIME_CHUNK
    most = m1.AUTO_CHUNK_BELOW_PROGRAMS_PER_SM * 132  # programs the walk may start and chunk
    d = 8192  # 512 programs of 16 channels per request
    r_max = -(-most // 512) - 1  # the most requests below the threshold
    assert m1.auto_time_chunk(8192, 1, d, cuda) == L
    assert m1.auto_time_chunk(2 * L * r_max, r_max, d, cuda) == L
    assert m1.auto_time_chunk(2 * L * (r_max + 1), r_max + 1, d, cuda) == 0
    assert m1.auto_time_chunk(2 * L - 1, 1, d, cuda) == 0  # under two chunks a request
    assert m1.auto_time_chunk(8192, 0, d, cuda) == 0
    assert m1.auto_time_chunk(8192, 1, d, torch.device("cpu")) == 0
    # decode: the streaming hints below 1024 requests, 4 requests a program from there
    assert m1.decode_defaults(1023) == (1, True) and m1.decode_defaults(1024) == (4, False)


def test_automatic_choices_reach_the_launches(monkeypatch) -> None:
    """``time_chunk=None`` takes ``auto_time_chunk``'s answer (same outputs as asking for it),
    except with ``intermediate_states`` (never chunked) and for decode; a decode call with
    ``requests_per_program`` / ``cache_hints`` None takes ``decode_defaults``."""
    from attn_plugin_triton_ssm.kernels import mamba1 as m1

    asked: list = []
    monkeypatch.setattr(m1, "auto_time_chunk", lambda T, R, D, device, **kw: asked.append(T) or 4)
    chunked = _record_launches(monkeypatch, "_launch_chunked", "L")
    gen, p, t, pool, a = _two_requests(9)
    lens, slots, initial = TWO_LENS, TWO_SLOTS, TWO_INITIAL
    b = pool.clone().to(DEV)
    auto = _varlen(t, p, a, slots, lens, initial).cpu()
    explicit = _varlen(t, p, b, slots, lens, initial, time_chunk=4).cpu()
    assert asked == [16] and chunked == [4, 4]
    assert torch.equal(auto, explicit) and torch.equal(a, b)
    inter = torch.zeros(2, 10, Dn, N, device=DEV)
    _varlen(t, p, pool.clone().to(DEV), slots, lens, initial, intermediate_states=inter)
    assert asked == [16] and chunked == [4, 4]

    launches = _record_launches(monkeypatch, "_launch", "requests_per_program")
    hints = _record_launches(monkeypatch, "_launch", "cache_hints")
    monkeypatch.setattr(m1, "decode_defaults", lambda R: (3, False))
    _assert_decode_ignores(gen, p, pool)  # two decode calls, both with the defaults
    assert launches[-2:] == [3, 3] and hints[-2:] == [False, False]
    assert asked == [16]


@pytest.mark.parametrize("K1", [1, 4])
def test_verify_and_replay_commit_launch_the_same_tiles(monkeypatch, K1) -> None:
    """Bit-identical commits need the same compiled arithmetic: the verify scan and the replay
    commit must run ``_mamba1_scan_kernel`` with the same channel block and warps (on the H200
    the replay's wider default tile rounded some states differently at d_inner 8192)."""
    from attn_plugin_triton_ssm.kernels import mamba1

    launched: list[tuple[int, int]] = []
    real = mamba1._mamba1_scan_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["BD"], kw["num_warps"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(mamba1, "_mamba1_scan_kernel", Recorder())
    gen = _gen(11)
    p = _params(gen)
    Bt = 3
    t = _dev(_tokens(Bt * K1, gen))
    toks = (t["x"], t["dt"], p["A_log"].to(DEV), t["B"], t["C"])
    idx = torch.tensor([1, 4, 0], dtype=torch.int32, device=DEV)
    cu = torch.arange(0, Bt * K1 + 1, K1, dtype=torch.int32, device=DEV)
    pool = torch.randn(S, Dn, N, generator=gen).to(DEV)
    inter = torch.empty(Bt, K1, Dn, N, device=DEV)
    K.mamba1_scan(*toks, pool, idx, cu_seqlens=cu, intermediate_states=inter, update_state=False)
    acc = torch.full((Bt,), K1, dtype=torch.int32, device=DEV)
    K.mamba1_replay_commit(*toks, acc, pool, idx)
    assert len(launched) == 2
    assert launched[0] == launched[1], f"verify scan {launched[0]} vs replay commit {launched[1]}"
