"""Launch a Triton kernel without ``JITFunction.run``'s per-call work after the first call.

Used by the core's K/V write kernel and by plugins' kernels (FlashInfer's small_decode).

Why: on the H200 server's host a Triton launch through ``kernel[grid](...)`` cost 100-150 us of
host time (two ``index_copy_`` launches took 46 us), which decides a host-bound eager decode step
of one request. The call binds and specialises every argument, hashes the result
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

A caller that launches one shape many times goes one step further with :meth:`CachedLaunch.bind`:
a :class:`BoundLaunch` fixes grid and scalars, takes only the stream and the addresses, and where
the launcher's form is known calls the C function under Triton's launcher object (whose Python
``__call__`` only allocates scratch memory such kernels lack). It checks nothing: the caller
checks alignment, device and hooks, once for all its launches of a step. H200 host time per
eager small_decode step of one request (two launches): 13.9 us bound, 15.8 through the launcher
objects, 30.0 through this class's per-launch keys, 40.5 through Triton's launcher.

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

__all__ = ["MAX_KEYS", "BoundLaunch", "CachedLaunch"]


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


#: The C launch call inside the ``__call__`` of Triton's CUDA launcher (``CompiledKernel.run``),
#: whitespace removed, by form: ``"tuple"`` (Triton 3.9: the kernel's arguments as one tuple
#: after the launcher's annotations) and ``"star"`` (Triton 3.6, the H200's, and older: the
#: runner's arguments spread).
_C_LAUNCH_CALLS = {
    "tuple": (
        "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,"
        "self.launch_pdl,kernel_metadata,launch_metadata,launch_enter_hook,launch_exit_hook,"
        "global_scratch,profile_scratch,self.arg_annotations,self.kernel_signature,{args})"
    ),
    "star": (
        "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,"
        "self.launch_pdl,global_scratch,profile_scratch,*args)"
    ),
}


@functools.cache
def _launcher_form(launcher_cls: type) -> str | None:
    """Which of :data:`_C_LAUNCH_CALLS` the launcher's ``__call__`` makes (None: unknown, or a
    launcher with paths of its own, such as TVM-FFI's): then a bound launch may call the C
    function itself. The rest of that ``__call__`` allocates scratch memory, which a kernel
    without scratch (checked per kernel, :func:`_c_launch`) does not need."""
    try:
        src = "".join(inspect.getsource(launcher_cls.__call__).split())
    except (OSError, TypeError, AttributeError):
        return None
    if "tvmffi" in src:
        return None
    for form, call in _C_LAUNCH_CALLS.items():
        if form == "tuple":
            if any(call.format(args=a) in src for a in ("args", "kernel_args")):
                return form
        elif call in src:
            return form
    return None


def _c_launch(run: Any) -> tuple[str, Any] | None:
    """``(form, C launch function)`` of a compiled kernel's launcher, where a bound launch may
    call it directly: a known :func:`_launcher_form`, no global or profile scratch, no GSan."""
    # a class is hashable; mypy does not match type[...] against Hashable
    form = _launcher_form(type(run))  # type: ignore[arg-type]
    if (
        form is None
        or getattr(run, "global_scratch_size", 1) != 0
        or getattr(run, "profile_scratch_size", 1) != 0
        or getattr(run, "gsan_enabled", False)
        or not callable(getattr(run, "launch", None))
    ):
        return None
    return form, run.launch


def _hooks_set() -> bool:
    """Whether a launch enter or exit hook is set (Triton 3.9 keeps an empty ``HookChain``
    where older versions keep None)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _no_cuda(*args: object) -> int:
    """Stands in for torch's raw current-stream / current-device calls in a build without CUDA
    (where no compiled kernel is launched directly)."""
    raise RuntimeError("this torch build has no CUDA: no current CUDA stream or device")


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
    current_stream = staticmethod(getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda))
    current_device = staticmethod(getattr(torch._C, "_cuda_getDevice", _no_cuda))

    def __init__(self, fn: Any, unkeyed_tail: int = 0) -> None:
        """
        :param unkeyed_tail: how many of the last scalars stay out of the key: parameters the
            kernel names in ``do_not_specialize`` (one compiled kernel serves every value).
        """
        self.fn = fn
        self._keyed = slice(None, -unkeyed_tail if unkeyed_tail else None)
        self._compiled: dict[tuple[Any, ...], _Entry] = {}
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
        device = tensors[0].get_device()
        key = self._key(ptrs, tensors, scalars, num_warps, num_stages, launch_pdl, device)
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
        if entry.run is not None and self.direct_ok(device):
            entry.run(g[0], g[1], g[2], self.current_stream(device), entry.function,
                      entry.metadata, None, None, None, *ptrs, *scalars)  # fmt: skip
        else:
            entry.compiled[g[:3]](*tensors, *scalars)

    def bind(self, grid: tuple[int, ...], tensors: Sequence[torch.Tensor],
             scalars: Sequence[Any], *, num_warps: int, num_stages: int,
             launch_pdl: bool = False) -> BoundLaunch | None:  # fmt: skip
        """The compiled kernel a :meth:`launch` of these arguments calls, with ``grid`` and
        ``scalars`` fixed (:class:`BoundLaunch`), for a caller that launches one shape many
        times and checks once what the key would check per launch.

        None where such a launch would not call the C launcher directly: the key not compiled
        yet (launch it once first), a tensor address off 16-byte alignment, the cache disabled,
        or a Triton whose runner does not look as expected.
        """
        if not self.enabled:
            return None
        ptrs = [t.data_ptr() for t in tensors]
        if functools.reduce(operator.or_, ptrs) & 15:
            return None
        device = tensors[0].get_device()
        entry = self._compiled.get(
            self._key(ptrs, tensors, scalars, num_warps, num_stages, launch_pdl, device)
        )
        if entry is None or entry.run is None:
            return None
        return BoundLaunch(entry, grid, scalars, device)

    def _key(self, ptrs: list[int], tensors: Sequence[torch.Tensor], scalars: Sequence[Any],
             num_warps: int, num_stages: int, launch_pdl: bool,
             device: int) -> tuple[Any, ...]:  # fmt: skip
        # Triton specialises a pointer on 16-byte alignment: one OR over all of them decides
        # the common case (all aligned) without a per-tensor term in the key.
        align = (
            tuple(p & 15 == 0 for p in ptrs) if functools.reduce(operator.or_, ptrs) & 15 else ()
        )
        return (
            num_warps,
            num_stages,
            launch_pdl,
            device,
            align,
            *[t.dtype for t in tensors],
            *scalars[self._keyed],
        )

    @classmethod
    def direct_ok(cls, device: int) -> bool:
        """Whether a launch on ``device`` may call a compiled kernel's C launcher itself: it is
        the current device (a compiled kernel's handle belongs to one device's context) and no
        launch hook is set (they see only launches through Triton's runner)."""
        return device == cls.current_device() and not _hooks_set()

    def _jit(self, grid: tuple[int, ...], tensors: Sequence[torch.Tensor],
             scalars: Sequence[Any], num_warps: int, num_stages: int,
             launch_pdl: bool) -> Any:  # fmt: skip
        extra = {"launch_pdl": True} if launch_pdl else {}
        return self.fn[grid](
            *tensors, *scalars, num_warps=num_warps, num_stages=num_stages, **extra
        )

    def clear(self) -> None:
        """Forget the compiled kernels (the next launch of each key goes through Triton)."""
        self._compiled.clear()


class BoundLaunch:
    """One compiled kernel with its grid and scalar arguments fixed (:meth:`CachedLaunch.bind`):
    ``bound.launch(stream, *addresses)`` launches it and does nothing else.

    Where the launcher's form is known (:func:`_launcher_form`) it calls the C launch function
    under Triton's ``CompiledKernel.run``, whose Python ``__call__`` (scratch allocation for
    kernels that need none) costs about as much host time as the C call; otherwise ``run``.

    It checks nothing. The caller passes the addresses of tensors of the dtypes bound, each
    16-byte aligned, on ``device``, and launches only on the stream :meth:`stream_for` gives:
    what :meth:`CachedLaunch.launch` checks per launch, a caller that launches several kernels
    per step (small_decode) checks once for all of them.
    """

    __slots__ = ("device", "launch")

    def __init__(self, entry: _Entry, grid: tuple[int, ...], scalars: Sequence[Any],
                 device: int) -> None:  # fmt: skip
        self.device = device
        g0, g1, g2 = (*grid, 1, 1)[:3]
        scalars = tuple(scalars)
        function, metadata, run = entry.function, entry.metadata, entry.run
        if run is None:
            raise ValueError("BoundLaunch: the entry has no direct runner (CachedLaunch.bind)")
        c_launch = _c_launch(run)
        fixed: tuple[Any, ...]
        if c_launch is not None and c_launch[0] == "tuple":
            launch = c_launch[1]
            fixed = (
                function, run.launch_cooperative_grid, run.launch_pdl, metadata,
                None, None, None, None, None, run.arg_annotations, run.kernel_signature,
            )  # fmt: skip

            def call(stream: int, *ptrs: int) -> None:
                launch(g0, g1, g2, stream, *fixed, (*ptrs, *scalars))

        elif c_launch is not None:
            launch = c_launch[1]
            fixed = (
                function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                metadata, None, None, None,
            )  # fmt: skip

            def call(stream: int, *ptrs: int) -> None:
                launch(g0, g1, g2, stream, *fixed, *ptrs, *scalars)

        else:

            def call(stream: int, *ptrs: int) -> None:
                run(g0, g1, g2, stream, function, metadata, None, None, None, *ptrs, *scalars)

        #: ``(stream, *addresses) -> None``
        self.launch = call

    def stream_for(self, address_bits: int) -> int | None:
        """The current stream of ``device`` where a bound launch may go there now, else None
        (then launch through :meth:`CachedLaunch.launch`, which checks per launch).

        :param address_bits: the OR of every address the caller is about to hand its bound
            launches: they must all be 16-byte aligned, as at bind time; the device must be the
            current one and no launch hook set (:meth:`CachedLaunch.direct_ok`).
        """
        if address_bits & 15 or not CachedLaunch.direct_ok(self.device):
            return None
        return CachedLaunch.current_stream(self.device)
