"""CachedLaunch without a GPU: a stand-in for a ``@triton.jit`` function whose launches return
a stand-in CompiledKernel, shaped like Triton's (``function``, ``packed_metadata``, the C
launcher ``run(g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook,
*args)`` and the ``kernel[grid](*args)`` runner, which calls ``run`` as Triton 3.6-3.9's does).

Nothing here reads Triton's source: the direct calls are gated on the version and on what the
runner and launcher are seen to do (the self-checks), which the stand-ins exercise both ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_core import fast_launch
from attn_core.fast_launch import MAX_KEYS, CachedLaunch

STREAM = 0x5EED
ROOT = Path(__file__).resolve().parents[1]


class _Compiled:
    def __init__(self, log: list) -> None:
        self.function = object()
        self.packed_metadata = ("meta",)
        self.log = log

    #: What the runner passes as launch metadata and hooks: None (Triton 3.6) or, as Triton 3.9
    #: does, launch metadata and empty hook chains (the launcher ignores all three then).
    runner_passes: tuple = (None, None, None)

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and metadata is self.packed_metadata
        assert not getattr(enter, "calls", None) and not getattr(exit_, "calls", None)
        self.log.append(("direct", (g0, g1, g2), stream, args))

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            # Triton's runner: the current stream, then run() with no hooks set.
            self.log.append(("runner", tuple(grid), args))
            stream = STREAM - 1 if stream is None else stream
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata,
                     *self.runner_passes, *args)  # fmt: skip

        return runner


class _EmptyHookChain:
    def __init__(self) -> None:
        self.calls: list = []  # Triton 3.9's HookChain with no hook added


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


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    """Every test starts with no self-check run and a Triton inside the tested range."""
    fast_launch._Checks.reset()
    monkeypatch.setattr(fast_launch, "triton_gate", lambda: None)
    yield
    fast_launch._Checks.reset()


@pytest.fixture
def cpu_device(monkeypatch):
    """CPU tensors report device -1: make that the "current device" with a known stream; the
    runner self-check counts as passed (tests of the check itself use ``unchecked``)."""
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    monkeypatch.setattr(CachedLaunch, "current_stream", staticmethod(lambda dev: STREAM + dev))
    fast_launch._Checks.runner = ""


@pytest.fixture
def unchecked(cpu_device):
    fast_launch._Checks.runner = None


def _kinds(log: list) -> list[str]:
    return [entry[0] for entry in log]


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
    knobs = pytest.importorskip("triton").knobs

    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(2)
    launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch.launch((2,), (x,), (1,), num_warps=4, num_stages=2)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: 0))
    launch.launch((3,), (x,), (1,), num_warps=4, num_stages=2)
    assert _kinds(fn.log) == ["jit", "runner", "direct", "runner", "direct"]
    assert fn.log[1][1] == (2, 1, 1) and fn.log[1][2] == (x, 1)

    fast_launch._Checks.runner = "a runner that failed the self-check"
    launch.clear()
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    del fn.log[:]
    for _ in range(2):
        launch.launch((1,), (x,), (1,), num_warps=4, num_stages=2)
    assert _kinds(fn.log) == ["jit", "runner", "direct"]
    assert fn.log[1][2] == (x, 1)  # the tensors, through Triton's runner


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
    fast_launch._Checks.runner = "a runner that failed the self-check"
    launch.clear()
    launch.launch((1,), (storage[:8],), (3,), num_warps=4, num_stages=2)
    assert launch.bind((1,), (storage[:8],), (3,), num_warps=4, num_stages=2) is None


def test_direct_ok_only_on_the_current_device_without_hooks(cpu_device, monkeypatch):
    knobs = pytest.importorskip("triton").knobs

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
    """What the launcher's own ``__call__`` hands its C function, then what the first bound
    launch (the C-launch self-check, through ``__call__``) and the second (direct) do."""
    fast_launch._Checks.runner = ""  # the runner check is another test's
    entry = fast_launch._Entry.__new__(fast_launch._Entry)
    entry.compiled, entry.run, entry.function, entry.metadata = None, launcher, "fn", ("meta",)
    bound = fast_launch.BoundLaunch(entry, (4, 2), (7, 8), device=0)
    launcher(4, 2, 1, STREAM, "fn", ("meta",), None, None, None, 101, 102, 7, 8)
    bound.launch(STREAM, 101, 102)
    bound.launch(STREAM, 101, 102)
    assert len(log) == 3, "each bound launch launches exactly once"
    return log[0], log[1], log[2]


class _TupleLauncher:
    """A launcher of the Triton 3.9 form: the kernel's arguments as one tuple."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):  # fmt: skip
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, global_scratch, profile_scratch, self.arg_annotations,
                    self.kernel_signature, args)  # fmt: skip


def _sourceless(cls: type) -> type:
    """``cls`` rebuilt by ``exec`` from no file: ``inspect.getsource`` cannot read it, as for a
    launcher compiled or generated at run time. Behaviour decides, not source text."""
    namespace: dict = {}
    code = {
        _StarLauncher: "def __call__(self, gx, gy, gz, stream, function, *args):\n"
        "    self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid,"
        " self.launch_pdl, None, None, *args)\n",
        _TupleLauncher: "def __call__(self, gx, gy, gz, stream, function, meta, lm, eh, xh, *a):\n"
        "    self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid,"
        " self.launch_pdl, meta, lm, eh, xh, None, None, self.arg_annotations,"
        " self.kernel_signature, a)\n",
    }[cls]
    exec(compile(code, "<generated>", "exec"), namespace)
    return type(cls.__name__, (), {"__call__": namespace["__call__"]})


@pytest.mark.parametrize(
    "which", ["installed", "tuple", "star", "tuple-sourceless", "star-sourceless"]
)
def test_a_bound_launch_hands_the_c_function_what_the_launchers_call_does(which, monkeypatch):
    """Against the installed Triton's own CUDA launcher class (its real ``__call__``) and
    stand-ins of both forms, with and without readable source: the first bound launch sees
    what ``__call__`` hands the C function and recognises the form; the next one calls the C
    function itself with the same arguments."""
    if which == "installed":
        triton = pytest.importorskip("triton")
        from triton.backends.nvidia.driver import CudaLauncher as cls

        # The real __call__ may read the active driver (none on a CPU machine).
        monkeypatch.setattr(triton.runtime, "driver", type("D", (), {"active": None})())
    else:
        form, _, sourceless = which.partition("-")
        cls = {"tuple": _TupleLauncher, "star": _StarLauncher}[form]
        if sourceless:
            cls = _sourceless(cls)
    log: list = []
    runner_call, checked_call, bound_call = _bound_against_runner(_launcher(cls, log), log)
    assert checked_call == runner_call and bound_call == runner_call
    assert bound_call[3] == STREAM and (101, 102, 7, 8) in (bound_call[-1], bound_call[-4:])
    seen = fast_launch._Checks.c_launch[cls]
    if which == "installed":
        assert seen in ("tuple", "star"), "the installed Triton's CUDA launcher: no known form"
    else:
        assert seen == which.partition("-")[0]


def test_kernels_with_scratch_or_unknown_launchers_keep_the_launchers_call():
    log: list = []
    for launcher in (
        _launcher(_StarLauncher, log, global_scratch_size=128),
        _launcher(_StarLauncher, log, profile_scratch_size=64),
        _launcher(_StarLauncher, log, gsan_enabled=True),
    ):
        assert fast_launch._c_launch(launcher) is None

    class Other:  # hands its C function the arguments in an order of its own
        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(function, stream, gx, gy, gz, *args)

    fast_launch._Checks.runner = ""
    launcher = _launcher(Other, log)
    calls: list = []
    real = Other.__call__
    Other.__call__ = lambda self, *a: (calls.append(a), real(self, *a))[1]  # type: ignore
    try:
        entry = fast_launch._Entry.__new__(fast_launch._Entry)
        entry.compiled, entry.run, entry.function, entry.metadata = None, launcher, "fn", ("m",)
        bound = fast_launch.BoundLaunch(entry, (2,), (5,), device=0)
        for _ in range(3):
            bound.launch(STREAM, 101)
    finally:
        Other.__call__ = real  # type: ignore
    assert fast_launch._Checks.c_launch[Other] is None
    assert len(calls) == 3, "every launch went through the launcher's own __call__"
    assert "no known form" in fast_launch.status()


# ------------------------------------------------------------------------------------------
# the runner self-check, the version gate, no Triton
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("passes", ["none", "3.9"])
def test_the_first_cached_launch_is_the_runner_self_check_then_launches_go_direct(
    unchecked, monkeypatch, passes
):
    if passes == "3.9":  # launch metadata and empty hook chains, as Triton 3.9's runner
        chain = _EmptyHookChain()
        monkeypatch.setattr(_Compiled, "runner_passes", ({"name": "k"}, chain, chain))
    fn = _JitFunction()
    launch = CachedLaunch(fn)
    x = torch.zeros(8)
    assert "self-check on first launch" in fast_launch.status()
    for _ in range(3):
        launch.launch((2,), (x,), (3,), num_warps=4, num_stages=2)
    # jit (compiles and launches), the watched runner launch, then the direct call: one
    # kernel launch per call.
    assert _kinds(fn.log) == ["jit", "runner", "direct", "direct"]
    assert fn.log[2][3] == fn.log[3][3] == (x.data_ptr(), 3)
    assert fast_launch._Checks.runner == ""
    assert "self-check passed" in fast_launch.status()


class _ReorderingCompiled(_Compiled):
    """A runner of some other Triton release: run() gets the metadata before the function."""

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("runner", tuple(grid), args))
            self.log.append(("other", grid, STREAM - 1, args))
            self.run_other(grid[0], grid[1], grid[2], STREAM - 1, self.packed_metadata,
                           self.function, None, None, None, *args)  # fmt: skip

        return runner

    def run_other(self, *a):
        pass

    def run(self, *a):  # called with this release's order by the runner above (via run_other)
        self.log.append(("direct", a[:3], a[3], a[9:]))


def test_a_runner_that_calls_run_otherwise_fails_the_self_check_and_stays_on_its_path(
    unchecked,
):
    class Fn(_JitFunction):
        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **options):
                self.log.append(("jit", tuple(grid), args, num_warps, num_stages, options))
                return _ReorderingCompiled(self.log)

            return run

    fn = Fn()
    launch = CachedLaunch(fn)
    x = torch.zeros(8)
    for _ in range(3):
        launch.launch((2,), (x,), (3,), num_warps=4, num_stages=2)
    assert "direct" not in _kinds(fn.log)
    assert _kinds(fn.log) == ["jit", "runner", "other", "runner", "other"]
    assert fast_launch._Checks.runner.startswith("Triton's runner called CompiledKernel.run 0")
    assert launch.bind((2,), (x,), (3,), num_warps=4, num_stages=2) is None
    assert fast_launch.status().startswith("fast launch: off (self-check: ")


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0"])
def test_a_triton_outside_the_tested_range_never_launches_directly(version, cpu_device,
                                                                   monkeypatch):  # fmt: skip
    monkeypatch.undo()  # the real gate, with this version
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    monkeypatch.setattr(CachedLaunch, "current_stream", staticmethod(lambda dev: STREAM + dev))
    monkeypatch.setattr(fast_launch, "_triton_version", lambda: version)
    fast_launch.triton_gate.cache_clear()
    try:
        reason = fast_launch.triton_gate()
        assert reason == (
            f"triton {version} is not in the tested range 3.6-3.9; Triton's launcher used"
        )
        assert fast_launch.status() == f"fast launch: off ({reason})"
        fn = _JitFunction()
        launch = CachedLaunch(fn)
        x = torch.zeros(8)
        for _ in range(3):
            launch.launch((2,), (x,), (3,), num_warps=4, num_stages=2)
        assert _kinds(fn.log) == ["jit", "runner", "direct", "runner", "direct"]
        assert all(e[3] == (x, 3) for e in fn.log if e[0] == "direct")  # tensors: no addresses
        assert launch.bind((2,), (x,), (3,), num_warps=4, num_stages=2) is None
    finally:
        fast_launch.triton_gate.cache_clear()


@pytest.mark.parametrize("version", ["3.6.0", "3.9.0", "3.7.1+git"])
def test_the_tested_range_admits_the_h200s_and_the_cpu_machines_triton(version, monkeypatch):
    monkeypatch.undo()  # the real gate, with this version
    monkeypatch.setattr(fast_launch, "_triton_version", lambda: version)
    fast_launch.triton_gate.cache_clear()
    try:
        assert fast_launch.triton_gate() is None
        assert fast_launch.status().startswith(f"fast launch: on (triton {version}")
    finally:
        fast_launch.triton_gate.cache_clear()


_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError, as where it is not installed
import attn_core.fast_launch as fl
assert fl.status() == "fast launch: off (triton is not installed)", fl.status()
assert not fl._hooks_set()
import types, warnings
import torch
from attn_core import pdl
from attn_core.state import kv_write
assert not pdl.pdl_enabled(torch.device("cuda", 0))  # the other launch helpers: PDL stays off,
with warnings.catch_warnings(record=True) as caught:  # a CUDA KV write takes the torch path
    warnings.simplefilter("always")
    assert kv_write._kernels(types.SimpleNamespace(is_cuda=True)) is None
assert "Triton is not importable" in str(caught[0].message), [str(w.message) for w in caught]
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_the_module_and_these_tests_load_without_triton():
    """triton is no core dependency: the module imports, says why it is off, and this file
    collects (its Triton-only tests skip) in an interpreter where ``import triton`` fails; the
    other launch helpers too (PDL off, a CUDA KV write on the torch path with a warning)."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON, __file__],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.lower(), done.stdout[-3000:]


def test_stream_for_gives_the_current_stream_only_where_a_bound_launch_may_go(
    cpu_device, monkeypatch
):
    knobs = pytest.importorskip("triton").knobs

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


def test_the_runner_self_check_passes_against_the_installed_tritons_own_runner(monkeypatch):
    """The installed Triton's real ``CompiledKernel.__getitem__`` runner (on a CompiledKernel
    whose handles and C launcher are stand-ins, and a stand-in driver for the current stream):
    what it hands ``run`` is what a direct call passes, so the check passes; with a launch hook
    set it does not."""
    pytest.importorskip("triton")
    from triton.compiler import compiler

    compiled = object.__new__(compiler.CompiledKernel)
    seen: list = []
    compiled.function, compiled.packed_metadata, compiled.name, compiled.src = 7, ("m",), "k", None
    compiled._init_handles = lambda: None
    compiled.module = None  # what CompiledKernel.__del__ reads
    compiled._run = lambda *a: seen.append(a)  # the launcher (3.9: behind the run property)
    if not isinstance(getattr(compiler.CompiledKernel, "run", None), property):
        compiled.run = compiled._run  # 3.6: an instance attribute

    class Active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: STREAM)

    monkeypatch.setattr(compiler, "driver", type("D", (), {"active": Active})())
    args = (0x1000, 0x2000, 3)
    assert fast_launch._check_runner(compiled, (2, 1, 1), args, STREAM) == ""
    assert seen[-1][:6] == (2, 1, 1, STREAM, 7, ("m",)) and seen[-1][9:] == args
    assert fast_launch._check_runner(compiled, (2, 1, 1), args, STREAM + 1).endswith(
        "another stream than torch's current one"
    )
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert "hooks" in fast_launch._check_runner(compiled, (2, 1, 1), args, STREAM)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_self_checks_pass_on_this_gpus_triton_and_direct_launches_compute_the_same(
    monkeypatch,
):
    """A tiny kernel on the GPU through CachedLaunch (jit, the watched runner launch, direct
    launches) and a bound launch (the watched C-launch check, then the direct C call): every
    launch computes what Triton's own launch does, and on a Triton in the tested range both
    self-checks pass (``fast_launch.status()`` says so)."""
    monkeypatch.undo()  # the real version gate
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.arange(300, dtype=torch.float32, device="cuda")
    launch = CachedLaunch(add_one)
    outs = []
    for _ in range(4):
        y = torch.zeros_like(x)
        launch.launch((3,), (x, y), (300, 128), num_warps=4, num_stages=1)
        outs.append(y)
    torch.cuda.synchronize()
    for y in outs:
        assert torch.equal(y, x + 1)
    if fast_launch.triton_gate() is not None:
        pytest.skip(fast_launch.status())
    assert fast_launch._Checks.runner == "", fast_launch.status()
    bound = launch.bind((3,), (torch.zeros_like(x), torch.zeros_like(x)), (300, 128),
                        num_warps=4, num_stages=1)  # fmt: skip
    assert bound is not None
    for _ in range(3):
        y = torch.zeros_like(x)
        stream = bound.stream_for(x.data_ptr() | y.data_ptr())
        assert stream is not None
        bound.launch(stream, x.data_ptr(), y.data_ptr())
        torch.cuda.synchronize()
        assert torch.equal(y, x + 1)
    assert set(fast_launch._Checks.c_launch.values()) <= {"tuple", "star"}, fast_launch.status()
    assert fast_launch.status().endswith("self-check passed)"), fast_launch.status()
