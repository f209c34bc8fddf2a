"""The plugin contract: pluggy hook specifications of project ``attn_core``.

A plugin is a module (or object) found through the ``attn_core`` entry-point group. It declares
the contract version it was written for as ``ATTN_CORE_API_VERSION = "1.2"`` and implements
some of the hooks below with :data:`hookimpl`. pluggy lets an implementation accept a subset of
a spec's arguments, so arguments added in a later minor version never break an older plugin.

Versions of the contract (``major.minor``; a plugin is loaded when its major equals the core's
and its minor is not newer):

- 1.0: ``attn_core_register_backends``, ``attn_core_allocate_context`` (without ``workspace``).
- 1.1: ``workspace`` argument to ``attn_core_allocate_context``,
  ``attn_core_workspace_requirements`` and ``attn_core_bind_forward``.
- 1.2: ``attn_core_self_check`` (optional: ``attn list --self-check`` runs a backend's
  fast-path self-checks before serving instead of at first use).

Life cycle, for each layer group of a model:

1. ``attn_core_register_backends`` once, when the registry loads the plugin (cold).
2. The selector picks one advertised backend per group (cold, no plugin code runs).
3. ``attn_core_workspace_requirements`` then ``attn_core_allocate_context`` of the owning plugin
   only (cold, once per group). The core allocates the workspace once, sized for the largest batch.
4. ``attn_core_bind_forward`` of the owning plugin (cold, once per context) returns the callable
   the core binds into every layer of the group.
5. Per step: ``context.prepare(batch)`` once per group (or ``context.update(batch)`` before a CUDA
   graph replay), then the bound forward once per layer: a direct call, never a pluggy broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from attn_core.backend import Backend, SelfCheck
    from attn_core.context import AttentionContext, WorkspaceRequirement
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerGroup
    from attn_core.state import PersistentState
    from attn_core.workspace import Workspace

PROJECT = "attn_core"
#: The contract version this core implements, ``(major, minor)``.
API_VERSION: tuple[int, int] = (1, 2)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ------------------------------------------------------------------------------------------
# Capability advertisement (cold: once per registry)
# ------------------------------------------------------------------------------------------
@hookspec
def attn_core_register_backends(register: Callable[[Backend], None]) -> None:
    """Advertise the backends this plugin provides.

    :param register: call it once per backend with a :class:`attn_core.backend.Backend`; the
        registry namespaces the name with the plugin name (``vendor:backend``), checks the
        capabilities and quarantines the whole plugin if one of them is malformed.
    :returns: None; backends are reported through ``register``.

    Called once per plugin when the registry loads it; every plugin is called (not firstresult).
    A backend that cannot run on this machine still registers, with ``available=False`` and an
    ``unavailable_reason`` (``"flashinfer is not importable: ..."``), so that ``attn list`` and
    the selector can say why it was not chosen, and with the capabilities it has where it runs:
    an offline plan for a target (``attn explain MODEL --target h200``) ranks it by them and
    marks it "not loadable here".
    """


# ------------------------------------------------------------------------------------------
# Context allocation (cold: once per layer group)
# ------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def attn_core_workspace_requirements(
    backend: Backend,
    group: LayerGroup,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
) -> Sequence[WorkspaceRequirement] | None:
    """Declare the scratch buffers the backend needs for this group (since API 1.1).

    :param backend: the backend chosen for ``group`` (one of this plugin's).
    :param group: the layer group; ``group.spec`` describes every layer in it.
    :param device: the device the context will run on.
    :param constraints: the run's demands; size buffers for ``max_batch_size``,
        ``max_num_tokens`` and ``speculative_tokens`` so one allocation serves every step and
        every captured CUDA graph.
    :returns: a list of :class:`attn_core.context.WorkspaceRequirement` (may be empty).

    Only the owning plugin's implementation is called (firstresult). The core allocates every
    buffer once per group and passes them as ``workspace`` to ``attn_core_allocate_context``.
    """


@hookspec(firstresult=True)
def attn_core_allocate_context(
    backend: Backend,
    group: LayerGroup,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    state: PersistentState | None,
    workspace: Workspace,
) -> AttentionContext | None:
    """Create the context that runs ``group`` with ``backend``.

    :param backend: the backend chosen for ``group`` (one of this plugin's), carrying the
        options in force in ``backend.options`` (``backend.option(key)``): every key of its
        ``option_schema``, the run's value or else the declared default (attn_core.options).
    :param group: the layer group it will serve.
    :param device: the device to run on.
    :param constraints: the run's demands (graph mode, batch limits, speculative tokens).
    :param state: the core's persistent state (paged KV, latent cache, conv and SSM state
        slots); None for encoder groups. Backends receive views of it and never own it.
    :param workspace: the buffers declared by ``attn_core_workspace_requirements`` (API 1.1).
    :returns: an object following :class:`attn_core.context.AttentionContext`.

    Only the owning plugin's implementation is called (firstresult). Errors raised here are
    re-raised by the core as :class:`attn_core.errors.PluginError` naming plugin and backend.
    """


# ------------------------------------------------------------------------------------------
# Forward (bound once per context; called directly per layer per step)
# ------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def attn_core_bind_forward(
    backend: Backend, context: AttentionContext
) -> Callable[..., Any] | None:
    """Return the per-layer forward callable of ``context`` (since API 1.1).

    :param backend: the backend that allocated ``context``.
    :param context: the context returned by ``attn_core_allocate_context``.
    :returns: ``fn(layer, q, k, v, out, **inputs) -> Tensor`` with the signature of
        :meth:`attn_core.context.AttentionContext.forward`; None to use ``context.forward``.

    Only the owning plugin's implementation is called (firstresult), once per context; the
    core stores the result in every
    :class:`attn_core.binding.LayerAttentionBinding` of the group, so the hot path pays one direct
    call per layer per step and no hook dispatch.
    """


# ------------------------------------------------------------------------------------------
# Self-check on request (cold: attn list --self-check)
# ------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def attn_core_self_check(backend: Backend, device: torch.device) -> SelfCheck | None:
    """Run ``backend``'s fast-path self-checks now on ``device`` (since API 1.2, optional).

    :param backend: one of this plugin's available backends.
    :param device: the CUDA device to check on (``torch.device("cuda", i)``).
    :returns: an :class:`attn_core.backend.SelfCheck`: the backend's notes line after the
        checks and which fast paths failed theirs (and are now off); None where the backend
        has no self-check.

    A backend whose fast path leans on a kernel library's internals checks it against the
    public API on a tiny case, by default at first use (the first context of the process).
    ``attn list --self-check`` calls this hook so that a server's operator sees the verdicts
    before serving; the verdicts hold for the rest of the process. Only the owning plugin's
    implementation is called (firstresult); an exception is reported as that backend's failed
    check, naming plugin and backend.
    """


__all__ = [
    "API_VERSION",
    "PROJECT",
    "attn_core_allocate_context",
    "attn_core_bind_forward",
    "attn_core_register_backends",
    "attn_core_self_check",
    "attn_core_workspace_requirements",
    "hookimpl",
    "hookspec",
]
