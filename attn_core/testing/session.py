"""The kit's session: which registry, which backend, which device, which seed.

Built once per pytest run by :func:`build_session` (only when ``--attn-backend`` is given).
"""

from __future__ import annotations

import importlib
import secrets
from dataclasses import dataclass, field

import torch

from attn_core.backend import Backend
from attn_core.errors import SelectionError
from attn_core.registry import REFERENCE_BACKEND, Registry
from attn_core.specs import DeviceCapabilities

__all__ = ["REFERENCE", "KitError", "KitSession", "build_session", "load_plugin_object"]

#: The ground truth every check compares with.
REFERENCE = REFERENCE_BACKEND  # the kit compares every backend with it
REFERENCE_PLUGIN = "attn_core"


class KitError(Exception):
    """A usage problem of the kit (unknown backend, unimportable ``--attn-plugin``)."""


@dataclass(slots=True)
class KitSession:
    """Everything a battery item needs to know about the run.

    :ivar registry: the registry holding the backend under test and the reference.
    :ivar backend: the backend under test.
    :ivar reference: the reference backend.
    :ivar device: the torch device the checks run on (None: nothing runs, see ``skip_reason``).
    :ivar device_caps: its description, passed to the backend's hooks.
    :ivar seed: base seed; each item derives its own from it and its id.
    :ivar quick: run the reduced matrix.
    :ivar skip_reason: why every item is skipped (backend unavailable, no usable device).
    """

    registry: Registry
    backend: Backend
    reference: Backend
    device: torch.device | None
    device_caps: DeviceCapabilities | None
    seed: int
    quick: bool = False
    skip_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def backend_name(self) -> str:
        return self.backend.qualified_name

    @property
    def device_label(self) -> str:
        if self.device is None:
            return "no device"
        return self.device_caps.short() if self.device_caps is not None else str(self.device)

    @property
    def has_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def header_lines(self) -> list[str]:
        mode = "quick" if self.quick else "full"
        lines = [
            f"attn-core conformance: backend {self.backend_name} vs {REFERENCE}, "
            f"device {self.device_label}, {mode} matrix, seed {self.seed} "
            f"(rerun with --attn-seed={self.seed})"
        ]
        if self.skip_reason:
            lines.append(f"attn-core conformance: every check is skipped: {self.skip_reason}")
        lines += [f"attn-core conformance: {n}" for n in self.notes]
        return lines


def load_plugin_object(spec: str) -> tuple[str, object]:
    """``"[NAME=]MODULE[:OBJECT]"`` -> ``(name, object)``; NAME defaults to the module's last part.

    OBJECT may be a dotted attribute path (``pkg.mod:Plugin`` or ``pkg.mod:plugins.broken``).
    """
    name, sep, target = spec.partition("=")
    if not sep:
        name, target = "", spec
    module_name, _, attr = target.partition(":")
    if not module_name:
        raise KitError(f"--attn-plugin={spec!r}: expected '[NAME=]MODULE[:OBJECT]'")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise KitError(
            f"--attn-plugin={spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise KitError(
                f"--attn-plugin={spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return (name or module_name.rpartition(".")[2]), obj


def _ensure_reference(registry: Registry) -> None:
    """Every check needs the reference: register it when discovery did not (source checkout)."""
    try:
        registry.resolve(REFERENCE)
        return
    except SelectionError:
        pass
    from attn_core.reference import plugin as reference_plugin

    name = REFERENCE_PLUGIN if REFERENCE_PLUGIN not in registry.plugins else "attn_core_reference"
    registry.register_plugin(reference_plugin, name=name)


def _pick_device(backend: Backend, requested: str) -> tuple[torch.device | None, str | None]:
    types = backend.capabilities.device_types
    cuda = torch.cuda.is_available()
    if requested == "cuda":
        if not cuda:
            return None, "--attn-device=cuda but CUDA is not available"
        if "cuda" not in types:
            return None, f"--attn-device=cuda but the backend runs on {sorted(types)}"
        return torch.device("cuda"), None
    if requested == "cpu":
        if "cpu" not in types:
            return None, f"--attn-device=cpu but the backend runs on {sorted(types)}"
        return torch.device("cpu"), None
    if cuda and "cuda" in types:
        return torch.device("cuda"), None
    if "cpu" in types:
        return torch.device("cpu"), None
    have = "a CUDA device" if cuda else "CPU only (no CUDA)"
    return None, f"the backend runs on {sorted(types)}; this machine has {have}"


def build_session(
    *,
    backend_name: str,
    plugin_specs: list[str] | tuple[str, ...] = (),
    registry: Registry | None = None,
    quick: bool = False,
    seed: int | None = None,
    device: str = "auto",
) -> KitSession:
    """Resolve the backend under test and the device; raise :class:`KitError` on misuse.

    :param backend_name: ``vendor:name`` (or a unique short name).
    :param plugin_specs: ``[NAME=]MODULE[:OBJECT]`` plugin objects to register first.
    :param registry: use this registry instead of ``Registry.discover()``.
    :param quick: the reduced matrix.
    :param seed: base seed (None: a fresh random one).
    :param device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    """
    if registry is None:
        registry = Registry.discover()
    for spec in plugin_specs:
        name, obj = load_plugin_object(spec)
        if name in registry.plugins:
            raise KitError(f"--attn-plugin={spec!r}: a plugin named {name!r} is already loaded")
        registry.register_plugin(obj, name=name)
        if name in registry.quarantined:
            q = registry.quarantined[name]
            raise KitError(f"--attn-plugin={spec!r} was quarantined ({q.stage}): {q.reason}")
    _ensure_reference(registry)
    try:
        backend = registry.resolve(backend_name)
    except SelectionError as exc:
        # Registry.resolve says why when the plugin the name points at is quarantined or was
        # skipped; otherwise every quarantined plugin is listed with its reason.
        plugin = backend_name.partition(":")[0]
        placed = plugin in registry.skipped or any(
            q.plugin == plugin for q in registry.quarantined.values()
        )
        quarantined = "; ".join(
            f"{q.plugin} ({q.stage}): {q.reason}" for q in registry.quarantined.values()
        )
        extra = f"; quarantined plugins: {quarantined}" if quarantined and not placed else ""
        raise KitError(f"--attn-backend={backend_name}: {exc}{extra}") from None
    reference = registry.resolve(REFERENCE)
    skip_reason = None
    if not backend.available:
        skip_reason = (
            f"backend {backend.qualified_name} is unavailable: {backend.unavailable_reason}"
        )
    dev, why = _pick_device(backend, device)
    caps = None
    if dev is None:
        skip_reason = skip_reason or why
    else:
        caps = DeviceCapabilities.detect(dev)
        cc = caps.compute_capability
        lo = backend.capabilities.min_compute_capability
        hi = backend.capabilities.max_compute_capability
        if cc is not None and ((lo is not None and cc < lo) or (hi is not None and cc > hi)):
            skip_reason = skip_reason or (
                f"the backend needs compute capability in [{lo}, {hi}], the device has {cc}"
            )
    session = KitSession(
        registry=registry,
        backend=backend,
        reference=reference,
        device=dev,
        device_caps=caps,
        seed=seed if seed is not None else secrets.randbelow(2**31),
        quick=quick,
        skip_reason=skip_reason,
    )
    if backend.qualified_name == REFERENCE:
        session.notes.append("the backend under test is the reference itself (a self-check)")
    return session
