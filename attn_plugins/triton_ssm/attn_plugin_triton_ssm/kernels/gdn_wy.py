"""Gated DeltaNet's intra-chunk WY representation (``w``, ``u``) in one kernel.

Per chunk of ``BT = 64`` tokens of one value head (``g`` the chunk-local cumulative log2 decay,
``beta`` the write strength, ``i > j`` the strictly lower triangle)::

    A[i, j] = beta_i * (k_i . k_j) * exp2(g_i - g_j)     (i > j, else 0)
    Ai      = (I + A)^-1
    w       = Ai @ (beta * exp2(g) * k)
    u       = Ai @ (beta * v)

fla-core computes this in two kernels (its fused ``beta k k^T``-and-solve kernel, which stores
``Ai``, then ``recompute_w_u``, which reads ``Ai``, k and v back) and zero-fills ``Ai`` first.
Here one program solves a chunk's ``Ai`` in registers and applies it at once: ``Ai`` is neither
stored nor read, and k is read by one kernel instead of two.

The solve works on 16-row blocks. Each diagonal block's inverse is a finite series, since a
strictly lower ``[16, 16]`` block ``a`` has ``a^16 = 0``; with ``n = -a`` it factors into
squarings::

    (I + a)^-1 = I + n + ... + n^15 = (I + n)(I + n^2)(I + n^4)(I + n^8)

(six float32 dots, no row-by-row substitution). The off-diagonal blocks follow from the rows of
``(I + A) Ai = I``: ``Ai[i, j] = -Ai[i, i] @ sum_{j <= m < i} A[i, m] @ Ai[m, j]``.

Rounding as in fla: ``Ai`` and the scaled operands ``beta * exp2(g) * k``, ``beta * v`` enter the
last dots rounded to the inputs' dtype (each scaled in float32 and rounded once), with float32
accumulation; ``w`` and ``u`` are stored in k's and v's dtype. The solve itself keeps float32's
precision throughout (fla's block merges use tf32).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import INTERPRETED

__all__ = ["BT", "gdn_wy"]

#: Tokens per chunk: fla's Gated DeltaNet chunk, which the state and output passes use.
BT = 64


@triton.jit
def _mm(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` in float32. ``UPCAST`` (Triton's interpreter, whose 16-bit dots are wrong):
    the operands, already rounded to their dtype, multiplied in float32. ``PREC``: Triton's
    ``input_precision`` for float32 operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _f32mm(a, b, SOLVE: tl.constexpr):
    """``a @ b`` of float32 blocks to float32's precision (not tf32: the solve's errors would
    compound): ``SOLVE`` ``"ieee"`` (CUDA cores) or ``"tf32x3"`` (three tf32 tensor-core
    products, the operands split into high and low parts)."""
    return tl.dot(a, b, input_precision=SOLVE)


@triton.jit
def _block_inverse(a, eye, SOLVE: tl.constexpr):
    """``(I + a)^-1`` of a strictly lower ``[16, 16]`` float32 block (see the module docstring)."""
    n = -a
    p = eye + n
    n = _f32mm(n, n, SOLVE)  # n^2
    p = p + _f32mm(p, n, SOLVE)
    n = _f32mm(n, n, SOLVE)  # n^4
    p = p + _f32mm(p, n, SOLVE)
    n = _f32mm(n, n, SOLVE)  # n^8
    return p + _f32mm(p, n, SOLVE)


@triton.jit
def _load_rows(base, b: tl.constexpr, o_c, left, stride, cols, m_cols):
    """Rows ``16 b .. 16 b + 15`` of a chunk (``left`` of them exist), columns ``cols``."""
    rows = b * 16 + o_c
    return tl.load(base + rows[:, None] * stride + cols[None, :],
                   mask=(rows < left)[:, None] & m_cols[None, :], other=0.0)  # fmt: skip


@triton.jit
def _store_rows(base, x, b: tl.constexpr, o_c, left, stride, cols, m_cols):
    rows = b * 16 + o_c
    tl.store(base + rows[:, None] * stride + cols[None, :], x.to(base.dtype.element_ty),
             mask=(rows < left)[:, None] & m_cols[None, :])  # fmt: skip


@triton.jit
def _scaled(a, g_i, g_j, beta_i, m_i, m_j):
    """An off-diagonal block of ``A``: ``a * exp2(g_i - g_j) * beta_i`` on rows and columns
    that exist, else 0 (a missing row's ``g`` is 0, so its ``exp2`` may overflow: masked)."""
    keep = m_i[:, None] & m_j[None, :]
    return tl.where(keep, a * tl.exp2(g_i[:, None] - g_j[None, :]), 0.0) * beta_i[:, None]


@triton.jit
def _apply_inverse(ai, scales, src, src_stride, dst, dst_stride, cols, m_cols, o_c, left,
                   UPCAST: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``dst = Ai @ (scales * src)`` on columns ``cols`` of a chunk: ``ai`` the ten lower
    ``[16, 16]`` blocks of ``Ai`` (row-major: 00, 10, 11, 20, ...), ``scales`` four ``[16]``
    row scales. ``Ai`` and the scaled rows enter the dots in ``src``'s dtype, as fla stores and
    rounds them; the sums are float32, stored in ``dst``'s dtype."""
    dt = src.dtype.element_ty
    c00, c10, c11, c20, c21 = ai[0].to(dt), ai[1].to(dt), ai[2].to(dt), ai[3].to(dt), ai[4].to(dt)
    c22, c30, c31, c32, c33 = ai[5].to(dt), ai[6].to(dt), ai[7].to(dt), ai[8].to(dt), ai[9].to(dt)
    x0 = _load_rows(src, 0, o_c, left, src_stride, cols, m_cols).to(tl.float32) * scales[0][:, None]
    x1 = _load_rows(src, 1, o_c, left, src_stride, cols, m_cols).to(tl.float32) * scales[1][:, None]
    x2 = _load_rows(src, 2, o_c, left, src_stride, cols, m_cols).to(tl.float32) * scales[2][:, None]
    x3 = _load_rows(src, 3, o_c, left, src_stride, cols, m_cols).to(tl.float32) * scales[3][:, None]
    x0, x1, x2, x3 = x0.to(dt), x1.to(dt), x2.to(dt), x3.to(dt)
    y0 = _mm(c00, x0, UPCAST, PREC)
    y1 = _mm(c10, x0, UPCAST, PREC) + _mm(c11, x1, UPCAST, PREC)
    y2 = _mm(c20, x0, UPCAST, PREC) + _mm(c21, x1, UPCAST, PREC) + _mm(c22, x2, UPCAST, PREC)
    y3 = (_mm(c30, x0, UPCAST, PREC) + _mm(c31, x1, UPCAST, PREC) + _mm(c32, x2, UPCAST, PREC)
          + _mm(c33, x3, UPCAST, PREC))  # fmt: skip
    _store_rows(dst, y0, 0, o_c, left, dst_stride, cols, m_cols)
    _store_rows(dst, y1, 1, o_c, left, dst_stride, cols, m_cols)
    _store_rows(dst, y2, 2, o_c, left, dst_stride, cols, m_cols)
    _store_rows(dst, y3, 3, o_c, left, dst_stride, cols, m_cols)


@triton.jit
def _wy_kernel(
    k_ptr,  # [T, H, K]
    v_ptr,  # [T, HV, V]
    g_ptr,  # [T, HV] float32, chunk-local cumulative log2 decay
    beta_ptr,  # [T, HV]
    w_ptr,  # [T, HV, K] out, k's dtype
    u_ptr,  # [T, HV, V] out, v's dtype
    cu_ptr,  # [N + 1] token offsets
    chunk_ptr,  # [NT, 2] (sequence, chunk of the sequence) of every chunk
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    SOLVE: tl.constexpr,
):
    """Grid ``(NT, HV)``: one program per chunk and value head, the chunk as four blocks of
    16 rows (the inverse's series is exact for 16)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_ptr + 2 * i_c)
    i_t = tl.load(chunk_ptr + 2 * i_c + 1).to(tl.int32)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    left = (tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos).to(tl.int32) - i_t * 64
    t0 = bos + i_t * 64  # the chunk's first token
    i_hk = i_h // (HV // H)

    o_c = tl.arange(0, 16)
    m0, m1, m2, m3 = o_c < left, o_c + 16 < left, o_c + 32 < left, o_c + 48 < left
    p_gb = t0 * HV + i_h + o_c * HV
    g0 = tl.load(g_ptr + p_gb, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + p_gb + 16 * HV, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + p_gb + 32 * HV, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g_ptr + p_gb + 48 * HV, mask=m3, other=0.0).to(tl.float32)
    b0 = tl.load(beta_ptr + p_gb, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + p_gb + 16 * HV, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + p_gb + 32 * HV, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + p_gb + 48 * HV, mask=m3, other=0.0).to(tl.float32)

    # the ten lower blocks of k k^T, over K in slices of BK
    p_k = k_ptr + t0 * (H * K) + i_hk * K
    a00 = tl.zeros([16, 16], dtype=tl.float32)
    a10 = tl.zeros([16, 16], dtype=tl.float32)
    a11 = tl.zeros([16, 16], dtype=tl.float32)
    a20 = tl.zeros([16, 16], dtype=tl.float32)
    a21 = tl.zeros([16, 16], dtype=tl.float32)
    a22 = tl.zeros([16, 16], dtype=tl.float32)
    a30 = tl.zeros([16, 16], dtype=tl.float32)
    a31 = tl.zeros([16, 16], dtype=tl.float32)
    a32 = tl.zeros([16, 16], dtype=tl.float32)
    a33 = tl.zeros([16, 16], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        k_0 = _load_rows(p_k, 0, o_c, left, H * K, o_k, m_k)
        k_1 = _load_rows(p_k, 1, o_c, left, H * K, o_k, m_k)
        k_2 = _load_rows(p_k, 2, o_c, left, H * K, o_k, m_k)
        k_3 = _load_rows(p_k, 3, o_c, left, H * K, o_k, m_k)
        a00 += _mm(k_0, tl.trans(k_0), UPCAST, PREC)
        a10 += _mm(k_1, tl.trans(k_0), UPCAST, PREC)
        a11 += _mm(k_1, tl.trans(k_1), UPCAST, PREC)
        a20 += _mm(k_2, tl.trans(k_0), UPCAST, PREC)
        a21 += _mm(k_2, tl.trans(k_1), UPCAST, PREC)
        a22 += _mm(k_2, tl.trans(k_2), UPCAST, PREC)
        a30 += _mm(k_3, tl.trans(k_0), UPCAST, PREC)
        a31 += _mm(k_3, tl.trans(k_1), UPCAST, PREC)
        a32 += _mm(k_3, tl.trans(k_2), UPCAST, PREC)
        a33 += _mm(k_3, tl.trans(k_3), UPCAST, PREC)

    strict = o_c[:, None] > o_c[None, :]
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    # the diagonal blocks: strictly lower, then inverted
    ai00 = _block_inverse(tl.where(strict, _scaled(a00, g0, g0, b0, m0, m0), 0.0), eye, SOLVE)
    ai11 = _block_inverse(tl.where(strict, _scaled(a11, g1, g1, b1, m1, m1), 0.0), eye, SOLVE)
    ai22 = _block_inverse(tl.where(strict, _scaled(a22, g2, g2, b2, m2, m2), 0.0), eye, SOLVE)
    ai33 = _block_inverse(tl.where(strict, _scaled(a33, g3, g3, b3, m3, m3), 0.0), eye, SOLVE)
    a10 = _scaled(a10, g1, g0, b1, m1, m0)
    a20 = _scaled(a20, g2, g0, b2, m2, m0)
    a21 = _scaled(a21, g2, g1, b2, m2, m1)
    a30 = _scaled(a30, g3, g0, b3, m3, m0)
    a31 = _scaled(a31, g3, g1, b3, m3, m1)
    a32 = _scaled(a32, g3, g2, b3, m3, m2)
    # the blocks below the diagonal, one block-diagonal at a time
    ai10 = -_f32mm(ai11, _f32mm(a10, ai00, SOLVE), SOLVE)
    ai21 = -_f32mm(ai22, _f32mm(a21, ai11, SOLVE), SOLVE)
    ai32 = -_f32mm(ai33, _f32mm(a32, ai22, SOLVE), SOLVE)
    ai20 = -_f32mm(ai22, _f32mm(a20, ai00, SOLVE) + _f32mm(a21, ai10, SOLVE), SOLVE)
    ai31 = -_f32mm(ai33, _f32mm(a31, ai11, SOLVE) + _f32mm(a32, ai21, SOLVE), SOLVE)
    x30 = _f32mm(a30, ai00, SOLVE) + _f32mm(a31, ai10, SOLVE) + _f32mm(a32, ai20, SOLVE)
    ai30 = -_f32mm(ai33, x30, SOLVE)

    # w = Ai @ (beta exp2(g) k) and u = Ai @ (beta v)
    ai = (ai00, ai10, ai11, ai20, ai21, ai22, ai30, ai31, ai32, ai33)
    scales = (b0 * tl.exp2(g0), b1 * tl.exp2(g1), b2 * tl.exp2(g2), b3 * tl.exp2(g3))
    p_w = w_ptr + t0 * (HV * K) + i_h * K
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        _apply_inverse(ai, scales, p_k, H * K, p_w, HV * K, o_k, o_k < K, o_c, left, UPCAST, PREC)
    p_v = v_ptr + t0 * (HV * V) + i_h * V
    p_u = u_ptr + t0 * (HV * V) + i_h * V
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        _apply_inverse(ai, (b0, b1, b2, b3), p_v, HV * V, p_u, HV * V, o_v, o_v < V, o_c, left,
                       UPCAST, PREC)  # fmt: skip


def gdn_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    block_k: int = 64,
    block_v: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    solve_precision: Literal["ieee", "tf32x3"] = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's ``w`` and ``u`` per 64-token chunk of every sequence (the module
    docstring gives the formulas); what fla-core's ``chunk_gated_delta_rule_fwd_intra``
    returns as its first two outputs.

    :param k: ``[T, H, K]`` keys (l2-normalised where the layer does so), contiguous.
    :param v: ``[T, HV, V]`` values, contiguous; ``HV`` a multiple of ``H`` (each key head
        serves ``HV // H`` value heads).
    :param g: ``[T, HV]`` float32, the chunk-local cumulative log2 decay (restarting at every
        chunk of every sequence), contiguous.
    :param beta: ``[T, HV]``, contiguous, any float dtype.
    :param cu_seqlens: ``[N + 1]`` int64 token offsets of the sequences.
    :param chunk_indices: ``[NT, 2]`` integer (sequence, chunk of that sequence) of every
        64-token chunk, as fla's ``prepare_chunk_indices`` gives them.
    :param block_k: key columns a program handles at once (a power of two, at least 16);
        ``block_v`` likewise for the values.
    :param solve_precision: how the solve's float32 block products run: ``"ieee"`` (CUDA
        cores) or ``"tf32x3"`` (tensor cores, three tf32 products each); both keep float32's
        precision. The interpreter computes both in float32.
    :returns: ``(w, u)``: ``[T, HV, K]`` in k's dtype and ``[T, HV, V]`` in v's dtype.
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    expected = {"v": (T, HV, V), "g": (T, HV), "beta": (T, HV)}
    for name, t in (("v", v), ("g", g), ("beta", beta)):
        if tuple(t.shape) != expected[name] or not t.is_contiguous():
            raise ValueError(
                f"gdn_wy: expected a contiguous {name} of shape {expected[name]} (k "
                f"{tuple(k.shape)}, v {tuple(v.shape)}), got {tuple(t.shape)}"
                f"{'' if t.is_contiguous() else ' not contiguous'}"
            )
    if not k.is_contiguous() or HV % H:
        raise ValueError(
            f"gdn_wy: expected contiguous keys whose heads divide the value heads, got k "
            f"{tuple(k.shape)} (contiguous: {k.is_contiguous()}) and {HV} value heads"
        )
    if g.dtype != torch.float32:
        raise ValueError(f"gdn_wy: expected g in float32 (log2 decay), got {g.dtype}")
    if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(
            f"gdn_wy: expected chunk_indices [NT, 2], got {tuple(chunk_indices.shape)}"
        )
    if solve_precision not in ("ieee", "tf32x3"):
        raise ValueError(
            f"gdn_wy: solve_precision must be 'ieee' or 'tf32x3', got {solve_precision!r}"
        )
    for name, block in (("block_k", block_k), ("block_v", block_v)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"gdn_wy: {name} must be a power of two >= 16, got {block}")
    w = torch.empty(T, HV, K, device=k.device, dtype=k.dtype)
    u = torch.empty(T, HV, V, device=v.device, dtype=v.dtype)
    if chunk_indices.shape[0] and HV:
        full = torch.float32 in (k.dtype, v.dtype)
        _wy_kernel[(chunk_indices.shape[0], HV)](
            k, v, g, beta, w, u, cu_seqlens, chunk_indices,
            H=H, HV=HV, K=K, V=V, BK=min(block_k, triton.next_power_of_2(K)),
            BV=min(block_v, triton.next_power_of_2(V)), UPCAST=INTERPRETED,
            PREC="ieee" if full else "tf32", SOLVE=solve_precision, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip
    return w, u
