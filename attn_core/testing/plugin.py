"""pytest plugin of the conformance kit (entry point ``pytest11: attn_core``).

Loaded by every pytest run where attn-core is installed, so it must stay cheap and inert: it
imports nothing heavy at module level and changes nothing unless a backend is named::

    pytest --attn-backend=vendor:name [--attn-quick] [--attn-seed=N] [--attn-device=cpu]
           [--attn-plugin=[NAME=]MODULE[:OBJECT] ...] [--attn-shard=K/N]

With a backend named, the run collects only the kit's battery (:mod:`attn_core.testing.battery`)
instead of the project's tests, parametrised by the capability matrix of that backend, and ends
with one line per advertised capability. Environment equivalents: ``ATTN_CORE_CONFORMANCE_BACKEND``,
``ATTN_CORE_CONFORMANCE_QUICK=1``, ``ATTN_CORE_CONFORMANCE_SEED``, ``ATTN_CORE_CONFORMANCE_DEVICE``,
``ATTN_CORE_EXTRA_PLUGINS`` (comma-separated ``[NAME=]MODULE[:OBJECT]``),
``ATTN_CORE_CONFORMANCE_SHARD``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest

from attn_core.testing.report import CapabilityReport, reason

ENV_BACKEND = "ATTN_CORE_CONFORMANCE_BACKEND"
ENV_QUICK = "ATTN_CORE_CONFORMANCE_QUICK"
ENV_SEED = "ATTN_CORE_CONFORMANCE_SEED"
ENV_DEVICE = "ATTN_CORE_CONFORMANCE_DEVICE"
ENV_EXTRA_PLUGINS = "ATTN_CORE_EXTRA_PLUGINS"
ENV_SHARD = "ATTN_CORE_CONFORMANCE_SHARD"
BATTERY = Path(__file__).with_name("battery.py")

#: The kit session (registry, backend, device, seed), set in ``pytest_configure`` when enabled.
SESSION_KEY = pytest.StashKey[Any]()
REPORT_KEY = pytest.StashKey[CapabilityReport]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from attn_core.testing import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn-core", "attn-core backend conformance kit")
    group.addoption(
        "--attn-backend",
        default=os.environ.get(ENV_BACKEND) or None,
        metavar="VENDOR:NAME",
        help="run the conformance battery against this backend (and nothing else); "
        f"env {ENV_BACKEND}",
    )
    group.addoption(
        "--attn-plugin",
        action="append",
        default=[],
        metavar="[NAME=]MODULE[:OBJECT]",
        help="register this plugin object (module, class or instance) under NAME before "
        f"resolving the backend; repeatable; env {ENV_EXTRA_PLUGINS} (comma-separated)",
    )
    group.addoption(
        "--attn-quick",
        action="store_true",
        default=os.environ.get(ENV_QUICK, "").lower() in ("1", "true", "yes", "on"),
        help=f"a reduced matrix (one representative per sweep, short workloads); env {ENV_QUICK}",
    )
    group.addoption(
        "--attn-seed",
        type=int,
        default=int(os.environ[ENV_SEED]) if os.environ.get(ENV_SEED) else None,
        help=f"base seed of the random inputs (default: fresh each run); env {ENV_SEED}",
    )
    group.addoption(
        "--attn-shard",
        default=os.environ.get(ENV_SHARD) or None,
        metavar="K/N",
        help="run only shard K of N (0 <= K < N; each layer spec's checks in one shard, the "
        "shards balanced), to spread one battery over N GPUs or N processes as N runs with "
        f"the same --attn-seed; env {ENV_SHARD}",
    )
    group.addoption(
        "--attn-device",
        choices=("auto", "cpu", "cuda"),
        default=os.environ.get(ENV_DEVICE) or "auto",
        help="device to run on (auto: CUDA if available and advertised, else CPU); "
        f"env {ENV_DEVICE}",
    )


def enabled(config: pytest.Config) -> bool:
    """Whether this run is a conformance run (a backend was named)."""
    return bool(config.getoption("--attn-backend", default=None))


def _plugin_specs(config: pytest.Config) -> list[str]:
    specs = list(config.getoption("--attn-plugin") or [])
    env = os.environ.get(ENV_EXTRA_PLUGINS, "")
    specs += [s.strip() for s in env.split(",") if s.strip()]
    return specs


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not enabled(config):
        return
    from attn_core.testing.session import KitError, build_session

    try:
        session = build_session(
            backend_name=config.getoption("--attn-backend"),
            plugin_specs=_plugin_specs(config),
            registry=config.pluginmanager.hook.pytest_attn_core_registry(config=config),
            quick=config.getoption("--attn-quick"),
            seed=config.getoption("--attn-seed"),
            device=config.getoption("--attn-device"),
        )
    except KitError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = session
    report = config.stash[REPORT_KEY] = CapabilityReport(
        backend=session.backend_name, device=session.device_label, seed=session.seed
    )
    if not hasattr(config, "workerinput"):  # an xdist worker's controller records its reports
        recorder = _CapabilityRecorder(report, config.pluginmanager.get_plugin("terminalreporter"))
        config.pluginmanager.register(recorder, "attn_core_capabilities")
    # Collect the battery instead of the project's tests; keep explicit battery node ids
    # (``battery.py::test_x[...]``) the user gave.
    battery = str(BATTERY)
    wanted = [a for a in config.args if Path(a.split("::")[0]).name == BATTERY.name]
    config.args[:] = [
        battery + "::" + a.split("::", 1)[1] if "::" in a else battery for a in wanted
    ]
    if not config.args:
        config.args.append(battery)


def _shard(config: pytest.Config) -> tuple[int, int] | None:
    text = config.getoption("--attn-shard", default=None)
    if not text:
        return None
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k < n:
        raise pytest.UsageError(f"--attn-shard={text!r}: expected K/N with 0 <= K < N")
    return k, n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not enabled(config):
        return
    shard = _shard(config)
    if shard is None:
        return
    k, n = shard
    # Collection order is the battery's (deterministic), so the N runs split it exactly. A
    # layer spec's checks stay in one shard: a backend that JIT-compiles per configuration
    # (FlashInfer, Triton) then builds each spec's kernels in one run, where shards that
    # shared a spec would build the same modules (FlashInfer: one at a time, behind its lock).
    groups = _spec_groups(items)
    shard_of = _balanced_shards(groups, n)
    mine = [shard_of[group] == k for group in groups]
    keep = [item for item, ok in zip(items, mine, strict=True) if ok]
    drop = [item for item, ok in zip(items, mine, strict=True) if not ok]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _spec_groups(items: list[pytest.Item]) -> list[int]:
    """Per item, the number of its layer spec in order of first appearance (an item without a
    case, such as a check's skip placeholder, is a group of its own)."""
    numbers: dict[object, int] = {}
    groups = []
    for i, item in enumerate(items):
        callspec = getattr(item, "callspec", None)
        case = callspec.params.get("case") if callspec is not None else None
        key = case.spec_label if case is not None else ("item", i)
        groups.append(numbers.setdefault(key, len(numbers)))
    return groups


def _balanced_shards(groups: list[int], n: int) -> dict[int, int]:
    """Group number -> shard: the largest groups first, each to the shard with the fewest
    items so far (lowest shard on a tie); the same for every one of the N runs."""
    sizes = Counter(groups)
    load = [0] * n
    shard_of = {}
    for group in sorted(sizes, key=lambda g: (-sizes[g], g)):
        shard = min(range(n), key=lambda s: (load[s], s))
        shard_of[group] = shard
        load[shard] += sizes[group]
    return shard_of


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not enabled(config) or SESSION_KEY not in config.stash:
        return None
    return config.stash[SESSION_KEY].header_lines()


def _message(report: pytest.TestReport, call: pytest.CallInfo[None]) -> str:
    """The item's message, whole (the report keeps its first line: :func:`report.reason`)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if call.excinfo is not None:
        return str(call.excinfo.value).strip() or call.excinfo.typename
    return report.outcome


#: user_properties key under which an item's report carries its capability labels and message
_CAPS = "attn_core_capabilities"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    config = item.config
    if not enabled(config) or REPORT_KEY not in config.stash:
        return report
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    capabilities = getattr(case, "capabilities", None)
    if not capabilities:
        return report
    # One record per item: the call phase, or the setup phase when it did not pass. The labels
    # ride on the report (user_properties cross the process boundary under pytest-xdist), and
    # _CapabilityRecorder records them where the terminal summary is written.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        report.user_properties.append((_CAPS, (tuple(capabilities), _message(report, call))))
    return report


class _CapabilityRecorder:
    """Records the capability labels of every item's report where the terminal summary is
    written: in the only process, or in the xdist controller (workers forward their reports).

    A failure's reason is also written the moment it arrives (``attn-core FAIL <test>:
    <reason>``): a run cut by a time limit never reaches its closing summary, and pytest's
    own progress lines name the test but not why it failed.
    """

    def __init__(self, report: CapabilityReport, terminal: Any = None) -> None:
        self.report = report
        self.terminal = terminal

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == _CAPS:  # stored by pytest_runtest_makereport: (labels, message)
                capabilities, message = cast("tuple[tuple[str, ...], str]", value)
                self.report.record(capabilities, report.outcome, report.nodeid, message)
                if report.failed and self.terminal is not None:
                    test = report.nodeid.rpartition("::")[2]
                    self.terminal.write_line(f"attn-core FAIL {test}: {reason(message)}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not enabled(config) or REPORT_KEY not in config.stash:
        return
    report = config.stash[REPORT_KEY]
    counts = report.counts
    terminalreporter.section(
        f"attn-core conformance: {report.backend} on {report.device}, seed {report.seed}"
    )
    for line in report.lines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"capabilities: {counts['PASS']} passed, {counts['FAIL']} failed, "
        f"{counts['SKIP']} skipped (rerun with --attn-seed={report.seed})"
    )
