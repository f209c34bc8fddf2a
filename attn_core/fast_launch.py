"""Launch a Triton kernel without ``JITFunction.run``'s per-call work after the first call.

Used by the core's K/V write kernel and by plugins' kernels (FlashInfer's small_decode).

Why: a Triton launch through ``kernel[grid](...)`` costs the host 100-150 us, more than two
``index_copy_`` launches, and that decides a host-bound eager decode step of one request. The
call binds and specialises every argument, hashes the result
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
tensors' device is not the current one, or the direct call is off (below), the cached kernel is
launched through that runner instead.

A caller that launches one shape many times goes one step further with :meth:`CachedLaunch.bind`:
a :class:`BoundLaunch` fixes grid and scalars, takes only the stream and the addresses, and where
the launcher's C call is known calls the C function under Triton's launcher object (whose Python
``__call__`` only allocates scratch memory such kernels lack). It checks nothing: the caller
checks alignment, device and hooks, once for all its launches of a step: small_decode's step
of one request (two launches) takes under half the host time this class's per-launch keys do.

When the direct calls are used, and why not (:func:`status` says it in one line, ``attn list``
prints it):

- A version gate: only Triton releases in :data:`TESTED_TRITON` (the H200's 3.6 and the CPU
  machines' 3.9), whose runner and launcher these calls were written against. Any other release,
  or no Triton at all, launches through Triton's own runner.
- A behavioural self-check on first use, nothing read from Triton's source: the first cached
  launch of the process goes through Triton's runner with a recorder around the compiled
  kernel's ``run``, and the direct call is used only if the runner handed ``run`` exactly the
  arguments a direct call passes (grid, the current stream, function handle, metadata, no launch
  hooks set, the kernel's arguments; launch metadata, which only hooks read, is passed as None).
  Likewise the first bound launch of each launcher class goes
  through the launcher's ``__call__`` with a recorder around its C function, and the C function
  is called directly only if the recorded arguments are those of one of the known forms. A
  mismatch leaves that launch and all later ones on Triton's own path, with the reason kept.

Under Triton's interpreter (CPU tests) a launch returns no compiled kernel, and every call goes
through ``kernel[grid](...)``. Without Triton installed the module imports (nothing is launched
then: the kernels themselves need Triton).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

__all__ = ["MAX_KEYS", "TESTED_TRITON", "BoundLaunch", "CachedLaunch", "status", "triton_gate"]


#: Keys kept per kernel before the cache starts over: a caller whose arguments keep changing
#: (views at ever new offsets, say) costs a Triton launch per new key, never unbounded memory.
MAX_KEYS = 256

#: Triton releases (major, minor) whose runner and CUDA launcher the direct calls were written
#: against and checked on: 3.6 (the H200's; C launch "star" form) to 3.9 (CPU CI; "tuple" form).
TESTED_TRITON = ((3, 6), (3, 9))


def _triton_version() -> str | None:
    """The installed Triton's ``__version__``; None where ``import triton`` fails."""
    try:
        import triton
    except ImportError:
        return None
    return str(getattr(triton, "__version__", "unknown"))


@functools.cache
def triton_gate() -> str | None:
    """Why the direct calls are off for the installed Triton (not installed, or a release
    outside :data:`TESTED_TRITON`); None where they may be used (subject to the self-checks)."""
    version = _triton_version()
    if version is None:
        return "triton is not installed"
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED_TRITON
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) <= hi:
        return (
            f"triton {version} is not in the tested range {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}; "
            "Triton's launcher used"
        )
    return None


class _Checks:
    """What the self-checks found, for the process (reset by tests).

    ``runner``: None (not checked yet), or the reason the runner check failed ("" passed).
    ``c_launch``: by launcher class, the form its C call was seen to take (None: unknown).
    """

    runner: ClassVar[str | None] = None
    c_launch: ClassVar[dict[type, str | None]] = {}
    c_launch_reason: ClassVar[str] = ""

    @classmethod
    def reset(cls) -> None:
        cls.runner = None
        cls.c_launch = {}
        cls.c_launch_reason = ""


def status() -> str:
    """One line for ``attn list``: whether cached launches call Triton's compiled kernels
    directly, and why not."""
    gate = triton_gate()
    if gate is not None:
        return f"fast launch: off ({gate})"
    version = _triton_version()
    if _Checks.runner is None:
        return f"fast launch: on (triton {version}; self-check on first launch)"
    if _Checks.runner:
        return f"fast launch: off (self-check: {_Checks.runner}; Triton's runner used)"
    if _Checks.c_launch_reason:
        return (
            f"fast launch: on (triton {version}); bound launches through the launcher object "
            f"({_Checks.c_launch_reason})"
        )
    return f"fast launch: on (triton {version}, self-check passed)"


def _unset(hook: object) -> bool:
    """A launch hook slot the runner passed that is empty (None, or 3.9's empty HookChain)."""
    return hook is None or not getattr(hook, "calls", True)


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Argument lists equal element by element (identity first: tensors compare by identity)."""
    return len(a) == len(b) and all(
        x is y or (_plain(x) and _plain(y) and x == y) for x, y in zip(a, b, strict=True)
    )


def _plain(x: object) -> bool:
    return x is None or isinstance(x, (int, float, bool, str, bytes, tuple))


def _check_runner(compiled: Any, grid: tuple[int, ...], args: Sequence[Any],
                  stream: int) -> str:  # fmt: skip
    """Launch ``compiled`` once through Triton's runner ``compiled[grid](*args)`` with a recorder
    around its ``run``; "" where the runner handed ``run`` what a direct call passes, else
    what differed. The launch itself happens either way (it is the caller's launch)."""
    seen: list[tuple[Any, ...]] = []
    real = compiled.run  # an instance attribute (Triton 3.6) or a property (3.9)
    cls = type(compiled)

    def spy(*a: Any) -> Any:
        seen.append(a)
        return real(*a)

    # Watch through a subclass whose ``run`` property returns the recorder: a data descriptor
    # wins over an instance attribute as well as over the base class's property.
    watched = type(cls.__name__, (cls,), {"run": property(lambda self: spy)})
    try:
        compiled.__class__ = watched
    except TypeError as exc:
        compiled[grid](*args)  # the caller's launch, unwatched
        return f"cannot watch {cls.__name__}.run ({exc})"
    try:
        compiled[grid](*args)
    finally:
        compiled.__class__ = cls
    if len(seen) != 1:
        return f"Triton's runner called CompiledKernel.run {len(seen)} times, expected once"
    got = seen[0]
    if len(got) < 9:
        return f"Triton's runner passed run() {len(got)} arguments, expected 9 + the kernel's"
    if tuple(got[:3]) != tuple(grid):
        return f"Triton's runner passed grid {tuple(got[:3])}, expected {tuple(grid)}"
    if got[3] != stream:
        return "Triton's runner launched on another stream than torch's current one"
    if got[4] is not compiled.function or got[5] is not compiled.packed_metadata:
        return "Triton's runner did not pass (function, packed_metadata) at positions 4-5"
    # Launch metadata feeds only the hooks: with both unset (None, or Triton 3.9's empty
    # HookChain) the launcher ignores it and them, so the direct call passes None for all three.
    if not (_unset(got[7]) and _unset(got[8])):
        return "Triton's runner passed launch hooks where none are set"
    if not _same(got[9:], args):
        return "Triton's runner passed the kernel's arguments otherwise than as given"
    return ""


def _c_launch(run: Any) -> Callable[..., Any] | None:
    """The C launch function under a compiled kernel's launcher where a bound launch may call it
    directly (its form still to be seen, :func:`_check_c_launch`): no global or profile
    scratch, no GSan."""
    if (
        getattr(run, "global_scratch_size", 1) != 0
        or getattr(run, "profile_scratch_size", 1) != 0
        or getattr(run, "gsan_enabled", False)
        or not callable(getattr(run, "launch", None))
    ):
        return None
    launch: Callable[..., Any] = run.launch
    return launch


def _c_forms(run: Any, grid: tuple[int, ...], stream: int, function: Any, metadata: Any,
             args: tuple[Any, ...]) -> dict[str, tuple[Any, ...]]:  # fmt: skip
    """What the launcher's C function receives from ``run(*grid, stream, function, metadata,
    None, None, None, *args)`` in each known form: ``"tuple"`` (Triton 3.9: the kernel's
    arguments as one tuple after the launcher's annotations) and ``"star"`` (Triton 3.6, the
    H200's: the runner's arguments spread). Scratch pointers are None (no scratch)."""
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    return {
        "tuple": (
            *grid, stream, function, coop, pdl, metadata, None, None, None, None, None,
            getattr(run, "arg_annotations", None), getattr(run, "kernel_signature", None), args,
        ),
        "star": (*grid, stream, function, coop, pdl, None, None, metadata, None, None, None, *args),
    }  # fmt: skip


def _check_c_launch(run: Any, grid: tuple[int, ...], stream: int, function: Any,
                    metadata: Any, args: tuple[Any, ...]) -> str | None:  # fmt: skip
    """Launch once through the launcher's ``__call__`` with a recorder around its C function;
    the form (:func:`_c_forms`) the recorded call has, else None (kept, with the reason, for
    the launcher's class in :class:`_Checks`)."""
    seen: list[tuple[Any, ...]] = []
    real = run.launch

    def spy(*a: Any) -> Any:
        seen.append(a)
        return real(*a)

    try:
        run.launch = spy
    except (AttributeError, TypeError):  # not an instance attribute here: no direct C call
        seen.append(())
        run(*grid, stream, function, metadata, None, None, None, *args)
    else:
        try:
            run(*grid, stream, function, metadata, None, None, None, *args)
        finally:
            run.launch = real
    form = None
    if len(seen) == 1:
        for name, expected in _c_forms(run, grid, stream, function, metadata, args).items():
            if _same(seen[0], expected):
                form = name
    if form is None:
        _Checks.c_launch_reason = (
            f"{type(run).__name__}.__call__ hands its C function arguments of no known form"
        )
    _Checks.c_launch[type(run)] = form
    return form


def _hooks_set() -> bool:
    """Whether a launch enter or exit hook is set (Triton 3.9 keeps an empty ``HookChain``
    where older versions keep None)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = knobs.runtime
    return not (_unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook))


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
                direct = triton_gate() is None and hasattr(compiled, "packed_metadata")
                self._compiled[key] = _Entry(compiled, direct)
            return
        g = (*grid, 1, 1)  # the launcher reads grid[0..2]; Triton's own call pads a short grid
        if entry.run is not None and _Checks.runner == "" and self.direct_ok(device):
            entry.run(g[0], g[1], g[2], self.current_stream(device), entry.function,
                      entry.metadata, None, None, None, *ptrs, *scalars)  # fmt: skip
        elif entry.run is not None and _Checks.runner is None and self.direct_ok(device):
            # The process's first direct-capable launch: through the runner, watched.
            _Checks.runner = _check_runner(
                entry.compiled, g[:3], (*ptrs, *scalars), self.current_stream(device)
            )
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
        a Triton outside the tested range or one whose runner failed the self-check.
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
        if entry is None or entry.run is None or _Checks.runner:
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

    Where the launcher's C call has a known form (seen by :func:`_check_c_launch` on the first
    bound launch of its class) it calls the C launch function under Triton's
    ``CompiledKernel.run``, whose Python ``__call__`` (scratch allocation for kernels that need
    none) costs about as much host time as the C call; otherwise ``run``. The first bound launch
    of the process also runs the runner self-check (:func:`_check_runner`) where no launch has.

    It checks nothing. The caller passes the addresses of tensors of the dtypes bound, each
    16-byte aligned, on ``device``, and launches only on the stream :meth:`stream_for` gives:
    what :meth:`CachedLaunch.launch` checks per launch, a caller that launches several kernels
    per step (small_decode) checks once for all of them.
    """

    __slots__ = ("device", "launch")

    def __init__(self, entry: _Entry, grid: tuple[int, ...], scalars: Sequence[Any],
                 device: int) -> None:  # fmt: skip
        self.device = device
        g0, g1, g2 = g3 = (*grid, 1, 1)[:3]
        scalars = tuple(scalars)
        function, metadata, run, compiled = (
            entry.function,
            entry.metadata,
            entry.run,
            entry.compiled,
        )
        if run is None:
            raise ValueError("BoundLaunch: the entry has no direct runner (CachedLaunch.bind)")
        c_launch = _c_launch(run)

        def via_run(stream: int, *ptrs: int) -> None:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *ptrs, *scalars)

        def via_runner(stream: int, *ptrs: int) -> None:
            # Triton's own runner, with the addresses; it launches on the current stream,
            # which is ``stream`` (stream_for gave it)
            compiled[g3](*ptrs, *scalars)

        def direct(form: str | None) -> Callable[..., None]:
            if c_launch is None or form is None:
                return via_run
            launch = c_launch
            fixed = _c_forms(run, g3, 0, function, metadata, ())[form][4:]
            if form == "tuple":
                head = fixed[:-1]

                def call_tuple(stream: int, *ptrs: int) -> None:
                    launch(g0, g1, g2, stream, *head, (*ptrs, *scalars))

                return call_tuple

            def call_star(stream: int, *ptrs: int) -> None:
                launch(g0, g1, g2, stream, *fixed, *ptrs, *scalars)

            return call_star

        unchecked = object()
        known = _Checks.c_launch.get(type(run), unchecked) if c_launch is not None else None
        if _Checks.runner == "" and known is not unchecked:
            self.launch = direct(known)  # type: ignore[arg-type]
            return
        target: list[Callable[..., None]] = []

        def first(stream: int, *ptrs: int) -> None:
            """Until both self-checks have run: each launch that runs one is that check's."""
            if target:
                target[0](stream, *ptrs)
                return
            args = (*ptrs, *scalars)
            if _Checks.runner is None:
                _Checks.runner = _check_runner(compiled, g3, args, stream)
                return
            if _Checks.runner:
                target.append(via_runner)
            elif c_launch is not None:
                form = _Checks.c_launch.get(type(run), unchecked)
                if form is unchecked:
                    target.append(
                        direct(_check_c_launch(run, g3, stream, function, metadata, args))
                    )
                    return
                target.append(direct(form))  # type: ignore[arg-type]
            else:
                target.append(via_run)
            target[0](stream, *ptrs)

        #: ``(stream, *addresses) -> None``
        self.launch = first

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
