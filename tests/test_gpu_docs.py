"""docs/gpu.md's stage table names exactly the stages scripts/gpu_run.sh runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script_stages() -> set[str]:
    """The named branches of gpu_run.sh's ``case`` (``NAME=COMMAND`` and the catch-all aside)."""
    text = (ROOT / "scripts" / "gpu_run.sh").read_text()
    return set(re.findall(r"^([a-z_0-9]+)\)", text, flags=re.MULTILINE))


def _documented_stages() -> set[str]:
    """The stage names in the first column of gpu.md's table of stages."""
    names: set[str] = set()
    for line in (ROOT / "docs" / "gpu.md").read_text().splitlines():
        first = line.split("|")[1] if line.startswith("| `") else ""
        names |= set(re.findall(r"`([a-z_0-9]+)`", first))
    return names


def test_every_gpu_stage_is_documented_and_every_documented_stage_exists():
    script, docs = _script_stages(), _documented_stages()
    assert {"info", "install", "kit_fi", "b_tuned"} <= script  # the parse found the stages
    assert script - docs == set(), f"stages gpu.md does not list: {sorted(script - docs)}"
    assert docs - script == set(), f"gpu.md lists stages the script lacks: {sorted(docs - script)}"
