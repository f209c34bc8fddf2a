"""Run the plugin's tests from a source checkout: put the plugin and the core on ``sys.path``,
skip ``gpu`` tests without CUDA, and remove ``ATTN_CORE_*`` variables a shell may have set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_PLUGIN = Path(__file__).resolve().parents[1]
_ROOT = _PLUGIN.parents[1]
for path in (_PLUGIN, _ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_attn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ATTN_CORE_"):
            monkeypatch.delenv(name)
