"""The KDA chunk state pass over slots (``kernels.gdn_chunk``, per-channel decay).

``chunk_state_pass`` with a ``[T, HV, K]`` decay against the same recurrence written out in
float64 torch, on varlen batches whose sequences end inside and exactly on chunk boundaries (and
one of no tokens), slots in no order (CPU: Triton's interpreter; CUDA: compiled). Then the whole
chunked KDA: fla's forward stages written out in torch (per-channel cumsum, the WY
representation with ``kg``, the output pass) around the kernel's state pass, against fla's
``naive_recurrent_kda`` token by token. On CUDA the whole slot path of ``kda_prefill`` against
fla's public ``chunk_kda`` with gathered states, at Kimi-Linear's head shape.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from slot_pass_check import (
    assert_chunked_matches_naive,
    assert_slot_pass_matches_gathered,
    chunk_spans,
    fla_stages_here,
    slot_path_on_fla_stages,
)

gdn_chunk = K.gdn_chunk
BT = gdn_chunk.CHUNK
S = 7  # slots in the pool
SLOTS = [5, 0, 3, 6]


def _chunks(lens):
    return chunk_spans(lens, BT)


def _chunk_cumsum(x, lens):
    """Cumulative sum along tokens restarting at every chunk of every sequence."""
    out = torch.empty_like(x)
    for s, e in _chunks(lens):
        out[s:e] = x[s:e].cumsum(0)
    return out


def _offsets(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    nchunks = [-(-n // BT) for n in lens]
    chunk_off = torch.tensor([0, *torch.tensor(nchunks).cumsum(0).tolist()], device=DEV)
    return cu, chunk_off, sum(nchunks)


def _reference(kg, w, u, gk, state, idx, lens):
    """The KDA pass written out per sequence and chunk in float64, from the same inputs:
    ``v_new = u - w @ h``, ``h = exp2(g_last)[:, None] * h + kg^T @ v_new``."""
    d = torch.float64
    kg, w, u, gk = kg.to(d), w.to(d), u.to(d), gk.to(d)
    hs, v_new, finals = [], torch.empty_like(u), {}
    s0 = 0
    for i, n in enumerate(lens):
        h = state[int(idx[i])].to(d).clone()  # [HV, K, V]
        for s, e in _chunks([n]):
            s, e = s0 + s, s0 + e
            hs.append(h.clone())
            vn = u[s:e] - torch.einsum("thk,hkv->thv", w[s:e], h)
            v_new[s:e] = vn
            h = torch.exp2(gk[e - 1])[..., None] * h + torch.einsum("thk,thv->hkv", kg[s:e], vn)
        finals[int(idx[i])] = h
        s0 += n
    return torch.stack(hs), v_new, finals


@pytest.mark.parametrize(
    ("lens", "HV", "Kd", "Vd", "dtype", "state_dtype"),
    [
        ([70, BT, 0, 5], 2, 32, 16, torch.float32, torch.float32),  # inside / on / empty
        ([2 * BT + 1], 1, 32, 16, torch.bfloat16, torch.float32),
        ([33, 130], 2, 32, 16, torch.bfloat16, torch.bfloat16),
        ([90], 1, 24, 20, torch.float32, torch.float32),  # masked key rows and value columns
    ],
)
def test_per_channel_state_pass_matches_the_recurrence(lens, HV, Kd, Vd, dtype, state_dtype):
    """Key channels decaying at different rates (some barely, some by 2^-3 per token): a decay
    applied per head, or to the wrong axis of h, misses the recurrence."""
    g = torch.Generator().manual_seed(1)
    T = sum(lens)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV)

    rate = torch.linspace(0.01, 3.0, Kd)  # per channel: log2 decay per token up to -3
    step = -(torch.rand(T, HV, Kd, generator=g) * rate).to(DEV)
    gk = _chunk_cumsum(step, lens)
    kg = r(T, HV, Kd, scale=Kd**-0.5).to(dtype)
    w = r(T, HV, Kd, scale=Kd**-0.5).to(dtype)
    u = r(T, HV, Vd).to(dtype)
    state = r(S, HV, Kd, Vd).to(state_dtype)
    idx = torch.tensor(SLOTS[: len(lens)], device=DEV, dtype=torch.int32)
    cu, chunk_off, nt = _offsets(lens)
    before = state.clone()
    h_ref, v_ref, finals = _reference(kg, w, u, gk, before, idx, lens)
    h, v_new = gdn_chunk.chunk_state_pass(
        kg, w, u, gk, state, idx, cu, chunk_off, nt, block_v=16, num_warps=2
    )
    assert h.shape == (1, nt, HV, Kd, Vd) and h.dtype == dtype
    assert v_new.shape == (1, *u.shape) and v_new.dtype == dtype
    # 16-bit inputs: the kernel's dots round h to the input dtype, as fla's pass does; float32
    # inputs use tf32 tensor-core dots when compiled (10-bit mantissa)
    tol = 3e-2 if dtype != torch.float32 else (2e-5 if DEV == "cpu" else 4e-3)
    assert (h[0].double() - h_ref).abs().max().item() < tol * h_ref.abs().max().item()
    assert (v_new[0].double() - v_ref).abs().max().item() < tol * v_ref.abs().max().item()
    s_tol = tol if state_dtype == torch.float32 else 3e-2
    for slot, want in finals.items():
        got = state[slot].double()
        assert (got - want).abs().max().item() < s_tol * want.abs().max().item(), slot
    untouched = [s for s in range(S) if s not in finals]
    assert torch.equal(state[untouched], before[untouched])
    empty = int(idx[lens.index(0)]) if 0 in lens else None
    if empty is not None:  # a sequence of no tokens keeps its state as it was
        assert torch.equal(state[empty], before[empty])


def test_per_channel_state_pass_refuses_a_decay_of_the_wrong_shape():
    T, HV, Kd = 4, 2, 16
    z = torch.zeros(T, HV, Kd, device=DEV)
    state = torch.zeros(2, HV, Kd, Kd, device=DEV)
    idx = torch.tensor([0], device=DEV, dtype=torch.int32)
    cu = torch.tensor([0, T], device=DEV)
    with pytest.raises(ValueError, match=r"g must be \[T, HV\] .* got \[4, 2, 8\]"):
        gdn_chunk.chunk_state_pass(z, z, z, z[..., :8], state, idx, cu, cu, 1)
    with pytest.raises(ValueError, match=r"takes fla's kg \[T, HV, K\] as k .* got k \[4, 1, 16\]"):
        gdn_chunk.chunk_state_pass(z[:, :1], z, z, z, state, idx, cu, cu, 1)


def _torch_kda_forward(q, k, v, g, beta, state, idx, lens, scale):
    """Chunked KDA as fla-core 0.6.0's ``chunk_kda`` forward computes it, with the stages fla
    runs written out in float64 torch and the inter-chunk state pass the kernel's:

    * ``gk``: the chunk-local cumulative decay in log2 (``chunk_local_cumsum``, RCP_LN2);
    * ``Akk = (I + strict_tril(beta_i * k_i . k_j * exp2(gk_i - gk_j)))^-1``, ``u = Akk @ (beta
      v)``, ``w = Akk @ (beta k exp2(gk))``, ``kg = k exp2(gk_last - gk)``, ``Aqk =
      tril(scale q_i . k_j exp2(gk_i - gk_j))`` (``chunk_kda_fwd_intra``);
    * ``o = scale (q exp2(gk)) @ h + Aqk @ v_new`` (``chunk_gla_fwd_o_gk``).
    """
    d = torch.float64
    HV = v.shape[1]
    group = HV // q.shape[1]
    q, k = (x.to(d).repeat_interleave(group, dim=1) for x in (q, k))
    v, beta = v.to(d), beta.to(d)
    gk = _chunk_cumsum(g.to(d) / math.log(2), lens)
    w, u, kg = torch.empty_like(k), torch.empty_like(v), torch.empty_like(k)
    aqk = []
    for s, e in _chunks(lens):
        qc, kc, gc, bc = q[s:e], k[s:e], gk[s:e], beta[s:e]
        decay = torch.exp2(gc[:, None] - gc[None, :])  # [i, j, HV, K]
        eye = torch.eye(e - s, dtype=d, device=q.device)
        lower = torch.einsum("ihc,jhc,ijhc->hij", kc, kc, decay) * bc.T[:, :, None]
        a_kk = torch.linalg.inv(eye + torch.tril(lower, -1))
        u[s:e] = torch.einsum("hij,jhv->ihv", a_kk, v[s:e] * bc[..., None])
        w[s:e] = torch.einsum("hij,jhk->ihk", a_kk, kc * bc[..., None] * torch.exp2(gc))
        kg[s:e] = kc * torch.exp2(gc[-1][None] - gc)
        aqk.append(torch.tril(torch.einsum("ihc,jhc,ijhc->hij", qc, kc, decay) * scale))
    cu, chunk_off, nt = _offsets(lens)
    h, v_new = gdn_chunk.chunk_state_pass(
        kg.float(), w.float(), u.float(), gk.float(), state, idx, cu, chunk_off, nt,
        block_v=16, num_warps=2,
    )  # fmt: skip
    h, v_new = h[0].to(d), v_new[0].to(d)
    o = torch.empty_like(v)
    for c, (s, e) in enumerate(_chunks(lens)):
        inter = torch.einsum("ihk,hkv->ihv", q[s:e] * torch.exp2(gk[s:e]), h[c]) * scale
        o[s:e] = inter + torch.einsum("hij,jhv->ihv", aqk[c], v_new[s:e])
    return o


def test_chunked_kda_around_the_state_pass_matches_the_naive_recurrence():
    """The formulation the slot pass is written for (k decayed into kg, h's rows decayed per
    channel, v_new undecayed) composes with fla's stages into KDA itself: fla's token-by-token
    ``naive_recurrent_kda``, outputs and final states, two value heads per key head."""
    from attn_plugin_triton_ssm import compat

    assert_chunked_matches_naive(
        compat.naive_recurrences()[1], _torch_kda_forward,
        lambda T, HV, K, g: -torch.rand(T, HV, K, generator=g) * torch.linspace(0.01, 0.8, K),
        chunk=BT, slots=SLOTS, num_slots=S, device=DEV,
    )  # fmt: skip


@pytest.mark.parametrize("out_kind", ["none", "given", "strided"])
def test_kda_slot_path_on_fla_stages_matches_the_naive_recurrence(out_kind, monkeypatch):
    """The KDA slot path as it runs on a GPU - fla-core's KDA stages (per-channel cumsum,
    ``chunk_kda_fwd_intra``, the output pass launched into the layer's ``out``) around the
    per-channel state pass - against fla's ``naive_recurrent_kda`` (float32); ``out`` written
    in place, or copied into one whose rows are not packed. On the CPU fla's kernels run in
    Triton's interpreter."""
    from attn_plugin_triton_ssm import compat

    fla_stages_here("kda", DEV, monkeypatch)
    assert_chunked_matches_naive(
        compat.naive_recurrences()[1],
        slot_path_on_fla_stages(gdn_chunk.kda_chunk_prefill_slots, out_kind),
        lambda T, HV, K, g: -torch.rand(T, HV, K, generator=g) * torch.linspace(0.01, 0.8, K),
        chunk=BT, slots=SLOTS, num_slots=S, device=DEV,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
@pytest.mark.parametrize(
    ("dtype", "state_dtype", "lens"),
    [
        (torch.bfloat16, torch.float32, [1000]),
        (torch.bfloat16, torch.float32, [1000, 64, 1, 257, 2100]),
        (torch.bfloat16, torch.bfloat16, [1000, 64, 1, 257, 2100]),
        # float32 inputs on one sequence: the tiling of few programs takes the most stages
        (torch.float32, torch.float32, [700]),
    ],
)
def test_kda_slot_path_matches_fla_with_gathered_states(dtype, state_dtype, lens):
    """Kimi-Linear's KDA heads (32 heads, d 128), sequences in arbitrary slots, one of them a
    fresh request (zeroed slot): the slot path and fla's public ``chunk_kda`` (states gathered
    and scattered) run the same stages, so outputs and states agree to bf16 rounding; other
    slots stay untouched."""
    from attn_plugin_triton_ssm import compat

    if reason := compat.slot_pass_reason(torch.device("cuda"), "kda"):
        pytest.fail(f"the KDA slot pass is off on this fla-core: {reason}")
    torch.manual_seed(0)
    T, H, D = sum(lens), 32, 128
    q, k = (torch.randn(T, H, D, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(T, H, D, device="cuda", dtype=dtype)
    # Kimi's gate, -exp(A_log) * softplus(...) per channel: mostly near 0, some channels fast
    # (down to -1 a token; fla's unbounded-gate intra stage overflows float32 far below that)
    g = -torch.exp(torch.randn(T, H, D, device="cuda") - 2.0).clamp(max=1.0)
    beta = torch.rand(T, H, device="cuda")
    state = (torch.randn(12, H, D, D, device="cuda") * 0.1).to(state_dtype)
    idx = torch.tensor([9, 2, 11, 0, 5][: len(lens)], device="cuda", dtype=torch.int32)
    state[int(idx[-1])] = 0  # a fresh request: the context zeroes its slot
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    assert_slot_pass_matches_gathered(K.kda_prefill, q, k, v, g, beta, state, idx, cu)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
def test_kda_prefill_takes_the_slot_pass_by_default(monkeypatch):
    """With fla's stages on, ``kda_prefill`` on CUDA runs the slot pass without being asked
    (no gather/scatter around fla's public function)."""
    from attn_plugin_triton_ssm import compat

    if reason := compat.slot_pass_reason(torch.device("cuda"), "kda"):
        pytest.fail(f"the KDA slot pass is off on this fla-core: {reason}")
    calls = []
    real = gdn_chunk.kda_chunk_prefill_slots
    monkeypatch.setattr(gdn_chunk, "kda_chunk_prefill_slots",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    T, H, D = 80, 2, 64
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    state = torch.zeros(3, H, D, D, device="cuda")
    idx = torch.tensor([2], device="cuda", dtype=torch.int32)
    cu = torch.tensor([0, T], device="cuda")
    g = -torch.rand(T, H, D, device="cuda") * 0.1
    K.kda_prefill(q, q, q, g, torch.rand(T, H, device="cuda"), state, idx, cu)
    assert calls == [1]
