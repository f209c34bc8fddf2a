"""Mamba1 kernels at real shapes (Falcon-Mamba-7B and Jamba: d_inner 8192, d_state 16),
compiled, against attn-core's reference selective scan on the same GPU.

Skipped without CUDA, and skipped when this process built the kernels for the interpreter (run
``pytest -m gpu`` on a CUDA machine: the CPU test modules then leave TRITON_INTERPRET unset).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attn_core.reference.ops import mamba1_selective_scan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

D, N = 8192, 16


@pytest.fixture(scope="module")
def K():
    from attn_plugin_triton_ssm import kernels

    if kernels.INTERPRETED:
        pytest.skip("kernels were built for the Triton interpreter in this process")
    return kernels


def _case(T: int, S: int, seed: int, dtype=torch.bfloat16, state_dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale

    a_log = (torch.arange(1, N + 1, device="cuda").float().log().expand(D, -1)
             + r(D, N, scale=0.3)).contiguous()  # fmt: skip
    tok = {"x": r(T, D).to(dtype), "dt": r(T, D, scale=0.5).to(dtype), "B": r(T, N).to(dtype),
           "C": r(T, N).to(dtype)}  # fmt: skip
    params = {"A_log": a_log, "D": r(D), "dt_bias": r(D, scale=0.5) - 2.0}
    state = (r(S, D, N, 1, scale=0.1)).to(state_dtype)
    return tok, params, state


def _reference(tok, params, pool, lens, slots, initial, **kw):
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    return mamba1_selective_scan(
        tok["x"][..., None], tok["dt"], params["A_log"], tok["B"][:, None], tok["C"][:, None],
        params["D"], params["dt_bias"], pool, qsl,
        torch.tensor(slots, dtype=torch.int32, device="cuda"),
        torch.tensor(initial, device="cuda"), **kw,
    )[..., 0]  # fmt: skip


# the tilings decode can take: the default, unrolled requests, and the pipelined request loop
# (60 requests: the last program of 8 gets 4)
DECODE_TILINGS = {
    "default": {},
    "rpp4": {"requests_per_program": 4},
    "pipelined": {"requests_per_program": 8, "pipeline": 3, "block_d": 32, "num_warps": 1},
    "loads-first": {"requests_per_program": 2, "loads_first": True},
}


@pytest.mark.parametrize("tuning", DECODE_TILINGS.values(), ids=DECODE_TILINGS.keys())
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_real_shape(K, state_dtype, tuning):
    Bn, S = 60, 100
    tok, params, state = _case(Bn, S, 0, state_dtype=state_dtype)
    slots = torch.randperm(S, device="cuda")[:Bn].int()
    slots[3::7] = -1
    ref_pool = state.float().clone()
    want = _reference(tok, params, ref_pool, [1] * Bn, slots.tolist(), [True] * Bn,
                      mode="recurrent")  # fmt: skip
    before = state.clone()
    out = K.mamba1_decode(tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"], state, slots,
                          D=params["D"], dt_bias=params["dt_bias"], **tuning)  # fmt: skip
    valid = slots >= 0
    torch.testing.assert_close(out[valid].float(), want[valid].float(), atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[~valid]) == 0
    live = slots[valid].long()
    tol = dict(atol=1e-4, rtol=1e-4) if state_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state[live].float(), ref_pool[live], **tol)
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[live] = False
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("lanes", [False, True], ids=["tiles", "lanes"])
def test_varlen_prefill_real_shape(K, lanes):
    lens, slots, initial = [300, 1, 77, 512], [7, 2, 0, 9], [True, False, True, False]
    tok, params, state = _case(sum(lens), 10, 1)
    ref_pool = state.clone()
    want = _reference(tok, params, ref_pool, lens, slots, initial, mode="chunked")
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    out = K.mamba1_scan(
        tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"], state,
        torch.tensor(slots, dtype=torch.int32, device="cuda"), cu_seqlens=cu,
        has_initial_state=torch.tensor(initial, device="cuda"), D=params["D"],
        dt_bias=params["dt_bias"], lanes=lanes,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state[slots], ref_pool[slots], atol=1e-3, rtol=1e-3)


# time_chunk 1000: longer than every request but one; the tile kernel's chunked form, the lanes
# kernel as the walk (two channels a thread, the default, and one) and as both scans of the
# chunked form
@pytest.mark.parametrize(
    "variant",
    [{"lanes": False, "time_chunk": 64}, {"lanes": False, "time_chunk": 256},
     {"lanes": False, "time_chunk": 1000},
     {"lanes": True, "time_chunk": 0}, {"lanes": True, "time_chunk": 0, "block_d": 128},
     {"lanes": True, "time_chunk": 64}, {"lanes": True, "time_chunk": 256}],
    ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()),
)  # fmt: skip
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_parallel_prefill_real_shape(K, variant, state_dtype):
    """The time-chunked scan and the lanes kernel compiled against the sequential tile kernel:
    unequal lengths not multiples of the chunk or block, fresh and continued requests, a
    padding request, z."""
    lens, slots = [300, 1, 77, 0, 1500, 33], [7, 2, 0, 4, -1, 9]
    initial = [True, False, True, True, True, False]
    tok, params, state = _case(sum(lens), 10, 5, state_dtype=state_dtype)
    z = torch.randn_like(tok["x"])
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    args = (tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"])
    kw = dict(cu_seqlens=cu, has_initial_state=torch.tensor(initial, device="cuda"),
              D=params["D"], dt_bias=params["dt_bias"], z=z)  # fmt: skip
    seq_state, par_state = state.clone(), state.clone()
    want = K.mamba1_scan(*args, seq_state, idx, time_chunk=0, lanes=False, **kw)
    got = K.mamba1_scan(*args, par_state, idx, **variant, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    pad = slice(sum(lens[:4]), sum(lens[:5]))
    assert torch.count_nonzero(got[pad]) == 0
    tol = dict(atol=1e-3, rtol=1e-3) if state_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(par_state.float(), seq_state.float(), **tol)


def test_default_chunks_two_long_requests_and_matches_the_walk(K, monkeypatch):
    """``time_chunk=None`` on two long requests (1024 programs of the walk: a few per SM) takes
    the chunked path, with the walk's outputs and states."""
    from attn_plugin_triton_ssm.kernels import mamba1

    lens, slots = [5000, 700], [3, 1]
    T = sum(lens)
    assert mamba1.auto_time_chunk(T, 2, D, torch.device("cuda")) == mamba1.AUTO_TIME_CHUNK
    tok, params, state = _case(T, 4, 11)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    args = (tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"])
    kw = dict(cu_seqlens=cu, D=params["D"], dt_bias=params["dt_bias"])
    walk_state, auto_state = state.clone(), state.clone()
    want = K.mamba1_scan(*args, walk_state, idx, time_chunk=0, **kw)
    chunks: list = []
    real = mamba1._launch_chunked
    monkeypatch.setattr(
        mamba1, "_launch_chunked", lambda *a, **k: chunks.append(k["L"]) or real(*a, **k)
    )
    got = K.mamba1_scan(*args, auto_state, idx, **kw)
    assert chunks == [mamba1.AUTO_TIME_CHUNK]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(auto_state, walk_state, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_native_and_replay_commit_identical_real_shape(K, state_dtype):
    Bn, K1, S = 16, 4, 40
    tok, params, state = _case(Bn * K1, S, 2, state_dtype=state_dtype)
    idx = torch.randperm(S, device="cuda")[:Bn].int()
    idx[5] = -1
    cu = torch.arange(0, Bn * K1 + 1, K1, dtype=torch.int32, device="cuda")
    inter = torch.empty(Bn, K1, D, N, 1, dtype=state_dtype, device="cuda")
    args = (tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"])
    common = dict(D=params["D"], dt_bias=params["dt_bias"])
    before = state.clone()
    K.mamba1_scan(*args, state, idx, cu_seqlens=cu, intermediate_states=inter,
                  update_state=False, **common)  # fmt: skip
    assert torch.equal(state, before)
    acc = torch.randint(0, K1 + 1, (Bn,), dtype=torch.int32, device="cuda")
    native, replay = before.clone(), before.clone()
    K.mamba1_commit(inter, acc, native, idx)
    K.mamba1_replay_commit(*args, acc, replay, idx, **common)
    assert torch.equal(native, replay)


def test_decode_cuda_graph_replay_equals_eager(K):
    Bn, S = 32, 64
    tok, params, state = _case(Bn, S, 3)
    idx = torch.randperm(S, device="cuda")[:Bn].int()
    out = torch.empty_like(tok["x"])

    def body():
        K.mamba1_decode(tok["x"], tok["dt"], params["A_log"], tok["B"], tok["C"], state, idx,
                        D=params["D"], dt_bias=params["dt_bias"], out=out)  # fmt: skip

    snapshot = state.clone()
    body()  # compile before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    new_tok, _, _ = _case(Bn, S, 4)
    for k, t in new_tok.items():
        tok[k].copy_(t)
    idx.copy_(torch.randperm(S, device="cuda")[:Bn].int())
    state.copy_(snapshot)
    graph.replay()
    torch.cuda.synchronize()
    got, got_state = out.clone(), state.clone()
    state.copy_(snapshot)
    body()
    assert torch.equal(got, out) and torch.equal(got_state, state)
