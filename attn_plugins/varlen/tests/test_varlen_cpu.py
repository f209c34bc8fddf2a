"""CPU tests of the varlen plugin: advertisement, unavailability, selection, and the SDPA path's
math against the reference backend's ``varlen_attention`` (an independent implementation).

The SDPA code path is CUDA-only in the advertisement, but its math is device-agnostic, so it is
checked here on CPU; the varlen_attn path needs CUDA and is covered by ``test_varlen_gpu.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from attn_plugin_varlen import kernels, plugin

import attn_core.reference.plugin as ref_plugin
from attn_core.batch import BatchBuilder
from attn_core.hookspecs import hookimpl
from attn_core.reference.ops import varlen_attention
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers

ENC = LayerSpec(kind="encoder", num_heads=4, num_kv_heads=4, head_dim=64, causal=False)


def _registry(available: bool | None) -> Registry:
    """Reference + the varlen plugin; ``available`` overrides the machine probe (None: real)."""
    reg = Registry(strict=True)
    reg.register_plugin(ref_plugin, name="attn_core")
    if available is None:
        reg.register_plugin(plugin, name="varlen")
    else:

        class Forced:
            ATTN_CORE_API_VERSION = plugin.ATTN_CORE_API_VERSION
            attn_core_allocate_context = staticmethod(plugin.attn_core_allocate_context)
            attn_core_bind_forward = staticmethod(plugin.attn_core_bind_forward)

            @staticmethod
            @hookimpl
            def attn_core_register_backends(register):
                for b in plugin.make_backends(available=available):
                    register(b)

        reg.register_plugin(Forced(), name="varlen")
    return reg


def _plan(
    spec: LayerSpec,
    target: str,
    available: bool | None = True,
    local: bool | None = None,
    **constraints,
):
    groups = group_layers([spec])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # downgrade warnings are asserted on the plan instead
        return select(
            groups,
            _registry(available),
            DeviceCapabilities.target(target),
            ExecutionConstraints(**constraints),
            local=local,
        )


# ------------------------------------------------------------------------------------------
# Advertisement
# ------------------------------------------------------------------------------------------
def test_plugin_loads_with_api_version_and_two_backends():
    reg = _registry(None)
    assert not reg.quarantined
    assert reg.plugins["varlen"].api_version == (1, 1)
    names = {b.qualified_name for b in reg.backends}
    assert {"varlen:varlen", "varlen:sdpa"} <= names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's verdict")
def test_unavailable_without_cuda_with_reason():
    by = {b.name: b for b in plugin.make_backends()}
    for name in (plugin.VARLEN, plugin.SDPA):
        assert not by[name].available
        assert "CUDA is not available" in by[name].unavailable_reason


def test_varlen_capabilities_are_what_flash_attention_2_serves():
    caps = {b.name: b for b in plugin.make_backends(available=True)}[plugin.VARLEN].capabilities
    assert {k.value for k in caps.kinds} == {"encoder"}
    assert caps.device_types == frozenset({"cuda"})
    assert caps.min_compute_capability == (8, 0)
    assert caps.dtypes == frozenset({"bfloat16", "float16"})
    assert 72 in caps.head_dims and 80 in caps.head_dims and 256 in caps.head_dims
    assert 260 not in caps.head_dims and 68 not in caps.head_dims
    assert caps.non_causal and caps.causal
    assert not caps.logits_soft_cap and not caps.sinks
    assert {m.value for m in caps.graph_modes} == {"none"}


def test_window_flag_follows_the_torch_signature():
    info, reason = kernels.probe_varlen_attn()
    if info is None:
        pytest.skip(f"this torch has no varlen_attn: {reason}")
    b = {b.name: b for b in plugin.make_backends(available=True)}[plugin.VARLEN]
    assert b.capabilities.sliding_window == info.window


# ------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------
def test_h200_picks_sdpa_over_varlen_and_reference():
    """Without tuning data SDPA ranks first: on sm90 it ran 1.2-2.0x faster than
    ``varlen_attn`` at every encoder shape of ``bench_varlen.py`` (ragged ones included)."""
    plan = _plan(ENC, "h200")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "varlen:sdpa"
    assert choice.outranked == ("varlen:varlen", "attn_core:reference")


def test_float32_goes_to_sdpa_with_a_dtype_reason_for_varlen():
    plan = _plan(ENC.with_(dtype="float32", kv_dtype=None), "h200")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "varlen:sdpa"
    codes = {r.code for r in choice.rejections_by_backend()["varlen:varlen"]}
    assert codes == {"dtype"}


def test_odd_head_dim_goes_to_sdpa():
    plan = _plan(ENC.with_(head_dim=68), "h200")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "varlen:sdpa"
    [rej] = choice.rejections_by_backend()["varlen:varlen"]
    assert rej.code == "head_dim" and rej.fix is None  # the model's head dim: no hint
    assert rej.reason.startswith("cannot serve this model: head_dim 68 (serves ")


def test_soft_cap_falls_back_to_reference():
    """A soft cap is what the model is: the reference serving it is no downgrade."""
    plan = _plan(ENC.with_(logits_soft_cap=30.0), "h200")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "attn_core:reference"
    by = choice.rejections_by_backend()
    assert {r.code for r in by["varlen:varlen"]} == {"soft_cap"}
    assert {r.code for r in by["varlen:sdpa"]} == {"soft_cap"}
    assert choice.downgraded_from == ()


def test_cpu_target_rejects_both_for_device_type():
    plan = _plan(ENC, "cpu")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "attn_core:reference"
    by = choice.rejections_by_backend()
    for name in ("varlen:varlen", "varlen:sdpa"):
        assert "device_type" in {r.code for r in by[name]}


def test_pre_ampere_rejects_varlen_for_compute_capability():
    volta = DeviceCapabilities(
        vendor="nvidia", name="V100", device_type="cuda", compute_capability=(7, 0),
        dtypes=frozenset({"float32", "float16"}),
    )  # fmt: skip
    groups = group_layers([ENC.with_(dtype="float16", kv_dtype=None)])
    plan = select(groups, _registry(True), volta, ExecutionConstraints())
    choice = plan.choice("encoder")
    assert choice.downgraded_from == ()  # SDPA ranks first anyway: nothing above it lost
    assert choice.backend.qualified_name == "varlen:sdpa"
    [rej] = choice.rejections_by_backend()["varlen:varlen"]
    assert rej.code == "compute_capability"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's verdict")
def test_real_registry_on_h200_target_explains_unavailability():
    offline = _plan(ENC, "h200", available=None, local=False).choice("encoder")
    assert offline.backend.qualified_name == "varlen:sdpa" and not offline.loadable_here
    assert "CUDA" in dict(offline.not_loadable_here)["varlen:sdpa"]
    assert offline.rejected == ()
    plan = _plan(ENC, "h200", available=None, local=True, downgrade="allow")
    choice = plan.choice("encoder")
    assert choice.backend.qualified_name == "attn_core:reference"
    by = choice.rejections_by_backend()
    assert [r.code for r in by["varlen:varlen"]] == ["unavailable"]
    assert "CUDA" in by["varlen:varlen"][0].reason


# ------------------------------------------------------------------------------------------
# The SDPA path's math (device-agnostic) against the reference
# ------------------------------------------------------------------------------------------
def test_equal_length_runs_merges_consecutive_equal_lengths_only():
    cu = np.array([0, 4, 8, 12, 15, 15, 19, 23], dtype=np.int32)
    assert kernels.equal_length_runs(cu) == [(0, 4, 3), (12, 3, 1), (15, 4, 2)]
    assert kernels.equal_length_runs(np.array([0], dtype=np.int32)) == []


@pytest.mark.parametrize(
    ("causal", "window", "hkv"),
    [(False, None, 4), (True, None, 2), (False, 3, 4), (True, 4, 1), (False, 50, 2)],
)
def test_sdpa_varlen_matches_reference(causal, window, hkv):
    torch.manual_seed(0)
    lens = [5, 5, 5, 9, 0, 1, 7, 7]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, hq, d = int(cu[-1]), 4, 16
    q = torch.randn(t + 2, hq, d)  # two trailing rows no sequence owns: must come back zero
    k = torch.randn(t + 2, hkv, d)
    v = torch.randn(t + 2, hkv, d)
    out = torch.full((t + 2, hq, d), float("nan"))
    got = kernels.sdpa_varlen(q, k, v, cu, scale=0.3, causal=causal, sliding_window=window, out=out)
    want = varlen_attention(
        q, k, v, torch.from_numpy(cu), scale=0.3, causal=causal, sliding_window=window
    )
    assert got is out
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(got[t:]) == 0


def test_window_mask_matches_hf_convention():
    m = kernels.window_mask(5, True, 2, torch.device("cpu"))
    assert m[3].tolist() == [False, False, True, True, False]  # sees itself and one before
    b = kernels.window_mask(5, False, 2, torch.device("cpu"))
    assert b[2].tolist() == [False, True, True, True, False]


@pytest.mark.parametrize(
    ("causal", "window", "expected"),
    [(True, None, (-1, 0)), (False, None, (-1, -1)), (True, 8, (7, 0)), (False, 8, (7, 7))],
)
def test_flash_window_translation(causal, window, expected):
    assert kernels.flash_window(causal, window) == expected


def test_sdpa_context_through_the_runtime_on_cpu():
    """Wiring: plan for an H200 with the backends forced available, then run the SDPA context
    on CPU tensors through AttentionRuntime + BatchBuilder.build_encoder, against the reference."""
    spec = LayerSpec(kind="encoder", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
    assert spec.causal  # the default; the plugin must honour it
    plan = _plan(spec, "h200")
    assert plan.choice("encoder").backend.qualified_name == "varlen:sdpa"
    reg = _registry(True)
    runtime = AttentionRuntime(plan, reg, device="cpu", layer_params={0: {"scale": 0.2}})
    builder = BatchBuilder(None, max_batch_size=8, max_num_tokens=64)
    batch = builder.build_encoder([6, 6, 3, 10])
    runtime.prepare(batch)
    torch.manual_seed(1)
    q = torch.randn(25, 4, 16)
    k = torch.randn(25, 2, 16)
    v = torch.randn(25, 2, 16)
    out = torch.empty(25, 4, 16)
    got = runtime.binding(0).forward(q, k, v, out=out)
    want = varlen_attention(q, k, v, batch.query_start_loc, scale=0.2, causal=True)
    assert got is out
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_batch_is_rejected_with_a_clear_error():
    spec = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=16, dtype="float32")
    ctx = plugin.SdpaContext(plugin.make_backends(available=True)[1], group_layers([spec])[0])
    builder = BatchBuilder(None, max_batch_size=4, max_num_tokens=8)
    with pytest.raises(ValueError, match="encoder batch"):
        ctx.prepare(builder.build([("a", 1)]))


@pytest.mark.parametrize("offsets", [[1, 3, 6], [0, 4, 2], [0, 3, 9], [0, 2, 4], [0, 6]], ids=str)
def test_offsets_that_do_not_cut_the_batch_into_its_requests_are_refused(offsets):
    """A batch whose offsets do not start at 0, go back, pass the token count, stop short of
    it, or miss a request gave silent zero rows or a bare unflatten error; prepare refuses it,
    naming the group and backend, before any forward."""
    import dataclasses

    spec = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=16, dtype="float32")
    group = group_layers([spec])[0]
    base = BatchBuilder(None, max_batch_size=8, max_num_tokens=64).build_encoder([3, 3])
    cu = np.array(offsets, dtype=np.int32)
    bad = dataclasses.replace(base, query_start_loc_cpu=cu, query_start_loc=torch.from_numpy(cu))
    for backend in plugin.make_backends(available=True):
        if backend.name == "sdpa":
            ctx = plugin.SdpaContext(backend, group)
        else:  # prepare reads no kernel: a stand-in for what this torch's varlen_attn takes
            info = kernels.VarlenAttnInfo(lambda *a, **k: None, None, True, False, False)
            ctx = plugin.VarlenContext(backend, group, info)
        with pytest.raises(
            ValueError, match=r"query_start_loc.*expected 3 offsets from 0 to 6"
        ) as e:
            ctx.prepare(bad)
        assert f"backend {backend.qualified_name!r}" in str(e.value)
        ctx.prepare(base)  # the batch as built is fine
