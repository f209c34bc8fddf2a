"""The capability matrix tests what is advertised and nothing else; the report's statuses."""

from __future__ import annotations

import pytest

from attn_core.backend import BackendCapabilities
from attn_core.reference.plugin import CAPABILITIES as REFERENCE_CAPS
from attn_core.specs import LayerKind
from attn_core.testing.matrix import build_matrix
from attn_core.testing.report import CapabilityReport
from attn_core.testing.session import KitError, load_plugin_object

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
    assert not any(s.has_sinks or s.sliding_window or s.logits_soft_cap for s in specs)
    assert {c.spec_tokens for c in cases} == {0, 1, 2}
    graph = [c for c in cases if c.check == "graph"]
    assert len(graph) == 1 and "CUDA is not available" in graph[0].skip


def test_reference_matrix_covers_every_kind_and_option() -> None:
    full = build_matrix(REFERENCE_CAPS, quick=False)
    quick = build_matrix(REFERENCE_CAPS, quick=True)
    labels = {label for c in full for label in c.capabilities}
    for label in (
        "full: sinks",
        "full: soft-cap",
        "full: sliding window",
        "encoder: causal",
        "mla: kv_dtype fp8_e4m3",
        "linear/kda: state_dtype bfloat16",
        "full: speculative verify k=4",
        "full: head_dim 80",
        "full: page_size 1",
    ):
        assert label in labels, label
    assert len(quick) < len(full)
    assert len({(c.check, c.id) for c in full}) == len(full)  # ids are unique per check


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


def test_plugin_spec_parsing() -> None:
    name, obj = load_plugin_object("attn_core.reference.plugin")
    assert name == "plugin" and hasattr(obj, "attn_core_register_backends")
    name, obj = load_plugin_object("ref=attn_core.reference.plugin:CAPABILITIES")
    assert name == "ref" and obj is REFERENCE_CAPS
    with pytest.raises(KitError, match="cannot import 'no_such_module'"):
        load_plugin_object("no_such_module:x")
    with pytest.raises(KitError, match="has no attribute 'nothing'"):
        load_plugin_object("attn_core.reference.plugin:nothing")
