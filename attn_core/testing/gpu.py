"""Shared pytest glue of the plugins' test folders (``attn_plugins/<name>/tests/conftest.py``).

A plugin's conftest puts the repository root on ``sys.path`` (so this module imports from a
source checkout) and then imports the two pytest names below, which pytest only finds when they
are module attributes of the conftest::

    from attn_core.testing.gpu import clean_attn_env, pytest_collection_modifyitems, use_checkout

    use_checkout(__file__)

- :func:`use_checkout` puts the plugin and the repository root on ``sys.path``, so the tests run
  without ``pip install``;
- :func:`pytest_collection_modifyitems` skips tests marked ``gpu`` when there is no CUDA device;
- :func:`clean_attn_env` (autouse) removes the ``ATTN_CORE_*`` variables a developer's shell may
  have set, so ``ATTN_CORE_STRICT=1`` or ``ATTN_CORE_BACKENDS=...`` never changes a result, and
  pins the terminal width that tables wrap to.

Not imported by :mod:`attn_core.testing` (it imports torch); only the conftests import it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

__all__ = ["clean_attn_env", "pytest_collection_modifyitems", "use_checkout"]


def use_checkout(conftest_file: str | os.PathLike[str]) -> None:
    """Put the plugin folder and the repository root of the conftest at ``conftest_file``
    (``<root>/attn_plugins/<name>/tests/conftest.py``) at the front of ``sys.path``, unless there
    already."""
    plugin = Path(conftest_file).resolve().parents[1]
    for path in (plugin, plugin.parents[1]):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every collected test marked ``gpu`` when CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_attn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every ``ATTN_CORE_*`` environment variable for the duration of a test, and make
    the terminal 120 columns wide (``COLUMNS``): the CLI's tables wrap to the terminal, which
    differs between a shell, CI and pytest-xdist's workers (80 columns), and a test's text
    assertions must see one layout everywhere."""
    for name in list(os.environ):
        if name.startswith("ATTN_CORE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "120")
