"""CPU tests of the FlashInfer plugin: advertisement, availability reasons, planning, slot writes,
registry and selector, and the whole runtime flow against the reference backend with a
pure-PyTorch stand-in for FlashInfer (:mod:`fake_flashinfer`)."""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import shutil
import warnings
from pathlib import Path

import attn_plugin_flashinfer.plugin as fi_plugin
import fake_flashinfer
import numpy as np
import pytest
import torch
import workloads as wl
from attn_plugin_flashinfer import capability, compat, planning
from attn_plugin_flashinfer.context import StepKind, decode_uses_tensor_cores

from attn_core.registry import Registry
from attn_core.selector import check_backend, select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerSpec,
    group_layers,
)
from attn_core.state.kv_write import quantize, write_slots

AVAILABLE = capability.Availability(True, None, "0.6.7")
RELEASES = "0.6.7, 0.6.13, 0.7.2.post1, 0.7.4"
FULL = LayerSpec(kind="full", num_heads=8, num_kv_heads=2, head_dim=64, page_size=4)
#: small_decode runs these CPU contexts in Triton's interpreter, which the conftest turns on
#: only where there is no CUDA device (it must be chosen before any kernel is defined, for the
#: whole process); on a GPU machine the contexts here stay on FlashInfer's decode, and
#: test_gpu.py / test_small_decode.py run small_decode on the GPU.
INTERPRETED = pytest.mark.skipif(
    torch.cuda.is_available(), reason="small_decode on CPU tensors needs Triton's interpreter"
)
MLA = LayerSpec(
    kind="mla",
    num_heads=2,
    num_kv_heads=1,
    head_dim=576,
    head_dim_v=512,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    page_size=4,
)


@pytest.fixture
def available(monkeypatch):
    """Pretend CUDA, flashinfer and nvcc are present (registration only)."""
    monkeypatch.setattr(capability, "probe", lambda: AVAILABLE)


@pytest.fixture
def fake_fi(monkeypatch, available):
    return fake_flashinfer.install(monkeypatch)


# ------------------------------------------------------------------------------------------
# Advertisement and availability
# ------------------------------------------------------------------------------------------
def test_advertises_two_backends_honestly():
    full, mla = fi_plugin.backends(AVAILABLE)
    assert (full.name, mla.name) == ("flashinfer", "flashinfer_mla")
    assert full.priority == mla.priority == 100
    c = full.capabilities
    assert c.head_dims == {64, 128, 256}
    assert c.kv_dtypes == {"bfloat16", "float16", "fp8_e4m3"}
    assert c.dtypes == {"bfloat16", "float16"}
    assert c.sliding_window and c.logits_soft_cap
    assert c.sinks  # through run()'s log-sum-exp and the rescale (sinks.py)
    assert not c.non_causal
    # full: mixed steps captured through the paged prefill wrapper's graph mode; MLA: decode
    assert c.graph_modes == {GraphMode.NONE, GraphMode.DECODE, GraphMode.FULL}
    assert mla.capabilities.graph_modes == {GraphMode.NONE, GraphMode.DECODE}
    assert c.min_compute_capability == (8, 0)
    assert c.max_speculative_tokens >= 4
    assert mla.capabilities.head_dims == {576, 512}
    assert mla.capabilities.kv_dtypes == {"bfloat16", "float16"}
    assert fi_plugin.ATTN_CORE_API_VERSION == "1.2"


def test_this_machine_reports_unavailable_with_reason():
    av = capability.probe()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert not av.available
    assert "no CUDA device" in av.reason
    for backend in fi_plugin.backends():
        assert not backend.available and backend.unavailable_reason == av.reason


def _all_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: importlib.machinery.ModuleSpec(name, None),
    )
    monkeypatch.setattr(
        importlib, "import_module", lambda name: type("M", (), {"__version__": "0.6.7"})
    )
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvcc")


def test_probe_available_when_everything_is_there(monkeypatch):
    _all_present(monkeypatch)
    av = capability.probe()
    assert av.available and av.reason is None and av.version == "0.6.7"


def test_probe_reads_the_installed_distributions_version(monkeypatch):
    """The version the graph modes and the fast path follow is one: the installed
    ``flashinfer-python`` distribution's, also where flashinfer is not imported (no CUDA), and
    before the module's ``__version__`` (a source build reports ``0.0.0+unknown`` there)."""
    from attn_plugin_flashinfer import compat

    _all_present(monkeypatch)
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.7.4")
    assert capability.probe().version == "0.7.4"  # its module says 0.6.7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capability.probe().version == "0.7.4"  # not imported
    monkeypatch.setattr(compat, "distribution_version", lambda: None)
    assert capability.probe().version == ""  # neither: unknown (no graph decode for MLA)


@pytest.mark.parametrize("version", ["0.8.0", "1.0.0rc1", "0.6.5"])
def test_a_release_outside_the_supported_range_serves_without_release_specific_capabilities(
    version,
):
    """A release installed past pip's range (``--no-deps`` beside another stack) still serves
    through the public API, but without what the kit verified per release: sinks (the rescale
    reads run()'s log-sum-exp in base 2), graph mode full, MLA graph decode; both notes say so."""
    av = capability.Availability(True, None, version)
    assert capability.outside_supported(version)
    full, mla = fi_plugin.backends(av)
    assert full.available and mla.available
    assert not full.capabilities.sinks
    assert {m.value for m in full.capabilities.graph_modes} == {"none", "decode"}
    assert {m.value for m in mla.capabilities.graph_modes} == {"none"}
    for backend in (full, mla):
        assert f"flashinfer {version} is outside the supported releases (>=0.6.7,<0.8)" in (
            backend.notes
        )
    inside = fi_plugin.backends(capability.Availability(True, None, "0.7.4"))[0]
    assert inside.capabilities.sinks and "outside" not in inside.notes


def test_supported_range_is_the_packages_requirement():
    """One range: what pip enforces (pyproject.toml) is what probe() checks."""
    from pathlib import Path

    import tomllib
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pyproject = Path(fi_plugin.__file__).parents[1] / "pyproject.toml"
    requires = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"flashinfer-python{capability.SUPPORTED_RELEASES}" in requires
    assert Version("0.7.4") in SpecifierSet(capability.SUPPORTED_RELEASES)


def test_probe_names_no_cuda(monkeypatch):
    _all_present(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    av = capability.probe()
    assert not av.available
    assert av.reason == "no CUDA device (torch.cuda.is_available() is False)"


def test_probe_names_import_error_text(monkeypatch):
    _all_present(monkeypatch)

    def fail(name):
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", fail)
    av = capability.probe()
    assert not av.available
    assert av.reason == (
        "flashinfer is not importable: ImportError: libcudart.so.13: cannot open shared object file"
    )


def test_probe_names_missing_module(monkeypatch):
    _all_present(monkeypatch)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    av = capability.probe()
    assert "no module named 'flashinfer'" in av.reason


def test_probe_names_missing_nvcc(monkeypatch):
    _all_present(monkeypatch)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    real_isfile = capability.os.path.isfile
    monkeypatch.setattr(
        capability.os.path, "isfile", lambda p: False if p.endswith("nvcc") else real_isfile(p)
    )
    av = capability.probe()
    assert not av.available and "nvcc" in av.reason


def test_probe_accepts_cuda_home(monkeypatch, tmp_path):
    _all_present(monkeypatch)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert capability.probe().available


# ------------------------------------------------------------------------------------------
# Registry and selector
# ------------------------------------------------------------------------------------------
def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "attn-plugin-flashinfer"
    eps = meta["project"]["entry-points"]["attn_core"]
    assert eps == {"flashinfer": "attn_plugin_flashinfer.plugin"}
    # a range, not a pin: the plugin installs beside a serving stack's FlashInfer in it, and
    # its lower bound is the oldest release the fast path knows
    from attn_plugin_flashinfer import compat
    from packaging.requirements import Requirement
    from packaging.version import Version

    (req,) = [Requirement(d) for d in meta["project"]["dependencies"] if d.startswith("flashinfer")]
    assert req.name == "flashinfer-python" and len(req.specifier) == 2, req
    assert all(v in req.specifier for v in compat.TESTED_RELEASES)
    assert min(compat.TESTED_RELEASES, key=Version) == "0.6.7"
    # the upper bound admits the newest release compat knows and stops below the next minor
    assert max(compat.TESTED_RELEASES, key=Version) == "0.7.4"
    assert "0.8.0" not in req.specifier  # not read


def test_registry_loads_plugin_on_cpu_without_error():
    reg = Registry(strict=True)
    info = reg.register_plugin(fi_plugin, name="flashinfer")
    assert info is not None and not reg.quarantined
    names = sorted(b.qualified_name for b in info.backends)
    assert names == ["flashinfer:flashinfer", "flashinfer:flashinfer_mla"]


def test_selector_picks_flashinfer_on_h200(available):
    reg = wl.registry()
    specs = [FULL.with_(sliding_window=64, logits_soft_cap=30.0), MLA]
    plan = select(group_layers(specs), reg, DeviceCapabilities.target("h200"))
    chosen = [c.backend.qualified_name for c in plan.choices]
    assert chosen == ["flashinfer:flashinfer", "flashinfer:flashinfer_mla"]


def test_selector_rejects_flashinfer_on_cpu_with_reason_codes():
    reg = wl.registry()  # real probe: unavailable on this machine
    plan = select(group_layers([FULL]), reg, DeviceCapabilities.target("cpu"))
    choice = plan.choices[0]
    assert choice.backend.qualified_name == "attn_core:reference"
    rejected = {r.code for r in choice.rejected if r.backend == "flashinfer:flashinfer"}
    assert "device_type" in rejected
    if not torch.cuda.is_available():
        assert "unavailable" in rejected


def test_rejections_for_what_is_not_advertised(available):
    full = fi_plugin.backends(AVAILABLE)[0].with_plugin("flashinfer")
    h200, a100 = DeviceCapabilities.target("h200"), DeviceCapabilities.target("a100")
    c = ExecutionConstraints()

    def codes(spec, device=h200, constraints=c):
        return {r.code for r in check_backend(full, spec, device, constraints)}

    assert codes(FULL) == set()
    assert "sinks" not in codes(FULL.with_(has_sinks=True))
    assert "head_dim" in codes(FULL.with_(head_dim=96))
    assert "kv_dtype" not in codes(FULL.with_(kv_dtype="fp8_e4m3"))
    assert "device_fp8" in codes(FULL.with_(kv_dtype="fp8_e4m3"), device=a100)
    assert "graph_mode" not in codes(FULL, constraints=c.with_(graph_mode="full"))
    mla = fi_plugin.backends(AVAILABLE)[1].with_plugin("flashinfer")
    mla_codes = {
        r.code for r in check_backend(mla, MLA, h200, c.with_(graph_mode="full"), phase="prefill")
    }
    assert "graph_mode" in mla_codes
    assert "speculative" in codes(FULL, constraints=c.with_(speculative_tokens=64))
    assert "dtype" in codes(FULL.with_(dtype="float32"))


def test_decode_kernel_choice():
    assert decode_uses_tensor_cores(32, 8)  # GQA, 16-bit cache: the faster tensor-core kernel
    assert not decode_uses_tensor_cores(8, 8)  # MHA: nothing for an MMA tile to share
    assert not decode_uses_tensor_cores(32, 8, "fp8_e4m3")  # fp8: the verified CUDA-core kernel
    assert decode_uses_tensor_cores(48, 8)  # group 6: no CUDA-core decode instance
    assert decode_uses_tensor_cores(64, 4, "fp8_e4m3")  # group 16


# ------------------------------------------------------------------------------------------
# compat: the version gate, private attributes, per-layer scales, the self-check
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "note"),
    [
        ("0.6.7", "fast plan: on (flashinfer 0.6.7, self-check at first GPU use)"),
        ("0.6.13", "fast plan: on (flashinfer 0.6.13, self-check at first GPU use)"),
        ("0.7.2.post1", "fast plan: on (flashinfer 0.7.2.post1, self-check at first GPU use)"),
        ("0.7.4", "fast plan: on (flashinfer 0.7.4, self-check at first GPU use)"),
        (
            "0.8.0",
            f"fast plan: off (flashinfer 0.8.0 is not a release the fast path was written "
            f"against ({RELEASES}); public plan() used)",
        ),
        (
            "0.6.10",
            f"fast plan: off (flashinfer 0.6.10 is not a release the fast path was written "
            f"against ({RELEASES}); public plan() used)",
        ),
        (
            "0.7.2",  # not the post-release: its internals were not read
            f"fast plan: off (flashinfer 0.7.2 is not a release the fast path was written "
            f"against ({RELEASES}); public plan() used)",
        ),
        (
            "0.7.4+cu128",  # a local build: its sources may differ
            f"fast plan: off (flashinfer 0.7.4+cu128 is not a release the fast path was "
            f"written against ({RELEASES}); public plan() used)",
        ),
        (
            None,
            "fast plan: off (no flashinfer-python distribution found, its version unknown; "
            "public plan() used)",
        ),
    ],
)
def test_the_fast_path_is_on_only_for_the_releases_it_was_written_against(version, note):
    from attn_plugin_flashinfer import compat

    fp = compat.FastPath(None, version)
    assert fp.enabled == (version in compat.TESTED_RELEASES)
    assert fp.note() == note


def test_attn_list_notes_say_whether_the_fast_path_is_on(monkeypatch):
    from attn_plugin_flashinfer import compat

    fake_flashinfer.install(monkeypatch, "0.8.0")
    for backend in fi_plugin.backends(AVAILABLE):
        assert backend.notes == (
            f"fast plan: off (flashinfer 0.8.0 is not a release the fast path was written "
            f"against ({RELEASES}); public plan() used)"
        )
    fake_flashinfer.install(monkeypatch, "0.6.13")
    fp = compat.fast_path(fake_flashinfer)
    fp.check = ""  # a context of this process ran the self-check
    assert {b.notes for b in fi_plugin.backends(AVAILABLE)} == {
        "fast plan: on (flashinfer 0.6.13, self-check passed)"
    }
    fp.check = "ValueError: boom"
    assert {b.notes for b in fi_plugin.backends(AVAILABLE)} == {
        "fast plan: off (self-check against public plan()/run() failed: ValueError: boom; "
        "public plan() used)"
    }


def _decode_counts(h) -> tuple[int, int]:
    """(public plan() calls, direct compiled-kernel calls since the last one) of the context's
    eager decode wrapper."""
    w = h.context.decode
    m = w._cached_module
    return w.plans, (m.compiled_calls - m.python_run_calls if m else 0)


@pytest.mark.parametrize("version", ["0.6.7", "0.6.13", "0.7.2.post1", "0.7.4", "0.8.0"])
def test_decode_takes_the_fast_path_on_tested_releases_and_public_plan_elsewhere(
    monkeypatch, available, version
):
    """The stand-in FlashInfer has each release's internals: on the releases compat was written
    against the decode steps after the first are planned by the fast plan and run by the direct
    call (0.6.13's and 0.7's run argument lists have the two block-scale slots, 0.7's scheduler
    one or two arguments more; a wrong list raises in the stand-in), on an unknown release (0.8.0,
    with 0.7.4's internals) every decode step goes through plan() and run(). The outputs match
    the reference."""
    fake_flashinfer.install(monkeypatch, version)
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    script = wl.WORKLOADS["prefill_decode_mixed"]
    fi = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    ref = wl.make(FULL, wl.REFERENCE, "cpu")
    out_fi = [wl.run_step(fi, i, step) for i, step in enumerate(script)]
    out_ref = [wl.run_step(ref, i, step) for i, step in enumerate(script)]
    assert wl.max_error(out_fi, out_ref) < 2e-2
    decodes = 3  # steps 1, 2 and 5 of the script are decode-only
    plans, direct = _decode_counts(fi)
    if version == "0.8.0":
        assert (plans, direct) == (decodes, 0)
    else:
        # the first decode planned through plan(), the others by the fast plan; every decode
        # layer (3 steps x 2 layers) run by the direct call
        assert (plans, direct) == (1, 2 * decodes)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_the_fast_path_serves_only_configurations_its_self_check_covers(
    monkeypatch, available, kv_dtype
):
    """The self-check builds K/V in the query's dtype. An fp8 cache on tensor-core decode (a
    head group the CUDA-core kernel is not compiled for, here 5) is a configuration it never
    ran, so such a group plans every decode step through plan() and run(); the same group over
    a bf16 cache takes the fast path."""
    fake_flashinfer.install(monkeypatch, "0.6.13")
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    spec = FULL.with_(num_heads=10, num_kv_heads=2, kv_dtype=kv_dtype)
    script = wl.WORKLOADS["prefill_decode_mixed"]
    fi = wl.make(spec, "flashinfer:flashinfer", "cpu")
    assert fi.context.tensor_core_decode
    ref = wl.make(spec, wl.REFERENCE, "cpu")
    out_fi = [wl.run_step(fi, i, step) for i, step in enumerate(script)]
    out_ref = [wl.run_step(ref, i, step) for i, step in enumerate(script)]
    assert wl.max_error(out_fi, out_ref) < (1e-1 if kv_dtype == "fp8_e4m3" else 2e-2)
    decodes = 3
    assert _decode_counts(fi) == ((decodes, 0) if kv_dtype == "fp8_e4m3" else (1, 2 * decodes))


class _RenamedScale:
    """A release that renamed the wrappers' ``_sm_scale``: what plan() stores, run() reads."""

    _SCALE_ATTR = "_softmax_scale"


def _renamed(monkeypatch, mixin, *names):
    for name in names:
        cls = getattr(fake_flashinfer, name)
        monkeypatch.setattr(fake_flashinfer, name, type(name, (mixin, cls), {}))


@pytest.mark.parametrize("version", ["0.6.7", "0.7.4", "0.8.0"])
@pytest.mark.parametrize("spec_name", ["full", "mla"])
def test_a_renamed_private_scale_cannot_drop_a_layers_softmax_scale(
    monkeypatch, available, version, spec_name
):
    """Layers whose own softmax scale differs from the spec's (and from each other), on a
    FlashInfer whose private scale attribute has another name: every path (ragged and paged
    prefill, decode on the fast path or through run(), MLA) still computes with the layer's
    scale. Writing ``wrapper._sm_scale`` would set an attribute nobody reads here."""
    fake_flashinfer.install(monkeypatch, version)
    _renamed(
        monkeypatch, _RenamedScale,
        "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
        "BatchPrefillWithRaggedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
    )  # fmt: skip
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    spec = FULL if spec_name == "full" else MLA
    scales = (spec.scale * 0.5, spec.scale * 2.0)
    kinds = {StepKind.RAGGED, StepKind.PAGED, StepKind.DECODE} if spec is FULL else {StepKind.MLA}
    seen = _compare(
        spec, wl.WORKLOADS["prefill_decode_mixed"], tol=2e-2, kinds=kinds,
        make_kw={"layer_scales": scales},
    )  # fmt: skip
    assert seen


class _RenamedIndptr:
    """A release that renamed the decode wrapper's ``_paged_kv_indptr_buf``."""

    _INDPTR_ATTR = "_paged_kv_indptr_buffer"


def test_a_renamed_private_buffer_turns_the_fast_plan_off_for_that_wrapper(monkeypatch, available):
    """The fast plan points the wrapper's ``_paged_kv_indptr_buf`` at the step's metadata; on a
    release that renamed it that write would leave run() reading the previous step's. The
    attribute check refuses the fast plan instead: every decode step goes through plan()."""
    fake_flashinfer.install(monkeypatch, "0.6.7")
    _renamed(monkeypatch, _RenamedIndptr, "BatchDecodeWithPagedKVCacheWrapper")
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    _compare(FULL, wl.WORKLOADS["prefill_decode_mixed"], tol=2e-2, kinds={StepKind.DECODE})
    # _compare's flashinfer harness is gone; the attribute check on a fresh one:
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    for i, step in enumerate(wl.WORKLOADS["prefill_decode_mixed"][:3]):
        wl.run_step(h, i, step)
    w = h.context.decode
    assert not h.context.fast.can_replan(w) and _decode_counts(h) == (2, 0)


def test_the_fast_plan_keeps_captured_buffers_and_checks_the_batch_size(monkeypatch):
    from attn_plugin_flashinfer import compat

    fi = fake_flashinfer.install(monkeypatch, "0.6.7")
    buf = torch.zeros(5, dtype=torch.int32)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(8, dtype=torch.uint8), "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=buf, paged_kv_indices_buffer=torch.zeros(16, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.zeros(4, dtype=torch.int32),
    )  # fmt: skip
    i32 = torch.int32
    indptr, last = torch.tensor([0, 1, 2, 3, 4], dtype=i32), torch.ones(4, dtype=i32)
    w.plan(indptr, torch.arange(4, dtype=i32), last, 8, 2, 64, 4, q_data_type=torch.bfloat16)
    fp = compat.fast_path(fi)
    fp.mark_planned(w)
    assert fp.can_replan(w)

    def replan(P):
        t = torch.arange(P + 1, dtype=i32)
        fp.replan_tensor_core_decode(
            w, qo_indptr_host=t, kv_indptr_host=t, kv_len_host=torch.ones(P, dtype=i32),
            max_kv_len=1, kv_indptr_dev=t.clone(), kv_indices_dev=t[:P].clone(),
            last_page_len_dev=torch.ones(P, dtype=i32), qo_indptr_dev=t.clone(),
            num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=4, window_left=-1,
        )  # fmt: skip

    replan(4)
    assert w._paged_kv_indptr_buf is buf  # a captured graph reads these very buffers
    assert w._plan_info[10] == 1  # the scheduler planned for graph replay
    with pytest.raises(ValueError, match="captured for 4 requests, the step has 3"):
        replan(3)


@pytest.mark.parametrize(
    ("layout_of", "expect"),
    [("0.6.7", ""), ("0.6.13", "TypeError")],
    ids=["same_internals", "changed_internals"],
)
def test_the_self_check_turns_the_fast_path_off_where_it_disagrees_with_the_public_api(
    monkeypatch, available, layout_of, expect
):
    """The self-check (on CPU only with the stand-in) runs the fast plan and the direct run
    against plan()/run(). Release 0.6.7 whose compiled paged_run took 0.6.13's argument list
    (internals changed under a tested version number) fails it: the fast path is off for the
    process, attn list says why, and every decode step goes through plan() and run()."""
    from attn_plugin_flashinfer import compat

    fake_flashinfer.install(monkeypatch, "0.6.7", layout_of=layout_of)
    monkeypatch.setattr(compat.FastPath, "CHECK_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = wl.make(FULL, "flashinfer:flashinfer", "cpu")  # the context runs the self-check
    fp = h.context.fast
    assert fp.check is not None and fp.check.startswith(expect)
    # a failed self-check is reported where it happens, not only in attn list
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == ([f"attn_plugin_flashinfer: {fp.note()}"] if expect else []), said
    script = wl.WORKLOADS["prefill_decode_mixed"]
    ref = wl.make(FULL, wl.REFERENCE, "cpu")
    out = [wl.run_step(h, i, step) for i, step in enumerate(script)]
    out_ref = [wl.run_step(ref, i, step) for i, step in enumerate(script)]
    assert wl.max_error(out, out_ref) < 2e-2
    if expect:
        assert not fp.enabled and _decode_counts(h) == (3, 0)
        (note,) = {b.notes for b in fi_plugin.backends(AVAILABLE)}
        assert note.startswith(
            "fast plan: off (self-check against public plan()/run() failed: TypeError"
        )
    else:
        assert fp.enabled and _decode_counts(h) == (1, 6)
        assert fp.note() == "fast plan: on (flashinfer 0.6.7, self-check passed)"


@pytest.mark.parametrize(
    ("layout_of", "failed"), [("0.6.7", False), ("0.6.13", True)], ids=["passes", "fails"]
)
def test_attn_list_self_check_runs_the_fast_plan_check_before_any_context(
    monkeypatch, available, layout_of, failed
):
    """``attn list --self-check`` (hook ``attn_core_self_check``) runs the fast plan's
    self-check at once, with no context: both backends' notes then carry the verdict, and a
    failure (0.6.7 whose compiled paged_run takes 0.6.13's arguments) is named as failed."""
    fake_flashinfer.install(monkeypatch, "0.6.7", layout_of=layout_of)
    monkeypatch.setattr(compat.FastPath, "CHECK_DEVICES", ("cuda", "cpu"))
    full, mla = fi_plugin.backends(AVAILABLE)
    assert "self-check at first GPU use" in full.notes
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        checks = [fi_plugin.attn_core_self_check(b, torch.device("cpu")) for b in (full, mla)]
    for check in checks:
        assert check is not None
        if failed:
            assert check.notes.startswith(
                "fast plan: off (self-check against public plan()/run() failed: TypeError"
            ), check.notes
            (line,) = check.failed
            assert line.startswith("fast plan: self-check against public plan()/run() failed")
        else:
            assert check.notes.startswith("fast plan: on (flashinfer 0.6.7, self-check passed)"), (
                check.notes
            )
            assert check.failed == ()


@pytest.mark.parametrize(
    ("version", "layout_of", "expect"),
    [
        ("0.7.2.post1", None, ""),
        ("0.7.4", None, ""),
        # 0.7.4 whose scheduler lost fixed_uniform_q_len (0.7.2.post1's plan arguments)
        ("0.7.4", "0.7.2.post1", "TypeError"),
        # 0.7.2.post1 whose scheduler took 0.7.4's two arguments
        ("0.7.2.post1", "0.7.4", "TypeError"),
        # a 0.7 release with 0.6.13's internals: no _cudnn_auto on its wrappers
        ("0.7.4", "0.6.13", "the decode wrapper lacks ['_cudnn_auto']"),
    ],
)
def test_the_self_check_on_0_7_catches_a_changed_scheduler_argument_list(
    monkeypatch, available, version, layout_of, expect
):
    """The 0.7 releases' tensor-core decode plan() passes the fa2 scheduler one (0.7.2.post1)
    or two (0.7.4) arguments more than 0.6; the stand-in's scheduler takes exactly its
    release's. The self-check passes where compat's table matches the internals and turns the
    fast path off (the public path then computes every step) where it does not."""
    fake_flashinfer.install(monkeypatch, version, layout_of=layout_of)
    monkeypatch.setattr(compat.FastPath, "CHECK_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    fp = h.context.fast
    assert fp.check is not None and fp.check.startswith(expect), fp.check
    script = wl.WORKLOADS["prefill_decode_mixed"]
    ref = wl.make(FULL, wl.REFERENCE, "cpu")
    out = [wl.run_step(h, i, step) for i, step in enumerate(script)]
    out_ref = [wl.run_step(ref, i, step) for i, step in enumerate(script)]
    assert wl.max_error(out, out_ref) < 2e-2
    assert _decode_counts(h) == ((3, 0) if expect else (1, 6))
    assert fp.enabled == (not expect)


def _planned_decode_wrapper(fi, fp, **attrs):
    """A tensor-core decode wrapper of the stand-in, planned publicly once, with ``attrs``
    set on it afterwards (what a release's plan() might have left)."""
    i32 = torch.int32
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), "NHD",
                                              use_tensor_cores=True)  # fmt: skip
    w.plan(torch.tensor([0, 1, 2], dtype=i32), torch.arange(2, dtype=i32),
           torch.ones(2, dtype=i32), 8, 2, 64, 4, q_data_type=torch.bfloat16)  # fmt: skip
    for name, value in attrs.items():
        if value is None:
            delattr(w, name)
        else:
            setattr(w, name, value)
    fp.mark_planned(w)
    return w


@pytest.mark.parametrize(
    ("version", "attrs", "replans"),
    [
        ("0.6.7", {}, True),
        ("0.7.4", {}, True),
        ("0.7.2.post1", {}, True),
        # "auto" sent this wrapper's plan to cuDNN: its run() is not the fa2 kernel's
        ("0.7.4", {"_cudnn_auto": True}, False),
        # a 0.7 wrapper without the attribute that says whether cuDNN took the plan
        ("0.7.4", {"_cudnn_auto": None}, False),
        # 0.6 wrappers have no _cudnn_auto, and need none
        ("0.6.13", {}, True),
        ("0.7.4", {"_backend": "fa3"}, False),
        ("0.7.4", {"_max_kv_len": None}, False),
        ("0.8.0", {}, False),
    ],
)
def test_the_gate_decides_per_release_and_attribute_set(monkeypatch, version, attrs, replans):
    fi = fake_flashinfer.install(monkeypatch, version)
    fp = compat.fast_path(fi)
    w = _planned_decode_wrapper(fi, fp, **attrs)
    assert fp.can_replan(w) == replans
    assert fp.enabled == (version != "0.8.0")


@pytest.mark.parametrize(
    ("where", "name", "why"),
    [
        ("utils", "device_support_pdl", "flashinfer.utils lacks ['device_support_pdl']"),
        ("utils", "_get_cache_alibi_slopes_buf", "flashinfer.utils lacks"),
        ("class", "use_tensor_cores", "BatchDecodeWithPagedKVCacheWrapper lacks"),
        ("module", "BatchDecodeWithPagedKVCacheWrapper", "the module has no"),
    ],
)
def test_the_probe_checks_import_level_facts_before_any_gpu_work(monkeypatch, where, name, why):
    """At probe (the plugin imports flashinfer where CUDA is present) compat checks what the
    fast path needs of the module beyond its version; a missing piece turns the fast path off
    from the start and attn list says which, before any context or kernel exists."""
    fi = fake_flashinfer.install(monkeypatch, "0.7.4")
    target = {"utils": fake_flashinfer.utils, "module": fi,
              "class": fi.BatchDecodeWithPagedKVCacheWrapper}[where]  # fmt: skip
    monkeypatch.delattr(target, name)
    fp = compat.fast_path(fi)
    assert fp.facts is not None and fp.facts.startswith(why)
    assert not fp.enabled
    assert fp.note().startswith(f"fast plan: off (flashinfer 0.7.4: {why}")


def test_the_probe_runs_the_import_level_checks(monkeypatch):
    """capability.probe() (CUDA present) imports flashinfer and hands it to compat, so attn
    list reports the import-level verdict of this very module."""
    fi = fake_flashinfer.install(monkeypatch, "0.7.4")
    monkeypatch.setattr(capability, "_cuda_reason", lambda: None)
    monkeypatch.setattr(capability, "_toolchain_reason", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    av = capability.probe()
    assert av.available and av.version == "0.7.4"
    assert compat.fast_path(fi).facts == ""
    assert compat.installed_note() == (
        "fast plan: on (flashinfer 0.7.4, import checks passed, self-check at first GPU use)"
    )


def test_the_0_7_direct_run_refuses_unequal_kv_strides(monkeypatch):
    """0.7's run() sends K/V caches of unequal strides to a second compiled module; the
    direct run calls the equal-stride one, so it refuses other strides with the reason."""
    fi = fake_flashinfer.install(monkeypatch, "0.7.4")
    fp = compat.fast_path(fi)
    w = _planned_decode_wrapper(fi, fp)
    runner = fp.decode_runner(w, 0.125)
    assert runner is not None
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(4, 4, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(4, 4, 2, 128, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match=r"K cache strides .* differ from V cache strides"):
        runner(q, k, v, torch.empty_like(q))
    runner(q, k, v.contiguous(), torch.empty_like(q))  # equal strides: the kernel runs


def test_the_int_workspace_is_shared_privately_on_the_fast_path_and_publicly_elsewhere(
    monkeypatch,
):
    from attn_plugin_flashinfer import compat

    int_ws, pinned, float_ws = (torch.zeros(4, dtype=torch.uint8) for _ in range(3))
    for version, shares_pinned in (("0.6.7", True), ("0.7.4", True), ("0.8.0", False)):
        fi = fake_flashinfer.install(monkeypatch, version)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
        compat.fast_path(fi).share_int_workspace(w, float_ws, int_ws, pinned)
        assert w._int_workspace_buffer is int_ws  # reset_workspace_buffer() off the fast path
        assert (w._pin_memory_int_workspace_buffer is pinned) == shares_pinned


# ------------------------------------------------------------------------------------------
# Planning (pure functions)
# ------------------------------------------------------------------------------------------
def test_window_left_is_hf_window_minus_one():
    assert planning.window_left(None) == -1
    assert planning.window_left(1) == 0  # a query sees only itself
    assert planning.window_left(4096) == 4095
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            planning.window_left(bad)


def test_paged_metadata_matches_a_loop():
    rng = np.random.default_rng(0)
    for page in (1, 4, 16):
        seq = rng.integers(1, 70, size=9).astype(np.int32)
        width = 80
        B = len(seq)
        kv_indptr = np.zeros(B + 1, np.int32)
        lpl = np.zeros(B, np.int32)
        roff = np.zeros(B, np.int32)
        meta = planning.fill_paged_metadata(
            seq, page, width, kv_indptr=kv_indptr, last_page_len=lpl, row_offset=roff
        )
        counts = [math.ceil(s / page) for s in seq]
        assert kv_indptr.tolist() == [0, *np.cumsum(counts).tolist()]
        assert meta.total_pages == sum(counts)
        for b, s in enumerate(seq):
            assert 1 <= lpl[b] <= page
            assert (counts[b] - 1) * page + lpl[b] == s  # FlashInfer's kv_len rule
            assert roff[b] == b * width - kv_indptr[b]


def test_paged_metadata_rejects_too_narrow_table():
    with pytest.raises(ValueError, match="page table has 2 columns"):
        planning.fill_paged_metadata(
            np.array([9], np.int32),
            4,
            2,
            kv_indptr=np.zeros(2, np.int32),
            last_page_len=np.zeros(1, np.int32),
            row_offset=np.zeros(1, np.int32),
        )


def test_gather_kv_indices_matches_a_loop():
    rng = np.random.default_rng(1)
    B, W, page = 6, 12, 4
    table = torch.from_numpy(rng.integers(0, 1000, size=(B, W)).astype(np.int32))
    seq = np.array([1, 9, 48, 4, 0, 17], np.int32)  # a zero-length row too
    kv_indptr = np.zeros(B + 1, np.int32)
    roff = np.zeros(B, np.int32)
    lpl = np.zeros(B, np.int32)
    meta = planning.fill_paged_metadata(
        seq, page, W, kv_indptr=kv_indptr, last_page_len=lpl, row_offset=roff
    )
    out = torch.full((200,), -7, dtype=torch.int32)
    got = planning.gather_kv_indices(
        table,
        torch.from_numpy(kv_indptr),
        torch.from_numpy(roff),
        meta.total_pages,
        arange=torch.arange(200, dtype=torch.int32),
        out=out,
    )
    want = [int(table[b, j]) for b in range(B) for j in range(math.ceil(seq[b] / page))]
    assert got.tolist() == want
    assert out[len(want)] == -7  # nothing written past the step's pages
    with pytest.raises(ValueError, match="kv_indices buffer"):
        planning.gather_kv_indices(
            table,
            torch.from_numpy(kv_indptr),
            torch.from_numpy(roff),
            meta.total_pages,
            arange=torch.arange(3, dtype=torch.int32),
            out=out,
        )


# ------------------------------------------------------------------------------------------
# Slot writes
# ------------------------------------------------------------------------------------------
def test_kv_write_fp8_quantises_with_the_layer_scale():
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    x = torch.randn(3, 1, 8) * 300
    scale = torch.tensor(0.5)
    write_slots(x, cache, torch.tensor([0, 5, 7]))
    plain = cache.view(8, 1, 8)[[0, 5, 7]].float()
    assert torch.equal(plain, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    write_slots(x, cache, torch.tensor([0, 5, 7]), scale)
    stored = cache.view(8, 1, 8)[[0, 5, 7]].float()
    want = (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(stored, want)
    assert quantize(x, torch.bfloat16, scale).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------
# The whole flow with a stand-in FlashInfer, against the reference backend
# ------------------------------------------------------------------------------------------
def _compare(spec, script, *, tol, steps_kw=None, make_kw=None, kinds=None):
    make_kw = make_kw or {}
    fi = wl.make(spec, "flashinfer:" + _name(spec), "cpu", **make_kw)
    ref = wl.make(spec, wl.REFERENCE, "cpu", **make_kw)
    seen = []
    out_fi, out_ref = [], []
    for i, step in enumerate(script):
        kw = (steps_kw or {}).get(i, {})
        out_fi.append(wl.run_step(fi, i, step, **kw))
        seen.append(fi.context.step.kind)
        out_ref.append(wl.run_step(ref, i, step, **kw))
    err = wl.max_error(out_fi, out_ref)
    assert err < tol, f"max error {err} (step kinds {seen})"
    if kinds is not None:
        assert set(kinds) <= set(seen), seen
    return seen


def _name(spec):
    return "flashinfer_mla" if spec.kind.value == "mla" else "flashinfer"


@pytest.mark.parametrize(
    "small", ["0", pytest.param("2", marks=INTERPRETED)], ids=["fi_decode", "small_decode"]
)
@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_full_attention_matches_reference(fake_fi, monkeypatch, name, small):
    """Every workload, with eager decode steps on FlashInfer's decode wrapper, and with the
    steps of one or two requests on small_decode's fused kernels (Triton's interpreter)."""
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", small)
    decode = StepKind.DECODE if small == "0" else StepKind.DECODE_SMALL
    seen = _compare(FULL, wl.WORKLOADS[name], tol=2e-2, kinds={StepKind.RAGGED, StepKind.PAGED})
    assert decode in seen or StepKind.DECODE in seen, seen
    if small == "0":
        assert StepKind.DECODE_SMALL not in seen, seen


@INTERPRETED
def test_eager_small_decode_follows_the_steps_kv_positions(fake_fi, monkeypatch):
    """An eager decode step of at most SMALL_DECODE_MAX_BATCH requests takes small_decode
    while its requests' KV positions add up to at most SMALL_DECODE_MAX_KV_TOKENS (known on the
    host, unlike a graph's), FlashInfer's decode above; the env var turns it off."""
    from attn_plugin_flashinfer import context as fi_context

    monkeypatch.setattr(fi_context, "SMALL_DECODE_MAX_KV_TOKENS", 24)
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    wl.run_step(h, 0, [(0, 11), (1, 9), (2, 5)])
    kinds = []
    for step in ([(0, 1), (1, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)], [(0, 1), (1, 1)]):
        wl.run_step(h, len(kinds) + 1, step)
        kinds.append(h.context.step.kind)
    # 12 + 10 = 22 positions; three requests; 13 + 7 = 20; 14 + 12 = 26 > 24
    small, fi = StepKind.DECODE_SMALL, StepKind.DECODE
    assert kinds == [small, fi, small, fi]
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    wl.run_step(h, 0, [(0, 3)])
    wl.run_step(h, 1, [(0, 1)])
    assert h.context.small_decode_max_batch == 0 and h.context.step.kind is fi


def test_window_and_soft_cap_match_reference(fake_fi):
    spec = FULL.with_(sliding_window=6, logits_soft_cap=5.0)
    _compare(spec, wl.WORKLOADS["prefill_decode_mixed"], tol=2e-2)


def test_fp8_kv_with_scales_matches_reference(fake_fi):
    spec = FULL.with_(kv_dtype="fp8_e4m3")
    seen = _compare(
        spec,
        wl.WORKLOADS["prefill_decode_mixed"],
        tol=6e-2,
        make_kw={"kv_scales": (0.02, 0.03)},
    )
    assert StepKind.RAGGED not in seen  # fp8 attends over the quantised cache, never ragged


def test_mqa_and_speculative_verify_match_reference(fake_fi):
    spec = FULL.with_(num_heads=4, num_kv_heads=1)
    script = [[(0, 9), (1, 6)], [(0, 3), (1, 3)], [(0, 3), (1, 3)], [(0, 1), (1, 1)]]
    steps_kw = {1: {"spec_tokens": 2}, 2: {"spec_tokens": 2}}
    seen = _compare(spec, script, tol=2e-2, steps_kw=steps_kw, make_kw={"spec_tokens": 2})
    assert seen[1] is StepKind.PAGED


@pytest.mark.parametrize("graph", [False, True])
def test_a_context_for_one_request_plans_and_matches_reference(fake_fi, graph):
    """max_batch_size=1 (a B=1 decode graph): every metadata view has a single row."""
    script = [[(0, 21)], [(0, 1)], [(0, 1)]]
    steps_kw = {1: {"pad_to": 1}, 2: {"pad_to": 1}} if graph else None
    _compare(FULL, script, tol=2e-2, steps_kw=steps_kw, make_kw={"graph": graph, "max_batch": 1})


def test_mla_matches_reference(fake_fi):
    _compare(MLA, wl.WORKLOADS["chunked_prefill"], tol=2e-2, kinds={StepKind.MLA})


@pytest.mark.parametrize(
    ("small_max", "kind"),
    [
        ("0", StepKind.DECODE_GRAPH),
        pytest.param("4", StepKind.DECODE_SMALL, marks=INTERPRETED),
    ],
)
def test_graph_decode_padding_and_update(fake_fi, monkeypatch, small_max, kind):
    """Graph mode: padded decode steps use the fixed-buffer wrappers, or up to
    SMALL_DECODE_MAX_BATCH padded requests the fused small_decode kernels (here in Triton's
    interpreter); both match the reference, and padding writes nothing."""
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", small_max)
    spec = FULL
    script = [[(0, 11), (1, 4), (2, 7)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)]]
    steps_kw = {1: {"pad_to": 4}, 2: {"pad_to": 4}}
    seen = _compare(spec, script, tol=2e-2, steps_kw=steps_kw, make_kw={"graph": True})
    assert seen[1:] == [kind, kind]


GPT_OSS = FULL.with_(has_sinks=True)


def test_sinks_are_served_on_every_release_at_the_plain_priority():
    """Sinks go through the plain wrappers plus the LSE rescale: the full backend advertises
    them whatever the installed release, ranks a sinks layer like any other (no feature
    priority), and an offline H200 plan admits it; the MLA backend has no sinks."""
    by_name = {b.name: b for b in fi_plugin.backends(AVAILABLE)}
    full = by_name["flashinfer"]
    assert full.capabilities.sinks and full.capabilities.feature_priority == ()
    for phase in ("prefill", "decode", "verify"):
        assert full.priority_for(phase, GPT_OSS) == full.priority_for(phase, FULL)
    assert not by_name["flashinfer_mla"].capabilities.sinks
    h200 = DeviceCapabilities.target("h200")
    qualified = full.with_plugin("flashinfer")
    rejections = check_backend(qualified, GPT_OSS, h200, ExecutionConstraints())
    assert {r.code for r in rejections} == set()


@pytest.mark.parametrize("version", ["0.6.7", "0.7.4"])
@pytest.mark.parametrize(
    ("spec", "graph", "make_kw", "tol"),
    [
        (GPT_OSS, False, {}, 2e-2),
        (GPT_OSS.with_(sliding_window=6), False, {}, 2e-2),  # gpt-oss's sliding layers
        (GPT_OSS, True, {}, 2e-2),
        (GPT_OSS.with_(sliding_window=6), True, {}, 2e-2),
        (GPT_OSS.with_(logits_soft_cap=5.0), False, {}, 2e-2),
        (GPT_OSS.with_(kv_dtype="fp8_e4m3"), False, {"kv_scales": (0.02, 0.03)}, 6e-2),
    ],
    ids=["full", "window", "graph", "graph_window", "soft_cap", "fp8"],
)
def test_sinks_match_the_reference_on_every_step_kind(
    available, monkeypatch, version, spec, graph, make_kw, tol
):
    """A layer with sinks runs ragged and paged prefill, mixed, eager decode (the fast path's
    direct run on a tested release) and graph decode with padding through the plain wrappers,
    each layer at its own softmax scale, and matches the reference (which adds the sink as a
    softmax column); soft-cap and an fp8 cache too."""
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    fake_flashinfer.install(monkeypatch, version)
    script = [
        [(0, 11), (1, 4), (2, 7)],
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (2, 1)],
        [(0, 1), (3, 9), (2, 1)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ]
    steps_kw = {1: {"pad_to": 4}, 2: {"pad_to": 4}} if graph else {}
    kw = {"graph": graph, "layer_scales": (spec.scale * 0.5, spec.scale * 2.0), **make_kw}
    seen = _compare(spec, script, tol=tol, steps_kw=steps_kw, make_kw=kw)
    first = StepKind.PAGED if spec.kv_dtype == "fp8_e4m3" else StepKind.RAGGED
    decode = StepKind.DECODE_GRAPH if graph else StepKind.DECODE
    assert seen[0] is first and seen[1] is decode and seen[3] is StepKind.PAGED, seen


def test_the_sinks_change_the_result(fake_fi):
    """The workloads' sinks weigh enough to matter: sinks of no mass give another output, so the
    comparison with the reference above fails for a path that drops or misplaces them."""
    step = [(0, 9), (1, 3)]
    h = wl.make(GPT_OSS, "flashinfer:flashinfer", "cpu")
    with_sinks = wl.run_step(h, 0, step)
    h2 = wl.make(GPT_OSS, "flashinfer:flashinfer", "cpu")
    for layer in range(h2.num_layers):
        h2.runtime.binding(layer).sinks.fill_(-1e4)  # exp(-1e4): no sink mass
    without = wl.run_step(h2, 0, step)
    plain = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    assert wl.max_error([with_sinks], [without]) > 1e-2
    assert wl.max_error([without], [wl.run_step(plain, 0, step)]) < 1e-5


def _with_sink_column(o_logits, v, sinks):
    """Independent of the LSE identity: softmax over the logits and a sink column, then ``p v``
    (``o_logits [T, H, L]``, ``v [L, H, D]``, ``sinks [H]``) -> ``[T, H, D]`` float32."""
    T, H, _ = o_logits.shape
    column = sinks.view(1, H, 1).expand(T, H, 1)
    p = torch.softmax(torch.cat([o_logits, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thl,lhd->thd", p, v)


@pytest.mark.parametrize(
    "interpret", [False, pytest.param(True, marks=INTERPRETED)], ids=["torch", "triton"]
)
def test_apply_sinks_equals_a_softmax_with_a_sink_column(monkeypatch, interpret):
    """sinks.apply_sinks_ on a plain output and its base-2 LSE gives the softmax with the sink
    as one more column, in bf16 and float32, a row that saw no key included (all mass on the
    sink: zeros); the Triton kernel under the interpreter, torch ops otherwise."""
    from attn_plugin_flashinfer.sinks import LN2, apply_sinks_

    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    g = torch.Generator().manual_seed(3)
    T, H, L, D = 5, 4, 7, 24  # D not a power of two: the kernel's masked tail
    logits = torch.randn(T, H, L, generator=g) * 3
    logits[2, 1] = float("-inf")
    v = torch.randn(L, H, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    plain = torch.einsum("thl,lhd->thd", torch.softmax(logits, dim=-1).nan_to_num(0.0), v)
    lse2 = torch.logsumexp(logits, dim=-1) / LN2
    want = _with_sink_column(logits, v, sinks)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = plain.to(dtype, copy=True)
        assert apply_sinks_(out, lse2, sinks) is out
        assert (out.float() - want).abs().max().item() < tol, dtype
        assert torch.equal(out[2, 1].float(), torch.zeros(D))
    with pytest.raises(ValueError, match=r"needs lse \[5, 4\] and sinks \[4\]"):
        apply_sinks_(plain.clone(), lse2[:4], sinks)


def test_small_decode_serves_plain_16_bit_layers_only(fake_fi):
    """Which layers the fused small-decode kernels take; the others keep FlashInfer's graph
    wrapper at every batch size."""
    import torch
    from attn_plugin_flashinfer.context import small_decode_serves

    bf16 = torch.bfloat16
    assert small_decode_serves(FULL, bf16, bf16)
    for spec, kv in [
        (FULL.with_(sliding_window=8), bf16),
        (FULL.with_(logits_soft_cap=30.0), bf16),
        (FULL.with_(has_sinks=True), bf16),
        (FULL.with_(head_dim=96), bf16),
        (FULL.with_(num_heads=64, num_kv_heads=2), bf16),
        (FULL, torch.float8_e4m3fn),
        (FULL, torch.float16),
    ]:
        assert not small_decode_serves(spec, kv, bf16), spec
    h = wl.make(FULL.with_(sliding_window=8), "flashinfer:flashinfer", "cpu", graph=True)
    wl.run_step(h, 0, [(0, 5)])
    wl.run_step(h, 1, [(0, 1)], pad_to=1)
    assert h.context.small_decode_max_batch == 0
    assert h.context.step.kind is StepKind.DECODE_GRAPH


def test_the_triton_kernels_run_on_cuda_or_in_triton_s_interpreter(monkeypatch):
    """small_decode and the sinks rescale: on CUDA tensors, on CPU ones only interpreted."""
    from attn_plugin_flashinfer.sinks import triton_runs_on

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_runs_on(torch.device("cuda", 0))
    assert not triton_runs_on(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_runs_on(torch.device("cpu"))


@INTERPRETED
def test_small_decode_batch_limit_keeps_the_step_under_its_kv_token_budget(fake_fi):
    """A graph replays at every length up to max_model_len: past SMALL_DECODE_MAX_KV_TOKENS
    positions per step FlashInfer's kernels are the faster ones, so fewer requests (or none)
    take the fused path as max_model_len grows."""
    from attn_plugin_flashinfer import context as fi_context
    from attn_plugin_flashinfer.context import small_decode_batch_limit

    budget = fi_context.SMALL_DECODE_MAX_KV_TOKENS
    cap = fi_context.SMALL_DECODE_MAX_BATCH
    assert cap == 4
    assert small_decode_batch_limit(4112) == 4  # the benchmark's ctx 4096 (+ one page)
    assert small_decode_batch_limit(32784) == 0  # ctx 32768 (+ one page): FlashInfer's
    assert small_decode_batch_limit(budget // 4) == 4
    assert small_decode_batch_limit(budget // 4 + 1) == 3
    assert small_decode_batch_limit(budget // 2 + 1) == 1
    assert small_decode_batch_limit(budget) == 1
    assert small_decode_batch_limit(budget + 1) == 0
    assert small_decode_batch_limit(65536) == 0
    assert small_decode_batch_limit(1024, cap=8) == 8
    assert small_decode_batch_limit(1024, cap=0) == 0
    for max_len, on in ((budget, True), (budget + 1, False)):
        h = wl.make(FULL, "flashinfer:flashinfer", "cpu", graph=True, max_model_len=max_len)
        wl.run_step(h, 0, [(0, 5)])
        wl.run_step(h, 1, [(0, 1)], pad_to=1)
        assert (h.context.small_decode_max_batch > 0) is on, max_len
        want = StepKind.DECODE_SMALL if on else StepKind.DECODE_GRAPH
        assert h.context.step.kind is want, max_len


@INTERPRETED
def test_small_decode_above_the_batch_limit_is_flashinfers(fake_fi, monkeypatch):
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "2")
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu", graph=True)
    wl.run_step(h, 0, [(0, 5), (1, 3), (2, 4)])
    kinds = []
    for pad in (2, 3, 2):
        wl.run_step(h, 1, [(0, 1), (1, 1)], pad_to=pad)
        kinds.append(h.context.step.kind)
    assert kinds == [StepKind.DECODE_SMALL, StepKind.DECODE_GRAPH, StepKind.DECODE_SMALL]
    assert set(h.context._small) == {2}  # the partials of one padded size, made once


def test_graph_decode_wrapper_is_reused_per_padded_size(fake_fi, monkeypatch):
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu", graph=True)
    wl.run_step(h, 0, [(0, 5), (1, 3)])
    wl.run_step(h, 1, [(0, 1), (1, 1)], pad_to=4)
    ctx = h.context
    w = ctx.step.wrapper
    assert ctx._graph_wrappers == {4: w}
    # update() with a new batch of the same padded size re-plans the same wrapper in place
    batch = h.builder.build([(1, 1)], pad_to=4)
    h.runtime.update(batch)
    # (the first through plan(), the second through the fast plan: the scheduler ran twice)
    assert ctx.step.wrapper is w and w.plans == 1 and w._cached_module.plan_calls == 2
    # the step's one copy fills what the captured kernels read
    assert w._paged_kv_indptr_buf.data_ptr() == ctx.dev_meta.data_ptr()


def test_mla_graph_decode(fake_fi):
    script = [[(0, 6), (1, 9)], [(0, 1), (1, 1)], [(1, 1)]]
    steps_kw = {1: {"pad_to": 3}, 2: {"pad_to": 3}}
    seen = _compare(MLA, script, tol=2e-2, steps_kw=steps_kw, make_kw={"graph": True})
    assert seen[1:] == [StepKind.MLA_GRAPH, StepKind.MLA_GRAPH]


def test_unequal_v_head_dim_is_refused_by_the_selector(fake_fi):
    """The paged kernels need K and V of one width: the backend does not declare
    distinct_value_head_dim, so a forced plan names the layer's widths."""
    with pytest.raises(Exception, match=r"\[head_dim_v\].*head_dim_v 128 beside head_dim 64"):
        wl.make(FULL.with_(head_dim_v=128), "flashinfer:flashinfer", "cpu")


def test_a_ragged_prefill_plans_its_slots_as_runs_of_consecutive_rows(fake_fi, monkeypatch):
    """A ragged prefill's slots, as runs the side stream can copy with memcpys: one per run of
    consecutive cache rows; past MAX_SLOT_RUNS runs the write kernel takes the step."""
    from attn_core.state import kv_write

    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    for r in (0, 1):
        h.state.add_request(r)
    batch = h.builder.build([(0, 9), (1, 6)])
    h.runtime.prepare(batch)
    step = h.context.step
    assert step.kind is StepKind.RAGGED
    slots = batch.slot_mapping.tolist()
    runs = step.kv_runs
    assert runs and sum(n for _, _, n in runs) == 15
    for t0, s0, n in runs:
        assert slots[t0 : t0 + n] == list(range(s0, s0 + n))
    monkeypatch.setattr(kv_write, "MAX_SLOT_RUNS", len(runs) - 1)
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    for r in (0, 1):
        h.state.add_request(r)
    h.runtime.prepare(h.builder.build([(0, 9), (1, 6)]))
    assert h.context.step.kind is StepKind.RAGGED and h.context.step.kv_runs is None


def _spy_on_the_self_check(monkeypatch, fails=lambda cfg: False) -> list[tuple]:
    """Install the stand-in FlashInfer 0.6.13 with its self-check on the CPU; returns the list
    each check's configuration ``(dtype, heads, kv heads, head dim, page, window_left,
    soft-cap)`` goes to. A configuration ``fails`` accepts reports "output differs"."""
    from attn_plugin_flashinfer import compat

    fake_flashinfer.install(monkeypatch, "0.6.13")
    monkeypatch.setattr(compat.FastPath, "CHECK_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")
    calls: list[tuple] = []
    real = compat.FastPath._self_check

    def spy(self, *args):
        calls.append(args[1:])
        return "output differs" if fails(args[1:]) else real(self, *args)

    monkeypatch.setattr(compat.FastPath, "_self_check", spy)
    return calls


def test_the_self_check_runs_on_the_groups_own_shape_window_and_soft_cap(monkeypatch, available):
    """The context hands the self-check its dtype, heads, head dim, page, window and soft-cap
    (the kernel module compiled for the check is the group's); it passes on the stand-in and
    the group's windowed, soft-capped decode steps then take the fast path."""
    calls = _spy_on_the_self_check(monkeypatch)
    spec = FULL.with_(sliding_window=6, logits_soft_cap=5.0, dtype="float16", kv_dtype="float16")
    _compare(spec, wl.WORKLOADS["prefill_decode_mixed"], tol=2e-2, kinds={StepKind.DECODE})
    assert calls == [(torch.float16, 8, 2, 64, 4, 5, 5.0)]  # window_left = window - 1
    (note,) = {b.notes for b in fi_plugin.backends(AVAILABLE)}
    assert note == "fast plan: on (flashinfer 0.6.13, self-check passed)"


def test_each_new_configuration_gets_its_own_self_check_before_its_fast_path(
    monkeypatch, available
):
    """The check a context runs covers its own configuration (dtype, heads, head dim, page,
    window, soft-cap) only: a later group of another configuration runs its own before the
    fast path serves it, a repeated one does not, and a failure there turns the fast path off
    for the process, the note naming that configuration."""
    # the windowed group's kernel disagrees
    calls = _spy_on_the_self_check(monkeypatch, fails=lambda cfg: cfg[5] == 5)
    plain = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    wl.make(FULL, "flashinfer:flashinfer", "cpu")  # the same configuration: checked already
    assert calls == [(torch.bfloat16, 8, 2, 64, 4, -1, 0.0)]
    assert plain.context.fast.enabled
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        wl.make(FULL.with_(sliding_window=6), "flashinfer:flashinfer", "cpu")
    assert len(calls) == 2 and calls[1][5] == 5
    fp = plain.context.fast
    assert not fp.enabled
    assert "output differs" in fp.note() and "window_left=5" in fp.note(), fp.note()


def test_no_module_but_compat_touches_flashinfer_internals():
    """Private attributes of FlashInfer objects (wrappers, modules, flashinfer.utils) are read
    and written in compat.py only; the scale is never written into a wrapper anywhere."""
    import re

    from attn_plugin_flashinfer import compat

    package = Path(compat.__file__).parent
    private = re.compile(
        r"(wrapper|module|utils|\bw)\._[a-z]|_sm_scale|_cached_module|getclosurevars|"
        r"flashinfer\.utils"
    )
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in package.glob("*.py")
        if path.name != "compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------
# Graph mode full: a captured mixed step, replayed with other splits
# ------------------------------------------------------------------------------------------
FULL_P, FULL_T = 4, 48
#: every split a captured mixed step replays: pure prefill, pure decode, mixed, a page
#: crossing, all four rows real (no padding row: the rows past the requests are padding)
FULL_SCRIPT = [
    [(0, 13), (1, 5)],
    [(0, 1), (1, 1)],
    [(0, 1), (2, 20)],
    [(2, 9), (0, 1), (1, 1), (3, 6)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


def _full_harnesses(spec=FULL):
    kw = dict(max_batch=FULL_P, max_tokens=FULL_T, max_model_len=128)
    fi = wl.make(spec, "flashinfer:flashinfer", "cpu", graph="full", **kw)
    ref = wl.make(spec, wl.REFERENCE, "cpu", **kw)
    return fi, ref


def test_graph_full_plan_keeps_full_for_a_model_of_full_attention(available):
    groups = group_layers([FULL] * 2)
    reg = wl.registry()
    plan = select(groups, reg, DeviceCapabilities.target("h200"), ExecutionConstraints(
        graph_mode="full"))  # fmt: skip
    assert plan.constraints.graph_mode is GraphMode.FULL and plan.graph_mode_requested is None
    assert plan.choices[0].backend.qualified_name == "flashinfer:flashinfer"
    assert plan.phase_graph_modes("prefill") == (GraphMode.FULL, GraphMode.FULL)


@pytest.mark.parametrize(
    "spec_kw",
    [{}, {"sliding_window": 6, "logits_soft_cap": 5.0}, {"has_sinks": True}],
    ids=["plain", "window_soft_cap", "sinks"],
)
def test_captured_mixed_step_replays_every_split_and_matches_reference(fake_fi, spec_kw):
    """Capture on an all-padding batch at the captured sizes, then update + run (what precedes
    a replay) for every split: one wrapper, its fixed buffers, the capture's row count; the
    outputs equal the reference backend run eagerly on the same steps."""
    spec = FULL.with_(**spec_kw)
    fi, ref = _full_harnesses(spec)
    pad = dict(pad_to=FULL_P, pad_tokens_to=FULL_T)
    wl.run_step(fi, 0, [], **pad)  # the capture: padding only
    ctx = fi.context
    assert ctx.step.kind is StepKind.PAGED_GRAPH
    (w,) = ctx._full_wrappers.values()
    assert ctx._full_wrappers == {FULL_P: w} and w.is_cuda_graph_enabled
    assert w._max_total_num_rows == FULL_T  # the capture's rows: the scheduler's fixed grid
    held = (w._qo_indptr_buf, w._paged_kv_indptr_buf, w._paged_kv_indices_buf,
            w._paged_kv_last_page_len_buf)  # fmt: skip
    views = (ctx.g_qo_indptr, ctx.dev_meta, ctx.kv_indices, ctx._last_page_len_dev(FULL_P))
    assert [b.data_ptr() for b in held] == [b.data_ptr() for b in views]
    outs_fi, outs_ref = [], []
    for i, step in enumerate(FULL_SCRIPT, start=1):
        outs_fi.append(wl.run_step(fi, i, step, update=True, **pad))
        assert ctx.step.kind is StepKind.PAGED_GRAPH and ctx.step.wrapper is w
        assert ctx.step.padded  # a replay may carry padding rows: the K/V write skips them
        outs_ref.append(wl.run_step(ref, i, step, **pad))
    assert ctx._full_wrappers == {FULL_P: w} and w._max_total_num_rows == FULL_T
    assert w.plans == 1 + len(FULL_SCRIPT)
    err = wl.max_error(outs_fi, outs_ref)
    assert err < 2e-2, err


def test_captured_mixed_step_equals_the_eager_paths(fake_fi, monkeypatch):
    """The same steps through the eager paths (ragged, paged, decode) of another context give
    the same outputs as the captured mixed step's one wrapper."""
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", "0")  # FlashInfer's decode
    fi, _ = _full_harnesses()
    eager = wl.make(FULL, "flashinfer:flashinfer", "cpu", max_batch=FULL_P, max_tokens=FULL_T,
                    max_model_len=128)  # fmt: skip
    pad = dict(pad_to=FULL_P, pad_tokens_to=FULL_T)
    wl.run_step(fi, 0, [], **pad)
    got, want, kinds = [], [], []
    for i, step in enumerate(FULL_SCRIPT, start=1):
        got.append(wl.run_step(fi, i, step, update=True, **pad))
        want.append(wl.run_step(eager, i, step, input_rows=FULL_T))
        kinds.append(eager.context.step.kind)
    assert {StepKind.RAGGED, StepKind.PAGED, StepKind.DECODE} <= set(kinds), kinds
    assert wl.max_error(got, want) < 1e-5


def test_the_plan_of_a_captured_mixed_step_does_not_depend_on_its_split(fake_fi, monkeypatch):
    """What the captured kernel is planned with - batch size, row budget, buffers, the
    max_token_per_sequence argument - is the same for every split; only buffer contents vary."""
    fi, _ = _full_harnesses()
    ctx = fi.context
    seen = []
    real_plan = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def spy(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kw):
        seen.append((len(qo_indptr), int(qo_indptr[-1]) <= FULL_T, len(last_page_len),
                     kw["max_token_per_sequence"], kw["causal"]))  # fmt: skip
        return real_plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kw)

    monkeypatch.setattr(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", spy)
    pad = dict(pad_to=FULL_P, pad_tokens_to=FULL_T)
    wl.run_step(fi, 0, [], **pad)
    for i, step in enumerate(FULL_SCRIPT, start=1):
        wl.run_step(fi, i, step, update=True, **pad)
    assert set(seen) == {(FULL_P + 1, True, FULL_P, FULL_T, True)}, seen
    assert len(seen) == 1 + len(FULL_SCRIPT)
    assert ctx.step.kind is StepKind.PAGED_GRAPH


def test_a_captured_mixed_step_whose_requests_fill_every_row_runs_the_plans_rows(fake_fi):
    """A split with no padding row (its padding tokens past the last request belong to no
    row): FlashInfer's run() takes exactly the plan's qo_indptr[-1] query rows, so the update
    before a replay, then forward, attends over those rows; out=None still returns every
    padded row, and a strided out gets the real rows (the kit's emulated mixed replay)."""
    fi, ref = _full_harnesses()
    pad = dict(pad_to=FULL_P, pad_tokens_to=FULL_T)
    wl.run_step(fi, 0, [], **pad)  # the capture: padding only
    step = [(0, 5), (1, 3), (2, 1), (3, 2)]  # every one of FULL_P rows real, 11 tokens
    for h in (fi, ref):
        for rid, _ in step:
            h.state.add_request(rid)
            h.positions[rid] = 0
    batch = fi.builder.build(list(step), **pad)
    assert batch.padded_reqs == batch.num_reqs == FULL_P and batch.padded_tokens == FULL_T
    fi.runtime.update(batch)
    ref_batch = ref.builder.build(list(step), **pad)
    ref.runtime.prepare(ref_batch)
    H, Dv, n = FULL.num_heads, FULL.head_dim_v, batch.num_tokens
    for layer in range(fi.num_layers):
        q, k, v = wl.inputs(FULL, 1, layer, FULL_T, "cpu")
        want = ref.runtime.binding(layer).forward(q, k, v, out=None)[:n]
        got = fi.runtime.binding(layer).forward(q, k, v, out=None)
        assert got.shape == (FULL_T, H, Dv)
        assert (got[:n] - want).abs().max() < 2e-2
        wide = torch.full((FULL_T, H, Dv + 3), float("nan"), dtype=q.dtype)
        fi.runtime.binding(layer).forward(q, k, v, out=wide[..., :Dv])
        assert (wide[:n, :, :Dv] - want).abs().max() < 2e-2
        assert wide[..., Dv:].isnan().all()  # the gap columns untouched


def test_capturing_a_mixed_step_whose_requests_fill_every_row_is_refused(fake_fi, monkeypatch):
    """Captured on a split without a padding row, the step's temporaries (fp8's scaled q, a
    layer's scale ratio, the sinks rescale) would cover only its real rows, and a replay with
    more rows would read past them: the capture is refused, naming the batch to capture on.
    Eager runs of the same step (the kit's emulated replay) stay allowed."""
    from attn_plugin_flashinfer import context as fi_context

    from attn_core.errors import BackendInputError

    fi, _ = _full_harnesses()
    pad = dict(pad_to=FULL_P, pad_tokens_to=FULL_T)
    wl.run_step(fi, 0, [], **pad)
    step = [(0, 5), (1, 3), (2, 1), (3, 2)]  # every row real: 11 of FULL_T tokens
    wl.run_step(fi, 1, step, update=True, **pad)  # eagerly: fine
    monkeypatch.setattr(fi_context, "_capturing", lambda device: True)
    with pytest.raises(BackendInputError, match=(
        r"layer group 'full', backend 'flashinfer:flashinfer': layer 0: a CUDA-graph capture "
        r"of a mixed step whose requests fill every row: expected a padding row \(capture on "
        rf"BatchBuilder.build\(\[\], pad_to=P, pad_tokens_to=T\)\), got 4 requests with 4 "
        rf"tokens of {FULL_T}"
    )):  # fmt: skip
        wl.run_step(fi, 2, [(0, 1), (1, 1), (2, 1), (3, 1)], update=True, **pad)
    monkeypatch.setattr(fi_context, "_capturing", lambda device: False)
    wl.run_step(fi, 3, [(0, 1), (1, 1), (2, 1), (3, 1)], update=True, **pad)  # no state moved


def test_a_captured_mixed_step_needs_a_context_for_graph_mode_full(fake_fi):
    h = wl.make(FULL, "flashinfer:flashinfer", "cpu", graph=True, max_batch=FULL_P,
                max_tokens=FULL_T, max_model_len=128)  # fmt: skip
    with pytest.raises(Exception, match=(
        r"group 'full' \(flashinfer\): a captured mixed step \(a full_graph batch\) needs a "
        r"context allocated for graph mode full, this one is for decode"
    )):  # fmt: skip
        wl.run_step(h, 0, [(0, 3)], pad_to=FULL_P, pad_tokens_to=FULL_T)


# ------------------------------------------------------------------------------------------
# Chunked (local) attention through the core's local virtual batches
# ------------------------------------------------------------------------------------------
CHUNKED = FULL.with_(attention_chunk_size=8)  # two pages of 4
#: prefill spanning chunks (ragged: every piece starts at its chunk), decodes on and across a
#: boundary, a chunk over a cached prefix across boundaries (paged), a mixed step
CHUNKED_SCRIPT = [
    [(0, 21), (1, 7), (2, 3)],
    [(0, 1), (1, 1), (2, 1)],  # 1: position 7, the last of chunk 0
    [(0, 1), (1, 1), (2, 1)],  # 1: position 8, the first of chunk 1
    [(0, 1), (1, 19), (3, 10)],  # 1: 9 .. 27 across 16 and 24; mixed
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


def test_chunked_prefill_is_not_captured_in_graph_mode_full(available):
    """A chunked group's mixed steps through local virtual batches vary in their number of
    requests, so one captured mixed graph cannot replay them: under graph mode full the
    prefill phase rejects FlashInfer with [graph_mode] (the policy lowers the run to decode)."""
    groups = group_layers([CHUNKED] * 2)
    reason = check_backend(
        fi_plugin.backends(AVAILABLE)[0],
        CHUNKED,
        DeviceCapabilities.target("h200"),
        ExecutionConstraints(graph_mode="full"),
        phase="prefill",
    )
    assert [r.code for r in reason] == ["graph_mode"], reason
    assert "cannot be captured in graph mode full" in reason[0].reason
    with pytest.warns(UserWarning):
        plan = select(groups, wl.registry(), DeviceCapabilities.target("h200"),
                      ExecutionConstraints(graph_mode="full"))  # fmt: skip
    assert plan.constraints.graph_mode is GraphMode.DECODE
    assert plan.choices[0].backend.qualified_name == "flashinfer:flashinfer"


def test_chunked_layers_are_admitted_through_virtual_batches(fake_fi):
    caps = fi_plugin.backends(AVAILABLE)[0].capabilities
    assert caps.chunked_virtual_batches and not caps.chunked_attention
    h = wl.make(CHUNKED, "flashinfer:flashinfer", "cpu")  # asserts the forced choice stands
    assert set(h.runtime.local_batchers) == {"full"}


@pytest.mark.parametrize(
    "small", ["0", pytest.param("2", marks=INTERPRETED)], ids=["fi_decode", "small_decode"]
)
def test_chunked_layers_match_the_reference_chunk_mask(fake_fi, monkeypatch, small):
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", small)
    seen = _compare(CHUNKED, CHUNKED_SCRIPT, tol=2e-2, kinds={StepKind.RAGGED, StepKind.PAGED})
    # the same workload without the chunk mask differs: the comparison would catch a context
    # that read the real batch
    fi = wl.make(FULL, "flashinfer:flashinfer", "cpu")
    ref = wl.make(CHUNKED, wl.REFERENCE, "cpu")
    plain = [wl.run_step(fi, i, s) for i, s in enumerate(CHUNKED_SCRIPT)]
    chunked = [wl.run_step(ref, i, s) for i, s in enumerate(CHUNKED_SCRIPT)]
    assert wl.max_error(plain, chunked) > 0.1, seen


@pytest.mark.parametrize(
    ("small_max", "kind"),
    [
        ("0", StepKind.DECODE_GRAPH),
        pytest.param("4", StepKind.DECODE_SMALL, marks=INTERPRETED),
    ],
)
def test_chunked_graph_decode_and_the_virtual_rows_fit_the_context(
    fake_fi, monkeypatch, small_max, kind
):
    """Graph decode steps of a chunked layer replay into the captured wrapper's buffers (or the
    fused small-decode kernels'); a prefill whose virtual requests outnumber max_batch_size
    fits the context's rows."""
    monkeypatch.setenv("ATTN_FLASHINFER_SMALL_DECODE_MAX_BATCH", small_max)
    script = [[(0, 30), (1, 30)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    steps_kw = {i: {"pad_to": 2} for i in (1, 2, 3)}
    make_kw = {"graph": True, "max_batch": 2}
    seen = _compare(CHUNKED, script, tol=2e-2, steps_kw=steps_kw, make_kw=make_kw)
    assert seen[0] is StepKind.RAGGED and seen[1:] == [kind] * 3
    h = wl.make(CHUNKED, "flashinfer:flashinfer", "cpu", **make_kw)
    assert h.context.B >= 8  # 2 requests of 30 tokens: 4 chunks each


@pytest.mark.parametrize(
    "version, mla_modes, note",
    [
        ("0.6.7", {"none", "decode"}, ""),
        ("0.6.13", {"none", "decode"}, ""),
        ("0.7.2.post1", {"none"}, "withdrawn from 0.7 on: 0.7.4's captured MLA decode"),
        ("0.7.4", {"none"}, "withdrawn from 0.7 on: 0.7.4's captured MLA decode"),
        ("0.7.4+cu128", {"none"}, "withdrawn from 0.7 on"),
        # a version that says nothing (a source build's, an unreadable one): not declared
        ("0.0.0+unknown", {"none"}, "outside the supported releases"),
        ("", {"none"}, "MLA graph modes: none (no flashinfer release to read: see the backend"),
        ("garbage", {"none"}, "version unknown"),
    ],
)
def test_graph_modes_follow_the_installed_release(version, mla_modes, note):
    """MLA graph decode (FlashInfer 0.7.4's captured MLA decode failed the kit on the H200) is
    declared on the 0.6 releases only, and never where the version cannot tell which release
    is installed; ``attn list``'s note says why, without claiming a kit run on a release that
    had none. The full backend keeps every graph mode inside the supported range."""
    av = capability.Availability(True, None, version)
    by_name = {b.name: b for b in fi_plugin.backends(av)}
    full, mla = by_name["flashinfer"], by_name["flashinfer_mla"]
    full_modes = {"none", "decode"} | (set() if "outside" in note else {"full"})
    assert {m.value for m in full.capabilities.graph_modes} == full_modes
    assert {m.value for m in mla.capabilities.graph_modes} == mla_modes
    if note:
        assert note in mla.notes, mla.notes
    else:
        assert "graph modes" not in mla.notes
    assert ("outside" in full.notes) is ("outside" in note)
