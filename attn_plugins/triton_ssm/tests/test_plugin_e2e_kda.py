"""Kimi-Linear end to end with every KDA layer on ``triton_ssm:triton_ssm`` (its MLA layers on
whichever backend serves them): the conv over q|k|v, chunked prefill, mixed steps and greedy
decode against transformers' own forward of the same random-weight model.

Without CUDA the kernels run in Triton's CPU interpreter (``ATTN_TRITON_SSM_INTERPRET=1``) at
the tiny shapes; with CUDA the same comparison runs compiled.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "attn_plugin_triton_ssm.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from test_plugin_harness import TRITON, available_registry  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"

pytest.importorskip("transformers")


@pytest.fixture
def registry(monkeypatch):
    return available_registry(monkeypatch, TRITON)


def test_kimi_linear_matches_transformers_through_the_plugin(registry):
    from attn_core.e2e import run_architecture

    run = run_architecture(
        "kimi-linear", device=DEV, prompts=4, max_new_tokens=6, registry=registry
    )
    backends = {g["group_id"]: g["backend"] for g in run.plan["groups"]}
    assert backends["linear"] == TRITON, run.format()
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.match.token_agreement == 1.0 and run.ok, run.format()
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.mode_counts
