"""attn-core hook implementations of the FlashInfer plugin (entry point ``flashinfer``).

Backends, both priority 100 (above the reference's 0):

- ``flashinfer:flashinfer``: full attention (see :data:`capability.FULL_CAPABILITIES`),
  attention sinks included.
- ``flashinfer:flashinfer_mla``: absorbed MLA (see :data:`capability.MLA_CAPABILITIES`).

Both register on every machine; where CUDA, flashinfer or nvcc is missing they register with
``available=False`` and the reason (``attn list`` shows it; the selector rejects them with code
``unavailable``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from attn_core.backend import Backend, SelfCheck
from attn_core.hookspecs import hookimpl
from attn_core.specs import GraphMode, LayerKind
from attn_plugin_flashinfer import __version__, capability, compat
from attn_plugin_flashinfer import context as ctx

ATTN_CORE_API_VERSION = "1.2"  # attn_core_self_check
PRIORITY = 100
FULL_BACKEND = "flashinfer"
MLA_BACKEND = "flashinfer_mla"

__all__ = [
    "ATTN_CORE_API_VERSION",
    "FULL_BACKEND",
    "MLA_BACKEND",
    "PRIORITY",
    "attn_core_allocate_context",
    "attn_core_bind_forward",
    "attn_core_register_backends",
    "attn_core_self_check",
    "attn_core_workspace_requirements",
    "backends",
]


def backends(availability: capability.Availability | None = None) -> list[Backend]:
    """The two backends this plugin advertises, marked with this machine's availability."""
    av = capability.probe() if availability is None else availability
    version = f"{__version__} (flashinfer {av.version})" if av.version else __version__
    # whether the version-gated fast path (compat.py) is on, and why not
    notes = compat.installed_note() if _flashinfer_installed() else ""
    common: dict[str, Any] = dict(
        priority=PRIORITY,
        version=version,
        available=av.available,
        unavailable_reason=av.reason,
    )
    full, mla = capability.FULL_CAPABILITIES, capability.MLA_CAPABILITIES
    # graph modes follow the installed release: those its kit run failed are not declared (MLA
    # graph decode on 0.7; the note goes with the MLA backend)
    full_graph, mla_graph, mla_graph_note = capability.graph_modes(av.version)
    full_note = ""
    if capability.outside_supported(av.version):
        # not a release the kit ran on: no captured mixed step, no sinks (the rescale reads
        # run()'s log-sum-exp in base 2, a release's convention), no MLA graph decode
        full_graph, mla_graph = full_graph - {GraphMode.FULL}, frozenset({GraphMode.NONE})
        full = dataclasses.replace(full, sinks=False)
        full_note = mla_graph_note = (
            f"flashinfer {av.version} is outside the supported releases "
            f"({capability.SUPPORTED_RELEASES}): no sinks, graph modes none/decode (MLA: none)"
        )
    full = dataclasses.replace(full, graph_modes=full_graph)
    mla = dataclasses.replace(mla, graph_modes=mla_graph)
    return [
        Backend(
            name=FULL_BACKEND,
            capabilities=full,
            notes="; ".join(n for n in (notes, full_note) if n),
            description=(
                "FlashInfer paged attention: decode, prefill, mixed (CUDA graphs: decode and "
                "full), speculative verify; GQA/MQA, sliding window, soft-cap, sinks, fp8 KV"
            ),
            **common,
        ),
        Backend(
            name=MLA_BACKEND,
            capabilities=mla,
            description="FlashInfer MLA (absorbed; rank 512, rope 64) over the latent cache",
            notes="; ".join(n for n in (notes, mla_graph_note) if n),
            **common,
        ),
    ]


def _flashinfer_installed() -> bool:
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


@hookimpl
def attn_core_register_backends(register: Callable[[Backend], None]) -> None:
    for backend in backends():
        register(backend)


@hookimpl
def attn_core_workspace_requirements(backend, group, device, constraints):
    return ctx.workspace_requirements(group.spec, constraints)


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, state, workspace):
    if group.spec.kind is LayerKind.MLA:
        return ctx.MLAContext(backend, group, constraints, workspace)
    if group.spec.kind is LayerKind.FULL:
        return ctx.FullAttentionContext(backend, group, constraints, workspace)
    raise ValueError(
        f"flashinfer serves full and mla layers; group {group.group_id!r} is "
        f"{group.spec.kind.value}"
    )


@hookimpl
def attn_core_bind_forward(backend, context):
    # The context's bound method: one direct call per layer per step, no hook dispatch.
    return context.forward


@hookimpl
def attn_core_self_check(backend: Backend, device: torch.device) -> SelfCheck | None:
    """The fast plan's self-check (:meth:`compat.FastPath.self_check`, its default tiny bf16
    case) on ``device`` now rather than in the first context of that configuration (every
    other configuration is checked where its first context is allocated); a failure holds for
    the process. Both backends share the fast path, so both report it."""
    if not _flashinfer_installed():
        return None
    import flashinfer

    fast = compat.fast_path(flashinfer)
    fast.self_check(device)
    notes = {b.name: b.notes for b in backends()}[backend.name]
    failed = (f"fast plan: {fast.off_reason()}",) if fast.check else ()
    return SelfCheck(notes, failed)
