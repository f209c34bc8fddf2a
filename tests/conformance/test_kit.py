"""The conformance kit end to end: the reference and the SDPA example pass, broken backends fail.

Each run is a pytest subprocess (pytester) with ``--attn-backend``; broken backends are small
inline plugins that wrap the reference's contexts with one defect each, registered through
``--attn-plugin``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attn_core.testing.report import statuses

# A plugin that serves full attention like the reference, with one defect switched on by name.
BROKEN = textwrap.dedent(
    '''
    import types
    import torch
    import attn_core.reference.plugin as ref
    from attn_core.backend import Backend, BackendCapabilities
    from attn_core.hookspecs import hookimpl

    class Broken:
        ATTN_CORE_API_VERSION = "1.1"

        def __init__(self, defect, name=None, **caps):
            self.defect, self.name = defect, name or defect
            self.caps = BackendCapabilities(**{
                "kinds": {"full"}, "device_types": {"cpu"}, "dtypes": {"float32"},
                "head_dims": {64}, "page_sizes": {16}, **caps})

        @hookimpl
        def attn_core_register_backends(self, register):
            register(Backend(name=self.name, capabilities=self.caps))

        @hookimpl
        def attn_core_allocate_context(self, backend, group, device, constraints, state,
                                       workspace):
            if self.defect in ("virtual_chunks", "ignores_chunks"):  # plain causal attention
                import dataclasses
                group = dataclasses.replace(group, spec=group.spec.with_(attention_chunk_size=None))
            if self.defect == "mla_always_causal":  # advertises non-causal, serves causal
                import dataclasses
                group = dataclasses.replace(group, spec=group.spec.with_(causal=True))
            inner = ref.attn_core_allocate_context(backend, group, device, constraints, state,
                                                   workspace)
            return Context(inner, self.defect)

    def _frozen(batch):
        """What a planning backend keeps: private copies of the metadata at prepare time."""
        import copy
        snap = copy.copy(batch)
        for name in ("query_start_loc", "seq_lens", "context_lens", "page_table",
                     "slot_mapping", "positions"):
            t = getattr(batch, name)
            setattr(snap, name, None if t is None else t.clone())
        return snap

    class Context:
        def __init__(self, inner, defect):
            self.inner, self.defect = inner, defect

        def prepare(self, batch):
            self.inner.prepare(_frozen(batch) if self.defect == "stale_update" else batch)

        def update(self, batch):
            if self.defect != "stale_update":  # the defect: update() does not refresh
                self.inner.update(batch)

        def forward(self, layer, q, k, v, out, **inputs):
            if self.defect == "decode_kernel" and self.inner.batch.mode.value != "decode":
                raise NotImplementedError("a decode kernel: one new token per request only")
            view = layer
            if self.defect == "wrong_scale":
                view = types.SimpleNamespace(scale=layer.scale * 1.25, kv=layer.kv,
                                             sinks=layer.sinks)
            if self.defect == "spec_scale":  # the spec's scale, not the layer's own
                view = types.SimpleNamespace(scale=layer.spec.scale, kv=layer.kv,
                                             sinks=layer.sinks)
            cache = getattr(layer.kv, "k", None)  # MLA's latent cache has no k
            if cache is not None and cache.dtype == torch.float8_e4m3fn:
                if self.defect == "fp8_swaps_scales":  # k_scale and v_scale read swapped
                    kv = types.SimpleNamespace(k=layer.kv.k, v=layer.kv.v,
                                               k_scale=layer.kv.v_scale, v_scale=layer.kv.k_scale)
                    view = types.SimpleNamespace(scale=layer.scale, kv=kv, sinks=layer.sinks)
                if self.defect == "fp8_raises":
                    raise NotImplementedError("fp8 KV is not implemented")
                if self.defect == "fp8_ignores_scale":
                    one = torch.ones((), device=q.device)
                    kv = types.SimpleNamespace(k=layer.kv.k, v=layer.kv.v, k_scale=one,
                                               v_scale=one)
                    view = types.SimpleNamespace(scale=layer.scale, kv=kv, sinks=layer.sinks)
            if self.defect == "same_kv_dtype" and cache is not None and cache.dtype != q.dtype:
                # what a naive kernel does with q @ k of two dtypes
                raise RuntimeError(f"expected both operands in {q.dtype}, got {layer.kv.k.dtype}")
            low = {"computes_in_fp16": torch.float16, "computes_in_bf16": torch.bfloat16}
            if self.defect in low:  # what a kernel that runs one 16-bit dtype as the other sees
                q, k, v = (t.to(low[self.defect]).to(t.dtype) for t in (q, k, v))
            result = self.inner.forward(view, q, k, v, out, **inputs)
            if self.defect in low:
                result = result.to(low[self.defect]).to(q.dtype)
                if out is not None:
                    out.copy_(result)
                    result = out
            if self.defect == "noncausal_new_only" and not layer.spec.causal:
                # a non-causal layer served by varlen attention over the step's own K/V: right
                # for a first prefill, blind to the cached context of every later step
                b = self.inner.batch
                qsl = b.query_start_loc_cpu
                group = q.shape[1] // k.shape[1]
                for i in range(b.num_reqs):
                    s, e = int(qsl[i]), int(qsl[i + 1])
                    qq, kk, vv = (t[s:e].transpose(0, 1) for t in (q, k, v))
                    kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
                    o = torch.nn.functional.scaled_dot_product_attention(
                        qq, kk, vv, scale=layer.scale)
                    result[s:e] = o.transpose(0, 1).to(result.dtype)
            if self.defect == "real_rows_only" and out is None:
                # what a kernel that allocates its own output for the real tokens returns
                result = result[: self.inner.batch.num_tokens]
            if self.defect == "writes_past_out" and out is not None:
                rows = out.shape[0] + 1  # one row past the end, when the storage has room
                need = (out.storage_offset() + rows * out.stride(0)) * out.element_size()
                if out.untyped_storage().nbytes() >= need:
                    torch.as_strided(out, (rows, *out.shape[1:]), out.stride(),
                                     out.storage_offset())[-1].fill_(0.0)
            return result

    wrong_scale = Broken("wrong_scale")
    spec_scale = Broken("spec_scale")
    mla_always_causal = Broken("mla_always_causal", kinds={"mla"}, head_dims=None,
                               non_causal=True)
    noncausal_new_only = Broken("noncausal_new_only", non_causal=True)
    fp8_swaps_scales = Broken("fp8_swaps_scales", kv_dtypes={"float32", "fp8_e4m3"})
    stale_update = Broken("stale_update", graph_modes={"none", "decode"})
    writes_past_out = Broken("writes_past_out")
    fp8_ignores_scale = Broken("fp8_ignores_scale", kv_dtypes={"float32", "fp8_e4m3"})
    fp8_raises = Broken("fp8_raises", kv_dtypes={"float32", "fp8_e4m3"})
    computes_in_fp16 = Broken("computes_in_fp16", dtypes={"bfloat16"})
    computes_in_bf16 = Broken("computes_in_bf16", dtypes={"float16"})
    # mixed_kv_dtypes left at its default (True) by a kernel that needs KV in q's dtype
    same_kv_dtype = Broken("same_kv_dtype", dtypes={"bfloat16", "float16"})
    # decode-only backends: one that raises on any other step, one with a wrong scale
    decode_kernel = Broken("decode_kernel", phases={"decode"})
    decode_wrong_scale = Broken("wrong_scale", name="decode_wrong_scale", phases={"decode"})
    # graph mode full declared: the reference as it is (its contexts read the builder's
    # persistent buffers: update() refreshes), and one whose update() keeps stale metadata
    full_ok = Broken("none", name="full_ok", graph_modes={"none", "decode", "full"})
    stale_update_full = Broken("stale_update", name="stale_update_full",
                               graph_modes={"none", "decode", "full"})
    # out=None on a padded step: only the real tokens' rows come back
    real_rows_only = Broken("real_rows_only", graph_modes={"none", "decode", "full"})
    # chunked layers as plain causal attention over the runtime's local virtual batches
    virtual_chunks = Broken("virtual_chunks", chunked_virtual_batches=True)
    ignores_chunks = Broken("ignores_chunks", chunked_attention=True)
    '''
)

# A linear backend: the reference's linear context with one defect switched on by name.
BROKEN_LINEAR = textwrap.dedent(
    """
    import dataclasses
    import torch
    import attn_core.reference.plugin as ref
    from attn_core.backend import Backend
    from attn_core.hookspecs import hookimpl

    class BrokenLinear:
        ATTN_CORE_API_VERSION = "1.1"

        def __init__(self, defect, variants):
            self.defect = defect
            self.caps = dataclasses.replace(
                ref.CAPABILITIES, kinds={"linear"}, linear_variants=set(variants),
                device_types={"cpu"}, dtypes={"float32"}, graph_modes={"none"})

        @hookimpl
        def attn_core_register_backends(self, register):
            register(Backend(name=self.defect, capabilities=self.caps))

        @hookimpl
        def attn_core_allocate_context(self, backend, group, device, constraints, state,
                                       workspace):
            inner = ref.attn_core_allocate_context(backend, group, device, constraints, state,
                                                   workspace)
            return LinearContext(inner, self.defect)

    class LinearContext:
        def __init__(self, inner, defect):
            self.inner, self.defect = inner, defect

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward(self, layer, q, k, v, out, **inputs):
            if self.defect == "slope_off":  # a decay 10 % off, as a wrong slope table gives
                inputs["slope"] = inputs["slope"] * 1.1
            if self.defect == "always_l2norm" and not layer.spec.qk_l2norm:
                # a kernel that always normalises q and k (Qwen3-Next's layers ask for it)
                q = torch.nn.functional.normalize(q.float(), dim=-1).to(q.dtype)
                k = torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype)
            if self.defect == "drop_chunk_carry":
                return self._drop_chunk_carry(layer, q, k, v, out, inputs)
            heads, groups = v.shape[1], k.shape[1]
            if self.defect == "groups_modulo" and groups < heads:
                # head h reads B / C group h % G (tiled) instead of h // (H / G)
                q, k = q.repeat(1, heads // groups, 1), k.repeat(1, heads // groups, 1)
            res = self.inner.forward(layer, q, k, v, out, **inputs)
            if self.defect == "state_through_bf16":  # a float32 pool holding bf16 values
                ssm = layer.linear_state.ssm
                ssm.copy_(ssm.to(torch.bfloat16).to(ssm.dtype))
            if self.defect == "drift16":  # a 16-bit state 3 % low after every step
                ssm = layer.linear_state.ssm
                if ssm.dtype == torch.bfloat16:
                    slots = self.inner.batch.state_indices[: self.inner.batch.num_reqs].long()
                    slots = slots[slots >= 0]
                    ssm[slots] = (ssm[slots].float() * 0.97).to(ssm.dtype)
            return res

        def _drop_chunk_carry(self, layer, q, k, v, out, inputs):
            # a chunked kernel (chunks of 64) that drops the state carried into every chunk
            # after a request's first in one step: tokens 64.. restart from zero
            from attn_core.reference import ops

            res = self.inner.forward(layer, q, k, v, out, **inputs)
            b = self.inner.batch
            qsl = [int(x) for x in b.query_start_loc_cpu]
            ssm = layer.linear_state.ssm
            for i in range(b.num_reqs):
                s, e = qsl[i], qsl[i + 1]
                if e - s <= 64:
                    continue
                s2 = s + 64
                pool = torch.zeros((1, *ssm.shape[1:]), dtype=ssm.dtype)
                o = ops.gated_delta_rule(
                    q[s2:e], k[s2:e], v[s2:e], inputs["g"][s2:e], inputs["beta"][s2:e], pool,
                    torch.tensor([0, e - s2], dtype=torch.int32),
                    torch.tensor([0], dtype=torch.int32), torch.tensor([False]),
                    scale=layer.scale, use_qk_l2norm=layer.spec.qk_l2norm)
                res[s2:e] = o.to(res.dtype)
                ssm[int(b.state_indices[i])] = pool[0]
            return res

        def conv1d(self, layer, x, weight, bias, *, activation, out=None):
            if self.defect == "silu_only_with_bias" and bias is None:
                activation = None  # the activation skipped with the bias
            return self.inner.conv1d(layer, x, weight, bias, activation=activation, out=out)

        def prepare(self, batch):
            if self.defect == "ignore_initial":  # every slot read, a fresh request's too
                batch = dataclasses.replace(
                    batch, has_initial_state=torch.ones_like(batch.has_initial_state))
            self.inner.prepare(batch)

        def commit_speculative(self, batch, num_accepted):
            if self.defect == "commit_by_slot":  # per-token states kept by slot, read by row
                n = batch.num_reqs
                slots = batch.state_indices[:n].long()
                for li, st in list(self.inner._verify_states.items()):
                    by_slot = torch.zeros((int(slots.max()) + 1, *st.shape[1:]), dtype=st.dtype)
                    by_slot[slots] = st[:n]
                    self.inner._verify_states[li] = by_slot[:n]
            if self.defect == "commit_one_short":  # keeps one accepted token too few
                num_accepted = (num_accepted - 1).clamp(min=1)
            self.inner.commit_speculative(batch, num_accepted)

    ignore_initial = BrokenLinear("ignore_initial", {"gated_deltanet", "mamba2"})
    groups_modulo = BrokenLinear("groups_modulo", {"mamba2"})
    silu_only_with_bias = BrokenLinear("silu_only_with_bias", {"gated_deltanet"})
    commit_by_slot = BrokenLinear("commit_by_slot", {"gated_deltanet"})
    drop_chunk_carry = BrokenLinear("drop_chunk_carry", {"gated_deltanet"})
    slope_off = BrokenLinear("slope_off", {"lightning"})
    commit_one_short = BrokenLinear("commit_one_short", {"mamba2"})
    state_through_bf16 = BrokenLinear("state_through_bf16", {"gated_deltanet"})
    always_l2norm = BrokenLinear("always_l2norm", {"gated_deltanet", "kda"})
    drift16 = BrokenLinear("drift16", {"mamba2"})
    """
)


def _summary(result: pytest.RunResult) -> dict[str, str]:
    """Capability -> PASS / FAIL / SKIP from the kit's terminal summary."""
    return statuses(result.outlines)


def _run_broken(
    pytester, run_kit, defect: str, *extra: str
) -> tuple[pytest.RunResult, dict[str, str]]:
    pytester.makepyfile(broken=BROKEN)
    result = run_kit(
        f"--attn-plugin=broken=broken:{defect}",
        f"--attn-backend=broken:{defect}",
        "--attn-quick",
        *extra,
    )
    return result, _summary(result)


SPEC_LABELS = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        print("SPEC", item.nodeid, case.spec_label if case else "-")
"""


def test_shards_split_the_battery_exactly_and_keep_a_spec_together(pytester, run_kit) -> None:
    """``--attn-shard K/N`` runs are disjoint and together collect the whole battery; every
    check of one layer spec lands in the same shard (a JIT-compiling backend builds that
    spec's kernels in one run), and the shards are about the same size."""
    pytester.makepyfile(spec_labels=SPEC_LABELS)

    def collected(*extra: str) -> tuple[list[str], dict[str, str]]:
        result = run_kit("--attn-backend=attn_core:reference", "--attn-quick",
                         "--collect-only", "-q", "-p", "spec_labels", *extra)  # fmt: skip
        assert result.ret == 0, result.stdout.str()[-2000:]
        labels = dict(line.split()[1:3] for line in result.stdout.lines if line.startswith("SPEC "))
        lines = [line for line in result.stdout.lines if "::" in line and " " not in line]
        return lines, labels

    whole, labels = collected()
    parts = [collected(f"--attn-shard={k}/3") for k in range(3)]
    assert len(whole) > 30 and all(lines for lines, _ in parts)
    assert sorted(line for lines, _ in parts for line in lines) == sorted(whole)
    shard_of: dict[str, set[int]] = {}
    for k, (lines, _) in enumerate(parts):
        for line in lines:
            node = line.split("::", 1)[1]
            shard_of.setdefault(labels["::" + node], set()).add(k)
    assert len(shard_of) > 3, shard_of
    assert all(len(shards) == 1 for label, shards in shard_of.items() if label != "-"), shard_of
    # balanced: the shards differ by at most one spec's checks (the largest spec first, each to
    # the emptiest shard); dealt out in turn, the first spec's many checks made one shard twice
    # the size of another
    sizes = [len(lines) for lines, _ in parts]
    largest = max(list(labels.values()).count(label) for label in shard_of if label != "-")
    assert max(sizes) - min(sizes) <= largest, (sizes, largest)
    bad = run_kit("--attn-backend=attn_core:reference", "--attn-shard=3/3", "--collect-only")
    assert bad.ret != 0 and "expected K/N with 0 <= K < N" in bad.stderr.str()


def test_reference_passes_quick(run_kit) -> None:
    result = run_kit("--attn-backend=attn_core:reference", "--attn-quick")
    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert outcomes.get("passed", 0) > 50 and "failed" not in outcomes
    summary = _summary(result)
    assert summary and not [c for c, s in summary.items() if s == "FAIL"]
    # every kind the reference advertises is in the report, CUDA graphs skipped with a reason
    for label in (
        "full: kind",
        "mla: kind",
        "encoder: kind",
        "linear/mamba2: kind",
        "linear/mamba1: kind",
        "linear/mamba1: speculative verify k=1",
        "full: kv_dtype fp8_e4m3",
        "full: sinks",
        "linear/kda: speculative verify k=1",
    ):
        assert summary.get(label) == "PASS", label
    if not _cuda():
        result.stdout.fnmatch_lines(["SKIP  full: graph_mode decode*CUDA is not available*"])
    result.stdout.fnmatch_lines(["*attn-core conformance: attn_core:reference on cpu, seed*"])


def test_sdpa_example_passes(run_kit) -> None:
    # a fixed seed: a float32 backend against the reference must not fail CI by the draw
    result = run_kit(
        "--attn-plugin=sdpa=attn_sdpa_backend", "--attn-backend=sdpa:sdpa", "--attn-seed=7"
    )
    assert result.ret == 0, result.stdout.str()[-3000:]
    summary = _summary(result)
    assert summary["full: head_dim 128"] == "PASS"
    assert summary["full: dtype bfloat16"] == "PASS"
    assert not any(s == "FAIL" for s in summary.values())


def test_chunked_layers_through_virtual_batches_pass_and_a_missing_mask_fails(
    pytester, run_kit
) -> None:
    """A backend without a chunk mask that declares ``chunked_virtual_batches`` passes the
    battery's chunked cases (the runtime hands it local virtual batches); the same context
    declaring a native chunk mask it does not apply fails them."""
    label = "full: chunked attention (local virtual batches)"
    result, summary = _run_broken(pytester, run_kit, "virtual_chunks", "-k", "chunk")
    assert summary.get(label) == "PASS", result.stdout.str()[-3000:]
    result, summary = _run_broken(pytester, run_kit, "ignores_chunks", "-k", "chunk")
    assert result.ret == 1 and summary.get("full: chunked attention") == "FAIL", summary


def test_wrong_scale_is_caught(pytester, run_kit) -> None:
    result, summary = _run_broken(pytester, run_kit, "wrong_scale")
    assert result.ret == 1
    assert summary["full: kind"] == "FAIL"
    result.stdout.fnmatch_lines(
        ["*broken:wrong_scale advertised [[]full: kind*failed: attention output differs*"]
    )
    result.stdout.fnmatch_lines(["*item seed*rerun with --attn-seed=*"])
    # the report line carries the whole reason, down to where it happened
    (line,) = [line for line in result.outlines if line.startswith("FAIL  full: kind - ")]
    assert re.search(r"test_correctness\[full-decode-\S+\]: attention output differs", line)
    assert re.search(r"max \|diff\| \S+ \(workload 'decode', step \d.*, layer 0, batch mode ", line)
    assert "advertised" not in line and not line.endswith("...")


def test_a_failure_reason_is_printed_when_the_failure_happens(pytester, run_kit) -> None:
    # A GPU run cut by its time limit never prints the closing summary: each failure's reason
    # must already be on the terminal, ahead of that summary.
    result, _ = _run_broken(pytester, run_kit, "wrong_scale")
    lines = result.outlines
    early = [i for i, line in enumerate(lines) if line.startswith("attn-core FAIL test_")]
    # the closing section's header (the run's own header line reads the same)
    summary = max(i for i, line in enumerate(lines) if "attn-core conformance:" in line)
    assert early and max(early) < summary
    assert any("attention output differs" in lines[i] for i in early)
    assert not any("advertised [" in lines[i] for i in early)


def test_stale_metadata_on_replay_is_caught(pytester, run_kit) -> None:
    result, summary = _run_broken(pytester, run_kit, "stale_update")
    assert result.ret == 1
    # prepare() alone is right: ordinary workloads pass, the replay emulation fails
    assert summary["full: kind"] == "PASS"
    assert summary["full: update() refreshes metadata (emulated replay)"] == "FAIL"
    result.stdout.fnmatch_lines(["*failed:*emulated replay 1*update only*"])


FULL_REPLAY = "full: graph_mode full: update() refreshes a captured mixed step (emulated)"


def test_a_backend_declaring_graph_mode_full_replays_captured_mixed_steps(pytester, run_kit):
    """Declaring full adds the emulated replay of a captured mixed step (update only, every
    split at the captured sizes); it passes where update() refreshes, and the GPU capture is
    listed (skipped here without CUDA)."""
    result, summary = _run_broken(pytester, run_kit, "full_ok")
    assert summary[FULL_REPLAY] == "PASS", result.stdout.str()
    if not _cuda():
        assert summary["full: graph_mode full (CUDA graph capture + replay)"] == "SKIP"


def test_stale_metadata_on_a_mixed_replay_is_caught(pytester, run_kit) -> None:
    result, summary = _run_broken(pytester, run_kit, "stale_update_full")
    assert result.ret == 1
    assert summary[FULL_REPLAY] == "FAIL"
    result.stdout.fnmatch_lines(["*failed:*emulated mixed replay 0*update only*"])


def test_a_padded_step_returning_only_the_real_rows_for_out_none_is_caught(pytester, run_kit):
    """out=None on a padded step (a captured decode step's, a captured mixed step whose
    requests fill every row) must return every padded row: a caller indexes the output by the
    padded layout."""
    result, summary = _run_broken(pytester, run_kit, "real_rows_only")
    assert result.ret == 1
    assert summary["full: update() refreshes metadata (emulated replay)"] == "FAIL"
    assert summary[FULL_REPLAY] == "FAIL"
    result.stdout.fnmatch_lines(["*failed:*out=None*"])


def test_write_past_out_is_caught(pytester, run_kit) -> None:
    result, summary = _run_broken(pytester, run_kit, "writes_past_out")
    assert result.ret == 1
    assert summary["full: out contract (out, strided out, None; guards)"] == "FAIL"
    result.stdout.fnmatch_lines(["*failed: guard region after out: * elements were overwritten*"])


@pytest.mark.parametrize("defect", ["fp8_ignores_scale", "fp8_raises"])
def test_false_fp8_claim_is_caught(pytester, run_kit, defect: str) -> None:
    result, summary = _run_broken(pytester, run_kit, defect)
    assert result.ret == 1
    assert summary["full: kv_dtype fp8_e4m3"] == "FAIL"
    assert summary["full: dtype float32"] == "PASS"  # the honest part of the claim still passes
    expected = (
        "*advertised [[]full: kv_dtype fp8_e4m3], failed: the backend raised*NotImplementedError*"
        if defect == "fp8_raises"
        else "*advertised [[]full: kv_dtype fp8_e4m3], failed:*differs*"
    )
    result.stdout.fnmatch_lines([expected])


def test_bf16_backend_computing_in_fp16_fails_the_dtype_check(pytester, run_kit) -> None:
    """Unit-scale inputs are exact in fp16 too: only values past fp16's range (65504), which bf16
    holds, tell a bf16 backend that computes in fp16 from one that does not.

    The seed is fixed: a random input below fp16's smallest normal (6e-5) can still round
    differently in fp16, and the kit then rightly fails a unit-scale workload too on some seeds.
    """
    result, summary = _run_broken(pytester, run_kit, "computes_in_fp16", "--attn-seed=1")
    assert result.ret == 1
    assert summary["full: kind"] == "PASS"  # the unit-scale workloads cannot tell
    assert summary["full: dtype bfloat16"] == "FAIL"
    (line,) = [line for line in result.outlines if line.startswith("FAIL  full: dtype bfloat16")]
    assert "x131072" in line  # the large-magnitude case, named in the item id
    # k * 2^17 is inf in fp16: the logits are, and the output is NaN (not "never written")
    assert "NaN where the reference is finite" in line and "or computed as NaN" in line


def test_fp16_backend_computing_in_bf16_fails_the_dtype_check(pytester, run_kit) -> None:
    """The converse: bf16 keeps 8 bits of mantissa to fp16's 11, so rounding an fp16 layer's
    inputs and output to bf16 exceeds fp16's tolerance at unit scale (every check of the line
    fails on this seed, a few elements each)."""
    result, summary = _run_broken(pytester, run_kit, "computes_in_bf16", "--attn-seed=1")
    assert result.ret == 1
    assert summary["full: dtype float16"] == "FAIL"
    (line,) = [line for line in result.outlines if line.startswith("FAIL  full: dtype float16")]
    assert "attention output differs from the reference" in line, line


def test_a_kernel_that_needs_kv_in_the_query_dtype_fails_the_default_mixed_claim(
    pytester, run_kit
) -> None:
    """mixed_kv_dtypes defaults to True (the selector then puts an fp16 layer over a bf16 cache
    on the backend): a backend that leaves it so without serving the mix fails that line alone."""
    result, summary = _run_broken(pytester, run_kit, "same_kv_dtype")
    assert result.ret == 1
    assert summary["full: mixed_kv_dtypes"] == "FAIL"
    assert summary["full: dtype bfloat16"] == summary["full: dtype float16"] == "PASS"
    (line,) = [line for line in result.outlines if line.startswith("FAIL  full: mixed_kv_dtypes")]
    assert "expected both operands in torch." in line


def test_registry_hook_supplies_the_registry(pytester, run_kit) -> None:
    pytester.makepyfile(broken=BROKEN)
    pytester.makeconftest(
        """
        import broken
        from attn_core.registry import Registry

        def pytest_attn_core_registry(config):
            registry = Registry(allow=["attn_core", "mine"])
            registry.register_plugin(broken.wrong_scale, name="mine")
            return registry
        """
    )
    result = run_kit("--attn-backend=mine:wrong_scale", "--attn-quick", "-k", "lifecycle")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*mine:wrong_scale advertised*failed*"])


def test_unknown_backend_is_a_usage_error(run_kit) -> None:
    result = run_kit("--attn-backend=nobody:nothing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attn-backend=nobody:nothing*registered:*attn_core:reference*"])


def test_inert_without_a_backend(pytester, run_kit) -> None:
    pytester.makepyfile(test_mine="def test_one():\n    assert 1 + 1 == 2\n")
    result = run_kit()
    result.assert_outcomes(passed=1)
    assert "attn-core conformance" not in result.stdout.str()


def test_plugin_import_is_light() -> None:
    code = (
        "import sys, attn_core.testing.plugin\n"
        "heavy = [m for m in ('attn_core.testing.battery', 'attn_core.testing.harness', "
        "'attn_core.registry', 'attn_core.reference.plugin', 'attn_core.state') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_guide_shows_the_shipped_example() -> None:
    repo = Path(__file__).resolve().parents[2]
    REPO, SDPA_EXAMPLE = repo, repo / "docs" / "examples" / "sdpa_backend"

    guide = (REPO / "docs" / "plugin-guide.md").read_text()
    module = (SDPA_EXAMPLE / "attn_sdpa_backend.py").read_text()
    pyproject = (SDPA_EXAMPLE / "pyproject.toml").read_text()
    assert module in guide and pyproject in guide
    assert len(module.splitlines()) <= 60 and len(pyproject.splitlines()) <= 6
    for option in ("--attn-backend", "--attn-plugin", "--attn-quick", "--attn-seed"):
        assert option in guide


def test_a_decode_only_backend_is_tested_on_decode_steps_only(pytester, run_kit) -> None:
    """phases={'decode'}: the kit fills the other phases with the reference, as a plan would
    (the backend raises on any other step, and passes); the same backend with a wrong scale
    fails, so its decode steps did run on it."""
    result, summary = _run_broken(pytester, run_kit, "decode_kernel")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert summary["full: kind"] == "PASS"
    assert not any(label.startswith("full: speculative verify") for label in summary)
    result, summary = _run_broken(pytester, run_kit, "decode_wrong_scale")
    assert result.ret == 1
    assert summary["full: kind"] == "FAIL"
    (line,) = [line for line in result.outlines if line.startswith("FAIL  full: kind - ")]
    assert "batch mode decode" in line, line


@pytest.mark.parametrize(
    ("defect", "failing", "passing"),
    [
        ("slope_off", "linear/lightning: kind", None),
        # the core zeroes a fresh request's slot; an engine that recycles slots may not: a
        # backend must start such a request from zero, not read the slot
        ("ignore_initial", "linear/mamba2: kind", None),
        # Mamba2 had one B/C group: every head-to-group mapping read the same one
        ("groups_modulo", "linear/mamba2: kind", None),
        # every conv had a bias (Qwen3-Next's has none)
        ("silu_only_with_bias", "linear/gated_deltanet: kind", None),
        # verify rows were the requests' slots in order: a commit by slot read the right row
        ("commit_by_slot", "linear/gated_deltanet: speculative verify k=1", None),
        # no quick step was longer than 64 tokens, a chunked kernel's chunk
        (
            "drop_chunk_carry",
            "linear/gated_deltanet: state hand-off (chunked prefill)",
            "linear/gated_deltanet: kind",
        ),
        (
            "commit_one_short",
            "linear/mamba2: speculative verify k=4",
            "linear/mamba2: state hand-off (chunked prefill)",
        ),
        # each step's 16-bit state within the state tolerance of the reference continuing
        # from the backend's: a drift of a few ulps a step must still add up
        ("drift16", "linear/mamba2: state_dtype bfloat16", "linear/mamba2: kind"),
        # every Gated DeltaNet and KDA layer the kit built asked for the q/k l2norm
        ("always_l2norm", "linear/gated_deltanet: without the q/k l2norm", "linear/kda: kind"),
        ("always_l2norm", "linear/kda: without the q/k l2norm", "linear/gated_deltanet: kind"),
        # a float32 state rounded through bf16 every step is within the state tolerance of
        # steps that prefill in chunks (5e-3 + 5e-3 |s|, wider than bf16's 2^-9)
        (
            "state_through_bf16",
            "linear/gated_deltanet: float32 state precision",
            "linear/gated_deltanet: kind",
        ),
    ],
)
def test_a_broken_linear_backend_is_caught(pytester, run_kit, defect, failing, passing) -> None:
    """The linear checks can fail: a lightning decay off by 10 %, and a commit that keeps one
    accepted token too few (every other step of that backend right)."""
    pytester.makepyfile(broken_linear=BROKEN_LINEAR)
    result = run_kit(
        f"--attn-plugin=broken_linear=broken_linear:{defect}",
        f"--attn-backend=broken_linear:{defect}",
        "--attn-quick",
    )
    summary = _summary(result)
    assert result.ret == 1, result.stdout.str()[-3000:]
    assert summary.get(failing) == "FAIL", summary
    if passing:
        assert summary.get(passing) == "PASS", summary


def test_a_backend_that_ignores_a_layers_own_scale_is_caught(pytester, run_kit) -> None:
    """Every layer's scale was the spec's 1/sqrt(d): a backend reading the spec's scale (or a
    hard-coded one) instead of the layer's own passed every check."""
    result, summary = _run_broken(pytester, run_kit, "spec_scale")
    assert result.ret == 1, result.stdout.str()[-3000:]
    assert summary.get("full: per-layer softmax scale") == "FAIL", summary
    assert summary.get("full: kind") == "PASS", summary


def test_a_non_causal_backend_blind_to_the_cached_context_is_caught(pytester, run_kit) -> None:
    """The non-causal case ran one prefill from an empty cache, where the step's own keys are
    all the keys: a backend that never reads the cached context passed."""
    result, summary = _run_broken(pytester, run_kit, "noncausal_new_only")
    assert result.ret == 1, result.stdout.str()[-3000:]
    assert summary.get("full: non-causal") == "FAIL", summary


def test_the_fp8_scales_of_k_and_v_are_far_apart_in_either_order() -> None:
    """k_scale and v_scale were drawn independently from [0.03, 0.08]: at some seeds within
    1 % of each other, and a backend that read them swapped passed there. Now one is 2-4x the
    other, either way round, at every seed."""
    import torch

    from attn_core.testing.harness import fp8_kv_scales

    larger_k = 0
    for seed in range(200):
        k, v = fp8_kv_scales(torch.Generator().manual_seed(seed))
        assert 2.0 <= max(k, v) / min(k, v) <= 4.0, (seed, k, v)
        assert min(k, v) >= 0.01 and max(k, v) <= 0.5, (seed, k, v)  # far from 1: 2-100x off
        larger_k += k > v
    assert 60 < larger_k < 140, larger_k


def test_an_mla_backend_that_serves_non_causal_as_causal_is_caught(pytester, run_kit) -> None:
    """MLA's masking modes were never swept: an MLA backend advertising non-causal layers and
    serving them causally passed."""
    result, summary = _run_broken(pytester, run_kit, "mla_always_causal")
    assert result.ret == 1, result.stdout.str()[-3000:]
    assert summary.get("mla: non-causal") == "FAIL", summary
    assert summary.get("mla: kind") == "PASS", summary
