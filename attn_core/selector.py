"""Pick a backend per layer group and phase for a whole model, and explain every rejection.

Selection is deterministic. A plan chooses for every group and every phase the run steps it
through (:func:`planned_phases`: ``prefill`` for prefill / mixed steps, ``decode``, and ``verify``
when draft tokens are verified). For each group and phase the admissible backends are ranked by
measured tuning data when the tuning file has a time for that backend on that group's spec in
that phase (faster first; the geometric mean over the step-size buckets, and, where another
backend is fastest at some buckets, a switch per bucket: ``PhaseChoice.by_step_size``; a step's
size is its requests in decode and verify, its query tokens in prefill; a bucket's backend is
the one with the smallest worst ratio to the fastest over the bucket's points, and a prefill
bucket whose request splits disagree also switches by requests: ``PhaseChoice.by_requests``;
a lead under :data:`MEASURED_TIE` is a tie, which the default rule decides); the rest by the
default rule: every other backend before the reference
(``attn_core:reference``), whatever their priorities and names, then by declared priority in
that phase for the layer (higher first; ``feature_priority`` lowers it for a layer feature),
then by qualified name. Settings that must be shared by every group and phase - page size, KV
layout (every phase's backend reads the group's one persistent state) and CUDA-graph mode - are
chosen for the whole model: the selector tries each candidate page size / layout and keeps the
first one under which every group and phase has a backend, preferring the model's own page
size; when some group has no backend under the run's graph mode, the downgrade policy may lower
it (full -> decode -> none). Each phase is held to how its steps are captured: under ``full``
prefill / mixed steps need ``full``, decode / verify steps ``decode``
(``Plan.phase_graph_modes``).

A plan is for this machine when its device is one this machine has (the CPU, or a CUDA device of
the same name and compute capability): a backend this machine cannot load (``available=False``)
is rejected as ``unavailable``. A plan for any other device (``attn explain --target h200`` on a
machine without one) is an offline plan: backends are judged by their static capabilities, and a
candidate this machine cannot load is only marked ``not_loadable_here``. The runtime refuses to
run a plan whose chosen backend is not loadable here.

Every rejected candidate carries a :class:`Rejection`: a reason code, a sentence, and, when the
mismatch is a run-time knob (page size, KV layout, graph mode, KV dtype, draft tokens, batch
limits, the device), the smallest change that would admit it (``"page_size 16 -> 64"``). What the
model is (its layer kind, head dims, dtypes, sinks, soft-cap, window...) is never proposed for a
change: those reasons read ``"cannot serve this model: head_dim 256 (serves 64, 96, 128)"``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from attn_core.backend import Backend
from attn_core.errors import SelectionError
from attn_core.options import resolve_backend_options
from attn_core.registry import REFERENCE_BACKEND, Registry
from attn_core.specs import (
    DeviceCapabilities,
    DowngradePolicy,
    ExecutionConstraints,
    GraphMode,
    LayerGroup,
    LayerKind,
    LayerSpec,
    LinearVariant,
    Phase,
)
from attn_core.step_buckets import pick_for_step

__all__ = [
    "GroupChoice",
    "PhaseChoice",
    "Plan",
    "Rejection",
    "TuningData",
    "check_backend",
    "is_this_machine",
    "mapping_from_plan",
    "parse_forced",
    "phase_mapping_from_plan",
    "planned_phases",
    "select",
    "spec_key",
    "tuning_spec",
]

#: e.g. "full=flashinfer,linear=triton_ssm,decode:full=flashinfer" (see parse_forced)
ENV_FORCE = "ATTN_CORE_BACKENDS"
ENV_TUNING = "ATTN_CORE_TUNING"  # path of a tuning file written by `attn bench`


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one backend cannot serve one group."""

    backend: str
    code: str  # e.g. "head_dim", "page_size", "unavailable"
    reason: str
    fix: str | None = None  # the smallest change of a run-time knob that would admit it
    #: True: what the model is (its kind, head dims, dtypes, features) rules the backend out;
    #: no run setting would admit it, so it is no downgrade when a lower one serves instead
    model: bool = False

    def __str__(self) -> str:
        return f"[{self.code}] {self.reason}" + (f" (fix: {self.fix})" if self.fix else "")


def _sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers numerically (16 before 128), before everything else in text order."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _fmt_set(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in sorted(values, key=_sort_key))


def _nearest(value: int, allowed: Iterable[int]) -> int:
    """The allowed value closest to ``value`` (ties go to the larger one)."""
    return min(allowed, key=lambda a: (abs(a - value), -a))


def _phase_graph_mode(mode: GraphMode, phase: Phase | None) -> GraphMode:
    """How the steps of ``phase`` are captured under the run's graph mode ``mode``: ``decode``
    captures decode steps (and the uniform verify steps), not prefill or mixed ones; ``full``
    captures prefill / mixed steps too (one graph at fixed padded sizes), while its decode and
    verify steps are captured as under ``decode``. ``phase`` None: any step (``mode`` itself)."""
    if phase is None:
        return mode
    if phase is Phase.PREFILL:
        return GraphMode.NONE if mode is GraphMode.DECODE else mode
    return GraphMode.DECODE if mode is GraphMode.FULL else mode


def _captures(modes: frozenset[GraphMode], needed: GraphMode) -> bool:
    """Whether a backend declaring ``modes`` serves steps captured as ``needed``: a backend
    that captures mixed steps (``full``) captures decode steps too."""
    return needed in modes or (needed is GraphMode.DECODE and GraphMode.FULL in modes)


#: How a rejection names the steps a phase's graph mode captures.
_CAPTURED_STEPS = {
    Phase.PREFILL: "prefill / mixed steps",
    Phase.DECODE: "decode steps",
    Phase.VERIFY: "verify steps",
}


def constraints_for_phases(
    constraints: ExecutionConstraints, phases: Iterable[Phase]
) -> ExecutionConstraints:
    """The run's demands as a backend serving only ``phases`` meets them: no graph mode when
    none of its steps is captured, no draft tokens when it verifies none (what
    :func:`check_backend` held it to, and what its context is allocated for)."""
    phases = tuple(phases)
    changes: dict[str, Any] = {}
    modes = {_phase_graph_mode(constraints.graph_mode, p) for p in phases}
    # the most captured of its phases' modes: full for a backend that serves mixed steps under
    # full, decode for one that serves only decode / verify steps there, none for eager ones
    held = max(modes, key=_GRAPH_MODES_DOWN[::-1].index) if modes else constraints.graph_mode
    if held is not constraints.graph_mode:
        changes["graph_mode"] = held
    if constraints.speculative_tokens and Phase.VERIFY not in phases:
        changes["speculative_tokens"] = 0
    return constraints.with_(**changes) if changes else constraints


def check_backend(
    backend: Backend,
    spec: LayerSpec,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    *,
    page_size: int | None = None,
    kv_layout: str | None = None,
    local: bool = True,
    phase: Phase | str | None = None,
) -> list[Rejection]:
    """Every reason ``backend`` cannot serve layers of ``spec`` under these conditions.

    An empty list means admissible. ``page_size`` / ``kv_layout`` are the model-wide settings
    being tried (None: not constrained yet). ``local=False`` judges for another machine (an
    offline plan): that this machine cannot load the backend is then no reason. ``phase``: the
    phase being planned (a backend that does not serve it is rejected with code ``phase``);
    None: any. Each phase is held to the demands its own steps make: under graph mode
    ``decode`` only the decode and verify phases are captured (prefill and mixed steps run
    eagerly), and only the verify phase carries draft tokens (``speculative_tokens``, the
    verify strategy); the other demands hold for every phase.
    """
    caps = backend.capabilities
    name = backend.qualified_name
    out: list[Rejection] = []
    phase = Phase(phase) if phase is not None else None

    def reject(code: str, reason: str, fix: str | None = None, model: bool = False) -> None:
        out.append(Rejection(name, code, reason, fix, model))

    def model_mismatch(code: str, what: str, serves: str) -> None:
        """The model is what it is: say what the backend serves, propose no change."""
        reject(code, f"cannot serve this model: {what} ({serves})", model=True)

    if spec.kind not in caps.kinds:
        model_mismatch(
            "kind", f"kind {spec.kind.value}", f"serves {_fmt_set(k.value for k in caps.kinds)}"
        )
        return out  # nothing else is meaningful
    if phase is not None and phase not in caps.phases:
        reject(
            "phase",
            f"serves the {_fmt_set(p.value for p in caps.phases)} phase"
            f"{'s' if len(caps.phases) > 1 else ''}, not {phase.value}",
        )
    if local and not backend.available:
        reject("unavailable", backend.unavailable_reason or "unavailable")
    if spec.kind is LayerKind.LINEAR and spec.linear_variant not in caps.linear_variants:
        model_mismatch(
            "linear_variant",
            f"linear variant {spec.linear_variant}",
            f"serves {_fmt_set(v.value for v in caps.linear_variants)}",
        )
    if device.device_type not in caps.device_types:
        reject(
            "device_type",
            f"runs on {_fmt_set(caps.device_types)}, the device is {device.device_type}",
            f"run on a {'/'.join(sorted(caps.device_types))} device",
        )
    elif device.compute_capability is not None:
        cc = device.compute_capability
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        if lo is not None and cc < lo:
            reject(
                "compute_capability",
                f"needs compute capability >= {lo[0]}.{lo[1]}, the device has {cc[0]}.{cc[1]}",
                f"a GPU with compute capability >= {lo[0]}.{lo[1]}",
            )
        if hi is not None and cc > hi:
            reject(
                "compute_capability",
                f"supports compute capability <= {hi[0]}.{hi[1]}, the device has {cc[0]}.{cc[1]}",
                f"a GPU with compute capability <= {hi[0]}.{hi[1]}",
            )
    if spec.dtype not in caps.dtypes:
        model_mismatch("dtype", f"dtype {spec.dtype}", f"serves {_fmt_set(caps.dtypes)}")
    if spec.dtype not in device.dtypes:
        reject("device_dtype", f"the device does not support {spec.dtype}")
    kv_dtype = constraints.kv_dtype or spec.kv_dtype
    if spec.has_kv_cache and kv_dtype not in caps.kv_dtypes:
        reject(
            "kv_dtype",
            f"stores KV as {_fmt_set(caps.kv_dtypes)}, the run asks for {kv_dtype}",
            f"kv_dtype {kv_dtype} -> "
            f"{spec.dtype if spec.dtype in caps.kv_dtypes else sorted(caps.kv_dtypes)[0]}",
        )
    elif (
        spec.has_kv_cache
        and not caps.mixed_kv_dtypes
        and kv_dtype != spec.dtype
        and not kv_dtype.startswith("fp8")
    ):
        reject(
            "kv_dtype",
            f"keeps an unquantised KV cache in the compute dtype only, the layer computes in "
            f"{spec.dtype} over a {kv_dtype} cache",
            f"kv_dtype {kv_dtype} -> {spec.dtype}",
        )
    if kv_dtype == "fp8_e4m3" and spec.has_kv_cache and not device.supports_fp8:
        reject("device_fp8", f"the device {device.name} has no fp8 support")
    if spec.kind is LayerKind.LINEAR and spec.state_dtype not in caps.state_dtypes:
        model_mismatch(
            "state_dtype",
            f"state dtype {spec.state_dtype}",
            f"serves {_fmt_set(caps.state_dtypes)}",
        )
    # The short conv has no heads (its head_dim is the conv's channel count): no head dim to serve.
    if caps.head_dims is not None and spec.linear_variant is not LinearVariant.SHORT_CONV:
        for label, dim in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
            if dim not in caps.head_dims:
                model_mismatch("head_dim", f"{label} {dim}", f"serves {_fmt_set(caps.head_dims)}")
                break
    if (
        spec.kind in (LayerKind.FULL, LayerKind.ENCODER)  # MLA and linear widths are their own
        and spec.head_dim_v != spec.head_dim
        and not caps.distinct_value_head_dim
    ):
        model_mismatch(
            "head_dim_v",
            f"head_dim_v {spec.head_dim_v} beside head_dim {spec.head_dim}",
            "serves values as wide as queries and keys only",
        )
    if spec.has_kv_cache:
        ps = page_size if page_size is not None else spec.page_size
        if caps.page_sizes is not None and ps not in caps.page_sizes:
            reject(
                "page_size",
                f"serves page sizes {_fmt_set(caps.page_sizes)}, the run uses {ps}",
                f"page_size {ps} -> {_nearest(ps, caps.page_sizes)}",
            )
        if kv_layout is not None and kv_layout not in caps.kv_layouts:
            reject(
                "kv_layout",
                f"reads KV in layout {_fmt_set(caps.kv_layouts)}, the run uses {kv_layout}",
                f"kv_layout {kv_layout} -> {sorted(caps.kv_layouts)[0]}",
            )
    captured = _phase_graph_mode(constraints.graph_mode, phase)
    if not _captures(caps.graph_modes, captured):
        modes = caps.graph_modes
        # the most captured run mode under which this phase's steps need what it declares
        mode = constraints.graph_mode
        # (a backend that lacks none, asked for none, is offered the most it captures)
        best = next(
            (
                m
                for m in _GRAPH_MODES_DOWN[_GRAPH_MODES_DOWN.index(mode) + 1 :]
                if _captures(modes, _phase_graph_mode(m, phase))
            ),
            max(modes, key=_GRAPH_MODES_DOWN[::-1].index),
        )
        steps = _CAPTURED_STEPS[phase] if phase is not None else "every step"
        reject(
            "graph_mode",
            f"captures CUDA-graph modes {_fmt_set(m.value for m in modes)}; graph mode "
            f"{mode.value} captures {steps}, which needs {captured.value}",
            f"graph_mode {mode.value} -> {best.value}",
        )
    verifies = phase in (None, Phase.VERIFY)  # only verify steps carry draft tokens
    if verifies and constraints.speculative_tokens > caps.max_speculative_tokens:
        reject(
            "speculative",
            f"verifies at most {caps.max_speculative_tokens} draft tokens per request, the run "
            f"asks for {constraints.speculative_tokens}",
            f"speculative_tokens {constraints.speculative_tokens} -> {caps.max_speculative_tokens}",
        )
    if (
        spec.kind is LayerKind.LINEAR
        and verifies
        and constraints.speculative_tokens
        and constraints.spec_verify_strategy is not None
        and constraints.spec_verify_strategy not in caps.spec_verify_strategies
    ):
        reject(
            "spec_verify_strategy",
            f"verifies with {_fmt_set(caps.spec_verify_strategies)}, the run asks for "
            f"{constraints.spec_verify_strategy}",
            f"spec_verify_strategy {constraints.spec_verify_strategy} -> "
            f"{sorted(caps.spec_verify_strategies)[0]}",
        )
    if spec.kind in (LayerKind.FULL, LayerKind.ENCODER, LayerKind.MLA):
        if spec.causal and not caps.causal:
            model_mismatch("causal", "causal attention", "serves bidirectional only")
        if not spec.causal and not caps.non_causal:
            model_mismatch("non_causal", "bidirectional attention", "serves causal only")
    if spec.sliding_window is not None and not caps.sliding_window:
        model_mismatch(
            "sliding_window",
            f"sliding window {spec.sliding_window}",
            "serves full-context attention only",
        )
    chunk = spec.attention_chunk_size
    if chunk is not None and not caps.chunked_attention:
        if not caps.chunked_virtual_batches:
            model_mismatch(
                "chunked_attention",
                f"chunked attention (chunks of {chunk} tokens)",
                "has no chunk mask and takes no local virtual batches",
            )
        else:
            ps = page_size if page_size is not None else spec.page_size
            if chunk % ps:
                # a chunk's virtual page-table row must start on a page boundary
                fits = sorted(p for p in (caps.page_sizes or {ps}) if chunk % p == 0)
                reject(
                    "page_size",
                    f"serves chunked attention through local virtual batches, which need the "
                    f"chunk size to be a multiple of the page size: chunks of {chunk} tokens, "
                    f"page size {ps}",
                    f"page_size {ps} -> {_nearest(ps, frozenset(fits))}" if fits else None,
                )
            if (
                phase in (None, Phase.VERIFY)
                and constraints.speculative_tokens
                and _phase_graph_mode(constraints.graph_mode, Phase.VERIFY) is not GraphMode.NONE
            ):
                # a verify step's pieces vary in number with the step: not capturable
                reject(
                    "graph_mode",
                    "serves chunked attention through local virtual batches, whose verify "
                    "steps vary in shape and cannot be captured",
                    f"graph_mode {constraints.graph_mode.value} -> none",
                )
            if (
                phase in (None, Phase.PREFILL)
                and _phase_graph_mode(constraints.graph_mode, Phase.PREFILL) is GraphMode.FULL
            ):
                # a mixed step's pieces vary in number with the step: one captured mixed
                # graph (fixed padded requests) cannot replay them
                reject(
                    "graph_mode",
                    "serves chunked attention through local virtual batches, whose prefill / "
                    "mixed steps vary in their number of requests and cannot be captured in "
                    "graph mode full",
                    "graph_mode full -> decode",
                )
    if spec.logits_soft_cap is not None and not caps.logits_soft_cap:
        model_mismatch(
            "soft_cap",
            f"logits soft-cap {spec.logits_soft_cap:g}",
            "serves uncapped logits only",
        )
    if spec.has_sinks and not caps.sinks:
        model_mismatch("sinks", "attention sinks", "serves attention without sinks only")
    if constraints.deterministic and not caps.deterministic:
        reject("deterministic", "is not deterministic run to run", "deterministic True -> False")
    if constraints.allow and not any(a in (name, backend.name) for a in constraints.allow):
        reject("not_allowed", f"not in the allow list ({_fmt_set(constraints.allow)})")
    if any(d in (name, backend.name) for d in constraints.deny):
        reject("denied", "in the deny list")
    return out


# ------------------------------------------------------------------------------------------
# Tuning data
# ------------------------------------------------------------------------------------------
def spec_key(spec: LayerSpec) -> str:
    """A stable text key of a layer spec, used by tuning files."""
    fields_ = {k: (str(v) if v is not None else None) for k, v in asdict(spec).items()}
    return json.dumps(fields_, sort_keys=True)


def tuning_spec(spec: LayerSpec, page_size: int | None) -> LayerSpec:
    """The layer spec a tuning entry of ``spec``'s group is keyed by in a plan (or a bench run)
    of ``page_size``: a paged kind's time depends on the page size, which the plan sets for the
    whole model while the group's spec carries the model's default; None: the spec's own."""
    if page_size is None or page_size == spec.page_size:
        return spec
    if spec.kind not in (LayerKind.FULL, LayerKind.MLA):
        return spec
    return spec.with_(page_size=page_size)


def _spec_fields_with_defaults(written: Mapping[str, Any]) -> dict[str, Any]:
    """A tuning file's spec (the fields of :func:`spec_key`) with every ``LayerSpec`` field it
    lacks at its default: a file written before a field existed (e.g. before
    ``attention_chunk_size``) describes a layer with that field unset, and must keep matching
    the :func:`spec_key` of that layer."""
    missing = {
        f.name: (str(f.default) if f.default is not None else None)
        for f in fields(LayerSpec)
        if f.name not in written
    }
    return {**missing, **written}


#: The tuning file format ``TuningData.save`` writes; ``load`` reads it, formats 2 and 1.
TUNING_FORMAT = 3

#: Measured times within this fraction of the fastest are a tie, which the default rule
#: (priority per phase, :func:`_default_rank`) decides: the GPUs tuning files come from drift by
#: a few percent between runs, so a smaller lead is noise. On an H100, a 0.6 % tuning lead of
#: one backend at 16384 prefill tokens came out a 5.6 % loss when the same step was timed again.
MEASURED_TIE = 0.02

#: A measured point: (backend qualified name, spec_key, phase or None, step size or None);
#: None: the time holds for every phase / step size (format 1 files).
TuningKey = tuple[str, str, "Phase | None", "int | None"]


def step_size_unit(phase: Phase | None) -> str:
    """What a step's size counts in ``phase``, the unit of tuning buckets: query ``"tokens"``
    in prefill (whose time grows with the tokens, whatever the requests they come in),
    ``"requests"`` in decode and verify (one or ``K + 1`` tokens each)."""
    return "tokens" if phase is Phase.PREFILL else "requests"


def step_size(phase: Phase, num_reqs: int, num_tokens: int) -> int:
    """A step's size in ``phase``'s unit (:func:`step_size_unit`)."""
    return num_tokens if phase is Phase.PREFILL else num_reqs


def _time_us(name: str, value: object) -> float:
    """A measured time from a tuning file: a finite number of microseconds above 0 (ranking
    divides by it, and a negative or NaN time would rank first)."""
    # a JSON number only: float("50") and float(True) would pass a string or a boolean
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: a time > 0 (microseconds), got {value!r}")
    t = float(value)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{name}: a time > 0 (microseconds), got {value!r}")
    return t


def _count(name: str, value: object) -> int:
    """A step size from a tuning file: an int >= 1 (8.7 is not a batch size)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)  # int(inf) raises OverflowError
        or value != int(value)
        or value < 1
    ):
        raise ValueError(f"{name}: an int >= 1, got {value!r}")
    return int(value)


def _geomean(values: Sequence[float]) -> float:
    if len(values) == 1:
        return float(values[0])  # exact: a single measurement is shown as it was recorded
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


@dataclass(slots=True)
class TuningData:
    """Measured times (microseconds per layer) per backend, layer spec, phase and step size.

    A step's size is its requests in decode and verify and its query tokens in prefill
    (:func:`step_size_unit`). ``attn bench --write-tuning`` writes them: for each group and
    phase, a grid of batch sizes and context lengths; in decode and verify each batch size is a
    bucket (its context lengths aggregated by geometric mean), in prefill each token count
    (``batch * context``). A time recorded without a phase or size (format 1 files) holds for
    every phase / size.

    A bucket may also keep the points it aggregates (:attr:`shape_us`): one bucket's steps can
    differ in their other dimension (a decode batch of 1 at 2k or at 64k cached tokens; a
    prefill of 4096 tokens as one request or as four), and the fastest backend can differ
    between them. The selector then picks the bucket's backend by the smallest worst ratio to
    the fastest over those points rather than by the bucket's mean.
    """

    times_us: dict[TuningKey, float] = field(default_factory=dict)
    #: the device measured on (:meth:`DeviceCapabilities.short`); "" unknown
    device: str = ""
    #: the graph mode the captured phases were timed under ("none": every step eager; ""
    #: unknown, as in files written before it was recorded)
    graph_mode: str = ""
    #: per bucket, its points' times: ``{context: us}`` in decode and verify (cached tokens per
    #: request at that batch size), ``{requests: us}`` in prefill (the bucket's tokens split
    #: into that many requests)
    shape_us: dict[TuningKey, dict[int, float]] = field(default_factory=dict)
    #: the draft tokens per request its verify times were measured with (``--spec-tokens``);
    #: 0: none measured, or a file written before it was recorded (they then hold for any)
    speculative_tokens: int = 0

    def record(
        self,
        backend: str,
        spec: LayerSpec,
        us: float,
        *,
        phase: Phase | str | None = None,
        batch: int | None = None,
        tokens: int | None = None,
        shapes: Mapping[int, float] | None = None,
    ) -> None:
        """Record ``us`` for ``backend`` on ``spec`` in ``phase``, at ``batch`` requests per step
        (decode, verify) or ``tokens`` query tokens per step (prefill); None: every phase /
        every size. ``shapes``: the bucket's points that ``us`` aggregates (:attr:`shape_us`:
        context -> us in decode / verify, requests -> us in prefill)."""
        ph = None if phase is None else Phase(phase)
        unit = step_size_unit(ph)
        wrong = batch if unit == "tokens" else tokens
        if wrong is not None:
            given = "batch" if unit == "tokens" else "tokens"
            raise ValueError(
                f"TuningData.record: {backend} {ph.value if ph else 'any phase'}: steps are "
                f"bucketed by {unit} in this phase, got {given}={wrong}"
            )
        size = tokens if unit == "tokens" else batch
        key = (backend, spec_key(spec), ph, size)
        self.times_us[key] = _time_us(f"TuningData.record: {backend} us", us)
        if shapes:
            self.shape_us[key] = {
                int(k): _time_us(f"TuningData.record: {backend} point {k}", v)
                for k, v in shapes.items()
            }
        else:
            self.shape_us.pop(key, None)

    def shapes(
        self, backend: str, spec: LayerSpec, phase: Phase | None, size: int | None
    ) -> dict[int, float]:
        """The points bucket ``size`` of ``backend`` on ``spec`` aggregates in ``phase``
        (:attr:`shape_us`; the phase's own bucket, else one recorded for every phase); {} where
        none were recorded."""
        sk = spec_key(spec)
        own = self.shape_us.get((backend, sk, phase, size))
        if own is None and (backend, sk, phase, size) not in self.times_us:
            own = self.shape_us.get((backend, sk, None, size))
        return dict(own or {})

    def points(
        self,
        backend: str,
        spec: LayerSpec,
        phase: Phase | None = None,
        *,
        max_size: int | None = None,
    ) -> dict[int | None, float]:
        """``{step size: us}`` measured for ``backend`` on ``spec`` in ``phase``: the phase's
        own entries, else those recorded for every phase. ``max_size``: only the sizes a plan
        with at most that many requests (tokens in prefill) per step can hit (when some are;
        else all of them)."""
        sk = spec_key(spec)
        mine = {
            (p, b): t for (name, s, p, b), t in self.times_us.items() if name == backend and s == sk
        }
        exact = {b: t for (p, b), t in mine.items() if phase is not None and p is phase}
        chosen = exact or {b: t for (p, b), t in mine.items() if p is None}
        if max_size is not None:
            within = {b: t for b, t in chosen.items() if b is None or b <= max_size}
            chosen = within or chosen
        return chosen

    def time(
        self,
        backend: str,
        spec: LayerSpec,
        phase: Phase | None = None,
        *,
        max_size: int | None = None,
    ) -> float | None:
        """The geometric mean of :meth:`points`, or None when nothing was measured."""
        pts = self.points(backend, spec, phase, max_size=max_size)
        return _geomean(list(pts.values())) if pts else None

    def measured_where(self) -> str:
        """``"on h200 under graph mode none"``: what the times hold for."""
        return (
            f"on {self.device or 'an unknown device'} under graph mode "
            f"{self.graph_mode or 'unknown'}"
        )

    def verify_times_hold_for(self, speculative_tokens: int) -> bool:
        """Whether the verify times hold for a run (or other data) verifying
        ``speculative_tokens`` draft tokens: measured with that count, or either count unknown
        (0)."""
        mine = self.speculative_tokens
        return not mine or not speculative_tokens or mine == speculative_tokens

    def verify_conflict(self, other: TuningData) -> str | None:
        """Why ``other``'s verify times cannot sit beside this data's (measured with another
        count of draft tokens), or None."""
        mine, theirs = self.speculative_tokens, other.speculative_tokens
        if not self.verify_times_hold_for(theirs):
            return (
                f"its verify times were measured with {mine} draft token(s) per request, the "
                f"other's with {theirs}"
            )
        return None

    def update(self, newer: TuningData) -> None:
        """Take ``newer``'s measurements in: each of its buckets (with its points) replaces this
        one's bucket of the same backend, spec, phase and size; the others stay. Both must be
        measured on one device under one graph mode, and their verify times with one count of
        draft tokens (``ValueError`` otherwise): a file mixing machines would rank backends by
        the mix."""
        if newer.measured_where() != self.measured_where():
            raise ValueError(
                f"tuning data measured {newer.measured_where()} cannot join data measured "
                f"{self.measured_where()}"
            )
        conflict = self.verify_conflict(newer)
        if conflict:
            raise ValueError(f"tuning data cannot join: {conflict}")
        self.speculative_tokens = self.speculative_tokens or newer.speculative_tokens
        for key, us in newer.times_us.items():
            self.times_us[key] = us
            if key in newer.shape_us:
                self.shape_us[key] = dict(newer.shape_us[key])
            else:
                self.shape_us.pop(key, None)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def to_json(self) -> dict[str, Any]:
        """The tuning file's content (what :meth:`save` writes, :meth:`load` reads)."""

        def order(item: tuple[TuningKey, float]) -> tuple[str, str, str, int]:
            (b, s, p, n), _ = item
            return (b, s, "" if p is None else p.value, -1 if n is None else n)

        entries = []
        for key, t in sorted(self.times_us.items(), key=order):
            b, s, p, n = key
            by_tokens = step_size_unit(p) == "tokens"
            entry: dict[str, Any] = {"backend": b, "spec": json.loads(s), "phase": p and p.value,
                                     ("tokens" if by_tokens else "batch"): n, "us": t}  # fmt: skip
            if key in self.shape_us:  # the bucket's points: prefill by requests, else context
                entry["points"] = [
                    {("batch" if by_tokens else "context"): k, "us": v}
                    for k, v in sorted(self.shape_us[key].items())
                ]
            entries.append(entry)
        payload: dict[str, Any] = {"format": TUNING_FORMAT, "device": self.device}
        if self.graph_mode:
            payload["graph_mode"] = self.graph_mode
        if self.speculative_tokens:
            payload["speculative_tokens"] = self.speculative_tokens
        return {**payload, "entries": entries}

    @classmethod
    def load(cls, path: str | os.PathLike) -> TuningData:
        """Read a tuning file of format 3, 2 or 1. Format 1: times per backend and spec only.
        Format 2 bucketed prefill by requests per step: those prefill times are kept without a
        size (their geometric mean per backend and spec), so they rank but never switch."""
        source = f"tuning file {path}"
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"{source}: cannot read it: {exc}") from None
        try:
            payload = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{source}: not JSON: {exc}") from None
        return cls.from_json(payload, source=source)

    @classmethod
    def from_json(cls, payload: dict[str, Any], source: str = "tuning data") -> TuningData:
        """:meth:`load` from the file's parsed content (``source`` names it in errors)."""
        if not isinstance(payload, dict) or "entries" not in payload:
            raise ValueError(
                f"{source}: expected a JSON object with format and entries, got "
                + (
                    f"keys {sorted(payload)}"
                    if isinstance(payload, dict)
                    else type(payload).__name__
                )
            )
        fmt = payload.get("format")
        if fmt not in (1, 2, TUNING_FORMAT):
            raise ValueError(f"{source}: format {fmt!r}, expected {TUNING_FORMAT} (or 2, 1)")
        entries = payload["entries"]
        if not isinstance(entries, list):
            raise ValueError(f"{source}: entries: expected a list, got {type(entries).__name__}")
        device = payload.get("device", "")
        if not isinstance(device, str):
            raise ValueError(f"{source}: device: expected a string (e.g. 'h200'), got {device!r}")
        graph_mode = payload.get("graph_mode") or ""
        if graph_mode not in ("", *(m.value for m in GraphMode)):
            raise ValueError(
                f"{source}: graph_mode: expected one of {[m.value for m in GraphMode]}, got "
                f"{graph_mode!r}"
            )
        spec_tokens = payload.get("speculative_tokens", 0)
        if isinstance(spec_tokens, bool) or not isinstance(spec_tokens, int) or spec_tokens < 0:
            raise ValueError(
                f"{source}: speculative_tokens: expected an int >= 0, got {spec_tokens!r}"
            )
        data = cls(device=device, graph_mode=graph_mode, speculative_tokens=spec_tokens)
        folded: dict[TuningKey, list[float]] = {}
        for i, e in enumerate(entries):
            try:
                phase = e.get("phase")
                ph = None if phase is None else Phase(phase)
                unit = step_size_unit(ph)
                size = e.get("tokens") if unit == "tokens" else e.get("batch")
                if fmt == 2 and ph is Phase.PREFILL:
                    size = None
                key = (
                    e["backend"],
                    json.dumps(_spec_fields_with_defaults(e["spec"]), sort_keys=True),
                    ph,
                    None
                    if size is None
                    else _count("tokens" if unit == "tokens" else "batch", size),
                )
                folded.setdefault(key, []).append(_time_us("us", e["us"]))
                if e.get("points") is not None and not (fmt == 2 and ph is Phase.PREFILL):
                    shape = "batch" if unit == "tokens" else "context"
                    data.shape_us[key] = {
                        _count(f"points: {shape}", pt[shape]): _time_us("points: us", pt["us"])
                        for pt in e["points"]
                    }
            except (KeyError, ValueError, TypeError, AttributeError) as exc:
                raise ValueError(
                    f"{source}: entry {i} ({e!r}) is malformed: {exc!r}; expected "
                    "backend, spec, us and (formats 2, 3) phase in "
                    f"{[p.value for p in Phase]} or null, batch (decode, verify) or tokens "
                    "(prefill, format 3) an int or null, and optionally points: a list of "
                    "{context (decode, verify) or batch (prefill), us}"
                ) from None
        data.times_us = {key: _geomean(v) for key, v in folded.items()}
        return data


# ------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------
def _by_backend(rejected: Iterable[Rejection]) -> dict[str, list[Rejection]]:
    by: dict[str, list[Rejection]] = {}
    for r in rejected:
        by.setdefault(r.backend, []).append(r)
    return by


@dataclass(frozen=True, slots=True)
class PhaseChoice:
    """The backend chosen for one phase of one group, and why every other candidate was not."""

    phase: Phase
    backend: Backend
    rejected: tuple[Rejection, ...]  # one entry per reason, several per backend possible
    outranked: tuple[str, ...]  # admissible backends ranked below the chosen one
    forced: bool = False
    downgraded_from: tuple[str, ...] = ()  # rejected backends that rank above the chosen one
    tuned_us: float | None = None  # the chosen backend's measured time in this phase
    option_sources: tuple[tuple[str, str], ...] = ()  # as GroupChoice.option_sources
    #: ``(backend, us)``: the measured time in this phase of each backend of :attr:`outranked`
    #: that has one (a faster one lost a tie, :data:`MEASURED_TIE`, or a bucket)
    outranked_us: tuple[tuple[str, float], ...] = ()
    #: per step-size bucket, where the tuning data has another fastest backend than
    #: ``backend`` for some bucket: ``(largest step size, backend)``, ascending; a step of size
    #: ``n`` (padded requests in decode / verify, padded query tokens in prefill:
    #: :func:`step_size`) runs on the first entry whose bound is ``>= n`` (the last one beyond).
    #: Empty: ``backend`` serves every step of the phase.
    by_step_size: tuple[tuple[int, Backend], ...] = ()
    #: prefill only, where a token bucket's request splits disagree on the fastest backend:
    #: ``(tokens above, tokens at most, requests at most, backend)``; a step of ``n`` query
    #: tokens in ``r`` requests inside a rule's token range runs on the first of its rules with
    #: ``r <=`` their bound, ahead of :attr:`by_step_size`. Never under graph mode ``full``
    #: (a captured prefill graph replays with other request counts).
    by_requests: tuple[tuple[int, int, int, Backend], ...] = ()

    def __post_init__(self) -> None:
        bounds = [bound for bound, _ in self.by_step_size]
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            # the first bound that holds a step picks its backend: out of order, a small step
            # would run on a large bucket's backend in silence
            raise ValueError(
                f"PhaseChoice {self.phase.value}: by_step_size bounds {bounds}: expected "
                "ascending, each bound once"
            )

    def backend_for_step(self, size: int, requests: int | None = None) -> Backend:
        """The backend that serves a step of this phase of ``size`` (:func:`step_size`) and, in
        prefill, ``requests`` requests (None: by size alone)."""
        return pick_for_step(self.by_step_size, self.by_requests, self.backend, size, requests)

    @property
    def switch_backends(self) -> tuple[Backend, ...]:
        """The backends of :attr:`by_step_size` and :attr:`by_requests`, in order, each once."""
        seen: dict[str, Backend] = {}
        for b in [b for _, b in self.by_step_size] + [r[3] for r in self.by_requests]:
            seen.setdefault(b.qualified_name, b)
        return tuple(seen.values())

    def switch_notes(self) -> list[str]:
        """Where this phase switches backend, as ``attn explain`` says it: ``"by step size
        (tuned): <= 2048 tokens: fa3:fa3; ..."`` and ``"by requests (tuned): 2049-8192 tokens,
        <= 2 requests: ..."``, each present only where the phase switches that way."""
        notes = []
        if self.by_step_size:
            unit = step_size_unit(self.phase)
            notes.append(
                "by step size (tuned): "
                + "; ".join(f"<= {n} {unit}: {b.qualified_name}" for n, b in self.by_step_size)
            )
        if self.by_requests:
            notes.append(
                "by requests (tuned): "
                + "; ".join(
                    f"{above + 1}-{at_most} tokens, <= {r} requests: {b.qualified_name}"
                    for above, at_most, r, b in self.by_requests
                )
            )
        return notes

    @property
    def options(self) -> dict[str, object]:
        return dict(self.backend.options)

    def rejections_by_backend(self) -> dict[str, list[Rejection]]:
        return _by_backend(self.rejected)

    def to_dict(self) -> dict[str, Any]:
        return {
            **_choice_dict(self),
            "outranked_us": dict(self.outranked_us),
            "by_step_size": [
                {"max": bound, "unit": step_size_unit(self.phase), "backend": b.qualified_name}
                for bound, b in self.by_step_size
            ],
            "by_requests": [
                {
                    "tokens_above": above,
                    "tokens_max": at_most,
                    "requests_max": max_requests,
                    "backend": b.qualified_name,
                }
                for above, at_most, max_requests, b in self.by_requests
            ],
        }


def _choice_dict(c: PhaseChoice | GroupChoice) -> dict[str, Any]:
    """The JSON of a choice that a group's entry and each of its phases' entries share: the
    chosen backend (and whether it loads here), how it was chosen, its options in force with
    their sources, and every other candidate (ranked lower or rejected)."""
    sources = dict(c.option_sources)
    return {
        "backend": c.backend.qualified_name,
        "loadable_here": c.backend.available,
        "forced": c.forced,
        "downgraded_from": list(c.downgraded_from),
        "tuned_us": c.tuned_us,
        "options": {
            k: {"value": v, "source": sources.get(k, "default")} for k, v in c.backend.options
        },
        "outranked": list(c.outranked),
        "rejected": [
            {"backend": r.backend, "code": r.code, "reason": r.reason, "fix": r.fix}
            for r in c.rejected
        ],
    }


@dataclass(frozen=True, slots=True)
class GroupChoice:
    """The backends chosen for one group, per phase, and why every other candidate was not.

    The fields ``backend`` .. ``tuned_us`` and ``option_sources`` describe the ``prefill``
    phase (prefill and mixed steps), as they did before plans chose per phase; ``phases`` holds
    every planned phase (prefill first). All of them share the group's persistent state: one
    page size, KV layout and KV dtype.
    """

    group: LayerGroup
    backend: Backend
    rejected: tuple[Rejection, ...]  # one entry per reason, several per backend possible
    outranked: tuple[str, ...]  # admissible backends ranked below the chosen one
    forced: bool = False
    downgraded_from: tuple[str, ...] = ()  # rejected backends that rank above the chosen one
    tuned_us: float | None = None
    #: offline plans: (backend, reason) of every candidate of the group's kind that this
    #: machine cannot load (chosen, ranked lower or rejected for the target); sorted
    not_loadable_here: tuple[tuple[str, str], ...] = ()
    #: (key, where its value came from: "default", "--option", ATTN_CORE_BACKEND_OPTIONS=...,
    #: "ExecutionConstraints.backend_options") for every option of the chosen backend; sorted
    option_sources: tuple[tuple[str, str], ...] = ()
    #: every planned phase's choice, prefill first; empty (a choice made by hand): the one
    #: ``backend`` serves every phase
    phases: tuple[PhaseChoice, ...] = ()

    @property
    def options(self) -> dict[str, object]:
        """The chosen backend's options in force (declared defaults filled in)."""
        return dict(self.backend.options)

    def phase_choice(self, phase: Phase | str) -> PhaseChoice:
        """The choice of ``phase``; a phase that was not planned (verify without speculative
        tokens, decode of an encoder group, a hand-made choice) is served by the prefill one."""
        phase = Phase(phase)
        for p in self.phases:
            if p.phase is phase:
                return p
        return PhaseChoice(
            phase,
            self.backend,
            self.rejected,
            self.outranked,
            forced=self.forced,
            downgraded_from=self.downgraded_from,
            tuned_us=self.tuned_us,
            option_sources=self.option_sources,
        )

    def backend_for_phase(self, phase: Phase | str) -> Backend:
        """The backend that serves ``phase`` steps of this group (see :meth:`phase_choice`)."""
        return self.phase_choice(phase).backend

    @property
    def planned_phases(self) -> tuple[Phase, ...]:
        return tuple(p.phase for p in self.phases) or (Phase.PREFILL,)

    def phases_served_by(self, qualified_name: str) -> tuple[Phase, ...]:
        """The planned phases whose steps (some step-size bucket included) run on this
        backend; every phase for the backend of a choice without phases (made by hand: it
        serves them all). A phase a plan left out never runs (verify without draft tokens,
        decode of an encoder group), so it counts for no backend."""
        served = tuple(
            p.phase
            for p in self.phases
            if p.backend.qualified_name == qualified_name
            or any(b.qualified_name == qualified_name for b in p.switch_backends)
        )
        if not self.phases and self.backend.qualified_name == qualified_name:
            return tuple(Phase)
        return served

    @property
    def backends(self) -> tuple[Backend, ...]:
        """The distinct backends of the group's phases (prefill's first): one context each."""
        out: dict[str, Backend] = {self.backend.qualified_name: self.backend}
        for p in self.phases:
            out.setdefault(p.backend.qualified_name, p.backend)
            for b in p.switch_backends:
                out.setdefault(b.qualified_name, b)
        return tuple(out.values())

    @property
    def loadable_here(self) -> bool:
        """Whether this machine can load the chosen backend (False only in offline plans)."""
        return self.backend.available

    def rejections_by_backend(self) -> dict[str, list[Rejection]]:
        return _by_backend(self.rejected)


@dataclass(frozen=True, slots=True)
class Plan:
    """One backend per layer group and phase, plus the model-wide settings they agreed on."""

    device: DeviceCapabilities
    constraints: ExecutionConstraints
    choices: tuple[GroupChoice, ...]
    page_size: int | None
    kv_layout: str | None
    #: True: planned for this machine (a backend it cannot load was rejected); False: an
    #: offline plan for a target, which may choose backends this machine cannot load
    local: bool = True
    #: the graph mode the run asked for, when the downgrade policy lowered it to
    #: ``constraints.graph_mode`` (no backend served some group under it); None: not lowered
    graph_mode_requested: GraphMode | None = None

    def choice(self, group_id: str) -> GroupChoice:
        for c in self.choices:
            if c.group.group_id == group_id:
                return c
        raise KeyError(
            f"no group {group_id!r} in the plan; groups: {[c.group.group_id for c in self.choices]}"
        )

    def backend_for(self, group_id: str, phase: Phase | str | None = None) -> Backend:
        """The backend of ``group_id`` in ``phase`` (None: the prefill / mixed one)."""
        choice = self.choice(group_id)
        return choice.backend if phase is None else choice.backend_for_phase(phase)

    def phase_graph_modes(self, phase: Phase | str) -> tuple[GraphMode, GraphMode]:
        """``(requested, granted)``: how the steps of ``phase`` would be captured under the
        graph mode the run asked for, and how they are under the plan's (lowered) one. Under
        ``full`` prefill / mixed steps are captured as ``full`` and decode / verify steps as
        ``decode``; under ``decode`` prefill / mixed steps run eagerly (``none``)."""
        phase = Phase(phase)
        asked = self.graph_mode_requested or self.constraints.graph_mode
        return (
            _phase_graph_mode(asked, phase),
            _phase_graph_mode(self.constraints.graph_mode, phase),
        )

    def _phase_dict(self, p: PhaseChoice) -> dict[str, Any]:
        asked, granted = self.phase_graph_modes(p.phase)
        return {**p.to_dict(), "graph_mode_requested": asked.value, "graph_mode": granted.value}

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.short(),
            "local": self.local,
            "graph_mode": self.constraints.graph_mode.value,
            "graph_mode_requested": (
                self.graph_mode_requested.value if self.graph_mode_requested else None
            ),
            "page_size": self.page_size,
            "kv_layout": self.kv_layout,
            "phases": [p.value for p in Phase if any(p in c.planned_phases for c in self.choices)],
            "groups": [
                {
                    "group_id": c.group.group_id,
                    "spec": c.group.spec.short(),
                    "layers": list(c.group.layer_indices),
                    **_choice_dict(c),
                    "not_loadable_here": [
                        {"backend": b, "reason": why} for b, why in c.not_loadable_here
                    ],
                    # every planned phase (prefill's entry repeats the keys above), with how
                    # its steps are captured: asked for and granted (phase_graph_modes)
                    "phases": {p.phase.value: self._phase_dict(p) for p in c.phases},
                }
                for c in self.choices
            ],
        }


def _default_rank(
    backend: Backend, phase: Phase = Phase.PREFILL, spec: LayerSpec | None = None
) -> tuple[int, int]:
    """The default rule without measurements: the reference last, then the backend's priority
    in ``phase`` for a layer of ``spec`` (higher first; :meth:`Backend.priority_for`)."""
    return (
        1 if backend.qualified_name == REFERENCE_BACKEND else 0,
        -backend.priority_for(phase, spec),
    )


def is_measured_tie(t: float, fastest: float) -> bool:
    """Whether a time ``t`` is within :data:`MEASURED_TIE` of ``fastest``: a tie, which the
    default rule decides."""
    return t <= fastest * (1.0 + MEASURED_TIE)


def _measured_key(
    t: float, fastest: float, backend: Backend, phase: Phase, spec: LayerSpec | None, us: float
) -> tuple[float, int, int, float, str]:
    """The sort key of a measured candidate whose score is ``t`` (a time or a ratio, lower
    first) against the best ``fastest``: within :data:`MEASURED_TIE` of it a tie, then the
    default rule, then its measured time ``us``, then its name."""
    banded = fastest if is_measured_tie(t, fastest) else t
    return (banded, *_default_rank(backend, phase, spec), us, backend.qualified_name)


def _rank_key(
    backend: Backend, phase: Phase, times: Mapping[str, float], spec: LayerSpec | None = None
) -> tuple[int, float, int, int, float, str]:
    """Measured candidates first (fastest first; within :data:`MEASURED_TIE` of the fastest a
    tie), then the default rule, then the measured time, then name."""
    t = times.get(backend.qualified_name)
    if t is None:
        return (1, 0.0, *_default_rank(backend, phase, spec), 0.0, backend.qualified_name)
    return (0, *_measured_key(t, min(times.values()), backend, phase, spec, t))


def _phase_times(
    tuning: TuningData | None,
    candidates: Sequence[Backend],
    spec: LayerSpec,
    phase: Phase,
    max_size: int,
) -> dict[str, float]:
    """Each measured candidate's time in ``phase``: the geometric mean over the step-size
    buckets every measured candidate has (so that all are compared on the same points), or over
    its own buckets when they share none; buckets above ``max_size`` are left out when others
    remain."""
    if tuning is None:
        return {}
    points = {
        b.qualified_name: tuning.points(b.qualified_name, spec, phase, max_size=max_size)
        for b in candidates
    }
    points = {name: pts for name, pts in points.items() if pts}
    if not points:
        return {}
    common = set.intersection(*(set(pts) for pts in points.values()))
    return {
        name: _geomean([pts[k] for k in common] if common else list(pts.values()))
        for name, pts in points.items()
    }


def planned_phases(group: LayerGroup, constraints: ExecutionConstraints) -> tuple[Phase, ...]:
    """The phases a run of ``constraints`` steps ``group`` through: ``prefill`` and ``decode``,
    plus ``verify`` when it verifies draft tokens; an encoder group has prefill steps only."""
    if group.spec.kind is LayerKind.ENCODER:
        return (Phase.PREFILL,)
    if constraints.speculative_tokens > 0:
        return (Phase.PREFILL, Phase.DECODE, Phase.VERIFY)
    return (Phase.PREFILL, Phase.DECODE)


def _forced_keys(group: LayerGroup, phase: Phase) -> tuple[str, ...]:
    """The ``force`` keys that may apply to ``group`` in ``phase``, the first set one wins: the
    phase-qualified ones first (``decode:GROUP``, ``decode:KIND``), then the unqualified ones
    (``GROUP``, ``KIND``: every phase), then the bare phase (``decode``: every group)."""
    g, k, p = group.group_id, group.spec.kind.value, phase.value
    return (f"{p}:{g}", f"{p}:{k}", g, k, p)


def _forced_key(
    group: LayerGroup, constraints: ExecutionConstraints, phase: Phase = Phase.PREFILL
) -> str | None:
    """The ``force`` key that applies to ``group`` in ``phase`` (see :func:`_forced_keys`)."""
    forced = constraints.forced
    for key in _forced_keys(group, phase):
        if forced.get(key):
            return key
    return None


def _forced_name(
    group: LayerGroup, constraints: ExecutionConstraints, phase: Phase = Phase.PREFILL
) -> str | None:
    key = _forced_key(group, constraints, phase)
    return constraints.forced[key] if key is not None else None


def _force_key_problem(key: str, targets: set[str]) -> str | None:
    """Why ``key`` is not a force key of this model (None: it is). ``targets``: the model's
    layer kinds and group ids."""
    phases = [p.value for p in Phase]
    if key in targets or key in phases:
        return None
    prefix, sep, rest = key.partition(":")
    if sep:
        if prefix not in phases:
            return f"has '{prefix}' before ':', which is not a phase (one of {phases})"
        if rest in targets:
            return None
        return f"names '{rest}' after '{prefix}:': no layer kind and no group of this model"
    return "names no layer kind and no group of this model, and no phase"


def parse_forced(text: str, *, source: str) -> dict[str, str]:
    """``"full=flashinfer,linear=triton_ssm"`` -> ``{"full": "flashinfer", "linear": ...}``.

    :param text: comma-separated ``KEY=BACKEND`` entries; a key is a layer kind or group id
        (every phase), ``PHASE:KIND_OR_GROUP`` (that phase only, e.g. ``decode:full``) or a bare
        phase (``decode``: that phase of every group); empty entries (a trailing comma) are
        ignored. Whether a key names a kind, group or phase is checked by :func:`select`.
    :param source: where ``text`` came from (``"ATTN_CORE_BACKENDS"``, ``"--backends"``); every
        error starts with ``source=text``, so the user knows which setting to fix.
    :returns: one backend name per layer kind or group id.
    :raises SelectionError: an entry without ``=``, with nothing before or after it, or a key
        given twice (the message names both values).
    """
    forced: dict[str, str] = {}
    hint = (
        "expected KIND_OR_GROUP=BACKEND entries, e.g. 'full=flashinfer,linear=triton_ssm' "
        "(a phase prefix forces one phase: 'decode:full=flashinfer', 'decode=flashinfer')"
    )
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, name = entry.partition("=")
        key, name = key.strip(), name.strip()
        problem = None
        if not sep:
            problem = "has no '='"
        elif not key:
            problem = "names no layer kind or group before '='"
        elif not name:
            problem = "names no backend after '='"
        if problem is not None:
            raise SelectionError(f"{source}={text!r}: entry {entry!r} {problem}; {hint}")
        if key in forced:
            raise SelectionError(
                f"{source}={text!r}: {key!r} is given twice ({forced[key]!r} and {name!r}); "
                "keep one"
            )
        forced[key] = name
    return forced


def _env_constraints(
    constraints: ExecutionConstraints,
) -> tuple[ExecutionConstraints, dict[str, str]]:
    """``constraints`` with ``ATTN_CORE_BACKENDS`` merged in, and the entries that came from the
    variable (so that errors about them can name it)."""
    env = os.environ.get(ENV_FORCE, "")
    if not env.strip():
        return constraints, {}
    from_env = parse_forced(env, source=ENV_FORCE)
    explicit = constraints.forced
    from_env = {k: v for k, v in from_env.items() if k not in explicit}  # arguments win
    return constraints.with_(force={**from_env, **explicit}), from_env


def _env_origin(key: str | None, from_env: Mapping[str, str]) -> str:
    """``" (from ATTN_CORE_BACKENDS='...')"`` when the forced ``key`` came from the variable."""
    if key is None or key not in from_env:
        return ""
    return f" (from {ENV_FORCE}={os.environ.get(ENV_FORCE, '')!r})"


def select(
    groups: Sequence[LayerGroup],
    registry: Registry,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints | None = None,
    *,
    tuning: TuningData | None = None,
    local: bool | None = None,
) -> Plan:
    """Choose one backend for every group, under settings every group agrees on.

    When no backend serves some group under the run's graph mode, the downgrade policy lowers it
    (``full`` -> ``decode`` -> ``none``) as far as every group needs: ``warn`` warns, ``allow``
    is silent, ``error`` refuses; the plan's ``constraints.graph_mode`` is the mode it runs in and
    ``Plan.graph_mode_requested`` the one asked for.

    :param groups: the model's layer groups (``ModelLayout.groups``).
    :param registry: loaded plugins.
    :param device: the device to plan for (detected or a named target).
    :param local: whether the plan is for this machine, where a backend it cannot load is
        rejected; False makes an offline plan for ``device``, which marks such backends
        (``GroupChoice.not_loadable_here``) instead. Default: :func:`is_this_machine`.
    :param constraints: the run's demands; forced backends also come from ``ATTN_CORE_BACKENDS``
        (explicit ``constraints.force`` entries win). Backend options come from
        ``constraints.backend_options``, then ``constraints.cli_backend_options`` (``--option``),
        then ``ATTN_CORE_BACKEND_OPTIONS`` (the first that sets a key wins); the chosen backend
        of every group carries its options in force (defaults filled in) as ``backend.options``.
    :param tuning: measured times that rank admissible backends before declared priority;
        default: the file named by ``ATTN_CORE_TUNING`` if set.
    :raises SelectionError: no setting admits a backend for every group, a forced backend cannot
        serve, or the downgrade policy is ``error`` and a higher-ranked backend was rejected or
        the graph mode would have to be lowered.
        The message lists every candidate of the failing group with its reasons. A malformed
        ``ATTN_CORE_BACKENDS`` (an entry without ``=``, a key given twice, a key that names no
        kind or group) is an error too, and every error about an entry of the variable names it.
        So is a backend option for a backend that is not registered, a key its
        ``option_schema`` does not declare, or a value it does not accept (the message names the
        backend, the key, what is allowed and the source).
    """
    constraints, from_env = _env_constraints(constraints or ExecutionConstraints())
    if local is None:
        local = is_this_machine(device)
    if tuning is None and os.environ.get(ENV_TUNING):
        tuning = TuningData.load(os.environ[ENV_TUNING])
    if tuning is not None:
        _warn_foreign_tuning(tuning, device, constraints)
    backends = registry.backends
    _warn_unmatched_deny(registry, constraints)
    targets = {k.value for k in LayerKind} | {g.group_id for g in groups}
    expected = (
        f"expected one of {sorted(targets)}, a phase {[p.value for p in Phase]}, or "
        "PHASE:KIND_OR_GROUP (e.g. decode:full)"
    )
    for key in sorted(from_env):
        problem = _force_key_problem(key, targets)
        if problem is not None:
            raise SelectionError(
                f"{ENV_FORCE}={os.environ[ENV_FORCE]!r}: entry '{key}={from_env[key]}' "
                f"{problem}; {expected}"
            )
    unknown = {
        k: problem
        for k in sorted(constraints.forced)
        if (problem := _force_key_problem(k, targets)) is not None
    }
    if unknown:
        details = "; ".join(
            f"'{k}={constraints.forced[k]}' {problem}" for k, problem in unknown.items()
        )
        raise SelectionError(
            f"forced backend keys {sorted(unknown)} name no layer kind, group or phase of this "
            f"model ({details}); {expected}"
        )
    _warn_unmatched_force(groups, constraints)
    for group in groups:
        for phase in planned_phases(group, constraints):
            fkey = _forced_key(group, constraints, phase)
            if fkey is None:
                continue
            name = constraints.forced[fkey]
            try:
                registry.resolve(name)  # unknown / ambiguous names fail here, with the known ones
            except SelectionError as exc:
                if fkey not in from_env:
                    raise
                raise SelectionError(
                    f"{ENV_FORCE}={os.environ[ENV_FORCE]!r}: entry '{fkey}={name}': {exc}"
                ) from None

    # Every option value is checked here, for every backend it names (chosen or not).
    options = resolve_backend_options(registry, constraints)

    kv_groups = [g for g in groups if g.spec.has_kv_cache]
    page_options: Sequence[int | None] = _page_size_options(kv_groups, backends, constraints)
    layout_options: Sequence[str | None] = (
        [constraints.kv_layout] if constraints.kv_layout else ["NHD", "HND"]
    )
    if not kv_groups:
        page_options, layout_options = [None], [None]

    Failure = tuple[LayerGroup, Phase, list[Rejection], int | None, str | None]

    def attempt(
        cons: ExecutionConstraints,
        pages: Sequence[int | None] = page_options,
        layouts: Sequence[str | None] = layout_options,
    ) -> Plan | Failure:
        """The first plan under ``cons`` over the page sizes and layouts (every group and phase
        has a backend under it), else its first failure."""
        first_failure: Failure | None = None
        for page_size in pages:
            for layout in layouts:
                choices: list[GroupChoice] = []
                failed = None
                for group in groups:
                    result = _choose(
                        group, backends, registry, device, cons, page_size, layout, tuning, local
                    )
                    if isinstance(result, GroupChoice):
                        choices.append(result)
                    else:
                        failed = (group, result[0], result[1], page_size, layout)
                        break
                if failed is None:
                    choices = [_with_options(c, options) for c in choices]
                    plan = Plan(device, cons, tuple(choices), page_size, layout, local)
                    if pages is page_options and layouts is layout_options:
                        plan = _say_shared_state(plan, backends, tuning, attempt)
                    return plan
                if first_failure is None:
                    first_failure = failed
        assert first_failure is not None
        return first_failure

    result = attempt(constraints)
    if isinstance(result, Plan):
        _apply_downgrade_policy(result)
        _warn_unused_tuning(result, tuning)
        return result
    group, phase, rejections, page_size, layout = result
    message = _no_backend_message(
        group, rejections, constraints, page_size, layout, from_env, phase
    ) + _allow_list_notes(registry, constraints)
    # The downgrade policy may lower the graph mode (full -> decode -> none) as far as it takes
    # for every group to have a backend; a run whose mode every group can serve keeps it.
    requested = constraints.graph_mode
    for mode in _GRAPH_MODES_DOWN[_GRAPH_MODES_DOWN.index(requested) + 1 :]:
        lowered = attempt(constraints.with_(graph_mode=mode))
        if not isinstance(lowered, Plan):
            continue
        policy = constraints.downgrade
        if policy is DowngradePolicy.ERROR:
            raise SelectionError(
                f"{message}\ngraph mode {mode.value} would admit every group, but the downgrade "
                f"policy is error: the graph mode is not lowered (run with graph mode "
                f"{mode.value}, or downgrade warn) [downgrade policy: error]"
            )
        lowered = replace(lowered, graph_mode_requested=requested)
        if policy is DowngradePolicy.WARN:
            # Every group that has no backend under the requested mode (at the lowered plan's
            # page size and layout), each with its candidates and why they were rejected.
            blocked = []
            for g in groups:
                got = _choose(
                    g,
                    backends,
                    registry,
                    device,
                    constraints,
                    lowered.page_size,
                    lowered.kv_layout,
                    tuning,
                    local,
                )
                if not isinstance(got, GroupChoice):
                    blocked.append(
                        _no_backend_message(
                            g,
                            got[1],
                            constraints,
                            lowered.page_size,
                            lowered.kv_layout,
                            from_env,
                            got[0],
                        )
                    )
            warnings.warn(
                f"graph mode lowered {requested.value} -> {mode.value}: "
                + ("\n".join(blocked) or message),
                stacklevel=2,
            )
        _apply_downgrade_policy(lowered)
        _warn_unused_tuning(lowered, tuning)
        return lowered
    raise SelectionError(message)


def _warn_unused_tuning(plan: Plan, tuning: TuningData | None) -> None:
    """Warn where tuning data was given and timed no group of ``plan`` in any phase: its
    entries are for other layer specs (another model, dtype, tensor-parallel size) or backend
    names not registered, so the plan ranked by priority alone."""
    if tuning is None or not tuning.times_us:
        return
    for choice in plan.choices:
        if choice.tuned_us is not None or any(p.tuned_us is not None for p in choice.phases):
            return
    # the usual cause: attn bench's dtype default (float32 on a CPU, bfloat16 on CUDA) is not
    # explain's (the config's)
    measured = {json.loads(spec).get("dtype") for _, spec, _, _ in tuning.times_us}
    planned = {c.group.spec.dtype for c in plan.choices}
    hint = ""
    if measured.isdisjoint(planned):
        hint = (
            f"; its times are for dtype {', '.join(sorted(map(str, measured)))}, the plan's "
            f"groups are {', '.join(sorted(planned))}: pass the --dtype it was measured with"
        )
    warnings.warn(
        "the tuning data times no group of this plan (its entries are for other layer specs, "
        "e.g. another model, dtype or --tp, or for backends not registered here): backends "
        "rank by priority (re-run attn bench --write-tuning for this model and settings)" + hint,
        stacklevel=3,
    )


def _warn_foreign_tuning(
    tuning: TuningData, device: DeviceCapabilities, constraints: ExecutionConstraints
) -> None:
    """Warn where the tuning data was measured on another device, or timed the captured phases
    under another graph mode than the run's: its times rank backends as they ran there."""
    differ = []
    if tuning.device and tuning.device != device.short():
        differ.append(f"measured on {tuning.device}, the plan is for {device.short()}")
    if tuning.graph_mode and tuning.graph_mode != constraints.graph_mode.value:
        differ.append(
            f"timed under graph mode {tuning.graph_mode}, the run asks for "
            f"{constraints.graph_mode.value}"
        )
    k, run_k = tuning.speculative_tokens, constraints.speculative_tokens
    if not tuning.verify_times_hold_for(run_k):
        warnings.warn(
            f"the tuning data's verify times were measured with {k} draft token(s) per request, "
            f"the run verifies {run_k}: the verify phase ranks by priority (re-run attn bench "
            f"--write-tuning --spec-tokens {run_k} into another file)",
            stacklevel=3,
        )
    if differ:
        warnings.warn(
            "the tuning data ranks backends as they ran where it was measured: "
            + "; ".join(differ)
            + " (re-run attn bench --write-tuning on this device with the run's --graph-mode)",
            stacklevel=3,
        )


#: Graph modes from the most captured to none: the order the downgrade policy lowers them in.
_GRAPH_MODES_DOWN = (GraphMode.FULL, GraphMode.DECODE, GraphMode.NONE)


def _local_cuda_devices() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of every CUDA device this machine has."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append((props.name, (props.major, props.minor)))
    return out


def is_this_machine(device: DeviceCapabilities) -> bool:
    """Whether ``device`` is one this machine has: the CPU, or a CUDA device of the same name
    and compute capability (``DeviceCapabilities.target("h200")`` on an H200). Plugins report
    ``available`` for this machine, so only then does unavailability reject a backend."""
    if device.device_type == "cpu":
        return True
    return (device.name, device.compute_capability) in _local_cuda_devices()


def _warn_unmatched_force(groups: Sequence[LayerGroup], constraints: ExecutionConstraints) -> None:
    """A forced entry naming a layer kind the model has no layers of forces nothing: a typo
    (``linear`` for ``full``) would leave the layers it meant to the ranking. A warning, not
    an error: a server's forced backends may name kinds that only some of its models have."""
    kinds = {g.spec.kind.value for g in groups}
    absent = {k.value for k in LayerKind} - kinds
    for key in sorted(constraints.forced):
        target = key.partition(":")[2] or key
        if target in absent:
            warnings.warn(
                f"forced entry '{key}={constraints.forced[key]}' applies to no layer: this "
                f"model has no {target} layers (its kinds: {', '.join(sorted(kinds))})",
                stacklevel=3,
            )


def _warn_unmatched_deny(registry: Registry, constraints: ExecutionConstraints) -> None:
    """A deny-list entry that names no registered backend excludes nothing: a typo would leave
    the backend it meant in the race. A warning, not an error: a server's deny list may name a
    plugin that one of its machines does not install."""
    for entry in sorted(constraints.deny):
        if any(registry.matches(entry, b) for b in registry.backends):
            continue
        try:
            registry.resolve(entry)
            why = "it matches no backend"
        except SelectionError as exc:
            why = str(exc)
        warnings.warn(f"deny list entry {entry!r} excludes nothing: {why}", stacklevel=3)


def _allow_list_notes(registry: Registry, constraints: ExecutionConstraints) -> str:
    """Lines for allow-list entries that name no registered backend, saying why (the plugin is
    quarantined or was skipped, or no such backend exists), so a failed selection names them."""
    lines = []
    for entry in sorted(constraints.allow):
        if any(registry.matches(entry, b) for b in registry.backends):
            continue
        try:
            registry.resolve(entry)
        except SelectionError as exc:
            lines.append(f"\n  allow list entry {entry!r}: {exc}")
    return "".join(lines)


def _page_size_options(
    kv_groups: Sequence[LayerGroup], backends: Sequence[Backend], constraints: ExecutionConstraints
) -> list[int | None]:
    if constraints.page_size is not None:
        return [constraints.page_size]
    preferred = [g.spec.page_size for g in kv_groups]
    others: set[int] = set()
    for b in backends:
        if b.capabilities.page_sizes is not None and (
            b.capabilities.kinds & {LayerKind.FULL, LayerKind.MLA}
        ):
            others |= b.capabilities.page_sizes
    ordered: list[int | None] = []
    for p in [*preferred, *sorted(others)]:
        if p not in ordered:
            ordered.append(p)
    return ordered


#: Rejection codes of the settings every backend of a group shares through its persistent
#: state (chosen for the whole model): a backend rejected only for them could serve the group
#: under other settings.
_SHARED_STATE_CODES = frozenset({"page_size", "kv_layout"})


def _choose(
    group: LayerGroup,
    backends: Sequence[Backend],
    registry: Registry,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    page_size: int | None,
    layout: str | None,
    tuning: TuningData | None,
    local: bool = True,
) -> GroupChoice | tuple[Phase, list[Rejection]]:
    """Every planned phase's backend for ``group`` under one page size and KV layout (which all
    of them share), else the first phase without one and its rejections."""
    phases: list[PhaseChoice] = []
    for phase in planned_phases(group, constraints):
        result = _choose_phase(
            group, phase, backends, registry, device, constraints, page_size, layout, tuning, local
        )
        if not isinstance(result, PhaseChoice):
            return phase, result
        phases.append(result)
    first = phases[0]
    spec = group.spec
    return GroupChoice(
        group=group,
        backend=first.backend,
        rejected=first.rejected,
        outranked=first.outranked,
        forced=first.forced,
        downgraded_from=first.downgraded_from,
        tuned_us=first.tuned_us,
        not_loadable_here=()
        if local
        else tuple(
            sorted(
                (b.qualified_name, b.unavailable_reason or "unavailable")
                for b in backends
                if not b.available and spec.kind in b.capabilities.kinds
            )
        ),
        phases=tuple(phases),
    )


def _choose_phase(
    group: LayerGroup,
    phase: Phase,
    backends: Sequence[Backend],
    registry: Registry,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    page_size: int | None,
    layout: str | None,
    tuning: TuningData | None,
    local: bool,
) -> PhaseChoice | list[Rejection]:
    spec = group.spec
    forced = _forced_name(group, constraints, phase)
    admissible: list[Backend] = []
    rejected: list[Rejection] = []
    for b in backends:
        reasons = check_backend(
            b,
            spec,
            device,
            constraints,
            page_size=page_size,
            kv_layout=layout,
            local=local,
            phase=phase,
        )
        if forced is not None and not registry.matches(forced, b) and not reasons:
            reasons = [Rejection(b.qualified_name, "not_forced", f"the run forces {forced}")]
        if reasons:
            rejected.extend(reasons)
        else:
            admissible.append(b)
    if not admissible:
        return rejected
    max_size = step_size(phase, constraints.max_batch_size, constraints.max_num_tokens)
    # the times of this page size; verify times of another draft-token count do not hold
    timed = tuning_spec(spec, page_size)
    if (
        tuning is not None
        and phase is Phase.VERIFY
        and not tuning.verify_times_hold_for(constraints.speculative_tokens)
    ):
        tuning = None  # said by _warn_foreign_tuning
    times = _phase_times(tuning, admissible, timed, phase, max_size)
    winners = (
        [] if forced is not None else _bucket_winners(tuning, admissible, timed, phase, max_size)
    )
    by_step_size = _merge_buckets([(bound, b) for bound, b, _ in winners])
    by_requests: tuple[tuple[int, int, int, Backend], ...] = ()
    if winners and phase is Phase.PREFILL and constraints.graph_mode is not GraphMode.FULL:
        assert tuning is not None  # winners come from tuning data
        by_requests = _request_splits(
            tuning, admissible, timed, winners, constraints.max_batch_size
        )
    admissible.sort(key=lambda b: _rank_key(b, phase, times, spec))
    if winners and not by_step_size:  # one backend wins every bucket: it serves the rest
        only = winners[0][1].qualified_name
        admissible.sort(key=lambda b: b.qualified_name != only)  # stable: the rest keep rank
    chosen = admissible[0]
    # backends that could serve this group and phase but for a run setting (not those of
    # another kind, that do not serve the phase, or that lost to a forced one)
    not_serving = {
        r.backend for r in rejected if r.model or r.code in ("kind", "not_forced", "phase")
    }
    serving = {r.backend for r in rejected} - not_serving
    downgraded_from = tuple(
        sorted(
            b.qualified_name
            for b in backends
            if b.qualified_name in serving
            and _default_rank(b, phase, spec) < _default_rank(chosen, phase, spec)  # above it
            and not any(
                r.backend == b.qualified_name and r.code in ("denied", "not_allowed")
                for r in rejected
            )
        )
    )
    return PhaseChoice(
        phase=phase,
        backend=chosen,
        rejected=tuple(rejected),
        outranked=tuple(b.qualified_name for b in admissible[1:]),
        forced=forced is not None,
        downgraded_from=downgraded_from,
        tuned_us=times.get(chosen.qualified_name),
        outranked_us=tuple(
            (b.qualified_name, times[b.qualified_name])
            for b in admissible[1:]
            if b.qualified_name in times
        ),
        by_step_size=by_step_size,
        by_requests=by_requests,
    )


def _bucket_winners(
    tuning: TuningData | None,
    candidates: Sequence[Backend],
    spec: LayerSpec,
    phase: Phase,
    max_size: int,
) -> list[tuple[int, Backend, int]]:
    """The fastest measured candidate per step-size bucket, ``(largest step size, backend, the
    bucket's measured size)`` ascending; [] where fewer than two candidates share a measured
    bucket.

    The buckets are the step sizes (requests, or tokens in prefill: :func:`step_size_unit`)
    every measured candidate was timed at, up to ``max_size``. A step of size ``n`` belongs to
    the measured size nearest in ratio: the bound between sizes ``a < b`` is
    ``floor(sqrt(a * b))``; the last bucket reaches ``max_size``. Each bucket's backend is
    :func:`_bucket_winner`'s.
    """
    if tuning is None:
        return []
    points: dict[str, tuple[Backend, dict[int, float]]] = {}
    for b in candidates:
        pts = tuning.points(b.qualified_name, spec, phase, max_size=max_size)
        sized = {n: t for n, t in pts.items() if n is not None and n <= max_size}
        if sized:
            points[b.qualified_name] = (b, sized)
    if len(points) < 2:
        return []
    common = sorted(set.intersection(*(set(sized) for _, sized in points.values())))
    if not common:
        return []
    winners = [
        _bucket_winner(tuning, [(b, sized[n]) for b, sized in points.values()], spec, phase, n)
        for n in common
    ]
    bounds = [math.isqrt(a * b) for a, b in itertools.pairwise(common)] + [max_size]
    return list(zip(bounds, winners, common, strict=True))


def _bucket_winner(
    tuning: TuningData,
    measured: Sequence[tuple[Backend, float]],
    spec: LayerSpec,
    phase: Phase,
    size: int,
) -> Backend:
    """The backend for one bucket, from ``(candidate, the bucket's time)``: the smallest worst
    ratio to the fastest over the points of the bucket every candidate was timed at
    (:meth:`TuningData.shapes`), so that a bucket whose points disagree on the fastest backend
    gets the one that loses least where it loses; buckets without shared points go to the
    fastest bucket time. Within :data:`MEASURED_TIE` of the best it is a tie: the default
    rule decides, then the bucket time."""
    shapes = {
        b.qualified_name: tuning.shapes(b.qualified_name, spec, phase, size) for b, _ in measured
    }
    common = set.intersection(*(set(pts) for pts in shapes.values()))
    fastest = {k: min(pts[k] for pts in shapes.values()) for k in common}
    quickest = min(t for _, t in measured)
    score = {
        b.qualified_name: max(shapes[b.qualified_name][k] / fastest[k] for k in common)
        if common
        else t / quickest
        for b, t in measured
    }
    best = min(score.values())

    def key(item: tuple[Backend, float]) -> tuple[float, int, int, float, str]:
        b, t = item
        return _measured_key(score[b.qualified_name], best, b, phase, spec, t)

    return min(measured, key=key)[0]


def _request_splits(
    tuning: TuningData,
    candidates: Sequence[Backend],
    spec: LayerSpec,
    winners: Sequence[tuple[int, Backend, int]],
    max_requests: int,
) -> tuple[tuple[int, int, int, Backend], ...]:
    """:attr:`PhaseChoice.by_requests` for prefill: in each token bucket of ``winners``
    (:func:`_bucket_winners`), the fastest candidate at each request split every measured
    candidate was timed at (:meth:`TuningData.shapes`), where they are not all one backend; the
    bound between splits of ``a < b`` requests is ``floor(sqrt(a * b))``, the last reaching
    ``max_requests``."""
    rules: list[tuple[int, int, int, Backend]] = []
    above = 0
    for at_most, _, size in winners:
        timed = [
            (b, tuning.shapes(b.qualified_name, spec, Phase.PREFILL, size)) for b in candidates
        ]
        timed = [(b, pts) for b, pts in timed if pts]
        common = sorted(set.intersection(*(set(pts) for _, pts in timed))) if timed else []
        if len(timed) >= 2 and len(common) >= 2:
            fastest = [_fastest_at(timed, r, spec) for r in common]
            if len({b.qualified_name for b in fastest}) > 1:
                bounds = [math.isqrt(a * b) for a, b in itertools.pairwise(common)]
                splits = list(zip([*bounds, max_requests], fastest, strict=True))
                rules += [(above, at_most, r, b) for r, b in _merge_buckets(splits)]
        above = at_most
    return tuple(rules)


def _fastest_at(
    timed: Sequence[tuple[Backend, dict[int, float]]], shape: int, spec: LayerSpec
) -> Backend:
    """The candidate of ``timed`` (backend, its prefill points) fastest at point ``shape``;
    within :data:`MEASURED_TIE` of the fastest a tie, which the default rule decides."""
    fastest = min(pts[shape] for _, pts in timed)

    def key(item: tuple[Backend, dict[int, float]]) -> tuple[float, int, int, float, str]:
        b, pts = item
        return _measured_key(pts[shape], fastest, b, Phase.PREFILL, spec, pts[shape])

    return min(timed, key=key)[0]


def _merge_buckets(winners: Sequence[tuple[int, Backend]]) -> tuple[tuple[int, Backend], ...]:
    """:attr:`PhaseChoice.by_step_size` from :func:`_bucket_winners`: neighbouring buckets with
    the same backend merged; () where one backend wins every bucket."""
    merged: list[tuple[int, Backend]] = []
    for bound, winner in winners:
        if merged and merged[-1][1].qualified_name == winner.qualified_name:
            merged[-1] = (bound, winner)
        else:
            merged.append((bound, winner))
    return tuple(merged) if len(merged) > 1 else ()


def _say_shared_state(
    plan: Plan,
    backends: Sequence[Backend],
    tuning: TuningData | None,
    attempt: Callable[..., Plan | tuple[LayerGroup, Phase, list[Rejection], Any, Any]],
) -> Plan:
    """Add a ``shared_state`` rejection to every phase whose best candidate was rejected only
    for the page size / KV layout the plan shares, when no plan exists under a setting that
    candidate serves: some other group or phase has no backend there. (When one exists, the
    selector merely preferred the model's own page size, and the ``page_size`` rejection's fix
    says how to get it.)"""
    by_name = {b.qualified_name: b for b in backends}
    new_choices = []
    for c in plan.choices:
        phases = []
        for p in c.phases:
            extra: list[Rejection] = []
            for name, reasons in sorted(p.rejections_by_backend().items()):
                b = by_name.get(name)
                if b is None or not {r.code for r in reasons} <= _SHARED_STATE_CODES:
                    continue
                times = _phase_times(
                    tuning, [p.backend, b], c.group.spec, p.phase, plan.constraints.max_batch_size
                )
                spec = c.group.spec
                if _rank_key(b, p.phase, times, spec) >= _rank_key(p.backend, p.phase, times, spec):
                    continue
                caps = b.capabilities
                pages = (
                    sorted(caps.page_sizes)
                    if "page_size" in {r.code for r in reasons} and caps.page_sizes
                    else [plan.page_size]
                )
                layouts = (
                    sorted(caps.kv_layouts)
                    if "kv_layout" in {r.code for r in reasons}
                    else [plan.kv_layout]
                )
                other = attempt(plan.constraints, pages, layouts)
                if isinstance(other, Plan):
                    continue
                group, phase, _, ps, layout = other
                where = f"page_size {ps}" + (f", kv_layout {layout}" if layout else "")
                extra.append(
                    Rejection(
                        name,
                        "shared_state",
                        f"ranks above {p.backend.qualified_name} for {p.phase.value} but cannot "
                        f"share the persistent state the plan gives every group and phase "
                        f"(page_size {plan.page_size}, kv_layout {plan.kv_layout}): under "
                        f"{where}, which it serves, layer group {group.group_id!r} has no "
                        f"backend for {phase.value}",
                    )
                )
            phases.append(replace(p, rejected=p.rejected + tuple(extra)) if extra else p)
        first = phases[0] if phases else None
        new_choices.append(
            replace(c, phases=tuple(phases), rejected=first.rejected)
            if first is not None and first.phase is Phase.PREFILL
            else replace(c, phases=tuple(phases))
        )
    return replace(plan, choices=tuple(new_choices))


def _with_options(
    choice: GroupChoice, options: Mapping[str, tuple[dict[str, object], dict[str, str]]]
) -> GroupChoice:
    """``choice`` whose phases' backends carry their options in force (none declared: as is)."""

    def carry(backend: Backend) -> tuple[Backend, tuple[tuple[str, str], ...]] | None:
        resolved = options.get(backend.qualified_name)
        if resolved is None:
            return None
        values, sources = resolved
        return backend.with_options(values), tuple(sorted(sources.items()))

    phases = []
    for p in choice.phases:
        given = carry(p.backend)
        if given is not None:
            p = replace(p, backend=given[0], option_sources=given[1])
        if p.by_step_size or p.by_requests:
            p = replace(
                p,
                by_step_size=tuple(
                    (bound, (carry(b) or (b, ()))[0]) for bound, b in p.by_step_size
                ),
                by_requests=tuple(
                    (above, at_most, r, (carry(b) or (b, ()))[0])
                    for above, at_most, r, b in p.by_requests
                ),
            )
        phases.append(p)
    given = carry(choice.backend)
    if given is None:
        return replace(choice, phases=tuple(phases))
    return replace(choice, backend=given[0], option_sources=given[1], phases=tuple(phases))


def _apply_downgrade_policy(plan: Plan) -> None:
    policy = plan.constraints.downgrade
    if policy is DowngradePolicy.ALLOW:
        return
    for c in plan.choices:
        first = c.phase_choice(Phase.PREFILL)
        for p in c.phases or (first,):
            if not p.downgraded_from or p.forced:
                continue
            if p is not first and (p.backend.qualified_name, p.downgraded_from) == (
                first.backend.qualified_name,
                first.downgraded_from,
            ):
                continue  # the same fall-back as the prefill phase: said once
            _downgrade(c, p, policy)


def _downgrade(c: GroupChoice, p: PhaseChoice, policy: DowngradePolicy) -> None:
    """Warn about (or, under policy ``error``, refuse) phase ``p`` of ``c`` falling back."""
    by = p.rejections_by_backend()
    details = "; ".join(
        f"{b}: " + ", ".join(str(r) for r in by[b]) for b in p.downgraded_from if b in by
    )
    rank = (
        "the reference, ranked last"
        if p.backend.qualified_name == REFERENCE_BACKEND
        else f"priority {p.backend.priority_for(p.phase, c.group.spec)}"
    )
    phase = "" if p.phase is Phase.PREFILL else f" in the {p.phase.value} phase"
    message = (
        f"layer group {c.group.group_id!r} ({c.group.spec.short()}) falls back to "
        f"{p.backend.qualified_name}{phase} ({rank}); higher-ranked backends were rejected: "
        f"{details}"
    )
    if policy is DowngradePolicy.ERROR:
        raise SelectionError(message + " [downgrade policy: error]")
    warnings.warn(message, stacklevel=4)


def _no_backend_message(
    group: LayerGroup,
    rejections: Sequence[Rejection],
    constraints: ExecutionConstraints,
    page_size: int | None,
    layout: str | None,
    from_env: Mapping[str, str],
    phase: Phase = Phase.PREFILL,
) -> str:
    forced = _forced_name(group, constraints, phase)
    origin = _env_origin(_forced_key(group, constraints, phase), from_env)
    head = (
        f"forced backend {forced!r}{origin} cannot serve layer group {group.group_id!r}"
        if forced
        else f"no backend can serve layer group {group.group_id!r}"
    )
    if phase is not Phase.PREFILL:
        head += f" in the {phase.value} phase"
    settings = []
    if page_size is not None:
        settings.append(f"page_size={page_size}")
    if layout is not None:
        settings.append(f"kv_layout={layout}")
    settings.append(f"graph_mode={constraints.graph_mode.value}")
    lines = [
        f"{head} ({group.spec.short()}, layers {list(group.layer_indices)}) "
        f"under {', '.join(settings)}. Candidates:"
    ]
    by: dict[str, list[Rejection]] = {}
    for r in rejections:
        by.setdefault(r.backend, []).append(r)
    if not by:
        lines.append("  (no backend is registered: install a plugin, e.g. attn-plugin-flashinfer)")
    for backend, rs in sorted(by.items()):
        if forced and all(r.code == "not_forced" for r in rs):
            continue
        lines.append(f"  {backend}:")
        lines.extend(f"    - {r}" for r in rs)
    return "\n".join(lines)


def mapping_from_plan(plan: Plan) -> Mapping[str, str]:
    """``{group_id: backend qualified name}`` of a plan (the prefill / mixed backends)."""
    return {c.group.group_id: c.backend.qualified_name for c in plan.choices}


def phase_mapping_from_plan(plan: Plan) -> Mapping[str, Mapping[str, str]]:
    """``{group_id: {phase: backend qualified name}}`` of a plan, for every planned phase."""
    return {
        c.group.group_id: {p.value: c.backend_for_phase(p).qualified_name for p in c.planned_phases}
        for c in plan.choices
    }
