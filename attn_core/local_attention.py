"""Chunked (local) attention as ordinary causal attention over *local virtual batches*.

A chunked layer (``LayerSpec.attention_chunk_size = C``, Llama-4) lets the query at absolute
position ``p`` see the keys ``p // C * C .. p``. Over paged KV that is plain causal attention once
each request's new queries are cut at chunk boundaries::

    request b: ctx cached tokens, q_len new ones (positions ctx .. ctx+q_len-1), C = 4

    position:   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | ...
    cached:     x x x x   x x                        ctx = 6
    new:                      q q   q q  q           q_len = 5 (positions 6 .. 10)

    virtual request 0: queries 6, 7   keys 4 .. 7   (chunk 1: page-table row from page 4/ps)
    virtual request 1: queries 8 .. 10 keys 8 .. 10 (chunk 2: page-table row from page 8/ps)

A piece whose queries lie in chunk ``c`` is a virtual request whose page-table row starts at page
``c * C / page_size`` (so ``C % page_size == 0`` is required) and whose KV length is its last
query position + 1 - ``c * C``; its queries are the last ones of that KV range, which is where an
end-aligned causal kernel puts them. The query rows keep their place and order (``q`` / ``out``
are untouched); only the request-level metadata changes. The per-token metadata
(``slot_mapping``, ``positions``) is the real batch's: the new K/V are still written where the
request's pages are, only the attention read goes through the virtual rows.

Decode steps (one query per request) give one virtual request per request, built on the device
into buffers kept per padded batch size (fixed addresses, so a captured graph replays them).
Other steps are built on the host from the batch's host mirrors (no device read-back) and copied
once; their count of virtual requests varies with the step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from attn_core.batch import AttentionBatch, BatchMode

__all__ = ["LocalVirtualBatcher", "local_virtual_batch", "max_virtual_requests"]


def _check_chunk(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"attention_chunk_size: expected a positive int, got {chunk_size!r}")


def _check(chunk_size: int, page_size: int | None) -> None:
    if page_size is None:
        raise ValueError(
            "local virtual batches need a paged batch (page_size set), got a batch without pages"
        )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page size {page_size!r}: expected a positive int")
    if chunk_size % page_size:
        raise ValueError(
            f"attention_chunk_size {chunk_size} is not a multiple of the page size {page_size}: "
            "a chunk must start on a page boundary for its virtual page-table row"
        )


class LocalVirtualBatcher:
    """Rewrites steps into local virtual batches for one chunked group.

    :param chunk_size: ``C``, the layer's ``attention_chunk_size``.

    Keeps the decode buffers per padded batch size: the virtual batch of a decode step of
    ``P`` padded requests always has the same device tensors, refilled in place.
    """

    __slots__ = ("_decode", "chunk_size")

    def __init__(self, chunk_size: int) -> None:
        _check_chunk(chunk_size)  # the page size is checked per batch
        self.chunk_size = chunk_size
        #: (padded requests, page-table width, device, page-table dtype) -> the decode step's
        #: device buffers: seq_lens [P] int32, context_lens [P] int32, page_table
        #: [P, min(C / ps, W)] of the page table's dtype and the column offsets
        #: [min(C / ps, W)] int64 of the page-table gather
        self._decode: dict[
            tuple[int, int, torch.device, torch.dtype], tuple[torch.Tensor, ...]
        ] = {}

    def __call__(self, batch: AttentionBatch) -> AttentionBatch:
        """The virtual batch of ``batch`` (see the module docstring)."""
        _check(self.chunk_size, batch.page_size)
        if batch.page_table is None:
            raise ValueError("local virtual batches need a batch with a page table")
        if batch.mode is BatchMode.DECODE:
            return self._decode_batch(batch)
        return _host_batch(batch, self.chunk_size)

    def _decode_batch(self, batch: AttentionBatch) -> AttentionBatch:
        """One virtual request per (padded) request, computed on the device from the batch's
        ``seq_lens`` and ``page_table`` into this batcher's buffers: no host read-back, and
        the tensors a captured graph read are the ones the next step refills."""
        C, ps = self.chunk_size, batch.page_size
        pt = batch.page_table
        assert pt is not None and ps is not None  # checked by __call__
        rows, width = pt.shape[0], min(C // ps, pt.shape[1])
        key = (rows, pt.shape[1], pt.device, pt.dtype)
        bufs = self._decode.get(key)
        if bufs is None:
            seq_b = torch.empty(rows, dtype=torch.int32, device=pt.device)
            ctx_b = torch.empty(rows, dtype=torch.int32, device=pt.device)
            pt_b = torch.empty(rows, width, dtype=pt.dtype, device=pt.device)
            cols = torch.arange(width, dtype=torch.int64, device=pt.device)
            bufs = self._decode[key] = (seq_b, ctx_b, pt_b, cols)
        seq_b, ctx_b, pt_b, cols = bufs
        seq = batch.seq_lens[:rows]
        # chunk start of the one query at position seq - 1 (padding rows: seq 1, start 0)
        start = torch.div(seq - 1, C, rounding_mode="floor") * C
        torch.sub(seq, start, out=seq_b)
        torch.sub(seq_b, 1, out=ctx_b)
        index = (
            torch.div(start, ps, rounding_mode="floor").long()[:, None] + cols[None, :]
        ).clamp_(max=pt.shape[1] - 1)
        torch.gather(pt, 1, index, out=pt_b)
        # host mirrors from the host mirrors (no read-back)
        seq_h = batch.seq_lens_cpu[:rows]
        vseq_h = (seq_h - (seq_h - 1) // C * C).astype(np.int32)
        n = batch.num_reqs
        return replace(
            batch,
            seq_lens=seq_b,
            context_lens=ctx_b,
            page_table=pt_b,
            seq_lens_cpu=vseq_h,
            context_lens_cpu=(vseq_h - 1).astype(np.int32),
            max_seq_len=int(vseq_h[:n].max()) if n else 0,
            # only full-attention groups get virtual batches, and they do not read it
            has_initial_state=None if batch.has_initial_state is None else ctx_b > 0,
        )


def max_virtual_requests(max_batch_size: int, max_num_tokens: int, chunk_size: int) -> int:
    """The most requests a virtual batch of a step within these limits can have (what a
    backend sizes its per-request buffers for).

    A request adds one virtual request per chunk boundary its new queries cross. A first
    crossing needs 2 new tokens (one on each side: at most ``min(B, T // 2)`` requests cross
    any), each further crossing of the same request ``chunk_size`` more (at most ``T // C`` in
    all): ``B + min(B, T // 2) + T // C``.
    """
    _check_chunk(chunk_size)
    for name, value in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    B, T = max_batch_size, max_num_tokens
    return B + min(B, T // 2) + T // chunk_size


def local_virtual_batch(batch: AttentionBatch, chunk_size: int) -> AttentionBatch:
    """``batch`` as causal attention over local virtual requests for chunks of ``chunk_size``.

    :param batch: a paged step (``page_size`` set, ``chunk_size % page_size == 0``).
    :param chunk_size: ``C``: the query at position ``p`` sees keys ``p // C * C .. p``.
    :returns: an :class:`AttentionBatch` with the same tokens (``num_tokens``, ``padded_tokens``,
        ``slot_mapping``, ``positions``) and, per virtual request ``i`` (``num_reqs`` of them,
        then the batch's padding rows unchanged): ``query_start_loc [V + pad + 1]`` int32,
        ``seq_lens`` / ``context_lens [V + pad]`` int32 (the KV length from the chunk start
        with and without the piece's queries), ``page_table [V + pad, min(C / page_size, W)]``
        int32 (the request's row from the chunk's first page), ``request_ids`` the real
        request's id per piece. A verify step whose pieces no longer have ``k + 1`` queries each
        becomes a ``mixed`` one (``spec_tokens`` 0).
    """
    return LocalVirtualBatcher(chunk_size)(batch)


def _host_batch(batch: AttentionBatch, C: int) -> AttentionBatch:
    """Any step, built on the host from the host mirrors and copied once."""
    ps, pt = batch.page_size, batch.page_table
    assert ps is not None and pt is not None  # checked by the caller
    n, padded = batch.num_reqs, batch.padded_reqs
    qsl = batch.query_start_loc_cpu[: padded + 1].astype(np.int64)
    seq = batch.seq_lens_cpu[:n].astype(np.int64)
    ctx = batch.context_lens_cpu[:n].astype(np.int64)
    first = ctx // C  # chunk of the first new query
    counts = (seq - 1) // C - first + 1  # chunks the new queries touch
    counts[seq == ctx] = 0  # a request without new queries (none expected) gives no piece
    V = int(counts.sum())
    req = np.repeat(np.arange(n), counts)
    offset = np.arange(V) - np.repeat(np.cumsum(counts) - counts, counts)
    chunk = first[req] + offset
    base = chunk * C
    q_first = np.maximum(ctx[req], base)  # first query position of the piece
    q_end = np.minimum(seq[req], base + C)  # one past its last
    pad = padded - n
    v_qsl = np.empty(V + pad + 1, dtype=np.int32)
    v_qsl[:V] = qsl[req] + (q_first - ctx[req])
    v_qsl[V:] = qsl[n:]
    v_seq = np.concatenate([q_end - base, batch.seq_lens_cpu[n:padded]]).astype(np.int32)
    v_ctx = np.concatenate([q_first - base, batch.context_lens_cpu[n:padded]]).astype(np.int32)
    rows = np.concatenate([req, np.arange(n, padded)])
    start_page = np.concatenate([base // ps, np.zeros(pad, dtype=np.int64)])
    width = min(C // ps, pt.shape[1])
    dev = pt.device
    # one host-to-device copy of the per-request integers
    packed = torch.from_numpy(
        np.concatenate([v_qsl, v_seq, v_ctx, rows.astype(np.int32), start_page.astype(np.int32)])
    ).to(dev)
    R = V + pad
    d_qsl, d_seq, d_ctx, d_rows, d_start = torch.split(packed, [R + 1, R, R, R, R])
    cols = torch.arange(width, dtype=torch.int64, device=dev)
    index = (d_start.long()[:, None] + cols[None, :]).clamp_(max=pt.shape[1] - 1)
    v_pt = pt[d_rows.long()].gather(1, index)
    v_qlens = np.diff(v_qsl[: V + 1])
    mode, spec_tokens = batch.mode, batch.spec_tokens
    if mode is BatchMode.VERIFY and n != V:
        mode, spec_tokens = BatchMode.MIXED, 0  # pieces with fewer than k + 1 queries
    return replace(
        batch,
        mode=mode,
        spec_tokens=spec_tokens,
        num_reqs=V,
        padded_reqs=R,
        max_query_len=int(v_qlens.max()) if V else 0,
        max_seq_len=int(v_seq[:V].max()) if V else 0,
        request_ids=tuple(batch.request_ids[i] for i in req),
        query_start_loc=d_qsl,
        seq_lens=d_seq,
        context_lens=d_ctx,
        page_table=v_pt,
        state_indices=None if batch.state_indices is None else batch.state_indices[d_rows.long()],
        has_initial_state=None if batch.has_initial_state is None else d_ctx > 0,
        query_start_loc_cpu=v_qsl,
        seq_lens_cpu=v_seq,
        context_lens_cpu=v_ctx,
    )
