"""The capability matrix tests what is advertised and nothing else; the report's statuses."""

from __future__ import annotations

import pytest
import torch

from attn_core.backend import BackendCapabilities
from attn_core.reference.plugin import CAPABILITIES as REFERENCE_CAPS
from attn_core.specs import LayerKind
from attn_core.testing.matrix import build_matrix, kind_label
from attn_core.testing.report import CapabilityReport, statuses
from attn_core.testing.session import KitError, load_plugin_object
from attn_core.testing.workloads import LARGE_MAGNITUDE, layer_inputs, scale_inputs

NARROW = BackendCapabilities(
    kinds={"full"},
    device_types={"cuda"},
    dtypes={"bfloat16"},
    head_dims={128},
    page_sizes={16, 64},
    graph_modes={"none", "decode"},
    max_speculative_tokens=2,
)


def test_narrow_backend_gets_only_its_claims() -> None:
    cases = build_matrix(NARROW, quick=False)
    specs = [c.spec for c in cases]
    assert {s.kind for s in specs} == {LayerKind.FULL}
    assert {s.dtype for s in specs} == {"bfloat16"}
    assert {s.head_dim for s in specs} == {128}
    assert {s.page_size for s in specs} == {16, 64}
    assert not any(
        s.has_sinks or s.sliding_window or s.attention_chunk_size or s.logits_soft_cap
        for s in specs
    )
    assert {c.spec_tokens for c in cases} == {0, 1, 2}
    graph = [c for c in cases if c.check == "graph"]
    assert len(graph) == 1 and "CUDA is not available" in graph[0].skip


def test_virtual_batch_backend_gets_chunks_of_whole_pages() -> None:
    """A backend serving chunked layers through local virtual batches is tested at chunks of
    one page (a chunk must be whole pages), over workloads whose requests span several."""
    import dataclasses

    caps = dataclasses.replace(NARROW, chunked_virtual_batches=True)
    chunked = [c for c in build_matrix(caps, quick=False) if c.spec.attention_chunk_size]
    assert {c.workload for c in chunked} == {"page_boundary", "ragged"}
    assert all(c.spec.attention_chunk_size == c.spec.page_size for c in chunked)
    assert {c.capabilities for c in chunked} == {
        ("full: chunked attention (local virtual batches)",)
    }


def test_a_mixed_kv_dtype_claim_is_tested_and_only_where_it_is_made() -> None:
    """mixed_kv_dtypes (default True) lets the selector put a layer of one 16-bit dtype over a
    cache of another: the kit runs each such pair a backend would be chosen for, once."""
    import dataclasses

    both = dataclasses.replace(
        NARROW, dtypes={"bfloat16", "float16"}, kv_dtypes={"bfloat16", "float16"}
    )
    mixed = [c for c in build_matrix(both) if c.spec.kv_dtype != c.spec.dtype]
    assert sorted((c.spec.dtype, c.spec.kv_dtype) for c in mixed) == [
        ("bfloat16", "float16"),
        ("float16", "bfloat16"),
    ]
    assert {c.capabilities for c in mixed} == {("full: mixed_kv_dtypes",)}
    assert len(build_matrix(both, quick=True)) < len(build_matrix(both))
    quick = [c for c in build_matrix(both, quick=True) if c.spec.kv_dtype != c.spec.dtype]
    assert len(quick) == 1
    same = dataclasses.replace(both, mixed_kv_dtypes=False)
    assert not [c for c in build_matrix(same) if c.spec.kv_dtype != c.spec.dtype]
    assert not [c for c in build_matrix(NARROW) if c.spec.kv_dtype != c.spec.dtype]  # one dtype


def test_reference_matrix_covers_every_kind_and_option() -> None:
    full = build_matrix(REFERENCE_CAPS, quick=False)
    quick = build_matrix(REFERENCE_CAPS, quick=True)
    labels = {label for c in full for label in c.capabilities}
    for label in (
        "full: sinks",
        "full: sinks + sliding window",
        "full: soft-cap",
        "full: sliding window",
        "full: chunked attention",
        "encoder: chunked attention",
        "encoder: causal",
        "mla: kv_dtype fp8_e4m3",
        "linear/kda: state_dtype bfloat16",
        "full: speculative verify k=4",
        "full: head_dim 80",
        "full: page_size 1",
        "full: mixed_kv_dtypes",
        "mla: mixed_kv_dtypes",
    ):
        assert label in labels, label
    assert len(quick) < len(full)
    assert len({(c.check, c.id) for c in full}) == len(full)  # ids are unique per check


def test_bfloat16_is_also_checked_past_float16s_range() -> None:
    """Every kind that computes in bf16 gets one case whose values exceed fp16's largest (65504)."""
    for quick in (False, True):
        cases = build_matrix(REFERENCE_CAPS, quick=quick)
        large = [c for c in cases if c.magnitude != 1.0]
        assert {kind_label(c.spec) for c in large} == {
            "full",
            "mla",
            "encoder",
            "linear/gated_deltanet",
            "linear/kda",
            "linear/mamba2",
            "linear/lightning",
            "linear/short_conv",
            "linear/mamba1",
        }
        for c in large:
            assert c.check == "correctness" and c.spec.dtype == "bfloat16"
            assert c.magnitude == LARGE_MAGNITUDE > torch.finfo(torch.float16).max
            assert c.capabilities == (f"{kind_label(c.spec)}: dtype bfloat16",)
            assert c.id.endswith("-x131072")
    fp32_only = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
    assert not [c for c in build_matrix(fp32_only) if c.magnitude != 1.0]


@pytest.mark.parametrize("kind", ["full", "mla", "encoder", "gdn", "mamba2", "mamba1"])
def test_large_inputs_keep_the_logits_and_scale_the_values(kind, tiny_specs) -> None:
    spec = tiny_specs[kind].with_(dtype="bfloat16", kv_dtype=None)
    raw = layer_inputs(spec, 6, torch.Generator().manual_seed(0))
    big = scale_inputs(raw, spec, LARGE_MAGNITUDE)
    bf16 = {n: t.to(torch.bfloat16) for n, t in raw.items()}
    bf16_big = {n: t.to(torch.bfloat16) for n, t in big.items()}
    if spec.kind is LayerKind.LINEAR:
        scaled, same = {"v", "conv_x"}, set(raw) - {"v", "conv_x"}
    else:
        scaled, same = {"k", "v"} & set(raw), set()
        # q / M times k * M: the logits are those of the unit-scale inputs, bit for bit in bf16
        assert torch.equal(bf16_big["q"] * LARGE_MAGNITUDE, bf16["q"])
    for name in scaled:  # exactly M times the unit-scale values, and past fp16's range
        assert torch.equal(bf16_big[name], bf16[name] * LARGE_MAGNITUDE)
        assert bf16_big[name].to(torch.float16).isinf().any()
    for name in same:
        assert torch.equal(big[name], raw[name])


def test_report_statuses() -> None:
    report = CapabilityReport(backend="v:b", device="cpu", seed=1)
    report.record(("a", "b"), "passed", "x::test_one[1]", "")
    report.record(("b",), "failed", "x::test_one[2]", "advertised b, failed: boom")
    report.record(("c",), "skipped", "x::test_one[3]", "no GPU")
    lines = report.lines()
    assert lines[0].startswith("PASS  a")
    assert lines[1].startswith("FAIL  b") and "test_one[2]: advertised b, failed: boom" in lines[1]
    assert lines[2] == "SKIP  c - skipped: no GPU"
    assert report.counts == {"PASS": 1, "FAIL": 1, "SKIP": 1}
    # read back from a run's output, other lines among them
    assert statuses(["collected 3 items", *lines]) == {"a": "PASS", "b": "FAIL", "c": "SKIP"}


def test_report_line_keeps_the_whole_first_line_of_the_reason() -> None:
    """A failure's reason ends with where it happened: the line must keep it, however long."""
    reason = (
        "attention output differs from the reference: 6361 of 7424 elements out of tolerance "
        "(atol=0.0002, rtol=0.0002); worst at [9, 1, 16]: got 2.65757, expected 2.25875; max "
        "|diff| 0.399 (workload 'decode', step 0 [new tokens 5,9,3,12], layer 0, batch mode "
        "prefill)"
    )
    message = (
        "v:b advertised [full: kind; full: dtype float32; full: head_dim 64; full: page_size "
        f"16], failed: {reason}\n  case correctness:full-decode, item seed 7, rerun with "
        "--attn-seed=1"
    )
    report = CapabilityReport(backend="v:b", device="cpu", seed=1)
    report.record(("full: kind",), "failed", "battery.py::test_correctness[full-decode]", message)
    report.record(("full: sinks",), "skipped", "battery.py::test_correctness[x]", "a" * 300)
    fail, skip = report.lines()
    # the claims are the report's own labels: only the reason follows the test id
    head = "FAIL  full: kind - 1 of 1 checks failed; test_correctness[full-decode]: "
    assert fail == head + reason
    assert skip == "SKIP  full: sinks - skipped: " + "a" * 300
    # a failure the kit did not phrase (an error in a fixture) keeps its first line as is
    other = CapabilityReport(backend="v:b")
    other.record(("full: kind",), "failed", "b.py::t[1]", "RuntimeError: boom\nTraceback ...")
    assert other.lines() == ["FAIL  full: kind - 1 of 1 checks failed; t[1]: RuntimeError: boom"]


def test_plugin_spec_parsing() -> None:
    name, obj = load_plugin_object("attn_core.reference.plugin")
    assert name == "plugin" and hasattr(obj, "attn_core_register_backends")
    name, obj = load_plugin_object("ref=attn_core.reference.plugin:CAPABILITIES")
    assert name == "ref" and obj is REFERENCE_CAPS
    with pytest.raises(KitError, match="cannot import 'no_such_module'"):
        load_plugin_object("no_such_module:x")
    with pytest.raises(KitError, match="has no attribute 'nothing'"):
        load_plugin_object("attn_core.reference.plugin:nothing")


def test_lightning_and_short_conv_are_certified_on_their_own_terms() -> None:
    """Lightning attention: no conv input, a slope per head; the short conv: the conv input
    only, no state-dtype sweep (it keeps no SSM state)."""
    import torch

    from attn_core.specs import LinearVariant
    from attn_core.testing.workloads import layer_inputs

    full = build_matrix(REFERENCE_CAPS, quick=False)
    labels = {label for c in full for label in c.capabilities}
    for variant in ("lightning", "short_conv"):
        for what in ("kind", "speculative verify k=4", "state hand-off (chunked prefill)"):
            assert f"linear/{variant}: {what}" in labels, (variant, what)
    assert "linear/lightning: state_dtype bfloat16" in labels
    assert not any(label.startswith("linear/short_conv: state_dtype") for label in labels)
    specs = {c.spec.linear_variant: c.spec for c in full if c.spec.linear_variant}
    gen = torch.Generator().manual_seed(0)
    lt = layer_inputs(specs[LinearVariant.LIGHTNING], 5, gen)
    assert set(lt) == {"q", "k", "v", "slope"} and bool((lt["slope"] > 0).all())
    sc = layer_inputs(specs[LinearVariant.SHORT_CONV], 5, gen)
    assert set(sc) == {"conv_x"}


def test_spec_label_groups_the_checks_of_one_layer_spec() -> None:
    cases = build_matrix(REFERENCE_CAPS, quick=True)
    by_label: dict[str, set] = {}
    for c in cases:
        by_label.setdefault(c.spec_label, set()).add(c.spec)
    # one spec per label, one label per spec: a label neither merges specs nor splits one
    assert all(len(specs) == 1 for specs in by_label.values()), by_label
    assert len(by_label) == len({c.spec for c in cases})
    # a spec's checks differ in workload and run options, not in the label
    shared = [label for label in by_label if sum(c.spec_label == label for c in cases) > 1]
    assert shared, "every spec has a single check: the grouping would do nothing"
    for c in cases:
        assert c.id.startswith(c.spec_label.split("-")[0])
        assert c.workload not in c.spec_label.split("-")


def test_the_float32_state_precision_check_needs_a_backend_that_decodes() -> None:
    """The check's one decode step from the same state: a backend that serves no decode steps
    leaves it to the reference, which would pass it against itself."""
    import dataclasses

    linear = dataclasses.replace(
        REFERENCE_CAPS, kinds={"linear"}, linear_variants={"mamba2"}, device_types={"cpu"}
    )
    labels = {label for c in build_matrix(linear, quick=True) for label in c.capabilities}
    assert "linear/mamba2: float32 state precision" in labels
    prefill_only = dataclasses.replace(linear, phases={"prefill"})
    labels = {label for c in build_matrix(prefill_only, quick=True) for label in c.capabilities}
    assert "linear/mamba2: float32 state precision" not in labels
    assert "linear/mamba2: state hand-off (chunked prefill)" in labels
