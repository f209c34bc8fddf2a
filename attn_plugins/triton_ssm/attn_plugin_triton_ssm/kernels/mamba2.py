"""Mamba2 (SSD) single-token state update, with the state in slots in attn-core's layout.

Per head ``h`` (group ``h // (H // G)``), with the state ``S`` ``[N, P]`` (``Dk = d_state`` first,
``Dv = head_dim`` second, as every linear layer in attn-core)::

    dt  <- softplus(dt + dt_bias)          (dt_softplus; softplus(x) = x for x > 20, as torch)
    A   <- -exp(A_log[h])
    S   <- S * exp(A * dt) + dt * B[g] x^T
    y   <- S^T C[g] + D[h] * x
    y   <- y * silu(z)                     (when z is given)

This is ``selective_state_update`` of mamba_ssm with a scalar ``dt`` and ``A`` per head
(Mamba2's tying), transposed to ``[N, P]``. Grid ``(B * H, P / BP)``: each program holds an
``[N, BP]`` tile of one head's state in registers (whole rows by default); read once, written
once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import (
    STATE_DTYPES,
    cdiv,
    check_dtype,
    check_float,
    check_index,
    check_last_contiguous,
    check_same_device,
    check_shape,
    next_pow2,
)

__all__ = ["mamba2_decode"]


@triton.jit
def _mamba2_decode_kernel(
    x_ptr,
    dt_ptr,
    a_log_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_bias_ptr,
    z_ptr,
    state_ptr,
    idx_ptr,
    out_ptr,
    s_xb,
    s_xh,
    s_dtb,
    s_bb,
    s_bg,
    s_cb,
    s_cg,
    s_zb,
    s_zh,
    s_ss,
    s_sh,
    s_sn,
    s_ob,
    s_oh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    N: tl.constexpr,
    P: tl.constexpr,
    BN: tl.constexpr,
    BP: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    STREAM: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = pid_bh % H
    i_g = i_h // GROUP
    slot = tl.load(idx_ptr + i_b).to(tl.int64)
    o_n = tl.arange(0, BN)
    o_p = pid_p * BP + tl.arange(0, BP)
    m_n = o_n < N
    m_p = o_p < P
    valid = (o_p * 0 + slot) >= 0  # a block: the interpreter rejects scalar & block masks
    m_state = m_n[:, None] & (m_p & valid)[None, :]

    p_state = state_ptr + slot * s_ss + i_h * s_sh + o_n[:, None] * s_sn + o_p[None, :]
    if STREAM:  # read once, written once: keep it out of L2's way
        b_s = tl.load(p_state, mask=m_state, other=0.0, eviction_policy="evict_first")
    else:
        b_s = tl.load(p_state, mask=m_state, other=0.0)
    b_s = b_s.to(tl.float32)

    b_x = tl.load(x_ptr + i_b * s_xb + i_h * s_xh + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_ptr + i_b * s_dtb + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    b_a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
    b_B = tl.load(b_ptr + i_b * s_bb + i_g * s_bg + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(c_ptr + i_b * s_cb + i_g * s_cg + o_n, mask=m_n, other=0.0).to(tl.float32)

    b_s = b_s * tl.exp(b_a * b_dt) + (b_B * b_dt)[:, None] * b_x[None, :]
    b_y = tl.sum(b_s * b_C[:, None], 0)
    if HAS_D:
        b_y += tl.load(d_ptr + i_h).to(tl.float32) * b_x
    if HAS_Z:
        b_z = tl.load(z_ptr + i_b * s_zb + i_h * s_zh + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    b_y = tl.where(valid, b_y, 0.0)
    tl.store(out_ptr + i_b * s_ob + i_h * s_oh + o_p, b_y.to(out_ptr.dtype.element_ty), mask=m_p)
    if STREAM:
        tl.store(p_state, b_s.to(state_ptr.dtype.element_ty), mask=m_state, cache_modifier=".cs")
    else:
        tl.store(p_state, b_s.to(state_ptr.dtype.element_ty), mask=m_state)


def mamba2_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = True,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    num_warps: int | None = None,
    streaming: bool = False,
) -> torch.Tensor:
    """Mamba2 decode: one token per request; updates ``ssm_state`` in place.

    :param x: ``[Bt, H, P]`` float (``Bt`` requests, ``H`` heads of width ``P``).
    :param dt: ``[Bt, H]`` raw time step (before ``dt_bias`` and softplus).
    :param A_log: ``[H]``; ``A = -exp(A_log)``.
    :param B: ``[Bt, G, N]`` input projection per group; ``C``: ``[Bt, G, N]`` output projection.
        ``H`` a multiple of ``G``; head ``h`` uses group ``h // (H // G)``.
    :param ssm_state: ``[S, H, N, P]`` float32/bfloat16, last two dims packed.
    :param state_indices: ``[Bt]`` int32; ``-1`` = padding row (zeros out, state untouched).
    :param D: ``[H]`` skip connection, or ``None``.
    :param dt_bias: ``[H]`` or ``None``.
    :param z: ``[Bt, H, P]`` gate (``y *= silu(z)``), or ``None``.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param out: ``[Bt, H, P]`` (allocated like ``x`` when ``None``).
    :param block_p: columns of ``P`` per program; ``num_warps``: warps per program (tuning
        knobs; ``None`` picks).
    :param streaming: load the state tile with ``evict_first`` and store it with the streaming
        cache modifier (``.cs``); a tuning knob.
    :returns: ``out``.
    """
    check_shape("x", x, [None, None, None], "[B, H, P]")
    Bt, H, P = x.shape
    check_shape("dt", dt, [Bt, H], "[B, H]")
    check_shape("A_log", A_log, [H], "[H]")
    check_shape("B", B, [Bt, None, None], "[B, G, N]")
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"B: heads H={H} must be a multiple of groups G={G}")
    check_shape("C", C, [Bt, G, N], "[B, G, N] like B")
    check_shape("ssm_state", ssm_state, [None, H, N, P], "[S, H, N, P]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    check_index("state_indices", state_indices, Bt)
    check_last_contiguous("dt", dt)
    check_last_contiguous("A_log", A_log)
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_shape(name, t, [H], "[H]")
            check_last_contiguous(name, t)
    if z is not None:
        check_shape("z", z, [Bt, H, P], "[B, H, P]")
        check_last_contiguous("z", z)
    for name, t in (("x", x), ("B", B), ("C", C)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check_last_contiguous("ssm_state", ssm_state, 2)
    check_same_device(
        {"x": x, "dt": dt, "A_log": A_log, "B": B, "C": C, "ssm_state": ssm_state,
         "state_indices": state_indices, "D": D, "dt_bias": dt_bias, "z": z}
    )  # fmt: skip
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_shape("out", out, [Bt, H, P], "[B, H, P]")
    check_last_contiguous("out", out)

    BN = next_pow2(N)
    # Whole rows of the state (up to 16K elements a tile), about 128 elements per thread: on
    # the H200 at B = 256 (one run, bench_decode_sweep.py) Mamba2 H=128 N=128 P=64 moved 0.94 of
    # copy bandwidth with 64-column tiles against 0.84 with 32 columns, and MiniMax's lightning
    # layer (H=64, N=P=128) 0.944 with 128 columns on 4 warps against 0.818 with 32.
    BP = block_p or next_pow2(P)
    while block_p is None and BP > 16 and BN * BP > 16384:
        BP //= 2
    BP = min(BP, next_pow2(P))
    if num_warps is None:
        num_warps = max(1, min(8, BN * BP // 4096))
    _mamba2_decode_kernel[(Bt * H, cdiv(P, BP))](
        x,
        dt,
        A_log,
        B,
        C,
        D if D is not None else A_log,
        dt_bias if dt_bias is not None else A_log,
        z if z is not None else x,
        ssm_state,
        state_indices,
        out,
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        *(z.stride()[:2] if z is not None else (0, 0)),
        *ssm_state.stride()[:3],
        out.stride(0),
        out.stride(1),
        H=H,
        GROUP=H // G,
        N=N,
        P=P,
        BN=BN,
        BP=BP,
        HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None,
        HAS_Z=z is not None,
        DT_SOFTPLUS=dt_softplus,
        STREAM=streaming,
        num_warps=num_warps,
    )
    return out
