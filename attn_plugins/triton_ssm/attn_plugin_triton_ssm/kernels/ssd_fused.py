"""Mamba2 chunked prefill (SSD) in one Triton kernel: a sequential walk over token tiles that
computes each tile's outputs from the running state and carries the state on.

The math is that of :mod:`~attn_plugin_triton_ssm.kernels.ssd` with the chunk equal to the tile
(``BT`` tokens). Per tile, with ``cs`` the cumulative log decay inside it and ``S`` ``[N, P]`` the
state entering it::

    y   = ((C B^T) * exp(cs_i - cs_j) * dt_j, causal) @ x  +  exp(cs_i) C S
    S  <- exp(cs_last) S + (B * exp(cs_last - cs) dt)^T x

Why one kernel: the two-kernel SSD stores the state entering every chunk for its scan kernel to
read back. At granite's shape (H=128, N=128, P=64) a float32 state of all heads is 4 MiB, so at
chunk 64 that is 64 KB per token written and 64 KB read: more HBM traffic than everything else
the prefill moves (x, B, C, z and y, about 50 KB per token). Here the state never leaves the
registers between tiles. What it costs is parallelism: one program per head, block of ``P`` and
sequence walks the sequence's tiles in order, so one long sequence runs ``H * P / BP`` programs
(128 at granite's shape), where the two-kernel scan has a program per chunk. Which one wins for a
shape is measured (``bench_ssm.py``), not assumed.

Precision is the two-kernel path's with float32 entering states: float32 operands of the dots
(the decayed ``C B^T`` weights, ``B`` times its decay, the state) are split in hi + lo halves of
the 16-bit input dtype with ``precise`` (two dots each), tf32x3 dots for float32 inputs, float32
accumulation and state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import INTERPRETED, cdiv, next_pow2
from attn_plugin_triton_ssm.kernels.ssd import (
    _carry_state,
    _decay_of,
    _mma,
    _mma_f32_left,
    _mma_f32_right,
    _tile_total,
)

__all__ = ["FUSED_MAX_N", "check_fused", "launch_fused"]

#: The largest state size ``N`` the fused kernel takes: its program holds the whole ``[N, BP]``
#: float32 state in registers (32 KiB at N = 128, BP = 64), and C S needs all of N at once.
FUSED_MAX_N = 128


@triton.jit
def _ssd_fused_kernel(
    x_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr, ssm_ptr, idx_ptr,
    cu_ptr, dts_ptr, cs_ptr, s_xt, s_xh, s_dtt, s_bt, s_bg, s_ct, s_cg, s_zt, s_zh, s_ot, s_oh,
    s_ss, s_sh, s_sn, n_tok, GROUP: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr,
    F32: tl.constexpr, UPCAST: tl.constexpr, PRE_DECAY: tl.constexpr,
):  # fmt: skip
    """Grid ``(P / BP, H, N_seq)``: one head's ``[N, BP]`` state block of one sequence, carried
    through the sequence's tiles of ``BT`` tokens in order; each tile's ``y`` ``[BT, BP]`` is
    written as it is done. ``cu_ptr``: the sequences' int32 offsets ``[N_seq + 1]``;
    ``PRE_DECAY``: ``dt`` and its cumulative decays come from the decay pass's ``[H, n_tok]``
    buffers (:func:`~attn_plugin_triton_ssm.kernels.ssd._decay_pass`)."""
    pid_p = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    o_p = pid_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    m_np = m_n[:, None] & m_p[None, :]
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]
    i_g = i_h // GROUP

    bos = tl.load(cu_ptr + i_s)
    eos = tl.load(cu_ptr + i_s + 1)
    slot = tl.load(idx_ptr + i_s).to(tl.int64)  # int64: slot * stride passes 2**31 elements
    a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
    skip = 0.0
    if HAS_D:
        skip = tl.load(d_ptr + i_h).to(tl.float32)

    p_slot = ssm_ptr + slot * s_ss + i_h * s_sh + o_n[:, None] * s_sn + o_p[None, :]
    h = tl.load(p_slot, mask=m_np, other=0.0).to(tl.float32)
    for b in range(0, tl.cdiv(eos - bos, BT)):
        t = bos + b * BT + o_t
        m_t = t < eos
        t64 = t.to(tl.int64)
        m_tp = m_t[:, None] & m_p[None, :]
        d, cs = _decay_of(dt_ptr, dt_bias_ptr, dts_ptr, cs_ptr, a, t64, m_t, s_dtt, i_h, n_tok,
                          PRE_DECAY, HAS_DT_BIAS, DT_SOFTPLUS)  # fmt: skip
        last = _tile_total(cs_ptr, cs, o_t, i_h, n_tok, tl.minimum(bos + b * BT + BT, eos) - 1,
                           BT, PRE_DECAY)  # fmt: skip
        c_t = tl.load(c_ptr + t64[:, None] * s_ct + i_g * s_cg + o_n[None, :],
                      mask=m_t[:, None] & m_n[None, :], other=0.0)  # fmt: skip
        b_t = tl.load(b_ptr + t64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                      mask=m_n[:, None] & m_t[None, :], other=0.0)  # fmt: skip
        x_t = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :], mask=m_tp,
                      other=0.0)  # fmt: skip
        # The order keeps few [64, 64] float32 tiles live beside the state (spills): the
        # entering state's term first, decayed to each row, then the state leaving the tile
        # (the old one is dead after), then the causal term within the tile.
        y = _mma_f32_right(c_t, h, tl.zeros((BT, BP), dtype=tl.float32), SPLIT, F32, UPCAST)
        y = y * tl.exp(cs)[:, None]
        h = _carry_state(h, b_t, x_t, d, cs, last, SPLIT, F32, UPCAST)
        # C B^T: exact products of 16-bit values, float32 sums; decayed, causal (-inf above
        # the diagonal: exp gives 0, never overflows), times dt
        cb = _mma(c_t, b_t, tl.zeros((BT, BT), dtype=tl.float32), F32, UPCAST)
        seg = tl.where(causal, cs[:, None] - cs[None, :], float("-inf"))
        y = _mma_f32_left(cb * tl.exp(seg) * d[None, :], x_t, y, SPLIT, F32, UPCAST)
        if HAS_D:
            y += skip * x_t.to(tl.float32)
        if HAS_Z:
            zt = tl.load(z_ptr + t64[:, None] * s_zt + i_h * s_zh + o_p[None, :], mask=m_tp,
                         other=0.0).to(tl.float32)  # fmt: skip
            y = y * zt * tl.sigmoid(zt)
        tl.store(out_ptr + t64[:, None] * s_ot + i_h * s_oh + o_p[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=m_tp)  # fmt: skip
    tl.store(p_slot, h.to(ssm_ptr.dtype.element_ty), mask=m_np)


def check_fused(N: int) -> None:
    """Raise ``ValueError`` unless the fused kernel takes a state of ``N`` rows."""
    if N > FUSED_MAX_N:
        raise ValueError(
            f"fused: expected a state size N <= {FUSED_MAX_N} (the whole [N, P] block stays in "
            f"registers), got N={N}; use fused=False"
        )


def launch_fused(x, dt, A_log, B, C, ssm_state, state_indices, cu_dev: torch.Tensor, out, *,
                 D, dt_bias, z, dt_softplus: bool, block_t: int, block_p: int, split: bool,
                 decay: tuple[torch.Tensor, torch.Tensor] | None, num_warps: int,
                 num_stages: int) -> None:  # fmt: skip
    """Run :func:`_ssd_fused_kernel` on arguments :func:`~attn_plugin_triton_ssm.kernels.ssd.
    mamba2_ssd_triton` has checked (``cu_dev``: the sequences' offsets ``[N_seq + 1]``, int32,
    on the device: the head of its chunk plan; ``decay``: the decay pass's buffers, or None)."""
    H, P = x.shape[1], x.shape[2]
    G, N = B.shape[1], B.shape[2]
    check_fused(N)
    n_seq = state_indices.shape[0]
    dummy = A_log
    f32 = x.dtype == torch.float32
    _ssd_fused_kernel[(cdiv(P, block_p), H, n_seq)](
        x, dt, A_log, dt_bias if dt_bias is not None else dummy, B, C,
        D if D is not None else dummy, z if z is not None else x, out, ssm_state, state_indices,
        cu_dev, *(decay or (dummy, dummy)), x.stride(0), x.stride(1), dt.stride(0), B.stride(0),
        B.stride(1), C.stride(0), C.stride(1), *(z.stride()[:2] if z is not None else (0, 0)),
        out.stride(0), out.stride(1), *ssm_state.stride()[:3], x.shape[0], GROUP=H // G, N=N,
        P=P, BT=block_t, BN=max(16, next_pow2(N)), BP=block_p, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_Z=z is not None, SPLIT=split,
        F32=f32, UPCAST=INTERPRETED, PRE_DECAY=decay is not None, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
