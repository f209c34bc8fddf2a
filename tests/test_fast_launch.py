"""CachedLaunch without a GPU: a stand-in for a ``@triton.jit`` function whose launches return
a stand-in CompiledKernel, shaped like Triton's (``function``, ``packed_metadata``, the C
launcher ``run(g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook,
*args)`` and the ``kernel[grid](*args)`` runner)."""

from __future__ import annotations

import pytest
import torch

from attn_core import fast_launch
from attn_core.fast_launch import MAX_KEYS, CachedLaunch

STREAM = 0x5EED


class _Compiled:
    def __init__(self, log: list) -> None:
        self.function = object()
        self.packed_metadata = ("meta",)
        self.log = log

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and metadata is self.packed_metadata
        assert (launch_metadata, enter, exit_) == (None, None, None)
        self.log.append(("direct", (g0, g1, g2), stream, args))

    def __getitem__(self, grid):
        def runner(*args):
            self.log.append(("runner", tuple(grid), args))

        return runner


class _JitFunction:
    """``fn[grid](*args, num_warps=, num_stages=[, launch_pdl=])`` compiles (here: counts) and
    returns a compiled kernel per distinct specialisation, as Triton's JITFunction does."""

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **options):
            self.log.append(("jit", tuple(grid), args, num_warps, num_stages, options))
            return _Compiled(self.log)

        return run


@pytest.fixture
def cpu_device(monkeypatch):
    """CPU tensors report device -1: make that the "current device" with a known stream."""
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    monkeypatch.setattr(CachedLaunch, "current_stream", staticmethod(lambda dev: STREAM + dev))


def test_the_second_launch_calls_the_c_launcher_with_addresses_and_a_padded_grid(cpu_device):
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x, y = torch.zeros(8), torch.zeros(4, dtype=torch.int32)
    launch.launch((4, 2), (x, y), (3, 16), num_warps=4, num_stages=2)
    launch.launch((5, 2), (x, y), (3, 16), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]
    assert fn.log[0][2][:2] == (x, y) and fn.log[0][5] == {}
    _, grid, stream, args = fn.log[1]
    assert grid == (5, 2, 1)  # the launcher reads three grid dimensions
    assert stream == STREAM - 1
    assert args == (x.data_ptr(), y.data_ptr(), 3, 16)


def test_a_new_key_goes_through_the_jit_function(cpu_device):
    """Anything Triton specialises on, and more, makes a new key: another int value, another
    dtype, a pointer off 16-byte alignment, other warps or stages, programmatic launch."""
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    storage = torch.zeros(64, dtype=torch.bfloat16)
    base = ((storage[:8],), (3, 16))
    calls = [
        (base, 4, 2, False),
        (((storage[:8],), (3, 17)), 4, 2, False),
        (((storage[:8].float(),), (3, 16)), 4, 2, False),
        (((storage[4:12],), (3, 16)), 4, 2, False),  # 8 bytes into the storage
        (base, 8, 2, False),
        (base, 4, 3, False),
        (base, 4, 2, True),
    ]
    for (tensors, scalars), warps, stages, pdl in calls:
        launch.launch((1,), tensors, scalars, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    assert [entry[0] for entry in fn.log] == ["jit"] * len(calls)
    assert fn.log[-1][5] == {"launch_pdl": True}
    launch.launch((1,), *base, num_warps=4, num_stages=2)
    assert fn.log[-1][0] == "direct"
    # Another aligned address (64 bytes in) is the same specialisation: no new compile.
    launch.launch((1,), (storage[32:40],), (3, 16), num_warps=4, num_stages=2)
    assert fn.log[-1][0] == "direct" and fn.log[-1][3][0] == storage[32:40].data_ptr()


def test_hooks_another_device_or_an_unknown_runner_use_the_compiled_kernels_runner(
    cpu_device, monkeypatch
):
    from triton import knobs

    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(2)
    launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch.launch((2,), (x,), (1,), num_warps=4, num_stages=2)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: 0))
    launch.launch((3,), (x,), (1,), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "runner", "runner"]
    assert fn.log[1][1] == (2, 1, 1) and fn.log[1][2] == (x, 1)

    monkeypatch.setattr(fast_launch, "_runner_calls_run_as_expected", lambda: False)
    launch.clear()
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    for _ in range(2):
        launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log[3:]] == ["jit", "runner"]


def test_disabled_or_interpreted_launches_always_go_through_the_jit_function(cpu_device):
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    launch.enabled = False
    x = torch.zeros(2)
    for _ in range(2):
        launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]

    class _Interpreted(_JitFunction):  # Triton's interpreter returns no compiled kernel
        def __getitem__(self, grid):
            run = super().__getitem__(grid)
            return lambda *a, **kw: (run(*a, **kw), None)[1]

    fn = _Interpreted()
    launch = CachedLaunch(fn)
    for _ in range(2):
        launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]


def test_the_cache_starts_over_past_max_keys(cpu_device):
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(2)
    for n in range(MAX_KEYS + 1):
        launch.launch((1,), (x,), (n,), num_warps=4, num_stages=2)
    assert len(launch._compiled) == 1  # full at MAX_KEYS: cleared, then the new key
    launch.launch((1,), (x,), (MAX_KEYS,), num_warps=4, num_stages=2)
    assert fn.log[-1][0] == "direct"


def test_unkeyed_trailing_scalars_reuse_the_compiled_kernel(cpu_device):
    """Scalars the kernel does not specialise on (``do_not_specialize``, passed last) are
    launched with their new values through the same compiled kernel."""
    fn = _JitFunction()
    launch = CachedLaunch(fn, unkeyed_tail=1)
    x = torch.zeros(2)
    launch.launch((1,), (x,), (3, 100), num_warps=4, num_stages=2)
    launch.launch((1,), (x,), (3, 7), num_warps=4, num_stages=2)
    launch.launch((1,), (x,), (4, 7), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "jit"]
    assert fn.log[1][3] == (x.data_ptr(), 3, 7)


def test_bind_returns_the_compiled_kernel_with_grid_and_scalars_fixed(cpu_device):
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x, y = torch.zeros(8), torch.zeros(4, dtype=torch.int32)
    args = ((4, 2), (x, y), (3, 16))
    assert launch.bind(*args, num_warps=4, num_stages=2) is None  # not compiled yet
    launch.launch(*args, num_warps=4, num_stages=2)
    bound = launch.bind(*args, num_warps=4, num_stages=2)
    assert bound is not None and bound.device == -1
    assert launch.bind(*args, num_warps=8, num_stages=2) is None  # another key
    x2, y2 = torch.ones(8), torch.ones(4, dtype=torch.int32)
    bound.launch(STREAM, x2.data_ptr(), y2.data_ptr())
    assert fn.log[-1] == ("direct", (4, 2, 1), STREAM, (x2.data_ptr(), y2.data_ptr(), 3, 16))
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]


def test_bind_refuses_misaligned_disabled_or_runner_only_launches(cpu_device, monkeypatch):
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    storage = torch.zeros(64, dtype=torch.bfloat16)
    for view in (storage[:8], storage[4:12]):  # aligned, then 8 bytes in
        launch.launch((1,), (view,), (3,), num_warps=4, num_stages=2)
    assert launch.bind((1,), (storage[:8],), (3,), num_warps=4, num_stages=2) is not None
    assert launch.bind((1,), (storage[4:12],), (3,), num_warps=4, num_stages=2) is None
    launch.enabled = False
    assert launch.bind((1,), (storage[:8],), (3,), num_warps=4, num_stages=2) is None
    launch.enabled = True
    monkeypatch.setattr(fast_launch, "_runner_calls_run_as_expected", lambda: False)
    launch.clear()
    launch.launch((1,), (storage[:8],), (3,), num_warps=4, num_stages=2)
    assert launch.bind((1,), (storage[:8],), (3,), num_warps=4, num_stages=2) is None


def test_direct_ok_only_on_the_current_device_without_hooks(cpu_device, monkeypatch):
    from triton import knobs

    assert CachedLaunch.direct_ok(-1)
    assert not CachedLaunch.direct_ok(0)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda *a: None)
    assert not CachedLaunch.direct_ok(-1)


class _StarLauncher:
    """A launcher of the Triton 3.6 form (the H200's): the runner's arguments spread."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, global_scratch, profile_scratch, *args)  # fmt: skip


def _launcher(cls: type, log: list, **attrs) -> object:
    """An instance of ``cls`` (a real or stand-in launcher class) with a recording C launch."""
    obj = object.__new__(cls)
    fields = {
        "launch": lambda *args: log.append(args),
        "launch_cooperative_grid": False,
        "launch_pdl": True,
        "global_scratch_size": 0,
        "global_scratch_align": 1,
        "profile_scratch_size": 0,
        "profile_scratch_align": 1,
        "num_ctas": 1,
        "gsan_enabled": False,
        "arg_annotations": ("ann",),
        "kernel_signature": b"sig",
    }
    fields.update(attrs)
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


def _bound_against_runner(launcher: object, log: list) -> tuple:
    """What the launcher's own ``__call__`` hands its C function, and what a bound launch does."""
    entry = fast_launch._Entry.__new__(fast_launch._Entry)
    entry.compiled, entry.run, entry.function, entry.metadata = None, launcher, "fn", ("meta",)
    bound = fast_launch.BoundLaunch(entry, (4, 2), (7, 8), device=0)
    launcher(4, 2, 1, STREAM, "fn", ("meta",), None, None, None, 101, 102, 7, 8)
    bound.launch(STREAM, 101, 102)
    return log[0], log[1]


class _TupleLauncher:
    """A launcher of the Triton 3.9 form: the kernel's arguments as one tuple."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):  # fmt: skip
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, global_scratch, profile_scratch, self.arg_annotations,
                    self.kernel_signature, args)  # fmt: skip


@pytest.mark.parametrize("which", ["installed", "tuple", "star"])
def test_a_bound_launch_hands_the_c_function_what_the_launchers_call_does(which, monkeypatch):
    """Against the installed Triton's own CUDA launcher class (its real ``__call__``, of either
    form) and stand-ins of both forms: the C launch function receives the same arguments from
    a bound launch as from the launcher's ``__call__``."""
    if which == "installed":
        import triton
        from triton.backends.nvidia.driver import CudaLauncher as cls

        if fast_launch._launcher_form(cls) is None:
            pytest.skip("this Triton's CUDA launcher is of neither known form")
        # The real __call__ may read the active driver (none on a CPU machine).
        monkeypatch.setattr(triton.runtime, "driver", type("D", (), {"active": None})())
    else:
        cls = {"tuple": _TupleLauncher, "star": _StarLauncher}[which]
        assert fast_launch._launcher_form(cls) == which
    log: list = []
    runner_call, bound_call = _bound_against_runner(_launcher(cls, log), log)
    assert bound_call == runner_call
    assert bound_call[3] == STREAM and (101, 102, 7, 8) in (bound_call[-1], bound_call[-4:])


def test_kernels_with_scratch_or_unknown_launchers_keep_the_launchers_call():
    log: list = []
    for launcher in (
        _launcher(_StarLauncher, log, global_scratch_size=128),
        _launcher(_StarLauncher, log, profile_scratch_size=64),
        _launcher(_StarLauncher, log, gsan_enabled=True),
    ):
        assert fast_launch._c_launch(launcher) is None

    class Other:
        def __call__(self, *args):
            self.launch(*args)

    assert fast_launch._launcher_form(Other) is None


def test_stream_for_gives_the_current_stream_only_where_a_bound_launch_may_go(
    cpu_device, monkeypatch
):
    from triton import knobs

    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(8)
    launch.launch((1,), (x,), (3,), num_warps=4, num_stages=2)
    bound = launch.bind((1,), (x,), (3,), num_warps=4, num_stages=2)
    assert bound.stream_for(x.data_ptr() | 32) == STREAM - 1
    assert bound.stream_for(x.data_ptr() | 8) is None  # an address off 16-byte alignment
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert bound.stream_for(x.data_ptr()) is None
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: 0))
    assert bound.stream_for(x.data_ptr()) is None
