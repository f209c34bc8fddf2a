"""Offline plans (issue 24 item 4): planning for a named target on a machine that is not it.

A plan for a target (``attn explain MODEL --target h200`` on a machine without that GPU) ranks the
backends by their static capabilities: a backend this machine cannot load is marked "not loadable
here", not rejected. A plan for this machine (a detected device, or a target equal to it) still
rejects it, and the runtime refuses a plan whose chosen backend cannot be loaded here.

Which devices this machine has is stubbed (``selector._local_cuda_devices``), so every test says
the same on a CPU machine and on an H200.
"""

from __future__ import annotations

import json

import pytest

from attn_core import cli, selector
from attn_core.backend import Backend, BackendCapabilities
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import is_this_machine, select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers
from attn_core.state import PersistentState

H200 = DeviceCapabilities.target("h200")
H100 = DeviceCapabilities.target("h100")
CPU = DeviceCapabilities.target("cpu")
WHY = "libfast is not importable: No module named 'libfast'"
FULL = LayerSpec(kind="full", num_heads=32, num_kv_heads=8, head_dim=128)
LIMITS = dict(max_batch_size=4, max_num_tokens=64)


def _fast(available: bool = False, **caps) -> Backend:
    caps = {
        "kinds": {"full"},
        "device_types": {"cuda"},
        "dtypes": {"bfloat16", "float16"},
        "min_compute_capability": (9, 0),
        "head_dims": {64, 128},
        **caps,
    }
    return Backend(
        name="fast",
        capabilities=BackendCapabilities(**caps),
        priority=100,
        available=available,
        unavailable_reason=None if available else WHY,
    )


@pytest.fixture
def fast_registry(make_plugin) -> Registry:
    """The reference plus ``fast:fast``: an sm90 backend this machine cannot load."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    reg.register_plugin(make_plugin("fast", [_fast()]), name="fast")
    return reg


@pytest.fixture
def no_gpu_here(monkeypatch):
    monkeypatch.setattr(selector, "_local_cuda_devices", lambda: [])


@pytest.fixture
def h200_here(monkeypatch):
    monkeypatch.setattr(selector, "_local_cuda_devices", lambda: [("NVIDIA H200", (9, 0))])


# ------------------------------------------------------------------------------------------
# Which plans are for this machine
# ------------------------------------------------------------------------------------------
def test_a_target_is_this_machine_only_when_the_machine_has_that_device(monkeypatch):
    monkeypatch.setattr(selector, "_local_cuda_devices", lambda: [])
    assert is_this_machine(CPU)  # every machine has its CPU
    assert not is_this_machine(H200)
    monkeypatch.setattr(
        selector, "_local_cuda_devices", lambda: [("NVIDIA H100 80GB HBM3", (9, 0))]
    )
    assert is_this_machine(H100) and is_this_machine(CPU)
    assert not is_this_machine(H200)  # same architecture, another device
    monkeypatch.setattr(
        selector,
        "_local_cuda_devices",
        lambda: [("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA H200", (9, 0))],
    )
    assert is_this_machine(H200)


def test_local_cuda_devices_reads_torch(monkeypatch):
    import torch

    class Props:
        name, major, minor = "NVIDIA H200", 9, 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    assert selector._local_cuda_devices() == [("NVIDIA H200", (9, 0))] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selector._local_cuda_devices() == []


# ------------------------------------------------------------------------------------------
# The selector
# ------------------------------------------------------------------------------------------
def test_offline_plan_chooses_what_the_target_would_and_marks_it(fast_registry, no_gpu_here):
    plan = select(group_layers([FULL]), fast_registry, H200, ExecutionConstraints(**LIMITS))
    assert plan.local is False
    choice = plan.choice("full")
    assert choice.backend.qualified_name == "fast:fast"
    assert choice.not_loadable_here == (("fast:fast", WHY),)
    assert not choice.loadable_here
    assert choice.outranked == ("attn_core:reference",)
    assert [r.code for r in choice.rejected] == []  # nothing rejected for the target
    assert choice.downgraded_from == ()


def test_offline_plan_still_rejects_what_the_target_cannot_serve(fast_registry, no_gpu_here):
    plan = select(
        group_layers([FULL.with_(head_dim=256)]),
        fast_registry,
        H200,
        ExecutionConstraints(downgrade="allow", **LIMITS),
    )
    choice = plan.choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert [(r.backend, r.code) for r in choice.rejected] == [("fast:fast", "head_dim")]
    assert choice.loadable_here
    # a rejected candidate this machine cannot load is still named so
    assert choice.not_loadable_here == (("fast:fast", WHY),)


def test_plan_for_this_machine_rejects_what_it_cannot_load(fast_registry, h200_here):
    """A target equal to the detected device is this machine: unavailability rejects."""
    with pytest.warns(UserWarning, match="falls back to attn_core:reference"):
        plan = select(group_layers([FULL]), fast_registry, H200, ExecutionConstraints(**LIMITS))
    assert plan.local is True
    choice = plan.choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert [(r.backend, r.code, r.reason) for r in choice.rejected] == [
        ("fast:fast", "unavailable", WHY)
    ]
    assert choice.not_loadable_here == ()
    assert choice.downgraded_from == ("fast:fast",)


def test_local_can_be_given_explicitly(fast_registry, no_gpu_here):
    groups, c = group_layers([FULL]), ExecutionConstraints(downgrade="allow", **LIMITS)
    assert select(groups, fast_registry, H200, c, local=True).choice("full").backend.name == (
        "reference"
    )
    assert select(groups, fast_registry, H200, c, local=False).choice("full").backend.name == (
        "fast"
    )


def test_plan_json_says_which_backends_are_not_loadable_here(fast_registry, no_gpu_here):
    plan = select(group_layers([FULL]), fast_registry, H200, ExecutionConstraints(**LIMITS))
    d = plan.to_dict()
    assert d["local"] is False
    (g,) = d["groups"]
    assert g["backend"] == "fast:fast" and g["loadable_here"] is False
    assert g["not_loadable_here"] == [{"backend": "fast:fast", "reason": WHY}]
    local = select(
        group_layers([FULL]), fast_registry, CPU, ExecutionConstraints(downgrade="allow", **LIMITS)
    ).to_dict()
    assert local["local"] is True
    assert local["groups"][0]["loadable_here"] is True
    assert local["groups"][0]["not_loadable_here"] == []


# ------------------------------------------------------------------------------------------
# The runtime
# ------------------------------------------------------------------------------------------
def test_runtime_refuses_a_plan_whose_backend_is_not_loadable_here(fast_registry, no_gpu_here):
    plan = select(group_layers([FULL]), fast_registry, H200, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=4, num_slots=1, device="cpu")
    with pytest.raises(ValueError) as info:
        AttentionRuntime(plan, fast_registry, state=state)
    msg = str(info.value)
    assert msg.startswith(
        f"layer group 'full': the plan chooses fast:fast, which is not loadable here: {WHY}"
    ), msg
    assert "offline plan for NVIDIA H200" in msg
    assert "DeviceCapabilities.detect()" in msg


def test_runtime_accepts_an_offline_plan_whose_backends_load_here(fast_registry, no_gpu_here):
    spec = FULL.with_(dtype="float32", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    plan = select(
        group_layers([spec]),
        fast_registry,
        H200,
        ExecutionConstraints(downgrade="allow", **LIMITS),
    )
    assert plan.local is False and plan.choice("full").backend.name == "reference"
    state = PersistentState.from_plan(plan, num_pages=4, num_slots=1, device="cpu")
    runtime = AttentionRuntime(plan, fast_registry, state=state)
    assert runtime.groups["full"].backend.qualified_name == "attn_core:reference"
    assert runtime.binding(0).layer_index == 0


# ------------------------------------------------------------------------------------------
# attn explain
# ------------------------------------------------------------------------------------------
@pytest.fixture
def explain(monkeypatch, capsys, fast_registry):
    monkeypatch.setattr(cli, "_registry", lambda args: fast_registry)
    monkeypatch.setenv("COLUMNS", "250")  # one line per table row

    def run(*argv: str) -> tuple[int, str, str]:
        rc = cli.main(["explain", "qwen3", *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("│ ") and not line.startswith("│ backend "):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


def test_explain_target_marks_backends_not_loadable_here(explain, no_gpu_here):
    rc, out, err = explain("--target", "h200")
    assert (rc, err) == (0, "")
    assert "offline plan for a target, not this machine" in out
    rows = _rows(out)
    assert rows["fast:fast"] == ["chosen", f"not loadable here: {WHY}"]
    assert rows["attn_core:reference"] == ["admissible, ranked lower", ""]
    assert "[unavailable]" not in out and "warning:" not in out


def test_explain_target_json_says_which(explain, no_gpu_here):
    rc, out, _ = explain("--target", "h200", "--json")
    assert rc == 0
    payload = json.loads(out)
    assert payload["local"] is False
    (g,) = payload["groups"]
    assert (g["backend"], g["loadable_here"]) == ("fast:fast", False)
    assert g["not_loadable_here"] == [{"backend": "fast:fast", "reason": WHY}]


def test_explain_on_the_target_itself_rejects_as_before(explain, h200_here):
    rc, out, _ = explain("--target", "h200")
    assert rc == 0
    assert "offline plan" not in out
    rows = _rows(out)
    assert rows["attn_core:reference"][0] == "chosen (downgraded from fast:fast)"
    assert rows["fast:fast"] == ["rejected", f"[unavailable] {WHY}"]
    rc, out, _ = explain("--target", "h200", "--json")
    payload = json.loads(out)
    assert payload["local"] is True
    assert payload["groups"][0]["not_loadable_here"] == []
