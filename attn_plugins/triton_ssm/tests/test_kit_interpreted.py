"""The conformance kit certifies triton_ssm's kernels on a machine without a GPU too: the whole
quick battery of both backends runs their Triton kernels in Triton's CPU interpreter
(``ATTN_TRITON_SSM_INTERPRET=1``), every linear variant, its speculative verify in both the
native and the replay strategy included. On a GPU the kit runs compiled (``gpu_run.sh
kit_ssm``), so this test is for machines without one.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_plugin_harness import TRITON, TRITON_MAMBA1

from attn_core.testing.report import statuses

SEED = 7
#: a draw at which Mamba1's bf16 state pools of the kernel and the reference came out of a step
#: one bf16 ulp apart in 6 of 160 entries (each side rounds its own float32 state, and a few
#: land on either side of a rounding boundary); the next step's output read the largest entry,
#: 2.6, one ulp (0.0156) apart, times C (1.26): 0.0196 on an output of 0.76
ROUNDING_FLIP_SEED = 327942285
VARIANTS = {
    TRITON: ("gated_deltanet", "kda", "mamba2", "lightning", "short_conv"),
    TRITON_MAMBA1: ("mamba1",),
}
#: capabilities every variant must pass, besides speculative verify
CHECKS = (
    "kind",
    "dtype bfloat16",
    "life cycle (many steps, changing batches)",
    "state hand-off (chunked prefill)",
    "prefix-cache restore (conv + SSM)",
)


def _kit(tmp_path: Path, backend: str, seed: int, *select: str) -> subprocess.CompletedProcess:
    """The quick kit of ``backend`` in a fresh process on the interpreted kernels."""
    # the kit's own settings (backend, seed, extra plugins) come from the arguments only
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_CORE_")}
    env.update(ATTN_TRITON_SSM_INTERPRET="1", TRITON_INTERPRET="1")
    loaded = not env.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") and any(
        e.value == "attn_core.testing.plugin"
        for e in importlib.metadata.entry_points(group="pytest11")
    )
    args = [] if loaded else ["-p", "attn_core.testing.plugin"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "-rfEs",
         f"--attn-backend={backend}", "--attn-quick", f"--attn-seed={seed}", *select],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kit runs compiled: kit_ssm")
def test_a_16_bit_state_one_ulp_off_across_a_rounding_boundary_passes(tmp_path: Path) -> None:
    proc = _kit(tmp_path, TRITON_MAMBA1, ROUNDING_FLIP_SEED, "-k", "state-bfloat16")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kit runs compiled: kit_ssm")
@pytest.mark.parametrize("backend", sorted(VARIANTS))
def test_the_kit_passes_on_the_interpreted_kernels(tmp_path: Path, backend: str) -> None:
    proc = _kit(tmp_path, backend, SEED)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = statuses(proc.stdout.splitlines())
    assert not [c for c, s in summary.items() if s == "FAIL"], summary
    for variant in VARIANTS[backend]:
        # the short conv keeps no SSM state; the delta rule's layers choose the q/k l2norm
        extra = () if variant == "short_conv" else ("float32 state precision",)
        if variant in ("gated_deltanet", "kda"):
            extra += ("without the q/k l2norm",)
        for check in (*CHECKS, *extra):
            assert summary.get(f"linear/{variant}: {check}") == "PASS", (variant, check)
        for k in (1, 4):
            for strategy in ("native", "replay"):
                label = f"linear/{variant}: speculative verify k={k} ({strategy})"
                assert summary.get(label) == "PASS", label
    assert f"attn-core conformance: {backend} on cpu" in proc.stdout
