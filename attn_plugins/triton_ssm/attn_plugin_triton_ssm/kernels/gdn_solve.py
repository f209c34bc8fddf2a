"""Gated DeltaNet's intra-chunk solve: ``(I + A)^-1`` of every 64-token chunk, one kernel.

Per chunk of ``BT = 64`` tokens and value head, with ``k`` the (normalized) keys of the head's
key group, ``g`` the chunk-local cumulative log2 decay and ``beta`` the write strength::

    A[i, j] = beta[i] * (k[i] . k[j]) * 2^(g[i] - g[j])     for j < i, else 0   [BT, BT]
    Ai      = (I + A)^-1                                                       [BT, BT]

``Ai`` is what the WY representation needs (``w = Ai (beta 2^g k)``, ``u = Ai (beta v)``); fla
computes the same in ``chunk_gated_delta_rule_fwd_kkt_solve_kernel``. Both cut ``A`` into
16-row blocks, invert the four diagonal blocks by forward substitution and merge them with
block products. Where fla runs the four substitutions as four loops one after another, this
kernel runs them as one loop of four independent chains, so each step's latency (two
reductions across a block) is paid once for the four blocks. Compiled for sm90 by Triton 3.6
(4 warps, Qwen3-Next's heads) a step of the four is 241 instructions, 48 of them shuffles,
with no barrier or shared memory (fla's first loop syncs the block twice a step); the layouts
behind that are the compiler's, picked by how the blocks are built (:func:`_gated_diag_t`). The
off-diagonal ``k k^T`` blocks are computed after the loop, so fewer tiles stay live through
it. It stores every entry of a chunk's rows, zeros above the diagonal blocks, so ``Ai`` may
come uninitialised whoever reads it (fla's ``recompute_w_u`` reads whole rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import (
    INTERPRETED,
    check_dtype,
    check_float,
    check_same_device,
    check_shape,
)

__all__ = ["kkt_solve"]

#: Tokens per chunk: the chunk size of every GDN stage around it (fla's and ours).
CHUNK = 64
#: Rows per block of the substitution and the merge.
_BLOCK = 16


@triton.jit
def _kk_block(p_k, r, c, m_r, m_c, s_t, K: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """``k_r k_c^T`` ``[16, 16]`` float32 of the chunk's 16-token blocks ``r`` and ``c`` (rows
    ``m_r`` / ``m_c`` inside the sequence; ``p_k``: block 0's ``[16, 1]`` row pointers, ``s_t``
    the token stride)."""
    acc = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        o_k = (i_k + tl.arange(0, BK))[None, :]
        k_r = tl.load(p_k + r * 16 * s_t + o_k, mask=m_r[:, None], other=0.0)
        k_c = k_r
        if c != r:
            k_c = tl.load(p_k + c * 16 * s_t + o_k, mask=m_c[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter, whose 16-bit dots are wrong: float32 products
            k_r, k_c = k_r.to(tl.float32), k_c.to(tl.float32)
        acc = tl.dot(k_r, tl.trans(k_c), acc)
    return acc


@triton.jit
def _gated(kk, g_r, g_c, b_r, m_r, m_c):
    """``beta_r * kk * 2^(g_r - g_c)`` of a block below the diagonal blocks, on the rows
    ``m_r`` and columns ``m_c`` inside the sequence, 0 elsewhere ``[16, 16]`` float32."""
    keep = m_r[:, None] & m_c[None, :]
    # where, not a product with a 0/1 mask: 2^(g_r - g_c) may overflow where it is not kept
    return tl.where(keep, kk * tl.exp2(g_r[:, None] - g_c[None, :]), 0.0) * b_r[:, None]


@triton.jit
def _gated_diag_t(kk, g, b, m):
    """The transpose of a diagonal block's gated ``A``, from its symmetric ``kk``:
    ``At[j, i] = A[i, j] = beta[i] kk[i, j] 2^(g[i] - g[j])`` for ``j < i`` ``[16, 16]``."""
    o = tl.arange(0, 16)
    keep = (o[:, None] < o[None, :]) & m[:, None] & m[None, :]
    return tl.where(keep, kk * tl.exp2(g[None, :] - g[:, None]), 0.0) * b[None, :]


@triton.jit
def _solve_step(at, x, i):
    """Row ``i`` of ``X = (I + A)^-1 - I`` of a diagonal block from ``At = A^T`` and ``X``'s
    rows above it: ``x_i = -a_i - sum_j a_ij x_j`` (``a_ij = 0`` for ``j >= i``)."""
    o = tl.arange(0, 16)
    r = -tl.sum(tl.where((o == i)[:, None], tl.trans(at), 0.0), 0)  # -a_i
    x_i = r + tl.sum(r[:, None] * x, 0)
    return tl.where((o == i)[:, None], x_i[None, :], x)


@triton.jit
def _store_band(p, b0, b1, b2, b3, m):
    """Four ``[16, 16]`` float32 blocks side by side as one 16-row band of ``Ai`` (``p``: the
    band's ``[16, 16]`` pointers of its first block; rows ``m`` inside the sequence)."""
    ty = p.dtype.element_ty
    tl.store(p, b0.to(ty), mask=m[:, None])
    tl.store(p + 16, b1.to(ty), mask=m[:, None])
    tl.store(p + 32, b2.to(ty), mask=m[:, None])
    tl.store(p + 48, b3.to(ty), mask=m[:, None])


@triton.jit
def _kkt_solve_kernel(
    k_ptr, g_ptr, beta_ptr, ai_ptr, gc_ptr, cu_ptr, chunks_ptr, LOG2E,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr, CUMSUM: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid ``(chunks, HV)``: chunk ``chunks[c] = (sequence, chunk within it)`` of value head
    ``program_id(1)``, its key head ``i_hv // (HV / H)``. ``CUMSUM``: ``g`` is each token's log
    decay; the chunk-local cumulative sum times ``LOG2E`` is computed here and stored in
    ``gc``."""
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    seq = tl.load(chunks_ptr + 2 * i_c).to(tl.int64)
    t0 = tl.load(cu_ptr + seq).to(tl.int64) + tl.load(chunks_ptr + 2 * i_c + 1).to(tl.int64) * BT
    n = tl.load(cu_ptr + seq + 1).to(tl.int64) - t0  # the sequence's tokens from t0 on
    o = tl.arange(0, BC)
    m0, m1, m2, m3 = o < n, o + BC < n, o + 2 * BC < n, o + 3 * BC < n

    p_k = k_ptr + (t0 + o)[:, None] * (H * K) + i_h * K
    kk00 = _kk_block(p_k, 0, 0, m0, m0, H * K, K, BK, UPCAST)
    kk11 = _kk_block(p_k, 1, 1, m1, m1, H * K, K, BK, UPCAST)
    kk22 = _kk_block(p_k, 2, 2, m2, m2, H * K, K, BK, UPCAST)
    kk33 = _kk_block(p_k, 3, 3, m3, m3, H * K, K, BK, UPCAST)

    p_gb = (t0 + o) * HV + i_hv
    g0 = tl.load(g_ptr + p_gb, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + p_gb + BC * HV, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + p_gb + 2 * BC * HV, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g_ptr + p_gb + 3 * BC * HV, mask=m3, other=0.0).to(tl.float32)
    if CUMSUM:  # g is each token's log decay: the chunk-local cumulative sum, in log2, stored
        s1 = tl.sum(g0, 0)
        s2 = s1 + tl.sum(g1, 0)
        s3 = s2 + tl.sum(g2, 0)
        g0 = tl.cumsum(g0, 0) * LOG2E
        g1 = (tl.cumsum(g1, 0) + s1) * LOG2E
        g2 = (tl.cumsum(g2, 0) + s2) * LOG2E
        g3 = (tl.cumsum(g3, 0) + s3) * LOG2E
        tl.store(gc_ptr + p_gb, g0, mask=m0)
        tl.store(gc_ptr + p_gb + BC * HV, g1, mask=m1)
        tl.store(gc_ptr + p_gb + 2 * BC * HV, g2, mask=m2)
        tl.store(gc_ptr + p_gb + 3 * BC * HV, g3, mask=m3)
    b0 = tl.load(beta_ptr + p_gb, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + p_gb + BC * HV, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + p_gb + 2 * BC * HV, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + p_gb + 3 * BC * HV, mask=m3, other=0.0).to(tl.float32)

    # the diagonal blocks' inverses: four chains of substitution steps in one loop
    # built transposed and read through tl.trans: compiled for sm90 a step of the four chains
    # is then 241 instructions with 48 shuffles, against 348-378 and 96-112 for the plain
    # block read along either axis
    at0 = _gated_diag_t(kk00, g0, b0, m0)
    at1 = _gated_diag_t(kk11, g1, b1, m1)
    at2 = _gated_diag_t(kk22, g2, b2, m2)
    at3 = _gated_diag_t(kk33, g3, b3, m3)
    x0 = tl.zeros([BC, BC], dtype=tl.float32)
    x1 = tl.zeros([BC, BC], dtype=tl.float32)
    x2 = tl.zeros([BC, BC], dtype=tl.float32)
    x3 = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        x0 = _solve_step(at0, x0, i)
        x1 = _solve_step(at1, x1, i)
        x2 = _solve_step(at2, x2, i)
        x3 = _solve_step(at3, x3, i)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    x0 += eye
    x1 += eye
    x2 += eye
    x3 += eye

    # the blocks below the diagonal (their k k^T only now: fewer tiles live through the
    # loop), then block forward substitution, X_rc = -X_rr sum_j A_rj X_jc
    kk10 = _kk_block(p_k, 1, 0, m1, m0, H * K, K, BK, UPCAST)
    kk20 = _kk_block(p_k, 2, 0, m2, m0, H * K, K, BK, UPCAST)
    kk21 = _kk_block(p_k, 2, 1, m2, m1, H * K, K, BK, UPCAST)
    kk30 = _kk_block(p_k, 3, 0, m3, m0, H * K, K, BK, UPCAST)
    kk31 = _kk_block(p_k, 3, 1, m3, m1, H * K, K, BK, UPCAST)
    kk32 = _kk_block(p_k, 3, 2, m3, m2, H * K, K, BK, UPCAST)
    a10 = _gated(kk10, g1, g0, b1, m1, m0)
    a20 = _gated(kk20, g2, g0, b2, m2, m0)
    a21 = _gated(kk21, g2, g1, b2, m2, m1)
    a30 = _gated(kk30, g3, g0, b3, m3, m0)
    a31 = _gated(kk31, g3, g1, b3, m3, m1)
    a32 = _gated(kk32, g3, g2, b3, m3, m2)
    x10 = -tl.dot(x1, tl.dot(a10, x0, input_precision=PRECISION), input_precision=PRECISION)
    x21 = -tl.dot(x2, tl.dot(a21, x1, input_precision=PRECISION), input_precision=PRECISION)
    x32 = -tl.dot(x3, tl.dot(a32, x2, input_precision=PRECISION), input_precision=PRECISION)
    s20 = tl.dot(a20, x0, input_precision=PRECISION)
    s20 = tl.dot(a21, x10, s20, input_precision=PRECISION)
    x20 = -tl.dot(x2, s20, input_precision=PRECISION)
    s31 = tl.dot(a31, x1, input_precision=PRECISION)
    s31 = tl.dot(a32, x21, s31, input_precision=PRECISION)
    x31 = -tl.dot(x3, s31, input_precision=PRECISION)
    s30 = tl.dot(a30, x0, input_precision=PRECISION)
    s30 = tl.dot(a31, x10, s30, input_precision=PRECISION)
    s30 = tl.dot(a32, x20, s30, input_precision=PRECISION)
    x30 = -tl.dot(x3, s30, input_precision=PRECISION)

    # every entry of the chunk's rows, zeros above the diagonal blocks
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    p_ai = ai_ptr + ((t0 + o) * HV + i_hv)[:, None] * BT + o[None, :]
    band = BC * HV * BT  # 16 token rows of Ai
    _store_band(p_ai, x0, zero, zero, zero, m0)
    _store_band(p_ai + band, x10, x1, zero, zero, m1)
    _store_band(p_ai + 2 * band, x20, x21, x2, zero, m2)
    _store_band(p_ai + 3 * band, x30, x31, x32, x3, m3)


def kkt_solve(
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    g_cumsum_out: torch.Tensor | None = None,
    block_k: int = 32,
    num_warps: int = 1,
    precision: str = "tf32",
) -> torch.Tensor:
    """``(I + A)^-1`` of every chunk of 64 tokens and every value head.

    :param k: ``[T, H, K]`` keys (normalized where the layer normalizes them), packed.
    :param g: ``[T, HV]`` float32 chunk-local cumulative log2 decay (fla's ``chunk_local_cumsum``
        with ``scale=RCP_LN2``); with ``g_cumsum_out``, each token's log decay instead (natural
        log, any float dtype), whose cumulative sum the kernel computes.
    :param beta: ``[T, HV]`` write strength, any float dtype.
    :param cu_seqlens: ``[N + 1]`` int32 / int64 token offsets of the sequences.
    :param chunk_indices: ``[NT, 2]`` int32 / int64 ``(sequence, chunk within it)`` of every
        chunk (fla's ``prepare_chunk_indices(cu_seqlens, 64)``).
    :param out: ``[T, HV, 64]`` in k's dtype, or None (allocated); every entry is written.
    :param g_cumsum_out: ``[T, HV]`` float32, or None: receives the chunk-local cumulative log2
        decay of ``g`` (what the stages after this one read), saving a launch of its own.
    :param block_k: key channels per load of the ``k k^T`` blocks; ``num_warps``: warps a
        program. One warp by default: compiled for sm90 (Triton 3.6) the substitution loop is
        the same 241 instructions at 1, 2, 4 or 8 warps (each warp holds a 16-row block whole),
        so more warps repeat its work, and 32 channels a load spill least there (24 bytes
        against 80 at 64). Not yet timed: ``bench_ssm.py --only gdn_solve`` sweeps both.
    :param precision: the block products' ``input_precision``: ``"tf32"`` (fla's on sm80+) or
        ``"ieee"`` (float32 throughout).
    :returns: ``out``: row ``t`` of head ``hv`` is row ``t - chunk start`` of its chunk's
        ``(I + A)^-1``.
    """
    check_shape("k", k, [None, None, None], "[T, H, K]")
    T, H, K = k.shape
    if K < 16 or K & (K - 1):
        raise ValueError(f"k: expected [T, H, K] with K a power of two >= 16, got K = {K}")
    check_float("k", k)
    check_shape("g", g, [T, None], "[T, HV]")
    HV = g.shape[1]
    if HV % H:
        raise ValueError(
            f"k, g: HV = {HV} value heads must be a multiple of H = {H} key heads (each key "
            "head serves HV / H value heads)"
        )
    check_float("g", g)
    check_shape("beta", beta, [T, HV], "[T, HV]")
    check_float("beta", beta)
    check_shape("cu_seqlens", cu_seqlens, [None], "[N + 1]")
    check_shape("chunk_indices", chunk_indices, [None, 2], "[NT, 2] (sequence, chunk)")
    for name, t in (("cu_seqlens", cu_seqlens), ("chunk_indices", chunk_indices)):
        check_dtype(name, t, (torch.int32, torch.int64))
    if out is None:
        out = k.new_empty(T, HV, CHUNK)
    check_shape("out", out, [T, HV, CHUNK], f"[T, HV, {CHUNK}]")
    check_float("out", out)
    if g_cumsum_out is not None:
        check_shape("g_cumsum_out", g_cumsum_out, [T, HV], "[T, HV]")
        check_dtype("g_cumsum_out", g_cumsum_out, (torch.float32,))
    packed: tuple[tuple[str, torch.Tensor | None], ...] = (
        ("k", k), ("g", g), ("beta", beta), ("out", out), ("chunk_indices", chunk_indices),
        ("g_cumsum_out", g_cumsum_out),
    )  # fmt: skip
    for name, p in packed:
        if p is not None and not p.is_contiguous():
            raise ValueError(f"{name}: expected a packed tensor, got strides {list(p.stride())}")
    check_same_device(
        {"k": k, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices,
         "out": out, "g_cumsum_out": g_cumsum_out}
    )  # fmt: skip
    if T == 0 or chunk_indices.shape[0] == 0:
        return out
    cumsum = g_cumsum_out is not None
    _kkt_solve_kernel[(chunk_indices.shape[0], HV)](
        k, g, beta, out, g_cumsum_out if cumsum else g, cu_seqlens, chunk_indices,
        1.0 / math.log(2.0), H=H, HV=HV, K=K, BK=min(block_k, K), PRECISION=precision,
        CUMSUM=cumsum, UPCAST=INTERPRETED, num_warps=num_warps,
    )  # fmt: skip
    return out
