"""attn_core.bench_util helpers that need no GPU."""

from __future__ import annotations

from attn_core.bench_util import profile_calls


def test_profile_calls_runs_each_index_once_and_titles_the_table():
    seen: list[int] = []
    table = profile_calls(seen.append, 5, "five appends")
    assert seen == [0, 1, 2, 3, 4]
    assert table.startswith("cProfile of five appends, 5 calls (us per call):")
    assert "append" in table  # the profiled function's own row
