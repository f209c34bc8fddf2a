"""Programmatic dependent launch (PDL) for the Triton kernels of attn-core and its plugins.

Why: in a captured decode step each kernel waits for the one before it to finish, drain and
flush before it even starts to launch, a gap of a microsecond or two that a step of a few
requests pays per kernel (FlashInfer's own kernels launch this way: two of them back to back
overlap the gap). With PDL (sm90+) a kernel is launched as a *programmatic dependent* of the
stream's previous kernel: it may start as soon as every program of that kernel has signalled
``gdc_launch_dependents``, and blocks in ``gdc_wait`` until that kernel has completed and its
writes are visible. So a kernel launched this way must call :func:`gdc_wait` before it reads
anything an earlier kernel wrote; calling :func:`gdc_launch_dependents` right after lets the
next kernel's launch overlap this one's work. Both are no-ops without PDL.

``ATTN_PDL=0`` turns it off (every kernel then waits for its predecessor as usual); Triton's
CPU interpreter and devices below sm90 never use it.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["ENV_VAR", "gdc_launch_dependents", "gdc_wait", "pdl_enabled"]

ENV_VAR = "ATTN_PDL"

try:  # importable without Triton (CPU installs): kernels that use these import Triton anyway
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without the griddepcontrol builtins: PDL stays off
    gdc_launch_dependents = gdc_wait = None


def pdl_enabled(device: torch.device | int) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents: a CUDA device of compute
    capability 9.0 or newer, a Triton with ``gdc_wait``, not the interpreter, and ``ATTN_PDL``
    not ``0`` (read per call, so benchmarks can compare)."""
    if os.environ.get(ENV_VAR, "1") == "0" or gdc_wait is None:
        return False
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return False
        device = device.index if device.index is not None else torch.cuda.current_device()
    return device >= 0 and _sm90_or_newer(device)


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    import triton

    if triton.knobs.runtime.interpret:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9
