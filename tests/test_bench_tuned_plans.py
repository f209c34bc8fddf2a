"""bench/bench_tuned_plans.py on the CPU with stand-in timings: the tuning grid, the tuned plan
and the check rows are the script's own; only the kernel times are a table."""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import attn_core.reference.plugin as ref
from attn_core.backend import Backend, BackendCapabilities
from attn_core.bench import BenchResult
from attn_core.models import specs_from_hf_config
from attn_core.registry import Registry
from attn_core.selector import PhaseChoice, TuningData
from attn_core.specs import Phase

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_tuned_plans", ROOT / "bench" / "bench_tuned_plans.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in(timed: list | None = None, time: Callable[[str, str, int, int], float] | None = None):
    """bench_group with ``time(backend, phase, batch, context)`` (default :func:`_time`'s
    table; it may raise, as a failing kernel does), appending each timing to ``timed``."""

    def bench_group(group, backend, registry, plan, device, *, batch, context, iters, phase):
        if timed is not None:
            timed.append((phase.value, backend.qualified_name, batch, context))
        us = (time or _time)(backend.qualified_name, phase.value, batch, context)
        return BenchResult(group.group_id, backend.qualified_name, us, us, phase=phase.value,
                           batch=batch, context=context)  # fmt: skip

    return bench_group


def _time(backend: str, phase: str, batch: int, context: int) -> float:
    """short:s is fastest at short contexts and single-request prefill, long:l at long contexts
    and split prefill: every bucket's points disagree."""
    if phase == "prefill":
        per_token = (
            {"short:s": 1.0, "long:l": 1.3} if batch == 1 else {"short:s": 1.6, "long:l": 1.2}
        )
        return per_token[backend] * batch * context
    per_token = (
        {"short:s": 1.0, "long:l": 2.0} if context <= 4096 else {"short:s": 4.0, "long:l": 1.5}
    )
    return per_token[backend] * batch * context / 1000


CAPS = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"bfloat16", "float32"})


def _allocate(backend, group, device, constraints, state, workspace):
    """The stand-in plugins' contexts are the reference's (only their timings are made up)."""
    return ref.attn_core_allocate_context(
        backend=backend, group=group, device=device, constraints=constraints, state=state,
        workspace=workspace,
    )  # fmt: skip


def _registry(make_plugin, *backends: tuple[str, Backend]) -> Registry:
    """The reference plus one plugin per ``(plugin name, backend)``."""
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, backend in backends:
        reg.register_plugin(make_plugin(plugin, [backend], allocate=_allocate), name=plugin)
    return reg


@pytest.fixture
def registry(make_plugin) -> Registry:
    return _registry(
        make_plugin,
        ("short", Backend(name="s", capabilities=CAPS, priority=50)),
        ("long", Backend(name="l", capabilities=CAPS, priority=60)),
    )


def _small_grid() -> argparse.Namespace:
    """Two batch sizes and contexts, two prefill sizes in 1 and 4 requests, a check point on
    and one off the grid per phase, one round."""
    return argparse.Namespace(
        tune_batch="1,16", tune_context="2048,16384", max_kv_tokens=2**18,
        tune_prefill="1024,4096", tune_prefill_requests="1,4", graph_mode="none",
        decode_points="1x2048,1x32768", prefill_points="1x4096,4x1024", rounds=1, iters=1,
    )  # fmt: skip


def test_the_tuned_plan_is_checked_on_and_off_its_grid(registry, monkeypatch, capsys):
    script = _script()
    timed: list = []
    monkeypatch.setattr(script, "bench_group", _stand_in(timed))
    args = argparse.Namespace(
        tune_batch="1,16", tune_context="2048,16384", max_kv_tokens=2**18,
        tune_prefill="1024,4096", tune_prefill_requests="1,4", graph_mode="none",
        decode_points="1x2048,1x32768,16x8192", prefill_points="1x4096,4x1024,2x2048",
        rounds=2, iters=1,
    )  # fmt: skip
    rows: list[dict] = []
    tunings: dict = {}
    saved: list[tuple[int, bool]] = []  # (rows, tuning present) at each save

    def save() -> None:
        saved.append((len(rows), "qwen3" in tunings))

    script.bench_model("qwen3", registry, torch.device("cpu"), args, tunings, rows, save)
    # saved after each phase's grid (both candidates, 2 phases), once the tuning is complete,
    # then after every row: a killed run keeps what it measured
    assert saved == [(0, True)] * 2 + [(n, True) for n in range(len(rows) + 1)]
    # the decode grid stops at max_kv_tokens: 16 x 16384 = 2^18 is in, nothing above
    assert {(b, c) for ph, n, b, c in timed if ph == "decode" and n == "long:l"} >= {
        (1, 2048), (1, 16384), (16, 2048), (16, 16384)
    }  # fmt: skip
    got = {(r["phase"], r["batch"], r["context"]): (r["chosen"], r["fastest"]) for r in rows}
    # prefill: one token bucket per count, switched by requests (1: short, 4: long)
    assert got[("prefill", 1, 4096)] == ("short:s", "short:s")
    assert got[("prefill", 4, 1024)] == ("long:l", "long:l")
    # decode: a batch bucket's contexts disagree; the worst ratio decides (long loses 2x at 2k,
    # short 2.7x at 16k), so 1 x 2048 is a miss the check reports
    assert got[("decode", 1, 2048)] == ("long:l", "short:s")
    assert got[("decode", 1, 32768)] == ("long:l", "long:l")
    ratios = {(r["phase"], r["batch"], r["context"]): r["ratio"] for r in rows}
    assert ratios[("decode", 1, 2048)] == pytest.approx(2.0)
    assert ratios[("prefill", 4, 1024)] == pytest.approx(1.0)
    notes = {(r["phase"], r["batch"], r["context"]): r["note"] for r in rows}
    assert (
        notes[("prefill", 4, 1024)] == "tuned point"
        and notes[("decode", 1, 32768)] == "not tuned on"
    )
    # the tuning data the plan used travels with the rows
    entries = tunings["qwen3"]["entries"]
    assert any(e.get("points") for e in entries)
    out = capsys.readouterr().out
    assert "# qwen3 full prefill:" in out and "tokens, <= 2 requests: short:s" in out, out
    assert "# tune qwen3 full decode long:l B=16 ctx=16384: " in out, out  # progress per point

    # --tuning-in: a second call checks the same plan from the saved tuning, timing no grid
    timed.clear()
    args.tuning_in = tunings
    again: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, again)
    assert [(r["chosen"], r["ratio"]) for r in again] == [(r["chosen"], r["ratio"]) for r in rows]
    checks = len(rows) * 2 * args.rounds  # every check point: both candidates, every round
    assert len(timed) == checks, timed
    assert "# qwen3: tuning from --tuning-in" in capsys.readouterr().out


def test_a_point_with_a_candidate_not_loadable_here_says_so(make_plugin, monkeypatch):
    """A backend that cannot load on this machine (fa3 without its FlashAttention parts) leaves
    one candidate: its rows read 'only candidate; not loadable here: ...', not as uncontested."""
    script = _script()
    gone = Backend(name="g", capabilities=CAPS, available=False, unavailable_reason="no kernels")
    registry = _registry(
        make_plugin, ("short", Backend(name="s", capabilities=CAPS, priority=50)), ("gone", gone)
    )
    monkeypatch.setattr(script, "bench_group", _stand_in())
    args = argparse.Namespace(
        tune_batch="1", tune_context="2048", max_kv_tokens=2**18, tune_prefill="1024",
        tune_prefill_requests="1", graph_mode="none", decode_points="1x2048",
        prefill_points="1x1024", rounds=1, iters=1,
    )  # fmt: skip
    rows: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, rows)
    assert rows and all(r["chosen"] == "short:s" for r in rows)
    assert all(r["note"] == "only candidate; not loadable here: gone:g" for r in rows), rows
    assert all(r["not_loadable"] == ["gone:g"] for r in rows)


@pytest.mark.parametrize("cut_after", [1, 5], ids=["in the tuning", "in the check rows"])
def test_a_run_cut_at_its_limit_is_resumed_without_measuring_twice(
    registry, monkeypatch, cut_after: int
):
    """--resume: a call killed in the middle of its work (as the H200's limit cut gpt-oss's
    tuning) leaves an --out file; the next call tunes only the candidates it had not finished,
    keeps the check rows it has, and ends with the plan and rows of an uncut run. Saves come
    after each of the 2 phases' grids (2 candidates each), after the complete tuning, then
    after each row."""
    script = _script()
    args = _small_grid()
    uncut_timed: list = []
    monkeypatch.setattr(script, "bench_group", _stand_in(uncut_timed))
    uncut: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, uncut)

    class Killed(Exception):
        pass

    timed: list = []
    monkeypatch.setattr(script, "bench_group", _stand_in(timed))
    rows: list[dict] = []
    tunings: dict = {}
    progress: dict = {}
    files: list[str] = []

    def save() -> None:
        files.append(json.dumps({"rows": rows, "tuning": tunings, "tuned": progress}))
        if len(files) == cut_after:
            raise Killed

    with pytest.raises(Killed):
        script.bench_model(
            "qwen3", registry, torch.device("cpu"), args, tunings, rows, save, progress
        )
    file = json.loads(files[-1])
    assert len(file["tuned"]["qwen3"]) == 2 * min(cut_after, 2)
    assert len(file["rows"]) == max(cut_after - 3, 0)
    cut_timed = len(timed)
    args.resume = file
    again: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, again, progress={})
    assert [(r["chosen"], r["ratio"]) for r in again] == [(r["chosen"], r["ratio"]) for r in uncut]
    # nothing measured twice: the cut run and the resumed one time what one uncut run does
    assert cut_timed < len(timed) == len(uncut_timed)


def test_a_layer_spec_two_models_share_is_timed_once_per_run(registry, monkeypatch, capsys):
    """bamba's attention layers have qwen3's spec (32q/8kv d128): with one ``shared`` dict for
    the run, bamba's tuning grid and check points come from qwen3's timings, and its rows
    say so; a spec of its own would be timed."""
    script = _script()
    timed: list = []
    monkeypatch.setattr(script, "bench_group", _stand_in(timed))
    args = _small_grid()
    shared: dict = {}
    qwen3: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, qwen3, shared=shared)
    first = len(timed)
    assert first > 0
    bamba: list[dict] = []
    tunings: dict = {}
    script.bench_model("bamba", registry, torch.device("cpu"), args, tunings, bamba,
                       shared=shared)  # fmt: skip
    assert len(timed) == first, "bamba's attention layers were timed again"
    full = [r for r in bamba if r["group"] == "full"]
    assert full and all("timed with qwen3 (the same layer spec)" in r["note"] for r in full)
    by_point = {(r["phase"], r["batch"], r["context"]): (r["chosen"], r["us"]) for r in qwen3}
    assert all(by_point[(r["phase"], r["batch"], r["context"])] == (r["chosen"], r["us"])
               for r in full)  # fmt: skip
    assert tunings["bamba"]["entries"], "bamba's tuning data is recorded all the same"
    assert "qwen3's grid (the same layer spec)" in capsys.readouterr().out
    # without the shared dict every model times its own layers
    script.bench_model("bamba", registry, torch.device("cpu"), args, {}, [])
    assert len(timed) > first


def test_the_summary_table_says_per_group_and_phase_how_the_plan_did(
    registry, monkeypatch, tmp_path, capsys
):
    """The table a run ends with, and ``--summary FILE`` prints from its saved file: per group
    and phase the tuned plan, its check points, how many are within 1.03, the worst ratio."""
    script = _script()
    monkeypatch.setattr(script, "bench_group", _stand_in([]))
    args = _small_grid()
    rows: list[dict] = []
    plans: dict = {}
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, rows, plans=plans)
    assert set(plans["qwen3"]) == {"full/prefill", "full/decode"}
    table = script.summary_table({"rows": rows, "plans": plans}).splitlines()
    assert table[0].startswith("| model | group | phase | tuned plan | check points |")
    decode = next(line for line in table if "| decode |" in line)
    prefill = next(line for line in table if "| prefill |" in line)
    # decode 1 x 2048 is the stand-in's miss (2.0), 1 x 32768 is off the grid
    assert decode.endswith("| 1x2048, 1x32768 | 1 of 2 | 2.000 | 1 |"), decode
    assert prefill.endswith("| 1x4096, 4x1024 | 2 of 2 | 1.000 | 0 |"), prefill
    assert f"| {plans['qwen3']['full/prefill']} |" in prefill
    saved = tmp_path / "tuned.json"
    saved.write_text(json.dumps({"rows": rows, "plans": plans}))
    monkeypatch.setattr("sys.argv", ["bench_tuned_plans.py", "--summary", str(saved)])
    assert script.main() == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == table[-2:]


def test_the_plan_is_made_for_the_largest_step_the_bench_times(registry, monkeypatch):
    """The tuned plan is selected with step limits that hold every tuning and check point: a
    plan under the default 8192-token limit left a 16384-token step to the phase's default
    backend, though the tuning had timed another one faster at every split of that size."""
    script = _script()

    def time(backend: str, phase: str, batch: int, context: int) -> float:
        tokens = batch * context  # short:s fastest up to 8192 tokens, long:l above
        fast = (backend == "short:s") == (tokens <= 8192)
        return tokens * (1.0 if fast else 1.5)

    monkeypatch.setattr(script, "bench_group", _stand_in(time=time))
    args = argparse.Namespace(
        tune_batch="1,512", tune_context="2048", max_kv_tokens=2**20,
        tune_prefill="4096,16384", tune_prefill_requests="1,2", graph_mode="none",
        decode_points="512x2048", prefill_points="1x16384,2x8192,1x4096",
        rounds=1, iters=1,
    )  # fmt: skip
    rows: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, rows)
    chosen = {(r["phase"], r["batch"], r["context"]): r["chosen"] for r in rows}
    assert chosen[("prefill", 1, 16384)] == "long:l"
    assert chosen[("prefill", 2, 8192)] == "long:l"
    assert chosen[("prefill", 1, 4096)] == "short:s"
    assert max(r["ratio"] for r in rows) == pytest.approx(1.0)


def test_replan_scores_a_saved_run_from_its_own_tuning_and_medians(registry, monkeypatch):
    """``--replan``: the saved rows' choices come from a plan made anew from the saved tuning
    (nothing timed), their ratios from the medians the rows measured."""
    from attn_core.specs import DeviceCapabilities

    script = _script()
    monkeypatch.setattr(script, "bench_group", _stand_in([]))
    args = _small_grid()
    rows: list[dict] = []
    tunings: dict = {}
    plans: dict = {}
    script.bench_model("qwen3", registry, torch.device("cpu"), args, tunings, rows, plans=plans)
    # a saved run whose plan chose otherwise: every row on the other backend
    other = {"short:s": "long:l", "long:l": "short:s"}
    saved = {"tuning": tunings, "rows": [{**r, "chosen": other[r["chosen"]]} for r in rows]}
    monkeypatch.setattr(script, "bench_group", None)  # nothing may be timed
    again, replanned = script.replan(saved, args, registry, DeviceCapabilities.detect("cpu"))
    assert [(r["chosen"], r["ratio"], r["note"]) for r in again] == [
        (r["chosen"], r["ratio"], r["note"]) for r in rows
    ]
    assert replanned == plans


def test_a_split_that_does_not_divide_the_token_count_is_tuned_in_its_bucket(registry, monkeypatch):
    """Three requests of a 4096-token step are timed as 3 x 1365 and kept in the 4096-token
    bucket with the other splits: without a 3-request split a 3-request step went to the
    4-request winner (the H100 run's 3 x 4000 miss, 1.11 of the fastest)."""
    script = _script()

    def time(backend: str, phase: str, batch: int, context: int) -> float:
        fast = (backend == "short:s") == (batch <= 3)  # s up to 3 requests
        return batch * context * (1.0 if fast else 1.5)

    monkeypatch.setattr(script, "bench_group", _stand_in(time=time))
    args = argparse.Namespace(
        tune_batch="1", tune_context="2048", max_kv_tokens=2**20,
        tune_prefill="1024,4096", tune_prefill_requests="1,2,3,4", graph_mode="none",
        decode_points="1x2048", prefill_points="3x1300,4x1000,2x2000", rounds=1, iters=1,
    )  # fmt: skip
    assert (3, 1365) in script._tuning_grid(Phase.PREFILL, args)
    rows: list[dict] = []
    tunings: dict = {}
    script.bench_model("qwen3", registry, torch.device("cpu"), args, tunings, rows)
    tuning = TuningData.from_json(tunings["qwen3"])
    group = specs_from_hf_config("qwen3", dtype="bfloat16").groups[0]
    assert set(tuning.shapes("short:s", group.spec, Phase.PREFILL, 4096)) == {1, 2, 3, 4}
    assert tuning.points("short:s", group.spec, Phase.PREFILL).keys() == {1024, 4096}
    chosen = {(r["batch"], r["context"]): r["chosen"] for r in rows if r["phase"] == "prefill"}
    assert chosen == {(3, 1300): "short:s", (4, 1000): "long:l", (2, 2000): "short:s"}


def test_the_tuning_times_the_candidates_in_alternating_rounds(registry, monkeypatch):
    """Each tuning point times every candidate once a round for --tune-rounds rounds, the order
    rotated each round, and records each candidate's median: a slow sample of the faster
    backend (a clock dip) does not hand its bucket to the other."""
    script = _script()
    order: list[str] = []
    #: each backend's 1st, 2nd and 3rd sample at every point: short:s is faster but for one
    samples = {"short:s": [1.0, 9.0, 1.1], "long:l": [2.0, 2.1, 2.2]}

    def time(backend: str, phase: str, batch: int, context: int) -> float:
        if phase == "prefill" and (batch, context) == (1, 1024):
            order.append(backend)
        return samples[backend][order.count(backend) - 1] if order else 1.0

    monkeypatch.setattr(script, "bench_group", _stand_in(time=time))
    args = _small_grid()
    args.tune_rounds = 3
    tunings: dict = {}
    script.bench_model("qwen3", registry, torch.device("cpu"), args, tunings, [])
    first = order[:6]
    assert first[:2] == first[4:6] == first[3:1:-1] and set(first[:2]) == set(samples)
    tuning = TuningData.from_json(tunings["qwen3"])
    spec = specs_from_hf_config("qwen3", dtype="bfloat16").groups[0].spec
    assert tuning.shapes("short:s", spec, Phase.PREFILL, 1024)[1] == pytest.approx(1.1)
    assert tuning.shapes("long:l", spec, Phase.PREFILL, 1024)[1] == pytest.approx(2.1)


def test_a_plan_that_switches_only_by_requests_reads_without_an_empty_step_size_list():
    """gpt-oss's full layers switched by requests in one token bucket and by nothing else: the
    H100 run's table read "fa3:fa3 (by step size: ; 8193-16384 tokens in <= 2 requests: ...)".
    The table now says it as explain does."""
    script = _script()
    fa3 = Backend(name="fa3", capabilities=CAPS, plugin="fa3")
    fi = Backend(name="flashinfer", capabilities=CAPS, plugin="flashinfer")

    def choice(by_step_size=(), by_requests=(), backend=fa3) -> PhaseChoice:
        return PhaseChoice(phase=Phase.PREFILL, backend=backend, rejected=(), outranked=(),
                           by_step_size=by_step_size, by_requests=by_requests)  # fmt: skip

    only_requests = choice(by_requests=((8192, 16384, 2, fi), (8192, 16384, 1024, fa3)))
    assert script._said(only_requests) == (
        "fa3:fa3 (by requests (tuned): 8193-16384 tokens, <= 2 requests: flashinfer:flashinfer; "
        "8193-16384 tokens, <= 1024 requests: fa3:fa3)"
    )
    both = choice(by_step_size=((2048, fa3), (16384, fi)), by_requests=((0, 2048, 1, fi),))
    assert script._said(both) == (
        "fa3:fa3 (by step size (tuned): <= 2048 tokens: fa3:fa3; <= 16384 tokens: "
        "flashinfer:flashinfer; by requests (tuned): 1-2048 tokens, <= 1 requests: "
        "flashinfer:flashinfer)"
    )
    assert script._said(choice(backend=fi)) == "flashinfer:flashinfer"


def test_a_candidate_that_fails_a_point_is_timed_once_there(registry, monkeypatch, capsys):
    """long:l fails every step: each tuning and check point reports it once, not once a round,
    and the plan and the rows go to the candidate that ran."""
    script = _script()
    timed: list[tuple[str, str, int, int]] = []

    def time(backend: str, phase: str, batch: int, context: int) -> float:
        if backend == "long:l":
            raise RuntimeError("no kernel for this shape")
        return _time(backend, phase, batch, context)

    monkeypatch.setattr(script, "bench_group", _stand_in(timed, time))
    args = _small_grid()
    args.tune_rounds = args.rounds = 3
    rows: list[dict] = []
    script.bench_model("qwen3", registry, torch.device("cpu"), args, {}, rows)
    points = 4 + 4 + 2 + 2  # tuning grid (prefill, decode), then check points (decode, prefill)
    assert len([t for t in timed if t[1] == "long:l"]) == points  # once a point
    assert len([t for t in timed if t[1] == "short:s"]) == 3 * points  # every round
    assert rows and all(r["chosen"] == r["fastest"] == "short:s" for r in rows)
    assert capsys.readouterr().out.count("long:l prefill B=1 ctx=1024: no kernel") == 1
