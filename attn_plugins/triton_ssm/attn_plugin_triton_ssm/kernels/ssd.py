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

Two kernels:

1. ``_ssd_state_kernel``, grid ``(N/BN * P/BP, H, N_seq)``: one program walks the chunks of one
   sequence in order for a ``[BN, BP]`` tile of one head's state. It reads the initial state
   from the slot, stores the state entering every chunk (float32, ``states``
   ``[chunks, H, N, P]``) and writes the final state back to the slot. The chunk's own
   contribution (a ``[BN, Q] x [Q, BP]`` dot) does not depend on the running state, so the
   loads of the next chunk are pipelined under the current one.
2. ``_ssd_scan_kernel``, grid ``(chunks, H / HB, P / BP)``: one program per chunk and block of
   ``HB`` heads of one group. ``C B^T`` ``[Q, Q]`` is computed once (B and C are shared by the
   heads of a group and never expanded to ``H`` heads), then, per head, the causal decayed
   product with ``x`` plus the read of the entering state.

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
    check_dtype,
    check_last_contiguous,
    check_same_device,
    check_shape,
    first_that_fits,
    next_pow2,
)

__all__ = ["CHUNK_SIZES", "DEFAULT_CHUNK", "mamba2_ssd_triton"]

#: Chunk sizes the kernels take: ``tl.dot`` needs every dim >= 16.
CHUNK_SIZES = (16, 32, 64, 128)
#: 64: with the scan on 4 warps, chunk 128 runs far slower (H200, granite shape, T = 8192 as
#: one request / 32768 as 16: 6.63 / 6.52 M tokens/s against 10.05 / 11.61 at 64).
DEFAULT_CHUNK = 64
#: Columns of P per program of both kernels when compiled (see :func:`mamba2_ssd_triton`).
_P_TILE = 64
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------
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
        d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(d)), d)  # threshold 20, as torch
    d = tl.where(mask_t, d, 0.0)
    return d, tl.cumsum(d * a, 0)


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
    s_xt, s_xh, s_dtt, s_bt, s_bg, s_ss, s_sh, s_sn, n_seq,
    H: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """States entering each chunk of one sequence, for a ``[BN, BP]`` tile of one head."""
    pid_np = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    NBP: tl.constexpr = (P + BP - 1) // BP
    o_n = (pid_np // NBP) * BN + tl.arange(0, BN)
    o_p = (pid_np % NBP) * BP + tl.arange(0, BP)
    m_n = o_n < N
    m_p = o_p < P
    m_np = m_n[:, None] & m_p[None, :]
    o_q = tl.arange(0, Q)
    i_g = i_h // GROUP

    bos = tl.load(plan_ptr + i_s)
    eos = tl.load(plan_ptr + i_s + 1)
    first_chunk = tl.load(plan_ptr + n_seq + 1 + i_s).to(tl.int64)
    slot = tl.load(idx_ptr + i_s).to(tl.int64)  # int64: slot * stride passes 2**31 elements
    a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))

    p_slot = ssm_ptr + slot * s_ss + i_h * s_sh + o_n[:, None] * s_sn + o_p[None, :]
    h = tl.load(p_slot, mask=m_np, other=0.0).to(tl.float32)
    # states is ours, contiguous [chunks, H, N, P]
    p_states = states_ptr + i_h * (N * P) + o_n[:, None] * P + o_p[None, :]
    for c in range(0, tl.cdiv(eos - bos, Q)):
        tl.store(p_states + (first_chunk + c) * (H * N * P), h, mask=m_np)
        t = bos + c * Q + o_q
        m_t = t < eos
        t64 = t.to(tl.int64)
        d, cs = _chunk_decay(dt_ptr, dt_bias_ptr, a, t64, m_t, s_dtt, i_h, HAS_DT_BIAS,
                             DT_SOFTPLUS)  # fmt: skip
        last = tl.sum(tl.where(o_q == Q - 1, cs, 0.0), 0)  # cs[Q - 1], exactly
        w = tl.exp(last - cs) * d  # decay from each token to the chunk's end, times dt
        b_t = tl.load(b_ptr + t64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                      mask=m_n[:, None] & m_t[None, :], other=0.0)  # fmt: skip
        x_c = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :],
                      mask=m_t[:, None] & m_p[None, :], other=0.0)  # fmt: skip
        bw = b_t.to(tl.float32) * w[None, :]  # [BN, Q]
        h = _mma_f32_left(bw, x_c, h * tl.exp(last), SPLIT, F32, UPCAST)
    tl.store(p_slot, h.to(ssm_ptr.dtype.element_ty), mask=m_np)


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr, plan_ptr,
    states_ptr, s_xt, s_xh, s_dtt, s_bt, s_bg, s_ct, s_cg, s_zt, s_zh, s_ot, s_oh, table_off,
    H: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, HB: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr,
    F32: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Outputs of one chunk for ``HB`` heads of one group and ``BP`` columns of ``P``."""
    i_c = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    o_p = tl.program_id(2) * BP + tl.arange(0, BP)
    m_p = o_p < P
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    o_q = tl.arange(0, Q)
    i_g = h0 // GROUP  # HB divides GROUP: the whole head block shares B and C

    start = tl.load(plan_ptr + table_off + 2 * i_c)
    end = tl.load(plan_ptr + table_off + 2 * i_c + 1)
    t = start + o_q
    m_t = t < end
    t64 = t.to(tl.int64)
    m_tp = m_t[:, None] & m_p[None, :]

    c_m = tl.load(c_ptr + t64[:, None] * s_ct + i_g * s_cg + o_n[None, :],
                  mask=m_t[:, None] & m_n[None, :], other=0.0)  # fmt: skip
    b_t = tl.load(b_ptr + t64[None, :] * s_bt + i_g * s_bg + o_n[:, None],
                  mask=m_n[:, None] & m_t[None, :], other=0.0)  # fmt: skip
    # C B^T of 16-bit values: exact products, float32 sums; shared by the HB heads.
    cb = _mma(c_m, b_t, tl.zeros((Q, Q), dtype=tl.float32), F32, UPCAST)
    causal = o_q[:, None] >= o_q[None, :]
    p_states = states_ptr + i_c.to(tl.int64) * (H * N * P) + o_n[:, None] * P + o_p[None, :]

    for j in range(HB):
        i_h = h0 + j
        a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
        d, cs = _chunk_decay(dt_ptr, dt_bias_ptr, a, t64, m_t, s_dtt, i_h, HAS_DT_BIAS,
                             DT_SOFTPLUS)  # fmt: skip
        # -inf above the diagonal: exp gives 0 there and never overflows.
        seg = tl.where(causal, cs[:, None] - cs[None, :], float("-inf"))
        s = cb * tl.exp(seg) * d[None, :]
        x_c = tl.load(x_ptr + t64[:, None] * s_xt + i_h * s_xh + o_p[None, :], mask=m_tp,
                      other=0.0)  # fmt: skip
        y = _mma_f32_left(s, x_c, tl.zeros((Q, BP), dtype=tl.float32), SPLIT, F32, UPCAST)
        h_in = tl.load(p_states + i_h * (N * P), mask=m_n[:, None] & m_p[None, :], other=0.0)
        y_in = _mma_f32_right(c_m.to(x_c.dtype), h_in, tl.zeros((Q, BP), dtype=tl.float32),
                              SPLIT, F32, UPCAST)  # fmt: skip
        y += y_in * tl.exp(cs)[:, None]
        if HAS_D:
            y += tl.load(d_ptr + i_h).to(tl.float32) * x_c.to(tl.float32)
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
    :param chunk_size: one of :data:`CHUNK_SIZES`.
    :param precise: split float32 dot operands in hi + lo halves (16-bit inputs; see above).
    :param out: ``[T, H, P]``, written and returned (a new tensor of ``x``'s dtype if ``None``).
    :param heads_per_program: heads of one group per scan program (a divisor of ``H // G``).
    :param block_n: rows of ``N`` per state-kernel program (a power of two >= 16).
    :param block_p: columns of ``P`` per program of both kernels (a power of two >= 16),
        instead of :data:`_P_TILE`; for diagnostics (32 compiled on Triton 3.6 hits the
        miscompile described in the body).
    :param num_warps: ``(state kernel, scan kernel)``; ``num_stages`` likewise.
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
    # The state kernel is sequential over a sequence's chunks. 64 rows of N: fewer programs
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
    BP = _P_TILE if not INTERPRETED else max(16, min(_P_TILE, next_pow2(P)))
    if block_p is not None:
        if block_p < 16 or block_p & (block_p - 1):
            raise ValueError(f"block_p: expected a power of two >= 16, got {block_p}")
        BP = block_p
    # 4 warps for the scan: 8 (a guess at its register needs: C [Q, N], C B^T with decayed
    # hi/lo copies, the entering state [N, BP]) ran 1.46x slower on the H200 at the granite
    # shape (4.82 against 7.05 M tokens/s, T = 8192; 4.76 / 6.85 at T = 32768 as 16 requests).
    nw_state, nw_scan = num_warps or (4, 4)
    # One stage for the scan: its loop over a block's heads gains nothing from prefetching
    # the next head's x and state, and the buffers cost occupancy (H200, granite shape: 10.15
    # against 9.42 M tokens/s at T = 8192, 11.64 against 10.77 at T = 32768 as 16 requests;
    # bit-identical outputs).
    ns_state, ns_scan = num_stages or (3, 1)
    dummy = A_log

    def scan(Q: int, bp: int, stages: int, plan: torch.Tensor, states: torch.Tensor, n: int,
             warmup: bool = False):  # fmt: skip
        grid = (n, H // hb, triton.cdiv(P, bp))
        args = (
            x, dt, A_log, dt_bias if dt_bias is not None else dummy, B, C,
            D if D is not None else dummy, z if z is not None else x, out, plan, states,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
            C.stride(1), *(z.stride()[:2] if z is not None else (0, 0)), out.stride(0),
            out.stride(1), 2 * n_seq + 1,
        )  # fmt: skip
        kw = dict(H=H, GROUP=group, N=N, P=P, Q=Q, BN=max(16, next_pow2(N)), BP=bp, HB=hb,
                  HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_D=D is not None,
                  HAS_Z=z is not None, **flags, num_warps=nw_scan, num_stages=stages)  # fmt: skip
        if warmup:
            return _ssd_scan_kernel.warmup(*args, grid=grid, **kw)
        return _ssd_scan_kernel[grid](*args, **kw)

    key = (device, x.dtype, N, P, G, hb, chunk_size, BP, ns_scan, precise, dt_softplus,
           D is not None, z is not None, dt_bias is not None)  # fmt: skip
    tiling = _SCAN_TILING.get(key)
    if tiling is None:
        tiling = _SCAN_TILING[key] = _fit_scan(scan, chunk_size, BP, ns_scan, cu, device)
    Q, BP_scan, ns_scan = tiling

    plan, n_chunks = _chunk_plan(cu, Q, device)
    # Every chunk's entering state, float32 (T=8192, H=128, N=128, P=64, Q=64: 512 MiB).
    states = torch.empty((max(n_chunks, 1), H, N, P), dtype=torch.float32, device=device)
    _ssd_state_kernel[(triton.cdiv(N, BNs) * triton.cdiv(P, BP), H, n_seq)](
        x, dt, A_log, dt_bias if dt_bias is not None else dummy, B, ssm_state, state_indices,
        plan, states, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        *ssm_state.stride()[:3], n_seq, H=H, GROUP=group, N=N, P=P, Q=Q, BN=BNs, BP=BP,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, **flags,
        num_warps=nw_state, num_stages=ns_state,
    )  # fmt: skip
    if n_chunks == 0:
        return out
    scan(Q, BP_scan, ns_scan, plan, states, n_chunks)
    return out


#: Scan-kernel tiling that fits the device's shared memory, by (device, dtype, shape, flags):
#: ``(chunk, BP, num_stages)``. See :func:`_fit_scan`.
_SCAN_TILING: dict[tuple, tuple[int, int, int]] = {}


def _scan_candidates(chunk: int, bp: int, stages: int) -> list[tuple[int, int, int]]:
    """Scan tilings ``(chunk, BP, stages)`` to try in order: the requested one, one stage, then
    halved chunks down to the smallest of :data:`CHUNK_SIZES`, all at ``bp`` columns."""
    candidates = [(chunk, bp, stages)]
    if stages > 1:
        candidates.append((chunk, bp, 1))
    q = chunk
    while q > CHUNK_SIZES[0]:
        q //= 2
        candidates.append((q, bp, 1))
    return candidates


def _fit_scan(scan, chunk: int, bp: int, stages: int, cu: torch.Tensor, device: torch.device):
    """The first scan tiling, from the requested one down, whose compiled kernel fits in the
    device's shared memory: fewer pipeline stages, then smaller chunks. P tiles never narrow
    below :data:`_P_TILE` (the miscompile at 32 columns, see :func:`mamba2_ssd_triton`).

    Why: the scan holds ``C`` and ``B`` ``[Q, N]``, the entering state ``[N, BP]`` and ``x``
    ``[Q, BP]`` in shared memory; float32 inputs (tf32x3 dots) at N = 128 need 263 KB at Q = 128
    on an H200, which has 227 KB per block. The state kernel tiles N and never comes close. Each
    candidate is compiled (``warmup``, no launch) and its ``metadata.shared`` compared with the
    limit, before anything is written, so a request's state is never half-updated. Under the
    interpreter there is no limit: the requested tiling stands.
    """
    if INTERPRETED or device.type != "cuda":
        return chunk, bp, stages
    candidates = _scan_candidates(chunk, bp, stages)

    def compile_one(tiling: tuple[int, int, int]):
        q, b, st = tiling
        plan, n = _chunk_plan(cu, q, device)
        states = torch.empty(1, dtype=torch.float32, device=device)
        return scan(q, b, st, plan, states, n, warmup=True)

    return first_that_fits(candidates, compile_one, device, "mamba2_ssd_triton: no scan tiling",
                           "(chunk, BP, stages)")  # fmt: skip
