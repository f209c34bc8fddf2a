"""Causal conv1d update, Mamba2 decode and the prefill wrappers against independent references
(torch conv1d, an explicit SSD recurrence, our own decode kernel token by token).

Without CUDA the kernels run in Triton's CPU interpreter (see ``kernel_device``); with CUDA the
same small-shape tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from triton_ssm_refs import conv_ref, delta_rule_ref, mamba2_ref

IDX = [3, -1, 0]
UNTOUCHED = [1, 2, 4]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _assert_state_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """The conv state stores inputs unchanged: exact, except that Triton's interpreter casts
    float32 -> bfloat16 by truncation (the GPU rounds to nearest even): one ulp there."""
    if K.INTERPRETED and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# conv1d
# --------------------------------------------------------------------------------------------
def test_conv1d_update_default_groups_a_large_batch_and_matches_torch_conv1d(monkeypatch):
    """B = 258 requests of 24 channels on the general kernel: the default takes 4 requests a
    program (the last program has two rows past the batch), and every row still matches
    torch's conv."""
    from attn_plugin_triton_ssm.kernels import conv1d

    seen: list[int] = []
    kernel = conv1d._conv1d_update_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["RPP"])
                return kernel[grid](*a, **kw)

            return launch

    monkeypatch.setattr(conv1d, "_conv1d_update_kernel", Spy())
    g = _gen(3)
    Bn, C, KW, S = 258, 24, 3, 262
    x = torch.randn(Bn, C, generator=g)
    state = torch.randn(S, C, KW - 1, generator=g)
    w = torch.randn(C, KW, generator=g)
    idx = torch.randperm(S, generator=g)[:Bn].int()
    idx[7] = -1
    st = state.clone().to(DEV)
    out = K.causal_conv1d_update(x.to(DEV), st, w.to(DEV), None, idx.to(DEV), activation=None,
                                 packed_pairs=False)  # fmt: skip
    assert seen == [4]
    out, st = out.cpu(), st.cpu()
    for bi in (0, 7, 255, 256, 257):
        s = int(idx[bi])
        if s < 0:
            assert torch.count_nonzero(out[bi]) == 0
            continue
        ref, seq = conv_ref(state[s], x[bi][None], w, None, False)
        torch.testing.assert_close(out[bi], ref[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(st[s], seq[:, 1:])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "two_d"), [(1, True), (1, False), (3, False)])
@pytest.mark.parametrize(("bias", "act"), [(True, "silu"), (False, None)])
@pytest.mark.parametrize("rpp", [None, 2, 4])  # 2: the last program has one row past the batch
def test_conv1d_update_matches_torch_conv1d(state_dtype, T, two_d, bias, act, rpp):
    g = _gen()
    Bn, C, KW, S = 3, 40, 4, 5
    x = torch.randn(Bn, T, C, generator=g)
    state = torch.randn(S, C, KW - 1, generator=g).to(state_dtype)
    w = torch.randn(C, KW, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    idx = torch.tensor(IDX, dtype=torch.int32)
    before = state.clone()
    xin = x[:, 0] if two_d else x
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    st = state.to(DEV)
    out = K.causal_conv1d_update(dev(xin), st, dev(w), dev(b), dev(idx), activation=act,
                                 block_c=16, requests_per_program=rpp)  # fmt: skip
    assert out.shape == xin.shape
    out3 = (out[:, None] if two_d else out).cpu()
    for bi, s in enumerate(IDX):
        if s < 0:
            assert torch.count_nonzero(out3[bi]) == 0
            continue
        ref, seq = conv_ref(before[s], x[bi], w, b, act is not None)
        torch.testing.assert_close(out3[bi], ref, atol=1e-5, rtol=1e-5)
        _assert_state_equal(st[s].cpu(), seq[:, -(KW - 1) :].to(state_dtype))
    assert torch.equal(st[UNTOUCHED].cpu(), before[UNTOUCHED])


@pytest.mark.parametrize("rpp", [None, 2])
def test_conv1d_verify_then_commit_each_accepted_count(rpp):
    g = _gen(1)
    Bn, T, C, KW, S = 3, 3, 24, 4, 5
    x = torch.randn(Bn, T, C, generator=g).to(DEV)
    state = torch.randn(S, C, KW - 1, generator=g).to(DEV)
    w = torch.randn(C, KW, generator=g).to(DEV)
    idx = torch.tensor(IDX, dtype=torch.int32, device=DEV)
    before = state.clone()
    out = K.causal_conv1d_update(x, state, w, None, idx, update_state=False)
    assert torch.equal(state, before), "update_state=False must not write the slot"
    for n in range(T + 1):
        st = before.clone()
        num = torch.tensor([n, T, 1], dtype=torch.int32, device=DEV)
        K.causal_conv1d_commit(x, num, st, w, idx, requests_per_program=rpp)
        for bi, s in enumerate(IDX):
            if s < 0:
                continue
            ref, seq = conv_ref(before[s].cpu(), x[bi].cpu(), w.cpu(), None, True)
            torch.testing.assert_close(out[bi].cpu(), ref, atol=1e-5, rtol=1e-5)
            nb = int(num[bi])
            assert torch.equal(st[s].cpu(), seq[:, nb : nb + KW - 1])
        assert torch.equal(st[UNTOUCHED], before[UNTOUCHED])


def test_conv1d_errors():
    x = torch.zeros(2, 8, device=DEV)
    idx = torch.zeros(2, dtype=torch.int32, device=DEV)
    w = torch.zeros(8, 4, device=DEV)
    with pytest.raises(ValueError, match=r"conv_state: expected K-1=3 columns.*got 2"):
        K.causal_conv1d_update(x, torch.zeros(3, 8, 2, device=DEV), w, None, idx)
    with pytest.raises(ValueError, match="activation: expected one of"):
        K.causal_conv1d_update(x, torch.zeros(3, 8, 3, device=DEV), w, None, idx,
                               activation="gelu")  # fmt: skip
    with pytest.raises(ValueError, match="requests_per_program: expected a positive count"):
        K.causal_conv1d_update(x, torch.zeros(3, 8, 3, device=DEV), w, None, idx,
                               requests_per_program=0)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Mamba2 decode
# --------------------------------------------------------------------------------------------
def _mamba_inputs(*, Bn=3, T=1, H=4, G=2, N=16, P=32, S=5, state_dtype=torch.float32, seed=0):
    g = _gen(seed)
    x = torch.randn(Bn, T, H, P, generator=g)
    dt = torch.randn(Bn, T, H, generator=g)
    A_log = torch.randn(H, generator=g) * 0.5
    Bm = torch.randn(Bn, T, G, N, generator=g)
    Cm = torch.randn(Bn, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g)
    z = torch.randn(Bn, T, H, P, generator=g)
    state = torch.randn(S, H, N, P, generator=g).to(state_dtype)
    return x, dt, A_log, Bm, Cm, D, dt_bias, z, state


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("extras", "streaming"), [(True, False), (False, False), (True, True)],
    ids=["D_bias_z", "plain", "D_bias_z_streaming"],
)  # fmt: skip
def test_mamba2_decode_matches_explicit_recurrence(state_dtype, extras, streaming):
    x, dt, A_log, Bm, Cm, D, dt_bias, z, state = _mamba_inputs(state_dtype=state_dtype)
    if not extras:
        D = dt_bias = z = None
    idx = torch.tensor(IDX, dtype=torch.int32)
    before = state.clone()
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    st = state.to(DEV)
    out = K.mamba2_decode(d(x[:, 0]), d(dt[:, 0]), d(A_log), d(Bm[:, 0]), d(Cm[:, 0]), st,
                          d(idx), D=d(D), dt_bias=d(dt_bias),
                          z=None if z is None else d(z[:, 0]), block_p=16,
                          streaming=streaming)  # fmt: skip
    y_ref, h_ref = mamba2_ref(x, dt, A_log, Bm, Cm, before[idx.clamp(min=0).long()], D=D,
                              dt_bias=dt_bias, z=z)  # fmt: skip
    tol = (
        dict(atol=3e-2, rtol=2e-2) if state_dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    for bi, s in enumerate(IDX):
        if s < 0:
            assert torch.count_nonzero(out[bi]) == 0
            continue
        torch.testing.assert_close(out[bi].float().cpu(), y_ref[bi, 0], **tol)
        torch.testing.assert_close(st[s].float().cpu(), h_ref[bi], **tol)
    assert torch.equal(st[UNTOUCHED].cpu(), before[UNTOUCHED])


# --------------------------------------------------------------------------------------------
# prefill wrappers (state gathered from / scattered to slots)
# --------------------------------------------------------------------------------------------
def test_mamba2_prefill_varlen_matches_recurrence_then_decode_continues():
    lens = [5, 11, 1]
    T = sum(lens)
    x, dt, A_log, Bm, Cm, D, dt_bias, z, state = _mamba_inputs(Bn=1, T=T, seed=3)
    cu = torch.tensor([0, 5, 16, 17], dtype=torch.int32)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    before = state.clone()
    y = K.mamba2_prefill(x[0], dt[0], A_log, Bm[0], Cm[0], state, idx, cu, D=D, dt_bias=dt_bias,
                         z=z[0], chunk_size=4)  # fmt: skip
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(s, e)
        y_ref, h_ref = mamba2_ref(x[:, sl], dt[:, sl], A_log, Bm[:, sl], Cm[:, sl],
                                  before[idx[i]][None], D=D, dt_bias=dt_bias,
                                  z=z[:, sl])  # fmt: skip
        torch.testing.assert_close(y[sl], y_ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[idx[i]], h_ref[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(state[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_prefill_cpu_fallback_matches_decode_kernel_token_by_token(kda):
    gen = _gen(5)
    lens, Hk, Hv, D = [3, 2], 2, 4, 16
    T = sum(lens)
    q, k = torch.randn(T, Hk, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
    v = torch.randn(T, Hv, D, generator=gen)
    g = -torch.rand(T, Hv, D, generator=gen) if kda else -torch.rand(T, Hv, generator=gen)
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(4, Hv, D, D, generator=gen)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    before = state.clone()
    prefill = K.kda_prefill if kda else K.gdn_prefill
    y = prefill(q, k, v, g, beta, state, idx, cu)
    # Same sequences through fla's naive recurrence directly, one [B=1] call per sequence.
    for i, (s, e) in enumerate(((0, 3), (3, 5))):
        o_ref, h_ref = delta_rule_ref(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                      beta[None, s:e], before[idx[i]][None], kda=kda)  # fmt: skip
        torch.testing.assert_close(y[s:e], o_ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[idx[i]], h_ref[0, -1], atol=1e-4, rtol=1e-4)
    # ... and the decode kernel, token by token, from the same slots.
    st = before.clone().to(DEV)
    decode = K.kda_decode if kda else K.gdn_decode
    for t in range(3):
        rows = [r for r, (s, e) in enumerate(((0, 3), (3, 5))) if s + t < e]
        pos = [(0, 3)[r] + t for r in rows]
        q_t, k_t, v_t, g_t, b_t = (a[pos].to(DEV) for a in (q, k, v, g, beta))
        o = decode(q_t, k_t, v_t, g_t, b_t, st, idx[rows].to(DEV))
        torch.testing.assert_close(o.cpu(), y[pos], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.cpu(), state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_prefill_refuses_a_misshapen_out_before_writing_a_slot(kda):
    """An ``out`` of the wrong shape is bad input: the prefill raises naming it and what it
    expected, and no slot, this batch's or another's, has moved (the check used to come after
    the final states were written)."""
    gen = _gen(6)
    T, Hk, Hv, D = 5, 2, 4, 16
    q, k = torch.randn(T, Hk, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
    v = torch.randn(T, Hv, D, generator=gen)
    g = -torch.rand(T, Hv, D, generator=gen) if kda else -torch.rand(T, Hv, generator=gen)
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(4, Hv, D, D, generator=gen)
    before = state.clone()
    prefill = K.kda_prefill if kda else K.gdn_prefill
    idx, cu = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out: expected shape \[5, 4, 16\]"):
        prefill(q, k, v, g, beta, state, idx, cu, out=torch.empty(T, Hv, D + 1))
    assert torch.equal(state, before)
