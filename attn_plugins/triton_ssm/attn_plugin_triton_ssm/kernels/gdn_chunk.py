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

fla's internal functions come from :mod:`attn_plugin_triton_ssm.compat` (gated by fla-core's
release, self-checked against fla's public function on the GPU, each family on its own);
:func:`unavailable` says why this path cannot run, and the prefill wrapper then gathers and
scatters around fla's public function instead.

For Gated DeltaNet batches that fill the GPU (by default; :func:`gdn_chunk_prefill_slots`), the
pass reads fla's solved ``(I + A)^-1``, the values and ``beta`` instead of ``w`` and ``u``,
folding fla's ``recompute_w_u`` in (:func:`chunk_state_pass_wy`). ``solve="ours"`` (opt-in)
replaces fla's cumsum and kkt-and-solve kernel with :func:`.gdn_solve.kkt_solve`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm import compat
from attn_plugin_triton_ssm.kernels import gdn_solve
from attn_plugin_triton_ssm.kernels._common import INTERPRETED, cdiv, first_that_fits, next_pow2

__all__ = [
    "CHUNK",
    "chunk_state_output_pass",
    "chunk_state_pass",
    "chunk_state_pass_wy",
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
    a_ptr,  # [T, HV, BT] fla's (I + A)^-1 per chunk, lower triangle only; WY only
    vin_ptr,  # [T, HV, V] the values; WY only
    beta_ptr,  # [T, HV]; WY only
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
    WY: tl.constexpr,
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

    ``WY`` (Gated DeltaNet only): ``w`` and ``u`` are not read but folded into the pass from
    fla's solved ``Ai = (I + A)^-1`` (``w = Ai @ (beta exp2(g) k)``, ``u = Ai @ (beta v)``)::

        v_new = Ai @ (beta v - (beta exp2(g) k) @ h)

    which needs one ``[BT, BT] x [BT, BV]`` dot more on the chain but no ``[BT, K]`` one, and
    spares fla's ``recompute_w_u`` its pass over k and v and the write and read of w and u. Only
    ``Ai``'s lower triangle is read (fla stores no other blocks), so it needs no zero-fill.

    The loop is a chain of dependent dots, so its length is latency: each tile's addresses are
    a scalar base per chunk (advanced by a constant) plus int32 offsets computed once, rather
    than int64 arithmetic per element per chunk."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
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
    p_a = a_ptr + (bos * HV + i_h) * BT
    p_vin = vin_ptr + bos * (HV * V) + i_h * V
    p_beta = beta_ptr + bos * HV + i_h
    a_offs = o_t[:, None] * (HV * BT) + o_t[None, :]
    lower = o_t[None, :] <= o_t[:, None]
    b_h = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(tl.cdiv(T, BT)):
        left = T - i_t * BT  # tokens from this chunk's start to the sequence's end
        m_t = o_t < left
        if not FUSE_O:  # the state entering this chunk, for fla's output pass
            tl.store(p_h + kv_offs, b_h.to(h_ptr.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if WY:
            # fla's recompute_w_u's operands (k * beta rounded to k's dtype, then the decay),
            # applied to h before Ai rather than to Ai before h
            b_k = tl.load(p_k + k_offs, mask=m_tk, other=0.0)
            b_hq = b_h.to(b_k.dtype)
            b_beta = tl.load(p_beta + g_offs, mask=m_t, other=0.0)
            b_gt = tl.load(p_g + g_offs, mask=m_t, other=0.0).to(tl.float32)
            b_kb = ((b_k * b_beta[:, None]) * tl.exp2(b_gt)[:, None]).to(b_k.dtype)
            b_vin = tl.load(p_vin + u_offs, mask=m_tv, other=0.0).to(tl.float32)
            b_x = b_vin * b_beta.to(tl.float32)[:, None] - _dot(b_kb, b_hq, UPCAST)
            b_a = tl.load(p_a + a_offs, mask=m_t[:, None] & lower, other=0.0)
            b_v = _dot(b_a.to(tl.float32), b_x, UPCAST)  # tf32: Ai exact, x to 10 bits
        else:
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
            if WY or FUSE_O:
                b_g = b_gt  # each token's decay, loaded above
            else:
                b_g = tl.load(p_g + g_offs, mask=m_t, other=0.0).to(tl.float32)
            b_v = b_v * tl.where(m_t, tl.exp2(g_last - b_g), 0.0)[:, None]
            b_decay = tl.exp2(g_last)
        if FUSE_O:
            b_k = b_kt  # loaded for the output above
        elif not WY:  # (WY loaded it for the values above)
            b_k = tl.load(p_k + k_offs, mask=m_tk, other=0.0)
        b_vq = b_v.to(b_k.dtype)
        b_h = b_h * b_decay + _dot(tl.trans(b_k), b_vq, UPCAST)
        p_w += BT * HV * K
        p_u += BT * HV * V
        p_vn += BT * HV * V
        p_k += BT * H * K
        p_q += BT * H * K
        p_o += BT * HV * V
        p_a += BT * HV * BT
        p_vin += BT * HV * V
        p_beta += BT * HV
        if GK:
            p_g += BT * HV * K
        else:
            p_g += BT * HV
        p_h += HV * K * V

    tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_kv)


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
        grid = (cdiv(rows, block_rows), 2)
        _l2norm_qk_kernel[grid](
            q, k, qn, kn, rows, eps, D=D, BR=block_rows, BD=next_pow2(D),
            num_warps=num_warps,
        )  # fmt: skip
    return qn, kn


def _tiling(num_seqs: int, HV: int, V: int) -> tuple[int, int]:
    """``(BV, num_stages)``: 32-wide value blocks with 4 stages when blocks of 64 would leave
    SMs idle (one long sequence: the pass is a chain of chunks, so parallelism comes from heads
    and value blocks only), else 64 with 2: (32, 4) ran fastest for one long sequence (about
    15 % ahead of (64, 2)), (64, 2) for 16 sequences (``bench_ssm.py --prefill``, 32 value
    heads, d 128). Float32 inputs get fewer stages where these do not fit (see
    :func:`_fit_stages`). KDA's pass (the same loads and dots, plus a ``[K]`` row of decay per
    chunk) takes the same choice; ``bench_ssm.py --prefill`` times it against fla."""
    return (64, 2) if _fills_the_gpu(num_seqs, HV, V) and V >= 64 else (32, 4)


def _fills_the_gpu(num_seqs: int, HV: int, V: int) -> bool:
    """Whether the state pass over ``num_seqs`` sequences of ``HV`` value heads of ``V``, in
    64-wide value blocks, has at least two programs per SM: the pass is then bound by the bytes
    it moves, not by the chain of a sequence's chunks."""
    return num_seqs * HV * cdiv(V, 64) >= 2 * _sm_count_here()


def _sm_count_here() -> int:
    """SMs of the current CUDA device; 132 (an H100's or H200's) without one."""
    return _sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132


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
                 v_new=v_new, q=None, o=None, scale=1.0, wy=None, block_v=block_v,
                 num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    return h, v_new[None]


def chunk_state_pass_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    Ai: torch.Tensor,
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
    """Gated DeltaNet's state pass with fla's ``recompute_w_u`` folded in (the kernel's ``WY``):
    it reads the values, ``beta`` and the solved ``Ai`` in place of ``w`` and ``u``.

    :param k: ``[T, H, K]`` keys (already l2-normalised when the layer asks for it).
    :param v: ``[T, HV, V]`` values, k's dtype; ``beta``: ``[T, HV]``.
    :param Ai: ``[T, HV, BT]`` in k's dtype: each chunk's ``(I + A)^-1`` as fla's fused
        kkt-and-solve kernel stores it (row ``t`` of a chunk at ``Ai[t]``, its columns the
        chunk's tokens); only the lower triangle is read.
    :param g: ``[T, HV]`` float32 chunk-local cumulative log2 decay; the rest as
        :func:`chunk_state_pass`, but ``num_warps`` 2 or 4 only.
    :returns: ``h`` ``[1, num_chunks, HV, K, V]`` in k's dtype and ``v_new`` ``[1, T, HV, V]``
        in v's dtype, as :func:`chunk_state_pass`.
    """
    T, HV = v.shape[:2]
    if g.shape != (T, HV) or beta.shape != (T, HV) or Ai.shape != (T, HV, CHUNK):
        raise ValueError(
            f"chunk_state_pass_wy: Gated DeltaNet's per-head decay g [T, HV], beta [T, HV] and "
            f"Ai [T, HV, {CHUNK}] with T={T}, HV={HV}; got g {list(g.shape)}, beta "
            f"{list(beta.shape)}, Ai {list(Ai.shape)}"
        )
    _check_wy_warps("chunk_state_pass_wy", num_warps)
    K, V = k.shape[2], v.shape[2]
    h = k.new_empty(1, num_chunks, HV, K, V)
    v_new = torch.empty_like(v)
    _launch_pass(k, k, v, g, ssm_state, state_indices, cu_seqlens, chunk_offsets, h=h,
                 v_new=v_new, q=None, o=None, scale=1.0, wy=(Ai, v, beta), block_v=block_v,
                 num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    return h, v_new[None]


def _check_wy_warps(caller: str, num_warps: int) -> None:
    # 8 warps a program faulted (an illegal address) on an H100 at 16 sequences, where the same
    # tiling ran clean for one and 4 warps at 16; not served until that is understood
    if num_warps not in (2, 4):
        raise ValueError(
            f"{caller}: the pass with the WY folded in runs on 2 or 4 warps a program, got "
            f"num_warps={num_warps}"
        )


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
                 v_new=o, q=q, o=o, scale=scale, wy=None, block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages)  # fmt: skip
    return o


def _launch_pass(k, w, u, g, ssm_state, state_indices, cu_seqlens, chunk_offsets, *, h, v_new,
                 q, o, scale, wy, block_v, num_warps, num_stages) -> None:  # fmt: skip
    """One launch of :func:`_chunk_state_kernel` (``q`` given: with the output, ``FUSE_O``;
    ``h`` and ``v_new`` then unwritten placeholders; ``wy`` given, ``(Ai, v, beta)``: ``WY``,
    ``w`` then unread and ``u`` the values)."""
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
    BV, stages = _tiling(N, HV, V)
    BV, stages = block_v or BV, num_stages or stages
    grid = (cdiv(V, BV), N * HV)

    Ai, v, beta = wy if wy is not None else (w, u, g)  # placeholders where not WY

    def launch(stages: int, warmup: bool = False):
        args = (k, w, u, g, h, v_new, ssm_state, state_indices, cu_seqlens, chunk_offsets,
                q if fuse else k, o if fuse else u, Ai, v, beta, float(scale),
                ssm_state.stride(0))  # fmt: skip
        kw = dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, next_pow2(K)), BV=BV,
                  GK=per_channel, UPCAST=INTERPRETED, FUSE_O=fuse, WY=wy is not None,
                  num_warps=num_warps, num_stages=stages)  # fmt: skip
        if warmup:
            return _chunk_state_kernel.warmup(*args, grid=grid, **kw)
        return _chunk_state_kernel[grid](*args, **kw)

    key = (k.device, k.dtype, ssm_state.dtype, H, HV, K, V, BV, per_channel, fuse,
           wy is not None, num_warps, stages)  # fmt: skip
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


def _plan(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f, cumsum=True):
    """The steps both prefills share: a batch axis for fla, the l2norm, the chunk plan and
    (``cumsum``) the chunk-local cumulative log2 decay (per head or per key channel, by ``g``'s
    rank)."""
    q, k, v, g, beta = (t[None] for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm_qk(q, k)
    chunk_indices = f["chunk_indices"](cu_seqlens, CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    chunk_offsets = f["chunk_offsets"](cu_seqlens, CHUNK)
    if cumsum:
        g = f["cumsum"](
            g, chunk_size=CHUNK, scale=f["RCP_LN2"], cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
        )  # fmt: skip
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
    wy_in_pass: bool | None = None,
    solve: str = "fla",
    out: torch.Tensor | None = None,
    **pass_options,
) -> torch.Tensor:
    """Gated DeltaNet chunked prefill on CUDA with fla's stages and our state pass over slots:
    fla's intra-chunk stage (``w``, ``u``), then :func:`chunk_state_pass`; or, where the batch
    fills the GPU, fla's fused kkt-and-solve kernel only, its ``recompute_w_u`` folded into the
    pass (:func:`chunk_state_pass_wy`).

    ``wy_in_pass``: None (the default) folds where the pass's 64-wide value blocks give at
    least two programs per SM (:func:`_fills_the_gpu`: many sequences, where the bytes it saves
    count: at 16 sequences 0.81-0.82 of fla's time on an H100 and 0.89-0.92 on an H200,
    against 0.90-0.99 unfolded in the same runs) and not where they do not (one long sequence,
    whose pass is a chain of chunks that the extra dot lengthens: 1.25-1.3x slower), nor with
    ``fuse_output`` or a ``num_warps`` other than 2 or 4; True or False forces it (True: 2 or
    4 warps a program). ``fuse_output`` (not with
    ``wy_in_pass=True``): the output computed in the pass, :func:`chunk_state_output_pass`, in
    place of fla's ``chunk_fwd_o`` after it. ``solve``: ``"fla"`` (the default) runs fla's
    cumsum and its kkt-and-solve kernel (and its ``recompute_w_u`` over a zero-filled
    ``(I + A)^-1``); ``"ours"`` (opt-in: checked in Triton's interpreter against the float64
    solve and fla's naive recurrence, not yet run on a GPU) computes each chunk's
    ``(I + A)^-1`` and the decay's chunk-local cumsum in one kernel
    (:func:`.gdn_solve.kkt_solve`), then fla's ``recompute_w_u`` where the pass does not fold
    it in.

    :param q: ``[T, H, K]``, ``k`` likewise, ``v`` ``[T, HV, V]``, ``g`` ``[T, HV]`` log
        decay, ``beta`` ``[T, HV]`` (contiguous; checked by the caller).
    :param cu_seqlens: ``[N + 1]`` int64 device offsets (``cu_seqlens_cpu`` the same on the
        host, so that fla plans its chunks without reading the device).
    :param out: ``[T, HV, V]``, any float dtype: fla's output pass writes into it directly when
        it is contiguous and shares no memory with ``q`` or ``k`` (else the output is copied
        into it).
    :returns: ``out``, or a new ``[T, HV, V]`` in v's dtype; the slots hold the final states.
    """
    if solve not in ("ours", "fla"):
        raise ValueError(f"gdn_chunk_prefill_slots: solve: expected 'ours' or 'fla', got {solve!r}")
    if wy_in_pass and fuse_output:
        raise ValueError("gdn_chunk_prefill_slots: fuse_output needs wy_in_pass=False")
    num_warps = pass_options.get("num_warps", 4)
    if wy_in_pass is None:
        fills = _fills_the_gpu(state_indices.shape[0], v.shape[1], v.shape[2])
        wy_in_pass = not fuse_output and num_warps in (2, 4) and fills
    if wy_in_pass:
        _check_wy_warps("gdn_chunk_prefill_slots", num_warps)
    f, reason = compat.stages("gdn")
    if reason:
        raise RuntimeError(reason)
    callers = (q, k)
    q, k, v, g, beta, chunk_indices, chunk_offsets = _plan(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f, cumsum=solve == "fla"
    )
    if solve == "ours":  # the solve also takes the decay's chunk-local cumsum off fla
        gc = torch.empty(g.shape[1:], device=g.device, dtype=torch.float32)
        Ai = gdn_solve.kkt_solve(k[0], g[0], beta[0], cu_seqlens, chunk_indices,
                                 g_cumsum_out=gc)[None]  # fmt: skip
        g = gc[None]
    elif wy_in_pass:
        Ai = f["kkt_solve_into"](
            k.new_empty(*v.shape[:3], CHUNK), k=k, g=g, beta=beta, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, chunk_size=CHUNK,
        )  # fmt: skip
    if wy_in_pass:
        h, v_new = chunk_state_pass_wy(
            k[0], v[0], beta[0], Ai[0], g[0], ssm_state, state_indices, cu_seqlens,
            chunk_offsets, chunk_indices.shape[0], **pass_options,
        )  # fmt: skip
    else:
        if solve == "ours":
            w, u = f["recompute_w_u"](
                k=k, v=v, beta=beta, A=Ai, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
            )
        else:
            w, u, _ = f["intra"](
                k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                chunk_size=CHUNK,
            )  # fmt: skip
        if fuse_output:
            o = chunk_state_output_pass(
                q[0], k[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens,
                chunk_offsets, scale=scale, **pass_options,
            )  # fmt: skip
            return _into(out, o)
        h, v_new = chunk_state_pass(
            k[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
            chunk_indices.shape[0], **pass_options,
        )  # fmt: skip
    return _output_pass(f, out, callers, q=q, k=k, v_new=v_new, h=h, g=g, A=None, scale=scale,
                        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)  # fmt: skip


def _output_pass(f, out, callers, *, q, k, v_new, h, g, A, scale, cu_seqlens,
                 chunk_indices) -> torch.Tensor:  # fmt: skip
    """fla's output pass (``f["output_into"]``, GDN with ``k``, KDA with the intra-chunk
    attention ``A``) into ``out`` or a new tensor (:func:`_output_buffer`); returns
    ``[T, HV, V]``, ``out`` when given."""
    o = f["output_into"](
        _output_buffer(out, v_new, zeros=A is not None, callers=callers), q=q, k=k, v=v_new, h=h,
        g=g, A=A, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_size=CHUNK,
    )  # fmt: skip
    return _into(out, o[0])


def _output_buffer(
    out: torch.Tensor | None, v_new: torch.Tensor, *, zeros: bool, callers: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """Where fla's output pass writes: ``out`` ``[T, HV, V]`` itself where it has the layout
    the kernel stores (contiguous) and shares no memory with the caller's tensors the pass reads
    (``callers``: q and k; the pass reads a chunk's every key channel while other programs store
    other value blocks of the same rows), so the layer's buffer is written once rather than
    filled by a copy; else a new ``[1, T, HV, V]`` tensor in ``v_new``'s dtype (``zeros``: as
    fla's KDA pass allocates its output)."""
    if (
        out is not None
        and out.shape == v_new.shape[1:]
        and out.is_contiguous()
        and not any(_same_memory(out, t) for t in callers)
    ):
        return out[None]
    return torch.zeros_like(v_new) if zeros else torch.empty_like(v_new)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    # one storage: views of one buffer may interleave, so any shared storage counts
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _into(out: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """``o``, in ``out`` when one is given (a copy unless ``o`` is ``out`` already)."""
    if out is None:
        return o
    if o.data_ptr() != out.data_ptr():  # else the output pass wrote it in place
        out.copy_(o)
    return out


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
    out: torch.Tensor | None = None,
    **pass_options,
) -> torch.Tensor:
    """KDA chunked prefill on CUDA with fla's stages and our state pass over slots: the stages
    of fla's ``chunk_kda`` forward (per-channel cumsum, ``chunk_kda_fwd_intra``, the output pass
    ``chunk_gla_fwd_o_gk``) around :func:`chunk_state_pass` with the per-channel decay.

    :param q: ``[T, H, K]``, ``k`` likewise, ``v`` ``[T, HV, V]``, ``g`` ``[T, HV, K]`` log
        decay (natural log, as ``chunk_kda`` takes it), ``beta`` ``[T, HV]`` (contiguous;
        checked by the caller).
    :param cu_seqlens: ``[N + 1]`` int64 device offsets (``cu_seqlens_cpu`` the same on the
        host, so that fla plans its chunks without reading the device).
    :param out: as :func:`gdn_chunk_prefill_slots`.
    :returns: ``out``, or a new ``[T, HV, V]`` in v's dtype; the slots hold the final states.
    """
    f, reason = compat.stages("kda")
    if reason:
        raise RuntimeError(reason)
    callers = (q, k)
    q, k, v, g, beta, chunk_indices, chunk_offsets = _plan(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, f
    )
    # w, u: the WY representation; kg: k decayed to each chunk's end; Aqk: the intra-chunk
    # attention the output pass reads (qg and Akk are for fla's backward)
    w, u, _, kg, Aqk, _ = f["intra"](
        q=q, k=k, v=v, gk=g, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=CHUNK, chunk_indices=chunk_indices,
    )  # fmt: skip
    h, v_new = chunk_state_pass(
        kg[0], w[0], u[0], g[0], ssm_state, state_indices, cu_seqlens, chunk_offsets,
        chunk_indices.shape[0], **pass_options,
    )  # fmt: skip
    return _output_pass(f, out, callers, q=q, k=None, v_new=v_new, h=h, g=g, A=Aqk, scale=scale,
                        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)  # fmt: skip
