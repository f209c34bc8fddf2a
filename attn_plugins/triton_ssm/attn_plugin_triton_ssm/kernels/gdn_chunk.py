"""Gated DeltaNet and KDA chunked prefill with the recurrent state read from and written to its
slots.

fla-core's ``chunk_gated_delta_rule`` and ``chunk_kda`` take the initial states as a dense
``[N, Hv, K, V]`` tensor and return the final states likewise, so a caller whose states live in
slots of a pool gathers them before and scatters them after: two extra passes over
``N * Hv * K * V`` float32 (16 sequences of Qwen3-Next's 32 heads: 34 MB each way, ~10 % of a
T = 8192 prefill).

Here fla's stages run as in its forward - the chunk-local cumulative decay, the intra-chunk WY
representation (``w``, ``u``) and the output pass - and two are ours: the l2norm of q and k
(:func:`l2norm_qk`: one launch for both, where fla's two also store reciprocal norms that a
forward never reads; 30.8 against 33.1 us at T = 8192 on the H200) and the inter-chunk state
pass (GDN: 156.7 against fla's 159.8 us there): :func:`_chunk_state_kernel` loads each
sequence's initial state from ``ssm_state[state_indices[n]]``, walks its chunks and stores the
final state back into the same slot. What it writes for fla's output pass is what fla's own
state pass (``chunk_gated_delta_rule_fwd_h``) writes: the state entering every chunk ``h``
``[1, NT, Hv, K, V]`` (in k's dtype) and the corrected values ``v_new = u - w @ h``
``[1, T, Hv, V]``.

Per chunk of ``BT`` tokens (``g`` the chunk-local cumulative log2 decay, ``g_last`` its value at
the chunk's last token). Gated DeltaNet, one decay per head (fla's ``chunk_fwd_o`` reads the
result)::

    v_new = u - w @ h
    h     = exp2(g_last) * h + k^T @ (exp2(g_last - g) * v_new)

KDA, one decay per key channel (``g`` ``[T, Hv, K]``); fla's intra stage
(``chunk_kda_fwd_intra``) has folded the decay into ``w`` and into ``kg = k * exp2(g_last - g)``,
and ``chunk_gla_fwd_o_gk`` reads the result::

    v_new = u - w @ h
    h     = exp2(g_last)[:, None] * h + kg^T @ v_new

One long sequence gives the pass few programs (heads times value blocks), each a chain of
dependent dots through every chunk, so most SMs idle until it ends. For Gated DeltaNet the
output can then run beside it (:func:`chunk_state_output_beside`): one launch whose first
programs to start are the state pass and whose later ones compute fla's output formula for one
chunk each, as soon as the pass has stored that chunk's ``h`` and ``v_new`` (a per-head count
in global memory, released by the pass, acquired by the outputs).

fla's internal functions come from :mod:`attn_plugin_triton_ssm.compat` (gated by fla-core's
release, self-checked against fla's public function on the GPU, each family on its own);
:func:`unavailable` says why this path cannot run, and the prefill wrapper then gathers and
scatters around fla's public function instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm import compat
from attn_plugin_triton_ssm.kernels._common import INTERPRETED, first_that_fits

__all__ = [
    "CHUNK",
    "chunk_state_output_beside",
    "chunk_state_output_pass",
    "chunk_state_pass",
    "gdn_chunk_prefill_slots",
    "kda_chunk_prefill_slots",
    "l2norm_qk",
    "unavailable",
]

#: fla's chunk size for Gated DeltaNet and KDA (the default of both; their stages are
#: compiled for it).
CHUNK = 64


def unavailable(kind: compat.Kind = "gdn") -> str | None:
    """Why :func:`gdn_chunk_prefill_slots` (``kind`` ``"gdn"``) or
    :func:`kda_chunk_prefill_slots` (``"kda"``) cannot run here (fla-core's release, its
    internals, a failed self-check: :func:`attn_plugin_triton_ssm.compat.slot_pass_reason`),
    or None."""
    return compat.slot_pass_reason(None, kind)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` in float32; ``UPCAST`` (Triton's interpreter, whose 16-bit dots are wrong):
    the operands, already rounded to the input dtype, multiplied in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["slot_stride"])
def _chunk_state_kernel(
    k_ptr,  # [T, H, K] (l2-normalised keys; KDA: fla's kg, [T, HV, K]), k dtype
    w_ptr,  # [T, HV, K]
    u_ptr,  # [T, HV, V]
    g_ptr,  # [T, HV] (KDA: [T, HV, K]) float32, chunk-local cumulative log2 decay
    h_ptr,  # [NT_total, HV, K, V] out: the state entering each chunk, k dtype
    v_new_ptr,  # [T, HV, V] out
    state_ptr,  # [S, HV, K, V] float32 / bfloat16 slots, read then overwritten
    slot_ptr,  # [N] slots
    cu_ptr,  # [N + 1] token offsets
    chunk_off_ptr,  # [N + 1] chunk offsets
    q_ptr,  # [T, H, K] (l2-normalised queries), k dtype; FUSE_O only
    o_ptr,  # [T, HV, V] out, u dtype; FUSE_O only
    scale,
    slot_stride,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSE_O: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``: one program carries a ``[K, BV]`` block of one head's
    state through every chunk of one sequence. ``GK`` (KDA): the decay is per key channel, ``g``
    ``[T, HV, K]``, and ``k`` already carries each token's decay to the chunk's end (fla's
    ``kg``), so the state's rows decay by ``exp2(g_last)`` and ``v_new`` enters undecayed.
    ``UPCAST``: see :func:`_dot`.

    ``FUSE_O`` (Gated DeltaNet only): the chunk's output as fla's ``chunk_fwd_o`` computes it
    from ``h`` and ``v_new`` (both rounded to the inputs' dtype, as fla stores them), here from
    the registers that hold them, so neither is written::

        o = scale * (exp2(g) * (q @ h) + (causal(q @ k^T) * exp2(g_i - g_j)) @ v_new)

    The loop is a chain of dependent dots, so its length is latency: each tile's addresses are
    a scalar base per chunk (advanced by a constant) plus int32 offsets computed once, rather
    than int64 arithmetic per element per chunk."""
    _state_program(
        tl.program_id(0), tl.program_id(1), k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr,
        state_ptr, slot_ptr, cu_ptr, chunk_off_ptr, q_ptr, o_ptr, slot_ptr, scale, slot_stride,
        H, HV, K, V, BT, BK, BV, GK, UPCAST, FUSE_O, False, 1,
    )  # fmt: skip


@triton.jit
def _state_program(
    i_v, i_nh, k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr, state_ptr, slot_ptr, cu_ptr,
    chunk_off_ptr, q_ptr, o_ptr, progress_ptr, scale, slot_stride, H: tl.constexpr,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, GK: tl.constexpr, UPCAST: tl.constexpr, FUSE_O: tl.constexpr,
    SIGNAL: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    """Value block ``i_v`` of head and sequence ``i_nh`` (``n * HV + head``) through every chunk
    of its sequence: :func:`_chunk_state_kernel`'s program. ``SIGNAL``: for the output
    programs of :func:`_state_output_beside_kernel`, each of the program's ``THREADS``
    threads adds 1 with release to its count ``progress_ptr[i_nh * cdiv(V, BV) + i_v]`` at
    the start of every chunk and once after the last, so a count of ``(c + 2) * THREADS``
    says every thread has stored chunk ``c``'s ``h`` and ``v_new`` and whoever reads it sees
    them. Each thread's release orders its own stores, and a barrier between two adds (the
    chunk's dots pass operands through shared memory) keeps any thread from adding twice
    before every thread has added once. The adds come a chunk after the stores, which are
    done by then, so the release waits on nothing."""
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // (HV // H)  # the key head this value head reads (GQA-style grouping)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    T = (tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    first_chunk = tl.load(chunk_off_ptr + i_n).to(tl.int64)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # offsets inside one chunk's tiles (int32, the same for every chunk)
    kv_offs = o_k[:, None] * V + o_v[None, :]
    w_offs = o_t[:, None] * (HV * K) + o_k[None, :]
    u_offs = o_t[:, None] * (HV * V) + o_v[None, :]
    k_offs = o_t[:, None] * (H * K) + o_k[None, :]
    g_offs = o_t * HV  # GDN's per-head decay of each token
    # per-chunk bases, advanced by one chunk per iteration
    p_w = w_ptr + bos * (HV * K) + i_h * K
    p_u = u_ptr + bos * (HV * V) + i_h * V
    p_vn = v_new_ptr + bos * (HV * V) + i_h * V
    p_k = k_ptr + bos * (H * K) + i_hk * K
    if GK:
        p_g = g_ptr + (bos * HV + i_h) * K
    else:
        p_g = g_ptr + bos * HV + i_h
    p_h = h_ptr + (first_chunk * HV + i_h) * (K * V)
    p_state = state_ptr + slot * slot_stride + i_h * K * V + kv_offs
    p_q = q_ptr + bos * (H * K) + i_hk * K
    p_o = o_ptr + bos * (HV * V) + i_h * V
    b_h = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)

    if SIGNAL:
        p_count = progress_ptr + i_nh * tl.cdiv(V, BV) + i_v + tl.zeros([THREADS], tl.int32)
    for i_t in range(tl.cdiv(T, BT)):
        if SIGNAL:  # chunk i_t - 1's h and v_new are stored (see the docstring)
            tl.atomic_add(p_count, 1, sem="release", scope="gpu")
        left = T - i_t * BT  # tokens from this chunk's start to the sequence's end
        m_t = o_t < left
        if not FUSE_O:  # the state entering this chunk, for fla's output pass
            tl.store(p_h + kv_offs, b_h.to(h_ptr.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(p_w + w_offs, mask=m_tk, other=0.0)
        b_u = tl.load(p_u + u_offs, mask=m_tv, other=0.0)
        b_hq = b_h.to(b_w.dtype)
        b_v = b_u.to(tl.float32) - _dot(b_w, b_hq, UPCAST)
        if FUSE_O:
            # fla's output pass on this chunk (see the docstring); independent of the state
            # update below, so the two chains of dots can overlap
            b_q = tl.load(p_q + k_offs, mask=m_tk, other=0.0)
            b_kt = tl.load(p_k + k_offs, mask=m_tk, other=0.0)
            b_gt = tl.load(p_g + g_offs, mask=m_t, other=0.0).to(tl.float32)
            b_o = _dot(b_q, b_hq, UPCAST) * tl.exp2(b_gt)[:, None]
            b_a = _dot(b_q, tl.trans(b_kt), UPCAST) * tl.exp2(b_gt[:, None] - b_gt[None, :])
            causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
            b_a = tl.where(causal, b_a, 0.0)
            b_vo = b_v.to(b_kt.dtype)  # v_new as fla's pass reads it
            b_o = b_o * scale + _dot(b_a.to(b_vo.dtype), b_vo, UPCAST) * scale
            tl.store(p_o + u_offs, b_o.to(o_ptr.dtype.element_ty), mask=m_tv)
        else:
            tl.store(p_vn + u_offs, b_v.to(v_new_ptr.dtype.element_ty), mask=m_tv)
        # decay to the chunk's end, then add the chunk's keys times its decayed values
        last = tl.minimum(left, BT) - 1
        if GK:  # per key channel: the rows of h; the tokens' decay is in k already
            g_last = tl.load(p_g + last * (HV * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_decay = tl.exp2(g_last)[:, None]
        else:  # per head: all of h, and each token's value by its decay to the chunk's end
            g_last = tl.load(p_g + last * HV).to(tl.float32)
            b_g = tl.load(p_g + g_offs, mask=m_t, other=0.0).to(tl.float32)
            b_v = b_v * tl.where(m_t, tl.exp2(g_last - b_g), 0.0)[:, None]
            b_decay = tl.exp2(g_last)
        if FUSE_O:
            b_k = b_kt  # loaded for the output above
        else:
            b_k = tl.load(p_k + k_offs, mask=m_tk, other=0.0)
        b_vq = b_v.to(b_k.dtype)
        b_h = b_h * b_decay + _dot(tl.trans(b_k), b_vq, UPCAST)
        p_w += BT * HV * K
        p_u += BT * HV * V
        p_vn += BT * HV * V
        p_k += BT * H * K
        p_q += BT * H * K
        p_o += BT * HV * V
        if GK:
            p_g += BT * HV * K
        else:
            p_g += BT * HV
        p_h += HV * K * V

    if SIGNAL:  # the last chunk's h and v_new are stored
        tl.atomic_add(p_count, 1, sem="release", scope="gpu")
    tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_kv)


@triton.jit
def _output_program(
    j, q_ptr, k_ptr, g_ptr, a_ptr, h_ptr, v_new_ptr, o_ptr, cu_ptr, chunk_off_ptr,
    chunk_idx_ptr, progress_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVO: tl.constexpr,
    GK: tl.constexpr, UPCAST: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    """Output program ``j`` of :func:`_state_output_beside_kernel`: chunk ``j // (HV * nvo)``
    (``nvo = cdiv(V, BVO)``), then head, then ``BVO``-wide value block. Waits until every
    value block of its head's state pass has stored the chunk's ``h`` and ``v_new``, then
    computes fla's output pass on them: Gated DeltaNet's ``chunk_fwd_o``::

        o = scale * (exp2(g) * (q @ h) + (causal(q @ k^T) * exp2(g_i - g_j)) @ v_new)

    or (``GK``, KDA's per-channel decay ``g`` ``[T, HV, K]``) ``chunk_gla_fwd_o_gk``, with
    fla's intra-chunk attention ``A`` ``[T, HV, BT]`` (scaled already)::

        o = scale * (q * exp2(g)) @ h + causal(A) @ v_new
    """
    n_vo = tl.cdiv(V, BVO)
    i_c = j // (HV * n_vo)
    i_h = (j // n_vo) % HV
    i_vo = j % n_vo
    i_hk = i_h // (HV // H)
    i_n = tl.load(chunk_idx_ptr + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_idx_ptr + 2 * i_c + 1).to(tl.int32)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    T = (tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    first_chunk = tl.load(chunk_off_ptr + i_n).to(tl.int64)
    # the state programs (value blocks) whose columns this program reads: each has stored
    # chunk i_t once its count reaches (i_t + 2) * THREADS (see _state_program)
    n_v = tl.cdiv(V, BV)
    p_progress = progress_ptr + (i_n * HV + i_h) * n_v
    for i_v in range((i_vo * BVO) // BV, tl.minimum(((i_vo + 1) * BVO + BV - 1) // BV, n_v)):
        done = tl.atomic_add(p_progress + i_v, 0, sem="acquire", scope="gpu")
        while done < (i_t + 2) * THREADS:
            done = tl.atomic_add(p_progress + i_v, 0, sem="acquire", scope="gpu")

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_vo * BVO + tl.arange(0, BVO)
    m_t = o_t < T - i_t * BT
    m_k = o_k < K
    m_v = o_v < V
    t0 = bos + i_t * BT
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    k_offs = (t0 + o_t)[:, None] * (H * K) + i_hk * K + o_k[None, :]
    v_offs = (t0 + o_t)[:, None] * (HV * V) + i_h * V + o_v[None, :]
    b_q = tl.load(q_ptr + k_offs, mask=m_tk, other=0.0)
    # written by other programs during this launch: read past L1 (.cg), after the count
    p_h = h_ptr + ((first_chunk + i_t) * HV + i_h) * (K * V)
    b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                  other=0.0, cache_modifier=".cg")  # fmt: skip
    b_vn = tl.load(v_new_ptr + v_offs, mask=m_tv, other=0.0, cache_modifier=".cg")
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if GK:
        g_offs = (t0 + o_t)[:, None] * (HV * K) + i_h * K + o_k[None, :]
        b_gk = tl.load(g_ptr + g_offs, mask=m_tk, other=0.0).to(tl.float32)
        b_qg = (b_q * tl.exp2(b_gk)).to(b_q.dtype)
        a_offs = (t0 + o_t)[:, None] * (HV * BT) + i_h * BT + o_t[None, :]
        b_a = tl.load(a_ptr + a_offs, mask=m_t[:, None], other=0.0)
        b_a = tl.where(causal, b_a, 0.0)
        b_o = _dot(b_qg, b_h, UPCAST) * scale + _dot(b_a.to(b_vn.dtype), b_vn, UPCAST)
    else:
        b_k = tl.load(k_ptr + k_offs, mask=m_tk, other=0.0)
        b_g = tl.load(g_ptr + (t0 + o_t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_o = _dot(b_q, b_h, UPCAST) * tl.exp2(b_g)[:, None]
        b_a = _dot(b_q, tl.trans(b_k), UPCAST) * tl.exp2(b_g[:, None] - b_g[None, :])
        b_a = tl.where(causal, b_a, 0.0)
        b_o = b_o * scale + _dot(b_a.to(b_vn.dtype), b_vn, UPCAST) * scale
    tl.store(o_ptr + v_offs, b_o.to(o_ptr.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["slot_stride", "n_state"])
def _state_output_beside_kernel(
    k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr, state_ptr, slot_ptr, cu_ptr, chunk_off_ptr,
    q_ptr, o_ptr, a_ptr, chunk_idx_ptr, sync_ptr, scale, slot_stride, n_state,
    H: tl.constexpr, HQ: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVO: tl.constexpr, GK: tl.constexpr,
    UPCAST: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    """The state pass and fla's output pass in one launch, side by side (Gated DeltaNet; with
    ``GK`` KDA: ``k`` is fla's ``kg`` ``[T, HV, K]``, ``a_ptr`` its intra-chunk attention;
    ``H`` counts k's heads, ``HQ`` q's). The first ``n_state`` programs to start are the state
    pass (:func:`_state_program`, grid order ``(value block, n * HV + head)`` flattened),
    every later one computes one chunk's output for one head and ``BVO`` values
    (:func:`_output_program`) once the pass has stored that chunk. One long sequence's pass
    has few programs (heads times value blocks), each a chain of dependent dots, and leaves
    most of the GPU idle; the outputs fill it.

    ``sync_ptr`` ``[1 + n_state]`` int32, zeros: a ticket counter, then each state program's
    count of stored chunks (:func:`_state_program`). A program's role comes from its
    ticket, taken when it starts, not from its program id: every state program has started
    before any output program waits, and a state program never waits, so the launch cannot
    deadlock whatever order the hardware starts programs in."""
    ticket = tl.atomic_add(sync_ptr, 1)
    n_v = tl.cdiv(V, BV)
    if ticket < n_state:
        _state_program(
            ticket % n_v, ticket // n_v, k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr,
            state_ptr, slot_ptr, cu_ptr, chunk_off_ptr, q_ptr, o_ptr, sync_ptr + 1, scale,
            slot_stride, H, HV, K, V, BT, BK, BV, GK, UPCAST, False, True, THREADS,
        )  # fmt: skip
    else:
        _output_program(
            ticket - n_state, q_ptr, k_ptr, g_ptr, a_ptr, h_ptr, v_new_ptr, o_ptr, cu_ptr,
            chunk_off_ptr, chunk_idx_ptr, sync_ptr + 1, scale, HQ, HV, K, V, BT, BK, BV, BVO, GK,
            UPCAST, THREADS,
        )  # fmt: skip


@triton.jit
def _l2norm_rows(x_ptr, y_ptr, row0, rows, eps, D: tl.constexpr, BR: tl.constexpr,
                 BD: tl.constexpr):  # fmt: skip
    o_r = row0 + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    mask = (o_r < rows)[:, None] & (o_d < D)[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) + eps))[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _l2norm_qk_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, rows, eps, D: tl.constexpr,
                      BR: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Grid ``(cdiv(rows, BR), 2)``: axis 1 picks q or k; ``BR`` rows of ``D`` per program."""
    row0 = tl.program_id(0).to(tl.int64) * BR
    if tl.program_id(1) == 0:
        _l2norm_rows(q_ptr, qn_ptr, row0, rows, eps, D, BR, BD)
    else:
        _l2norm_rows(k_ptr, kn_ptr, row0, rows, eps, D, BR, BD)


def l2norm_qk(
    q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6, *, block_rows: int = 16,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x / sqrt(sum(x**2, -1) + eps)`` of q and of k in one launch (fla's ``l2norm_fwd``
    formula; fla normalises each in its own launch and also stores the reciprocal norms, which
    a forward pass never reads).

    :param q: ``[..., D]`` contiguous; ``k`` the same shape and dtype.
    :returns: ``(q_normed, k_normed)``, new tensors of the inputs' shape and dtype; the sums of
        squares are taken in float32.
    """
    if q.shape != k.shape or q.dtype != k.dtype or not (q.is_contiguous() and k.is_contiguous()):
        raise ValueError(
            f"l2norm_qk: expected contiguous q and k of one shape and dtype, got q "
            f"{tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype}"
        )
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    D = q.shape[-1]
    rows = q.numel() // D if D else 0
    if rows:
        grid = (triton.cdiv(rows, block_rows), 2)
        _l2norm_qk_kernel[grid](
            q, k, qn, kn, rows, eps, D=D, BR=block_rows, BD=triton.next_power_of_2(D),
            num_warps=num_warps,
        )  # fmt: skip
    return qn, kn


def _tiling(num_programs_bv64: int, V: int) -> tuple[int, int]:
    """``(BV, num_stages)``: 32-wide value blocks with 4 stages when blocks of 64 would leave
    SMs idle (one long sequence: the pass is a chain of chunks, so parallelism comes from heads
    and value blocks only), else 64 with 2: (32, 4) ran fastest for one long sequence (about
    15 % ahead of (64, 2)), (64, 2) for 16 sequences (``bench_ssm.py --prefill``, 32 value
    heads, d 128). Float32 inputs get fewer stages where these do not fit (see
    :func:`_fit_stages`). KDA's pass (the same loads and dots, plus a ``[K]`` row of decay per
    chunk) takes the same choice; ``bench_ssm.py --prefill`` times it against fla."""
    sms = _sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    return (32, 4) if num_programs_bv64 < 2 * sms or V < 64 else (64, 2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def chunk_state_pass(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inter-chunk state pass over slots (see the module docstring).

    :param k: ``[T, H, K]`` keys (already l2-normalised when the layer asks for it); for KDA
        fla's ``kg`` ``[T, HV, K]``: the keys times each token's decay to its chunk's end.
    :param w: ``[T, HV, K]``, ``u``: ``[T, HV, V]`` fla's WY representation of each chunk.
    :param g: float32 chunk-local cumulative log2 decay: ``[T, HV]`` per head (Gated
        DeltaNet), or ``[T, HV, K]`` per key channel (KDA; ``k`` is then ``kg``).
    :param ssm_state: ``[S, HV, K, V]`` float32/bfloat16, each slot's ``[HV, K, V]`` contiguous.
    :param state_indices: ``[N]`` distinct slots; ``cu_seqlens``: ``[N + 1]`` token offsets;
        ``chunk_offsets``: ``[N + 1]`` offsets of each sequence's chunks (``num_chunks`` total).
    :returns: ``h`` ``[1, num_chunks, HV, K, V]`` in k's dtype and ``v_new`` like ``u``
        (``[1, T, HV, V]``), the tensors fla's ``chunk_fwd_o`` reads.
    """
    K, (HV, V) = k.shape[2], u.shape[1:]
    h = k.new_empty(1, num_chunks, HV, K, V)
    v_new = torch.empty_like(u)
    _launch_pass(k, w, u, g, ssm_state, state_indices, cu_seqlens, chunk_offsets, h=h,
                 v_new=v_new, q=None, o=None, scale=1.0, block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages)  # fmt: skip
    return h, v_new[None]


def chunk_state_output_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    *,
    scale: float,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Gated DeltaNet's state pass and output in one pass: :func:`chunk_state_pass` with fla's
    ``chunk_fwd_o`` computed chunk by chunk from the registers holding ``h`` and ``v_new``, so
    neither is written to memory nor read back (at T = 8192 with 32 heads of 128, ``h`` alone
    is 128 MiB each way).

    :param q: ``[T, H, K]`` queries (already l2-normalised when the layer asks for it), k's
        dtype; ``k``, ``w``, ``u``, ``g`` (``[T, HV]``, per head) and the rest as
        :func:`chunk_state_pass`.
    :param scale: the query scale.
    :returns: the output ``o`` ``[T, HV, V]`` in u's dtype; the slots hold the final states.
    """
    if q.shape != k.shape or q.dtype != k.dtype:
        raise ValueError(
            f"chunk_state_output_pass: q must be like k [T, H, K] {k.dtype}, got "
            f"{list(q.shape)} {q.dtype} and k {list(k.shape)}"
        )
    if g.dim() != 2:
        raise ValueError(
            f"chunk_state_output_pass: Gated DeltaNet's per-head decay g [T, HV] only (KDA's "
            f"output pass reads fla's intra-chunk attention), got g {list(g.shape)}"
        )
    o = torch.empty_like(u)
    _launch_pass(k, w, u, g, ssm_state, state_indices, cu_seqlens, chunk_offsets, h=o,
                 v_new=o, q=q, o=o, scale=scale, block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages)  # fmt: skip
    return o


def chunk_state_output_beside(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    scale: float,
    attn: torch.Tensor | None = None,
    block_v: int | None = None,
    block_vo: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """The state pass with fla's output pass beside it, in one launch
    (:func:`_state_output_beside_kernel`): each chunk's output is computed as soon as the pass
    has stored the chunk's ``h`` and ``v_new``, on the SMs the pass leaves idle, in place of
    :func:`chunk_state_pass` followed by fla's output pass (Gated DeltaNet's ``chunk_fwd_o``,
    KDA's ``chunk_gla_fwd_o_gk``). The same arithmetic on the same rounded ``h`` and
    ``v_new`` as that pair.

    :param q: ``[T, H, K]`` queries (already l2-normalised when the layer asks for it), k's
        dtype; ``k``, ``w``, ``u``, ``g`` (``[T, HV]`` per head, or KDA's ``[T, HV, K]`` per
        key channel with ``k`` fla's ``kg``), the slots and offsets as
        :func:`chunk_state_pass`.
    :param chunk_indices: ``[num_chunks, 2]`` int64, (sequence, chunk within it) of every
        chunk in order (fla's ``prepare_chunk_indices``).
    :param attn: KDA only (and required there): fla's intra-chunk attention ``Aqk``
        ``[T, HV, 64]``, scaled, which the output pass reads in place of ``q @ k^T``.
    :param block_vo: values per output program; ``num_stages``: the state pass's pipeline
        depth (2 by default: deeper pipelines take the shared memory an output program
        would run in beside it).
    :returns: the output ``o`` ``[T, HV, V]`` in u's dtype; the slots hold the final states.
    """
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    per_channel = g.dim() == 3
    if g.shape != ((T, HV, K) if per_channel else (T, HV)):
        raise ValueError(
            f"chunk_state_output_beside: g must be [T, HV] (per-head decay) or [T, HV, K] (per "
            f"key channel) with T={T}, HV={HV}, K={K}, got {list(g.shape)}"
        )
    if per_channel != (attn is not None):
        raise ValueError(
            "chunk_state_output_beside: a per-channel decay (KDA) reads fla's intra-chunk "
            "attention: pass attn [T, HV, 64] with g [T, HV, K], and neither with g [T, HV]; got "
            f"g {list(g.shape)}, attn {None if attn is None else list(attn.shape)}"
        )
    if attn is not None and attn.shape != (T, HV, CHUNK):
        raise ValueError(
            f"chunk_state_output_beside: attn must be [T, HV, {CHUNK}] = [{T}, {HV}, {CHUNK}], "
            f"got {list(attn.shape)}"
        )
    if q.shape[0] != T or q.shape[2] != K or q.dtype != k.dtype or HV % q.shape[1]:
        raise ValueError(
            f"chunk_state_output_beside: q must be [T={T}, H, K={K}] in {k.dtype} with H "
            f"dividing HV={HV}, got {list(q.shape)} {q.dtype}"
        )
    if not per_channel and q.shape != k.shape:
        raise ValueError(
            f"chunk_state_output_beside: q must be like k {list(k.shape)}, got {list(q.shape)}"
        )
    n_chunks = chunk_indices.shape[0]
    if chunk_indices.shape != (n_chunks, 2):
        raise ValueError(
            f"chunk_state_output_beside: chunk_indices must be [num_chunks, 2] (sequence, "
            f"chunk), got {list(chunk_indices.shape)}"
        )
    o = torch.empty_like(u)
    N = state_indices.shape[0]
    if not N or not T:
        return o
    h = k.new_empty(n_chunks, HV, K, V)
    v_new = torch.empty_like(u)
    BV = block_v or _tiling(triton.cdiv(V, 64) * N * HV, V)[0]
    n_state = triton.cdiv(V, BV) * N * HV
    # the ticket counter, then each state program's count of stored chunks
    sync = torch.zeros(1 + n_state, dtype=torch.int32, device=k.device)
    grid = (n_state + n_chunks * HV * triton.cdiv(V, block_vo),)

    def launch(stages: int, warmup: bool = False):
        args = (k, w, u, g, h, v_new, ssm_state, state_indices, cu_seqlens, chunk_offsets, q, o,
                u if attn is None else attn, chunk_indices, sync, float(scale),
                ssm_state.stride(0), n_state)  # fmt: skip
        kw = dict(H=H, HQ=q.shape[1], HV=HV, K=K, V=V, BT=CHUNK,
                  BK=max(16, triton.next_power_of_2(K)), BV=BV, BVO=block_vo, GK=per_channel,
                  UPCAST=INTERPRETED,
                  THREADS=32 * num_warps, num_warps=num_warps, num_stages=stages)  # fmt: skip
        if warmup:
            return _state_output_beside_kernel.warmup(*args, grid=grid, **kw)
        return _state_output_beside_kernel[grid](*args, **kw)

    key = ("beside", k.device, k.dtype, ssm_state.dtype, q.shape[1], HV, K, V, BV, block_vo,
           per_channel, num_warps, num_stages)  # fmt: skip
    fitted = _FITTED_STAGES.get(key)
    if fitted is None:
        fitted = _FITTED_STAGES[key] = _fit_stages(launch, num_stages, k.device)
    launch(fitted)
    return o


def _launch_pass(k, w, u, g, ssm_state, state_indices, cu_seqlens, chunk_offsets, *, h, v_new,
                 q, o, scale, block_v, num_warps, num_stages) -> None:  # fmt: skip
    """One launch of :func:`_chunk_state_kernel` (``q`` given: with the output, ``FUSE_O``;
    ``h`` and ``v_new`` then unwritten placeholders)."""
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    per_channel = g.dim() == 3
    if g.shape != ((T, HV, K) if per_channel else (T, HV)):
        raise ValueError(
            f"chunk_state_pass: g must be [T, HV] (per-head decay) or [T, HV, K] (per key "
            f"channel) with T={T}, HV={HV}, K={K}, got {list(g.shape)}"
        )
    if per_channel and H != HV:
        raise ValueError(
            f"chunk_state_pass: a per-channel decay takes fla's kg [T, HV, K] as k (one key "
            f"row per value head), got k {list(k.shape)} for {HV} value heads"
        )
    N = state_indices.shape[0]
    if not N or not T:
        return
    fuse = q is not None
    BV, stages = _tiling(triton.cdiv(V, 64) * N * HV, V)
    BV, stages = block_v or BV, num_stages or stages
    grid = (triton.cdiv(V, BV), N * HV)

    def launch(stages: int, warmup: bool = False):
        args = (k, w, u, g, h, v_new, ssm_state, state_indices, cu_seqlens, chunk_offsets,
                q if fuse else k, o if fuse else u, float(scale), ssm_state.stride(0))  # fmt: skip
        kw = dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, triton.next_power_of_2(K)), BV=BV,
                  GK=per_channel, UPCAST=INTERPRETED, FUSE_O=fuse, num_warps=num_warps,
                  num_stages=stages)  # fmt: skip
        if warmup:
            return _chunk_state_kernel.warmup(*args, grid=grid, **kw)
        return _chunk_state_kernel[grid](*args, **kw)

    key = (k.device, k.dtype, ssm_state.dtype, H, HV, K, V, BV, per_channel, fuse, num_warps,
           stages)  # fmt: skip
    fitted = _FITTED_STAGES.get(key)
    if fitted is None:
        fitted = _FITTED_STAGES[key] = _fit_stages(launch, stages, k.device)
    launch(fitted)


#: Pipeline stages of the state pass that fit the device's shared memory, by (device, dtypes,
#: shape, BV, warps, requested stages). See :func:`_fit_stages`.
_FITTED_STAGES: dict[tuple, int] = {}


def _fit_stages(launch, stages: int, device: torch.device) -> int:
    """The most pipeline stages, from ``stages`` down, whose compiled pass fits in the device's
    shared memory. Each stage buffers a chunk's ``w`` and ``k`` ``[BT, K]`` and ``u``
    ``[BT, BV]``: float32 inputs at d 128 take 72 KB a stage, so the 3 stages chosen for one
    long sequence need 246 KB where an H200 block has 227 KB. Compiled (``warmup``, no launch)
    and measured before anything is written, so a request's state is never half-updated."""
    if INTERPRETED or device.type != "cuda":
        return stages
    return first_that_fits(range(stages, 0, -1), lambda st: launch(st, warmup=True), device,
                           "chunk state pass (GDN / KDA): no pipeline depth", "stages")  # fmt: skip


def _plan(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f):
    """The steps both prefills share: a batch axis for fla, the l2norm, the chunk plan and
    the chunk-local cumulative log2 decay (per head or per key channel, by ``g``'s rank)."""
    q, k, v, g, beta = (t[None] for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm_qk(q, k)
    chunk_indices = f["chunk_indices"](cu_seqlens, CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    chunk_offsets = f["chunk_offsets"](cu_seqlens, CHUNK)
    g = f["cumsum"](
        g, chunk_size=CHUNK, scale=f["RCP_LN2"], cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )
    return q, k, v, g, beta, chunk_indices, chunk_offsets


def gdn_chunk_prefill_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm: bool,
    fuse_output: bool = False,
    output_beside: bool = False,
    **pass_options,
) -> torch.Tensor:
    """Gated DeltaNet chunked prefill on CUDA with fla's stages and our state pass over slots,
    then fla's ``chunk_fwd_o``; or the output computed in that pass (``fuse_output``,
    :func:`chunk_state_output_pass`), or beside it in the same launch (``output_beside``,
    :func:`chunk_state_output_beside`).

    :param q: ``[T, H, K]``, ``k`` likewise, ``v`` ``[T, HV, V]``, ``g`` ``[T, HV]`` log
        decay, ``beta`` ``[T, HV]`` (contiguous; checked by the caller).
    :param cu_seqlens: ``[N + 1]`` int64 device offsets (``cu_seqlens_cpu`` the same on the
        host, so that fla plans its chunks without reading the device).
    :returns: the output ``[T, HV, V]`` in v's dtype; the slots hold the final states.
    """
    f, reason = compat.stages("gdn")
    if reason:
        raise RuntimeError(reason)
    q, k, v, g, beta, chunk_indices, chunk_offsets = _plan(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f
    )
    w, u, _ = f["intra"](
        k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_size=CHUNK,
    )  # fmt: skip
    if fuse_output and output_beside:
        raise ValueError(
            "gdn_chunk_prefill_slots: fuse_output and output_beside exclude each other"
        )
    if fuse_output:
        return chunk_state_output_pass(
            q[0], k[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
            scale=scale, **pass_options,
        )  # fmt: skip
    if output_beside:
        return chunk_state_output_beside(
            q[0], k[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
            chunk_indices, scale=scale, **pass_options,
        )  # fmt: skip
    h, v_new = chunk_state_pass(
        k[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
        chunk_indices.shape[0], **pass_options,
    )  # fmt: skip
    o = f["chunk_fwd_o"](
        q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_size=CHUNK,
    )  # fmt: skip
    return o[0]


def kda_chunk_prefill_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm: bool,
    output_beside: bool = False,
    **pass_options,
) -> torch.Tensor:
    """KDA chunked prefill on CUDA with fla's stages and our state pass over slots: the stages
    of fla's ``chunk_kda`` forward (per-channel cumsum, ``chunk_kda_fwd_intra``, the output pass
    ``chunk_gla_fwd_o_gk``) around :func:`chunk_state_pass` with the per-channel decay; the
    output pass beside the state pass in one launch with ``output_beside``
    (:func:`chunk_state_output_beside`).

    :param q: ``[T, H, K]``, ``k`` likewise, ``v`` ``[T, HV, V]``, ``g`` ``[T, HV, K]`` log
        decay (natural log, as ``chunk_kda`` takes it), ``beta`` ``[T, HV]`` (contiguous;
        checked by the caller).
    :param cu_seqlens: ``[N + 1]`` int64 device offsets (``cu_seqlens_cpu`` the same on the
        host, so that fla plans its chunks without reading the device).
    :returns: the output ``[T, HV, V]`` in v's dtype; the slots hold the final states.
    """
    f, reason = compat.stages("kda")
    if reason:
        raise RuntimeError(reason)
    q, k, v, g, beta, chunk_indices, chunk_offsets = _plan(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f
    )
    # w, u: the WY representation; kg: k decayed to each chunk's end; Aqk: the intra-chunk
    # attention the output pass reads (qg and Akk are for fla's backward)
    w, u, _, kg, Aqk, _ = f["intra"](
        q=q, k=k, v=v, gk=g, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=CHUNK, chunk_indices=chunk_indices,
    )  # fmt: skip
    if output_beside:
        return chunk_state_output_beside(
            q[0], kg[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
            chunk_indices, scale=scale, attn=Aqk[0], **pass_options,
        )  # fmt: skip
    h, v_new = chunk_state_pass(
        kg[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
        chunk_indices.shape[0], **pass_options,
    )  # fmt: skip
    o = f["chunk_fwd_o"](
        q=q, v=v_new, g=g, A=Aqk, h=h, scale=scale, cu_seqlens=cu_seqlens, chunk_size=CHUNK,
        chunk_indices=chunk_indices,
    )  # fmt: skip
    return o[0]
