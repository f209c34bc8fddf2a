"""GPU tests at real shapes (Qwen3-Next GDN: Hk=16, Hv=32, Dk=Dv=128), compiled kernels.

Skipped without CUDA, and skipped when this process built the kernels for the interpreter (run
``pytest -m gpu`` on a CUDA machine: the CPU test modules then leave TRITON_INTERPRET unset).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HK, HV, D = 16, 32, 128


@pytest.fixture(scope="module")
def K():
    from attn_plugin_triton_ssm import kernels

    if kernels.INTERPRETED:
        pytest.skip("kernels were built for the Triton interpreter in this process")
    return kernels


def _inputs(Bn, S, T=1, state_dtype=torch.float32, seed=0, kda=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q, k = r(Bn, T, HK, D).bfloat16(), r(Bn, T, HK, D).bfloat16()
    v = r(Bn, T, HV, D).bfloat16()
    gshape = (Bn, T, HV, D) if kda else (Bn, T, HV)
    gg = -torch.rand(*gshape, generator=g, device="cuda") * 0.5
    beta = torch.rand(Bn, T, HV, generator=g, device="cuda")
    state = (torch.randn(S, HV, D, D, generator=g, device="cuda") * 0.1).to(state_dtype)
    # distinct slots (a shared slot would race), every 7th row padding
    idx = torch.randperm(S, generator=g, device="cuda")[:Bn].int()
    idx[3::7] = -1
    return q, k, v, gg, beta, state, idx


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_decode_real_shape_matches_fla_naive(K, kda):
    from triton_ssm_refs import delta_rule_ref

    q, k, v, g, beta, state, idx = _inputs(64, 100, kda=kda)
    before = state.clone()
    fn = K.kda_decode if kda else K.gdn_decode
    out = fn(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, idx)
    o_ref, h_ref = delta_rule_ref(q, k, v, g, beta, before[idx.clamp(min=0).long()], kda=kda)
    valid = idx >= 0
    torch.testing.assert_close(out[valid].float(), o_ref[valid, 0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state[idx[valid].long()], h_ref[valid, 0], atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[~valid]) == 0
    untouched = torch.ones(state.shape[0], dtype=torch.bool, device="cuda")
    untouched[idx[valid].long()] = False
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize(("Bn", "S"), [(512, 1100), (2048, 2100)])
def test_decode_large_pool_int64_offsets(K, Bn, S):
    # 1100 fp32 slots of 32*128*128 = 2.3 GB: slot * stride passes 2**31 elements' bytes; 2048
    # requests over 4.4 GB is the largest batch the bench runs.
    q, k, v, g, beta, _, _ = _inputs(Bn, S)
    state = torch.zeros(S, HV, D, D, device="cuda")
    state[S - 1] = 0.01
    state[S - Bn] = -0.02
    idx = torch.arange(S - Bn, S, device="cuda", dtype=torch.int32).flip(0)
    ref_state = state[idx.long()].clone()
    out = K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, idx)
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from triton_ssm_refs import l2

    o_ref, h_ref = naive_recurrent_gated_delta_rule(
        l2(q).repeat_interleave(2, 2), l2(k).repeat_interleave(2, 2), v.float(), beta, g,
        initial_state=ref_state, output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), o_ref[:, 0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state[idx.long()], h_ref, atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(state[: S - Bn]) == 0, "slots outside the batch were written"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_native_and_replay_commit_identical_real_shape(K, state_dtype):
    T = 4
    q, k, v, g, beta, state, idx = _inputs(32, 64, T=T, state_dtype=state_dtype)
    inter = torch.empty(32, T, HV, D, D, dtype=state_dtype, device="cuda")
    o1 = K.gdn_verify_native(q, k, v, g, beta, state, idx, inter)
    o2 = K.gdn_verify_replay(q, k, v, g, beta, state, idx)
    assert torch.equal(o1, o2)
    num = torch.randint(1, T + 1, (32,), device="cuda", dtype=torch.int32)
    s1, s2 = state.clone(), state.clone()
    K.gdn_commit(inter, num, s1, idx)
    K.gdn_replay_commit(q, k, v, g, beta, num, s2, idx)
    assert torch.equal(s1, s2)


def test_gdn_prefill_matches_fla_naive_varlen(K):
    """Against fla's naive recurrence in float64. fla's chunked kernel runs on the bf16 q/k/v
    given, with bf16/tf32 tensor-core dots, and the output is bf16: after 700 tokens single
    state entries differ from the exact recurrence by ~5e-3 (H200: mean error 3e-3 and 4e-3 of
    the mean magnitude for state and output). A wrong head grouping, scale, l2norm or
    cu_seqlens/slot mapping puts the relative error at tens of percent.
    """
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from triton_ssm_refs import l2

    T = 1065
    q, k, v, g, beta, state, _ = _inputs(1, 10, T=T)
    idx = torch.tensor([7, 2, 9, 0], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 700, 764, 765, 1065], dtype=torch.int32, device="cuda")
    before = state.clone()
    y = K.gdn_prefill(q[0], k[0], v[0], g[0], beta[0], state, idx, cu)
    assert y.dtype == v.dtype
    untouched = [s for s in range(10) if s not in idx.tolist()]
    assert torch.equal(state[untouched], before[untouched])
    d = torch.float64
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(s, e)
        o_ref, h_ref = naive_recurrent_gated_delta_rule(
            l2(q[:, sl]).repeat_interleave(2, 2).to(d), l2(k[:, sl]).repeat_interleave(2, 2).to(d),
            v[:, sl].to(d), beta[:, sl].to(d), g[:, sl].to(d),
            initial_state=before[idx[i]][None].to(d), output_final_state=True,
        )  # fmt: skip
        # fla's naive casts its inputs to float32 inside: compare in float64 all the same.
        o, h, o_ref, h_ref = y[sl].double(), state[idx[i]].double(), o_ref.double(), h_ref.double()
        o_rel = ((o - o_ref[0]).abs().mean() / o_ref.abs().mean()).item()
        h_rel = ((h - h_ref[0]).abs().mean() / h_ref.abs().mean()).item()
        h_max = (h - h_ref[0]).abs().max().item()
        stats = f"sequence {i} ({e - s} tokens): out rel {o_rel:.2e}, state rel {h_rel:.2e}, " \
                f"state max {h_max:.2e}"  # fmt: skip
        print(stats)
        assert o_rel < 1e-2 and h_rel < 1e-2 and h_max < 2e-2, stats
        torch.testing.assert_close(
            o, o_ref[0], atol=5e-2, rtol=5e-2, msg=lambda m, s=stats: f"{s}\n{m}"
        )


def test_mamba2_decode_real_shape(K):
    from triton_ssm_refs import mamba2_ref

    Bn, H, G, N, P, S = 64, 128, 8, 128, 64, 80
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, dt, A_log = r(Bn, 1, H, P), r(Bn, 1, H), r(H) * 0.5
    Bm, Cm, Dp, dt_bias = r(Bn, 1, G, N), r(Bn, 1, G, N), r(H), r(H)
    state = r(S, H, N, P) * 0.1
    idx = torch.randperm(S, generator=g, device="cuda")[:Bn].int()
    idx[5] = -1
    before = state.clone()
    out = K.mamba2_decode(x[:, 0], dt[:, 0], A_log, Bm[:, 0], Cm[:, 0], state, idx, D=Dp,
                          dt_bias=dt_bias)  # fmt: skip
    y_ref, h_ref = mamba2_ref(x, dt, A_log, Bm, Cm, before[idx.clamp(min=0).long()], D=Dp,
                              dt_bias=dt_bias)  # fmt: skip
    ok = idx >= 0
    torch.testing.assert_close(out[ok], y_ref[ok, 0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(state[idx[ok].long()], h_ref[ok], atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[~ok]) == 0


@pytest.mark.parametrize("impl", ["fla", "torch", "triton"])
def test_mamba2_prefill_varlen_matches_recurrence(K, impl):
    """The prefill paths (fla ``chunk_simple_gla``, the chunked SSD in torch and ours in Triton)
    against the explicit float32 recurrence, four packed sequences (one of a single token),
    shared B/C groups, bf16 inputs. The fla path runs its dots on the bf16 inputs (``dt * x``
    rounded to bf16): mean relative error well under 1e-2; a wrong decay, group expansion or slot
    mapping gives tens of percent."""
    from triton_ssm_refs import MAMBA2_VARLEN, mamba2_varlen_case, mamba2_varlen_errors

    inputs, state, idx, offsets = mamba2_varlen_case()
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    before = state.clone()
    x = inputs["x"]
    y = K.mamba2_prefill(**inputs, ssm_state=state, state_indices=idx, cu_seqlens=cu, impl=impl)
    assert y.dtype == x.dtype and y.shape == x.shape
    untouched = [s for s in range(MAMBA2_VARLEN["S"]) if s not in idx.tolist()]
    assert torch.equal(state[untouched], before[untouched])
    errors = mamba2_varlen_errors(y, state, before, inputs, idx, offsets)
    for i, (o_rel, h_rel) in enumerate(errors):
        assert o_rel < 1e-2 and h_rel < 1e-2, f"{impl} sequence {i}: out {o_rel:.2e} h {h_rel:.2e}"


_BF16_STATES = {"states_dtype": torch.bfloat16}


def _param_id(v) -> str:
    if isinstance(v, dict):
        return "-".join(f"{k}={w}" for k, w in v.items()).replace("torch.", "") or "default"
    return str(v).removeprefix("torch.")


@pytest.mark.parametrize(
    ("dtype", "chunk", "opts"),
    [
        (torch.bfloat16, 32, {}),
        (torch.bfloat16, 64, {}),
        (torch.bfloat16, 128, {}),
        (torch.bfloat16, 256, {}),
        (torch.float32, 64, {}),
        (torch.float32, 128, {}),
        (torch.float32, 256, {}),
        # the variants bench_ssm.py --mamba2-sweep times, compiled at the shape it times them
        (torch.bfloat16, 128, {"precompute_cb": True}),
        (torch.bfloat16, 256, {"precompute_cb": True, "num_warps": (4, 8)}),
        (torch.bfloat16, 256, {"num_warps": (4, 8)}),
        (torch.bfloat16, 256, {"block_t": 32}),
        (torch.bfloat16, 256, {"heads_per_program": 2, "num_stages": (3, 2)}),
        (torch.bfloat16, 64, _BF16_STATES),
        (torch.bfloat16, 256, _BF16_STATES),
        (torch.bfloat16, 64, {"precompute_decay": False}),
        (torch.bfloat16, 256, {"precompute_decay": False}),
        (torch.float32, 128, {"precompute_decay": False}),
        (torch.bfloat16, 64, {"fused": True}),
        (torch.bfloat16, 64, {"fused": True, "block_t": 32}),
        (torch.bfloat16, 64, {"fused": True, "num_warps": (4, 4)}),
        (torch.bfloat16, 64, {"fused": True, "precompute_decay": True}),
        (torch.float32, 64, {"fused": True}),
    ],
    ids=lambda v: _param_id(v),
)
def test_mamba2_prefill_triton_matches_torch_granite_shape(K, dtype, chunk, opts):
    """``impl="triton"`` (our chunked SSD) against ``impl="torch"`` (the float32 chunked SSD in
    torch) at the granite-4.0-h-small-like shape (H=128, P=64, N=128, one B/C group), T=4096 in
    4 packed sequences: one ends on a chunk boundary, one is a single token. Both run on the same
    inputs in float32 arithmetic (ours splits the float32 dot operands in bf16 hi + lo halves,
    or uses tf32x3 dots for float32 inputs): the states agree to ~1e-5, the bf16 outputs to a
    rounding step. A wrong decay, group mapping or chunk boundary gives tens of percent. Chunks
    above 64 run on 64-token tiles (``opts`` pick others, the cb pass, warps); bf16 entering
    states add one bf16 rounding of the state to each output's inter-chunk term (looser output
    bounds; the final states never read them)."""
    lens, H, G, N, P, S = [2048, 1023, 1, 1024], 128, 1, 128, 64, 10
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, dt, Bm, Cm = r(T, H, P).to(dtype), r(T, H) - 2.0, r(T, G, N).to(dtype), r(T, G, N).to(dtype)
    A_log = torch.rand(H, generator=g, device="cuda").mul(15).add(1).log()  # A in -[1, 16]
    Dp, dt_bias = r(H), r(H) * 0.5
    state = r(S, H, N, P) * 0.1
    idx = torch.tensor([7, 2, 9, 0], dtype=torch.int32, device="cuda")
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_cpu.to("cuda")
    st_torch, st_triton = state.clone(), state.clone()
    common = dict(D=Dp, dt_bias=dt_bias, cu_seqlens_cpu=cu_cpu)
    y_torch = K.mamba2_prefill(x, dt, A_log, Bm, Cm, st_torch, idx, cu, impl="torch", **common)
    if opts:
        y = K.mamba2_ssd_triton(x, dt, A_log, Bm, Cm, st_triton, idx, chunk_size=chunk,
                                **common, **opts)  # fmt: skip
    else:
        y = K.mamba2_prefill(x, dt, A_log, Bm, Cm, st_triton, idx, cu, impl="triton",
                             chunk_size=chunk, **common)  # fmt: skip
    o_bound, o_atol = (1e-2, 4e-3) if "states_dtype" in opts else (5e-3, 1e-3)
    assert y.dtype == dtype and y.shape == x.shape
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(st_triton[untouched], state[untouched])
    for i, (s, e) in enumerate(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist(), strict=True)):
        o, o_ref = y[s:e].float(), y_torch[s:e].float()
        h, h_ref = st_triton[idx[i]], st_torch[idx[i]]
        o_rel = ((o - o_ref).abs().mean() / o_ref.abs().mean()).item()
        h_rel = ((h - h_ref).abs().mean() / h_ref.abs().mean()).item()
        stats = f"sequence {i} ({e - s} tokens): out rel {o_rel:.2e}, state rel {h_rel:.2e}"
        print(stats)
        assert o_rel < o_bound and h_rel < 1e-4, stats
        torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=o_atol * o_ref.abs().max().item(),
                                   msg=lambda m, s_=stats: f"{s_}\n{m}")  # fmt: skip
        torch.testing.assert_close(h, h_ref, rtol=1e-3, atol=1e-4 * h_ref.abs().max().item(),
                                   msg=lambda m, s_=stats: f"{s_}\n{m}")  # fmt: skip


def test_conv1d_update_real_shape(K):
    from triton_ssm_refs import conv_ref

    Bn, C, KW, S = 64, 8192, 4, 80
    x = torch.randn(Bn, C, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(S, C, KW - 1, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(C, KW, device="cuda"), torch.randn(C, device="cuda")
    idx = torch.randperm(S, device="cuda")[:Bn].int()
    before = state.clone()
    out = K.causal_conv1d_update(x, state, w.bfloat16(), b.bfloat16(), idx)
    for bi in (0, 17, 63):
        s = int(idx[bi])
        ref, seq = conv_ref(before[s], x[bi][None], w.bfloat16(), b.bfloat16(), True)
        torch.testing.assert_close(out[bi].float(), ref[0], atol=3e-2, rtol=3e-2)
        assert torch.equal(state[s], seq[:, 1:].bfloat16())


def test_triton_reports_the_shared_memory_the_tilings_are_fitted_by(K):
    """On the GPU the installed Triton says how much shared memory a compiled kernel needs
    (compat.kernel_shared_memory), so the GDN state pass and the SSD scan fit their tilings to
    the device instead of falling back to the smallest one: after both ran, attn list's
    Triton clause is empty."""
    from attn_plugin_triton_ssm import compat
    from attn_plugin_triton_ssm.kernels import gdn_chunk

    q = torch.randn(64 * HK, D, device="cuda", dtype=torch.bfloat16)
    compiled = gdn_chunk._l2norm_qk_kernel.warmup(
        q, q, q, q, 64 * HK, 1e-6, D=D, BR=16, BD=D, grid=(64, 2)
    )
    shared = compat.kernel_shared_memory(compiled)
    assert isinstance(shared, int) and shared >= 0, shared
    T, H, P, N = 512, 8, 64, 128
    x = torch.randn(T, H, P, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(T, H, device="cuda") - 2.0
    A_log = torch.rand(H, device="cuda").add(1).log()
    Bm = torch.randn(T, 1, N, device="cuda", dtype=torch.bfloat16)
    state = torch.zeros(2, H, N, P, device="cuda")
    idx = torch.tensor([1], dtype=torch.int32, device="cuda")
    cu_cpu = torch.tensor([0, T], dtype=torch.int32)
    K.mamba2_prefill(x, dt, A_log, Bm, Bm, state, idx, cu_cpu.cuda(), impl="triton",
                     cu_seqlens_cpu=cu_cpu)  # fmt: skip
    q, k, v, g, beta, st, _ = _inputs(1, 2, T=T)
    K.gdn_prefill(q[0], k[0], v[0], g[0], beta[0], st, idx,
                  torch.tensor([0, T], dtype=torch.int32, device="cuda"))  # fmt: skip
    assert compat.triton_note() == ""
