"""Mamba2 chunked prefill (SSD) in Triton over packed sequences, with the state in slots.

Per head ``h`` (group ``g = h // (H // G)``) and token ``t``, state ``S`` ``[N, P]``::

    dt_t = softplus(dt_t + dt_bias_h)       a_t = dt_t * A_h,  A_h = -exp(A_log_h)
    S_t  = exp(a_t) S_{t-1} + dt_t B_t x_t^T
    y_t  = S_t^T C_t + D_h x_t              (then y_t *= silu(z_t) when z is given)

Chunked form (Dao & Gu 2024): each sequence is cut into chunks of ``Q`` tokens (the last one
shorter; a chunk never straddles two sequences). With ``cs`` the cumulative log decay inside a
chunk (``cs_i = a_0 + ... + a_i``) and ``S_in`` the state entering it::

    y_i   = sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j  +  exp(cs_i) S_in^T C_i
    S_out = exp(cs_last) S_in + sum_j exp(cs_last - cs_j) dt_j B_j x_j^T

Chunk and tile are separate sizes. The chunk (``Q``, :data:`CHUNK_SIZES`) is where entering
states are stored; the tile (``BT = block_t``, 64 tokens by default, at most ``Q``) is what the
dots and registers see. A chunk of 128 or 256 tokens is 2 or 4 blocks of 64 tokens, never one
``[Q, Q]`` register tile (chunk 128 as one tile spilled heavily on 4 warps and ran at 0.57-0.66x
of chunk 64 on the H200), and P is tiled by 64 columns (never the 32 that Triton 3.6
miscompiles on sm90, see :func:`mamba2_ssd_triton`).

Why larger chunks: the states buffer is HBM traffic. At the granite shape (H=128, N=128, P=64)
one float32 entering state is 4 MiB for all heads; at ``Q = 64`` that is 64 KB per token
written by the state kernel and read again by the scan, 128 KB/token, which alone caps the
rate near 30 M tokens/s at ~4 TB/s, against ~48 KB/token for x (read by both kernels) and y
(``z`` adds 16 more). At ``Q = 256`` (mamba_ssm's chunk) the states cost 32 KB/token. What grows
with ``Q`` is the causal part of the scan: a row block reads ``(m + 1)`` column blocks, on
average ``(Q / BT + 1) / 2``, so its ``[BT, BT] x [BT, P]`` dots grow linearly with ``Q``.
``states_dtype`` = the input dtype halves the states traffic again (and the scan's state dot,
which then needs no hi/lo split); off by default, see :func:`mamba2_ssd_triton`. With
``precise=False`` the states are stored in the input dtype anyway (the scan would round them
to it), and ``split_states`` stores float32 states as the hi + lo halves the scan would split
them into (same bytes, same values, the split done once per chunk instead of per row block).

Two main kernels (after the decay pass, below):

1. ``_ssd_state_kernel``, grid ``(N/BN * P/BP, H, N_seq)``: one program walks the sub-blocks
   of ``BT`` tokens of one sequence in order for a ``[BN, BP]`` tile of one head's state (the
   recurrence at sub-block granularity, one ``[BN, BT] x [BT, BP]`` dot per step). It reads the
   initial state from the slot, stores the state entering every chunk (when a sub-block
   opens one) in ``states`` ``[chunks, 1 or 2 halves, H, N, P]`` and writes the final state
   back to the slot. A step's contribution does not depend on the running state, so the
   loads of the next sub-block are pipelined under the current one.
2. ``_ssd_scan_kernel``, grid ``(chunks * Q/BT, H / HB, P / BP)``: one program per row block
   of ``BT`` tokens of a chunk and block of ``HB`` heads of one group. Per head it walks the
   chunk's column blocks from its own down to the first (causal: none after its own, the
   diagonal one masked), accumulating ``(C_m B_k^T * decay * dt_k) @ x_k`` tile by tile, then
   adds the entering state's term ``exp(cs_i) C_i S_in``. B and C are shared by the heads of
   a group and never expanded to ``H`` heads; with one block per chunk (``Q = BT``) ``C B^T``
   is computed once for the ``HB`` heads, with several it is recomputed per head and column
   block (the ``HB`` heads' accumulators cannot all stay live across blocks).

First, by default (``precompute_decay``), a decay pass writes every token's ``dt`` (bias,
softplus) and its cumulative log decay within its tile into ``[H, T]`` buffers, which both
kernels then load instead of computing them (a cumulative sum and a reduction across warps
per sub-block, and again per head and column block in the scan): the same outputs in
0.75-0.81 of the time on the H200 at granite's shape (float32 rounding apart: the cumulative
sum may add in another order).

Chunk boundaries come from the host offsets (``cu_seqlens_cpu``): a small int32 plan on the
device ``[cu_seqlens (N_seq + 1) | first chunk of each sequence (N_seq) | (start, end) of each
chunk]``, cached by content so that all layers of a step share one upload.

Precision: the tensor-core dots take 16-bit operands. ``x``, ``B``, ``C`` are exact in their
dtype, but the float32 factors (decay times ``dt``, the float32 state) are not; rounding them to
bf16 alone costs ~2^-9 relative per term (what fla's path does to ``dt * x``). With
``precise=True`` each float32 operand ``f`` is split as ``hi + lo`` (``hi`` = ``f`` rounded,
``lo`` = the rest rounded) and dotted twice: operand error ~2^-16 for one extra dot. float32
inputs use ``tf32x3`` dots. Accumulation and the carried state are float32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import (
    INTERPRETED,
    STATE_DTYPES,
    cdiv,
    check_dtype,
    check_last_contiguous,
    check_same_device,
    check_shape,
    first_that_fits,
    next_pow2,
)

__all__ = ["CHUNK_SIZES", "DEFAULT_CHUNK", "mamba2_ssd_triton"]

#: Chunk sizes the kernels take: ``tl.dot`` needs every dim >= 16; a chunk above
#: :data:`_T_TILE` runs on tiles of that many tokens.
CHUNK_SIZES = (16, 32, 64, 128, 256)
#: 64: measured when a chunk was one [Q, Q] tile, where chunk 128 ran far slower (H200, granite
#: shape, T = 8192 as one request / 32768 as 16: 6.63 / 6.52 M tokens/s against 10.05 / 11.61
#: at 64). Chunks now run on 64-token tiles; ``bench_ssm.py --mamba2-sweep`` times 64 / 128 /
#: 256 to pick it again.
DEFAULT_CHUNK = 64
#: Columns of P per program of both kernels when compiled (see :func:`mamba2_ssd_triton`).
_P_TILE = 64
#: Tokens per tile of both kernels by default (``block_t``): a chunk of 128 or 256 tokens is
#: 2 or 4 blocks of 64, never one [128, 128] or [256, 256] register tile.
_T_TILE = 64
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _softplus(d):
    """torch's softplus (threshold 20) of float32 ``d``, any shape: the decay pass and the
    in-kernel decay both take it from here, so the two paths' ``dt`` agree."""
    return tl.where(d <= 20.0, tl.log(1.0 + tl.exp(d)), d)


@triton.jit
def _chunk_decay(dt_ptr, dt_bias_ptr, a, offs_t, mask_t, s_dt_t, i_h,
                 HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):  # fmt: skip
    """``dt`` after bias and softplus ``[Q]`` (0 past the chunk's end, so the tail neither decays
    nor writes) and its cumulative log decay ``cs`` ``[Q]``. Both kernels call this one function,
    so they see bit-identical decays."""
    d = tl.load(dt_ptr + offs_t * s_dt_t + i_h, mask=mask_t, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        d += tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        d = _softplus(d)
    d = tl.where(mask_t, d, 0.0)
    return d, tl.cumsum(d * a, 0)


@triton.jit
def _decay_of(dt_ptr, dt_bias_ptr, dts_ptr, cs_ptr, a, offs_t, mask_t, s_dt_t, i_h, n_tok,
              PRE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):  # fmt: skip
    """``(d, cs)`` ``[BT]`` of one head over the tile ``offs_t``: read from the decay pass's
    ``[H, n_tok]`` buffers (``PRE``; 0 past the tile's end) or computed here."""
    if PRE:
        row = i_h.to(tl.int64) * n_tok + offs_t
        d = tl.load(dts_ptr + row, mask=mask_t, other=0.0)
        cs = tl.load(cs_ptr + row, mask=mask_t, other=0.0)
    else:
        d, cs = _chunk_decay(dt_ptr, dt_bias_ptr, a, offs_t, mask_t, s_dt_t, i_h, HAS_DT_BIAS,
                             DT_SOFTPLUS)  # fmt: skip
    return d, cs


@triton.jit
def _tile_total(cs_ptr, cs, o_t, i_h, n_tok, t_last, BT: tl.constexpr, PRE: tl.constexpr):
    """A tile's total log decay, ``cs`` at its last real token ``t_last``: one load from the
    decay pass's buffer (``PRE``), else ``cs[BT - 1]``, the same value since ``dt`` is 0 past
    the tile's end (a sum with one nonzero term: exact)."""
    if PRE:
        last = tl.load(cs_ptr + i_h.to(tl.int64) * n_tok + t_last)
    else:
        last = tl.sum(tl.where(o_t == BT - 1, cs, 0.0), 0)
    return last


@triton.jit
def _carry_state(h, b_t, x, d, cs, last, SPLIT: tl.constexpr, F32: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    """The state leaving a tile, ``exp(last) h + (B * exp(last - cs) dt)^T x``: ``h``
    ``[BN, BP]`` float32, ``b_t`` ``[BN, BT]`` (B transposed), ``x`` ``[BT, BP]``, ``d`` and
    ``cs`` ``[BT]``."""
    bw = b_t.to(tl.float32) * (tl.exp(last - cs) * d)[None, :]
    return _mma_f32_left(bw, x, h * tl.exp(last), SPLIT, F32, UPCAST)


@triton.jit
def _ssd_decay_kernel(
    dt_ptr, dt_bias_ptr, a_log_ptr, plan_ptr, dts_ptr, cs_ptr, s_dtt, table_off, n_tok,
    H: tl.constexpr, BT: tl.constexpr, SUBS: tl.constexpr, BH: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):  # fmt: skip
    """The decay pass, grid ``(chunks * SUBS, H / BH)``: ``dt`` after bias and softplus and its
    cumulative log decay ``cs`` over tile ``m`` of one chunk (``BT`` tokens, local to the tile,
    as :func:`_chunk_decay` computes them) for ``BH`` heads, into ``dts`` and ``cs``
    ``[H, n_tok]`` float32, head-major so that the kernels' per-head tile loads are
    contiguous."""
    pid = tl.program_id(0)
    i_c = pid // SUBS
    i_m = pid % SUBS
    start = tl.load(plan_ptr + table_off + 2 * i_c)
    end = tl.load(plan_ptr + table_off + 2 * i_c + 1)
    row0 = start + i_m * BT
    if row0 < end:
        t = (row0 + tl.arange(0, BT)).to(tl.int64)
        m_t = t < end
        o_h = tl.program_id(1) * BH + tl.arange(0, BH)
        m_h = o_h < H
        m = m_t[:, None] & m_h[None, :]
        d = tl.load(dt_ptr + t[:, None] * s_dtt + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            d += tl.load(dt_bias_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
        if DT_SOFTPLUS:
            d = _softplus(d)
        d = tl.where(m, d, 0.0)
        a = -tl.exp(tl.load(a_log_ptr + o_h, mask=m_h, other=0.0).to(tl.float32))
        cs = tl.cumsum(d * a[None, :], 0)
        at = o_h.to(tl.int64)[None, :] * n_tok + t[:, None]
        tl.store(dts_ptr + at, d, mask=m)
        tl.store(cs_ptr + at, cs, mask=m)


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` for operands already in the dot dtype."""
    if F32:
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    elif UPCAST:
        # Triton's interpreter reads 16-bit dot operands as raw integers: upcast (exact).
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mma_f32_left(a, b, acc, SPLIT: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with ``a`` float32 and ``b`` in the dot dtype (``a`` split in hi + lo)."""
    hi = a.to(b.dtype)
    acc = _mma(hi, b, acc, F32, UPCAST)
    if SPLIT:
        acc = _mma((a - hi.to(tl.float32)).to(b.dtype), b, acc, F32, UPCAST)
    return acc


@triton.jit
def _mma_f32_right(a, b, acc, SPLIT: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with ``a`` in the dot dtype and ``b`` float32 (``b`` split in hi + lo)."""
    hi = b.to(a.dtype)
    acc = _mma(a, hi, acc, F32, UPCAST)
    if SPLIT:
        acc = _mma(a, (b - hi.to(tl.float32)).to(a.dtype), acc, F32, UPCAST)
    return acc


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _ssd_state_kernel(
    x_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, b_ptr, ssm_ptr, idx_ptr, plan_ptr, states_ptr,
    dts_ptr, cs_ptr, s_xt, s_xh, s_dtt, s_bt, s_bg, s_ss, s_sh, s_sn, n_seq, n_tok,
    H: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
    SUBS: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr,
    HALVES: tl.constexpr, PRE_DECAY: tl.constexpr,
):  # fmt: skip
    """States entering each chunk of one sequence, for a ``[BN, BP]`` tile of one head.

    One flat loop over the sequence's sub-blocks of ``BT`` tokens (``SUBS`` per chunk): the
    recurrence at sub-block granularity, ``S <- exp(cs_last) S + (B w)^T x`` with ``cs`` local
    to the sub-block, is the chunk-level one regrouped. The state is stored when a sub-block
    opens a chunk (``b % SUBS == 0``), so the stored states and their traffic scale with the
    chunk, the dots and registers with ``BT``. One loop (no nest per chunk) so that the
    pipeliner prefetches the next sub-block's ``B`` and ``x`` across chunk boundaries too.
    ``HALVES == 2``: each state is stored as its hi and lo halves in the states dtype (the
    scan's operands as they are), ``states`` ``[chunks, 2, H, N, P]``."""
    pid_np = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    NBP: tl.constexpr = (P + BP - 1) // BP
    o_n = (pid_np // NBP) * BN + tl.arange(0, BN)
    o_p = (pid_np % NBP) * BP + tl.arange(0, BP)
    m_n = o_n < N
    m_p = o_p < P
    m_np = m_n[:, None] & m_p[None, :]
    o_t = tl.arange(0, BT)
    i_g = i_h // GROUP

    bos = tl.load(plan_ptr + i_s)
    eos = tl.load(plan_ptr + i_s + 1)
    first_chunk = tl.load(plan_ptr + n_seq + 1 + i_s).to(tl.int64)
    slot = tl.load(idx_ptr + i_s).to(tl.int64)  # int64: slot * stride passes 2**31 elements
    a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))

    p_slot = ssm_ptr + slot * s_ss + i_h * s_sh + o_n[:, None] * s_sn + o_p[None, :]
    h = tl.load(p_slot, mask=m_np, other=0.0).to(tl.float32)
    # states is ours, contiguous [chunks, HALVES, H, N, P]
    p_states = states_ptr + i_h * (N * P) + o_n[:, None] * P + o_p[None, :]
    for b in range(0, tl.cdiv(eos - bos, BT)):
        p_in = p_states + (first_chunk + b // SUBS) * (HALVES * H * N * P)
        # only where sub-block b opens a chunk (a masked store costs no traffic)
        m_in = m_np if SUBS == 1 else m_np & (b % SUBS == 0)
        hi = h.to(states_ptr.dtype.element_ty)
        tl.store(p_in, hi, mask=m_in)
        if HALVES == 2:
            tl.store(p_in + H * N * P, (h - hi.to(tl.float32)).to(states_ptr.dtype.element_ty),
                     mask=m_in)  # fmt: skip
        t = bos + b * BT + o_t
        m_t = t < eos
        t64 = t.to(tl.int64)
        d, cs = _decay_of(dt_ptr, dt_bias_ptr, dts_ptr, cs_ptr, a, t64, m_t, s_dtt, i_h, n_tok,
                          PRE_DECAY, HAS_DT_BIAS, DT_SOFTPLUS)  # fmt: skip
        last = _tile_total(cs_ptr, cs, o_t, i_h, n_tok, tl.minimum(bos + b * BT + BT, eos) - 1,
                           BT, PRE_DECAY)  # fmt: skip
        b_t = tl.load(b_ptr + t64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                      mask=m_n[:, None] & m_t[None, :], other=0.0)  # fmt: skip
        x_c = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :],
                      mask=m_t[:, None] & m_p[None, :], other=0.0)  # fmt: skip
        h = _carry_state(h, b_t, x_c, d, cs, last, SPLIT, F32, UPCAST)
    tl.store(p_slot, h.to(ssm_ptr.dtype.element_ty), mask=m_np)


@triton.jit
def _ssd_cb_kernel(
    b_ptr, c_ptr, cb_ptr, plan_ptr, s_bt, s_bg, s_ct, s_cg, table_off,
    G: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, SUBS: tl.constexpr, BN: tl.constexpr,
    F32: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``C_m B_k^T`` ``[BT, BT]`` float32 for row block ``m`` >= column block ``k`` of one chunk
    and group, into ``cb`` ``[chunks, G, SUBS, SUBS, BT, BT]`` (blocks above the diagonal, and
    those of empty row blocks, are left unwritten: the scan never reads them)."""
    pid = tl.program_id(0)
    i_c = pid // SUBS
    i_m = pid % SUBS
    i_k = tl.program_id(1)
    i_g = tl.program_id(2)
    start = tl.load(plan_ptr + table_off + 2 * i_c)
    end = tl.load(plan_ptr + table_off + 2 * i_c + 1)
    if (i_k <= i_m) & (start + i_m * BT < end):
        o_t = tl.arange(0, BT)
        o_n = tl.arange(0, BN)
        m_n = o_n < N
        t = start + i_m * BT + o_t
        tk = start + i_k * BT + o_t
        c_m = tl.load(c_ptr + t.to(tl.int64)[:, None] * s_ct + i_g * s_cg + o_n[None, :],
                      mask=(t < end)[:, None] & m_n[None, :], other=0.0)  # fmt: skip
        b_k = tl.load(b_ptr + tk.to(tl.int64)[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                      mask=m_n[:, None] & (tk < end)[None, :], other=0.0)  # fmt: skip
        cb = _mma(c_m, b_k, tl.zeros((BT, BT), dtype=tl.float32), F32, UPCAST)
        blk = ((i_c.to(tl.int64) * G + i_g) * SUBS + i_m) * SUBS + i_k
        tl.store(cb_ptr + blk * (BT * BT) + o_t[:, None] * BT + o_t[None, :], cb)


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr, plan_ptr,
    states_ptr, cb_ptr, dts_ptr, cs_ptr, s_xt, s_xh, s_dtt, s_bt, s_bg, s_ct, s_cg, s_zt, s_zh,
    s_ot, s_oh, table_off, n_tok, H: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr,
    P: tl.constexpr, BT: tl.constexpr, SUBS: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    HB: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr,
    STATES_LOW: tl.constexpr, HALVES: tl.constexpr, CB_MEM: tl.constexpr,
    PRE_DECAY: tl.constexpr,
):  # fmt: skip
    """Outputs of one row block (``BT`` tokens) of one chunk, for ``HB`` heads of one group and
    ``BP`` columns of ``P``.

    Row block ``m`` of a chunk reads the chunk's column blocks ``k = m, m - 1, ..., 0`` (causal:
    none after its own, the diagonal one masked), each a ``[BT, BT]`` tile of ``C B^T``, decayed
    and dotted with that block's ``x``. The decay from column ``j`` of block ``k`` to row ``i``
    is ``cs_i + gap - cs_j`` with ``cs`` local to each block and ``gap`` the sum of the log
    decays of the blocks ``k + 1 .. m - 1`` plus block ``k``'s own total (0 on the diagonal):
    walking ``k`` down accumulates it, and at the end it is the log decay from the chunk's
    start to block ``m``, which the entering state's term needs. ``CB_MEM``: the ``C B^T``
    blocks come from ``_ssd_cb_kernel`` (``cb_ptr``) instead of a dot per head and block.
    The entering state comes as float32 (split here when ``SPLIT``), in the dot dtype
    (``STATES_LOW``: one dot) or as hi and lo halves (``HALVES == 2``: two dots, no split)."""
    pid = tl.program_id(0)
    i_c = pid // SUBS
    i_m = pid % SUBS
    h0 = tl.program_id(1) * HB
    o_p = tl.program_id(2) * BP + tl.arange(0, BP)
    m_p = o_p < P
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    o_t = tl.arange(0, BT)
    i_g = h0 // GROUP  # HB divides GROUP: the whole head block shares B and C

    start = tl.load(plan_ptr + table_off + 2 * i_c)
    end = tl.load(plan_ptr + table_off + 2 * i_c + 1)
    row0 = start + i_m * BT
    if row0 < end:  # a short last chunk leaves its later row blocks empty
        t = row0 + o_t
        m_t = t < end
        t64 = t.to(tl.int64)
        m_tp = m_t[:, None] & m_p[None, :]
        c_m = tl.load(c_ptr + t64[:, None] * s_ct + i_g * s_cg + o_n[None, :],
                      mask=m_t[:, None] & m_n[None, :], other=0.0)  # fmt: skip
        causal = o_t[:, None] >= o_t[None, :]
        if SUBS == 1:
            # One block per chunk: C B^T of 16-bit values (exact products, float32 sums) once,
            # shared by the HB heads.
            b_t = tl.load(b_ptr + t64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                          mask=m_n[:, None] & m_t[None, :], other=0.0)  # fmt: skip
            cb0 = _mma(c_m, b_t, tl.zeros((BT, BT), dtype=tl.float32), F32, UPCAST)
        p_states = (states_ptr + i_c.to(tl.int64) * (HALVES * H * N * P) + o_n[:, None] * P
                    + o_p[None, :])  # fmt: skip

        for j in range(HB):
            i_h = h0 + j
            a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
            d_m, cs_m = _decay_of(dt_ptr, dt_bias_ptr, dts_ptr, cs_ptr, a, t64, m_t, s_dtt, i_h,
                                  n_tok, PRE_DECAY, HAS_DT_BIAS, DT_SOFTPLUS)  # fmt: skip
            y = tl.zeros((BT, BP), dtype=tl.float32)
            gap = tl.sum(tl.zeros((BT,), dtype=tl.float32), 0)
            for kk in range(0, i_m + 1):
                k = i_m - kk
                if SUBS == 1:
                    cb = cb0
                    d_k = d_m
                    cs_k = cs_m
                    x_k = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :],
                                  mask=m_tp, other=0.0)  # fmt: skip
                else:
                    tk = start + k * BT + o_t
                    m_k = tk < end
                    tk64 = tk.to(tl.int64)
                    if CB_MEM:  # [BT, BT] float32: as many bytes as B_k, and no dot
                        blk = ((i_c.to(tl.int64) * (H // GROUP) + i_g) * SUBS + i_m) * SUBS + k
                        cb = tl.load(cb_ptr + blk * (BT * BT) + o_t[:, None] * BT + o_t[None, :])
                    else:
                        # C B^T per column block and head: B is shared by the group's heads,
                        # but the HB heads' [BT, BP] accumulators cannot all stay live across
                        # blocks; B_k comes from L1/L2 after the first head.
                        b_k = tl.load(b_ptr + tk64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                                      mask=m_n[:, None] & m_k[None, :], other=0.0)  # fmt: skip
                        cb = _mma(c_m, b_k, tl.zeros((BT, BT), dtype=tl.float32), F32, UPCAST)
                    d_k, cs_k = _decay_of(dt_ptr, dt_bias_ptr, dts_ptr, cs_ptr, a, tk64, m_k,
                                          s_dtt, i_h, n_tok, PRE_DECAY, HAS_DT_BIAS,
                                          DT_SOFTPLUS)  # fmt: skip
                    if PRE_DECAY:  # block k < m is whole: its last token's cs, one load
                        total_k = tl.load(cs_ptr + i_h.to(tl.int64) * n_tok + start + k * BT
                                          + BT - 1, mask=k < i_m, other=0.0)  # fmt: skip
                    else:
                        total_k = tl.sum(tl.where(o_t == BT - 1, cs_k, 0.0), 0)
                    gap += tl.where(k < i_m, total_k, 0.0)
                    x_k = tl.load(x_ptr + tk64[:, None] * s_xt + i_h * s_xh + o_p[None, :],
                                  mask=m_k[:, None] & m_p[None, :], other=0.0)  # fmt: skip
                # -inf above the diagonal of the diagonal block: exp gives 0, never overflows.
                seg = tl.where(causal | (k < i_m), cs_m[:, None] + gap - cs_k[None, :],
                               float("-inf"))  # fmt: skip
                s = cb * tl.exp(seg) * d_k[None, :]
                y = _mma_f32_left(s, x_k, y, SPLIT, F32, UPCAST)
            # The entering state, decayed from the chunk's start: gap is now the log decay of
            # the blocks before this one.
            m_np = m_n[:, None] & m_p[None, :]
            h_in = tl.load(p_states + i_h * (N * P), mask=m_np, other=0.0)
            if HALVES == 2:  # hi and lo halves, split by the state kernel: two dots
                y_in = _mma(c_m, h_in, tl.zeros((BT, BP), dtype=tl.float32), F32, UPCAST)
                h_lo = tl.load(p_states + H * N * P + i_h * (N * P), mask=m_np, other=0.0)
                y_in = _mma(c_m, h_lo, y_in, F32, UPCAST)
            elif STATES_LOW:  # stored in the dot dtype: one dot, nothing to split
                y_in = _mma(c_m, h_in, tl.zeros((BT, BP), dtype=tl.float32), F32, UPCAST)
            else:
                y_in = _mma_f32_right(c_m, h_in, tl.zeros((BT, BP), dtype=tl.float32), SPLIT,
                                      F32, UPCAST)  # fmt: skip
            y += y_in * tl.exp(cs_m + gap)[:, None]
            if HAS_D:
                x_m = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :],
                              mask=m_tp, other=0.0)  # fmt: skip
                y += tl.load(d_ptr + i_h).to(tl.float32) * x_m.to(tl.float32)
            if HAS_Z:
                z = tl.load(z_ptr + t64[:, None] * s_zt + i_h * s_zh + o_p[None, :], mask=m_tp,
                            other=0.0).to(tl.float32)  # fmt: skip
                y = y * z * tl.sigmoid(z)
            tl.store(out_ptr + t64[:, None] * s_ot + i_h * s_oh + o_p[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=m_tp)  # fmt: skip


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------
#: (device, chunk) -> (host offsets int64, device plan int32, number of chunks). Keyed by
#: content (a host compare of N_seq + 1 integers), so all layers of a step share one upload.
_PLAN_CACHE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int]] = {}


def _check_offsets(cu_cpu: torch.Tensor, n_seq: int, total: int) -> torch.Tensor:
    check_shape("cu_seqlens_cpu", cu_cpu, [n_seq + 1], f"[N_seq + 1 = {n_seq + 1}]")
    if cu_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu: expected a host tensor, got one on {cu_cpu.device}")
    cu = cu_cpu.long()
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens_cpu: expected non-decreasing offsets from 0 to T={total}, got "
            f"{cu.tolist() if n_seq <= 16 else f'[{int(cu[0])}, ..., {int(cu[-1])}]'}"
        )
    return cu


def _chunk_plan(cu: torch.Tensor, chunk: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Device int32 plan ``[cu (n+1) | first chunk per sequence (n) | (start, end) per chunk]``
    and the number of chunks, for int64 host offsets ``cu`` ``[n + 1]``."""
    key = (str(device), chunk)
    hit = _PLAN_CACHE.get(key)
    if hit is not None and torch.equal(hit[0], cu):
        return hit[1], hit[2]
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    per_seq = (lens + chunk - 1) // chunk
    first = torch.cumsum(per_seq, 0) - per_seq
    n_chunks = int(per_seq.sum())
    seq = torch.repeat_interleave(torch.arange(n), per_seq)
    start = cu[seq] + (torch.arange(n_chunks) - first[seq]) * chunk
    end = torch.minimum(start + chunk, cu[seq + 1])
    table = torch.stack([start, end], 1).reshape(-1)
    plan = torch.cat([cu, first, table]).to(torch.int32).to(device)
    _PLAN_CACHE[key] = (cu.clone(), plan, n_chunks)
    return plan, n_chunks


def _heads_per_program(group: int, requested: int | None) -> int:
    if requested is not None:
        if requested < 1 or group % requested:
            raise ValueError(
                f"heads_per_program: expected a divisor of the {group} heads per group, got "
                f"{requested}"
            )
        return requested
    return next(hb for hb in (8, 4, 2, 1) if group % hb == 0)


def mamba2_ssd_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
    precise: bool = True,
    out: torch.Tensor | None = None,
    heads_per_program: int | None = None,
    block_n: int | None = None,
    block_p: int | None = None,
    block_t: int | None = None,
    states_dtype: torch.dtype = torch.float32,
    precompute_cb: bool = False,
    split_states: bool = False,
    precompute_decay: bool | None = None,
    fused: bool = False,
    num_warps: tuple[int, int] | None = None,
    num_stages: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Mamba2 chunked prefill (SSD) over packed sequences in two Triton kernels.

    :param x: ``[T, H, P]`` float32/bfloat16/float16, tokens of ``N_seq`` sequences packed.
    :param dt: ``[T, H]`` raw time step (before ``dt_bias`` and softplus), any float dtype.
    :param A_log: ``[H]``; ``A = -exp(A_log)``.
    :param B: ``[T, G, N]`` in ``x``'s dtype; ``C`` likewise. Head ``h`` uses group
        ``h // (H // G)``.
    :param ssm_state: ``[S, H, N, P]`` float32/bfloat16, last two dims packed; the slots
        ``state_indices`` are read as initial states and overwritten with the final states.
    :param state_indices: ``[N_seq]`` int32/int64, distinct valid slots (no ``-1``).
    :param cu_seqlens_cpu: ``[N_seq + 1]`` host offsets, ``0`` to ``T``.
    :param D: ``[H]`` skip, ``dt_bias``: ``[H]``, ``z``: ``[T, H, P]`` gate (``y *= silu(z)``).
    :param chunk_size: one of :data:`CHUNK_SIZES`: the tokens per stored entering state and
        per scan row-block family (the causal intra-chunk work grows with it, the state
        traffic shrinks with it).
    :param precise: split float32 dot operands in hi + lo halves (16-bit inputs; see above).
    :param out: ``[T, H, P]``, written and returned (a new tensor of ``x``'s dtype if ``None``).
    :param heads_per_program: heads of one group per scan program (a divisor of ``H // G``).
    :param block_n: rows of ``N`` per state-kernel program (a power of two >= 16).
    :param block_p: columns of ``P`` per program of both kernels (a power of two >= 16),
        instead of :data:`_P_TILE`; for diagnostics (32 compiled on Triton 3.6 hits the
        miscompile described in the body).
    :param block_t: tokens per tile of both kernels (a power of two from 16 to
        ``chunk_size``; default ``min(chunk_size, 64)``): the scan's ``[BT, BT]`` blocks of
        ``C B^T`` and the state kernel's sub-blocks.
    :param states_dtype: dtype of the entering states the state kernel stores for the scan:
        ``torch.float32`` (the default: the scan reads them split in hi + lo, as exact as the
        carried state) or ``x``'s dtype (half the traffic, one dot instead of two, but each
        output's inter-chunk term carries one rounding of the state, ~2^-9 relative in bf16:
        what mamba_ssm and fla do). The carried and the final states stay float32 either way.
        With ``precise=False`` the states are stored in ``x``'s dtype whatever this says: the
        scan would round them to it before its dot (bit-identical, half the traffic).
    :param precompute_cb: with several token tiles per chunk, compute each chunk's ``C B^T``
        blocks once per group in a third kernel (``[chunks, G, Q, Q]`` float32 scratch, 1 KB
        per token and group at ``Q = 256``) that the scan reads, instead of one more dot per
        head and block in the scan. Same values either way (the same dot); ignored with one
        tile per chunk, where the scan computes ``C B^T`` once for its heads. Off by default:
        the block read from memory is 16 KB like the ``B`` block it replaces and saves a
        ``[BT, N] x [N, BT]`` dot, but compiled for sm90 (Triton 3.9, offline) it spilled
        936 bytes per thread on 4 warps against 128 for the dot (112 / 40 on 8 warps);
        ``bench_ssm.py --mamba2-sweep`` times both.
    :param split_states: float32 entering states with 16-bit inputs and ``precise``: store
        them as their hi + lo halves in ``x``'s dtype (as many bytes; the split done once per
        chunk in the state kernel, and the scan's dot operands come as stored) rather than in
        float32, split in the scan by each row block and head. Bit-identical values. Off by
        default until timed: compiled offline for sm90 (Triton 3.9) the scan spilled more
        with it at chunk 64 (520 against 456 bytes per thread) and less at chunk 256 (96
        against 128).
    :param precompute_decay: compute ``dt`` (bias, softplus) and its cumulative log decay per
        token tile once, in a third kernel, into two ``[H, T]`` float32 buffers that the
        state kernel and the scan load, instead of each computing them (a strided ``dt``
        load, a softplus, a cumulative sum and a reduction across warps for the tile's last
        value) per sub-block, and the scan again per head and column block. Both kernels
        then see the same decays by construction. Costs ``8 H`` bytes per token written and
        read again. ``None`` (the default): on for the two kernels, off for ``fused``. On the
        H200 at granite's shape (T = 32768, chunk 64, float32 entering states, outputs as far
        from the float32 torch SSD as without it) the two kernels took 0.75-0.81 of the time
        without it (2.50 against 3.31 ms as one sequence, 2.40 against 2.97 as 16), and
        0.59-0.65 with ``precise=False`` (1.49 against 2.54 ms as one sequence). The fused
        kernel on 4 warps was timed without it (on 8 warps it gained 10 %).
    :param fused: run the single-pass kernel of :mod:`~attn_plugin_triton_ssm.kernels.ssd_fused`
        instead: one program per head, ``P`` block and sequence walks the sequence's tiles of
        ``block_t`` tokens with the state in registers, so no entering state is stored
        (``chunk_size`` only bounds the tile; ``states_dtype``, ``split_states``,
        ``precompute_cb``, ``heads_per_program`` and ``block_n`` do not apply; with
        ``precompute_decay`` it reads the decay pass's buffers). Takes ``N`` up to
        :data:`~attn_plugin_triton_ssm.kernels.ssd_fused.FUSED_MAX_N`.
    :param num_warps: ``(state kernel, scan kernel)``; ``num_stages`` likewise. With ``fused``
        the second entry of each applies to the fused kernel (default 4 warps, 2 stages).
    :returns: ``y`` ``[T, H, P]``.
    """
    check_shape("x", x, [None, None, None], "[T, H, P]")
    T, H, P = x.shape
    check_shape("dt", dt, [T, H], "[T, H]")
    check_shape("A_log", A_log, [H], "[H]")
    check_shape("B", B, [T, None, None], "[T, G, N]")
    G, N = B.shape[1], B.shape[2]
    if G == 0 or H % G:
        raise ValueError(f"B: expected a number of groups G that divides H={H}, got G={G}")
    check_shape("C", C, [T, G, N], "[T, G, N] like B")
    check_shape("ssm_state", ssm_state, [None, H, N, P], "[S, H, N, P]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    check_shape("state_indices", state_indices, [None], "[N_seq]")
    check_dtype("state_indices", state_indices, (torch.int32, torch.int64))
    n_seq = state_indices.shape[0]
    if not 1 <= n_seq <= 65535:
        raise ValueError(f"state_indices: expected 1 to 65535 sequences (grid dim), got {n_seq}")
    for name, t in (("x", x), ("dt", dt)):
        if t.dtype not in _INPUT_DTYPES:
            raise ValueError(
                f"{name}: impl='triton' takes float32/bfloat16/float16, got "
                f"{str(t.dtype).removeprefix('torch.')}"
            )
    for name, t in (("B", B), ("C", C)):
        if t.dtype != x.dtype:
            raise ValueError(
                f"{name}: expected x's dtype {str(x.dtype).removeprefix('torch.')} (the dots "
                f"run in it), got {str(t.dtype).removeprefix('torch.')}; cast it first"
            )
    for name, opt in (("D", D), ("dt_bias", dt_bias)):
        if opt is not None:
            check_shape(name, opt, [H], "[H]")
    if z is not None:
        check_shape("z", z, [T, H, P], "[T, H, P]")
        check_last_contiguous("z", z)
    for name, t in (("x", x), ("dt", dt), ("A_log", A_log), ("B", B), ("C", C)):
        check_last_contiguous(name, t)
    for name, opt in (("D", D), ("dt_bias", dt_bias)):
        if opt is not None:
            check_last_contiguous(name, opt)
    check_last_contiguous("ssm_state", ssm_state, 2)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(
            f"chunk_size: impl='triton' takes one of {list(CHUNK_SIZES)}, got {chunk_size}"
        )
    BT = block_t if block_t is not None else min(chunk_size, _T_TILE)
    if not 16 <= BT <= chunk_size or BT & (BT - 1):
        raise ValueError(
            f"block_t: expected a power of two from 16 to chunk_size={chunk_size}, got {BT}"
        )
    if states_dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"states_dtype: expected float32 or x's dtype {str(x.dtype).removeprefix('torch.')},"
            f" got {str(states_dtype).removeprefix('torch.')}"
        )
    device = check_same_device(
        {"x": x, "dt": dt, "A_log": A_log, "B": B, "C": C, "ssm_state": ssm_state,
         "state_indices": state_indices, "D": D, "dt_bias": dt_bias, "z": z}
    )  # fmt: skip
    if out is None:
        out = torch.empty((T, H, P), dtype=x.dtype, device=device)
    check_shape("out", out, [T, H, P], "[T, H, P]")
    check_last_contiguous("out", out)
    cu = _check_offsets(cu_seqlens_cpu, n_seq, T)
    group = H // G
    hb = _heads_per_program(group, heads_per_program)

    f32 = x.dtype == torch.float32
    flags = dict(SPLIT=precise and not f32, F32=f32, UPCAST=INTERPRETED)
    # The state kernel is sequential over a sequence's sub-blocks. 64 rows of N: fewer programs
    # than 32 or 16 would give, but each dependent step carries twice the work (H200, granite
    # shape, T = 8192 as one request: 5.83 M tokens/s at 64, 4.82 at 32, 4.54 at 16).
    BNs = block_n or max(16, min(64, next_pow2(N)))
    if BNs < 16 or BNs & (BNs - 1):
        raise ValueError(f"block_n: expected a power of two >= 16, got {BNs}")
    # P tiles of 64 columns when compiled, also for P < 64 (masked): Triton 3.6 miscompiles
    # the scan's dots at 32 columns on the H200. At H=16, G=2, N=64, P=32 (the GPU test's
    # varlen case, ``triton_ssm_refs.MAMBA2_VARLEN``) a 32-column tile faulted with an illegal
    # memory access at chunk 64 with one scan stage and at chunk 128 with one, and gave wrong
    # outputs (error 1.1) at chunk 128 with two; 64-column tiles were right in all four.
    # Triton's issues #10573 and #11366 report the same family (sm90, several dots, a 32-wide
    # tile). The interpreter keeps narrow tiles: it has no such bug and pays per element.
    # (Those chunk-128 runs were one [128, 128] block per chunk; chunks now tile by BT.)
    BP = _P_TILE if not INTERPRETED else max(16, min(_P_TILE, next_pow2(P)))
    if block_p is not None:
        if block_p < 16 or block_p & (block_p - 1):
            raise ValueError(f"block_p: expected a power of two >= 16, got {block_p}")
        BP = block_p
    if precompute_decay is None:
        precompute_decay = not fused
    if fused:
        from attn_plugin_triton_ssm.kernels.ssd_fused import check_fused, launch_fused

        check_fused(N)  # before the plan and the decay pass
        plan, n_chunks = _chunk_plan(cu, chunk_size, device)  # its head: the offsets
        pre = None
        if precompute_decay and n_chunks:
            pre = _decay_pass(
                dt, dt_bias, A_log, plan, n_seq, n_chunks, chunk_size, BT, dt_softplus
            )
        launch_fused(
            x, dt, A_log, B, C, ssm_state, state_indices, plan, out, D=D, dt_bias=dt_bias, z=z,
            dt_softplus=dt_softplus, block_t=BT, block_p=BP, split=flags["SPLIT"], decay=pre,
            # 4 warps, though compiled for sm90 they spill 1.7 KB a thread against 460 bytes on
            # 8: on the H200 at granite's shape (T = 32768) 3.62 against 3.98 ms as one
            # sequence and 2.13 against 4.08 as 16
            num_warps=num_warps[1] if num_warps else 4,
            num_stages=num_stages[1] if num_stages else 2,
        )  # fmt: skip
        return out
    # 4 warps for the scan: 8 (a guess at its register needs: C [Q, N], C B^T with decayed
    # hi/lo copies, the entering state [N, BP]) ran 1.46x slower on the H200 at the granite
    # shape (4.82 against 7.05 M tokens/s, T = 8192; 4.76 / 6.85 at T = 32768 as 16 requests).
    # Measured at chunk 64. With several tiles per chunk, unmeasured: compiled offline for sm90
    # (Triton 3.9) the scan spilled less on 8 warps at granite's shape (chunk 256, bf16: 40
    # against 128 bytes per thread; with the cb pass 112 against 936); the sweep times both.
    nw_state, nw_scan = num_warps or (4, 4)
    # One stage for the scan: its loop over a block's heads gains nothing from prefetching
    # the next head's x and state, and the buffers cost occupancy (H200, granite shape: 10.15
    # against 9.42 M tokens/s at T = 8192, 11.64 against 10.77 at T = 32768 as 16 requests;
    # bit-identical outputs). Measured with one block per chunk (chunk 64).
    ns_state, ns_scan = num_stages or (3, 1)
    dummy = A_log
    # How the entering states are stored: float32 for float32 inputs; x's dtype when asked
    # or when the scan would round them to it (no hi/lo split); else hi + lo halves in x's
    # dtype (split_states) or float32 split by the scan.
    states_low = not f32 and (states_dtype != torch.float32 or not precise)
    halves = 2 if not f32 and not states_low and split_states else 1
    store_dtype = x.dtype if states_low or halves == 2 else torch.float32

    def cb_mem(bt: int) -> bool:
        return chunk_size > bt and precompute_cb

    def scan(bt: int, bp: int, stages: int, plan: torch.Tensor, states: torch.Tensor, n: int,
             cb: torch.Tensor, decay: tuple[torch.Tensor, torch.Tensor],
             warmup: bool = False):  # fmt: skip
        subs = chunk_size // bt
        grid = (n * subs, H // hb, cdiv(P, bp))
        args = (
            x, dt, A_log, dt_bias if dt_bias is not None else dummy, B, C,
            D if D is not None else dummy, z if z is not None else x, out, plan, states, cb,
            *decay, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
            C.stride(0), C.stride(1), *(z.stride()[:2] if z is not None else (0, 0)),
            out.stride(0), out.stride(1), 2 * n_seq + 1, T,
        )  # fmt: skip
        kw = dict(H=H, GROUP=group, N=N, P=P, BT=bt, SUBS=subs, BN=max(16, next_pow2(N)), BP=bp,
                  HB=hb, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
                  HAS_D=D is not None, HAS_Z=z is not None, **flags, STATES_LOW=states_low,
                  HALVES=halves, CB_MEM=cb_mem(bt), PRE_DECAY=precompute_decay,
                  num_warps=nw_scan, num_stages=stages)  # fmt: skip
        if warmup:
            return _ssd_scan_kernel.warmup(*args, grid=grid, **kw)
        return _ssd_scan_kernel[grid](*args, **kw)

    key = (device, x.dtype, N, P, G, hb, chunk_size, BT, BP, nw_scan, ns_scan, precise,
           dt_softplus, D is not None, z is not None, dt_bias is not None, store_dtype, halves,
           precompute_cb, precompute_decay)  # fmt: skip
    tiling = _SCAN_TILING.get(key)
    if tiling is None:
        tiling = _SCAN_TILING[key] = _fit_scan(scan, chunk_size, BT, BP, ns_scan, cu, device,
                                               store_dtype)  # fmt: skip
    BT, BP_scan, ns_scan = tiling

    plan, n_chunks = _chunk_plan(cu, chunk_size, device)
    # Every chunk's entering state (T=8192, H=128, N=128, P=64 in float32 or as bf16 halves:
    # 512 MiB at chunk 64, 128 MiB at chunk 256).
    states = torch.empty((max(n_chunks, 1), halves, H, N, P), dtype=store_dtype, device=device)
    subs = chunk_size // BT
    decay = (dummy, dummy)
    if precompute_decay and n_chunks:
        decay = _decay_pass(dt, dt_bias, A_log, plan, n_seq, n_chunks, chunk_size, BT, dt_softplus)
    _ssd_state_kernel[(cdiv(N, BNs) * cdiv(P, BP), H, n_seq)](
        x, dt, A_log, dt_bias if dt_bias is not None else dummy, B, ssm_state, state_indices,
        plan, states, *decay, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        *ssm_state.stride()[:3], n_seq, T, H=H, GROUP=group, N=N, P=P, BT=BT, SUBS=subs,
        BN=BNs, BP=BP, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, **flags,
        HALVES=halves, PRE_DECAY=precompute_decay and n_chunks > 0, num_warps=nw_state,
        num_stages=ns_state,
    )  # fmt: skip
    if n_chunks == 0:
        return out
    cb = dummy
    if cb_mem(BT):
        cb = torch.empty((n_chunks, G, subs, subs, BT, BT), dtype=torch.float32, device=device)
        _ssd_cb_kernel[(n_chunks * subs, subs, G)](
            B, C, cb, plan, B.stride(0), B.stride(1), C.stride(0), C.stride(1), 2 * n_seq + 1,
            G=G, N=N, BT=BT, SUBS=subs, BN=max(16, next_pow2(N)), F32=f32, UPCAST=INTERPRETED,
            num_warps=4, num_stages=1,
        )  # fmt: skip
    scan(BT, BP_scan, ns_scan, plan, states, n_chunks, cb, decay)
    return out


def _decay_pass(dt, dt_bias, A_log, plan, n_seq: int, n_chunks: int, chunk: int, bt: int,
                dt_softplus: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dts, cs)`` ``[H, T]`` float32 from :func:`_ssd_decay_kernel` over the chunks of
    ``plan`` (:func:`_chunk_plan` at ``chunk``) in tiles of ``bt`` tokens: 0.5 MiB each per
    1024 tokens at H = 128, against the 4 MiB of one entering state at the granite shape."""
    T, H = dt.shape
    dts = torch.empty((H, T), dtype=torch.float32, device=dt.device)
    cs = torch.empty((H, T), dtype=torch.float32, device=dt.device)
    bh = min(32, next_pow2(H))
    _ssd_decay_kernel[(n_chunks * (chunk // bt), cdiv(H, bh))](
        dt, dt_bias if dt_bias is not None else A_log, A_log, plan, dts, cs, dt.stride(0),
        2 * n_seq + 1, T, H=H, BT=bt, SUBS=chunk // bt, BH=bh, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, num_warps=4,
    )  # fmt: skip
    return dts, cs


#: Scan-kernel tiling that fits the device's shared memory, by (device, dtype, shape, flags):
#: ``(block_t, BP, num_stages)``. See :func:`_fit_scan`.
_SCAN_TILING: dict[tuple, tuple[int, int, int]] = {}


def _scan_candidates(block_t: int, bp: int, stages: int) -> list[tuple[int, int, int]]:
    """Scan tilings ``(block_t, BP, stages)`` to try in order: the requested one, one stage,
    then halved token tiles down to 16, all at ``bp`` columns. The chunk stays: it fixes where
    states are stored, and a chunk of any size runs on tiles of any smaller ``block_t``."""
    candidates = [(block_t, bp, stages)]
    if stages > 1:
        candidates.append((block_t, bp, 1))
    bt = block_t
    while bt > 16:
        bt //= 2
        candidates.append((bt, bp, 1))
    return candidates


def _fit_scan(scan, chunk: int, block_t: int, bp: int, stages: int, cu: torch.Tensor,
              device: torch.device, states_dtype: torch.dtype):  # fmt: skip
    """The first scan tiling, from the requested one down, whose compiled kernel fits in the
    device's shared memory: fewer pipeline stages, then smaller token tiles. P tiles never
    narrow below :data:`_P_TILE` (the miscompile at 32 columns, see :func:`mamba2_ssd_triton`).

    Why: the scan holds ``C`` and ``B`` ``[BT, N]``, the entering state ``[N, BP]`` and ``x``
    ``[BT, BP]`` in shared memory; float32 inputs (tf32x3 dots) at N = 128 needed 263 KB at a
    128-token tile on an H200, which has 227 KB per block. The state kernel tiles N and never
    comes close. Each candidate is compiled (``warmup``, no launch) and its ``metadata.shared``
    compared with the limit, before anything is written, so a request's state is never
    half-updated. Under the interpreter there is no limit: the requested tiling stands. The
    state kernel then runs on the same ``block_t``, so both see the same decays.
    """
    if INTERPRETED or device.type != "cuda":
        return block_t, bp, stages
    candidates = _scan_candidates(block_t, bp, stages)
    plan, n = _chunk_plan(cu, chunk, device)

    def compile_one(tiling: tuple[int, int, int]):
        bt, b, st = tiling
        states = torch.empty(1, dtype=states_dtype, device=device)
        cb = torch.empty(1, dtype=torch.float32, device=device)
        return scan(bt, b, st, plan, states, n, cb, (cb, cb), warmup=True)

    return first_that_fits(candidates, compile_one, device, "mamba2_ssd_triton: no scan tiling",
                           "(block_t, BP, stages)")  # fmt: skip
