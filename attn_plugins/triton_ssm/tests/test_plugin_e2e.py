"""The families of triton_ssm's newer kernels end to end through the plugin: Jamba and
Falcon-Mamba with every Mamba1 layer on ``triton_ssm:triton_ssm_mamba1``, MiniMax-Text-01
(lightning attention) and LFM2 (the short conv) with their linear layers on
``triton_ssm:triton_ssm``, and Falcon-H1 with the Mamba2 op of every parallel layer on
``triton_ssm:triton_ssm`` beside the attention op on the reference (each layer keeps a conv / SSM
slot served by the plugin and KV pages served by the reference): continuous batching (chunked
prefill, mixed steps, greedy decode) against transformers' own forward of the same random-weight
model.

Without CUDA the kernels run in Triton's CPU interpreter (``ATTN_TRITON_SSM_INTERPRET=1``) at
the tiny shapes; with CUDA the same comparison runs compiled, at the shapes of a GPU run.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "attn_plugin_triton_ssm.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from test_plugin_harness import REFERENCE, TRITON, TRITON_MAMBA1, available_registry  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def registry(monkeypatch):
    return available_registry(monkeypatch, TRITON_MAMBA1)


@pytest.mark.parametrize("name", ["falcon-mamba", "jamba"])
def test_mamba1_models_match_transformers_through_the_plugin(registry, name):
    from attn_core.e2e import run_architecture

    run = run_architecture(name, device=DEV, prompts=4, max_new_tokens=6, registry=registry)
    backends = {g["group_id"]: g["backend"] for g in run.plan["groups"]}
    assert backends["linear"] == TRITON_MAMBA1, run.format()
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.match.token_agreement == 1.0 and run.ok, run.format()
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.mode_counts


@pytest.mark.parametrize("name", ["minimax", "lfm2"])
def test_lightning_and_short_conv_models_match_transformers_through_the_plugin(monkeypatch, name):
    from attn_core.e2e import run_architecture

    registry = available_registry(monkeypatch, TRITON)
    run = run_architecture(name, device=DEV, prompts=3, max_new_tokens=4, registry=registry)
    linear = [g for g in run.plan["groups"] if g["group_id"].startswith("linear")]
    assert linear and all(g["backend"] == TRITON for g in linear), run.format()
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.match.token_agreement == 1.0 and run.ok, run.format()
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.mode_counts


def test_falcon_h1_matches_transformers_with_the_mamba2_ops_on_the_plugin(monkeypatch):
    from attn_core.e2e import run_architecture

    registry = available_registry(monkeypatch, TRITON)
    shapes = "kernel" if HAS_CUDA else "tiny"
    run = run_architecture(
        "falcon-h1", device=DEV, prompts=3, max_new_tokens=4, registry=registry, shapes=shapes
    )
    groups = {g["group_id"]: (g["backend"], g["layers"]) for g in run.plan["groups"]}
    assert groups == {"linear": (TRITON, [0, 1, 2]), "full": (REFERENCE, [0, 1, 2])}, run.format()
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.match.token_agreement == 1.0 and run.ok, run.format()
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.mode_counts
