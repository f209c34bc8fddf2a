"""Per-group FlashInfer contexts: one plan per step, shared by every layer of the group.

Life cycle (see :mod:`attn_core.context`)::

    ctx = FullAttentionContext(...)   # wrappers over the core-allocated workspace
    ctx.prepare(batch)                # host metadata (numpy), kv_indices gathered on device,
                                      # one FlashInfer plan() for the step
    ctx.forward(layer, q, k, v, out)  # write K/V by slot, then wrapper.run() (per layer)
    ctx.update(batch)                 # before a CUDA-graph replay: the same, into the buffers
                                      # the captured kernels read

Which FlashInfer wrapper runs a step:

============================ ==============================================================
step                         wrapper
============================ ==============================================================
decode of at most            the plugin's own fused write + split-KV Triton kernels
``SMALL_DECODE_MAX_BATCH``   (:mod:`attn_plugin_flashinfer.small_decode`), plain attention
padded requests within       with a 16-bit cache only; FlashInfer is latency-bound there.
``SMALL_DECODE_MAX_KV_``     Captured: B x ``max_model_len`` counts; eager: the requests'
``TOKENS`` positions         own lengths
decode, graph mode DECODE    ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)``, one
                             per padded batch size, buffers = views of the workspace
decode                       ``BatchDecodeWithPagedKVCacheWrapper``
captured mixed step (graph   ``BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True)``,
mode FULL, a ``full_graph``  one per padded batch size, planned into fixed buffers (views of
batch)                       the workspace) at the captured token count, whatever the split
prefill without context,     ``BatchPrefillWithRaggedKVCacheWrapper`` over the step's own k/v
non-fp8 KV                   (they are also written to the cache)
prefill / mixed / verify     ``BatchPrefillWithPagedKVCacheWrapper`` (causal, bottom-right
                             aligned: the queries are each request's last tokens)
MLA, any step                ``BatchMLAPagedAttentionWrapper`` (graph variant for graph decode)
============================ ==============================================================

Attention sinks (gpt-oss) take the same wrappers as any other layer: ``run()`` also returns
the log-sum-exp of each row, and one elementwise pass (:mod:`attn_plugin_flashinfer.sinks`)
rescales the output by ``sigmoid(lse - sink)``: every step kind, graph modes, soft-cap and an
fp8 cache included (small_decode's kernels take no sinks: such layers keep FlashInfer's decode).

FP8 KV: FlashInfer's ``k_scale``/``v_scale`` run arguments are host floats, while the core keeps
each layer's scale as a 0-dim device tensor (set in place, read by captured graphs). So the
context folds them on the device instead: ``q * k_scale`` before the kernel and
``out *= v_scale`` after it - no host sync, and a graph replay sees the current scale.

Softmax scales go through public arguments only: each plan() takes the group's
(``spec.scale``, as ``sm_scale``); a layer whose own scale (``LayerAttentionBinding.scale``)
differs has the ratio folded into ``q`` before ``run()`` (``softmax(s' q.k) =
softmax(s (s'/s) q).k)``, soft-cap included, which FlashInfer applies after the scale), and the
fast path's direct decode run takes the layer's scale as an argument. No wrapper attribute is
written for it, so no FlashInfer release can drop it silently. Every other use of FlashInfer's
internals (fast plan, direct run, shared int workspace) is in :mod:`attn_plugin_flashinfer.compat`,
gated by the installed release.

Host metadata lives in two pinned halves used alternately, so a step's non-blocking copies never
read a buffer the next step is already rewriting.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from attn_core.batch import AttentionBatch, BatchMode
from attn_core.context import WorkspaceRequirement
from attn_core.errors import BackendInputError
from attn_core.local_attention import max_virtual_requests
from attn_core.specs import ExecutionConstraints, GraphMode, LayerGroup, LayerKind, LayerSpec
from attn_core.state.kv_write import (
    FP8_DTYPE,
    KVWriter,
    scale_kind,
    slot_runs,
    write_kv_runs,
    write_slots,
)
from attn_plugin_flashinfer import compat, planning
from attn_plugin_flashinfer.sinks import apply_sinks_, triton_runs_on

__all__ = [
    "FLOAT_WORKSPACE_BYTES",
    "INT_WORKSPACE_BYTES",
    "FullAttentionContext",
    "MLAContext",
    "StepKind",
    "decode_uses_tensor_cores",
    "request_rows",
    "workspace_requirements",
]

#: FlashInfer's recommended float workspace (split-KV partial results); override with
#: ``ATTN_FLASHINFER_WORKSPACE_MB``.
FLOAT_WORKSPACE_BYTES = int(os.environ.get("ATTN_FLASHINFER_WORKSPACE_MB", "128")) * 2**20
#: Size of the int workspace every FlashInfer wrapper allocates for itself (plan info).
INT_WORKSPACE_BYTES = 8 * 2**20
#: Decode steps of at most this many (padded) requests whose KV positions stay within
#: ``SMALL_DECODE_MAX_KV_TOKENS`` run the plugin's own fused write + split-KV kernels
#: (:mod:`attn_plugin_flashinfer.small_decode`) instead of FlashInfer's decode: there FlashInfer
#: is latency-bound and the separate K/V write launch is a large share of the step. Why these
#: limits (H200, 32 q / 8 kv heads, d128, 32-layer CUDA graph, us per layer): both paths are
#: close to linear in the step's KV positions N, about 8.2 + 1.075 N/1000 for small_decode and
#: 10.9 + 0.94 N/1000 for FlashInfer + the write, which cross near N = 20k; and at ctx 4096 the
#: two are even at 4 requests (26.95 against 27.26) while FlashInfer is faster at 8 (42.08
#: against 43.12). A captured graph replays at every length up to ``max_model_len``, so its
#: limit holds for requests x ``max_model_len``; an eager step's limit holds for its requests'
#: own lengths (on the host). Eager steps keep the graph's limit: there FlashInfer's path also
#: pays host time for its run() and the K/V write, so up to ~20k positions small_decode is never
#: much slower and often far faster.
#: ``ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH`` overrides the batch limit (0: never).
SMALL_DECODE_MAX_BATCH = 4
SMALL_DECODE_MAX_KV_TOKENS = 20480
#: GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (DISPATCH_GQA_GROUP_SIZE).
_CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 8})


class StepKind(str, enum.Enum):
    DECODE = "decode"
    DECODE_GRAPH = "decode_graph"
    DECODE_SMALL = "decode_small"  # captured, small batch: small_decode's fused kernels
    RAGGED = "ragged"
    PAGED = "paged"
    PAGED_GRAPH = "paged_graph"  # a captured mixed step (graph mode full)
    MLA = "mla"
    MLA_GRAPH = "mla_graph"
    EMPTY = "empty"


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int, kv_dtype: str = "bfloat16") -> bool:
    """Whether decode runs FlashInfer's tensor-core (prefill-kernel) path.

    GQA (group size > 1) with a 16-bit cache: yes. On an H200 (bf16, 32 q / 8 kv heads, d128,
    page 16) it reads KV at 4.3-4.5 TB/s against 2.7-3.0 TB/s for the CUDA-core decode kernel
    (``bench_flashinfer.py --variants``); its expensive Python ``plan()`` is bypassed on later
    steps by the fast plan (:mod:`attn_plugin_flashinfer.compat`, tested releases only). MHA
    keeps the CUDA-core kernel (one query row per KV head fills no MMA tile), and so does an
    fp8 cache (FlashInfer routes fp8 tensor-core decode to other backends this plugin has not
    verified), except for group sizes the CUDA-core kernel is not compiled for.
    """
    group = num_heads // num_kv_heads
    if group not in _CUDA_CORE_DECODE_GROUPS:
        return True
    return group > 1 and kv_dtype != "fp8_e4m3"


def _max_pages(spec: LayerSpec, constraints: ExecutionConstraints) -> int:
    page = min(constraints.page_size or spec.page_size, spec.page_size)
    per_request = -(-constraints.max_model_len // page) + 1  # + 1: decode may cross a page
    return constraints.max_batch_size * per_request


def request_rows(spec: LayerSpec, constraints: ExecutionConstraints) -> int:
    """Per-request rows the metadata buffers hold: ``max_batch_size``, or for a chunked layer
    (served through the core's local virtual batches) the most virtual requests a step can
    have (:func:`attn_core.local_attention.max_virtual_requests`)."""
    B = constraints.max_batch_size
    chunk = spec.attention_chunk_size
    if chunk is None:
        return B
    return max_virtual_requests(B, constraints.max_num_tokens, chunk)


def workspace_requirements(
    spec: LayerSpec, constraints: ExecutionConstraints
) -> list[WorkspaceRequirement]:
    """Buffers one context needs, sized for ``constraints`` (largest batch, longest request).

    - ``float_workspace`` ``[128 MiB]`` uint8, zeroed (FlashInfer asks for zeros on first use).
    - ``int_workspace`` ``[8 MiB]`` uint8: plan info, shared by the context's wrappers.
    - ``host_meta`` ``[2, 5B + 2]`` int32, pinned: two halves of
      ``kv_indptr (B+1) | row_offset (B) | last_page_len (B) | qo_indptr (B+1) | kv_len (B)``.
    - ``dev_meta`` ``[3B + 1]`` int32: device copy of ``kv_indptr | row_offset | last_page_len``
      (what the page gather and tensor-core decode kernels read).
    - ``kv_indices`` / ``arange`` ``[B * (ceil(max_model_len / page) + 1)]`` int32.
    - ``graph_kv_indptr`` / ``graph_qo_indptr`` ``[B + 1]``, ``graph_kv_len`` ``[B]`` int32:
      what captured MLA decode kernels read (full attention's read ``dev_meta``, and a
      captured mixed step's prefill kernel ``graph_qo_indptr`` for its query offsets).
    - ``sink_lse`` ``[max_num_tokens, num_heads]`` float32, layers with attention sinks only:
      the log-sum-exp rows ``run()`` writes and the sinks rescale reads (fixed, so a captured
      step reads the same buffer on replay).

    None of these sizes depends on a step: a captured mixed step (graph mode full) is planned
    into the same buffers whatever its split between prefill chunks and decodes.
    """
    B = request_rows(spec, constraints)
    pages = _max_pages(spec, constraints)
    i32 = torch.int32
    sinks = (
        [WorkspaceRequirement(
            "sink_lse", (max(constraints.max_num_tokens, 1), spec.num_heads), torch.float32
        )]
        if spec.has_sinks
        else []
    )  # fmt: skip
    return [
        *sinks,
        WorkspaceRequirement("float_workspace", (FLOAT_WORKSPACE_BYTES,), torch.uint8, zero=True),
        WorkspaceRequirement("int_workspace", (INT_WORKSPACE_BYTES,), torch.uint8, zero=True),
        WorkspaceRequirement("host_meta", (2, 5 * B + 2), i32, host=True, zero=True),
        WorkspaceRequirement("dev_meta", (3 * B + 1,), i32, zero=True),
        WorkspaceRequirement("kv_indices", (pages,), i32, zero=True),
        WorkspaceRequirement("arange", (pages,), i32),
        WorkspaceRequirement("graph_kv_indptr", (B + 1,), i32, zero=True),
        WorkspaceRequirement("graph_qo_indptr", (B + 1,), i32, zero=True),
        WorkspaceRequirement("graph_kv_len", (B,), i32, zero=True),
    ]


@dataclass(slots=True)
class _Step:
    """What forward needs from the step's plan (the same for every layer)."""

    kind: StepKind
    wrapper: Any
    # the step has padding rows, or is a captured graph that may be replayed with some: the
    # K/V write must redirect slot -1 (False: every slot is a real token's, a plain scatter)
    padded: bool
    # DECODE_SMALL: the split partials of this padded batch size (None for the other kinds)
    small: Any = None
    # RAGGED: the step's slots as runs of consecutive cache rows (kv_write.slot_runs), which
    # the side stream writes as memcpys; None: the write kernel
    kv_runs: list[tuple[int, int, int]] | None = None
    # DECODE: compat may call the wrapper's compiled kernel itself (a tested release)
    direct_run: bool = False
    # the query rows the plan covers (its qo_indptr[-1]); fewer than the step's padded tokens
    # only in a captured mixed step whose requests fill every row, where the padding tokens
    # past the last request belong to no row (0: the kind plans no rows)
    rows: int = 0


class _PagedContext:
    """Planning shared by the full-attention and MLA contexts."""

    #: whether compat's fast plan may serve this context's decode steps (a full-attention
    #: context of a configuration the self-check covers; MLA plans publicly)
    fast_checked: bool = False

    def __init__(
        self,
        backend: Any,
        group: LayerGroup,
        constraints: ExecutionConstraints,
        workspace: Any,
    ) -> None:
        import flashinfer  # cold: once per group

        self.fi = flashinfer
        #: FlashInfer's internals, gated by the installed release (compat.py)
        self.fast = compat.fast_path(flashinfer)
        self.fi_version = self.fast.version
        self.backend = backend
        self.group = group
        self.spec = group.spec
        self._where = f"group {group.group_id!r} (flashinfer): "  # errors' prefix
        self.constraints = constraints
        self.graph_decode = constraints.graph_mode is not GraphMode.NONE
        #: graph mode full: prefill / mixed steps built with ``full_graph`` are captured too
        self.graph_full = constraints.graph_mode is GraphMode.FULL
        ws = workspace
        self.float_ws = ws["float_workspace"]
        self.int_ws = ws["int_workspace"]
        self.device = self.float_ws.device
        self.pinned_staging = torch.empty(
            INT_WORKSPACE_BYTES,
            dtype=torch.uint8,
            pin_memory=self.device.type == "cuda",
        )
        self.host = ws["host_meta"]
        self.host_np = self.host.numpy()
        self.dev_meta = ws["dev_meta"]
        self.kv_indices = ws["kv_indices"]
        self.arange = ws["arange"]
        torch.arange(self.arange.shape[0], dtype=torch.int32, out=self.arange)
        self.g_kv_indptr = ws["graph_kv_indptr"]
        self.g_qo_indptr = ws["graph_qo_indptr"]
        self.g_kv_len = ws["graph_kv_len"]
        self.B = request_rows(self.spec, constraints)
        self.offsets = _Offsets(self.B)
        self._views: dict[tuple[int, int], _StepViews] = {}  # by (half, padded batch size)
        # kv_indices on CUDA in one Triton launch (kv_indices.py); torch calls elsewhere
        self._gather_kv_indices: Any = None
        if self.device.type == "cuda":
            from attn_plugin_flashinfer.kv_indices import KVIndexGather

            self._gather_kv_indices = KVIndexGather()
        self._row_base: tuple[int, np.ndarray] | None = None  # (W, b * W) for page-table width W
        dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
        self.q_dtype = dtypes[self.spec.dtype]
        self.kv_dtype = (
            torch.float8_e4m3fn if self.spec.kv_dtype == "fp8_e4m3" else dtypes[self.spec.kv_dtype]
        )
        self.fp8 = self.kv_dtype == FP8_DTYPE
        self.batch: AttentionBatch | None = None
        self.step: _Step | None = None
        self._half = 1
        self._graph_wrappers: dict[int, Any] = {}
        self._full_wrappers: dict[int, Any] = {}  # captured mixed steps, by padded batch size
        self.small_decode_max_batch = 0  # FullAttentionContext turns it on where it applies
        self._small: dict[int, Any] = {}  # small_decode buffers by padded batch size
        self._small_plan_for: Any = None  # small_decode.plan, imported with the buffers
        # small_decode's plans of the current step, by (q, k, v, out strides, scale, pdl).
        self._small_plans: dict[tuple, Any] = {}
        # The step's K/V writers (kv_write.KVWriter), by (k, v strides, scale kinds).
        self._writers: dict[tuple, KVWriter] = {}
        # The step's direct decode runs (compat.FastPath.decode_runner) by softmax scale;
        # None where compat does not know the wrapper's run().
        self._runners: dict[float, Any] = {}

    # -- the contract ------------------------------------------------------------------------
    def prepare(self, batch: AttentionBatch) -> None:
        """Plan ``batch``: host metadata, device ``kv_indices``, write slots, one plan()."""
        if batch is self.batch and self.step is not None:
            return  # already planned for this very batch (prepare then update, say)
        self.step = self._plan(batch)
        self.batch = batch
        self._small_plans = {}
        self._writers = {}
        self._runners = {}

    def update(self, batch: AttentionBatch) -> None:
        """Before a CUDA-graph replay: re-plan into the captured wrapper's fixed buffers.

        Decode graph wrappers own no per-step buffers of their own: their indptr, indices and
        last-page-length buffers are views of this context's workspace, and ``plan()`` rewrites
        them (and the plan info in the shared int workspace) in place.
        """
        self.prepare(batch)

    # -- planning -----------------------------------------------------------------------------
    def _plan(self, batch: AttentionBatch) -> _Step:
        if batch.mode is BatchMode.ENCODER:
            raise ValueError(
                f"group {self.group.group_id!r} ({self.spec.kind.value}) got an encoder batch; "
                "expected decode / prefill / mixed / verify"
            )
        P, T, n = batch.padded_reqs, batch.padded_tokens, batch.num_tokens
        if P == 0 or T == 0:
            return _Step(StepKind.EMPTY, None, False)
        if batch.page_table is None or batch.slot_mapping is None or not batch.page_size:
            raise ValueError("the batch has no page table / slot mapping: build it with a state")
        if P > self.B:
            raise ValueError(
                f"batch of {P} requests exceeds the {self.B} this context was sized for "
                "(max_batch_size, or its virtual requests for a chunked layer)"
            )
        if batch.full_graph and not self.graph_full:
            self._bad(
                "a captured mixed step (a full_graph batch) needs a context allocated for "
                f"graph mode full, this one is for {self.constraints.graph_mode.value}"
            )
        graph = self.graph_decode and batch.mode is BatchMode.DECODE
        if (
            batch.mode is BatchMode.DECODE
            and self.small_decode_max_batch >= P
            # a graph's limit holds at max_model_len; an eager step's lengths are known
            and (graph or int(batch.seq_lens_cpu[:P].sum()) <= SMALL_DECODE_MAX_KV_TOKENS)
        ):
            # The fused kernels read the batch's own page table, lengths and slots: no plan.
            return _Step(StepKind.DECODE_SMALL, None, graph, small=self._small_buffers(P))
        self._half ^= 1
        sv = self._views.get((self._half, P)) or self._make_views(self._half, P)
        width = batch.page_table.shape[1]
        if self._row_base is None or self._row_base[0] != width:
            self._row_base = (width, np.arange(self.B, dtype=np.int32) * np.int32(width))
        row_base = self._row_base[1]
        seq_lens = batch.seq_lens_cpu[:P]
        meta = planning.fill_paged_metadata(
            seq_lens,
            batch.page_size,
            width,
            kv_indptr=sv.kv_indptr,
            row_offset=sv.row_offset,
            last_page_len=sv.last_page_len,
            row_base=row_base,
        )
        sv.qo_indptr[:] = batch.query_start_loc_cpu[: P + 1]
        sv.kv_len[:] = seq_lens
        # One copy carries kv_indptr | row_offset | last_page_len (adjacent): the kv_indices
        # gather reads kv_indptr (the torch one off CUDA row_offset too), tensor-core decode
        # kernels kv_indptr and last_page_len.
        self.dev_meta.copy_(sv.upload, non_blocking=self.device.type == "cuda")
        if self._gather_kv_indices is not None:
            planning.check_kv_indices_room(
                self.kv_indices.shape[0], meta.total_pages, where=self._where
            )
            self._gather_kv_indices(batch.page_table, sv.kv_indptr_dev, self.kv_indices, P)
            indices = self.kv_indices[: meta.total_pages]
        else:
            indices = planning.gather_kv_indices(
                batch.page_table,
                sv.kv_indptr_dev,
                sv.row_offset_dev,
                meta.total_pages,
                arange=self.arange,
                out=self.kv_indices,
            )
        kind, wrapper = self._plan_kernel(batch, sv, indices, graph)
        runs = None
        if kind is StepKind.RAGGED and batch.slot_mapping_cpu is not None and not self.fp8:
            runs = slot_runs(batch.slot_mapping_cpu[:n])
        direct_run = kind is StepKind.DECODE and self._fast_replan(wrapper)
        captured = graph or batch.full_graph  # a replay may carry padding rows
        return _Step(kind, wrapper, captured or n != T, kv_runs=runs, direct_run=direct_run,
                     rows=int(batch.query_start_loc_cpu[P]))  # fmt: skip

    def _fast_replan(self, wrapper: Any) -> bool:
        """Whether the fast plan (and the direct run) may serve ``wrapper``'s decode step."""
        return self.fast_checked and self.fast.can_replan(wrapper)

    def _small_buffers(self, P: int) -> Any:
        raise NotImplementedError

    def _make_views(self, half: int, P: int) -> _StepViews:
        """Slices of one half of the metadata for ``P`` requests, made once: slicing a tensor
        costs microseconds of host time per call, and a step would take a dozen."""
        o, row, host = self.offsets, self.host_np[half], self.host[half]

        def np_and_torch(start: int, n: int) -> tuple[np.ndarray, torch.Tensor]:
            return row[start : start + n], host[start : start + n]

        views = _StepViews(
            *np_and_torch(o.kv_indptr, P + 1),
            *np_and_torch(o.row_offset, P),
            *np_and_torch(o.last_page_len, P),
            *np_and_torch(o.qo_indptr, P + 1),
            *np_and_torch(o.kv_len, P),
            upload=host[: 3 * self.B + 1],
            kv_indptr_dev=self.dev_meta[: P + 1],
            row_offset_dev=self.dev_meta[o.row_offset : o.row_offset + P],
            last_page_len_dev=self._last_page_len_dev(P),
            qo_indptr_dev=self.arange[: P + 1],
        )
        self._views[half, P] = views
        return views

    def _plan_kernel(
        self, batch: AttentionBatch, views: _StepViews, indices: torch.Tensor, graph: bool
    ) -> tuple[StepKind, Any]:
        raise NotImplementedError

    def _last_page_len_dev(self, P: int) -> torch.Tensor:
        """``[P]`` int32 device view of the step's last-page lengths (in ``dev_meta``)."""
        start = self.offsets.last_page_len
        return self.dev_meta[start : start + P]

    def _write(self, x: torch.Tensor, cache: torch.Tensor, step: _Step, scale) -> None:
        """The step's new rows into ``cache`` at ``slot_mapping`` (padding rows change nothing)."""
        batch = self.batch
        if batch is None or batch.slot_mapping is None:  # _plan refused such a batch
            self._bad("a cache write without a prepared paged batch")
        write_slots(x, cache, batch.slot_mapping, scale, may_have_padding=step.padded)

    def _share(self, wrapper: Any) -> Any:
        """``wrapper`` on the context's int workspace (compat.FastPath.share_int_workspace)."""
        return self.fast.share_int_workspace(
            wrapper, self.float_ws, self.int_ws, self.pinned_staging
        )

    def _q_for(self, layer: Any, q: torch.Tensor) -> torch.Tensor:
        """``q`` for a ``run()`` planned at the group's scale: scaled by ``layer.scale /
        spec.scale`` where the layer's own scale differs (the plan's ``sm_scale`` stays the
        group's; a public argument, never a wrapper attribute, carries the layer's)."""
        if layer.scale == self.spec.scale:
            return q
        return q * (layer.scale / self.spec.scale)

    def _finish(self, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def _bad(self, what: str) -> NoReturn:
        raise ValueError(f"{self._where}{what}")


@dataclass(frozen=True, slots=True)
class _Offsets:
    """Layout of one half of ``host_meta`` (``B`` = max batch size, 5B + 2 int32 in all)."""

    B: int

    @property
    def kv_indptr(self) -> int:  # B + 1
        return 0

    @property
    def row_offset(self) -> int:  # B, right after kv_indptr: both go to the device in one copy
        return self.B + 1

    @property
    def last_page_len(self) -> int:  # B
        return 2 * self.B + 1

    @property
    def qo_indptr(self) -> int:  # B + 1
        return 3 * self.B + 1

    @property
    def kv_len(self) -> int:  # B
        return 4 * self.B + 2


@dataclass(slots=True)
class _StepViews:
    """One half of the step metadata for a padded batch of ``P`` requests, as numpy views (filled
    on the host), pinned torch views of the same memory (FlashInfer's plan reads them) and the
    device views the kernels read. Made once per (half, P) by ``_PagedContext._make_views``."""

    kv_indptr: np.ndarray  # [P + 1] int32
    kv_indptr_host: torch.Tensor
    row_offset: np.ndarray  # [P] int32
    row_offset_host: torch.Tensor
    last_page_len: np.ndarray  # [P] int32
    last_page_len_host: torch.Tensor
    qo_indptr: np.ndarray  # [P + 1] int32
    qo_indptr_host: torch.Tensor
    kv_len: np.ndarray  # [P] int32
    kv_len_host: torch.Tensor
    upload: torch.Tensor  # [3B + 1] int32 pinned: kv_indptr | row_offset | last_page_len
    kv_indptr_dev: torch.Tensor  # [P + 1] int32, in dev_meta
    row_offset_dev: torch.Tensor  # [P] int32, in dev_meta
    last_page_len_dev: torch.Tensor  # [P] int32, in dev_meta
    qo_indptr_dev: torch.Tensor  # [P + 1] int32 0..P (the context's arange)


class FullAttentionContext(_PagedContext):
    """Full (MHA / GQA / MQA) attention over the core's paged ``k``/``v`` caches (NHD)."""

    def __init__(self, backend, group, constraints, workspace) -> None:
        super().__init__(backend, group, constraints, workspace)
        spec = self.spec
        if spec.kind is not LayerKind.FULL:
            raise ValueError(f"FullAttentionContext serves full layers, got {spec.kind.value}")
        if spec.head_dim != spec.head_dim_v:
            raise ValueError(
                f"FlashInfer's paged kernels need head_dim == head_dim_v (equal K/V cache "
                f"strides), the layer has {spec.head_dim} / {spec.head_dim_v}"
            )
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
            )
        self.window_left = planning.window_left(spec.sliding_window)
        self.soft_cap = spec.logits_soft_cap
        #: attention sinks: every step's output rescaled by its log-sum-exp (sinks.py), which
        #: run() writes into the workspace's ``sink_lse`` rows
        self.sinks = spec.has_sinks
        self.sink_lse: torch.Tensor | None = workspace["sink_lse"] if self.sinks else None
        self.tensor_core_decode = decode_uses_tensor_cores(
            spec.num_heads, spec.num_kv_heads, spec.kv_dtype
        )
        if small_decode_serves(spec, self.kv_dtype, self.q_dtype) and triton_runs_on(self.device):
            cap = int(
                os.environ.get(
                    "ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", str(SMALL_DECODE_MAX_BATCH)
                )
            )
            self.small_decode_max_batch = (
                small_decode_batch_limit(constraints.max_model_len, cap)
                if self.graph_decode
                else max(0, cap)  # an eager step checks its own KV positions
            )
        #: small_decode's kernels as programmatic dependents (attn_core.pdl): off, as they ran
        #: slower that way in a 32-layer graph at B=1; the benchmark turns it on to compare. The
        #: K/V write before FlashInfer's kernel does launch that way (figures: docs/results.md).
        self.pdl = False
        #: Ragged prefill writes the KV cache on a side stream, overlapping the attention
        #: kernel (``ATTN_FLASHINFER_OVERLAP_KV_WRITE=0`` turns it off; benchmarks toggle it).
        self.overlap_kv_write = self.device.type == "cuda" and os.environ.get(
            "ATTN_FLASHINFER_OVERLAP_KV_WRITE", "1"
        ) not in ("0", "")
        self._side: torch.cuda.Stream | None = None
        #: Eager tensor-core decode calls FlashInfer's compiled kernel without ``run()``'s
        #: Python (compat.FastPath.decode_runner) where compat knows the release;
        #: benchmarks turn it off to compare.
        self.direct_decode_run = True
        #: The fast path serves the configurations its self-check runs: K/V in the query's
        #: dtype. An fp8 cache on tensor-core decode (head groups the CUDA-core kernel lacks)
        #: plans and runs through the public API.
        self.fast_checked = self.tensor_core_decode and self.kv_dtype == self.q_dtype
        if self.fast_checked:
            # Once per process and configuration, before this group's first fast plan: the
            # fast path against the public plan()/run() on a tiny case of this group's shape
            # (GPU only; the kernel module it compiles is this context's); a failure turns it
            # off, attn list says why.
            self.fast.self_check(
                self.device, dtype=self.q_dtype, num_qo_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                page_size=spec.page_size, window_left=self.window_left,
                logits_soft_cap=self.soft_cap or 0.0,
            )  # fmt: skip
        fi = self.fi
        self.decode = self._share(
            fi.BatchDecodeWithPagedKVCacheWrapper(
                self.float_ws, "NHD", use_tensor_cores=self.tensor_core_decode
            )
        )
        self.paged = self._share(fi.BatchPrefillWithPagedKVCacheWrapper(self.float_ws, "NHD"))
        self.ragged = self._share(fi.BatchPrefillWithRaggedKVCacheWrapper(self.float_ws, "NHD"))

    def _graph_wrapper(self, P: int) -> Any:
        wrapper = self._graph_wrappers.get(P)
        if wrapper is None:
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.float_ws,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_core_decode,
                # Views of the context's device metadata: the step's one host-to-device copy
                # fills what the captured kernels read.
                paged_kv_indptr_buffer=self.dev_meta[: P + 1],
                paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self._last_page_len_dev(P),
            )
            self._share(wrapper)
            self._graph_wrappers[P] = wrapper
        return wrapper

    def _full_graph_wrapper(self, P: int) -> Any:
        """The prefill wrapper a captured mixed step of ``P`` padded requests runs (graph mode
        full): its buffers are views of the context's workspace - ``graph_qo_indptr[:P + 1]``,
        ``dev_meta``'s kv_indptr and last-page lengths, ``kv_indices`` - which every plan()
        rewrites in place and the captured kernels read."""
        wrapper = self._full_wrappers.get(P)
        if wrapper is None:
            wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.float_ws,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=self.g_qo_indptr[: P + 1],
                paged_kv_indptr_buf=self.dev_meta[: P + 1],
                paged_kv_indices_buf=self.kv_indices,
                paged_kv_last_page_len_buf=self._last_page_len_dev(P),
            )
            self._share(wrapper)
            self._full_wrappers[P] = wrapper
        return wrapper

    def _small_buffers(self, P: int) -> Any:
        """small_decode's partials for ``P`` padded requests, made on the first plan of that
        size: before the step is captured, so a replay finds them at the same address."""
        buffers = self._small.get(P)
        if buffers is None:
            from attn_plugin_flashinfer import small_decode  # Triton: only where it runs

            self._small_plan_for = small_decode.plan
            spec = self.spec
            sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 4
            )
            splits = small_decode.num_splits_for(
                P, spec.num_kv_heads, self.constraints.max_model_len, sms
            )
            buffers = small_decode.SmallDecodeBuffers.allocate(
                P, spec.num_heads, splits, spec.head_dim, self.device
            )
            self._small[P] = buffers
        return buffers

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The stream a ragged prefill writes the cache on, beside the attention kernel; None
        when the write stays on the current stream (CPU, ``overlap_kv_write`` off, or a graph
        being captured, where a side stream would need its own fork and join events)."""
        if not self.overlap_kv_write or torch.cuda.is_current_stream_capturing():
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def _plan_kernel(self, batch, views, indices, graph):
        spec = self.spec
        common = dict(
            window_left=self.window_left,
            logits_soft_cap=self.soft_cap,
            sm_scale=spec.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
        )
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        # the paged prefill wrappers' (plain and graph-mode) positional arguments
        paged = (
            views.qo_indptr_host,
            views.kv_indptr_host,
            indices,
            views.last_page_len_host,
            H,
            Hkv,
            D,
            batch.page_size,
        )
        if batch.mode is BatchMode.DECODE:
            wrapper = self._graph_wrapper(batch.padded_reqs) if graph else self.decode
            kind = StepKind.DECODE_GRAPH if graph else StepKind.DECODE
            if self._fast_replan(wrapper):
                self.fast.replan_tensor_core_decode(
                    wrapper,
                    qo_indptr_host=views.qo_indptr_host,
                    kv_indptr_host=views.kv_indptr_host,
                    kv_len_host=views.kv_len_host,
                    max_kv_len=batch.max_seq_len,
                    kv_indptr_dev=views.kv_indptr_dev,
                    kv_indices_dev=indices,
                    last_page_len_dev=views.last_page_len_dev,
                    qo_indptr_dev=views.qo_indptr_dev,
                    num_qo_heads=H,
                    num_kv_heads=Hkv,
                    head_dim=D,
                    page_size=batch.page_size,
                    window_left=self.window_left,
                )
                return kind, wrapper
            wrapper.plan(
                views.kv_indptr_host,
                indices,
                views.last_page_len_host,
                H,
                Hkv,
                D,
                batch.page_size,
                pos_encoding_mode="NONE",
                non_blocking=True,
                **common,
            )
            self.fast.mark_planned(wrapper)
            return kind, wrapper
        P = batch.padded_reqs
        if batch.full_graph:
            # A captured mixed step: the graph wrapper of P requests, planned into its fixed
            # buffers. FlashInfer's graph-mode scheduler keeps the batch size and the row
            # count of the first plan (the capture's, at the full padded token count: the
            # builder's last padding row takes every padding token), so every replay's plan
            # has the captured grid and workspace offsets; a smaller split only has shorter
            # rows. Nothing here depends on the split but the values copied into the buffers.
            wrapper = self._full_graph_wrapper(P)
            wrapper.plan(
                *paged,
                causal=True,
                non_blocking=True,
                # fixed, not the split's longest query: the plan must not vary with the split
                max_token_per_sequence=batch.padded_tokens,
                **common,
            )
            return StepKind.PAGED_GRAPH, wrapper
        no_context = not batch.context_lens_cpu[:P].any()
        if no_context and not self.fp8:
            # Pure prefill: attend over the step's own k/v (contiguous rows, no page walk).
            self.ragged.plan(
                views.qo_indptr_host,
                views.qo_indptr_host,
                H,
                Hkv,
                D,
                causal=True,
                non_blocking=True,
                **common,
            )
            return StepKind.RAGGED, self.ragged
        self.paged.plan(
            *paged,
            causal=True,
            non_blocking=True,
            max_token_per_sequence=max(batch.max_query_len, 1),
            **common,
        )
        return StepKind.PAGED, self.paged

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,  # a full layer's: the binding passes both
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """One layer: write the step's K/V into the cache, then attend.

        :param q: ``[T, num_heads, head_dim]`` (T = padded tokens), last dim contiguous.
        :param k: ``[T, num_kv_heads, head_dim]``; ``v`` ``[T, num_kv_heads, head_dim]``.
        :param out: ``[T, num_heads, head_dim]`` or None.
        :returns: ``out`` (filled) or a new ``[T, num_heads, head_dim]`` tensor in q's dtype.
        """
        step = self.step
        if step is None:
            self._bad("forward before prepare(batch)")
        if step.kind is StepKind.EMPTY:
            return out if out is not None else torch.empty_like(q)
        kv = layer.kv
        k_cache, v_cache = kv.k, kv.v
        if k_cache.dtype != self.kv_dtype:
            self._bad(f"KV cache dtype {k_cache.dtype}, the plan expects {self.kv_dtype}")
        if step.kind is StepKind.DECODE_SMALL:
            return self._small_decode(layer, q, k, v, out, step)
        fp8 = self.fp8
        # the K/V write takes every padded token (slot -1 writes nothing), attention the plan's
        # rows: FlashInfer's run() refuses a q with more rows than the plan's qo_indptr[-1]
        write = (k, v, k_cache, v_cache, kv.k_scale if fp8 else None, kv.v_scale if fp8 else None)
        whole = out
        if step.rows < q.shape[0]:
            if _capturing(q.device):
                # the temporaries below (fp8's scaled q, a scale ratio, the sinks rescale)
                # would cover these rows only, and a replay with more rows reads past them
                batch = self.batch
                raise BackendInputError(
                    group=self.group.group_id,
                    backend=self.backend.qualified_name,
                    what=f"layer {layer.layer_index}: a CUDA-graph capture of a mixed step "
                    "whose requests fill every row",
                    expected="a padding row (capture on BatchBuilder.build([], pad_to=P, "
                    "pad_tokens_to=T))",
                    got=f"{batch.num_reqs if batch else '?'} requests with {step.rows} tokens "
                    f"of {q.shape[0]}",
                )
            if whole is None:  # the caller still gets every padded row (those past: garbage)
                whole = q.new_empty(q.shape[0], self.spec.num_heads, self.spec.head_dim_v)
            q, k, v, out = q[: step.rows], k[: step.rows], v[: step.rows], whole[: step.rows]
        wrapper = step.wrapper
        o = out if out is not None and out.is_contiguous() else None
        # attention sinks: run() also writes each row's log-sum-exp, the output is rescaled
        sinks, lse = self._sinks_and_lse(layer, q.shape[0]) if self.sinks else (None, None)
        if step.kind is StepKind.RAGGED:
            # The ragged kernel reads the step's own k/v, not the cache: the cache write can
            # run beside it on a side stream (memory-bound next to compute-bound).
            side = self._side_stream()
            if side is None:
                self._write_kv(*write)
                result = _run(wrapper, self._q_for(layer, q), k, v, out=o, lse=lse)
            else:
                main = torch.cuda.current_stream(self.device)
                side.wait_stream(main)  # k and v are ready
                with torch.cuda.stream(side):
                    if step.kv_runs is not None and _copyable(k, k_cache) and _copyable(v, v_cache):
                        # Few runs of consecutive slots (fresh pages): memcpys, which need no
                        # SM, where the write kernel would wait for the prefill's SMs.
                        write_kv_runs(k, v, k_cache, v_cache, step.kv_runs)
                    else:
                        self._write_kv(*write)
                result = _run(wrapper, self._q_for(layer, q), k, v, out=o, lse=lse)
                # Join before returning: later work on the main stream (the next step's
                # attention, or the caller freeing k/v) is ordered after the write.
                main.wait_stream(side)
        else:
            # One launch on CUDA for K and V (padding rows change nothing).
            self._write_kv(*write)
            # fp8: the kernel dequantises nothing; fold k_scale into q, v_scale into out.
            qk = torch.mul(q, kv.k_scale) if fp8 else q
            direct = step.direct_run and self.direct_decode_run
            runner = self._direct_run(step, layer.scale) if direct else None
            if runner is not None:  # the layer's scale is the runner's argument
                result = o if o is not None else torch.empty_like(q)
                runner(qk, k_cache, v_cache, result, lse)
            else:
                result = _run(wrapper, self._q_for(layer, qk), (k_cache, v_cache), out=o, lse=lse)
            if fp8:
                result.mul_(kv.v_scale)
        if sinks is not None and lse is not None:
            apply_sinks_(result, lse, sinks)
        result = self._finish(result, out)
        return whole if whole is not None else result

    def _sinks_and_lse(self, layer: Any, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's sinks ``[H]`` float32 and ``[T, H]`` float32 rows for run()'s LSE: the
        workspace's ``sink_lse`` (fixed rows a captured step reads on replay), or a fresh
        tensor for a step longer than ``max_num_tokens`` (eager only: the builder refuses
        such a step for a graph)."""
        sinks = layer.sinks
        if sinks is None:
            self._bad(f"layer {layer.layer_index} has no sinks tensor [num_heads] (float32)")
        if sinks.dtype != torch.float32:
            sinks = sinks.float()
        buf = self.sink_lse
        if buf is not None and buf.shape[0] >= T:
            return sinks, buf[:T]
        return sinks, torch.empty(T, self.spec.num_heads, dtype=torch.float32, device=self.device)

    def _direct_run(self, step: _Step, scale: float) -> Any:
        """The step's compiled decode call at softmax ``scale`` (compat), made on the first
        layer of the step that asks; None where compat does not know ``run()``."""
        try:
            return self._runners[scale]
        except KeyError:
            runner = self._runners[scale] = self.fast.decode_runner(step.wrapper, scale)
            return runner

    def _write_kv(self, k, v, k_cache, v_cache, k_scale, v_scale) -> None:
        """The step's K/V rows into the caches: one kv_write.KVWriter per (k/v strides, scale
        kinds) for the step, checked on its first write (the binding checks k/v shapes, dtypes
        and device per call, forward() the cache dtype; the slots are the step's)."""
        batch, step = self.batch, self.step
        if batch is None or step is None or batch.slot_mapping is None:  # _plan refused those
            self._bad("a K/V write without a prepared paged batch")
        key = (k.stride(), v.stride(), scale_kind(k_scale), scale_kind(v_scale))
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = KVWriter(may_have_padding=step.padded)
        writer(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)

    def _small_decode(self, layer, q, k, v, out, step: _Step) -> torch.Tensor:
        """A small decode step: the fused write + split-KV kernels (small_decode)."""
        ks, vs = k.stride(), v.stride()
        if ks[-1] != 1:
            k = k.contiguous()
            ks = k.stride()
        if vs[-1] != 1:
            v = v.contiguous()
            vs = v.stride()
        o = out if out is not None and out.stride(-1) == 1 else torch.empty_like(q)
        batch, kv = self.batch, layer.kv
        if batch is None:
            self._bad("forward before prepare(batch)")
        args = (
            q, k, v, kv.k, kv.v, batch.page_table, batch.seq_lens, batch.slot_mapping, o,
            step.small,
        )  # fmt: skip
        # Within a step only these vary between calls: the binding has checked q/k/v/out shapes
        # and dtypes, forward() the cache dtype, and a group's layers share one spec, device
        # and batch. The plan itself checks the rest once (small_decode.plan).
        key = (q.stride(), ks, vs, o.stride(), layer.scale, self.pdl)
        plan = self._small_plans.get(key)
        if plan is None:
            plan = self._small_plans[key] = self._small_plan_for(
                *args, scale=layer.scale, pdl=self.pdl
            )
        plan(*args)
        return self._finish(o, out)


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current CUDA stream is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _run(wrapper: Any, *args: Any, out: torch.Tensor | None,
         lse: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``wrapper.run(*args, out=out)``'s output; with ``lse`` (``[T, H]`` float32) the run
    also writes the rows' log-sum-exp into it (``return_lse``: run() then returns a pair)."""
    if lse is None:
        return wrapper.run(*args, out=out)
    return wrapper.run(*args, out=out, lse=lse, return_lse=True)[0]


def _copyable(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether kv_write.write_kv_runs can write ``x`` into ``cache``: contiguous, same dtype."""
    return x.dtype == cache.dtype and x.is_contiguous() and cache.is_contiguous()


def small_decode_batch_limit(max_model_len: int, cap: int = SMALL_DECODE_MAX_BATCH) -> int:
    """Most padded requests a captured decode step may have to take small_decode: ``cap``, and
    no more than ``SMALL_DECODE_MAX_KV_TOKENS`` KV positions at ``max_model_len`` each (0: the
    path is off)."""
    return max(0, min(cap, SMALL_DECODE_MAX_KV_TOKENS // max(max_model_len, 1)))


def small_decode_serves(spec: LayerSpec, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether :mod:`attn_plugin_flashinfer.small_decode` computes this layer's decode: plain
    attention (no window, soft-cap or sinks), a 16-bit cache in q's dtype, a power-of-two head
    dim and at most 16 query heads per KV head (one MMA tile of rows)."""
    group = spec.num_heads // spec.num_kv_heads
    d = spec.head_dim
    return (
        spec.sliding_window is None
        and not spec.logits_soft_cap
        and not spec.has_sinks
        and kv_dtype == q_dtype
        and kv_dtype in (torch.bfloat16, torch.float16)
        and d & (d - 1) == 0
        and 16 <= d <= 256
        and group <= 16
    )


class MLAContext(_PagedContext):
    """Absorbed MLA over the core's paged latent cache ``[num_pages, page_size, R + P]``.

    The cache is passed to FlashInfer as two strided views, ``ckv = latent[..., :R]`` and
    ``kpe = latent[..., R:]`` (the MLA kernels read page and token strides from the tensors),
    and the absorbed query ``[T, H, R + P]`` likewise as ``q_nope``/``q_pe`` views.
    """

    def __init__(self, backend, group, constraints, workspace) -> None:
        super().__init__(backend, group, constraints, workspace)
        spec = self.spec
        if spec.kind is not LayerKind.MLA:
            raise ValueError(f"MLAContext serves MLA layers, got {spec.kind.value}")
        if self.fp8:
            raise ValueError("FlashInfer MLA with bf16/fp16 queries needs a bf16/fp16 latent cache")
        self.rank, self.rope, _ = spec.mla_dims
        self.eager = self._share(self.fi.BatchMLAPagedAttentionWrapper(self.float_ws))

    def _graph_wrapper(self, P: int) -> Any:
        wrapper = self._graph_wrappers.get(P)
        if wrapper is None:
            wrapper = self.fi.BatchMLAPagedAttentionWrapper(
                self.float_ws,
                use_cuda_graph=True,
                qo_indptr=self.g_qo_indptr[: P + 1],
                kv_indptr=self.g_kv_indptr[: P + 1],
                kv_indices=self.kv_indices,
                kv_len_arr=self.g_kv_len[:P],
            )
            self._share(wrapper)
            self._graph_wrappers[P] = wrapper
        return wrapper

    def _plan_kernel(self, batch, views, indices, graph):
        wrapper = self._graph_wrapper(batch.padded_reqs) if graph else self.eager
        wrapper.plan(
            views.qo_indptr_host,
            views.kv_indptr_host,
            indices,
            views.kv_len_host,
            self.spec.num_heads,
            self.rank,
            self.rope,
            batch.page_size,
            # Decode queries see every key: no mask; longer queries are bottom-right causal.
            batch.mode is not BatchMode.DECODE,
            self.spec.scale,
            self.q_dtype,
            self.kv_dtype,
        )
        return (StepKind.MLA_GRAPH if graph else StepKind.MLA), wrapper

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,  # the new latents: the binding passes them
        v: torch.Tensor | None,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """One MLA layer: write the new latents, then attend over the latent cache.

        :param q: ``[T, H, R + P]`` absorbed query (``concat(q_nope W_UK, q_pe)``).
        :param k: ``[T, R + P]`` new latents ``concat(c_kv, k_pe)``; ``v`` is None.
        :param out: ``[T, H, R]`` or None.
        :returns: ``[T, H, R]`` latent attention output in q's dtype.
        """
        step = self.step
        if step is None:
            self._bad("forward before prepare(batch)")
        if step.kind is StepKind.EMPTY:
            return out if out is not None else q.new_empty((*q.shape[:2], self.rank))
        latent = layer.kv.latent
        if latent.dtype != self.kv_dtype:
            self._bad(f"latent cache dtype {latent.dtype}, the plan expects {self.kv_dtype}")
        self._write(k, latent, step, None)
        R = self.rank
        wrapper = step.wrapper
        o = out if out is not None and out.is_contiguous() else None
        q = self._q_for(layer, q)
        result = wrapper.run(q[..., :R], q[..., R:], latent[..., :R], latent[..., R:], out=o)
        return self._finish(result, out)
