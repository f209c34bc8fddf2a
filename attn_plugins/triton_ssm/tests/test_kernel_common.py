"""The kernels' shared host helpers (``kernels/_common.py``)."""

from __future__ import annotations

import triton
from attn_plugin_triton_ssm.kernels._common import cdiv, next_pow2


def test_next_pow2_is_tritons_next_power_of_2():
    """The tile sizes every wrapper derives on each call: the same as Triton's own function
    (which newer Triton releases wrap as a constexpr function, microseconds a call), from 0
    through sizes past any head dimension, and for a tensor-shape int that is not a Python int."""
    import torch

    for n in range(0, 4100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(torch.Size([1000])[0]) == 1024
    assert type(next_pow2(torch.tensor(5).item())) is int


def test_cdiv_is_tritons_cdiv():
    """The grids every wrapper derives on each call: ``ceil(a / b)`` as Triton computes it."""
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
