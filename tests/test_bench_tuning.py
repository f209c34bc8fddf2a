"""``attn bench --write-tuning`` writes a time per backend, group, phase and batch size over a
grid of batch sizes and context lengths, and the selector ranks each phase by it.

Two stand-in CPU plugins (``fast_prefill:fp``, ``fast_decode:fd``, both the reference's contexts)
are "timed" by a stand-in table: ``fp`` is faster at prefill, ``fd`` at decode, with the opposite
order of their declared priorities. What the bench writes and what the selector does with it is
the real code.
"""

from __future__ import annotations

import json
import math

import pytest

import attn_core.reference.plugin as ref
from attn_core import bench, cli
from attn_core.backend import Backend, BackendCapabilities
from attn_core.bench import BenchResult
from attn_core.models import specs_from_hf_config
from attn_core.registry import Registry
from attn_core.selector import TuningData, phase_mapping_from_plan, select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, Phase

#: (backend, phase) -> us per layer at batch B and context C: base * B ** 0.5 * (1 + C / 1000)
BASE = {
    ("fast_prefill:fp", "prefill"): 10.0,
    ("fast_decode:fd", "prefill"): 30.0,
    ("attn_core:reference", "prefill"): 300.0,
    ("fast_prefill:fp", "decode"): 20.0,
    ("fast_decode:fd", "decode"): 5.0,
    ("attn_core:reference", "decode"): 200.0,
}


def _stand_in_time(backend: str, phase: str, batch: int, context: int) -> float:
    """Verify steps take what decode steps take, in this table."""
    base = BASE[(backend, "decode" if phase == "verify" else phase)]
    return base * batch**0.5 * (1 + context / 1000)


@pytest.fixture
def registry(make_plugin) -> Registry:
    def backend(name, priority):
        return Backend(
            name=name,
            capabilities=BackendCapabilities(
                kinds={"full"}, device_types={"cpu"}, dtypes={"float32"}, max_speculative_tokens=8
            ),
            priority=priority,
        )

    def allocate(backend, group, device, constraints, state, workspace):
        return ref.attn_core_allocate_context(
            backend=backend,
            group=group,
            device=device,
            constraints=constraints,
            state=state,
            workspace=workspace,
        )

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    # declared priorities rank fd first in every phase: only the measurements say otherwise
    reg.register_plugin(
        make_plugin("fast_prefill", [backend("fp", 10)], allocate=allocate), name="fast_prefill"
    )
    reg.register_plugin(
        make_plugin("fast_decode", [backend("fd", 90)], allocate=allocate), name="fast_decode"
    )
    return reg


@pytest.fixture
def timed(monkeypatch, registry):
    calls = []

    def fake_bench_group(group, backend, registry, plan, device, *, batch, context, iters, phase):
        calls.append((group.group_id, backend.qualified_name, phase.value, batch, context))
        us = _stand_in_time(backend.qualified_name, phase.value, batch, context)
        return BenchResult(
            group.group_id,
            backend.qualified_name,
            us,
            us,
            phase=phase.value,
            batch=batch,
            context=context,
        )

    monkeypatch.setattr(cli, "_registry", lambda args: registry)
    monkeypatch.setattr(bench, "bench_group", fake_bench_group)
    return calls


def test_bench_writes_per_phase_and_batch_and_the_selector_ranks_by_it(tmp_path, timed, registry):
    path = tmp_path / "tuning.json"
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "1,4,16"]
    argv += ["--include-reference"]
    assert cli.main([*argv, "--context", "100,900", "--write-tuning", str(path)]) == 0
    # every candidate, phase and grid point was timed, in 3 rounds (the default)
    assert len(timed) == 3 * 2 * 3 * 2 * 3
    assert {(b, p) for _, b, p, _, _ in timed} == set(BASE)
    payload = json.loads(path.read_text())
    assert payload["format"] == 3
    decode = {(e["backend"], e["batch"]): e["us"] for e in payload["entries"]
              if e["phase"] == "decode"}  # fmt: skip
    assert len(decode) == 3 * 3  # one per backend and batch size
    want = math.sqrt(
        _stand_in_time("fast_decode:fd", "decode", 4, 100)
        * _stand_in_time("fast_decode:fd", "decode", 4, 900)
    )
    assert decode[("fast_decode:fd", 4)] == pytest.approx(want)  # geomean over contexts
    # prefill: one bucket per token count (batch * context), 6 distinct ones here
    prefill = {(e["backend"], e["tokens"]): e["us"] for e in payload["entries"]
               if e["phase"] == "prefill"}  # fmt: skip
    assert {n for _, n in prefill} == {b * c for b in (1, 4, 16) for c in (100, 900)}
    assert prefill[("fast_prefill:fp", 3600)] == pytest.approx(
        _stand_in_time("fast_prefill:fp", "prefill", 4, 900)
    )

    tuning = TuningData.load(path)
    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    cpu = DeviceCapabilities.target("cpu")
    plan = select(groups, registry, cpu, ExecutionConstraints(), tuning=tuning)
    assert phase_mapping_from_plan(plan)["full"] == {
        "prefill": "fast_prefill:fp",
        "decode": "fast_decode:fd",
    }
    # without the tuning file, the declared priorities: fd for both
    plan = select(groups, registry, cpu, ExecutionConstraints())
    assert set(phase_mapping_from_plan(plan)["full"].values()) == {"fast_decode:fd"}
    # a forced phase wins over the measurements
    forced = ExecutionConstraints(force={"prefill:full": "fd"})
    plan = select(groups, registry, cpu, forced, tuning=tuning)
    assert phase_mapping_from_plan(plan)["full"]["prefill"] == "fast_decode:fd"


def test_the_reference_is_not_timed_where_a_plugin_is_a_candidate(tmp_path, timed, capsys):
    """On the H200 a bench at ctx 32768 printed nothing in a 185 s call: the reference's
    prefill, 46x flashinfer's time at 8 x 1024 tokens and quadratic in the context, is where
    such a run goes. The default rule ranks the reference below every plugin anyway, so it is
    left out (and said so) and the selector's choice from the file is the same."""
    path = tmp_path / "tuning.json"
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "1,4", "--context", "100"]
    assert cli.main([*argv, "--write-tuning", str(path)]) == 0
    out = capsys.readouterr().out
    assert {b for _, b, _, _, _ in timed} == {"fast_prefill:fp", "fast_decode:fd"}
    assert "attn_core:reference not timed where a plugin is a candidate (full prefill, " in out
    assert "--include-reference" in out
    assert "attn_core:reference" not in {e["backend"] for e in json.loads(path.read_text())[
        "entries"]}  # fmt: skip
    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    plan = select(groups, cli._registry(None), DeviceCapabilities.target("cpu"),
                  ExecutionConstraints(), tuning=TuningData.load(path))  # fmt: skip
    assert phase_mapping_from_plan(plan)["full"] == {
        "prefill": "fast_prefill:fp",
        "decode": "fast_decode:fd",
    }


def test_bench_times_verify_with_speculative_tokens(timed):
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--spec-tokens", "2", "--json"]
    assert cli.main(argv) == 0
    assert {p for _, _, p, _, _ in timed} == {"prefill", "decode", "verify"}


def test_bench_skips_prefill_points_over_the_token_cap(timed, capsys):
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "2,8", "--context", "64"]
    assert cli.main([*argv, "--max-prefill-tokens", "200"]) == 0
    prefill = {(b, batch) for _, b, p, batch, _ in timed if p == "prefill"}
    assert {batch for _, batch in prefill} == {2}  # 8 x 64 > 200
    assert "skipped (over --max-prefill-tokens 200): full prefill" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch", "1,x", "'x' is not an integer"),
        ("--context", "0", "0 is not positive"),
        # "1,,2" timed 1 and 2 and said nothing of the empty entry (a lost digit?)
        ("--batch", "1,,2", "entry 2 is empty"),
        ("--context", "64,", "entry 2 is empty"),
    ],
)
def test_bench_grid_errors_name_the_flag(timed, capsys, flag, value, message):
    rc = cli.main(["bench", "--model", "qwen3", "--device", "cpu", flag, value])
    assert rc == 2
    assert f"{flag} {value!r}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--iters", "--rounds", "--max-prefill-tokens"])
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_bench_counts_below_one_are_an_error_naming_the_flag(timed, capsys, flag, value):
    """--iters 0 printed "float division by zero" as every candidate's error;
    --max-prefill-tokens 0 meant 65536 and -1 skipped every prefill point."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--model", "qwen3", "--device", "cpu", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a whole number >= 1, got {value!r}" in err
    assert timed == []


def test_bench_group_times_each_phase_for_real(registry):
    """bench_group itself (no stand-in) runs a step of each phase on the CPU."""
    import torch

    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    cpu = DeviceCapabilities.target("cpu")
    plan = select(groups, registry, cpu, ExecutionConstraints(speculative_tokens=2))
    backend = plan.choice("full").backend_for_phase("decode")
    for phase in Phase:
        res = bench.bench_group(
            groups[0],
            backend,
            registry,
            plan,
            torch.device("cpu"),
            batch=2,
            context=5,
            iters=1,
            phase=phase,
        )
        assert res.error is None and res.us_per_layer > 0 and res.phase == phase.value


def test_bench_times_every_stack_of_a_multimodal_model(timed, capsys):
    """Every group of every stack is timed, under its stack-prefixed id; ``--stack`` keeps one;
    Whisper's decoder is refused as in explain."""
    argv = ["bench", "--model", "qwen2.5-vl", "--device", "cpu", "--context", "16"]
    assert cli.main(argv) == 0
    assert {g for g, *_ in timed} == {"vision.encoder", "text.full"}
    timed.clear()
    assert cli.main(["bench", "--model", "whisper", "--stack", "encoder", "--device", "cpu"]) == 0
    assert {g for g, *_ in timed} == {"encoder.encoder"}
    capsys.readouterr()
    assert cli.main(["bench", "--model", "whisper", "--device", "cpu"]) == 2
    assert (
        "whisper: cross-attention in decoder layers 0-31: no layer kind" in capsys.readouterr().err
    )


def test_the_phases_a_graph_mode_captures_are_the_ones_timed_as_replays():
    """bench_group times a phase as a CUDA-graph replay exactly where the run's graph mode
    captures it: decode and verify under decode and full, prefill under full only."""
    from attn_core.bench import _captured
    from attn_core.selector import Plan
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints

    def plan(mode: str) -> Plan:
        return Plan(
            device=DeviceCapabilities.target("h200"),
            constraints=ExecutionConstraints(graph_mode=mode),
            choices=(),
            page_size=16,
            kv_layout="NHD",
        )

    captured = {
        (mode, phase.value): _captured(plan(mode), phase)
        for mode in ("none", "decode", "full")
        for phase in Phase
    }
    assert captured == {
        ("none", "prefill"): False,
        ("none", "decode"): False,
        ("none", "verify"): False,
        ("decode", "prefill"): False,
        ("decode", "decode"): True,
        ("decode", "verify"): True,
        ("full", "prefill"): True,
        ("full", "decode"): True,
        ("full", "verify"): True,
    }


def test_bench_times_the_candidates_in_alternating_rounds_and_keeps_each_median(
    tmp_path, monkeypatch, registry
):
    """Every grid point times every candidate once per round, the order rotated each round (a
    drift over the run, clocks or heat, falls on each candidate in turn), and the tuning keeps
    each candidate's median: a single slow sample does not rank a backend."""
    calls: list[tuple[str, int]] = []
    #: per backend, the time of its 1st, 2nd, 3rd sample at a point: one outlier each
    samples = {"fast_prefill:fp": [10.0, 90.0, 12.0], "fast_decode:fd": [50.0, 11.0, 11.5]}

    def fake_bench_group(group, backend, registry, plan, device, *, batch, context, iters, phase):
        name = backend.qualified_name
        us = 1.0
        if phase is Phase.DECODE:
            us = samples[name][sum(1 for n, _ in calls if n == name)]
            calls.append((name, batch))
        return BenchResult(group.group_id, name, us, us / 2, phase=phase.value, batch=batch,
                           context=context)  # fmt: skip

    monkeypatch.setattr(cli, "_registry", lambda args: registry)
    monkeypatch.setattr(bench, "bench_group", fake_bench_group)
    path = tmp_path / "tuning.json"
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "4", "--context", "100"]
    assert cli.main([*argv, "--rounds", "3", "--write-tuning", str(path), "--json"]) == 0
    assert [n for n, _ in calls] == [
        "fast_decode:fd", "fast_prefill:fp",
        "fast_prefill:fp", "fast_decode:fd",
        "fast_decode:fd", "fast_prefill:fp",
    ]  # fmt: skip
    decode = {e["backend"]: e["us"] for e in json.loads(path.read_text())["entries"]
              if e["phase"] == "decode"}  # fmt: skip
    assert decode == {"fast_prefill:fp": 12.0, "fast_decode:fd": 11.5}


def test_write_tuning_adds_to_an_existing_file_and_replaces_what_it_measures_again(
    tmp_path, timed, registry, capsys
):
    """A server serving several models tunes each into one file: a second --write-tuning of
    another model keeps the first model's entries (it overwrote them, a whole run lost), and
    points measured again replace their old entries instead of sitting beside them."""
    path = tmp_path / "tuning.json"
    base = ["bench", "--device", "cpu", "--rounds", "1", "--write-tuning", str(path)]
    assert cli.main([*base, "--model", "qwen3", "--batch", "1,4", "--context", "100"]) == 0
    qwen3 = TuningData.load(path)
    assert cli.main([*base, "--model", "gpt-oss", "--batch", "1", "--context", "100"]) == 0
    both = TuningData.load(path)
    assert set(qwen3.times_us) < set(both.times_us)  # gpt-oss's specs added, qwen3's kept
    assert all(both.times_us[k] == v for k, v in qwen3.times_us.items())
    out = capsys.readouterr().out
    assert f"tuning data written to {path}: " in out and f"kept from {path}" in out, out

    BASE[("fast_decode:fd", "decode")] = 50.0  # measured again, slower now
    try:
        assert cli.main([*base, "--model", "qwen3", "--batch", "4", "--context", "100"]) == 0
    finally:
        BASE[("fast_decode:fd", "decode")] = 5.0
    again = TuningData.load(path)
    assert set(again.times_us) == set(both.times_us)  # replaced, not added beside
    for key, us in both.times_us.items():
        backend, _, phase, size = key
        remeasured = key in qwen3.times_us and (backend, phase, size) == (
            "fast_decode:fd",
            Phase.DECODE,
            4,
        )
        assert again.times_us[key] == pytest.approx(10 * us if remeasured else us), key


def test_write_tuning_refuses_a_file_measured_on_another_device_before_timing(
    tmp_path, timed, capsys
):
    """Times from two devices in one file would rank backends by a mix of machines: the run
    stops before timing anything, naming the file's device and graph mode and its own."""
    path = tmp_path / "tuning.json"
    TuningData(device="h200", graph_mode="none").save(path)
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--write-tuning", str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--write-tuning {path}" in err and "h200" in err and "cpu" in err, err
    assert "another file" in err
    assert timed == []
    assert TuningData.load(path).device == "h200"


def test_write_tuning_into_a_folder_that_does_not_exist_is_refused_before_timing(
    tmp_path, timed, capsys
):
    """The file was written only after every point was timed, and a missing folder then lost
    the whole run in a traceback."""
    path = tmp_path / "no-such-folder" / "tuning.json"
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--write-tuning", str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--write-tuning {path}: cannot write there" in err, err
    assert timed == []


def test_a_candidate_that_fails_a_point_is_not_timed_again_in_later_rounds(
    monkeypatch, registry, capsys
):
    """A backend that errors at a point reports the error once; the other rounds time only the
    candidates that ran."""
    calls: list[str] = []

    def fake_bench_group(group, backend, registry, plan, device, *, batch, context, iters, phase):
        calls.append(backend.qualified_name)
        if backend.qualified_name == "fast_prefill:fp":
            raise RuntimeError("no kernel for this shape")
        return BenchResult(group.group_id, backend.qualified_name, 5.0, 5.0, phase=phase.value,
                           batch=batch, context=context)  # fmt: skip

    monkeypatch.setattr(cli, "_registry", lambda args: registry)
    monkeypatch.setattr(bench, "bench_group", fake_bench_group)
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "1", "--context", "8"]
    assert cli.main([*argv, "--rounds", "3", "--json"]) == 1  # a candidate failed
    phases = 2  # prefill and decode, one point each
    assert calls.count("fast_prefill:fp") == phases
    assert calls.count("fast_decode:fd") == 3 * phases
    results = json.loads(capsys.readouterr().out.splitlines()[0])
    errors = [r["error"] for r in results if r["backend"] == "fast_prefill:fp"]
    assert errors == ["RuntimeError: no kernel for this shape"] * phases


def test_tuning_data_from_two_devices_does_not_merge():
    """TuningData.update refuses another device's or graph mode's times, naming both."""
    base = TuningData(device="h200", graph_mode="none")
    with pytest.raises(ValueError, match="measured on h100 under graph mode none cannot join "
                       "data measured on h200 under graph mode none"):  # fmt: skip
        base.update(TuningData(device="h100", graph_mode="none"))
    with pytest.raises(ValueError, match="under graph mode decode cannot join"):
        base.update(TuningData(device="h200", graph_mode="decode"))
    assert base.times_us == {}


def _bench(tmp_path, *extra):
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--rounds", "1"]
    return cli.main([*argv, "--batch", "1,4", "--context", "100", *extra])


def test_tuning_times_hold_for_the_page_size_they_were_measured_at(tmp_path, timed, registry):
    """Times measured with --page-size 64 were recorded under the model's page size (16): a
    later run at page 16 ranked by them in silence, and a page-16 run into the same file
    replaced them. Each page size now has its own entries, and a plan uses those of its own."""
    path = tmp_path / "tuning.json"
    assert _bench(tmp_path, "--page-size", "64", "--write-tuning", str(path)) == 0
    assert _bench(tmp_path, "--page-size", "16", "--write-tuning", str(path)) == 0
    tuning = TuningData.load(path)
    pages = {json.loads(spec)["page_size"] for _, spec, _, _ in tuning.times_us}
    assert pages == {"16", "64"}
    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    cpu = DeviceCapabilities.target("cpu")
    for page in (16, 64):
        plan = select(groups, registry, cpu, ExecutionConstraints(page_size=page), tuning=tuning)
        assert plan.choice("full").tuned_us is not None, page
    only64 = TuningData.load(path)
    only64.times_us = {k: v for k, v in only64.times_us.items() if '"page_size": "64"' in k[1]}
    with pytest.warns(UserWarning, match="times no group"):
        plan = select(groups, registry, cpu, ExecutionConstraints(page_size=16), tuning=only64)
    assert plan.choice("full").tuned_us is None


def test_verify_times_hold_for_the_draft_tokens_they_were_measured_with(
    tmp_path, timed, registry, capsys
):
    """Verify times measured with 7 draft tokens replaced those measured with 1, and a plan
    verifying 1 ranked by them without a word. The file records the draft tokens its verify
    times hold for: another count is refused before timing, and a plan verifying another
    count ranks its verify phase by priority, saying why."""
    path = tmp_path / "tuning.json"
    assert _bench(tmp_path, "--spec-tokens", "1", "--write-tuning", str(path)) == 0
    tuning = TuningData.load(path)
    assert tuning.speculative_tokens == 1
    assert json.loads(path.read_text())["speculative_tokens"] == 1
    before = len(timed)
    assert _bench(tmp_path, "--spec-tokens", "7", "--write-tuning", str(path)) == 2
    err = capsys.readouterr().err
    assert "1 draft token" in err and "7" in err, err
    assert len(timed) == before
    assert _bench(tmp_path, "--write-tuning", str(path)) == 0  # no verify: joins
    assert TuningData.load(path).speculative_tokens == 1
    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    cpu = DeviceCapabilities.target("cpu")
    plan = select(groups, registry, cpu, ExecutionConstraints(speculative_tokens=1),
                  tuning=tuning)  # fmt: skip
    verify = {p.phase: p for p in plan.choice("full").phases}[Phase.VERIFY]
    assert verify.tuned_us is not None and verify.backend.qualified_name == "fast_decode:fd"
    with pytest.warns(UserWarning, match="1 draft token.*verifies 7"):
        plan = select(groups, registry, cpu, ExecutionConstraints(speculative_tokens=7),
                      tuning=tuning)  # fmt: skip
    verify = {p.phase: p for p in plan.choice("full").phases}[Phase.VERIFY]
    assert verify.tuned_us is None


@pytest.mark.parametrize(
    "header, words",
    [({"device": 5}, "device"), ({"graph_mode": ["a"]}, "graph_mode"),
     ({"graph_mode": "bogus"}, "graph_mode"), ({"speculative_tokens": -1}, "speculative_tokens")],
    ids=["device-int", "graph-mode-list", "graph-mode-unknown", "negative-draft-tokens"],
)  # fmt: skip
def test_a_tuning_file_header_of_the_wrong_type_is_refused(tmp_path, header, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": 3, "device": "cpu", "entries": [], **header}))
    with pytest.raises(ValueError, match=words):
        TuningData.load(path)


def test_bench_does_not_read_the_tuning_file_the_environment_names(
    tmp_path, timed, monkeypatch, capsys
):
    """ATTN_CORE_TUNING is for the runs that rank by it: bench read it in its own selection,
    so pointing it at the file about to be written failed before anything was timed."""
    path = tmp_path / "new.json"
    monkeypatch.setenv("ATTN_CORE_TUNING", str(path))
    assert _bench(tmp_path, "--write-tuning", str(path)) == 0, capsys.readouterr().err
    assert TuningData.load(path).times_us


def test_a_plot_path_that_cannot_be_written_is_refused_before_timing(tmp_path, timed, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "no-such-folder" / "bench.png"
    assert _bench(tmp_path, "--plot", str(path)) == 2
    assert f"--plot {path}: cannot write there" in capsys.readouterr().err
    assert timed == []


def test_bench_json_output_stays_json_when_it_writes_a_file(tmp_path, timed, capsys):
    path = tmp_path / "tuning.json"
    assert _bench(tmp_path, "--json", "--write-tuning", str(path)) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert rows and all("backend" in r for r in rows)
    assert f"tuning data written to {path}" in err


def test_tuning_data_of_another_dtype_says_which_dtype_to_plan_with(tmp_path, timed, registry):
    """attn bench on a CPU measures float32 by default, attn explain plans the config's dtype:
    the warning that the file times no group now names both dtypes and the flag."""
    path = tmp_path / "tuning.json"
    assert _bench(tmp_path, "--write-tuning", str(path)) == 0
    groups = specs_from_hf_config("qwen3", dtype="bfloat16").groups
    with pytest.warns(UserWarning, match=r"dtype float32, the plan's groups are bfloat16.*--dtype"):
        select(groups, registry, DeviceCapabilities.target("h200"), ExecutionConstraints(),
               tuning=TuningData.load(path))  # fmt: skip
