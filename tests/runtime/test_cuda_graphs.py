"""CUDA-graph decode: capture ``binding.forward`` once, replay with new metadata == eager.

The batch is padded (``pad_to``) to the captured size; before each replay the builder rebuilds
the step into the same device buffers and ``runtime.update(batch)`` refreshes every context in
place. The replay must compute the *new* batch (other requests, other lengths, page-boundary
crossings), never the one seen at capture.
"""

from __future__ import annotations

import pytest
import torch

from attn_core.batch import BatchBuilder
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerKind, group_layers
from attn_core.state import PersistentState

pytestmark = pytest.mark.gpu
PAD = 4


def _all_state(state):
    tensors = [t for la in state.kv_cache.layers() for t in la.tensors().values()]
    tensors += [t for la in state.state_slots.layers() for t in la.tensors().values()]
    return tensors


def test_decode_graph_replay_with_new_metadata_equals_eager(tiny_specs, ref_registry):
    device = torch.device("cuda")
    specs = [tiny_specs["full"], tiny_specs["mla"], tiny_specs["gdn"], tiny_specs["mamba2"]]
    groups = group_layers(specs)
    state = PersistentState(groups, num_pages=64, num_slots=16, device=device)
    constraints = ExecutionConstraints(max_batch_size=8, max_num_tokens=64, graph_mode="decode")
    plan = select(groups, ref_registry, DeviceCapabilities.detect(device), constraints)
    runtime = AttentionRuntime(plan, ref_registry, state=state, device=device)
    builder = BatchBuilder(
        state, max_batch_size=8, max_num_tokens=64, max_pages_per_request=16, device=device
    )
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    # static per-layer inputs / outputs of the captured step
    static = []
    for s in specs:
        H, Hkv, D, Dv = s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim_v
        if s.kind is LayerKind.FULL:
            inp = {"q": rnd(PAD, H, D), "k": rnd(PAD, Hkv, D), "v": rnd(PAD, Hkv, Dv)}
        elif s.kind is LayerKind.MLA:
            inp = {"q": rnd(PAD, H, D), "k": rnd(PAD, D), "v": None}
        else:
            inp = {"q": rnd(PAD, Hkv, D), "k": rnd(PAD, Hkv, D), "v": rnd(PAD, H, Dv)}
            if s.linear_variant.value == "mamba2":
                inp |= {
                    "dt": rnd(PAD, H),
                    "A_log": rnd(H).abs().log(),
                    "D": rnd(H),
                    "dt_bias": rnd(H) * 0.1,
                }
            else:
                inp |= {
                    "g": torch.nn.functional.logsigmoid(rnd(PAD, H)),
                    "beta": torch.sigmoid(rnd(PAD, H)),
                }
        static.append((inp, torch.zeros(PAD, s.num_heads, s.head_dim_v, device=device)))

    def step():
        for i, (inp, out) in enumerate(static):
            rest = {k: v for k, v in inp.items() if k not in ("q", "k", "v")}
            runtime.binding(i).forward(inp["q"], inp["k"], inp["v"], out=out, **rest)

    # three requests with some history
    for r, n in (("a", 3), ("b", 6), ("c", 1)):
        state.add_request(r)
        state.ensure_capacity(r, n)
        state.advance(r, n)

    batch = builder.build([("a", 1), ("b", 1)], pad_to=PAD)
    runtime.prepare(batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    snap = [t.clone() for t in _all_state(state)]
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, s in zip(_all_state(state), snap, strict=True):
        t.copy_(s)

    # a different batch: other requests, order, lengths (c crosses a page boundary at 4)
    for r in ("a", "b"):
        state.ensure_capacity(r, state.num_tokens(r) + 1)
        state.advance(r, 1)
    state.ensure_capacity("c", 3)
    state.advance("c", 2)
    new = builder.build([("c", 1), ("a", 1), ("b", 1)], pad_to=PAD)
    runtime.update(new)
    for inp, _ in static:  # new token inputs, copied into the captured buffers
        for v in inp.values():
            if v is not None and v.shape[0] == PAD:
                v.copy_(rnd(*v.shape))

    before = [t.clone() for t in _all_state(state)]
    graph.replay()
    torch.cuda.synchronize()
    replay_out = [out[: new.num_reqs].clone() for _, out in static]
    replay_state = [t.clone() for t in _all_state(state)]

    for t, s in zip(_all_state(state), before, strict=True):
        t.copy_(s)
    runtime.prepare(new)
    step()  # eager
    torch.cuda.synchronize()
    for i, (_, out) in enumerate(static):
        torch.testing.assert_close(
            replay_out[i],
            out[: new.num_reqs],
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, i=i: f"layer {i}: {m}",
        )
    for a, b in zip(replay_state, _all_state(state), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
