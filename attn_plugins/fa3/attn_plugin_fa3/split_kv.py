"""Split-KV decode: attention of one query per request over a long context, spread over the GPU.

FlashAttention-4's Hopper kernel has no split-KV (``num_splits`` must be 1 on sm90): its grid is
one CTA per (request, KV head) for a decode step, so B=1 with 8 KV heads keeps 8 of 132 SMs busy
and a 32k-token decode runs about 10x slower than FlashInfer's. This module splits each request's
cached context (its ``seq_len - 1`` keys before the step's token) into chunks of whole pages,
runs every chunk as its own one-query "request" of the same varlen call (the chunk's slice of the
page table, its length as ``seqused_k``), and merges the chunk outputs by their log-sum-exp
together with the step's own key, whose logit ``s_new = q . k_new * scale`` (soft-capped where
the layer caps) the merge computes itself::

    M   = max(max_s lse_s, s_new, sink)
    out = (sum_s exp(lse_s - M) * o_s + exp(s_new - M) * v_new)
          / (sum_s exp(lse_s - M) + exp(s_new - M) + exp(sink - M))

Why the new token is left out of the chunks: the merge kernel then also stores the step's K/V
rows into the paged cache (the chunk kernel, which ran before it, never reads that slot), so no
write launch precedes the chunks. With the query of a single request passed broadcast over its
chunk rows (:func:`query_rows`, where the kernel was seen to read such rows right) a split
decode step is two launches per layer (the chunk call and the merge); several requests copy
their query rows first (three). It took four: KV write, query copy, chunk call, merge.
Learnable sinks join the softmax denominator once, so they are left out of the chunk calls and
added in the merge too. Chunks past a request's context (``seqused_k = 0``) get weight 0 whatever
the kernel wrote for them.

Only decode steps of layers without a sliding window are split (a window already bounds the work,
and a chunk would need the window's start mask). :func:`plan_splits` decides from a host length:
an eager step's longest context, or, in CUDA-graph mode (where a captured graph may not depend on
the step's lengths), the page table's capacity, so that every replay of one padded batch size
has the captured split; its metadata is then refilled in place (:func:`build_metadata` ``out=``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attn_core.state.kv_write import write_kv_slots

__all__ = [
    "SplitMetadata",
    "SplitPlan",
    "build_metadata",
    "merge",
    "merge_reference",
    "new_token_logits",
    "plan_splits",
    "query_rows",
    "sm_count",
]

#: The split aims for one full wave of CTAs: the Hopper kernel's shared memory fits one CTA per
#: SM, and a second, partial wave costs as much as a full one (9 chunks of 4 x 8 CTAs ran at
#: 73 % of the bandwidth 4 chunks reach).
_WAVES = 1
#: A chunk shorter than this costs more in the merge than it saves in the kernel.
_MIN_CHUNK_TOKENS = 1024
_MAX_SPLITS = 64


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """How a decode step is split: ``num_splits`` chunks of ``pages_per_chunk`` pages each."""

    num_splits: int
    pages_per_chunk: int
    page_size: int

    @property
    def chunk_tokens(self) -> int:
        return self.pages_per_chunk * self.page_size


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (nothing to fill: no split)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(
    num_reqs: int, max_seq_len: int, page_size: int, num_kv_heads: int, num_sms: int
) -> SplitPlan | None:
    """The split of a decode step, or None when one call already fills the GPU.

    :param num_reqs: requests of the step (one query token each).
    :param max_seq_len: the most keys the chunk kernel reads for one request (host int): an
        eager step's longest cached context (``seq_len - 1``), or the page table's capacity.
    :param num_kv_heads: the kernel runs one CTA per (request, KV head) (GQA heads are packed).
    :param num_sms: streaming multiprocessors of the device.
    """
    ctas = num_reqs * num_kv_heads
    if 2 * ctas > _WAVES * num_sms or max_seq_len < 2 * _MIN_CHUNK_TOKENS:
        return None
    wanted = min(_WAVES * num_sms // ctas, max_seq_len // _MIN_CHUNK_TOKENS, _MAX_SPLITS)
    pages = -(-max_seq_len // page_size)
    pages_per_chunk = -(-pages // wanted)
    num_splits = -(-pages // pages_per_chunk)  # no chunk is empty for the longest request
    if num_splits < 2:
        return None
    return SplitPlan(num_splits, pages_per_chunk, page_size)


@dataclass(frozen=True, slots=True)
class SplitMetadata:
    """The chunked step as the varlen kernel takes it (device tensors, built once per step).

    :ivar page_table: ``[B * S, pages_per_chunk]`` int32, row ``b * S + s`` = chunk ``s`` of ``b``.
    :ivar seqused_k: ``[B * S]`` int32, cached keys of each chunk: of the ``seq_len - 1`` keys
        before the step's token (0 past the request's context); the merge adds the new token.
    :ivar cu_seqlens_q: ``[B * S + 1]`` int32, ``0, 1, ..., B * S`` (one query per chunk).
    :ivar seq_lens: ``[B]`` int32, the requests' KV lengths, the new token included.
    """

    plan: SplitPlan
    num_reqs: int
    page_table: torch.Tensor
    seqused_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor


#: per (device, plan, rows): ``1 + `` the chunk start offsets ``[S]`` (a chunk's cached keys are
#: ``seq_len - (1 + start)``) and ``cu_seqlens_q`` ``[B * S + 1]``, the same every step: built
#: once instead of two ``arange`` launches per layer per step
_CONSTANTS: dict[tuple[torch.device, SplitPlan, int], tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_CONSTANTS = 256


def _constants(
    plan: SplitPlan, num_reqs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, plan, num_reqs)
    hit = _CONSTANTS.get(key)
    if hit is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        starts = torch.arange(plan.num_splits, device=device, dtype=torch.int32)
        cu = torch.arange(num_reqs * plan.num_splits + 1, device=device, dtype=torch.int32)
        hit = _CONSTANTS[key] = (starts * plan.chunk_tokens + 1, cu)
    return hit


def build_metadata(
    plan: SplitPlan,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: SplitMetadata | None = None,
) -> SplitMetadata:
    """Chunk a decode step's page table and cached lengths (a few small device ops, no host
    sync).

    The chunked page table is a view of ``page_table`` where its width is the split's
    (``S * pages_per_chunk``), else a padded copy; the chunk lengths take two launches.

    :param page_table: ``[B, max_pages]`` int32 (rows of the step's real requests).
    :param seq_lens: ``[B]`` int32, KV length including the new token (the chunks cover the
        ``seq_len - 1`` keys before it).
    :param out: metadata of the same plan and ``B`` whose buffers are refilled in place (CUDA
        graph mode: a captured graph reads their addresses); None: fresh tensors.
    """
    num_reqs = seq_lens.shape[0]
    s, ppc = plan.num_splits, plan.pages_per_chunk
    width = s * ppc
    table = page_table[:num_reqs, : min(width, page_table.shape[1])]
    if table.shape[1] < width:  # pages past a request's length are never read: any index works
        table = F.pad(table, (0, width - table.shape[1]))
    table = table.reshape(num_reqs * s, ppc)  # a view when the rows are the split's width
    first_key, cu_seqlens_q = _constants(plan, num_reqs, seq_lens.device)
    chunk_lengths = seq_lens[:num_reqs, None] - first_key[None, :]
    if out is not None:
        if out.plan != plan or out.num_reqs != num_reqs:
            raise ValueError(
                f"split metadata of {out.num_reqs} requests, {out.plan} refilled for "
                f"{num_reqs} requests, {plan}"
            )
        if (
            table.data_ptr() != out.page_table.data_ptr()
            or table.stride() != out.page_table.stride()
        ):
            out.page_table.copy_(table)
        torch.clamp(chunk_lengths, 0, plan.chunk_tokens, out=out.seqused_k.view(num_reqs, s))
        if out.seq_lens.data_ptr() != seq_lens.data_ptr():
            out.seq_lens.copy_(seq_lens[:num_reqs])
        return out
    return SplitMetadata(
        plan=plan,
        num_reqs=num_reqs,
        page_table=table.contiguous(),
        seqused_k=chunk_lengths.clamp_(0, plan.chunk_tokens).reshape(-1).to(torch.int32),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens[:num_reqs],
    )


def query_rows(q: torch.Tensor, num_splits: int, buffer: torch.Tensor | None) -> torch.Tensor:
    """The chunk rows' queries ``[B * S, H, D]``: row ``b * S + s`` is ``q[b]``.

    :param q: ``[B, H, D]``, the step's real (or padded) requests' queries.
    :param buffer: ``[>= B * S, H, D]`` contiguous in q's dtype to copy the rows into (one copy
        launch), or None: a zero-stride view of ``q[0]`` (no launch), for ``B == 1`` and a
        kernel that reads broadcast rows (:func:`attn_plugin_fa3.providers.check_broadcast_q`).
    """
    b, h, d = q.shape
    if buffer is None:
        if b != 1:
            raise ValueError(f"query rows of {b} requests need a buffer (a view serves one)")
        return q.expand(num_splits, h, d)
    rows = buffer[: b * num_splits]
    rows.view(b, num_splits, h, d).copy_(q[:, None].expand(b, num_splits, h, d))
    return rows


def new_token_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``[B, H]`` float32 logits of each query against the step's own key (GQA: head ``h``
    reads KV head ``h // (H / Hkv)``), scaled and soft-capped as the chunk kernel's are
    (``c * tanh(s * scale / c)``).

    :param q: ``[B, H, D]``; ``k``: ``[B, Hkv, D]``.
    """
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("bhd,bhd->bh", q.float(), k.float().repeat_interleave(group, dim=1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def merge_reference(
    partial: torch.Tensor,
    lse: torch.Tensor,
    meta: SplitMetadata,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    *,
    v: torch.Tensor,
    new_logits: torch.Tensor,
) -> torch.Tensor:
    """The merge in plain PyTorch (CPU, and the check of the Triton kernel).

    :param partial: ``[B * S, H, D]`` chunk outputs (q's dtype).
    :param lse: ``[H, B * S]`` float32 natural-log sum of exp of each chunk's scaled logits.
    :param sinks: ``[H]`` or None, in the units of the scaled logits.
    :param out: ``[>= B, H, D]``; rows ``[:B]`` are written (0 where a row has no key at all).
    :param v: ``[>= B, Hkv, D]`` the step's new values.
    :param new_logits: ``[B, H]`` float32, :func:`new_token_logits`; a request whose
        ``seq_len`` is 0 has no new key (its logit is ignored).
    """
    b, s = meta.num_reqs, meta.plan.num_splits
    h = partial.shape[1]
    group = h // v.shape[1]
    lse_bsh = lse.float().t().reshape(b, s, h)
    valid = (meta.seqused_k.reshape(b, s) > 0).to(lse.device)  # [B, S]
    lse_bsh = torch.where(valid[:, :, None], lse_bsh, float("-inf"))
    has_new = (meta.seq_lens[:b] > 0).to(lse.device)[:, None]  # [B, 1]
    s_new = torch.where(has_new, new_logits.float(), float("-inf"))  # [B, H]
    m = torch.maximum(lse_bsh.amax(dim=1), s_new)  # [B, H]
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[None, :])
    m = torch.where(torch.isinf(m) & (m < 0), 0.0, m)  # no key at all: every weight is 0
    w = torch.exp(lse_bsh - m[:, None, :])  # [B, S, H]
    w_new = torch.exp(s_new - m)  # [B, H]
    denom = w.sum(dim=1) + w_new
    if sinks is not None:
        denom = denom + torch.exp(sinks.float()[None, :] - m)
    parts = torch.where(valid[:, :, None, None], partial.float().reshape(b, s, h, -1), 0.0)
    v_new = v[:b].float().repeat_interleave(group, dim=1)  # [B, H, D]
    merged = (w[..., None] * parts).sum(dim=1) + w_new[..., None] * v_new
    merged = torch.where(denom[..., None] > 0, merged / denom[..., None], 0.0)
    out[:b].copy_(merged)
    return out


def merge(
    partial: torch.Tensor,
    lse: torch.Tensor,
    meta: SplitMetadata,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Merge the chunk outputs and the step's own key into ``out[:B]``, and store the step's
    K/V rows at ``slot_mapping[b]`` (``< 0``: padding, nothing stored).

    CUDA tensors (and CPU ones under Triton's interpreter): one Triton kernel
    (:mod:`attn_plugin_fa3.split_kv_triton`) does both. Elsewhere the core's KV writer, then
    :func:`merge_reference`.

    :param q: ``[>= B, H, D]``; ``k`` / ``v``: ``[>= B, Hkv, D]`` the step's new rows (request
        ``b`` is token ``b`` of a decode step), last dim contiguous.
    :param k_cache: ``[num_pages, page_size, Hkv, D]`` in q's dtype; ``v_cache`` likewise.
    :param slot_mapping: ``[>= B]`` int64 cache row of each new token.
    :param scale: the softmax scale; ``softcap``: the layer's logit cap or None.
    """
    if not partial.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        b = meta.num_reqs
        write_kv_slots(k[:b], v[:b], k_cache, v_cache, slot_mapping[:b])
        logits = new_token_logits(q[:b], k[:b], scale, softcap)
        return merge_reference(partial, lse, meta, sinks, out, v=v, new_logits=logits)
    from attn_plugin_fa3 import split_kv_triton

    return split_kv_triton.merge(
        partial, lse, meta, sinks, out, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping, scale=scale, softcap=softcap,
    )  # fmt: skip
