"""Advertisement of the triton_ssm backend: capabilities, availability with a reason, what the
selector makes of it on CPU and H200 targets, workspace declarations, and lazy kernel import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from test_plugin_harness import REFERENCE, TRITON, make_registry

from attn_core.models import load_sample, specs_from_hf_config
from attn_core.selector import check_backend, select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, GraphMode, torch_dtype

HAS_CUDA = torch.cuda.is_available()
PLUGIN_ROOT = Path(__file__).resolve().parents[1]
ENV = "ATTN_TRITON_SSM_INTERPRET"


@pytest.fixture
def no_interpret(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def qwen3_next():
    layout = specs_from_hf_config(load_sample("qwen3-next"))
    linear = next(g for g in layout.groups if g.spec.kind.value == "linear")
    return layout.groups, linear


def test_contract_version_and_capabilities(no_interpret):
    from attn_plugin_triton_ssm import plugin

    assert plugin.ATTN_CORE_API_VERSION == "1.2"
    backend = make_registry().resolve(TRITON)
    caps = backend.capabilities
    assert backend.priority == 100
    assert {k.value for k in caps.kinds} == {"linear"}
    assert {v.value for v in caps.linear_variants} == {
        "gated_deltanet",
        "kda",
        "mamba2",
        "lightning",
        "short_conv",
    }
    assert caps.device_types == {"cuda"} and caps.min_compute_capability == (8, 0)
    assert caps.dtypes == {"float32", "bfloat16", "float16"}
    assert caps.state_dtypes == {"float32", "bfloat16"}
    assert caps.graph_modes == {GraphMode.NONE, GraphMode.DECODE}
    assert caps.spec_verify_strategies == {"native", "replay"}
    assert caps.max_speculative_tokens == 7
    assert {64, 128, 256} <= caps.head_dims


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA advertisement")
def test_unavailable_on_cpu_with_a_reason(no_interpret):
    backend = make_registry().resolve(TRITON)
    assert not backend.available
    assert "CUDA" in backend.unavailable_reason and ENV in backend.unavailable_reason


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA advertisement")
def test_selector_rejects_it_on_cpu_with_reason_codes(no_interpret, qwen3_next):
    groups, linear = qwen3_next
    plan = select(groups, make_registry(), DeviceCapabilities.target("cpu"), ExecutionConstraints())
    choice = plan.choice(linear.group_id)
    assert choice.backend.qualified_name == REFERENCE
    codes = {r.code for r in choice.rejections_by_backend()[TRITON]}
    assert codes == {"unavailable", "device_type"}


def test_selector_would_choose_it_on_h200_for_qwen3_next(no_interpret, qwen3_next):
    """Every capability admits Qwen3-Next's GDN group on an H200 (decode graphs, 3 drafts with
    replay): an offline plan chooses it; a plan for a machine without CUDA rejects it only for
    availability."""
    groups, linear = qwen3_next
    h200 = DeviceCapabilities.target("h200")
    constraints = ExecutionConstraints(
        graph_mode="decode", speculative_tokens=3, spec_verify_strategy="replay", downgrade="allow"
    )
    registry = make_registry()
    backend = registry.resolve(TRITON)
    usable = dataclasses.replace(backend, available=True, unavailable_reason=None)
    assert check_backend(usable, linear.spec, h200, constraints) == []
    # (the reference fallback verifies natively only, so plan with the default strategy)
    native = constraints.with_(spec_verify_strategy=None)
    offline = select(groups, registry, h200, native, local=False).choice(linear.group_id)
    assert offline.backend.qualified_name == TRITON  # what an H200 would choose
    assert REFERENCE in offline.outranked
    assert offline.loadable_here is backend.available
    plan = select(groups, registry, h200, native, local=True)
    choice = plan.choice(linear.group_id)
    if backend.available:
        assert choice.backend.qualified_name == TRITON
        assert REFERENCE in choice.outranked
    else:
        codes = {r.code for r in choice.rejections_by_backend()[TRITON]}
        assert codes == {"unavailable"}
    # too many drafts and sm75 are rejected with their own codes
    rejected = check_backend(
        usable,
        linear.spec,
        dataclasses.replace(h200, compute_capability=(7, 5)),
        constraints.with_(speculative_tokens=8),
    )
    assert {r.code for r in rejected} == {"compute_capability", "speculative"}


def test_interpret_mode_advertises_cpu_only(monkeypatch, qwen3_next):
    monkeypatch.setenv(ENV, "1")
    backend = make_registry().resolve(TRITON)
    assert backend.available, backend.unavailable_reason
    assert backend.capabilities.device_types == {"cpu"}
    assert "interpreter" in backend.description
    groups, linear = qwen3_next
    plan = select(groups, make_registry(), DeviceCapabilities.target("cpu"))
    assert plan.choice(linear.group_id).backend.qualified_name == TRITON


def test_workspace_for_qwen3_next_native_verify(no_interpret, qwen3_next):
    from attn_plugin_triton_ssm import plugin

    _, linear = qwen3_next
    backend = make_registry().resolve(TRITON)
    h200 = DeviceCapabilities.target("h200")
    c = ExecutionConstraints(max_batch_size=64, speculative_tokens=3)
    reqs = plugin.attn_core_workspace_requirements(backend, linear, h200, c)
    assert [r.name for r in reqs] == [f"verify_states.{i}" for i in linear.layer_indices]
    assert all(r.shape == (64, 4, 32, 128, 128) for r in reqs)
    assert all(r.dtype == torch_dtype(linear.spec.state_dtype) for r in reqs)
    assert plugin.attn_core_workspace_requirements(backend, linear, h200, c.with_(
        spec_verify_strategy="replay")) == []  # fmt: skip
    assert (
        plugin.attn_core_workspace_requirements(backend, linear, h200, ExecutionConstraints()) == []
    )


def test_entry_point_names_the_plugin_module():
    meta = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["attn_core"] == {
        "triton_ssm": "attn_plugin_triton_ssm.plugin"
    }


def test_registering_does_not_import_triton_or_the_kernels():
    code = (
        "import sys\n"
        "from attn_core.registry import Registry\n"
        "from attn_plugin_triton_ssm import plugin\n"
        "r = Registry(); r.register_plugin(plugin, name='triton_ssm')\n"
        "assert r.resolve('triton_ssm:triton_ssm')\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.endswith('.kernels')))\n"
    )
    env_path = f"{PLUGIN_ROOT}:{Path(__file__).resolve().parents[3]}"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("sample", ["minimax", "lfm2"])
def test_selector_would_choose_it_on_h200_for_minimax_and_lfm2(no_interpret, sample):
    """MiniMax's lightning group (64 heads of 128) and LFM2's short-conv group (a 2048-channel
    conv: no heads, so no head-dim limit applies) are admitted on an H200, decode graphs and
    3 drafts in both verify strategies; no native-verify workspace for the short conv."""
    layout = specs_from_hf_config(sample)
    linear = next(g for g in layout.groups if g.group_id == "linear")
    h200 = DeviceCapabilities.target("h200")
    backend = dataclasses.replace(
        make_registry().resolve(TRITON), available=True, unavailable_reason=None
    )
    for strategy in ("native", "replay"):
        constraints = ExecutionConstraints(
            graph_mode="decode", speculative_tokens=3, spec_verify_strategy=strategy
        )
        assert check_backend(backend, linear.spec, h200, constraints) == [], strategy
    from attn_plugin_triton_ssm import plugin

    native = ExecutionConstraints(speculative_tokens=3, spec_verify_strategy="native")
    ws = plugin.attn_core_workspace_requirements(backend, linear, h200, native)
    assert len(ws) == (len(linear.layer_indices) if sample == "minimax" else 0)
