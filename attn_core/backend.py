"""What a plugin advertises: a backend, its capabilities, and how to reach it.

A plugin registers :class:`Backend` objects from its ``attn_core_register_backends`` hook::

    @hookimpl
    def attn_core_register_backends(register):
        register(Backend(
            name="mykernel",
            capabilities=BackendCapabilities(
                kinds={"full"}, device_types={"cuda"}, min_compute_capability=(9, 0),
                dtypes={"bfloat16"}, head_dims={128}, page_sizes={16, 64},
            ),
            priority=50,
        ))

Capabilities are plain sets; ``None`` means "any" where a field allows it (``head_dims``,
``page_sizes``). ``kinds``, ``device_types`` and ``dtypes`` have no default: a backend names
where it runs and what it computes in, so that no default narrows it silently. They are checked on
construction and a malformed or missing one quarantines the plugin that advertised it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from attn_core.options import OptionSpec
from attn_core.specs import (
    DTYPES,
    KV_DTYPES,
    GraphMode,
    LayerKind,
    LayerSpec,
    LinearVariant,
    Phase,
    _canonical_dtype,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "RANK_FEATURES",
    "Backend",
    "BackendCapabilities",
    "OptionSpec",
    "SelfCheck",
    "layer_has_feature",
]


class _Required:
    """The default of a field a backend must state (see :class:`BackendCapabilities`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<required>"


#: Default of ``device_types`` and ``dtypes``: leaving them out is an error, never a guess.
REQUIRED: Any = _Required()
#: What each required field means, and an example, for the error that names it.
_REQUIRED_FIELDS = {
    "device_types": ("the device types the backend runs on", "{'cuda'} or {'cpu', 'cuda'}"),
    "dtypes": ("the activation dtypes it computes in", "{'bfloat16', 'float16'} or {'float32'}"),
}


def _frozen(value: Iterable | None, name: str, convert=None) -> frozenset | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name}={value!r}: expected a set of values or None")
    items = [convert(v) if convert else v for v in value]
    return frozenset(items)


#: The layer features a backend may rank itself lower for (``feature_priority``), each a
#: :class:`LayerSpec` field: ``sinks`` (``has_sinks``), ``sliding_window``,
#: ``logits_soft_cap``, ``attention_chunk_size`` (set, not None).
RANK_FEATURES: tuple[str, ...] = (
    "attention_chunk_size",
    "logits_soft_cap",
    "sinks",
    "sliding_window",
)


def layer_has_feature(spec: LayerSpec, feature: str) -> bool:
    """Whether a layer of ``spec`` has ``feature`` (one of :data:`RANK_FEATURES`)."""
    if feature == "sinks":
        return bool(spec.has_sinks)
    return getattr(spec, feature) is not None


def _phase_priorities(given: Any, field_name: str) -> tuple[tuple[Phase, int], ...]:
    """``{phase: int}`` (or pairs) checked and kept as pairs sorted by phase."""
    pairs = given.items() if isinstance(given, Mapping) else given
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise ValueError(f"{field_name}={given!r}: expected a mapping {{phase: int}}")
    checked: dict[Phase, int] = {}
    for item in pairs:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"{field_name}={given!r}: expected a mapping {{phase: int}}")
        phase, prio = _enum(Phase, field_name)(item[0]), item[1]
        if not isinstance(prio, int) or isinstance(prio, bool):
            raise ValueError(f"{field_name}: {phase.value}: {prio!r} is not an int (a priority)")
        if phase in checked:
            raise ValueError(f"{field_name}: {phase.value} is given twice")
        checked[phase] = prio
    return tuple(sorted(checked.items(), key=lambda kv: kv[0].value))


def _enum(enum_cls, name):
    def convert(v):
        try:
            return enum_cls(v)
        except ValueError:
            allowed = [e.value for e in enum_cls]
            raise ValueError(f"{name}: {v!r} is not one of {allowed}") from None

    return convert


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """Everything the selector checks before it lets a backend serve a layer group."""

    kinds: frozenset[LayerKind]
    linear_variants: frozenset[LinearVariant] = frozenset()
    device_types: frozenset[str] = REQUIRED  # no default: {"cuda"}, {"cpu"}, {"cpu", "cuda"}
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = REQUIRED  # no default: e.g. {"bfloat16", "float16"}
    kv_dtypes: frozenset[str] = cast("frozenset[str]", None)  # None: the activation dtypes above
    state_dtypes: frozenset[str] = frozenset({"float32"})
    head_dims: frozenset[int] | None = None  # None: any
    page_sizes: frozenset[int] | None = None  # None: any
    kv_layouts: frozenset[str] = frozenset({"NHD"})
    graph_modes: frozenset[GraphMode] = frozenset({GraphMode.NONE})
    max_speculative_tokens: int = 0
    causal: bool = True
    non_causal: bool = False
    sliding_window: bool = False
    #: serves ``spec.attention_chunk_size`` (chunked local attention, Llama-4)
    chunked_attention: bool = False
    #: serves ``spec.attention_chunk_size`` as plain causal attention over the local virtual
    #: batches the runtime builds per step (:mod:`attn_core.local_attention`; needs the chunk
    #: size to be a multiple of the page size). ``chunked_attention`` (a native chunk mask)
    #: takes precedence where both are set.
    chunked_virtual_batches: bool = False
    logits_soft_cap: bool = False
    sinks: bool = False
    #: serves full / encoder layers whose values have another width than queries and keys
    #: (``spec.head_dim_v != spec.head_dim``, MiMo-V2-Flash); MLA and linear layers are exempt
    distinct_value_head_dim: bool = False
    deterministic: bool = False
    spec_verify_strategies: frozenset[str] = frozenset({"native"})
    #: False: an unquantised KV cache must be in the compute dtype (no fp16 queries over a
    #: bf16 cache); 8-bit KV dtypes in ``kv_dtypes`` are still served with any compute dtype.
    mixed_kv_dtypes: bool = True
    #: the phases (prefill / mixed, decode, speculative verify) the backend serves; a plan
    #: chooses a backend per group and phase among those that serve it
    phases: frozenset[Phase] = frozenset(Phase)
    #: ``{phase: priority}`` (kept as sorted pairs): the backend's rank in that phase when no
    #: tuning data decides; a phase left out ranks by ``Backend.priority``
    phase_priority: tuple[tuple[Phase, int], ...] = ()
    #: ``{feature: {phase: priority}}`` (kept as sorted pairs): the backend's rank in that phase
    #: for a layer with that feature (:data:`RANK_FEATURES`), where the backend serves it on a
    #: slower path than its usual one; the lowest entry among the layer's features replaces
    #: ``phase_priority`` / ``Backend.priority``
    feature_priority: tuple[tuple[str, tuple[tuple[Phase, int], ...]], ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        self._check_required()
        set_(self, "kinds", _frozen(self.kinds, "kinds", _enum(LayerKind, "kinds")))
        if not self.kinds:
            raise ValueError("kinds=set(): a backend must serve at least one layer kind")
        set_(
            self,
            "linear_variants",
            _frozen(
                self.linear_variants, "linear_variants", _enum(LinearVariant, "linear_variants")
            ),
        )
        if LayerKind.LINEAR in self.kinds and not self.linear_variants:
            raise ValueError("linear_variants=set(): a linear backend must name its variants")
        set_(self, "device_types", _frozen(self.device_types, "device_types"))
        if not self.device_types:
            raise ValueError(
                "device_types=set(): a backend must run on at least one device type ('cpu', 'cuda')"
            )
        for dt in self.device_types:
            if dt not in ("cuda", "cpu"):
                raise ValueError(f"device_types: {dt!r} is not one of ['cpu', 'cuda']")
        for name in ("min_compute_capability", "max_compute_capability"):
            cc = getattr(self, name)
            if cc is not None:
                if not (
                    isinstance(cc, (tuple, list))
                    and len(cc) == 2
                    and all(isinstance(x, int) for x in cc)
                ):
                    raise ValueError(f"{name}={cc!r}: expected (major, minor) integers or None")
                set_(self, name, tuple(cc))
        set_(
            self,
            "dtypes",
            _frozen(self.dtypes, "dtypes", lambda d: _canonical_dtype(d, DTYPES, "dtypes")),
        )
        if not self.dtypes:
            raise ValueError(
                f"dtypes=set(): a backend must compute in at least one dtype ({sorted(DTYPES)})"
            )
        kv = self.dtypes if self.kv_dtypes is None else self.kv_dtypes
        set_(
            self,
            "kv_dtypes",
            _frozen(kv, "kv_dtypes", lambda d: _canonical_dtype(d, KV_DTYPES, "kv_dtypes")),
        )
        set_(
            self,
            "state_dtypes",
            _frozen(
                self.state_dtypes,
                "state_dtypes",
                lambda d: _canonical_dtype(d, DTYPES, "state_dtypes"),
            ),
        )
        for name in ("head_dims", "page_sizes"):
            values = _frozen(getattr(self, name), name)
            if values is not None:
                for v in values:
                    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                        raise ValueError(f"{name}: {v!r} is not a positive integer")
            set_(self, name, values)
        set_(self, "kv_layouts", _frozen(self.kv_layouts, "kv_layouts"))
        for layout in self.kv_layouts:
            if layout not in ("NHD", "HND"):
                raise ValueError(f"kv_layouts: {layout!r} is not one of ['HND', 'NHD']")
        set_(
            self,
            "graph_modes",
            _frozen(self.graph_modes, "graph_modes", _enum(GraphMode, "graph_modes")),
        )
        if (
            not isinstance(self.max_speculative_tokens, int)
            or isinstance(self.max_speculative_tokens, bool)
            or self.max_speculative_tokens < 0
        ):
            raise ValueError(
                f"max_speculative_tokens={self.max_speculative_tokens!r}: expected an int >= 0"
            )
        set_(self, "spec_verify_strategies", _frozen(self.spec_verify_strategies, "strategies"))
        for s in self.spec_verify_strategies:
            if s not in ("native", "replay"):
                raise ValueError(f"spec_verify_strategies: {s!r} is not one of native, replay")
        set_(self, "phases", _frozen(self.phases, "phases", _enum(Phase, "phases")))
        if not self.phases:
            raise ValueError(
                "phases=set(): a backend must serve at least one phase (prefill, decode, verify)"
            )
        set_(self, "phase_priority", _phase_priorities(self.phase_priority, "phase_priority"))
        given = self.feature_priority
        items = given.items() if isinstance(given, Mapping) else given
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise ValueError(
                f"feature_priority={given!r}: expected a mapping {{feature: {{phase: int}}}}"
            )
        features: dict[str, tuple[tuple[Phase, int], ...]] = {}
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(
                    f"feature_priority={given!r}: expected a mapping {{feature: {{phase: int}}}}"
                )
            feature, by_phase = item
            if feature not in RANK_FEATURES:
                raise ValueError(
                    f"feature_priority: {feature!r} is not a feature; expected one of "
                    f"{', '.join(RANK_FEATURES)}"
                )
            if feature in features:
                raise ValueError(f"feature_priority: {feature} is given twice")
            features[feature] = _phase_priorities(by_phase, f"feature_priority[{feature!r}]")
        set_(self, "feature_priority", tuple(sorted(features.items())))
        for name in (
            "causal",
            "non_causal",
            "sliding_window",
            "chunked_attention",
            "chunked_virtual_batches",
            "logits_soft_cap",
            "sinks",
            "deterministic",
            "mixed_kv_dtypes",
            "distinct_value_head_dim",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")

    def _check_required(self) -> None:
        """``device_types`` and ``dtypes`` must be given, as sets: there is no default and no
        "any" (a default would narrow the backend without its author knowing)."""
        missing = [name for name in _REQUIRED_FIELDS if getattr(self, name) is REQUIRED]
        if len(missing) == 1:
            (name,) = missing
            meaning, example = _REQUIRED_FIELDS[name]
            raise ValueError(
                f"BackendCapabilities: {name} is required (there is no default): name {meaning}, "
                f"e.g. {name}={example}"
            )
        if missing:
            raise ValueError(
                "BackendCapabilities: device_types and dtypes are required (there is no "
                "default): name the device types the backend runs on and the dtypes it computes "
                "in, e.g. device_types={'cuda'}, dtypes={'bfloat16', 'float16'}"
            )
        for name, (meaning, example) in _REQUIRED_FIELDS.items():
            if getattr(self, name) is None:
                raise ValueError(
                    f'BackendCapabilities: {name}=None: this field has no "any"; name them '
                    f"({meaning}), e.g. {name}={example}"
                )

    def short(self) -> str:
        kinds = ",".join(sorted(k.value for k in self.kinds))
        if self.linear_variants:
            kinds += "(" + ",".join(sorted(v.value for v in self.linear_variants)) + ")"
        return kinds

    if TYPE_CHECKING:
        # What the constructor accepts (any iterable for a set, enums by value, dtypes by
        # alias or torch dtype); the fields above are what __post_init__ leaves.
        # tests/test_typed_constructors.py checks that it matches the fields.
        def __init__(
            self,
            kinds: Iterable[LayerKind | str],
            *,  # by name (the dataclass also takes them by position)
            linear_variants: Iterable[LinearVariant | str] = frozenset(),
            device_types: Iterable[str],  # required (REQUIRED at run time)
            min_compute_capability: tuple[int, int] | list[int] | None = None,
            max_compute_capability: tuple[int, int] | list[int] | None = None,
            dtypes: Iterable[str | torch.dtype],  # required (REQUIRED at run time)
            kv_dtypes: Iterable[str | torch.dtype] | None = None,
            state_dtypes: Iterable[str | torch.dtype] = frozenset({"float32"}),
            head_dims: Iterable[int] | None = None,
            page_sizes: Iterable[int] | None = None,
            kv_layouts: Iterable[str] = frozenset({"NHD"}),
            graph_modes: Iterable[GraphMode | str] = frozenset({GraphMode.NONE}),
            max_speculative_tokens: int = 0,
            causal: bool = True,
            non_causal: bool = False,
            sliding_window: bool = False,
            chunked_attention: bool = False,
            chunked_virtual_batches: bool = False,
            logits_soft_cap: bool = False,
            sinks: bool = False,
            distinct_value_head_dim: bool = False,
            deterministic: bool = False,
            spec_verify_strategies: Iterable[str] = frozenset({"native"}),
            mixed_kv_dtypes: bool = True,
            phases: Iterable[Phase | str] = frozenset(Phase),
            phase_priority: Mapping[Phase, int]
            | Mapping[str, int]
            | Iterable[tuple[Phase | str, int]] = (),
            feature_priority: Mapping[str, Mapping[Phase, int] | Mapping[str, int]]
            | Iterable[tuple[str, Iterable[tuple[Phase | str, int]]]] = (),
        ) -> None: ...


@dataclass(frozen=True, slots=True)
class Backend:
    """One backend a plugin offers: its name, what it can serve, and its rank among peers.

    ``plugin`` is filled in by the registry (the plugin's entry-point name) and namespaces the
    backend: ``qualified_name`` is ``"<plugin>:<name>"`` so that two vendors never collide.
    """

    name: str
    capabilities: BackendCapabilities
    priority: int = 0  # higher wins when no tuning data decides
    description: str = ""
    version: str = ""
    available: bool = True
    unavailable_reason: str | None = None
    #: One line ``attn list`` prints after the status: which of the backend's version-gated fast
    #: paths are on here, and why one is off (e.g. "fast plan: off (flashinfer 0.7.4 not in the
    #: tested range 0.6.7-0.6.13; public plan() used)"). Informational: selection ignores it.
    notes: str = ""
    plugin: str = ""
    options: tuple[tuple[str, object], ...] = field(default=())  # backend-private, hashable
    #: ``{key: OptionSpec}`` (kept as sorted pairs): the options a run may set for this backend;
    #: the selector checks them and fills ``options`` of the chosen backend (attn_core.options)
    option_schema: tuple[tuple[str, OptionSpec], ...] = field(default=())

    if TYPE_CHECKING:
        # What the constructor accepts (option_schema as a mapping too); the fields above are
        # what __post_init__ leaves.
        def __init__(
            self,
            name: str,
            capabilities: BackendCapabilities,
            priority: int = 0,
            description: str = "",
            version: str = "",
            available: bool = True,
            unavailable_reason: str | None = None,
            notes: str = "",
            plugin: str = "",
            options: tuple[tuple[str, object], ...] = (),
            option_schema: Mapping[str, OptionSpec] | tuple[tuple[str, OptionSpec], ...] = (),
        ) -> None: ...

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(
                f"Backend name={self.name!r}: expected a non-empty string without ':' "
                "(the registry adds the plugin namespace)"
            )
        if not isinstance(self.capabilities, BackendCapabilities):
            raise TypeError(
                f"Backend {self.name!r}: capabilities must be a BackendCapabilities, "
                f"got {type(self.capabilities).__name__}"
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"Backend {self.name!r}: priority={self.priority!r}: expected an int")
        schema = self.option_schema
        pairs = schema.items() if isinstance(schema, Mapping) else schema
        checked = []
        for key, spec in pairs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(
                    f"Backend {self.name!r}: option name {key!r}: expected an identifier"
                )
            if not isinstance(spec, OptionSpec):
                raise TypeError(
                    f"Backend {self.name!r}: option {key!r}: expected an OptionSpec, "
                    f"got {type(spec).__name__}"
                )
            checked.append((key, spec))
        object.__setattr__(self, "option_schema", tuple(sorted(checked, key=lambda kv: kv[0])))
        if not isinstance(self.available, bool):  # "False" is truthy: it would be selected
            raise ValueError(
                f"Backend {self.name!r}: available={self.available!r}: expected True or False"
            )
        if not self.available and not self.unavailable_reason:
            raise ValueError(
                f"Backend {self.name!r}: available=False needs an unavailable_reason that says why"
            )

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin}:{self.name}" if self.plugin else self.name

    def with_plugin(self, plugin: str) -> Backend:
        return replace(self, plugin=plugin)

    def option(self, key: str, default: object = None) -> object:
        return dict(self.options).get(key, default)

    def priority_for(self, phase: Phase | str, spec: LayerSpec | None = None) -> int:
        """The backend's priority in ``phase`` (for a layer of ``spec``): the lowest
        ``capabilities.feature_priority`` entry of that phase among the layer's features, else
        its ``capabilities.phase_priority`` entry, else ``priority``."""
        ph = Phase(phase)
        if spec is not None:
            lowered = [
                dict(by_phase)[ph]
                for feature, by_phase in self.capabilities.feature_priority
                if ph in dict(by_phase) and layer_has_feature(spec, feature)
            ]
            if lowered:
                return min(lowered)
        return dict(self.capabilities.phase_priority).get(ph, self.priority)

    def serves_phase(self, phase: Phase | str) -> bool:
        return Phase(phase) in self.capabilities.phases

    def with_options(self, options: Mapping[str, object]) -> Backend:
        """A copy carrying ``options`` (what the selector hands the chosen backend)."""
        return replace(self, options=tuple(sorted(options.items())))


@dataclass(frozen=True, slots=True)
class SelfCheck:
    """What a backend's fast-path self-checks found when asked to run them now
    (``attn_core_self_check``, ``attn list --self-check``).

    :ivar notes: the backend's :attr:`Backend.notes` line after the checks ran (verdicts in
        place of "self-check at first GPU use").
    :ivar failed: one line per fast path whose check failed and is now off (the backend serves
        through its public path); empty when every check passed.
    """

    notes: str
    failed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.notes, str):
            raise TypeError(f"SelfCheck.notes: expected a str, got {type(self.notes).__name__}")
        failed = self.failed
        if isinstance(failed, str) or not all(isinstance(f, str) and f for f in failed):
            raise TypeError(f"SelfCheck.failed: expected a tuple of non-empty str, got {failed!r}")
        object.__setattr__(self, "failed", tuple(failed))
