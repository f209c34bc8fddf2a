"""The Gated DeltaNet chunk state pass over slots (``kernels.gdn_chunk``).

``chunk_state_pass`` against the same recurrence written out in float64 torch, on varlen batches
whose sequences end inside and exactly on chunk boundaries, with grouped key heads and slots in
no order (CPU: Triton's interpreter; CUDA: compiled). On CUDA the whole slot path of
``gdn_prefill`` against fla's public ``chunk_gated_delta_rule`` with gathered states, at
Qwen3-Next's head shape.
"""

from __future__ import annotations

import functools
import itertools
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

gdn_chunk = K.gdn_chunk  # the submodule, imported by the package after kernel_device
BT = gdn_chunk.CHUNK
S = 7  # slots in the pool
SLOTS = [5, 0, 3]


def _inputs(lens, H, HV, Kd, Vd, dtype, state_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV)

    k = r(T, H, Kd, scale=Kd**-0.5).to(dtype)
    w = r(T, HV, Kd, scale=Kd**-0.5).to(dtype)
    u = r(T, HV, Vd).to(dtype)
    # chunk-local cumulative log2 decay: restarts at every chunk of every sequence
    step = -torch.rand(T, HV, generator=g).to(DEV) * 0.2
    gc = torch.empty_like(step)
    start = 0
    for n in lens:
        for c in range(0, n, BT):
            s, e = start + c, start + min(c + BT, n)
            gc[s:e] = step[s:e].cumsum(0)
        start += n
    state = r(S, HV, Kd, Vd).to(state_dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    chunks = [-(-n // BT) for n in lens]
    chunk_off = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], device=DEV)
    idx = torch.tensor(SLOTS[: len(lens)], device=DEV, dtype=torch.int32)
    return k, w, u, gc, state, idx, cu, chunk_off, sum(chunks)


def _reference(k, w, u, gc, state, idx, cu, lens):
    """The pass written out per sequence and chunk in float64, from the same rounded inputs."""
    d = torch.float64
    H, HV = k.shape[1], u.shape[1]
    kk = k.to(d).repeat_interleave(HV // H, dim=1)
    w, u, gc = w.to(d), u.to(d), gc.to(d)
    hs, v_new, finals = [], torch.empty_like(u), {}
    for i, n in enumerate(lens):
        h = state[int(idx[i])].to(d).clone()  # [HV, K, V]
        s0 = int(cu[i])
        for c in range(0, n, BT):
            s, e = s0 + c, s0 + min(c + BT, n)
            hs.append(h.clone())
            vn = u[s:e] - torch.einsum("thk,hkv->thv", w[s:e], h)
            v_new[s:e] = vn
            g_last = gc[e - 1]  # [HV]
            decay = torch.exp2(g_last[None] - gc[s:e])  # [t, HV]
            h = torch.exp2(g_last)[:, None, None] * h + torch.einsum(
                "thk,thv->hkv", kk[s:e], vn * decay[..., None]
            )
        finals[int(idx[i])] = h
    return torch.stack(hs), v_new, finals


@pytest.mark.parametrize(
    ("lens", "H", "HV", "dtype", "state_dtype"),
    [
        ([70, BT, 5], 2, 4, torch.float32, torch.float32),  # inside / on a chunk boundary
        ([2 * BT + 1], 1, 2, torch.bfloat16, torch.float32),
        ([33, 130], 2, 2, torch.bfloat16, torch.bfloat16),
    ],
)
def test_state_pass_matches_the_recurrence(lens, H, HV, dtype, state_dtype):
    Kd, Vd = 32, 32
    k, w, u, gc, state, idx, cu, chunk_off, nt = _inputs(lens, H, HV, Kd, Vd, dtype, state_dtype)
    before = state.clone()
    h_ref, v_ref, finals = _reference(k, w, u, gc, before, idx, cu, lens)
    h, v_new = gdn_chunk.chunk_state_pass(
        k, w, u, gc, state, idx, cu, chunk_off, nt, block_v=16, num_warps=2
    )
    assert h.shape == (1, nt, HV, Kd, Vd) and h.dtype == dtype
    assert v_new.shape == (1, *u.shape) and v_new.dtype == dtype
    # 16-bit inputs: the kernel's dots round h to the input dtype, as fla's pass does; float32
    # inputs use tf32 tensor-core dots when compiled (10-bit mantissa)
    tol = 3e-2 if dtype != torch.float32 else (2e-5 if DEV == "cpu" else 4e-3)
    scale = h_ref.abs().max().item()
    assert (h[0].double() - h_ref).abs().max().item() < tol * scale
    assert (v_new[0].double() - v_ref).abs().max().item() < tol * v_ref.abs().max().item()
    s_tol = tol if state_dtype == torch.float32 else 3e-2
    for slot, want in finals.items():
        got = state[slot].double()
        assert (got - want).abs().max().item() < s_tol * want.abs().max().item(), slot
    untouched = [s for s in range(S) if s not in finals]
    assert torch.equal(state[untouched], before[untouched])


def _wy_inputs(k, gc, cu, lens, HV, Vd, dtype, seed=1):
    """Values, beta and a solved ``Ai`` ``[T, HV, BT]`` (unit lower triangle, NaN above it, as
    the entries fla never stores may hold anything) for :func:`.chunk_state_pass_wy`, and the
    ``w``, ``u`` fla's ``recompute_w_u`` makes of them in float64 (``w = Ai (beta exp2(g) k)``,
    ``u = Ai (beta v)`` per chunk)."""
    g = torch.Generator().manual_seed(seed)
    T, H, _ = k.shape
    v = (torch.randn(T, HV, Vd, generator=g)).to(DEV, dtype)
    beta = torch.rand(T, HV, generator=g).to(DEV)
    Ai = torch.full((T, HV, BT), float("nan"))
    for s, e in _chunks(lens):
        n = e - s
        tril = torch.tril(torch.randn(HV, n, n, generator=g) * 0.2, -1) + torch.eye(n)
        Ai[s:e, :, :n] = tril.transpose(0, 1)  # row t of the chunk at Ai[s + t]
    Ai = Ai.to(DEV, dtype)
    d = torch.float64
    kk = k.to(d).repeat_interleave(HV // H, dim=1)
    kb = kk * (beta.to(d) * torch.exp2(gc.to(d)))[..., None]
    vb = v.to(d) * beta.to(d)[..., None]
    w, u = torch.empty_like(kb), torch.empty_like(vb)
    for s, e in _chunks(lens):
        a = Ai[s:e, :, : e - s].to(d).transpose(0, 1)  # [HV, n, n]
        w[s:e] = torch.einsum("hts,shk->thk", a, kb[s:e])
        u[s:e] = torch.einsum("hts,shv->thv", a, vb[s:e])
    return v, beta, Ai, w, u


@pytest.mark.parametrize(
    ("lens", "H", "HV", "dtype", "state_dtype"),
    [
        ([70, BT, 5], 2, 4, torch.float32, torch.float32),
        ([2 * BT + 1, 33], 1, 2, torch.bfloat16, torch.float32),
    ],
)
def test_state_pass_with_the_wy_folded_in_matches_the_recurrence(lens, H, HV, dtype, state_dtype):
    """The pass reading the values, beta and fla's solved ``Ai``
    (:func:`.chunk_state_pass_wy`) equals the recurrence over the ``w`` and ``u`` fla's
    ``recompute_w_u`` would make of them, reading only ``Ai``'s lower triangle (NaN above it),
    the sequences' last chunks partial; slots outside the batch untouched."""
    Kd, Vd = 32, 32
    k, _, _, gc, state, idx, cu, chunk_off, nt = _inputs(lens, H, HV, Kd, Vd, dtype, state_dtype)
    v, beta, Ai, w, u = _wy_inputs(k, gc, cu, lens, HV, Vd, dtype)
    before = state.clone()
    h_ref, v_ref, finals = _reference(k, w, u, gc, before, idx, cu, lens)
    h, v_new = gdn_chunk.chunk_state_pass_wy(
        k, v, beta, Ai, gc, state, idx, cu, chunk_off, nt, block_v=16, num_warps=2
    )
    assert h.shape == (1, nt, HV, Kd, Vd) and v_new.shape == (1, *v.shape)
    assert v_new.dtype == dtype and not v_new.isnan().any()
    tol = 3e-2 if dtype != torch.float32 else (2e-5 if DEV == "cpu" else 4e-3)
    assert (h[0].double() - h_ref).abs().max().item() < tol * h_ref.abs().max().item()
    assert (v_new[0].double() - v_ref).abs().max().item() < tol * v_ref.abs().max().item()
    for slot, want in finals.items():
        got = state[slot].double()
        assert (got - want).abs().max().item() < tol * want.abs().max().item(), slot
    untouched = [s for s in range(S) if s not in finals]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize(
    ("g_shape", "beta_shape", "got"),
    [((8, 2, 16), (8, 2), r"got g \[8, 2, 16\]"), ((8, 2), (8,), r"beta \[8\]")],
    ids=["per_channel_decay", "one_beta_a_token"],
)
def test_the_folded_pass_refuses_misshapen_inputs(g_shape, beta_shape, got):
    """A per-channel decay (KDA's) or a beta that is not ``[T, HV]`` is refused by name before
    any launch by the pass with the WY folded in."""
    T, HV, D = 8, 2, 16
    k = torch.zeros(T, HV, D, device=DEV)
    g, beta = torch.zeros(*g_shape, device=DEV), torch.zeros(*beta_shape, device=DEV)
    Ai = torch.zeros(T, HV, BT, device=DEV)
    pool, cu = torch.zeros(2, HV, D, D, device=DEV), torch.tensor([0, T], device=DEV)
    slots, chunk_off = torch.tensor([0], device=DEV), torch.tensor([0, 1], device=DEV)
    with pytest.raises(
        ValueError,
        match=r"chunk_state_pass_wy: Gated DeltaNet's per-head decay g \[T, HV\], beta "
        r"\[T, HV\].*" + got,
    ):
        gdn_chunk.chunk_state_pass_wy(k, k, beta, Ai, g, pool, slots, cu, chunk_off, 1)


def _output_reference(q, k, gc, h_chunks, v_new, cu, lens, scale):
    """fla's ``chunk_fwd_o`` written out in float64: per chunk ``c`` of a sequence,
    ``o = scale * (exp2(g) * (q @ h_c) + (causal(q @ k^T) * exp2(g_i - g_j)) @ v_new)``, from
    the pass's own ``h`` (entering each chunk) and ``v_new``."""
    d = torch.float64
    H, HV = q.shape[1], v_new.shape[1]
    qq = q.to(d).repeat_interleave(HV // H, dim=1)
    kk = k.to(d).repeat_interleave(HV // H, dim=1)
    o = torch.empty(v_new.shape, dtype=d, device=v_new.device)
    c_global = 0
    for i, n in enumerate(lens):
        s0 = int(cu[i])
        for c in range(0, n, BT):
            s, e = s0 + c, s0 + min(c + BT, n)
            g = gc[s:e].to(d)  # [t, HV]
            h = h_chunks[c_global].to(d)  # [HV, K, V]
            inter = torch.einsum("thk,hkv->thv", qq[s:e], h) * torch.exp2(g)[..., None]
            a = torch.einsum("ihk,jhk->hij", qq[s:e], kk[s:e])
            a = a * torch.exp2(g.T[:, :, None] - g.T[:, None, :])
            a = a * torch.tril(torch.ones(e - s, e - s, dtype=d, device=a.device))
            intra = torch.einsum("hij,jhv->ihv", a, v_new[s:e].to(d))
            o[s:e] = scale * (inter + intra)
            c_global += 1
    return o


@pytest.mark.parametrize(
    ("lens", "H", "HV", "dtype", "state_dtype"),
    [
        ([70, BT, 5], 2, 4, torch.float32, torch.float32),  # inside / on a chunk boundary
        ([33, 130], 2, 2, torch.bfloat16, torch.bfloat16),
    ],
)
def test_state_and_output_in_one_pass_match_the_two_passes(lens, H, HV, dtype, state_dtype):
    """``chunk_state_output_pass`` (the output computed in the state pass) against
    ``chunk_state_pass`` plus fla's output formula written out: the same final states, and the
    output of the formula on the pass's ``h`` and ``v_new``."""
    Kd, Vd = 32, 32
    k, w, u, gc, state, idx, cu, chunk_off, nt = _inputs(lens, H, HV, Kd, Vd, dtype, state_dtype)
    q = (torch.randn(k.shape, generator=torch.Generator().manual_seed(1)) * Kd**-0.5).to(DEV)
    q = q.to(dtype)
    two = state.clone()
    h, v_new = gdn_chunk.chunk_state_pass(
        k, w, u, gc, two, idx, cu, chunk_off, nt, block_v=16, num_warps=2
    )
    o_ref = _output_reference(q, k, gc, h[0], v_new[0], cu, lens, scale=0.7)
    before = state.clone()
    o = gdn_chunk.chunk_state_output_pass(
        q, k, w, u, gc, state, idx, cu, chunk_off, scale=0.7, block_v=16, num_warps=2
    )
    assert o.shape == u.shape and o.dtype == u.dtype
    tol = 3e-2 if dtype != torch.float32 else (2e-5 if DEV == "cpu" else 4e-3)
    assert (o.double() - o_ref).abs().max().item() < tol * o_ref.abs().max().item()
    # the state half is the same pass: final states as the two-pass path's
    assert torch.equal(state, two) if DEV == "cpu" else torch.allclose(state, two, atol=1e-6)
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(state[untouched], before[untouched])
    with pytest.raises(ValueError, match=r"per-head decay g \[T, HV\] only"):
        gdn_chunk.chunk_state_output_pass(
            q, k, w, u, gc[..., None].expand(-1, -1, Kd), state, idx, cu, chunk_off, scale=1.0
        )


def _stand_in_stages():
    """fla-core 0.6.0's two Gated DeltaNet stages around the state pass, written out in float64
    torch on one sequence's ``[1, T, ...]`` tensors without ``cu_seqlens``;
    ``g`` is the chunk-local cumulative log2 decay ``gc``:

    * ``intra`` (``chunk_scaled_dot_kkt``, ``solve_tril``, ``recompute_w_u``):
      ``A = (I + strict_tril(beta_i k_i . k_j exp2(gc_i - gc_j)))^-1``, ``u = A @ (beta v)``,
      ``w = A @ (beta k exp2(gc))``;
    * ``chunk_fwd_o``: ``o = scale (q exp2(gc)) @ h + tril(scale q_i . k_j exp2(gc_i - gc_j))
      @ v_new``.
    """

    def chunks(T):
        return [(s, min(s + BT, T)) for s in range(0, T, BT)]

    def intra(*, k, v, g, beta, cu_seqlens, chunk_size):
        assert cu_seqlens is None and chunk_size == BT
        group = v.shape[2] // k.shape[2]
        kk = k[0].double().repeat_interleave(group, dim=1)
        vv, gg, bb = v[0].double(), g[0].double(), beta[0].double()
        w, u = torch.empty_like(kk), torch.empty_like(vv)
        for s, e in chunks(kk.shape[0]):
            decay = torch.exp2(gg[s:e, None] - gg[None, s:e]).permute(2, 0, 1)
            lower = torch.einsum("ihc,jhc->hij", kk[s:e], kk[s:e]) * decay * bb[s:e].T[..., None]
            a = torch.linalg.inv(torch.eye(e - s, dtype=kk.dtype) + torch.tril(lower, -1))
            u[s:e] = torch.einsum("hij,jhv->ihv", a, vv[s:e] * bb[s:e, :, None])
            w[s:e] = torch.einsum(
                "hij,jhk->ihk", a, kk[s:e] * (bb[s:e] * torch.exp2(gg[s:e]))[..., None]
            )
        return w[None].to(k.dtype), u[None].to(v.dtype), None

    def chunk_fwd_o(*, q, k, v, h, g, scale, cu_seqlens, chunk_size):
        assert cu_seqlens is None and chunk_size == BT
        group = v.shape[2] // q.shape[2]
        qq, kk = (x[0].double().repeat_interleave(group, dim=1) for x in (q, k))
        vv, gg = v[0].double(), g[0].double()
        o = torch.empty_like(vv)
        for c, (s, e) in enumerate(chunks(qq.shape[0])):
            inter = torch.einsum("thk,hkv->thv", qq[s:e], h[0, c].double())
            a = torch.einsum("ihk,jhk->hij", qq[s:e], kk[s:e])
            a = torch.tril(a * torch.exp2(gg[s:e].T[:, :, None] - gg[s:e].T[:, None, :]))
            intra_o = torch.einsum("hij,jhv->ihv", a, vv[s:e])
            o[s:e] = scale * (inter * torch.exp2(gg[s:e])[..., None] + intra_o)
        return o[None].to(v.dtype)

    return {"intra": intra, "chunk_fwd_o": chunk_fwd_o}


def _torch_gdn_forward(q, k, v, g, beta, state, idx, lens, scale):
    """Chunked Gated DeltaNet as fla-core 0.6.0's ``chunk_gated_delta_rule`` forward computes
    it: fla's stages written out in float64 torch (:func:`_stand_in_stages`), one sequence at a
    time, around the kernel's state pass over the whole varlen batch; ``gc``, the chunk-local
    cumulative decay, in log2 as the pass takes it."""
    d = torch.float64
    q, k, v, g, beta = (x.cpu().to(d) for x in (q, k, v, g, beta))
    gc = torch.empty_like(g)
    for s, e in _chunks(lens):
        gc[s:e] = (g[s:e] / math.log(2)).cumsum(0)
    bounds = [0, *itertools.accumulate(lens)]
    seqs = list(itertools.pairwise(bounds))
    stages = _stand_in_stages()
    wu = [
        stages["intra"](k=k[None, s:e], v=v[None, s:e], g=gc[None, s:e], beta=beta[None, s:e],
                        cu_seqlens=None, chunk_size=BT)
        for s, e in seqs
    ]  # fmt: skip
    w, u = (torch.cat([x[i][0] for x in wu]) for i in (0, 1))
    cu = torch.tensor(bounds, device=DEV)
    nchunks = [-(-n // BT) for n in lens]
    chunk_off = torch.tensor([0, *itertools.accumulate(nchunks)], device=DEV)
    h, v_new = gdn_chunk.chunk_state_pass(
        k.float().to(DEV), w.float().to(DEV), u.float().to(DEV), gc.float().to(DEV), state,
        idx, cu, chunk_off, sum(nchunks), block_v=16, num_warps=2,
    )  # fmt: skip
    h, v_new = h.cpu().to(d), v_new.cpu().to(d)
    o = []
    for (s, e), (c0, c1) in zip(seqs, itertools.pairwise(chunk_off.tolist()), strict=True):
        o.append(stages["chunk_fwd_o"](
            q=q[None, s:e], k=k[None, s:e], v=v_new[:, s:e], h=h[:, c0:c1], g=gc[None, s:e],
            scale=scale, cu_seqlens=None, chunk_size=BT,
        )[0])  # fmt: skip
    return torch.cat(o)


def _chunks(lens):
    return chunk_spans(lens, BT)


def test_chunked_gdn_around_the_state_pass_matches_the_naive_recurrence():
    """The formulation the slot pass is written for (log2 chunk-local decay, v_new undecayed,
    k decayed to the chunk's end inside the pass) composes with fla's stages into Gated
    DeltaNet itself: fla's token-by-token ``naive_recurrent_gated_delta_rule``, outputs and
    final states, two value heads per key head, sequences ending inside and on chunk ends."""
    from attn_plugin_triton_ssm import compat

    assert_chunked_matches_naive(
        compat.naive_recurrences()[0], _torch_gdn_forward,
        lambda T, HV, K, g: -torch.rand(T, HV, generator=g) * 0.3,
        chunk=BT, slots=SLOTS, num_slots=S, device=DEV, repeat_qk_for_naive=True,
    )  # fmt: skip


@pytest.mark.parametrize("solve", ["fla", "ours"])
@pytest.mark.parametrize("wy_in_pass", [False, True], ids=["wu_stored", "wy_in_pass"])
@pytest.mark.parametrize("out_kind", ["none", "given", "strided"])
def test_slot_path_on_fla_stages_matches_the_naive_recurrence(
    out_kind, wy_in_pass, solve, monkeypatch
):
    """The slot path as it runs on a GPU - fla-core's own stages (cumsum, intra-chunk WY or,
    ``wy_in_pass``, only its kkt-and-solve kernel; the output pass launched into the layer's
    ``out``) around the state pass over slots - against fla's token-by-token
    ``naive_recurrent_gated_delta_rule`` (float32): outputs, final states, other slots
    untouched; the output written into a given ``out`` in place, or copied into one whose rows
    are not packed. ``solve="ours"``: the cumsum and the kkt-and-solve are our one kernel
    (``gdn_solve``), ahead of fla's ``recompute_w_u`` or the folded pass. On the CPU fla's
    kernels run in Triton's interpreter."""
    from attn_plugin_triton_ssm import compat

    fla_stages_here("gdn", DEV, monkeypatch)
    slot_fn = functools.partial(
        gdn_chunk.gdn_chunk_prefill_slots, wy_in_pass=wy_in_pass, solve=solve
    )
    assert_chunked_matches_naive(
        compat.naive_recurrences()[0],
        slot_path_on_fla_stages(slot_fn, out_kind),
        lambda T, HV, K, g: -torch.rand(T, HV, generator=g) * 0.3,
        chunk=BT, slots=SLOTS, num_slots=S, device=DEV, repeat_qk_for_naive=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("sms", "options", "ran"),
    [
        (1, {}, "chunk_state_pass_wy"),  # 3 sequences x 4 heads: 12 programs on one SM
        (100, {}, "chunk_state_pass"),  # 12 programs on 100 SMs
        (1, {"fuse_output": True}, "chunk_state_output_pass"),
        (1, {"num_warps": 8}, "chunk_state_pass"),  # the folded pass refuses 8 warps
    ],
    ids=["fills-the-gpu", "leaves-sms-idle", "fused-output", "8-warps"],
)
def test_the_default_folds_the_wy_in_where_the_batch_fills_the_gpu(sms, options, ran, monkeypatch):
    """``wy_in_pass=None`` (the default) folds fla's ``recompute_w_u`` into the pass where its
    64-wide value blocks give at least two programs per SM, and not where they leave SMs idle,
    with the output fused into the pass, or on 8 warps; whichever runs, the outputs and final
    states are Gated DeltaNet's (fla's naive recurrence)."""
    from attn_plugin_triton_ssm import compat

    fla_stages_here("gdn", DEV, monkeypatch)
    monkeypatch.setattr(gdn_chunk, "_sm_count_here", lambda: sms)
    calls = []
    for name in ("chunk_state_pass", "chunk_state_pass_wy", "chunk_state_output_pass"):
        real = getattr(gdn_chunk, name)

        def spy(*args, real=real, name=name, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(gdn_chunk, name, spy)
    slot_fn = functools.partial(gdn_chunk.gdn_chunk_prefill_slots, **options)
    assert_chunked_matches_naive(
        compat.naive_recurrences()[0],
        slot_path_on_fla_stages(slot_fn, "none"),
        lambda T, HV, K, g: -torch.rand(T, HV, generator=g) * 0.3,
        chunk=BT, slots=SLOTS, num_slots=S, device=DEV, repeat_qk_for_naive=True,
    )  # fmt: skip
    assert calls and set(calls) == {ran}, calls


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_an_out_over_the_queries_is_not_written_while_they_are_read(kda, monkeypatch):
    """``out`` may be the queries' own buffer (an in-place layer). fla's output pass reads every
    key channel of a chunk's queries while other programs store other value blocks of the same
    rows, so it must not write into that buffer directly: the result equals the call with a
    separate ``out``, value blocks narrower than the head (V = 64 in 32-wide blocks)."""
    fla_stages_here("kda" if kda else "gdn", DEV, monkeypatch)
    gen = torch.Generator().manual_seed(2)
    T, H, D = 70, 2, 64
    q = torch.randn(T, H, D, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen), dim=-1)
    v = torch.randn(T, H, D, generator=gen)
    gate = -torch.rand(*((T, H, D) if kda else (T, H)), generator=gen) * 0.3
    beta = torch.rand(T, H, generator=gen)
    state = torch.randn(3, H, D, D, generator=gen) * 0.1
    q, k, v, gate, beta, state = (x.to(DEV) for x in (q, k, v, gate, beta, state))
    idx, cu = torch.tensor([1], dtype=torch.int32, device=DEV), torch.tensor([0, T])
    fn = gdn_chunk.kda_chunk_prefill_slots if kda else gdn_chunk.gdn_chunk_prefill_slots

    def run(q_in, out):
        return fn(q_in, k, v, gate, beta, state.clone(), idx, cu.to(DEV), cu, scale=D**-0.5,
                  use_qk_l2norm=False, out=out)  # fmt: skip

    want = run(q, torch.empty_like(v))
    q_buffer = q.clone()
    got = run(q_buffer, q_buffer)
    assert got is q_buffer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _qwen3_next_batch(lens, dtype=torch.bfloat16, state_dtype=torch.float32, device="cuda"):
    """A Gated DeltaNet prefill batch at Qwen3-Next's heads (16 key / 32 value heads, d 128):
    ``(q, k, v, g, beta, state, idx, cu)``, the sequences of ``lens`` in slots 9, 2, 11, 0, 5
    of a pool of 12, ``cu`` int64 offsets on ``device``."""
    torch.manual_seed(0)
    T, Hk, Hv, D = sum(lens), 16, 32, 128
    q, k = (torch.randn(T, Hk, D, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(T, Hv, D, device=device, dtype=dtype)
    g = -torch.rand(T, Hv, device=device) * 0.3
    beta = torch.rand(T, Hv, device=device)
    state = (torch.randn(12, Hv, D, D, device=device) * 0.1).to(state_dtype)
    idx = torch.tensor([9, 2, 11, 0, 5][: len(lens)], device=device, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    return q, k, v, g, beta, state, idx, cu


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
@pytest.mark.parametrize(
    ("dtype", "state_dtype", "lens"),
    [
        (torch.bfloat16, torch.float32, [1000, 64, 1, 257, 2100]),
        (torch.bfloat16, torch.bfloat16, [1000, 64, 1, 257, 2100]),
        # float32 inputs on one sequence: the tiling of few programs (3 stages) overflowed
        # shared memory at d 128 (246 KB); the pass must fit its stages to the device
        (torch.float32, torch.float32, [700]),
    ],
)
def test_slot_path_matches_fla_with_gathered_states(dtype, state_dtype, lens):
    """Qwen3-Next heads (16 key / 32 value heads, d 128), sequences in arbitrary slots: the
    slot path with ``w`` and ``u`` stored and fla's public function (states gathered and
    scattered) run the same stages, so outputs and states agree to bf16 rounding; other slots
    stay untouched. (Folded into the pass, which the default does for this batch, the rounding
    falls elsewhere: :func:`test_wy_in_pass_is_as_close_to_the_recurrence_as_fla`.)"""
    assert_slot_pass_matches_gathered(
        _prefill_with(wy_in_pass=False), *_qwen3_next_batch(lens, dtype, state_dtype)
    )


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
@pytest.mark.parametrize("wy_in_pass", [False, True], ids=["wu_stored", "wy_in_pass"])
def test_slot_path_with_our_solve_matches_fla_with_gathered_states(wy_in_pass):
    """``solve="ours"`` at Qwen3-Next's heads: the decay's cumsum and every chunk's
    ``(I + A)^-1`` from our kernel, the rest as with fla's solve; outputs and states agree with
    fla's public function to bf16 rounding, other slots untouched."""
    lens = [1000, 64, 1, 257, 2100]
    assert_slot_pass_matches_gathered(
        _prefill_with(wy_in_pass=wy_in_pass, solve="ours"),
        *_qwen3_next_batch(lens, torch.bfloat16, torch.float32),
    )


def _prefill_with(**options):
    """``gdn_prefill``'s signature for :func:`assert_slot_pass_matches_gathered`: the slot path
    with ``options`` (``fuse_output``, ``wy_in_pass``), or (``slot_pass=False``) fla's public
    function around gathered states."""

    def prefill(q, k, v, g, beta, state, idx, cu, *, cu_seqlens_cpu, slot_pass):
        if not slot_pass:
            return K.gdn_prefill(q, k, v, g, beta, state, idx, cu, cu_seqlens_cpu=cu_seqlens_cpu,
                                 slot_pass=False)  # fmt: skip
        return gdn_chunk.gdn_chunk_prefill_slots(
            q, k, v, g, beta, state, idx, cu.long(), cu_seqlens_cpu.long(),
            scale=q.shape[-1] ** -0.5, use_qk_l2norm=True, **options,
        )  # fmt: skip

    return prefill


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_fused_output_slot_path_matches_fla_with_gathered_states(state_dtype):
    """The output computed in the state pass (``fuse_output``) against fla's public function,
    at Qwen3-Next's heads, sequences ending inside and on chunk boundaries."""
    lens = [1000, 64, 1, 257, 2100]
    assert_slot_pass_matches_gathered(
        _prefill_with(fuse_output=True), *_qwen3_next_batch(lens, state_dtype=state_dtype)
    )


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (fla's chunk stages)")
@pytest.mark.parametrize(
    "lens",
    [[1000, 64, 1, 257, 700], [1500]],  # more programs than 2 per SM (64-wide blocks); fewer
)
def test_wy_in_pass_is_as_close_to_the_recurrence_as_fla(lens):
    """With ``wy_in_pass`` the bf16 rounding falls elsewhere than in fla (``w`` and ``u`` are
    never rounded; ``beta v - kb h`` enters ``Ai`` in tf32), so the outputs differ from fla's
    by its own rounding (2.7e-3 mean relative at Qwen3-Next's heads, where the stored path
    matches fla's stages to 2e-3). The measure is the recurrence token by token (fla's naive,
    float32, per sequence): outputs and final states within 1.1x fla's public function's error
    to it, other slots untouched."""
    from attn_plugin_triton_ssm import compat

    q, k, v, g, beta, state, idx, cu = _qwen3_next_batch(lens)
    Hk, Hv, D = k.shape[1], v.shape[1], k.shape[2]
    cu_cpu, scale = cu.cpu(), D**-0.5
    before = state.clone()
    got = gdn_chunk.gdn_chunk_prefill_slots(
        q, k, v, g, beta, state, idx, cu, cu_cpu, scale=scale, use_qk_l2norm=True,
        wy_in_pass=True,
    ).double()  # fmt: skip
    fla_o, fla_ht = compat.public_chunk(kda=False)(
        q[None], k[None], v[None], g[None], beta[None], scale=scale,
        initial_state=before[idx.long()], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
    naive = compat.naive_recurrences()[0]
    qn, kn = (torch.nn.functional.normalize(x.double(), dim=-1) for x in (q, k))
    want_o, want_ht = [], []
    for i, (s0, s1) in enumerate(itertools.pairwise(cu_cpu.tolist())):
        o_i, ht_i = naive(
            *(x[s0:s1].repeat_interleave(Hv // Hk, dim=1)[None] for x in (qn, kn)),
            v[s0:s1][None].double(), beta[s0:s1][None].double(), g[s0:s1][None].double(),
            scale=scale, initial_state=before[int(idx[i])][None].double(),
            output_final_state=True,
        )  # fmt: skip
        want_o.append(o_i[0])
        want_ht.append(ht_i[0])
    want, want_states = torch.cat(want_o), torch.stack(want_ht)

    def err(x, ref):
        return ((x.double() - ref).abs().mean() / ref.abs().mean()).item()

    assert err(got, want) <= 1.1 * err(fla_o[0], want), (err(got, want), err(fla_o[0], want))
    ours_ht = state[idx.long()]
    assert err(ours_ht, want_states) <= 1.1 * err(fla_ht, want_states) + 1e-6
    untouched = [s for s in range(state.shape[0]) if s not in idx.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_wy_in_pass_refuses_what_it_does_not_serve():
    """``wy_in_pass`` with the output fused into the pass, or on 8 warps a program (which
    faulted on an H100), is refused before anything runs."""
    T, D = 4, 16
    x = torch.zeros(T, 1, D, device=DEV)
    args = (x, x, x, torch.zeros(T, 1, device=DEV), torch.zeros(T, 1, device=DEV),
            torch.zeros(2, 1, D, D, device=DEV), torch.tensor([0], device=DEV),
            torch.tensor([0, T], device=DEV), torch.tensor([0, T]))  # fmt: skip
    with pytest.raises(ValueError, match="fuse_output needs wy_in_pass=False"):
        gdn_chunk.gdn_chunk_prefill_slots(
            *args, scale=1.0, use_qk_l2norm=False, wy_in_pass=True, fuse_output=True
        )
    with pytest.raises(ValueError, match="2 or 4 warps a program, got num_warps=8"):
        gdn_chunk.gdn_chunk_prefill_slots(
            *args, scale=1.0, use_qk_l2norm=False, wy_in_pass=True, num_warps=8
        )
    before = args[5].clone()
    with pytest.raises(ValueError, match=r"chunk_state_pass_wy: .* got num_warps=8"):
        gdn_chunk.chunk_state_pass_wy(
            x, x, torch.zeros(T, 1, device=DEV), torch.zeros(T, 1, BT, device=DEV),
            torch.zeros(T, 1, device=DEV), args[5], args[6], args[7],
            torch.tensor([0, 1], device=DEV), 1, num_warps=8,
        )  # fmt: skip
    assert torch.equal(args[5], before)


@pytest.mark.parametrize("kda", [False, True])
def test_slot_pass_true_refuses_what_it_cannot_serve(kda):
    """``slot_pass=True`` where the slot pass cannot run raises, naming the family and what
    it needs: off CUDA (the interpreter) and, on CUDA, slots whose [Hv, Dk, Dv] is not packed
    (a transposed state)."""
    T, D = 4, 16
    q = torch.zeros(T, 1, D, device=DEV, dtype=torch.bfloat16)
    state = torch.zeros(2, 1, D, D, device=DEV)
    if DEV == "cuda":
        state = state.transpose(-1, -2)
    g = torch.zeros(T, 1, D, device=DEV) if kda else torch.zeros(T, 1, device=DEV)
    idx = torch.tensor([0], device=DEV, dtype=torch.int32)
    cu = torch.tensor([0, T], device=DEV)
    kind = "kda" if kda else "gdn"
    with pytest.raises(ValueError, match=rf"slot_pass=True \({kind} prefill\): needs CUDA"):
        K.prefill._delta_prefill(
            q, q, q, g, torch.zeros(T, 1, device=DEV), state, idx, cu, kda=kda, scale=None,
            use_qk_l2norm=False, out=None, cu_seqlens_cpu=None, slot_pass=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((37, 3, 128), torch.bfloat16), ((5, 2, 96), torch.float32), ((1, 1, 16), torch.float16)],
)
def test_l2norm_qk_matches_torch(shape, dtype):
    """Rows not a multiple of the block, a head dim not a power of two (masked columns), and
    each of q and k normalised by its own norms (not swapped, not shared)."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    k = (torch.randn(*shape, generator=g) * 0.1).to(dtype).to(DEV)
    qn, kn = gdn_chunk.l2norm_qk(q, k)
    for x, y in ((q, qn), (k, kn)):
        xf = x.float()
        want = xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y.float(), want, atol=1e-2 if dtype != torch.float32 else 1e-6,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)  # fmt: skip


def test_l2norm_qk_refuses_mismatched_inputs():
    q = torch.zeros(4, 2, 16, device=DEV)
    with pytest.raises(ValueError, match=r"one shape and dtype, got q \(4, 2, 16\)"):
        gdn_chunk.l2norm_qk(q, torch.zeros(4, 2, 32, device=DEV))


def test_first_that_fits_takes_the_first_candidate_under_the_limit(monkeypatch):
    """The shared-memory fit both the GDN state pass and the SSD scan use: candidates in order,
    the first whose compiled kernel fits; none fitting names every candidate's bytes."""
    from types import SimpleNamespace

    common = K._common
    monkeypatch.setattr(common, "max_shared_memory", lambda device: 100)
    needs = {4: 180, 3: 120, 2: 90, 1: 50}
    compiled = []

    def compile_one(st):
        compiled.append(st)
        return SimpleNamespace(metadata=SimpleNamespace(shared=needs[st]))

    assert common.first_that_fits([4, 3, 2, 1], compile_one, "cuda", "x", "stages") == 2
    assert compiled == [4, 3, 2]  # stops at the first fit
    with pytest.raises(ValueError, match=r"x fits in 100 bytes .* by stages: \{4: 180, 3: 120\}"):
        common.first_that_fits([4, 3], compile_one, "cuda", "x", "stages")


def test_first_that_fits_takes_the_smallest_candidate_where_triton_does_not_say_its_bytes(
    monkeypatch,
):
    """A compiled kernel's shared memory is read through the compat module: where the installed
    Triton does not report it (renamed, or a value that cannot be a size), the fit cannot be
    judged, so the last candidate (the smallest tiling) is used and ``attn list`` says why."""
    from types import SimpleNamespace

    from attn_plugin_triton_ssm import compat

    common = K._common
    monkeypatch.setattr(common, "max_shared_memory", lambda device: 100)
    monkeypatch.setattr(compat._State, "unsized", "")
    for compiled in (SimpleNamespace(), SimpleNamespace(metadata=SimpleNamespace(shared=-1))):
        compat._State.unsized = ""
        compile_one = lambda st, c=compiled: c  # noqa: E731
        assert common.first_that_fits([4, 3, 2], compile_one, "cuda", "x", "stages") == 2
        assert "kernel shared memory unreadable: the smallest tiling used" in compat.triton_note()
