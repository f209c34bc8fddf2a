"""``attn bench``: time every admissible backend of every group and phase on the model's shapes.

For each layer group, each phase the plan steps it through (``prefill``, ``decode``, ``verify``
with ``--spec-tokens``) and each backend that can serve it there, one step is timed per point of
the grid ``--batch`` x ``--context`` (comma lists: ``--batch 1,8,64 --context 512,4096``) through
a fresh runtime; where several backends are candidates, each point times them in ``--rounds``
alternating rounds (the order rotated each round) and keeps each one's median, so that drift
over the run does not decide the ranking:

- decode: ``batch`` requests of one new token over ``context`` cached tokens;
- verify: ``batch`` requests of ``k + 1`` new tokens over ``context`` cached tokens;
- prefill: ``batch`` requests of ``context`` new tokens each, nothing cached (points over
  ``--max-prefill-tokens`` tokens in all are skipped).

A layer's step is its ``binding.forward`` with the inputs its spec needs (sinks, lightning's
slopes, Mamba's and the gated kinds' extra tensors), except the gated short conv (LFM2), whose
step is its ``binding.conv1d``: the conv is its whole core and it has no ``forward``.

The time per layer goes into tuning data the selector uses (``attn explain --tuning FILE``):
one entry per backend, group spec, phase and batch size (the geometric mean over the context
lengths), which the selector ranks each phase (and batch-size bucket) by. Optionally plotted
(``--plot FILE``: a PNG of every candidate's time per group, phase and batch size; needs the
``plot`` extra, ``pip install 'attn-core[plot]'``). Framework overhead is reported as a ratio:
the layer call through ``LayerAttentionBinding.forward`` over the same backend forward called
directly with the same inputs.

Steps are timed the way the run would take them: eagerly (back-to-back calls, so a backend
whose launch costs more host time than its kernels shows it), and, for the phases the run's
graph mode captures (``--graph-mode decode``: decode and verify; ``full``: prefill too), as a
CUDA-graph replay of the step after one ``prepare``. Tune with the graph mode the server runs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import torch

from attn_core.batch import BatchBuilder
from attn_core.errors import AttnCoreError
from attn_core.options import resolve_backend_options
from attn_core.registry import REFERENCE_BACKEND
from attn_core.runtime import AttentionRuntime
from attn_core.selector import (
    GroupChoice,
    Plan,
    TuningData,
    check_backend,
    step_size,
    step_size_unit,
    tuning_spec,
)
from attn_core.specs import (
    GraphMode,
    LayerGroup,
    LayerKind,
    LayerSpec,
    LinearVariant,
    Phase,
    torch_dtype,
)
from attn_core.tables import render_table

__all__ = [
    "BenchResult",
    "Timing",
    "admissible_backends",
    "alternating",
    "bench_group",
    "median_result",
    "plot_figure",
    "run_bench",
    "sample_alternating",
    "step_inputs",
    "write_plot",
]

PLOT_INSTALL = "pip install 'attn-core[plot]'"

T = TypeVar("T")
S = TypeVar("S")


@dataclass(slots=True)
class BenchResult:
    group_id: str
    backend: str
    us_per_layer: float  # through the binding
    us_direct: float  # the bound backend forward called directly
    error: str | None = None
    phase: str = "decode"  # the step timed: "prefill", "decode" or "verify"
    batch: int = 0  # requests per step
    context: int = 0  # tokens cached per request (prefill: new tokens per request)

    @property
    def overhead_ratio(self) -> float:
        return self.us_per_layer / self.us_direct if self.us_direct else float("nan")


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured point of a plot: a candidate's time per layer for one group, phase and
    batch size."""

    group_id: str
    phase: str  # "decode", "prefill", ...
    batch: int  # requests per step
    backend: str
    us: float


def step_inputs(group: LayerGroup, tokens: int, device: torch.device) -> dict[str, Any]:
    """Random inputs of one step for a layer of ``group`` (shapes from :mod:`attn_core.specs`).

    ``q``, ``k``, ``v`` and the kind's extra forward inputs (lightning's ``slope``, Mamba's
    ``dt``, ``A_log``, ``D``, ``dt_bias``, the gates ``g``, ``beta`` of the others), except for
    the gated short conv, whose layers call ``binding.conv1d`` only: ``conv_x [T, C]``,
    ``conv_weight [C, K]`` and ``conv_bias [C]``.
    """
    s = group.spec
    dt = torch_dtype(s.dtype)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dt)

    if s.kind is LayerKind.MLA:
        return {"q": r(tokens, s.num_heads, s.head_dim), "k": r(tokens, s.head_dim), "v": None}
    if s.linear_variant is LinearVariant.SHORT_CONV:
        channels, width = s.conv_dims
        return {
            "conv_x": r(tokens, channels),
            "conv_weight": r(channels, width, scale=0.5),
            "conv_bias": r(channels, scale=0.1),
        }
    if s.kind is LayerKind.LINEAR:
        base = {
            "q": r(tokens, s.num_kv_heads, s.head_dim),
            "k": r(tokens, s.num_kv_heads, s.head_dim),
            "v": r(tokens, s.num_heads, s.head_dim_v),
        }
        if s.linear_variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
            # Mamba1: A per channel and state entry; Mamba2: one per head
            a_dims = (s.head_dim,) if s.linear_variant is LinearVariant.MAMBA1 else ()
            base.update(
                dt=r(tokens, s.num_heads),
                A_log=torch.zeros(s.num_heads, *a_dims, device=device),
                D=torch.ones(s.num_heads, device=device),
                dt_bias=torch.zeros(s.num_heads, device=device),
            )
        elif s.linear_variant is LinearVariant.LIGHTNING:
            # MiniMax's per-head decay rates ([H] float32, > 0): a per-layer constant the model
            # passes in place of the gates (the backend refuses a step without it)
            base["slope"] = torch.rand(s.num_heads, device=device).mul_(1.5).add_(0.01)
        else:
            g_shape = (tokens, s.num_heads) + (
                (s.head_dim,) if s.linear_variant is LinearVariant.KDA else ()
            )
            base.update(
                g=-torch.rand(g_shape, device=device).to(torch.float32) * 0.1,
                beta=torch.rand(tokens, s.num_heads, device=device).to(torch.float32),
            )
        return base
    return {
        "q": r(tokens, s.num_heads, s.head_dim),
        "k": r(tokens, s.num_kv_heads, s.head_dim),
        "v": r(tokens, s.num_kv_heads, s.head_dim_v),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, iters: int, device: torch.device) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / iters)
    return sorted(samples)[1] * 1e6


def bench_group(
    group: LayerGroup,
    backend,
    registry,
    plan: Plan,
    device: torch.device,
    *,
    batch: int,
    context: int,
    iters: int,
    phase: Phase = Phase.DECODE,
) -> BenchResult:
    """Time one step of ``phase`` of ``group`` served by ``backend`` (a fresh runtime and
    state): see the module docstring for what each phase's step is."""
    from attn_core.state import PersistentState

    phase = Phase(phase)
    k = plan.constraints.speculative_tokens if phase is Phase.VERIFY else 0
    # new tokens per request, and tokens cached before the step
    q_len, cached = {
        Phase.DECODE: (1, context),
        Phase.VERIFY: (k + 1, context),
        Phase.PREFILL: (context, 0),
    }[phase]
    if group.spec.kind is LayerKind.ENCODER:
        q_len, cached = (context if phase is Phase.PREFILL else 1), 0
    # One layer of the group is enough to time a layer call (and keeps the state small).
    single = LayerGroup(group.group_id, group.spec, group.layer_indices[:1])
    ps = plan.page_size or group.spec.page_size
    pages_per_req = -(-(cached + q_len) // ps)
    cons = plan.constraints
    # the step's own size: backends size their buffers by the run's limits
    cons = cons.with_(
        max_batch_size=max(cons.max_batch_size, batch),
        max_num_tokens=max(cons.max_num_tokens, batch * q_len),
        max_model_len=max(cons.max_model_len, cached + q_len),
    )
    one = Plan(
        device=plan.device,
        constraints=cons,
        choices=(GroupChoice(group=single, backend=backend, rejected=(), outranked=()),),
        page_size=plan.page_size,
        kv_layout=plan.kv_layout,
    )
    state = None
    if group.spec.kind is not LayerKind.ENCODER:
        state = PersistentState.from_plan(
            one, num_pages=batch * pages_per_req + 1, num_slots=batch + 1, device=device
        )
    layer = single.layer_indices[0]
    # A layer with sinks (gpt-oss) needs its [num_heads] float32 sink logits, as a server gives.
    layer_params = (
        {layer: {"sinks": torch.zeros(group.spec.num_heads, dtype=torch.float32, device=device)}}
        if group.spec.has_sinks
        else {}
    )
    runtime = AttentionRuntime(one, registry, state=state, device=device, layer_params=layer_params)
    binding = runtime.binding(layer)
    builder = BatchBuilder(
        state,
        max_batch_size=batch,
        max_num_tokens=max(batch * q_len, 1),
        max_pages_per_request=pages_per_req,
        device=device,
    )
    if state is None:  # an encoder group: no persistent state
        step = builder.build_encoder([q_len] * batch)
    else:
        for r in range(batch):
            state.add_request(r)
            if group.spec.has_kv_cache and cached:
                state.ensure_capacity(r, cached)
                state.advance(r, cached)
        step = builder.build([(r, q_len) for r in range(batch)], spec_tokens=k)
    runtime.prepare(step)
    inputs = step_inputs(single, step.padded_tokens, device)
    q, k, v = inputs.pop("q", None), inputs.pop("k", None), inputs.pop("v", None)
    dv = group.spec.head_dim_v
    dtype = torch_dtype(group.spec.dtype)
    out = torch.empty(step.padded_tokens, group.spec.num_heads, dv, device=device, dtype=dtype)
    group_rt = runtime.groups[single.group_id]

    if group.spec.linear_variant is LinearVariant.SHORT_CONV:
        # the gated short conv's whole core is its conv (no activation: the gates are the
        # model's); its layers never call forward, which backends refuse for it. The output is
        # written into out's one "head", as the model reads it.
        x, weight, bias = inputs["conv_x"], inputs["conv_weight"], inputs["conv_bias"]
        flat = out[:, 0]

        def through_binding() -> None:
            binding.conv1d(x, weight, bias, activation=None, out=flat)

        def direct() -> None:
            conv1d = group_rt.context.conv1d  # type: ignore[attr-defined]  # a linear context
            conv1d(binding, x, weight, bias, activation=None, out=flat)

    else:

        def through_binding() -> None:
            binding.forward(q, k, v, out=out, **inputs)

        def direct() -> None:
            group_rt.forward(binding, q, k, v, out, **inputs)

    if device.type == "cuda" and _captured(one, phase):
        # the run replays this phase's steps from CUDA graphs: time the replay, so that host
        # time per call (large for some kernel libraries' Python launchers) does not rank
        # backends as it would an eager run
        from attn_core.bench_util import capture_graph

        us = _time(capture_graph(through_binding).replay, iters, device)
        us_direct = _time(capture_graph(direct).replay, iters, device)
    else:
        us = _time(through_binding, iters, device)
        us_direct = _time(direct, iters, device)
    return BenchResult(
        group.group_id,
        backend.qualified_name,
        us,
        us_direct,
        phase=phase.value,
        batch=batch,
        context=context,
    )


def _captured(plan: Plan, phase: Phase) -> bool:
    """Whether ``plan``'s run captures ``phase``'s steps in CUDA graphs (decode and verify under
    graph mode ``decode`` or ``full``, prefill under ``full``)."""
    return plan.phase_graph_modes(phase)[1] is not GraphMode.NONE


def _grid(text: str | int, flag: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]`` (positive integers, each once, in order)."""
    out: list[int] = []
    for i, part in enumerate(str(text).split(","), start=1):
        part = part.strip()
        if not part:
            raise AttnCoreError(f"{flag} {text!r}: entry {i} is empty; expected e.g. 1,8,64")
        try:
            value = int(part)
        except ValueError:
            raise AttnCoreError(f"{flag} {text!r}: {part!r} is not an integer") from None
        if value <= 0:
            raise AttnCoreError(f"{flag} {text!r}: {value} is not positive")
        if value not in out:
            out.append(value)
    if not out:
        raise AttnCoreError(f"{flag} {text!r}: expected one or more integers, e.g. 1,8,64")
    return out


def _geomean(values: Sequence[float]) -> float:
    if len(values) == 1:
        return values[0]
    return math.exp(sum(math.log(v) for v in values) / len(values))


def record_measured(
    tuning: TuningData,
    backend: str,
    spec: LayerSpec,
    phase: Phase,
    measured: Sequence[tuple[int, int, float]],
    *,
    bucket_of: Callable[[int, int], int] | None = None,
) -> None:
    """Record ``(batch, context, us)`` measurements of ``backend`` in ``phase`` as tuning
    buckets: one per step size (:func:`attn_core.selector.step_size`: the batch in decode and
    verify, ``batch * context`` query tokens in prefill), the geometric mean of the points that
    share one, with those points kept (:attr:`TuningData.shape_us`: by context in decode and
    verify, by requests in prefill) for the selector's worst-ratio choice.

    ``bucket_of(batch, context)``: the step size a point is recorded under, where it is not
    the point's own (a prefill of 4096 tokens split into 3 requests is timed as 3 x 1365 =
    4095 tokens and belongs with the other splits of 4096)."""
    by_tokens = step_size_unit(phase) == "tokens"
    by_size: dict[int, dict[int, list[float]]] = {}
    for batch, context, us in measured:
        shape = batch if by_tokens else context
        size = (
            bucket_of(batch, context)
            if bucket_of is not None
            else step_size(phase, batch, batch * context)
        )
        by_size.setdefault(size, {}).setdefault(shape, []).append(us)
    for size, shapes in sorted(by_size.items()):
        key = {"tokens": size} if by_tokens else {"batch": size}
        times = [t for ts in shapes.values() for t in ts]
        per_shape = {shape: _geomean(ts) for shape, ts in shapes.items()}
        tuning.record(backend, spec, _geomean(times), phase=phase, shapes=per_shape, **key)


def admissible_backends(
    registry, group: LayerGroup, caps, plan: Plan, phase: Phase, options=None
) -> list[Any]:
    """Every registered backend that can serve ``group``'s ``phase`` steps under ``plan``'s
    constraints and layout (page size, KV layout), with the options in force applied (``options``:
    :func:`~attn_core.options.resolve_backend_options`' result), in registry order."""
    out = []
    for backend in registry.backends:
        if options and backend.qualified_name in options:  # timed with the options in force
            backend = backend.with_options(options[backend.qualified_name][0])
        if not check_backend(
            backend,
            group.spec,
            caps,
            plan.constraints,
            page_size=plan.page_size,
            kv_layout=plan.kv_layout,
            phase=phase,
        ):
            out.append(backend)
    return out


def run_bench(args, registry, device_name: str, constraints) -> int:
    from attn_core.models import specs_from_hf_config
    from attn_core.selector import select
    from attn_core.specs import DeviceCapabilities

    if args.plot:
        _require_matplotlib()  # before anything is timed
        _require_writable("--plot", args.plot)
    device = torch.device(device_name)
    caps = DeviceCapabilities.detect(device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    stack = getattr(args, "stack", None)  # one stack of a multi-stack model (--stack)
    layout = specs_from_hf_config(args.model, tp_size=args.tp, dtype=dtype, stack=stack)
    # every candidate is timed whatever a tuning file says: an empty one, not ATTN_CORE_TUNING's
    # (which may name the very file this run writes)
    plan = select(layout.groups, registry, caps, constraints, tuning=TuningData())
    constraints = plan.constraints  # the graph mode the policy may have lowered, forced entries
    tuning = TuningData(
        device=caps.short(),
        graph_mode=constraints.graph_mode.value,
        speculative_tokens=constraints.speculative_tokens,
    )
    # checked before anything is timed: a run whose times cannot join the file is refused now
    earlier = _earlier_tuning(args.write_tuning, tuning) if args.write_tuning else None
    results: list[BenchResult] = []
    skipped: list[str] = []
    batches = _grid(args.batch, "--batch")
    contexts = _grid(args.context, "--context")
    max_prefill = getattr(args, "max_prefill_tokens", None)
    max_prefill = 65536 if max_prefill is None else max_prefill
    options = resolve_backend_options(registry, constraints)  # checked by select() above
    progress = not getattr(args, "no_progress", False)
    include_reference = getattr(args, "include_reference", False)
    rounds = max(1, getattr(args, "rounds", 1))
    left_out: list[str] = []  # groups and phases whose reference run was left out
    for group in layout.groups:
        for phase in plan.choice(group.group_id).planned_phases:
            candidates = admissible_backends(registry, group, caps, plan, phase, options)
            if not include_reference and len(candidates) > 1:
                # The reference is the ground truth, not a speed candidate: the default rule
                # ranks it below every plugin, and at long contexts its steps take minutes.
                kept = [b for b in candidates if b.qualified_name != REFERENCE_BACKEND]
                if len(kept) < len(candidates):
                    left_out.append(f"{group.group_id} {phase.value}")
                candidates = kept
            measured: dict[str, list[tuple[int, int, float]]] = {
                b.qualified_name: [] for b in candidates
            }
            for batch in batches:
                for context in contexts:
                    if phase is Phase.PREFILL and batch * context > max_prefill:
                        skipped += [
                            f"{group.group_id} {phase.value} {b.qualified_name} "
                            f"B={batch} ctx={context}"
                            for b in candidates
                        ]
                        continue
                    samples = sample_alternating(
                        candidates,
                        rounds if len(candidates) > 1 else 1,  # nothing to rank against: once
                        functools.partial(
                            _bench_or_error,
                            group=group,
                            registry=registry,
                            plan=plan,
                            device=device,
                            iters=args.iters,
                            phase=phase,
                            batch=batch,
                            context=context,
                        ),
                        failed=lambda res: res.error is not None,
                    )
                    for name, taken in samples.items():
                        res = median_result(taken)
                        results.append(res)
                        if res.error is None:
                            measured[name].append((batch, context, res.us_per_layer))
                        if progress:  # a run cut at a time limit still shows what it measured
                            print(_progress_line(res), file=sys.stderr, flush=True)
            for name, points in measured.items():  # under the run's page size
                record_measured(
                    tuning, name, tuning_spec(group.spec, plan.page_size), phase, points
                )
    # under --json, stdout holds the JSON only: what else the run says goes to stderr
    said_to = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps([asdict(r) | {"overhead_ratio": r.overhead_ratio} for r in results]))
    else:
        rows = [
            [
                r.group_id,
                r.phase,
                str(r.batch),
                str(r.context),
                r.backend,
                "-" if r.error else f"{r.us_per_layer:.1f}",
                "-" if r.error else f"{r.us_direct:.1f}",
                "-" if r.error else f"{r.overhead_ratio:.3f}",
                r.error or "",
            ]
            for r in results
        ]
        print(
            render_table(
                [
                    "group",
                    "phase",
                    "batch",
                    "context",
                    "backend",
                    "us/layer (binding)",
                    "us/layer (direct)",
                    "binding/direct",
                    "error",
                ],
                rows,
                title="one step per group, phase and grid point (decode / verify: context = "
                f"cached tokens per request; prefill: new tokens per request) on {caps.short()}",
            )
        )
    for line in skipped:
        print(f"skipped (over --max-prefill-tokens {max_prefill}): {line}", file=said_to)
    if left_out:
        print(
            f"{REFERENCE_BACKEND} not timed where a plugin is a candidate "
            f"({', '.join(left_out)}): it ranks below them without a time "
            "(--include-reference times it too)",
            file=said_to,
        )
    if args.write_tuning:
        said = f"tuning data written to {args.write_tuning}: {len(tuning.times_us)} entries "
        said += "measured now"
        if earlier is not None:
            said += (
                f", {len(set(earlier.times_us) - set(tuning.times_us))} kept from "
                f"{args.write_tuning}"
            )
            earlier.update(tuning)
            tuning = earlier
        tuning.save(args.write_tuning)
        print(said, file=said_to)
    if args.plot:
        table = [
            Timing(group_id, phase_, batch, backend_, _geomean(us))
            for (group_id, phase_, batch, backend_), us in _by_point(results).items()
        ]
        if table:
            write_plot(table, args.plot)
            print(f"plot written to {args.plot}", file=said_to)
        else:
            print(f"no plot written to {args.plot}: no candidate ran", file=said_to)
    return 0 if all(r.error is None for r in results) else 1


def _earlier_tuning(path: str | os.PathLike, run: TuningData) -> TuningData | None:
    """The tuning file ``--write-tuning`` names, when it exists: the run's measurements go into
    it (a file tuned for one model keeps its entries when another model is tuned into it).
    Refused when it cannot be read or holds another device's or graph mode's times."""
    if not os.path.exists(path):
        _require_writable("--write-tuning", path)
        return None
    try:
        earlier = TuningData.load(path)
    except ValueError as exc:  # load names an unreadable file so too
        raise AttnCoreError(
            f"--write-tuning {path}: the file exists but is not a tuning file this release "
            f"reads ({exc}); write to another file or remove it"
        ) from None
    if earlier.measured_where() != run.measured_where():
        raise AttnCoreError(
            f"--write-tuning {path}: its times were measured {earlier.measured_where()}, this "
            f"run measures {run.measured_where()}; one file holds one device's times: write to "
            "another file (or remove it)"
        )
    conflict = earlier.verify_conflict(run)
    if conflict:
        raise AttnCoreError(
            f"--write-tuning {path}: {conflict} (this run); one file holds one count's verify "
            "times: write to another file (or remove it); nothing was timed"
        )
    return earlier


def _require_writable(flag: str, path: str | os.PathLike) -> None:
    """Refuse, before anything is timed, a file the run could not write at its end."""
    folder = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise AttnCoreError(
            f"{flag} {path}: cannot write there (the folder {folder} does not exist or is not "
            "writable); nothing was timed"
        )


def alternating(candidates: Sequence[T], rounds: int) -> Iterator[T]:
    """Each candidate once per round for ``rounds`` rounds, the order rotated by one each round
    (``a b c``, ``b c a``, ``c a b``, ...): a drift over the run (clocks, heat, a neighbour on a
    shared GPU) falls on every candidate in turn instead of on whichever is timed last."""
    n = len(candidates)
    for r in range(rounds):
        for i in range(n):
            yield candidates[(r + i) % n]


def sample_alternating(
    candidates: Sequence[Any],
    rounds: int,
    take: Callable[[Any], S],
    *,
    failed: Callable[[S], bool],
) -> dict[str, list[S]]:
    """One point's samples of every candidate (a backend), ``{qualified name: [sample, ...]}``:
    ``take(candidate)`` once a round for ``rounds`` rounds in :func:`alternating` order; a
    candidate whose sample ``failed`` is not taken again at this point (its failure is
    reported once)."""
    samples: dict[str, list[S]] = {c.qualified_name: [] for c in candidates}
    for candidate in alternating(candidates, rounds):
        taken = samples[candidate.qualified_name]
        if not (taken and failed(taken[-1])):
            taken.append(take(candidate))
    return samples


def median_result(samples: Sequence[BenchResult]) -> BenchResult:
    """One point's result from its rounds' samples: the medians of the binding and direct
    times; the first error where a round failed."""
    failed = [s for s in samples if s.error is not None]
    if failed or len(samples) == 1:
        return (failed or list(samples))[0]
    return replace(
        samples[0],
        us_per_layer=statistics.median(s.us_per_layer for s in samples),
        us_direct=statistics.median(s.us_direct for s in samples),
    )


def _bench_or_error(
    backend,
    group: LayerGroup,
    registry,
    plan: Plan,
    device: torch.device,
    iters: int,
    phase: Phase,
    batch: int,
    context: int,
) -> BenchResult:
    """:func:`bench_group`, or its failure as a result (reported; the other candidates go on)."""
    try:
        return bench_group(
            group, backend, registry, plan, device, batch=batch, context=context, iters=iters,
            phase=phase,
        )  # fmt: skip
    except Exception as exc:
        return BenchResult(
            group.group_id, backend.qualified_name, float("nan"), float("nan"),
            f"{type(exc).__name__}: {exc}", phase=phase.value, batch=batch, context=context,
        )  # fmt: skip


def _progress_line(res: BenchResult) -> str:
    """One measured grid point, as the table will show it: ``bench: GROUP PHASE BACKEND B=..
    ctx=..: X us/layer (binding), Y direct`` or the error."""
    where = f"bench: {res.group_id} {res.phase} {res.backend} B={res.batch} ctx={res.context}"
    if res.error is not None:
        return f"{where}: {res.error}"
    return f"{where}: {res.us_per_layer:.1f} us/layer (binding), {res.us_direct:.1f} direct"


def _by_point(results: Sequence[BenchResult]) -> dict[tuple[str, str, int, str], list[float]]:
    """The successful times per (group, phase, batch, backend), over the context lengths."""
    out: dict[tuple[str, str, int, str], list[float]] = {}
    for r in results:
        if r.error is None:
            out.setdefault((r.group_id, r.phase, r.batch, r.backend), []).append(r.us_per_layer)
    return out


def _require_matplotlib():
    """``matplotlib.pyplot`` on the file-only Agg backend; an error naming the extra without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AttnCoreError(
            f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}"
        ) from None
    return plt


def plot_figure(table: Sequence[Timing]):
    """A matplotlib Figure: one panel per (group, phase), time per layer over batch size, one
    line per candidate backend (batch sizes in increasing order)."""
    plt = _require_matplotlib()
    panels = sorted({(t.group_id, t.phase) for t in table})
    if not panels:
        raise ValueError("no timings to plot")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (group, phase) in zip(axes.flat, panels, strict=False):
        points = [t for t in table if (t.group_id, t.phase) == (group, phase)]
        for backend in sorted({t.backend for t in points}):
            mine = sorted((t.batch, t.us) for t in points if t.backend == backend)
            ax.plot([b for b, _ in mine], [us for _, us in mine], marker="o", label=backend)
        batches = sorted({t.batch for t in points})
        if len(batches) > 1 and batches[-1] / max(batches[0], 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"{group}: {phase}")
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel("us per layer")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("attn bench: time per layer of every candidate")
    fig.tight_layout()
    return fig


def write_plot(table: Sequence[Timing], path: str | os.PathLike) -> None:
    """Write :func:`plot_figure` of ``table`` to ``path`` as a PNG."""
    fig = plot_figure(table)
    try:
        fig.savefig(path, dpi=120, format="png")
    finally:
        fig.clear()
        _require_matplotlib().close(fig)
