"""``attn bench`` feeds every layer what its spec needs: gpt-oss's attention sinks (issue 24).

On the H200 every gpt-oss candidate failed with "has sinks in its spec but no sinks tensor": the
bench built its runtime without ``layer_params``. Here the bench runs for real on the CPU with
the reference and tiny sizes; ``_time`` is replaced by one call of the step (nothing is timed and
no time is asserted).
"""

from __future__ import annotations

import json

from attn_core import bench, cli
from attn_core.models import specs_from_hf_config


def test_bench_gpt_oss_times_the_sinks_groups(monkeypatch, capsys, ref_registry):
    calls = []

    def one_call(fn, iters, device):
        fn()
        calls.append(iters)
        return 1.0

    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    monkeypatch.setattr(bench, "_time", one_call)
    argv = ["bench", "--model", "gpt-oss", "--device", "cpu", "--batch", "2", "--context", "5"]
    rc = cli.main([*argv, "--iters", "1", "--json"])
    results = json.loads(capsys.readouterr().out)
    sinks_groups = [
        g.group_id
        for g in specs_from_hf_config("gpt-oss", dtype="float32").groups
        if g.spec.has_sinks
    ]
    assert sinks_groups  # the model has sinks, or the test proves nothing
    assert [r["error"] for r in results] == [None] * len(results)
    assert rc == 0
    timed = {(r["group_id"], r["backend"]) for r in results}
    assert {(g, "attn_core:reference") for g in sinks_groups} <= timed
    assert calls  # the steps ran


def test_bench_times_under_the_graph_mode_the_plan_lowered_to(monkeypatch, capsys, ref_registry):
    """The reference has no graph mode full: the plan lowers it to decode (with a warning), and
    the bench judges its candidates under the plan's mode, not the one asked for."""
    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    monkeypatch.setattr(bench, "_time", lambda fn, iters, device: (fn(), 1.0)[1])
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "2", "--context", "5"]
    rc = cli.main([*argv, "--iters", "1", "--graph-mode", "full", "--json"])
    captured = capsys.readouterr()
    results = json.loads(captured.out)
    # the selector's warning as the CLI's line (it was a raw UserWarning with a source line)
    assert "attn bench: warning: " in captured.err, captured.err
    assert "graph mode lowered full -> decode" in captured.err, captured.err
    assert "UserWarning" not in captured.err, captured.err
    assert rc == 0
    assert [(r["phase"], r["backend"], r["error"]) for r in results] == [
        ("prefill", "attn_core:reference", None),
        ("decode", "attn_core:reference", None),
    ]
