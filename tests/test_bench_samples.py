"""``attn bench --model NAME`` works for every bundled sample (issue 24).

The H200 bench of gpt-oss failed every candidate because the bench fed no sinks tensor; only
four samples had a CPU test then. Here the CLI's bench path runs for every sample name on the
CPU with the reference registry, small steps (two requests, one grid point) and every phase
(``--spec-tokens 2`` adds verify). ``bench._time`` is a stand-in that runs the step once for
real (so a backend that refuses the bench's inputs fails the test) and returns a time from
:data:`BASE_US`; the tuning file the bench writes must hold that time for every group's spec,
phase and candidate.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from attn_core import bench, cli
from attn_core.bench import admissible_backends
from attn_core.models import sample_names, specs_from_hf_config
from attn_core.options import resolve_backend_options
from attn_core.registry import Registry
from attn_core.selector import TuningData, select
from attn_core.specs import DeviceCapabilities, LayerKind, Phase

#: Samples whose whole model the mapper refuses in every command, with the sample that maps
#: (Whisper's decoder cross-attention has no layer kind; its encoder stack maps alone).
REFUSED = {"whisper": "whisper-encoder"}
BATCH, CONTEXT, SPEC_TOKENS = 2, 17, 2  # 17 cached tokens cross a 16-token page boundary
#: the stand-in time per layer of one step, by phase
BASE_US = {"prefill": 30.0, "decode": 5.0, "verify": 8.0}

# (group, phase, backend) as strings
Candidate = tuple[str, str, str]


def _argv(name: str, tuning: str) -> list[str]:
    return [
        "bench",
        "--model",
        name,
        "--device",
        "cpu",
        "--batch",
        str(BATCH),
        "--context",
        str(CONTEXT),
        "--spec-tokens",
        str(SPEC_TOKENS),
        "--iters",
        "1",
        "--rounds",
        "1",
        "--json",
        "--write-tuning",
        tuning,
    ]


def _expected(name: str, registry: Registry, argv: list[str]) -> dict[Candidate, Any]:
    """Every admissible (group, phase, backend) of ``name``'s bench, mapped to its group's
    spec: what the selector plans and the candidate filter admits, computed here from the
    same arguments the CLI parses."""
    args = cli.build_parser().parse_args(argv)
    constraints = cli._constraints(args)
    caps = DeviceCapabilities.detect(torch.device("cpu"))
    layout = specs_from_hf_config(name, dtype="float32")
    plan = select(layout.groups, registry, caps, constraints)
    options = resolve_backend_options(registry, plan.constraints)
    out: dict[Candidate, Any] = {}
    for group in layout.groups:
        phases = plan.choice(group.group_id).planned_phases
        # an encoder is one prefill; every other group steps through all three phases
        want = {Phase.PREFILL} if group.spec.kind is LayerKind.ENCODER else set(Phase)
        assert set(phases) == want, (group.group_id, phases)
        for phase in phases:
            backends = admissible_backends(registry, group, caps, plan, phase, options)
            assert backends, f"{group.group_id} {phase.value}: no candidate"
            for backend in backends:
                out[(group.group_id, phase.value, backend.qualified_name)] = group.spec
    return out


@pytest.fixture
def stand_in_time(monkeypatch, ref_registry) -> list[tuple[Candidate, int]]:
    """``bench._time`` replaced by one real call of the step and a time from :data:`BASE_US`;
    returns ``[((group, phase, backend), steps run), ...]``, one per ``bench_group`` call."""
    real_bench_group = bench.bench_group
    calls: list[tuple[Candidate, int]] = []
    current: dict[str, Any] = {}

    def one_call(fn, iters, device) -> float:
        fn()  # the real step: an input the backend refuses raises here
        current["runs"] += 1
        return BASE_US[current["phase"]]

    def recording(group, backend, registry, plan, device, **kw: Any):
        current.update(phase=Phase(kw["phase"]).value, runs=0)
        res = real_bench_group(group, backend, registry, plan, device, **kw)
        calls.append(((group.group_id, current["phase"], backend.qualified_name), current["runs"]))
        return res

    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    monkeypatch.setattr(bench, "_time", one_call)
    monkeypatch.setattr(bench, "bench_group", recording)
    return calls


@pytest.mark.parametrize("name", [n for n in sample_names() if n not in REFUSED])
def test_bench_times_every_candidate_of_every_group_and_phase(
    name: str, tmp_path, capsys, stand_in_time, ref_registry
) -> None:
    path = str(tmp_path / "tuning.json")
    argv = _argv(name, path)
    expected = _expected(name, ref_registry, argv)

    rc = cli.main(argv)

    captured = capsys.readouterr()
    results = json.loads(captured.out.splitlines()[0])
    errors = {(r["group_id"], r["phase"], r["backend"]): r["error"] for r in results if r["error"]}
    assert errors == {}
    assert rc == 0, captured.err
    timed = [candidate for candidate, _ in stand_in_time]
    assert sorted(timed) == sorted(expected)  # each candidate once (one grid point)
    # through the binding and directly: two real steps per candidate
    assert {runs for _, runs in stand_in_time} == {2}
    tuning = TuningData.load(path)
    for (group_id, phase, backend), spec in expected.items():
        got = tuning.time(backend, spec, Phase(phase))
        assert got == pytest.approx(BASE_US[phase]), (group_id, phase, backend)


@pytest.mark.parametrize(("name", "instead"), sorted(REFUSED.items()))
def test_a_sample_the_mapper_refuses_names_the_one_to_bench(
    name: str, instead: str, tmp_path, capsys, stand_in_time
) -> None:
    rc = cli.main(_argv(name, str(tmp_path / "tuning.json")))

    err = capsys.readouterr().err
    assert rc == 2
    assert instead in err and "refused" in err
    assert instead in sample_names()  # which the test above benches
    assert stand_in_time == []
    assert not (tmp_path / "tuning.json").exists()


def test_each_point_is_reported_on_stderr_as_it_is_measured(
    tmp_path, capsys, stand_in_time, ref_registry
) -> None:
    """A bench cut at a device call's time limit printed nothing: the table comes at the end.
    Each grid point now has a line on stderr as it ends (the JSON on stdout stays one line)."""
    argv = _argv("qwen3", str(tmp_path / "tuning.json"))
    expected = _expected("qwen3", ref_registry, argv)

    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("bench: ")]
    assert len(lines) == len(expected), captured.err
    for group_id, phase, backend in expected:
        head = f"bench: {group_id} {phase} {backend} B={BATCH} ctx={CONTEXT}: "
        want = f"{head}{BASE_US[phase]:.1f} us/layer (binding), {BASE_US[phase]:.1f} direct"
        assert want in lines, (want, lines)
    assert "bench: " not in captured.out  # stdout keeps the JSON a reader parses
    json.loads(captured.out.splitlines()[0])

    assert cli.main([*argv, "--no-progress"]) == 0
    assert "bench: " not in capsys.readouterr().err
