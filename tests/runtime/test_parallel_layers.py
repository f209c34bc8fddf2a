"""A parallel hybrid's layers (Falcon-H1: attention and Mamba2 side by side in every decoder
layer) hold two ops: the state keeps KV pages and a conv / SSM slot for each such layer, the
runtime binds each op to its own group, and two ops of one role in a layer are refused."""

from __future__ import annotations

import pytest

from attn_core.e2e.configs import tiny_config
from attn_core.models import specs_from_hf_config
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerGroup,
    LayerKind,
    layer_ops,
)
from attn_core.state import PersistentState
from attn_core.state.layout import StateLayout

CPU = DeviceCapabilities.target("cpu")
LIMITS = dict(max_batch_size=4, max_num_tokens=32)


@pytest.fixture
def layout():
    return specs_from_hf_config(tiny_config("falcon-h1"), dtype="float32", page_size=4)


def test_every_parallel_layer_keeps_kv_pages_and_a_state_slot(layout, ref_registry) -> None:
    full = layout.group_of(0, LayerKind.FULL)
    linear = layout.group_of(0, LayerKind.LINEAR)
    state_layout = StateLayout.from_groups(layout.groups)
    assert list(state_layout.kv_specs) == list(state_layout.linear_specs) == [0, 1, 2]
    # both stores are sized for every layer: nothing counted once for a layer in two groups
    assert state_layout.page_bytes == 4 * 3 * full.spec.kv_bytes_per_token
    assert state_layout.slot_bytes == 3 * linear.spec.state_bytes_per_request()
    plan = select(layout.groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=2)
    assert state.kv_cache.layer_indices == state.state_slots.layer_indices == (0, 1, 2)
    assert state.plan_differences(plan) == []


def test_the_runtime_binds_each_op_of_a_parallel_layer_to_its_group(layout, ref_registry) -> None:
    plan = select(layout.groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=2)
    runtime = AttentionRuntime(plan, ref_registry, state=state)
    for i in (0, 1, 2):
        attn, ssm = runtime.binding(i, LayerKind.FULL), runtime.binding(i, LayerKind.LINEAR)
        assert (attn.group_id, ssm.group_id) == ("full", "linear")
        assert attn.layer_index == ssm.layer_index == i
        assert attn.kv is not None and attn.linear_state is None
        assert ssm.linear_state is not None and ssm.kv is None
        assert attn.kv.layer_index == ssm.linear_state.layer_index == i
    assert runtime.bindings == {}  # no layer holds a single op
    with pytest.raises(KeyError, match=r"layer 1 holds parallel ops .*pass kind="):
        runtime.binding(1)
    with pytest.raises(KeyError, match=r"layer 1 has no mla op"):
        runtime.binding(1, LayerKind.MLA)


def test_a_state_without_the_linear_ops_is_named_per_store(layout, ref_registry) -> None:
    """The plan's parallel layers keep a KV entry and a slot each; a state that has only the
    KV one is told apart (keyed by layer and store, not by layer alone)."""
    plan = select(layout.groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    full = layout.group_of(0, LayerKind.FULL)
    state = PersistentState([full], num_pages=8, num_slots=2, page_size=4)
    assert state.plan_differences(plan) == [
        "layers [0 (linear), 1 (linear), 2 (linear)]: in the plan, keep no state here"
    ]


def test_two_ops_of_one_role_in_a_layer_are_refused(layout) -> None:
    full = layout.group_of(0, LayerKind.FULL)
    other = LayerGroup("full.1", full.spec.with_(num_heads=2, num_kv_heads=1), (1,))
    with pytest.raises(ValueError, match=r"layer 1 is in groups 'full' and 'full.1', two attent"):
        StateLayout.from_groups([full, other])
    with pytest.raises(ValueError, match="two attention ops"):
        PersistentState([full, other], num_pages=8, num_slots=2)
    linear = layout.group_of(0, LayerKind.LINEAR)
    twin = LayerGroup("linear.1", linear.spec.with_(num_heads=3, num_kv_heads=1), (2,))
    with pytest.raises(ValueError, match=r"layer 2 .* two linear ops"):
        layer_ops([linear, twin])
    assert set(layer_ops([full, linear])) == {0, 1, 2}


def test_a_plan_of_two_stacks_is_refused_but_each_stack_runs(ref_registry) -> None:
    """A multi-stack layout (Qwen2.5-VL's vision tower and language model) numbers each stack's
    layers from 0: one runtime over both would give layer 0 two attention ops. The parallel
    hybrid rule (one attention op and one linear op per layer) refuses it and says what to do."""
    from attn_core.models import load_sample

    whole = specs_from_hf_config(load_sample("qwen2.5-vl"), dtype="float32")
    plan = select(whole.groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    with pytest.raises(ValueError, match=r"two attention ops .*plan one stack at a time"):
        AttentionRuntime(plan, ref_registry, state=None)
    text = whole.stack_layout("text")
    plan = select(text.groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=2)
    runtime = AttentionRuntime(plan, ref_registry, state=state)
    assert runtime.binding(text.layer_indices[0]).group_id == "text.full"
