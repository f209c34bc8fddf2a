"""fla-core compat (``attn_plugin_triton_ssm.compat``): the version gate on fla's internal stages
(Gated DeltaNet's and KDA's, each family on its own), the self-check's verdict, the line
``attn list`` shows, and the declared version ranges. The
self-check itself needs CUDA (fla's chunk kernels): the GPU test at the end runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from attn_plugin_triton_ssm import compat

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    compat._State.reset()
    yield
    compat._State.reset()


BOTH_PUBLIC = "fla's public chunk_gated_delta_rule and chunk_kda used"


@pytest.mark.parametrize("version", ["0.7.1", "0.5.9", None])
@pytest.mark.parametrize("kind", compat.KINDS)
def test_another_fla_release_keeps_the_internal_stages_off(monkeypatch, version, kind):
    monkeypatch.setattr(compat, "distribution_version", lambda: version)
    stages, reason = compat.stages(kind)
    assert stages == {} and reason
    if version is None:
        assert reason == "no fla-core distribution found"
    else:
        assert reason == f"fla-core {version} is not a release the slot pass was tested on (0.6.0)"
    assert compat.slot_pass_reason(CUDA, kind) == reason  # no self-check on an untested release
    assert compat._State.check == {}
    assert compat.note() == f"fla stages: GDN and KDA off ({reason}; {BOTH_PUBLIC})"


def test_the_note_imports_nothing_before_the_stages_are_looked_up(monkeypatch):
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # would fail to import
    monkeypatch.setitem(sys.modules, "fla.ops.kda.chunk_intra", None)
    assert compat.note() == (
        "fla stages: GDN and KDA on (fla-core 0.6.0, self-check at first GPU prefill)"
    )
    assert compat._State.reason == {}


@pytest.mark.parametrize(
    ("kind", "module"), [("gdn", "fla.ops.common.chunk_o"), ("kda", "fla.ops.kda.chunk_intra")]
)
def test_internals_that_moved_under_a_tested_version_turn_that_familys_stages_off(
    monkeypatch, kind, module
):
    """One family's internals failing to import leaves the other's on."""
    pytest.importorskip("fla")
    for each in compat.KINDS:  # loaded first: the blocked module is imported by both chains
        compat._import_stages(each)
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    monkeypatch.setitem(sys.modules, module, None)  # import raises
    stages, reason = compat.stages(kind)
    assert stages == {} and reason.startswith("fla-core internals not importable (")
    other = "kda" if kind == "gdn" else "gdn"
    assert compat.stages(other)[1] is None
    public = compat.PUBLIC[kind]
    clause = {
        kind: f"{kind.upper()} off (fla-core internals not importable",
        other: f"{other.upper()} on (fla-core 0.6.0, self-check at first GPU prefill)",
    }
    note = compat.note()
    assert note.startswith("fla stages: " + clause["gdn"]), note
    assert clause["kda"] in note and f"; fla's public {public} used)" in note, note


@pytest.mark.parametrize("kind", compat.KINDS)
@pytest.mark.parametrize("failure", ["outputs differ by 0.5", RuntimeError("boom")])
def test_a_failed_self_check_keeps_that_familys_stages_off_and_says_why(monkeypatch, failure, kind):
    pytest.importorskip("fla")
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    other = "kda" if kind == "gdn" else "gdn"

    def check(device, checked):
        if checked == other:
            return ""
        if isinstance(failure, Exception):
            raise failure
        return failure

    monkeypatch.setattr(compat, "_self_check", check)
    assert compat.stages(kind)[1] is None  # the stages import
    assert compat.slot_pass_reason(torch.device("cpu"), kind) is None  # no self-check off GPU
    why = failure if isinstance(failure, str) else "RuntimeError: boom"
    reason = compat.slot_pass_reason(CUDA, kind)  # runs the (stubbed) self-check once
    assert reason == f"self-check against fla's {compat.PUBLIC[kind]} failed: {why}"
    assert compat.slot_pass_reason(CUDA, other) is None  # the other family's check passed
    clause = {
        kind: f"{kind.upper()} off ({reason}; fla's public {compat.PUBLIC[kind]} used)",
        other: f"{other.upper()} on (fla-core 0.6.0, self-check passed)",
    }
    assert compat.note() == f"fla stages: {clause['gdn']}; {clause['kda']}"
    monkeypatch.setattr(compat, "_self_check", lambda device, kind: pytest.fail("ran twice"))
    assert compat.slot_pass_reason(CUDA, kind) == reason


def test_a_passed_self_check_is_shown(monkeypatch):
    pytest.importorskip("fla")
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    ran = []
    monkeypatch.setattr(compat, "_self_check", lambda device, kind: ran.append(kind) or "")
    assert compat.slot_pass_reason(CUDA, "kda") is None
    assert compat.note() == (
        "fla stages: GDN on (fla-core 0.6.0, self-check at first GPU prefill); "
        "KDA on (fla-core 0.6.0, self-check passed)"
    )
    assert compat.slot_pass_reason(CUDA, "gdn") is None
    assert compat.note() == "fla stages: GDN and KDA on (fla-core 0.6.0, self-check passed)"
    assert ran == ["kda", "gdn"]


@pytest.mark.parametrize("gdn", ["", "outputs differ by 0.5"], ids=["passes", "gdn_fails"])
def test_attn_list_self_check_runs_both_families_checks_at_once(monkeypatch, gdn):
    """``attn list --self-check`` (the plugin's ``attn_core_self_check``) runs each family's
    self-check before any prefill: the note then carries both verdicts, a failure is named."""
    pytest.importorskip("fla")
    from attn_plugin_triton_ssm import plugin

    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    ran = []
    verdicts = {"gdn": gdn, "kda": ""}
    monkeypatch.setattr(
        compat, "_self_check", lambda device, kind: ran.append(kind) or verdicts[kind]
    )
    backend = plugin.Backend(
        name=plugin.BACKEND_NAME, capabilities=plugin.capabilities(interpret=True)
    )
    check = plugin.attn_core_self_check(backend, CUDA)
    assert check is not None and ran == ["gdn", "kda"] and check.notes == compat.note()
    if gdn:
        assert check.failed == (
            "fla stages: GDN: self-check against fla's chunk_gated_delta_rule failed: "
            "outputs differ by 0.5",
        )
        assert "GDN off (self-check against fla's chunk_gated_delta_rule failed" in check.notes
    else:
        assert check.failed == ()
        assert check.notes == "fla stages: GDN and KDA on (fla-core 0.6.0, self-check passed)"
    mamba1 = plugin.Backend(
        name=plugin.MAMBA1_BACKEND_NAME, capabilities=plugin.capabilities(interpret=True)
    )
    assert plugin.attn_core_self_check(mamba1, CUDA) is None  # Mamba1 has no fla stages


def test_attn_list_self_check_has_nothing_to_run_on_another_fla_release(monkeypatch):
    from attn_plugin_triton_ssm import plugin

    monkeypatch.setattr(compat, "distribution_version", lambda: "0.7.1")
    monkeypatch.setattr(compat, "_self_check", lambda device, kind: pytest.fail("ran"))
    backend = plugin.Backend(
        name=plugin.BACKEND_NAME, capabilities=plugin.capabilities(interpret=True)
    )
    assert plugin.attn_core_self_check(backend, CUDA) is None


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match=r"kind must be one of \('gdn', 'kda'\), got 'mamba2'"):
        compat.stages("mamba2")  # type: ignore[arg-type]


def test_the_backend_carries_the_note(monkeypatch):
    from attn_plugin_triton_ssm import plugin

    monkeypatch.setattr(compat, "distribution_version", lambda: "0.7.1")
    seen = []
    plugin.attn_core_register_backends(seen.append)
    by_name = {b.name: b for b in seen}
    assert by_name[plugin.BACKEND_NAME].notes.startswith(
        "fla stages: GDN and KDA off (fla-core 0.7.1 is not a release"
    )
    # the Mamba1 backend runs only its own scan kernel: no fla stage to report
    assert by_name[plugin.MAMBA1_BACKEND_NAME].notes == ""


def test_without_fla_the_backend_leaves_out_the_families_whose_prefill_needs_it(monkeypatch):
    """fla-core not importable at all (a ``--no-deps`` install): Gated DeltaNet and KDA, whose
    prefill runs fla's chunk stages (and their CPU path fla's naive recurrences), are not
    advertised, and the note says why instead of naming public functions that cannot load; the
    other families, our own kernels end to end, stay."""
    import importlib.util

    from attn_plugin_triton_ssm import plugin

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a)
    )
    seen = []
    plugin.attn_core_register_backends(seen.append)
    backend = {b.name: b for b in seen}[plugin.BACKEND_NAME]
    assert {v.value for v in backend.capabilities.linear_variants} == {
        "mamba2", "lightning", "short_conv"
    }  # fmt: skip
    assert backend.notes == (
        "fla-core is not installed (pip install 'fla-core>=0.6.0,<0.7'): gated_deltanet and kda "
        "are not served (their prefill runs fla's chunk stages)"
    )


def test_pyproject_declares_ranges_that_hold_the_tested_releases():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    reqs = {r.name: r for r in map(Requirement, meta["project"]["dependencies"])}
    fla = reqs["fla-core"].specifier
    # what the missing-fla message tells
    assert reqs["fla-core"] == Requirement(compat.REQUIREMENT)
    assert len(fla) == 2 and all(v in fla for v in compat.TESTED_STAGES)  # a range, not a pin
    triton = reqs["triton"].specifier
    assert "3.6.0" in triton and "3.9.0" in triton  # the H200's and the CPU machines'


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", compat.KINDS)
def test_the_self_check_passes_on_this_fla_core(kind):
    """On the installed fla-core: the slot pass agrees with fla's public chunked prefill (or
    the stages are off for a stated reason on an untested release)."""
    pytest.importorskip("fla")
    _, reason = compat.stages(kind)
    if reason:
        pytest.skip(reason)
    assert compat.self_check(CUDA, kind) == ""
    assert compat.slot_pass_reason(CUDA, kind) is None


def test_no_module_but_compat_imports_fla():
    """Every fla-core import of the plugin goes through compat.py (gated, reported)."""
    import re

    package = Path(compat.__file__).parent
    offenders = [
        f"{path.relative_to(package)}:{n}"
        for path in package.rglob("*.py")
        if path.name != "compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*(from fla[. ]|import fla\b)", line)
    ]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------
# Triton internals: the shared-memory limit and a compiled kernel's resources
# ------------------------------------------------------------------------------------------
class _Props:
    """torch's public device properties of an H200-like device."""

    shared_memory_per_block = 48 * 1024
    shared_memory_per_multiprocessor = 228 * 1024


def _triton_says(monkeypatch, get_device_properties):
    triton = pytest.importorskip("triton")
    utils = type("U", (), {"get_device_properties": staticmethod(get_device_properties)})
    active = type("A", (), {"utils": utils})
    monkeypatch.setattr(triton.runtime, "driver", type("D", (), {"active": active})())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())


def test_the_shared_memory_limit_is_tritons_where_it_lies_within_torchs_public_bounds(
    monkeypatch,
):
    _triton_says(monkeypatch, lambda index: {"max_shared_mem": 227 * 1024})
    assert compat.max_shared_memory(0) == 227 * 1024
    assert compat.triton_note() == "" and "shared-memory" not in compat.note()


@pytest.mark.parametrize(
    ("says", "why"),
    [
        ({"max_shared_mem": 300 * 1024}, "Triton says 307200 bytes, outside torch's 49152..233472"),
        ({"max_shared_mem": 1024}, "Triton says 1024 bytes, outside torch's 49152..233472"),
        ({"renamed": 1}, "Triton's device properties unreadable: KeyError: 'max_shared_mem'"),
    ],
)
def test_a_shared_memory_limit_triton_cannot_give_falls_back_to_torchs_and_attn_list_says_so(
    monkeypatch, says, why
):
    _triton_says(monkeypatch, lambda index: says)
    assert compat.max_shared_memory(1) == 48 * 1024  # smaller tiles, never one that cannot fit
    expected = f"cuda:1 shared-memory limit: torch's public per-block limit used ({why})"
    assert compat.triton_note() == expected
    assert compat.note().endswith("; " + expected)


@pytest.mark.parametrize("release", ["3.5.1", "3.10.0", "4.0.0", "not-a-version"])
def test_a_triton_release_outside_the_checked_ones_reads_no_internals(monkeypatch, release):
    """Triton's driver utilities and a compiled kernel's ``metadata`` are read only on the
    releases they were checked on: on another, the public fallback serves (torch's per-block
    limit, the smallest tiling) and ``attn list`` says which release and why, even where the
    internal read would have given a plausible number."""
    triton = pytest.importorskip("triton")
    _triton_says(monkeypatch, lambda index: {"max_shared_mem": 227 * 1024})
    monkeypatch.setattr(triton, "__version__", release)
    why = (
        f"Triton {release} is not a release these reads were checked on "
        f"({compat.TESTED_TRITON[0]}-{compat.TESTED_TRITON[-1]})"
    )
    assert compat.max_shared_memory(2) == 48 * 1024
    compiled = type("K", (), {"metadata": type("M", (), {"shared": 1024})()})()
    assert compat.kernel_shared_memory(compiled) is None
    assert compat.triton_note() == (
        f"cuda:2 shared-memory limit: torch's public per-block limit used ({why}); "
        f"kernel shared memory unreadable: the smallest tiling used ({why})"
    )


def test_a_checked_triton_release_reads_a_compiled_kernels_shared_memory(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", compat.TESTED_TRITON[-1] + ".0")
    compiled = type("K", (), {"metadata": type("M", (), {"shared": 1024})()})()
    assert compat.kernel_shared_memory(compiled) == 1024
    assert compat.triton_note() == ""


def test_tensor_version_counts_in_place_changes_and_is_none_without_the_counter():
    """The lightning slope check's key: torch's in-place counter moves on ``add_`` and not on a
    read; an object without one (another torch) gives None, not an error."""
    t = torch.ones(3)
    before = compat.tensor_version(t)
    assert isinstance(before, int)
    assert compat.tensor_version(t) == before
    t.add_(1)
    assert compat.tensor_version(t) == before + 1

    class NoCounter:
        pass

    assert compat.tensor_version(NoCounter()) is None  # type: ignore[arg-type]
