"""Registry: inline plugins, entry points with quarantine, strict mode, allow/deny, namespacing,
and plugin errors at run time named by plugin and backend."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

from attn_core.backend import Backend
from attn_core.batch import BatchBuilder
from attn_core.errors import BackendInputError, PluginError, PluginLoadError, SelectionError
from attn_core.hookspecs import hookimpl
from attn_core.registry import Registry, parse_api_version
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers
from attn_core.workspace import Workspace

CPU = DeviceCapabilities.target("cpu")
ENCODER = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=8, dtype="float32")


class EchoContext:
    """A context whose forward copies q into out (encoder spec: out has q's shape)."""

    def __init__(self, fail_in: str | None = None, exc: type[Exception] = RuntimeError):
        self.fail_in = fail_in
        self.exc = exc
        self.batch = None

    def _maybe_fail(self, stage: str) -> None:
        if self.fail_in == stage:
            raise self.exc(f"boom in {stage}")

    def prepare(self, batch):
        self._maybe_fail("prepare")
        self.batch = batch

    def update(self, batch):
        self._maybe_fail("update")
        self.batch = batch

    def forward(self, layer, q, k, v, out, **inputs):
        self._maybe_fail("forward")
        out.copy_(q)
        return out


def _backend(make_caps, name="echo", **kw):
    return Backend(name=name, capabilities=make_caps(kinds={"encoder"}, non_causal=True), **kw)


# ------------------------------------------------------------------------------------------
# Inline plugins
# ------------------------------------------------------------------------------------------
def test_register_inline_plugin_namespaces_backends(registry, make_plugin, make_caps):
    mod = make_plugin("vendor", [_backend(make_caps, "fast"), _backend(make_caps, "slow")])
    info = registry.register_plugin(mod, name="vendor", version="1.2.3")
    assert info is not None and info.version == "1.2.3" and info.api_version == (1, 1)
    assert [b.qualified_name for b in registry.backends] == ["vendor:fast", "vendor:slow"]
    assert registry.resolve("fast").plugin == "vendor"
    assert registry.resolve("vendor:slow").name == "slow"
    assert registry.quarantined == {}


def test_inline_plugin_as_class_instance(registry, make_caps):
    from attn_core.hookspecs import hookimpl

    class Plugin:
        ATTN_CORE_API_VERSION = "1.1"

        @hookimpl
        def attn_core_register_backends(self, register):
            register(_backend(make_caps, "obj"))

    registry.register_plugin(Plugin(), name="objplug")
    assert [b.qualified_name for b in registry.backends] == ["objplug:obj"]


def test_duplicate_plugin_name_is_quarantined_first_kept(registry, make_plugin, make_caps):
    registry.register_plugin(make_plugin("a", [_backend(make_caps, "x")]), name="dup")
    assert (
        registry.register_plugin(make_plugin("b", [_backend(make_caps, "y")]), name="dup") is None
    )
    assert [b.qualified_name for b in registry.backends] == ["dup:x"]
    q = registry.quarantined["dup (duplicate)"]
    assert q.stage == "register" and "already registered" in q.reason
    assert "(from a direct registration)" in q.reason  # not "(from None)"
    # a third of that name keeps the second's record
    registry.register_plugin(make_plugin("c", [_backend(make_caps, "z")]), name="dup")
    assert set(registry.quarantined) == {"dup (duplicate)", "dup (duplicate 2)"}


def test_a_name_quarantined_before_is_said_to_be_so_when_taken_again(
    registry, make_plugin, make_caps
):
    registry.register_plugin(make_plugin("a", [], api=None), name="fixme")  # no API version
    assert registry.register_plugin(make_plugin("b", [_backend(make_caps, "y")]),
                                    name="fixme") is None  # fmt: skip
    reason = registry.quarantined["fixme (duplicate)"].reason
    assert "was quarantined before (api-version: does not declare" in reason, reason
    assert "already registered" not in reason


@pytest.mark.parametrize("name", ["", "a:b", "a b", "a=b", "a,b"])
def test_a_plugin_name_that_cannot_prefix_its_backends_is_quarantined(
    registry, make_plugin, make_caps, name
):
    """A backend's qualified name is ``plugin:backend``: with no plugin name its backends went
    in un-namespaced (``reference``) and took the short name from ``attn_core:reference``;
    ``a:b`` made ``a:b:x``."""
    import attn_core.reference.plugin as ref

    registry.register_plugin(ref, name="attn_core")
    assert registry.register_plugin(make_plugin("m", [_backend(make_caps, "reference")]),
                                    name=name) is None  # fmt: skip
    assert [b.qualified_name for b in registry.backends] == ["attn_core:reference"]
    assert registry.resolve("reference").qualified_name == "attn_core:reference"
    q = registry.quarantined[name]
    assert q.stage == "register" and f"plugin name {name!r}" in q.reason, q.reason


def test_a_register_hook_that_returns_its_backends_is_quarantined(registry, make_caps):
    """The hook calls ``register(backend)``; one that returns a list registered nothing and
    loaded as a plugin without backends."""

    class Returns:
        ATTN_CORE_API_VERSION = "1.1"

        @hookimpl
        def attn_core_register_backends(self, register):
            return [_backend(make_caps, "x")]

    assert registry.register_plugin(Returns(), name="returns") is None
    q = registry.quarantined["returns"]
    assert q.stage == "register" and "returned list" in q.reason and "register(" in q.reason


def test_register_called_after_the_hook_returned_raises_and_changes_nothing(registry, make_caps):
    kept = []

    class Lazy:
        ATTN_CORE_API_VERSION = "1.1"

        @hookimpl
        def attn_core_register_backends(self, register):
            kept.append(register)

    info = registry.register_plugin(Lazy(), name="lazy")
    with pytest.raises(RuntimeError, match="after attn_core_register_backends returned"):
        kept[0](_backend(make_caps, "late"))
    assert info.backends == [] and registry.backends == []


def test_a_hook_attn_core_does_not_define_is_quarantined_naming_it(registry, make_caps):
    """A misspelt hook (``attn_core_register_backend``) loaded as a plugin that registered
    nothing, without a word."""

    class Misspelt:
        ATTN_CORE_API_VERSION = "1.1"

        @hookimpl
        def attn_core_register_backend(self, register):
            register(_backend(make_caps, "x"))

    assert registry.register_plugin(Misspelt(), name="misspelt") is None
    q = registry.quarantined["misspelt"]
    assert q.stage == "register" and "attn_core_register_backend" in q.reason, q.reason
    assert "attn_core_register_backends" in q.reason  # the hooks there are

    class Optional:  # a hook of a later release, marked optional: loads
        ATTN_CORE_API_VERSION = "1.1"

        @hookimpl
        def attn_core_register_backends(self, register):
            register(_backend(make_caps, "x"))

        @hookimpl(optionalhook=True)
        def attn_core_a_later_hook(self):
            pass

    registry.register_plugin(Optional(), name="optional")
    assert [b.qualified_name for b in registry.backends] == ["optional:x"]


def test_backend_registered_twice_quarantines_plugin(registry, make_plugin, make_caps):
    mod = make_plugin("twice", [_backend(make_caps, "x"), _backend(make_caps, "x")])
    registry.register_plugin(mod, name="twice")
    assert registry.backends == []
    assert "registered twice" in registry.quarantined["twice"].reason


def test_namespaced_names_and_ambiguity(registry, make_plugin, make_caps):
    for vendor in ("vendor_a", "vendor_b"):
        registry.register_plugin(make_plugin(vendor, [_backend(make_caps, "flash")]), name=vendor)
    assert {b.qualified_name for b in registry.backends} == {"vendor_a:flash", "vendor_b:flash"}
    with pytest.raises(SelectionError, match="ambiguous") as info:
        registry.resolve("flash")
    assert "vendor_a:flash" in str(info.value) and "vendor_b:flash" in str(info.value)
    assert registry.resolve("vendor_b:flash").plugin == "vendor_b"
    with pytest.raises(SelectionError, match=r"no backend named 'nope'.*vendor_a:flash"):
        registry.resolve("nope")
    # a forced short name that is ambiguous fails selection with the same message
    with pytest.raises(SelectionError, match="ambiguous"):
        select(group_layers([ENCODER]), registry, CPU, ExecutionConstraints(force="encoder=flash"))


def _quarantined_acme(registry, make_plugin):
    def register(register):
        raise RuntimeError("GPU driver too old")

    registry.register_plugin(make_plugin("acme", register=register), name="acme")
    assert "acme" in registry.quarantined


@pytest.mark.parametrize("name", ["acme:turbo", "acme"])
def test_resolving_a_backend_of_a_quarantined_plugin_says_so(registry, make_plugin, name):
    _quarantined_acme(registry, make_plugin)
    with pytest.raises(SelectionError) as info:
        registry.resolve(name)
    assert str(info.value) == (
        f"no backend named {name!r} is registered: plugin 'acme' is quarantined: "
        "attn_core_register_backends raised RuntimeError: GPU driver too old (stage register)"
    )


def test_unknown_short_name_lists_the_quarantined_plugins(registry, make_plugin, make_caps):
    _quarantined_acme(registry, make_plugin)
    registry.register_plugin(make_plugin("fine", [_backend(make_caps, "x")]), name="fine")
    with pytest.raises(SelectionError) as info:
        registry.resolve("turbo")
    assert str(info.value) == (
        "no backend named 'turbo' is registered; registered: fine:x; quarantined plugins (none "
        "of their backends is registered): acme (register)"
    )


def test_forcing_a_backend_of_a_skipped_plugin_says_why(make_plugin, make_caps):
    registry = Registry(deny={"acme"})
    registry.register_plugin(make_plugin("acme", [_backend(make_caps, "turbo")]), name="acme")
    with pytest.raises(SelectionError) as info:
        select(
            group_layers([ENCODER]), registry, CPU, ExecutionConstraints(force="encoder=acme:turbo")
        )
    assert str(info.value) == (
        "no backend named 'acme:turbo' is registered: plugin 'acme' was not loaded: denied by "
        "the deny list given to Registry (deny=['acme'])"
    )


def test_backend_name_with_colon_quarantines(registry, make_plugin, make_caps):
    def register(register):
        register(Backend(name="a:b", capabilities=make_caps()))

    registry.register_plugin(make_plugin("colon", register=register), name="colon")
    q = registry.quarantined["colon"]
    assert q.stage == "register" and "without ':'" in q.reason


def test_hookimpl_with_unknown_argument_is_quarantined(registry, make_caps):
    import types

    from attn_core.hookspecs import hookimpl

    mod = types.ModuleType("badsig")
    mod.ATTN_CORE_API_VERSION = "1.1"

    @hookimpl
    def attn_core_register_backends(register, not_an_argument):
        register(_backend(make_caps))

    mod.attn_core_register_backends = attn_core_register_backends
    registry.register_plugin(mod, name="badsig")
    assert registry.backends == []
    assert "not_an_argument" in registry.quarantined["badsig"].reason


def test_call_owner_never_broadcasts(registry, make_plugin, make_caps):
    calls = []

    def allocate_for(tag):
        def allocate(backend, group, device, constraints, state, workspace):
            calls.append(tag)
            return EchoContext()

        return allocate

    for tag in ("p1", "p2"):
        mod = make_plugin(tag, [_backend(make_caps, "b")], allocate=allocate_for(tag))
        registry.register_plugin(mod, name=tag)
    (group,) = group_layers([ENCODER])
    ctx = registry.call_owner(
        "attn_core_allocate_context",
        registry.resolve("p2:b"),
        group=group,
        device=CPU,
        constraints=ExecutionConstraints(),
        state=None,
        workspace=Workspace([], "cpu"),
    )
    assert isinstance(ctx, EchoContext)
    assert calls == ["p2"]


def test_parse_api_version():
    assert parse_api_version("1.1") == (1, 1)
    assert parse_api_version("2") == (2, 0)
    assert parse_api_version(1) == (1, 0)
    assert parse_api_version((1, 0)) == (1, 0)
    for bad in ("1.x", "1.1.1", "", None, 1.5, True):
        with pytest.raises(ValueError, match=r"expected 'major\.minor'"):
            parse_api_version(bad)


# ------------------------------------------------------------------------------------------
# Entry points: one good plugin among many broken ones
# ------------------------------------------------------------------------------------------
@pytest.fixture
def fake_entry_points(monkeypatch, make_plugin, make_caps):
    """Install fake modules and entry points; returns ``install(dict name -> module|None)``.

    A ``None`` module makes the entry point name a module that does not exist (ImportError).
    """

    def install(plugins):
        eps = []
        for name, mod in plugins.items():
            modname = f"_attn_core_test_ep_{name}"
            if mod is not None:
                monkeypatch.setitem(sys.modules, modname, mod)
            eps.append(EntryPoint(name=name, value=modname, group="attn_core"))

        real = importlib.metadata.entry_points

        def entry_points(**kwargs):
            if kwargs != {"group": "attn_core"}:
                # another library's discovery: Triton reads its backends' entry points on its
                # first import, which attn list's summary may trigger inside this test
                return real(**kwargs)
            return list(eps)

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
        return eps

    return install


def _broken_world(make_plugin, make_caps):
    def raising_register(register):
        raise RuntimeError("GPU driver too old")

    def malformed_register(register):
        from attn_core.backend import BackendCapabilities

        register(
            Backend(
                name="neg",
                capabilities=BackendCapabilities(
                    kinds={"full"}, device_types={"cpu"}, dtypes={"float32"}, head_dims={-1}
                ),
            )
        )

    def non_backend_register(register):
        register(_backend(make_caps, "fine"))  # dropped too: the plugin is quarantined whole
        register({"name": "dict-backend"})

    def allocate_v10(backend, group, device, constraints, state):  # API 1.0: no workspace
        return EchoContext()

    return {
        "good": make_plugin("good", [_backend(make_caps, "good", priority=10)]),
        "noimport": None,
        "raising": make_plugin("raising", register=raising_register),
        "future": make_plugin("future", [_backend(make_caps, "future")], api="2.0"),
        "newerminor": make_plugin("newerminor", [_backend(make_caps, "nm")], api="1.9"),
        "noversion": make_plugin("noversion", [_backend(make_caps, "nv")], api=None),
        "old": make_plugin("old", [_backend(make_caps, "old")], api="1.0", allocate=allocate_v10),
        "malformed": make_plugin("malformed", register=malformed_register),
        "notabackend": make_plugin("notabackend", register=non_backend_register),
    }


def test_entry_points_quarantine_broken_plugins(fake_entry_points, make_plugin, make_caps):
    fake_entry_points(_broken_world(make_plugin, make_caps))
    reg = Registry.discover()
    assert sorted(reg.plugins) == ["good", "old"]
    assert [b.qualified_name for b in reg.backends] == ["good:good", "old:old"]
    q = reg.quarantined
    assert sorted(q) == [
        "future",
        "malformed",
        "newerminor",
        "noimport",
        "notabackend",
        "noversion",
        "raising",
    ]
    assert q["noimport"].stage == "import" and "ModuleNotFoundError" in q["noimport"].reason
    assert q["raising"].stage == "register"
    assert "RuntimeError: GPU driver too old" in q["raising"].reason
    assert q["future"].stage == "api-version" and "major versions must match" in q["future"].reason
    assert "upgrade attn-core" in q["newerminor"].reason
    assert "does not declare ATTN_CORE_API_VERSION" in q["noversion"].reason
    assert "head_dims" in q["malformed"].reason and "-1" in q["malformed"].reason
    assert q["notabackend"].stage == "capabilities" and "got dict" in q["notabackend"].reason
    # a quarantined plugin leaves no hook implementation behind
    registered = {reg.pm.get_name(p) for p in reg.pm.get_plugins()}
    assert registered == {"good", "old"}
    summary = reg.summary()
    json.dumps(summary)  # JSON-ready
    assert {e["plugin"] for e in summary["quarantined"]} == set(q)
    assert reg.plugins["old"].api_version == (1, 0)


def test_api_1_0_plugin_allocates_without_workspace(fake_entry_points, make_plugin, make_caps):
    fake_entry_points(_broken_world(make_plugin, make_caps))
    reg = Registry.discover()
    groups = group_layers([ENCODER])
    plan = select(groups, reg, CPU, ExecutionConstraints(force="encoder=old:old", max_batch_size=4))
    runtime = AttentionRuntime(plan, reg)
    assert isinstance(runtime.groups["encoder"].context, EchoContext)
    builder = BatchBuilder(max_batch_size=4, max_num_tokens=16)
    batch = builder.build_encoder([3, 2])
    runtime.prepare(batch)
    q = torch.randn(5, 2, 8)
    out = torch.zeros_like(q)
    runtime.binding(0).forward(q, q.clone(), q.clone(), out=out)
    assert torch.equal(out, q)


def test_strict_flag_raises_plugin_load_error(fake_entry_points, make_plugin, make_caps):
    fake_entry_points(_broken_world(make_plugin, make_caps))
    with pytest.raises(PluginLoadError) as info:
        Registry.discover(strict=True)
    # entry points load in name order: 'future' is the first broken one
    assert info.value.plugin == "future"
    assert "api-version" in info.value.reason and "2.0" in str(info.value)


def test_env_strict_raises(fake_entry_points, make_plugin, make_caps, monkeypatch):
    fake_entry_points({"noimport": None})
    monkeypatch.setenv("ATTN_CORE_STRICT", "1")
    with pytest.raises(PluginLoadError, match="'noimport' was not loaded: import"):
        Registry.discover()


def test_env_allow_and_deny(fake_entry_points, make_plugin, make_caps, monkeypatch):
    fake_entry_points(_broken_world(make_plugin, make_caps))
    monkeypatch.setenv("ATTN_CORE_PLUGINS_ALLOW", "good, raising")
    reg = Registry.discover()
    assert sorted(reg.plugins) == ["good"] and sorted(reg.quarantined) == ["raising"]
    assert "ATTN_CORE_PLUGINS_ALLOW" in reg.skipped["old"]
    monkeypatch.delenv("ATTN_CORE_PLUGINS_ALLOW")
    monkeypatch.setenv("ATTN_CORE_PLUGINS_DENY", "good,noimport")
    reg = Registry.discover()
    assert "good" not in reg.plugins and "noimport" not in reg.quarantined
    assert "ATTN_CORE_PLUGINS_DENY" in reg.skipped["good"]
    assert "old" in reg.plugins


def test_skip_reasons_name_where_the_filter_came_from(make_plugin, make_caps, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_PLUGINS_DENY", "x, z")
    reg = Registry()
    assert reg.register_plugin(make_plugin("x", [_backend(make_caps)]), name="x") is None
    assert reg.skipped == {"x": "denied by ATTN_CORE_PLUGINS_DENY='x, z'"}
    reg = Registry(allow={"y"}, deny={"z"})
    reg.register_plugin(make_plugin("x", [_backend(make_caps)]), name="x")
    reg.register_plugin(make_plugin("z", [_backend(make_caps)]), name="z")
    assert reg.skipped == {
        "x": "not in the allow list given to Registry (allow=['y'])",
        "z": "denied by the deny list given to Registry (deny=['z'])",
    }


@pytest.mark.parametrize("var", ["ATTN_CORE_PLUGINS_ALLOW", "ATTN_CORE_PLUGINS_DENY"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        (" , ", "names no plugin"),
        ("good,vendor:flash", "entry 'vendor:flash' is a backend name"),
        ("good,x=1", "entry 'x=1' is not a plugin name"),
    ],
)
def test_malformed_plugin_filter_env_is_an_error_naming_it(monkeypatch, var, value, why):
    # Before: ' , ' made an empty allow list (nothing loads, silently) and the others matched no
    # plugin without a word.
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as info:
        Registry()
    assert str(info.value).startswith(f"{var}={value!r}: {why}")


def test_explicit_allow_deny_arguments_win_over_env(registry, make_plugin, make_caps, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_PLUGINS_DENY", "x")
    reg = Registry(deny=())
    assert reg.register_plugin(make_plugin("x", [_backend(make_caps)]), name="x") is not None
    reg = Registry(allow={"y"})
    assert reg.register_plugin(make_plugin("x", [_backend(make_caps)]), name="x") is None
    assert reg.backends == []


# ------------------------------------------------------------------------------------------
# Errors raised inside plugins at run time
# ------------------------------------------------------------------------------------------
def _runtime_with(registry, make_plugin, make_caps, ctx=None, allocate=None, requirements=None):
    def default_allocate(backend, group, device, constraints, state, workspace):
        return ctx

    mod = make_plugin(
        "acme",
        [_backend(make_caps, "kern")],
        allocate=allocate or default_allocate,
        requirements=requirements,
    )
    registry.register_plugin(mod, name="acme")
    plan = select(group_layers([ENCODER]), registry, CPU, ExecutionConstraints(max_batch_size=4))
    return AttentionRuntime(plan, registry)


def test_allocate_error_is_plugin_error(registry, make_plugin, make_caps):
    def allocate(backend, group, device, constraints, state, workspace):
        raise MemoryError("no room for the workspace")

    with pytest.raises(PluginError) as info:
        _runtime_with(registry, make_plugin, make_caps, allocate=allocate)
    err = info.value
    assert (err.plugin, err.backend, err.stage) == ("acme", "kern", "attn_core_allocate_context")
    assert "no room for the workspace" in str(err) and "'acme'" in str(err)


def test_allocate_returning_none_is_plugin_error(registry, make_plugin, make_caps):
    with pytest.raises(PluginError, match="returned no context for group 'encoder'"):
        _runtime_with(registry, make_plugin, make_caps, ctx=None)


def test_bad_workspace_requirement_is_plugin_error(registry, make_plugin, make_caps):
    def requirements(backend, group, device, constraints):
        return ["not a requirement"]

    with pytest.raises(PluginError) as info:
        _runtime_with(
            registry, make_plugin, make_caps, ctx=EchoContext(), requirements=requirements
        )
    assert info.value.stage == "workspace" and "WorkspaceRequirement" in str(info.value)


@pytest.mark.parametrize("stage", ["prepare", "update", "forward"])
def test_run_time_errors_name_plugin_and_backend(registry, make_plugin, make_caps, stage):
    runtime = _runtime_with(registry, make_plugin, make_caps, ctx=EchoContext(fail_in=stage))
    batch = BatchBuilder(max_batch_size=4, max_num_tokens=16).build_encoder([2])
    q = torch.randn(2, 2, 8)
    with pytest.raises(PluginError) as info:
        if stage == "update":
            runtime.update(batch)
        else:
            runtime.prepare(batch)
            runtime.binding(0).forward(q, q, q, out=torch.empty_like(q))
    err = info.value
    assert (err.plugin, err.backend, err.stage) == ("acme", "kern", stage)
    assert f"boom in {stage}" in str(err)
    assert isinstance(err.__cause__, RuntimeError)


def test_value_error_in_forward_is_the_plugins_error(registry, make_plugin, make_caps):
    """The core checks the caller's inputs before the plugin runs: a ValueError from inside the
    plugin is the plugin's failure, not bad input (a plugin names bad input by raising
    BackendInputError itself)."""
    runtime = _runtime_with(
        registry, make_plugin, make_caps, ctx=EchoContext(fail_in="forward", exc=ValueError)
    )
    runtime.prepare(BatchBuilder(max_batch_size=4, max_num_tokens=16).build_encoder([2]))
    q = torch.randn(2, 2, 8)
    with pytest.raises(PluginError) as info:
        runtime.binding(0).forward(q, q, q, out=torch.empty_like(q))
    err = info.value
    assert not isinstance(err, BackendInputError)
    assert (err.group, err.layer, err.plugin, err.backend) == ("encoder", 0, "acme", "kern")
    assert "boom in forward" in str(err) and isinstance(err.__cause__, ValueError)
