"""GPU tests of the plugin at realistic shapes (compiled kernels): every batch mode against the
reference backend, and CUDA-graph decode replay with changed metadata equal to eager.

Skipped without CUDA, and when this process built the kernels for the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from test_plugin_harness import (
    LAYERS,
    REFERENCE,
    TRITON,
    TRITON_MAMBA1,
    layer_params,
    make_lane,
    make_registry,
    make_spec,
    run_step,
    states,
    step_inputs,
)

from attn_core.specs import DeviceCapabilities, ExecutionConstraints

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Qwen3-Next GDN, Kimi-Linear-like KDA, Nemotron-H-like Mamba2 (fewer heads to keep it quick)
SHAPES = {
    "gated_deltanet": dict(hv=32, hk=16, dk=128, dv=128, channels=8192),
    "kda": dict(hv=32, hk=32, dk=128, dv=128, channels=12288),
    "mamba2": dict(hv=32, hk=8, dk=128, dv=64, channels=6144),
    # Falcon-Mamba-7B / Jamba at tp=2: 4096 inner channels (one head each), d_state 16
    "mamba1": dict(hv=4096, hk=1, dk=16, dv=1, channels=4096),
}


def _backend(variant: str) -> str:
    return TRITON_MAMBA1 if variant == "mamba1" else TRITON


TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 activations, fp32 state and math


@pytest.fixture(scope="module")
def registry():
    from attn_plugin_triton_ssm import plugin

    if plugin.kernels().INTERPRETED:
        pytest.skip("kernels were built for the Triton interpreter in this process")
    reg = make_registry()
    assert reg.resolve(TRITON).available
    return reg


def _lane(registry, name, spec, constraints):
    lane = make_lane(
        registry, name, spec, "cuda", DeviceCapabilities.detect("cuda"), constraints, num_slots=16
    )
    lane.params = layer_params(spec, "cuda", seed=3)
    return lane


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(b.float(), a.float(), **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("strategy", ["native", "replay"])
@pytest.mark.parametrize("variant", list(SHAPES))
def test_realistic_shapes_match_reference(registry, variant, strategy):
    spec = make_spec(variant, dtype="bfloat16", **SHAPES[variant])
    c = ExecutionConstraints(
        max_batch_size=16, max_num_tokens=1024, speculative_tokens=3, spec_verify_strategy=strategy
    )
    lanes = [
        _lane(registry, REFERENCE, spec, c.with_(spec_verify_strategy=None)),
        _lane(registry, _backend(variant), spec, c),
    ]
    reqs = ["a", "b", "c", "d"]
    for lane in lanes:
        for r in reqs:
            lane.state.add_request(r)
    steps = [
        ([("a", 300), ("b", 77), ("c", 129)], 0),  # prefill
        ([("a", 1), ("d", 200), ("b", 1), ("c", 5)], 0),  # mixed, decodes not first
        ([("c", 1), ("a", 1), ("b", 1), ("d", 1)], 0),  # decode
        ([("a", 4), ("b", 4), ("c", 4), ("d", 4)], 3),  # verify
    ]
    for n, (requests, k) in enumerate(steps):
        tokens = sum(t for _, t in requests)
        inputs = step_inputs(spec, tokens, "cuda", seed=n)
        res = [run_step(lane, requests, inputs, spec_tokens=k) for lane in lanes]
        for i in LAYERS:
            _close(res[0][i][0], res[1][i][0], f"step {n} L{i} conv")
            _close(res[0][i][1], res[1][i][1], f"step {n} L{i} out")
        if k:
            acc = torch.tensor([1, 4, 2, 3], dtype=torch.int32)
            for lane in lanes:
                lane.runtime.commit_speculative(lane.batch, acc)
        for i in LAYERS:
            for a, b, name in zip(
                states(lanes[0])[i], states(lanes[1])[i], ("conv", "ssm"), strict=True
            ):
                _close(a, b, f"step {n} L{i} {name} state")
        if not k:  # (verify is the last step)
            for lane in lanes:
                for r, t in requests:
                    lane.state.advance(r, t)


@pytest.mark.parametrize("variant", ["gated_deltanet", "mamba2", "mamba1"])
def test_cuda_graph_decode_replay_with_new_metadata_equals_eager(registry, variant):
    spec = make_spec(variant, dtype="bfloat16", **SHAPES[variant])
    c = ExecutionConstraints(max_batch_size=16, max_num_tokens=1024, graph_mode="decode")
    lane = _lane(registry, _backend(variant), spec, c)
    reqs = [f"r{i}" for i in range(6)]
    for r in reqs:
        lane.state.add_request(r)
    run_step(lane, [(r, 17) for r in reqs], step_inputs(spec, 6 * 17, "cuda", 0))
    for r in reqs:
        lane.state.advance(r, 17)

    pad = 8
    static = step_inputs(spec, pad, "cuda", 1)
    outs = {
        i: (torch.empty_like(static[i]["conv_x"]), torch.empty_like(static[i]["v"])) for i in LAYERS
    }

    def body():
        for i in LAYERS:
            b, x, p = lane.runtime.binding(i), static[i], lane.params[i]
            b.conv1d(x["conv_x"], p["conv_w"], p["conv_b"], out=outs[i][0])
            extra = dict(x["extra"])
            if "A_log" in p:
                extra.update(A_log=p["A_log"], D=p["D"], dt_bias=p["dt_bias"])
            b.forward(x["q"], x["k"], x["v"], out=outs[i][1], **extra)

    capture_batch = lane.builder.build([(r, 1) for r in reqs[:5]], pad_to=pad)
    lane.runtime.prepare(capture_batch)
    snapshot = states(lane)
    body()  # warm-up: compiles every kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    _restore(lane, snapshot)

    # a different batch: other requests, other order, fewer rows (more padding)
    replay_reqs = [reqs[5], reqs[2], reqs[0]]
    batch = lane.builder.build([(r, 1) for r in replay_reqs], pad_to=pad)
    lane.runtime.update(batch)
    new = step_inputs(spec, pad, "cuda", 2)
    for i in LAYERS:
        _copy_inputs(static[i], new[i])
    graph.replay()
    torch.cuda.synchronize()
    got = {i: (outs[i][0][:3].clone(), outs[i][1][:3].clone()) for i in LAYERS}
    got_states = states(lane)

    _restore(lane, snapshot)
    lane.runtime.prepare(batch)
    body()
    for i in LAYERS:
        assert torch.equal(got[i][0], outs[i][0][:3])
        assert torch.equal(got[i][1], outs[i][1][:3])
        for a, b in zip(got_states[i], states(lane)[i], strict=True):
            assert torch.equal(a, b)
    # the slots of requests not in the replayed batch are untouched
    untouched = [lane.state.slot(r) for r in reqs if r not in replay_reqs]
    for i in LAYERS:
        assert torch.equal(got_states[i][1][untouched], snapshot[i][1][untouched])


def _restore(lane, snapshot):
    for i in LAYERS:
        st = lane.state.state_slots.layer(i)
        st.conv.copy_(snapshot[i][0])
        st.ssm.copy_(snapshot[i][1])


def _copy_inputs(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict):
            _copy_inputs(dst[key], value)
        else:
            dst[key].copy_(value)
