"""Gated delta rule (Gated DeltaNet, KDA) decode and speculative-verify kernels.

One kernel, ``_delta_rule_kernel``, runs ``T`` tokens per request against the recurrent
state of that request's slot; compile-time flags pick what it stores. Per value head ``h`` (key
head ``h // (Hv // Hk)``) and token ``t``::

    q, k <- q / ||q||, k / ||k||          (use_qk_l2norm; ||x|| = sqrt(sum x^2 + 1e-6), as fla)
    S    <- S * exp(g)                    (GDN: g scalar per head; KDA: g[Dk] per key channel)
    v'   <- beta * (v - S^T k)
    S    <- S + k v'^T
    o    <- S^T (q * scale)

``S`` is ``[Dk, Dv]`` (key dim first). A work item is one ``[Dk, BV]`` tile of one head's state
(``B * Hv * Dv / BV`` items), held in registers so the state is read once and written once
(decode is HBM-bound on the state). By default each item is one program, which holds one tile
(127 registers a thread at ``BV = 64`` on sm90, so four programs share an SM and hide each
other's loads). ``programs_per_sm=n`` launches a persistent grid instead: ``n`` programs per
SM, each looping over items and prefetching the next item's tile while it updates the current
one (226 registers: two programs an SM). Slot offsets are computed in int64: ``slot * stride``
overflows int32 past 2 GiB of state.

Public wrappers (all write in place and return ``out``):

* ``gdn_decode`` / ``kda_decode``: one token per request, state updated in the slot (or,
  with ``state_indices_out``, written to another slot: out of place).
* ``gdn_verify_native`` / ``kda_verify_native``: ``K1`` tokens, every per-position state stored
  in ``intermediate_states``; slot untouched. ``gdn_commit`` then copies the state after the
  accepted prefix into the slot.
* ``gdn_verify_replay`` / ``kda_verify_replay``: ``K1`` tokens, outputs only, slot untouched;
  ``gdn_replay_commit`` / ``kda_replay_commit`` recompute the accepted prefix from the slot and
  write the result. Both strategies run the same float operations in the same order, so they
  commit bit-identical states.

A ``state_indices`` entry of ``-1`` marks a padding row (CUDA-graph batch padding): its outputs
are zeros and no state is read or written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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

__all__ = [
    "gdn_commit",
    "gdn_decode",
    "gdn_replay_commit",
    "gdn_verify_native",
    "gdn_verify_replay",
    "kda_commit",
    "kda_decode",
    "kda_replay_commit",
    "kda_verify_native",
    "kda_verify_replay",
]

_L2_EPS = 1e-6  # fla's in-kernel l2norm: x / sqrt(sum(x^2) + 1e-6)


@triton.jit
def _tile_coords(w, n_work, idx_ptr, HV: tl.constexpr, NVB: tl.constexpr, GROUP: tl.constexpr):
    """Work item ``w`` -> (request, value head, key head, Dv block, slot). Items past the end get
    slot -1 (nothing loaded or stored) and the coordinates of the last item (addresses stay in
    bounds). Neighbouring items are the Dv blocks of one head, then the heads of one request."""
    ok = w < n_work
    wc = tl.minimum(w, n_work - 1)
    i_vb = wc % NVB
    i_bh = wc // NVB
    i_hv = i_bh % HV
    i_b = (i_bh // HV).to(tl.int64)
    slot = tl.load(idx_ptr + i_b).to(tl.int32)
    slot = tl.where(ok, slot, -1)
    return i_b, i_hv, i_hv // GROUP, i_vb, slot


@triton.jit
def _load_token(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_b, t, i_hk, i_hv, o_k, o_v,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
    PER_CHANNEL_G: tl.constexpr,
):  # fmt: skip
    """Token ``t`` of request ``i_b``, float32: q, k ``[BK]``, v ``[BV]``, g (scalar, or ``[BK]``
    per key channel), beta (scalar)."""
    p_q = q_ptr + i_b * s_qb + t * s_qt + i_hk * s_qh + o_k
    p_k = k_ptr + i_b * s_kb + t * s_kt + i_hk * s_kh + o_k
    p_v = v_ptr + i_b * s_vb + t * s_vt + i_hv * s_vh + o_v
    if EVEN_K:
        b_q = tl.load(p_q)
        b_k = tl.load(p_k)
    else:
        b_q = tl.load(p_q, mask=o_k < DK, other=0.0)
        b_k = tl.load(p_k, mask=o_k < DK, other=0.0)
    if EVEN_V:
        b_v = tl.load(p_v)
    else:
        b_v = tl.load(p_v, mask=o_v < DV, other=0.0)
    if PER_CHANNEL_G:
        p_g = g_ptr + i_b * s_gb + t * s_gt + i_hv * s_gh + o_k
        if EVEN_K:
            b_g = tl.load(p_g)
        else:
            b_g = tl.load(p_g, mask=o_k < DK, other=0.0)
    else:
        b_g = tl.load(g_ptr + i_b * s_gb + t * s_gt + i_hv * s_gh)
    b_beta = tl.load(beta_ptr + i_b * s_bb + t * s_bt + i_hv * s_bh)
    return (
        b_q.to(tl.float32),
        b_k.to(tl.float32),
        b_v.to(tl.float32),
        b_g.to(tl.float32),
        b_beta.to(tl.float32),
    )


@triton.jit
def _load_state(state_ptr, slot, i_hv, i_vb, o_k, o_v0, zero_kv, s_ss, s_sh,
                DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, EVEN_K: tl.constexpr,
                EVEN_V: tl.constexpr):  # fmt: skip
    """The ``[BK, BV]`` state tile (float32); zeros for slot -1. The validity mask is built as a
    block so it is uniform along Dv (loads stay vectorised) and the interpreter accepts it. The
    last two dims are packed (checked on the host): the row stride is the constant ``DV``, so
    the addresses of a thread's rows are immediate offsets from one base register."""
    o_v = i_vb * BV + o_v0
    base = state_ptr + tl.maximum(slot, 0).to(tl.int64) * s_ss + i_hv * s_sh
    p_s = base + o_k[:, None] * DV + o_v[None, :]
    m = (zero_kv + slot) >= 0
    if not EVEN_K:
        m = m & (o_k[:, None] < DK)
    if not EVEN_V:
        m = m & (o_v[None, :] < DV)
    return tl.load(p_s, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _load_item(
    w, n_work, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, idx_ptr, o_k, o_v0, zero_kv,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    s_ss, s_sh,
    HV: tl.constexpr, GROUP: tl.constexpr, NVB: tl.constexpr, DK: tl.constexpr,
    DV: tl.constexpr, BV: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
    PER_CHANNEL_G: tl.constexpr,
):  # fmt: skip
    """Work item ``w``: its coordinates (:func:`_tile_coords`), state tile
    (:func:`_load_state`) and first token (:func:`_load_token`), as one tuple."""
    i_b, i_hv, i_hk, i_vb, slot = _tile_coords(w, n_work, idx_ptr, HV, NVB, GROUP)
    b_s = _load_state(state_ptr, slot, i_hv, i_vb, o_k, o_v0, zero_kv, s_ss, s_sh,
                      DK, DV, BV, EVEN_K, EVEN_V)  # fmt: skip
    b_q, b_k, b_v, b_g, b_beta = _load_token(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_b, 0, i_hk, i_hv, o_k, i_vb * BV + o_v0,
        s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
        DK, DV, EVEN_K, EVEN_V, PER_CHANNEL_G,
    )  # fmt: skip
    return i_b, i_hv, i_hk, i_vb, slot, b_s, b_q, b_k, b_v, b_g, b_beta


@triton.jit
def _step(b_s, b_q, b_k, b_v, b_g, b_beta, scale, USE_L2NORM: tl.constexpr,
          EPS: tl.constexpr, PER_CHANNEL_G: tl.constexpr):  # fmt: skip
    """One delta-rule token on a ``[BK, BV]`` tile; returns the new tile and the output ``[BV]``.

    Every reduction reads the loaded tile and the raw q, k, so all five are independent and
    run together (no load -> reduce -> update -> reduce chain): with d = exp(g),
    q' = q * scale / ||q||, k' = k / ||k||,
        u = (d S)^T k',  w = (d S)^T q',  v' = beta (v - u),
        S <- d S + k' v'^T,  o = S^T q' = w + (q'.k') v'.
    """
    if USE_L2NORM:
        r_q = scale / tl.sqrt(tl.sum(b_q * b_q) + EPS)
        r_k = 1.0 / tl.sqrt(tl.sum(b_k * b_k) + EPS)
    else:
        r_q = scale
        r_k = 1.0
    d = tl.exp(b_g)
    if PER_CHANNEL_G:
        u = tl.sum(b_s * (b_k * d)[:, None], 0) * r_k
        w = tl.sum(b_s * (b_q * d)[:, None], 0) * r_q
        b_s = b_s * d[:, None]
    else:
        u = tl.sum(b_s * b_k[:, None], 0) * (r_k * d)
        w = tl.sum(b_s * b_q[:, None], 0) * (r_q * d)
        b_s = b_s * d
    qk = tl.sum(b_q * b_k) * (r_q * r_k)
    v_new = b_beta * (b_v - u)
    b_s = b_s + (b_k * r_k)[:, None] * v_new[None, :]
    return b_s, w + qk * v_new


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, idx_ptr, ntok_ptr, out_ptr, inter_ptr,
    widx_ptr, scale, n_work,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    s_ss, s_sh, s_ob, s_ot, s_oh, s_ib, s_it, s_ih,
    T: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr, PER_CHANNEL_G: tl.constexpr,
    USE_L2NORM: tl.constexpr, EPS: tl.constexpr, HAS_NTOK: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_INTER: tl.constexpr, WRITE_SLOT: tl.constexpr,
    OUT_OF_PLACE: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    # Persistent: program p handles work items p, p + P, p + 2P, ... (P = grid size) and, with
    # PREFETCH, loads item i + P (state tile and first token) before computing item i, so a
    # state read is in flight while the previous tile is reduced and stored. Without it (one
    # program per item) each item is loaded when its turn comes: the prefetched tile's
    # registers go, so more programs fit on an SM at once.
    EVEN_K: tl.constexpr = DK == BK
    EVEN_V: tl.constexpr = DV % BV == 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o_k = tl.arange(0, BK)
    o_v0 = tl.arange(0, BV)
    zero_kv = tl.zeros([BK, BV], dtype=tl.int32)
    zero_v = tl.zeros([BV], dtype=tl.int32)

    if PREFETCH:
        i_b, i_hv, i_hk, i_vb, slot, b_s, b_q, b_k, b_v, b_g, b_beta = _load_item(
            pid, n_work, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, idx_ptr, o_k, o_v0,
            zero_kv, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh,
            s_bb, s_bt, s_bh, s_ss, s_sh, HV, GROUP, NVB, DK, DV, BV, EVEN_K, EVEN_V,
            PER_CHANNEL_G,
        )  # fmt: skip
    for w in range(pid, n_work, nprog):
        # ---- item w + P with PREFETCH (computed next iteration), else item w, loaded now
        n_b, n_hv, n_hk, n_vb, n_slot, n_s, n_q, n_k, n_v, n_g, n_beta = _load_item(
            w + nprog if PREFETCH else w, n_work, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
            state_ptr, idx_ptr, o_k, o_v0, zero_kv, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb,
            s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_ss, s_sh, HV, GROUP, NVB, DK, DV,
            BV, EVEN_K, EVEN_V, PER_CHANNEL_G,
        )  # fmt: skip
        if not PREFETCH:
            i_b, i_hv, i_hk, i_vb, slot = n_b, n_hv, n_hk, n_vb, n_slot
            b_s, b_q, b_k, b_v, b_g, b_beta = n_s, n_q, n_k, n_v, n_g, n_beta

        # ---- item w
        o_v = i_vb * BV + o_v0
        valid_v = (zero_v + slot) >= 0
        m_st = (zero_kv + slot) >= 0  # as a block: see _load_state
        if not EVEN_K:
            m_st = m_st & (o_k[:, None] < DK)
        if not EVEN_V:
            m_st = m_st & (o_v[None, :] < DV)
        if HAS_NTOK:
            n_tok = tl.minimum(tl.load(ntok_ptr + i_b).to(tl.int32), T)
        for t in tl.static_range(T):
            if t > 0:
                b_q, b_k, b_v, b_g, b_beta = _load_token(
                    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_b, t, i_hk, i_hv, o_k, o_v,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh,
                    s_bb, s_bt, s_bh, DK, DV, EVEN_K, EVEN_V, PER_CHANNEL_G,
                )  # fmt: skip
            s_new, b_o = _step(b_s, b_q, b_k, b_v, b_g, b_beta, scale, USE_L2NORM, EPS,
                               PER_CHANNEL_G)  # fmt: skip
            if HAS_NTOK:  # tokens past num_accepted leave the state as it is
                b_s = tl.where((zero_kv + n_tok) > t, s_new, b_s)
            else:
                b_s = s_new
            if STORE_OUT:
                b_o = tl.where(valid_v, b_o, 0.0)
                p_o = out_ptr + i_b * s_ob + t * s_ot + i_hv * s_oh + o_v
                if EVEN_V:
                    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty))
                else:
                    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=o_v < DV)
            if STORE_INTER:
                p_i = inter_ptr + i_b * s_ib + t * s_it + i_hv * s_ih
                p_i = p_i + o_k[:, None] * DV + o_v[None, :]
                tl.store(p_i, b_s.to(inter_ptr.dtype.element_ty), mask=m_st)
        if WRITE_SLOT:
            if OUT_OF_PLACE:  # into the request's out slot (-1: not stored); a padding row: none
                w_slot = tl.load(widx_ptr + i_b).to(tl.int32)
                w_slot = tl.where(slot >= 0, w_slot, -1)
                m_w = (zero_kv + w_slot) >= 0
                if not EVEN_K:
                    m_w = m_w & (o_k[:, None] < DK)
                if not EVEN_V:
                    m_w = m_w & (o_v[None, :] < DV)
            else:
                w_slot = slot
                m_w = m_st
            p_s = state_ptr + tl.maximum(w_slot, 0).to(tl.int64) * s_ss + i_hv * s_sh
            p_s = p_s + o_k[:, None] * DV + o_v[None, :]
            tl.store(p_s, b_s.to(state_ptr.dtype.element_ty), mask=m_w)

        if PREFETCH:
            i_b, i_hv, i_hk, i_vb, slot = n_b, n_hv, n_hk, n_vb, n_slot
            b_s, b_q, b_k, b_v, b_g, b_beta = n_s, n_q, n_k, n_v, n_g, n_beta


@triton.jit
def _commit_kernel(
    inter_ptr,
    nacc_ptr,
    state_ptr,
    idx_ptr,
    s_ib,
    s_it,
    s_ih,
    s_ik,
    s_ss,
    s_sh,
    s_sk,
    T: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    i_b = (pid_bh // HV).to(tl.int64)
    i_hv = pid_bh % HV
    slot = tl.load(idx_ptr + i_b).to(tl.int64)
    n_acc = tl.load(nacc_ptr + i_b).to(tl.int64)
    # n_acc == 0 (nothing accepted) and padding rows leave the slot as it was.
    o_k = tl.arange(0, BK)
    o_v = pid_v * BV + tl.arange(0, BV)
    # As a block (the interpreter rejects scalar & block masks).
    ok = ((o_v * 0 + slot) >= 0) & ((o_v * 0 + n_acc) > 0) & ((o_v * 0 + n_acc) <= T)
    m = (o_k[:, None] < DK) & (o_v[None, :] < DV) & ok[None, :]
    src = inter_ptr + i_b * s_ib + (n_acc - 1) * s_it + i_hv * s_ih
    b_s = tl.load(src + o_k[:, None] * s_ik + o_v[None, :], mask=m, other=0.0)
    dst = state_ptr + slot * s_ss + i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :]
    tl.store(dst, b_s.to(state_ptr.dtype.element_ty), mask=m)


#: Tile defaults, from the H200 sweep (bench/bench_ssm.py --sweep).
_DEFAULT_BLOCK_V = 64
_INTERPRETER_SMS = 2  # few programs in the interpreter, so each loops over several items
_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _block_v(dk: int, dv: int, block_v: int | None) -> int:
    if block_v is not None:
        if block_v <= 0 or block_v & (block_v - 1):
            raise ValueError(f"block_v: expected a positive power of two, got {block_v}")
        return min(block_v, next_pow2(dv))
    # A [BK, BV] fp32 tile of <= 8192 elements (64 registers a thread at 4 warps; a persistent
    # grid's prefetched next tile doubles that), and BV >= 16 so each state row read is >= 64
    # contiguous bytes.
    return min(next_pow2(dv), max(16, min(_DEFAULT_BLOCK_V, 8192 // next_pow2(dk))))


def _num_warps(bk: int, bv: int, num_warps: int | None) -> int:
    if num_warps is not None:
        if num_warps <= 0 or num_warps & (num_warps - 1):
            raise ValueError(f"num_warps: expected a positive power of two, got {num_warps}")
        return num_warps
    return 4 if bk * bv <= 8192 else 8


def _launch(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_tokens: torch.Tensor | None,
    out: torch.Tensor | None,
    intermediate_states: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
    per_channel_g: bool,
    write_slot: bool,
    block_v: int | None,
    num_warps: int | None,
    programs_per_sm: int | None = None,
    state_indices_out: torch.Tensor | None = None,
) -> None:
    """q, k, v, g, beta, out, intermediate_states are 4-D/5-D ``[B, T, ...]`` here.

    The tile (``block_v``, ``num_warps``) does not depend on the batch, so decode, verify and
    replay-commit reduce in the same order and commit bit-identical states. ``programs_per_sm``
    sets a persistent grid (``None`` or ``0``: one program per work item, the default)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if scale is None:
        scale = Dk**-0.5
    BK = next_pow2(Dk)
    BV = _block_v(Dk, Dv, block_v)
    nw = _num_warps(BK, BV, num_warps)
    NVB = cdiv(Dv, BV)
    n_work = B * Hv * NVB
    if n_work == 0:
        return
    if programs_per_sm is not None and programs_per_sm < 0:
        raise ValueError(f"programs_per_sm: expected >= 0 or None, got {programs_per_sm}")
    # One item a program by default: an H100 ran the step 3 % faster that way than with the
    # persistent grid that fits on the SMs (0.976-0.979 of copy against 0.950 at B = 256); an
    # H200 tied (0.926 against 0.923, measured while one item a program still carried the
    # prefetch's registers). A persistent grid prefetches the next item; one item a program has
    # nothing to prefetch, and without the next tile's registers twice the programs fit an SM.
    pps = programs_per_sm or 0
    o = out if out is not None else v  # dummy pointer when not stored
    inter = intermediate_states if intermediate_states is not None else ssm_state
    inter_strides = (
        intermediate_states.stride()[:3] if intermediate_states is not None else (0, 0, 0)
    )
    args = (
        q, k, v, g, beta, ssm_state, state_indices,
        num_tokens if num_tokens is not None else state_indices, o, inter,
        state_indices_out if state_indices_out is not None else state_indices, float(scale), n_work,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3], *beta.stride()[:3],
        *ssm_state.stride()[:2], *(out.stride()[:3] if out is not None else (0, 0, 0)),
        *inter_strides,
    )  # fmt: skip
    meta = dict(
        T=T, HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=BK, BV=BV, NVB=NVB,
        PER_CHANNEL_G=per_channel_g, USE_L2NORM=use_qk_l2norm, EPS=_L2_EPS,
        HAS_NTOK=num_tokens is not None, STORE_OUT=out is not None,
        STORE_INTER=intermediate_states is not None, WRITE_SLOT=write_slot,
        OUT_OF_PLACE=state_indices_out is not None, PREFETCH=pps != 0, num_warps=nw,
    )  # fmt: skip
    n_prog = n_work if pps == 0 else min(n_work, pps * _num_sms(q.device))
    _delta_rule_kernel[(n_prog,)](*args, **meta)


def _check_inputs(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    per_channel_g: bool,
    multi_token: bool,
) -> tuple[int, int, int, int, int, int]:
    """Check the decode (``multi_token=False``) or verify layout; return B, T, Hk, Hv, Dk, Dv."""
    lead = "[B, K1, " if multi_token else "["
    check_shape("q", q, [None] * (4 if multi_token else 3), f"{lead}Hk, Dk]")
    B = q.shape[0]
    T = q.shape[1] if multi_token else 1
    Hk, Dk = q.shape[-2], q.shape[-1]
    bt = [B, T] if multi_token else [B]
    check_shape("k", k, [*bt, Hk, Dk], f"{lead}Hk, Dk] like q")
    check_shape("v", v, [*bt, None, None], f"{lead}Hv, Dv]")
    Hv, Dv = v.shape[-2], v.shape[-1]
    if Hv % Hk:
        raise ValueError(f"v: value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    if per_channel_g:
        check_shape("g", g, [*bt, Hv, Dk], f"{lead}Hv, Dk] (KDA per-channel log decay)")
    else:
        check_shape("g", g, [*bt, Hv], f"{lead}Hv] (GDN per-head log decay)")
    check_shape("beta", beta, [*bt, Hv], f"{lead}Hv]")
    check_shape("ssm_state", ssm_state, [None, Hv, Dk, Dv], "[S, Hv, Dk, Dv]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    check_index("state_indices", state_indices, B)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check_last_contiguous("ssm_state", ssm_state, 2)
    check_same_device(
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "ssm_state": ssm_state,
         "state_indices": state_indices}
    )  # fmt: skip
    return B, T, Hk, Hv, Dk, Dv


def _alloc_out(out: torch.Tensor | None, v: torch.Tensor, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty_like(v, memory_format=torch.contiguous_format)
    check_shape(name, out, list(v.shape), "like v")
    check_float(name, out)
    check_last_contiguous(name, out)
    if out.device != v.device:
        raise ValueError(f"{name} is on {out.device} but v is on {v.device}")
    return out


# --------------------------------------------------------------------------------------------
# Public wrappers. GDN and KDA differ only in the gate: ``g`` is ``[.., Hv]`` (one log decay per
# head) or ``[.., Hv, Dk]`` (one per key channel), a compile-time flag of the same kernel. Each
# operation is therefore written once, in a factory closed over ``per_channel_g``, and bound to
# both gate kinds by name at the end of this section.
# --------------------------------------------------------------------------------------------
_F = TypeVar("_F", bound=Callable[..., Any])


def _public(fn: _F, name: str, doc: str | None = None) -> _F:
    """Give a factory-made wrapper its public name (and a docstring other than the factory's)."""
    fn.__name__ = fn.__qualname__ = name
    if doc is not None:
        fn.__doc__ = doc
    return fn


# decode: one token per request ---------------------------------------------------------------
def _decode_op(per_channel_g: bool) -> Callable[..., torch.Tensor]:
    def decode(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        out: torch.Tensor | None = None,
        block_v: int | None = None,
        num_warps: int | None = None,
        programs_per_sm: int | None = None,
        state_indices_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gated DeltaNet decode: one token per request; updates ``ssm_state`` in place.

        :param q: ``[B, Hk, Dk]`` float32/bfloat16/float16 (last dim contiguous; outer strides
            free).
        :param k: ``[B, Hk, Dk]`` like ``q``.
        :param v: ``[B, Hv, Dv]``; ``Hv`` a multiple of ``Hk`` (value head ``h`` reads key head
            ``h // (Hv // Hk)``).
        :param g: ``[B, Hv]`` log decay (``S *= exp(g)``), any float dtype.
        :param beta: ``[B, Hv]`` delta-rule step size (already through its sigmoid).
        :param ssm_state: ``[S, Hv, Dk, Dv]`` float32 or bfloat16, last two dims packed; slot
            ``state_indices[b]`` is read and written (math in float32).
        :param state_indices: ``[B]`` int32 (or int64); ``-1`` marks a padding row: zeros in
            ``out``, no state touched.
        :param scale: query scale; ``None`` means ``Dk ** -0.5``.
        :param use_qk_l2norm: L2-normalise q and k first (eps 1e-6 inside the sqrt, as fla).
        :param out: ``[B, Hv, Dv]`` output buffer (allocated like ``v`` when ``None``).
        :param block_v: Dv tile per program (power of two); ``None`` picks one. A tuning knob.
        :param num_warps: Triton warps per program; ``None`` picks one.
        :param programs_per_sm: a persistent grid of this many programs per SM, each looping
            over (request, head, Dv block) items and prefetching the next; ``None`` or ``0``
            (the default) launches one program per item.
        :param state_indices_out: ``[B]`` int32: each request's updated state goes to this slot
            instead (out of place: the slot it was read from keeps its state; ``-1``: not
            stored). A request's out slot must not be another request's slot of the step,
            read or written. ``None``: back into ``state_indices``.
        :returns: ``out``.
        """
        _check_inputs(
            q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_indices=state_indices,
            per_channel_g=per_channel_g, multi_token=False,
        )  # fmt: skip
        if state_indices_out is not None:
            check_index("state_indices_out", state_indices_out, q.shape[0])
            check_same_device({"ssm_state": ssm_state, "state_indices_out": state_indices_out})
        out = _alloc_out(out, v)
        _launch(
            q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.unsqueeze(1),
            beta=beta.unsqueeze(1), ssm_state=ssm_state, state_indices=state_indices,
            num_tokens=None, out=out.unsqueeze(1), intermediate_states=None, scale=scale,
            use_qk_l2norm=use_qk_l2norm, per_channel_g=per_channel_g, write_slot=True,
            block_v=block_v, num_warps=num_warps, programs_per_sm=programs_per_sm,
            state_indices_out=state_indices_out,
        )  # fmt: skip
        return out

    return decode


# speculative verify: K1 = k + 1 tokens per request, [B, K1, ...] layout ----------------------
def _verify(q, k, v, g, beta, ssm_state, state_indices, *, per_channel_g, scale, use_qk_l2norm,
            out, intermediate_states, block_v, num_warps):  # fmt: skip
    B, T, _, Hv, Dk, Dv = _check_inputs(
        q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_indices=state_indices,
        per_channel_g=per_channel_g, multi_token=True,
    )  # fmt: skip
    out = _alloc_out(out, v)
    if intermediate_states is not None:
        check_shape(
            "intermediate_states", intermediate_states, [B, T, Hv, Dk, Dv],
            "[B, K1, Hv, Dk, Dv]",
        )  # fmt: skip
        check_dtype("intermediate_states", intermediate_states, STATE_DTYPES)
        check_last_contiguous("intermediate_states", intermediate_states, 2)
    _launch(
        q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_indices=state_indices,
        num_tokens=None, out=out, intermediate_states=intermediate_states, scale=scale,
        use_qk_l2norm=use_qk_l2norm, per_channel_g=per_channel_g, write_slot=False,
        block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return out


def _verify_native_op(per_channel_g: bool) -> Callable[..., torch.Tensor]:
    def verify_native(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        intermediate_states: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        out: torch.Tensor | None = None,
        block_v: int | None = None,
        num_warps: int | None = None,
    ) -> torch.Tensor:
        """Speculative verify, native strategy: run ``K1`` tokens per request from the slot
        state, storing the state after every position; the slot is not written (see
        :func:`gdn_commit`).

        :param q: ``[B, K1, Hk, Dk]``; ``k`` likewise; ``v`` ``[B, K1, Hv, Dv]``; ``g`` and
            ``beta`` ``[B, K1, Hv]``.
        :param ssm_state: ``[S, Hv, Dk, Dv]`` float32/bfloat16, read only here.
        :param state_indices: ``[B]`` int32, ``-1`` = padding row (zeros out, nothing stored).
        :param intermediate_states: ``[B, K1, Hv, Dk, Dv]`` float32/bfloat16 output: entry ``t``
            is the state after tokens ``0..t``.
        :param out: ``[B, K1, Hv, Dv]`` output (allocated like ``v`` when ``None``).
        :returns: ``out``.
        """
        return _verify(q, k, v, g, beta, ssm_state, state_indices, per_channel_g=per_channel_g,
                       scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
                       intermediate_states=intermediate_states, block_v=block_v,
                       num_warps=num_warps)  # fmt: skip

    return verify_native


def _verify_replay_op(per_channel_g: bool) -> Callable[..., torch.Tensor]:
    def verify_replay(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        out: torch.Tensor | None = None,
        block_v: int | None = None,
        num_warps: int | None = None,
    ) -> torch.Tensor:
        """Speculative verify, replay strategy: outputs for ``K1`` tokens, no state stored
        anywhere (the slot is untouched); :func:`gdn_replay_commit` recomputes the accepted
        prefix later. Shapes as :func:`gdn_verify_native`. :returns: ``out`` ``[B, K1, Hv, Dv]``.
        """
        return _verify(q, k, v, g, beta, ssm_state, state_indices, per_channel_g=per_channel_g,
                       scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
                       intermediate_states=None, block_v=block_v,
                       num_warps=num_warps)  # fmt: skip

    return verify_replay


def _replay_commit_op(per_channel_g: bool) -> Callable[..., None]:
    def replay_commit(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        num_accepted: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        block_v: int | None = None,
        num_warps: int | None = None,
    ) -> None:
        """Replay commit: advance each slot by its request's first ``num_accepted[b]`` tokens.

        :param q: ``[B, K1, Hk, Dk]`` (the verify inputs; tokens past ``num_accepted[b]`` are
            not read), ``k``, ``v``, ``g``, ``beta`` as in :func:`gdn_verify_replay`.
        :param num_accepted: ``[B]`` int32 in ``0..K1`` (values above ``K1`` are clamped; ``0``
            leaves the slot unchanged).
        :param ssm_state: ``[S, Hv, Dk, Dv]``, slots written in place.
        :param state_indices: ``[B]`` int32, ``-1`` = padding row (skipped).
        """
        B = q.shape[0] if q.dim() == 4 else -1
        _check_inputs(
            q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_indices=state_indices,
            per_channel_g=per_channel_g, multi_token=True,
        )  # fmt: skip
        check_index("num_accepted", num_accepted, B)
        if num_accepted.device != q.device:
            raise ValueError(f"num_accepted is on {num_accepted.device} but q is on {q.device}")
        _launch(
            q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_indices=state_indices,
            num_tokens=num_accepted, out=None, intermediate_states=None, scale=scale,
            use_qk_l2norm=use_qk_l2norm, per_channel_g=per_channel_g, write_slot=True,
            block_v=block_v, num_warps=num_warps,
        )  # fmt: skip

    return replay_commit


# The public names: GDN (per-head gate) keeps each factory's docstring, KDA (per-channel gate)
# points to it. Signatures, defaults and behaviour are those of the factories' inner functions.
gdn_decode = _public(_decode_op(per_channel_g=False), "gdn_decode")
kda_decode = _public(
    _decode_op(per_channel_g=True),
    "kda_decode",
    """Kimi Delta Attention decode: as :func:`gdn_decode` with ``g`` ``[B, Hv, Dk]``, a log decay
    per key channel (``S *= exp(g)[:, None]``).""",
)
gdn_verify_native = _public(_verify_native_op(per_channel_g=False), "gdn_verify_native")
kda_verify_native = _public(
    _verify_native_op(per_channel_g=True),
    "kda_verify_native",
    """:func:`gdn_verify_native` for KDA: ``g`` is ``[B, K1, Hv, Dk]``.""",
)
gdn_verify_replay = _public(_verify_replay_op(per_channel_g=False), "gdn_verify_replay")
kda_verify_replay = _public(
    _verify_replay_op(per_channel_g=True),
    "kda_verify_replay",
    """:func:`gdn_verify_replay` for KDA: ``g`` is ``[B, K1, Hv, Dk]``.""",
)
gdn_replay_commit = _public(_replay_commit_op(per_channel_g=False), "gdn_replay_commit")
kda_replay_commit = _public(
    _replay_commit_op(per_channel_g=True),
    "kda_replay_commit",
    """:func:`gdn_replay_commit` for KDA: ``g`` is ``[B, K1, Hv, Dk]``.""",
)


def gdn_commit(
    intermediate_states: torch.Tensor,
    num_accepted: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    block_v: int | None = None,
) -> None:
    """Native commit: copy ``intermediate_states[b, num_accepted[b] - 1]`` into slot
    ``state_indices[b]`` (the state after the accepted prefix).

    :param intermediate_states: ``[B, K1, Hv, Dk, Dv]`` from :func:`gdn_verify_native`.
    :param num_accepted: ``[B]`` int32 in ``1..K1``; ``0`` (or anything out of range) and
        padding rows leave the slot unchanged.
    :param ssm_state: ``[S, Hv, Dk, Dv]`` float32/bfloat16, written in place (cast on store).
    :param state_indices: ``[B]`` int32, ``-1`` = padding row.
    """
    check_shape("intermediate_states", intermediate_states, [None] * 5, "[B, K1, Hv, Dk, Dv]")
    B, T, Hv, Dk, Dv = intermediate_states.shape
    check_shape("ssm_state", ssm_state, [None, Hv, Dk, Dv], "[S, Hv, Dk, Dv]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    check_dtype("intermediate_states", intermediate_states, STATE_DTYPES)
    check_index("state_indices", state_indices, B)
    check_index("num_accepted", num_accepted, B)
    check_last_contiguous("intermediate_states", intermediate_states, 2)
    check_last_contiguous("ssm_state", ssm_state, 2)
    check_same_device(
        {"intermediate_states": intermediate_states, "num_accepted": num_accepted,
         "ssm_state": ssm_state, "state_indices": state_indices}
    )  # fmt: skip
    BK = next_pow2(Dk)
    BV = _block_v(Dk, Dv, block_v)
    _commit_kernel[(B * Hv, cdiv(Dv, BV))](
        intermediate_states,
        num_accepted,
        ssm_state,
        state_indices,
        *intermediate_states.stride()[:4],
        *ssm_state.stride()[:3],
        T=T,
        HV=Hv,
        DK=Dk,
        DV=Dv,
        BK=BK,
        BV=BV,
    )


#: The native commit copies states and does not care how they were computed.
kda_commit = gdn_commit
