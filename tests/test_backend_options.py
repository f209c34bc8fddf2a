"""Backend options: the schema a backend declares, values from ExecutionConstraints, ``--option``
and ``ATTN_CORE_BACKEND_OPTIONS``, their precedence, the errors select() raises, what a plugin's
hooks receive, ``attn explain``, and the reference's ``decode_path`` run end to end on CPU."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import attn_core.reference.plugin as ref
from attn_core.backend import Backend, BackendCapabilities, OptionSpec
from attn_core.batch import BatchBuilder
from attn_core.cli import main
from attn_core.errors import PluginError, SelectionError
from attn_core.options import ENV_OPTIONS
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, group_layers
from attn_core.state import PersistentState

CPU = DeviceCapabilities.target("cpu")


def caps() -> BackendCapabilities:
    return BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})


SCHEMA = {
    "split_kv": OptionSpec(bool, True, "split long KV ranges"),
    "num_splits": OptionSpec(int, 0, "0: a heuristic picks"),
    "schedule": OptionSpec(str, "auto", "work order", choices=("auto", "lpt")),
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_OPTIONS, raising=False)
    monkeypatch.delenv("ATTN_CORE_BACKENDS", raising=False)


@pytest.fixture
def seen() -> list[dict[str, object]]:
    return []


@pytest.fixture
def registry(seen, make_plugin) -> Registry:
    """The reference plus ``vendor:fast`` (priority 10, declares SCHEMA) whose hooks record the
    options of the backend they receive, then hand over to the reference's context."""

    def requirements(backend):
        seen.append({"hook": "requirements", **dict(backend.options)})
        return []

    def allocate(backend, group, device, constraints, state, workspace):
        seen.append({"hook": "allocate", **dict(backend.options)})
        return ref.attn_core_allocate_context(backend, group, device, constraints, state, workspace)

    fast = Backend(name="fast", capabilities=caps(), priority=10, option_schema=SCHEMA)
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    reg.register_plugin(
        make_plugin("vendor", [fast], allocate=allocate, requirements=requirements),
        name="vendor",
    )
    return reg


def _groups(tiny_specs):
    return group_layers([tiny_specs["full"]])


# ------------------------------------------------------------------------------------------
# The schema
# ------------------------------------------------------------------------------------------
def test_option_spec_converts_text_and_refuses_bad_values():
    b = OptionSpec(bool, True)
    assert [b.convert(t) for t in ("false", "0", "No", "on", True)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert OptionSpec(int, 0).convert("4") == 4
    assert OptionSpec(float, 0.5).convert(2) == 2.0
    s = OptionSpec(str, "auto", choices=("auto", "lpt"))
    assert s.convert("lpt") == "lpt"
    with pytest.raises(ValueError, match=r"'maybe' is not a bool \(true/false\)"):
        b.convert("maybe")
    # "an int", "a float": the article follows the type's name
    with pytest.raises(ValueError, match="True is not an int"):
        OptionSpec(int, 0).convert(True)  # a bool is no int
    with pytest.raises(ValueError, match="'x' is not a float"):
        OptionSpec(float, 0.5).convert("x")
    with pytest.raises(ValueError, match="OptionSpec default='0': expected an int"):
        OptionSpec(int, "0")
    with pytest.raises(ValueError, match="'fifo' is not one of 'auto', 'lpt'"):
        s.convert("fifo")
    with pytest.raises(ValueError, match="default='x' is not among choices"):
        OptionSpec(str, "x", choices=("a",))
    with pytest.raises(ValueError, match="expected one of bool, int, float, str"):
        OptionSpec(list, [])


def test_backend_keeps_the_schema_sorted_and_refuses_a_non_spec():
    b = Backend(name="x", capabilities=caps(), option_schema=SCHEMA)
    assert [k for k, _ in b.option_schema] == ["num_splits", "schedule", "split_kv"]
    hash(b)  # still hashable (a plan is)
    with pytest.raises(TypeError, match="option 'split_kv': expected an OptionSpec"):
        Backend(name="x", capabilities=caps(), option_schema={"split_kv": True})
    with pytest.raises(ValueError, match="option name 'split-kv'"):
        Backend(name="x", capabilities=caps(), option_schema={"split-kv": SCHEMA["split_kv"]})


# ------------------------------------------------------------------------------------------
# Selection: values, defaults, sources, precedence
# ------------------------------------------------------------------------------------------
def test_defaults_fill_the_options_of_the_chosen_backend(registry, tiny_specs):
    plan = select(_groups(tiny_specs), registry, CPU)
    c = plan.choices[0]
    assert c.backend.qualified_name == "vendor:fast"
    assert c.options == {"num_splits": 0, "schedule": "auto", "split_kv": True}
    assert dict(c.option_sources) == dict.fromkeys(c.options, "default")


def test_constraints_beat_cli_beat_env(registry, tiny_specs, monkeypatch):
    env = "fast.split_kv=false,vendor:fast.num_splits=2,fast.schedule=lpt"
    monkeypatch.setenv(ENV_OPTIONS, env)
    constraints = ExecutionConstraints(
        cli_backend_options={"fast": {"num_splits": "3", "schedule": "auto"}},
        backend_options={"vendor:fast": {"schedule": "lpt"}},
    )
    c = select(_groups(tiny_specs), registry, CPU, constraints).choices[0]
    assert c.options == {"split_kv": False, "num_splits": 3, "schedule": "lpt"}
    sources = dict(c.option_sources)
    assert sources["split_kv"].startswith(f"{ENV_OPTIONS}=")
    assert sources["num_splits"] == "--option"
    assert sources["schedule"] == "ExecutionConstraints.backend_options"


@pytest.mark.parametrize(
    ("constraints", "env", "pattern"),
    [
        (
            {"backend_options": {"fast": {"splitkv": True}}},
            None,
            r"ExecutionConstraints.backend_options: backend 'vendor:fast' has no option 'splitkv'; "
            r"it declares: num_splits, schedule, split_kv",
        ),
        (
            {"cli_backend_options": {"fast": {"schedule": "fifo"}}},
            None,
            r"--option: option 'schedule' of backend 'vendor:fast': 'fifo' is not one of "
            r"'auto', 'lpt' \(work order\)",
        ),
        (
            {},
            "fast.num_splits=four",
            r"ATTN_CORE_BACKEND_OPTIONS='fast.num_splits=four': option 'num_splits' of backend "
            r"'vendor:fast': 'four' is not an int",
        ),
        (
            {},
            "nosuch.key=1",
            r"ATTN_CORE_BACKEND_OPTIONS='nosuch.key=1': options for backend 'nosuch': no backend "
            r"named 'nosuch' is registered",
        ),
        (
            {},
            "fast.split_kv",
            r"ATTN_CORE_BACKEND_OPTIONS='fast.split_kv': entry 'fast.split_kv' is malformed",
        ),
        (
            # the reference is not chosen here (vendor:fast outranks it): still checked
            {"backend_options": {"reference": {"decode_path": "slow"}}},
            None,
            r"option 'decode_path' of backend 'attn_core:reference': 'slow' is not one of "
            r"'fixed', 'ragged'",
        ),
    ],
)
def test_bad_options_are_selection_errors(
    registry, tiny_specs, monkeypatch, constraints, env, pattern
):
    if env is not None:
        monkeypatch.setenv(ENV_OPTIONS, env)
    with pytest.raises(SelectionError, match=pattern):
        select(_groups(tiny_specs), registry, CPU, ExecutionConstraints(**constraints))


def test_hooks_receive_the_options_in_force(registry, tiny_specs, seen):
    groups = _groups(tiny_specs)
    plan = select(
        groups, registry, CPU, ExecutionConstraints(backend_options={"fast": {"num_splits": 4}})
    )
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=2)
    AttentionRuntime(plan, registry, state=state)
    want = {"num_splits": 4, "schedule": "auto", "split_kv": True}
    assert seen == [{"hook": "requirements", **want}, {"hook": "allocate", **want}]


# ------------------------------------------------------------------------------------------
# The reference's decode_path, end to end on CPU
# ------------------------------------------------------------------------------------------
def _decode_outputs(specs, decode_path: str) -> list[torch.Tensor]:
    """Prefill 5 and 3 tokens, then two decode steps of both requests, through the runtime;
    the outputs of every layer of every step."""
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    groups = group_layers(specs)
    limits = dict(max_batch_size=4, max_num_tokens=16)
    constraints = ExecutionConstraints(
        **limits, cli_backend_options={"reference": {"decode_path": decode_path}}
    )
    plan = select(groups, reg, CPU, constraints)
    assert all(c.options == {"decode_path": decode_path} for c in plan.choices)
    state = PersistentState.from_plan(plan, num_pages=16, num_slots=4)
    runtime = AttentionRuntime(plan, reg, state=state)
    builder = BatchBuilder(state, **limits, max_pages_per_request=8)
    gen = torch.Generator().manual_seed(0)
    outs = []
    for r in ("a", "b"):
        state.add_request(r)
    for step in ([("a", 5), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]):
        batch = builder.build(step)
        runtime.prepare(batch)
        n = sum(t for _, t in step)
        for i, spec in enumerate(specs):
            q = torch.randn(n, spec.num_heads, spec.head_dim, generator=gen)
            if spec.kind.value == "mla":
                k, v = torch.randn(n, spec.head_dim, generator=gen), None
            else:
                k = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen)
                v = torch.randn(n, spec.num_kv_heads, spec.head_dim_v, generator=gen)
            out = torch.empty(n, spec.num_heads, spec.head_dim_v)
            outs.append(runtime.binding(i).forward(q, k, v, out=out).clone())
        for r, t in step:
            state.advance(r, t)
    return outs


def test_reference_decode_path_ragged_runs_decode_through_the_prefill_ops(tiny_specs, monkeypatch):
    specs = [tiny_specs["full"], tiny_specs["mla"]]
    calls: dict[str, int] = {"full": 0, "mla": 0}

    def counting(name: str, fn: Any):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(
        ref.dec, "decode_full_attention", counting("full", ref.dec.decode_full_attention)
    )
    monkeypatch.setattr(
        ref.dec, "decode_mla_attention", counting("mla", ref.dec.decode_mla_attention)
    )
    fixed = _decode_outputs(specs, "fixed")
    assert calls == {"full": 2, "mla": 2}  # two decode steps, one layer each
    ragged = _decode_outputs(specs, "ragged")
    assert calls == {"full": 2, "mla": 2}  # the fixed-shape functions were not called again
    assert len(fixed) == len(ragged) == 6
    for a, b in zip(fixed, ragged, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_reference_refuses_ragged_decode_under_graph_capture(tiny_specs):
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    constraints = ExecutionConstraints(
        graph_mode="decode", backend_options={"reference": {"decode_path": "ragged"}}
    )
    plan = select(_groups(tiny_specs), reg, CPU, constraints)
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=2)
    with pytest.raises(PluginError, match=r"decode_path='ragged'.*cannot be captured"):
        AttentionRuntime(plan, reg, state=state)


# ------------------------------------------------------------------------------------------
# attn explain
# ------------------------------------------------------------------------------------------
def test_explain_shows_the_options_in_force(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_PLUGINS_ALLOW", "attn_core")
    rc = main(["explain", "qwen3", "--target", "cpu", "--option", "reference.decode_path=ragged"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "options: decode_path='ragged' (--option)" in out
    rc = main(["explain", "qwen3", "--target", "cpu", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert payload["groups"][0]["options"] == {
        "decode_path": {"value": "fixed", "source": "default"}
    }


def test_explain_names_the_flag_of_a_bad_option(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_PLUGINS_ALLOW", "attn_core")
    rc = main(["explain", "qwen3", "--target", "cpu", "--option", "reference.decode_path=slow"])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "--option: option 'decode_path' of backend 'attn_core:reference': 'slow' is not one of "
        "'fixed', 'ragged'" in err
    )


def test_list_json_shows_the_declared_options(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_PLUGINS_ALLOW", "attn_core")
    assert main(["list", "--json"]) == 0
    (plugin,) = json.loads(capsys.readouterr().out)["plugins"]
    (backend,) = plugin["backends"]
    assert backend["options"] == {
        "decode_path": {
            "type": "str",
            "default": "fixed",
            "choices": ["fixed", "ragged"],
            "doc": ref.OPTION_SCHEMA["decode_path"].doc,
        }
    }
