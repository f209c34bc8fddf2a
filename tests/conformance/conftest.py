"""Helpers for running the conformance kit in a pytester subprocess."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SDPA_EXAMPLE = REPO / "docs" / "examples" / "sdpa_backend"


def _entry_point_installed() -> bool:
    return any(
        ep.value == "attn_core.testing.plugin" for ep in metadata.entry_points(group="pytest11")
    )


@pytest.fixture
def run_kit(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """Run pytest with the kit in a subprocess rooted at the pytester dir; returns the result."""
    paths = [str(pytester.path), str(REPO), str(SDPA_EXAMPLE)]
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + ([old] if old else [])))
    for name in (
        "ATTN_CORE_CONFORMANCE_BACKEND",
        "ATTN_CORE_EXTRA_PLUGINS",
        "ATTN_CORE_CONFORMANCE_SEED",
        "ATTN_CORE_CONFORMANCE_QUICK",
        "ATTN_CORE_CONFORMANCE_SHARD",
    ):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, timeout: float = 300) -> pytest.RunResult:
        # Source checkout without the entry point: load the plugin by module name instead.
        extra = [] if _entry_point_installed() else ["-p", "attn_core.testing.plugin"]
        return pytester.runpytest_subprocess(
            *extra, "-p", "no:cacheprovider", "-rfEs", *args, timeout=timeout
        )

    return run
