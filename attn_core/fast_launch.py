"""Launch a Triton kernel without ``JITFunction.run``'s per-call work after the first call.

Used by the core's K/V write kernel and by plugins' kernels (FlashInfer's small_decode).

Why: on the H200 server's host a Triton launch through ``kernel[grid](...)`` cost 100-150 us of
host time (session 8; two ``index_copy_`` launches took 46 us), which decides a host-bound eager
decode step of one request. The call binds and specialises every argument, hashes the result
into a cache key and looks the compiled kernel up. :class:`CachedLaunch` does that once per
*argument key* and afterwards calls the :class:`triton.compiler.CompiledKernel` the first call
returned.

The key is finer than Triton's specialisation, so a cached kernel is never launched with
arguments it was not compiled for: each tensor's dtype and whether its address is 16-byte
aligned (what Triton specialises pointers on), every other argument's exact value (Triton
specialises integers on ``== 1``, 16-divisibility and range, constexprs on their value), the
warps, stages, programmatic dependent launch and the device (a compiled kernel's handle belongs
to one device's context).

A cached launch calls the compiled kernel's C launcher directly, as Triton's own
``CompiledKernel[grid]`` runner does, minus that runner's per-call work (a closure, the device
and stream lookups, launch metadata for hooks that are not set), and hands it the tensors'
addresses as integers: given a tensor the launcher calls ``data_ptr()`` and asks the driver
whether the address is a device pointer, per tensor, per launch. Where a launch hook is set, the
tensors' device is not the current one, or this Triton's runner does not look as expected, the
cached kernel is launched through that runner instead.

Under Triton's interpreter (CPU tests) a launch returns no compiled kernel, and every call goes
through ``kernel[grid](...)``.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import torch
from triton import knobs

__all__ = ["MAX_KEYS", "CachedLaunch"]


#: Keys kept per kernel before the cache starts over: a caller whose arguments keep changing
#: (views at ever new offsets, say) costs a Triton launch per new key, never unbounded memory.
MAX_KEYS = 256


@functools.cache
def _runner_calls_run_as_expected() -> bool:
    """Whether this Triton's ``CompiledKernel[grid]`` runner launches through
    ``self.run(g0, g1, g2, stream, self.function, self.packed_metadata, launch_metadata,
    enter_hook, exit_hook, *args)`` (Triton 3.3-3.9): the call a cached launch makes itself."""
    try:
        from triton.compiler.compiler import CompiledKernel

        src = inspect.getsource(CompiledKernel.__getitem__)
    except (ImportError, OSError, TypeError):
        return False
    return "self.function, self.packed_metadata, launch_metadata" in src


def _hooks_set() -> bool:
    """Whether a launch enter or exit hook is set (Triton 3.9 keeps an empty ``HookChain``
    where older versions keep None)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class _Entry:
    """A compiled kernel and, where the direct call applies, its launcher's fixed arguments."""

    __slots__ = ("compiled", "function", "metadata", "run")

    def __init__(self, compiled: Any, direct: bool) -> None:
        self.compiled = compiled
        self.run = compiled.run if direct else None
        self.function = compiled.function if direct else None
        self.metadata = compiled.packed_metadata if direct else None


class CachedLaunch:
    """A ``@triton.jit`` function launched through a cache of its compiled kernels.

    ``launch(grid, tensors, scalars, num_warps=..., num_stages=...)`` takes every parameter of
    the kernel positionally, constexprs included, in the signature's order: first its leading
    tensors, then the rest (split so that building the key needs no type test per argument).
    """

    #: ``device index -> raw current stream`` and ``() -> current device index``; tests swap
    #: them for stand-ins.
    current_stream = staticmethod(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    current_device = staticmethod(getattr(torch._C, "_cuda_getDevice", None))

    def __init__(self, fn: Any, unkeyed_tail: int = 0) -> None:
        """
        :param unkeyed_tail: how many of the last scalars stay out of the key: parameters the
            kernel names in ``do_not_specialize`` (one compiled kernel serves every value).
        """
        self.fn = fn
        self._keyed = slice(None, -unkeyed_tail if unkeyed_tail else None)
        self._compiled: dict[tuple, _Entry] = {}
        #: False: every launch goes through ``fn[grid](...)`` (benchmarks compare the two).
        self.enabled = True

    def launch(self, grid: tuple[int, ...], tensors: Sequence[torch.Tensor],
               scalars: Sequence[Any], *, num_warps: int, num_stages: int,
               launch_pdl: bool = False) -> None:  # fmt: skip
        """Launch on the current device (as for any Triton launch).

        :param tensors: the kernel's leading tensor parameters, in order.
        :param scalars: every parameter after them (numbers, constexprs), in order.
        :param launch_pdl: launch as a programmatic dependent of the stream's previous kernel
            (Triton's ``launch_pdl``; the kernel must wait on it with ``gdc_wait``).
        """
        if not self.enabled:
            self._jit(grid, tensors, scalars, num_warps, num_stages, launch_pdl)
            return
        ptrs = [t.data_ptr() for t in tensors]
        # Triton specialises a pointer on 16-byte alignment: one OR over all of them decides
        # the common case (all aligned) without a per-tensor term in the key.
        align = (
            tuple(p & 15 == 0 for p in ptrs) if functools.reduce(operator.or_, ptrs) & 15 else ()
        )
        device = tensors[0].get_device()
        key = (
            num_warps,
            num_stages,
            launch_pdl,
            device,
            align,
            *[t.dtype for t in tensors],
            *scalars[self._keyed],
        )
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self._jit(grid, tensors, scalars, num_warps, num_stages, launch_pdl)
            if callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
                if len(self._compiled) >= MAX_KEYS:
                    self._compiled.clear()
                direct = _runner_calls_run_as_expected() and hasattr(compiled, "packed_metadata")
                self._compiled[key] = _Entry(compiled, direct)
            return
        g = (*grid, 1, 1)  # the launcher reads grid[0..2]; Triton's own call pads a short grid
        if entry.run is not None and device == self.current_device() and not _hooks_set():
            entry.run(g[0], g[1], g[2], self.current_stream(device), entry.function,
                      entry.metadata, None, None, None, *ptrs, *scalars)  # fmt: skip
        else:
            entry.compiled[g[:3]](*tensors, *scalars)

    def _jit(self, grid, tensors, scalars, num_warps, num_stages, launch_pdl) -> Any:
        extra = {"launch_pdl": True} if launch_pdl else {}
        return self.fn[grid](
            *tensors, *scalars, num_warps=num_warps, num_stages=num_stages, **extra
        )

    def clear(self) -> None:
        """Forget the compiled kernels (the next launch of each key goes through Triton)."""
        self._compiled.clear()
