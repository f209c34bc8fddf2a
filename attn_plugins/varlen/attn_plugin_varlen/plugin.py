"""attn-core hooks of the varlen plugin (entry point ``varlen``): encoder attention backends.

``varlen:varlen`` runs :func:`torch.nn.attention.varlen.varlen_attn`, ``varlen:sdpa`` runs SDPA
per run of equal-length sequences. Both are CUDA-only: on CPU neither beats the reference
backend (measured on the 2-core CI machine: SDPA per sequence was 0.6x-2.2x the reference's time,
i.e. sometimes slower), so a CPU advertisement would only add a second slow path.

A backend that cannot run here still registers, with ``available=False`` and the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from attn_core.backend import Backend, BackendCapabilities
from attn_core.batch import AttentionBatch, BatchMode
from attn_core.errors import BackendInputError
from attn_core.hookspecs import hookimpl
from attn_core.specs import GraphMode, LayerGroup, LayerKind
from attn_plugin_varlen import __version__, kernels

if TYPE_CHECKING:
    from attn_core.binding import LayerAttentionBinding

ATTN_CORE_API_VERSION = "1.1"

VARLEN = "varlen"
SDPA = "sdpa"
#: FlashAttention-2 (inside torch) head dims: multiples of 8 up to 256.
VARLEN_HEAD_DIMS = frozenset(range(8, 257, 8))


def varlen_capabilities(*, window: bool = True) -> BackendCapabilities:
    """What ``varlen_attn`` serves (``window=False`` for a torch whose varlen_attn has none)."""
    return BackendCapabilities(
        kinds={"encoder"},
        device_types={"cuda"},
        min_compute_capability=(8, 0),  # FlashAttention-2
        dtypes={"bfloat16", "float16"},
        head_dims=VARLEN_HEAD_DIMS,
        graph_modes={GraphMode.NONE},
        causal=True,
        non_causal=True,
        sliding_window=window,
        logits_soft_cap=False,  # varlen_attn has no soft-cap argument
        sinks=False,
        deterministic=True,  # forward only, no split-KV atomics
    )


def sdpa_capabilities() -> BackendCapabilities:
    """What the SDPA-per-sequence path serves."""
    return BackendCapabilities(
        kinds={"encoder"},
        device_types={"cuda"},
        dtypes={"float32", "bfloat16", "float16"},
        head_dims=None,
        graph_modes={GraphMode.NONE},  # reads host offsets each step: not capturable
        causal=True,
        non_causal=True,
        sliding_window=True,  # as a boolean band mask (memory-efficient kernel)
        chunked_attention=False,  # the band mask is built for windows only
        logits_soft_cap=False,
        sinks=False,
        deterministic=True,
    )


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return (
            f"CUDA is not available (torch {torch.__version__}: torch.cuda.is_available() is False)"
        )
    return None


def make_backends(*, available: bool | None = None) -> list[Backend]:
    """The two backends as this machine sees them.

    :param available: None probes the machine; True/False overrides the verdict (tests use it to
        plan for an H200 from a CPU machine).
    """
    info, missing = kernels.probe_varlen_attn()
    cuda = _cuda_reason()
    varlen_reason = "; ".join(r for r in (cuda, missing) if r) or None
    varlen_ok = varlen_reason is None if available is None else available
    window = info.window if info is not None else True
    backends = [
        Backend(
            name=VARLEN,
            capabilities=varlen_capabilities(window=window),
            # below SDPA: on sm90 varlen_attn ran 0.5-0.8x SDPA's rate at every encoder shape
            # bench_varlen.py times, ragged batches too (docs/results.md)
            priority=40,
            description="torch.nn.attention.varlen.varlen_attn (FlashAttention-2), one launch per "
            "ragged batch",
            version=f"attn-plugin-varlen {__version__}, torch {torch.__version__}",
            available=varlen_ok,
            unavailable_reason=None if varlen_ok else (varlen_reason or "disabled"),
        ),
    ]
    sdpa_ok = cuda is None if available is None else available
    backends.append(
        Backend(
            name=SDPA,
            capabilities=sdpa_capabilities(),
            priority=50,
            description="torch SDPA per run of equal-length sequences (host offsets, no sync)",
            version=f"attn-plugin-varlen {__version__}, torch {torch.__version__}",
            available=sdpa_ok,
            unavailable_reason=None if sdpa_ok else (cuda or "disabled"),
        )
    )
    return backends


@hookimpl
def attn_core_register_backends(register) -> None:
    for backend in make_backends():
        register(backend)


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, workspace):
    if group.spec.kind is not LayerKind.ENCODER:
        raise ValueError(
            f"group {group.group_id!r}: {backend.qualified_name} serves encoder layers, "
            f"got kind={group.spec.kind.value!r}"
        )
    if backend.name == VARLEN:
        info, reason = kernels.probe_varlen_attn()
        if info is None:
            raise RuntimeError(f"{backend.qualified_name} cannot run: {reason}")
        return VarlenContext(backend, group, info)
    return SdpaContext(backend, group)


@hookimpl
def attn_core_bind_forward(backend, context):
    return context.forward


class _EncoderContext:
    """Shared life cycle: encoder batches need no planning beyond remembering the batch."""

    def __init__(self, backend: Backend, group: LayerGroup) -> None:
        self.backend = backend
        self.group = group
        self.spec = group.spec
        self.batch: AttentionBatch | None = None

    def prepare(self, batch: AttentionBatch) -> None:
        if batch.mode is not BatchMode.ENCODER:
            self._bad("batch mode", "an encoder batch (BatchBuilder.build_encoder)", batch.mode)
        # The kernels cut the tokens by these offsets and check nothing: offsets that go back
        # or stop short gave zero rows, past the end a bare reshape error.
        cu = batch.query_start_loc_cpu
        n, T = batch.num_reqs, batch.num_tokens
        offsets = cu[: n + 1] if cu is not None else None
        if (
            offsets is None
            or len(offsets) != n + 1
            or offsets[0] != 0
            or offsets[-1] != T
            or bool((np.diff(offsets) < 0).any())
        ):
            got = None if cu is None else [int(x) for x in cu]
            self._bad(
                "query_start_loc",
                f"{n + 1} offsets from 0 to {T}, non-decreasing (one sequence each)",
                got,
            )
        self.batch = batch

    update = prepare

    def _bad(self, what: str, expected: object, got: object) -> NoReturn:
        raise BackendInputError(
            group=self.group.group_id,
            backend=self.backend.qualified_name,
            what=what,
            expected=expected,
            got=got,
        )

    def _batch(self) -> AttentionBatch:
        """The prepared batch (the core prepares one before any forward)."""
        batch = self.batch
        if batch is None:
            self._bad("batch", "a prepared encoder batch (prepare before forward)", None)
        return batch


class VarlenContext(_EncoderContext):
    """``varlen_attn`` over the whole ragged batch: ``cu_seqlens`` on the device,
    ``max_query_len`` from the host."""

    def __init__(self, backend: Backend, group: LayerGroup, info: kernels.VarlenAttnInfo) -> None:
        super().__init__(backend, group)
        if self.spec.head_dim_v != self.spec.head_dim:
            # BackendCapabilities cannot say "head_dim_v must equal head_dim"; say it here.
            raise ValueError(
                f"group {group.group_id!r}: varlen_attn (FlashAttention-2) needs head_dim_v == "
                f"head_dim, got {self.spec.head_dim_v} and {self.spec.head_dim}"
            )
        self.info = info

    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the binding passes k and v for encoder layers
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        return kernels.run_varlen_attn(
            self.info,
            q,
            k,
            v,
            batch.query_start_loc,
            batch.max_query_len,
            scale=layer.scale,
            causal=spec.causal,
            sliding_window=spec.sliding_window,
            out=out,
        )


class SdpaContext(_EncoderContext):
    """SDPA per run of equal-length sequences, offsets read from the batch's host mirror."""

    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the binding passes k and v for encoder layers
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        return kernels.sdpa_varlen(
            q,
            k,
            v,
            batch.query_start_loc_cpu,
            scale=layer.scale,
            causal=spec.causal,
            sliding_window=spec.sliding_window,
            out=out if out is not None and out.dtype == q.dtype else None,
        )
