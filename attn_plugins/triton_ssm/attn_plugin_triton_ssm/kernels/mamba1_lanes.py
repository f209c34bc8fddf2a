"""Mamba1 prefill with whole channels a thread, states in registers.

:func:`~attn_plugin_triton_ssm.kernels.mamba1.mamba1_scan`'s walk holds a ``[BD, N]`` tile a
program, which Triton spreads over threads along ``N`` (four entries of two channels a thread
at 16 x 16 on one warp): each token's softplus and loads then run once per entry group rather
than once per channel, ``y = h . C`` crosses threads, and ``exp`` carries Triton's denormal
guard: compiled for sm90 at d_state 16, its token loop is 274 instructions for the 8 state
entries a thread holds, 34 an entry.

Here a program is a 1-D block of ``BD`` channels, whole channels a thread (``BD / (32 *
num_warps)`` of them: two by default), and the state row of a channel is a tuple of ``N``
registers (``N`` vectors of ``[BD]``), so per token and channel:

    dt  <- softplus(dt + dt_bias)          once (lg2 / ex2 of the special-function unit)
    h_n <- h_n * 2^(dt a_n) + (dt x) B_n    n = 0 .. N-1, ``a_n = -exp(A_log[:, n]) log2(e)``
    y   <- sum_n h_n C_n (+ D x, * silu(z))  in the thread: no shuffle

with ``B_n``, ``C_n`` as scalars every thread of the block reads. Its token loop compiles for
sm90 to 13 instructions a state entry with the output (10.6 at two channels a thread, whose
``B`` and ``C`` loads serve both), 9 without it (the chunked form's first scan); one of them
is the ``ex2`` every recurrence of this kind needs. ``mamba1_scan``'s default where it serves
(:data:`~attn_plugin_triton_ssm.kernels.mamba1.LANES_DEFAULT`), checked on the GPU against the
tile kernel and mamba_ssm (``test_triton_ssm_mamba1_gpu``, ``bench_ssm.py --only mamba1_lanes``).

It serves varlen calls (prefill and mixed steps) as the walk of whole requests and as both scans
of the time-chunked form, through :func:`launch_lanes`; not decode, where the tile kernel moved
the state faster (a decode of this kernel's, one channel a thread, ran 0.82-0.88 of copy on an
H100 against the tile kernel's 0.90-0.91: docs/results.md, Ruled out); and not the speculative
verify, since it keeps no per-token states and the verify's two commit strategies must round
alike. The state update is the same explicit FMA as the tile
kernel's; the decay ``2^(dt a_n)`` rounds differently from its ``exp(dt A)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import INTERPRETED, cdiv

__all__ = ["LANES_BLOCK_D", "LANES_WARPS", "lanes_tiling", "launch_lanes"]

#: Warps per program and channels per program by default: two channels a thread. Compiled for
#: sm90 at d_state 16 the output pass takes 128 registers a thread and 10.6 instructions per
#: state entry a token (one channel a thread: 64 and 13, their ``B`` and ``C`` loads serving
#: one channel). On the H200 at d_inner 8192, T = 8192, two channels a thread ran 1.09x /
#: 1.10x / 1.43x the rate of one as 1 / 4 / 16 requests (docs/results.md).
LANES_WARPS = 4
LANES_BLOCK_D = 64 * LANES_WARPS


def lanes_tiling(block_d: int | None, num_warps: int | None) -> tuple[int, int]:
    """``(BD, num_warps)``: ``BD`` channels a program, a power of two and a multiple of the
    ``32 * num_warps`` threads (each thread takes ``BD / (32 * num_warps)`` channels). None
    takes the defaults: :data:`LANES_BLOCK_D` on :data:`LANES_WARPS`."""
    warps = num_warps or LANES_WARPS
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"num_warps: expected a power of two, got {warps}")
    bd = block_d or max(LANES_BLOCK_D, 32 * warps)
    if bd & (bd - 1) or bd < 32 * warps:
        raise ValueError(
            f"block_d: the lanes kernel takes a power of two >= 32 * num_warps = {32 * warps} "
            f"(whole channels a thread), got {bd}"
        )
    return bd, warps


@triton.jit
def _lg2(x, FAST: tl.constexpr):
    """``log2(x)`` (float32, ``x >= 1`` here): one ``lg2.approx.ftz`` where Triton's ``log2``
    is libdevice's polynomial; Triton's in the interpreter. (Triton's ``exp2`` is one
    ``ex2.approx.ftz`` already: a decay small enough to flush is zero either way.)"""
    if FAST:
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.log2(x)


@triton.jit
def _decay_rate(a_log):
    """``-exp(A_log) log2(e)``: the ``a`` of the decay ``2^(dt a)``, float32."""
    return -tl.exp(a_log) * 1.4426950408889634


@triton.jit
def _columns4(tile):
    """A ``[BD, 4]`` tile's four columns, each ``[BD]``: in-thread where a thread holds whole
    rows (one channel a thread)."""
    a, b = tl.split(tl.reshape(tile, [tile.shape[0], 2, 2]))  # a: columns 0, 2; b: 1, 3
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _rows4(c0, c1, c2, c3):
    """Four ``[BD]`` columns as one ``[BD, 4]`` tile (:func:`_columns4`'s inverse)."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [c0.shape[0], 4])


@triton.jit
def _mamba1_lanes_kernel(
    x_ptr,  # [T, D] (s_xt, s_xd)
    dt_ptr,  # [T, D] (s_dtt, 1)
    a_log_ptr,  # [D, N] float32, packed
    b_ptr,  # [T, N] (s_bt, 1)
    c_ptr,  # [T, N] (s_ct, 1)
    d_ptr,  # [D] skip; HAS_D
    dt_bias_ptr,  # [D]; HAS_DT_BIAS
    z_ptr,  # [T, D] (s_zt, s_zd); HAS_Z
    state_ptr,  # [S, D, N] (s_ss, s_sd, 1) float32 / bfloat16
    idx_ptr,  # [R] slot per request, -1: padding
    cu_ptr,  # [R + 1] token offsets
    init_ptr,  # [R] bool, False: start from zero; HAS_INIT
    out_ptr,  # [T, D] (s_ot, s_od); WRITE_OUT
    dts_ptr,  # [S, D] float32: each request's total dt per channel; STORE_DTSUM
    s_xt,
    s_xd,
    s_dtt,
    s_bt,
    s_ct,
    s_zt,
    s_zd,
    s_ot,
    s_od,
    s_ss,
    s_sd,
    D: tl.constexpr,
    N: tl.constexpr,
    BD: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    STORE_DTSUM: tl.constexpr,
    FAST: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """Grid ``(R, cdiv(D, BD))``: request ``program_id(0)`` on ``BD`` channels, its tokens in
    order, whole channels a thread. A padding request (slot -1) reads no state, stores none and
    writes ``y = 0``. ``GROUPED`` (one channel a thread, ``N`` a multiple of 4): the state and
    ``A_log`` move in 16-byte rows of four entries, one vector access each, where per-entry
    accesses would touch a line of every other thread's row."""
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    o_d = pid_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    As = ()
    if GROUPED:
        for g in tl.static_range(N // 4):
            o_n = g * 4 + tl.arange(0, 4)
            a4 = tl.load(a_log_ptr + o_d[:, None] * N + o_n[None, :], mask=m_d[:, None], other=0.0)
            As = As + _columns4(_decay_rate(a4))
    else:
        for n in tl.static_range(N):
            a = tl.load(a_log_ptr + o_d * N + n, mask=m_d, other=0.0)
            As = As + (_decay_rate(a),)  # type: ignore[assignment]  # noqa: RUF005
    b_bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_skip = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        b_skip = tl.load(d_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)

    slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    valid = (o_d * 0 + slot) >= 0  # a block: the interpreter rejects scalar & block masks
    m_state = m_d & valid
    p_state = state_ptr + slot * s_ss + o_d * s_sd
    start = tl.load(cu_ptr + pid_b).to(tl.int64)
    end = tl.load(cu_ptr + pid_b + 1).to(tl.int64)

    fresh = o_d < 0  # no channel starts from zero unless HAS_INIT says so
    if HAS_INIT:
        init = tl.load(init_ptr + pid_b).to(tl.int32)
        fresh = (o_d * 0 + init) == 0
    hs = ()
    m_load = m_state & ~fresh
    if GROUPED:
        for g in tl.static_range(N // 4):
            o_n = g * 4 + tl.arange(0, 4)
            h4 = tl.load(p_state[:, None] + o_n[None, :], mask=m_load[:, None], other=0.0)
            hs = hs + _columns4(h4.to(tl.float32))
    else:
        for n in tl.static_range(N):
            h = tl.load(p_state + n, mask=m_load, other=0.0).to(tl.float32)
            hs = hs + (h,)  # type: ignore[assignment]  # noqa: RUF005
    b_dts = tl.zeros([BD], dtype=tl.float32)

    for t in range(start, end):
        b_x = tl.load(x_ptr + t * s_xt + o_d * s_xd, mask=m_d, other=0.0).to(tl.float32)
        b_dt = tl.load(dt_ptr + t * s_dtt + o_d, mask=m_d, other=0.0).to(tl.float32) + b_bias
        if DT_SOFTPLUS:  # softplus(x) = x above 20, as torch's
            sp = _lg2(1.0 + tl.math.exp2(b_dt * 1.4426950408889634), FAST) * 0.6931471805599453
            b_dt = tl.where(b_dt <= 20.0, sp, b_dt)
        b_u = b_dt * b_x
        b_y = tl.zeros([BD], dtype=tl.float32)
        new = ()
        for n in tl.static_range(N):
            b_n = tl.load(b_ptr + t * s_bt + n).to(tl.float32)
            # an explicit FMA, as the tile kernel's update
            h = tl.fma(hs[n], tl.math.exp2(b_dt * As[n]), b_u * b_n)
            if WRITE_OUT:
                b_y = tl.fma(h, tl.load(c_ptr + t * s_ct + n).to(tl.float32), b_y)
            new = new + (h,)  # type: ignore[assignment]  # noqa: RUF005
        hs = new
        if STORE_DTSUM:
            b_dts += b_dt
        if WRITE_OUT:
            if HAS_D:
                b_y += b_skip * b_x
            if HAS_Z:
                b_z = tl.load(z_ptr + t * s_zt + o_d * s_zd, mask=m_d, other=0.0)
                b_z = b_z.to(tl.float32)
                b_y = b_y * b_z * tl.sigmoid(b_z)
            b_y = tl.where(valid, b_y, 0.0)
            tl.store(out_ptr + t * s_ot + o_d * s_od, b_y.to(out_ptr.dtype.element_ty),
                     mask=m_d)  # fmt: skip

    if WRITE_STATE:
        if GROUPED:
            for g in tl.static_range(N // 4):
                o_n = g * 4 + tl.arange(0, 4)
                h4 = _rows4(hs[4 * g], hs[4 * g + 1], hs[4 * g + 2], hs[4 * g + 3])
                tl.store(p_state[:, None] + o_n[None, :], h4.to(state_ptr.dtype.element_ty),
                         mask=m_state[:, None])  # fmt: skip
        else:
            for n in tl.static_range(N):
                tl.store(p_state + n, hs[n].to(state_ptr.dtype.element_ty), mask=m_state)
    if STORE_DTSUM:  # time-chunked pass 1: the chunk's total dt per channel (pass 2's decay)
        tl.store(dts_ptr + slot * D + o_d, b_dts, mask=m_state)


def _grouped(block_d: int, warps: int, d_state: int) -> bool:
    """Whether the kernel moves the state in 16-byte rows: one channel a thread (a thread's
    row is whole there, so the rows' columns need no shuffle into the channel vectors) and
    ``d_state`` a multiple of 4."""
    return block_d == 32 * warps and d_state % 4 == 0


def launch_lanes(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor | None,
    *,
    cu: torch.Tensor,
    init: torch.Tensor | None,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_softplus: bool,
    write_state: bool,
    dtsum: torch.Tensor | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> None:
    """One launch: request ``b`` is tokens ``cu[b] .. cu[b + 1]`` continuing from
    ``state[idx[b]]`` ``[D, N]`` (zeros where ``init[b]`` is False),
    ``y`` into ``out`` (None: not computed), the end state back to the slot where
    ``write_state``, the total ``dt`` per channel into ``dtsum[idx[b]]`` ``[S, D]`` float32
    where given (the time-chunked scan's first pass). Inputs as
    :func:`~attn_plugin_triton_ssm.kernels.mamba1.mamba1_scan` checked them; ``state``
    ``[S, D, N]`` with its last dim packed. ``block_d``, ``num_warps``: see
    :func:`lanes_tiling`."""
    Dn, N = A_log.shape
    R = idx.shape[0]
    BD, warps = lanes_tiling(block_d, num_warps)
    if R == 0:
        return
    _mamba1_lanes_kernel[(R, cdiv(Dn, BD))](
        x, dt, A_log, B, C,
        D if D is not None else A_log,
        dt_bias if dt_bias is not None else A_log,
        z if z is not None else x,
        state, idx, cu,
        init if init is not None else idx,
        out if out is not None else x,
        dtsum if dtsum is not None else A_log,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), C.stride(0),
        *(z.stride() if z is not None else (0, 0)),
        *(out.stride() if out is not None else (0, 0)),
        state.stride(0), state.stride(1),
        D=Dn, N=N, BD=BD, HAS_INIT=init is not None, HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None, HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus,
        WRITE_STATE=write_state, WRITE_OUT=out is not None, STORE_DTSUM=dtsum is not None,
        FAST=not INTERPRETED, GROUPED=_grouped(BD, warps, N), num_warps=warps,
    )  # fmt: skip
