"""Per-layer :class:`LayerSpec` s from a Hugging Face ``config.json``.

``specs_from_hf_config`` reads the fields a model's ``config.json`` carries (the names the
``transformers`` configuration classes use, checked against transformers 5.24) and returns a
:class:`ModelLayout`: one spec per attention-carrying layer, grouped into layer groups with
:func:`attn_core.specs.group_layers` semantics, with heads already divided for one tensor-parallel
rank.

Tensor parallelism follows vLLM: query heads (and Gated DeltaNet value heads, Mamba2 heads,
Mamba1 inner channels) are split evenly across ranks; KV heads (and GDN key heads, Mamba2 groups)
are split when there are at least ``tp_size`` of them and replicated, one per rank, when there are
fewer (``tp_size`` must then be a multiple of their count). Anything else raises ``ValueError``
naming the config field.

A ``model_type`` no family names is read by the generic dense mapping (GQA on every layer, full
or sliding, or MLA under DeepSeek's field names) when every field of its config is one that
mapping understands, under the common names or those its transformers config class maps to them
(``attribute_map``: GPT-2's ``n_layer``); any other field is refused with its layers, since it
may change the attention math. A few attention-side fields are read only for the model types
known to apply them (``query_pre_attn_scalar``, ``attn_logit_softcapping``, learned sinks, GPT-2's
scale fields); features no layer kind describes (ALiBi, cross-attention, bidirectional or
differential attention, linear mixers) are refused by name.

Where the config has ``layer_types``, every parser's result is checked against it layer by layer,
and a feature no layer kind describes (an unknown ``layer_types`` value) or the family's
mapping does not read (``attention_chunk_size`` outside Llama-4) is refused with the layers
that have it: there is never a partial mapping. Llama-4's chunked layers map to
``LayerSpec.attention_chunk_size``.

Layers that carry no attention (Nemotron-H's MLP / MoE layers) are absent from the layout; their
indices are simply missing from ``layer_indices``. A parallel hybrid's layers (Falcon-H1:
attention and Mamba2 side by side in every decoder layer) hold two ops each, one in an attention
group and one in a linear group: their index is listed once per op.

Multi-stack models (Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3.5 with their MoE forms, Gemma-3
and Llama-4 multimodal, LLaVA: a vision tower and a language model; Whisper: an encoder and a
decoder)
yield every stack's groups, ids prefixed by the stack (``vision.encoder``, ``text.full``), one
layout per stack in ``ModelLayout.stacks``; ``stack=`` keeps one. A stack no layer kind
describes (Whisper's decoder: cross-attention in every layer) is refused unless another stack
is asked for, never dropped silently.

Linear layers with one state only: MiniMax-Text-01 / MiniMax-M1's lightning attention (no conv;
its per-layer slopes are the model's input) and LFM2's gated short conv (``layer_types`` value
``conv``; conv state only, its ``hidden_size`` channels split under tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypedDict

from attn_core.specs import (
    LayerGroup,
    LayerKind,
    LayerSpec,
    LinearVariant,
    group_layers,
    layer_ops,
)

__all__ = [
    "MODEL_TYPE_FAMILIES",
    "MULTI_STACK_MODEL_TYPES",
    "SAMPLE_STACKS",
    "SUPPORTED_MODEL_TYPES",
    "ModelLayout",
    "load_sample",
    "sample_names",
    "specs_from_hf_config",
    "stack_families",
]

_MISSING: Any = object()


# ------------------------------------------------------------------------------------------
# The result
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelLayout:
    """The attention layers of one model on one tensor-parallel rank.

    ``layer_specs[i]`` describes an op of model layer ``layer_indices[i]``; layers without
    attention are absent. A layer of a parallel hybrid (Falcon-H1: attention and Mamba2 side
    by side in one decoder layer) appears twice in a row, once per op: an attention op and a
    linear op (:func:`attn_core.specs.layer_ops` has the rule). ``groups`` partition the ops
    (ids ``full``, ``full.1``, ``linear``, ...); such a layer is in two groups.
    """

    model_type: str  # the config's model_type, e.g. "qwen3_next"
    # the config's architectures[0] (e.g. "Qwen3NextForCausalLM"); when it has none, the
    # transformers class for model_type. For qwen2_5_vl it names the whole model, not the tower.
    architecture: str
    num_layers: int  # all layers of the stack, attention-free ones included
    layer_specs: tuple[LayerSpec, ...]
    layer_indices: tuple[int, ...]
    groups: tuple[LayerGroup, ...]
    tp_size: int = 1
    family: str = ""  # the supported family that parsed it, e.g. "qwen3-next"
    # Qwen2.5-VL vision tower: blocks using full (not windowed) attention. Both are encoder
    # varlen attention with different cu_seqlens, so they share one spec and one group.
    encoder_full_attention_layers: tuple[int, ...] = ()
    # A model of several stacks (a vision tower and a language model, Whisper's encoder and
    # decoder): the stack this layout is ("vision", "text", "encoder"), its group ids prefixed
    # "<stack>."; "" for a model of one stack (ids unprefixed).
    stack: str = ""
    # The layout of a whole multi-stack model: one layout per stack, in the model's order. Its
    # groups are all of theirs; it has no layers of its own (layer_specs, layer_indices empty),
    # since every stack numbers its layers from 0: address them through stack_layout(name).
    stacks: tuple[ModelLayout, ...] = ()
    _by_layer: dict[int, tuple[LayerGroup, ...]] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        for name in (
            "layer_specs",
            "layer_indices",
            "groups",
            "encoder_full_attention_layers",
            "stacks",
        ):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # lists would not hash
        if self.stacks:
            self._check_stacks()
            return
        if len(self.layer_specs) != len(self.layer_indices):
            raise ValueError(
                f"layer_specs has {len(self.layer_specs)} entries but layer_indices has "
                f"{len(self.layer_indices)}; expected one spec per op of each layer"
            )
        if list(self.layer_indices) != sorted(self.layer_indices) or any(
            not 0 <= i < self.num_layers for i in self.layer_indices
        ):
            raise ValueError(
                f"layer_indices={self.layer_indices} must be non-decreasing (a layer twice in "
                f"a row: its parallel ops) and in [0, num_layers={self.num_layers})"
            )
        by_layer = layer_ops(self.groups)  # raises: two ops of one role in one layer
        ops = list(zip(self.layer_indices, self.layer_specs, strict=True))
        grouped = [(i, g.spec) for i, gs in by_layer.items() for g in gs]
        if sorted(ops, key=_op_key) != sorted(grouped, key=_op_key):
            missing = sorted({i for i, s in ops if (i, s) not in grouped})
            extra = sorted({i for i, s in grouped if (i, s) not in ops})
            raise ValueError(
                f"the groups do not partition the ops: layers {missing} have an op in no "
                f"group, layers {extra} are in a group whose spec is not one of theirs; "
                "every op of every layer needs exactly one group"
            )
        self._by_layer.update(by_layer)

    @property
    def parallel_layers(self) -> tuple[int, ...]:
        """Layers that hold an attention op and a linear op side by side (parallel hybrid)."""
        return tuple(i for i, gs in self._by_layer.items() if len(gs) > 1)

    def _check_stacks(self) -> None:
        names = [s.stack for s in self.stacks]
        if "" in names or len(set(names)) != len(names) or any(s.stacks for s in self.stacks):
            raise ValueError(
                f"stacks {names}: expected uniquely named single-stack layouts (stack set)"
            )
        if self.layer_specs or self.layer_indices:
            raise ValueError(
                "a multi-stack layout has no layers of its own (each stack numbers its layers "
                "from 0); expected empty layer_specs and layer_indices"
            )
        want = tuple(g for s in self.stacks for g in s.groups)
        if self.groups != want:
            raise ValueError(
                f"groups {[g.group_id for g in self.groups]}: expected the stacks' groups "
                f"{[g.group_id for g in want]}, in order"
            )

    @property
    def stack_names(self) -> tuple[str, ...]:
        """The stacks' names (``("vision", "text")``); ``(stack,)`` for a single-stack layout."""
        return tuple(s.stack for s in self.stacks) if self.stacks else (self.stack,)

    def stack_layout(self, name: str) -> ModelLayout:
        """The layout of stack ``name`` (``"vision"``, ``"text"``, ``"encoder"``); a
        single-stack layout returns itself for its own name."""
        for s in self.stacks or (self,):
            if s.stack == name:
                return s
        raise ValueError(
            f"{self.model_type}: stack {name!r} is unknown; its stacks: {list(self.stack_names)}"
        )

    def groups_of(self, layer_index: int) -> tuple[LayerGroup, ...]:
        """Every group holding an op of model layer ``layer_index`` (two for a parallel
        layer); ValueError for attention-free layers and for a multi-stack layout (whose
        stacks each have a layer ``layer_index``)."""
        if self.stacks:
            raise ValueError(
                f"{self.model_type} has stacks {list(self.stack_names)}, each numbering its "
                f"layers from 0: layer {layer_index} is ambiguous; use "
                f"stack_layout(name).group_of({layer_index})"
            )
        try:
            return self._by_layer[layer_index]
        except KeyError:
            raise ValueError(
                f"layer {layer_index} carries no attention in this {self.model_type} layout; "
                f"attention layers are {_ranges(sorted(self._by_layer))} of {self.num_layers}"
            ) from None

    def group_of(self, layer_index: int, kind: LayerKind | None = None) -> LayerGroup:
        """The group serving model layer ``layer_index``; ValueError for attention-free layers.

        :param kind: the op's kind, needed for a layer with parallel ops (which one to pick);
            a layer without an op of that kind raises.
        """
        groups = self.groups_of(layer_index)
        if kind is not None:
            picked = [g for g in groups if g.spec.kind is kind]
            if not picked:
                have = ", ".join(f"{g.group_id!r} ({g.spec.kind.value})" for g in groups)
                raise ValueError(f"layer {layer_index} has no {kind.value} op; it is in {have}")
            return picked[0]
        if len(groups) > 1:
            raise ValueError(
                f"layer {layer_index} holds parallel ops in groups "
                f"{' and '.join(repr(g.group_id) for g in groups)}; pass kind= "
                f"({' or '.join(g.spec.kind.value for g in groups)}) to pick one"
            )
        return groups[0]

    def spec_of(self, layer_index: int, kind: LayerKind | None = None) -> LayerSpec:
        """The spec of model layer ``layer_index`` (see :meth:`group_of`)."""
        return self.group_of(layer_index, kind).spec

    def short(self) -> str:
        """Multi-line human summary: one line per group (and one for parallel layers)."""
        head = (
            f"{self.architecture} ({self.model_type}), {self.num_layers} layers, tp={self.tp_size}"
        )
        if self.stacks:
            head = (
                f"{self.architecture} ({self.model_type}), stacks "
                f"{', '.join(f'{s.stack} ({s.num_layers} layers)' for s in self.stacks)}, "
                f"tp={self.tp_size}"
            )
        elif self.stack:
            head += f", stack {self.stack}"
        width = max([10, *(len(g.group_id) for g in self.groups)])
        lines = [head]
        for g in self.groups:
            lines.append(
                f"  {g.group_id:<{width}} {len(g.layer_indices):>3} layers  {g.spec.short()}"
            )
        if self.parallel_layers:
            lines.append(
                f"  {'parallel':<{width}} layers {_ranges(self.parallel_layers)}: attention and "
                "linear ops side by side in each"
            )
        return "\n".join(lines)


def _op_key(op: tuple[int, LayerSpec]) -> tuple[int, str]:
    return op[0], op[1].kind.value


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: keeps error messages about 48-layer models short."""
    parts: list[str] = []
    start: int | None = None
    prev: int | None = None
    for i in [*indices, None]:
        if start is not None and prev is not None and (i is None or i != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ",".join(parts) or "none"


# ------------------------------------------------------------------------------------------
# Reading fields
# ------------------------------------------------------------------------------------------
class _FieldValueError(ValueError):
    """A field the mapping reads holds a value it cannot take (present, but wrong): the
    config's error, reported as it is; a model type the generic dense mapping reads is not
    then called unsupported."""


class _Reader:
    """Field access on one config dict, with errors that name the field and the model type."""

    def __init__(
        self, cfg: Mapping[str, Any], where: str, defaults: Mapping[str, Any] | None = None
    ) -> None:
        self.cfg = cfg
        self.where = where
        self.defaults = defaults or {}

    def get(self, name: str, default: Any = _MISSING) -> Any:
        value = self.cfg.get(name, _MISSING)
        if value is _MISSING:
            value = self.defaults.get(name, default)
        if value is _MISSING:
            raise ValueError(f"{self.where}: config field {name!r} is missing; it is required")
        return value

    def pos_int(self, name: str, default: Any = _MISSING) -> int:
        value = self.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _FieldValueError(
                f"{self.where}: config field {name}={value!r}: expected a positive int"
            )
        return value


def _int_list(r: _Reader, name: str, what: str) -> list[int]:
    """Field ``name`` as a list of ints (``what`` they are, for the error); ``[]`` when absent
    or null. Any other value is refused here: iterating a string or an int would map a wrong
    plan or fail without naming the field."""
    value = r.cfg.get(name)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        got = type(value).__name__
    else:
        bad = [i for i in value if not isinstance(i, int) or isinstance(i, bool)]
        got = f"entries {bad!r}" if bad else ""
    if got:
        raise ValueError(
            f"{r.where}: config field {name}={value!r}: expected a list of ints ({what}), got {got}"
        )
    return list(value)


def _mapping(r: _Reader, name: str) -> Mapping[str, Any]:
    """Field ``name`` as a mapping (``{}`` when absent or null); any other value is refused
    naming the field."""
    value = r.cfg.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{r.where}: config field {name}={value!r}: expected a mapping (a JSON object), "
            f"got {type(value).__name__}"
        )
    return value


class _HeadSplitError(ValueError):
    """Heads that do not divide over the tensor-parallel ranks; :func:`_specs` names the
    family and model type in front of the field and the sizes."""


def _split(total: int, tp_size: int, name: str) -> int:
    """Heads per rank for heads that must split evenly (query heads, GDN value heads)."""
    if total % tp_size:
        raise _HeadSplitError(
            f"{name}={total} is not divisible by tp_size={tp_size}; "
            f"choose a tp_size that divides it"
        )
    return total // tp_size


def _split_or_replicate(total: int, tp_size: int, name: str) -> int:
    """KV heads per rank: split when there are enough, else replicated one per rank (vLLM)."""
    if total >= tp_size:
        return _split(total, tp_size, name)
    if tp_size % total:
        raise _HeadSplitError(
            f"{name}={total} is fewer than tp_size={tp_size} and tp_size is not a multiple of it, "
            f"so the heads can be neither split nor replicated evenly"
        )
    return 1


@dataclass(frozen=True, slots=True)
class _Options:
    tp_size: int
    dtype: str
    page_size: int
    kv_dtype: str | None

    def full(self, kind: LayerKind = LayerKind.FULL, **fields_: Any) -> LayerSpec:
        """A full / mla / encoder spec with the run-wide dtype, KV dtype and page size."""
        if kind is LayerKind.ENCODER:  # no KV cache: neither KV dtype nor pages apply
            return LayerSpec(kind=kind, dtype=self.dtype, **fields_)
        return LayerSpec(
            kind=kind,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            page_size=self.page_size,
            **fields_,
        )

    def linear(self, **fields_: Any) -> LayerSpec:
        # Linear layers keep no KV cache: kv_dtype stays equal to dtype, page_size at default.
        return LayerSpec(kind=LayerKind.LINEAR, dtype=self.dtype, **fields_)


# One parsed model: total layers, (layer index, spec) per attention layer, extra layout fields.
_Parsed = tuple[int, list[tuple[int, LayerSpec]], dict[str, Any]]


def _layer_types(r: _Reader, num_layers: int, fallback: Callable[[int], str]) -> list[str]:
    """``layer_types`` when the config has it (transformers >= 4.54 writes it), else derived."""
    types = r.cfg.get("layer_types")
    if types is None:
        return [fallback(i) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(
            f"{r.where}: layer_types has {len(types) if isinstance(types, list) else types!r} "
            f"entries; expected a list of num_hidden_layers={num_layers}"
        )
    return list(types)


def _layers_of(types: Sequence[Any], value: Any) -> str:
    """``"layer 3"`` / ``"layers 0-2,5"``: where ``value`` occurs in ``types``."""
    where = [i for i, t in enumerate(types) if t == value]
    return f"layer{'s' if len(where) > 1 else ''} {_ranges(where)}"


def _describe_types(types: Sequence[Any]) -> str:
    """``"linear_attention in layers 0-1,3; full_attention in layer 2"``."""
    return "; ".join(f"{t} in {_layers_of(types, t)}" for t in dict.fromkeys(types))


def _check_types(r: _Reader, types: Sequence[str], allowed: set[str]) -> None:
    bad = sorted(set(types) - allowed, key=str)
    if bad:
        found = "; ".join(f"{t!r} in {_layers_of(types, t)}" for t in bad)
        raise ValueError(
            f"{r.where}: layer_types has {found}; this family's layers are {sorted(allowed)}"
        )


# layer_types values and what a parser must have mapped such a layer to. Granite-4.0-H's hub
# configs say "mamba" / "attention"; transformers' own classes write the names on the left.
_TYPE_KINDS: dict[str, str] = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",  # Llama-4's local layers (attention_chunk_size)
    "linear_attention": "linear",
    "mamba": "linear",
    "conv": "linear",  # LFM2's gated short conv
    # Falcon-H1 (its config's layer_types property): attention and Mamba2 in parallel
    "hybrid": "full+linear",
}


# layer_types values no layer kind describes, and what they compute (named in the refusal).
_QSA = (
    "QSA sparse attention: per query a learned indexer scores blocks of mean-pooled keys and "
    "the query attends only to the top-k blocks' tokens and its incomplete last block "
    "(DeepSeek-style)"
)
_NO_KIND_TYPES: dict[str, str] = {
    # Qwen4-Exp (every attention module has the indexer; its config renames full_attention)
    "indexed_attention": _QSA,
    "qwen_sparse_attention": _QSA,  # the same layers' name before transformers 5.18
}


def _mapped_as(spec: LayerSpec) -> str:
    if spec.kind is LayerKind.FULL and spec.sliding_window is not None:
        return "sliding"
    if spec.kind is LayerKind.FULL and spec.attention_chunk_size is not None:
        return "chunked"
    return str(spec.kind.value)


def _refuse_features(model_type: str, cfg: Mapping[str, Any], family: str) -> None:
    """Features no layer kind describes, or the family's mapping does not read, on a config of
    a supported model_type."""
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types")
    n = cfg.get("num_hidden_layers")
    if chunk is not None and family not in _READS_CHUNKS:
        if isinstance(types, list) and "chunked_attention" in types:
            where = _layers_of(types, "chunked_attention")
        else:
            where = f"layers {_ranges(range(n))}" if isinstance(n, int) else "every layer"
        raise ValueError(
            f"{model_type}: chunked attention (attention_chunk_size={chunk}) in {where}: the "
            f"{family} mapping does not read it (families that do: {sorted(_READS_CHUNKS)}); "
            f"refused, not mapped in part"
        )
    if isinstance(types, list):
        unknown = [t for t in dict.fromkeys(types) if t not in _TYPE_KINDS]
        if unknown:
            found = "; ".join(
                f"{t!r} in {_layers_of(types, t)}"
                + (f" ({_NO_KIND_TYPES[t]})" if t in _NO_KIND_TYPES else "")
                for t in unknown
            )
            raise ValueError(
                f"{model_type}: layer_types has {found}: no layer kind "
                f"(known layer_types: {sorted(_TYPE_KINDS)})"
            )


def _check_against_types(
    model_type: str, cfg: Mapping[str, Any], num_layers: int, layers: Sequence[tuple[int, Any]]
) -> None:
    """A parser's result must agree with the config's own ``layer_types``, layer by layer."""
    types = cfg.get("layer_types")
    if not isinstance(types, list):
        return
    if len(types) != num_layers:
        raise ValueError(
            f"{model_type}: layer_types has {len(types)} entries; "
            f"expected num_hidden_layers={num_layers}"
        )
    if model_type in _LAYER_TYPES_UNREAD:
        return  # the model does not follow the list (the parser says what it does instead)
    ops: dict[int, list[LayerSpec]] = {}
    for i, spec in layers:
        ops.setdefault(i, []).append(spec)
    window_set = cfg.get("sliding_window") is not None
    wrong: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(types):
        # a parallel layer's ops joined: "full+linear"
        got = "+".join(sorted(_mapped_as(s) for s in ops.get(i, []))) or "nothing"
        want = _TYPE_KINDS[t]
        if want == "full" and got == "mla":
            continue
        if want == "sliding" and got == "full" and not window_set:
            continue  # sliding_window null: transformers attends over every token too
        if want != got:
            wrong.setdefault((t, got), []).append(i)
    if wrong:
        parts = [
            f"layer{'s' if len(v) > 1 else ''} {_ranges(v)}: config says {t}, mapped {got}"
            for (t, got), v in wrong.items()
        ]
        raise ValueError(
            f"{model_type}: the mapping disagrees with the config's layer_types ("
            + "; ".join(parts)
            + "); is the model_type right?"
        )


# ------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------
class _Heads(TypedDict):
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _gqa(r: _Reader, o: _Options, head_dim: int) -> _Heads:
    heads = r.pos_int("num_attention_heads")
    # absent or null (Nemotron): one KV head per query head, as transformers reads it
    kv_heads = (
        r.pos_int("num_key_value_heads")
        if r.get("num_key_value_heads", None) is not None
        else heads
    )
    if heads % kv_heads:
        raise _FieldValueError(
            f"{r.where}: config fields num_attention_heads={heads}, num_key_value_heads="
            f"{kv_heads}: the query heads must be a multiple of the KV heads (each KV head "
            f"serves a group of query heads)"
        )
    return {
        "num_heads": _split(heads, o.tp_size, "num_attention_heads"),
        "num_kv_heads": _split_or_replicate(kv_heads, o.tp_size, "num_key_value_heads"),
        "head_dim": head_dim,
    }


#: ``head_dim`` of the model types whose transformers config class defaults it to a fixed
#: value rather than ``hidden_size // num_attention_heads`` (Qwen3Config: 128 whatever the
#: hidden size); a config that leaves it out gets this. Checked against transformers by
#: tests/test_hf_config_dense.py for every supported model type.
_HEAD_DIM_DEFAULTS: dict[str, int] = {
    "gemma3_text": 256,
    "lara_mini": 128,
    "lfm3": 128,
    "llama4_text": 128,
    "nemotron_h": 128,
    "qwen3": 128,
    "qwen3_5_moe_text": 256,
    "qwen3_5_text": 256,
    "qwen3_next": 256,
    "qwen4_exp_text": 256,
}


def _head_dim(r: _Reader) -> int:
    """``head_dim`` when set (Qwen3, Mistral-Nemo), else the model type's default in its
    transformers config class (:data:`_HEAD_DIM_DEFAULTS`), else hidden_size //
    num_attention_heads."""
    value = r.cfg.get("head_dim")
    if value is None:
        default = _HEAD_DIM_DEFAULTS.get(r.cfg.get("model_type", ""))
        if default is not None:
            return default
        hidden, heads = r.pos_int("hidden_size"), r.pos_int("num_attention_heads")
        if hidden % heads:  # transformers refuses to build such a model too
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                "the config sets no head_dim"
            )
        return hidden // heads
    return r.pos_int("head_dim")


#: ``sliding_window`` of the model types :func:`_dense` reads whose transformers config class
#: defaults it (MistralConfig: 4096; Qwen's apply it under ``use_sliding_window``): a config
#: that leaves it out slides by this. Checked against transformers by
#: tests/test_hf_config_review.py.
_SLIDING_WINDOW_DEFAULTS: dict[str, int] = {
    "mistral": 4096,
    "qwen2": 4096,
    "qwen3": 4096,
    "qwen3_moe": 4096,
}

#: ``max_window_layers`` of the model types :func:`_dense` reads whose config class defaults it
#: (Qwen2Config, Qwen3Config: 28, the layers from it on slide): a config without the field and
#: without ``layer_types`` slides those. Checked against transformers by
#: tests/test_hf_config_review.py.
_MAX_WINDOW_LAYERS_DEFAULTS: dict[str, int] = {"qwen2": 28, "qwen3": 28}

#: Model types whose transformers model never reads ``layer_types`` (their config class may
#: store one, MistralConfig warning that it is unused): every layer gets the same attention,
#: sliding over ``sliding_window`` when one applies. The config's list is validated as
#: transformers validates it, then not followed.
_LAYER_TYPES_UNREAD: frozenset[str] = frozenset({"llama", "mistral", "qwen3_moe"})


def _dense(r: _Reader, o: _Options) -> _Parsed:
    """Llama / Mistral / Qwen2 / Qwen3 (+MoE): GQA on every layer, optionally sliding."""
    n = r.pos_int("num_hidden_layers")
    model_type = r.cfg["model_type"]
    window = r.cfg.get("sliding_window", _SLIDING_WINDOW_DEFAULTS.get(model_type))
    if model_type == "llama":
        window = None  # Llama has no sliding window
    elif model_type != "mistral" and not r.cfg.get("use_sliding_window", False):
        window = None  # Qwen: sliding_window is only read when use_sliding_window is set
    max_window_layers = r.cfg.get("max_window_layers", _MAX_WINDOW_LAYERS_DEFAULTS.get(model_type))
    if max_window_layers is None:  # null, or a class without the field (Qwen3-MoE)
        max_window_layers = n

    def fallback(i: int) -> str:
        if window is None:
            return "full_attention"
        if model_type in ("mistral", "qwen3_moe"):
            # Mistral slides on every layer; so does Qwen3-MoE when use_sliding_window is set
            # (its config has no layer_types, its model builds one sliding mask for all layers)
            return "sliding_attention"
        return "sliding_attention" if i >= max_window_layers else "full_attention"

    types = _layer_types(r, n, fallback)
    _check_types(r, types, {"full_attention", "sliding_attention"})
    if model_type in _LAYER_TYPES_UNREAD:
        types = [fallback(i) for i in range(n)]  # the model's own rule, whatever the list says
    heads = _gqa(r, o, _head_dim(r))
    layers = []
    for i, t in enumerate(types):
        sw = window if t == "sliding_attention" else None
        layers.append((i, o.full(sliding_window=sw, **heads)))
    return n, layers, {}


# Fields every PretrainedConfig carries (none acts on the attention op).
_CONFIG_FIELDS: frozenset[str] = frozenset(
    {
        "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
        "id2label", "is_encoder_decoder", "label2id", "model_type", "output_attentions",
        "output_hidden_states", "problem_type", "return_dict", "transformers_version",
        "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
        "eod_token_id", "sep_token_id", "classifier_dropout",
    }
)  # fmt: skip

# Fields the generic dense mapping understands: what every config carries, the common attention
# names, and fields that act outside the attention op: embeddings, norms, MLP and MoE / router
# blocks, dropout, projection biases and q / k / v clipping or norms, RoPE and its placement
# (partial rotary, NoPE layers), parallel residuals, residual / logit multipliers, training-only
# fields. transformers runs all of those itself around the hooked op (the adapter drives the
# model's own forward). Any other field may change the attention math, so a config carrying one
# is refused rather than mapped on a guess.
_DENSE_FIELDS: frozenset[str] = _CONFIG_FIELDS | frozenset(
    {
        # sizes and the attention op
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "sliding_window", "use_sliding_window", "layer_types", "attn_logit_softcapping",
        "attention_multiplier", "query_pre_attn_scalar", "use_bidirectional_attention",
        # the layer pattern, when the config has no layer_types (older configs)
        "sliding_window_pattern", "max_window_layers",
        # outside the op: embeddings, norms, MLP, dropout, RoPE, multipliers
        "hidden_act", "hidden_activation", "initializer_range", "rms_norm_eps",
        "layer_norm_eps", "norm_eps", "norm_epsilon", "layer_norm_epsilon", "rope_theta",
        "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "original_max_position_embeddings",
        "no_rope_layers", "no_rope_layer_interval", "layer_rope_theta", "attention_bias",
        "attention_dropout", "mlp_bias", "use_bias", "qkv_bias", "use_qkv_bias",
        "attention_out_bias", "clip_qkv", "qk_layernorm", "use_qk_norm", "embd_pdrop",
        "resid_pdrop", "embedding_dropout", "residual_dropout", "hidden_dropout",
        "embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale",
        "final_logit_softcapping", "lm_head_bias", "use_parallel_residual", "use_post_norm",
        "is_decoder", "pretraining_tp", "num_nextn_predict_layers",
        "scale_emb", "scale_depth", "dim_model_base", "embedding_initializer_range",
        # GPT-2 / OPT style names of the same outside-the-op things (dropout, MLP, heads for
        # other tasks, numerics of an fp32 softmax that computes the same values)
        "activation_function", "attn_pdrop", "n_inner", "summary_type", "summary_use_proj",
        "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
        "reorder_and_upcast_attn", "attention_softmax_in_fp32",
        "scale_attention_softmax_in_fp32", "rotary_dim", "enable_bias", "do_layer_norm_before",
        "word_embed_proj_dim", "_remove_final_layer_norm", "layerdrop", "dropout", "init_std",
        "ffn_dim", "layer_norm_elementwise_affine", "activation_dropout",
        "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "multi_query", "n_ctx", "dff",
        "attention_probs_dropout_prob", "hidden_dropout_prob", "scale_embedding",
        "decoder_start_token_id",
        # MoE and router blocks (the MLP side of a layer)
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
        "num_experts_per_tok", "moe_k", "moe_topk", "n_shared_experts", "num_shared_experts",
        "moe_num_shared_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
        "shared_intermediate_size", "norm_topk_prob", "output_router_logits",
        "router_aux_loss_coef", "aux_loss_coef", "router_jitter_noise", "input_jitter_noise",
        "routed_scaling_factor", "n_group", "topk_group", "topk_method", "scoring_func",
        "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace", "mlp_layer_types",
        "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "moe_norm_min",
        "num_dense_layers", "route_scale", "router_scaling_factor", "enable_moe_fp32_combine",
        "mtp_layer_types", "mtp_mlp_layer_types", "output_vocab_size",
        "expert_selection_fn", "shared_expert_combination_strategy",
        "prefix_dense_intermediate_size",
        "moe_apply_router_weight_on_input", "moe_routed_scaling_factor",
        "moe_router_logit_softcapping",
        # muP input scaling of the embeddings (AFMoE); an output gate after the op (Laguna)
        "mup_enabled", "gating",
        # per-layer query head counts (Laguna): each layer's spec has its own
        "num_attention_heads_per_layer",
        # a value scale applied to v before the op (MiMo-V2-Flash); v's own head width
        "attention_value_scale", "v_head_dim",
        # DBRX: its attention and MoE fields nested (read for dbrx only: _FIELD_READERS)
        "attn_config", "ffn_config", "emb_pdrop",
        # Gemma-4: per-layer inputs beside the embeddings, its MoE block, per-layer overrides
        # (read by _per_layer_overrides), KV sharing (refused when on)
        "hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
        "top_k_experts", "use_double_wide_mlp", "per_layer_config", "num_kv_shared_layers",
        # Ergo: a dense-MLP prefix before the MoE layers; q and k scaled by the root of
        # global_attention_scale before the attention function on its full layers
        "num_dense_blocks", "first_dense_intermediate_size", "global_attention_scale",
        # an embedding model's pooling of the last hidden states (Cohere Compass)
        "pooling",
        # ModernBERT's decoder: norm and LM-head biases, MLP dropout, its classifier head, the
        # init; local_attention is the window's source (_DERIVED_WINDOWS)
        "norm_bias", "decoder_bias", "mlp_dropout", "classifier_bias", "classifier_activation",
        "cls_token_id", "initializer_cutoff_factor", "local_attention",
    }
)  # fmt: skip

# Fields from which a config class derives ``sliding_window`` (``field // divisor``) when the
# config gives none; a ``sliding_window`` the config gives is the one its class keeps.
_DERIVED_WINDOWS: dict[str, int] = {"local_attention": 2}  # ModernBERT's decoder

# Layer-pattern fields from which a config class derives its ``layer_types``: read only through
# the ``layer_types`` the class wrote beside them (a config.json without them is refused: the
# pattern rule is the class's own code).
_PATTERN_FIELDS: frozenset[str] = frozenset(
    {
        "global_attn_every_n_layers", "prefix_dense_sliding_window_pattern",
        "global_attention_every_n_layers",
    }
)  # fmt: skip

# DeepSeek's multi-head latent attention names: a config with ``kv_lora_rank`` set is read as
# MLA on every layer (GLM-4.7-Flash, MiniCPM3, Youtu, ...), the scale as DeepSeek computes it
# (the adapter checks it against the module's).
_MLA_FIELDS: frozenset[str] = frozenset(
    {
        "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim",
        "v_head_dim", "rope_interleave",
    }
)  # fmt: skip

# Fields of dense-looking configs that change the attention math in a way no layer kind
# describes, and what to call the feature in the refusal (when the field is set).
_ATTENTION_FEATURES: dict[str, str] = {
    "alibi": "ALiBi position bias",
    "position_bias_num_buckets": "relative position bias",
    "lambda_std_dev": "differential attention (two softmax maps subtracted)",
    "add_cross_attention": "cross-attention",
    "cross_attention_layers": "cross-attention layers (to image tokens)",
    "attention_k_eq_v": "keys shared as values",
    "keep_window_size": "dynamic mask attention",
    "prefix_lm": "a bidirectional prefix",
}

# Model types whose attention modules hold learned per-head sinks (a ``sinks`` parameter, no
# config field says so): their layers are mapped with sinks.
_SINK_MODEL_TYPES: frozenset[str] = frozenset({"flint", "granite_swa", "granitemoe_swa"})

# Model types whose sliding layers, by their module's code (no config field says so), have
# twice the config's KV heads and learned per-head sinks (MiMo-V2-Flash); the full layers
# have neither.
_SWA_DOUBLE_KV_SINK_MODEL_TYPES: frozenset[str] = frozenset({"mimo_v2_flash"})

# Model types whose attention module calls the attention op with scale 1: OPT scales q in its
# projection, Gemma-4 RMS-normalizes q and k.
_PRESCALED_Q_MODEL_TYPES: frozenset[str] = frozenset({"opt", "gemma4_text"})

# Model types whose attention module tiles its keys and values to every query head before the
# attention function (JetMoE's mixture of attention heads: ``num_experts_per_tok`` query-head
# sets, one per routed expert, ``key.repeat`` over them, not GQA's grouping): the op sees as many
# KV heads as query heads, so the KV cache holds the tiled copies.
_TILED_KV_MODEL_TYPES: frozenset[str] = frozenset({"jetmoe"})

#: ``attention_multiplier`` of the model types whose transformers config class defaults it
#: (GraniteConfig: 1.0) and whose attention module takes it as the softmax scale: a config that
#: leaves it out is scaled by this, not by ``1 / sqrt(head_dim)``. Checked against transformers
#: by tests/test_hf_config_review.py.
_ATTENTION_MULTIPLIER_DEFAULTS: dict[str, float] = {
    "granite": 1.0,
    "granite4_vision_text": 1.0,
    "granite_docling_text": 0.015625,
    "granite_swa": 1.0,
    "granitemoe": 1.0,
    "granitemoe_swa": 1.0,
    "granitemoehybrid": 1.0,
    "granitemoeshared": 1.0,
}


def _attention_multiplier(r: _Reader) -> Any:
    """The config's ``attention_multiplier``; when absent, its config class's default
    (:data:`_ATTENTION_MULTIPLIER_DEFAULTS`), else None (the ``1 / sqrt(head_dim)`` scale)."""
    if "attention_multiplier" in r.cfg:
        return r.cfg["attention_multiplier"]
    return _ATTENTION_MULTIPLIER_DEFAULTS.get(r.cfg.get("model_type", ""))


# Model types whose attention applies ``attn_logit_softcapping`` (the field is passed as the
# attention function's ``softcap``); the other dense families store it and never apply it.
_SOFTCAP_MODEL_TYPES: frozenset[str] = frozenset({"gemma2", "vaultgemma"})

# Attention-side fields only some model types read, and those: on any other model type the
# field is refused (mapping it would describe a model other than the one transformers runs).
# The layer-pattern fields matter only without ``layer_types`` (transformers 5 writes the
# pattern out, and the mapping follows it).
_FIELD_READERS: dict[str, frozenset[str]] = {
    # DBRX's nested attention fields (kv_n_heads, clip_qkv: _dbrx_attention) and its MoE block
    "attn_config": frozenset({"dbrx"}),
    "ffn_config": frozenset({"dbrx"}),
    # per-layer head_dim / KV heads (Gemma-4's full layers: head_dim 512), and KV sharing
    "per_layer_config": frozenset({"gemma4_text"}),
    "num_kv_shared_layers": frozenset({"gemma4_text"}),
    "query_pre_attn_scalar": frozenset({"gemma2", "vaultgemma"}),  # softmax scale
    "sliding_window_pattern": frozenset({"cohere2", "cohere2_moe", "exaone4", "exaone_moe"}),
    "max_window_layers": frozenset({"dots1", "qwen2_moe"}),
    # GPT-2 / GPT-BigCode: no scale when false, the scale over (layer + 1) when set, one KV head
    "scale_attn_weights": frozenset({"gpt2", "gpt_bigcode"}),
    "scale_attn_by_inverse_layer_idx": frozenset({"gpt2"}),
    "multi_query": frozenset({"gpt_bigcode"}),
}

# Fields that name a model's sizes the GPT-2 / BLOOM way, and the common names they stand for:
# a config that has them instead of the common ones is refused with that said.
_OTHER_SIZE_NAMES: dict[str, str] = {
    "n_layer": "num_hidden_layers",
    "num_layers": "num_hidden_layers",
    "n_layers": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_heads": "num_attention_heads",
    "n_embd": "hidden_size",
    "d_model": "hidden_size",
}


def _dense_layer_type(cfg: Mapping[str, Any], window: int | None, i: int) -> str:
    """Layer ``i``'s type for a config without ``layer_types``: full without a window; with
    one, every layer slides (Mistral, Phi-3, Starcoder2) except every ``sliding_window_pattern``
    -th (Cohere-2, EXAONE-4)."""
    if window is None:
        return "full_attention"
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0 and (i + 1) % pattern == 0:
        return "full_attention"
    return "sliding_attention"


def _own_names(model_type: Any) -> dict[str, str]:
    """The common field names -> the names ``model_type``'s transformers config class stores
    them under (its ``attribute_map``: GPT-2's ``n_layer`` for ``num_hidden_layers``); ``{}``
    without transformers or for a model type it does not know."""
    if not isinstance(model_type, str):
        return {}
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # the mapping runs without transformers: only the common names then
        return {}
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return {}
    names = getattr(cls, "attribute_map", None)
    return {k: v for k, v in names.items() if isinstance(v, str)} if isinstance(names, dict) else {}


def _common_names(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """``cfg`` with the fields its config class names its own way also under the common names,
    and those own names (read as the common ones, so not unknown fields)."""
    out = dict(cfg)
    aliases = set()
    fields_ = class_fields(cfg.get("model_type"))
    for common, own in _own_names(cfg.get("model_type")).items():
        # attribute_map: the attribute -> the field stored; only a common name the mapping
        # reads stands for another (EXAONE's maps its legacy num_layers to num_hidden_layers)
        if own not in out or common not in _DENSE_FIELDS | _MLA_FIELDS:
            continue
        if common in out:
            # both given: the class sets its fields first and a name that is no field of it
            # last, through attribute_map, so the alias's value is the one the model reads
            # (Glm4MoeLite's head_dim for qk_rope_head_dim: its rope width and its scale)
            if common not in fields_:
                out[own] = out[common]
            continue
        out[common] = out[own]
        aliases.add(own)
    return out, frozenset(aliases)


def class_fields(model_type: Any) -> frozenset[str]:
    """The dataclass fields of ``model_type``'s transformers config class (``{}`` without
    transformers, for a model type it does not know, or a class that is no dataclass)."""
    if not isinstance(model_type, str):
        return frozenset()
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return frozenset()
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return frozenset()
    if not dataclasses.is_dataclass(cls):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(cls))


def _nested_text(sub: Mapping[str, Any], key: str) -> str:
    """What the mapping makes of a composite config's language model on its own."""
    inner = sub.get("model_type")
    try:
        layout = specs_from_hf_config(sub)
    except ValueError as err:
        return f"its {key} ({inner!r}) alone: {str(err).split('; ')[0]}"
    return (
        f"its {key} ({inner!r}) alone maps ({layout.num_layers} layers, family {layout.family}): "
        f"give that config to explain or run the language model"
    )


def _attention_in_own_code(model_type: Any) -> list[str]:
    """The attention classes of ``model_type``'s transformers modeling module when that module
    never refers to transformers' attention-function interface (``ALL_ATTENTION_FUNCTIONS``,
    the one the adapter hooks): its modules compute attention in their own code (XGLM, Falcon,
    BLOOM, MPT, GPT-Neo in transformers 5), so no backend could serve a layer of it (the
    caller skips the model types of :data:`_OWN_ATTENTION`, whose modules the adapter
    replaces: Falcon's rotary layouts, GPT-Neo). ``[]`` when
    the module uses the interface, has no attention class (Mamba), or cannot be imported (no
    transformers, a model type it does not know): the run's own check (every attention layer
    must call the hook) still holds there.

    The module's namespace is what is read (no source text): a module whose code dispatches
    through the interface imports ``ALL_ATTENTION_FUNCTIONS``, and so holds the name whichever
    of its classes or helper functions uses it (a module that uses it is never refused on a
    guess). Over transformers 5's modeling modules this gives what reading their sources for
    the name gives."""
    if not isinstance(model_type, str):
        return []
    try:
        import torch
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        name = model_type_to_module_name(model_type)
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return []
    if hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        return []
    return sorted(
        n
        for n, c in vars(modeling).items()
        if "Attention" in n
        and inspect.isclass(c)
        and issubclass(c, torch.nn.Module)
        and c.__module__ == modeling.__name__
    )


def _falcon_layers(r: _Reader, o: _Options, n: int) -> list[tuple[int, LayerSpec]]:
    """Falcon's rotary attention (ALiBi is refused before this): ``query_key_value`` holds
    ``num_kv_heads`` KV heads with the new decoder architecture (GQA), else one with
    ``multi_query``, else one per query head; ``head_dim = hidden_size // num_attention_heads``
    and the scale ``1 / sqrt(head_dim)`` on every layer. Absent fields take FalconConfig's
    defaults (``multi_query`` True, ``new_decoder_architecture`` False)."""
    heads = r.pos_int("num_attention_heads")
    hidden = r.pos_int("hidden_size")
    if hidden % heads:
        raise ValueError(
            f"{r.where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    if r.cfg.get("new_decoder_architecture", False):
        # FalconConfig reads a null num_kv_heads as one per query head
        kv = r.pos_int("num_kv_heads") if r.cfg.get("num_kv_heads") is not None else heads
    elif r.cfg.get("multi_query", True):
        kv = 1
    else:  # the fused projection splits q, k, v per head: as many KV heads as query heads
        kv = heads
    # transformers 5.25's FalconConfig also writes a num_key_value_heads (derived as above
    # unless given); FalconAttention never reads it, so neither does the mapping
    spec = o.full(
        num_heads=_split(heads, o.tp_size, "num_attention_heads"),
        num_kv_heads=_split_or_replicate(kv, o.tp_size, "num_kv_heads"),
        head_dim=hidden // heads,
    )
    return [(i, spec) for i in range(n)]


def _gpt_neo_layers(r: _Reader, o: _Options, n: int) -> list[tuple[int, LayerSpec]]:
    """GPT-Neo: ``attention_types`` (``[[["global", "local"], 12]]``: the pattern and its
    repeats, expanded as GPTNeoConfig does; its ``attention_layers`` is derived from it) gives
    each layer global (causal) or local attention; a local layer sees the last ``window_size``
    tokens, itself included (the module's mask is ``tril(1) xor tril(1, -window_size)``: ``i -
    window_size < j <= i``). No layer scales ``q . k`` (the op's scale is 1)."""
    pattern = r.get("attention_types", [[["global", "local"], 12]])
    try:
        types = [t for kinds, repeat in pattern for _ in range(repeat) for t in kinds]
    except (TypeError, ValueError):
        raise ValueError(
            f"{r.where}: attention_types={pattern!r}: expected [[[type, ...], repeats], ...]"
        ) from None
    if len(types) != n:
        raise ValueError(
            f"{r.where}: attention_types={pattern!r} gives {len(types)} layers; expected "
            f"num_hidden_layers={n}"
        )
    bad = sorted({str(t) for t in types} - {"global", "local"})
    if bad:
        raise ValueError(
            f"{r.where}: attention_types has {bad}; GPT-Neo's layers are ['global', 'local']"
        )
    heads = r.pos_int("num_attention_heads")
    hidden = r.pos_int("hidden_size")
    if hidden % heads:
        raise ValueError(
            f"{r.where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    window = r.pos_int("window_size", 256) if "local" in types else None
    h = _split(heads, o.tp_size, "num_attention_heads")
    return [
        (
            i,
            o.full(
                num_heads=h,
                num_kv_heads=h,
                head_dim=hidden // heads,
                sliding_window=window if t == "local" else None,
                softmax_scale=1.0,
            ),
        )
        for i, t in enumerate(types)
    ]


@dataclass(frozen=True, slots=True)
class _OwnAttention:
    """A model type whose attention modules compute attention in their own code, for which the
    adapter replaces each module's forward by one that calls the op
    (``attn_core.e2e.adapters.MODULE_ADAPTERS``, the same model types): the fields its config
    class adds to every PretrainedConfig's, and its layers' specs (``(reader, options,
    num_layers) -> [(layer, spec)]``)."""

    fields: frozenset[str]
    layers: Callable[[_Reader, _Options, int], list[tuple[int, LayerSpec]]]


# The fields Falcon's and GPT-Neo's config classes add to every PretrainedConfig's (sizes,
# the attention layout, and what acts outside the op: norms, MLP, dropout, RoPE); Falcon's
# num_key_value_heads (transformers 5.25 on) is one its modules do not read.
_FALCON_FIELDS: frozenset[str] = frozenset(
    {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_kv_heads",
        "num_key_value_heads", "alibi", "new_decoder_architecture", "multi_query", "parallel_attn",
        "num_ln_in_parallel_attn", "bias", "ffn_hidden_size", "activation", "hidden_dropout",
        "attention_dropout", "layer_norm_epsilon", "initializer_range",
        "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
    }
)  # fmt: skip
_GPT_NEO_FIELDS: frozenset[str] = frozenset(
    {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "attention_types", "attention_layers", "window_size", "intermediate_size",
        "activation_function", "resid_dropout", "embed_dropout", "attention_dropout",
        "layer_norm_epsilon", "initializer_range", "max_position_embeddings",
    }
)  # fmt: skip

#: Model types mapped although their modules never call the attention-function interface.
_OWN_ATTENTION: dict[str, _OwnAttention] = {
    "falcon": _OwnAttention(_FALCON_FIELDS, _falcon_layers),
    "gpt_neo": _OwnAttention(_GPT_NEO_FIELDS, _gpt_neo_layers),
}


def _refuse_unknown(r: _Reader, known: frozenset[str], every: str) -> None:
    """Any field outside ``known`` (and the refused features' own) is refused, named."""
    unknown = sorted(k for k in r.cfg if k not in known and k not in _ATTENTION_FEATURES)
    if unknown:
        # a sub-model's config beside the language model's sizes (Git's vision tower, Moshi's
        # audio encoder): another stack, which no family of this mapping reads
        stacks = [k for k in unknown if k.endswith("_config") and isinstance(r.cfg[k], Mapping)]
        nested = ""
        if stacks:
            names = ", ".join(repr(k) for k in stacks)
            are = "are nested model configs" if len(stacks) > 1 else "is a nested model config"
            nested = f"; {names} {are}: a composite model, whose other stack no family reads"
        raise ValueError(
            f"{r.where}: config field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in unknown)} in {every}: not understood "
            f"by the generic dense mapping (it may change the attention math){nested}; "
            "refused, not mapped in part"
        )


def _refuse_not_dense(r: _Reader) -> None:
    """A config the generic dense mapping cannot read at all: an encoder-decoder model, or one
    that names its sizes its own way; the refusal says which."""
    cfg = r.cfg
    if cfg.get("is_encoder_decoder") or "decoder_layers" in cfg or "encoder_layers" in cfg:
        n = cfg.get("decoder_layers", cfg.get("num_hidden_layers"))
        where = f"decoder layers {_ranges(range(n))}" if isinstance(n, int) and n > 0 else ""
        raise ValueError(
            f"{r.where}: an encoder-decoder model (cross-attention in "
            f"{where or 'its decoder layers'}): no layer kind"
        )
    sizes = "num_hidden_layers" in cfg
    if not sizes:
        other = {k: v for k, v in _OTHER_SIZE_NAMES.items() if k in cfg}
        if other:
            names = ", ".join(f"{k} for {v}" for k, v in other.items())
            raise ValueError(
                f"{r.where}: names its sizes its own way ({names}); the generic dense mapping "
                f"reads the common names (num_hidden_layers, num_attention_heads, hidden_size), "
                f"so no family reads this model_type; refused, not guessed"
            )
    composite = ("text_config", "llm_config", "decoder", "language_config")
    nested = [k for k in composite if isinstance(cfg.get(k), Mapping)]
    towers = [k for k in cfg if k.endswith("_config") and isinstance(cfg[k], Mapping)]
    # a language model nested in the config is a composite config even where its class also
    # forwards the text sizes to the top (Gemma-4, Emu3): named as such, not as unknown fields
    if nested or (towers and not sizes):
        text = _nested_text(cfg[nested[0]], nested[0]) if nested else "none is a text_config"
        raise ValueError(
            f"{r.where}: a composite config ({', '.join(towers or nested)}) that no family "
            f"reads the stacks of; {text}; refused, not mapped in part"
        )


def _generic_dense(r: _Reader, o: _Options) -> _Parsed:
    """Any dense family that uses the common names: GQA on every layer, full or sliding.

    Without ``layer_types``, a set ``sliding_window`` slides every layer (Mistral, Phi-3,
    Starcoder2) unless ``use_sliding_window`` is false, but for every
    ``sliding_window_pattern``-th layer; with ``max_window_layers`` too it is refused (Qwen2
    and Qwen2-MoE read it differently).
    ``attention_multiplier`` (Granite; absent, its config class's default) is the softmax
    scale, ``query_pre_attn_scalar`` (Gemma-2) its inverse square. A set
    ``attn_logit_softcapping`` is mapped for the model types that apply it
    (:data:`_SOFTCAP_MODEL_TYPES`) and refused for the others.
    """
    named, aliases = _common_names(r.cfg)
    r = _Reader(named, r.where, r.defaults)
    _refuse_not_dense(r)
    n = r.pos_int("num_hidden_layers")
    every = f"layers {_ranges(range(n))}"
    model_type = r.cfg.get("model_type")
    features = [
        f"{what} ({key}={r.cfg[key]!r})"
        for key, what in _ATTENTION_FEATURES.items()
        if r.cfg.get(key) not in (None, False, 0)
    ]
    if r.cfg.get("use_bidirectional_attention"):
        features.append("bidirectional attention (use_bidirectional_attention=True)")
    bert_names = "add_cross_attention" in r.cfg and "attention_probs_dropout_prob" in r.cfg
    if bert_names and not r.cfg.get("is_decoder"):
        # a BERT-style model (BERT's field names): causal only as a decoder (is_decoder=True);
        # GPT-2 has add_cross_attention too and is causal either way
        features.append("bidirectional attention (a BERT-style encoder: is_decoder=False)")
    attn_config = r.cfg.get("attn_config")
    if model_type == "bloom" or (isinstance(attn_config, Mapping) and attn_config.get("alibi")):
        features.append(f"ALiBi position bias ({model_type} adds it to every layer's logits)")
    reasons = [f"{'; '.join(features)} in {every}: no layer kind"] if features else []
    own = _OWN_ATTENTION.get(model_type) if isinstance(model_type, str) else None
    own_code = _attention_in_own_code(model_type) if own is None else []
    if own_code:
        # the same refusal for explain and run: the hook would never be called (the adapter's
        # check after a step says the same of a model this test misses)
        reasons.append(
            f"{every}: their attention modules {own_code} compute attention in their own code, "
            f"not through transformers' attention-function interface (the op the adapter "
            f"replaces), so no backend can serve them; refused, not mapped"
        )
    if reasons:
        raise ValueError(f"{r.where}: {'; '.join(reasons)}")
    if own is not None:  # the adapter replaces its attention modules: its own fields only
        _refuse_unknown(r, _CONFIG_FIELDS | aliases | own.fields, every)
        return n, own.layers(r, o, n), {}
    mla = r.cfg.get("kv_lora_rank") is not None
    linear = sorted(k for k in r.cfg if k.startswith(("linear_", "mamba_", "conv_")))
    if linear:
        raise ValueError(
            f"{r.where}: linear-attention / recurrent mixer fields ({', '.join(linear)}) in "
            f"{every}: the generic dense mapping maps attention layers only, and no family "
            f"reads {model_type!r}'s mixers; refused, not mapped in part"
        )
    patterns = _PATTERN_FIELDS if isinstance(r.cfg.get("layer_types"), list) else frozenset()
    known = _DENSE_FIELDS | aliases | patterns | (_MLA_FIELDS if mla else frozenset())
    _refuse_unknown(r, known, every)
    for key, readers in _FIELD_READERS.items():
        if r.cfg.get(key) is not None and model_type not in readers:
            raise ValueError(
                f"{r.where}: {key!r}={r.cfg[key]!r} in {every}: {model_type!r} is not known to "
                f"read it (the model types that do: {sorted(readers)}); refused, not guessed"
            )
    for key, divisor in _DERIVED_WINDOWS.items():
        if "sliding_window" not in r.cfg and r.cfg.get(key):  # the class's rule, as it holds it
            r = _Reader({**r.cfg, "sliding_window": r.cfg[key] // divisor}, r.where, r.defaults)
    window = r.cfg.get("sliding_window")
    if r.cfg.get("use_sliding_window", True) is False:
        window = None
    if window is not None:
        window = r.pos_int("sliding_window")
    if window is not None and "layer_types" not in r.cfg and "max_window_layers" in r.cfg:
        # Qwen2 slides the layers from max_window_layers on, Qwen2-MoE every other layer below
        # it: which layers slide is the model's own rule
        raise ValueError(
            f"{r.where}: sliding_window={window} with max_window_layers="
            f"{r.cfg['max_window_layers']} and no layer_types in {every}: which layers slide "
            f"differs by model type (write the config's layer_types); refused, not guessed"
        )
    types = _layer_types(r, n, lambda i: _dense_layer_type(r.cfg, window, i))
    if mla:  # DeepSeek's MLA field names: the absorbed MLA spec on every layer
        _check_types(r, types, {"full_attention"})
        if window is not None or r.cfg.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"{r.where}: multi-head latent attention with a sliding window or a soft-cap in "
                f"{every}: no layer kind"
            )
        if model_type in _SINK_MODEL_TYPES:
            raise ValueError(f"{r.where}: multi-head latent attention with sinks: no layer kind")
        missing = [k for k in ("qk_rope_head_dim", "qk_nope_head_dim") if k not in r.cfg]
        if missing:
            raise ValueError(
                f"{r.where}: multi-head latent attention (kv_lora_rank={r.cfg['kv_lora_rank']}) "
                f"in {every} without {', '.join(missing)}: not DeepSeek's MLA field names; "
                f"refused, not guessed"
            )
        spec = _mla(r, o, yarn_scale=True)
        return n, [(i, spec) for i in range(n)], {}
    _check_types(r, types, {"full_attention", "sliding_attention"})
    if model_type == "dbrx":
        r = _dbrx_attention(r)
    heads = _gqa(r, o, _head_dim(r))
    if r.cfg.get("multi_query"):  # GPT-BigCode: one KV head for all query heads
        heads["num_kv_heads"] = 1
    if model_type in _TILED_KV_MODEL_TYPES:  # the op gets one (tiled) KV head per query head
        heads["num_kv_heads"] = heads["num_heads"]
    fields_: dict[str, Any] = dict(heads)
    if not mla and r.cfg.get("v_head_dim") is not None:  # values of another width (MiMo)
        fields_["head_dim_v"] = r.pos_int("v_head_dim")
    cap = r.cfg.get("attn_logit_softcapping")
    if model_type in _SINK_MODEL_TYPES:
        fields_["has_sinks"] = True
    if cap is not None and model_type in _SOFTCAP_MODEL_TYPES:
        fields_["logits_soft_cap"] = float(cap)
    elif cap is not None:
        # transformers' other dense families store the field but never pass it to the
        # attention function: capping would describe another model than the one it runs
        raise ValueError(
            f"{r.where}: attn_logit_softcapping={cap} in {every}: the generic dense mapping "
            f"cannot tell whether {model_type!r} applies it to the attention logits (the "
            f"model types known to: {sorted(_SOFTCAP_MODEL_TYPES)}); refused, not guessed"
        )
    scale = _attention_multiplier(r)
    pre = r.cfg.get("query_pre_attn_scalar")
    if scale is not None and pre is not None:
        raise ValueError(
            f"{r.where}: both attention_multiplier={scale} and query_pre_attn_scalar={pre} set "
            f"the softmax scale in {every}; refused, not guessed"
        )
    if scale is not None:
        fields_["softmax_scale"] = float(scale)
    elif pre is not None:
        fields_["softmax_scale"] = float(pre) ** -0.5
    elif r.cfg.get("scale_attn_weights") is False or model_type in _PRESCALED_Q_MODEL_TYPES:
        fields_["softmax_scale"] = 1.0
    by_layer = bool(r.cfg.get("scale_attn_by_inverse_layer_idx"))
    base = fields_.pop("softmax_scale", heads["head_dim"] ** -0.5)
    per_layer_heads = _heads_per_layer(r, o, n)
    overrides = _per_layer_overrides(r, o, n)
    _refuse_kv_sharing(r, n)
    layers = []
    for i, t in enumerate(types):
        sw = window if t == "sliding_attention" else None
        # GPT-2's scale_attn_by_inverse_layer_idx: layer i's scale over (i + 1)
        sc = base / (i + 1) if by_layer else base
        if per_layer_heads is not None:
            fields_["num_heads"] = per_layer_heads[i]
        layer_fields = {**fields_, **overrides.get(i, {})}
        if sw is not None and model_type in _SWA_DOUBLE_KV_SINK_MODEL_TYPES:
            kv = _split_or_replicate(
                2 * r.pos_int("num_key_value_heads"), o.tp_size, "2 x num_key_value_heads"
            )
            layer_fields.update(num_kv_heads=kv, has_sinks=True)
        layers.append((i, o.full(sliding_window=sw, softmax_scale=sc, **layer_fields)))
    return n, layers, {}


#: ``per_layer_config`` keys and the spec field each sets; other keys outside the op are
#: accepted as they are (the MLP's sizes), any other is refused.
_PER_LAYER_SPEC_KEYS = {"head_dim": "head_dim", "num_key_value_heads": "num_kv_heads"}
_PER_LAYER_OUTSIDE_KEYS = frozenset({"intermediate_size", "moe_intermediate_size"})


def _per_layer_overrides(r: _Reader, o: _Options, n: int) -> dict[int, dict[str, int]]:
    """Gemma-4's ``per_layer_config`` (layer index as a string, ``"5"`` or ``"05"`` -> the
    fields that layer overrides): the spec fields it sets per layer (head_dim, KV heads)."""
    cfg = r.cfg.get("per_layer_config")
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{r.where}: per_layer_config: expected a mapping, got {cfg!r}")
    out: dict[int, dict[str, int]] = {}
    for key, fields in cfg.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= index < n or not isinstance(fields, Mapping):
            raise ValueError(
                f"{r.where}: per_layer_config[{key!r}]: expected a layer 0..{n - 1} and its "
                f"fields, got {fields!r}"
            )
        unknown = sorted(set(fields) - set(_PER_LAYER_SPEC_KEYS) - _PER_LAYER_OUTSIDE_KEYS)
        if unknown:
            raise ValueError(
                f"{r.where}: per_layer_config[{key!r}] sets {unknown} for layer {index}: not "
                f"understood by the generic dense mapping; refused, not mapped in part"
            )
        spec: dict[str, int] = {}
        for name, spec_field in _PER_LAYER_SPEC_KEYS.items():
            value = fields.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{r.where}: per_layer_config[{key!r}].{name}: expected a positive int, "
                    f"got {value!r}"
                )
            spec[spec_field] = value
        if "num_kv_heads" in spec:
            spec["num_kv_heads"] = _split_or_replicate(
                spec["num_kv_heads"], o.tp_size, f"per_layer_config[{key!r}].num_key_value_heads"
            )
        out[index] = spec
    return out


def _refuse_kv_sharing(r: _Reader, n: int) -> None:
    """Gemma-4's last ``num_kv_shared_layers`` layers attend over an earlier layer's keys and
    values, writing none of their own: no layer kind describes reading another layer's cache."""
    shared = r.cfg.get("num_kv_shared_layers")
    if shared:
        first = n - int(shared)
        raise ValueError(
            f"{r.where}: keys and values shared from earlier layers (num_kv_shared_layers="
            f"{shared}) in layers {_ranges(range(max(first, 0), n))}: no layer kind; refused, "
            f"not mapped in part"
        )


#: DBRX's ``attn_config`` keys: its KV heads, and what acts outside the op (dropout, q/k/v
#: clipping, the RoPE base of older configs); anything else is refused
_DBRX_ATTENTION_KEYS = frozenset({"kv_n_heads", "attn_pdrop", "clip_qkv", "rope_theta"})


def _dbrx_attention(r: _Reader) -> _Reader:
    """DBRX keeps its KV heads in ``attn_config.kv_n_heads`` (a hub config.json has no
    top-level ``num_key_value_heads``): ``r`` with them read there."""
    attn = r.cfg.get("attn_config")
    if not isinstance(attn, Mapping):
        return r
    unknown = sorted(set(attn) - _DBRX_ATTENTION_KEYS - _CONFIG_FIELDS - {"attn_impl"})
    if unknown:
        raise ValueError(
            f"{r.where}: attn_config sets {unknown}: not understood by the generic dense mapping; "
            f"refused, not mapped in part"
        )
    kv = attn.get("kv_n_heads")
    if kv is None:
        return r
    top = r.cfg.get("num_key_value_heads")
    if top is not None and top != kv:
        raise ValueError(
            f"{r.where}: num_key_value_heads={top} but attn_config.kv_n_heads={kv}; refused"
        )
    return _Reader({**r.cfg, "num_key_value_heads": kv}, r.where, r.defaults)


def _heads_per_layer(r: _Reader, o: _Options, n: int) -> list[int] | None:
    """``num_attention_heads_per_layer`` (Laguna: each layer's query heads, the KV heads and
    head_dim shared), split for tensor parallelism; None when the config has no such list."""
    value = r.cfg.get("num_attention_heads_per_layer")
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in value)
    ):
        raise ValueError(
            f"{r.where}: num_attention_heads_per_layer: expected {n} positive ints (one per "
            f"layer), got {value!r}"
        )
    key = "num_attention_heads_per_layer"
    return [_split(h, o.tp_size, f"{key}[{i}]") for i, h in enumerate(value)]


def _llama4(r: _Reader, o: _Options) -> _Parsed:
    """Llama-4 text (``llama4_text``; ``llama4`` reads its ``text_config``): chunked (local)
    attention layers and global full-attention layers, by ``layer_types``.

    Without ``layer_types`` transformers derives them from the NoPE pattern: a layer that uses
    rope (``no_rope_layers[i] == 1``; by default every layer but each
    ``no_rope_layer_interval``-th) is chunked when ``attention_chunk_size`` is set, the NoPE
    layers are full. Everything else acts outside the attention op and stays the model's:
    rope on the rope layers only, the weightless L2 q/k norm (``use_qk_norm``) on the rope
    layers, and on NoPE layers with ``attn_temperature_tuning`` the query scale
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` of each query's position ``p``
    (a per-token factor on q before the op, as rope is: the adapter applies it with the
    step's positions); the softmax scale stays ``head_dim ** -0.5``.
    """
    n = r.pos_int("num_hidden_layers")
    chunk = r.cfg.get("attention_chunk_size")
    if chunk is not None:
        chunk = r.pos_int("attention_chunk_size")
    uses_rope = _llama4_rope_layers(r, n)
    types = _layer_types(
        r,
        n,
        lambda i: "chunked_attention" if uses_rope[i] and chunk is not None else "full_attention",
    )
    _check_types(r, types, {"chunked_attention", "full_attention"})
    if chunk is None and "chunked_attention" in types:
        where = _layers_of(types, "chunked_attention")
        raise ValueError(
            f"{r.where}: layer_types has chunked_attention in {where} but attention_chunk_size "
            "is null; expected the chunk size"
        )
    heads = _gqa(r, o, _head_dim(r))
    layers = []
    for i, t in enumerate(types):
        size = chunk if t == "chunked_attention" else None
        layers.append((i, o.full(attention_chunk_size=size, **heads)))
    return n, layers, {}


def _llama4_rope_layers(r: _Reader, n: int) -> list[bool]:
    """Per layer whether it applies rope: ``no_rope_layers`` (1: rope, 0: NoPE, transformers'
    naming), or when empty every layer but each ``no_rope_layer_interval``-th."""
    given = r.cfg.get("no_rope_layers")
    if not given:
        interval = r.pos_int("no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(n)]
    if not isinstance(given, list) or len(given) != n or any(v not in (0, 1) for v in given):
        raise ValueError(
            f"{r.where}: no_rope_layers={given!r}: expected {n} entries of 1 (rope) or 0 (NoPE)"
        )
    return [bool(v) for v in given]


# Gated DeltaNet model types whose attention layers also slide (``sliding_attention`` layers
# over ``sliding_window``, beside ``full_attention`` ones): Lara-Mini.
_GDN_SLIDING: frozenset[str] = frozenset({"lara_mini"})


def _qwen3_next(r: _Reader, o: _Options) -> _Parsed:
    """Qwen3-Next: Gated DeltaNet layers and gated full-attention layers (3 : 1); Lara-Mini's
    attention layers slide or not by ``layer_types``."""
    n = r.pos_int("num_hidden_layers")
    interval = r.pos_int("full_attention_interval", 4)
    types = _layer_types(
        r, n, lambda i: "linear_attention" if (i + 1) % interval else "full_attention"
    )
    sliding = r.cfg.get("model_type") in _GDN_SLIDING
    _check_types(
        r,
        types,
        {"full_attention", "linear_attention"} | ({"sliding_attention"} if sliding else set()),
    )
    # The full-attention output gate (q_proj emits q and a gate) is applied by the model, as
    # are Lara-Mini's rope on its sliding layers only (its global layers have none).
    heads = _gqa(r, o, _head_dim(r))
    full = o.full(**heads)
    by_type = {"full_attention": full}
    if "sliding_attention" in types:
        by_type["sliding_attention"] = o.full(sliding_window=r.pos_int("sliding_window"), **heads)
    all_v, all_k = r.pos_int("linear_num_value_heads"), r.pos_int("linear_num_key_heads")
    if all_v % all_k:
        raise _FieldValueError(
            f"{r.where}: config fields linear_num_value_heads={all_v}, linear_num_key_heads="
            f"{all_k}: the value heads must be a multiple of the key heads (each key head "
            "serves a group of value heads)"
        )
    v_heads = _split(all_v, o.tp_size, "linear_num_value_heads")
    k_heads = _split_or_replicate(all_k, o.tp_size, "linear_num_key_heads")
    dk, dv = r.pos_int("linear_key_head_dim"), r.pos_int("linear_value_head_dim")
    linear = o.linear(
        linear_variant=LinearVariant.GATED_DELTANET,
        num_heads=v_heads,
        num_kv_heads=k_heads,
        head_dim=dk,
        head_dim_v=dv,
        conv_kernel_size=r.pos_int("linear_conv_kernel_dim"),
        conv_channels=2 * k_heads * dk + v_heads * dv,  # the conv runs over q, k and v
        qk_l2norm=True,
        state_dtype="float32",
    )
    by_type["linear_attention"] = linear
    return n, [(i, by_type[t]) for i, t in enumerate(types)], {}


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _mla(r: _Reader, o: _Options, *, yarn_scale: bool) -> LayerSpec:
    """The absorbed MLA spec from the DeepSeek field names (``kv_lora_rank``,
    ``qk_rope_head_dim``, ``qk_nope_head_dim``); ``yarn_scale`` folds a YaRN rope's temperature
    into the scale, as DeepSeek does."""
    rank, rope, nope = (
        r.pos_int("kv_lora_rank"),
        r.pos_int("qk_rope_head_dim"),
        r.pos_int("qk_nope_head_dim"),
    )
    scale = 1.0 / math.sqrt(nope + rope)
    # Older configs say rope_scaling {"type": "yarn"}, transformers 5 rope_parameters {"rope_type"}.
    name = "rope_parameters" if r.cfg.get("rope_parameters") else "rope_scaling"
    rope_cfg = _mapping(r, name) if yarn_scale else {}
    rope_type = rope_cfg.get("rope_type", rope_cfg.get("type", "default"))
    if rope_type != "default" and rope_cfg.get("mscale_all_dim"):
        # DeepSeek (and HF's yarn_apply_mscale, V2 and V3 alike: any non-default rope type)
        # fold YaRN's temperature, squared, into the scale.
        factor = rope_cfg.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise ValueError(
                f"{r.where}: config field {name}={dict(rope_cfg)!r}: rope type {rope_type!r} "
                f"with mscale_all_dim scales attention by its 'factor': expected a number, "
                f"got {factor!r}"
            )
        m = _yarn_mscale(float(factor), float(rope_cfg["mscale_all_dim"]))
        scale *= m * m
    return o.full(
        kind=LayerKind.MLA,
        num_heads=_split(r.pos_int("num_attention_heads"), o.tp_size, "num_attention_heads"),
        num_kv_heads=1,
        head_dim=rank + rope,
        head_dim_v=rank,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        softmax_scale=scale,
    )


def _deepseek_v3(r: _Reader, o: _Options) -> _Parsed:
    """DeepSeek-V3 and V2: MLA on every layer (the MTP layers are not part of the stack)."""
    n = r.pos_int("num_hidden_layers")
    spec = _mla(r, o, yarn_scale=True)
    return n, [(i, spec) for i in range(n)], {}


def _kimi_types(r: _Reader, n: int) -> list[str]:
    """Kimi-Linear's layer types: ``linear_attn_config``'s ``kda_layers`` / ``full_attn_layers``
    (hub configs; 1-based, both needed, together naming every layer once), else ``layer_types``,
    else transformers' default (KDA except every fourth layer from layer 4, 0-based).

    transformers' ``KimiLinearConfig`` prefers ``layer_types`` when both are given; the result
    is checked against ``layer_types`` afterwards, so lists that disagree with it are refused."""
    lac = _mapping(r, "linear_attn_config")
    kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
    if kda is None or full is None:
        return _layer_types(
            r, n, lambda i: "full_attention" if i and i % 4 == 0 else "linear_attention"
        )
    types: list[str | None] = [None] * n
    for name, listed, value in (
        ("kda_layers", kda, "linear_attention"),
        ("full_attn_layers", full, "full_attention"),
    ):
        bad = not isinstance(listed, list) or any(
            not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= n for x in listed
        )
        if bad:
            raise ValueError(
                f"{r.where}: linear_attn_config.{name}={listed!r}: expected a list of 1-based "
                f"layer numbers in [1, num_hidden_layers={n}]"
            )
        for x in listed:
            if types[x - 1] is not None:
                raise ValueError(
                    f"{r.where}: linear_attn_config lists layer {x - 1} (0-based) twice (in "
                    "kda_layers and full_attn_layers, or twice in one); expected each layer once"
                )
            types[x - 1] = value
    missing = [i for i, t in enumerate(types) if t is None]
    if missing:
        raise ValueError(
            f"{r.where}: linear_attn_config's kda_layers and full_attn_layers leave layers "
            f"{_ranges(missing)} (0-based) out; expected every layer in one of them"
        )
    return [str(t) for t in types]


def _kimi_linear(r: _Reader, o: _Options) -> _Parsed:
    """Kimi-Linear: Kimi Delta Attention layers and MLA layers by layer type.

    KDA: q, k, v of ``num_heads`` heads of ``head_dim`` each (``linear_attn_config``, which
    transformers prefers, else ``linear_num_heads`` / ``linear_head_dim``), one short conv over
    q|k|v, per-channel decay, q and k L2-normalised in the kernel, a float32 state. MLA: the
    DeepSeek fields with no positional encoding at all (transformers' Kimi-Linear applies no
    rope, ``mla_use_nope``), so no YaRN temperature either.
    """
    n = r.pos_int("num_hidden_layers")
    types = _kimi_types(r, n)
    _check_types(r, types, {"full_attention", "linear_attention"})
    if r.cfg.get("mla_use_nope", True) is not True:
        raise ValueError(
            f"{r.where}: mla_use_nope={r.cfg['mla_use_nope']!r} (rope on the MLA layers "
            f"{_layers_of(types, 'full_attention')}): transformers' Kimi-Linear applies no rope, "
            "so what the model computes is ambiguous; expected true"
        )
    lac = _mapping(r, "linear_attn_config")
    lin = _Reader(
        lac,
        f"{r.where} linear_attn_config",
        {
            "num_heads": r.cfg.get("linear_num_heads", 32),
            "head_dim": r.cfg.get("linear_head_dim", 128),
            "short_conv_kernel_size": r.cfg.get("linear_conv_kernel_dim", 4),
        },
    )
    heads = _split(lin.pos_int("num_heads"), o.tp_size, "linear_attn_config.num_heads")
    dim = lin.pos_int("head_dim")
    kda = o.linear(
        linear_variant=LinearVariant.KDA,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=dim,
        head_dim_v=dim,
        conv_kernel_size=lin.pos_int("short_conv_kernel_size"),
        conv_channels=3 * heads * dim,  # the conv runs over q, k and v
        qk_l2norm=True,
        state_dtype="float32",
    )
    mla = _mla(r, o, yarn_scale=False)
    return n, [(i, mla if t == "full_attention" else kda) for i, t in enumerate(types)], {}


def _mamba2(
    r: _Reader,
    o: _Options,
    *,
    n_heads: str,
    d_head: int,
    n_groups: str,
    d_state: str,
    d_conv: str,
) -> LayerSpec:
    heads = _split(r.pos_int(n_heads), o.tp_size, n_heads)
    groups = _split_or_replicate(r.pos_int(n_groups), o.tp_size, n_groups)
    state = r.pos_int(d_state)
    state_dtype = r.cfg.get("mamba_ssm_cache_dtype") or "float32"
    if state_dtype == "auto":  # vLLM: "auto" keeps the SSM state in the model dtype
        state_dtype = o.dtype
    return o.linear(
        linear_variant=LinearVariant.MAMBA2,
        num_heads=heads,
        num_kv_heads=groups,
        head_dim=state,
        head_dim_v=d_head,
        conv_kernel_size=r.pos_int(d_conv),
        # The conv runs over x (heads * d_head channels) and B, C (groups * d_state each).
        conv_channels=heads * d_head + 2 * groups * state,
        state_dtype=state_dtype,
    )


def _mamba_prefixed_mamba2(r: _Reader, o: _Options, *, auto: tuple[Any, ...]) -> LayerSpec:
    """The Mamba2 mixer of configs that name its fields ``mamba_*`` (Bamba, Granite-4.0-H):
    ``mamba_d_head`` in ``auto`` means the inner width ``mamba_expand * hidden_size`` split over
    ``mamba_n_heads``; any other value must split it exactly."""
    inner = r.pos_int("mamba_expand") * r.pos_int("hidden_size")
    d_head = r.cfg.get("mamba_d_head", "auto")
    if d_head in auto:
        d_head = inner // r.pos_int("mamba_n_heads")
    if not isinstance(d_head, int) or d_head * r.pos_int("mamba_n_heads") != inner:
        raise ValueError(
            f"{r.where}: mamba_d_head={d_head!r} * mamba_n_heads={r.get('mamba_n_heads')} must "
            f"equal mamba_expand * hidden_size = {inner}"
        )
    return _mamba2(
        r,
        o,
        n_heads="mamba_n_heads",
        d_head=d_head,
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
    )


def _bamba(r: _Reader, o: _Options) -> _Parsed:
    """Bamba: Mamba2 layers with full attention at ``attn_layer_indices``."""
    n = r.pos_int("num_hidden_layers")
    attn = set(_int_list(r, "attn_layer_indices", "0-based layer indices"))
    bad = sorted(i for i in attn if not 0 <= i < n)
    if bad:
        raise ValueError(f"{r.where}: attn_layer_indices {bad} are not layers of 0..{n - 1}")
    _refuse_dt_clamp(r, [i for i in range(n) if i not in attn])
    mamba = _mamba_prefixed_mamba2(r, o, auto=("auto",))  # as BambaConfig
    full = o.full(**_gqa(r, o, _head_dim(r)))
    return n, [(i, full if i in attn else mamba) for i in range(n)], {}


def _granite_hybrid(r: _Reader, o: _Options) -> _Parsed:
    """Granite-4.0-H (``granitemoehybrid``): Mamba2 and attention layers by ``layer_types``
    (``mamba`` / ``attention`` in hub configs, ``linear_attention`` / ``full_attention`` as
    transformers writes them; all Mamba2 when absent, as GraniteMoeHybridConfig). The softmax
    scale is ``attention_multiplier`` (1.0 when absent, as the class); the embedding, residual
    and logits multipliers and RoPE or NoPE (``position_embedding_type``) act outside the
    attention op."""
    n = r.pos_int("num_hidden_layers")
    key = "layer_types" if r.cfg.get("layer_types") else "layers_block_type"
    raw = r.cfg.get(key)
    if raw is not None and not isinstance(raw, list):  # a string would map every layer Mamba2
        raise ValueError(
            f"{r.where}: config field {key}={raw!r}: expected a list of {n} layer types "
            f"('mamba' / 'attention'), got {type(raw).__name__}"
        )
    types = list(raw) if raw else ["linear_attention"] * n
    if len(types) != n:
        raise ValueError(f"{r.where}: layer_types has {len(types)} entries; expected {n}")
    _check_types(r, types, {"mamba", "attention", "linear_attention", "full_attention"})
    attention = {"attention", "full_attention"}
    _refuse_dt_clamp(r, [i for i, t in enumerate(types) if t not in attention])
    mamba = _mamba_prefixed_mamba2(r, o, auto=("auto", None))  # as GraniteMoeHybridConfig
    scale = _attention_multiplier(r)
    full = o.full(softmax_scale=None if scale is None else float(scale), **_gqa(r, o, _head_dim(r)))
    return n, [(i, full if t in attention else mamba) for i, t in enumerate(types)], {}


def _falcon_h1(r: _Reader, o: _Options) -> _Parsed:
    """Falcon-H1: every decoder layer runs a Mamba2 mixer and GQA attention side by side on
    the same normed input and adds their outputs (a parallel hybrid: two ops per layer, one
    in the ``linear`` group, one in the ``full`` group).

    The Mamba2 op is attn-core's: conv over x|B|C, ``D`` skip, ``softplus(dt + dt_bias)``.
    Its inner width is ``mamba_d_ssm`` (``mamba_expand * hidden_size`` when null), split into
    ``mamba_n_heads`` heads of ``mamba_d_head`` (``"auto"``: the width over the heads). What
    FalconH1Mixer does beyond Bamba's mixer acts outside the op and stays the model's: the
    input times ``ssm_in_multiplier``, ``in_proj``'s z|x|B|C|dt output times the muP vector
    (``ssm_multipliers``, so ``dt`` and the conv input are already scaled when they reach
    the op), and after the op either the gated RMSNorm over ``mamba_n_groups`` groups
    (``mamba_rms_norm``, normalising before or after the ``silu(z)`` gate by
    ``mamba_norm_before_gate``) or the plain ``silu(z)`` gate; ``mamba_chunk_size`` only tiles
    transformers' scan. A lower ``time_step_limit`` is folded into ``dt`` by the adapter; an
    upper one has no op input and is refused.

    The attention's softmax scale is ``head_dim ** -0.5``; ``key_multiplier`` scales k before
    rope and the cache (the op sees scaled keys), ``attention_in_multiplier`` the attention's
    input, ``attention_out_multiplier`` / ``ssm_out_multiplier`` the two branches' outputs,
    and the embedding, MLP and ``lm_head`` multipliers act outside both ops.
    """
    n = r.pos_int("num_hidden_layers")
    types = _layer_types(r, n, lambda i: "hybrid")
    _check_types(r, types, {"hybrid"})
    every = f"layers {_ranges(range(n))}"
    _refuse_dt_clamp(r, range(n))
    mup = r.cfg.get("ssm_multipliers")
    if mup is not None and (not isinstance(mup, list) or len(mup) != 5):
        raise ValueError(
            f"{r.where}: ssm_multipliers={mup!r} in the Mamba2 ops of {every}: expected 5 "
            "multipliers, of in_proj's z, x, B, C and dt sections"
        )
    d_ssm = r.get("mamba_d_ssm")
    if d_ssm is None:
        d_ssm = r.pos_int("mamba_expand") * r.pos_int("hidden_size")
    elif not isinstance(d_ssm, int) or isinstance(d_ssm, bool) or d_ssm <= 0:
        raise ValueError(f"{r.where}: mamba_d_ssm={d_ssm!r}: expected a positive int or null")
    heads = r.pos_int("mamba_n_heads")
    d_head = r.get("mamba_d_head")
    if d_head in ("auto", None):
        d_head = d_ssm // heads
    if not isinstance(d_head, int) or isinstance(d_head, bool) or d_head * heads != d_ssm:
        raise ValueError(
            f"{r.where}: mamba_d_head={d_head!r} * mamba_n_heads={heads} must equal the Mamba2 "
            f"inner width {d_ssm} (mamba_d_ssm, or mamba_expand * hidden_size when null)"
        )
    mamba = _mamba2(
        r,
        o,
        n_heads="mamba_n_heads",
        d_head=d_head,
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
    )
    full = o.full(**_gqa(r, o, _head_dim(r)))
    # the model's order within a layer: the Mamba2 branch, then the attention branch
    return n, [op for i in range(n) for op in ((i, mamba), (i, full))], {}


def _refuse_dt_clamp(
    r: _Reader, mamba_layers: Sequence[int], name: str = "time_step_limit"
) -> None:
    """A Mamba2 mixer's ``time_step_limit`` (``name``): ``[lo, inf]`` with ``0 <= lo`` maps (the
    model's adapter folds a lower bound into dt); an upper clamp on ``softplus(dt + dt_bias)``
    has no Mamba2 op input, so it is refused here rather than when the model runs."""
    limit = r.cfg.get(name)
    if limit is None or not mamba_layers:
        return
    where = f"the Mamba2 ops of layer{'s' if len(mamba_layers) > 1 else ''} {_ranges(mamba_layers)}"
    pair = limit if isinstance(limit, (list, tuple)) and len(limit) == 2 else (None, None)
    lo, hi = (_decoded_float(v) for v in pair)
    if lo is None or hi is None or lo < 0:
        raise ValueError(f"{r.where}: {name}={limit!r} in {where}: expected [lo, hi] with 0 <= lo")
    if hi != math.inf:
        raise ValueError(
            f"{r.where}: {name}={limit!r} in {where}: an upper clamp on softplus(dt + dt_bias) "
            "that no Mamba2 op input describes (expected [lo, inf]; a lower bound is folded into "
            "dt by the model's adapter); refused, not mapped in part"
        )


def _decoded_float(value: Any) -> float | None:
    """A config float, with transformers' JSON tag for infinity (``{"__float__":
    "Infinity"}``) decoded; None for anything else."""
    if isinstance(value, dict) and value.get("__float__") in ("Infinity", "inf"):
        return math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# FalconH1Config's defaults (transformers 5.24) of the fields the mapping reads: hub configs
# may omit them. A test keeps this table equal to the class.
_FALCON_H1_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_d_ssm": 1024,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


# -- Mamba1 (Jamba, Falcon-Mamba, Mamba) ------------------------------------------------------
def _mamba1(r: _Reader, o: _Options, *, expand: str, d_state: str, d_conv: str) -> LayerSpec:
    """One Mamba1 mixer: one head per inner channel, ``d_inner = expand * hidden_size``.

    Tensor parallelism splits the inner channels (in_proj column-parallel, out_proj row-parallel,
    as vLLM's MambaMixer); the conv and the scan then run on the rank's channels only.
    """
    inner = r.pos_int(expand) * r.pos_int("hidden_size")
    channels = _split(inner, o.tp_size, f"{expand} * hidden_size")
    state_dtype = r.cfg.get("mamba_ssm_cache_dtype") or "float32"
    if state_dtype == "auto":  # vLLM: "auto" keeps the SSM state in the model dtype
        state_dtype = o.dtype
    return o.linear(
        linear_variant=LinearVariant.MAMBA1,
        num_heads=channels,
        num_kv_heads=1,  # B and C: one d_state vector per token, shared by every channel
        head_dim=r.pos_int(d_state),
        head_dim_v=1,
        conv_kernel_size=r.pos_int(d_conv),
        conv_channels=channels,  # the conv runs over x only; B, C, dt come from x_proj after it
        state_dtype=state_dtype,
    )


def _jamba(r: _Reader, o: _Options) -> _Parsed:
    """Jamba: Mamba1 layers, full attention (no positional encoding) once every
    ``attn_layer_period`` layers at ``attn_layer_offset``; its MoE is model side."""
    n = r.pos_int("num_hidden_layers")
    period = r.pos_int("attn_layer_period")
    offset = r.get("attn_layer_offset")
    if not (isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset < period):
        raise ValueError(
            f"{r.where}: config field attn_layer_offset={offset!r}: expected an int in "
            f"0..attn_layer_period-1 = 0..{period - 1}"
        )
    mamba = _mamba1(r, o, expand="mamba_expand", d_state="mamba_d_state", d_conv="mamba_d_conv")
    full = o.full(**_gqa(r, o, _head_dim(r)))
    return n, [(i, full if i % period == offset else mamba) for i in range(n)], {}


def _falcon_mamba(r: _Reader, o: _Options) -> _Parsed:
    """Falcon-Mamba and Mamba: a Mamba1 mixer in every layer (Falcon-Mamba's weightless RMS
    norms on B / C / dt are model side, as are the projections and the z gate)."""
    n = r.pos_int("num_hidden_layers")
    inner = r.pos_int("expand") * r.pos_int("hidden_size")
    declared = r.cfg.get("intermediate_size")
    if declared is not None and declared != inner:
        # transformers re-derives intermediate_size from expand (Jamba's is the MLP's width); a
        # config where they disagree describes a model other than the one it builds
        raise ValueError(
            f"{r.where}: intermediate_size={declared} but expand * hidden_size = {inner}; "
            "transformers builds the mixer from expand"
        )
    mamba = _mamba1(r, o, expand="expand", d_state="state_size", d_conv="conv_kernel")
    return n, [(i, mamba) for i in range(n)], {}


# transformers' config defaults (JambaConfig, FalconMambaConfig / MambaConfig): hub configs
# written by older releases leave some of these out.
_JAMBA_DEFAULTS: dict[str, Any] = {
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
_MAMBA1_DEFAULTS: dict[str, Any] = {"state_size": 16, "expand": 2, "conv_kernel": 4}


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h(r: _Reader, o: _Options) -> _Parsed:
    """Nemotron-H: ``hybrid_override_pattern`` of M (Mamba2), * (attention), - (MLP), E (MoE)."""
    pattern = r.cfg.get("hybrid_override_pattern")
    if pattern is not None:
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise ValueError(
                f"{r.where}: hybrid_override_pattern has {bad}; "
                f"allowed: {sorted(_NEMOTRON_PATTERN)}"
            )
        types = [_NEMOTRON_PATTERN[c] for c in pattern]
        listed = r.cfg.get("layers_block_type")
        if isinstance(listed, list) and listed != types:
            wrong = [i for i, t in enumerate(types) if i >= len(listed) or listed[i] != t]
            i = wrong[0]
            raise ValueError(
                f"{r.where}: hybrid_override_pattern and layers_block_type disagree in "
                f"layer{'s' if len(wrong) > 1 else ''} {_ranges(wrong)} (layer {i}: "
                f"pattern {pattern[i]!r} = {types[i]}, layers_block_type "
                f"{listed[i] if i < len(listed) else 'nothing'!r}); "
                f"which one describes the model?"
            )
    else:  # transformers 5 serialises the list instead
        types = list(r.get("layers_block_type"))
        _check_types(r, types, set(_NEMOTRON_PATTERN.values()))
    n = len(types)
    declared = r.cfg.get("num_hidden_layers")
    if declared is not None and declared != n:
        raise ValueError(
            f"{r.where}: num_hidden_layers={declared} but the layer pattern has {n} layers"
        )
    # NemotronHConfig takes a legacy mamba_dt_limit, when given, as its time_step_limit
    limit = "mamba_dt_limit" if "mamba_dt_limit" in r.cfg else "time_step_limit"
    _refuse_dt_clamp(r, [i for i, t in enumerate(types) if t == "linear_attention"], limit)
    mamba = _mamba2(
        r,
        o,
        n_heads="mamba_num_heads",
        d_head=r.pos_int("mamba_head_dim"),
        n_groups="n_groups",
        d_state="ssm_state_size",
        d_conv="conv_kernel",
    )
    # head_dim, 128 when absent (NemotronHConfig's): the class has no attention_head_dim
    # (NVIDIA's original configs' name), so the model transformers builds never reads it
    full = o.full(**_gqa(r, o, _head_dim(r)))
    by_type = {"linear_attention": mamba, "full_attention": full}
    return n, [(i, by_type[t]) for i, t in enumerate(types) if t in by_type], {}


# -- lightning attention (MiniMax-01) and the gated short conv (LFM2) --------------------------
def _minimax_types(r: _Reader, n: int) -> list[str]:
    """``layer_types`` (transformers' MiniMaxConfig) or the hub configs' ``attn_type_list``
    (0: lightning attention, 1: softmax attention; read for their own model types only:
    MiniMaxConfig never reads it); transformers' default alternates."""
    listed = r.cfg.get("attn_type_list")
    if r.cfg.get("model_type") == "minimax":
        listed = None  # MiniMaxConfig derives layer_types by its own rule instead
    if r.cfg.get("layer_types") is None and listed is not None:
        if not isinstance(listed, list) or len(listed) != n or set(listed) - {0, 1}:
            raise ValueError(
                f"{r.where}: attn_type_list={listed!r}: expected num_hidden_layers={n} entries "
                f"of 0 (lightning attention) or 1 (softmax attention)"
            )
        return ["full_attention" if t == 1 else "linear_attention" for t in listed]
    types = _layer_types(r, n, lambda i: "full_attention" if (i + 1) % 2 else "linear_attention")
    _check_types(r, types, {"full_attention", "linear_attention"})
    return types


def _minimax(r: _Reader, o: _Options) -> _Parsed:
    """MiniMax-Text-01 / MiniMax-M1: lightning attention layers (linear attention with a fixed
    per-head decay, no conv) and softmax GQA layers, per ``layer_types`` / ``attn_type_list``.

    Lightning attention has one key head per value head (``num_attention_heads`` of
    ``head_dim``); its per-head slopes depend on the layer index and are the model's input
    (``slope``), not part of the spec. ``rotary_dim`` and the residual alpha / beta factors
    are outside the attention op.
    """
    n = r.pos_int("num_hidden_layers")
    types = _minimax_types(r, n)
    window = r.cfg.get("sliding_window")
    if window is not None:
        # transformers slides the layers its layer_types calls full_attention; no released
        # MiniMax checkpoint sets a window, and a window on "full" layers contradicts them
        raise ValueError(
            f"{r.where}: sliding_window={window!r} on the softmax layers "
            f"({_layers_of(types, 'full_attention')}), which layer_types calls full_attention: "
            f"refused rather than mapped either way (the released configs set null)"
        )
    head_dim = _head_dim(r)
    full = o.full(**_gqa(r, o, head_dim))
    heads = _split(r.pos_int("num_attention_heads"), o.tp_size, "num_attention_heads")
    lightning = o.linear(
        linear_variant=LinearVariant.LIGHTNING,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        head_dim_v=head_dim,
        state_dtype="float32",
    )
    return n, [(i, full if t == "full_attention" else lightning) for i, t in enumerate(types)], {}


def _lfm2(r: _Reader, o: _Options) -> _Parsed:
    """LFM2, LFM2-MoE and LFM3: gated short-conv layers (``conv``: a causal depthwise conv over
    ``hidden_size`` channels, conv state only) and GQA layers, per ``layer_types``, else as the
    config class derives them (LFM2: ``full_attn_idxs``; LFM3: its own pattern; LFM2-MoE
    derives none and is refused without them); LFM3's ``sliding_attention`` layers slide over
    ``sliding_window`` (its attention gate and sandwich norms act outside the op); LFM2 and
    LFM2-MoE have no sliding layers, so such a layer type is refused for them.

    Under tensor parallelism the conv's channels split across ranks, as its in / out
    projections do.
    """
    n = r.pos_int("num_hidden_layers")
    model_type = r.cfg.get("model_type")
    if model_type == "lfm2_moe" and r.cfg.get("layer_types") is None:
        # transformers' Lfm2MoeModel indexes config.layer_types, which its config class
        # leaves None (it reads no full_attn_idxs): which layers are conv is not known
        raise ValueError(
            f"{r.where}: layers {_ranges(range(n))}: no layer_types, and Lfm2MoeConfig derives "
            f"none (Lfm2Config derives them from full_attn_idxs; Lfm2MoeConfig reads no such "
            f"field and transformers cannot build the model); expected a list of {n} of "
            f"['conv', 'full_attention'], got {r.cfg.get('layer_types')!r}"
        )
    if model_type == "lfm3":
        # Lfm3Config's own default: full attention every 4th layer from layer 2, sliding
        # every 4th from layer 4, the short conv elsewhere
        def fallback(i: int) -> str:
            if i % 4 == 2:
                return "full_attention"
            return "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
    else:
        attn: set[int] = set()
        if r.cfg.get("layer_types") is None:  # Lfm2Config reads full_attn_idxs only then
            listed = _int_list(r, "full_attn_idxs", "0-based indices of the attention layers")
            # absent or null: Lfm2Config's default, every layer full attention
            attn = set(range(n)) if r.cfg.get("full_attn_idxs") is None else set(listed)

        def fallback(i: int) -> str:
            return "full_attention" if i in attn else "conv"

    types = _layer_types(r, n, fallback)
    # LFM3 alone has sliding layers: Lfm2Model and Lfm2MoeModel build masks for
    # full_attention and conv layers only (a sliding_attention layer fails there)
    slides = {"sliding_attention"} if model_type == "lfm3" else set()
    _check_types(r, types, {"full_attention", "conv"} | slides)
    channels = _split(r.pos_int("hidden_size"), o.tp_size, "hidden_size")
    heads = _gqa(r, o, _head_dim(r))
    full = o.full(**heads)
    if "sliding_attention" in types:
        sliding = o.full(sliding_window=r.pos_int("sliding_window"), **heads)
    conv = o.linear(
        linear_variant=LinearVariant.SHORT_CONV,
        num_heads=1,
        num_kv_heads=1,
        head_dim=channels,
        conv_kernel_size=r.pos_int("conv_L_cache", 3),
        conv_channels=channels,
    )
    by_type = {"full_attention": full, "conv": conv}
    if "sliding_attention" in types:
        by_type["sliding_attention"] = sliding
    return n, [(i, by_type[t]) for i, t in enumerate(types)], {}


def _gpt_oss(r: _Reader, o: _Options) -> _Parsed:
    """gpt-oss: alternating sliding / full attention, learned sinks on every layer."""
    n = r.pos_int("num_hidden_layers")
    types = _layer_types(r, n, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    _check_types(r, types, {"full_attention", "sliding_attention"})
    heads = _gqa(r, o, _head_dim(r))
    window = r.pos_int("sliding_window")
    layers = []
    for i, t in enumerate(types):
        sw = window if t == "sliding_attention" else None
        layers.append((i, o.full(sliding_window=sw, has_sinks=True, **heads)))
    return n, layers, {}


# Gemma3TextConfig's defaults (transformers 5.24): Gemma-3 multimodal configs omit most fields
# of their text_config and rely on them. A test keeps this table equal to the class.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
}


def _gemma3(r: _Reader, o: _Options) -> _Parsed:
    """Gemma-3 text: 5 local (sliding) : 1 global layers, scale from query_pre_attn_scalar;
    ``attn_logit_softcapping`` is not applied (transformers' Gemma-3 ignores it)."""
    n = r.pos_int("num_hidden_layers")
    if r.cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{r.where}: use_bidirectional_attention=True is not supported")
    pattern = r.pos_int("sliding_window_pattern")
    types = _layer_types(
        r, n, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"
    )
    _check_types(r, types, {"full_attention", "sliding_attention"})
    heads = _gqa(r, o, r.pos_int("head_dim"))
    window = r.pos_int("sliding_window")
    scalar = r.get("query_pre_attn_scalar")
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"{r.where}: query_pre_attn_scalar={scalar!r}: expected a positive number")
    # attn_logit_softcapping is not mapped: transformers' Gemma3Attention stores it but never
    # passes it to the attention function (Gemma-2 does), so Gemma-3 computes uncapped logits
    # whatever the config says; mapping it made attn-core cap what the model does not.
    layers = []
    for i, t in enumerate(types):
        sw = window if t == "sliding_attention" else None
        spec = o.full(
            sliding_window=sw,
            softmax_scale=float(scalar) ** -0.5,
            **heads,
        )
        layers.append((i, spec))
    return n, layers, {}


def _qwen2_5_vl_vision(r: _Reader, o: _Options) -> _Parsed:
    """Qwen2.5-VL's vision tower: bidirectional varlen encoder attention on every block."""
    n = r.pos_int("depth")
    heads = r.pos_int("num_heads")
    per_rank = _split(heads, o.tp_size, "vision_config.num_heads")
    spec = o.full(
        kind=LayerKind.ENCODER,
        num_heads=per_rank,
        num_kv_heads=per_rank,
        head_dim=r.pos_int("hidden_size") // heads,
        causal=False,
    )
    full_blocks = tuple(_int_list(r, "fullatt_block_indexes", "0-based block indices"))
    bad = [i for i in full_blocks if not 0 <= i < n]
    if bad:
        raise ValueError(f"{r.where}: fullatt_block_indexes {bad} are not blocks of 0..{n - 1}")
    return n, [(i, spec) for i in range(n)], {"encoder_full_attention_layers": full_blocks}


def _encoder_tower(r: _Reader, o: _Options, depth: str, heads_key: str, width: str) -> _Parsed:
    """A vision tower whose every block is the same bidirectional encoder attention over each
    image's patches (no window pattern): ``depth`` blocks of ``heads_key`` heads of
    ``width // heads`` (transformers: ``head_dim = width // num_heads``)."""
    n = r.pos_int(depth)
    heads = r.pos_int(heads_key)
    dim = r.pos_int(width)
    if dim % heads:
        raise ValueError(f"{r.where}: {width}={dim} is not a multiple of {heads_key}={heads}")
    per_rank = _split(heads, o.tp_size, heads_key)
    spec = o.full(
        kind=LayerKind.ENCODER,
        num_heads=per_rank,
        num_kv_heads=per_rank,
        head_dim=dim // heads,
        causal=False,
    )
    return n, [(i, spec) for i in range(n)], {}


def _siglip_vision(r: _Reader, o: _Options) -> _Parsed:
    """SigLIP's vision tower: every encoder layer non-causal attention over one image's
    patches (all images have the same patch count)."""
    return _encoder_tower(r, o, "num_hidden_layers", "num_attention_heads", "hidden_size")


def _qwen2_vl_vision(r: _Reader, o: _Options) -> _Parsed:
    """Qwen2-VL's vision tower: every block full attention within each image (varlen, no
    windows); its width is ``embed_dim`` (``hidden_size`` is the merger's output width)."""
    return _encoder_tower(r, o, "depth", "num_heads", "embed_dim")


def _qwen3_vision(r: _Reader, o: _Options) -> _Parsed:
    """Qwen3-VL's and Qwen3.5's vision towers (and their MoE forms'): every block full
    attention within each image frame (varlen, no windows) over ``hidden_size // num_heads``
    heads. Qwen3-VL's DeepStack mergers read the hidden states after the blocks of
    ``deepstack_visual_indexes`` (transformers skips an index past the last block): outside the
    attention op, which is the same in every block either way."""
    return _encoder_tower(r, o, "depth", "num_heads", "hidden_size")


def _qwen3_vl_text(r: _Reader, o: _Options) -> _Parsed:
    """Qwen3-VL's language model (``qwen3_vl_text`` / ``qwen3_vl_moe_text``): Qwen3's GQA on
    every layer, full causal attention (its attention module passes no window and its mask is
    causal whatever the config says); q / k norms and the interleaved M-RoPE act outside the
    op."""
    n = r.pos_int("num_hidden_layers")
    types = _layer_types(r, n, lambda i: "full_attention")
    _check_types(r, types, {"full_attention"})
    spec = o.full(**_gqa(r, o, r.pos_int("head_dim")))
    return n, [(i, spec) for i in range(n)], {}


# WhisperConfig.attribute_map: the common names it maps onto its own fields (transformers 5.24;
# given both, the common name wins). A test keeps this table equal to the class's.
_WHISPER_ALIASES: dict[str, str] = {
    "num_hidden_layers": "encoder_layers",
    "num_attention_heads": "encoder_attention_heads",
    "num_key_value_heads": "encoder_attention_heads",
    "hidden_size": "d_model",
}
# WhisperConfig's defaults for the fields the encoder mapping reads (transformers 5.24).
_WHISPER_DEFAULTS: dict[str, Any] = {
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "d_model": 384,
}


def _whisper_encoder(r: _Reader, o: _Options) -> _Parsed:
    """Whisper's encoder: every layer non-causal self-attention over one clip's
    ``max_source_positions`` frames; ``encoder_attention_heads`` heads of
    ``d_model // heads`` (transformers scales q by ``head_dim ** -0.5`` before the op, which
    calls it with scale 1: the same softmax as the default scale)."""
    for alias, name in _WHISPER_ALIASES.items():
        given, own = r.cfg.get(alias), r.cfg.get(name)
        if given is not None and own is not None and given != own:
            raise ValueError(
                f"{r.where}: {alias}={given!r} and {name}={own!r} disagree; WhisperConfig maps "
                f"{alias} onto {name} (the former wins): expected equal values"
            )
    # the alias stands for the field where the config has only the alias
    fields_ = dict(r.cfg)
    for alias, name in _WHISPER_ALIASES.items():
        if fields_.get(name) is None and fields_.get(alias) is not None:
            fields_[name] = fields_[alias]
    reader = _Reader(fields_, r.where, r.defaults)
    return _encoder_tower(reader, o, "encoder_layers", "encoder_attention_heads", "d_model")


@dataclass(frozen=True, slots=True)
class _Family:
    name: str  # sample name
    parse: Callable[[_Reader, _Options], _Parsed]
    # model_type -> the transformers class name, used when the config has no "architectures"
    model_types: Mapping[str, str]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # A multi-stack model (a vision tower and a language model, an encoder and a decoder): the
    # whole config -> its stacks; None: one stack, read by ``parse``.
    stacks: Callable[[Mapping[str, Any], str], list[_StackPart]] | None = None


@dataclass(frozen=True, slots=True)
class _StackPart:
    """One stack of a multi-stack config: its name, the sub-config and the family reading it,
    or, when no layer kind describes it, ``refusal`` (why) and no family."""

    name: str  # "vision", "text", "encoder", "decoder"
    config: Mapping[str, Any]
    family: _Family | None
    refusal: str = ""
    dtype_first: bool = True  # the stack's own dtype field before the whole config's


def _refuse_parse(r: _Reader, o: _Options) -> _Parsed:
    raise AssertionError(f"{r.where}: a multi-stack family has no single-stack parser")


# SiglipVisionConfig's defaults (transformers 5.24): Gemma-3's vision_config may omit them.
_SIGLIP_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "hidden_size": 768,
}
_SIGLIP = _Family(
    "siglip-vision",
    _siglip_vision,
    {"siglip_vision_model": "SiglipVisionModel"},
    _SIGLIP_DEFAULTS,
)
_QWEN2_VL_VISION = _Family(
    "qwen2-vl-vision",
    _qwen2_vl_vision,
    {"qwen2_vl_vision": "Qwen2VisionTransformerPretrainedModel"},
)
_QWEN2_5_VL_VISION = _Family(
    "qwen2.5-vl-vision",
    _qwen2_5_vl_vision,
    {"qwen2_5_vl_vision": "Qwen2_5_VisionTransformerPretrainedModel"},
)
# Qwen3VLVisionConfig's defaults (transformers 5.24) for the fields the tower mappings read;
# Qwen3_5VisionConfig's are the same.
_QWEN3_VISION_DEFAULTS: dict[str, Any] = {"depth": 27, "hidden_size": 1152, "num_heads": 16}
# Two families of one mapping: Qwen3-VL's tower has DeepStack mergers (its runs compare their
# features too), Qwen3.5's has none.
_QWEN3_VL_VISION = _Family(
    "qwen3-vl-vision",
    _qwen3_vision,
    {
        "qwen3_vl_vision": "Qwen3VLVisionModel",
        "qwen3_vl_moe_vision": "Qwen3VLMoeVisionModel",
    },
    _QWEN3_VISION_DEFAULTS,
)
_QWEN3_5_VISION = _Family(
    "qwen3.5-vision",
    _qwen3_vision,
    {"qwen3_5_vision": "Qwen3_5VisionModel", "qwen3_5_moe_vision": "Qwen3_5MoeVisionModel"},
    _QWEN3_VISION_DEFAULTS,
)
# Qwen3VLTextConfig's defaults (transformers 5.24) for the fields the mapping reads.
_QWEN3_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
}
_QWEN3_VL_TEXT = _Family("qwen3-vl-text", _qwen3_vl_text, {}, _QWEN3_VL_TEXT_DEFAULTS)
# The language model of Qwen2-VL / Qwen2.5-VL: Qwen2's GQA (sliding only with
# use_sliding_window, from max_window_layers on); M-RoPE acts on q and k outside the op.
_QWEN_VL_TEXT = _Family("qwen2-vl-text", _dense, {})
_GEMMA3_TEXT = _Family(
    "gemma-3",
    _gemma3,
    {"gemma3_text": "Gemma3ForCausalLM"},
    _GEMMA3_DEFAULTS,
)
# Llama4VisionConfig's defaults (transformers 5.24) for the fields the tower mapping reads.
_LLAMA4_VISION_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 34,
    "num_attention_heads": 16,
    "hidden_size": 768,
}


# Llama-4's vision encoder: every layer bidirectional attention within each image tile (its
# class token and patches; 2D rotary on q and k outside the op). transformers' eager function
# applies no mask (its module sets no is_causal), as the reference implementation.
def _llama4_vision(r: _Reader, o: _Options) -> _Parsed:
    """Llama-4's vision encoder: ``num_hidden_layers`` layers of ``num_attention_heads`` heads
    of ``hidden_size // heads``, non-causal."""
    return _encoder_tower(r, o, "num_hidden_layers", "num_attention_heads", "hidden_size")


_LLAMA4_VISION = _Family("llama-4-vision", _llama4_vision, {}, _LLAMA4_VISION_DEFAULTS)
_LLAMA4_TEXT = _Family("llama-4", _llama4, {"llama4_text": "Llama4ForCausalLM"})


def _llama4_stacks(raw: Mapping[str, Any], model_type: str) -> list[_StackPart]:
    """Llama-4 multimodal: the vision tower (``vision_config``; transformers fills an absent
    one with Llama4VisionConfig's defaults) and the language model (``text_config``)."""
    vision = raw.get("vision_config")
    text = _sub_config(raw, "text_config", model_type)
    return [
        _StackPart("vision", dict(vision) if isinstance(vision, Mapping) else {}, _LLAMA4_VISION),
        _StackPart("text", text, _LLAMA4_TEXT),
    ]


_WHISPER_ENCODER = _Family("whisper-encoder", _whisper_encoder, {}, _WHISPER_DEFAULTS)

# Keys of a flat (hub-style) Qwen-VL config that are not its language model's.
_QWEN_VL_NOT_TEXT = frozenset({"vision_config", "text_config", "architectures"})


def _qwen_vl_stacks(
    raw: Mapping[str, Any], model_type: str, tower: _Family, text_family: _Family
) -> list[_StackPart]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 (and their MoE forms): the vision tower
    (``vision_config``) and the language model (``text_config``, or, in the hub's flat form
    that transformers also reads, the top-level fields)."""
    vision = _sub_config(raw, "vision_config", model_type)
    text_sub = raw.get("text_config")
    if isinstance(text_sub, Mapping):
        text = dict(text_sub)
    else:
        text = {k: v for k, v in raw.items() if k not in _QWEN_VL_NOT_TEXT}
    text.setdefault("model_type", f"{model_type}_text")
    return [
        _StackPart("vision", vision, tower, dtype_first=False),
        _StackPart("text", text, text_family),
    ]


def _gemma3_stacks(raw: Mapping[str, Any], model_type: str) -> list[_StackPart]:
    """Gemma-3 multimodal: the SigLIP vision tower (``vision_config``; transformers fills an
    absent one with SiglipVisionConfig's defaults) and the language model (``text_config``)."""
    vision = raw.get("vision_config")
    text = _sub_config(raw, "text_config", model_type)
    return [
        _StackPart("vision", dict(vision) if isinstance(vision, Mapping) else {}, _SIGLIP),
        _StackPart("text", text, _GEMMA3_TEXT),
    ]


# CLIPVisionConfig's defaults (transformers 5.24): a LLaVA vision_config given without them
# gets these (LlavaConfig's own tower defaults apply only to an absent vision_config).
_CLIP_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "hidden_size": 768,
}
# LlavaConfig's vision_config when the config has none (its sub_configs_defaults, 5.24;
# LlavaNextConfig's are the same).
_LLAVA_VISION: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "hidden_size": 1024,
}


def _clip_vision(r: _Reader, o: _Options) -> _Parsed:
    """CLIP's vision tower: every encoder layer non-causal attention over one image's class
    token and patches (all images the same count); ``hidden_size // num_attention_heads``
    heads. The embeddings and pre-layernorm act before the first layer, outside the op.
    LLaVA's ``vision_feature_layer`` picks one hidden state, but every layer runs (the ones
    after it too), so every layer is mapped."""
    return _encoder_tower(r, o, "num_hidden_layers", "num_attention_heads", "hidden_size")


_CLIP = _Family(
    "clip-vision",
    _clip_vision,
    {"clip_vision_model": "CLIPVisionModel"},
    _CLIP_DEFAULTS,
)


def _llava_stacks(raw: Mapping[str, Any], model_type: str) -> list[_StackPart]:
    """LLaVA and LLaVA-NeXT: the CLIP vision tower (``vision_config``; the config class fills
    an absent one with its own tower defaults) and the language model (``text_config``,
    ``llama`` unless it says otherwise), read by the family its ``model_type`` maps to (the
    generic dense mapping for one no family names, as a lone config of it). Another tower
    class is refused."""
    sub = raw.get("vision_config")
    vision = dict(sub) if isinstance(sub, Mapping) else dict(_LLAVA_VISION)
    tower = vision.get("model_type", "clip_vision_model")
    text = dict(raw.get("text_config") or {})
    inner = text.setdefault("model_type", "llama")
    family = _BY_MODEL_TYPE.get(inner, _DENSE) if isinstance(inner, str) else None
    parts = [
        _StackPart("vision", vision, _CLIP)
        if tower == "clip_vision_model"
        else _StackPart(
            "vision",
            vision,
            None,
            f"{model_type}: vision_config model_type {tower!r}: only LLaVA's CLIP tower "
            f"('clip_vision_model') is mapped",
        ),
        _StackPart("text", text, family)
        if family is not None and family.stacks is None
        else _StackPart(
            "text",
            text,
            None,
            f"{model_type}: text_config model_type {inner!r} is not a single-stack language "
            f"model a family reads",
        ),
    ]
    return parts


def _whisper_stacks(raw: Mapping[str, Any]) -> list[_StackPart]:
    """Whisper: the encoder, and a decoder whose every layer has cross-attention (queries from
    the decoder, keys and values from the encoder's output), which no layer kind describes."""
    n = raw.get("decoder_layers")
    where = f"decoder layers {_ranges(range(n))}" if isinstance(n, int) and n > 0 else "decoder"
    refusal = (
        f"whisper: cross-attention in {where}: no layer kind; the encoder maps alone: "
        f"stack='encoder' (the sample 'whisper-encoder', `--stack encoder`)"
    )
    return [
        _StackPart("encoder", raw, _WHISPER_ENCODER),
        _StackPart("decoder", raw, None, refusal),
    ]


_QWEN3_5_TEXT = _Family(
    "qwen3.5",
    _qwen3_next,
    {
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
        # OLMo-Hybrid: the same Gated DeltaNet fields (its beta range [0, 2] under
        # linear_allow_neg_eigval is the mixer's, before the op) and OLMo attention
        "olmo_hybrid": "OlmoHybridForCausalLM",
    },
)

_FAMILIES: tuple[_Family, ...] = (
    _Family(
        "qwen3",
        _dense,
        {
            "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
        },
    ),
    # Dense families tried against transformers (tests/test_hf_config_dense.py); any other
    # model_type whose config uses only the common names is read the same way.
    _Family(
        "dense",
        _generic_dense,
        {
            "granite": "GraniteForCausalLM",
            "ministral": "MinistralForCausalLM",
            "olmo2": "Olmo2ForCausalLM",
            "phi3": "Phi3ForCausalLM",
            "starcoder2": "Starcoder2ForCausalLM",
        },
    ),
    _Family("qwen3-next", _qwen3_next, {"qwen3_next": "Qwen3NextForCausalLM"}),
    _LLAMA4_TEXT,
    # Llama-4 multimodal: its vision tower and the language model.
    _Family(
        "llama-4",
        _refuse_parse,
        {"llama4": "Llama4ForConditionalGeneration"},
        stacks=_llama4_stacks,
    ),
    # Qwen3.5 text: the same Gated DeltaNet and gated full-attention layers by layer_types.
    _QWEN3_5_TEXT,
    # DeepSeek-V2 has the same MLA fields (its rope is always interleaved: no rope_interleave).
    _Family(
        "deepseek-v3",
        _deepseek_v3,
        {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"},
    ),
    _Family("kimi-linear", _kimi_linear, {"kimi_linear": "KimiLinearForCausalLM"}),
    # Gated DeltaNet hybrids whose model code around the mixers (Lara-Mini's NoPE global
    # layers, Qwen4-Exp's hyper-connections) runs as transformers' whole forward: Qwen3.5's
    # Gated DeltaNet; Lara-Mini's ungated GQA, sliding or global (no rope).
    _Family(
        "gdn-hybrid",
        _qwen3_next,
        {"lara_mini": "LaraMiniForCausalLM", "qwen4_exp_text": "Qwen4ExpForCausalLM"},
    ),
    _Family("bamba", _bamba, {"bamba": "BambaForCausalLM"}),
    _Family("nemotron-h", _nemotron_h, {"nemotron_h": "NemotronHForCausalLM"}),
    _Family("granite-4.0-h", _granite_hybrid, {"granitemoehybrid": "GraniteMoeHybridForCausalLM"}),
    _Family("falcon-h1", _falcon_h1, {"falcon_h1": "FalconH1ForCausalLM"}, _FALCON_H1_DEFAULTS),
    _Family("jamba", _jamba, {"jamba": "JambaForCausalLM"}, _JAMBA_DEFAULTS),
    _Family(
        "falcon-mamba",
        _falcon_mamba,
        {"falcon_mamba": "FalconMambaForCausalLM", "mamba": "MambaForCausalLM"},
        _MAMBA1_DEFAULTS,
    ),
    _Family("gpt-oss", _gpt_oss, {"gpt_oss": "GptOssForCausalLM"}),
    _Family(
        "minimax",
        _minimax,
        {
            "minimax": "MiniMaxForCausalLM",
            "minimax_m1": "MiniMaxM1ForCausalLM",
            "minimax_text_01": "MiniMaxText01ForCausalLM",
        },
    ),
    _Family(
        "lfm2",
        _lfm2,
        {"lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM", "lfm3": "Lfm3ForCausalLM"},
    ),
    _GEMMA3_TEXT,
    # Gemma-3 multimodal: the SigLIP tower and the language model.
    _Family(
        "gemma-3",
        _refuse_parse,
        {"gemma3": "Gemma3ForConditionalGeneration"},
        stacks=_gemma3_stacks,
    ),
    _SIGLIP,
    # LLaVA: the CLIP tower and the language model its text_config names.
    _Family(
        "llava",
        _refuse_parse,
        {"llava": "LlavaForConditionalGeneration"},
        stacks=_llava_stacks,
    ),
    # LLaVA-NeXT: the same tower (run over each image's anyres tiles, every tile a full
    # image_size image: the tiling is before the tower) and language model.
    _Family(
        "llava-next",
        _refuse_parse,
        {"llava_next": "LlavaNextForConditionalGeneration"},
        stacks=_llava_stacks,
    ),
    _CLIP,
    _QWEN2_VL_VISION,
    _QWEN2_5_VL_VISION,
    _QWEN3_VL_VISION,
    _QWEN3_5_VISION,
    # Multi-stack models: every stack's groups, ids prefixed by the stack.
    _Family(
        "qwen2-vl",
        _refuse_parse,
        {"qwen2_vl": "Qwen2VLForConditionalGeneration"},
        stacks=lambda raw, mt: _qwen_vl_stacks(raw, mt, _QWEN2_VL_VISION, _QWEN_VL_TEXT),
    ),
    _Family(
        "qwen2.5-vl",
        _refuse_parse,
        {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"},
        stacks=lambda raw, mt: _qwen_vl_stacks(raw, mt, _QWEN2_5_VL_VISION, _QWEN_VL_TEXT),
    ),
    _Family(
        "qwen3-vl",
        _refuse_parse,
        {
            "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
        },
        stacks=lambda raw, mt: _qwen_vl_stacks(raw, mt, _QWEN3_VL_VISION, _QWEN3_VL_TEXT),
    ),
    # Qwen3.5 multimodal: Qwen3-VL's tower without DeepStack and the Qwen3.5 language model.
    _Family(
        "qwen3.5",
        _refuse_parse,
        {
            "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        },
        stacks=lambda raw, mt: _qwen_vl_stacks(raw, mt, _QWEN3_5_VISION, _QWEN3_5_TEXT),
    ),
    _Family(
        "whisper",
        _refuse_parse,
        {"whisper": "WhisperForConditionalGeneration"},
        stacks=lambda raw, mt: _whisper_stacks(raw),
    ),
)
#: Families whose mapping reads ``attention_chunk_size`` (any other refuses a config with it).
_READS_CHUNKS: frozenset[str] = frozenset({"llama-4"})
_DENSE: _Family = next(f for f in _FAMILIES if f.name == "dense")
_BY_MODEL_TYPE: dict[str, _Family] = {t: f for f in _FAMILIES for t in f.model_types}


# Model types no family parses, with the features that keep them out: the error names them.
# (None now: Falcon-H1's parallel attention and Mamba2 map since layers may hold two ops.)
_UNSUPPORTED_FEATURES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {}


def _unsupported(
    model_type: Any, raw: Mapping[str, Any], reasons: Sequence[str] = ()
) -> ValueError:
    """The error for a model_type no family parses: its features, its layer_types, the list."""
    head = f"model_type={model_type!r} is not supported"
    detect = _UNSUPPORTED_FEATURES.get(model_type) if isinstance(model_type, str) else None
    features = detect(raw) if detect is not None else []
    if reasons:
        head = "; ".join(reasons) + f"; {head}"
    if features:
        head = "; ".join(f"{model_type}: {f}" for f in features) + f"; {head}"
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        head += f" (its layer_types: {_describe_types(types)})"
    elif isinstance(model_type, str) and not features:
        head += " (the config has no layer_types)"
    return ValueError(
        f"{head}; supported: {list(SUPPORTED_MODEL_TYPES)} (samples: {sample_names()})"
    )


#: Multi-stack model types -> their stacks, in the model's order -> the family reading each
#: (``""``: no layer kind describes it; refused). A test keeps it equal to the parsers'.
MULTI_STACK_MODEL_TYPES: dict[str, dict[str, str]] = {
    "gemma3": {"vision": "siglip-vision", "text": "gemma-3"},
    "llama4": {"vision": "llama-4-vision", "text": "llama-4"},
    # the default text_config (llama) is read by the qwen3 family
    "llava": {"vision": "clip-vision", "text": "qwen3"},
    "llava_next": {"vision": "clip-vision", "text": "qwen3"},
    "qwen2_5_vl": {"vision": "qwen2.5-vl-vision", "text": "qwen2-vl-text"},
    "qwen2_vl": {"vision": "qwen2-vl-vision", "text": "qwen2-vl-text"},
    "qwen3_5": {"vision": "qwen3.5-vision", "text": "qwen3.5"},
    "qwen3_5_moe": {"vision": "qwen3.5-vision", "text": "qwen3.5"},
    "qwen3_vl": {"vision": "qwen3-vl-vision", "text": "qwen3-vl-text"},
    "qwen3_vl_moe": {"vision": "qwen3-vl-vision", "text": "qwen3-vl-text"},
    "whisper": {"encoder": "whisper-encoder", "decoder": ""},
}


def stack_families(config: Mapping[str, Any]) -> dict[str, str]:
    """A multi-stack config's stacks -> the family reading each (``""``: a stack no layer kind
    describes, which :func:`specs_from_hf_config` refuses); ``{}`` for a single-stack model.

    :param config: a parsed ``config.json``.
    """
    model_type = config.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None or family.stacks is None or not isinstance(model_type, str):
        return {}
    return {
        p.name: p.family.name if p.family is not None else ""
        for p in family.stacks(config, model_type)
    }


#: model_type -> the family (sample name) that parses it, e.g. ``"qwen2" -> "qwen3"``.
MODEL_TYPE_FAMILIES: dict[str, str] = {t: f.name for t, f in sorted(_BY_MODEL_TYPE.items())}
#: model_type values :func:`specs_from_hf_config` understands.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BY_MODEL_TYPE))


# ------------------------------------------------------------------------------------------
# Samples and loading
# ------------------------------------------------------------------------------------------
def _samples_dir() -> Any:
    return resources.files("attn_core.models") / "samples"


#: Sample names that name one stack of a multi-stack sample: name -> (sample file, stack).
#: ``specs_from_hf_config("qwen2.5-vl-vision")`` is the vision stack of the ``qwen2.5-vl``
#: config; ``load_sample`` returns the whole config for both names.
SAMPLE_STACKS: dict[str, tuple[str, str]] = {
    "qwen2-vl-vision": ("qwen2-vl", "vision"),
    "qwen2.5-vl-vision": ("qwen2.5-vl", "vision"),
    "whisper-encoder": ("whisper", "encoder"),
}


def sample_names() -> list[str]:
    """Names of the bundled sample configs (``"qwen3-next"``, ``"deepseek-v3"``, ...) and of
    the stacks of multi-stack samples (:data:`SAMPLE_STACKS`), sorted."""
    files = {
        p.name.removesuffix(".json") for p in _samples_dir().iterdir() if p.name.endswith(".json")
    }
    return sorted(files | set(SAMPLE_STACKS))


def load_sample(name: str) -> dict[str, Any]:
    """The bundled ``config.json`` called ``name`` (see :func:`sample_names`), as a fresh dict;
    for a stack's name (:data:`SAMPLE_STACKS`) the whole model's config."""
    names = sample_names()
    if name not in names:
        raise ValueError(f"sample {name!r} is unknown; available: {names}")
    file = SAMPLE_STACKS.get(name, (name, ""))[0]
    return json.loads((_samples_dir() / f"{file}.json").read_text(encoding="utf-8"))


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                with path.open(encoding="utf-8") as fh:
                    data = json.load(fh)
            except ValueError as exc:  # json.JSONDecodeError, or bytes that are not UTF-8
                raise ValueError(f"{path}: not a JSON config: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
            return data
        if isinstance(config, str) and config in sample_names():
            return load_sample(config)
        raise ValueError(
            f"config={str(config)!r} is neither a config.json path (or a folder holding one) nor "
            f"a sample name; samples: {sample_names()}"
        )
    if callable(getattr(config, "to_dict", None)):  # a transformers PretrainedConfig
        return dict(config.to_dict())
    raise TypeError(
        f"config: expected a dict, a path to config.json or a sample name, "
        f"got {type(config).__name__}"
    )


def _config_dtype(*configs: Mapping[str, Any]) -> str:
    """The model dtype: ``dtype`` (transformers 5) or ``torch_dtype`` (older); bfloat16 if none."""
    for cfg in configs:
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if value not in (None, "auto"):
                return str(value).removeprefix("torch.")
    return "bfloat16"


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------
def specs_from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    tp_size: int = 1,
    dtype: str | None = None,
    page_size: int = 16,
    kv_dtype: str | None = None,
    stack: str | None = None,
) -> ModelLayout:
    """The attention layout of a Hugging Face model on one tensor-parallel rank.

    A multi-stack model (Qwen2-VL / Qwen2.5-VL, Qwen3-VL / Qwen3.5 and their MoE forms, Gemma-3
    and Llama-4 multimodal, LLaVA: ``vision`` and ``text``; Whisper: ``encoder`` and ``decoder``)
    yields every stack's groups, their ids prefixed by the stack (``vision.encoder``,
    ``text.full``), each stack's layout in ``ModelLayout.stacks``; a stack no layer kind
    describes (Whisper's decoder, with cross-attention) is refused unless ``stack`` names
    another one.

    :param config: a parsed ``config.json`` (dict), a path to one (or to a folder holding one),
        a sample name from :func:`sample_names` (a name in :data:`SAMPLE_STACKS` selects that
        stack), or a ``transformers`` config object.
    :param stack: one stack of a multi-stack model (``"vision"``, ``"text"``, ``"encoder"``):
        its layout alone (group ids still prefixed); None: every stack (or the sample's).
    :param tp_size: tensor-parallel ranks; head counts are per rank (see the module docstring).
    :param dtype: activation dtype; default: the config's ``dtype`` / ``torch_dtype``, else
        bfloat16.
    :param page_size: tokens per KV page for layers with a KV cache (full / mla).
    :param kv_dtype: KV cache dtype for full / mla layers (e.g. ``"fp8_e4m3"``); default: dtype.
        Linear and encoder layers keep no KV cache and ignore it.
    :returns: a :class:`ModelLayout`.
    :raises ValueError: unknown ``model_type`` (the message names its ``layer_types`` and
        lists the supported ones); a feature no layer kind describes (an unknown
        ``layer_types`` value, a Mamba2 mixer's upper ``time_step_limit``) or the family does
        not read (chunked attention outside Llama-4), named with its layers; a mapping that
        disagrees with the config's own ``layer_types`` (the layers, what the config says,
        what was mapped); a missing or invalid field; or a head count ``tp_size`` does not
        divide; a stack no layer kind describes, or a ``stack`` the model does not have.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size <= 0:
        raise ValueError(f"tp_size={tp_size!r}: expected a positive int")
    # a sample named for one stack (not a file called so): that stack
    if stack is None and isinstance(config, str) and config in SAMPLE_STACKS:
        stack = None if Path(config).exists() else SAMPLE_STACKS[config][1]
    raw = _as_dict(config)
    model_type = raw.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if stack is not None and (family is None or family.stacks is None):
        raise ValueError(
            f"{model_type}: stack={stack!r}: this model has one stack; stacks are those of "
            f"multi-stack models ({sorted(MULTI_STACK_MODEL_TYPES)})"
        )
    if family is None and isinstance(model_type, str) and model_type not in _UNSUPPORTED_FEATURES:
        # A model_type no family names: the generic dense mapping reads it when every field is
        # one it understands; otherwise its refusal says why, with the supported list.
        try:
            return _specs(raw, model_type, _DENSE, tp_size, dtype, page_size, kv_dtype)
        # the mapping reads it: its heads do not split over tp_size, or a field's value is wrong
        except (_HeadSplitError, _FieldValueError):
            raise
        except ValueError as err:
            raise _unsupported(model_type, raw, [str(err)]) from None
    if family is None or not isinstance(model_type, str):
        raise _unsupported(model_type, raw)
    if family.stacks is None:
        return _specs(raw, model_type, family, tp_size, dtype, page_size, kv_dtype)
    return _multi_stack(raw, model_type, family, stack, tp_size, dtype, page_size, kv_dtype)


def _multi_stack(
    raw: Mapping[str, Any],
    model_type: str,
    family: _Family,
    stack: str | None,
    tp_size: int,
    dtype: str | None,
    page_size: int,
    kv_dtype: str | None,
) -> ModelLayout:
    """Every stack of a multi-stack config (or the one ``stack`` names), group ids prefixed."""
    assert family.stacks is not None
    parts = family.stacks(raw, model_type)
    names = [p.name for p in parts]
    if stack is not None and stack not in names:
        raise ValueError(f"{model_type}: stack {stack!r} is unknown; its stacks: {names}")
    chosen = [p for p in parts if stack is None or p.name == stack]
    refused = [p.refusal for p in chosen if p.family is None]
    if refused:
        raise ValueError("; ".join(refused) + "; refused, not mapped in part")
    architectures = raw.get("architectures") or [family.model_types.get(model_type, model_type)]
    layouts = []
    for part in chosen:
        assert part.family is not None
        sources = [part.config, raw] if part.dtype_first else [raw, part.config]
        layouts.append(
            _specs(
                part.config,
                model_type,
                part.family,
                tp_size,
                dtype if dtype is not None else _config_dtype(*sources),
                page_size,
                kv_dtype,
                stack=part.name,
                architecture=str(architectures[0]),
            )
        )
    if stack is not None:
        return layouts[0]
    return ModelLayout(
        model_type=model_type,
        architecture=str(architectures[0]),
        num_layers=sum(s.num_layers for s in layouts),
        layer_specs=(),
        layer_indices=(),
        groups=tuple(g for s in layouts for g in s.groups),
        tp_size=tp_size,
        family=family.name,
        stacks=tuple(layouts),
    )


def _specs(
    raw: Mapping[str, Any],
    model_type: str,
    family: _Family,
    tp_size: int,
    dtype: str | None,
    page_size: int,
    kv_dtype: str | None,
    *,
    stack: str = "",
    architecture: str | None = None,
) -> ModelLayout:
    """One stack: ``raw`` is the config its family reads (a multi-stack model's sub-config)."""
    cfg, dtype_sources = raw, [raw]
    options = _Options(
        tp_size=tp_size,
        dtype=dtype if dtype is not None else _config_dtype(*dtype_sources),
        page_size=page_size,
        kv_dtype=kv_dtype,
    )
    where = (
        f"{family.name} ({model_type}, stack {stack})" if stack else f"{family.name} ({model_type})"
    )
    reader = _Reader(cfg, where, family.defaults)
    _refuse_features(model_type, cfg, family.name)
    try:
        num_layers, layers, extra = family.parse(reader, options)
    except _HeadSplitError as err:  # which model's heads: the field alone may be ambiguous
        raise _HeadSplitError(f"{reader.where}: {err}") from None
    _check_against_types(model_type, cfg, num_layers, layers)
    indices = tuple(i for i, _ in layers)
    specs = tuple(s for _, s in layers)
    # group_layers numbers layers by position; map positions back to model layer indices.
    groups = tuple(
        LayerGroup(g.group_id, g.spec, tuple(indices[p] for p in g.layer_indices))
        for g in group_layers(specs, prefix=f"{stack}." if stack else "")
    )
    if architecture is None:
        arch = raw.get("architectures") or [family.model_types.get(model_type, model_type)]
        architecture = str(arch[0])
    return ModelLayout(
        model_type=model_type,
        architecture=architecture,
        num_layers=num_layers,
        layer_specs=specs,
        layer_indices=indices,
        groups=groups,
        tp_size=tp_size,
        family=family.name,
        stack=stack,
        **extra,
    )


def _sub_config(raw: Mapping[str, Any], key: str, model_type: str) -> dict[str, Any]:
    sub = raw.get(key)
    if not isinstance(sub, Mapping):
        raise ValueError(f"model_type={model_type!r}: expected a {key} object, got {sub!r}")
    return dict(sub)
