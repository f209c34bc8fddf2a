"""LayerAttentionBinding: the ``out`` contract and input checks that leave the state untouched."""

from __future__ import annotations

import pytest
import torch

from attn_core.backend import Backend
from attn_core.batch import BatchBuilder
from attn_core.errors import BackendInputError
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, group_layers
from attn_core.state import PersistentState

CPU = DeviceCapabilities.target("cpu")
LIMITS = dict(max_batch_size=8, max_num_tokens=64)


class ModeContext:
    """Computes ``out = 2 q + 1`` (encoder layout) and hands the result back in one of three
    ways: written in place, as a view of a padded strided buffer, or as a temporary."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.batch = None
        self.returned: torch.Tensor | None = None

    def prepare(self, batch):
        self.batch = batch

    def update(self, batch):
        self.batch = batch

    def forward(self, layer, q, k, v, out, **inputs):
        value = q * 2 + 1
        if self.mode == "inplace":
            out.copy_(value)
            result = out
        elif self.mode == "view":
            T, H, D = q.shape
            padded = torch.full((T + 3, H + 1, D * 2), float("nan"), dtype=q.dtype)
            result = padded[:T, :H, ::2]  # strided view, not out's memory
            result.copy_(value)
        else:
            result = value.clone()
        self.returned = result
        return result


@pytest.mark.parametrize("mode", ["inplace", "view", "temp"])
def test_out_is_filled_equally_whatever_the_backend_returns(
    mode, make_plugin, make_caps, tiny_specs
):
    spec = tiny_specs["encoder"]
    ctx = ModeContext(mode)

    def allocate(backend, group, device, constraints, state, workspace):
        return ctx

    backend = Backend(name="modes", capabilities=make_caps(kinds={"encoder"}, non_causal=True))
    reg = Registry(strict=True)
    reg.register_plugin(make_plugin("modes", [backend], allocate=allocate), name="modes")
    plan = select(group_layers([spec]), reg, CPU, ExecutionConstraints(**LIMITS))
    runtime = AttentionRuntime(plan, reg)
    runtime.prepare(BatchBuilder(None, **LIMITS).build_encoder([3, 4]))
    torch.manual_seed(0)
    q = torch.randn(7, 4, 16)
    out = torch.full_like(q, -7.0)
    result = runtime.binding(0).forward(q, q.clone(), q.clone(), out=out)
    assert result is out
    torch.testing.assert_close(out, q * 2 + 1, rtol=0, atol=0)
    if mode == "view":
        assert not ctx.returned.is_contiguous()
    if mode != "inplace":  # without out, what the backend returned is returned
        assert runtime.binding(0).forward(q, q, q) is ctx.returned


# ------------------------------------------------------------------------------------------
# Bad inputs against the reference backend: named errors, nothing written
# ------------------------------------------------------------------------------------------
@pytest.fixture
def full_setup(tiny_specs, ref_registry):
    spec = tiny_specs["full"]
    groups = group_layers([spec, spec])
    state = PersistentState(groups, num_pages=32, num_slots=0)
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    runtime = AttentionRuntime(plan, ref_registry, state=state)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=8)
    torch.manual_seed(1)
    for r in ("a", "b"):  # prefill both: the cache holds real data
        state.add_request(r)
    batch = builder.build([("a", 6), ("b", 3)])
    runtime.prepare(batch)
    for layer in (0, 1):
        q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
        runtime.binding(layer).forward(q, k, v, out=torch.empty_like(q))
    state.advance("a", 6)
    state.advance("b", 3)
    return state, runtime, builder


def _snapshot(state):
    return [t.clone() for la in state.kv_cache.layers() for t in la.tensors().values()]


def _unchanged(state, snap) -> bool:
    now = [t for la in state.kv_cache.layers() for t in la.tensors().values()]
    return all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(now, snap, strict=True)
    )


def _decode_inputs(T=2):
    return torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)


@pytest.mark.parametrize(
    ("case", "what", "expected", "got"),
    [
        ("q_dtype", "q dtype", "torch.float32", "torch.float64"),
        ("q_heads", "q shape", "(2, 4, 16)", "(2, 3, 16)"),
        ("q_layout", "q layout", "unit stride in the last dim", "(1, 32, 2)"),
        ("k_heads", "k shape", "(2, 2, 16)", "(2, 4, 16)"),
        ("v_dtype", "v dtype", "torch.float32", "torch.float16"),
        ("v_missing", "v", "a tensor", "None"),
        ("q_tokens", "q shape", "(2, 4, 16)", "(3, 4, 16)"),
        ("out_small", "out shape", "(2, 4, 16)", "(1, 4, 16)"),
        ("out_dtype", "out dtype", "torch.float32", "torch.bfloat16"),
    ],
)
def test_bad_inputs_are_named_and_change_nothing(full_setup, case, what, expected, got):
    state, runtime, builder = full_setup
    batch = builder.build([("a", 1), ("b", 1)])
    runtime.prepare(batch)
    q, k, v = _decode_inputs()
    out = torch.empty_like(q)
    if case == "q_dtype":
        q = q.double()
    elif case == "q_heads":
        q = q[:, :3]
    elif case == "q_layout":
        q = torch.randn(2, 16, 4).transpose(1, 2)  # [2, 4, 16] with last-dim stride 4
        got = str(q.stride())
    elif case == "k_heads":
        k = torch.randn(2, 4, 16)
    elif case == "v_dtype":
        v = v.half()
    elif case == "v_missing":
        v = None
    elif case == "q_tokens":
        q = torch.randn(3, 4, 16)
    elif case == "out_small":
        out = out[:1]
    elif case == "out_dtype":
        out = out.bfloat16()
    snap = _snapshot(state)
    with pytest.raises(BackendInputError) as info:
        runtime.binding(1).forward(q, k, v, out=out)
    err = info.value
    assert err.group == "full" and err.backend == "attn_core:reference"
    assert err.what == f"layer 1: {what}"
    assert str(err.expected) == expected and str(err.got) == got
    msg = str(err)
    assert "layer group 'full'" in msg and "'attn_core:reference'" in msg
    assert f"expected {expected}, got {got}" in msg
    assert _unchanged(state, snap)
    assert state.num_tokens("a") == 6 and state.num_tokens("b") == 3


def test_tensors_on_another_device_are_named_before_any_kernel_sees_them(full_setup):
    """A kernel handed another device's address faults the whole CUDA context (every request's
    state with it): the binding compares each tensor's device with its group's first. Here
    the group says cuda:0 and the tensors live on the CPU."""
    state, runtime, builder = full_setup
    runtime.prepare(builder.build([("a", 1), ("b", 1)]))
    runtime.groups["full"].device_index = 0
    q, k, v = _decode_inputs()
    snap = _snapshot(state)
    with pytest.raises(BackendInputError) as info:
        runtime.binding(1).forward(q, k, v, out=torch.empty_like(q))
    err = info.value
    assert err.what == "layer 1: q device"
    assert (str(err.expected), str(err.got)) == ("the group's device cuda:0", "cpu")
    assert _unchanged(state, snap)


def test_forward_before_prepare(tiny_specs, ref_registry):
    groups = group_layers([tiny_specs["full"]])
    state = PersistentState(groups, num_pages=8, num_slots=0)
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    runtime = AttentionRuntime(plan, ref_registry, state=state)
    q, k, v = _decode_inputs(1)
    with pytest.raises(RuntimeError, match=r"forward before runtime.prepare\(batch\)"):
        runtime.binding(0).forward(q, k, v)


def test_context_for_another_step_is_refused(full_setup):
    _, runtime, builder = full_setup
    b1 = builder.build([("a", 1)])
    runtime.prepare(b1)
    b2 = builder.build([("b", 1)])
    assert runtime.binding(0).context(b1) is runtime.groups["full"].context
    with pytest.raises(ValueError, match=r"prepared for step \d+, not for step \d+"):
        runtime.binding(0).context(b2)


def test_batch_referencing_released_pages_is_refused(full_setup):
    state, runtime, builder = full_setup
    batch = builder.build([("a", 1), ("b", 1)])
    runtime.prepare(batch)
    state.release("a")
    state.add_request("c")  # takes a's freed pages
    state.ensure_capacity("c", 8)
    snap = _snapshot(state)
    q, k, v = _decode_inputs()
    with pytest.raises(BackendInputError, match=r"stale|released|freed"):
        runtime.binding(0).forward(q, k, v, out=torch.empty_like(q))
    assert _unchanged(state, snap)


@pytest.fixture
def gdn_setup(tiny_specs, ref_registry):
    """One Gated DeltaNet layer on the reference backend, requests "a" and "b" added."""
    groups = group_layers([tiny_specs["gdn"]])
    state = PersistentState(groups, num_pages=4, num_slots=4)
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    runtime = AttentionRuntime(plan, ref_registry, state=state)
    builder = BatchBuilder(state, **LIMITS, max_pages_per_request=2)
    for r in ("a", "b"):
        state.add_request(r)
    return state, runtime, builder


@pytest.mark.parametrize(
    ("case", "what", "expected", "got"),
    [
        ("weight", "conv weight shape", "(64, 4)", "(64, 3)"),
        ("channels", "conv input shape", "[T, 64]", "(2, 32)"),
        ("rank", "conv input shape", "[T, 64]", "(2, 64, 1)"),
        ("tokens", "conv input tokens", "2", "3"),
    ],
)
def test_bad_conv_inputs_are_named_and_change_no_state(gdn_setup, case, what, expected, got):
    """A linear layer's conv1d: a wrong weight, channel count, rank or token count is refused
    with the layer, group and backend named, before the conv state is touched."""
    state, runtime, builder = gdn_setup
    runtime.prepare(builder.build([("a", 1), ("b", 1)]))
    x, w = torch.randn(2, 64), torch.randn(64, 4)
    if case == "weight":
        w = w[:, :3]
    elif case == "channels":
        x = x[:, :32]
    elif case == "rank":
        x = x[..., None]
    elif case == "tokens":
        x = torch.randn(3, 64)
    conv = state.state_slots.layer(0).conv
    conv.normal_()
    before = conv.clone()
    with pytest.raises(BackendInputError) as info:
        runtime.binding(0).conv1d(x, w)
    err = info.value
    assert err.group == "linear" and err.backend == "attn_core:reference"
    assert err.what == f"layer 0: {what}"
    assert str(err.expected) == expected and str(err.got) == got
    assert torch.equal(conv, before)
    good = runtime.binding(0).conv1d(torch.randn(2, 64), torch.randn(64, 4))
    assert good.shape == (2, 64) and not torch.equal(conv, before)  # the right call updates it


def test_conv_on_a_full_layer_is_a_type_error(full_setup):
    _, runtime, _ = full_setup
    with pytest.raises(TypeError, match="layer 0 is full: it has no conv"):
        runtime.binding(0).conv1d(torch.randn(2, 8), torch.randn(8, 4))


def test_conv_shapes_accepted_for_one_step_are_rechecked_when_the_tokens_change(gdn_setup):
    """conv1d remembers the shapes it accepted for a token count: a next step with another
    token count must not accept the previous step's input."""
    state, runtime, builder = gdn_setup
    x, w = torch.randn(2, 64), torch.randn(64, 4)
    runtime.prepare(builder.build([("a", 1), ("b", 1)]))
    runtime.binding(0).conv1d(x, w)
    state.advance("a", 1)
    state.advance("b", 1)
    runtime.prepare(builder.build([("a", 1)]))
    with pytest.raises(BackendInputError, match=r"conv input tokens: expected 1, got 2"):
        runtime.binding(0).conv1d(x, w)
