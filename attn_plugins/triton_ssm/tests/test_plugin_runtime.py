"""The triton_ssm backend through the core runtime, against the reference backend, on every batch
mode: prefill, mixed (decodes not first, a zero-length request), padded decode, speculative
verify with native and replay commit, and decode after the commit.

Without CUDA the kernels run in Triton's CPU interpreter (``ATTN_TRITON_SSM_INTERPRET=1`` makes
the backend advertise ``cpu``); with CUDA the same comparisons run compiled on the GPU.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "attn_plugin_triton_ssm.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from test_plugin_harness import (  # noqa: E402
    LAYERS,
    REFERENCE,
    TRITON,
    TRITON_MAMBA1,
    available_registry,
    layer_params,
    make_lane,
    make_spec,
    run_step,
    states,
    step_inputs,
)

from attn_core.errors import BackendInputError  # noqa: E402
from attn_core.specs import DeviceCapabilities, ExecutionConstraints  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
# float32: fla's chunked GDN/KDA prefill sums in another order than the recurrent reference;
# on an H200 0.6% of outputs differed by up to 5.6e-4 (a wrong gate or slot is off by > 1e-1)
TOL = {"float32": dict(atol=1e-3, rtol=1e-3), "bfloat16": dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture
def registry(monkeypatch):
    return available_registry(monkeypatch, TRITON)


def _target() -> DeviceCapabilities:
    return DeviceCapabilities.detect(DEV)


def _backend(spec):
    return TRITON_MAMBA1 if spec.linear_variant.value == "mamba1" else TRITON


def _spec(variant, **kw):
    if variant == "mamba1":  # 12 inner channels, one head each, d_state 8, conv over x only
        return make_spec(variant, hv=12, hk=1, dk=8, dv=1, channels=12, **kw)
    return make_spec(variant, **kw)


def _lanes(registry, spec, constraints):
    # the reference verifies natively only; the strategy is triton_ssm's choice
    ref_constraints = constraints.with_(spec_verify_strategy=None)
    lanes = [
        make_lane(registry, REFERENCE, spec, DEV, _target(), ref_constraints),
        make_lane(registry, _backend(spec), spec, DEV, _target(), constraints),
    ]
    params = layer_params(spec, DEV, seed=7)
    for lane in lanes:
        lane.params = params
    return lanes


def _add(lanes, req, seed):
    """Add ``req`` to both lanes and fill its fresh slot with garbage: has_initial_state is
    False for its first step, so both backends must ignore what the slot holds."""
    gen = torch.Generator().manual_seed(seed)
    for lane in lanes:
        lane.state.add_request(req)
    slot = lanes[0].state.slot(req)
    assert lanes[1].state.slot(req) == slot
    for i in LAYERS:
        for lane in lanes:
            st = lane.state.state_slots.layer(i)
            gen.manual_seed(seed * 100 + i)
            st.conv[slot] = torch.randn(st.conv[slot].shape, generator=gen).to(st.conv)
            st.ssm[slot] = torch.randn(st.ssm[slot].shape, generator=gen).to(st.ssm)


def _compare(lanes, results, tokens, tol, what, *, check_states=True):
    ref, tri = results
    for i in LAYERS:
        for name, a, b in (("conv", ref[i][0], tri[i][0]), ("out", ref[i][1], tri[i][1])):
            torch.testing.assert_close(
                b[:tokens].float(),
                a[:tokens].float(),
                **tol,
                msg=lambda m, i=i, name=name: f"{what} L{i} {name}: {m}",
            )
    if not check_states:
        return
    s_ref, s_tri = states(lanes[0]), states(lanes[1])
    for i in LAYERS:
        for name, a, b in zip(("conv", "ssm"), s_ref[i], s_tri[i], strict=True):
            torch.testing.assert_close(
                b.float(),
                a.float(),
                **tol,
                msg=lambda m, i=i, name=name: f"{what} L{i} {name} state: {m}",
            )


def _step(lanes, spec, requests, seed, *, spec_tokens=0, pad_to=None, advance=True):
    n_tok = sum(n for _, n in requests)
    padded = n_tok + ((pad_to - len(requests)) if pad_to else 0)
    inputs = step_inputs(spec, padded, DEV, seed)
    results = [
        run_step(lane, requests, inputs, spec_tokens=spec_tokens, pad_to=pad_to) for lane in lanes
    ]
    if advance:
        for lane in lanes:
            for r, n in requests:
                lane.state.advance(r, n)
    return results, n_tok


@pytest.mark.parametrize("strategy", ["native", "replay"])
@pytest.mark.parametrize(
    "variant", ["gated_deltanet", "kda", "mamba2", "mamba1", "lightning", "short_conv"]
)
def test_every_mode_matches_reference(registry, variant, strategy):
    spec = _spec(variant)
    tol = TOL["float32"]
    constraints = ExecutionConstraints(
        max_batch_size=8, max_num_tokens=64, speculative_tokens=2, spec_verify_strategy=strategy
    )
    lanes = _lanes(registry, spec, constraints)
    assert lanes[1].runtime.groups["linear"].backend.qualified_name == _backend(spec)
    _add(lanes, "a", 1)
    _add(lanes, "b", 2)

    res, t = _step(lanes, spec, [("a", 5), ("b", 3)], 10)
    assert lanes[1].batch.mode.value == "prefill"
    _compare(lanes, res, t, tol, "prefill")

    _add(lanes, "c", 3)  # mixed: decode, fresh prefill, decode (decodes not first)
    res, t = _step(lanes, spec, [("a", 1), ("c", 4), ("b", 1)], 11)
    assert lanes[1].batch.mode.value == "mixed"
    _compare(lanes, res, t, tol, "mixed")

    res, t = _step(lanes, spec, [("b", 2), ("a", 0), ("c", 1)], 12)  # zero-length request
    assert lanes[1].batch.mode.value == "mixed"
    _compare(lanes, res, t, tol, "mixed with an empty request")

    res, t = _step(lanes, spec, [("a", 1), ("b", 1), ("c", 1)], 13, pad_to=5)
    assert lanes[1].batch.mode.value == "decode" and lanes[1].batch.padded_reqs == 5
    _compare(lanes, res, t, tol, "padded decode")

    before = states(lanes[1])
    reqs = [("c", 3), ("a", 3), ("b", 3)]
    res, t = _step(lanes, spec, reqs, 14, spec_tokens=2, advance=False)
    assert lanes[1].batch.mode.value == "verify"
    # (the reference advances its slots in verify and rolls back in the commit: no state check)
    _compare(lanes, res, t, tol, "verify outputs", check_states=False)
    for i in LAYERS:  # triton_ssm leaves every slot as it was until the commit
        for a, b in zip(before[i], states(lanes[1])[i], strict=True):
            assert torch.equal(a, b)
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    for lane in lanes:
        lane.runtime.commit_speculative(lane.batch, accepted)
        for (r, _), n in zip(reqs, accepted.tolist(), strict=True):
            lane.state.advance(r, n)
    _compare(lanes, _no_outputs(), 0, tol, "states after commit")

    res, t = _step(lanes, spec, [("b", 1), ("c", 1), ("a", 1)], 15)
    _compare(lanes, res, t, tol, "decode after commit")


@pytest.mark.parametrize("variant", ["gated_deltanet", "mamba2", "short_conv"])
def test_a_padded_step_with_out_none_returns_every_padded_row(registry, variant):
    """With ``out=None`` a padded prefill or verify step returned the real tokens' rows only:
    forward failed the binding's result check after the state was written, and conv1d's short
    result went through unchecked. Every padded row comes back now, the real ones as the
    reference's."""
    spec = _spec(variant)
    constraints = ExecutionConstraints(max_batch_size=8, max_num_tokens=64, speculative_tokens=2)
    lanes = _lanes(registry, spec, constraints)
    _add(lanes, "a", 1)
    _add(lanes, "b", 2)
    steps = [([("a", 3), ("b", 2)], 0), ([("a", 3), ("b", 3)], 2)]  # prefill, then verify
    for requests, spec_tokens in steps:
        n_tok = sum(n for _, n in requests)
        padded = n_tok + 2 * (spec_tokens + 1)  # 2 padding requests, k + 1 tokens in verify
        inputs = step_inputs(spec, padded, DEV, 20 + spec_tokens)
        results = [
            run_step(lane, requests, inputs, spec_tokens=spec_tokens, pad_to=4, out_none=True)
            for lane in lanes
        ]
        assert lanes[1].batch.padded_tokens == padded
        for i in LAYERS:
            for name, got in zip(("conv", "out"), results[1][i], strict=True):
                assert got.shape[0] == padded, (variant, spec_tokens, name, tuple(got.shape))
        _compare(lanes, results, n_tok, TOL["float32"], "padded", check_states=False)
        if spec_tokens:
            for lane in lanes:
                lane.runtime.commit_speculative(lane.batch, torch.tensor([1, 2], dtype=torch.int32))
        else:
            for lane in lanes:
                for r, n in requests:
                    lane.state.advance(r, n)


def _no_outputs():
    empty = (torch.zeros(0), torch.zeros(0))
    return [dict.fromkeys(LAYERS, empty), dict.fromkeys(LAYERS, empty)]


def _prefill_then_verify(registry, spec, strategy):
    """A triton_ssm lane verifying with ``strategy``, after a prefill of requests a (4 tokens)
    and b (6) and a verify of 3 speculative tokens each: ``(lane, the verify's results)``."""
    constraints = ExecutionConstraints(
        max_batch_size=4, max_num_tokens=32, speculative_tokens=3, spec_verify_strategy=strategy
    )
    lane = _lanes(registry, spec, constraints)[1]
    for r in ("a", "b"):
        lane.state.add_request(r)
    run_step(lane, [("a", 4), ("b", 6)], step_inputs(spec, 10, DEV, 1))
    for r, n in (("a", 4), ("b", 6)):
        lane.state.advance(r, n)
    return lane, run_step(lane, [("a", 4), ("b", 4)], step_inputs(spec, 8, DEV, 2), spec_tokens=3)


@pytest.mark.parametrize(
    "variant", ["gated_deltanet", "kda", "mamba2", "mamba1", "lightning", "short_conv"]
)
def test_native_and_replay_commit_the_same_state(registry, variant):
    """Both strategies, same verify inputs and accepted counts: bit-identical slots."""
    spec = _spec(variant)
    got = []
    for strategy in ("native", "replay"):
        lane, _ = _prefill_then_verify(registry, spec, strategy)
        lane.runtime.commit_speculative(lane.batch, torch.tensor([2, 4], dtype=torch.int32))
        got.append(states(lane))
    for i in LAYERS:
        for a, b in zip(got[0][i], got[1][i], strict=True):
            assert torch.equal(a, b)


def test_mamba1_prefill_takes_the_lanes_kernel_and_both_verify_strategies_the_tiles(
    registry, monkeypatch
):
    """Mamba1 prefill runs the whole-channels-a-thread kernel (the default for varlen scans); the
    verify keeps the tile kernel in both strategies, so that its outputs are the same bits
    whichever commits (native needs per-token states, which only the tile kernel writes)."""
    from attn_plugin_triton_ssm.kernels import mamba1 as m1

    tokens: list = []  # the tokens of each lanes launch: the prefill's 10, never the verify's 8
    real = m1.launch_lanes
    monkeypatch.setattr(
        m1, "launch_lanes", lambda *a, **k: tokens.append(int(k["cu"][-1])) or real(*a, **k)
    )
    spec = _spec("mamba1")
    verify_out = []
    for strategy in ("native", "replay"):
        tokens.clear()
        _, res = _prefill_then_verify(registry, spec, strategy)
        assert tokens == [10] * len(LAYERS), strategy
        verify_out.append({i: res[i][1].clone() for i in LAYERS})
    for i in LAYERS:
        assert torch.equal(verify_out[0][i], verify_out[1][i]), f"L{i} verify outputs"


@pytest.mark.parametrize("variant", ["gated_deltanet", "mamba1"])
def test_bf16_state_and_activations(registry, variant):
    spec = _spec(variant, dtype="bfloat16", state_dtype="bfloat16")
    constraints = ExecutionConstraints(max_batch_size=4, max_num_tokens=32, speculative_tokens=1)
    lanes = _lanes(registry, spec, constraints)
    _add(lanes, "a", 1)
    _add(lanes, "b", 2)
    tol = TOL["bfloat16"]
    res, t = _step(lanes, spec, [("a", 6), ("b", 1)], 3)
    _compare(lanes, res, t, tol, "bf16 mixed")
    res, t = _step(lanes, spec, [("a", 1), ("b", 1)], 4, pad_to=3)
    _compare(lanes, res, t, tol, "bf16 decode")


def test_commit_rejects_bad_accepted_counts_and_foreign_batch(registry):
    spec = make_spec("gated_deltanet")
    constraints = ExecutionConstraints(max_batch_size=4, max_num_tokens=32, speculative_tokens=2)
    lane = _lanes(registry, spec, constraints)[1]
    lane.state.add_request("a")
    run_step(lane, [("a", 3)], step_inputs(spec, 3, DEV, 1), spec_tokens=2)
    verify = lane.batch
    ctx = lane.runtime.groups["linear"].context
    with pytest.raises(BackendInputError, match="num_accepted"):
        ctx.commit_speculative(verify, torch.tensor([4], dtype=torch.int32))
    other = lane.builder.build([("a", 3)], spec_tokens=2)
    with pytest.raises(BackendInputError, match="commit batch"):
        ctx.commit_speculative(other, torch.tensor([1], dtype=torch.int32))


def test_native_verify_without_workspace_says_what_to_set(registry):
    spec = make_spec("kda")
    lane = _lanes(registry, spec, ExecutionConstraints(max_batch_size=4, max_num_tokens=32))[1]
    assert len(lane.runtime.workspaces["linear"]) == 0
    lane.state.add_request("a")
    with pytest.raises(BackendInputError, match="speculative_tokens"):
        run_step(lane, [("a", 3)], step_inputs(spec, 3, DEV, 1), spec_tokens=2)


def test_missing_inputs_are_named(registry):
    spec = make_spec("gated_deltanet")
    lane = _lanes(registry, spec, ExecutionConstraints(max_batch_size=4, max_num_tokens=32))[1]
    lane.state.add_request("a")
    batch = lane.builder.build([("a", 1)])
    lane.runtime.prepare(batch)
    x = step_inputs(spec, 1, DEV, 0)[0]
    with pytest.raises(BackendInputError, match="beta"):
        lane.runtime.binding(0).forward(x["q"], x["k"], x["v"], g=x["extra"]["g"])


@pytest.mark.parametrize("variant, name", [("lightning", "slope"), ("mamba1", "A_log")])
def test_a_layer_parameter_of_the_wrong_shape_is_named_with_its_layer(registry, variant, name):
    """The plugin's own input checks named the group and the backend, not the layer."""
    spec = _spec(variant)
    lane = _lanes(registry, spec, ExecutionConstraints(max_batch_size=4, max_num_tokens=32))[1]
    lane.state.add_request("a")
    lane.runtime.prepare(lane.builder.build([("a", 1)]))
    x, p = step_inputs(spec, 1, DEV, 0)[1], lane.params[1]
    kw = {**x["extra"], **{n: t for n, t in p.items() if n not in ("conv_w", "conv_b")}}
    kw[name] = kw[name][:1]
    with pytest.raises(BackendInputError, match=f"layer 1: .*{name} shape"):
        lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], **kw)


def test_a_negative_lightning_slope_is_refused_before_any_state_changes(registry):
    """Lightning's kernels decay by ``e^(-slope)`` through ``A_log = log(slope)``: a negative
    slope (a state that grows) came out as NaN in the slot. It is refused, naming the layer
    and the head, before the step writes anything; a slope changed in place after it passed
    is checked again (the check keys on the tensor's storage and version)."""
    spec = _spec("lightning")
    lane = _lanes(registry, spec, ExecutionConstraints(max_batch_size=4, max_num_tokens=32))[1]
    lane.state.add_request("a")
    lane.runtime.prepare(lane.builder.build([("a", 3)]))
    x, p = step_inputs(spec, 3, DEV, 0)[1], lane.params[1]
    slope = p["slope"].clone()
    bad = slope.clone()
    bad[1] = -0.25
    before = states(lane)
    with pytest.raises(BackendInputError, match=r"layer 1: lightning slope: .*head 1"):
        lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], slope=bad)
    after = states(lane)
    assert all(torch.equal(before[i][1], after[i][1]) for i in LAYERS)
    lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], slope=slope)  # a valid slope runs
    assert torch.isfinite(lane.state.state_slots.layer(1).ssm).all()
    slope[1] = float("nan")  # in place: a new version of the same storage
    lane.runtime.prepare(lane.builder.build([("a", 3)]))
    with pytest.raises(BackendInputError, match=r"layer 1: lightning slope: .*head 1"):
        lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], slope=slope)


@pytest.mark.skipif(DEV != "cpu", reason="aliases host memory (torch.frombuffer)")
def test_a_new_slope_tensor_at_a_checked_address_is_checked_again(registry):
    """The check's record names the tensor itself, not its address: a new tensor at the
    address of one that passed, with the same in-place count (0), is read again. Here both
    view one host buffer, whose values turned negative after the first passed."""
    import numpy as np

    spec = _spec("lightning")
    lane = _lanes(registry, spec, ExecutionConstraints(max_batch_size=4, max_num_tokens=32))[1]
    lane.state.add_request("a")
    lane.runtime.prepare(lane.builder.build([("a", 3)]))
    x, p = step_inputs(spec, 3, DEV, 0)[1], lane.params[1]
    buf = bytearray(p["slope"].float().numpy().tobytes())
    first = torch.frombuffer(buf, dtype=torch.float32)
    lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], slope=first)
    np.frombuffer(buf, dtype=np.float32)[1] = -0.25  # not through torch: no count moves
    second = torch.frombuffer(buf, dtype=torch.float32)
    assert second.data_ptr() == first.data_ptr()
    lane.runtime.prepare(lane.builder.build([("a", 3)]))
    with pytest.raises(BackendInputError, match=r"layer 1: lightning slope: .*head 1"):
        lane.runtime.binding(1).forward(x["q"], x["k"], x["v"], slope=second)


def test_workspace_declared_per_layer_for_native_only(registry):
    spec = make_spec("gated_deltanet")
    native = ExecutionConstraints(max_batch_size=4, max_num_tokens=32, speculative_tokens=3)
    lane = _lanes(registry, spec, native)[1]
    ws = lane.runtime.workspaces["linear"]
    assert sorted(ws) == [f"verify_states.{i}" for i in LAYERS]
    assert tuple(ws["verify_states.0"].shape) == (4, 4, *spec.ssm_state_shape)
    replay = native.with_(spec_verify_strategy="replay")
    assert len(_lanes(registry, spec, replay)[1].runtime.workspaces["linear"]) == 0


@pytest.mark.parametrize("states", [None, "float32", "activations"])
@pytest.mark.parametrize("variant", ["mamba2", "lightning"])
def test_the_ssd_states_option_reaches_the_prefill_and_matches_the_reference(
    registry, monkeypatch, variant, states
):
    """``--option triton_ssm.ssd_states=activations``: the SSD prefill is asked for entering
    states in the activations' dtype (float32 otherwise, the default), and the outputs and
    states still match the reference (on CUDA the Triton SSD runs with them; without CUDA the
    torch SSD runs, which keeps float32 states)."""
    from attn_plugin_triton_ssm import kernels

    asked: list[object] = []
    real = kernels.mamba2_prefill

    def recording(*args, **kwargs):
        asked.append(kwargs.get("states_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "mamba2_prefill", recording)
    spec = _spec(variant, dtype="bfloat16")
    options = {} if states is None else {TRITON: {"ssd_states": states}}
    constraints = ExecutionConstraints(max_batch_size=4, max_num_tokens=32, backend_options=options)
    lanes = _lanes(registry, spec, constraints)
    assert dict(lanes[1].runtime.plan.choices[0].backend.options) == {
        "ssd_states": states or "float32",
        "ssd_dots": "split",
    }
    _add(lanes, "a", 1)
    _add(lanes, "b", 2)
    res, t = _step(lanes, spec, [("a", 9), ("b", 5)], 3)
    _compare(lanes, res, t, TOL["bfloat16"], f"{variant} prefill, ssd_states={states}")
    want = torch.bfloat16 if states == "activations" else None
    assert asked and set(asked) == {want}, asked


@pytest.mark.parametrize("dots", [None, "split", "activations"])
def test_the_ssd_dots_option_reaches_the_prefill_and_matches_the_reference(
    registry, monkeypatch, dots
):
    """``--option triton_ssm.ssd_dots=activations``: the SSD prefill is asked not to split its
    float32 dot operands (``precise=False``; split, the default, otherwise), and the outputs and
    states still match the reference (without CUDA the torch SSD runs, float32 throughout)."""
    from attn_plugin_triton_ssm import kernels

    asked: list[object] = []
    real = kernels.mamba2_prefill

    def recording(*args, **kwargs):
        asked.append(kwargs.get("precise"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "mamba2_prefill", recording)
    spec = _spec("mamba2", dtype="bfloat16")
    options = {} if dots is None else {TRITON: {"ssd_dots": dots}}
    constraints = ExecutionConstraints(max_batch_size=4, max_num_tokens=32, backend_options=options)
    lanes = _lanes(registry, spec, constraints)
    assert dict(lanes[1].runtime.plan.choices[0].backend.options)["ssd_dots"] == (dots or "split")
    _add(lanes, "a", 1)
    _add(lanes, "b", 2)
    res, t = _step(lanes, spec, [("a", 9), ("b", 5)], 3)
    _compare(lanes, res, t, TOL["bfloat16"], f"mamba2 prefill, ssd_dots={dots}")
    assert asked and set(asked) == {dots != "activations"}, asked


def test_a_bad_ssd_states_value_names_the_choices(registry):
    from attn_core.errors import SelectionError

    spec = _spec("mamba2")
    bad = ExecutionConstraints(backend_options={TRITON: {"ssd_states": "fp8"}})
    with pytest.raises(SelectionError, match=r"ssd_states.*'fp8'.*float32.*activations"):
        _lanes(registry, spec, bad)
    bad = ExecutionConstraints(backend_options={TRITON: {"ssd_dots": "tf32"}})
    with pytest.raises(SelectionError, match=r"ssd_dots.*'tf32'.*split.*activations"):
        _lanes(registry, spec, bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the Triton SSD is the default")
@pytest.mark.parametrize("variant", ["mamba2", "lightning"])
def test_every_mode_matches_reference_through_the_triton_ssd(registry, monkeypatch, variant):
    """Without CUDA the plugin's Mamba2 and lightning prefill take the torch SSD; here the GPU's
    Triton SSD (lightning's mapping onto it included) runs in the interpreter through every
    mode of the test above."""
    from attn_plugin_triton_ssm import kernels

    ssd = kernels.mamba2_prefill
    impls: list[str] = []

    def triton_ssd(*args, **kwargs):
        impls.append("triton")
        return ssd(*args, **{**kwargs, "impl": "triton"})

    monkeypatch.setattr(kernels, "mamba2_prefill", triton_ssd)
    test_every_mode_matches_reference(registry, variant, "native")
    assert impls, "the plugin's prefill did not reach mamba2_prefill"
