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

import json
import sys
import textwrap
import time
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
    caps = BackendCapabilities(kinds={{"full"}}, device_types={{"cpu"}}, dtypes={{"float32"}})
    register(Backend(name="{backend}", capabilities=caps))
"""


#: A plugin that imports nothing heavy (a probe of it is an interpreter start) and registers no
#: backend: for tests about probes and the cache, where a probe that imports torch would cost
#: seconds.
LIGHT_PLUGIN = """
import pluggy

ATTN_CORE_API_VERSION = "1.1"


@pluggy.HookimplMarker("attn_core")
def attn_core_register_backends(register):
    pass
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

    def entry_points(self, **selection: str) -> metadata.EntryPoints:
        """This world's ``attn_core`` entry points (for that group or none named); any other
        group is the real installation's: ``import triton``, first made in a test that lists
        the world, selects its own group from the result."""
        if selection.get("group", "attn_core") != "attn_core":
            return _REAL_ENTRY_POINTS(**selection)
        found = {d.metadata["Name"]: d for d in metadata.distributions(path=[str(self.root)])}
        return metadata.EntryPoints(
            ep
            for name in self.order
            for ep in found[name].entry_points
            if ep.group == selection.get("group", ep.group)
        )


_REAL_ENTRY_POINTS = metadata.entry_points


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A folder of distributions on ``sys.path``; ``metadata.entry_points`` lists only theirs."""
    w = World(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(metadata, "entry_points", w.entry_points)
    # A cache of its own: the distributions of every test share names and versions.
    monkeypatch.setenv("ATTN_CORE_PROBE_CACHE", str(tmp_path / "probe-cache.json"))
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
    # This plugin imports torch: its probe takes seconds, well within the default limit.
    world.distribution(
        "attn-plugin-aaa",
        entry_points={"aaa": "aaa_attn"},
        modules={"aaa_attn": GOOD_PLUGIN.format(backend="fast")},
    )
    world.attn_core()
    reg = Registry.discover()
    assert list(reg.plugins) == ["attn_core", "aaa"]  # the reference first, then by name
    assert reg.plugins["aaa"].distribution == "attn-plugin-aaa"
    assert [b.qualified_name for b in reg.backends] == ["aaa:fast", "attn_core:reference"]
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


# ------------------------------------------------------------------------------------------
# Plugins that never finish importing or registering
# ------------------------------------------------------------------------------------------
HANGS_AT_IMPORT = """
import time

while True:  # an import that waits for a device, a lock or a network that never answers
    time.sleep(1)
"""

# pluggy's marker directly: importing attn_core would import torch, and the import stage of the
# probe would then take most of a short time limit.
HANGS_IN_REGISTER = """
import time

import pluggy

ATTN_CORE_API_VERSION = "1.1"
hookimpl = pluggy.HookimplMarker("attn_core")


@hookimpl
def attn_core_register_backends(register):
    while True:
        time.sleep(1)
"""


def _hanging_world(world: World) -> None:
    world.attn_core()
    world.distribution(
        "attn-plugin-stuck",
        "0.3",
        entry_points={"stuck": "stuck_attn"},
        modules={"stuck_attn": HANGS_AT_IMPORT},
    )
    world.distribution(
        "attn-plugin-loop",
        "0.4",
        entry_points={"loop": "loop_attn"},
        modules={"loop_attn": HANGS_IN_REGISTER},
    )
    world.distribution(
        "attn-plugin-light",
        "1.0",
        entry_points={"light": "light_attn"},
        modules={"light_attn": LIGHT_PLUGIN},
    )


def test_plugins_that_hang_are_quarantined_within_the_time_limit(world: World):
    _hanging_world(world)
    start = time.monotonic()
    reg = Registry.discover(plugin_timeout=2, probe_cache=False)
    elapsed = time.monotonic() - start
    # Before: discover() never returned. The probes run side by side: about one limit in all.
    assert elapsed < 12, f"discovery took {elapsed:.1f} s"
    assert sorted(reg.plugins) == ["attn_core", "light"]
    assert [b.qualified_name for b in reg.backends] == ["attn_core:reference"]
    stuck, loop = reg.quarantined["stuck"], reg.quarantined["loop"]
    assert (stuck.stage, stuck.distribution) == ("import", "attn-plugin-stuck")
    assert stuck.reason == (
        "did not finish importing within 2 s (probe in a subprocess; "
        "ATTN_CORE_PLUGIN_TIMEOUT sets the limit)"
    )
    assert (loop.stage, loop.distribution) == ("register", "attn-plugin-loop")
    assert loop.reason == (
        "attn_core_register_backends did not return within 2 s (probe in a subprocess; "
        "ATTN_CORE_PLUGIN_TIMEOUT sets the limit)"
    )
    assert reg.summary()["plugin_timeout_s"] == 2
    # Neither ran in this process: a module still importing would hold its import lock.
    assert "stuck_attn" not in sys.modules and "loop_attn" not in sys.modules


def test_env_sets_the_time_limit_and_attn_list_shows_the_reason(world: World, monkeypatch, capsys):
    world.distribution(
        "attn-plugin-stuck",
        "0.3",
        entry_points={"stuck": "stuck_attn"},
        modules={"stuck_attn": HANGS_AT_IMPORT},
    )
    monkeypatch.setenv("ATTN_CORE_PLUGIN_TIMEOUT", "1.5")
    monkeypatch.setenv("COLUMNS", "250")  # one line per table row
    from attn_core import cli

    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "stuck" in line)
    assert "attn-plugin-stuck" in row and "import" in row
    assert "did not finish importing within 1.5 s (probe in a subprocess;" in row


def test_strict_mode_raises_on_a_plugin_that_hangs(world: World):
    world.distribution(
        "attn-plugin-stuck",
        "0.3",
        entry_points={"stuck": "stuck_attn"},
        modules={"stuck_attn": HANGS_AT_IMPORT},
    )
    with pytest.raises(PluginLoadError, match=r"'stuck' was not loaded: import: did not finish"):
        Registry.discover(strict=True, plugin_timeout=1, probe_cache=False)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import os\nos._exit(3)\n", "the probe process exited with status 3 while importing"),
        (
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
            "the probe process was killed by SIGKILL while importing",
        ),
    ],
)
def test_plugin_that_ends_the_process_is_quarantined(world: World, code, reason):
    # In this process either would have ended the server; the probe sees it happen.
    world.distribution(
        "attn-plugin-exit",
        "0.1",
        entry_points={"exits": "exits_attn"},
        modules={"exits_attn": code},
    )
    reg = Registry.discover(plugin_timeout=20, probe_cache=False)
    q = reg.quarantined["exits"]
    assert q.stage == "import"
    assert q.reason == f"{reason}, without raising (probe in a subprocess)"
    assert "exits_attn" not in sys.modules


@pytest.mark.parametrize(
    ("value", "why"),
    [("soon", "expected seconds"), ("-1", "expected seconds"), ("inf", "expected seconds")],
)
def test_bad_time_limit_is_an_error_naming_the_variable(monkeypatch, value, why):
    monkeypatch.setenv("ATTN_CORE_PLUGIN_TIMEOUT", value)
    with pytest.raises(ValueError) as info:
        Registry()
    assert str(info.value) == (
        f"ATTN_CORE_PLUGIN_TIMEOUT={value!r}: {why} (a finite number >= 0; 0 turns the probe off)"
    )
    with pytest.raises(ValueError, match=r"plugin_timeout=-2: expected seconds"):
        Registry(plugin_timeout=-2)


# ------------------------------------------------------------------------------------------
# Probe results are cached by interpreter, distribution, version and entry point
# ------------------------------------------------------------------------------------------
@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """The entry-point names probed in a subprocess, in the order they were probed."""
    from attn_core import probe

    seen: list[str] = []
    real = probe.run_probe

    def spy(ep, timeout):
        seen.append(ep.name)
        return real(ep, timeout)

    monkeypatch.setattr(probe, "run_probe", spy)
    return seen


def _good_world(world: World, version: str = "1.0") -> None:
    world.attn_core()
    world.distribution(
        "attn-plugin-good",
        version,
        entry_points={"good": "good_attn"},
        modules={"good_attn": LIGHT_PLUGIN},
    )


def test_a_successful_probe_is_cached_and_the_reference_is_never_probed(
    world: World, probes: list[str], tmp_path: Path, monkeypatch
):
    _good_world(world)
    cache = tmp_path / "probes.json"
    monkeypatch.setenv("ATTN_CORE_PROBE_CACHE", str(cache))
    assert sorted(Registry.discover().plugins) == ["attn_core", "good"]
    assert probes == ["good"]
    entries = json.loads(cache.read_text())["probes"]
    (key,) = entries
    assert json.loads(key) == [sys.executable, "attn-plugin-good", "1.0", "good", "good_attn"]
    assert sorted(Registry.discover().plugins) == ["attn_core", "good"]
    assert probes == ["good"]  # the second start-up read the cache


def test_a_new_version_is_probed_again(
    world: World, probes: list[str], tmp_path: Path, monkeypatch
):
    monkeypatch.setenv("ATTN_CORE_PROBE_CACHE", str(tmp_path / "probes.json"))
    _good_world(world, "1.0")
    Registry.discover()
    other = World(tmp_path / "v2")
    other.root.mkdir()
    _good_world(other, "2.0")
    monkeypatch.setattr(metadata, "entry_points", other.entry_points)
    Registry.discover()
    assert probes == ["good", "good"]


@pytest.mark.parametrize(
    ("xdg", "where"),
    [
        ("xdg", "xdg/attn-core/plugin-probes.json"),
        (None, "home/.cache/attn-core/plugin-probes.json"),
    ],
)
def test_cache_location_follows_xdg_cache_home(
    world: World, probes, tmp_path: Path, monkeypatch, xdg, where
):
    _good_world(world)
    monkeypatch.delenv("ATTN_CORE_PROBE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg))
    Registry.discover()
    assert probes == ["good"]
    assert "attn-plugin-good" in (tmp_path / where).read_text()


@pytest.mark.parametrize(
    "settings", [{"ATTN_CORE_PROBE_CACHE": "off"}, {"ATTN_CORE_PLUGIN_TIMEOUT": "0"}]
)
def test_cache_and_probe_can_be_turned_off(world: World, probes, tmp_path, monkeypatch, settings):
    _good_world(world)
    monkeypatch.delenv("ATTN_CORE_PROBE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    for _ in range(2):
        assert sorted(Registry.discover().plugins) == ["attn_core", "good"]
    assert not (tmp_path / "xdg").exists()
    assert probes == ([] if "ATTN_CORE_PLUGIN_TIMEOUT" in settings else ["good", "good"])


def test_unreadable_cache_is_ignored_and_rewritten(world: World, probes, tmp_path, monkeypatch):
    _good_world(world)
    cache = tmp_path / "probes.json"
    cache.write_text("{not json")
    monkeypatch.setenv("ATTN_CORE_PROBE_CACHE", str(cache))
    assert sorted(Registry.discover().plugins) == ["attn_core", "good"]
    assert probes == ["good"] and len(json.loads(cache.read_text())["probes"]) == 1
