"""The split-KV merge as one Triton kernel (see :mod:`attn_plugin_fa3.split_kv`).

One program per (request, head): it reads the request's ``S`` chunk log-sum-exps (a chunk past the
request's length counts as ``-inf``), then accumulates the chunk outputs weighted by
``exp(lse_s - M)`` in float32 and writes ``out[b, h, :]`` in ``out``'s dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from attn_plugin_fa3.split_kv import SplitMetadata

__all__ = ["merge"]


@triton.jit
def _merge_kernel(
    partial_ptr,  # [B * S, H, D]
    lse_ptr,  # [H, B * S] float32
    seq_lens_ptr,  # [B] int32
    sinks_ptr,  # [H] float32 (unused without sinks)
    out_ptr,  # [>= B, H, D]
    num_splits,
    chunk_tokens,
    stride_pt,
    stride_ph,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    s = tl.arange(0, BLOCK_S)
    valid = (s < num_splits) & (s * chunk_tokens < seq_len)
    lse = tl.load(lse_ptr + h * stride_lh + b * num_splits + s, mask=valid, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.where(valid, tl.exp(lse - m), 0.0)
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom += tl.exp(sink - m)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row0 = b * num_splits
    for i in range(0, num_splits):
        wi = tl.sum(tl.where(s == i, w, 0.0), axis=0)
        if wi > 0.0:  # empty chunks: whatever the kernel left there is not read
            part = tl.load(partial_ptr + (row0 + i) * stride_pt + h * stride_ph + d, mask=dmask)
            acc += wi * part.to(tl.float32)
    acc = acc / denom
    tl.store(
        out_ptr + b * stride_ot + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty), mask=dmask
    )


def merge(
    partial: torch.Tensor,
    lse: torch.Tensor,
    meta: SplitMetadata,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Merge chunk outputs into ``out[:B]``.

    :param partial: ``[B * S, H, D]``, unit stride in D.
    :param lse: ``[H, B * S]`` float32, unit stride over chunks.
    :param sinks: ``[H]`` (any float dtype) or None.
    :param out: ``[>= B, H, D]``, unit stride in D.
    """
    b, s = meta.num_reqs, meta.plan.num_splits
    h, d = partial.shape[1], partial.shape[2]
    if partial.stride(2) != 1 or out.stride(2) != 1 or lse.stride(1) != 1:
        raise ValueError("split-KV merge needs unit stride in the head dim and over chunks")
    _merge_kernel[(b, h)](
        partial,
        lse,
        meta.seq_lens,
        sinks if sinks is not None else lse,
        out,
        s,
        meta.plan.chunk_tokens,
        partial.stride(0),
        partial.stride(1),
        lse.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_S=max(triton.next_power_of_2(s), 2),
        HAS_SINKS=sinks is not None,
    )
    return out
