"""Comparisons with explicit per-dtype tolerances, and the failures the kit raises.

Every message says what was compared, where it first differs, the tolerance, and the seed, so a
vendor can reproduce one failure with ``--attn-seed``.
"""

from __future__ import annotations

import torch

from attn_core.specs import LayerSpec

__all__ = [
    "FP32_STATE_RTOL",
    "NAN_POISON",
    "SENTINEL",
    "BackendRaised",
    "ConformanceFailure",
    "ReferenceRaised",
    "assert_close",
    "assert_equal_state",
    "assert_unchanged",
    "ssm_state_tolerance",
    "tolerance",
]

#: out is filled with NaN before each call: an element the backend never writes stays NaN.
NAN_POISON = float("nan")
#: guard regions around out hold this value (exact in every float dtype).
SENTINEL = 31.0

#: (atol, rtol) of outputs per layer dtype, ``|a - b| <= atol + rtol * |b|``.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (2e-4, 2e-4),
    "bfloat16": (2.5e-2, 2.5e-2),
    "float16": (5e-3, 5e-3),
}
#: fp8 KV: both sides read the same quantized cache, but the kernel may dequantize differently.
FP8_KV_TOLERANCE = (6e-2, 6e-2)
#: linear layers accumulate state over many tokens: a little more room.
LINEAR_FACTOR = 2.0
#: float32 linear layers: chunked kernels (fla's, on tensor cores) run their float32 dots in
#: TF32 (10-bit mantissa). On the H200, triton_ssm's fp32 prefill differed from the reference by
#: up to 6.0e-4 on outputs of ~0.2 (page_boundary workload): beyond (4e-4, 4e-4), within this.
LINEAR_FP32_TOLERANCE = (1e-3, 1e-3)
#: 16-bit recurrent state: both sides round the state every step, and an output read from a
#: state one bf16 ulp (2^-8 relative) apart differs by about that much (H200: 1.3e-3 at 0.26).
LINEAR_16BIT_STATE_TOLERANCE = (8e-3, 8e-3)
#: a float32 SSM state after one decode step from the same state on both sides: relative
#: 2^-11, four times finer than a bfloat16 rounding (2^-9), as coarse as TF32 (10-bit mantissa)
#: arithmetic; the absolute floor is that fraction of the pool's mean magnitude
FP32_STATE_RTOL = 2.0**-11


class ConformanceFailure(AssertionError):
    """The backend's result differs from the reference (or breaks a contract)."""


class BackendRaised(Exception):
    """The backend under test raised while running a configuration it advertised."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"the backend raised in {stage}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


class ReferenceRaised(Exception):
    """The reference itself cannot run this configuration: the item is skipped, not failed."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(
            f"the reference cannot run this configuration ({stage}): {type(cause).__name__}: "
            f"{cause}"
        )


def tolerance(spec: LayerSpec) -> tuple[float, float]:
    """(atol, rtol) for outputs of layers of ``spec``."""
    atol, rtol = TOLERANCES[spec.dtype]
    if spec.kv_dtype == "fp8_e4m3":
        atol, rtol = max(atol, FP8_KV_TOLERANCE[0]), max(rtol, FP8_KV_TOLERANCE[1])
    if spec.has_recurrent_state:
        atol, rtol = atol * LINEAR_FACTOR, rtol * LINEAR_FACTOR
        floor = (0.0, 0.0)
        if spec.dtype == "float32":
            floor = LINEAR_FP32_TOLERANCE
        if spec.state_dtype in ("bfloat16", "float16"):
            floor = max(floor, LINEAR_16BIT_STATE_TOLERANCE)
        atol, rtol = max(atol, floor[0]), max(rtol, floor[1])
    return atol, rtol


def ssm_state_tolerance(spec: LayerSpec, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for a linear layer's SSM state pool stored in ``dtype``: five times the
    output tolerance (the state integrates every step's rounding), and at least 2 ulps of a
    16-bit state (both sides round an fp32 update into it every step; summing in another order
    moves the result across a rounding boundary)."""
    atol, rtol = tolerance(spec)
    atol, rtol = atol * 5, rtol * 5
    if dtype in (torch.bfloat16, torch.float16):
        ulp = torch.finfo(dtype).eps
        atol, rtol = max(atol, 2 * ulp), max(rtol, 2 * ulp)
    return atol, rtol


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    what: str,
    where: str,
) -> None:
    """Raise :class:`ConformanceFailure` unless ``actual`` matches ``expected``.

    NaN in ``actual`` where ``expected`` is finite is reported apart: an element never written
    (outputs are NaN-poisoned before the call) or one computed as NaN (an overflow, say).
    """
    if actual.shape != expected.shape:
        raise ConformanceFailure(
            f"{what}: shape {tuple(actual.shape)}, the reference has {tuple(expected.shape)} "
            f"({where})"
        )
    a = actual.detach().float().cpu()
    b = expected.detach().float().cpu()
    unwritten = torch.isnan(a) & ~torch.isnan(b)
    if unwritten.any():
        n = int(unwritten.sum())
        first = _index(int(unwritten.flatten().nonzero()[0]), a.shape)
        raise ConformanceFailure(
            f"{what}: {n} of {a.numel()} elements are NaN where the reference is finite (never "
            f"written, as out was NaN-poisoned before the call, or computed as NaN), first at "
            f"{list(first)} ({where})"
        )
    diff = (a - b).abs()
    bad = ~(diff <= atol + rtol * b.abs()) & ~(torch.isnan(a) & torch.isnan(b))
    if bad.any():
        n = int(bad.sum())
        worst = int(torch.where(bad, diff.nan_to_num(float("inf")), -1.0).flatten().argmax())
        idx = _index(worst, a.shape)
        raise ConformanceFailure(
            f"{what} differs from the reference: {n} of {a.numel()} elements out of tolerance "
            f"(atol={atol:g}, rtol={rtol:g}); worst at {list(idx)}: got {a[idx].item():.6g}, "
            f"expected {b[idx].item():.6g}; max |diff| {diff.nan_to_num(float('inf')).max():.3g} "
            f"({where})"
        )


def assert_equal_state(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    where: str,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> None:
    """Compare persistent state (KV pages, conv / SSM slots) of the two sides.

    Exact for copies (``atol = rtol = 0``); fp8 and recurrent state get a tolerance. The first
    index names ``[page, offset, ...]`` for KV and ``[slot, ...]`` for linear state, so a write
    outside ``slot_mapping`` / ``state_indices`` shows where it landed.
    """
    if atol == 0.0 and rtol == 0.0 and actual.dtype == expected.dtype:
        same = (
            actual.view(torch.uint8) == expected.view(torch.uint8)
            if actual.dtype in (torch.float8_e4m3fn,)
            else (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
        )
        if bool(same.all()):
            return
        first = _index(int((~same).flatten().nonzero()[0]), same.shape)
        raise ConformanceFailure(
            f"{what} differs from the reference's at {list(first)}: got "
            f"{actual[first].float().item():.6g}, expected {expected[first].float().item():.6g} "
            f"(a wrong value, or a write outside the step's slots) ({where})"
        )
    assert_close(actual, expected, atol=atol, rtol=rtol, what=what, where=where)


def assert_unchanged(
    region: torch.Tensor, value: float | torch.Tensor, *, what: str, where: str
) -> None:
    """``region`` must still hold ``value`` (a guard region, an input the backend must keep)."""
    expected = value if isinstance(value, torch.Tensor) else torch.full_like(region, value)
    same = (region == expected) | (torch.isnan(region) & torch.isnan(expected))
    if bool(same.all()):
        return
    n = int((~same).sum())
    first = _index(int((~same).flatten().nonzero()[0]), same.shape)
    raise ConformanceFailure(
        f"{what}: {n} elements were overwritten, first at {list(first)} "
        f"(now {region[first].float().item():.6g}) ({where})"
    )
