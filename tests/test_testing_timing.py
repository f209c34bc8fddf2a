"""attn_core.testing.timing: a line per finished test, written as it ends (a run cut at its
time limit keeps the lines of what finished, and why each failed one failed), from the
controlling process only."""

from __future__ import annotations

import pytest

TESTS = """
import time, pytest

def test_slow():
    time.sleep(0.2)

def test_fails():
    assert 1 + 1 == 3, "arithmetic\\tbroke\\nhere"

def test_fails_at_length():
    assert 1 + 1 == 3, "x" * 1000

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


@pytest.mark.parametrize("workers", [None, "2"], ids=["one process", "xdist"])
def test_each_finished_test_gets_one_line_with_its_time_and_outcome(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: str | None
) -> None:
    if workers:
        pytest.importorskip("xdist")
    pytester.makepyfile(test_timed=TESTS)
    times = pytester.path / "times.tsv"
    monkeypatch.setenv("ATTN_TEST_TIMES", str(times))
    args = ["-p", "attn_core.testing.timing", *(["-n", workers] if workers else [])]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    lines = [line.split("\t") for line in times.read_text().splitlines()]
    assert {len(line) for line in lines} == {4}, lines
    by_test = {node.split("::")[1]: (float(s), outcome) for s, outcome, node, _ in lines}
    why = {line[2].split("::")[1]: line[3] for line in lines}
    assert len(lines) == 4, lines  # one per test, none doubled by the workers' reports
    # a failed test's crash message on its one line (tabs and newlines folded), others none
    assert why["test_fails"].startswith("AssertionError: arithmetic broke here"), why
    assert why["test_slow"] == why["test_skipped"] == "", why
    # a long message keeps both ends: the failed expression is at its end
    long = why["test_fails_at_length"]
    assert len(long) <= 400 and long.startswith("AssertionError: xxx"), long
    assert " ... " in long and long.endswith("assert (1 + 1) == 3"), long
    assert {k: v[1] for k, v in by_test.items()} == {
        "test_slow": "passed",
        "test_fails": "failed",
        "test_fails_at_length": "failed",
        "test_skipped": "skipped",
    }
    assert by_test["test_slow"][0] >= 0.2 > by_test["test_skipped"][0]


def test_without_the_variable_nothing_is_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_timed=TESTS)
    result = pytester.runpytest_subprocess("-p", "attn_core.testing.timing")
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    written = {p.name for p in pytester.path.iterdir() if p.is_file()}
    assert written <= {"test_timed.py", "stdout", "stderr"}, written  # pytester's own files
