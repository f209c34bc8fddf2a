"""Small harness shared by the plugins' GPU benchmark scripts (``attn_plugins/*/bench/``).

- :func:`cuda_time_us`: median microseconds of a callable, CUDA events around each run;
- :func:`new_result`, :func:`record_device`, :func:`run_case`, :func:`write_result`: the JSON
  document the lead collects, ``{"cases": [...], "errors": [...], "device": ..., "torch": ...}``,
  in which one failing case is recorded and the next one still runs.

:mod:`attn_core.bench` (``attn bench``) times with the wall clock on any device instead: it must
run on CPU too, where there are no CUDA events.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "alternating_us",
    "back_to_back_us",
    "capture_graph",
    "cuda_time_us",
    "new_result",
    "record_device",
    "run_case",
    "write_result",
]


def cuda_time_us(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median microseconds of ``fn`` over ``iters`` runs after ``warmup`` untimed ones.

    Each run is timed on its own between two CUDA events on the current stream, so host-side
    launch gaps between runs do not count and one slow outlier does not move the result.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def back_to_back_us(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    """Mean microseconds per ``fn()`` over ``iters`` calls issued back to back, between two CUDA
    events: unlike :func:`cuda_time_us`, host launch cost counts whenever the host cannot keep
    the GPU busy (what an uncaptured step pays)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def alternating_us(
    fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 3, repeat: int = 1
) -> dict[str, list[float]]:
    """Microseconds per call of several callables run in turn: ``rounds`` turns of each, a turn
    being ``repeat`` calls back to back.

    Round ``r`` gives every callable one turn, in ``fns``'s order on even rounds and reversed on
    odd ones (so none always follows the same neighbour), with a CUDA event on the current
    stream between turns and no synchronisation until the end: the GPU runs the calls back to
    back, as in :func:`back_to_back_us` (host time counts where the host cannot keep up), and
    the ``i``-th times of two callables come from turns adjacent in time. Why: a power-bound
    kernel's clock drifts by ~10 % over seconds, and a shared host's speed over milliseconds,
    more than the differences a benchmark looks for; adjacent turns see the same clock and the
    same host. ``repeat`` > 1 spreads the event's own host cost (a few us) over the turn's
    calls, for callables of a few microseconds. Work a callable puts on a side stream counts
    when it joins the current stream before returning.

    :returns: ``{name: [us per call in round 0's turn, round 1's, ...]}``.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(rounds * len(names) + 1)]
    order: list[str] = []
    marks[0].record()
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fn = fns[name]
            for _ in range(repeat):
                fn()
            marks[len(order) + 1].record()
            order.append(name)
    marks[-1].synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i, name in enumerate(order):
        times[name].append(marks[i].elapsed_time(marks[i + 1]) * 1e3 / repeat)
    return times


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one warm-up call on a side stream (which compiles
    kernels and settles allocator pools outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def profile_table(prof: cProfile.Profile, calls: int, what: str, top: int = 25) -> str:
    """``prof``'s functions by own time, in microseconds per call of the profiled code.

    :param calls: how many times the profiled code ran (the divisor).
    :param what: the table's title.
    """
    # {(file, line, name): (cc, nc, tottime, cumtime, callers)}; typeshed leaves .stats out
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = f"cProfile of {what}, {calls} calls (us per call):\n"
    out += f"  {'own':>7} {'cum':>7} {'calls':>6}  function\n"
    for (file, line, name), (_, nc, tt, ct, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        out += f"  {tt / calls * 1e6:7.2f} {ct / calls * 1e6:7.2f} {nc / calls:6.1f}  {where}\n"
    return out + "\n"


def profile_calls(fn: Callable[[int], object], calls: int, what: str) -> str:
    """Run ``fn(i)`` for ``i`` in ``range(calls)`` under cProfile; :func:`profile_table` of it.
    A CUDA device is synchronised after the calls, outside the profile."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn(i)
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return profile_table(prof, calls, what)


def new_result() -> dict[str, Any]:
    """An empty result document: ``{"cases": [], "errors": []}``."""
    return {"cases": [], "errors": []}


def record_device(result: dict[str, Any]) -> None:
    """Add the CUDA device's name and the torch version to ``result``."""
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__


def run_case(
    result: dict[str, Any], label: str, fn: Callable[..., dict[str, Any]], *args: Any
) -> None:
    """Run one benchmark case, ``fn(*args)``, and record it in ``result``, whatever happens.

    The row ``fn`` returns goes to ``result["cases"]`` and is printed as one JSON line; an
    exception goes to ``result["errors"]`` as ``{"case": label, "error", "trace"}`` and is printed
    as one line, so one bad case never loses the rest. The CUDA cache is emptied afterwards so
    that the next case starts from the same free memory.
    """
    try:
        row = fn(*args)
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
    except Exception as exc:  # record and go on: one bad case must not lose the rest
        result["errors"].append(
            {
                "case": label,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(limit=4),
            }
        )
        print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.empty_cache()


def write_result(result: dict[str, Any], path: str | Path) -> int:
    """Write ``result`` as indented JSON to ``path``; return the exit status (1 if any error)."""
    Path(path).write_text(json.dumps(result, indent=1))
    return 0 if not result["errors"] else 1
