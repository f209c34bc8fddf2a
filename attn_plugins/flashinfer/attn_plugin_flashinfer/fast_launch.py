"""Launch a Triton kernel without ``JITFunction.run``'s per-call work after the first call.

Why: on the H200 server's host a Triton launch through ``kernel[grid](...)`` cost 100-150 us of
host time (session 8; two ``index_copy_`` launches took 46 us), which decides a host-bound eager
decode step of one request. The call binds and specialises every argument, hashes the result
into a cache key and looks the compiled kernel up. :class:`CachedLaunch` does that once per
*argument key* and afterwards launches the :class:`triton.compiler.CompiledKernel` the first
call returned, through its own ``kernel[grid](*args)`` launcher.

The key is finer than Triton's specialisation, so a cached kernel is never launched with
arguments it was not compiled for: each tensor's dtype and ``data_ptr() % 256`` (Triton
specialises on 16-byte alignment) and every other argument's exact value (Triton specialises
integers on ``== 1``, 16-divisibility and range, constexprs on their value), the warps, stages
and the tensors' device (a compiled kernel's handle belongs to one device's context).

Under Triton's interpreter (CPU tests) a launch returns no compiled kernel, and every call goes
through ``kernel[grid](...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CachedLaunch"]


#: Keys kept per kernel before the cache starts over: a caller whose arguments keep changing
#: (views at ever new offsets, say) costs a Triton launch per new key, never unbounded memory.
MAX_KEYS = 256


class CachedLaunch:
    """A ``@triton.jit`` function launched through a cache of its compiled kernels.

    ``launch(grid, tensors, scalars, num_warps=..., num_stages=...)`` takes every parameter of
    the kernel positionally, constexprs included, in the signature's order: first its leading
    tensors, then the rest (split so that building the key needs no type test per argument).
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple, Any] = {}
        #: False: every launch goes through ``fn[grid](...)`` (benchmarks compare the two).
        self.enabled = True

    def launch(self, grid: tuple[int, ...], tensors: Sequence[torch.Tensor],
               scalars: Sequence[Any], *, num_warps: int, num_stages: int) -> None:  # fmt: skip
        """Launch on ``tensors[0]``'s device (the current one, as for any Triton launch).

        :param tensors: the kernel's leading tensor parameters, in order.
        :param scalars: every parameter after them (numbers, constexprs), in order.
        """
        args = (*tensors, *scalars)
        if not self.enabled:
            self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
            return
        key = (
            num_warps,
            num_stages,
            tensors[0].get_device(),
            *[(t.dtype, t.data_ptr() & 255) for t in tensors],
            *scalars,
        )
        compiled = self._compiled.get(key)
        if compiled is not None:
            # CompiledKernel's launcher reads grid[0..2]; Triton's own call pads a shorter grid
            compiled[(*grid, 1, 1)[:3]](*args)
            return
        compiled = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
            if len(self._compiled) >= MAX_KEYS:
                self._compiled.clear()
            self._compiled[key] = compiled

    def clear(self) -> None:
        """Forget the compiled kernels (the next launch of each key goes through Triton)."""
        self._compiled.clear()
