"""CPU tests of the fa3 plugin: advertisement, unavailability, selection (compute capability,
shared page size), the graph-safe KV write against the reference's ``write_paged_kv``, and the
context's wiring through AttentionRuntime with a stand-in provider."""

from __future__ import annotations

import warnings

import pytest
import torch
from attn_plugin_fa3 import kv_write, plugin, providers, split_kv
from chunk_rows import attend_chunk_rows

import attn_core.reference.plugin as ref_plugin
from attn_core.backend import Backend, BackendCapabilities
from attn_core.batch import BatchBuilder
from attn_core.errors import SelectionError
from attn_core.hookspecs import hookimpl
from attn_core.reference import ops
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    Phase,
    group_layers,
)
from attn_core.state.manager import PersistentState

FULL = LayerSpec(kind="full", num_heads=8, num_kv_heads=2, head_dim=128, page_size=16)

# On a machine with CUDA these tests' stand-ins are not what runs (the plugin takes its GPU
# paths, and ``--target h200`` on an H200 is a local plan): test_fa3_gpu.py covers them there
# with FlashAttention-4 itself.
_CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="models the CPU stand-in provider; test_fa3_gpu.py on CUDA"
)


def _fa3_module(available: bool | None):
    if available is None:
        return plugin

    class Forced:
        ATTN_CORE_API_VERSION = plugin.ATTN_CORE_API_VERSION
        attn_core_allocate_context = staticmethod(plugin.attn_core_allocate_context)
        attn_core_bind_forward = staticmethod(plugin.attn_core_bind_forward)

        @staticmethod
        @hookimpl
        def attn_core_register_backends(register):
            register(plugin.make_backend(available=available))

    return Forced()


def _registry(available: bool | None = True, *, reference: bool = True, extra=None) -> Registry:
    reg = Registry(strict=True)
    if reference:
        reg.register_plugin(ref_plugin, name="attn_core")
    reg.register_plugin(_fa3_module(available), name="fa3")
    if extra is not None:
        reg.register_plugin(extra, name="extra")
    return reg


def _plan(specs, target="h200", available=True, local=None, **constraints):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # downgrades are asserted on the plan
        return select(
            group_layers(specs),
            _registry(available),
            DeviceCapabilities.target(target),
            ExecutionConstraints(**constraints),
            local=local,
        )


def _codes(choice, backend="fa3:fa3"):
    return {r.code for r in choice.rejections_by_backend().get(backend, [])}


# ------------------------------------------------------------------------------------------
# Advertisement
# ------------------------------------------------------------------------------------------
def test_plugin_loads_with_api_version():
    reg = _registry(None)
    assert not reg.quarantined
    assert reg.plugins["fa3"].api_version == (1, 2)
    assert reg.resolve("fa3").qualified_name == "fa3:fa3"
    assert reg.resolve("fa3").priority == 90


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's verdict")
def test_unavailable_without_cuda_names_cuda_and_the_libraries():
    b = plugin.make_backend()
    assert not b.available
    assert "CUDA is not available" in b.unavailable_reason
    assert "flash-attn-4" in b.unavailable_reason


def test_capabilities_hopper_only_with_what_the_kernel_serves():
    caps = plugin.make_backend(available=True).capabilities
    assert caps.min_compute_capability == (9, 0) and caps.max_compute_capability == (9, 0)
    assert caps.device_types == frozenset({"cuda"})
    assert caps.dtypes == frozenset({"bfloat16", "float16"})
    assert caps.kv_dtypes == frozenset({"bfloat16", "float16"})  # no fp8 on sm90 in FA4
    assert not caps.mixed_kv_dtypes  # KV in the query's dtype only
    assert caps.head_dims == frozenset({64, 96, 128})
    assert caps.page_sizes == frozenset({16, 32, 64, 128, 256})
    assert {m.value for m in caps.graph_modes} == {"none", "decode"}
    assert caps.sliding_window and caps.logits_soft_cap and caps.sinks
    assert caps.causal and not caps.non_causal


def test_official_fa3_provider_advertises_no_sinks():
    fake = providers.Provider(
        name="flash_attn_interface",
        version="3.0",
        sinks=False,
        deterministic=False,
        head_dims=providers.FA3_HEAD_DIMS,
        _run=lambda *a, **k: None,
    )
    caps = plugin.make_backend(available=True, provider=fake).capabilities
    assert not caps.sinks and not caps.deterministic
    assert 256 in caps.head_dims


# ------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------
def test_h200_picks_fa3():
    plan = _plan([FULL])
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"
    assert plan.page_size == 16


@pytest.mark.parametrize(("target", "fix"), [("a100", ">= 9.0"), ("b200", "<= 9.0")])
def test_non_hopper_rejected_for_compute_capability(target, fix):
    plan = _plan([FULL], target=target)
    choice = plan.choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    [rej] = choice.rejections_by_backend()["fa3:fa3"]
    assert rej.code == "compute_capability" and fix in rej.fix
    assert choice.downgraded_from == ("fa3:fa3",)


def test_a_cache_in_another_16_bit_dtype_is_rejected_by_the_selector_not_at_allocation():
    """FA3 reads KV in the query dtype only: an fp16 layer over a bf16 cache goes to another
    backend at selection (code kv_dtype), instead of choosing fa3 and failing to allocate."""
    fp16 = FULL.with_(dtype="float16", kv_dtype=None)  # its cache in fp16 too
    choice = _plan([fp16], kv_dtype="bfloat16").choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert "kv_dtype" in _codes(choice)
    assert _plan([fp16]).choice("full").backend.qualified_name == "fa3:fa3"


def test_cpu_target_rejected_for_device_type():
    choice = _plan([FULL], target="cpu").choice("full")
    assert "device_type" in _codes(choice)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's verdict")
def test_real_registry_plans_h200_offline_and_rejects_for_this_machine():
    """An offline H200 plan chooses fa3 as an H200 would and says this machine cannot load it;
    a plan for this machine rejects it as unavailable."""
    choice = _plan([FULL], available=None, local=False).choice("full")
    assert choice.backend.qualified_name == "fa3:fa3" and not choice.loadable_here
    assert "CUDA is not available" in dict(choice.not_loadable_here)["fa3:fa3"]
    assert _codes(choice) == set()
    choice = _plan([FULL], available=None, local=True).choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert _codes(choice) == {"unavailable"}


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (dict(head_dim=256), "head_dim"),
        (dict(kv_dtype="fp8_e4m3"), "kv_dtype"),
        (dict(dtype="float32", kv_dtype=None), "dtype"),
        (dict(causal=False), "non_causal"),
    ],
)
def test_layer_features_fa3_does_not_serve(change, code):
    choice = _plan([FULL.with_(**change)]).choice("full")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert code in _codes(choice)


def test_gpt_oss_like_groups_window_softcap_sinks_all_on_fa3():
    specs = [
        FULL.with_(head_dim=64, sliding_window=128, has_sinks=True),
        FULL.with_(head_dim=64, has_sinks=True),
        FULL.with_(logits_soft_cap=50.0),
    ]
    plan = _plan(specs)
    assert {c.backend.qualified_name for c in plan.choices} == {"fa3:fa3"}


def test_speculative_verify_beyond_the_reference():
    choice = _plan([FULL], speculative_tokens=9).choice("full")
    assert choice.backend.qualified_name == "fa3:fa3"
    verify = choice.phase_choice("verify")  # draft tokens bind the verify phase only
    assert verify.backend.qualified_name == "fa3:fa3"
    assert "speculative" in {
        r.code for r in verify.rejections_by_backend().get("attn_core:reference", [])
    }
    with pytest.raises(SelectionError, match="speculative_tokens 33 -> 32"):
        _plan([FULL], speculative_tokens=33)


def test_full_graph_mode_rejected_with_a_fix():
    with pytest.raises(SelectionError) as err:
        _plan([FULL], graph_mode="full", downgrade="error")
    text = str(err.value)
    assert "fa3:fa3:" in text and "graph_mode full -> decode" in text
    # the default policy (warn) lowers the graph mode instead
    plan = _plan([FULL], graph_mode="full")
    assert plan.constraints.graph_mode.value == "decode"
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"


def test_decode_graphs_and_verify_admitted():
    plan = _plan([FULL], graph_mode="decode", speculative_tokens=3)
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"


def test_page_size_agreement_with_the_reference():
    """The model's own page size wins when some backend serves it: at page 8 the reference
    serves (fa3 is rejected with the fix), a forced page 16 brings fa3 back."""
    spec = FULL.with_(page_size=8)
    plan = _plan([spec])
    choice = plan.choice("full")
    assert plan.page_size == 8
    assert choice.backend.qualified_name == "attn_core:reference"
    [rej] = choice.rejections_by_backend()["fa3:fa3"]
    assert (rej.code, rej.fix) == ("page_size", "page_size 8 -> 16")
    plan16 = _plan([spec], page_size=16)
    assert plan16.page_size == 16
    assert plan16.choice("full").backend.qualified_name == "fa3:fa3"


def test_shared_page_size_moves_to_one_every_group_accepts():
    """Without the reference: an MLA backend that pages by 64 only and fa3 agree on 64."""
    mla_caps = BackendCapabilities(
        kinds={"mla"}, device_types={"cuda"}, dtypes={"bfloat16"}, page_sizes={64}
    )

    class MLA64:
        ATTN_CORE_API_VERSION = "1.1"

        @staticmethod
        @hookimpl
        def attn_core_register_backends(register):
            register(Backend(name="mla64", capabilities=mla_caps, priority=10))

    mla = LayerSpec(
        kind="mla", num_heads=8, num_kv_heads=1, head_dim=576, head_dim_v=512,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, page_size=16,
    )  # fmt: skip
    groups = group_layers([FULL, mla])
    reg = _registry(True, reference=False, extra=MLA64())
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints())
    assert plan.page_size == 64
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"
    with pytest.raises(SelectionError, match="page_size"):
        select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(page_size=16))


# ------------------------------------------------------------------------------------------
# The graph-safe KV write
# ------------------------------------------------------------------------------------------
def _caches(num_pages=6, page=4, hkv=2, d=8, dtype=torch.bfloat16):
    torch.manual_seed(0)
    k = torch.randn(num_pages, page, hkv, d).to(dtype)
    v = torch.randn(num_pages, page, hkv, d).to(dtype)
    return k, v


@pytest.mark.parametrize("padding", [False, True])
def test_write_kv_matches_reference_write(padding):
    k_cache, v_cache = _caches()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 6, 7, 8, 13, 2] + ([-1, -1, -1] if padding else []))
    t = slots.numel()
    k = torch.randn(t, 2, 8).to(torch.bfloat16)
    v = torch.randn(t, 2, 8).to(torch.bfloat16)
    kv_write.write_kv(k, v, k_cache, v_cache, slots, may_have_padding=padding)
    ops.write_paged_kv(k, v, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_write_kv_safe_path_without_padding_equals_plain_path():
    k_cache, v_cache = _caches()
    k2, v2 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 1, 9, 23])
    k = torch.randn(4, 2, 8).to(torch.bfloat16)
    v = torch.randn(4, 2, 8).to(torch.bfloat16)
    kv_write.write_kv(k, v, k_cache, v_cache, slots, may_have_padding=False)
    kv_write.write_kv(k, v, k2, v2, slots, may_have_padding=True)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)


def test_write_kv_rejects_a_dtype_mismatch():
    k_cache, v_cache = _caches()
    k = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="cache dtype"):
        kv_write.write_kv(k, k, k_cache, v_cache, torch.tensor([0]), may_have_padding=False)


# ------------------------------------------------------------------------------------------
# Context wiring (stand-in provider that computes with the reference op)
# ------------------------------------------------------------------------------------------
class _Recorder:
    """A provider that records the call and computes with ``ops.paged_attention``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def as_provider(self) -> providers.Provider:
        return providers.Provider(
            name="stand-in",
            version="0",
            sinks=True,
            deterministic=True,
            head_dims=providers.FA4_HEAD_DIMS,
            _run=self.run,
        )

    def run(self, q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k,
            max_seqlen_k, page_table, scale, window_left, softcap, sinks):  # fmt: skip
        self.calls.append(
            dict(window_left=window_left, softcap=softcap, sinks=sinks, out=out,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        )  # fmt: skip
        n = cu_seqlens_q.numel() - 1
        result = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            page_table[:n],
            cu_seqlens_q,
            seqused_k,
            scale=scale,
            causal=True,
            sliding_window=None if window_left is None else window_left + 1,
            logits_soft_cap=softcap,
            sinks=None if sinks is None else sinks.float(),
        )
        if out is not None:
            out.copy_(result)
            return out
        return result


def test_context_writes_kv_and_passes_the_batch_metadata(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    spec = LayerSpec(
        kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        sliding_window=5, logits_soft_cap=20.0, has_sinks=True,
    )  # fmt: skip
    groups = group_layers([spec])
    reg_fa3 = _registry(True)
    plan = select(groups, reg_fa3, DeviceCapabilities.target("h200"), ExecutionConstraints())
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"
    ref_plan = select(
        groups,
        reg_fa3,
        DeviceCapabilities.target("h200"),
        ExecutionConstraints(force="full=reference"),
    )
    state = PersistentState(groups, num_pages=16, num_slots=0)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).to(torch.bfloat16).float()
    params = {0: {"sinks": sinks, "scale": 0.11}}
    rt = AttentionRuntime(plan, reg_fa3, state=state, layer_params=params)
    rt_ref = AttentionRuntime(ref_plan, reg_fa3, state=state, layer_params=params)
    builder = BatchBuilder(state, max_batch_size=4, max_num_tokens=64, max_pages_per_request=8)
    torch.manual_seed(3)
    for r in ("a", "b"):
        state.add_request(r)
    for step in ([("a", 19), ("b", 3)], [("a", 1), ("b", 1)], [("a", 2), ("b", 1)]):
        batch = builder.build(step)
        t = batch.num_tokens
        q = torch.randn(t, 4, 64).to(torch.bfloat16)
        k = torch.randn(t, 2, 64).to(torch.bfloat16)
        v = torch.randn(t, 2, 64).to(torch.bfloat16)
        rt_ref.prepare(batch)
        want = rt_ref.binding(0).forward(q, k, v)
        rt.prepare(batch)
        out = torch.empty(t, 4, 64, dtype=torch.bfloat16)
        got = rt.binding(0).forward(q, k, v, out=out)
        assert got is out
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        for r, n in step:
            state.advance(r, n)
    call = rec.calls[-1]
    assert call["window_left"] == 4 and call["softcap"] == 20.0
    assert call["sinks"].dtype == torch.bfloat16 and torch.equal(call["sinks"].float(), sinks)
    assert call["out"] is not None and call["max_seqlen_q"] == 2 and call["max_seqlen_k"] == 22


class _SplitRecorder(_Recorder):
    """:class:`_Recorder` with the split-decode and dense-prefill entry points of flash-attn-4,
    computed with plain PyTorch, recording which path each step took."""

    def as_provider(self) -> providers.Provider:
        return providers.Provider(
            name="stand-in",
            version="0",
            sinks=True,
            deterministic=True,
            head_dims=providers.FA4_HEAD_DIMS,
            _run=self.run,
            _run_with_lse=self.run_with_lse,
            _run_dense=self.run_dense,
        )

    def run(self, *args, **kwargs):
        self.calls.append({"path": "paged"})
        return super().run(*args, **kwargs)

    def run_with_lse(self, q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, max_seqlen_k,
                     page_table, scale, softcap, out=None, lse=None):  # fmt: skip
        self.calls.append({"path": "split", "rows": q.shape[0], "max_seqlen_k": max_seqlen_k,
                           "q_row_stride": q.stride(0)})  # fmt: skip
        return attend_chunk_rows(q, k_cache, v_cache, page_table, seqused_k, scale, softcap=softcap)

    def run_dense(self, q, k, v, out, *, cu_seqlens, max_seqlen, scale, window_left, softcap,
                  sinks):  # fmt: skip
        self.calls.append({"path": "dense", "max_seqlen": max_seqlen})
        # the new tokens' own K/V as a cache of one-token pages, one page-table row per sequence
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        table = cu_seqlens[:-1, None] + torch.arange(max_seqlen)[None, :]
        table = table.clamp(max=k.shape[0] - 1).to(torch.int32)
        result = ops.paged_attention(
            q, k[:, None], v[:, None], table, cu_seqlens, lens, scale=scale, causal=True,
            sliding_window=None if window_left is None else window_left + 1,
            logits_soft_cap=softcap, sinks=None if sinks is None else sinks.float(),
        )  # fmt: skip
        if out is not None:
            out.copy_(result)
            return out
        return result


@_CPU_ONLY
def test_long_decode_is_split_and_fresh_prefill_skips_the_page_table(monkeypatch):
    """A prefill without cached prefix runs the non-paged varlen call; a decode step at long
    context and small batch runs as chunk rows merged by log-sum-exp (soft-cap and sinks
    included); a chunked prefill over a cached prefix keeps the paged call. Each matches the
    reference backend."""
    from attn_plugin_fa3 import split_kv

    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    monkeypatch.setattr(split_kv, "sm_count", lambda device: 132)
    spec = LayerSpec(
        kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        logits_soft_cap=30.0, has_sinks=True,
    )  # fmt: skip
    groups = group_layers([spec])
    reg = _registry(True)
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints())
    ref_plan = select(
        groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(force="full=reference")
    )
    state = PersistentState(groups, num_pages=2 * 200 + 1, num_slots=0)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).to(torch.bfloat16).float()
    params = {0: {"sinks": sinks}}
    rt = AttentionRuntime(plan, reg, state=state, layer_params=params)
    rt_ref = AttentionRuntime(ref_plan, reg, state=state, layer_params=params)
    builder = BatchBuilder(state, max_batch_size=2, max_num_tokens=5300, max_pages_per_request=200)
    torch.manual_seed(5)
    for r in ("a", "b"):
        state.add_request(r)
    steps = [[("a", 3000), ("b", 2200)], [("a", 1), ("b", 1)], [("a", 40), ("b", 1)]]
    paths = []
    for step in steps:
        batch = builder.build(step)
        t = batch.num_tokens
        q = torch.randn(t, 4, 64).to(torch.bfloat16)
        k = torch.randn(t, 2, 64).to(torch.bfloat16)
        v = torch.randn(t, 2, 64).to(torch.bfloat16)
        rt_ref.prepare(batch)
        want = rt_ref.binding(0).forward(q, k, v)
        rt.prepare(batch)
        before = len(rec.calls)
        out = torch.empty(t, 4, 64, dtype=torch.bfloat16)
        got = rt.binding(0).forward(q, k, v, out=out)
        paths.append([c["path"] for c in rec.calls[before:] if "path" in c])
        assert got is out
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        for r, n in step:
            state.advance(r, n)
    assert paths == [["dense"], ["split"], ["paged"]]
    split_call = next(c for c in rec.calls if c.get("path") == "split")
    # 2 requests x 2 KV heads = 4 CTAs: split as far as 1k-token chunks allow (3001 keys: 2)
    assert split_call["rows"] == 2 * 2 and split_call["max_seqlen_k"] == 1504


@_CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sinks_written_in_place_reach_the_kernel(monkeypatch, dtype):
    """A weight reload writes the sinks into the same tensor: the context kept a bf16 copy per
    tensor object and served the old values (max |fa3 - reference| 0.98). Every step now reads
    the layer's sinks: a bf16 tensor as it is, another dtype copied into one bf16 buffer (so a
    captured graph replays the copy too)."""
    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     has_sinks=True)  # fmt: skip
    groups = group_layers([spec])
    reg = _registry(True)
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints())
    ref_plan = select(
        groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(force="full=reference")
    )
    state = PersistentState(groups, num_pages=9, num_slots=0)
    sinks = torch.zeros(4, dtype=dtype)
    params = {0: {"sinks": sinks}}
    rt = AttentionRuntime(plan, reg, state=state, layer_params=params)
    rt_ref = AttentionRuntime(ref_plan, reg, state=state, layer_params=params)
    builder = BatchBuilder(state, max_batch_size=2, max_num_tokens=64, max_pages_per_request=4)
    state.add_request("a")
    torch.manual_seed(0)
    for step, new in (([("a", 8)], None), ([("a", 1)], 4.0), ([("a", 1)], -2.0)):
        if new is not None:
            sinks.fill_(new)  # in place: the same tensor object
        batch = builder.build(step)
        t = batch.num_tokens
        q, k, v = (torch.randn(t, h, 64).to(torch.bfloat16) for h in (4, 2, 2))
        rt_ref.prepare(batch)
        want = rt_ref.binding(0).forward(q, k, v).clone()
        rt.prepare(batch)
        got = rt.binding(0).forward(q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        state.advance("a", t)


@pytest.mark.parametrize("broadcast", [True, False])
def test_one_request_split_decode_broadcasts_its_query_where_the_check_passed(
    monkeypatch, broadcast
):
    """A split decode of one request hands the chunk call ``q[0]`` broadcast over its rows
    (row stride 0, no copy) where the layer shape's broadcast check passed, copied rows where
    it did not; both equal the reference, and the K/V the merge stored serve the next step."""
    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    monkeypatch.setattr(split_kv, "sm_count", lambda device: 132)
    verdict = None if broadcast else "a kernel that reads stride 0 wrong"
    monkeypatch.setattr(plugin, "broadcast_q_problem", lambda *args: verdict)
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     logits_soft_cap=30.0)  # fmt: skip
    groups = group_layers([spec])
    reg = _registry(True)
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints())
    ref_plan = select(
        groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(force="full=reference")
    )
    state = PersistentState(groups, num_pages=200 + 1, num_slots=0)
    rt = AttentionRuntime(plan, reg, state=state)
    rt_ref = AttentionRuntime(ref_plan, reg, state=state)
    assert rt.groups["full"].context.broadcast_q is broadcast
    builder = BatchBuilder(state, max_batch_size=1, max_num_tokens=3000, max_pages_per_request=200)
    torch.manual_seed(6)
    state.add_request("a")
    for step in ([("a", 2500)], [("a", 1)], [("a", 1)], [("a", 3)]):
        batch = builder.build(step)
        t = batch.num_tokens
        q = torch.randn(t, 4, 64).to(torch.bfloat16)
        k = torch.randn(t, 2, 64).to(torch.bfloat16)
        v = torch.randn(t, 2, 64).to(torch.bfloat16)
        rt_ref.prepare(batch)
        want = rt_ref.binding(0).forward(q, k, v)
        rt.prepare(batch)
        got = rt.binding(0).forward(q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        state.advance("a", t)
    splits = [c for c in rec.calls if c.get("path") == "split"]
    assert len(splits) == 2 and all(c["rows"] == 2 for c in splits)  # 2500 keys: 2 chunks
    assert all((c["q_row_stride"] == 0) is broadcast for c in splits)


def test_the_broadcast_check_runs_at_the_page_size_the_cache_has(monkeypatch):
    """The spec says page 16, the plan and the state 128 (TMA loads, another kernel variant):
    the broadcast-query check ran at the spec's 16 and its verdict served the 128 kernel."""
    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    seen = []

    def check(provider, device, spec, page_size=None):
        seen.append(page_size)

    monkeypatch.setattr(plugin, "broadcast_q_problem", check)
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    groups = group_layers([spec])
    reg = _registry(True)
    cons = ExecutionConstraints(page_size=128)
    plan = select(groups, reg, DeviceCapabilities.target("h200"), cons)
    state = PersistentState(groups, num_pages=4, num_slots=0, page_size=128)
    AttentionRuntime(plan, reg, state=state)
    assert seen == [128]


def test_chunk_buffers_are_views_of_one_allocation_that_outlives_a_larger_one(monkeypatch):
    """Split decode's chunk-row buffers: every row count a split makes is a view of one
    allocation sized for one wave of CTAs; a larger count allocates anew and keeps the old
    buffers (a captured graph may still read them)."""
    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    groups = group_layers([spec])
    reg = _registry(True)
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints())
    rt = AttentionRuntime(plan, reg, state=PersistentState(groups, num_pages=4, num_slots=0))
    ctx = rt.groups["full"].context
    ctx._num_sms = 132  # room for 66 rows of 2 KV heads
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    small, other = ctx._buffers(16, q), ctx._buffers(8, q)
    assert small.partial.shape == (16, 4, 64) and small.lse.shape == (4, 16)
    assert small.lse.is_contiguous() and small.q_rows.shape == (16, 4, 64)
    assert other.partial.data_ptr() == small.partial.data_ptr()  # one allocation
    assert ctx._buffers(16, q) is small  # views kept per row count
    big = ctx._buffers(80, q)
    assert big.partial.data_ptr() != small.partial.data_ptr()
    assert [b.partial.data_ptr() for b in ctx._retired_buffers] == [small.partial.data_ptr()]


# ------------------------------------------------------------------------------------------
# The private entry point: version gate and self-check
# ------------------------------------------------------------------------------------------
def _fake_fa4(monkeypatch, version: str, private_scale: float = 1.0, lse_scale: float = 1.0,
              private_drops_sinks: bool = False):  # fmt: skip
    """A stand-in ``flash_attn.cute.interface``: the public function computes with the
    reference op (learnable sinks included; one-query chunk rows with their log-sum-exp where
    ``return_lse``); the private one does the same times ``private_scale`` (1.0: agrees), its
    chunk rows' log-sum-exp times ``lse_scale``, and ignores ``learnable_sink`` where
    ``private_drops_sinks`` (a release that changed what the argument means). The private one
    returns ``(out, lse)`` as 4.0.0b14's does, or from 4.0.0b40 on ``(out, lse, p, row_max,
    o_lo)`` with the last three None, as 4.0.0b40's does."""
    import sys
    import types

    calls: list[str] = []

    def public(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, page_table,
               softmax_scale, causal, window_size=(None, None), learnable_sink=None,
               softcap=0.0, score_mod=None, return_lse=False, **_):  # fmt: skip
        calls.append("public")
        if return_lse:  # the split-KV chunk rows: one query each
            assert max_seqlen_q == 1 and q.shape[0] == cu_seqlens_q.numel() - 1
            return attend_chunk_rows(q, k, v, page_table, seqused_k, softmax_scale,
                                     softcap=softcap or None)  # fmt: skip
        n = cu_seqlens_q.numel() - 1
        window = window_size[0] if window_size[0] is not None and window_size[0] >= 0 else None
        o = ops.paged_attention(q.float(), k.float(), v.float(), page_table[:n], cu_seqlens_q,
                                seqused_k, scale=softmax_scale, causal=True,
                                sliding_window=None if window is None else window + 1,
                                logits_soft_cap=softcap or None,
                                sinks=None if learnable_sink is None else learnable_sink.float(),
                                ).to(q.dtype)  # fmt: skip
        return o, None

    def private(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None,
                causal=False, softcap=None, window_size_left=None, window_size_right=None,
                learnable_sink=None, score_mod=None, out=None, return_lse=False,
                lse=None):  # fmt: skip
        calls.append("private")
        sink = None if private_drops_sinks else learnable_sink
        o, lse_rows = public(q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                             seqused_k=seqused_k, max_seqlen_k=max_seqlen_k,
                             page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                             window_size=(window_size_left, window_size_right),
                             learnable_sink=sink, softcap=softcap,
                             return_lse=return_lse)  # fmt: skip
        calls.pop()
        out = torch.empty_like(o) if out is None else out
        out.copy_(o * private_scale)
        if return_lse:
            lse = torch.empty_like(lse_rows) if lse is None else lse
            lse.copy_(lse_rows * lse_scale)
        return (out, lse) if version == "4.0.0b14" else (out, lse, None, None, None)

    iface = types.ModuleType("flash_attn.cute.interface")
    iface._flash_attn_fwd = private
    iface.flash_attn_varlen_func = public
    iface.utils = types.SimpleNamespace()  # no score_mod builder: soft-cap passes as a float
    for name, mod in (
        ("flash_attn", types.ModuleType("flash_attn")),
        ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
        ("flash_attn.cute.interface", iface),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(providers, "_dist_version", lambda name: version)
    return calls


def _small_paged_call(provider):
    torch.manual_seed(0)
    k_cache = torch.randn(4, 16, 2, 64).bfloat16()
    v_cache = torch.randn(4, 16, 2, 64).bfloat16()
    q = torch.randn(3, 4, 64).bfloat16()
    out = torch.zeros_like(q)
    got = provider.run(
        q, k_cache, v_cache, out, cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32),
        max_seqlen_q=2, seqused_k=torch.tensor([20, 9], dtype=torch.int32), max_seqlen_k=20,
        page_table=torch.tensor([[1, 3], [2, 0]], dtype=torch.int32), scale=0.125,
        window_left=None, softcap=None, sinks=None,
    )  # fmt: skip
    return got, out


@pytest.mark.parametrize("version", ["4.0.0b14", "4.0.0b40"])
def test_private_entry_point_only_for_the_tested_release(monkeypatch, version):
    calls = _fake_fa4(monkeypatch, version)
    provider = providers._fa4_provider()
    assert provider.uses_private and f"on (flash-attn-4 {version}" in provider.note
    got, out = _small_paged_call(provider)
    assert calls == ["private"] and got is out and out.abs().sum() > 0
    # b40's five results and b14's two both pass the self-check (chunk rows included)
    assert providers.self_check(provider, torch.device("cpu")) is None

    calls = _fake_fa4(monkeypatch, "4.0.0b36")
    provider = providers._fa4_provider()
    assert not provider.uses_private
    assert (
        "off (flash-attn-4 4.0.0b36 not in the tested releases 4.0.0b14, 4.0.0b40)" in provider.note
    )
    got, out = _small_paged_call(provider)
    assert calls == ["public"] and got is out and out.abs().sum() > 0  # copied into out


def test_a_private_path_that_disagrees_is_dropped_and_the_note_says_why(monkeypatch):
    _fake_fa4(monkeypatch, "4.0.0b14", private_scale=1.5)
    provider = providers._fa4_provider()
    problem = providers.self_check(provider, torch.device("cpu"))
    assert problem is not None and "differs from flash_attn_varlen_func" in problem
    fallback = providers.public_only(provider, problem)
    assert not fallback.uses_private and problem in fallback.note
    _fake_fa4(monkeypatch, "4.0.0b14", private_scale=1.0)
    assert providers.self_check(providers._fa4_provider(), torch.device("cpu")) is None


def test_a_failed_self_check_at_the_first_context_warns_once_naming_why(monkeypatch):
    """The first context's self-check that fails moves the process to the public function:
    that is said (a RuntimeWarning naming the reason), not only in a later attn list."""
    _fake_fa4(monkeypatch, "4.0.0b40", private_scale=1.5)
    provider = providers._fa4_provider()
    monkeypatch.setattr(plugin, "_PROBE", (provider, None))
    monkeypatch.setattr(plugin, "_CHECK", None)
    monkeypatch.setattr(plugin, "_CHECK_SINKS", None)
    with pytest.warns(RuntimeWarning, match="_flash_attn_fwd.*differs from flash_attn_varlen_func"):
        served = plugin._run_self_check(provider, torch.device("cpu"))
    assert not served.uses_private


def test_a_private_path_that_drops_sinks_fails_the_sinks_check_only(monkeypatch):
    """A release whose private function no longer applies ``learnable_sink`` as the public one
    does passes the plain self-check (no sinks in it) but not the sinks check."""
    _fake_fa4(monkeypatch, "4.0.0b40", private_drops_sinks=True)
    provider = providers._fa4_provider()
    assert providers.self_check(provider, torch.device("cpu")) is None
    problem = providers.self_check_sinks(provider, torch.device("cpu"))
    assert problem is not None and "with learnable sinks" in problem, problem
    assert "differs from flash_attn_varlen_func" in problem
    _fake_fa4(monkeypatch, "4.0.0b40")
    assert providers.self_check_sinks(providers._fa4_provider(), torch.device("cpu")) is None


def test_the_first_context_with_sinks_checks_them_once_and_falls_back_with_a_warning(
    monkeypatch,
):
    """The sinks check runs when a context of a group with sinks needs the checked provider
    (not for groups without sinks, not twice); where it fails the process serves through the
    public function, and a RuntimeWarning and ``attn list`` say why."""
    _fake_fa4(monkeypatch, "4.0.0b40", private_drops_sinks=True)
    provider = providers._fa4_provider()
    monkeypatch.setattr(plugin, "_PROBE", (provider, None))
    monkeypatch.setattr(plugin, "_CHECK", None)
    monkeypatch.setattr(plugin, "_CHECK_SINKS", None)
    ran: list[str] = []
    real = providers.self_check_sinks
    monkeypatch.setattr(providers, "self_check_sinks", lambda *a: ran.append("sinks") or real(*a))
    cpu = torch.device("cpu")
    served = plugin._checked(provider, cpu, sinks=False)
    assert "self-check passed" in served.note
    assert ran == []
    with pytest.warns(RuntimeWarning, match="learnable sinks.*differs from flash_attn_varlen"):
        served = plugin._checked(served, cpu, sinks=True)
    assert ran == ["sinks"] and not served.uses_private
    assert "public flash_attn_varlen_func used" in served.note
    assert "with learnable sinks" in plugin.make_backend().notes
    again = plugin._checked(plugin.probe()[0], cpu, sinks=True)  # the verdict holds
    assert ran == ["sinks"] and again.note == served.note


@pytest.mark.parametrize("private_scale", [1.0, 1.5], ids=["agrees", "disagrees"])
def test_attn_list_self_check_checks_the_private_entry_point_before_any_context(
    monkeypatch, private_scale
):
    """``attn list --self-check`` (hook ``attn_core_self_check``) compares the private entry
    point with the public function at once: the backend's note then says "self-check passed",
    or names the disagreement as failed and the public path serves from then on."""
    _fake_fa4(monkeypatch, "4.0.0b14", private_scale=private_scale)
    provider = providers._fa4_provider()
    monkeypatch.setattr(plugin, "_PROBE", (provider, None))
    monkeypatch.setattr(plugin, "_CHECK", None)
    monkeypatch.setattr(plugin, "_CHECK_SINKS", None)
    assert "self-check at first GPU use" in plugin.make_backend().notes
    check = plugin.attn_core_self_check(plugin.make_backend(), torch.device("cpu"))
    assert check is not None
    served, _ = plugin.probe()
    assert served is not None and check.notes == served.note == plugin.make_backend().notes
    if private_scale == 1.0:
        assert check.failed == () and "self-check passed" in check.notes, check
    else:
        (line,) = check.failed
        assert "differs from flash_attn_varlen_func" in line, line
        assert not served.uses_private and "public flash_attn_varlen_func used" in check.notes
    # the verdict holds for the process: asked again, nothing runs again
    again = plugin.attn_core_self_check(plugin.make_backend(), torch.device("cpu"))
    assert again == check


def test_attn_list_self_check_has_nothing_to_check_without_a_private_path(monkeypatch):
    _fake_fa4(monkeypatch, "4.0.0b36")  # not a tested release: public path only
    monkeypatch.setattr(plugin, "_PROBE", (providers._fa4_provider(), None))
    monkeypatch.setattr(plugin, "_CHECK", None)
    monkeypatch.setattr(plugin, "_CHECK_SINKS", None)
    assert plugin.attn_core_self_check(plugin.make_backend(), torch.device("cpu")) is None


def test_the_private_chunk_row_call_writes_into_the_buffers_and_is_self_checked(monkeypatch):
    """Split decode's chunk call goes through the private entry point into the caller's
    buffers on the tested release; a private log-sum-exp that disagrees with the public one
    fails the self-check (which then drops the private path)."""
    calls = _fake_fa4(monkeypatch, "4.0.0b14")
    provider = providers._fa4_provider()
    g = torch.Generator().manual_seed(0)
    case = providers._chunk_rows_case(torch.device("cpu"), g, *_caches_64())
    out = torch.zeros_like(case["q"])
    lse = torch.zeros(case["q"].shape[1], 4)
    got, got_lse = provider.run_with_lse(**case, out=out, lse=lse)
    assert calls == ["private"] and got is out and got_lse is lse
    want, want_lse = attend_chunk_rows(
        case["q"], case["k_cache"], case["v_cache"], case["page_table"], case["seqused_k"], 0.1
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)
    assert providers.self_check(provider, torch.device("cpu")) is None
    _fake_fa4(monkeypatch, "4.0.0b14", lse_scale=1.01)
    problem = providers.self_check(providers._fa4_provider(), torch.device("cpu"))
    assert problem is not None and "chunk-row call (with log-sum-exp) differs" in problem


def _caches_64() -> tuple[torch.Tensor, torch.Tensor]:
    """The self-check's cache shape: 8 pages of 16, 2 KV heads, head dim 64 (bf16)."""
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(8, 16, 2, 64, generator=g).bfloat16() for _ in range(2))


@pytest.mark.parametrize("kernel", ["reads_strides", "as_if_contiguous", "keeps_stride_0"])
def test_broadcast_query_rows_only_where_the_kernel_reads_them_right(monkeypatch, kernel):
    """A split decode of one request passes its query broadcast over the chunk rows (stride 0)
    only where :func:`providers.check_broadcast_q` saw the kernel read such rows as it reads a
    copy, and read distinct rows as before afterwards; a kernel that reads q's storage as if
    contiguous fails the check, and so does one that keeps reading row 0 once it saw stride 0
    (as a compile fixing q's strides would)."""
    from dataclasses import replace

    _fake_fa4(monkeypatch, "4.0.0b14")
    provider = providers._fa4_provider()
    real = provider._run_with_lse
    seen_zero = []

    def as_if_contiguous(q, *args, **kwargs):
        dense = torch.as_strided(q, q.shape, (q.shape[1] * q.shape[2], q.shape[2], 1))
        return real(dense, *args, **kwargs)

    def keeps_stride_0(q, *args, **kwargs):
        if q.stride(0) == 0:
            seen_zero.append(True)
        return real(q[:1].expand(q.shape) if seen_zero else q, *args, **kwargs)

    if kernel != "reads_strides":
        fake = as_if_contiguous if kernel == "as_if_contiguous" else keeps_stride_0
        provider = replace(provider, _run_with_lse=fake)
    problem = providers.check_broadcast_q(provider, torch.device("cpu"))
    if kernel == "reads_strides":
        assert problem is None
    elif kernel == "as_if_contiguous":
        assert problem is not None and "stride 0: the chunk-row call differs" in problem
    else:
        assert problem is not None and "after query rows of stride 0" in problem


# ------------------------------------------------------------------------------------------
# Chunked (local) attention through local virtual batches
# ------------------------------------------------------------------------------------------
def test_chunked_layers_are_admitted_when_the_chunk_is_whole_pages():
    choice = _plan([FULL.with_(attention_chunk_size=8192)]).choice("full")
    assert choice.backend.qualified_name == "fa3:fa3"
    assert _codes(choice) == set()


@pytest.mark.parametrize(("chunk", "page", "fix"), [(40, 16, None), (48, 32, "page_size 32 -> 16")])
def test_chunked_layers_whose_chunk_is_not_whole_pages_are_rejected(chunk, page, fix):
    plan = _plan([FULL.with_(attention_chunk_size=chunk, page_size=page)])
    choice = plan.choice("full")
    assert plan.page_size == page  # the reference serves the model's own page size natively
    assert choice.backend.qualified_name == "attn_core:reference"
    [rej] = choice.rejections_by_backend()["fa3:fa3"]
    assert rej.code == "page_size" and rej.fix == fix
    assert f"chunks of {chunk} tokens, page size {page}" in rej.reason
    assert "multiple of the page size" in rej.reason


def test_chunked_verify_is_not_captured_but_decode_is():
    """Under graph mode decode a chunked group's verify steps (their count of virtual requests
    varies) go to the reference; its decode steps (one virtual request each) stay on fa3."""
    spec = FULL.with_(attention_chunk_size=64)
    choice = _plan([spec], graph_mode="decode", speculative_tokens=3).choice("full")
    assert choice.backend_for_phase(Phase.DECODE).qualified_name == "fa3:fa3"
    verify = choice.phase_choice("verify")
    assert verify.backend.qualified_name == "attn_core:reference"
    assert "graph_mode" in {r.code for r in verify.rejections_by_backend()["fa3:fa3"]}
    eager = _plan([spec], speculative_tokens=3).choice("full")
    assert eager.phase_choice("verify").backend.qualified_name == "fa3:fa3"


@_CPU_ONLY
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_mode_decode"])
def test_chunked_layer_through_virtual_batches_equals_the_reference(monkeypatch, graphs):
    """A chunked layer (chunks of 32 tokens, pages of 16) on fa3 with the stand-in provider:
    fresh prefill (the dense path over the virtual requests), decodes at and across chunk
    boundaries, a chunked prefill over a cached prefix crossing boundaries, a mixed step: each
    equals the reference's chunk mask. Graph mode: decode steps go through update() into the
    same buffers."""
    from attn_plugin_fa3 import split_kv

    rec = _SplitRecorder()
    monkeypatch.setattr(plugin, "_PROBE", (rec.as_provider(), None))
    monkeypatch.setattr(split_kv, "sm_count", lambda device: 132)
    spec = LayerSpec(
        kind="full", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        attention_chunk_size=32,
    )  # fmt: skip
    groups = group_layers([spec])
    reg = _registry(True)
    cons = dict(graph_mode="decode") if graphs else {}
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(**cons))
    assert plan.choice("full").backend.qualified_name == "fa3:fa3"
    ref_plan = select(
        groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(force="full=reference")
    )
    state = PersistentState(groups, num_pages=64, num_slots=0)
    rt = AttentionRuntime(plan, reg, state=state)
    rt_ref = AttentionRuntime(ref_plan, reg, state=state)
    assert set(rt.local_batchers) == {"full"}
    builder = BatchBuilder(state, max_batch_size=4, max_num_tokens=256, max_pages_per_request=16)
    torch.manual_seed(11)
    for r in ("a", "b", "c"):
        state.add_request(r)
    steps = [
        [("a", 70), ("b", 31)],  # fresh prefill: a spans 3 chunks, b one
        [("a", 1), ("b", 1)],  # b's decode lands on position 31, the last of chunk 0
        [("a", 1), ("b", 1)],  # b crosses into chunk 1
        [("a", 40), ("b", 1), ("c", 5)],  # cached prefix 72 -> 112 crosses chunk 3; mixed
        *[[("a", 1), ("b", 1), ("c", 1)]] * 3,
    ]
    paths, addresses = [], set()
    for step in steps:
        batch = builder.build(step, pad_to=4 if graphs and all(n == 1 for _, n in step) else None)
        t, rows = batch.num_tokens, batch.padded_tokens
        q = torch.randn(rows, 4, 64).to(torch.bfloat16)
        k = torch.randn(rows, 2, 64).to(torch.bfloat16)
        v = torch.randn(rows, 2, 64).to(torch.bfloat16)
        rt_ref.prepare(batch)
        want = rt_ref.binding(0).forward(q, k, v)
        if graphs and batch.mode.value == "decode":
            rt.prepare(batch) if not addresses else rt.update(batch)
            ctx = rt.groups["full"].context
            addresses.add(ctx.batch.page_table.data_ptr())
        else:
            rt.prepare(batch)
        before = len(rec.calls)
        got = rt.binding(0).forward(q, k, v)
        paths.append([c["path"] for c in rec.calls[before:] if "path" in c])
        torch.testing.assert_close(got[:t].float(), want[:t].float(), atol=2e-2, rtol=2e-2)
        for r, n in step:
            state.advance(r, n)
    # graph mode keeps fresh prefills on the paged call (the dense one is eager only)
    assert paths[0] == ["paged" if graphs else "dense"] and paths[3] == ["paged"]
    if graphs:
        assert len(addresses) == 1  # the decode virtual batch is refilled in place
        # the context saw virtual requests: a's 70 queries are three of at most 32 keys
        assert rec.calls[1]["max_seqlen_q"] == 32 and rec.calls[1]["max_seqlen_k"] == 32
    else:
        assert rec.calls[0]["max_seqlen"] == 32


@_CPU_ONLY
def test_explain_llama4_offline_h200_serves_the_chunked_group_on_fa3(monkeypatch, capsys):
    """``attn explain llama-4 --target h200``: the chunked group goes to fa3 (through local
    virtual batches), the line under the group says who serves chunked attention and how; at a
    page size that does not divide the chunk fa3 is rejected with the reason."""
    from attn_core import cli

    monkeypatch.setattr(cli, "_registry", lambda args: _registry(None))
    assert cli.main(["explain", "llama-4", "--target", "h200"]) == 0
    out = capsys.readouterr().out
    group = out[out.index("group full:") : out.index("group full.1:")]
    assert "chunk=8192" in group
    assert "prefill / mixed steps: fa3:fa3; decode steps: fa3:fa3" in group
    assert (
        "chunked attention (chunks of 8192 tokens): served by attn_core:reference (native "
        "chunk mask), fa3:fa3 (local virtual batches)" in group
    )
    assert cli.main(["explain", "llama-4", "--target", "h200", "--page-size", "256"]) == 0
    group = capsys.readouterr().out
    group = group[group.index("group full:") : group.index("group full.1:")]
    assert "steps: fa3:fa3" in group  # 8192 is whole pages of 256 too
    monkeypatch.setattr(plugin, "PAGE_SIZES", frozenset({16, 24}))
    assert cli.main(["explain", "llama-4", "--target", "h200", "--page-size", "24"]) == 0
    group = capsys.readouterr().out
    group = group[group.index("group full:") : group.index("group full.1:")]
    assert "prefill / mixed steps: attn_core:reference" in group
    assert "chunks of 8192 tokens, page size 24" in " ".join(group.split())


def test_e2e_llama4_kernel_shapes_put_the_chunked_group_on_fa3_for_an_h200():
    """What tests/e2e's GPU llama-4 run plans on an H200: the kernel-shape config's chunks are
    one page (16 tokens), so fa3 serves the chunked layers too, not the reference."""
    from attn_core.e2e.configs import tiny_config
    from attn_core.models.hf_config import specs_from_hf_config

    cfg = tiny_config("llama-4", "kernel")
    assert cfg["attention_chunk_size"] == 16
    layout = specs_from_hf_config(cfg, dtype="bfloat16", page_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = select(
            layout.groups, _registry(True), DeviceCapabilities.target("h200"),
            ExecutionConstraints(graph_mode="decode"),
        )  # fmt: skip
    chunked = [c for c in plan.choices if c.group.spec.attention_chunk_size is not None]
    assert [c.group.spec.attention_chunk_size for c in chunked] == [16]
    assert {c.backend_for_phase(p).qualified_name for c in chunked for p in Phase} == {"fa3:fa3"}
