"""attn_core.bench_util helpers (the GPU-timed ones carry the ``gpu`` marker)."""

from __future__ import annotations

import os

import pytest
import torch

from attn_core.bench_util import alternating_us, profile_calls


def test_profile_calls_runs_each_index_once_and_titles_the_table():
    seen: list[int] = []
    table = profile_calls(seen.append, 5, "five appends")
    assert seen == [0, 1, 2, 3, 4]
    assert table.startswith("cProfile of five appends, 5 calls (us per call):")
    assert "append" in table  # the profiled function's own row


@pytest.mark.gpu
@pytest.mark.skipif(
    bool(os.environ.get("PYTEST_XDIST_WORKER")),
    reason="other test processes share the GPU: their kernels run between the timed sleeps",
)
def test_alternating_us_times_each_call_of_each_callable_on_its_own():
    # torch.cuda._sleep spins the GPU for a number of cycles: "long" runs 4x "short" on any
    # clock, so each call's own time keeps that order in every round, whichever ran first.
    calls: list[str] = []

    def short():
        calls.append("short")
        torch.cuda._sleep(200_000)

    def long():
        calls.append("long")
        torch.cuda._sleep(800_000)

    times = alternating_us({"short": short, "long": long}, rounds=6, warmup=1)
    assert calls[:2] == ["short", "long"]  # the warm-up, in order
    # even rounds in the given order, odd rounds reversed
    assert calls[2:] == ["short", "long", "long", "short"] * 3
    assert [len(t) for t in times.values()] == [6, 6]
    for s, l in zip(times["short"], times["long"], strict=True):
        assert 2.5 < l / s < 6.0, (s, l)
    # Turns of three calls: the time is per call, the same as one call's.
    calls.clear()
    per_call = alternating_us({"short": short, "long": long}, rounds=2, warmup=0, repeat=3)
    assert calls == ["short"] * 3 + ["long"] * 6 + ["short"] * 3
    for name in ("short", "long"):
        for t in per_call[name]:
            assert 0.7 < t / min(times[name]) < 1.5, (name, t, times[name])
