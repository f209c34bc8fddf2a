"""CachedLaunch without a GPU: a stand-in for a ``@triton.jit`` function whose launches return
a stand-in CompiledKernel, shaped like Triton's (``function``, ``kernel[grid](*args)`` with a
launcher that reads three grid dimensions)."""

from __future__ import annotations

import torch
from attn_plugin_flashinfer.fast_launch import MAX_KEYS, CachedLaunch


class _Compiled:
    def __init__(self, log: list) -> None:
        self.function = object()
        self.log = log

    def __getitem__(self, grid):
        def runner(*args):
            self.log.append(("cached", (grid[0], grid[1], grid[2]), args))

        return runner


class _JitFunction:
    """``fn[grid](*args, num_warps=, num_stages=)`` compiles (here: counts) and returns a
    compiled kernel per distinct specialisation, as Triton's JITFunction does."""

    def __init__(self) -> None:
        self.log: list = []
        self.compiled: list[_Compiled] = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages):
            self.log.append(("jit", tuple(grid), args, num_warps, num_stages))
            kernel = _Compiled(self.log)
            self.compiled.append(kernel)
            return kernel

        return run


def test_the_second_launch_of_a_key_skips_the_jit_function_and_pads_the_grid():
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(8)  # a CPU tensor: get_device() is -1, a key like any other
    launch.launch((4, 2), (x,), (3, 16), num_warps=4, num_stages=2)
    launch.launch((5, 2), (x,), (3, 16), num_warps=4, num_stages=2)
    assert [entry[0] for entry in fn.log] == ["jit", "cached"]
    assert fn.log[1][1] == (5, 2, 1)  # the launcher reads three grid dimensions
    assert fn.log[1][2][0] is x


def test_a_new_key_goes_through_the_jit_function():
    """Anything Triton specialises on, and more, makes a new key: another int value, another
    dtype, a pointer off 16-byte alignment, other warps or stages."""
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    storage = torch.zeros(64, dtype=torch.bfloat16)
    base = ((storage[:8],), (3, 16))
    calls = [
        (base, 4, 2),
        (((storage[:8],), (3, 17)), 4, 2),
        (((storage[:8].float(),), (3, 16)), 4, 2),
        (((storage[4:12],), (3, 16)), 4, 2),  # 8 bytes into the storage
        (base, 8, 2),
        (base, 4, 3),
    ]
    for (tensors, scalars), warps, stages in calls:
        launch.launch((1,), tensors, scalars, num_warps=warps, num_stages=stages)
    assert [entry[0] for entry in fn.log] == ["jit"] * len(calls)
    launch.launch((1,), *base, num_warps=4, num_stages=2)
    assert fn.log[-1][0] == "cached"


def test_disabled_or_interpreted_launches_always_go_through_the_jit_function():
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


def test_the_cache_starts_over_past_max_keys():
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(2)
    for n in range(MAX_KEYS + 1):
        launch.launch((1,), (x,), (n,), num_warps=4, num_stages=2)
    assert len(launch._compiled) == 1  # full at MAX_KEYS: cleared, then the new key
    launch.launch((1,), (x,), (MAX_KEYS,), num_warps=4, num_stages=2)
    assert fn.log[-1][0] == "cached"
