"""pytest hook specifications added by the conformance kit (no torch import here)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_attn_core_registry(config: pytest.Config) -> Any:
    """Return the :class:`attn_core.registry.Registry` the kit resolves ``--attn-backend`` in.

    :param config: the pytest config.
    :returns: a registry, or None to let the kit build one with ``Registry.discover()`` (plus
        ``--attn-plugin`` / ``ATTN_CORE_EXTRA_PLUGINS`` objects).

    firstresult: the first conftest or plugin that returns a registry wins. The kit adds the
    reference plugin (``attn_core``) to it if it is missing, since every check compares with it.
    """
