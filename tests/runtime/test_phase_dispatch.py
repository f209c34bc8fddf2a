"""The runtime serves each step by the backend its plan chose for the step's phase.

Two stand-in CPU plugins run the reference's math through their own contexts (so outputs must
equal the reference's exactly, and the KV one writes is the KV the other reads):

- ``pre:pre``, priority 100, decode priority 10: serves prefill / mixed and verify steps;
- ``dec:dec``, priority 50: serves decode steps.

Every forward is logged by the backend that ran it.
"""

from __future__ import annotations

import pytest
import torch

import attn_core.reference.plugin as ref
from attn_core.backend import Backend, BackendCapabilities
from attn_core.batch import BatchBuilder
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import TuningData, phase_mapping_from_plan, select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    Phase,
    group_layers,
)
from attn_core.state import PersistentState

CPU = DeviceCapabilities.target("cpu")
LIMITS = dict(max_batch_size=4, max_num_tokens=32)
FULL = LayerSpec(
    kind="full", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32"
)
GDN = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    head_dim_v=8,
    conv_kernel_size=4,
    conv_channels=48,
    dtype="float32",
)
SPECS = [GDN, FULL, GDN, FULL]


def _caps(**kw) -> BackendCapabilities:
    fields: dict = dict(
        kinds={"full", "linear"},
        linear_variants={"gated_deltanet"},
        device_types={"cpu", "cuda"},
        dtypes={"float32"},
        graph_modes={"none", "decode"},
        max_speculative_tokens=4,
    )
    return BackendCapabilities(**{**fields, **kw})


def _stand_in(make_plugin, name: str, priority: int, log: list[str], **caps) -> object:
    """A plugin whose contexts are the reference's, with every forward logged."""

    def allocate(backend, group, device, constraints, state, workspace):
        return ref.attn_core_allocate_context(
            backend=backend,
            group=group,
            device=device,
            constraints=constraints,
            state=state,
            workspace=workspace,
        )

    def bind(backend, context):
        def forward(layer, q, k, v, out, **inputs):
            log.append(backend.qualified_name)
            return context.forward(layer, q, k, v, out, **inputs)

        return forward

    backend = Backend(name=name, capabilities=_caps(**caps), priority=priority)
    return make_plugin(name, [backend], allocate=allocate, bind=bind)


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def registry(log, make_plugin) -> Registry:
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    pre = _stand_in(make_plugin, "pre", 100, log, phase_priority={"decode": 10})
    reg.register_plugin(pre, name="pre")
    reg.register_plugin(_stand_in(make_plugin, "dec", 50, log), name="dec")
    return reg


class Lane:
    """A model of SPECS over its own state, driven one step at a time with given inputs."""

    def __init__(
        self,
        registry: Registry,
        constraints: ExecutionConstraints,
        device: str = "cpu",
        tuning: TuningData | None = None,
    ) -> None:
        self.groups = group_layers(SPECS)
        self.device = torch.device(device)
        caps = CPU if device == "cpu" else DeviceCapabilities.detect(self.device)
        self.plan = select(self.groups, registry, caps, constraints, tuning=tuning)
        self.state = PersistentState.from_plan(
            self.plan, num_pages=64, num_slots=8, device=self.device
        )
        self.runtime = AttentionRuntime(self.plan, registry, state=self.state, device=self.device)
        self.builder = BatchBuilder(
            self.state, **LIMITS, max_pages_per_request=16, device=self.device
        )
        self.known: set[int] = set()
        gen = torch.Generator().manual_seed(1)
        self.conv_w = [
            (torch.randn(s.conv_channels, s.conv_kernel_size, generator=gen) * 0.5).to(device)
            if s.kind.value == "linear"
            else None
            for s in SPECS
        ]

    def step(self, reqs, inputs, *, spec_tokens=0):
        """One step of ``reqs`` ([(request id, new tokens)]); a verify step accepts all but
        the last draft token of every request (committed through the verify backend)."""
        for rid, _ in reqs:
            if rid not in self.known:
                self.state.add_request(rid)
                self.known.add(rid)
        batch = self.builder.build(reqs, spec_tokens=spec_tokens)
        self.runtime.prepare(batch)
        outs = self.layers(inputs)
        accepted = [n - 1 if spec_tokens else n for _, n in reqs]
        if spec_tokens:
            self.runtime.commit_speculative(batch, torch.tensor(accepted, dtype=torch.int32))
        for (rid, _), n in zip(reqs, accepted, strict=True):
            self.state.advance(rid, n)
        return batch, outs

    def layers(self, inputs, outs=None):
        """Every layer's forward on the prepared batch (into ``outs`` when given)."""
        results = []
        for i, spec in enumerate(SPECS):
            binding = self.runtime.binding(i)
            t = dict(inputs[i])
            if spec.kind.value == "linear":
                binding.conv1d(t.pop("x"), self.conv_w[i], None)
            q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
            out = (
                outs[i]
                if outs is not None
                else torch.empty(q.shape[0], spec.num_heads, spec.head_dim_v, device=self.device)
            )
            results.append(binding.forward(q, k, v, out=out, **t).clone())
        return results


def _inputs(n: int, seed: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    out = []
    for s in SPECS:
        if s.kind.value == "full":
            out.append(
                {
                    "q": r(n, s.num_heads, s.head_dim),
                    "k": r(n, s.num_kv_heads, s.head_dim),
                    "v": r(n, s.num_kv_heads, s.head_dim_v),
                }
            )
        else:
            out.append(
                {
                    "q": r(n, s.num_kv_heads, s.head_dim),
                    "k": r(n, s.num_kv_heads, s.head_dim),
                    "v": r(n, s.num_heads, s.head_dim_v),
                    "x": r(n, s.conv_channels),
                    "g": torch.nn.functional.logsigmoid(r(n, s.num_heads)) * 0.5,
                    "beta": torch.sigmoid(r(n, s.num_heads)),
                }
            )
    return out


def test_the_plan_splits_the_phases_between_the_stand_ins(registry):
    plan = select(group_layers(SPECS), registry, CPU, ExecutionConstraints(**LIMITS))
    assert phase_mapping_from_plan(plan) == {
        g: {"prefill": "pre:pre", "decode": "dec:dec"} for g in ("linear", "full")
    }


def test_each_step_runs_on_its_phase_backend_and_matches_the_reference(registry, log):
    cons = ExecutionConstraints(**LIMITS, speculative_tokens=2)
    lane = Lane(registry, cons)
    reference = Lane(registry, cons.with_(force={"full": "reference", "linear": "reference"}))
    assert set(phase_mapping_from_plan(reference.plan)["full"].values()) == {"attn_core:reference"}
    rt = lane.runtime
    # one context per distinct backend of every group, all over the one state
    assert sorted(rt.backend_workspaces) == [
        ("full", "dec:dec"),
        ("full", "pre:pre"),
        ("linear", "dec:dec"),
        ("linear", "pre:pre"),
    ]
    # a group's workspace is its chosen (prefill) backend's, not the last one allocated
    for g in ("full", "linear"):
        assert rt.workspaces[g] is rt.backend_workspaces[(g, "pre:pre")], g
    full = rt.groups["full"]
    assert set(full.phase_targets) == set(Phase)
    assert full.phase_targets[Phase.VERIFY][0].qualified_name == "pre:pre"

    steps = [
        # (requests, expected phase, expected backend, spec tokens)
        ([(0, 5), (1, 3)], "prefill", "pre:pre", 0),
        ([(0, 1), (1, 1)], "decode", "dec:dec", 0),
        ([(0, 1), (1, 1)], "decode", "dec:dec", 0),
        ([(0, 1), (2, 6)], "prefill", "pre:pre", 0),  # mixed: a new request's prefill
        ([(0, 1), (1, 1), (2, 1)], "decode", "dec:dec", 0),
        ([(0, 3), (1, 3)], "verify", "pre:pre", 2),
        ([(0, 1), (1, 1)], "decode", "dec:dec", 0),
    ]
    for seed, (reqs, phase, backend, k) in enumerate(steps):
        n = sum(q for _, q in reqs)
        inputs = _inputs(n, seed)
        log.clear()
        batch, outs = lane.step(reqs, inputs, spec_tokens=k)
        assert batch.phase.value == phase
        assert log == [backend] * len(SPECS), (phase, log)
        assert rt.binding(1).backend.qualified_name == backend
        log.clear()
        _, want = reference.step(reqs, inputs, spec_tokens=k)
        assert log == []  # the reference lane ran none of the stand-ins
        for i, (got, exp) in enumerate(zip(outs, want, strict=True)):
            torch.testing.assert_close(got, exp, atol=1e-6, rtol=0, msg=f"{phase} layer {i}")


def test_update_switches_to_the_phase_backend_too(registry, log):
    """Graph replay refreshes the contexts with update(batch): a decode batch updates (and then
    runs) the decode backend's context, the one its graph was captured with."""
    lane = Lane(registry, ExecutionConstraints(**LIMITS, graph_mode="decode"))
    lane.step([(0, 4)], _inputs(4, 0))
    full = lane.runtime.groups["full"]
    assert full.backend.qualified_name == "pre:pre"
    batch = lane.builder.build([(0, 1)])
    lane.runtime.update(batch)
    assert full.backend.qualified_name == "dec:dec"
    assert full.context is full.phase_targets[Phase.DECODE][1]
    assert full.context.batch is batch  # the decode context was updated
    assert full.phase_targets[Phase.PREFILL][1].batch is not batch
    # what the runner captures a decode graph on (an all-padding batch) is a decode step: the
    # capture runs the decode backend
    lane.step([(1, 3)], _inputs(3, 1))
    dummy = lane.builder.build([], pad_to=2)
    assert dummy.phase is Phase.DECODE
    lane.runtime.prepare(dummy)
    assert full.backend.qualified_name == "dec:dec"


def test_one_backend_for_every_phase_keeps_one_context(registry):
    lane = Lane(registry, ExecutionConstraints(**LIMITS, force={"full": "pre", "linear": "pre"}))
    assert sorted(lane.runtime.backend_workspaces) == [("full", "pre:pre"), ("linear", "pre:pre")]
    assert lane.runtime.groups["full"].phase_targets == {}


def test_the_state_matches_a_per_phase_plan(registry):
    """PersistentState.from_plan / plan_differences: the phase backends share the one state."""
    plan = select(group_layers(SPECS), registry, CPU, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=8, num_slots=4)
    assert state.plan_differences(plan) == []


@pytest.mark.gpu
def test_a_decode_graph_is_captured_with_the_decode_backend_and_replays(registry, log):
    """graph_mode decode on CUDA: prefill runs eagerly on pre:pre; the decode step captured
    after prepare(padded decode batch) calls dec:dec, and its replay after a prefill step (which
    switched the groups to pre:pre) and update(new decode batch) equals the eager decode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pad = 4
    cons = ExecutionConstraints(**LIMITS, graph_mode="decode")
    lane = Lane(registry, cons, device="cuda")
    lane.step([(0, 5), (1, 3)], _inputs(8, 0, "cuda"))
    static = _inputs(pad, 1, "cuda")
    outs = [torch.zeros(pad, s.num_heads, s.head_dim_v, device="cuda") for s in SPECS]
    batch = lane.builder.build([(0, 1), (1, 1)], pad_to=pad)
    lane.runtime.prepare(batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lane.layers(static, outs)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    log.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lane.layers(static, outs)
    assert log == ["dec:dec"] * len(SPECS)
    for rid in (0, 1):
        lane.state.advance(rid, 1)
    # an eager prefill of a new request switches every group to pre:pre
    log.clear()
    lane.step([(2, 4)], _inputs(4, 2, "cuda"))
    assert log == ["pre:pre"] * len(SPECS)
    # replay a new decode batch: update() switches back to the captured dec:dec contexts
    new = lane.builder.build([(2, 1), (0, 1), (1, 1)], pad_to=pad)
    lane.runtime.update(new)
    assert lane.runtime.groups["full"].backend.qualified_name == "dec:dec"
    fresh = _inputs(pad, 3, "cuda")
    for layer, src in zip(static, fresh, strict=True):
        for name, t in layer.items():
            t.copy_(src[name])
    snapshot = [t.clone() for la in lane.state.kv_cache.layers() for t in la.tensors().values()]
    snapshot += [t.clone() for la in lane.state.state_slots.layers() for t in la.tensors().values()]
    log.clear()
    graph.replay()
    torch.cuda.synchronize()
    assert log == []  # a replay runs no Python
    replayed = [o[: new.num_reqs].clone() for o in outs]
    live = [t for la in lane.state.kv_cache.layers() for t in la.tensors().values()]
    live += [t for la in lane.state.state_slots.layers() for t in la.tensors().values()]
    for t, s in zip(live, snapshot, strict=True):
        t.copy_(s)
    lane.runtime.prepare(new)
    eager = lane.layers(static)
    assert log == ["dec:dec"] * len(SPECS)
    for i, (got, want) in enumerate(zip(replayed, eager, strict=True)):
        torch.testing.assert_close(
            got, want[: new.num_reqs], atol=1e-5, rtol=1e-5, msg=f"layer {i}"
        )


def test_attn_run_decodes_on_the_decode_backend_and_matches_transformers(registry, log):
    """The whole model path (`attn run` on the CPU): prefill steps on pre:pre, decode steps on
    dec:dec, logits matching transformers; the report names both."""
    pytest.importorskip("transformers")
    from attn_core.e2e import run_main

    report = run_main(
        "qwen3",
        device="cpu",
        dtype="fp32",
        prompts=2,
        max_new_tokens=3,
        graphs=False,
        registry=registry,
        constraints=None,
        progress=False,
        console=lambda *a, **k: None,
    )
    assert report.ok, report.format()
    assert "pre:pre" in log and "dec:dec" in log
    text = report.format()
    assert "full     -> pre:pre" in text and "decode: dec:dec" in text, text


def _steps_run_on(lane, reference, steps, log, *, first_seed: int) -> None:
    """Each ``(requests, backend)`` step runs on ``backend`` in every layer of ``lane`` and its
    outputs equal ``reference``'s."""
    for seed, (reqs, backend) in enumerate(steps, start=first_seed):
        inputs = _inputs(sum(n for _, n in reqs), seed)
        log.clear()
        _, outs = lane.step(reqs, inputs)
        assert log == [backend] * len(SPECS), (reqs, log)
        _, want = reference.step(reqs, inputs)
        for got, exp in zip(outs, want, strict=True):
            torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)


def test_decode_switches_backend_by_batch_bucket_from_tuning(registry, log):
    """Tuning says pre:pre decodes 1 request faster, dec:dec 4: a decode step of one request
    runs on pre:pre, one of three (bucket 4: isqrt(1 * 4) = 2 < 3) on dec:dec, with no
    re-planning; outputs still equal the reference's."""
    tuning = TuningData()
    for spec in (GDN, FULL):
        for backend, b1, b4 in (("pre:pre", 1.0, 9.0), ("dec:dec", 2.0, 3.0)):
            tuning.record(backend, spec, b1, phase="decode", batch=1)
            tuning.record(backend, spec, b4, phase="decode", batch=4)
    cons = ExecutionConstraints(**LIMITS)
    lane = Lane(registry, cons, tuning=tuning)
    decode = lane.plan.choice("full").phase_choice("decode")
    assert [(n, b.qualified_name) for n, b in decode.by_step_size] == [
        (2, "pre:pre"),
        (4, "dec:dec"),
    ]
    reference = Lane(registry, cons.with_(force={"full": "reference", "linear": "reference"}))
    steps = [
        ([(0, 3), (1, 2), (2, 4)], "pre:pre"),  # prefill
        ([(0, 1)], "pre:pre"),  # decode, 1 request
        ([(0, 1), (1, 1), (2, 1)], "dec:dec"),  # decode, 3 requests
        ([(1, 1), (2, 1)], "pre:pre"),  # decode, 2 requests: bucket 1 (bound 2)
    ]
    _steps_run_on(lane, reference, steps, log, first_seed=10)


def test_prefill_switches_backend_by_tokens_per_step_from_tuning(registry, log):
    """Tuning says pre:pre prefills 2 tokens faster and dec:dec 16: a prefill step of 3 tokens
    (over 2 requests) runs on pre:pre (bound isqrt(2 * 16) = 5), one of 9 tokens (over 2
    requests too) on dec:dec: prefill buckets count tokens, not requests."""
    tuning = TuningData()
    for spec in (GDN, FULL):
        for backend, t2, t16 in (("pre:pre", 1.0, 9.0), ("dec:dec", 2.0, 3.0)):
            tuning.record(backend, spec, t2, phase="prefill", tokens=2)
            tuning.record(backend, spec, t16, phase="prefill", tokens=16)
    cons = ExecutionConstraints(**LIMITS)
    lane = Lane(registry, cons, tuning=tuning)
    prefill = lane.plan.choice("full").phase_choice("prefill")
    assert [(n, b.qualified_name) for n, b in prefill.by_step_size] == [
        (5, "pre:pre"),
        (32, "dec:dec"),
    ]
    reference = Lane(registry, cons.with_(force={"full": "reference", "linear": "reference"}))
    steps = [([(0, 2), (1, 1)], "pre:pre"), ([(2, 5), (3, 4)], "dec:dec")]
    _steps_run_on(lane, reference, steps, log, first_seed=30)


def test_prefill_switches_backend_by_requests_within_a_token_bucket(registry, log):
    """One token bucket (8) timed as 1 request and as 4: pre:pre faster as one, dec:dec as
    four. A prefill of 8 tokens in 1 or 2 requests runs on pre:pre (bound isqrt(1 * 4) = 2),
    in 3 or 4 on dec:dec, without re-planning; outputs equal the reference's."""
    tuning = TuningData()
    for spec in (GDN, FULL):
        for backend, one, four in (("pre:pre", 1.0, 5.0), ("dec:dec", 3.0, 2.0)):
            shapes = {1: one, 4: four}
            tuning.record(backend, spec, (one * four) ** 0.5, phase="prefill", tokens=8,
                          shapes=shapes)  # fmt: skip
    cons = ExecutionConstraints(**LIMITS)
    lane = Lane(registry, cons, tuning=tuning)
    prefill = lane.plan.choice("full").phase_choice("prefill")
    assert [(a, m, r, b.qualified_name) for a, m, r, b in prefill.by_requests] == [
        (0, 32, 2, "pre:pre"),
        (0, 32, 4, "dec:dec"),
    ]
    reference = Lane(registry, cons.with_(force={"full": "reference", "linear": "reference"}))
    steps = [
        ([(0, 8)], "pre:pre"),
        ([(1, 2), (2, 2), (3, 2), (4, 2)], "dec:dec"),
        ([(5, 4), (6, 4)], "pre:pre"),
        ([(0, 3), (1, 3), (2, 2)], "dec:dec"),  # more prompt of three of them: chunked prefill
    ]
    _steps_run_on(lane, reference, steps, log, first_seed=40)


def test_each_context_is_allocated_for_the_demands_of_its_own_phases(make_plugin):
    """Under graph mode decode with draft tokens, a backend that serves only prefill (eager, no
    graph support) is admitted and allocated without the graph mode or draft tokens; the
    decode / verify backend gets the run's demands as they are."""
    seen: dict[str, ExecutionConstraints] = {}

    def recording(name: str, priority: int, **caps) -> object:
        def allocate(backend, group, device, constraints, state, workspace):
            seen[backend.qualified_name] = constraints
            return ref.attn_core_allocate_context(
                backend=backend, group=group, device=device, constraints=constraints,
                state=state, workspace=workspace,
            )  # fmt: skip

        backend = Backend(name=name, capabilities=_caps(**caps), priority=priority)
        return make_plugin(name, [backend], allocate=allocate)

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    # no graph support, no draft tokens: it could serve none of a graphed, verifying run before
    eager = recording("eager", 200, graph_modes={"none"}, max_speculative_tokens=0)
    reg.register_plugin(eager, name="eager")
    reg.register_plugin(recording("graphs", 100), name="graphs")
    cons = ExecutionConstraints(graph_mode="decode", speculative_tokens=2, **LIMITS)
    plan = select(group_layers([FULL]), reg, CPU, cons)
    assert phase_mapping_from_plan(plan)["full"] == {
        "prefill": "eager:eager",
        "decode": "graphs:graphs",
        "verify": "graphs:graphs",
    }
    state = PersistentState.from_plan(plan, num_pages=16, num_slots=0)
    AttentionRuntime(plan, reg, state=state)
    assert seen["eager:eager"].graph_mode.value == "none"
    assert seen["eager:eager"].speculative_tokens == 0
    assert seen["graphs:graphs"].graph_mode.value == "decode"
    assert seen["graphs:graphs"].speculative_tokens == 2
