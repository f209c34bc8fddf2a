"""One request, caller or plugin cannot touch another request's state, and every failure is named.

Each test reproduces one way the runtime, the binding or the BatchBuilder could write into state
that is not the caller's to write (a stale batch, a duplicated request id, a build that fails
half-way, a plan that disagrees with the state) or could blame the wrong party for a failure
(the caller's mistake reported as the plugin's, and the reverse).
"""

from __future__ import annotations

import pytest
import torch

from attn_core.backend import Backend
from attn_core.batch import BatchBuilder
from attn_core.errors import BackendInputError, NonFiniteInputError, PluginError
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, group_layers
from attn_core.state import OutOfPagesError, PersistentState

CPU = DeviceCapabilities.target("cpu")
LIMITS = dict(max_batch_size=8, max_num_tokens=64)


def _runtime(specs, registry, *, constraints=None, num_pages=32, num_slots=8, **state_kw):
    groups = group_layers(specs)
    plan = select(groups, registry, CPU, constraints or ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=num_pages, num_slots=num_slots, **state_kw)
    return state, AttentionRuntime(plan, registry, state=state)


def _kv_bytes(state) -> list[torch.Tensor]:
    return [t.clone() for la in state.kv_cache.layers() for t in la.tensors().values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _bookkeeping(state) -> tuple:
    """Everything a failed call must leave as it was: pages, tokens, slots, free counts."""
    rows = tuple(
        (r, tuple(state.pages(r)) if not state.is_offloaded(r) else (), state.num_tokens(r))
        for r in state.request_ids()
    )
    return rows, state.num_free_pages, state.num_free_slots


# ------------------------------------------------------------------------------------------
# 1. conv1d with a stale batch
# ------------------------------------------------------------------------------------------
def test_conv1d_of_a_stale_batch_is_refused_and_the_new_owner_of_the_slot_keeps_its_state(
    tiny_specs, ref_registry
):
    state, runtime = _runtime([tiny_specs["gdn"]], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    state.add_request("b")
    runtime.prepare(builder.build([("a", 1), ("b", 1)]))
    slot_b = state.slot("b")
    state.release("b")
    state.add_request("c")
    assert state.slot("c") == slot_b  # c now owns the slot the batch's second row points at
    conv = state.state_slots.layer(0).conv
    conv.normal_()
    before = conv.clone()
    with pytest.raises(BackendInputError) as info:
        runtime.binding(0).conv1d(torch.randn(2, 64), torch.randn(64, 4))
    err = info.value
    assert err.group == "linear" and err.backend == "attn_core:reference"
    assert err.what.startswith("layer 0: stale batch")
    assert torch.equal(conv, before)


def test_a_batch_built_by_another_state_is_refused_before_any_state_moves(tiny_specs, ref_registry):
    """Two fresh states share no epoch: a batch of the second (16 slots, a request in slot 9)
    handed to a runtime over the first (8 slots) would index past its pools."""
    state, runtime = _runtime([tiny_specs["gdn"]], ref_registry)
    other, _ = _runtime([tiny_specs["gdn"]], ref_registry, num_slots=16)
    state.add_request("a")
    for i in range(10):
        other.add_request(f"r{i}")
    foreign = BatchBuilder(other, **LIMITS, max_pages_per_request=2).build([("r9", 1)])
    assert int(foreign.state_indices[0]) >= state.state_slots.layer(0).conv.shape[0]
    conv = state.state_slots.layer(0).conv
    before = conv.clone()
    runtime.prepare(foreign)
    with pytest.raises(BackendInputError) as info:
        runtime.binding(0).conv1d(torch.randn(1, 64), torch.randn(64, 4))
    assert "another PersistentState" in info.value.what
    assert torch.equal(conv, before)


def test_conv1d_before_prepare_is_named(tiny_specs, ref_registry):
    _, runtime = _runtime([tiny_specs["gdn"]], ref_registry)
    with pytest.raises(RuntimeError, match=r"layer 0 \(group 'linear'\): conv1d before"):
        runtime.binding(0).conv1d(torch.randn(1, 64), torch.randn(64, 4))


def test_commit_of_a_stale_verify_batch_is_refused(tiny_specs, ref_registry):
    state, runtime = _runtime(
        [tiny_specs["gdn"]],
        ref_registry,
        constraints=ExecutionConstraints(**LIMITS, speculative_tokens=1),
    )
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    state.add_request("b")
    batch = builder.build([("a", 2), ("b", 2)], spec_tokens=1)
    runtime.prepare(batch)
    state.release("b")
    state.add_request("c")
    ssm = state.state_slots.layer(0).ssm
    ssm.normal_()
    before = ssm.clone()
    with pytest.raises(BackendInputError, match="stale batch"):
        runtime.commit_speculative(batch, torch.tensor([1, 2], dtype=torch.int32))
    assert torch.equal(ssm, before)


# ------------------------------------------------------------------------------------------
# 2 and 5. BatchBuilder.build is all-or-nothing
# ------------------------------------------------------------------------------------------
def test_a_request_id_twice_in_one_build_is_refused_before_anything_is_reserved(
    tiny_specs, ref_registry
):
    state, _ = _runtime([tiny_specs["full"]], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    state.add_request("a")
    state.add_request("b")
    before = _bookkeeping(state)
    for requests in ([("a", 1), ("a", 1)], [("a", 3), ("b", 2), ("a", 1)]):
        with pytest.raises(ValueError, match=r"request 'a' appears twice in one step"):
            builder.build(requests)
        assert _bookkeeping(state) == before
    state.check_invariants()


def test_duplicate_ids_are_refused_on_the_decode_paths_too(tiny_specs, ref_registry):
    """Decode steps take their own, faster path (and a remembered steady path): a duplicate
    must be caught there as well, also right after an accepted step of the same size."""
    state, _ = _runtime([tiny_specs["full"]], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    for r in "abc":
        state.add_request(r)
    builder.build([("a", 2), ("b", 2), ("c", 2)])
    for r in "abc":
        state.advance(r, 2)
    builder.build([("a", 1), ("b", 1), ("c", 1)])  # remembered as a steady step
    before = _bookkeeping(state)
    with pytest.raises(ValueError, match="appears twice"):
        builder.build([("a", 1), ("b", 1), ("b", 1)])
    assert _bookkeeping(state) == before


def test_a_request_over_max_pages_per_request_gets_no_page(tiny_specs, ref_registry):
    state, _ = _runtime([tiny_specs["full"]], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)  # 8 tokens of page 4
    state.add_request("a")
    before = _bookkeeping(state)
    with pytest.raises(ValueError, match=r"request 'a' needs 3 pages .*max_pages_per_request=2"):
        builder.build([("a", 9)])
    assert _bookkeeping(state) == before
    state.check_invariants()


def test_a_build_that_runs_out_of_pages_changes_no_request(tiny_specs, ref_registry):
    """The first requests of the step fit, the last one does not: every request keeps the
    pages it had, on the general path and on the decode path that appends pages in bulk."""
    state, _ = _runtime([tiny_specs["full"]], ref_registry, num_pages=6)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    for r in "abc":
        state.add_request(r)
    before = _bookkeeping(state)
    with pytest.raises(OutOfPagesError):
        builder.build([("a", 8), ("b", 8), ("c", 12)])  # 2 + 2 + 3 pages of 6
    assert _bookkeeping(state) == before
    state.check_invariants()
    builder.build([("a", 8), ("b", 8), ("c", 8)])  # what fits still builds
    for r in "abc":
        state.advance(r, 8)
    before = _bookkeeping(state)
    with pytest.raises(OutOfPagesError):  # each crosses into a new page; none is free
        builder.build([("a", 1), ("b", 1), ("c", 1)])
    assert _bookkeeping(state) == before
    state.check_invariants()


# ------------------------------------------------------------------------------------------
# 4. The plan and the state agree
# ------------------------------------------------------------------------------------------
def test_state_from_plan_takes_the_plans_page_size_and_kv_dtype(tiny_specs, ref_registry):
    groups = group_layers([tiny_specs["full"], tiny_specs["gdn"]])
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS, page_size=32))
    assert plan.page_size == 32
    state = PersistentState.from_plan(plan, num_pages=4, num_slots=2)
    assert state.page_size == 32
    assert state.kv_cache.layer(0).k.shape[1] == 32
    assert state.kv_layout == plan.kv_layout == "NHD"
    AttentionRuntime(plan, ref_registry, state=state)  # agrees: accepted


def test_a_state_that_disagrees_with_the_plan_is_refused(tiny_specs, ref_registry):
    spec = tiny_specs["full"]
    groups = group_layers([spec, tiny_specs["gdn"]])
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS, page_size=32))
    state = PersistentState(groups, num_pages=4, num_slots=2)  # keeps the specs' page size 4
    with pytest.raises(ValueError) as info:
        AttentionRuntime(plan, ref_registry, state=state)
    msg = str(info.value)
    assert "the persistent state does not match the plan" in msg
    assert "page_size: plan 32, state 4" in msg
    assert "PersistentState.from_plan" in msg

    other = PersistentState(group_layers([spec]), num_pages=4, num_slots=0, page_size=32)
    with pytest.raises(ValueError, match=r"layers \[1 \(linear\)\]: in the plan, keep no state"):
        AttentionRuntime(plan, ref_registry, state=other)

    fp8 = select(
        group_layers([spec]), ref_registry, CPU, ExecutionConstraints(**LIMITS, kv_dtype="bf16")
    )
    plain = PersistentState(group_layers([spec]), num_pages=4, num_slots=0)
    with pytest.raises(ValueError, match=r"layer 0: kv_dtype: plan bfloat16, state float32"):
        AttentionRuntime(fp8, ref_registry, state=plain)


def test_a_plan_in_a_kv_layout_the_state_does_not_store_is_refused(
    tiny_specs, make_plugin, make_caps
):
    """The core's cache stores NHD; a plan whose backends agreed on HND would read it wrong."""
    backend = Backend(name="hnd", capabilities=make_caps(kv_layouts={"HND"}))
    reg = Registry(strict=True)
    reg.register_plugin(make_plugin("hnd", [backend], allocate=lambda: object()), name="hnd")
    groups = group_layers([tiny_specs["full"]])
    plan = select(groups, reg, CPU, ExecutionConstraints(**LIMITS))
    assert plan.kv_layout == "HND"
    with pytest.raises(ValueError, match=r"kv_layout: plan HND, state NHD"):
        AttentionRuntime(plan, reg, state=PersistentState(groups, num_pages=4, num_slots=0))
    with pytest.raises(ValueError, match=r"kv_layout HND: the core's KV cache stores NHD only"):
        PersistentState.from_plan(plan, num_pages=4, num_slots=0)


# ------------------------------------------------------------------------------------------
# 6 and 10. What a backend returns, and who is blamed
# ------------------------------------------------------------------------------------------
class _Returns:
    """A context whose forward returns what the test says (or raises it)."""

    def __init__(self, make):
        self.make = make

    def prepare(self, batch):
        pass

    def update(self, batch):
        pass

    def forward(self, layer, q, k, v, out, **inputs):
        value = self.make(q)
        if isinstance(value, BaseException):
            raise value
        return value


def _plugin_runtime(tiny_specs, make_plugin, make_caps, context):
    backend = Backend(name="odd", capabilities=make_caps())
    reg = Registry(strict=True)
    reg.register_plugin(make_plugin("vendor", [backend], allocate=lambda: context), name="vendor")
    spec = tiny_specs["full"]
    state, runtime = _runtime([spec, spec], reg)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    state.add_request("a")
    state.add_request("b")
    runtime.prepare(builder.build([("a", 1), ("b", 1)]))
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    return runtime, q, k, v


@pytest.mark.parametrize(
    ("make", "expected", "got"),
    [
        (lambda q: q[:1].clone(), "(2, 4, 16)", "(1, 4, 16)"),
        (lambda q: None, "a tensor [T, num_heads, head_dim_v]", "None"),
        (lambda q: q.double(), "torch.float32", "torch.float64"),
    ],
    ids=["wrong-shape", "none", "wrong-dtype"],
)
def test_a_wrong_result_is_the_plugins_error_and_out_is_untouched(
    tiny_specs, make_plugin, make_caps, make, expected, got
):
    runtime, q, k, v = _plugin_runtime(tiny_specs, make_plugin, make_caps, _Returns(make))
    out = torch.full_like(q, 7.0)
    with pytest.raises(PluginError) as info:
        runtime.binding(1).forward(q, k, v, out=out)
    err = info.value
    assert (err.plugin, err.backend, err.group, err.layer) == ("vendor", "odd", "full", 1)
    msg = str(err)
    assert "layer group 'full', layer 1" in msg and "backend 'vendor:odd'" in msg
    assert f"expected {expected}, got {got}" in msg
    assert torch.equal(out, torch.full_like(q, 7.0))  # nothing broadcast into it


def test_a_plugins_own_value_error_is_a_plugin_error_naming_group_and_layer(
    tiny_specs, make_plugin, make_caps
):
    ctx = _Returns(lambda q: ValueError("tile size 7 not supported"))
    runtime, q, k, v = _plugin_runtime(tiny_specs, make_plugin, make_caps, ctx)
    with pytest.raises(PluginError) as info:
        runtime.binding(1).forward(q, k, v, out=torch.empty_like(q))
    assert not isinstance(info.value, BackendInputError)  # not the caller's fault
    msg = str(info.value)
    assert "layer group 'full', layer 1" in msg and "in forward" in msg
    assert "ValueError: tile size 7 not supported" in msg


def test_a_backend_input_error_raised_by_the_plugin_stays_the_callers(
    tiny_specs, make_plugin, make_caps
):
    err = BackendInputError(
        group="full", backend="vendor:odd", what="layer 1: q", expected="a", got="b"
    )
    runtime, q, k, v = _plugin_runtime(tiny_specs, make_plugin, make_caps, _Returns(lambda q: err))
    with pytest.raises(BackendInputError) as info:
        runtime.binding(1).forward(q, k, v, out=torch.empty_like(q))
    assert info.value is err


def test_a_context_without_forward_is_refused_when_the_runtime_is_built(
    tiny_specs, make_plugin, make_caps
):
    class NoForward:
        def prepare(self, batch):
            pass

    backend = Backend(name="half", capabilities=make_caps())
    reg = Registry(strict=True)
    reg.register_plugin(
        make_plugin("vendor", [backend], allocate=lambda: NoForward()), name="vendor"
    )
    groups = group_layers([tiny_specs["full"]])
    plan = select(groups, reg, CPU, ExecutionConstraints(**LIMITS))
    state = PersistentState.from_plan(plan, num_pages=4, num_slots=0)
    with pytest.raises(PluginError) as info:
        AttentionRuntime(plan, reg, state=state)
    msg = str(info.value)
    assert "layer group 'full'" in msg and "'vendor:half'" in msg
    assert "the context NoForward has no forward" in msg


@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_a_linear_context_that_verifies_drafts_needs_commit_speculative(
    tiny_specs, make_plugin, make_caps, spec_tokens
):
    """Without ``commit_speculative`` the runtime skips the commit after a verify step, and
    every draft's state (the rejected ones' too) would stay in the slot: refused at build time
    when the context serves verify steps, accepted when it does not."""

    class NoCommit:
        def prepare(self, batch):
            pass

        def forward(self, layer, q, k, v, out, **inputs):
            return out

        def conv1d(self, layer, x, weight, bias, *, activation="silu", out=None):
            return x

    caps = make_caps(kinds={"linear"}, linear_variants={"gated_deltanet"},
                     max_speculative_tokens=2)  # fmt: skip
    reg = Registry(strict=True)
    backend = Backend(name="lin", capabilities=caps)
    reg.register_plugin(
        make_plugin("vendor", [backend], allocate=lambda: NoCommit()), name="vendor"
    )
    groups = group_layers([tiny_specs["gdn"]])
    constraints = ExecutionConstraints(speculative_tokens=spec_tokens, **LIMITS)
    plan = select(groups, reg, CPU, constraints)
    assert plan.backend_for("linear").qualified_name == "vendor:lin"
    state = PersistentState.from_plan(plan, num_pages=0, num_slots=4)
    if not spec_tokens:
        AttentionRuntime(plan, reg, state=state)
        return
    with pytest.raises(PluginError) as info:
        AttentionRuntime(plan, reg, state=state)
    assert "the context NoCommit has no commit_speculative" in str(info.value)


class _Recorder(_Returns):
    """Counts forward calls: a caller's mistake must never reach the plugin."""

    def __init__(self):
        super().__init__(lambda q: q.clone())
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize(
    ("case", "what"),
    [
        ("out-expanded", "out layout"),
        ("k-meta", "k device"),
        ("v-meta", "v device"),
        ("q-meta", "q device"),
        ("out-meta", "out device"),
    ],
)
def test_caller_mistakes_are_named_before_the_plugin_runs(
    tiny_specs, make_plugin, make_caps, case, what
):
    ctx = _Recorder()
    runtime, q, k, v = _plugin_runtime(tiny_specs, make_plugin, make_caps, ctx)
    out = torch.empty_like(q)
    if case == "out-expanded":
        out = torch.empty(1, 4, 16).expand(2, 4, 16)  # every token row is the same memory
    elif case == "k-meta":
        k = k.to("meta")
    elif case == "v-meta":
        v = v.to("meta")
    elif case == "q-meta":
        q = q.to("meta")
    elif case == "out-meta":
        out = out.to("meta")
    with pytest.raises(BackendInputError) as info:
        runtime.binding(1).forward(q, k, v, out=out)
    assert info.value.what == f"layer 1: {what}"
    assert ctx.calls == 0


# ------------------------------------------------------------------------------------------
# 11. Non-finite values
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_finite_check_names_request_layer_and_tensor_before_the_cache_is_written(
    tiny_specs, ref_registry, bad
):
    spec = tiny_specs["full"]
    state, runtime = _runtime(
        [spec, spec], ref_registry, constraints=ExecutionConstraints(**LIMITS, check_finite=True)
    )
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    state.add_request("a")
    state.add_request("b")
    runtime.prepare(builder.build([("a", 2), ("b", 3)]))
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    k[3, 1, 5] = bad  # b's second new token
    before = _kv_bytes(state)
    with pytest.raises(NonFiniteInputError) as info:
        runtime.binding(1).forward(q, k, v, out=torch.empty_like(q))
    err = info.value
    assert (err.request_id, err.tensor, err.position) == ("b", "k", 1)
    assert "layer 1: k" in str(err) and "request 'b'" in str(err)
    assert _same(_kv_bytes(state), before)


def test_the_finite_check_is_off_by_default_and_on_with_the_environment(
    tiny_specs, ref_registry, monkeypatch
):
    spec = tiny_specs["full"]
    for env, raises in ((None, False), ("1", True)):
        if env is not None:
            monkeypatch.setenv("ATTN_CORE_CHECK_FINITE", env)
        state, runtime = _runtime([spec], ref_registry)
        builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
        state.add_request("a")
        runtime.prepare(builder.build([("a", 1)]))
        q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
        v[0, 0, 0] = float("nan")
        if raises:
            with pytest.raises(NonFiniteInputError, match="ATTN_CORE_CHECK_FINITE"):
                runtime.binding(0).forward(q, k, v)
        else:  # documented: the NaN is stored, and only this request's output shows it
            out = runtime.binding(0).forward(q, k, v)
            assert torch.isnan(out).any()


# ------------------------------------------------------------------------------------------
# Found by the runtime state machine
# ------------------------------------------------------------------------------------------
def test_append_pages_refuses_a_request_twice(tiny_specs, ref_registry):
    state, _ = _runtime([tiny_specs["full"]], ref_registry)
    state.add_request("a")
    before = _bookkeeping(state)
    with pytest.raises(ValueError, match=r"request 'a' appears twice"):
        state.append_pages(["a", "a"])
    assert _bookkeeping(state) == before
    state.check_invariants()


def test_a_batch_replayed_after_its_pages_became_shared_is_refused(tiny_specs, ref_registry):
    """A batch was built when request a's pages were private (no copy-on-write needed); once
    they back a cached prefix and request c shares them, replaying the batch would write c's
    KV and the cache's."""
    spec = tiny_specs["full"]
    state, runtime = _runtime([spec], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    state.add_request("a")
    old = builder.build([("a", 4)])
    runtime.prepare(old)
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    runtime.binding(0).forward(q, k, v)
    state.advance("a", 4)
    tokens = [1, 2, 3, 4, 5]
    assert state.cache_prefix("a", tokens) == 4
    state.add_request("c", prefix=state.match_prefix(tokens))
    assert state.pages("c") == state.pages("a")  # shared, refcount 3 with the cache
    before = _kv_bytes(state)
    runtime.prepare(old)
    with pytest.raises(BackendInputError, match="stale batch"):
        runtime.binding(0).forward(q, torch.randn_like(k), torch.randn_like(v))
    assert _same(_kv_bytes(state), before)


# ------------------------------------------------------------------------------------------
# Non-finite values stay in their own request
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["full", "mla"])
def test_a_nan_in_one_requests_pages_never_reaches_another_requests_decode(
    tiny_specs, ref_registry, kind
):
    """The fixed-shape decode gathers a request's whole page-table row: its unused entries
    (page 0, another request's) and the slots past its length hold other bytes. Masked logits
    are not enough: 0 x NaN is NaN, so those values must be masked too."""
    spec = tiny_specs[kind]
    state, runtime = _runtime([spec], ref_registry, num_pages=8)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    g = torch.Generator().manual_seed(0)

    def step(reqs, fill=None):
        batch = builder.build(reqs)
        runtime.prepare(batch)
        T = batch.num_tokens
        if kind == "full":
            q = torch.randn(T, spec.num_heads, spec.head_dim, generator=g)
            k = torch.randn(T, spec.num_kv_heads, spec.head_dim, generator=g)
            v = torch.randn(T, spec.num_kv_heads, spec.head_dim, generator=g)
            if fill is not None:
                v.fill_(fill)
        else:  # MLA: the latent arrives as k, v is None
            q = torch.randn(T, spec.num_heads, spec.kv_lora_rank + spec.qk_rope_head_dim,
                            generator=g)  # fmt: skip
            k = torch.randn(T, spec.kv_lora_rank + spec.qk_rope_head_dim, generator=g)
            v = None
            if fill is not None:
                k.fill_(fill)
        out = runtime.binding(0).forward(q, k, v)
        for r, n in reqs:
            state.advance(r, n)
        return out

    state.add_request("b")
    step([("b", 3)], fill=float("nan"))  # b holds page 0, its values NaN: b's own problem
    state.add_request("a")
    step([("a", 2)])
    assert state.pages("a") != state.pages("b")
    assert torch.isfinite(step([("a", 1)])).all(), "a's decode read b's NaN"


# ------------------------------------------------------------------------------------------
# commit_speculative takes the verify batch that ran, and num_accepted per request
# ------------------------------------------------------------------------------------------
def _verified(tiny_specs, ref_registry):
    """Requests a and b after a verify step of one draft each (not yet committed)."""
    spec = tiny_specs["gdn"]
    state, runtime = _runtime(
        [spec], ref_registry, constraints=ExecutionConstraints(**LIMITS, speculative_tokens=1)
    )
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    for r in "ab":
        state.add_request(r)
    batch = builder.build([("a", 2), ("b", 2)], spec_tokens=1)
    runtime.prepare(batch)
    g = torch.Generator().manual_seed(0)
    T, H, Hk = 4, spec.num_heads, spec.num_kv_heads
    runtime.binding(0).forward(
        torch.randn(T, Hk, spec.head_dim, generator=g),
        torch.randn(T, Hk, spec.head_dim, generator=g),
        torch.randn(T, H, spec.head_dim_v, generator=g),
        g=-torch.rand(T, H, generator=g),
        beta=torch.rand(T, H, generator=g),
    )
    return state, runtime, builder, batch


def test_commit_of_a_verify_step_whose_layers_did_not_all_run_is_refused(tiny_specs, ref_registry):
    """A verify step of two linear layers whose second layer's forward never returned (refused,
    or not called): committing it would move the first layer's slots and not the second's,
    leaving the request's layers at different tokens. Refused before any slot moves, naming
    the layer; the step can be run again (its slots have not moved) and then committed."""
    spec = tiny_specs["gdn"]
    state, runtime = _runtime(
        [spec, spec], ref_registry, constraints=ExecutionConstraints(**LIMITS, speculative_tokens=1)
    )
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    batch = builder.build([("a", 2)], spec_tokens=1)
    g = torch.Generator().manual_seed(0)
    T, H, Hk = 2, spec.num_heads, spec.num_kv_heads

    def run(layer):
        runtime.binding(layer).forward(
            torch.randn(T, Hk, spec.head_dim, generator=g),
            torch.randn(T, Hk, spec.head_dim, generator=g),
            torch.randn(T, H, spec.head_dim_v, generator=g),
            g=-torch.rand(T, H, generator=g),
            beta=torch.rand(T, H, generator=g),
        )

    runtime.prepare(batch)
    run(0)
    slots = [state.state_slots.layer(i).ssm for i in (0, 1)]
    before = [t.clone() for t in slots]
    with pytest.raises(BackendInputError) as info:
        runtime.commit_speculative(batch, torch.tensor([2], dtype=torch.int32))
    assert "layer 1" in info.value.what and info.value.group == "linear"
    assert all(torch.equal(t, b) for t, b in zip(slots, before, strict=True))
    runtime.prepare(batch)  # the same step again, every layer this time
    run(0)
    run(1)
    runtime.commit_speculative(batch, torch.tensor([2], dtype=torch.int32))
    assert not any(torch.equal(t, b) for t, b in zip(slots, before, strict=True))


def test_a_replayed_verify_step_commits_without_forwards_in_python(tiny_specs, ref_registry):
    """update() before a graph replay: the captured kernels run every layer, no forward is
    called in Python, so the commit of a replayed verify step must not ask for one."""
    spec = tiny_specs["gdn"]
    cons = ExecutionConstraints(**LIMITS, speculative_tokens=1, graph_mode="full")
    state, runtime = _runtime([spec, spec], ref_registry, constraints=cons)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    batch = builder.build([("a", 2)], spec_tokens=1)
    runtime.update(batch)  # the replay's metadata; the graph would now run both layers
    runtime.commit_speculative(batch, torch.tensor([2], dtype=torch.int32))


def test_a_verify_step_with_more_drafts_than_the_plan_declared_is_refused_at_prepare(
    tiny_specs, ref_registry
):
    """The plan chose backends (and sized verify workspaces) for ``speculative_tokens``: a
    native verify of more drafts failed on its workspace, a replay one ran and committed."""
    spec = tiny_specs["gdn"]
    state, runtime = _runtime(
        [spec], ref_registry, constraints=ExecutionConstraints(**LIMITS, speculative_tokens=1)
    )
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    with pytest.raises(BackendInputError, match="speculative_tokens") as info:
        runtime.prepare(builder.build([("a", 3)], spec_tokens=2))
    assert info.value.expected == "at most 1 draft tokens (the plan's speculative_tokens)"
    runtime.prepare(builder.build([("a", 2)], spec_tokens=1))  # as declared: fine


def test_commit_of_another_verify_batch_than_the_one_that_ran_is_refused(tiny_specs, ref_registry):
    """The same requests in another order, built after the verify step ran (same epoch):
    committing it would write each request's verified state into the other's slot."""
    state, runtime, builder, _ = _verified(tiny_specs, ref_registry)
    other = builder.build([("b", 2), ("a", 2)], spec_tokens=1)
    ssm = state.state_slots.layer(0).ssm
    before = ssm.clone()
    with pytest.raises(BackendInputError, match="not the batch the runtime last prepared"):
        runtime.commit_speculative(other, torch.tensor([2, 2], dtype=torch.int32))
    assert torch.equal(ssm, before)


def test_the_next_step_is_refused_until_the_verify_step_is_committed(tiny_specs, ref_registry):
    """Preparing the next step dropped the verify step's per-token states without a word: the
    reference's slots then kept the rejected drafts (triton_ssm's, none of the accepted ones),
    and the commit that came too late was refused. The next prepare is refused now, naming
    the verify step; after the commit it goes on."""
    state, runtime, builder, verify = _verified(tiny_specs, ref_registry)
    state.add_request("c")
    nxt = builder.build([("c", 3)])
    ssm = state.state_slots.layer(0).ssm
    before = ssm.clone()
    with pytest.raises(BackendInputError, match="commit_speculative") as info:
        runtime.prepare(nxt)
    assert f"step {verify.step}" in str(info.value)
    with pytest.raises(BackendInputError, match="commit_speculative"):
        runtime.update(nxt)
    assert torch.equal(ssm, before)
    runtime.commit_speculative(verify, torch.tensor([1, 2], dtype=torch.int32))
    for r, n in (("a", 1), ("b", 2)):
        state.advance(r, n)
    runtime.prepare(builder.build([("c", 3)]))  # a step built after the commit


def test_a_verify_step_whose_requests_were_released_no_longer_holds_the_next_step(
    tiny_specs, ref_registry
):
    """After a verify step that failed part-way, the remedy is to release (or restore) its
    requests; the batch is stale then and no commit can take it, so it must not block every
    later step."""
    state, runtime, builder, _ = _verified(tiny_specs, ref_registry)
    state.release("a")
    state.add_request("c")
    runtime.prepare(builder.build([("c", 3), ("b", 1)]))
    assert runtime.groups["linear"].batch.num_reqs == 2


@pytest.mark.parametrize(
    ("accepted", "got"),
    [
        (torch.tensor([1], dtype=torch.int32), "[1] int32"),  # broadcast over both requests
        (torch.tensor([1.9, 1.9]), "[2] float32"),  # truncated to 1
        (torch.tensor([[1, 1]], dtype=torch.int32), "[1, 2] int32"),
    ],
    ids=["too-short", "float", "2-d"],
)
def test_num_accepted_must_be_one_integer_per_request(tiny_specs, ref_registry, accepted, got):
    state, runtime, _, batch = _verified(tiny_specs, ref_registry)
    ssm = state.state_slots.layer(0).ssm
    before = ssm.clone()
    with pytest.raises(BackendInputError, match="num_accepted") as err:
        runtime.commit_speculative(batch, accepted)
    assert "[>= 2] int32 or int64" in str(err.value) and got in str(err.value)
    assert torch.equal(ssm, before)


# ------------------------------------------------------------------------------------------
# A linear layer's own inputs are checked in every step, not only in prefill
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("gdn", "g"),
        ("gdn", "beta"),
        ("kda", "beta"),
        ("mamba2", "dt"),
        ("mamba2", "D"),
        ("mamba1", "dt_bias"),
        ("mamba1", "A_log"),
    ],
)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_linear_input_of_the_wrong_shape_is_the_callers_error_naming_the_layer(
    tiny_specs, ref_registry, kind, name, mode
):
    """In a decode step of two requests, ``g`` of one row used to broadcast request a's
    gate onto request b's state; prefill refused it as the plugin's failure. Both are the
    caller's mistake, named with the layer, before any state is written."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs[kind]
    state, runtime, n = _step_of_two_requests(spec, ref_registry, mode)
    inputs = layer_inputs(spec, 2 * n, torch.Generator().manual_seed(0))
    inputs.pop("conv_x")
    good = tuple(inputs[name].shape)
    inputs[name] = inputs[name][:1]  # one row (per-token) or one head (per-head) too few
    before = [t.clone() for t in (state.state_slots.layer(0).ssm, state.state_slots.layer(0).conv)]
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    with pytest.raises(BackendInputError, match=f"layer 0: .*{name}") as err:
        runtime.binding(0).forward(q, k, v, **inputs)
    assert f"expected {list(good)}, got [1" in str(err.value)
    after = (state.state_slots.layer(0).ssm, state.state_slots.layer(0).conv)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


class _LinearRecorder(_Recorder):
    """A linear context that checks nothing itself (as a vendor's might): counts forwards."""

    def __init__(self):
        super().__init__()
        self.make = lambda q: None

    def forward(self, layer, q, k, v, out, **inputs):
        self.calls += 1
        return torch.zeros(q.shape[0], layer.spec.num_heads, layer.spec.head_dim_v)

    def conv1d(self, layer, x, weight, bias, *, activation="silu", out=None):
        return x.clone()


@pytest.mark.parametrize(
    ("kind", "name", "bad"),
    [("mamba1", "dt", lambda t: t[..., None]), ("mamba1", "D", lambda t: t[:1]),
     ("kda", "g", lambda t: t[..., :1]), ("mamba2", "A_log", lambda t: t[:1])],
)  # fmt: skip
def test_a_linear_input_shape_is_checked_by_the_core_for_every_backend(
    tiny_specs, make_plugin, make_caps, kind, name, bad
):
    """The reference checked its inputs' shapes itself; triton_ssm's kernels raised on some
    (reported as the plugin's failure) and a vendor's context need not check at all. The
    binding now refuses a present input of another shape than the layer's, naming it."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs[kind]
    ctx = _LinearRecorder()
    caps = make_caps(kinds={"linear"}, linear_variants={spec.linear_variant.value})
    backend = Backend(name="lin", capabilities=caps)
    reg = Registry(strict=True)
    reg.register_plugin(make_plugin("vendor", [backend], allocate=lambda: ctx), name="vendor")
    state, runtime = _runtime([spec], reg)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    runtime.prepare(builder.build([("a", 3)]))
    inputs = layer_inputs(spec, 3, torch.Generator().manual_seed(0))
    inputs.pop("conv_x")
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    good = list(inputs[name].shape)
    inputs[name] = bad(inputs[name])
    with pytest.raises(BackendInputError, match=f"layer 0: .*input {name} shape") as info:
        runtime.binding(0).forward(q, k, v, **inputs)
    assert info.value.expected == good and info.value.backend == "vendor:lin"
    assert ctx.calls == 0


# ------------------------------------------------------------------------------------------
# conv1d's out, results of padded steps, per-layer constants of padded steps
# ------------------------------------------------------------------------------------------
def _step_of_two_requests(spec, registry, mode):
    """A runtime prepared for a step of requests a and b, 1 token each in decode, 3 in
    prefill: ``(state, runtime, tokens each)``."""
    state, runtime = _runtime([spec], registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    for r in "ab":
        state.add_request(r)
    n = 1 if mode == "decode" else 3
    runtime.prepare(builder.build([("a", n), ("b", n)]))
    return state, runtime, n


def _conv_step_of_two_requests(spec, registry, mode):
    """:func:`_step_of_two_requests` with the conv slots filled with noise:
    ``(runtime, conv state, tokens each)``."""
    state, runtime, n = _step_of_two_requests(spec, registry, mode)
    conv = state.state_slots.layer(0).conv
    conv.normal_()
    return runtime, conv, n


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_conv1d_out_the_caller_got_wrong_is_refused_before_any_conv_state_moves(
    tiny_specs, ref_registry, mode, bad
):
    """conv1d never checked ``out``: the reference advanced every request's conv state, then
    failed copying into it, and the error blamed the plugin. A retry applied the conv twice."""
    spec = tiny_specs["gdn"]
    runtime, conv, n = _conv_step_of_two_requests(spec, ref_registry, mode)
    before = conv.clone()
    C = spec.conv_channels
    out = torch.empty(2 * n, C + 1) if bad == "shape" else torch.empty(2 * n, C).double()
    with pytest.raises(BackendInputError, match="layer 0: conv out") as info:
        runtime.binding(0).conv1d(torch.randn(2 * n, C), torch.randn(*spec.conv_dims), out=out)
    assert info.value.backend == "attn_core:reference"
    assert torch.equal(conv, before)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize(
    "bad, what",
    [("x", "conv input dtype"), ("x_int", "conv input dtype"), ("weight", "conv weight dtype"),
     ("bias", "conv bias dtype")],
)  # fmt: skip
def test_a_conv1d_input_of_another_dtype_than_the_layers_is_refused_before_any_conv_state_moves(
    tiny_specs, ref_registry, mode, bad, what
):
    """conv1d checked shapes only: a prefill took float64 or int32 ``x`` (and returned that
    dtype), a bf16 weight on a float32 layer passed every mode, and the conv state moved."""
    spec = tiny_specs["gdn"]  # float32
    runtime, conv, n = _conv_step_of_two_requests(spec, ref_registry, mode)
    before = conv.clone()
    C = spec.conv_channels
    x, w, b = torch.randn(2 * n, C), torch.randn(*spec.conv_dims), torch.randn(C)
    if bad == "x":
        x = x.double()
    elif bad == "x_int":
        x = x.int()
    elif bad == "weight":
        w = w.bfloat16()
    else:
        b = b.half()
    with pytest.raises(BackendInputError, match=f"layer 0: {what}") as info:
        runtime.binding(0).conv1d(x, w, b)
    assert "float32" in str(info.value.expected)
    assert torch.equal(conv, before)


def _padded_step(spec, registry, mode):
    """A runtime with requests a (3 tokens) and b (2) through a step padded to 4 requests: a
    prefill, or a verify of 2 drafts each."""
    spec_tokens = 2 if mode == "verify" else 0
    cons = ExecutionConstraints(**LIMITS, speculative_tokens=spec_tokens)
    state, runtime = _runtime([spec], registry, constraints=cons)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=4)
    for r in "ab":
        state.add_request(r)
    if mode == "verify":
        runtime.prepare(builder.build([("a", 3), ("b", 2)]))  # a context to verify against
        _run_layer(spec, runtime, builder.build([("a", 3), ("b", 2)]))
        state.advance("a", 3)
        state.advance("b", 2)
        batch = builder.build([("a", 3), ("b", 3)], spec_tokens=2, pad_to=4)
    else:
        batch = builder.build([("a", 3), ("b", 2)], pad_to=4)
    runtime.prepare(batch)
    return state, runtime, batch


def _run_layer(spec, runtime, batch, *, with_out=True, inputs=None):
    from attn_core.testing.workloads import layer_inputs

    if inputs is None:
        inputs = layer_inputs(spec, batch.padded_tokens, torch.Generator().manual_seed(1))
    inputs = dict(inputs)
    runtime.prepare(batch)
    binding = runtime.binding(0)
    conv_x = inputs.pop("conv_x", None)
    results = {}
    if conv_x is not None:
        w = torch.randn(*spec.conv_dims, generator=torch.Generator().manual_seed(2))
        out = torch.empty_like(conv_x) if with_out else None
        results["conv"] = binding.conv1d(conv_x, w, out=out)
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v", None)
    rows, heads, dv = batch.padded_tokens, spec.num_heads, spec.head_dim_v
    out = torch.empty(rows, heads, dv) if with_out else None
    results["forward"] = binding.forward(q, k, v, out=out, **inputs)
    return results


@pytest.mark.parametrize("mode", ["prefill", "verify"])
@pytest.mark.parametrize("kind", ["full", "mla", "gdn", "mamba2"])
def test_a_padded_step_with_out_none_returns_every_padded_row(tiny_specs, ref_registry, kind, mode):
    """With ``out=None`` the reference returned ``[num_tokens, ...]`` for a padded step: forward
    failed as the plugin's bad result after the KV or SSM state was written, and conv1d
    returned the short tensor without a word. Both now return ``[padded_tokens, ...]``, whose
    real rows equal the run with ``out`` given."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs[kind]
    got = {}
    for with_out in (True, False):
        _, runtime, batch = _padded_step(spec, ref_registry, mode)
        assert batch.padded_tokens > batch.num_tokens  # the step has padding rows
        inputs = layer_inputs(spec, batch.padded_tokens, torch.Generator().manual_seed(1))
        got[with_out] = _run_layer(spec, runtime, batch, with_out=with_out, inputs=inputs)
    t = batch.num_tokens
    for name, result in got[False].items():
        assert result.shape[0] == batch.padded_tokens, (name, tuple(result.shape))
        assert torch.equal(result[:t], got[True][name][:t]), name


def test_per_layer_inputs_are_not_cut_when_the_padded_token_count_equals_the_heads(
    tiny_specs, ref_registry
):
    """Mamba2 with 4 heads, a step of 3 tokens padded to 4: ``A_log``, ``D`` and ``dt_bias``
    (``[H]``) were cut to the 3 real tokens as if they were per-token inputs, and the valid
    step failed as the plugin's error after conv1d had moved the conv state."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs["mamba2"]
    state, runtime = _runtime([spec], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    batch = builder.build([("a", 3)], pad_to=2)
    assert batch.padded_tokens == spec.num_heads  # the coincidence the test is about
    inputs = layer_inputs(spec, batch.padded_tokens, torch.Generator().manual_seed(1))
    padded = _run_layer(spec, runtime, batch, inputs=inputs)
    # the same tokens unpadded, from a fresh state
    state, runtime = _runtime([spec], ref_registry)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    plain = builder.build([("a", 3)])
    cut = {k: (v[:3] if v.shape[0] == 4 and k not in ("A_log", "D", "dt_bias") else v)
           for k, v in inputs.items()}  # fmt: skip
    unpadded = _run_layer(spec, runtime, plain, inputs=cut)
    assert torch.allclose(padded["forward"][:3], unpadded["forward"][:3], atol=1e-6)


def test_the_finite_check_reads_a_per_layer_input_whole_whatever_the_token_count(
    tiny_specs, ref_registry
):
    """Mamba2 with 4 heads, 3 tokens padded to 4: ``A_log [H]`` was taken for a per-token
    input, so only its first 3 entries were checked and a NaN in the fourth went through."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs["mamba2"]
    cons = ExecutionConstraints(**LIMITS, check_finite=True)
    state, runtime = _runtime([spec], ref_registry, constraints=cons)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    state.add_request("a")
    batch = builder.build([("a", 3)], pad_to=2)
    assert batch.padded_tokens == spec.num_heads
    runtime.prepare(batch)
    inputs = layer_inputs(spec, batch.padded_tokens, torch.Generator().manual_seed(1))
    inputs.pop("conv_x")
    inputs["A_log"][3] = float("nan")
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    before = state.state_slots.layer(0).ssm.clone()
    with pytest.raises(NonFiniteInputError) as info:
        runtime.binding(0).forward(q, k, v, **inputs)
    assert (info.value.tensor, info.value.request_id) == ("A_log", None)
    assert torch.equal(state.state_slots.layer(0).ssm, before)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("bad", ["bias-per-token", "bias-short", "activation"])
def test_a_conv_bias_or_activation_the_caller_got_wrong_is_refused_before_any_state_moves(
    tiny_specs, ref_registry, mode, bad
):
    """A [T, C] bias broadcast over the tokens in decode (prefill refused it, as the plugin's
    failure); an unknown activation was the plugin's failure too. Both are the caller's."""
    spec = tiny_specs["gdn"]
    runtime, conv, n = _conv_step_of_two_requests(spec, ref_registry, mode)
    before = conv.clone()
    C, T = spec.conv_channels, 2 * n
    kw: dict = {"bias": torch.randn(T, C) if bad == "bias-per-token" else torch.randn(C - 1)}
    if bad == "activation":
        kw = {"bias": torch.randn(C), "activation": "gelu"}
    what = "conv activation" if bad == "activation" else "conv bias shape"
    with pytest.raises(BackendInputError, match=f"layer 0: {what}"):
        runtime.binding(0).conv1d(torch.randn(T, C), torch.randn(*spec.conv_dims), **kw)
    assert torch.equal(conv, before)


def test_a_swish_conv_decodes_as_it_prefills(tiny_specs, ref_registry):
    """'swish' (SiLU's other name) was accepted in prefill and refused in decode."""
    spec = tiny_specs["gdn"]
    results = {}
    for activation in ("silu", "swish"):
        state, runtime = _runtime([spec], ref_registry)
        builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
        state.add_request("a")
        gen = torch.Generator().manual_seed(3)
        w = torch.randn(*spec.conv_dims, generator=gen)
        outs = []
        for n in (3, 1):
            runtime.prepare(builder.build([("a", n)]))
            x = torch.randn(n, spec.conv_channels, generator=gen)
            outs.append(runtime.binding(0).conv1d(x, w, activation=activation))
            state.advance("a", n)
        results[activation] = outs
    for a, b in zip(results["silu"], results["swish"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_an_input_the_linear_variant_does_not_take_is_the_callers_error(
    tiny_specs, ref_registry, mode
):
    """An unknown keyword (a typo: ``bta=``) reached decode's kernel call as a TypeError,
    reported as the plugin's failure."""
    from attn_core.testing.workloads import layer_inputs

    spec = tiny_specs["gdn"]
    state, runtime, n = _step_of_two_requests(spec, ref_registry, mode)
    inputs = layer_inputs(spec, 2 * n, torch.Generator().manual_seed(0))
    inputs.pop("conv_x")
    inputs["bta"] = inputs["beta"]
    before = state.state_slots.layer(0).ssm.clone()
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    with pytest.raises(BackendInputError, match="layer 0: gated_deltanet inputs"):
        runtime.binding(0).forward(q, k, v, **inputs)
    assert torch.equal(state.state_slots.layer(0).ssm, before)
