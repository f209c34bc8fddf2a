"""Shared checks for the kernel wrappers: shapes, dtypes and devices, with messages that say what
was expected and what came.

The checks run on the host from tensor metadata only; none of them reads tensor values (that
would synchronise the device and break CUDA-graph capture).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from triton import knobs

from attn_plugin_triton_ssm import compat

__all__ = [
    "INTERPRETED",
    "check_dtype",
    "check_last_contiguous",
    "check_same_device",
    "check_shape",
    "first_that_fits",
    "max_shared_memory",
    "next_pow2",
]

#: True when the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` was set
#: before this package was imported). Interpreted kernels take CPU tensors; compiled ones CUDA.
INTERPRETED: bool = bool(knobs.runtime.interpret)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)
T = TypeVar("T")


# next_pow2 and cdiv: Triton's own (triton.next_power_of_2, triton.cdiv) in plain Python. The
# wrappers size tiles and grids with them on every launch, and newer Triton releases wrap theirs
# as constexpr functions that cost microseconds a call (a GDN decode call's host time, the
# launch aside, went from 41 to 35 us without them).


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0)."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-int(a) // int(b))


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on a CUDA ``device`` (opt-in maximum; read
    through :func:`attn_plugin_triton_ssm.compat.max_shared_memory`)."""
    return compat.max_shared_memory(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def first_that_fits(candidates: Sequence[T], compile_one: Callable[[T], Any],
                    device: torch.device, what: str, labels: str) -> T:  # fmt: skip
    """The first of ``candidates`` (tilings, best first, the smallest last) whose kernel,
    compiled by ``compile_one(candidate)`` (a Triton ``warmup``: nothing is launched or
    written), fits in the shared memory one block may use on ``device``. Where the installed
    Triton does not report a kernel's bytes, the last candidate.

    :raises ValueError: none fits; the message gives ``what``, the limit and each candidate's
        bytes (``labels`` names the candidate's fields).
    """
    limit = max_shared_memory(device)
    needed = {}
    for candidate in candidates:
        shared = compat.kernel_shared_memory(compile_one(candidate))
        if shared is None:
            return candidates[-1]
        needed[candidate] = shared
        if shared <= limit:
            return candidate
    raise ValueError(
        f"{what} fits in {limit} bytes of shared memory per block (bytes needed by {labels}: "
        f"{needed})"
    )


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str) -> None:
    """Raise ``ValueError`` unless ``t.shape`` matches ``expected`` (``None`` matches any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {what}, got {type(t).__name__}")
    ok = t.dim() == len(expected) and all(
        e is None or s == e for s, e in zip(t.shape, expected, strict=True)
    )
    if not ok:
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name}: expected shape [{shown}] {what}, got {list(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise TypeError(
            f"{name}: expected dtype in {[str(d).removeprefix('torch.') for d in allowed]}, "
            f"got {str(t.dtype).removeprefix('torch.')}"
        )


def check_float(name: str, t: torch.Tensor) -> None:
    check_dtype(name, t, _FLOAT_DTYPES)


def check_last_contiguous(name: str, t: torch.Tensor, ndims: int = 1) -> None:
    """The kernels take arbitrary outer strides but need the last ``ndims`` dims packed."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - ndims, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            raise ValueError(
                f"{name}: the last {ndims} dim(s) must be contiguous (strides of a packed "
                f"tensor), got strides {list(t.stride())} for shape {list(t.shape)}; "
                f"pass {name}.contiguous()"
            )
        expected *= t.shape[d]


def check_same_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """All given tensors on one device, and one the kernels can run on; returns it."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} is on {dev} but {first_name} is on {first}; all tensors must share "
                "one device"
            )
    if INTERPRETED and first.type != "cpu":
        raise ValueError(
            f"the kernels were built for the Triton interpreter (TRITON_INTERPRET=1) and take "
            f"CPU tensors, got tensors on {first}"
        )
    if not INTERPRETED and first.type != "cuda":
        raise ValueError(
            f"the compiled Triton kernels need CUDA tensors, got tensors on {first}; set "
            "TRITON_INTERPRET=1 before importing triton to run them on CPU"
        )
    return first


def check_index(name: str, t: torch.Tensor, batch: int) -> None:
    check_shape(name, t, [batch], "(int32, one entry per request)")
    check_dtype(name, t, (torch.int32, torch.int64))
