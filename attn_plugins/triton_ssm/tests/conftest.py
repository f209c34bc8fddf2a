"""Make the plugin importable from a source checkout (no ``pip install`` needed for tests)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# every test without the developer's ATTN_CORE_* variables, at a fixed terminal width
from attn_core.testing.gpu import clean_attn_env  # noqa: E402, F401
