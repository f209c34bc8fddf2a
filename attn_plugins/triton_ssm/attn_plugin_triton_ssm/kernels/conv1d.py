"""Causal depthwise conv1d for decode and speculative verify, with the conv state in slots.

Per channel ``c`` the conv sees the sequence ``seq = conv_state[slot, c, :] ++ x[b, :, c]`` (the
last ``K - 1`` inputs of the request, then this step's ``T`` tokens) and computes, for token
``t``::

    out[b, t, c] = act(bias[c] + sum_j weight[c, j] * seq[t + j])      j = 0 .. K-1

then stores ``seq[n : n + K - 1]`` back as the new conv state, with ``n = T`` (plain decode) or
``n = num_accepted[b]`` (speculative commit). This is the convention of vLLM's and Dao-AILab's
``causal_conv1d_update`` with ``conv_state`` ``[S, C, K - 1]`` (oldest input first).

Grid ``(B / RPP, C / BC)``; each program owns a block of channels of ``RPP`` requests in turn
(``requests_per_program``: a short conv's state is a few KiB per request, so one request per
program launches many tiny programs). A decode token of a kernel-3 conv (LFM2's) over packed
``[C, 2]`` slots runs :func:`_conv1d_decode_pairs_kernel`, which moves each channel's two
state values as one word, in the layout of the token and the output, where the general kernel
reads the two columns as strided loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_plugin_triton_ssm.kernels._common import (
    cdiv,
    check_dtype,
    check_float,
    check_index,
    check_last_contiguous,
    check_same_device,
    check_shape,
    next_pow2,
)

__all__ = ["causal_conv1d_commit", "causal_conv1d_update"]

_ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _conv1d_update_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    bias_ptr,
    idx_ptr,
    nacc_ptr,
    out_ptr,
    B,
    C,
    s_xb,
    s_xt,
    s_ss,
    s_sc,
    s_sk,
    s_wc,
    s_wk,
    s_ob,
    s_ot,
    T: tl.constexpr,
    KW: tl.constexpr,
    BKM1: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    STORE_OUT: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    HAS_NACC: tl.constexpr,
    RPP: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    o_c = pid_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_bias = tl.zeros([BC], dtype=tl.float32)
    if STORE_OUT and HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    for r in tl.static_range(RPP):
        i_b = pid_b * RPP + r
        # blocks: the interpreter rejects scalar & block masks
        m_b = m_c & ((o_c * 0 + i_b) < B)  # a row of this batch (the last program's may not be)
        slot = tl.load(idx_ptr + i_b, mask=i_b < B, other=-1).to(tl.int64)
        valid = (o_c * 0 + slot) >= 0
        m_cv = m_c & valid
        p_state = state_ptr + slot * s_ss + o_c * s_sc
        p_x = x_ptr + i_b * s_xb + o_c
        _conv1d_update_row(p_state, p_x, w_ptr, nacc_ptr, out_ptr, i_b, B, o_c, m_c, m_b, m_cv,
                           valid, b_bias, s_sk, s_xt, s_wc, s_wk, s_ob, s_ot, T, KW, BKM1,
                           SILU, STORE_OUT, WRITE_STATE, HAS_NACC)  # fmt: skip


@triton.jit
def _conv1d_update_row(
    p_state,
    p_x,
    w_ptr,
    nacc_ptr,
    out_ptr,
    i_b,
    B,
    o_c,
    m_c,
    m_b,
    m_cv,
    valid,
    b_bias,
    s_sk,
    s_xt,
    s_wc,
    s_wk,
    s_ob,
    s_ot,
    T: tl.constexpr,
    KW: tl.constexpr,
    BKM1: tl.constexpr,
    SILU: tl.constexpr,
    STORE_OUT: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    HAS_NACC: tl.constexpr,
):
    """One request's block of channels: its outputs, then its new conv state (``m_b``: the
    row is one of the batch; ``m_cv``: and its slot is not padding; ``b_bias``: the bias
    block, zeros without one)."""
    if STORE_OUT:
        for t in tl.static_range(T):
            acc = b_bias  # zeros without a bias
            for j in tl.static_range(KW):
                if t + j < KW - 1:
                    xv = tl.load(p_state + (t + j) * s_sk, mask=m_cv, other=0.0)
                else:
                    xv = tl.load(p_x + (t + j - (KW - 1)) * s_xt, mask=m_cv, other=0.0)
                w = tl.load(w_ptr + o_c * s_wc + j * s_wk, mask=m_c, other=0.0)
                acc += xv.to(tl.float32) * w.to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            acc = tl.where(valid, acc, 0.0)
            tl.store(
                out_ptr + i_b * s_ob + t * s_ot + o_c, acc.to(out_ptr.dtype.element_ty), mask=m_b
            )

    if WRITE_STATE:
        if HAS_NACC:
            n = tl.load(nacc_ptr + i_b, mask=i_b < B, other=0)
            n = tl.minimum(tl.maximum(n.to(tl.int32), 0), T)
        else:
            n = T
        o_j = tl.arange(0, BKM1)
        pos = n + o_j  # position in seq of new state column j
        m_j = o_j < KW - 1
        from_state = pos < KW - 1
        m2 = m_cv[:, None] & m_j[None, :]
        old = tl.load(
            p_state[:, None] + pos[None, :] * s_sk, mask=m2 & from_state[None, :], other=0.0
        )
        new = tl.load(
            p_x[:, None] + (pos[None, :] - (KW - 1)) * s_xt,
            mask=m2 & (pos[None, :] >= KW - 1),
            other=0.0,
        )
        b_new = tl.where(from_state[None, :], old.to(tl.float32), new.to(tl.float32))
        # Every thread must have read the old state (above, and for the outputs) before any
        # thread overwrites it: the two tile layouts map an element to different threads.
        tl.debug_barrier()
        tl.store(
            p_state[:, None] + o_j[None, :] * s_sk,
            b_new.to(p_state.dtype.element_ty),
            mask=m2,
        )


@triton.jit
def _conv1d_decode_pairs_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    bias_ptr,
    idx_ptr,
    out_ptr,
    B,
    C,
    s_xb,
    s_ss,
    s_wc,
    s_wk,
    s_ob,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    RPP: tl.constexpr,
):
    """One decode token of a kernel-3 conv (LFM2's), each slot's state ``[C, 2]`` packed.

    Grid ``(B / RPP, C / BC)``. A channel's two state values are adjacent in its slot, so the
    kernel moves them as one unsigned word of twice their width (``uint32`` for a 16-bit state,
    ``uint64`` for float32; the slot's pairs must be aligned to it) and takes the columns apart
    with shifts in registers. The slot's block is then a ``[BC]`` vector like the token, the
    weights and the output, and every tensor of the kernel has one layout: no reshape, no
    layout conversion through shared memory, no barrier. A program loads the slots, the state
    words and the tokens of its ``RPP`` requests before it computes and stores any of them,
    and the weights once for all of them. Two rows of a batch must not share a slot.
    """
    s_ty = state_ptr.dtype.element_ty
    tl.static_assert(s_ty.primitive_bitwidth == 16 or s_ty.primitive_bitwidth == 32)
    if s_ty.primitive_bitwidth == 16:
        word_ty = tl.uint32
        half_ty = tl.uint16
    else:
        word_ty = tl.uint64
        half_ty = tl.uint32
    HALF: tl.constexpr = s_ty.primitive_bitwidth
    # Channels per thread and access: 16 bytes of words, the widest store. Triton's layout
    # pass gives a store at most one 16-byte vector per thread but a load as many as its
    # neighbours take (the token's 16 bytes are 8 bf16 channels where the words hold 4), and
    # the two layouts would meet through shared memory, with barriers, on every request.
    VEC: tl.constexpr = 64 // HALF
    pid_b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    o_c = pid_c * BC + tl.max_contiguous(tl.arange(0, BC), VEC)
    m_c = o_c < C
    # All the loads first: the compiler cannot move a request's loads above the previous
    # one's stores (they might alias), so a request at a time would wait on memory twice
    # (its slot, then its state) and RPP requests 2 * RPP times.
    # (tuples grow by +: Triton's code generator takes no * in a tuple)
    slots = ()
    for r in tl.static_range(RPP):
        i_b = pid_b * RPP + r
        slot = tl.load(idx_ptr + i_b, mask=i_b < B, other=-1).to(tl.int64)
        slots = slots + (slot,)  # type: ignore[assignment]  # noqa: RUF005
    words = ()
    xs = ()
    for r in tl.static_range(RPP):
        # blocks: the interpreter rejects scalar & block masks
        m_cv = m_c & ((o_c * 0 + slots[r]) >= 0)
        p_word = (state_ptr + slots[r] * s_ss).to(tl.pointer_type(word_ty)) + o_c
        words = words + (tl.load(p_word, mask=m_cv, other=0),)  # type: ignore[assignment]  # noqa: RUF005
        p_x = x_ptr + (pid_b * RPP + r) * s_xb + o_c
        xs = xs + (tl.load(p_x, mask=m_cv, other=0.0),)  # type: ignore[assignment]  # noqa: RUF005
    w0 = tl.load(w_ptr + o_c * s_wc, mask=m_c, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + o_c * s_wc + s_wk, mask=m_c, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + o_c * s_wc + 2 * s_wk, mask=m_c, other=0.0).to(tl.float32)
    b_bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    for r in tl.static_range(RPP):
        i_b = pid_b * RPP + r
        valid = (o_c * 0 + slots[r]) >= 0
        m_cv = m_c & valid
        # little-endian: column 0 is the low half
        s0 = words[r].to(half_ty).to(s_ty, bitcast=True)  # type: ignore[var-annotated]
        s1_bits = words[r] >> HALF
        s1 = s1_bits.to(half_ty).to(s_ty, bitcast=True)
        xv = xs[r]
        acc = b_bias + w0 * s0.to(tl.float32) + w1 * s1.to(tl.float32) + w2 * xv.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        acc = tl.where(valid, acc, 0.0)
        m_out = m_c & ((o_c * 0 + i_b) < B)
        tl.store(out_ptr + i_b * s_ob + o_c, acc.to(out_ptr.dtype.element_ty), mask=m_out)
        x_bits = xv.to(s_ty).to(half_ty, bitcast=True).to(word_ty)
        # No barrier before the in-place store: it takes the pointers of its load, so every
        # thread stores only words it loaded itself (where the layout gives a word to several
        # threads, one of them stores it), and the word it stores is computed from the one it
        # loaded: no thread can overwrite a word before the thread that reads it has read it.
        p_word = (state_ptr + slots[r] * s_ss).to(tl.pointer_type(word_ty)) + o_c
        tl.store(p_word, s1_bits | (x_bits << HALF), mask=m_cv)


def _prepare(x, conv_state, weight, bias, state_indices, activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected shape [B, C] or [B, K1, C], got {got}")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    B, _, C = x3.shape
    check_shape("conv_state", conv_state, [None, C, None], "[S, C, K-1]")
    check_shape("weight", weight, [C, None], "[C, K]")
    K = weight.shape[1]
    if conv_state.shape[2] != K - 1:
        raise ValueError(
            f"conv_state: expected K-1={K - 1} columns for weight [C, K={K}], got "
            f"{conv_state.shape[2]}"
        )
    if bias is not None:
        check_shape("bias", bias, [C], "[C]")
        check_float("bias", bias)
        check_last_contiguous("bias", bias)
    check_index("state_indices", state_indices, B)
    for name, t in (("x", x3), ("conv_state", conv_state), ("weight", weight)):
        check_float(name, t)
    check_last_contiguous("x", x3)
    check_same_device(
        {"x": x, "conv_state": conv_state, "weight": weight, "bias": bias,
         "state_indices": state_indices}
    )  # fmt: skip
    return x3, B, C, K


def _pairs_apply(x3, conv_state, weight, num_accepted, out3, write_state) -> str | None:
    """Why the packed kernel-3 decode kernel cannot serve this call, or None."""
    if x3.shape[1] != 1 or weight.shape[1] != 3:
        return f"one token of a kernel-3 conv, got {x3.shape[1]} tokens, kernel {weight.shape[1]}"
    if num_accepted is not None or out3 is None or not write_state:
        return "a decode step that writes its output and its state"
    if conv_state.stride(2) != 1 or conv_state.stride(1) != 2:
        return f"each slot's [C, 2] packed, got strides {tuple(conv_state.stride())}"
    # the kernel moves a channel's two values as one word of twice their width
    pair = 2 * conv_state.element_size()
    if conv_state.data_ptr() % pair or (conv_state.shape[0] > 1 and conv_state.stride(0) % 2):
        return (
            f"each slot's [C, 2] packed in {pair}-byte aligned pairs, got address "
            f"{conv_state.data_ptr():#x} and strides {tuple(conv_state.stride())}"
        )
    return None


def _run(x3, conv_state, weight, bias, state_indices, num_accepted, out3, *, silu, write_state,
         block_c, requests_per_program, packed_pairs=None, num_warps=None):  # fmt: skip
    B, T, C = x3.shape
    K = weight.shape[1]
    why_not = _pairs_apply(x3, conv_state, weight, num_accepted, out3, write_state)
    if packed_pairs and why_not:
        raise ValueError(f"packed_pairs: expected {why_not}")
    if packed_pairs is None:
        packed_pairs = why_not is None
    BC = block_c or min(256, next_pow2(C))
    rpp = requests_per_program
    if rpp is None and packed_pairs:
        # LFM2's 2048 channels on the H200 (bench_decode_sweep.py, CUDA-graph replays, against
        # a copy of the same bytes): 256 channels, 4 requests a program, 2 warps 0.82 / 0.88
        # at B = 256 / 1024, against 0.74 / 0.79 with 2 requests and 0.72 / 0.68 with one
        rpp = 4 if B >= 256 else 1
    elif rpp is None:
        # a short conv's state is a few KiB a request: at LFM2's 2048 channels the H200 moved
        # 1859 / 2990 GB/s at B = 256 / 1024 with 4 requests a program, 1724 / 2395 with one
        # (bench_decode_sweep.py); wider convs (GDN's 8192 channels) were not timed so: one
        rpp = 4 if B >= 256 and C <= 2048 else 1
    if rpp < 1:
        raise ValueError(f"requests_per_program: expected a positive count, got {rpp}")
    if packed_pairs:
        _conv1d_decode_pairs_kernel[(cdiv(B, rpp), cdiv(C, BC))](
            x3, conv_state, weight, bias if bias is not None else weight, state_indices, out3,
            B, C, x3.stride(0), conv_state.stride(0), *weight.stride(), out3.stride(0),
            BC=BC, HAS_BIAS=bias is not None, SILU=silu, RPP=rpp, num_warps=num_warps or 2,
        )  # fmt: skip
        return
    _conv1d_update_kernel[(cdiv(B, rpp), cdiv(C, BC))](
        x3,
        conv_state,
        weight,
        bias if bias is not None else weight,
        state_indices,
        num_accepted if num_accepted is not None else state_indices,
        out3 if out3 is not None else x3,
        B,
        C,
        x3.stride(0),
        x3.stride(1),
        *conv_state.stride(),
        *weight.stride(),
        *(out3.stride()[:2] if out3 is not None else (0, 0)),
        T=T,
        KW=K,
        BKM1=max(next_pow2(K - 1), 1),
        BC=BC,
        HAS_BIAS=bias is not None,
        SILU=silu,
        STORE_OUT=out3 is not None,
        WRITE_STATE=write_state,
        HAS_NACC=num_accepted is not None,
        RPP=rpp,
        num_warps=num_warps or 4,
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    *,
    activation: str | None = "silu",
    update_state: bool = True,
    out: torch.Tensor | None = None,
    block_c: int | None = None,
    requests_per_program: int | None = None,
    packed_pairs: bool | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Depthwise causal conv over this step's tokens, continuing each request's conv state.

    :param x: ``[B, C]`` (one token) or ``[B, K1, C]`` (speculative verify), float; last dim
        contiguous.
    :param conv_state: ``[S, C, K-1]`` float32/bfloat16/float16, any strides; slot
        ``state_indices[b]`` holds the last ``K-1`` inputs, oldest first.
    :param weight: ``[C, K]``; ``bias``: ``[C]`` or ``None``.
    :param state_indices: ``[B]`` int32, distinct slots; ``-1`` = padding row (zeros out,
        state untouched).
    :param activation: ``"silu"`` (alias ``"swish"``) or ``None``.
    :param update_state: write the state after all ``K1`` tokens into the slot. Pass ``False``
        for speculative verify and call :func:`causal_conv1d_commit` once the accepted count
        is known.
    :param out: like ``x`` (allocated when ``None``).
    :param block_c: channels per program (default ``min(256, next_pow2(C))``);
        ``requests_per_program``: requests each program takes in turn (default: 4 from
        ``B = 256`` on the packed path, 4 on the general one for ``B >= 256`` requests of at
        most 2048 channels, else 1).
    :param packed_pairs: one decode token of a kernel-3 conv over slots whose ``[C, 2]`` is
        packed (LFM2's short conv) in pairs aligned to their size takes a kernel that moves
        each channel's two state values as one word (``None``: wherever it applies; ``True``
        raises where it does not; ``False``: the general kernel). ``num_warps``: per program
        (default 2 on the packed path, 4 on the general one).
    :returns: ``out``, shaped like ``x``.
    """
    x3, _, _, _ = _prepare(x, conv_state, weight, bias, state_indices, activation)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_shape("out", out, list(x.shape), "like x")
    check_last_contiguous("out", out)
    if update_state and out.data_ptr() == x.data_ptr():
        # the general kernel reads x again for the new state after it stored the output
        raise ValueError("out: must not be x itself when the step writes the state")
    out3 = out.unsqueeze(1) if out.dim() == 2 else out
    _run(x3, conv_state, weight, bias, state_indices, None, out3, silu=activation is not None,
         write_state=update_state, block_c=block_c, requests_per_program=requests_per_program,
         packed_pairs=packed_pairs, num_warps=num_warps)  # fmt: skip
    return out


def causal_conv1d_commit(
    x: torch.Tensor,
    num_accepted: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    block_c: int | None = None,
    requests_per_program: int | None = None,
) -> None:
    """Advance each slot's conv state by the first ``num_accepted[b]`` tokens of ``x``.

    :param x: ``[B, K1, C]``, the tokens given to the verify call (``update_state=False``).
    :param num_accepted: ``[B]`` int32 in ``0..K1`` (clamped into that range).
    :param conv_state: ``[S, C, K-1]``, written in place; ``weight`` ``[C, K]`` gives ``K``.
    :param state_indices: ``[B]`` int32; ``-1`` = padding row (skipped).
    """
    x3, B, _, _ = _prepare(x, conv_state, weight, None, state_indices, None)
    check_index("num_accepted", num_accepted, B)
    check_dtype("num_accepted", num_accepted, (torch.int32, torch.int64))
    _run(x3, conv_state, weight, None, state_indices, num_accepted, None, silu=False,
         write_state=True, block_c=block_c,
         requests_per_program=requests_per_program)  # fmt: skip
