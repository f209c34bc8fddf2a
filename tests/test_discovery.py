"""Discovery through real distributions: who may use the name ``attn_core``, and plugins that
never finish importing or registering.

Each test writes distributions as pip would leave them (a ``*.dist-info`` folder with
``METADATA`` and ``entry_points.txt``, next to the plugin modules) into its own folder on
``sys.path``, and discovery sees the entry points of that folder only (``importlib.metadata``
reads them; nothing is installed on the machine). ``attn-core`` itself is one of those
distributions when a test needs the built-in reference, declared as the real one is in
``pyproject.toml``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import attn_core.reference.plugin as reference_module
from attn_core.errors import PluginLoadError
from attn_core.registry import Registry

#: A plugin that loads at once and registers one CPU backend.
GOOD_PLUGIN = """
from attn_core.backend import Backend, BackendCapabilities
from attn_core.hookspecs import hookimpl

ATTN_CORE_API_VERSION = "1.1"


@hookimpl
def attn_core_register_backends(register):
    register(Backend(name="{backend}", capabilities=BackendCapabilities(kinds={{"full"}})))
"""


class World:
    """The distributions a test has written, and the entry points discovery sees."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []
        self.order: list[str] = []  # distribution names, in the order discovery lists them

    def distribution(
        self,
        name: str,
        version: str = "1.0",
        *,
        entry_points: dict[str, str],
        modules: dict[str, str] | None = None,
    ) -> None:
        """Write distribution ``name`` with ``entry_points`` (group ``attn_core``) and the
        source of ``modules`` (module name -> code)."""
        for module, source in (modules or {}).items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = "".join(f"{ep} = {value}\n" for ep, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[attn_core]\n{lines}")
        self.order.append(name)

    def attn_core(self) -> None:
        """attn-core's own distribution, with the entry point its pyproject declares."""
        self.distribution(
            "attn-core", "0.1.0", entry_points={"attn_core": "attn_core.reference.plugin"}
        )

    def entry_points(self, **selection: str) -> list[metadata.EntryPoint]:
        found = {d.metadata["Name"]: d for d in metadata.distributions(path=[str(self.root)])}
        return [
            ep
            for name in self.order
            for ep in found[name].entry_points
            if ep.group == selection.get("group", ep.group)
        ]


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A folder of distributions on ``sys.path``; ``metadata.entry_points`` lists only theirs."""
    w = World(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(metadata, "entry_points", w.entry_points)
    yield w
    for module in w.modules:
        sys.modules.pop(module, None)


# ------------------------------------------------------------------------------------------
# The name attn_core belongs to attn-core
# ------------------------------------------------------------------------------------------
IMPOSTOR = GOOD_PLUGIN.format(backend="reference")


def test_other_distribution_named_attn_core_cannot_replace_the_reference(world: World):
    # Listed before the real one: before, it loaded as 'attn_core' and the genuine reference was
    # quarantined as "already registered".
    world.distribution(
        "evil-dist", "6.6.6", entry_points={"attn_core": "evil_ref"}, modules={"evil_ref": IMPOSTOR}
    )
    world.attn_core()
    reg = Registry.discover()
    assert reg.plugins["attn_core"].distribution == "attn-core"
    assert reg.plugin_object("attn_core") is reference_module
    assert reg.resolve("attn_core:reference").capabilities == reference_module.CAPABILITIES
    assert [q.plugin for q in reg.quarantined.values()] == ["attn_core"]
    (q,) = reg.quarantined.values()
    assert q.stage == "register" and q.distribution == "evil-dist"
    assert q.reason == (
        "the plugin name 'attn_core' is reserved for attn-core's built-in reference; "
        "distribution 'evil-dist' 6.6.6 declares it (entry point attn_core = evil_ref)"
    )
    assert "evil_ref" not in sys.modules  # its code never ran


def test_name_attn_core_is_reserved_even_without_the_reference(world: World):
    # A source checkout without attn-core's metadata: the impostor still does not get the name.
    world.distribution(
        "evil-dist", "6.6.6", entry_points={"attn_core": "evil_ref"}, modules={"evil_ref": IMPOSTOR}
    )
    reg = Registry.discover()
    assert reg.plugins == {} and reg.backends == []
    (q,) = reg.quarantined.values()
    assert "reserved for attn-core's built-in reference" in q.reason and "'evil-dist'" in q.reason


def test_reference_module_under_another_name_cannot_take_it_first(world: World):
    # 'aaa' sorts before 'attn_core': before, it registered the reference module first, and the
    # genuine entry point failed with pluggy's "Plugin already registered".
    world.distribution("sneaky", entry_points={"aaa": "attn_core.reference.plugin"})
    world.attn_core()
    reg = Registry.discover()
    assert sorted(reg.plugins) == ["attn_core"]
    assert [b.qualified_name for b in reg.backends] == ["attn_core:reference"]
    (q,) = reg.quarantined.values()
    assert (q.plugin, q.stage, q.distribution) == ("aaa", "register", "sneaky")
    assert q.reason == (
        "entry point aaa = attn_core.reference.plugin of distribution 'sneaky' 1.0 names "
        "attn-core's built-in reference, which only attn-core registers"
    )


def test_reference_loads_first_and_other_plugins_load(world: World):
    world.distribution(
        "attn-plugin-aaa",
        entry_points={"aaa": "aaa_attn"},
        modules={"aaa_attn": GOOD_PLUGIN.format(backend="fast")},
    )
    world.attn_core()
    reg = Registry.discover()
    assert list(reg.plugins) == ["attn_core", "aaa"]  # the reference first, then by name
    assert reg.plugins["aaa"].distribution == "attn-plugin-aaa"
    assert reg.quarantined == {}


def test_strict_mode_refuses_the_impostor_by_distribution(world: World):
    world.attn_core()
    world.distribution(
        "evil-dist", "6.6.6", entry_points={"attn_core": "evil_ref"}, modules={"evil_ref": IMPOSTOR}
    )
    with pytest.raises(
        PluginLoadError, match=r"'attn_core' was not loaded: register: .*'evil-dist'"
    ):
        Registry.discover(strict=True)


def test_summary_and_list_name_the_offending_distribution(world: World, capsys):
    world.attn_core()
    world.distribution(
        "evil-dist", "6.6.6", entry_points={"attn_core": "evil_ref"}, modules={"evil_ref": IMPOSTOR}
    )
    reg = Registry.discover()
    (entry,) = reg.summary()["quarantined"]
    assert entry["plugin"] == "attn_core" and entry["distribution"] == "evil-dist"
    from attn_core import cli

    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    quarantined = out[out.index("Quarantined plugins") :]
    assert "evil-dist" in quarantined and "reserved for attn-core's" in quarantined
