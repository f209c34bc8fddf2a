"""Make the plugin (and these helpers) importable from a source checkout; keep FlashInfer's JIT
cache in the repository's git-ignored ``.jit/`` folder so a second run reuses compiled kernels."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_PLUGIN_ROOT = Path(__file__).resolve().parents[1]
_REPO_ROOT = Path(__file__).resolve().parents[3]
for p in (_PLUGIN_ROOT, Path(__file__).resolve().parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# Without a GPU the plugin's own Triton kernels (small_decode) run in Triton's CPU interpreter,
# which must be chosen before any @triton.jit function is created.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Must be set before flashinfer is imported (flashinfer.jit.env reads it at import time).
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(_REPO_ROOT / ".jit"))

# every test without the developer's ATTN_CORE_* variables, at a fixed terminal width
from attn_core.testing.gpu import clean_attn_env  # noqa: E402, F401
