"""Tensor parallelism: Qwen3 attention heads over 2 ranks (torchrun) vs the unsharded run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "attn_core.e2e.tp_check", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_tp2_gloo_matches_tp1() -> None:
    proc = _torchrun("--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tp=2 vs tp=1" in proc.stdout and "-> OK" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_nccl_matches_tp1() -> None:
    proc = _torchrun("--device", "cuda")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "-> OK" in proc.stdout
