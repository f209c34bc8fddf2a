"""MiniMax (lightning attention) and LFM2 (gated short conv) end to end against transformers.

The generic decoder test (test_e2e.py) runs both at fp32; here: the comparison catches a wrong
slope and a wrong conv activation, bf16 stays within tolerance, the kernel shapes build, and
`attn run` takes their config.json files (and refuses the remote-code MiniMax-M1 form, which
transformers cannot build).
"""

from __future__ import annotations

import json

import pytest
import torch

from attn_core.e2e import run_architecture, tiny_config
from attn_core.e2e.adapters import CausalLMAdapter
from attn_core.e2e.configs import build_tiny
from attn_core.e2e.main import resolve_models
from attn_core.models import specs_from_hf_config


def test_wrong_slope_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CausalLMAdapter._attend

    def doubled(self, i, q, k, v, out, **inputs):
        if "slope" in inputs:
            inputs["slope"] = inputs["slope"] * 2
        return real(self, i, q, k, v, out, **inputs)

    monkeypatch.setattr(CausalLMAdapter, "_attend", doubled)
    run = run_architecture("minimax", prompts=2, max_new_tokens=3)
    assert not run.ok and run.match.max_abs_diff > 1e-3


def test_wrong_conv_activation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CausalLMAdapter._conv

    def silu(self, i, x, weight, bias, activation):
        return real(self, i, x, weight, bias, "silu")

    monkeypatch.setattr(CausalLMAdapter, "_conv", silu)
    run = run_architecture("lfm2", prompts=2, max_new_tokens=3)
    assert not run.ok and run.match.max_abs_diff > 1e-3


def test_transformers_without_the_device_argument_of_get_slope_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Earlier transformers 5.x releases define ``get_slope_rate(self)`` with no ``device``
    argument (the H200's install does): building and running MiniMax must not depend on it."""
    from transformers.models.minimax import modeling_minimax

    real = modeling_minimax.MiniMaxLightningAttention.get_slope_rate

    def no_device(self):
        return real(self)

    monkeypatch.setattr(modeling_minimax.MiniMaxLightningAttention, "get_slope_rate", no_device)
    run = run_architecture("minimax", prompts=2, max_new_tokens=3)
    assert run.ok, run.format()


def test_decay_tables_are_built_from_cpu_slopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier transformers 5.x releases build ``decay_factors``' position range on the CPU
    whatever the slopes' device (a CUDA model raised "Expected all tensors to be on the same
    device" on the H200): the tables are computed from CPU slopes and then copied over."""
    from transformers.models.minimax import modeling_minimax

    real = modeling_minimax.MiniMaxLightningAttention.decay_factors
    devices: list[str] = []

    def cpu_range(self, slope_rate):
        devices.append(slope_rate.device.type)
        if slope_rate.device.type != "cpu":  # what the earlier release's CPU arange meets
            raise RuntimeError("Expected all tensors to be on the same device")
        return real(self, slope_rate)

    monkeypatch.setattr(modeling_minimax.MiniMaxLightningAttention, "decay_factors", cpu_range)
    build_tiny("minimax")
    assert devices and set(devices) == {"cpu"}


@pytest.mark.parametrize("name", ["minimax", "lfm2"])
def test_bf16_cpu_within_tolerance(name: str) -> None:
    run = run_architecture(name, dtype="bfloat16", prompts=4, max_new_tokens=6)
    assert run.ok, run.format()


@pytest.mark.parametrize("name", ["minimax", "lfm2"])
def test_kernel_shapes_map(name: str) -> None:
    layout = specs_from_hf_config(tiny_config(name, "kernel"), dtype="bfloat16")
    linear = next(g.spec for g in layout.groups if g.spec.kind.value == "linear")
    if name == "minimax":
        assert (linear.head_dim, linear.head_dim_v) == (128, 128)
    else:
        assert linear.conv_channels == 256


def test_run_takes_their_config_files_and_refuses_the_hub_m1_form(tmp_path) -> None:
    for name in ("minimax", "lfm2"):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(tiny_config(name)))
        assert resolve_models(str(path.parent)) == [str(path.parent)]
    cfg = tiny_config("minimax")
    types = cfg.pop("layer_types")
    cfg["model_type"] = "minimax_m1"
    cfg["attn_type_list"] = [1 if t == "full_attention" else 0 for t in types]
    path = tmp_path / "m1.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="transformers has no class for it"):
        resolve_models(str(path))


@pytest.mark.parametrize("name", ["minimax", "lfm2"])
def test_kernel_shapes_match_transformers_cpu(name: str) -> None:
    """The GPU runs' shapes (lightning heads of 128, a 256-channel conv) match on CPU too."""
    run = run_architecture(name, prompts=2, max_new_tokens=3, shapes="kernel")
    assert run.ok, run.format()


CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ("minimax", "lfm2")])
def test_cuda_graph_decode_gpu(name: str) -> None:
    run = run_architecture(
        name, device="cuda", dtype="float32", prompts=3, max_new_tokens=6, graphs=True
    )
    assert run.graph_replays > 0, run.format()
    assert run.match.max_abs_diff < 1e-3 and run.match.token_agreement == 1.0, run.format()


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ("minimax", "lfm2")])
def test_triton_ssm_serves_them_on_gpu_with_graphs(name: str) -> None:
    """At kernel shapes on a GPU the linear group goes to triton_ssm (not the reference), and
    bf16 generation with captured decode steps stays within tolerance."""
    from attn_core.registry import Registry

    run = run_architecture(
        name,
        device="cuda",
        dtype="bfloat16",
        prompts=3,
        max_new_tokens=6,
        graphs=True,
        shapes="kernel",
        registry=Registry.discover(),
    )
    linear = [g for g in run.plan["groups"] if g["spec"].startswith("linear")]
    assert linear and all(g["backend"] == "triton_ssm:triton_ssm" for g in linear), run.format()
    assert run.graph_replays > 0 and run.ok, run.format()
