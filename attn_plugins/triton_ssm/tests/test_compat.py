"""fla-core compat (``attn_plugin_triton_ssm.compat``): the version gate on fla's internal stages,
the self-check's verdict, the line ``attn list`` shows, and the declared version ranges. The
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


@pytest.mark.parametrize("version", ["0.7.1", "0.5.9", None])
def test_another_fla_release_keeps_the_internal_stages_off(monkeypatch, version):
    monkeypatch.setattr(compat, "distribution_version", lambda: version)
    stages, reason = compat.stages()
    assert stages == {} and reason
    if version is None:
        assert reason == "no fla-core distribution found"
    else:
        assert reason == f"fla-core {version} is not a release the slot pass was tested on (0.6.0)"
    assert compat.slot_pass_reason(CUDA) == reason  # no self-check on an untested release
    assert compat._State.check is None
    assert compat.note() == f"fla stages: off ({reason}; fla's public chunk_gated_delta_rule used)"


def test_the_note_imports_nothing_before_the_stages_are_looked_up(monkeypatch):
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # would fail to import
    assert compat.note() == "fla stages: on (fla-core 0.6.0, self-check at first GPU prefill)"
    assert compat._State.reason is None


def test_internals_that_moved_under_a_tested_version_turn_the_stages_off(monkeypatch):
    pytest.importorskip("fla")
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # import raises
    stages, reason = compat.stages()
    assert stages == {} and reason.startswith("fla-core internals not importable (")
    assert compat.note().startswith("fla stages: off (fla-core internals not importable")


@pytest.mark.parametrize("failure", ["outputs differ by 0.5", RuntimeError("boom")])
def test_a_failed_self_check_keeps_the_stages_off_and_says_why(monkeypatch, failure):
    pytest.importorskip("fla")
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")

    def check(device):
        if isinstance(failure, Exception):
            raise failure
        return failure

    monkeypatch.setattr(compat, "_self_check", check)
    assert compat.stages()[1] is None  # the stages import
    assert compat.slot_pass_reason(torch.device("cpu")) is None  # no self-check off the GPU
    why = failure if isinstance(failure, str) else "RuntimeError: boom"
    reason = compat.slot_pass_reason(CUDA)  # runs the (stubbed) self-check once
    assert reason == f"self-check against fla's chunk_gated_delta_rule failed: {why}"
    assert compat.note() == f"fla stages: off ({reason}; fla's public chunk_gated_delta_rule used)"
    monkeypatch.setattr(compat, "_self_check", lambda device: pytest.fail("ran twice"))
    assert compat.slot_pass_reason(CUDA) == reason


def test_a_passed_self_check_is_shown(monkeypatch):
    pytest.importorskip("fla")
    monkeypatch.setattr(compat, "distribution_version", lambda: "0.6.0")
    monkeypatch.setattr(compat, "_self_check", lambda device: "")
    assert compat.slot_pass_reason(CUDA) is None
    assert compat.note() == "fla stages: on (fla-core 0.6.0, self-check passed)"


def test_the_backend_carries_the_note(monkeypatch):
    from attn_plugin_triton_ssm import plugin

    monkeypatch.setattr(compat, "distribution_version", lambda: "0.7.1")
    seen = []
    plugin.attn_core_register_backends(seen.append)
    by_name = {b.name: b for b in seen}
    assert by_name[plugin.BACKEND_NAME].notes.startswith(
        "fla stages: off (fla-core 0.7.1 is not a release"
    )
    # the Mamba1 backend runs only its own scan kernel: no fla stage to report
    assert by_name[plugin.MAMBA1_BACKEND_NAME].notes == ""


def test_pyproject_declares_ranges_that_hold_the_tested_releases():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    reqs = {r.name: r for r in map(Requirement, meta["project"]["dependencies"])}
    fla = reqs["fla-core"].specifier
    assert len(fla) == 2 and all(v in fla for v in compat.TESTED_STAGES)  # a range, not a pin
    triton = reqs["triton"].specifier
    assert "3.6.0" in triton and "3.9.0" in triton  # the H200's and the CPU machines'


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_self_check_passes_on_this_fla_core():
    """On the installed fla-core: the slot pass agrees with fla's public chunked prefill (or
    the stages are off for a stated reason on an untested release)."""
    pytest.importorskip("fla")
    _, reason = compat.stages()
    if reason:
        pytest.skip(reason)
    assert compat.self_check(CUDA) == ""
    assert compat.slot_pass_reason(CUDA) is None


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
