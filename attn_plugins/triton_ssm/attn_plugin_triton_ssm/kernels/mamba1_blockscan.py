"""Mamba1 prefill as a parallel scan over blocks of tokens (``mamba1_scan(token_block=BT)``).

The sequential kernel (:mod:`.mamba1`) walks a request's tokens one by one; each step is a
chain of dependent loads, exponentials and a reduction, so one long request runs at the speed
of that chain (d_inner / 16 programs, each walking every token). Here a program still owns a
block of ``BD`` channels of one request, but takes ``BT`` tokens per step: the per-token
recurrence ``h_t = a_t h_{t-1} + u_t`` (``a_t = exp(dt_t A)``, ``u_t = dt_t x_t B_t``, all
``[BD, N]``) is an affine map, and maps compose associatively::

    (a1, u1) then (a2, u2)  =  (a1 a2, a2 u1 + u2)

so ``tl.associative_scan`` over the block's token axis gives every ``h_t`` of the block from
the state entering it in ``log2(BT)`` combine levels, the way mamba_ssm's CUDA scan runs a
block scan over its threads' tokens. Tokens past the request's end get ``dt = 0``: the identity
map (``a = 1``, ``u = 0``), so the block's last row is the state leaving it.

Same inputs, layouts and outputs as the sequential varlen kernel (no speculative verify: no
per-token states); it rounds differently (products of decays instead of one FMA per token).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _affine_then(a1, u1, a2, u2):
    """The map ``h -> a1 h + u1`` followed by ``h -> a2 h + u2``."""
    return a1 * a2, tl.fma(a2, u1, u2)


@triton.jit
def _mamba1_block_scan_kernel(
    x_ptr, dt_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, z_ptr, state_ptr, idx_ptr,
    cu_ptr, init_ptr, out_ptr,
    s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od, s_ss, s_sd,
    D: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr, WRITE_STATE: tl.constexpr,
):  # fmt: skip
    """Grid ``(R, D / BD)``: request ``pid_b``'s tokens ``cu[b] .. cu[b + 1]`` for channels
    ``pid_d * BD ..``, from and back to its slot (``-1``: zeros out, no state)."""
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_n = tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_d = o_d < D
    m_n = o_n < N
    m_dn = m_d[:, None] & m_n[None, :]
    b_a = -tl.exp(tl.load(a_log_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.0))
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    if HAS_D:
        b_skip = tl.load(d_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    start = tl.load(cu_ptr + pid_b).to(tl.int64)
    end = tl.load(cu_ptr + pid_b + 1).to(tl.int64)
    valid = (o_d * 0 + slot) >= 0  # a block: the interpreter rejects scalar & block masks
    m_state = m_dn & valid[:, None]
    p_state = state_ptr + slot * s_ss + o_d[:, None] * s_sd + o_n[None, :]
    b_h = tl.load(p_state, mask=m_state, other=0.0).to(tl.float32)
    if HAS_INIT:  # a fresh request's slot holds whatever its previous owner left: never read it
        init = tl.load(init_ptr + pid_b).to(tl.int32)
        b_h = tl.where(((o_d * 0 + init) == 0)[:, None], 0.0, b_h)
    last = (o_t == BT - 1)[:, None, None]

    for t0 in range(start, end, BT):
        t = t0 + o_t
        m_t = t < end
        m_td = m_t[:, None] & m_d[None, :]
        m_tn = m_t[:, None] & m_n[None, :]
        b_x = tl.load(x_ptr + t[:, None] * s_xt + o_d[None, :] * s_xd, mask=m_td, other=0.0)
        b_x = b_x.to(tl.float32)
        b_dt = tl.load(dt_ptr + t[:, None] * s_dtt + o_d[None, :], mask=m_td, other=0.0)
        b_dt = b_dt.to(tl.float32)
        if HAS_DT_BIAS:
            b_dt += b_bias[None, :]
        if DT_SOFTPLUS:
            b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
        b_dt = tl.where(m_td, b_dt, 0.0)  # past the end: the identity map
        b_B = tl.load(b_ptr + t[:, None] * s_bt + o_n[None, :], mask=m_tn, other=0.0)
        b_C = tl.load(c_ptr + t[:, None] * s_ct + o_n[None, :], mask=m_tn, other=0.0)
        b_decay = tl.exp(b_dt[:, :, None] * b_a[None, :, :])  # [BT, BD, BN]
        b_u = (b_dt * b_x)[:, :, None] * b_B.to(tl.float32)[:, None, :]
        b_acum, b_ucum = tl.associative_scan((b_decay, b_u), 0, _affine_then)
        b_hs = tl.fma(b_acum, b_h[None, :, :], b_ucum)  # h after each token of the block
        b_y = tl.sum(b_hs * b_C.to(tl.float32)[:, None, :], 2)  # [BT, BD]
        if HAS_D:
            b_y += b_skip[None, :] * b_x
        if HAS_Z:
            b_z = tl.load(z_ptr + t[:, None] * s_zt + o_d[None, :] * s_zd, mask=m_td, other=0.0)
            b_z = b_z.to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        b_y = tl.where(valid[None, :], b_y, 0.0)
        p_out = out_ptr + t[:, None] * s_ot + o_d[None, :] * s_od
        tl.store(p_out, b_y.to(out_ptr.dtype.element_ty), mask=m_td)
        b_h = tl.sum(tl.where(last, b_hs, 0.0), 0)  # the last row: the state leaving the block
    if WRITE_STATE:
        tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_state)


def launch_block_scan(
    x, dt, A_log, B, C, state, idx, out, *, cu, init, D, dt_bias, z, dt_softplus,
    write_state, token_block, block_d, num_warps,
) -> None:  # fmt: skip
    """Launch :func:`_mamba1_block_scan_kernel` over ``R = idx.shape[0]`` requests (the
    arguments are checked by ``mamba1_scan``; ``state`` is ``[S, D, N]``)."""
    Dn, N = A_log.shape
    R = idx.shape[0]
    if R == 0:
        return
    BN = triton.next_power_of_2(N)
    BD = block_d or 16
    warps = num_warps or max(1, min(8, token_block * BD * BN // 1024))  # 4 at 16 x 16 x 16
    _mamba1_block_scan_kernel[(R, triton.cdiv(Dn, BD))](
        x, dt, A_log, B, C,
        D if D is not None else A_log,
        dt_bias if dt_bias is not None else A_log,
        z if z is not None else x,
        state, idx, cu,
        init if init is not None else idx,
        out,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), C.stride(0),
        *(z.stride() if z is not None else (0, 0)),
        *out.stride(),
        state.stride(0), state.stride(1),
        D=Dn, N=N, BD=BD, BN=BN, BT=token_block,
        HAS_INIT=init is not None, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus, WRITE_STATE=write_state,
        num_warps=warps,
    )  # fmt: skip
