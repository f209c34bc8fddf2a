"""Exceptions of attn-core. Every message names who failed, what was expected and what came."""

from __future__ import annotations

__all__ = [
    "AttnCoreError",
    "BackendInputError",
    "NonFiniteInputError",
    "PluginError",
    "PluginLoadError",
    "SelectionError",
]


class AttnCoreError(Exception):
    """Base class of the errors attn-core raises on purpose."""


class PluginLoadError(AttnCoreError):
    """A plugin could not be loaded (strict mode); carries the plugin name and the reason."""

    def __init__(self, plugin: str, reason: str) -> None:
        super().__init__(f"plugin {plugin!r} was not loaded: {reason}")
        self.plugin = plugin
        self.reason = reason


class PluginError(AttnCoreError):
    """Plugin code failed at run time: it raised, or returned what the contract rules out.

    Names the plugin, the backend and the stage (``forward``, ``prepare``, ...) and, where one
    layer was running, the layer group and the layer.

    :ivar backend: the backend's short name (``plugin:backend`` is its qualified name).
    :ivar group: the layer group's id, or None for a failure outside one group.
    :ivar layer: the layer index, or None for a failure outside one layer's call.
    """

    def __init__(
        self,
        plugin: str,
        backend: str,
        stage: str,
        cause: BaseException,
        *,
        group: str | None = None,
        layer: int | None = None,
    ) -> None:
        where = ""
        if group is not None:
            where = f"layer group {group!r}, " + (f"layer {layer}, " if layer is not None else "")
        super().__init__(
            f"{where}plugin {plugin!r}, backend {plugin + ':' + backend!r} failed in {stage}: "
            f"{type(cause).__name__}: {cause}"
        )
        self.plugin = plugin
        self.backend = backend
        self.stage = stage
        self.group = group
        self.layer = layer


class SelectionError(AttnCoreError):
    """No backend (or not the forced one) can serve a layer group; the message lists why."""


class BackendInputError(ValueError, AttnCoreError):
    """Bad input reached a backend: names group, backend, what was expected and what came."""

    def __init__(self, *, group: str, backend: str, what: str, expected: object, got: object):
        super().__init__(
            f"layer group {group!r}, backend {backend!r}: {what}: expected {expected}, got {got}"
        )
        self.group = group
        self.backend = backend
        self.what = what
        self.expected = expected
        self.got = got


class NonFiniteInputError(BackendInputError):
    """A NaN or infinity in a tensor about to be written into a request's persistent state.

    Raised only when the finite check is on (``ExecutionConstraints(check_finite=True)`` or
    ``ATTN_CORE_CHECK_FINITE=1``), before the backend runs: the request's cache is unchanged.

    :ivar request_id: the request whose token holds the first non-finite value (None for a
        per-layer input such as ``A_log``).
    :ivar tensor: the input's name (``"k"``, ``"v"``, ``"q"``, ``"g"``, ...).
    :ivar position: the token's index among the request's new tokens of this step, or None.
    """

    def __init__(
        self,
        *,
        group: str,
        backend: str,
        layer: int,
        tensor: str,
        request_id: object,
        position: int | None,
        value: float,
        source: str,
    ) -> None:
        if position is None:
            where = f"layer {layer}: {tensor} (a per-layer input)"
        else:
            where = f"layer {layer}: {tensor} of request {request_id!r}, new token {position}"
        super().__init__(
            group=group,
            backend=backend,
            what=where,
            expected=f"finite values (checked because {source})",
            got=str(value),
        )
        self.layer = layer
        self.tensor = tensor
        self.request_id = request_id
        self.position = position
