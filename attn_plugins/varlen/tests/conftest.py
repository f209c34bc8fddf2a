"""Source-checkout test setup of the plugin: see :mod:`attn_core.testing.gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

if (_ROOT := str(Path(__file__).resolve().parents[3])) not in sys.path:
    sys.path.insert(0, _ROOT)  # so that attn_core imports without ``pip install``

from attn_core.testing.gpu import clean_attn_env, pytest_collection_modifyitems, use_checkout  # noqa: F401

use_checkout(__file__)
