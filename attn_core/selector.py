"""Pick one backend per layer group for a whole model, and explain every rejection.

Selection is deterministic. For each group the admissible backends are ranked by measured tuning
data when the tuning file has a time for that backend on that group's spec (faster first); the
rest by the default rule: every other backend before the reference (``attn_core:reference``),
whatever their priorities and names, then by declared priority (higher first), then by qualified
name. Settings that must be shared by every group - page size, KV layout and CUDA-graph mode -
are chosen for the whole model: the selector tries each candidate page size / layout and keeps
the first one under which every group has a backend, preferring the model's own page size; when
some group has no backend under the run's graph mode, the downgrade policy may lower it (full ->
decode -> none).

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

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
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
)

__all__ = [
    "GroupChoice",
    "Plan",
    "Rejection",
    "TuningData",
    "check_backend",
    "is_this_machine",
    "parse_forced",
    "select",
    "spec_key",
]

ENV_FORCE = "ATTN_CORE_BACKENDS"  # e.g. "full=flashinfer,linear=triton_ssm"
ENV_TUNING = "ATTN_CORE_TUNING"  # path of a tuning file written by `attn bench`


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one backend cannot serve one group."""

    backend: str
    code: str  # e.g. "head_dim", "page_size", "unavailable"
    reason: str
    fix: str | None = None  # the smallest change of a run-time knob that would admit it

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


def check_backend(
    backend: Backend,
    spec: LayerSpec,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    *,
    page_size: int | None = None,
    kv_layout: str | None = None,
    local: bool = True,
) -> list[Rejection]:
    """Every reason ``backend`` cannot serve layers of ``spec`` under these conditions.

    An empty list means admissible. ``page_size`` / ``kv_layout`` are the model-wide settings
    being tried (None: not constrained yet). ``local=False`` judges for another machine (an
    offline plan): that this machine cannot load the backend is then no reason.
    """
    caps = backend.capabilities
    name = backend.qualified_name
    out: list[Rejection] = []

    def reject(code: str, reason: str, fix: str | None = None) -> None:
        out.append(Rejection(name, code, reason, fix))

    def model_mismatch(code: str, what: str, serves: str) -> None:
        """The model is what it is: say what the backend serves, propose no change."""
        reject(code, f"cannot serve this model: {what} ({serves})")

    if spec.kind not in caps.kinds:
        model_mismatch(
            "kind", f"kind {spec.kind.value}", f"serves {_fmt_set(k.value for k in caps.kinds)}"
        )
        return out  # nothing else is meaningful
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
    if constraints.graph_mode not in caps.graph_modes:
        modes = caps.graph_modes
        best = max(modes, key=lambda m: list(GraphMode).index(m))
        reject(
            "graph_mode",
            f"supports CUDA-graph modes {_fmt_set(m.value for m in modes)}, the run asks for "
            f"{constraints.graph_mode.value}",
            f"graph_mode {constraints.graph_mode.value} -> {best.value}",
        )
    if constraints.speculative_tokens > caps.max_speculative_tokens:
        reject(
            "speculative",
            f"verifies at most {caps.max_speculative_tokens} draft tokens per request, the run "
            f"asks for {constraints.speculative_tokens}",
            f"speculative_tokens {constraints.speculative_tokens} -> {caps.max_speculative_tokens}",
        )
    if (
        spec.kind is LayerKind.LINEAR
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


@dataclass(slots=True)
class TuningData:
    """Measured step times (microseconds) per (backend, layer spec); written by ``attn bench``."""

    times_us: dict[tuple[str, str], float] = field(default_factory=dict)
    device: str = ""

    def record(self, backend: str, spec: LayerSpec, us: float) -> None:
        self.times_us[(backend, spec_key(spec))] = float(us)

    def time(self, backend: str, spec: LayerSpec) -> float | None:
        return self.times_us.get((backend, spec_key(spec)))

    def save(self, path: str | os.PathLike) -> None:
        entries = [
            {"backend": b, "spec": json.loads(s), "us": t}
            for (b, s), t in sorted(self.times_us.items())
        ]
        payload = {"format": 1, "device": self.device, "entries": entries}
        Path(path).write_text(json.dumps(payload, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> TuningData:
        payload = json.loads(Path(path).read_text())
        if payload.get("format") != 1:
            raise ValueError(f"tuning file {path}: format {payload.get('format')!r}, expected 1")
        data = cls(device=payload.get("device", ""))
        for e in payload["entries"]:
            data.times_us[(e["backend"], json.dumps(e["spec"], sort_keys=True))] = float(e["us"])
        return data


# ------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GroupChoice:
    """The backend chosen for one group and why every other candidate was not."""

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

    @property
    def options(self) -> dict[str, object]:
        """The chosen backend's options in force (declared defaults filled in)."""
        return dict(self.backend.options)

    @property
    def loadable_here(self) -> bool:
        """Whether this machine can load the chosen backend (False only in offline plans)."""
        return self.backend.available

    def rejections_by_backend(self) -> dict[str, list[Rejection]]:
        by: dict[str, list[Rejection]] = {}
        for r in self.rejected:
            by.setdefault(r.backend, []).append(r)
        return by


@dataclass(frozen=True, slots=True)
class Plan:
    """One backend per layer group, plus the model-wide settings they agreed on."""

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

    def backend_for(self, group_id: str) -> Backend:
        return self.choice(group_id).backend

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
            "groups": [
                {
                    "group_id": c.group.group_id,
                    "spec": c.group.spec.short(),
                    "layers": list(c.group.layer_indices),
                    "backend": c.backend.qualified_name,
                    "loadable_here": c.loadable_here,
                    "not_loadable_here": [
                        {"backend": b, "reason": why} for b, why in c.not_loadable_here
                    ],
                    "forced": c.forced,
                    "downgraded_from": list(c.downgraded_from),
                    "tuned_us": c.tuned_us,
                    "options": {
                        k: {"value": v, "source": dict(c.option_sources).get(k, "default")}
                        for k, v in c.backend.options
                    },
                    "outranked": list(c.outranked),
                    "rejected": [
                        {"backend": r.backend, "code": r.code, "reason": r.reason, "fix": r.fix}
                        for r in c.rejected
                    ],
                }
                for c in self.choices
            ],
        }


def _default_rank(backend: Backend) -> tuple[int, int]:
    """The default rule without measurements: the reference last, then priority (higher first)."""
    return (1 if backend.qualified_name == REFERENCE_BACKEND else 0, -backend.priority)


def _rank_key(backend: Backend, spec: LayerSpec, tuning: TuningData | None):
    t = tuning.time(backend.qualified_name, spec) if tuning is not None else None
    # Measured candidates first (fastest first), then the default rule, then name.
    return (0 if t is not None else 1, t or 0.0, *_default_rank(backend), backend.qualified_name)


def _forced_key(group: LayerGroup, constraints: ExecutionConstraints) -> str | None:
    """The ``force`` key that applies to ``group``: its group id, else its layer kind."""
    forced = constraints.forced
    for key in (group.group_id, group.spec.kind.value):
        if forced.get(key):
            return key
    return None


def _forced_name(group: LayerGroup, constraints: ExecutionConstraints) -> str | None:
    key = _forced_key(group, constraints)
    return constraints.forced[key] if key is not None else None


def parse_forced(text: str, *, source: str) -> dict[str, str]:
    """``"full=flashinfer,linear=triton_ssm"`` -> ``{"full": "flashinfer", "linear": ...}``.

    :param text: comma-separated ``KIND_OR_GROUP=BACKEND`` entries; empty entries (a trailing
        comma) are ignored.
    :param source: where ``text`` came from (``"ATTN_CORE_BACKENDS"``, ``"--backends"``); every
        error starts with ``source=text``, so the user knows which setting to fix.
    :returns: one backend name per layer kind or group id.
    :raises SelectionError: an entry without ``=``, with nothing before or after it, or a key
        given twice (the message names both values).
    """
    forced: dict[str, str] = {}
    hint = "expected KIND_OR_GROUP=BACKEND entries, e.g. 'full=flashinfer,linear=triton_ssm'"
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
    backends = registry.backends
    valid_keys = {k.value for k in LayerKind} | {g.group_id for g in groups}
    expected = f"expected one of {sorted(valid_keys)}"
    env_unknown = [k for k in from_env if k not in valid_keys]
    if env_unknown:
        bad = env_unknown[0]
        raise SelectionError(
            f"{ENV_FORCE}={os.environ[ENV_FORCE]!r}: entry '{bad}={from_env[bad]}' names no layer "
            f"kind and no group of this model; {expected}"
        )
    unknown = sorted(set(constraints.forced) - valid_keys)
    if unknown:
        raise SelectionError(
            f"forced backend keys {unknown} name no layer kind and no group of this model; "
            f"{expected}"
        )
    for group in groups:
        key = _forced_key(group, constraints)
        if key is None:
            continue
        name = constraints.forced[key]
        try:
            registry.resolve(name)  # unknown / ambiguous names fail here, with the known ones
        except SelectionError as exc:
            if key not in from_env:
                raise
            raise SelectionError(
                f"{ENV_FORCE}={os.environ[ENV_FORCE]!r}: entry '{key}={name}': {exc}"
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

    def attempt(
        cons: ExecutionConstraints,
    ) -> Plan | tuple[LayerGroup, list[Rejection], int | None, str | None]:
        """The first plan under ``cons`` over the page sizes and layouts, else its first failure."""
        first_failure: tuple[LayerGroup, list[Rejection], int | None, str | None] | None = None
        for page_size in page_options:
            for layout in layout_options:
                choices: list[GroupChoice] = []
                failed = None
                for group in groups:
                    result = _choose(
                        group, backends, registry, device, cons, page_size, layout, tuning, local
                    )
                    if isinstance(result, GroupChoice):
                        choices.append(result)
                    else:
                        failed = (group, result, page_size, layout)
                        break
                if failed is None:
                    choices = [_with_options(c, options) for c in choices]
                    return Plan(device, cons, tuple(choices), page_size, layout, local)
                if first_failure is None:
                    first_failure = failed
        assert first_failure is not None
        return first_failure

    result = attempt(constraints)
    if isinstance(result, Plan):
        _apply_downgrade_policy(result)
        return result
    group, rejections, page_size, layout = result
    message = _no_backend_message(
        group, rejections, constraints, page_size, layout, from_env
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
            warnings.warn(
                f"graph mode lowered {requested.value} -> {mode.value}: {message}", stacklevel=2
            )
        _apply_downgrade_policy(lowered)
        return lowered
    raise SelectionError(message)


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
) -> GroupChoice | list[Rejection]:
    spec = group.spec
    forced = _forced_name(group, constraints)
    admissible: list[Backend] = []
    rejected: list[Rejection] = []
    for b in backends:
        reasons = check_backend(
            b, spec, device, constraints, page_size=page_size, kv_layout=layout, local=local
        )
        if forced is not None and not registry.matches(forced, b) and not reasons:
            reasons = [Rejection(b.qualified_name, "not_forced", f"the run forces {forced}")]
        if reasons:
            rejected.extend(reasons)
        else:
            admissible.append(b)
    if not admissible:
        return rejected
    admissible.sort(key=lambda b: _rank_key(b, spec, tuning))
    chosen = admissible[0]
    serving_kind = {r.backend for r in rejected if r.code not in ("kind", "not_forced")}
    downgraded_from = tuple(
        sorted(
            b.qualified_name
            for b in backends
            if b.qualified_name in serving_kind
            and _default_rank(b) < _default_rank(chosen)  # ranks above it by the default rule
            and not any(
                r.backend == b.qualified_name and r.code in ("denied", "not_allowed")
                for r in rejected
            )
        )
    )
    return GroupChoice(
        group=group,
        backend=chosen,
        rejected=tuple(rejected),
        outranked=tuple(b.qualified_name for b in admissible[1:]),
        forced=forced is not None,
        downgraded_from=downgraded_from,
        tuned_us=tuning.time(chosen.qualified_name, spec) if tuning else None,
        not_loadable_here=()
        if local
        else tuple(
            sorted(
                (b.qualified_name, b.unavailable_reason or "unavailable")
                for b in backends
                if not b.available and spec.kind in b.capabilities.kinds
            )
        ),
    )


def _with_options(
    choice: GroupChoice, options: Mapping[str, tuple[dict[str, object], dict[str, str]]]
) -> GroupChoice:
    """``choice`` whose backend carries its options in force (none declared: unchanged)."""
    resolved = options.get(choice.backend.qualified_name)
    if resolved is None:
        return choice
    values, sources = resolved
    return replace(
        choice,
        backend=choice.backend.with_options(values),
        option_sources=tuple(sorted(sources.items())),
    )


def _apply_downgrade_policy(plan: Plan) -> None:
    policy = plan.constraints.downgrade
    if policy is DowngradePolicy.ALLOW:
        return
    for c in plan.choices:
        if not c.downgraded_from or c.forced:
            continue
        by = c.rejections_by_backend()
        details = "; ".join(
            f"{b}: " + ", ".join(str(r) for r in by[b]) for b in c.downgraded_from if b in by
        )
        rank = (
            "the reference, ranked last"
            if c.backend.qualified_name == REFERENCE_BACKEND
            else f"priority {c.backend.priority}"
        )
        message = (
            f"layer group {c.group.group_id!r} ({c.group.spec.short()}) falls back to "
            f"{c.backend.qualified_name} ({rank}); higher-ranked backends were rejected: {details}"
        )
        if policy is DowngradePolicy.ERROR:
            raise SelectionError(message + " [downgrade policy: error]")
        warnings.warn(message, stacklevel=3)


def _no_backend_message(
    group: LayerGroup,
    rejections: Sequence[Rejection],
    constraints: ExecutionConstraints,
    page_size: int | None,
    layout: str | None,
    from_env: Mapping[str, str],
) -> str:
    forced = _forced_name(group, constraints)
    origin = _env_origin(_forced_key(group, constraints), from_env)
    head = (
        f"forced backend {forced!r}{origin} cannot serve layer group {group.group_id!r}"
        if forced
        else f"no backend can serve layer group {group.group_id!r}"
    )
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
    """``{group_id: backend qualified name}`` of a plan."""
    return {c.group.group_id: c.backend.qualified_name for c in plan.choices}
