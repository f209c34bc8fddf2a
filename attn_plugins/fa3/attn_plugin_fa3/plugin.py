"""attn-core hooks of the fa3 plugin (entry point ``fa3``): full attention over the core's paged
KV through the FlashAttention-3 API (flash-attn-4's Hopper path, else the official FA3 build).

Per step and layer the context writes the new tokens' K/V into the paged cache by
``batch.slot_mapping`` (:mod:`attn_plugin_fa3.kv_write`) and then runs one varlen call over the
whole batch: ``cu_seqlens_q = batch.query_start_loc``, ``seqused_k = batch.seq_lens`` (KV length
including the new tokens), ``page_table = batch.page_table``. The kernel aligns each request's
queries to the end of its ``seqused_k`` keys, which is where the core puts them, so prefill
chunks, decodes, mixed and speculative-verify steps are all the same call.

CUDA graphs (mode ``decode``): every tensor the call reads is a view of a persistent buffer of the
:class:`attn_core.batch.BatchBuilder` (same address for the same padded size), no length is read
back from the device, padding tokens (slot ``-1``) write nothing, and flash-attn-4 uses
``max_seqlen_q`` / ``max_seqlen_k`` only on the host to pick a split count it ignores on sm90.
Run one eager step per padded batch size before capturing (the first call of a configuration
JIT-compiles the kernel, 2-4 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch

from attn_core.backend import Backend, BackendCapabilities
from attn_core.batch import AttentionBatch
from attn_core.errors import BackendInputError
from attn_core.hookspecs import hookimpl
from attn_core.specs import ExecutionConstraints, GraphMode, LayerGroup, LayerKind, Phase
from attn_plugin_fa3 import __version__, providers
from attn_plugin_fa3.kv_write import write_kv

if TYPE_CHECKING:
    from attn_core.binding import LayerAttentionBinding

ATTN_CORE_API_VERSION = "1.1"

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
        kv_dtypes={"bfloat16", "float16"},  # must equal the layer dtype (checked at allocation)
        head_dims=head_dims,
        page_sizes=PAGE_SIZES,
        kv_layouts={"NHD"},
        graph_modes={GraphMode.NONE, GraphMode.DECODE},
        max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
        causal=True,
        non_causal=False,  # decoder attention over a KV cache; see providers (tile_n)
        sliding_window=True,
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
        available=ok,
        unavailable_reason=None if ok else (reason or "disabled"),
    )


@hookimpl
def attn_core_register_backends(register) -> None:
    register(make_backend())


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, state, workspace):
    provider, reason = probe()
    if provider is None:
        raise RuntimeError(f"{backend.qualified_name} cannot run: {reason}")
    return FA3Context(backend, group, provider, constraints)


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
    ) -> None:
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
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batch: AttentionBatch | None = None

    def prepare(self, batch: AttentionBatch) -> None:
        if batch.page_table is None or batch.slot_mapping is None:
            self._bad(
                "batch", "a paged batch (BatchBuilder with a PersistentState and KV pages)", batch
            )
        self.batch = batch

    # Every tensor the call reads lives in the builder's persistent buffers: a replay only needs
    # the new batch recorded.
    update = prepare

    def _bad(self, what: str, expected: object, got: object) -> NoReturn:
        raise BackendInputError(
            group=self.group.group_id,
            backend=self.backend.qualified_name,
            what=what,
            expected=expected,
            got=got,
        )

    def _sinks_for(self, layer: Any, device: torch.device) -> torch.Tensor | None:
        """The layer's sinks as the kernel wants them: ``[Hq]`` bfloat16 on the device, cached
        per layer (converted once, outside any graph capture, on the first call)."""
        src = layer.sinks
        if src is None:
            return None
        if not self.provider.sinks:
            self._bad("sinks", f"none ({self.provider.name} has no learnable sinks)", "a tensor")
        cached = self._sinks.get(layer.layer_index)
        if cached is None or cached[0] is not src:
            converted = src.detach().to(device=device, dtype=torch.bfloat16).contiguous()
            cached = (src, converted)
            self._sinks[layer.layer_index] = cached
        return cached[1]

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
            self._bad("KV cache dtype", q.dtype, kv.k.dtype)
        padding = batch.padded_tokens != batch.num_tokens or (
            q.is_cuda and torch.cuda.is_current_stream_capturing()
        )
        write_kv(k, v, kv.k, kv.v, batch.slot_mapping, may_have_padding=padding)
        direct_out = (
            out if out is not None and out.dtype == q.dtype and out.is_contiguous() else None
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
            sinks=self._sinks_for(layer, q.device),
        )
