"""Exceptions of attn-core. Every message names who failed, what was expected and what came."""

from __future__ import annotations

__all__ = [
    "AttnCoreError",
    "BackendInputError",
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
    """An exception escaped plugin code at run time; names the plugin and the backend."""

    def __init__(self, plugin: str, backend: str, stage: str, cause: BaseException) -> None:
        super().__init__(
            f"plugin {plugin!r}, backend {backend!r} failed in {stage}: "
            f"{type(cause).__name__}: {cause}"
        )
        self.plugin = plugin
        self.backend = backend
        self.stage = stage


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
