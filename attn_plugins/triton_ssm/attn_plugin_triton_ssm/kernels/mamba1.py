"""Mamba1 selective scan (Jamba, Falcon-Mamba) with the state in slots in attn-core's layout.

Per inner channel ``d`` (attn-core's one head of width 1 per channel), with the state row
``h[d]`` ``[N]`` (``N = d_state``)::

    dt  <- softplus(dt[d] + dt_bias[d])    (dt_softplus; softplus(x) = x for x > 20, as torch)
    A   <- -exp(A_log[d, :])               [N]: one decay per state entry, unlike Mamba2
    h   <- h * exp(dt A) + (dt x[d]) B     B, C [N]: one per token, shared by every channel
    y   <- h . C + D[d] x[d]
    y   <- y * silu(z[d])                  (when z is given)

One kernel serves decode, prefill and speculative verify: grid ``(requests, D / BD)``, each
program keeps an ``[BD, N]`` tile of its request's state in registers and walks the request's
tokens in order (the sequential scan of mamba_ssm's ``selective_scan``, parallel over channels).
The state is read once and written once per request whatever its length; a token costs
``x, dt, z, y`` of ``BD`` channels and ``B, C`` of ``N``. Where the tokens of a request come from:

- decode: request ``b`` is token ``b`` (no lengths read: CUDA-graph capturable);
- varlen: ``cu_seqlens[b] .. cu_seqlens[b + 1]`` (prefill, mixed steps; read on the device);
- verify replay commit: ``b * K1 .. b * K1 + num_accepted[b]``.

A long prefill among few requests leaves most SMs idle (``D / BD`` programs, each walking
thousands of dependent steps). ``mamba1_scan(time_chunk=L)`` cuts each request into chunks of
``L`` tokens and runs the same kernel over the chunks (from zero, then again from the carried
state) with a cheap carry pass in between (:func:`_launch_chunked`); :func:`auto_time_chunk`
turns it on where the walk would leave SMs idle. Varlen calls without per-token states (prefill,
mixed steps) run the walk and the chunks' scans on a second kernel by default, which keeps
whole channels in a thread (:mod:`.mamba1_lanes`, :data:`LANES_DEFAULT`); the verify and the
replay commit keep the tile kernel, so both commit strategies round alike.

The state pool is ``[S, D, N]`` or attn-core's ``[S, D, N, 1]`` (the same memory: HF's
``[.., d_inner, d_state]`` cache), fp32 or bf16, maths in fp32, cast on store.
"""

from __future__ import annotations

import functools

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
from attn_plugin_triton_ssm.kernels.mamba1_lanes import LANES_BLOCK_D, LANES_WARPS, launch_lanes

__all__ = ["mamba1_commit", "mamba1_decode", "mamba1_replay_commit", "mamba1_scan"]

_DECODE, _VARLEN, _STRIDED = 0, 1, 2


@triton.jit
def _mamba1_token(
    t, tok_mask, valid, b_h, b_a, b_bias, b_skip, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, out_ptr,
    o_d, o_n, m_n, s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_Z: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, WRITE_OUT: tl.constexpr,
):  # fmt: skip
    """Token ``t`` on the ``[BD, N]`` state tile ``b_h``: returns ``(new tile, dt [BD])`` and
    stores ``y`` where ``WRITE_OUT``. ``tok_mask`` ``[BD]``: the channels whose token inputs
    are read and whose ``y`` is stored; ``valid`` ``[BD]``: False on a padding row (``y = 0``)."""
    b_x = tl.load(x_ptr + t * s_xt + o_d * s_xd, mask=tok_mask, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_ptr + t * s_dtt + o_d, mask=tok_mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += b_bias
    if DT_SOFTPLUS:
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    b_B = tl.load(b_ptr + t * s_bt + o_n, mask=m_n, other=0.0).to(tl.float32)
    # an explicit FMA: left to LLVM, the contraction depends on the specialization (the verify
    # build fused h * e, the replay commit's (dt x) B), and the two commit strategies must
    # store bit-identical states
    b_u = (b_dt * b_x)[:, None] * b_B[None, :]
    b_h = tl.fma(b_h, tl.exp(b_dt[:, None] * b_a), b_u)
    if WRITE_OUT:
        b_C = tl.load(c_ptr + t * s_ct + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_y = tl.sum(b_h * b_C[None, :], 1)
        if HAS_D:
            b_y += b_skip * b_x
        if HAS_Z:
            p_z = z_ptr + t * s_zt + o_d * s_zd
            b_z = tl.load(p_z, mask=tok_mask, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        b_y = tl.where(valid, b_y, 0.0)
        p_out = out_ptr + t * s_ot + o_d * s_od
        tl.store(p_out, b_y.to(out_ptr.dtype.element_ty), mask=tok_mask)
    return b_h, b_dt


@triton.jit
def _mamba1_state_in(
    pid_b, state_ptr, idx_ptr, init_ptr, o_d, o_n, m_dn, s_ss, s_sd, R,
    HAS_INIT: tl.constexpr, HINTS: tl.constexpr,
):  # fmt: skip
    """``(slot, [BD, N] float32 tile)`` of request ``pid_b``: its slot's state on the
    program's channel block, zeros for a fresh request, a padding row or past the last
    request."""
    live = pid_b < R
    slot = tl.load(idx_ptr + pid_b, mask=live, other=-1).to(tl.int64)
    valid = (o_d * 0 + slot) >= 0  # a block: the interpreter rejects scalar & block masks
    m_state = m_dn & valid[:, None]
    p_state = state_ptr + slot * s_ss + o_d[:, None] * s_sd + o_n[None, :]
    if HINTS:  # the state streams through once; A_log is read by every request
        b_h = tl.load(p_state, mask=m_state, other=0.0, eviction_policy="evict_first")
    else:
        b_h = tl.load(p_state, mask=m_state, other=0.0)
    b_h = b_h.to(tl.float32)
    if HAS_INIT:
        # a fresh request's slot holds whatever its previous owner left: never read it
        init = tl.load(init_ptr + pid_b, mask=live, other=1).to(tl.int32)
        b_h = tl.where(((o_d * 0 + init) == 0)[:, None], 0.0, b_h)
    return slot, b_h


@triton.jit
def _mamba1_request(
    pid_b, slot, b_h, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, state_ptr, cu_ptr, len_ptr,
    inter_ptr, out_ptr, dts_ptr, b_a, b_bias, b_skip, o_d, o_n, m_d, m_n, m_dn,
    s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od, s_ss, s_sd, s_ib, s_ik, s_id, R,
    D: tl.constexpr, BD: tl.constexpr, STEP: tl.constexpr, MODE: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr, STORE_INTER: tl.constexpr,
    WRITE_STATE: tl.constexpr, WRITE_OUT: tl.constexpr, STORE_DTSUM: tl.constexpr,
    HINTS: tl.constexpr,
):  # fmt: skip
    """Request ``pid_b`` on the program's channel block from its state tile ``b_h`` (read from
    ``slot`` by :func:`_mamba1_state_in`): its tokens, then the tile back to the slot. Past the
    last request (``pid_b >= R``): no tokens, nothing stored."""
    live = pid_b < R
    valid = (o_d * 0 + slot) >= 0
    m_state = m_dn & valid[:, None]
    p_state = state_ptr + slot * s_ss + o_d[:, None] * s_sd + o_n[None, :]

    if MODE == 0:
        # decode: request b is token b, with no loop around it, so that a pipelined loop
        # over the program's requests stays innermost (Triton pipelines only those)
        b_h, b_dt = _mamba1_token(
            pid_b.to(tl.int64), m_d & ((o_d * 0 + pid_b) < R), valid, b_h, b_a, b_bias,
            b_skip, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, out_ptr, o_d, o_n, m_n, s_xt, s_xd,
            s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od, HAS_D, HAS_DT_BIAS, HAS_Z, DT_SOFTPLUS,
            WRITE_OUT,
        )  # fmt: skip
        b_dts = b_dt
        if STORE_INTER:
            p_inter = (inter_ptr + pid_b.to(tl.int64) * s_ib + o_d[:, None] * s_id
                       + o_n[None, :])  # fmt: skip
            tl.store(p_inter, b_h.to(inter_ptr.dtype.element_ty), mask=m_state)
    else:
        if MODE == 1:
            start = tl.load(cu_ptr + pid_b, mask=live, other=0).to(tl.int64)
            end = tl.load(cu_ptr + pid_b + 1, mask=live, other=0).to(tl.int64)
        else:
            start = pid_b.to(tl.int64) * STEP
            end = start + tl.load(len_ptr + pid_b, mask=live, other=0).to(tl.int64)
        b_dts = tl.zeros([BD], dtype=tl.float32)
        # (software-pipelining this walk, tl.range num_stages 2-4, ran 1.1-1.3x slower on the
        # H200: the step is bound by its dependent arithmetic, not by its loads)
        for t in range(start, end):
            b_h, b_dt = _mamba1_token(
                t, m_d, valid, b_h, b_a, b_bias, b_skip, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr,
                out_ptr, o_d, o_n, m_n, s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od,
                HAS_D, HAS_DT_BIAS, HAS_Z, DT_SOFTPLUS, WRITE_OUT,
            )  # fmt: skip
            if STORE_DTSUM:
                b_dts += b_dt
            if STORE_INTER:
                p_inter = (inter_ptr + pid_b.to(tl.int64) * s_ib + (t - start) * s_ik
                           + o_d[:, None] * s_id + o_n[None, :])  # fmt: skip
                tl.store(p_inter, b_h.to(inter_ptr.dtype.element_ty), mask=m_state)
    if WRITE_STATE:
        if HINTS:
            tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_state,
                     cache_modifier=".cs")  # fmt: skip
        else:
            tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_state)
    if STORE_DTSUM:  # time-chunked pass 1: the chunk's total dt per channel (pass 2's decay)
        tl.store(dts_ptr + slot * D + o_d, b_dts, mask=m_d & valid)


@triton.jit
def _mamba1_scan_kernel(
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
    cu_ptr,
    len_ptr,
    init_ptr,
    inter_ptr,
    out_ptr,
    dts_ptr,
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
    s_ib,
    s_ik,
    s_id,
    R,
    D: tl.constexpr,
    N: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    RPP: tl.constexpr,
    STEP: tl.constexpr,
    MODE: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    STORE_INTER: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    STORE_DTSUM: tl.constexpr,
    HINTS: tl.constexpr,
    PIPELINE: tl.constexpr,
    LOADS_FIRST: tl.constexpr,
):
    """Grid ``(cdiv(R, RPP), cdiv(D, BD))``: a program takes ``RPP`` requests in turn on one
    block of ``BD`` channels. ``PIPELINE`` (decode only, ``MODE == 0``): ``0`` unrolls the
    requests; ``n >= 2`` runs them as a loop that Triton software-pipelines over ``n``
    stages, the next requests' state tiles loading into shared memory while one is updated
    (an unrolled request's loads wait for the previous request's stores, and a tile in flight
    costs registers). ``LOADS_FIRST`` (unrolled): every request's state tile is loaded before
    any is updated."""
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_n = tl.arange(0, BN)
    m_d = o_d < D
    m_n = o_n < N
    m_dn = m_d[:, None] & m_n[None, :]
    # per channel block, read once for the program's RPP requests (decode: A_log is as large as
    # one request's state, so sharing it cuts its L2 reads by RPP)
    b_a = -tl.exp(tl.load(a_log_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.0))
    b_bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_skip = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        b_skip = tl.load(d_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)

    if PIPELINE > 0:
        for i in tl.range(0, RPP, num_stages=PIPELINE):
            pid_b = pid_r * RPP + i
            slot, b_h = _mamba1_state_in(pid_b, state_ptr, idx_ptr, init_ptr, o_d, o_n, m_dn,
                                         s_ss, s_sd, R, HAS_INIT, HINTS)  # fmt: skip
            _mamba1_request(
                pid_b, slot, b_h, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, state_ptr, cu_ptr, len_ptr,
                inter_ptr, out_ptr, dts_ptr, b_a, b_bias, b_skip, o_d, o_n, m_d, m_n, m_dn,
                s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd, s_ot, s_od, s_ss, s_sd, s_ib, s_ik,
                s_id, R, D, BD, STEP, MODE, HAS_D, HAS_DT_BIAS, HAS_Z, DT_SOFTPLUS,
                STORE_INTER, WRITE_STATE, WRITE_OUT, STORE_DTSUM, HINTS,
            )  # fmt: skip
    else:
        # LOADS_FIRST: every request's state tile before any request is updated. The compiler
        # cannot move a load above an earlier request's stores (they might alias), so
        # unrolled requests one at a time each wait on memory in turn. (Groups of one
        # request without it; tuples grow by +: no * in a tuple.)
        G: tl.constexpr = RPP if LOADS_FIRST else 1
        for g in tl.static_range(RPP // G):
            slots = ()
            tiles = ()
            for j in tl.static_range(G):
                slot, b_h = _mamba1_state_in(pid_r * RPP + g * G + j, state_ptr, idx_ptr,
                                             init_ptr, o_d, o_n, m_dn, s_ss, s_sd, R, HAS_INIT,
                                             HINTS)  # fmt: skip
                slots = slots + (slot,)  # type: ignore[assignment]  # noqa: RUF005
                tiles = tiles + (b_h,)  # type: ignore[assignment]  # noqa: RUF005
            for j in tl.static_range(G):
                _mamba1_request(
                    pid_r * RPP + g * G + j, slots[j], tiles[j], x_ptr, dt_ptr, b_ptr, c_ptr,
                    z_ptr, state_ptr, cu_ptr, len_ptr, inter_ptr, out_ptr, dts_ptr, b_a, b_bias,
                    b_skip, o_d, o_n, m_d, m_n, m_dn, s_xt, s_xd, s_dtt, s_bt, s_ct, s_zt, s_zd,
                    s_ot, s_od, s_ss, s_sd, s_ib, s_ik, s_id, R, D, BD, STEP, MODE, HAS_D,
                    HAS_DT_BIAS, HAS_Z, DT_SOFTPLUS, STORE_INTER, WRITE_STATE, WRITE_OUT,
                    STORE_DTSUM, HINTS,
                )  # fmt: skip


def _pool(name: str, t: torch.Tensor, D: int, N: int, lead: int) -> torch.Tensor:
    """``t`` as ``[*lead dims, D, N]`` (a view: attn-core's trailing value dim of 1 dropped)."""
    dims = [None] * lead
    if t.dim() == lead + 3:
        check_shape(name, t, [*dims, D, N, 1], f"[{'*, ' * lead}D, N, 1]")
        t = t.squeeze(-1)
    check_shape(name, t, [*dims, D, N], f"[{'*, ' * lead}D, N] or [{'*, ' * lead}D, N, 1]")
    check_dtype(name, t, STATE_DTYPES)
    check_last_contiguous(name, t)
    return t


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _tiles(
    N: int, block_d: int | None, num_warps: int | None, *, requests: int = 0, D: int = 0,
    device: torch.device | None = None,
) -> tuple[int, int, int]:  # fmt: skip
    """``(BD, BN, num_warps)``. By default ``BD`` is the largest power of two up to
    ``1024 / BN`` channels (64 at ``N = 16``, on one warp) that still gives two programs per
    SM. Prefill and verify launches default to 16 channels (:func:`_launch`); decode keeps this
    rule, as 64 channels on one warp with the streaming hints moved the state over 10 % faster
    than 128 channels on four warps (figures: docs/results.md; ``bench_decode_sweep.py`` times
    each tiling)."""
    BN = next_pow2(N)
    BD = block_d or max(16, min(64, 1024 // BN))
    if block_d is None and device is not None and device.type == "cuda" and requests:
        want = 2 * _num_sms(device.index if device.index is not None else 0)
        while BD > 16 and requests * cdiv(D, BD) < want:
            BD //= 2
    return BD, BN, num_warps or min(8, max(1, BD * BN // 1024))  # 1 warp at 64 x 16


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = True,
    intermediate_states: torch.Tensor | None = None,
    update_state: bool = True,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
    requests_per_program: int | None = None,
    time_chunk: int | None = None,
    cache_hints: bool | None = None,
    pipeline: int = 0,
    loads_first: bool = False,
    lanes: bool | None = None,
) -> torch.Tensor:
    """Mamba1 over the tokens of ``R`` requests, each continuing from its slot.

    :param x: ``[T, D]`` float, after the conv (``D = d_inner``); any strides (``z`` and
        ``out`` too).
    :param dt: ``[T, D]`` time step after ``dt_proj``'s weight (before ``dt_bias``, softplus).
    :param A_log: ``[D, N]`` float32, packed; ``A = -exp(A_log)``.
    :param B: ``[T, N]`` float; ``C``: ``[T, N]`` float (last dim packed, outer strides free).
    :param ssm_state: ``[S, D, N]`` or ``[S, D, N, 1]`` float32 / bfloat16, updated in place
        (unless ``update_state`` is False).
    :param state_indices: ``[R]`` int32 slot per request; ``-1``: padding (zeros out, no state).
    :param cu_seqlens: ``[R + 1]`` int32 / int64 token offsets of the requests (read on the
        device); None: one token per request (decode, ``R == T``).
    :param has_initial_state: ``[R]`` bool; False starts the request from zero (its slot's
        old contents are never read). None: every request continues its slot.
    :param D: ``[D]`` skip, or None. ``dt_bias``: ``[D]`` (``dt_proj.bias``), or None.
    :param z: ``[T, D]`` gate (``y *= silu(z)``), or None.
    :param intermediate_states: ``[R, >= max len, D, N(, 1)]`` state dtype: receives the
        state after each token (speculative verify, native strategy).
    :param update_state: write the final state back to the slot.
    :param out: ``[T, D]`` (allocated like ``x`` when None).
    :param block_d: channels per program (default: see :func:`_tiles`).
    :param requests_per_program: requests one program walks in turn for its channel block,
        sharing its ``A_log`` / ``D`` / ``dt_bias`` reads. None: see
        :func:`decode_defaults` for decode, 1 otherwise.
    :param time_chunk: ``L > 0``: a varlen call (``cu_seqlens`` given) scans each request in
        time chunks of ``L`` tokens, parallel over chunks (:func:`_launch_chunked`: three
        launches plus a few small torch ops building the chunk table, no host sync; a
        per-call workspace of ``(T / L + R) * D * N`` float32). For few long requests, where
        the sequential walk leaves the GPU idle. ``0``: off. ``None``: :func:`auto_time_chunk`
        decides (off on the CPU and with ``intermediate_states``). Decode calls (no
        ``cu_seqlens``) ignore it; it cannot produce ``intermediate_states`` (ValueError);
        ``block_d`` applies to its scans, ``requests_per_program`` does not.
    :param cache_hints: stream the state (``evict_first`` loads, ``.cs`` stores) so that
        ``A_log``, read by every request, stays in L2. None: see :func:`decode_defaults` for
        decode, off for prefill.
    :param pipeline: decode only (ignored with ``cu_seqlens``): ``n >= 2`` takes a program's
        requests as a loop Triton software-pipelines over ``n`` stages (the next requests'
        state tiles load into shared memory while one is updated); ``0`` unrolls them.
    :param loads_first: decode only, unrolled requests: load every request's state tile
        before updating any (in registers: more in flight, more registers).
    :param lanes: ``True``: the whole-channels-a-thread kernel (:mod:`.mamba1_lanes`) for the
        walk and for both scans of ``time_chunk`` of a varlen call; ``block_d`` and
        ``num_warps`` then tile it (:func:`~.mamba1_lanes.lanes_tiling`). ``False``: the
        ``[BD, N]`` tile kernel. None: :data:`LANES_DEFAULT` for varlen calls without
        ``intermediate_states`` at d_state ``N <= LANES_MAX_D_STATE``, else the tile kernel.
        ``True`` on a decode call (no ``cu_seqlens``: the tile kernel moves the state faster)
        or with ``intermediate_states`` (the verify's two commit strategies must round alike,
        so they keep the tile kernel): ValueError. ``cache_hints`` and
        ``requests_per_program`` on a call the lanes kernel serves: ValueError (pass
        ``lanes=False``).
    :returns: ``out``: ``y`` per token and channel.
    """
    if requests_per_program is not None and (
        not isinstance(requests_per_program, int) or requests_per_program < 1
    ):
        raise ValueError(
            f"requests_per_program: expected a positive int, got {requests_per_program!r}"
        )
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline == 1 or pipeline < 0:
        raise ValueError(f"pipeline: expected 0 (off) or a stage count >= 2, got {pipeline!r}")
    if time_chunk is not None and (
        not isinstance(time_chunk, int) or isinstance(time_chunk, bool) or time_chunk < 0
    ):
        raise ValueError(f"time_chunk: expected None or an int >= 0, got {time_chunk!r}")
    if time_chunk and intermediate_states is not None:
        raise ValueError(
            "time_chunk: the time-chunked scan keeps no per-token states; pass time_chunk=0 "
            "(or None) with intermediate_states"
        )
    if lanes and cu_seqlens is None:
        raise ValueError(
            "lanes: the whole-channels-a-thread kernel serves varlen calls; a decode (no "
            "cu_seqlens) runs the [BD, N] tile kernel, which moved the state faster: pass "
            "lanes=False or None"
        )
    if lanes and intermediate_states is not None:
        raise ValueError(
            "lanes: the whole-channels-a-thread kernel keeps no per-token states; got "
            "intermediate_states=given (the verify's two commit strategies share the tile "
            "kernel: pass lanes=False or None)"
        )
    check_shape("x", x, [None, None], "[T, D]")
    T, Dn = x.shape
    check_shape("dt", dt, [T, Dn], "[T, D] like x")
    check_shape("A_log", A_log, [Dn, None], "[D, N]")
    N = A_log.shape[1]
    check_dtype("A_log", A_log, (torch.float32,))
    if not A_log.is_contiguous():
        raise ValueError(f"A_log: expected a packed [D, N] tensor, got strides {A_log.stride()}")
    for name, t in (("B", B), ("C", C)):
        check_shape(name, t, [T, N], "[T, N]")
        check_float(name, t)
        check_last_contiguous(name, t)
    check_float("x", x)  # any strides: attn-core's v [T, D, 1] may be a view of a wider buffer
    check_float("dt", dt)
    check_last_contiguous("dt", dt)
    state = _pool("ssm_state", ssm_state, Dn, N, 1)
    R = state_indices.shape[0] if state_indices.dim() == 1 else -1
    check_index("state_indices", state_indices, R)
    if cu_seqlens is None:
        if R != T:
            raise ValueError(
                f"state_indices: decode (no cu_seqlens) takes one token per request: expected "
                f"{T} entries, got {R}"
            )
    else:
        check_index("cu_seqlens", cu_seqlens, R + 1)
    if has_initial_state is not None:
        check_shape("has_initial_state", has_initial_state, [R], "[R] bool")
    for name, p in (("D", D), ("dt_bias", dt_bias)):
        if p is not None:
            check_shape(name, p, [Dn], "[D]")
            check_last_contiguous(name, p)
    if z is not None:
        check_shape("z", z, [T, Dn], "[T, D]")
    inter = None
    if intermediate_states is not None:
        inter = _pool("intermediate_states", intermediate_states, Dn, N, 2)
        if inter.shape[0] != R:
            raise ValueError(
                f"intermediate_states: expected {R} requests in dim 0, got {inter.shape[0]}"
            )
    check_same_device(
        {"x": x, "dt": dt, "A_log": A_log, "B": B, "C": C, "ssm_state": ssm_state,
         "state_indices": state_indices, "cu_seqlens": cu_seqlens,
         "has_initial_state": has_initial_state, "D": D, "dt_bias": dt_bias, "z": z,
         "intermediate_states": intermediate_states}
    )  # fmt: skip
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_shape("out", out, [T, Dn], "[T, D]")  # any strides, as x
    if lanes is None:
        lanes = (
            LANES_DEFAULT and cu_seqlens is not None and inter is None and N <= LANES_MAX_D_STATE
        )
    if lanes:
        for name, asked in (("requests_per_program", requests_per_program is not None),
                            ("cache_hints", bool(cache_hints))):  # fmt: skip
            if asked:
                raise ValueError(
                    f"{name}: a knob of the [BD, N] tile kernel; this varlen call runs the "
                    "whole-channels-a-thread kernel (lanes, the default for varlen calls without "
                    "intermediate_states): pass lanes=False"
                )
    if time_chunk is None and cu_seqlens is not None and inter is None:
        time_chunk = auto_time_chunk(T, R, Dn, x.device, lanes=lanes)
    if time_chunk and cu_seqlens is not None:
        _launch_chunked(
            x, dt, A_log, B, C, state, state_indices, out, cu=cu_seqlens, L=time_chunk,
            init=has_initial_state, D=D, dt_bias=dt_bias, z=z, dt_softplus=dt_softplus,
            write_state=update_state, block_d=block_d, num_warps=num_warps,
            cache_hints=bool(cache_hints), lanes=lanes,
        )  # fmt: skip
        return out
    if lanes:
        assert cu_seqlens is not None  # a lanes decode was refused above
        launch_lanes(
            x, dt, A_log, B, C, state, state_indices, out, cu=cu_seqlens,
            init=has_initial_state, D=D, dt_bias=dt_bias, z=z, dt_softplus=dt_softplus,
            write_state=update_state, block_d=block_d, num_warps=num_warps,
        )  # fmt: skip
        return out
    rpp, hints = requests_per_program or 1, bool(cache_hints)
    if cu_seqlens is None:
        rpp_auto, hints_auto = decode_defaults(R)
        rpp = requests_per_program or rpp_auto
        hints = hints_auto if cache_hints is None else cache_hints
    _launch(
        x, dt, A_log, B, C, state, state_indices, out,
        mode=_DECODE if cu_seqlens is None else _VARLEN, cu=cu_seqlens, lengths=None, step=1,
        init=has_initial_state, D=D, dt_bias=dt_bias, z=z, dt_softplus=dt_softplus,
        inter=inter, write_state=update_state, write_out=True, block_d=block_d,
        num_warps=num_warps, requests_per_program=rpp,
        cache_hints=hints, pipeline=pipeline, loads_first=loads_first,
    )  # fmt: skip
    return out


#: Channels per program of a prefill or verify walk unless the caller sets ``block_d`` (see
#: :func:`_launch`); :func:`auto_time_chunk` counts the walk's programs by it.
_WALK_BLOCK_D = 16
#: The time chunk :func:`auto_time_chunk` picks: 256 tokens ran as fast as 128 and faster than
#: 512 for one long request (figures: docs/results.md).
AUTO_TIME_CHUNK = 256
#: :func:`auto_time_chunk` chunks while the sequential walk would start fewer programs (of
#: 16 channels, one request) than this many per SM: the walk lost to chunks of 256 at 7.8
#: programs per SM and beat them from 15.5 (``bench_ssm.py`` section ``mamba1_chunk_rule``;
#: figures: docs/results.md).
AUTO_CHUNK_BELOW_PROGRAMS_PER_SM = 12
#: Whether varlen calls without per-token states take the whole-channels-a-thread kernel
#: (:mod:`.mamba1_lanes`) when ``mamba1_scan`` is given ``lanes=None``. On the H200 at d_inner
#: 8192, d_state 16, T = 8192, it ran 2.0x / 1.4x / 2.2x the tile kernel's rate as 1 / 4 / 16
#: requests, 1.20x / 1.00x / 1.70x mamba_ssm's CUDA selective scan (docs/results.md).
LANES_DEFAULT = True
#: The largest d_state the default sends to the lanes kernel: it holds a channel's ``N``
#: states in registers (``2 N`` at its default two channels a thread), measured at 16, the
#: d_state of every Mamba1 model served (Falcon-Mamba, Jamba, mamba-*); larger ones would
#: spill, so they keep the tile kernel unless ``lanes=True`` asks.
LANES_MAX_D_STATE = 16


def auto_time_chunk(T: int, R: int, D: int, device: torch.device, *, lanes: bool = False) -> int:
    """The ``time_chunk`` :func:`mamba1_scan` uses when given None, for ``T`` tokens of ``R``
    requests over ``D`` channels: :data:`AUTO_TIME_CHUNK` where the sequential walk leaves the
    GPU idle (few warps, at least two chunks a request on average), else 0 (the walk). The
    walk's warps: one per program of 16 channels for the tile kernel, ``LANES_WARPS`` per
    ``LANES_BLOCK_D`` channels for the lanes kernel (``lanes``); both against
    :data:`AUTO_CHUNK_BELOW_PROGRAMS_PER_SM` warps per SM (the lanes walk lost to chunks of
    256 at 3.9 warps per SM and beat them at 15.5 on the H200). Always 0 off CUDA: Triton's
    interpreter gains nothing from chunks."""
    if device.type != "cuda" or R == 0 or T < 2 * AUTO_TIME_CHUNK * R:
        return 0
    warps = R * (cdiv(D, LANES_BLOCK_D) * LANES_WARPS if lanes else cdiv(D, _WALK_BLOCK_D))
    sms = _num_sms(device.index if device.index is not None else 0)
    return AUTO_TIME_CHUNK if warps < AUTO_CHUNK_BELOW_PROGRAMS_PER_SM * sms else 0


def decode_defaults(R: int) -> tuple[int, bool]:
    """``(requests_per_program, cache_hints)`` of a decode step of ``R`` requests when the
    caller gives None. On the H200 (d_inner 8192, d_state 16, fp32 state, 64 channels on one
    warp): at B = 256 the streaming hints moved the state at 0.85 of copy bandwidth, 0.82
    without; at B = 1024 they cost (0.82 with, 0.85 without) and 4 requests a program, sharing
    the ``A_log`` / ``D`` / ``dt_bias`` reads, reached 0.87 (``bench_decode_sweep.py``)."""
    return (4, False) if R >= 1024 else (1, True)


def _launch(x, dt, A_log, B, C, state, idx, out, *, mode, cu, lengths, step, init, D, dt_bias,
            z, dt_softplus, inter, write_state, write_out, block_d, num_warps,
            requests_per_program=1, dtsum=None, cache_hints=False,
            pipeline=0, loads_first=False) -> None:  # fmt: skip
    Dn, N = A_log.shape
    R = idx.shape[0]
    walks = (mode == _VARLEN and x.shape[0] > R) or (mode == _STRIDED and step > 1)
    if block_d is None and walks:
        # a prefill walks its tokens: 16 channels per program ran fastest on the H200 at
        # d_inner 8192, d_state 16 (T = 8192 as 1 / 16 requests: 4.94 / 1.19 ms at 16, against
        # 8.7-11.0 / 1.20-1.46 ms at 32-128). The replay commit (strided, K1 tokens a request)
        # takes the verify scan's tile: another tile compiles to other roundings, and the two
        # commit strategies must store bit-identical states.
        block_d = _WALK_BLOCK_D
    BD, BN, warps = _tiles(N, block_d, num_warps, requests=R, D=Dn, device=x.device)
    if R == 0:
        return
    rpp = requests_per_program
    _mamba1_scan_kernel[(cdiv(R, rpp), cdiv(Dn, BD))](
        x, dt, A_log, B, C,
        D if D is not None else A_log,
        dt_bias if dt_bias is not None else A_log,
        z if z is not None else x,
        state, idx,
        cu if cu is not None else idx,
        lengths if lengths is not None else idx,
        init if init is not None else idx,
        inter if inter is not None else state,
        out if out is not None else x,
        dtsum if dtsum is not None else A_log,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), C.stride(0),
        *(z.stride() if z is not None else (0, 0)),
        *(out.stride() if out is not None else (0, 0)),
        state.stride(0), state.stride(1),
        *(inter.stride()[:3] if inter is not None else (0, 0, 0)),
        R, D=Dn, N=N, BD=BD, BN=BN, RPP=rpp, STEP=step, MODE=mode,
        HAS_INIT=init is not None, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus, STORE_INTER=inter is not None,
        WRITE_STATE=write_state, WRITE_OUT=write_out, STORE_DTSUM=dtsum is not None,
        HINTS=bool(cache_hints), PIPELINE=pipeline if mode == _DECODE else 0,
        LOADS_FIRST=bool(loads_first) and mode == _DECODE, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _mamba1_chunk_carry_kernel(
    ws_ptr, dts_ptr, a_log_ptr, state_ptr, idx_ptr, init_ptr, ccu_ptr, s_ss, s_sd,
    D: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    HAS_INIT: tl.constexpr, WRITE_STATE: tl.constexpr,
):  # fmt: skip
    """Time-chunked pass 2, grid ``(R, D / BD)``: walk request ``b``'s chunks
    ``ccu[b] .. ccu[b + 1]`` in order; ``ws[c]`` holds chunk ``c``'s end state from a zero start
    (pass 1) and is replaced by the state entering it, ``h_in(c + 1) = exp(A dtsum_c) h_in(c) +
    ws[c]``; the state after the last chunk goes to the slot."""
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_n = tl.arange(0, BN)
    m_d = o_d < D
    m_dn = m_d[:, None] & (o_n < N)[None, :]
    slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    valid = (o_d * 0 + slot) >= 0
    m_state = m_dn & valid[:, None]
    b_a = -tl.exp(tl.load(a_log_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.0))
    p_state = state_ptr + slot * s_ss + o_d[:, None] * s_sd + o_n[None, :]
    b_h = tl.load(p_state, mask=m_state, other=0.0).to(tl.float32)
    if HAS_INIT:  # as _mamba1_scan_kernel: a fresh request's slot is never read
        init = tl.load(init_ptr + pid_b).to(tl.int32)
        b_h = tl.where(((o_d * 0 + init) == 0)[:, None], 0.0, b_h)
    c0 = tl.load(ccu_ptr + pid_b).to(tl.int64)
    c1 = tl.load(ccu_ptr + pid_b + 1).to(tl.int64)
    for c in range(c0, c1):
        p_ws = ws_ptr + c * (D * N) + o_d[:, None] * N + o_n[None, :]
        b_end = tl.load(p_ws, mask=m_state, other=0.0)
        b_s = tl.load(dts_ptr + c * D + o_d, mask=m_d & valid, other=0.0)
        tl.store(p_ws, b_h, mask=m_state)
        b_h = b_h * tl.exp(b_s[:, None] * b_a) + b_end
    if WRITE_STATE:
        tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m_state)


def _chunk_table(
    cu: torch.Tensor, idx: torch.Tensor, T: int, L: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(n, chunk_cu [n + 1], chunk_idx [n], ccu [R + 1])`` on the device, no host sync:
    request ``b`` (tokens ``cu[b] .. cu[b + 1]``) is cut into ``cdiv(len_b, L)`` chunks of ``L``
    tokens, the last one shorter (chunks never cross a request boundary); its chunks are
    ``ccu[b] .. ccu[b + 1]``, chunk ``c`` spans tokens ``chunk_cu[c] .. chunk_cu[c + 1]``.
    ``n = cdiv(T, L) + R`` bounds the chunk count (each request adds at most one partial
    chunk); chunks past the real count are empty. ``chunk_idx[c]`` is ``c`` (its workspace
    row), ``-1`` for the chunks of padding requests (slot ``-1``) and the unused ones."""
    R = idx.shape[0]
    n = cdiv(T, L) + R
    cu64 = cu.to(torch.int64)
    counts = torch.div(cu64[1:] - cu64[:-1] + (L - 1), L, rounding_mode="floor")
    ccu = torch.zeros(R + 1, dtype=torch.int64, device=cu.device)
    torch.cumsum(counts, 0, out=ccu[1:])
    c = torch.arange(n, dtype=torch.int64, device=cu.device)
    b = torch.searchsorted(ccu[1:], c, right=True).clamp_(max=R - 1)  # chunk c's request
    used = c < ccu[R]
    start = torch.where(used, cu64[b] + (c - ccu[b]) * L, cu64[R])
    chunk_cu = torch.cat([start, cu64[R:]])
    chunk_idx = torch.where(used & (idx[b] >= 0), c, -1).to(torch.int32)
    return n, chunk_cu, chunk_idx, ccu


def _launch_chunked(x, dt, A_log, B, C, state, idx, out, *, cu, L, init, D, dt_bias, z,
                    dt_softplus, write_state, block_d, num_warps,
                    cache_hints=False, lanes=False) -> None:  # fmt: skip
    """The time-chunked varlen scan (``mamba1_scan(time_chunk=L)``), three launches (passes 1
    and 3 on the lanes kernel, :func:`~.mamba1_lanes.launch_lanes`, where ``lanes``):

    1. :func:`_mamba1_scan_kernel` over the chunks as requests, each from a zero state, no
       outputs: each chunk's end state into the workspace ``ws [n, D, N]`` (float32, whatever
       the pool's dtype) and its total ``dt`` per channel into ``dtsum [n, D]``;
    2. :func:`_mamba1_chunk_carry_kernel` per request (sequential over its chunks, cheap):
       ``ws[c]`` becomes the state entering chunk ``c``; the final state goes to the slot;
    3. :func:`_mamba1_scan_kernel` over the chunks again, each from its ``ws[c]``, writing
       ``y`` (``D``, ``z`` as usual).

    Pass 3 re-scans the chunk rather than adding ``C_t . (exp(A cumdt_t) h_in)`` to pass 1's
    local outputs: it is the sequential kernel itself (same code, same rounding, ``D`` / ``z``
    applied once on the full ``y``), and it needs no ``[T, D]`` float32 workspace for the local
    outputs and cumulative ``dt`` (written and read once more each, more traffic than reading
    ``x, dt, B, C`` again). Both ways cost one ``exp`` per token, channel and state entry."""
    Dn, N = A_log.shape
    T, R = x.shape[0], idx.shape[0]
    if R == 0:
        return
    n, chunk_cu, chunk_idx, ccu = _chunk_table(cu, idx, T, L)
    ws = torch.empty(n, Dn, N, dtype=torch.float32, device=x.device)
    dtsum = torch.empty(n, Dn, dtype=torch.float32, device=x.device)
    zero = torch.zeros(n, dtype=torch.bool, device=x.device)  # every chunk from a zero state
    if lanes:
        scan = dict(cu=chunk_cu, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                    block_d=block_d, num_warps=num_warps)  # fmt: skip
        launch_lanes(x, dt, A_log, B, C, ws, chunk_idx, None, init=zero, z=None,
                     write_state=True, dtsum=dtsum, **scan)  # fmt: skip
        _chunk_carry(ws, dtsum, A_log, state, idx, init, ccu, write_state)
        launch_lanes(x, dt, A_log, B, C, ws, chunk_idx, out, init=None, z=z, write_state=False,
                     **scan)  # fmt: skip
        return
    common = dict(
        mode=_VARLEN, cu=chunk_cu, lengths=None, step=1, D=D, dt_bias=dt_bias,
        dt_softplus=dt_softplus, inter=None, block_d=block_d, num_warps=num_warps,
        cache_hints=cache_hints,
    )  # fmt: skip
    _launch(x, dt, A_log, B, C, ws, chunk_idx, None, init=zero, z=None, write_state=True,
            write_out=False, dtsum=dtsum, **common)  # fmt: skip
    _chunk_carry(ws, dtsum, A_log, state, idx, init, ccu, write_state)
    _launch(x, dt, A_log, B, C, ws, chunk_idx, out, init=None, z=z, write_state=False,
            write_out=True, **common)  # fmt: skip


def _chunk_carry(ws, dtsum, A_log, state, idx, init, ccu, write_state) -> None:
    """Time-chunked pass 2 (:func:`_mamba1_chunk_carry_kernel`) over every request."""
    Dn, N = A_log.shape
    R = idx.shape[0]
    BD, BN, warps = _tiles(N, None, None, requests=R, D=Dn, device=ws.device)
    _mamba1_chunk_carry_kernel[(R, cdiv(Dn, BD))](
        ws, dtsum, A_log, state, idx, init if init is not None else idx, ccu,
        state.stride(0), state.stride(1), D=Dn, N=N, BD=BD, BN=BN,
        HAS_INIT=init is not None, WRITE_STATE=write_state, num_warps=warps,
    )  # fmt: skip


def mamba1_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    **kwargs: object,
) -> torch.Tensor:
    """One token per request (``x [B, D]``, ``B, C [B, N]``): :func:`mamba1_scan` without
    ``cu_seqlens``; reads no lengths, so a step can be captured in a CUDA graph."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("mamba1_decode takes one token per request: no cu_seqlens")
    return mamba1_scan(x, dt, A_log, B, C, ssm_state, state_indices, **kwargs)  # type: ignore[arg-type]


def mamba1_replay_commit(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    num_accepted: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    block_d: int | None = None,
) -> None:
    """Replay commit: rerun the first ``num_accepted[b]`` of request ``b``'s ``K1`` verify
    tokens from its slot and store the state (no outputs).

    :param x: ``[Bt * K1, D]`` (request-major, ``K1`` tokens each); ``dt`` the same; ``B``,
        ``C``: ``[Bt * K1, N]``.
    :param num_accepted: ``[Bt]`` int32 in ``0..K1`` (``0``: the slot is left as it is).
    """
    Bt = state_indices.shape[0]
    check_shape("x", x, [None, None], "[B * K1, D]")
    if Bt == 0 or x.shape[0] % Bt:
        raise ValueError(f"x: expected B * K1 rows for B={Bt} requests, got {x.shape[0]}")
    K1 = x.shape[0] // Bt
    Dn, N = A_log.shape[0], A_log.shape[-1]
    check_shape("dt", dt, [Bt * K1, Dn], "[B * K1, D]")
    for name, t in (("B", B), ("C", C)):
        check_shape(name, t, [Bt * K1, N], "[B * K1, N]")
        check_last_contiguous(name, t)
    check_index("num_accepted", num_accepted, Bt)
    check_index("state_indices", state_indices, Bt)
    state = _pool("ssm_state", ssm_state, Dn, N, 1)
    check_same_device(
        {"x": x, "dt": dt, "A_log": A_log, "B": B, "C": C, "ssm_state": ssm_state,
         "num_accepted": num_accepted, "state_indices": state_indices}
    )  # fmt: skip
    _launch(
        x, dt, A_log, B, C, state, state_indices, None, mode=_STRIDED, cu=None,
        lengths=num_accepted, step=K1, init=None, D=D, dt_bias=dt_bias, z=None,
        dt_softplus=dt_softplus, inter=None, write_state=True, write_out=False,
        block_d=block_d, num_warps=None,
    )  # fmt: skip


@triton.jit
def _mamba1_commit_kernel(
    inter_ptr, acc_ptr, state_ptr, idx_ptr, s_ib, s_ik, s_id, s_ss, s_sd,
    D: tl.constexpr, N: tl.constexpr, K1: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    acc = tl.load(acc_ptr + pid_b).to(tl.int64)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_n = tl.arange(0, BN)
    keep = (o_d * 0 + slot >= 0) & (o_d * 0 + acc >= 1) & (o_d * 0 + acc <= K1)
    m = (o_d < D)[:, None] & (o_n < N)[None, :] & keep[:, None]
    src = inter_ptr + pid_b.to(tl.int64) * s_ib + (acc - 1) * s_ik
    b_h = tl.load(src + o_d[:, None] * s_id + o_n[None, :], mask=m, other=0.0)
    p_state = state_ptr + slot * s_ss + o_d[:, None] * s_sd + o_n[None, :]
    tl.store(p_state, b_h.to(state_ptr.dtype.element_ty), mask=m)


def mamba1_commit(
    intermediate_states: torch.Tensor,
    num_accepted: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> None:
    """Native commit: copy ``intermediate_states[b, num_accepted[b] - 1]`` into slot
    ``state_indices[b]``; ``num_accepted`` out of ``1..K1`` and padding rows leave the slot.

    :param intermediate_states: ``[B, K1, D, N(, 1)]`` from :func:`mamba1_scan`.
    :param ssm_state: ``[S, D, N(, 1)]`` float32 / bfloat16 (cast on store).
    """
    lead = intermediate_states.dim() - (3 if intermediate_states.shape[-1] == 1 else 2)
    if lead != 2:
        raise ValueError(
            f"intermediate_states: expected [B, K1, D, N] or [B, K1, D, N, 1], got "
            f"{list(intermediate_states.shape)}"
        )
    Bt, K1, Dn = intermediate_states.shape[:3]
    N = intermediate_states.shape[3]
    inter = _pool("intermediate_states", intermediate_states, Dn, N, 2)
    state = _pool("ssm_state", ssm_state, Dn, N, 1)
    check_index("num_accepted", num_accepted, Bt)
    check_index("state_indices", state_indices, Bt)
    check_same_device(
        {"intermediate_states": intermediate_states, "num_accepted": num_accepted,
         "ssm_state": ssm_state, "state_indices": state_indices}
    )  # fmt: skip
    BD, BN, warps = _tiles(N, None, None)
    if Bt == 0:
        return
    _mamba1_commit_kernel[(Bt, cdiv(Dn, BD))](
        inter, num_accepted, state, state_indices, *inter.stride()[:3], *state.stride()[:2],
        D=Dn, N=N, K1=K1, BD=BD, BN=BN, num_warps=warps,
    )  # fmt: skip
