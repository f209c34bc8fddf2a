"""attn_core.pdl: which launches are programmatic dependents."""

from __future__ import annotations

import pytest
import torch

from attn_core import pdl


@pytest.fixture
def sm(monkeypatch):
    """Pretend device ``i`` has compute capability ``(major[i], 0)``."""
    majors = {0: 9, 1: 8}
    pdl._sm90_or_newer.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (majors[i], 0))
    monkeypatch.setattr("triton.knobs.runtime.interpret", False)
    monkeypatch.delenv(pdl.ENV_VAR, raising=False)
    yield
    pdl._sm90_or_newer.cache_clear()


@pytest.mark.skipif(pdl.gdc_wait is None, reason="this Triton has no griddepcontrol builtins")
def test_only_sm90_cuda_devices_launch_as_dependents_unless_turned_off(sm, monkeypatch):
    assert pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.pdl_enabled(0)
    assert not pdl.pdl_enabled(torch.device("cuda", 1))  # sm80
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert not pdl.pdl_enabled(-1)  # a CPU tensor's get_device()
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.pdl_enabled(0)


def test_never_under_the_interpreter(sm, monkeypatch):
    monkeypatch.setattr("triton.knobs.runtime.interpret", True)
    assert not pdl.pdl_enabled(0)
