"""Per-test wall times written as each test ends, for runs that may be cut at a time limit.

pytest's ``--durations`` prints its table at the end of the session, which a run killed at its
limit never reaches. Loaded with ``-p attn_core.testing.timing`` and given a file in
``ATTN_TEST_TIMES``, this plugin appends one line per finished test as it finishes::

    <seconds setup + call + teardown>\t<outcome>\t<node id>\t<why it failed, or empty>

The last column is the failure's crash message (``AssertionError: ...``, tabs and newlines
folded into spaces; one longer than :data:`WHY_CHARS` characters keeps its two ends): pytest
prints tracebacks only in its closing summary, which a cut run never reaches either.

Under pytest-xdist only the controlling process writes (the workers' reports reach it), so one
file holds every worker's tests. Without ``ATTN_TEST_TIMES`` the plugin does nothing.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["ENV_TIMES", "WHY_CHARS", "pytest_configure", "pytest_runtest_logreport"]

ENV_TIMES = "ATTN_TEST_TIMES"
WHY_CHARS = 400

_path: str | None = None
_seconds: dict[str, float] = {}
_outcome: dict[str, str] = {}
_why: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    global _path
    is_worker = hasattr(config, "workerinput")  # pytest-xdist's worker processes
    _path = None if is_worker else (os.environ.get(ENV_TIMES) or None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _path is None:
        return
    node = report.nodeid
    _seconds[node] = _seconds.get(node, 0.0) + report.duration
    if report.failed or report.when == "call" or node not in _outcome:
        _outcome[node] = "skipped" if report.skipped else report.outcome
    if report.failed and node not in _why:
        _why[node] = _crash_message(report)
    if report.when == "teardown":
        with open(_path, "a", encoding="utf-8") as f:
            why = _why.pop(node, "")
            f.write(f"{_seconds.pop(node):.2f}\t{_outcome.pop(node)}\t{node}\t{why}\n")


def _crash_message(report: pytest.TestReport) -> str:
    """The failure's one-line reason: its crash message, else the report's last text line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or (report.longreprtext.strip().splitlines() or [""])[-1]
    text = " ".join(text.split())
    if len(text) <= WHY_CHARS:
        return text
    # both ends: an assertion's message opens with its text and ends with the failed expression
    head = WHY_CHARS // 3
    return f"{text[:head]} ... {text[head + 5 - WHY_CHARS :]}"
