"""AttentionBatch and BatchBuilder: one step's batch, described once and shared by every group.

Lengths of request ``b`` in a step (``q_len`` new tokens appended to ``ctx`` cached ones)::

    position:   0 ............ ctx-1 | ctx ........ ctx+q_len-1
                 already in the cache | new this step (queries)
                 <---- context_lens[b] ----><-- query_lens[b] -->
                 <------------------ seq_lens[b] ---------------->

    query_start_loc = [0, q_0, q_0+q_1, ...]    (cu-seqlens of the new tokens, length B+1)

A decode request has ``q_len == 1``; a speculative-verify request has ``q_len == k + 1`` (the
last accepted token and ``k`` drafts); a prefill chunk has ``q_len > 1`` and any ``ctx``.

The builder owns every metadata buffer for the whole run, on the host (pinned when CUDA is used)
and on the device, and builds each step into them: device tensors keep their address from step to
step, which is what CUDA-graph replay needs, and one step costs a few small host-to-device copies
and no device-to-host synchronisation. The page table is kept incrementally: a step copies only
the page-table entries that changed since the last step.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["AttentionBatch", "BatchBuilder", "BatchMode"]


class BatchMode(str, enum.Enum):
    DECODE = "decode"  # every request has one new token
    PREFILL = "prefill"  # every request has several new tokens
    MIXED = "mixed"  # prefill chunks and decodes together
    VERIFY = "verify"  # every request verifies k draft tokens (q_len = k + 1)
    ENCODER = "encoder"  # varlen encoder sequences, no persistent state


@dataclass(slots=True, eq=False)
class AttentionBatch:
    """One step's batch. Device tensors are views of buffers owned by the :class:`BatchBuilder`.

    Host mirrors (``*_cpu``, numpy) exist so that backends plan without syncing with the GPU.
    Padding rows (``num_reqs <= i < padded_reqs``, only when the builder pads for a captured
    graph) have ``q_len = 1``, ``seq_len = 1``, page-table row of page 0, ``slot_mapping = -1``
    (nothing written) and ``state_indices = -1`` (no state touched); their output is garbage.
    """

    mode: BatchMode
    num_reqs: int  # real requests
    padded_reqs: int  # rows in the device tensors (>= num_reqs)
    num_tokens: int  # real new tokens
    padded_tokens: int  # rows of q/k/v the model passes (>= num_tokens)
    max_query_len: int
    max_seq_len: int
    spec_tokens: int  # k draft tokens per request in VERIFY mode, else 0
    request_ids: tuple[Hashable, ...]
    # device tensors
    query_start_loc: torch.Tensor  # [padded_reqs + 1] int32
    seq_lens: torch.Tensor  # [padded_reqs] int32, KV length including the new tokens
    context_lens: torch.Tensor  # [padded_reqs] int32, KV length before this step
    page_table: torch.Tensor | None  # [padded_reqs, max_pages_per_request] int32
    slot_mapping: torch.Tensor | None  # [padded_tokens] int64, page * page_size + offset, -1 skip
    positions: torch.Tensor  # [padded_tokens] int64, absolute position of each new token
    state_indices: torch.Tensor | None  # [padded_reqs] int32, linear-state slot, -1 none
    has_initial_state: torch.Tensor | None  # [padded_reqs] bool, context_lens > 0
    # host mirrors (numpy views of pinned buffers; never read back from the device)
    query_start_loc_cpu: np.ndarray  # [padded_reqs + 1] int32
    seq_lens_cpu: np.ndarray  # [padded_reqs] int32
    context_lens_cpu: np.ndarray  # [padded_reqs] int32
    page_size: int | None
    step: int  # builder step counter; contexts use it to skip re-planning the same batch
    state_epoch: int = -1  # PersistentState.epoch when built; -1: no persistent state

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is BatchMode.DECODE


class BatchBuilder:
    """Turns a step's requests into an :class:`AttentionBatch` in persistent buffers.

    :param state: the core's :class:`attn_core.state.PersistentState` (None for encoder-only).
    :param max_batch_size: most requests in a step (graph padding included).
    :param max_num_tokens: most new tokens in a step (graph padding included).
    :param max_pages_per_request: width of the page table (``ceil(max_model_len / page_size)``).
    :param device: where the kernels run.
    """

    def __init__(
        self,
        state=None,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        max_pages_per_request: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.state = state
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.page_size: int | None = getattr(state, "page_size", None)
        self.max_pages = max_pages_per_request
        # A model of linear layers only has no paged KV (its state still reports a page size).
        self._has_kv = (
            bool(getattr(state, "has_kv", True))
            and bool(self.page_size)
            and max_pages_per_request > 0
        )
        self._has_slots = bool(getattr(state, "has_state", False))
        pin = self.device.type == "cuda"
        B, T = max_batch_size, max_num_tokens

        # int32 metadata packed in one buffer: one host-to-device copy per step.
        # layout: [qsl (B+1) | seq_lens (B) | ctx_lens (B) | state_idx (B)]
        self._i32_host = torch.zeros(4 * B + 1, dtype=torch.int32, pin_memory=pin)
        self._i32_dev = torch.zeros(4 * B + 1, dtype=torch.int32, device=self.device)
        # int64 per-token metadata: [positions (n) | slot_mapping (n)] for a step of n padded
        # tokens, so one copy moves both (offsets depend only on n: graph-safe per size)
        self._i64_host = torch.zeros(2 * T, dtype=torch.int64, pin_memory=pin)
        self._i64_dev = torch.zeros(2 * T, dtype=torch.int64, device=self.device)
        self._has_init_dev = torch.zeros(B, dtype=torch.bool, device=self.device)
        self._i32 = self._i32_host.numpy()
        self._i64 = self._i64_host.numpy()
        if self._has_kv:
            # Host master copy of the page table, rows = batch positions; the device copy is
            # updated with only the changed entries each step.
            self._pt_host = np.zeros((B, self.max_pages), dtype=np.int32)
            self._pt_dev = torch.zeros((B, self.max_pages), dtype=torch.int32, device=self.device)
            # What each page-table row holds: the request's dense state row, its page count
            # and page version (bumped by the state when pages are replaced).
            self._row_dense = np.full(B, -1, dtype=np.int64)
            self._row_npages = np.zeros(B, dtype=np.int64)
            self._row_version = np.full(B, -1, dtype=np.int64)
            self._pt_upd_host = torch.zeros(
                2 * B * self.max_pages, dtype=torch.int32, pin_memory=pin
            )
        self._step = 0

    # ------------------------------------------------------------------------------------
    def build(
        self,
        requests: Sequence[tuple[Hashable, int]],
        *,
        spec_tokens: int = 0,
        pad_to: int | None = None,
    ) -> AttentionBatch:
        """Describe one step.

        :param requests: ``(request id, new tokens)`` per request, in batch order. KV lengths
            come from the persistent state (tokens already written); pages for the new tokens
            are reserved here (all-or-nothing per request: on OutOfPagesError nothing of the
            failing request changed and earlier requests keep their reserved pages).
        :param spec_tokens: ``k`` when this is a speculative-verify step (each request then
            has ``k + 1`` new tokens).
        :param pad_to: pad to this many requests (one token each) for a captured decode graph.
        """
        state = self.state
        B = len(requests)
        P = B if pad_to is None else pad_to
        if P < B:
            raise ValueError(f"pad_to={pad_to}: smaller than the batch ({B} requests)")
        if self.max_batch_size < P:
            raise ValueError(
                f"batch of {P} requests exceeds max_batch_size={self.max_batch_size} "
                "(set ExecutionConstraints.max_batch_size)"
            )
        ids = tuple(r for r, _ in requests)
        qlens = np.fromiter((n for _, n in requests), dtype=np.int64, count=B)
        if B and qlens.min() < 0:
            raise ValueError(f"new-token counts must be >= 0, got {qlens.tolist()}")
        if state is not None:
            dense = state.step_rows(ids)
            ctx = state.row_num_tokens[dense]
        else:
            dense = None
            ctx = np.zeros(B, dtype=np.int64)
        seq = ctx + qlens
        num_tokens = int(qlens.sum())
        padded_tokens = num_tokens + (P - B)
        if padded_tokens > self.max_num_tokens:
            raise ValueError(
                f"step of {padded_tokens} tokens exceeds max_num_tokens={self.max_num_tokens}"
            )
        if spec_tokens and B and (qlens != spec_tokens + 1).any():
            raise ValueError(
                f"speculative verify with k={spec_tokens} needs {spec_tokens + 1} new tokens "
                f"per request, got {qlens.tolist()}"
            )
        if state is not None and self._has_kv:
            self._reserve(ids, dense, ctx, seq)
        mode = self._mode(qlens, spec_tokens)

        # int32 block
        i32 = self._i32
        Bm = self.max_batch_size
        qsl = i32[: P + 1]
        qsl[0] = 0
        np.cumsum(qlens, out=qsl[1 : B + 1])
        if P > B:
            qsl[B + 1 : P + 1] = num_tokens + np.arange(1, P - B + 1)
        seq_view = i32[Bm + 1 : Bm + 1 + P]
        ctx_view = i32[2 * Bm + 1 : 2 * Bm + 1 + P]
        seq_view[:B] = seq
        seq_view[B:] = 1
        ctx_view[:B] = ctx
        ctx_view[B:] = 0
        slots_view = i32[3 * Bm + 1 : 3 * Bm + 1 + P]
        if self._has_slots:
            slots_view[:B] = state.row_slot[dense]
        else:
            slots_view[:B] = -1
        slots_view[B:] = -1

        # int64 per-token block: positions then slot mapping
        pos = self._i64[:padded_tokens]
        req_of_token = np.repeat(np.arange(B), qlens)
        pos[:num_tokens] = ctx[req_of_token] + (np.arange(num_tokens) - qsl[req_of_token])
        pos[num_tokens:] = 0

        page_table = slot_mapping = None
        if self._has_kv:
            self._sync_page_table(ids, dense, P)
            ps = self.page_size
            sm = self._i64[padded_tokens : 2 * padded_tokens]
            sm[:num_tokens] = self._pt_host[req_of_token, pos[:num_tokens] // ps] * ps + (
                pos[:num_tokens] % ps
            )
            sm[num_tokens:] = -1
            page_table = self._pt_dev[:P]
            slot_mapping = self._i64_dev[padded_tokens : 2 * padded_tokens]

        # host -> device: two packed copies (+ the page-table delta), never a sync
        nb = self.device.type == "cuda"
        self._i32_dev.copy_(self._i32_host, non_blocking=nb)
        n64 = 2 * padded_tokens if self._has_kv else padded_tokens
        self._i64_dev[:n64].copy_(self._i64_host[:n64], non_blocking=nb)
        dev = self._i32_dev
        seq_dev = dev[Bm + 1 : Bm + 1 + P]
        ctx_dev = dev[2 * Bm + 1 : 2 * Bm + 1 + P]
        state_idx = dev[3 * Bm + 1 : 3 * Bm + 1 + P] if self._has_slots else None
        has_init = None
        if self._has_slots:
            has_init = self._has_init_dev[:P]
            torch.gt(ctx_dev, 0, out=has_init)
        self._step += 1
        return AttentionBatch(
            mode=mode,
            num_reqs=B,
            padded_reqs=P,
            num_tokens=num_tokens,
            padded_tokens=padded_tokens,
            max_query_len=int(qlens.max()) if B else 0,
            max_seq_len=int(seq.max()) if B else 0,
            spec_tokens=spec_tokens,
            request_ids=ids,
            query_start_loc=dev[: P + 1],
            seq_lens=seq_dev,
            context_lens=ctx_dev,
            page_table=page_table,
            slot_mapping=slot_mapping,
            positions=self._i64_dev[:padded_tokens],
            state_indices=state_idx,
            has_initial_state=has_init,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_view,
            context_lens_cpu=ctx_view,
            page_size=self.page_size,
            step=self._step,
            state_epoch=state.epoch if state is not None else -1,
        )

    def build_encoder(self, seq_lens: Sequence[int]) -> AttentionBatch:
        """A batch of independent encoder sequences (bidirectional, no persistent state)."""
        B = len(seq_lens)
        if self.max_batch_size < B:
            raise ValueError(f"{B} sequences exceed max_batch_size={self.max_batch_size}")
        lens = np.asarray(seq_lens, dtype=np.int64)
        T = int(lens.sum())
        if self.max_num_tokens < T:
            raise ValueError(f"{T} tokens exceed max_num_tokens={self.max_num_tokens}")
        i32 = self._i32
        Bm = self.max_batch_size
        qsl = i32[: B + 1]
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:])
        seq_view = i32[Bm + 1 : Bm + 1 + B]
        seq_view[:] = lens
        ctx_view = i32[2 * Bm + 1 : 2 * Bm + 1 + B]
        ctx_view[:] = 0
        pos = self._i64[:T]
        req = np.repeat(np.arange(B), lens)
        pos[:] = np.arange(T) - qsl[req]
        nb = self.device.type == "cuda"
        self._i32_dev.copy_(self._i32_host, non_blocking=nb)
        self._i64_dev[:T].copy_(self._i64_host[:T], non_blocking=nb)
        dev = self._i32_dev
        self._step += 1
        return AttentionBatch(
            mode=BatchMode.ENCODER,
            num_reqs=B,
            padded_reqs=B,
            num_tokens=T,
            padded_tokens=T,
            max_query_len=int(lens.max()) if B else 0,
            max_seq_len=int(lens.max()) if B else 0,
            spec_tokens=0,
            request_ids=tuple(range(B)),
            query_start_loc=dev[: B + 1],
            seq_lens=dev[Bm + 1 : Bm + 1 + B],
            context_lens=dev[2 * Bm + 1 : 2 * Bm + 1 + B],
            page_table=None,
            slot_mapping=None,
            positions=self._i64_dev[:T],
            state_indices=None,
            has_initial_state=None,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_view,
            context_lens_cpu=ctx_view,
            page_size=None,
            step=self._step,
        )

    # ------------------------------------------------------------------------------------
    @staticmethod
    def _mode(qlens: np.ndarray, spec_tokens: int) -> BatchMode:
        if spec_tokens:
            return BatchMode.VERIFY
        if len(qlens) == 0 or (qlens == 1).all():
            return BatchMode.DECODE
        if (qlens > 1).all():
            return BatchMode.PREFILL
        return BatchMode.MIXED

    def _reserve(
        self, ids: tuple[Hashable, ...], dense: np.ndarray, ctx: np.ndarray, seq: np.ndarray
    ) -> None:
        """Reserve pages for the step; only requests that need work cost a Python call.

        A request needs :meth:`PersistentState.ensure_capacity` when its new tokens go past its
        pages, when its page-table row is not in sync, or when the page it writes first is
        shared (copy-on-write) - everything else is decided with numpy.
        """
        state = self.state
        B = len(ids)
        ps = self.page_size
        npages = state.row_num_pages[dense]
        in_sync = (self._row_dense[:B] == dense) & (
            self._row_version[:B] == state.row_page_version[dense]
        )
        first_page = ctx // ps
        has_page = in_sync & (first_page < np.minimum(npages, self._row_npages[:B]))
        write_page = self._pt_host[np.arange(B), np.where(has_page, first_page, 0)]
        shared = has_page & (state.page_allocator.refcount_array[write_page] > 1)
        slow = (seq > npages * ps) | ~in_sync | shared
        for b in np.flatnonzero(slow).tolist():
            state.ensure_capacity(ids[b], int(seq[b]))

    def _sync_page_table(self, ids: tuple[Hashable, ...], dense: np.ndarray, padded: int) -> None:
        """Bring rows ``0..len(ids)-1`` of the page table up to date; copy only the deltas."""
        state = self.state
        B = len(ids)
        host = self._pt_host
        npages = state.row_num_pages[dense]
        if B and npages.max() > self.max_pages:
            b = int(np.argmax(npages))
            raise ValueError(
                f"request {ids[b]!r} holds {int(npages[b])} pages, more than "
                f"max_pages_per_request={self.max_pages} (raise max_model_len)"
            )
        version = state.row_page_version[dense]
        rewrite = (self._row_dense[:B] != dense) | (self._row_version[:B] != version)
        grown = ~rewrite & (self._row_npages[:B] != npages)
        rows, cols = [], []
        for b in np.flatnonzero(rewrite | grown).tolist():
            pages = state.pages(ids[b])
            n = len(pages)
            start = 0 if rewrite[b] else int(self._row_npages[b])
            if start > n:  # pages were given back: rewrite the row
                start = 0
            host[b, start:n] = pages[start:n]
            rows.append(np.full(n - start, b, dtype=np.int64))
            cols.append(np.arange(start, n, dtype=np.int64))
        self._row_dense[:B] = dense
        self._row_version[:B] = version
        self._row_npages[:B] = npages
        pad = np.flatnonzero(self._row_dense[B:padded] != -1) + B
        if len(pad):  # padding rows read page 0 and write nothing
            self._row_dense[pad] = -1
            self._row_version[pad] = -1
            self._row_npages[pad] = 0
            host[pad, 0] = 0
            rows.append(pad.astype(np.int64))
            cols.append(np.zeros(len(pad), dtype=np.int64))
        if not rows:
            return
        r_idx = np.concatenate(rows)
        c_idx = np.concatenate(cols)
        n = len(r_idx)
        upd = self._pt_upd_host[: 2 * n]
        upd_np = upd.numpy()
        upd_np[:n] = r_idx * self.max_pages + c_idx
        upd_np[n:] = host[r_idx, c_idx]
        nb = self.device.type == "cuda"
        upd_dev = upd.to(self.device, non_blocking=nb)
        flat = self._pt_dev.view(-1)
        flat.index_copy_(0, upd_dev[:n].long(), upd_dev[n:])

    def invalidate(self, request_id: Hashable | None = None) -> None:
        """Forget what the page-table rows hold, so the next step rewrites every row.

        Not needed for correctness - the state's page versions tell the builder when a
        request's pages were replaced - but cheap, and kept for callers that reset a run.
        ``request_id`` is accepted for compatibility; every row is forgotten.
        """
        if self._has_kv:
            self._row_dense[:] = -1
            self._row_version[:] = -1
            self._row_npages[:] = 0
