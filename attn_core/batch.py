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
step, which is what CUDA-graph replay needs, and one step costs one host-to-device copy of one
packed buffer and no device-to-host synchronisation. The page table is kept incrementally: a
step copies only the page-table entries that changed since the last step, in that same copy.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from attn_core.specs import Phase
from attn_core.state.errors import OutOfPagesError

if TYPE_CHECKING:
    from attn_core.state.manager import PersistentState

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
    graph) have ``q_len = seq_len = 1`` (``k + 1`` in a verify step), page-table row from page
    0, ``slot_mapping = -1`` (nothing written) and ``state_indices = -1`` (no state touched);
    their output is garbage. A ``full_graph`` step's last padding row takes the rest of the
    padding tokens with ``seq_len = 1`` (docs/reference.md).
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
    # [padded_tokens] int64 host mirror of slot_mapping, where the builder keeps one (prefill,
    # mixed and verify steps); None for decode and encoder steps. Read it while planning: the
    # builder's host buffers are reused a few steps later.
    slot_mapping_cpu: np.ndarray | None = None
    # Built for a captured mixed step of graph mode ``full`` (``BatchBuilder.build(...,
    # pad_tokens_to=T)``): ``padded_reqs`` and ``padded_tokens`` are the captured graph's, the
    # last padding row holds every padding token beyond one per padding row, and the mode is
    # MIXED whatever the real split (the graph was captured as a mixed step). Contexts plan
    # such a step into the fixed buffers their captured kernels read.
    full_graph: bool = False

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is BatchMode.DECODE

    @property
    def phase(self) -> Phase:
        """The plan phase whose backend serves this step: ``decode`` (every request has one new
        token), ``verify`` (speculative verify) or ``prefill`` (prefill, mixed, encoder)."""
        return _PHASE_OF_MODE[self.mode]


_PHASE_OF_MODE = {
    BatchMode.DECODE: Phase.DECODE,
    BatchMode.VERIFY: Phase.VERIFY,
    BatchMode.PREFILL: Phase.PREFILL,
    BatchMode.MIXED: Phase.PREFILL,
    BatchMode.ENCODER: Phase.PREFILL,
}


_ALIGN = 16  # bytes: every region of the packed metadata buffer starts at a multiple of this
# Host staging buffers per half of the ring (the ring has two halves). Each half costs one
# event record and one event wait: larger halves cost fewer. A buffer is a few tens of KiB.
_RING_HALF = 8
# ufunc reduce called directly: ndarray.max() goes through two Python-level wrappers
_max = np.maximum.reduce
_NO_INDICES = np.zeros(0, dtype=np.int64)  # read-only use: "no page-table entry written"
_NO_INDICES.flags.writeable = False
# Raw current CUDA stream of a device, a C call (torch.cuda.current_stream builds a Python
# Stream object each call); absent from CPU builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# Device views of one padded batch size P (_make_req_views): query_start_loc, seq_lens,
# context_lens, state_indices (or None), has_initial_state (or None), page_table (or None).
_ReqViews = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]
# Device views of a step carrying m page-table entries (_make_delta_views): the copy's
# destination, the flat indices, the values and the copy's length in bytes.
_DeltaViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _HostSlot:
    """One host staging buffer of the ring (pinned on CUDA), laid out as the device buffer.

    ``prefix`` caches ``tensor[:nbytes]`` views for the copies (a torch slice costs about as
    much as the copy call itself). ``static`` is the :class:`_Steady` token whose
    per-batch-shape content (see :meth:`BatchBuilder._stage_static`) this buffer holds, or
    None; ``views`` caches the steady path's numpy views by ``(B, P)``.
    """

    __slots__ = (
        "ctx",
        "i64",
        "init",
        "prefix",
        "qsl",
        "raw",
        "seq",
        "slots",
        "static",
        "tensor",
        "views",
    )

    def __init__(self, nbytes: int, offsets: tuple[int, ...], max_batch: int, pin: bool) -> None:
        B = max_batch
        o_qsl, o_seq, o_ctx, o_slots, o_init, o_tok = offsets
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        raw = self.raw = self.tensor.numpy()
        self.qsl = raw[o_qsl : o_qsl + 4 * (B + 1)].view(np.int32)
        self.seq = raw[o_seq : o_seq + 4 * B].view(np.int32)
        self.ctx = raw[o_ctx : o_ctx + 4 * B].view(np.int32)
        self.slots = raw[o_slots : o_slots + 4 * B].view(np.int32)
        self.init = raw[o_init : o_init + B].view(np.bool_)
        self.i64 = raw[o_tok:].view(np.int64)
        self.prefix: dict[int, torch.Tensor] = {}
        self.static: object | None = None
        self.views: dict[tuple[int, int], tuple[Any, ...]] = {}

    def host_prefix(self, nbytes: int) -> torch.Tensor:
        """``tensor[:nbytes]``, cached (a few hundred lengths at most)."""
        if len(self.prefix) >= 256:
            self.prefix.clear()
        view = self.prefix[nbytes] = self.tensor[:nbytes]
        return view


class _Steady:
    """What the last decode step left to reuse when the next one has the same requests.

    Valid while ``PersistentState.changes`` and ``page_allocator.changes`` keep the values
    recorded here (no request's row, slot, page list or page refcount changed), no other kind
    of build ran since (every other path drops it) and every request still writes the page
    index ``q = ctx // page_size`` it wrote then: its page-table row, written page and that
    page's refcount are then those already checked, so the slot mapping is
    ``slot_base + ctx`` with ``slot_base = page * page_size - q * page_size``. A request that
    moved on to its next page index since is handled by :meth:`BatchBuilder._steady_cross`,
    which updates ``q``, ``slot_base`` and the recorded change counters.

    ``q``, ``q_bytes`` and ``slot_base`` are set only where the builder keeps a page table
    (they are read only there).
    """

    requests: tuple[tuple[Hashable, int], ...]  # the step's requests, as given
    ids: tuple[Hashable, ...]
    pad_to: int | None
    B: int  # requests
    P: int  # padded requests
    dense: np.ndarray  # the requests' dense state rows
    state_changes: int  # PersistentState.changes when recorded
    alloc_changes: int  # PersistentState.page_changes when recorded
    q: np.ndarray  # page index each request writes (ctx // page_size)
    q_bytes: bytes  # q.tobytes(), compared with the next step's
    slot_base: np.ndarray  # slot mapping = slot_base + ctx
    row_slot: np.ndarray | None  # the requests' state slots (None: no linear state)
    vkey: tuple[int, int]  # (B, P): key of the ring buffers' cached views
    used: bool  # whether a later step was built from it
    static: object  # token of the ring buffers' per-shape content
    req_views: _ReqViews  # the device views of _make_req_views for P
    positions: torch.Tensor
    slot_mapping: torch.Tensor | None
    tok_stride: int
    tok_end: int

    __slots__ = (
        "B",
        "P",
        "alloc_changes",
        "dense",
        "ids",
        "pad_to",
        "positions",
        "q",
        "q_bytes",
        "req_views",
        "requests",
        "row_slot",
        "slot_base",
        "slot_mapping",
        "state_changes",
        "static",
        "tok_end",
        "tok_stride",
        "used",
        "vkey",
    )


class BatchBuilder:
    """Turns a step's requests into an :class:`AttentionBatch` in persistent buffers.

    :param state: the core's :class:`attn_core.state.PersistentState` (None for encoder-only).
    :param max_batch_size: most requests in a step (graph padding included).
    :param max_num_tokens: most new tokens in a step (graph padding included).
    :param max_pages_per_request: width of the page table (``ceil(max_model_len / page_size)``).
    :param device: where the kernels run.

    All of a step's metadata travels in one packed buffer, laid out the same on the host and
    on the device (byte offsets, every region 16-byte aligned; ``Bm = max_batch_size``)::

        [query_start_loc i32 (Bm+1) | seq_lens i32 (Bm) | context_lens i32 (Bm)
         | state_indices i32 (Bm) | has_initial_state bool (Bm)      <- fixed offsets
         | positions i64 (n) | slot_mapping i64 (n)                 <- offsets depend on n only
         | page-table delta: flat indices i64 (m) | values i32 (m)]  <- this step only

    for a step of ``n`` padded tokens that changes ``m`` page-table entries. One
    ``copy_(non_blocking=True)`` of the used prefix moves the step, and one ``index_copy_``
    applies the delta to the device page table from that same copy. Every device tensor of a
    batch is a view of the persistent device buffer, at an address that depends only on the
    padded batch size and token count: what a captured CUDA graph reads is refreshed in place.

    The host side is a ring of ``2 * _RING_HALF`` staging buffers, so a step never writes into
    a buffer that a previous step's copy may still be reading (the copy is asynchronous: the
    host usually runs ahead of the GPU). On CUDA an event is recorded after the last copy of
    each half of the ring, and the host waits on it before writing into that half again - a
    wait that only blocks when the GPU is more than half a ring of steps behind. The event is
    recorded on the current stream; steps issued on different streams must be ordered by the
    caller (a step's kernels read the KV and state the previous step wrote, so they are).
    Host mirrors (``*_cpu``) of a batch stay valid for the ``2 * _RING_HALF - 1`` next builds
    (15 with ``_RING_HALF = 8``).

    Steady decode - the same requests, in the same order, as the last step, which was a
    decode step too - reuses that step's dense rows and page checks (see :class:`_Steady`):
    a step then costs a handful of numpy calls on ``B`` elements, whatever ``B``.
    """

    def __init__(
        self,
        state: PersistentState | None = None,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        max_pages_per_request: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        # Declared Any, not PersistentState | None: the decode paths run only with a state
        # (build() checks), and narrowing it there would cost a test per call on the hot path.
        self.state: Any = state
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
        # the page size where the builder keeps a page table (_has_kv implies one), else 0
        self._kv_page_size: int = self.page_size if self._has_kv and self.page_size else 0
        self._has_slots = bool(getattr(state, "has_state", False))
        cuda = self.device.type == "cuda"
        self._pin = self._nb = cuda
        B, T = max_batch_size, max_num_tokens

        offsets: list[int] = []
        o = 0
        for nbytes in (4 * (B + 1), 4 * B, 4 * B, 4 * B, B):
            offsets.append(o)
            o += _aligned(nbytes)
        offsets.append(o)
        self._offsets = tuple(offsets)
        self._o_tok = o  # positions, then slot mapping, then the page-table delta
        self._tok_regions = 2 if self._has_kv else 1
        # Page-table entries one copy carries; a step that changes more (a mass rewrite of long
        # rows) sends the rest in further chunks. Bounded so that the device buffer stays small.
        self._delta_cap = min(B * self.max_pages, max(1 << 16, 4 * B)) if self._has_kv else 0
        dev_bytes = self._tok_end(T) + _aligned(12 * self._delta_cap)
        self._dev = torch.zeros(dev_bytes, dtype=torch.uint8, device=self.device)
        o_qsl, o_seq, o_ctx, o_slots, o_init, _ = offsets
        d = self._dev
        self._d_qsl = d[o_qsl : o_qsl + 4 * (B + 1)].view(torch.int32)
        self._d_seq = d[o_seq : o_seq + 4 * B].view(torch.int32)
        self._d_ctx = d[o_ctx : o_ctx + 4 * B].view(torch.int32)
        self._d_slots = d[o_slots : o_slots + 4 * B].view(torch.int32)
        self._d_init = d[o_init : o_init + B].view(torch.bool)
        host_bytes = self._tok_end(T) + _aligned(12 * min(self._delta_cap, 4 * B))
        self._ring = [
            _HostSlot(host_bytes, self._offsets, B, self._pin) for _ in range(2 * _RING_HALF)
        ]
        self._events: list[torch.cuda.Event] | None = (
            [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        )
        # the device whose current stream the copies run on, and Stream objects by raw stream
        self._dev_index = self._dev.device.index if cuda else None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._steady: _Steady | None = None
        self._remember_reserved = True
        self._static_sig: tuple[int, int, bytes | None] | None = None
        self._static_token: object = object()
        # device views by padded batch size; by padded token count: (positions, slot mapping,
        # slot-mapping offset from the positions in int64 elements, delta byte offset)
        self._req_views: dict[int, _ReqViews] = {}
        self._tok_views: dict[int, tuple[torch.Tensor, torch.Tensor | None, int, int]] = {}
        self._dev_prefix: dict[int, torch.Tensor] = {}
        # (tok_end, m) -> device views of a step carrying m page-table entries
        self._delta_views: dict[tuple[int, int], _DeltaViews] = {}
        self._ar64 = np.arange(max(B, T) + 1, dtype=np.int64)
        self._ar32 = self._ar64[: B + 1].astype(np.int32)
        if self._has_kv:
            # Host master copy of the page table, rows = batch positions; the device copy is
            # updated with only the changed entries each step.
            self._pt_host = np.zeros((B, self.max_pages), dtype=np.int32)
            self._pt_flat = self._pt_host.reshape(-1)
            self._pt_dev = torch.zeros((B, self.max_pages), dtype=torch.int32, device=self.device)
            self._pt_dev_flat = self._pt_dev.view(-1)
            self._rowbase = self._ar64[:B] * self.max_pages  # flat index of each row's page 0
            self._ps64 = np.int64(self._kv_page_size)  # page * page_size in int64, never int32
            # What each page-table row holds: the request's dense state row, its page count
            # and page version (bumped by the state when pages are replaced).
            self._row_dense = np.full(B, -1, dtype=np.int64)
            self._row_npages = np.zeros(B, dtype=np.int64)
            self._row_version = np.full(B, -1, dtype=np.int64)
        self._step = 0
        self._paths = [0, 0, 0]  # builds by path: steady decode, decode, general (path_counts)

    # ------------------------------------------------------------------------------------
    def build(
        self,
        requests: Sequence[tuple[Hashable, int]],
        *,
        spec_tokens: int = 0,
        pad_to: int | None = None,
        pad_tokens_to: int | None = None,
    ) -> AttentionBatch:
        """Describe one step.

        :param requests: ``(request id, new tokens)`` per request, in batch order. KV lengths
            come from the persistent state (tokens already written); pages for the new tokens
            are reserved here, all or nothing: a step that raises (a request twice, one over
            ``max_pages_per_request``, :class:`OutOfPagesError`) changed no request.
        :param spec_tokens: ``k`` when this is a speculative-verify step (each request then
            has ``k + 1`` new tokens).
        :param pad_to: pad to this many requests for a captured decode or verify graph (one
            token each, ``k + 1`` in a verify step: its size is then ``pad_to * (k + 1)``
            tokens, at the same device addresses for any number of real requests).
        :param pad_tokens_to: pad to this many tokens for a captured mixed step (graph mode
            ``full``, with ``pad_to``): the batch's device tensors are then at the addresses
            of every other step of ``pad_to`` requests and ``pad_tokens_to`` tokens, whatever
            the split between prefill chunks and decodes; the padding rows take one token
            each, the last of them the rest (``query_start_loc[-1] == pad_tokens_to`` when
            there is a padding row), and the batch is a MIXED step with ``full_graph`` set.
        """
        if pad_tokens_to is not None:
            if pad_to is None:
                raise ValueError(
                    f"pad_tokens_to={pad_tokens_to} needs pad_to (a captured mixed step has a "
                    "fixed number of requests too)"
                )
            if spec_tokens:
                raise ValueError(
                    "pad_tokens_to is for captured mixed steps; a verify step is captured as "
                    "a uniform one (pad_to only)"
                )
        steady = self._steady
        reqs = None
        if steady is not None and pad_to == steady.pad_to and not spec_tokens and not pad_tokens_to:
            # Tuple equality compares identical objects by identity: a server that passes the
            # same ids pays one pointer compare per request.
            reqs = requests if type(requests) is tuple else tuple(requests)
            state = self.state
            if (
                reqs == steady.requests
                and state.changes == steady.state_changes
                and state.page_changes == steady.alloc_changes
            ):
                batch = self._build_steady(steady)
                if batch is not None:
                    steady.used = True
                    self._paths[0] += 1
                    return batch
        if steady is not None:  # was remembering worth it? (not when pages cross every step)
            self._remember_reserved = steady.used
        self._steady = None  # any other build may rewrite page-table rows or ring buffers
        B = len(requests)
        P = B if pad_to is None else pad_to
        if P < B:
            raise ValueError(f"pad_to={pad_to}: smaller than the batch ({B} requests)")
        if self.max_batch_size < P:
            raise ValueError(
                f"batch of {P} requests exceeds max_batch_size={self.max_batch_size} "
                "(set ExecutionConstraints.max_batch_size)"
            )
        if not B:
            self._paths[2] += 1
            return self._build_general((), (), 0, P, spec_tokens, pad_tokens_to)
        ids, qlens = zip(*requests, strict=True)
        if (
            not spec_tokens
            and pad_tokens_to is None
            and self.state is not None
            and qlens.count(1) == B
        ):
            if reqs is None:
                reqs = requests if type(requests) is tuple else tuple(requests)
            self._paths[1] += 1
            return self._build_decode(ids, B, P, reqs, pad_to)
        self._paths[2] += 1
        return self._build_general(ids, qlens, B, P, spec_tokens, pad_tokens_to)

    @property
    def path_counts(self) -> dict[str, int]:
        """Steps built so far by path (for benchmarks and diagnostics): ``steady`` (a decode
        step of the last step's requests, from its memo), ``decode`` (other all-decode steps)
        and ``general`` (prefill, mixed, verify, empty). Encoder batches are not counted."""
        steady, decode, general = self._paths
        return {"steady": steady, "decode": decode, "general": general}

    def _build_steady(self, steady: _Steady) -> AttentionBatch | None:
        """A decode step with the requests of the last one, whose rows, pages and refcounts
        did not change since (checked by :meth:`build`): only the context lengths are read.
        Returns None, having changed nothing the next path relies on, when a request now
        writes another page index than it did then."""
        k, slot = self._acquire(keep_static=True)
        if slot.static is steady.static:
            views = slot.views.get(steady.vkey) or self._slot_views(slot, steady)
        else:
            views = self._stage_static(slot, steady)
        pos = views[0]
        # positions = context lengths, gathered straight into the staging buffer ("clip": the
        # rows are valid, and "raise" would buffer the output)
        self.state.rows.num_tokens.take(steady.dense, out=pos, mode="clip")
        m = 0
        if self._has_kv:
            q = pos // self.page_size
            if q.tobytes() != steady.q_bytes:  # some request moved on to its next page
                written = self._steady_cross(steady, q)
                if written is None:
                    return None  # the full path consults the page table (nothing changed)
                m = len(written)
                if m:
                    # at most B entries: ring buffers hold 4 * max_batch_size, never replaced here
                    grown = self._stage_deltas(k, steady.tok_end, written)
                    assert grown is slot, "a steady step's page-table delta outgrew its buffer"
        _, ctx_b, seq_b, sm, init, qsl, seq_cpu, ctx_cpu = views
        if sm is not None:
            np.add(steady.slot_base, pos, out=sm)
        ctx_b[:] = pos
        np.add(pos, 1, out=seq_b)
        if init is not None:
            np.greater(pos, 0, out=init)
        max_seq_len = int(_max(pos)) + 1
        self._upload(k, slot, steady.tok_end, m)
        v = steady.req_views
        B, P = steady.B, steady.P
        return AttentionBatch(  # as _assemble does, without the keyword hop
            mode=BatchMode.DECODE,
            num_reqs=B,
            padded_reqs=P,
            num_tokens=B,
            padded_tokens=P,
            max_query_len=1,
            max_seq_len=max_seq_len,
            spec_tokens=0,
            request_ids=steady.ids,
            query_start_loc=v[0],
            seq_lens=v[1],
            context_lens=v[2],
            page_table=v[5],
            slot_mapping=steady.slot_mapping,
            positions=steady.positions,
            state_indices=v[3],
            has_initial_state=v[4],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_cpu,
            context_lens_cpu=ctx_cpu,
            page_size=self.page_size,
            step=self._step,
            state_epoch=self.state.epoch,
        )

    def _steady_cross(self, steady: _Steady, q: np.ndarray) -> np.ndarray | None:
        """A steady step where some requests write page index ``q = steady.q + 1`` (their
        new token starts the next page): those holding that page already (reserved ahead)
        write it if it is not shared; the others, whose pages are full, get one each in a
        single :meth:`PersistentState.append_pages`, written into the host page table.

        Every row was in sync when ``steady`` was recorded and no request's pages or page
        refcounts changed since (checked by :meth:`build`), so only the moved rows are read.

        :returns: the flat page-table indices written on the host (empty when none), which
            the step's device copy carries, with ``steady`` updated to this step; or None,
            having changed nothing, when the full path must decide (a request moved by more
            than one page, a shared page, the page table's width, no free page).
        """
        old = steady.q
        rows = (q != old).nonzero()[0]
        qr = q[rows]
        if np.count_nonzero(qr - old[rows] != 1):
            return None
        # Every row held its written page when remembered (old < pages held), so a row that
        # moved one page on either holds page qr (reserved ahead) or is full (qr == pages).
        nr = self._row_npages[rows]
        full = qr == nr
        if np.count_nonzero(full) == len(rows):  # the usual case: every moved row is full
            grow, held, ng = rows, None, nr
        else:
            grow, held, ng = rows[full], rows[~full], nr[full]
            page = self._pt_flat[self._rowbase[held] + q[held]]
            if np.count_nonzero(self.state.page_refcounts[page] > 1):
                return None  # a shared page: copy-on-write on the full path
        written = _NO_INDICES
        if len(grow):
            if _max(ng) >= self.max_pages:
                return None  # the full path names the request and max_pages_per_request
            appended = self._append_pages(steady.ids, grow, ng)
            if appended is None:
                return None
            written = appended[1]
            steady.state_changes = self.state.changes
            steady.alloc_changes = self.state.page_changes
        # held rows' pages were just read, grown rows' were just written: read both back
        page = self._pt_flat[written if held is None else self._rowbase[rows] + qr]
        steady.slot_base[rows] = (page - qr) * self._ps64
        steady.q = q
        steady.q_bytes = q.tobytes()
        return written

    def _stage_static(self, slot: _HostSlot, steady: _Steady) -> tuple[Any, ...]:
        """Write what a steady step of ``steady``'s shape keeps from step to step into a ring
        buffer: ``query_start_loc = 0..P``, the state slots and the padding rows and tokens
        (exactly what :meth:`_build_decode` writes besides the per-step values)."""
        B, P = steady.B, steady.P
        slot.qsl[: P + 1] = self._ar32[: P + 1]
        row_slot = steady.row_slot
        if row_slot is not None:  # set exactly where there is linear state
            slot.slots[:B] = row_slot
        if P > B:
            self._pad(slot, B, P, B, P)
        slot.static = steady.static
        return slot.views.get(steady.vkey) or self._slot_views(slot, steady)

    def _slot_views(self, slot: _HostSlot, steady: _Steady) -> tuple[Any, ...]:
        """Numpy views of one ring buffer for a steady step of ``B`` requests padded to ``P``:
        (positions[:B] i64, context_lens[:B] i32, seq_lens[:B] i32, slot_mapping[:B] i64 or
        None, has_initial_state[:B] bool or None, query_start_loc[:P+1], seq_lens[:P],
        context_lens[:P])."""
        B, P, s = steady.B, steady.P, steady.tok_stride
        views = (
            slot.i64[:B],
            slot.ctx[:B],
            slot.seq[:B],
            slot.i64[s : s + B] if self._has_kv else None,
            slot.init[:B] if self._has_slots else None,
            slot.qsl[: P + 1],
            slot.seq[:P],
            slot.ctx[:P],
        )
        if len(slot.views) >= 64:  # many shapes seen: keep the cache small
            slot.views.clear()
        slot.views[steady.vkey] = views
        return views

    def _build_decode(
        self,
        ids: tuple[Hashable, ...],
        B: int,
        P: int,
        requests: tuple[tuple[Hashable, int], ...] = (),
        pad_to: int | None = None,
    ) -> AttentionBatch:
        """Every request has one new token: positions = context lengths, query_start_loc is
        ``0..P``, the slot mapping one gather from the host page table. Leaves a
        :class:`_Steady` for the next step when every row is in sync afterwards."""
        if self.max_num_tokens < P:
            raise ValueError(f"step of {P} tokens exceeds max_num_tokens={self.max_num_tokens}")
        state = self.state
        dense = state.step_rows(ids)
        ctx = state.rows.num_tokens[dense]
        k, slot = self._acquire()
        m = 0
        q = page = None
        in_sync = True
        if self._has_kv:
            q = ctx // self.page_size
            fast = self._pages_in_sync(ids, dense, q, B, P)
            if fast is not None:
                page, written = fast
                if written is not None:  # pages appended for requests crossing a page
                    m = len(written)
                    slot = self._stage_deltas(k, self._tok_end(P), written)
                    # remembered only while remembered steps get used (not when some request
                    # crosses a page every step)
                    in_sync = self._remember_reserved
            else:  # a row needs a rewrite, a copy-on-write or more than one page: full path
                written = self._reserve(ids, dense, ctx, ctx + 1)
                fidx = self._sync_page_table(ids, dense, P, written)
                if fidx is not None:
                    m = len(fidx)
                    slot = self._stage_deltas(k, self._tok_end(P), fidx)
                page = self._pt_flat[self._rowbase[:B] + q]
                # Rows, padding rows and capacity are in sync now (_reserve and
                # _sync_page_table just made them so): only a shared written page is left to
                # rule out before remembering the step.
                # Skipped while remembered steps go unused (requests crossing pages at
                # different steps): the next step, if in sync, is remembered anyway.
                in_sync = self._remember_reserved and not np.count_nonzero(
                    state.page_refcounts[page] > 1
                )
        slot.qsl[: P + 1] = self._ar32[: P + 1]
        seq_cpu = slot.seq[:P]
        ctx_cpu = slot.ctx[:P]
        seq_cpu[:B] = ctx + 1
        ctx_cpu[:B] = ctx
        pos = slot.i64[:P]
        pos[:B] = ctx
        row_slot = None
        if self._has_slots:
            row_slot = state.rows.slot[dense]
            slot.slots[:B] = row_slot
            slot.init[:B] = ctx > 0
        positions, slot_mapping, s, tok_end = self._tok_views.get(P) or self._make_tok_views(P)
        if q is not None and page is not None:  # both set exactly where there is KV
            slot.i64[s : s + B] = page * self._ps64 + (ctx - q * self._kv_page_size)
        if P > B:
            self._pad(slot, B, P, B, P)
        views = self._req_views.get(P) or self._make_req_views(P)
        if in_sync:
            steady = self._remember(requests, ids, pad_to, dense, q, page, row_slot, B, P)
            if steady is not None:
                steady.req_views = views
                steady.positions, steady.slot_mapping = positions, slot_mapping
                steady.tok_stride, steady.tok_end = s, tok_end
                slot.static = steady.static  # this buffer holds what _stage_static writes
        self._upload(k, slot, tok_end, m)
        return self._assemble(
            views,
            positions,
            slot_mapping,
            mode=BatchMode.DECODE,
            num_reqs=B,
            padded_reqs=P,
            num_tokens=B,
            padded_tokens=P,
            max_query_len=1,
            max_seq_len=int(ctx.max()) + 1,
            spec_tokens=0,
            request_ids=ids,
            query_start_loc_cpu=slot.qsl[: P + 1],
            seq_lens_cpu=seq_cpu,
            context_lens_cpu=ctx_cpu,
            state_epoch=state.epoch,
        )

    def _remember(
        self,
        requests: tuple[tuple[Hashable, int], ...],
        ids: tuple[Hashable, ...],
        pad_to: int | None,
        dense: np.ndarray,
        q: np.ndarray | None,
        page: np.ndarray | None,
        row_slot: np.ndarray | None,
        B: int,
        P: int,
    ) -> _Steady | None:
        """Record a decode step whose rows are all in sync, for :meth:`_build_steady`."""
        state = self.state
        changes = getattr(state, "changes", None)
        if changes is None or len(requests) != B:
            return None
        # Only immutable (id, n) tuples: a list mutated in place would compare equal to itself.
        if not all(map(isinstance, requests, repeat(tuple))):
            return None
        st = self._steady = _Steady()
        st.requests, st.ids, st.pad_to, st.B, st.P = requests, ids, pad_to, B, P
        st.dense = dense
        st.state_changes = changes
        st.alloc_changes = state.page_changes
        if q is not None and page is not None:  # both or neither: set where there is KV
            st.q = q
            st.q_bytes = q.tobytes()
            st.slot_base = page * self._ps64 - q * self._kv_page_size
        st.row_slot = row_slot
        st.vkey = (B, P)
        st.used = False
        # The ring buffers' static content depends on (B, P, slots) only: a new step of the
        # same shape and slots (after a page crossing) keeps the buffers already staged.
        sig = (B, P, None if row_slot is None else row_slot.tobytes())
        if self._static_sig != sig:
            self._static_sig, self._static_token = sig, object()
        st.static = self._static_token
        return st

    def _build_general(
        self,
        ids: tuple[Hashable, ...],
        qlens_in: tuple[int, ...],
        B: int,
        P: int,
        spec_tokens: int,
        pad_tokens_to: int | None = None,
    ) -> AttentionBatch:
        state = self.state
        qlens = np.fromiter(qlens_in, dtype=np.int64, count=B)
        if B and qlens.min() < 0:
            raise ValueError(f"new-token counts must be >= 0, got {qlens.tolist()}")
        if state is not None:
            dense = state.step_rows(ids)
            ctx = state.rows.num_tokens[dense]
        else:
            dense = None
            ctx = np.zeros(B, dtype=np.int64)
        seq = ctx + qlens
        num_tokens = int(qlens.sum())
        # a verify step is captured as a uniform one: every padding request has k + 1 tokens
        # too, so the step's size (and its device addresses) do not depend on B
        per_pad = spec_tokens + 1
        padded_tokens = num_tokens + (P - B) * per_pad
        if padded_tokens > self.max_num_tokens:
            raise ValueError(
                f"step of {padded_tokens} tokens exceeds max_num_tokens={self.max_num_tokens}"
            )
        if pad_tokens_to is not None:
            if pad_tokens_to < padded_tokens or pad_tokens_to > self.max_num_tokens:
                raise ValueError(
                    f"pad_tokens_to={pad_tokens_to}: expected {padded_tokens} (the step's "
                    f"{num_tokens} tokens + {P - B} padding rows) .. max_num_tokens="
                    f"{self.max_num_tokens}"
                )
            padded_tokens = pad_tokens_to
        if spec_tokens and B and (qlens != spec_tokens + 1).any():
            raise ValueError(
                f"speculative verify with k={spec_tokens} needs {spec_tokens + 1} new tokens "
                f"per request, got {qlens.tolist()}"
            )
        written = None
        if state is not None and self._has_kv:
            written = self._reserve(ids, dense, ctx, seq)
        # a captured mixed step stays one whatever its split: the graph was captured as one
        mode = BatchMode.MIXED if pad_tokens_to is not None else self._mode(qlens, spec_tokens)

        k, slot = self._acquire()
        m = 0
        if self._has_kv:
            fidx = self._sync_page_table(ids, dense, P, written)
            if fidx is not None:
                m = len(fidx)
                slot = self._stage_deltas(k, self._tok_end(padded_tokens), fidx)
        qsl = slot.qsl[: P + 1]
        qsl[0] = 0
        np.cumsum(qlens, out=qsl[1 : B + 1])
        seq_cpu = slot.seq[:P]
        ctx_cpu = slot.ctx[:P]
        seq_cpu[:B] = seq
        ctx_cpu[:B] = ctx
        if self._has_slots:
            slot.slots[:B] = state.rows.slot[dense]
            slot.init[:B] = ctx > 0
        # int64 per-token block: positions then slot mapping
        pos = slot.i64[:padded_tokens]
        req_of_token = np.repeat(self._ar64[:B], qlens)
        tok = pos[:num_tokens]
        tok[:] = ctx[req_of_token] + (self._ar64[:num_tokens] - qsl[req_of_token])
        if self._has_kv:
            ps = self._kv_page_size
            s = self._tok_stride(padded_tokens)
            page = self._pt_flat[self._rowbase[req_of_token] + tok // ps]
            slot.i64[s : s + num_tokens] = page * self._ps64 + tok % ps
        self._pad(slot, B, P, num_tokens, padded_tokens, per_pad)
        views = self._req_views.get(P) or self._make_req_views(P)
        positions, slot_mapping, s, tok_end = self._tok_views.get(
            padded_tokens
        ) or self._make_tok_views(padded_tokens)
        self._upload(k, slot, tok_end, m)
        return self._assemble(
            views,
            positions,
            slot_mapping,
            mode=mode,
            num_reqs=B,
            padded_reqs=P,
            num_tokens=num_tokens,
            padded_tokens=padded_tokens,
            max_query_len=int(qlens.max()) if B else 0,
            max_seq_len=int(seq.max()) if B else 0,
            spec_tokens=spec_tokens,
            request_ids=ids,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_cpu,
            context_lens_cpu=ctx_cpu,
            state_epoch=state.epoch if state is not None else -1,
            slot_mapping_cpu=slot.i64[s : s + padded_tokens] if self._has_kv else None,
            full_graph=pad_tokens_to is not None,
        )

    def _assemble(
        self,
        views: _ReqViews,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        **fields: Any,
    ) -> AttentionBatch:
        """An AttentionBatch over the persistent device views of one padded size ``P``:
        ``views`` = (query_start_loc, seq_lens, context_lens, state_indices, has_initial_state,
        page_table), as :meth:`_make_req_views` lays them out."""
        return AttentionBatch(
            query_start_loc=views[0],
            seq_lens=views[1],
            context_lens=views[2],
            state_indices=views[3],
            has_initial_state=views[4],
            page_table=views[5],
            slot_mapping=slot_mapping,
            positions=positions,
            page_size=self.page_size,
            step=self._step,
            **fields,
        )

    def build_encoder(self, seq_lens: Sequence[int]) -> AttentionBatch:
        """A batch of independent encoder sequences (bidirectional, no persistent state)."""
        for i, n in enumerate(seq_lens):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(
                    f"seq_lens[{i}]={n!r}: expected a non-negative int (the tokens of encoder "
                    f"sequence {i})"
                )
        B = len(seq_lens)
        if self.max_batch_size < B:
            raise ValueError(f"{B} sequences exceed max_batch_size={self.max_batch_size}")
        lens = np.asarray(seq_lens, dtype=np.int64)
        T = int(lens.sum())
        if self.max_num_tokens < T:
            raise ValueError(f"{T} tokens exceed max_num_tokens={self.max_num_tokens}")
        k, slot = self._acquire()
        qsl = slot.qsl[: B + 1]
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:])
        seq_cpu = slot.seq[:B]
        seq_cpu[:] = lens
        ctx_cpu = slot.ctx[:B]
        ctx_cpu[:] = 0
        req = np.repeat(self._ar64[:B], lens)
        slot.i64[:T] = self._ar64[:T] - qsl[req]
        views = self._req_views.get(B) or self._make_req_views(B)
        positions = (self._tok_views.get(T) or self._make_tok_views(T))[0]
        self._upload(k, slot, self._o_tok + _aligned(8 * T), 0)
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
            query_start_loc=views[0],
            seq_lens=views[1],
            context_lens=views[2],
            page_table=None,
            slot_mapping=None,
            positions=positions,
            state_indices=None,
            has_initial_state=None,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_cpu,
            context_lens_cpu=ctx_cpu,
            page_size=None,
            step=self._step,
        )

    # -- the packed buffer -----------------------------------------------------------------
    def _tok_stride(self, n: int) -> int:
        """Offset (int64 elements) of the slot mapping from the positions, for ``n`` tokens."""
        return _aligned(8 * n) // 8

    def _tok_end(self, n: int) -> int:
        """Byte offset where the page-table delta starts in a step of ``n`` padded tokens."""
        return self._o_tok + self._tok_regions * _aligned(8 * n)

    def _make_req_views(self, P: int) -> _ReqViews:
        slots = self._has_slots
        views: _ReqViews = (
            self._d_qsl[: P + 1],
            self._d_seq[:P],
            self._d_ctx[:P],
            self._d_slots[:P] if slots else None,
            self._d_init[:P] if slots else None,
            self._pt_dev[:P] if self._has_kv else None,
        )
        self._req_views[P] = views
        return views

    def _make_tok_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        o = self._o_tok
        positions = self._dev[o : o + 8 * n].view(torch.int64)
        slot_mapping = None
        if self._has_kv:
            o += _aligned(8 * n)
            slot_mapping = self._dev[o : o + 8 * n].view(torch.int64)
        views = (positions, slot_mapping, self._tok_stride(n), self._tok_end(n))
        self._tok_views[n] = views
        return views

    def _pad(
        self, slot: _HostSlot, B: int, P: int, n: int, padded_tokens: int, per_row: int = 1
    ) -> None:
        """Padding rows: ``per_row`` tokens each (``k + 1`` in a verify step, else one; the last
        row every padding token beyond that, in a step padded to a captured mixed graph's
        token count), ``seq_len = per_row``, no state, nothing written."""
        if P > B:
            slot.qsl[B + 1 : P + 1] = n + per_row * self._ar64[1 : P - B + 1]
            slot.qsl[P] = padded_tokens
            slot.seq[B:P] = per_row
            slot.ctx[B:P] = 0
            if self._has_slots:
                slot.slots[B:P] = -1
                slot.init[B:P] = False
        if padded_tokens > n:
            slot.i64[n:padded_tokens] = 0
            if self._has_kv:
                s = self._tok_stride(padded_tokens)
                slot.i64[s + n : s + padded_tokens] = -1

    def _acquire(self, keep_static: bool = False) -> tuple[int, _HostSlot]:
        """The ring's next host buffer, once no copy can be reading it any more. Unless
        ``keep_static``, the caller rewrites it: it no longer holds a steady step's content."""
        k = self._step % len(self._ring)
        if self._events is not None and k % _RING_HALF == 0:
            # The copies of this half's previous turn were issued before the event that was
            # recorded after the last of them; in steady state it completed long ago.
            self._events[k // _RING_HALF].synchronize()
        slot = self._ring[k]
        if not keep_static:
            slot.static = None
        return k, slot

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream of the builder's device (the one its copies run on), as a
        cached Stream object looked up by the raw stream pointer (a C call)."""
        if _raw_stream is None:
            return torch.cuda.current_stream(self._dev_index)
        raw = _raw_stream(self._dev_index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self._dev_index)
        return stream

    def _upload(self, k: int, slot: _HostSlot, tok_end: int, m: int) -> None:
        """Copy the step's used prefix to the device (one copy), apply the page-table delta
        (one kernel per chunk), and close the ring buffer's turn."""
        nb = self._nb
        if not m:
            src = slot.prefix.get(tok_end)
            if src is None:
                src = slot.host_prefix(tok_end)
            dst = self._dev_prefix.get(tok_end)
            if dst is None:
                dst = self._dev_prefix[tok_end] = self._dev[:tok_end]
            dst.copy_(src, non_blocking=nb)
        elif m <= self._delta_cap:  # one chunk: the views for (tok_end, m) are cached
            key = (tok_end, m)
            views = self._delta_views.get(key)
            if views is None:
                views = self._delta_views[key] = self._make_delta_views(tok_end, m)
            dst, idx, val, end = views
            src = slot.prefix.get(end)
            if src is None:
                src = slot.host_prefix(end)
            dst.copy_(src, non_blocking=nb)
            self._pt_dev_flat.index_copy_(0, idx, val)
        else:
            cap = self._delta_cap
            stride = _aligned(12 * cap)
            end = tok_end + _aligned(12 * min(m, cap))
            self._dev[:end].copy_(slot.tensor[:end], non_blocking=nb)
            dev, flat, d0 = self._dev, self._pt_dev_flat, tok_end
            for j, start in enumerate(range(0, m, cap)):
                mj = min(cap, m - start)
                if j:  # a later chunk: into the same device region, after the last kernel
                    h = tok_end + j * stride
                    dev[d0 : d0 + 12 * mj].copy_(slot.tensor[h : h + 12 * mj], non_blocking=nb)
                idx = dev[d0 : d0 + 8 * mj].view(torch.int64)
                val = dev[d0 + 8 * mj : d0 + 12 * mj].view(torch.int32)
                flat.index_copy_(0, idx, val)
        if self._events is not None and k % _RING_HALF == _RING_HALF - 1:
            self._events[k // _RING_HALF].record(self._current_stream())
        self._step += 1

    def _make_delta_views(self, tok_end: int, m: int) -> _DeltaViews:
        """Device views for a step with ``m <= _delta_cap`` page-table entries staged after
        the per-token block ending at ``tok_end``: the copy's destination, the flat indices
        (int64), the values (int32) and the copy's length in bytes."""
        if len(self._delta_views) >= 256:  # many shapes seen: keep the cache small
            self._delta_views.clear()
        dev = self._dev
        end = tok_end + _aligned(12 * m)
        idx = dev[tok_end : tok_end + 8 * m].view(torch.int64)
        val = dev[tok_end + 8 * m : tok_end + 12 * m].view(torch.int32)
        return dev[:end], idx, val, end

    def _stage_deltas(self, k: int, tok_end: int, fidx: np.ndarray) -> _HostSlot:
        """Write the page-table delta (flat indices and values, in chunks of ``_delta_cap``)
        after the per-token block of ring buffer ``k``, growing the buffer when needed."""
        m = len(fidx)
        cap = self._delta_cap
        stride = _aligned(12 * cap)
        need = tok_end + (-(-m // cap) - 1) * stride + _aligned(12 * min(m, cap))
        slot = self._ring[k]
        if need > slot.raw.nbytes:
            # A new buffer; the old one goes back to torch's pinned-memory cache, which does
            # not hand it out again before the copies that read it have completed.
            slot = _HostSlot(
                max(need, 2 * slot.raw.nbytes), self._offsets, self.max_batch_size, self._pin
            )
            self._ring[k] = slot
        vals = self._pt_flat[fidx]
        raw = slot.raw
        for j, start in enumerate(range(0, m, cap)):
            mj = min(cap, m - start)
            h = tok_end + j * stride
            raw[h : h + 8 * mj].view(np.int64)[:] = fidx[start : start + mj]
            raw[h + 8 * mj : h + 12 * mj].view(np.int32)[:] = vals[start : start + mj]
        return slot

    # ------------------------------------------------------------------------------------
    @staticmethod
    def _mode(qlens: np.ndarray, spec_tokens: int) -> BatchMode:
        return BatchBuilder.step_mode(qlens, spec_tokens)

    @staticmethod
    def step_mode(qlens: np.ndarray, spec_tokens: int = 0) -> BatchMode:
        """The mode of a step of ``qlens`` new tokens per request (``[B]`` int): verify when it
        verifies draft tokens, decode when every request has one token (or none is there),
        prefill when every one has several, else mixed."""
        if spec_tokens:
            return BatchMode.VERIFY
        if len(qlens) == 0 or (qlens == 1).all():
            return BatchMode.DECODE
        if (qlens > 1).all():
            return BatchMode.PREFILL
        return BatchMode.MIXED

    def _pages_in_sync(
        self, ids: tuple[Hashable, ...], dense: np.ndarray, q: np.ndarray, B: int, P: int
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Decode fast path: the page each request writes and the flat page-table indices
        written here (or None), or None when some request needs :meth:`_reserve` /
        :meth:`_sync_page_table`.

        The fast path holds when every row holds its request's pages as last synced (same
        dense row, page version and page count), the padding rows are clean, and no written
        page is shared. A request whose new token starts a page (``q == pages held``: it
        crosses a page boundary, about ``B / page_size`` requests per step) gets its page
        here, all of them in one :meth:`PersistentState.append_pages`.
        """
        state = self.state
        npages = state.rows.num_pages[dense]
        if (
            self._row_dense[:B].tobytes() != dense.tobytes()
            or self._row_version[:B].tobytes() != state.rows.page_version[dense].tobytes()
            or self._row_npages[:B].tobytes() != npages.tobytes()
            or (P > B and np.count_nonzero(self._row_dense[B:P] != -1))
        ):
            return None
        cross = q >= npages
        written = None
        if not np.count_nonzero(cross):
            page = self._pt_flat[self._rowbase[:B] + q]
            if np.count_nonzero(state.page_refcounts[page] > 1):
                return None
            return page, None
        rows = np.flatnonzero(cross)
        if np.count_nonzero(q[rows] != npages[rows]) or npages[rows].max() >= self.max_pages:
            return None
        # The other rows write into pages they hold: none of those may be shared.
        held = self._pt_flat[self._rowbase[:B] + np.where(cross, 0, q)]
        if np.count_nonzero((state.page_refcounts[held] > 1) & ~cross):
            return None
        appended = self._append_pages(ids, rows, npages[rows])
        if appended is None:
            return None  # the full path reserves request by request and names the one left out
        new, written = appended
        held[rows] = new
        return held, written

    def _append_pages(
        self, ids: tuple[Hashable, ...], rows: np.ndarray, npages: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """One new page for each request of batch rows ``rows`` (whose ``npages`` pages are
        full), in one :meth:`PersistentState.append_pages`, written into the host page table.

        :returns: the new pages and their flat page-table indices (which the step's device copy
            must carry), or None when not all fit (nothing changed).
        """
        try:
            new = self.state.append_pages([ids[b] for b in rows.tolist()])
        except OutOfPagesError:
            return None
        flat = self._rowbase[rows] + npages
        self._pt_flat[flat] = new
        self._row_npages[rows] = npages + 1
        return new, flat

    def _reserve(
        self, ids: tuple[Hashable, ...], dense: np.ndarray, ctx: np.ndarray, seq: np.ndarray
    ) -> np.ndarray | None:
        """Reserve pages for the step, all or nothing, in one
        :meth:`PersistentState.reserve_step`; only requests that need work cost a Python call.

        Returns the flat page-table indices this wrote on the host (pages appended in bulk),
        which the step's device copy must carry; :meth:`_sync_page_table` takes them.

        A request needs work when its new tokens go past its pages, when its page-table row is
        not in sync, or when the page it writes first is shared (copy-on-write) - everything
        else is decided with numpy.
        """
        state = self.state
        B = len(ids)
        ps = self._kv_page_size
        npages = state.rows.num_pages[dense]
        # The page table's width is checked before anything is reserved (all or nothing).
        over = np.maximum(npages, -(-seq // ps)) > self.max_pages
        if np.count_nonzero(over):
            b = int(np.argmax(over))
            raise ValueError(
                f"request {ids[b]!r} needs {max(int(npages[b]), -(-int(seq[b]) // ps))} pages "
                f"for {int(seq[b])} tokens (page_size {ps}), more than "
                f"max_pages_per_request={self.max_pages} (raise max_model_len)"
            )
        in_sync = (self._row_dense[:B] == dense) & (
            self._row_version[:B] == state.rows.page_version[dense]
        )
        first_page = ctx // ps
        has_page = in_sync & (first_page < np.minimum(npages, self._row_npages[:B]))
        write_page = self._pt_host[self._ar64[:B], np.where(has_page, first_page, 0)]
        shared = has_page & (state.page_refcounts[write_page] > 1)
        slow = (seq > npages * ps) | ~in_sync | shared
        if not slow.any():
            return None
        # Rows whose pages are all full and whose new tokens fit in one more page (a decode
        # step crossing a page): one bulk allocation for all of them, and their page-table
        # entry written here, instead of one ensure_capacity + one row sync per request.
        simple = (
            slow
            & in_sync
            & (self._row_npages[:B] == npages)
            & (ctx == npages * ps)
            & (seq > ctx)
            & (seq - ctx <= ps)
        )
        rows = np.flatnonzero(simple)
        if len(rows) >= 2:  # one bulk append pays off from two rows on
            slow &= ~simple
        else:
            rows = rows[:0]
        grow = [(ids[b], int(seq[b])) for b in np.flatnonzero(slow).tolist()]
        # One call for the whole step: it reserves everything or raises having changed nothing.
        new = state.reserve_step([ids[b] for b in rows.tolist()], grow)
        if not len(rows):
            return None
        flat = self._rowbase[rows] + npages[rows]
        self._pt_flat[flat] = new
        self._row_npages[rows] = npages[rows] + 1
        return flat

    def _sync_page_table(
        self,
        ids: tuple[Hashable, ...],
        dense: np.ndarray,
        padded: int,
        written: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Bring rows ``0..padded-1`` of the host page table up to date.

        :returns: the flat indices (int64, ``row * max_pages + col``) of the entries that
            changed, for the device copy, or None when none did.
        """
        state = self.state
        B = len(ids)
        host = self._pt_host
        npages = state.rows.num_pages[dense]
        if B and npages.max() > self.max_pages:
            b = int(np.argmax(npages))
            raise ValueError(
                f"request {ids[b]!r} holds {int(npages[b])} pages, more than "
                f"max_pages_per_request={self.max_pages} (raise max_model_len)"
            )
        version = state.rows.page_version[dense]
        rewrite = (self._row_dense[:B] != dense) | (self._row_version[:B] != version)
        grown = ~rewrite & (self._row_npages[:B] != npages)
        changed = [] if written is None else [written]
        for b in np.flatnonzero(rewrite | grown).tolist():
            pages = state.pages(ids[b])
            n = len(pages)
            start = 0 if rewrite[b] else int(self._row_npages[b])
            if start > n:  # pages were given back: rewrite the row
                start = 0
            host[b, start:n] = pages[start:n]
            base = b * self.max_pages
            changed.append(np.arange(base + start, base + n, dtype=np.int64))
        self._row_dense[:B] = dense
        self._row_version[:B] = version
        self._row_npages[:B] = npages
        pad = np.flatnonzero(self._row_dense[B:padded] != -1) + B
        if len(pad):  # padding rows read page 0 and write nothing
            self._row_dense[pad] = -1
            self._row_version[pad] = -1
            self._row_npages[pad] = 0
            host[pad, 0] = 0
            changed.append(pad * self.max_pages)
        if not changed:
            return None
        return np.concatenate(changed)

    def invalidate(self, request_id: Hashable | None = None) -> None:
        """Forget what the page-table rows hold, so the next step rewrites every row.

        Not needed for correctness - the state's page versions tell the builder when a
        request's pages were replaced - but cheap, and kept for callers that reset a run.
        ``request_id`` is accepted for compatibility; every row is forgotten.
        """
        self._steady = None
        if self._has_kv:
            self._row_dense[:] = -1
            self._row_version[:] = -1
            self._row_npages[:] = 0
