"""Graph modes per phase: what each phase's steps are captured as, and how the downgrade policy
lowers ``full`` -> ``decode`` -> ``none`` (issue 24 item 8).

Under graph mode ``full`` prefill / mixed steps are captured (one graph at the step's fixed
padded sizes) and decode / verify steps are captured as under ``decode``: a backend that serves
only decode steps needs to capture decode steps, not mixed ones. Under ``decode`` prefill / mixed
steps run eagerly.
"""

from __future__ import annotations

import json
import warnings

import pytest

from attn_core import cli
from attn_core.backend import Backend, BackendCapabilities
from attn_core.errors import SelectionError
from attn_core.registry import Registry
from attn_core.selector import check_backend, constraints_for_phases, select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerSpec,
    Phase,
    group_layers,
)

CPU = DeviceCapabilities.target("cpu")
SMALL = LayerSpec(kind="full", num_heads=2, num_kv_heads=1, head_dim=8, dtype="float32")
LINEAR = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    conv_kernel_size=4,
    conv_channels=48,
    dtype="float32",
    state_dtype="float32",
)


def _backend(modes: set[str], *, phases=None, kinds=("full",), name="b", plugin="t") -> Backend:
    caps = BackendCapabilities(
        kinds=set(kinds),
        linear_variants={"gated_deltanet"} if "linear" in kinds else set(),
        device_types={"cpu"},
        dtypes={"float32"},
        graph_modes=modes,
        phases=phases or {"prefill", "decode", "verify"},
        max_speculative_tokens=4,
    )
    return Backend(name=name, capabilities=caps, plugin=plugin)


def _registry(make_plugin, *backends: tuple[str, int, set[str], tuple[str, ...]]) -> Registry:
    """The reference (graph modes none and decode) plus ``(plugin, priority, modes, kinds)``."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, priority, modes, kinds in backends:
        caps = BackendCapabilities(
            kinds=set(kinds),
            linear_variants={"gated_deltanet"} if "linear" in kinds else set(),
            device_types={"cpu"},
            dtypes={"float32"},
            graph_modes=modes,
        )
        reg.register_plugin(
            make_plugin(plugin, [Backend(name="k", capabilities=caps, priority=priority)]),
            name=plugin,
        )
    return reg


# ------------------------------------------------------------------------------------------
# What a phase's steps need
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.VERIFY])
def test_decode_steps_under_full_need_decode_capture_only(phase):
    backend = _backend({"none", "decode"})
    cons = ExecutionConstraints(graph_mode="full", speculative_tokens=2)
    assert check_backend(backend, SMALL, CPU, cons, phase=phase) == []


def test_mixed_steps_under_full_need_full_capture():
    backend = _backend({"none", "decode"})
    cons = ExecutionConstraints(graph_mode="full")
    rs = check_backend(backend, SMALL, CPU, cons, phase="prefill")
    assert [(r.code, r.fix) for r in rs] == [("graph_mode", "graph_mode full -> decode")]
    # expected and got, and which steps are captured
    assert rs[0].reason == (
        "captures CUDA-graph modes decode, none; graph mode full captures prefill / mixed "
        "steps, which needs full"
    )


def test_a_backend_that_captures_full_captures_decode_steps_too():
    backend = _backend({"none", "full"})
    for mode in ("decode", "full"):
        cons = ExecutionConstraints(graph_mode=mode)
        assert check_backend(backend, SMALL, CPU, cons, phase="decode") == []
        assert check_backend(backend, SMALL, CPU, cons, phase="prefill") == []


def test_decode_mode_keeps_prefill_steps_eager():
    backend = _backend({"none"})
    cons = ExecutionConstraints(graph_mode="decode")
    assert check_backend(backend, SMALL, CPU, cons, phase="prefill") == []
    assert [r.code for r in check_backend(backend, SMALL, CPU, cons, phase="decode")] == [
        "graph_mode"
    ]


@pytest.mark.parametrize(
    ("mode", "phases", "allocated"),
    [
        ("full", ("prefill", "decode"), "full"),
        ("full", ("prefill",), "full"),
        ("full", ("decode",), "decode"),  # a decode-only backend is never asked for full
        ("full", ("decode", "verify"), "decode"),
        ("decode", ("prefill",), "none"),
        ("decode", ("prefill", "decode"), "decode"),
        ("none", ("decode",), "none"),
    ],
)
def test_a_backend_is_allocated_for_the_modes_of_the_phases_it_serves(mode, phases, allocated):
    cons = ExecutionConstraints(graph_mode=mode)
    assert constraints_for_phases(cons, [Phase(p) for p in phases]).graph_mode.value == allocated


# ------------------------------------------------------------------------------------------
# Requested and granted, per group and phase
# ------------------------------------------------------------------------------------------
def test_a_plan_says_requested_and_granted_per_group_and_phase(make_plugin):
    reg = _registry(make_plugin, ("capt", 5, {"none", "decode", "full"}, ("full",)))
    plan = select(group_layers([SMALL]), reg, CPU, ExecutionConstraints(graph_mode="full"))
    assert plan.constraints.graph_mode is GraphMode.FULL and plan.graph_mode_requested is None
    assert plan.phase_graph_modes(Phase.PREFILL) == (GraphMode.FULL, GraphMode.FULL)
    assert plan.phase_graph_modes(Phase.DECODE) == (GraphMode.DECODE, GraphMode.DECODE)
    phases = plan.to_dict()["groups"][0]["phases"]
    assert {p: (v["graph_mode_requested"], v["graph_mode"]) for p, v in phases.items()} == {
        "prefill": ("full", "full"),
        "decode": ("decode", "decode"),
    }


def test_a_lowered_plan_says_what_each_phase_asked_for(make_plugin):
    reg = _registry(make_plugin, ("fast", 10, {"none", "decode"}, ("full",)))
    cons = ExecutionConstraints(graph_mode="full", downgrade="allow")
    plan = select(group_layers([SMALL]), reg, CPU, cons)
    assert plan.constraints.graph_mode is GraphMode.DECODE
    assert plan.phase_graph_modes("prefill") == (GraphMode.FULL, GraphMode.NONE)
    assert plan.phase_graph_modes("decode") == (GraphMode.DECODE, GraphMode.DECODE)
    d = json.loads(json.dumps(plan.to_dict()))
    assert (d["graph_mode_requested"], d["graph_mode"]) == ("full", "decode")
    prefill = d["groups"][0]["phases"]["prefill"]
    assert (prefill["graph_mode_requested"], prefill["graph_mode"]) == ("full", "none")


# ------------------------------------------------------------------------------------------
# The downgrade policy: warn names every group that blocks, error names group, backend,
# expected and got
# ------------------------------------------------------------------------------------------
def _two_groups():
    return group_layers([SMALL, LINEAR])


def test_the_warning_names_every_group_without_a_full_capture(make_plugin):
    reg = _registry(
        make_plugin,
        ("fast", 10, {"none", "decode"}, ("full",)),
        ("ssm", 10, {"none", "decode"}, ("linear",)),
    )
    with pytest.warns(UserWarning) as record:
        plan = select(_two_groups(), reg, CPU, ExecutionConstraints(graph_mode="full"))
    assert plan.constraints.graph_mode is GraphMode.DECODE
    (message,) = [str(w.message) for w in record]
    assert message.startswith("graph mode lowered full -> decode: ")
    ids = [g.group_id for g in _two_groups()]
    for gid in ids:
        assert f"no backend can serve layer group {gid!r}" in message
    # the backends that rank above the plan's choice, and why
    assert "  fast:k:\n    - [graph_mode] captures CUDA-graph modes decode, none" in message
    assert "  ssm:k:\n    - [graph_mode]" in message


def test_the_error_names_group_backend_expected_and_got(make_plugin):
    reg = _registry(make_plugin, ("fast", 10, {"none", "decode"}, ("full",)))
    with pytest.raises(SelectionError) as info:
        select(
            group_layers([SMALL]),
            reg,
            CPU,
            ExecutionConstraints(graph_mode="full", downgrade="error"),
        )
    msg = str(info.value)
    assert "layer group 'full'" in msg
    assert "fast:k" in msg
    assert "graph mode full captures prefill / mixed steps, which needs full" in msg  # expected
    assert "captures CUDA-graph modes decode, none" in msg  # got
    assert "[downgrade policy: error]" in msg


def test_allow_lowers_silently(make_plugin):
    reg = _registry(make_plugin, ("fast", 10, {"none", "decode"}, ("full",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = select(
            _two_groups()[:1], reg, CPU, ExecutionConstraints(graph_mode="full", downgrade="allow")
        )
    assert plan.constraints.graph_mode is GraphMode.DECODE


# ------------------------------------------------------------------------------------------
# attn explain
# ------------------------------------------------------------------------------------------
@pytest.fixture
def use_registry(monkeypatch):
    def use(reg):
        monkeypatch.setattr(cli, "_registry", lambda args: reg)
        return reg

    return use


def test_explain_shows_requested_and_granted_and_warns_on_stderr(capsys, use_registry):
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    use_registry(reg)
    rc = cli.main(["explain", "qwen3", "--target", "cpu", "--graph-mode", "full"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "graph mode: decode (lowered from full)" in out
    assert "CUDA graphs: prefill / mixed steps none (asked full); decode steps decode" in out
    assert "warning: graph mode lowered full -> decode" in err
    assert "graph mode lowered" not in out
    rc = cli.main(["explain", "qwen3", "--target", "cpu"])  # no graphs asked: no line
    out, err = capsys.readouterr()
    assert rc == 0 and "CUDA graphs:" not in out and not err

    rc = cli.main(["explain", "qwen3", "--target", "cpu", "--graph-mode", "full", "--json"])
    out, err = capsys.readouterr()
    group = json.loads(out)["groups"][0]
    assert group["phases"]["prefill"]["graph_mode_requested"] == "full"
    assert group["phases"]["prefill"]["graph_mode"] == "none"
    assert "graph mode lowered full -> decode" in err


# ------------------------------------------------------------------------------------------
# attn run --graphs [decode|full]
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "graphs"),
    [
        ([], None),
        (["--graphs"], "decode"),
        (["--graphs", "decode"], "decode"),
        (["--graphs", "full"], "full"),
    ],
)
def test_run_graphs_flag(monkeypatch, use_registry, argv, graphs):
    import attn_core.e2e as e2e
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    use_registry(reg)
    seen = {}

    class _Report:
        ok = True

        def format(self):
            return "report"

        def format_tail(self):
            return "1/1 architectures match transformers"

    def fake_run_main(model, **kw):
        seen.update(kw)
        return _Report()

    monkeypatch.setattr(e2e, "run_main", fake_run_main)
    assert cli.main(["run", "--model", "qwen3", "--device", "cpu", *argv]) == 0
    assert seen["graphs"] == graphs
