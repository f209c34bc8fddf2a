"""Tuned plans against the fastest admissible backend, per group, phase and shape.

For each model (a sample name): every admissible plugin backend of every layer group and phase
is timed on a tuning grid (decode: ``--tune-batch`` x ``--tune-context`` up to
``--max-kv-tokens`` cached tokens per step, as ``attn bench`` does; prefill: each
``--tune-prefill`` token count as one request and split into ``--tune-prefill-requests``,
prefill being bucketed by query tokens per step; the contexts of a batch size and the splits of
a token count are the bucket's points, by which the selector picks each bucket's backend; each
point times the candidates in ``--tune-rounds`` alternating rounds and keeps their medians), the
selector plans with that tuning data (printed per group and phase), and then, at check points on
and off the grid
(``--decode-points`` / ``--prefill-points``, ``BATCHxCONTEXT``), every candidate is timed again in
``--rounds`` alternating rounds (the order rotates each round) and the plan's choice for that
batch size is compared with the fastest candidate's median: ``ratio = chosen / fastest``. The
goal is ``ratio <= 1.03`` everywhere. A layer spec that several models of a run share (qwen3,
bamba, jamba and nemotron-h have the same attention layers) is timed once, for the first of
them; the others' rows say whose timings they reuse.

The reference backend is left out of the candidates: it is the ground truth, ranked last by the
default rule and never a speed candidate where a plugin serves the group. A group and phase that
one plugin alone serves is reported with ratio 1 and ``only candidate``.

Usage (on the GPU, plugins installed)::

    python bench/bench_tuned_plans.py [--models qwen3,gpt-oss,deepseek-v3,qwen3-next]
        [--rounds 3] [--out tuned.json]

``--out`` holds ``{"rows": [...], "tuning": {model: tuning file content}, "tuned": {model:
["group/phase/backend", ...]}, "plans": {model: {"group/phase": tuned plan}}}`` and is
rewritten after every group and phase's tuning grid and every check row; ``--summary FILE`` prints
such a file as a markdown table (the same table ends every run). ``--tuning-in`` takes such a
file and checks its models' tuned plans without tuning them again; ``--resume`` takes the file
of a run cut at its limit and goes on where it stopped: the candidates whose grids it finished
are not tuned again and the check rows it has are kept (a row is measured again only if it is
missing). ``--graph-mode decode`` tunes and checks the way a server replaying decode graphs
runs (decode and verify steps timed as CUDA-graph replays).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attn_core.bench import (  # noqa: E402
    admissible_backends,
    bench_group,
    record_measured,
    sample_alternating,
)
from attn_core.models import specs_from_hf_config  # noqa: E402
from attn_core.registry import REFERENCE_BACKEND, Registry  # noqa: E402
from attn_core.selector import TuningData, select, step_size  # noqa: E402
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, Phase  # noqa: E402


def _points(text: str) -> list[tuple[int, int]]:
    """``"1x32768,64x4096"`` -> ``[(1, 32768), (64, 4096)]``."""
    out = []
    for part in text.split(","):
        batch, context = part.lower().split("x")
        out.append((int(batch), int(context)))
    return out


def _row_key(row: dict) -> tuple[str, str, str, int, int]:
    return (row["model"], row["group"], row["phase"], row["batch"], row["context"])


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


HEADER = (
    f"{'model':<12} {'group':<8} {'phase':<8} {'B':>5} {'ctx':>7} {'chosen':<24} "
    f"{'fastest':<24} {'ratio':>6}  note"
)


def _row_line(r: dict) -> str:
    return (
        f"{r['model']:<12} {r['group']:<8} {r['phase']:<8} {r['batch']:>5} "
        f"{r['context']:>7} {r['chosen']:<24} {r['fastest']:<24} {r['ratio']:>6.3f}  "
        f"{r['note']}"
    )


def _tuning_grid(phase: Phase, args) -> list[tuple[int, int]]:
    """The (batch, context) points a phase is tuned on: decode / verify every
    ``--tune-batch`` x ``--tune-context`` of at most ``--max-kv-tokens`` cached tokens per step;
    prefill each ``--tune-prefill`` token count split into each of ``--tune-prefill-requests``
    requests, ``tokens // requests`` each (prefill buckets are tokens per step; the splits are
    the bucket's points, :func:`_prefill_bucket`)."""
    if phase is Phase.PREFILL:
        return [
            (r, tokens // r)
            for tokens in _ints(args.tune_prefill)
            for r in _ints(args.tune_prefill_requests)
            if r <= tokens
        ]
    return [
        (b, c)
        for b in _ints(args.tune_batch)
        for c in _ints(args.tune_context)
        if b * c <= args.max_kv_tokens
    ]


def _prefill_bucket(args) -> Callable[[int, int], int]:
    """The token bucket of a prefill tuning point: the ``--tune-prefill`` count it splits
    (3 x 1365 is a split of 4096: a split that does not divide its count stays in its bucket,
    with the others the selector compares by requests)."""
    nominal = {
        (r, tokens // r): tokens
        for tokens in _ints(args.tune_prefill)
        for r in _ints(args.tune_prefill_requests)
    }
    return lambda batch, context: nominal.get((batch, context), batch * context)


def _constraints(args) -> ExecutionConstraints:
    """The run's limits, large enough for every step the bench times: the plan is selected for
    steps up to ``max_num_tokens`` tokens of ``max_batch_size`` requests, and a larger step
    (a bucket the selector never saw) would fall to the phase's default backend. The graph
    mode's captured phases are timed as replays."""
    decode = _tuning_grid(Phase.DECODE, args) + _points(args.decode_points)
    prefill = _tuning_grid(Phase.PREFILL, args) + _points(args.prefill_points)
    defaults = ExecutionConstraints()
    return ExecutionConstraints(
        graph_mode=args.graph_mode,
        max_batch_size=max(defaults.max_batch_size, *(b for b, _ in decode + prefill)),
        max_num_tokens=max(defaults.max_num_tokens, *(b * c for b, c in prefill)),
    )


def _candidates(group, plan, caps, registry, phase) -> list[Any]:
    """The plugin backends admissible for ``group``'s ``phase`` (the reference left out)."""
    return [
        b
        for b in admissible_backends(registry, group, caps, plan, phase)
        if b.qualified_name != REFERENCE_BACKEND
    ]


def _not_loadable(group, registry) -> list[str]:
    """Plugin backends of ``group``'s kind that cannot load on this machine: a point with one
    candidate left says which were not timed, rather than reading as uncontested."""
    return sorted(
        b.qualified_name
        for b in registry.backends
        if not b.available and group.spec.kind in b.capabilities.kinds
    )


def _time(backend, group, registry, plan, device, phase, batch, context, iters) -> float:
    try:
        r = bench_group(
            group,
            backend,
            registry,
            plan,
            device,
            batch=batch,
            context=context,
            iters=iters,
            phase=phase,
        )
    except Exception as exc:  # a candidate that fails a shape is reported, not fatal
        print(f"  {backend.qualified_name} {phase.value} B={batch} ctx={context}: {exc}")
        return float("nan")
    return r.us_per_layer


def _failed(us: float) -> bool:
    """A :func:`_time` sample of a candidate that failed the step (NaN)."""
    return us != us


def _median(samples: list[float]) -> float:
    """The median of a candidate's samples at one point; NaN where one failed."""
    return float("nan") if any(map(_failed, samples)) else statistics.median(samples)


def _samples(cands, rounds, group, registry, plan, device, phase, batch, context,
             iters) -> dict[str, list[float]]:  # fmt: skip
    """Every candidate's :func:`_time` samples at one point, in ``rounds`` alternating rounds
    (:func:`sample_alternating`: a candidate that failed is not timed again there)."""
    take = functools.partial(_time, group=group, registry=registry, plan=plan, device=device,
                             phase=phase, batch=batch, context=context, iters=iters)  # fmt: skip
    return sample_alternating(cands, rounds, take, failed=_failed)


def _tune(name, group, cands, registry, plan, device, phase, args,
          start: float) -> dict[str, list[tuple[int, int, float]]]:  # fmt: skip
    """Every candidate's time at every point of ``phase``'s tuning grid, ``{backend: [(batch,
    context, us per layer), ...]}`` (a point it failed left out): each point times the
    candidates in ``--tune-rounds`` alternating rounds and keeps each one's median (timed one
    candidate's whole grid after another, a drift over the run ranked the H100's prefill
    near-ties by the order they were timed in: 10 % apart one way in the tuning, 11 % the other
    at the check). A line per point as it is timed (a cold JIT cache makes this the long part: a
    run cut here still shows how far it got)."""
    rounds = max(1, getattr(args, "tune_rounds", 1))
    measured: dict[str, list[tuple[int, int, float]]] = {b.qualified_name: [] for b in cands}
    for batch, context in _tuning_grid(phase, args):
        samples = _samples(cands, rounds, group, registry, plan, device, phase, batch, context, 10)
        for backend_name, taken in samples.items():
            us = _median(taken)
            print(f"# tune {name} {group.group_id} {phase.value} {backend_name}"
                  f" B={batch} ctx={context}: {us:.1f} us/layer"
                  f" ({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
            if us == us:
                measured[backend_name].append((batch, context, us))
    return measured


def bench_model(
    name: str,
    registry: Registry,
    device: torch.device,
    args,
    tunings: dict[str, Any],
    rows: list[dict],
    save: Callable[[], None] = lambda: None,
    progress: dict[str, list[str]] | None = None,
    shared: dict[tuple, Any] | None = None,
    plans: dict[str, dict[str, str]] | None = None,
) -> None:
    """Tune ``name``'s groups, plan with the tuning data (kept in ``tunings[name]``, the tuning
    file's content) and time every candidate at the check points: one row per point, appended
    to ``rows`` as it is measured. ``save()`` runs after the tuning and after every row: a run
    killed at its limit keeps what it measured (a SIGTERM handler alone did not: the H200 run
    cut at its limit wrote nothing), and after every group and phase's tuning grid, with the
    candidates done so far in ``progress[name]`` (``"group/phase/backend"``): ``--resume``
    goes on from there.

    ``shared``, one dict for every model of a run: a layer spec's tuning grid per candidate and
    its check points' medians, measured once per run whichever model has the spec (four
    samples share qwen3's 32q/8kv d128 layers, four the Qwen2-VL text and vision layers).

    ``plans[name]``: the tuned plan of each ``"group/phase"`` as explain says it (the backend,
    and where it switches by step size or requests), for :func:`summary_table`."""
    progress = {} if progress is None else progress
    shared = {} if shared is None else shared
    plans = {} if plans is None else plans
    caps = DeviceCapabilities.detect(device)
    layout = specs_from_hf_config(name, dtype="bfloat16")  # a stack sample: its stack
    constraints = _constraints(args)
    plan = select(layout.groups, registry, caps, constraints)
    constraints = plan.constraints
    reused = getattr(args, "tuning_in", None) or {}
    resumed = getattr(args, "resume", None) or {}
    done = set(resumed.get("tuned", {}).get(name, ()))  # "group/phase/backend" tuned already
    kept = {  # the check rows a cut run measured: not measured again
        _row_key(r): r for r in resumed.get("rows", ()) if r["model"] == name
    }
    work = []  # (group, phase, candidates)
    for group in layout.groups:
        for phase in plan.choice(group.group_id).planned_phases:
            cands = _candidates(group, plan, caps, registry, phase)
            if cands:
                work.append((group, phase, cands))
    # 1. the tuning grid: decode / verify per batch size, prefill per token count; a line per
    # point as it is timed (a cold JIT cache makes this the long part: a run cut here still
    # shows how far it got), or an earlier run's tuning of this model (--tuning-in)
    if name in reused:
        tuning = TuningData.from_json(reused[name], source=f"--tuning-in, model {name}")
        print(f"# {name}: tuning from --tuning-in ({len(tuning.times_us)} entries)", flush=True)
    else:
        tuning = TuningData(device=caps.short(), graph_mode=constraints.graph_mode.value)
        if name in resumed.get("tuning", {}):
            tuning = TuningData.from_json(resumed["tuning"][name], source=f"--resume, {name}")
            print(f"# {name}: resuming, {len(done)} candidate grids tuned already", flush=True)
            tunings[name] = resumed["tuning"][name]  # kept by this run's saves from the start
        finished = progress.setdefault(name, [])
        finished[:] = sorted(done)
        start = time.monotonic()
        for group, phase, cands in work:
            if len(cands) < 2:
                continue
            tasks = [f"{group.group_id}/{phase.value}/{b.qualified_name}" for b in cands]
            if all(task in done for task in tasks):
                continue
            grid_key = ("grid", group.spec, phase, tuple(b.qualified_name for b in cands))
            if grid_key in shared:
                measured, owner = shared[grid_key]
                print(f"# tune {name} {group.group_id} {phase.value}: {owner}'s grid"
                      " (the same layer spec)", flush=True)  # fmt: skip
            else:
                measured = _tune(name, group, cands, registry, plan, device, phase, args, start)
                shared[grid_key] = (measured, name)
            for backend_name, points in measured.items():
                record_measured(tuning, backend_name, group.spec, phase, points,
                                bucket_of=_prefill_bucket(args) if phase is Phase.PREFILL
                                else None)  # fmt: skip
            tunings[name] = tuning.to_json()  # a run cut later keeps this grid
            finished.extend(tasks)
            save()
    tuned = select(layout.groups, registry, caps, constraints, tuning=tuning)
    tunings[name] = tuning.to_json()
    save()
    for group, phase, _ in work:  # the tuned plan, as explain shows it
        pc = tuned.choice(group.group_id).phase_choice(phase)
        said = _said(pc)
        plans.setdefault(name, {})[f"{group.group_id}/{phase.value}"] = said
        print(f"# {name} {group.group_id} {phase.value}: {said}", flush=True)
    # 2. the check points, every candidate in alternating rounds
    for group, phase, cands in work:
        points = _points(args.prefill_points if phase is Phase.PREFILL else args.decode_points)
        pc = tuned.choice(group.group_id).phase_choice(phase)
        for batch, context in points:
            key = (name, group.group_id, phase.value, batch, context)
            if key in kept:  # measured by the run this one resumes
                rows.append(kept[key])
                print(_row_line(rows[-1]) + " (resumed)", flush=True)
                continue
            chosen = _chosen(pc, phase, batch, context)
            medians: dict[str, float] = {}
            check_key = ("check", group.spec, phase, batch, context,
                         tuple(b.qualified_name for b in cands))  # fmt: skip
            timed_with = None
            if len(cands) > 1 and check_key in shared:
                medians, timed_with = shared[check_key]
            elif len(cands) > 1:
                samples = _samples(cands, args.rounds, group, registry, plan, device, phase,
                                   batch, context, args.iters)  # fmt: skip
                medians = {k: m for k, v in samples.items() if not _failed(m := _median(v))}
                shared[check_key] = (medians, name)
            fastest = min(medians, key=medians.__getitem__) if medians else chosen
            ratio = medians.get(chosen, float("nan")) / medians[fastest] if medians else 1.0
            on_grid = (batch, context) in _tuning_grid(phase, args)
            missing = _not_loadable(group, registry)
            note = (
                "only candidate"
                if len(cands) < 2
                else ("tuned point" if on_grid else "not tuned on")
            ) + (f"; not loadable here: {', '.join(missing)}" if missing else "")
            if timed_with is not None:
                note += f"; timed with {timed_with} (the same layer spec)"
            rows.append(
                {
                    "model": name,
                    "group": group.group_id,
                    "phase": phase.value,
                    "batch": batch,
                    "context": context,
                    "chosen": chosen,
                    "fastest": fastest,
                    "ratio": ratio,
                    "us": {k: round(v, 2) for k, v in medians.items()},
                    "note": note,
                    "not_loadable": missing,
                }
            )
            print(_row_line(rows[-1]), flush=True)  # a run cut short keeps its rows
            save()


def replan(
    saved: dict[str, Any], args, registry: Registry, caps: DeviceCapabilities
) -> tuple[list[dict], dict[str, dict[str, str]]]:
    """A saved run's check rows scored anew, nothing timed: each model re-planned from the
    run's own tuning data with this script's limits (:func:`_constraints`) for ``caps`` (the
    device the run measured on, as a target: its plugins need not load here), and each row's
    choice looked up in that plan against the medians the row measured. Returns the rows
    (``chosen``, ``ratio`` and ``note`` recomputed) and the plans as :func:`bench_model`
    records them."""
    rows: list[dict] = []
    plans: dict[str, dict[str, str]] = {}
    for name, content in saved["tuning"].items():
        layout = specs_from_hf_config(name, dtype="bfloat16")
        tuning = TuningData.from_json(content, source=f"--replan, model {name}")
        with warnings.catch_warnings():  # measured on that device: the target is its name
            warnings.simplefilter("ignore")
            plan = select(layout.groups, registry, caps, _constraints(args), tuning=tuning)
        for row in (r for r in saved["rows"] if r["model"] == name):
            phase = Phase(row["phase"])
            pc = plan.choice(row["group"]).phase_choice(phase)
            plans.setdefault(name, {})[f"{row['group']}/{row['phase']}"] = _said(pc)
            chosen = _chosen(pc, phase, row["batch"], row["context"])
            us = row["us"]
            ratio = us[chosen] / min(us.values()) if us else 1.0
            note = row["note"]  # where the row's point stands: this script's grid decides
            if us:
                on_grid = (row["batch"], row["context"]) in _tuning_grid(phase, args)
                rest = note.partition(";")[1:]
                note = ("tuned point" if on_grid else "not tuned on") + "".join(rest)
            rows.append({**row, "chosen": chosen, "ratio": ratio, "note": note})
    return rows, plans


def _chosen(pc, phase: Phase, batch: int, context: int) -> str:
    """The backend a phase choice serves a step of ``batch`` x ``context`` with (prefill may
    switch by requests too)."""
    requests = batch if phase is Phase.PREFILL else None
    return pc.backend_for_step(step_size(phase, batch, batch * context), requests).qualified_name


def _said(pc) -> str:
    """A phase choice as explain says it: the backend, and where it switches by step size or
    by requests (:meth:`PhaseChoice.switch_notes`)."""
    notes = pc.switch_notes()
    return pc.backend.qualified_name + (f" ({'; '.join(notes)})" if notes else "")


def summary_table(out: dict[str, Any], goal: float = 1.03) -> str:
    """A saved ``--out`` file as a markdown table: per model, group and phase its tuned plan,
    the check points, how many of them the plan's choice is within ``goal`` of the fastest
    candidate, the worst ratio, and which points were tuned on and which not."""
    lines = [
        "| model | group | phase | tuned plan | check points | within "
        f"{goal:.2f} | worst | not tuned on |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keyed: dict[tuple[str, str, str], list[dict]] = {}
    for row in out.get("rows", ()):
        keyed.setdefault((row["model"], row["group"], row["phase"]), []).append(row)
    for (model, group, phase), rows in keyed.items():
        plan = out.get("plans", {}).get(model, {}).get(f"{group}/{phase}", "?")
        ratios = [r["ratio"] for r in rows]
        off_grid = [r for r in rows if r["note"].startswith("not tuned on")]
        points = ", ".join(f"{r['batch']}x{r['context']}" for r in rows)
        only = all(r["note"].startswith("only candidate") for r in rows)
        lines.append(
            f"| {model} | {group} | {phase} | {plan}{' (only candidate)' if only else ''} | "
            f"{points} | "
            f"{sum(x <= goal for x in ratios)} of {len(ratios)} | {max(ratios):.3f} | "
            f"{len(off_grid)} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3,gpt-oss,deepseek-v3,qwen3-next")
    ap.add_argument("--tune-batch", default="1,4,16,64,256,1024")
    ap.add_argument("--tune-context", default="2048,16384,65536")
    ap.add_argument(
        "--max-kv-tokens", type=int, default=2**24, help="skip decode grid points above it"
    )
    ap.add_argument("--tune-prefill", default="1024,2048,4096,8192,16384")
    ap.add_argument("--tune-prefill-requests", default="1,2,3,4")
    ap.add_argument(
        "--decode-points", default="1x32768,4x8192,8x16384,64x4096,128x2048,256x2048,1024x1024"
    )
    ap.add_argument("--prefill-points", default="1x8192,2x2048,3x4000,1x12000,4x1024")
    ap.add_argument(
        "--graph-mode",
        default="none",
        choices=["none", "decode", "full"],
        help="the run's CUDA-graph mode: the phases it captures are timed as graph replays",
    )
    ap.add_argument(
        "--tune-rounds",
        type=int,
        default=3,
        help="alternating rounds per tuning point (each candidate's median is kept)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--replan",
        type=lambda path: json.loads(Path(path).read_text()),
        default=None,
        help="an earlier run's --out file: re-plan its models from its tuning data with this "
        "script's step limits and score its check rows from their measured medians (nothing "
        "timed; with --target, the device it measured on), then print the rows and the table",
    )
    ap.add_argument("--target", default="h200", help="--replan's device (a target name)")
    ap.add_argument(
        "--summary",
        type=lambda path: json.loads(Path(path).read_text()),
        default=None,
        help="print the markdown table of an earlier run's --out file and exit (nothing timed)",
    )
    ap.add_argument(
        "--tuning-in",
        type=lambda path: json.loads(Path(path).read_text())["tuning"],
        default=None,
        help="an earlier run's --out file: its models' tuning is used, not measured again "
        "(the check points are all timed again; --resume keeps those it has)",
    )
    ap.add_argument(
        "--resume",
        type=lambda path: json.loads(Path(path).read_text()),
        default=None,
        help="the --out file of a run cut at its limit: the candidate grids it tuned and the "
        "check rows it measured are kept, the rest is measured",
    )
    args = ap.parse_args()
    if args.summary is not None:
        print(summary_table(args.summary))
        return 0
    if args.replan is not None:
        caps = DeviceCapabilities.target(args.target)
        replan_rows, replan_plans = replan(args.replan, args, Registry.discover(), caps)
        print(HEADER)
        for row in replan_rows:
            print(_row_line(row))
        worst = max((r["ratio"] for r in replan_rows), default=float("nan"))
        print(
            f"worst ratio chosen/fastest: {worst:.3f} (goal <= 1.03) over {len(replan_rows)} points"
        )
        print(summary_table({"rows": replan_rows, "plans": replan_plans}))
        if args.out:
            out = {**args.replan, "rows": replan_rows, "plans": replan_plans}
            Path(args.out).write_text(json.dumps(out))
        return 0
    device = torch.device("cuda")
    registry = Registry.discover()
    print(HEADER, flush=True)
    rows: list[dict] = []
    tunings: dict[str, Any] = {}
    progress: dict[str, list[str]] = {}
    shared: dict[tuple, Any] = {}  # a layer spec's timings, whichever model has it
    plans: dict[str, dict[str, str]] = dict((args.resume or {}).get("plans", {}))

    def save() -> None:
        if args.out:
            out = {"rows": rows, "tuning": tunings, "tuned": progress, "plans": plans}
            Path(args.out).write_text(json.dumps(out, indent=1))

    # a run cut at its limit (timeout sends SIGTERM) still prints its summary line where the
    # handler gets to run; the rows are saved as they come either way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        for name in args.models.split(","):
            bench_model(name, registry, device, args, tunings, rows, save, progress, shared, plans)
    finally:
        worst = max((r["ratio"] for r in rows), default=float("nan"))
        print(f"worst ratio chosen/fastest: {worst:.3f} (goal <= 1.03) over {len(rows)} points")
        missing = sorted({b for r in rows for b in r["not_loadable"]})
        if missing:  # their points were not contested: the figure above does not cover them
            print(f"not measured (not loadable here): {', '.join(missing)}")
        save()
        print(summary_table({"rows": rows, "plans": plans}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
