"""Plugin discovery and the registry of advertised backends.

A :class:`Registry` owns one pluggy ``PluginManager`` (never a global one: registrations must not
leak between servers or tests). Plugins come from the ``attn_core`` entry-point group, or are
registered directly (``registry.register_plugin(module, name="mine")``).

A plugin that fails to import, declares an incompatible API version, raises in its
``attn_core_register_backends`` hook or advertises a malformed backend is *quarantined*: it is
recorded with its reason and everything it registered is dropped, while the other plugins load.

The plugin name ``attn_core`` belongs to the built-in reference (distribution ``attn-core``,
module ``attn_core.reference.plugin``): its entry point loads first, and another distribution's
entry point that claims the name, or loads the reference module under another name, is
quarantined with a reason naming that distribution.

Discovery cannot hang: before an entry point is imported here, it is imported and its register
hook called in a subprocess with a time limit (``plugin_timeout``, ``ATTN_CORE_PLUGIN_TIMEOUT``,
default 30 s; see :mod:`attn_core.probe`); a plugin that does not finish in time, or ends that
process, is quarantined and never imported here. Successful probes are cached per distribution
version, and attn-core's own reference is never probed.

Strict mode (``strict=True`` or ``ATTN_CORE_STRICT=1``) turns a quarantine into
:class:`PluginLoadError`. ``ATTN_CORE_PLUGINS_ALLOW`` / ``ATTN_CORE_PLUGINS_DENY`` (comma-separated
plugin names) filter what is loaded.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from attn_core import hookspecs, probe
from attn_core.backend import Backend, SelfCheck
from attn_core.errors import PluginError, PluginLoadError, SelectionError
from attn_core.specs import Phase

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Quarantined",
    "Registry",
    "parse_api_version",
]

ENTRY_POINT_GROUP = "attn_core"
#: The built-in reference: the plugin name, the distribution and the module that own it. No other
#: distribution may use the name or load the module as a plugin (see :func:`_reserved_name`).
REFERENCE_PLUGIN = "attn_core"
REFERENCE_DISTRIBUTION = "attn-core"
REFERENCE_MODULE = "attn_core.reference.plugin"
#: The reference's qualified name: the selector ranks it below every other admissible backend.
REFERENCE_BACKEND = f"{REFERENCE_PLUGIN}:reference"
ENV_STRICT = "ATTN_CORE_STRICT"
ENV_ALLOW = "ATTN_CORE_PLUGINS_ALLOW"
ENV_DENY = "ATTN_CORE_PLUGINS_DENY"


def _env_names(name: str) -> frozenset[str] | None:
    """The plugin names of a comma-separated variable; None when it is unset or blank.

    :raises ValueError: (naming the variable and the entry) a value that names no plugin, which
        would otherwise make an empty allow list, or an entry that cannot be a plugin name.
    """
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ValueError(
            f"{name}={value!r}: names no plugin; unset it, or give comma-separated plugin names"
        )
    for entry in names:
        if ":" in entry:
            raise ValueError(
                f"{name}={value!r}: entry {entry!r} is a backend name; the variable takes plugin "
                f"(entry-point) names, e.g. {entry.partition(':')[0]!r}"
            )
        if "=" in entry:
            raise ValueError(
                f"{name}={value!r}: entry {entry!r} is not a plugin name (entry-point names "
                "contain no '=')"
            )
    return frozenset(names)


def _canonical(distribution: str | None) -> str | None:
    """A distribution name as packaging compares them (``Attn_Core`` -> ``attn-core``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower() if distribution is not None else None


def _is_reference(ep: metadata.EntryPoint) -> bool:
    """Whether ``ep`` is attn-core's own entry point for the built-in reference.

    An entry point without a distribution was built by code running in this process (a bench, a
    test), which is trusted as :meth:`Registry.register_plugin` is; installed metadata always
    names its distribution.
    """
    dist = getattr(ep, "dist", None)
    return (
        ep.name == REFERENCE_PLUGIN
        and ep.value.strip() == REFERENCE_MODULE
        and (dist is None or _canonical(dist.name) == REFERENCE_DISTRIBUTION)
    )


def _reserved_name(ep: metadata.EntryPoint, dist_name: str | None, dist_version: str) -> str | None:
    """Why another distribution's entry point may not load: it claims the reference's plugin
    name, or it names the reference's module (which would take the module before attn-core's
    own entry point could); None when it may."""
    if _is_reference(ep):
        return None
    owner = f"distribution {dist_name!r} {dist_version}".rstrip() if dist_name else "an entry point"
    if ep.name == REFERENCE_PLUGIN:
        return (
            f"the plugin name {REFERENCE_PLUGIN!r} is reserved for attn-core's built-in "
            f"reference; {owner} declares it (entry point {ep.name} = {ep.value})"
        )
    if ep.value.strip().partition(":")[0].strip() == REFERENCE_MODULE:
        return (
            f"entry point {ep.name} = {ep.value} of {owner} names attn-core's built-in "
            "reference, which only attn-core registers"
        )
    return None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_api_version(value: object) -> tuple[int, int]:
    """``"1.1"`` / ``(1, 1)`` / ``1`` -> ``(1, 1)``; anything else raises ValueError."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, 0)
    if isinstance(value, str):
        parts = value.strip().split(".")
        if 1 <= len(parts) <= 2 and all(p.isdigit() for p in parts):
            return (int(parts[0]), int(parts[1]) if len(parts) == 2 else 0)
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value
    raise ValueError(f"ATTN_CORE_API_VERSION={value!r}: expected 'major.minor', e.g. '1.1'")


def api_incompatibility(version: tuple[int, int]) -> str | None:
    """Why a plugin written for ``version`` cannot load into this core, or None if it can."""
    major, minor = hookspecs.API_VERSION
    core = f"{major}.{minor}"
    if version[0] != major:
        return (
            f"written for attn-core plugin API {version[0]}.{version[1]}, this core implements "
            f"{core} (major versions must match)"
        )
    if version[1] > minor:
        return (
            f"written for attn-core plugin API {version[0]}.{version[1]}, newer than this core's "
            f"{core}: upgrade attn-core"
        )
    return None


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A plugin that was not loaded, and why."""

    plugin: str
    stage: str  # "import", "api-version", "register", "capabilities"
    reason: str
    distribution: str | None = None  # the distribution of its entry point, when known


@dataclass(slots=True)
class PluginInfo:
    """A loaded plugin and what it registered."""

    name: str
    version: str
    api_version: tuple[int, int]
    distribution: str | None
    backends: list[Backend] = field(default_factory=list)
    load_seconds: float = 0.0


class _Quarantine(Exception):
    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


class Registry:
    """Loaded plugins, their backends, and the quarantined ones.

    :param strict: raise :class:`PluginLoadError` instead of quarantining; default from
        ``ATTN_CORE_STRICT``.
    :param allow: plugin names to load (None: all); default from ``ATTN_CORE_PLUGINS_ALLOW``.
    :param deny: plugin names never loaded; default from ``ATTN_CORE_PLUGINS_DENY``.
    :param plugin_timeout: seconds an entry point may take to import and register, tried in a
        subprocess before it is imported here (:mod:`attn_core.probe`); 0 turns the probe off.
        Default from ``ATTN_CORE_PLUGIN_TIMEOUT``, else 30.
    :param probe_cache: where successful probes are remembered: a file path, False for nowhere,
        None for ``ATTN_CORE_PROBE_CACHE`` or else ``$XDG_CACHE_HOME/attn-core/plugin-probes.json``.
    :raises ValueError: ``ATTN_CORE_PLUGINS_ALLOW`` / ``_DENY`` names no plugin or holds an entry
        that cannot be a plugin name (a backend name ``vendor:name``, ``x=1``), or the time limit
        is not a finite number of seconds >= 0.
    """

    def __init__(
        self,
        *,
        strict: bool | None = None,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] | None = None,
        plugin_timeout: float | None = None,
        probe_cache: str | os.PathLike[str] | bool | None = None,
    ) -> None:
        self.strict = _env_flag(ENV_STRICT) if strict is None else strict
        self.plugin_timeout = probe.timeout_from(plugin_timeout)
        self._probe_cache = probe_cache
        self.allow = frozenset(allow) if allow is not None else _env_names(ENV_ALLOW)
        self.deny = frozenset(deny) if deny is not None else (_env_names(ENV_DENY) or frozenset())
        # Where each list came from, for the reasons in ``skipped`` (and so `attn list`).
        self._allow_source = (
            f"the allow list given to Registry (allow={sorted(self.allow or ())})"
            if allow is not None
            else f"{ENV_ALLOW}={os.environ.get(ENV_ALLOW)!r}"
        )
        self._deny_source = (
            f"the deny list given to Registry (deny={sorted(self.deny)})"
            if deny is not None
            else f"{ENV_DENY}={os.environ.get(ENV_DENY)!r}"
        )
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.quarantined: dict[str, Quarantined] = {}
        self.skipped: dict[str, str] = {}  # plugin -> why the allow/deny lists skipped it
        self._backends: dict[str, Backend] = {}
        self._objects: dict[str, object] = {}

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def discover(cls, *, group: str = ENTRY_POINT_GROUP, **kwargs: Any) -> Registry:
        """A registry with every plugin of the entry-point ``group`` loaded."""
        registry = cls(**kwargs)
        registry.load_entry_points(group)
        return registry

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Load every plugin of the entry-point ``group``; quarantine the ones that fail.

        attn-core's own entry point (the built-in reference) loads first; any other
        distribution's entry point that claims its name ``attn_core`` or its module is
        quarantined with a reason naming that distribution, so the reference can be neither
        shadowed nor pushed into quarantine. The others load in name order, each after a probe
        in a subprocess (:meth:`_probe`) showed that it finishes importing and registering
        within ``plugin_timeout``; one that does not is quarantined without being imported here.
        """
        eps = sorted(
            metadata.entry_points(group=group), key=lambda e: (not _is_reference(e), e.name)
        )
        todo: list[tuple[metadata.EntryPoint, str | None, str]] = []
        for ep in eps:
            if not self._admitted(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            dist_name = dist.name if dist is not None else None
            dist_version = dist.version if dist is not None else ""
            reserved = _reserved_name(ep, dist_name, dist_version)
            if reserved is not None:
                key = f"{ep.name} (from {dist_name or 'an unknown distribution'})"
                self._quarantine(ep.name, "register", reserved, distribution=dist_name, key=key)
                continue
            todo.append((ep, dist_name, dist_version))
        verdicts = self._probe(todo)
        for (ep, dist_name, dist_version), verdict in zip(todo, verdicts, strict=True):
            if verdict is not None and verdict.stage is not None:
                self._quarantine(ep.name, verdict.stage, verdict.reason, distribution=dist_name)
                continue
            start = time.perf_counter()
            try:
                obj = ep.load()
            except BaseException as exc:  # an import may raise anything, SystemExit included
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._quarantine(
                    ep.name, "import", f"{type(exc).__name__}: {exc}", distribution=dist_name
                )
                continue
            self._load(
                obj,
                ep.name,
                distribution=dist_name,
                version=dist_version,
                started=start,
            )

    def _probe(
        self, todo: Sequence[tuple[metadata.EntryPoint, str | None, str]]
    ) -> list[probe.ProbeResult | None]:
        """One probe verdict per entry point of ``todo`` (None: not probed), probes side by side.

        Not probed: everything when the limit is 0 or probes cannot run here, the reference
        (attn-core's own code, imported by this module's package already), and entry points whose
        distribution version passed a probe before (the cache).
        """
        verdicts: list[probe.ProbeResult | None] = [None] * len(todo)
        others = [i for i, (ep, _, _) in enumerate(todo) if not _is_reference(ep)]
        if not others or self.plugin_timeout == 0 or probe.probe_interpreter() is None:
            return verdicts
        cache = probe.ProbeCache.from_setting(self._probe_cache)
        keys = [probe.ProbeCache.key(ep, dist, version) for ep, dist, version in todo]
        need = [i for i in others if keys[i] not in cache]
        if not need:
            return verdicts
        timeout = self.plugin_timeout
        with ThreadPoolExecutor(max_workers=min(len(need), probe.MAX_PARALLEL)) as pool:
            results = pool.map(lambda i: probe.run_probe(todo[i][0], timeout), need)
            for i, result in zip(need, results, strict=True):
                verdicts[i] = result
                if result.finished:
                    cache.add(keys[i], result.seconds)
        cache.save()
        return verdicts

    def register_plugin(
        self, obj: object, *, name: str, version: str = "", distribution: str | None = None
    ) -> PluginInfo | None:
        """Register a plugin object (module, class or instance) directly, as entry points do."""
        if not self._admitted(name):
            return None
        return self._load(
            obj, name, distribution=distribution, version=version, started=time.perf_counter()
        )

    def _admitted(self, name: str) -> bool:
        if name in self.deny:
            self.skipped[name] = f"denied by {self._deny_source}"
            return False
        if self.allow is not None and name not in self.allow:
            self.skipped[name] = f"not in {self._allow_source}"
            return False
        return True

    def _load(
        self,
        obj: object,
        name: str,
        *,
        distribution: str | None,
        version: str,
        started: float,
    ) -> PluginInfo | None:
        if not isinstance(name, str) or not name or any(c in name for c in ":=, \t\n"):
            # backends are named plugin:backend; an empty name left them un-namespaced (taking
            # another plugin's short name), "a:b" made "a:b:x"
            self._quarantine(
                str(name),
                "register",
                f"plugin name {name!r}: expected a non-empty name without ':', '=', ',' or "
                "whitespace (its backends are named 'plugin:backend')",
                distribution=distribution,
            )
            return None
        if name in self.plugins or name in self.quarantined:
            if name in self.plugins:
                source = self.plugins[name].distribution or "a direct registration"
                why = f"a plugin named {name!r} is already registered (from {source})"
            else:
                first = self.quarantined[name]
                why = (
                    f"a plugin named {name!r} was quarantined before ({first.stage}: "
                    f"{first.reason}); the name stays taken"
                )
            key, n = f"{name} (duplicate)", 2
            while key in self.quarantined:  # every later one keeps its own record
                key, n = f"{name} (duplicate {n})", n + 1
            self._quarantine(name, "register", why, distribution=distribution, key=key)
            return None
        try:
            api = self._check_api_version(obj, name)
            self.pm.register(obj, name=name)
            self._check_hook_names(obj)
        except _Quarantine as q:
            if self.pm.is_registered(obj):
                self.pm.unregister(obj)
            self._quarantine(name, q.stage, q.reason, distribution=distribution)
            return None
        except Exception as exc:  # pluggy validates hookimpl signatures on register
            self._quarantine(
                name, "register", f"{type(exc).__name__}: {exc}", distribution=distribution
            )
            return None
        info = PluginInfo(
            name=name,
            version=version or str(getattr(obj, "__version__", "")),
            api_version=api,
            distribution=distribution,
        )
        try:
            info.backends = self._collect_backends(obj, name)
        except _Quarantine as q:
            self.pm.unregister(obj)
            self._quarantine(name, q.stage, q.reason, distribution=distribution)
            return None
        for backend in info.backends:
            self._backends[backend.qualified_name] = backend
        info.load_seconds = time.perf_counter() - started
        self.plugins[name] = info
        self._objects[name] = obj
        return info

    @staticmethod
    def _check_api_version(obj: object, name: str) -> tuple[int, int]:
        declared = getattr(obj, "ATTN_CORE_API_VERSION", None)
        if declared is None:
            raise _Quarantine(
                "api-version",
                "does not declare ATTN_CORE_API_VERSION (e.g. ATTN_CORE_API_VERSION = "
                f"'{hookspecs.API_VERSION[0]}.{hookspecs.API_VERSION[1]}')",
            )
        try:
            version = parse_api_version(declared)
        except ValueError as exc:
            raise _Quarantine("api-version", str(exc)) from None
        problem = api_incompatibility(version)
        if problem:
            raise _Quarantine("api-version", problem)
        return version

    def _check_hook_names(self, obj: object) -> None:
        """Every hook ``obj`` implements is one attn-core defines: pluggy takes a hook without
        a spec silently, so a misspelt ``attn_core_register_backend`` loaded a plugin that
        registered nothing."""
        unknown = sorted(
            c.name
            for c in self.pm.get_hookcallers(obj) or []
            if c.spec is None  # optionalhook=True: a later release's hook, meant to be absent
            and any(i.plugin is obj and not i.optionalhook for i in c.get_hookimpls())
        )
        if unknown:
            known = sorted(n for n in dir(self.pm.hook) if n.startswith("attn_core_"))
            raise _Quarantine(
                "register",
                f"implements {', '.join(unknown)}, which attn-core does not define (its hooks: "
                f"{', '.join(known)})",
            )

    def _collect_backends(self, obj: object, plugin: str) -> list[Backend]:
        collected: list[Backend] = []
        closed = False  # set once the hook returned; register reads it through its closure

        def register(backend: Backend) -> None:
            if closed:  # kept and called later: the registry would not see the backend
                raise RuntimeError(
                    f"plugin {plugin!r}: register() called after attn_core_register_backends "
                    "returned; register every backend inside the hook"
                )
            if not isinstance(backend, Backend):
                raise _Quarantine(
                    "capabilities",
                    f"register() takes attn_core.backend.Backend objects, "
                    f"got {type(backend).__name__}",
                )
            if any(b.name == backend.name for b in collected):
                raise _Quarantine("capabilities", f"backend {backend.name!r} registered twice")
            collected.append(backend.with_plugin(plugin))

        impl = self._impl_of("attn_core_register_backends", obj)
        try:
            if impl is not None:
                result = impl.function(*({"register": register}[a] for a in impl.argnames))
                if result is not None:
                    raise _Quarantine(
                        "register",
                        f"attn_core_register_backends returned {type(result).__name__}; it "
                        "registers each backend with register(backend) and returns None",
                    )
        except _Quarantine:
            raise
        except Exception as exc:
            raise _Quarantine(
                "register",
                f"attn_core_register_backends raised {type(exc).__name__}: {exc}",
            ) from None
        finally:
            closed = True
        return list(collected)

    def _quarantine(
        self,
        name: str,
        stage: str,
        reason: str,
        *,
        distribution: str | None = None,
        key: str | None = None,
    ) -> None:
        """Record ``name`` as not loaded (or raise, in strict mode); ``key`` keeps a second
        plugin of a taken name from overwriting the record of the first."""
        if self.strict:
            raise PluginLoadError(name, f"{stage}: {reason}")
        self.quarantined[key or name] = Quarantined(
            plugin=name, stage=stage, reason=reason, distribution=distribution
        )

    # -- queries ---------------------------------------------------------------------------
    @property
    def backends(self) -> list[Backend]:
        """Every registered backend, in a stable order (qualified name)."""
        return [self._backends[k] for k in sorted(self._backends)]

    def resolve(self, name: str) -> Backend:
        """A backend by qualified (``vendor:name``) or unique short name.

        :raises SelectionError: no backend has that name (the message says when its plugin is
            quarantined or was skipped, and otherwise lists the registered and the quarantined),
            or a short name is offered by several plugins.
        """
        if name in self._backends:
            return self._backends[name]
        matches = [b for b in self._backends.values() if b.name == name]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(sorted(self._backends)) or "none"
        if not matches:
            not_loaded = self._why_not_loaded(name)
            if not_loaded is not None:
                raise SelectionError(f"no backend named {name!r} is registered: {not_loaded}")
            quarantined = ", ".join(f"{q.plugin} ({q.stage})" for q in self.quarantined.values())
            hint = (
                f"; quarantined plugins (none of their backends is registered): {quarantined}"
                if quarantined
                else ""
            )
            raise SelectionError(
                f"no backend named {name!r} is registered; registered: {known}{hint}"
            )
        options = ", ".join(sorted(b.qualified_name for b in matches))
        raise SelectionError(
            f"backend name {name!r} is ambiguous: it is offered by {options}; "
            "use the namespaced name"
        )

    def _why_not_loaded(self, name: str) -> str | None:
        """Why the plugin a backend name points at (``acme`` of ``acme:turbo``, or a short name
        that is a plugin's name) is not loaded: quarantined or skipped; None if neither."""
        plugin = name.partition(":")[0]
        for q in self.quarantined.values():
            if q.plugin == plugin:
                return f"plugin {plugin!r} is quarantined: {q.reason} (stage {q.stage})"
        if plugin in self.skipped:
            return f"plugin {plugin!r} was not loaded: {self.skipped[plugin]}"
        return None

    def matches(self, name: str, backend: Backend) -> bool:
        """Whether a user-given name (short or qualified) denotes ``backend``."""
        return name in (backend.qualified_name, backend.name)

    # -- cold calls into the owning plugin -------------------------------------------------
    def call_owner(self, hook: str, backend: Backend, **kwargs: Any) -> Any:
        """Call ``hook`` of the plugin that owns ``backend`` only (never a broadcast).

        Arguments the plugin's implementation does not accept are dropped (pluggy's subset
        rule), so plugins written for an older API minor keep working. Exceptions are re-raised
        as :class:`PluginError` naming plugin and backend.
        """
        obj = self._objects.get(backend.plugin)
        if obj is None:
            raise SelectionError(
                f"backend {backend.qualified_name!r}: plugin {backend.plugin!r} is not loaded"
            )
        impl = self._impl_of(hook, obj)
        if impl is None:
            return None
        kwargs["backend"] = backend
        try:
            return impl.function(*(kwargs[a] for a in impl.argnames))
        except Exception as exc:
            raise PluginError(backend.plugin, backend.name, hook, exc) from exc

    def _impl_of(self, hook: str, obj: object) -> Any:
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin is obj:
                return impl
        return None

    def plugin_object(self, name: str) -> object:
        return self._objects[name]

    def self_check(self, device: Any) -> dict[str, SelfCheck]:
        """Run every available backend's fast-path self-checks now on ``device`` (a CUDA
        ``torch.device``) through its plugin's ``attn_core_self_check``.

        :returns: ``{qualified backend name: SelfCheck}`` for the backends that have checks.
            A hook that raises, or returns something else than a :class:`SelfCheck`, counts
            as that backend's failed check (its notes as registered), named in ``failed``.
        """
        results: dict[str, SelfCheck] = {}
        for plugin in sorted(self.plugins.values(), key=lambda p: p.name):
            for backend in plugin.backends:
                if not backend.available:
                    continue
                try:
                    got = self.call_owner("attn_core_self_check", backend, device=device)
                except PluginError as exc:
                    results[backend.qualified_name] = SelfCheck(backend.notes, (str(exc),))
                    continue
                if got is None:
                    continue
                if not isinstance(got, SelfCheck):
                    why = (
                        f"plugin {backend.plugin!r}, backend {backend.qualified_name!r}: "
                        "attn_core_self_check returned "
                        f"{type(got).__name__}, expected an attn_core.backend.SelfCheck or None"
                    )
                    got = SelfCheck(backend.notes, (why,))
                results[backend.qualified_name] = got
        return results

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description of plugins, backends and quarantined plugins."""
        from attn_core import fast_launch  # the core's own version-gated fast path

        return {
            "api_version": "{}.{}".format(*hookspecs.API_VERSION),
            "plugin_timeout_s": self.plugin_timeout,
            "core": {"fast_launch": fast_launch.status()},
            "plugins": [
                {
                    "name": p.name,
                    "version": p.version,
                    "distribution": p.distribution,
                    "api_version": "{}.{}".format(*p.api_version),
                    "backends": [
                        {
                            "name": b.qualified_name,
                            "kinds": sorted(k.value for k in b.capabilities.kinds),
                            "linear_variants": sorted(
                                v.value for v in b.capabilities.linear_variants
                            ),
                            "device_types": sorted(b.capabilities.device_types),
                            "priority": b.priority,
                            # the phases it serves and its priority in each (additive keys)
                            "phase_priority": {
                                ph.value: b.priority_for(ph)
                                for ph in Phase
                                if ph in b.capabilities.phases
                            },
                            # where a layer feature ranks it lower: {feature: {phase: priority}}
                            "feature_priority": {
                                feature: {ph.value: prio for ph, prio in by_phase}
                                for feature, by_phase in b.capabilities.feature_priority
                            },
                            "available": b.available,
                            "unavailable_reason": b.unavailable_reason,
                            "notes": b.notes,
                            "options": {
                                key: {
                                    "type": spec.type.__name__,
                                    "default": spec.default,
                                    "choices": None if spec.choices is None else list(spec.choices),
                                    "doc": spec.doc,
                                }
                                for key, spec in b.option_schema
                            },
                        }
                        for b in p.backends
                    ],
                }
                for p in sorted(self.plugins.values(), key=lambda p: p.name)
            ],
            "quarantined": [
                {
                    "plugin": q.plugin,
                    "distribution": q.distribution,
                    "stage": q.stage,
                    "reason": q.reason,
                }
                for q in self.quarantined.values()
            ],
            "skipped": dict(self.skipped),
        }
