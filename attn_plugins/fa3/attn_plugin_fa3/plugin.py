"""attn-core hooks of the fa3 plugin (entry point ``fa3``): full attention over the core's paged
KV through the FlashAttention-3 API (flash-attn-4's Hopper path, else the official FA3 build).

Per step and layer the context writes the new tokens' K/V into the paged cache by
``batch.slot_mapping`` (:mod:`attn_plugin_fa3.kv_write`) and then runs one varlen call over the
whole batch: ``cu_seqlens_q = batch.query_start_loc``, ``seqused_k = batch.seq_lens`` (KV length
including the new tokens), ``page_table = batch.page_table``. The kernel aligns each request's
queries to the end of its ``seqused_k`` keys, which is where the core puts them, so prefill
chunks, decodes, mixed and speculative-verify steps are all the same call. A decode step at long
context and small batch is split over the cached context instead (:mod:`attn_plugin_fa3.split_kv`:
chunk rows, then one merge kernel that adds the step's own key and stores the new K/V).

CUDA graphs (mode ``decode``): every tensor the call reads is a view of a persistent buffer of the
:class:`attn_core.batch.BatchBuilder` (same address for the same padded size), no length is read
back from the device, padding tokens (slot ``-1``) write nothing, and flash-attn-4 uses
``max_seqlen_q`` / ``max_seqlen_k`` only on the host to pick a split count it ignores on sm90.
Run one eager step per padded batch size before capturing (the first call of a configuration
JIT-compiles the kernel, 2-4 s).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from attn_core.backend import Backend, BackendCapabilities, SelfCheck
from attn_core.batch import AttentionBatch, BatchMode
from attn_core.errors import BackendInputError
from attn_core.hookspecs import hookimpl
from attn_core.specs import (
    ExecutionConstraints,
    GraphMode,
    LayerGroup,
    LayerKind,
    LayerSpec,
    Phase,
)
from attn_plugin_fa3 import __version__, providers, split_kv
from attn_plugin_fa3.kv_write import check_kv_dtypes, write_kv

if TYPE_CHECKING:
    from attn_core.binding import LayerAttentionBinding

ATTN_CORE_API_VERSION = "1.2"  # attn_core_self_check

BACKEND_NAME = "fa3"
#: Page sizes served and covered by the GPU tests. 128 (= tile_n for head dims <= 128) loads
#: KV with TMA, the others with the cp.async per-row page lookup.
PAGE_SIZES = frozenset({16, 32, 64, 128, 256})
#: A verify step is a causal query run of k + 1 tokens like any prefill chunk; 32 bounds what is
#: tested, not what the kernel can do.
MAX_SPECULATIVE_TOKENS = 32
#: rank without tuning data: prefill / mixed, and decode / verify (see capabilities())
PRIORITY = 90
DECODE_PRIORITY = 60


def capabilities(
    *,
    sinks: bool = True,
    head_dims: frozenset[int] = providers.FA4_HEAD_DIMS,
    deterministic: bool = True,
) -> BackendCapabilities:
    """What the backend serves with a provider of these properties (default: flash-attn-4)."""
    return BackendCapabilities(
        kinds={"full"},
        device_types={"cuda"},
        min_compute_capability=(9, 0),  # Hopper only: wgmma / TMA kernels
        max_compute_capability=(9, 0),
        dtypes={"bfloat16", "float16"},
        kv_dtypes={"bfloat16", "float16"},
        # FA3 reads KV in the query's dtype only: said here, so that the selector picks another
        # backend for an fp16 layer over a bf16 cache (allocation still checks it)
        mixed_kv_dtypes=False,
        head_dims=head_dims,
        page_sizes=PAGE_SIZES,
        kv_layouts={"NHD"},
        graph_modes={GraphMode.NONE, GraphMode.DECODE},
        max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
        causal=True,
        non_causal=False,  # decoder attention over a KV cache; see providers (tile_n)
        sliding_window=True,
        chunked_attention=False,  # FA3's kernels have no chunk mask, but
        # end-aligned causal varlen over page_table / seqused_k makes each local virtual request
        # exact (attn_core.local_attention): the runtime hands this context virtual batches
        chunked_virtual_batches=True,
        logits_soft_cap=True,
        sinks=sinks,
        deterministic=deterministic,
        # Measured on the H200 (bf16, through the public API): close to FlashInfer at prefill
        # (481-508 vs 571-592 TF/s) but 1.2x-10x slower at decode (B=1 ctx 32k: 10.8x; B=4 ctx
        # 128k: 3.7x), where FlashAttention-4 has no split-KV on sm90. Without tuning data the
        # decode and verify phases rank it further below FlashInfer (100), still above the
        # reference (tuning data, when given, decides instead).
        phase_priority={Phase.DECODE: DECODE_PRIORITY, Phase.VERIFY: DECODE_PRIORITY},
    )


_PROBE: tuple[providers.Provider | None, str | None] | None = None


def probe() -> tuple[providers.Provider | None, str | None]:
    """``(provider, None)`` or ``(None, why not)``; imports happen once per process."""
    global _PROBE
    if _PROBE is None:
        if not torch.cuda.is_available():
            found = ", ".join(providers.describe_missing())
            _PROBE = (
                None,
                f"CUDA is not available (torch {torch.__version__}: torch.cuda.is_available() "
                f"is False); {found}",
            )
        else:
            provider, reasons = providers.probe()
            _PROBE = (provider, None if provider is not None else "; ".join(reasons))
    return _PROBE


def make_backend(
    *, available: bool | None = None, provider: providers.Provider | None = None
) -> Backend:
    """The backend as this machine sees it.

    :param available: None probes the machine; True/False overrides the verdict (tests plan for
        an H200 from a CPU machine with it).
    :param provider: describe this provider's capabilities instead of the probed one's.
    """
    probed, reason = probe() if available is None or provider is None else (provider, None)
    provider = provider or probed
    if provider is not None:
        caps = capabilities(
            sinks=provider.sinks,
            head_dims=provider.head_dims,
            deterministic=provider.deterministic,
        )
        source = f"{provider.name} {provider.version}"
    else:
        caps = capabilities()  # what flash-attn-4 would serve once installed
        source = "flash-attn-4 (not loaded)"
    ok = (provider is not None and probed is not None) if available is None else available
    return Backend(
        name=BACKEND_NAME,
        capabilities=caps,
        priority=PRIORITY,
        description=f"FlashAttention-3 API over paged KV via {source} (sm90)",
        version=f"attn-plugin-fa3 {__version__}; {source}",
        notes=provider.note if provider is not None else "",
        available=ok,
        unavailable_reason=None if ok else (reason or "disabled"),
    )


@hookimpl
def attn_core_register_backends(register) -> None:
    register(make_backend())


def checked_provider(device: torch.device, *, sinks: bool = False) -> providers.Provider:
    """The probed provider, its private entry point compared with the public one on this GPU
    once per process (:func:`providers.self_check`; with ``sinks``, for a group whose layers
    have learnable sinks, also :func:`providers.self_check_sinks`); a mismatch leaves the
    public path only, and the backend's note in ``attn list`` says why."""
    provider, reason = probe()
    if provider is None:
        raise RuntimeError(f"fa3 cannot run: {reason}")
    if device.type == "cuda":
        provider = _checked(provider, device, sinks=sinks)
    return provider


#: the private entry point's self-check for the process: None not run, "" passed, else why not
_CHECK: str | None = None
#: the same for its call with learnable sinks (run once the plain check passed)
_CHECK_SINKS: str | None = None


def _checked(provider: providers.Provider, device: torch.device, *, sinks: bool
             ) -> providers.Provider:  # fmt: skip
    """``provider`` once the checks it still needs on ``device`` ran: the plain one where
    not run yet, the sinks one where ``sinks`` and the plain one passed."""
    global _PROBE, _CHECK_SINKS
    if provider.uses_private:  # not checked yet in this process
        provider = _run_self_check(provider, device)
    if sinks and _CHECK == "" and _CHECK_SINKS is None:
        problem = providers.self_check_sinks(provider, device)
        _CHECK_SINKS = problem or ""
        if problem is not None:
            provider = _fall_back(provider, device, problem)
            _PROBE = (provider, None)
    return provider


def _fall_back(provider: providers.Provider, device: torch.device, problem: str
               ) -> providers.Provider:  # fmt: skip
    """The public path in place of ``provider``'s private one, said in a RuntimeWarning."""
    warnings.warn(
        f"fa3: _flash_attn_fwd failed its self-check on {device} ({problem}); this "
        "process serves through the public flash_attn_varlen_func",
        RuntimeWarning,
        stacklevel=3,
    )
    return providers.public_only(provider, problem)


def _run_self_check(provider: providers.Provider, device: torch.device) -> providers.Provider:
    """Check ``provider``'s private entry point on ``device``; keep and return the provider the
    process serves with from now on (the private path marked checked, or the public one)."""
    global _PROBE, _CHECK
    problem = providers.self_check(provider, device)
    _CHECK = problem or ""
    if problem is None:
        provider = replace(provider, uses_private=False, note=provider.note.replace(
            "self-check at first GPU use", "self-check passed"))  # fmt: skip
    else:
        provider = _fall_back(provider, device, problem)
    _PROBE = (provider, None)
    return provider


@hookimpl
def attn_core_self_check(backend: Backend, device: torch.device) -> SelfCheck | None:
    """The private entry point's self-check on ``device`` now rather than in the first
    context (``attn list --self-check``); None where the provider has no private path."""
    provider, _ = probe()
    if provider is None:
        return None
    _checked(provider, device, sinks=True)  # the sinks case too: check everything now
    if _CHECK is None:
        return None
    failed = tuple(
        f"_flash_attn_fwd: self-check failed: {problem}"
        for problem in (_CHECK, _CHECK_SINKS)
        if problem
    )
    return SelfCheck(make_backend().notes, failed)


#: :func:`providers.check_broadcast_q` verdicts per (provider, device, layer shape): None (the
#: kernel reads broadcast query rows right) or why not; checked once per process and shape
_BROADCAST_Q: dict[tuple, str | None] = {}


def broadcast_q_problem(
    provider: providers.Provider,
    device: torch.device,
    spec: LayerSpec,
    page_size: int | None = None,
) -> str | None:
    """Why a split decode of one request at ``spec``'s shape must copy its query rows on
    ``device`` (CPU: no check, always copied), or None where it may pass ``q[0]`` broadcast.
    ``page_size``: the KV cache's (the kernel loads a page of ``tile_n`` rows by TMA, any
    other by rows: another kernel); None: the spec's, else 16."""
    page_size = page_size or spec.page_size or 16
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not checked off CUDA"
    index = device.index if device.index is not None else torch.cuda.current_device()
    dtype = getattr(torch, spec.dtype)
    key = (
        provider.name, provider.version, provider.uses_private, index, spec.num_heads,
        spec.num_kv_heads, spec.head_dim, page_size, dtype, spec.logits_soft_cap,
    )  # fmt: skip
    if key not in _BROADCAST_Q:
        with torch.cuda.device(index):
            _BROADCAST_Q[key] = providers.check_broadcast_q(
                provider, torch.device("cuda", index), num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                page_size=page_size, dtype=dtype,
                softcap=provider.make_softcap(spec.logits_soft_cap),
            )  # fmt: skip
    return _BROADCAST_Q[key]


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, state, workspace):
    if probe()[0] is None:
        raise RuntimeError(f"{backend.qualified_name} cannot run: {probe()[1]}")
    where = torch.device("cuda" if device.device_type == "cuda" else "cpu")
    page_size = getattr(state, "page_size", None) or constraints.page_size
    provider = checked_provider(where, sinks=group.spec.has_sinks)
    return FA3Context(backend, group, provider, constraints, device=where,
                      page_size=page_size)  # fmt: skip


@hookimpl
def attn_core_bind_forward(backend, context):
    return context.forward


class FA3Context:
    """One group's context: KV write + one FA3 varlen call per layer per step."""

    def __init__(
        self,
        backend: Backend,
        group: LayerGroup,
        provider: providers.Provider,
        constraints: ExecutionConstraints,
        device: torch.device | None = None,
        page_size: int | None = None,
    ) -> None:
        """``page_size``: the KV cache's (the state's); None: the spec's."""
        spec = group.spec
        self.backend = backend
        self.group = group
        self.spec = spec
        self.provider = provider
        # What BackendCapabilities cannot express is checked here, once.
        if spec.kind is not LayerKind.FULL:
            raise ValueError(f"group {group.group_id!r}: fa3 serves full layers, got {spec.kind}")
        kv_dtype = constraints.kv_dtype or spec.kv_dtype
        if kv_dtype != spec.dtype:
            raise ValueError(
                f"group {group.group_id!r}: fa3 needs kv_dtype == dtype ({spec.dtype}), got "
                f"{kv_dtype}"
            )
        if spec.head_dim_v != spec.head_dim:
            raise ValueError(
                f"group {group.group_id!r}: fa3 needs head_dim_v == head_dim, got "
                f"{spec.head_dim_v} and {spec.head_dim}"
            )
        if not spec.causal:
            raise ValueError(f"group {group.group_id!r}: fa3 serves causal layers only")
        self.window_left = spec.sliding_window - 1 if spec.sliding_window is not None else None
        self.softcap = provider.make_softcap(spec.logits_soft_cap)
        self._sinks: dict[int, torch.Tensor] = {}  # per layer: its sinks in bfloat16
        self.batch: AttentionBatch | None = None
        #: decode steps split over the KV range (see :mod:`attn_plugin_fa3.split_kv`); a
        #: window bounds the work already
        self._split_decode = provider.splits_kv and self.window_left is None
        #: a split decode of one request passes q[0] broadcast over its chunk rows (no copy)
        #: where the kernel was seen to read such rows right at this layer's shape
        self._page_size = page_size or spec.page_size
        self.broadcast_q = (
            self._split_decode
            and device is not None
            and broadcast_q_problem(provider, device, spec, self._page_size) is None
        )
        self._graphs = constraints.graph_mode is not GraphMode.NONE
        self._num_sms = 0
        #: graph mode: split metadata per padded batch size, at fixed addresses
        self._split_buffers: dict[int, split_kv.SplitMetadata] = {}
        self.split: split_kv.SplitMetadata | None = None  # this step's split, or None
        #: split decode: the chunk rows' output, log-sum-exp and query buffers per q shape
        #: (shared by the group's layers, which run one after another on one stream)
        self._chunk_buffers: dict[tuple, _ChunkBuffers] = {}
        self._retired_buffers: list[_ChunkBuffers] = []
        self._chunk_views: dict[tuple, _ChunkBuffers] = {}  # per (q shape, rows): views of them
        self.dense = False  # this step: prefill without cached prefix, no page table read

    def prepare(self, batch: AttentionBatch) -> None:
        if batch.page_table is None or batch.slot_mapping is None:
            self._bad(
                "batch", "a paged batch (BatchBuilder with a PersistentState and KV pages)", batch
            )
        self.batch = batch
        self.split = self._plan_split(batch) if batch.mode is BatchMode.DECODE else None
        self.dense = (
            batch.mode is BatchMode.PREFILL
            and self.provider.runs_dense
            and not self._graphs
            and int(batch.context_lens_cpu[: batch.num_reqs].max()) == 0
        )

    # Every tensor the call reads lives in the builder's persistent buffers (the split metadata
    # of graph mode in this context's, refilled here): a replay only needs the new batch.
    update = prepare

    def _plan_split(self, batch: AttentionBatch) -> split_kv.SplitMetadata | None:
        """This decode step's split, or None. Eager: from the step's real lengths. Graph mode:
        from the capacity of the page table per padded batch size, so that a captured graph
        and every later replay of that size agree, refilled in place each step."""
        if not self._split_decode or batch.page_table is None or batch.page_size is None:
            return None
        if not self._num_sms:
            self._num_sms = split_kv.sm_count(batch.seq_lens.device)
        hkv = self.spec.num_kv_heads
        if not self._graphs:  # the chunks cover the cached context, the new token is merged
            plan = split_kv.plan_splits(
                batch.num_reqs, batch.max_seq_len - 1, batch.page_size, hkv, self._num_sms
            )
            if plan is None:
                return None
            return split_kv.build_metadata(plan, batch.page_table, batch.seq_lens[: batch.num_reqs])
        rows = batch.padded_reqs
        capacity = batch.page_table.shape[1] * batch.page_size
        plan = split_kv.plan_splits(rows, capacity, batch.page_size, hkv, self._num_sms)
        if plan is None:
            return None
        kept = self._split_buffers.get(rows)
        if kept is None or kept.plan != plan:
            kept = split_kv.build_metadata(plan, batch.page_table, batch.seq_lens[:rows])
            self._split_buffers[rows] = kept
            return kept
        # refilled in place: the page table stays a view of the builder's (no copy) where the
        # step's table has the split's width, the chunk lengths take two launches
        return split_kv.build_metadata(plan, batch.page_table, batch.seq_lens[:rows], out=kept)

    def _bad(self, what: str, expected: object, got: object, layer: int | None = None) -> NoReturn:
        raise BackendInputError(
            group=self.group.group_id,
            backend=self.backend.qualified_name,
            what=what if layer is None else f"layer {layer}: {what}",
            expected=expected,
            got=got,
        )

    def _sinks_for(self, layer: Any, device: torch.device) -> torch.Tensor | None:
        """The layer's sinks as the kernel wants them: ``[Hq]`` bfloat16 on the device, read
        at every call (a weight reload writes them in place): a bf16 tensor on the device as it
        is, another dtype copied into one bf16 buffer per layer (a captured graph replays the
        copy, so it too reads the current values)."""
        src = layer.sinks
        if src is None:
            return None
        if not self.provider.sinks:
            none = f"none ({self.provider.name} has no learnable sinks)"
            self._bad("sinks", none, "a tensor", layer.layer_index)
        src = src.detach()
        if src.dtype == torch.bfloat16 and src.device == device and src.is_contiguous():
            return src
        if (
            src.device != device
            and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        ):
            # a host-to-device copy cannot be captured: keep the model's sinks on its device
            self._bad(
                f"layer {layer.layer_index}: sinks device (captured)", str(device), str(src.device)
            )
        buffer = self._sinks.get(layer.layer_index)
        if buffer is None or buffer.shape != src.shape:
            buffer = torch.empty(src.shape, dtype=torch.bfloat16, device=device)
            self._sinks[layer.layer_index] = buffer
        buffer.copy_(src)
        return buffer

    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # a full layer's: the binding passes both
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """Write the new K/V, then attend.

        :param q: ``[padded_tokens, Hq, D]``; ``k``/``v`` ``[padded_tokens, Hkv, D]``.
        :param out: ``[padded_tokens, Hq, D]`` or None; used directly when contiguous.
        :returns: ``[padded_tokens, Hq, D]``; rows of padding tokens hold garbage.
        """
        batch = self.batch
        # never taken: the core prepares a batch first, and prepare() refuses one without these
        if batch is None or batch.page_table is None or batch.slot_mapping is None:
            self._bad("batch", "a prepared paged batch (prepare before forward)", batch)
        kv = layer.kv
        if kv.k.dtype != q.dtype:
            self._bad("KV cache dtype", q.dtype, kv.k.dtype, layer.layer_index)
        sinks = self._sinks_for(layer, q.device)
        if self.split is not None:  # the merge kernel stores the new K/V (after the chunks)
            check_kv_dtypes(k, v, kv.k, kv.v)
            return self._split_forward(
                self.split, q, k, v, kv.k, kv.v, batch.slot_mapping, out, layer.scale, sinks
            )
        padding = batch.padded_tokens != batch.num_tokens or (
            q.is_cuda and torch.cuda.is_current_stream_capturing()
        )
        write_kv(k, v, kv.k, kv.v, batch.slot_mapping, may_have_padding=padding)
        direct_out = (
            out if out is not None and out.dtype == q.dtype and out.is_contiguous() else None
        )
        if self.dense:
            return self.provider.run_dense(
                q,
                k,
                v,
                direct_out,
                cu_seqlens=batch.query_start_loc,
                max_seqlen=batch.max_query_len,
                scale=layer.scale,
                window_left=self.window_left,
                softcap=self.softcap,
                sinks=sinks,
            )
        return self.provider.run(
            q,
            kv.k,
            kv.v,
            direct_out,
            cu_seqlens_q=batch.query_start_loc,
            max_seqlen_q=batch.max_query_len,
            seqused_k=batch.seq_lens,
            max_seqlen_k=batch.max_seq_len,
            page_table=batch.page_table,
            scale=layer.scale,
            window_left=self.window_left,
            softcap=self.softcap,
            sinks=sinks,
        )

    def _split_forward(
        self,
        meta: split_kv.SplitMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor | None,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A decode step as ``S`` one-query chunk rows per request over the cached context,
        merged by log-sum-exp with the step's own key; the merge kernel also stores the new
        K/V. Launches: the chunk call and the merge, plus one copy of the query rows where
        there is more than one request (or the kernel was not seen to read broadcast rows)."""
        rows, splits = meta.num_reqs, meta.plan.num_splits
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        bufs = self._buffers(rows * splits, q)
        if rows == 1 and self.broadcast_q and meta.plan.page_size == self._page_size:
            q_rows = split_kv.query_rows(q[:1], splits, None)  # a view of q[0]: no launch
        else:
            q_rows = split_kv.query_rows(q[:rows], splits, bufs.q_rows)
        partial, lse = self.provider.run_with_lse(
            q_rows,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            seqused_k=meta.seqused_k,
            max_seqlen_k=meta.plan.chunk_tokens,
            page_table=meta.page_table,
            scale=scale,
            softcap=self.softcap,
            out=bufs.partial,
            lse=bufs.lse,
        )
        target = out if out is not None and out.stride(-1) == 1 else torch.empty_like(q)
        split_kv.merge(
            partial, lse, meta, sinks, target, q=q, k=k, v=v, k_cache=k_cache,
            v_cache=v_cache, slot_mapping=slot_mapping, scale=scale,
            softcap=self.spec.logits_soft_cap,
        )  # fmt: skip
        return target

    def _buffers(self, n: int, q: torch.Tensor) -> _ChunkBuffers:
        """Views of ``n`` chunk rows into this context's buffers for q's heads, dtype and
        device: allocated once, for the most rows a split makes (``num_sms // num_kv_heads``:
        one wave of CTAs), on a layer's first split step, which runs eagerly before any capture.
        A larger ``n`` allocates anew and keeps the old buffers alive (a captured graph may
        read them)."""
        h, d = q.shape[1], q.shape[2]
        key = (h, d, q.dtype, q.device)
        views = self._chunk_views.get((key, n))
        if views is not None:
            return views
        flat = self._chunk_buffers.get(key)
        if flat is None or flat.lse.numel() < h * n:
            if flat is not None:
                self._retired_buffers.append(flat)
                self._chunk_views.clear()
            rows = max(n, self._num_sms // self.spec.num_kv_heads)
            flat = self._chunk_buffers[key] = _ChunkBuffers(
                partial=torch.empty(rows * h * d, dtype=q.dtype, device=q.device),
                lse=torch.empty(rows * h, dtype=torch.float32, device=q.device),
                q_rows=torch.empty(rows * h * d, dtype=q.dtype, device=q.device),
            )
        views = self._chunk_views[(key, n)] = _ChunkBuffers(
            partial=flat.partial[: n * h * d].view(n, h, d),
            lse=flat.lse[: h * n].view(h, n),
            q_rows=flat.q_rows[: n * h * d].view(n, h, d),
        )
        return views


@dataclass(frozen=True, slots=True)
class _ChunkBuffers:
    """Split decode's buffers: ``partial`` ``[N, H, D]`` and ``lse`` ``[H, N]`` float32 the
    chunk kernel writes (where its private entry point is on), ``q_rows`` ``[N, H, D]`` the
    query rows copied for it (a context keeps them flat, with room for the most rows)."""

    partial: torch.Tensor
    lse: torch.Tensor
    q_rows: torch.Tensor
