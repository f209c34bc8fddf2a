"""The Triton chunked SSD (``mamba2_prefill(impl="triton")``) against the explicit Mamba2
recurrence of ``triton_ssm_refs`` and against the torch chunked SSD, on varlen batches whose
sequences end inside, and exactly on, chunk boundaries.

Without CUDA the kernels run in Triton's CPU interpreter (see ``kernel_device``); with CUDA the
same small-shape tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from triton_ssm_refs import mamba2_ref

ssd = K.ssd  # the submodule, imported by the package after kernel_device chose the build

S = 8  # slots in the pool
SLOTS = [6, 0, 3, 5, 2, 7]  # the first len(lens) are used, in this (non-sorted) order


def _case(lens, *, H=4, G=1, N=16, P=32, dtype=torch.float32, state_dtype=torch.float32,
          init=True, seed=0, dt_shift=1.0):  # fmt: skip
    """Packed inputs for sequences of ``lens`` tokens, on the host (float32 reference data
    rounded to ``dtype`` once, so the reference sees the same values). ``dt`` is drawn from
    ``N(-dt_shift, 1)`` before bias and softplus: a larger shift decays the state more slowly,
    so the initial and inter-chunk states still weigh on outputs hundreds of tokens later."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    inp = {
        "x": r(T, H, P).to(dtype),
        "dt": r(T, H) - dt_shift,
        "A_log": r(H) * 0.5,
        "B": r(T, G, N).to(dtype),
        "C": r(T, G, N).to(dtype),
    }
    extras = {"D": r(H), "dt_bias": r(H) * 0.5, "z": r(T, H, P)}
    state = (r(S, H, N, P) if init else torch.zeros(S, H, N, P)).to(state_dtype)
    idx = torch.tensor(SLOTS[: len(lens)], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return inp, extras, state, idx, cu


def _dev(d: dict) -> dict:
    return {k: v.to(DEV) for k, v in d.items()}


def _run(inp, extras, state, idx, cu, **kw) -> torch.Tensor:
    """impl='triton' on DEV; ``state`` (a DEV tensor) is updated in place."""
    return K.mamba2_prefill(
        **_dev(inp), ssm_state=state, state_indices=idx.to(DEV), cu_seqlens=cu.to(DEV),
        cu_seqlens_cpu=cu, impl="triton", **_dev(extras), **kw,
    )  # fmt: skip


def _check_against_recurrence(y, st, before, inp, extras, idx, cu, *, out_tol, state_tol):
    y, st = y.cpu(), st.cpu()
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        if s == e:  # no tokens: the slot keeps its state, bit for bit
            assert torch.equal(st[idx[i]], before[idx[i]]), f"empty sequence {i} changed its slot"
            continue
        y_ref, h_ref = mamba2_ref(
            inp["x"][None, s:e], inp["dt"][None, s:e], inp["A_log"], inp["B"][None, s:e],
            inp["C"][None, s:e], before[idx[i]][None], D=extras.get("D"),
            dt_bias=extras.get("dt_bias"), z=None if "z" not in extras else extras["z"][None, s:e],
        )  # fmt: skip
        msg = f"sequence {i} ({e - s} tokens)"
        torch.testing.assert_close(y[s:e].float(), y_ref[0], **out_tol,
                                   msg=lambda m, s_=msg: f"{s_} output\n{m}")  # fmt: skip
        torch.testing.assert_close(st[idx[i]].float(), h_ref[0], **state_tol,
                                   msg=lambda m, s_=msg: f"{s_} state\n{m}")  # fmt: skip
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(st[untouched], before[untouched]), "slots outside the batch were written"


def _with_and_without(option, inp, extras, state, idx, cu, **kw):
    """``[(y, final pool) with option=True, (y, final pool) with option=False]`` (host tensors),
    each from a copy of ``state``."""
    runs = []
    for on in (True, False):
        st = state.clone().to(DEV)
        y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                                  cu_seqlens_cpu=cu, **{option: on}, **kw,
                                  **_dev(extras))  # fmt: skip
        runs.append((y.cpu(), st.cpu()))
    return runs


FP32_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 outputs: one ulp (the interpreter truncates to bf16, 2**-7 relative; the GPU rounds).
BF16_OUT_TOL = dict(atol=1e-3, rtol=2**-7)


# (lens, G, chunk): one sequence; several with lengths 1, exact multiples of the chunk and not;
# a zero-length sequence in the middle (its slot must come back unchanged).
CASES = {
    "one_seq": ([37], 1, 16),
    "varlen_G1": ([1, 16, 45, 32, 3], 1, 16),
    "varlen_G2": ([5, 33, 1, 64], 2, 32),
    "varlen_G4_empty": ([17, 0, 16, 2], 4, 16),
}


@pytest.mark.parametrize(
    ("case", "init"),
    [(c, True) for c in CASES] + [("varlen_G2", False)],
    ids=[*(f"{c}-h0" for c in CASES), "varlen_G2-zero_h0"],
)
def test_fp32_matches_recurrence(case, init):
    lens, G, chunk = CASES[case]
    inp, extras, state, idx, cu = _case(lens, G=G, init=init, seed=len(case))
    before = state.clone()
    st = state.to(DEV)
    y = _run(inp, extras, st, idx, cu, chunk_size=chunk)
    assert y.dtype == torch.float32 and y.shape == inp["x"].shape
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["varlen_G1", "varlen_G2"])
def test_bf16_inputs_match_recurrence(case, state_dtype):
    """bf16 x/B/C: the float32 dot operands are split in hi + lo bf16 halves, so the state stays
    within float32 rounding of the recurrence run on the same bf16 values."""
    lens, G, chunk = CASES[case]
    inp, extras, state, idx, cu = _case(lens, G=G, dtype=torch.bfloat16, state_dtype=state_dtype)
    before = state.clone()
    st = state.to(DEV)
    y = _run(inp, extras, st, idx, cu, chunk_size=chunk)
    assert y.dtype == torch.bfloat16
    state_tol = FP32_TOL if state_dtype == torch.float32 else BF16_OUT_TOL
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=BF16_OUT_TOL,
                              state_tol=state_tol)  # fmt: skip


def test_plain_no_extras_non_pow2_dims_matches_torch_impl():
    """No D / dt_bias / z, raw dt (no softplus, may be negative), N and P not powers of two
    (masked tiles), against the torch chunked SSD."""
    lens = [9, 40, 1]
    inp, _, state, idx, cu = _case(lens, H=6, G=3, N=20, P=24, seed=7)
    inp["dt"] = inp["dt"].abs() * 0.3
    st_torch = state.clone()
    y_torch = K.mamba2_prefill(**inp, ssm_state=st_torch, state_indices=idx, cu_seqlens=cu,
                               dt_softplus=False, impl="torch")  # fmt: skip
    st = state.to(DEV)
    y = _run(inp, {}, st, idx, cu, chunk_size=16, dt_softplus=False)
    torch.testing.assert_close(y.cpu(), y_torch, **FP32_TOL)
    torch.testing.assert_close(st.cpu(), st_torch, **FP32_TOL)


def test_tiling_options_do_not_change_results():
    """heads_per_program only regroups whole heads: bit-identical under the interpreter, equal
    to float32 rounding on a GPU. block_n retiles the state kernel's dots: float32 rounding."""
    lens = [21, 11]
    inp, extras, state, idx, cu = _case(lens, H=8, G=2, N=32, seed=3)
    outs = []
    for hb, bn in ((1, 16), (2, 16), (4, 16), (4, 32)):
        st = state.clone().to(DEV)
        y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                                  cu_seqlens_cpu=cu, chunk_size=16, heads_per_program=hb,
                                  block_n=bn, **_dev(extras))  # fmt: skip
        outs.append((y.cpu(), st.cpu()))
    for y, st in outs[1:3]:
        if DEV == "cpu":  # the interpreter runs each head's dots the same way
            assert torch.equal(y, outs[0][0]) and torch.equal(st, outs[0][1])
        else:  # on a GPU the tile shape picks the MMA shape and so the summation order
            torch.testing.assert_close((y, st), outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[3], outs[0], atol=1e-5, rtol=1e-5)


def test_chunk_plan_table_and_cache():
    cu = torch.tensor([0, 1, 17, 62, 62, 65])
    plan, n = ssd._chunk_plan(cu, 16, torch.device("cpu"))
    assert n == 1 + 1 + 3 + 0 + 1
    n_seq = 5
    assert plan[: n_seq + 1].tolist() == cu.tolist()
    assert plan[n_seq + 1 : 2 * n_seq + 1].tolist() == [0, 1, 2, 5, 5]  # first chunk per seq
    table = plan[2 * n_seq + 1 :].view(-1, 2).tolist()
    assert table == [[0, 1], [1, 17], [17, 33], [33, 49], [49, 62], [62, 65]]
    again, _ = ssd._chunk_plan(cu.clone(), 16, torch.device("cpu"))
    assert again is plan, "same offsets (another tensor): the cached plan"
    other, _ = ssd._chunk_plan(torch.tensor([0, 2, 65]), 16, torch.device("cpu"))
    assert other is not plan and other[:3].tolist() == [0, 2, 65]


def test_errors_say_what_was_expected():
    inp, extras, state, idx, cu = _case([5, 7], dtype=torch.bfloat16)
    st = state.to(DEV)
    with pytest.raises(ValueError, match=r"chunk_size: impl='triton' takes one of .* got 48"):
        _run(inp, extras, st, idx, cu, chunk_size=48)
    with pytest.raises(ValueError, match=r"takes one of \[16, 32, 64, 128, 256\], got 512"):
        _run(inp, extras, st, idx, cu, chunk_size=512)
    for bt in (8, 24, 128):
        with pytest.raises(ValueError, match=rf"block_t: expected a power of two from 16 to "
                           rf"chunk_size=64, got {bt}"):  # fmt: skip
            ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                                  cu_seqlens_cpu=cu, chunk_size=64, block_t=bt)  # fmt: skip
    with pytest.raises(ValueError, match=r"states_dtype: expected float32 or x's dtype bfloat16, "
                       r"got float16"):  # fmt: skip
        ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, states_dtype=torch.float16)  # fmt: skip
    with pytest.raises(ValueError, match=r"B: expected x's dtype bfloat16 .* got float32"):
        _run({**inp, "B": inp["B"].float()}, extras, st, idx, cu)
    with pytest.raises(ValueError, match=r"x: impl='triton' takes float32/.* got float64"):
        _run({**inp, "x": inp["x"].double()}, extras, st, idx, cu)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu: expected non-decreasing offsets "):
        _run(inp, extras, st, idx, torch.tensor([0, 7, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"heads_per_program: expected a divisor of the 4"):
        ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, heads_per_program=3)  # fmt: skip
    with pytest.raises(ValueError, match=r"block_n: expected a power of two >= 16, got 24"):
        ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, block_n=24)  # fmt: skip
    with pytest.raises(ValueError, match=r"impl: expected 'auto', 'fla', 'torch' or 'triton'"):
        K.mamba2_prefill(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                         cu_seqlens=cu.to(DEV), impl="cuda")  # fmt: skip
    other = "cuda" if DEV == "cpu" else "cpu"
    if other == "cpu" or torch.cuda.is_available():
        with pytest.raises(ValueError, match="tensors"):
            K.mamba2_prefill(**{k: v.to(other) for k, v in inp.items()},
                             ssm_state=state.to(other), state_indices=idx.to(other),
                             cu_seqlens=cu.to(other), impl="triton")  # fmt: skip


def test_auto_is_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    calls = []
    real = ssd.mamba2_ssd_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssd, "mamba2_ssd_triton", spy)
    inp, extras, state, idx, cu = _case([5, 7])
    K.mamba2_prefill(**_dev(inp), ssm_state=state.to(DEV), state_indices=idx.to(DEV),
                     cu_seqlens=cu.to(DEV), **_dev(extras))  # fmt: skip
    assert len(calls) == (1 if DEV == "cuda" else 0)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="shared-memory limits exist only compiled")
@pytest.mark.parametrize("dim", [128, 256])
def test_fp32_wide_state_picks_a_scan_tiling_that_fits(dim):
    """float32 inputs at N = P = 128 / 256 (the kit's Mamba2 head dims) can need more shared
    memory than an H200 block has (at a 128-token tile: 263 / 493 KB against 227 KB); the
    wrapper picks a scan tiling that fits before writing anything (fewer stages, then smaller
    token tiles, never a narrower P tile), and the result matches the recurrence."""
    ssd._SCAN_TILING.clear()
    lens = [150, 0, 77]
    inp, extras, state, idx, cu = _case(lens, H=2, N=dim, P=dim, init=True, seed=3)
    st = state.to(DEV)
    before = state.clone()
    y = _run(inp, extras, st, idx, cu)
    (tiling,) = ssd._SCAN_TILING.values()
    assert tiling[0] in (16, 32, 64) and tiling[1] == ssd._P_TILE, tiling
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


def test_scan_tilings_to_try_never_narrow_the_p_tile():
    """Lowering stages and token tiles is how the scan fits shared memory; narrowing its P tile
    is not (32-column tiles are what Triton 3.6 miscompiles on the H200, see
    ssd.mamba2_ssd_triton)."""
    tilings = ssd._scan_candidates(64, ssd._P_TILE, 2)
    assert tilings == [(64, 64, 2), (64, 64, 1), (32, 64, 1), (16, 64, 1)]
    assert ssd._scan_candidates(ssd._T_TILE, 64, 1) == [(64, 64, 1), (32, 64, 1), (16, 64, 1)]
    assert ssd._scan_candidates(16, 64, 1) == [(16, 64, 1)]


@pytest.mark.parametrize("block_p", [0, 8, 48])
def test_block_p_must_be_a_power_of_two_from_16(block_p):
    inp, extras, state, idx, cu = _case([5])
    with pytest.raises(ValueError, match=f"block_p: expected a power of two >= 16, got {block_p}"):
        ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=state.to(DEV), state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, **_dev(extras), block_p=block_p)  # fmt: skip


# Chunks of 128 and 256 tokens run as 2 and 4 row / column blocks of 64 (block_t's default);
# the lengths straddle chunks and 64-token sub-blocks, end on and off them, and include
# sequences shorter than one chunk (whose later row blocks are empty) and than one sub-block.
def _chunk_lens(chunk: int) -> list[int]:
    return [chunk + 70, 1, chunk // 2 + 3]


@pytest.mark.parametrize("chunk", ssd.CHUNK_SIZES)
def test_every_chunk_size_matches_recurrence(chunk):
    """float32 inputs (tf32x3 dots, exact under the interpreter) at each chunk size with
    D / dt_bias / z: outputs and final states against the explicit recurrence, initial states
    read from non-sorted slots, the other slots untouched. The decay is slow (about e^-2 over
    256 tokens), so an entering state that is wrong, stale or decayed from the wrong block
    shows in every later output."""
    lens = _chunk_lens(chunk)
    inp, extras, state, idx, cu = _case(lens, H=4, G=2, N=16, P=16, seed=chunk, dt_shift=5.0)
    before = state.clone()
    st = state.to(DEV)
    y = _run(inp, extras, st, idx, cu, chunk_size=chunk)
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


@pytest.mark.parametrize("chunk", [256])
def test_large_chunks_match_torch_chunked_ssd(chunk):
    """Against the torch chunked SSD at the same chunk (its blocks are whole chunks, ours 64
    tokens), no extras, raw dt (no softplus), N and P not powers of two (masked tiles)."""
    lens = [chunk + 64 + 5, 40, 2 * chunk - 1]
    inp, _, state, idx, cu = _case(lens, H=4, G=1, N=20, P=24, seed=11)
    inp["dt"] = inp["dt"].abs() * 0.01
    st_torch = state.clone()
    y_torch = K.mamba2_prefill(**inp, ssm_state=st_torch, state_indices=idx, cu_seqlens=cu,
                               dt_softplus=False, chunk_size=chunk, impl="torch")  # fmt: skip
    st = state.to(DEV)
    y = _run(inp, {}, st, idx, cu, chunk_size=chunk, dt_softplus=False)
    torch.testing.assert_close(y.cpu(), y_torch, **FP32_TOL)
    torch.testing.assert_close(st.cpu(), st_torch, **FP32_TOL)


@pytest.mark.parametrize(("chunk", "block_t"), [(64, 16), (256, 32)], ids=lambda v: str(v))
def test_token_tiles_do_not_change_results(chunk, block_t):
    """``block_t`` only regroups a chunk's causal sum into blocks (and the state kernel's steps
    into sub-blocks): float32 inputs give the same outputs, states and final states as one
    block per chunk (``block_t = chunk`` where the register tile is small enough: 64) or
    the recurrence, to float32 rounding."""
    lens = [chunk + 19, 1, chunk // 2 + 33]
    inp, extras, state, idx, cu = _case(lens, H=2, G=1, N=16, P=16, seed=5, dt_shift=4.0)
    outs = []
    for bt in (block_t, min(chunk, 64)):
        st = state.clone().to(DEV)
        y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                                  cu_seqlens_cpu=cu, chunk_size=chunk, block_t=bt,
                                  **_dev(extras))  # fmt: skip
        outs.append((y.cpu(), st.cpu()))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    before = state.clone()
    _check_against_recurrence(*outs[0], before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


@pytest.mark.parametrize(
    ("chunk", "precise", "states_dtype"),
    [
        (64, False, torch.bfloat16),
        (256, True, torch.float32),
        (256, True, torch.bfloat16),
        (256, False, torch.float32),
    ],
    ids=["64-plain-bf16", "256-precise-f32", "256-precise-bf16", "256-plain-f32"],
)
def test_bf16_precise_and_states_dtype(chunk, precise, states_dtype):
    """bf16 x/B/C at chunk 64 and 256. With the hi/lo split and float32 entering states the
    final state stays within float32 rounding of the recurrence on the same bf16 values and
    the outputs within one bf16 step. Without the split (``dt``-weighted operands rounded to
    bf16, ~2^-9 per term) or with bf16 entering states (one rounding of the state in each
    output's inter-chunk term) the outputs are looser, and the final state is exact again
    only with the split (it never reads the stored states)."""
    lens = [chunk + 70, 3]
    inp, extras, state, idx, cu = _case(lens, H=4, G=2, N=16, P=16, dtype=torch.bfloat16,
                                        seed=9, dt_shift=4.0)  # fmt: skip
    before = state.clone()
    st = state.to(DEV)
    y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, chunk_size=chunk, precise=precise,
                              states_dtype=states_dtype, **_dev(extras))  # fmt: skip
    assert y.dtype == torch.bfloat16
    exact = precise and states_dtype == torch.float32
    # Inexact paths: a few 2^-9 (the interpreter truncates: 2^-8) roundings of O(1) terms,
    # summed over N = 16; a wrong state or decay is off by O(1).
    out_tol = BF16_OUT_TOL if exact else dict(atol=6e-2, rtol=2e-2)
    state_tol = FP32_TOL if precise else dict(atol=6e-2, rtol=2e-2)
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=out_tol,
                              state_tol=state_tol)  # fmt: skip


@pytest.mark.parametrize(("chunk", "block_t"), [(256, 64)], ids=lambda v: str(v))
def test_precomputed_cb_blocks_match_per_head_dots(chunk, block_t):
    """With several token tiles per chunk the scan computes ``C B^T`` blocks per head and block
    (the default) or reads them from the cb pass (``precompute_cb=True``): the same dot
    on the same operands, so bit-identical under the interpreter and equal to float32 rounding
    compiled (another kernel may pick another MMA shape). Two groups: the blocks of one group
    must not be read by the other's heads."""
    lens = [chunk + 40, 2]
    inp, extras, state, idx, cu = _case(lens, H=2, G=2, N=16, P=16, dtype=torch.bfloat16,
                                        seed=13, dt_shift=4.0)  # fmt: skip
    outs = _with_and_without("precompute_cb", inp, extras, state, idx, cu, chunk_size=chunk,
                             block_t=block_t)  # fmt: skip
    if DEV == "cpu":
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    else:
        torch.testing.assert_close(outs[0], outs[1], **BF16_OUT_TOL)


@pytest.mark.parametrize(
    ("lens", "chunk", "block_t", "bias"),
    [
        ([37, 0, 16, 5], 16, 16, True),  # a tile per chunk; an empty sequence; short tails
        ([150, 3, 64], 64, 16, True),  # four tiles a chunk; the last chunk's tiles partial
        ([150, 3, 64], 64, 16, False),  # no dt_bias (and softplus still on)
    ],
    ids=["tile_per_chunk", "four_tiles", "no_bias"],
)
def test_precomputed_decays_match_the_recurrence(lens, chunk, block_t, bias):
    """``precompute_decay=True``: the decay pass's ``dt`` and cumulative log decays, read by
    both kernels (the tile's last value by one load: on a short last tile it must be the last
    real token's), give the recurrence's outputs and states, and agree with the path that
    computes them in each kernel to float32 rounding (the cumulative sum over a tile of heads
    may add in another order)."""
    inp, extras, state, idx, cu = _case(lens, H=4, G=2, N=16, P=16, seed=21, dt_shift=3.0)
    if not bias:
        extras.pop("dt_bias")
    before = state.clone()
    (y, st), other = _with_and_without("precompute_decay", inp, extras, state, idx, cu,
                                       chunk_size=chunk, block_t=block_t)  # fmt: skip
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip
    torch.testing.assert_close((y, st), other, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cb", [False, True], ids=["scan_dots", "cb_pass"])
def test_a_smaller_tile_from_the_fit_reaches_every_kernel(monkeypatch, cb):
    """Where the scan's tiling does not fit the device's shared memory, ``_fit_scan`` falls back
    to a smaller token tile (compiled only): the decay pass, the cb pass and the state kernel
    must then run on that tile too, or their per-tile decays no longer line up with the
    scan's. Here the fit is patched to halve the requested tile."""
    monkeypatch.setattr(ssd, "_SCAN_TILING", {})
    monkeypatch.setattr(ssd, "_fit_scan", lambda scan, chunk, bt, bp, stages, *a: (bt // 2, bp, 1))
    inp, extras, state, idx, cu = _case([150, 3, 64], H=4, G=2, N=16, P=16, seed=29,
                                        dt_shift=3.0)  # fmt: skip
    before = state.clone()
    st = state.to(DEV)
    y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, chunk_size=64, block_t=32, precompute_cb=cb,
                              **_dev(extras))  # fmt: skip
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_fused_fp32_matches_recurrence(case):
    """``fused=True``: one kernel walks each sequence's tiles with the state in registers, so
    the tile's outputs must see the state of every tile before it (several tiles a sequence),
    none of another sequence's (varlen, G = 2 and 4, an empty sequence whose slot must come
    back bit for bit), and leave the final state in the slot."""
    lens, G, chunk = CASES[case]
    inp, extras, state, idx, cu = _case(lens, G=G, seed=len(case) + 40)
    before = state.clone()
    st = state.to(DEV)
    y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, chunk_size=chunk, fused=True,
                              **_dev(extras))  # fmt: skip
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=FP32_TOL,
                              state_tol=FP32_TOL)  # fmt: skip


@pytest.mark.parametrize(
    ("precise", "pre"), [(True, False), (False, False), (True, True)],
    ids=["precise", "plain", "precise-decay_pass"],
)  # fmt: skip
def test_fused_bf16_matches_recurrence(precise, pre):
    """bf16 inputs: with the hi/lo split the fused kernel keeps the float32 state exact (its
    entering-state dot splits the state as the two-kernel scan does); without it the operands
    are rounded to bf16, ~2^-9 a term. With the decay pass (``pre``) the tile totals come
    from one load each, the last tile of a sequence short."""
    lens = [150, 3, 64]
    inp, extras, state, idx, cu = _case(lens, H=4, G=2, N=16, P=16, dtype=torch.bfloat16,
                                        seed=23, dt_shift=4.0)  # fmt: skip
    before = state.clone()
    st = state.to(DEV)
    y = ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, chunk_size=64, block_t=32, fused=True,
                              precise=precise, precompute_decay=pre,
                              **_dev(extras))  # fmt: skip
    out_tol = BF16_OUT_TOL if precise else dict(atol=6e-2, rtol=2e-2)
    state_tol = FP32_TOL if precise else dict(atol=6e-2, rtol=2e-2)
    _check_against_recurrence(y, st, before, inp, extras, idx, cu, out_tol=out_tol,
                              state_tol=state_tol)  # fmt: skip


def test_fused_refuses_a_state_too_large_for_its_registers():
    inp, extras, state, idx, cu = _case([8], H=2, N=256, P=16)
    st = state.to(DEV)
    with pytest.raises(ValueError, match=r"fused: expected a state size N <= 128.*N=256"):
        ssd.mamba2_ssd_triton(**_dev(inp), ssm_state=st, state_indices=idx.to(DEV),
                              cu_seqlens_cpu=cu, fused=True, **_dev(extras))  # fmt: skip
    assert torch.equal(st.cpu(), state), "a refused call wrote the pool"


@pytest.mark.parametrize("chunk", [64, 256])
def test_split_states_are_the_scans_own_split(chunk):
    """``split_states=True`` stores each float32 entering state as the bf16 hi + lo halves the
    scan would split it into: the same values through the same dots, so bit-identical under
    the interpreter (float32 rounding compiled, where the operands' path differs). And
    ``precise=False`` stores x's dtype whatever ``states_dtype`` says (the scan rounds the
    states to it anyway): the same as asking for bf16 states."""
    lens = [chunk + 21, 2]
    inp, extras, state, idx, cu = _case(lens, H=2, G=1, N=16, P=16, dtype=torch.bfloat16,
                                        seed=17, dt_shift=4.0)  # fmt: skip

    def run(**kw):
        st = state.clone().to(DEV)
        y = ssd.mamba2_ssd_triton(
            **_dev(inp),
            ssm_state=st,
            state_indices=idx.to(DEV),
            cu_seqlens_cpu=cu,
            chunk_size=chunk,
            **kw,
            **_dev(extras),
        )
        return y.cpu(), st.cpu()  # fmt: skip

    pairs = [
        (run(split_states=True), run(split_states=False)),
        (run(precise=False), run(precise=False, states_dtype=torch.bfloat16)),
    ]
    for a, b in pairs:
        if DEV == "cpu":
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        else:
            torch.testing.assert_close(a, b, **BF16_OUT_TOL)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_mamba2_prefill_writes_into_a_given_out(impl):
    """``out`` (the layer's buffer, here a strided view of a wider one) is what comes back,
    holding what the call without it returns; the Triton SSD stores into it directly. A
    misshapen ``out`` is refused before any slot is written."""
    inp, extras, state, idx, cu = _case([5, 7])
    kw = dict(state_indices=idx.to(DEV), cu_seqlens=cu.to(DEV), cu_seqlens_cpu=cu, impl=impl,
              chunk_size=16, **_dev(extras))  # fmt: skip
    want_state = state.clone().to(DEV)
    want = K.mamba2_prefill(**_dev(inp), ssm_state=want_state, **kw)
    T, H, P = want.shape
    wide = torch.full((T, H, 2 * P), float("nan"), dtype=want.dtype, device=DEV)
    out = wide[..., :P]
    if impl == "triton":  # stored by the scan kernel, not copied in

        def no_copy(*_: object, **__: object) -> None:
            raise AssertionError("out was filled by a copy, not by the SSD's scan kernel")

        out.copy_ = no_copy  # type: ignore[method-assign]
    got_state = state.clone().to(DEV)
    got = K.mamba2_prefill(**_dev(inp), ssm_state=got_state, out=out, **kw)
    assert got is out
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert wide[..., P:].isnan().all()  # nothing written outside out
    every_other = torch.zeros(T, H, 2 * P, dtype=want.dtype, device=DEV)[..., ::2]
    got = K.mamba2_prefill(**_dev(inp), ssm_state=state.clone().to(DEV), out=every_other, **kw)
    assert got is every_other and torch.equal(got, want)  # not packed: copied in
    untouched = state.clone().to(DEV)
    with pytest.raises(ValueError, match=r"out: expected shape \[12, 4, 32\]"):
        K.mamba2_prefill(**_dev(inp), ssm_state=untouched, out=wide[:, :, : P + 1], **kw)
    assert torch.equal(untouched, state.to(DEV))
