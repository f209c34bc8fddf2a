"""Run an attn_core two-rank check (``tp_check``, ``handoff_check``) under torchrun, as the
tests of both do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node 2 -m MODULE ARGS`` from the checkout
    root, with it on ``PYTHONPATH``; output captured."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", module, *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
