"""Value types that describe the work: one attention layer, the device, and what the run demands.

All three are frozen, hashable and validated on construction: a bad value raises ``ValueError``
naming the field, the value and what is allowed, so that a mistake in a model config is caught
where it is made rather than deep inside a kernel.

Head layout conventions used everywhere in attn-core (``T`` = tokens in the step):

======== ================================ ================================ ==================
kind     query                            key / value (new tokens)         output
======== ================================ ================================ ==================
full     q ``[T, num_heads, head_dim]``   k ``[T, num_kv_heads, head_dim]`` ``[T, num_heads,
                                          v ``[T, num_kv_heads, head_dim_v]`` head_dim_v]``
encoder  same as full (no persistent KV)
mla      q ``[T, num_heads, kv_lora_rank  kv ``[T, kv_lora_rank +           ``[T, num_heads,
         + qk_rope_head_dim]`` (absorbed) qk_rope_head_dim]`` (latent)      kv_lora_rank]``
linear   q, k ``[T, num_kv_heads,         v ``[T, num_heads, head_dim_v]``  ``[T, num_heads,
         head_dim]``                                                        head_dim_v]``
======== ================================ ================================ ==================

For ``linear`` layers ``num_heads`` are the value heads and ``num_kv_heads`` the query/key heads
(Gated DeltaNet's ``num_v_heads`` / ``num_k_heads``; Mamba2's ``num_heads`` / ``n_groups`` with
``head_dim = d_state`` and ``head_dim_v`` = Mamba's head dim; Mamba1's ``d_inner`` channels /
one group with ``head_dim = d_state`` and ``head_dim_v = 1``). The recurrent state of one head is
``[head_dim, head_dim_v]``; the conv state of one layer is
``[conv_channels, conv_kernel_size - 1]``.

Two linear variants keep only one of the two states. Lightning attention (MiniMax-01) has no
conv: ``conv_kernel_size`` / ``conv_channels`` stay None and its conv state is empty; q, k and v
have the same heads (``num_kv_heads == num_heads``). The gated short convolution (LFM2) is a conv
and nothing else: no recurrent state, so its SSM state is empty; it has no heads either, and its
spec says so with ``num_heads = num_kv_heads = 1`` and ``head_dim = head_dim_v = conv_channels``
(the conv's channel row); its layers call ``binding.conv1d`` only, never ``forward``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from attn_core.options import OptionTable, options_table

__all__ = [
    "CONV_ACTIVATIONS",
    "DTYPES",
    "KV_DTYPES",
    "LINEAR_LAYER_INPUTS",
    "DeviceCapabilities",
    "DowngradePolicy",
    "ExecutionConstraints",
    "GraphMode",
    "LayerGroup",
    "LayerKind",
    "LayerSpec",
    "LinearVariant",
    "Phase",
    "group_layers",
    "layer_ops",
    "torch_dtype",
]


class LayerKind(str, enum.Enum):
    """What a layer computes; decides which persistent state it owns."""

    FULL = "full"  # softmax attention over a paged KV cache (MHA / GQA / MQA)
    MLA = "mla"  # multi-head latent attention over a paged latent cache (DeepSeek-V2/V3)
    LINEAR = "linear"  # linear attention / SSM with conv and recurrent state
    ENCODER = "encoder"  # bidirectional or causal varlen attention, no persistent KV

    def __str__(self) -> str:
        return self.value


class LinearVariant(str, enum.Enum):
    GATED_DELTANET = "gated_deltanet"  # Qwen3-Next: scalar gate per head, delta rule
    KDA = "kda"  # Kimi Delta Attention: per-channel gate, delta rule
    MAMBA2 = "mamba2"  # SSD: scalar decay per head, plain outer-product update
    # -- lightning attention and gated short convolution (issue 23) --
    LIGHTNING = "lightning"  # MiniMax-01: fixed per-head decay, plain outer product, no conv
    SHORT_CONV = "short_conv"  # LFM2: gated causal depthwise conv; conv state only, no SSM state
    # Mamba1 selective scan (Jamba, Falcon-Mamba): one "head" per inner channel with a
    # d_state-wide decay, head_dim_v = 1, one shared B / C group
    MAMBA1 = "mamba1"

    def __str__(self) -> str:
        return self.value


#: A linear layer's forward inputs that are the layer's own, not one row per token: Mamba's
#: ``A_log`` (``[H]``, Mamba1 ``[H, N]``), ``D`` and ``dt_bias`` (``[H]``), lightning's
#: ``slope`` (``[H]``). Every other input (``g``, ``beta``, ``dt``) has a row per token. A
#: constant's first dim may equal a step's token count: the name, not the shape, says which.
LINEAR_LAYER_INPUTS: frozenset[str] = frozenset({"A_log", "D", "dt_bias", "slope"})

#: What a linear layer's ``conv1d`` may apply after the conv: SiLU (``"swish"`` is its other
#: name, as causal-conv1d takes it) or nothing.
CONV_ACTIVATIONS: tuple[str | None, ...] = ("silu", "swish", None)


class GraphMode(str, enum.Enum):
    """How much of a step the server captures in CUDA graphs."""

    NONE = "none"
    DECODE = "decode"  # pure-decode steps captured for fixed batch sizes
    FULL = "full"  # every step captured (mixed batches included)

    def __str__(self) -> str:
        return self.value


class Phase(str, enum.Enum):
    """The kind of step a backend serves; a plan chooses a backend per layer group and phase.

    A step's phase follows from its batch (``AttentionBatch.phase``): every request with one new
    token is ``decode``; a speculative-verify step (``k + 1`` tokens per request) is ``verify``;
    everything else (prefill chunks, mixed prefill and decode, encoder sequences) is ``prefill``.
    """

    PREFILL = "prefill"  # prefill and mixed steps (and encoder steps)
    DECODE = "decode"  # pure decode: q_len == 1 for every request
    VERIFY = "verify"  # speculative verify: q_len == k + 1 for every request

    def __str__(self) -> str:
        return self.value


class DowngradePolicy(str, enum.Enum):
    """What to do when the best backend for a group is not available and a lower one is chosen."""

    ERROR = "error"
    WARN = "warn"
    ALLOW = "allow"

    def __str__(self) -> str:
        return self.value


#: Activation / query dtypes a layer may run in, by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: KV storage dtypes; ``fp8_e4m3`` stores KV as float8 e4m3 with one scale per layer.
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
}
_STATE_DTYPES = ("float32", "bfloat16")


def _canonical_dtype(name: object, allowed: dict[str, torch.dtype], field_name: str) -> str:
    if isinstance(name, torch.dtype):
        for key, value in allowed.items():
            if value == name:
                return key
        name = str(name).removeprefix("torch.")
    if not isinstance(name, str):
        raise ValueError(f"{field_name}={name!r}: expected a dtype name, one of {sorted(allowed)}")
    canonical = _DTYPE_ALIASES.get(name, name)
    if canonical not in allowed:
        raise ValueError(f"{field_name}={name!r} is not supported; allowed: {sorted(allowed)}")
    return canonical


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a canonical dtype name (``"bfloat16"``, ``"fp8_e4m3"``, ...)."""
    return KV_DTYPES[_DTYPE_ALIASES.get(name, name)]


def _require(condition: bool, field_name: str, value: object, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{field_name}={value!r} is invalid: {allowed}")


def _positive(field_name: str, value: object) -> int:
    """``value`` when it is a positive integer, else ValueError naming the field."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{field_name}={value!r} is invalid: expected a positive integer")
    return value


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Frozen description of one attention layer; equal specs share a layer group and a backend.

    Only the fields of the layer's kind are meaningful; the others keep their defaults and are
    checked to be unset so two specs of the same layer always compare equal.
    """

    kind: LayerKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # None: equal to head_dim. Read back it is always an int (__post_init__ sets it), hence
    # the declared type; the constructor's accepted types are in the __init__ stub below.
    head_dim_v: int = cast(int, None)
    dtype: str = "bfloat16"
    kv_dtype: str = cast(str, None)  # None: equal to dtype (full / mla only); read back: a str
    page_size: int = 16  # tokens per KV page (full / mla only)
    causal: bool = True
    sliding_window: int | None = None  # tokens a query sees, itself included (HF convention)
    # chunked (local) attention (Llama-4): the sequence is cut into chunks of this many tokens
    # and a query at position p sees only keys of its own chunk, [p // C * C, p] when causal
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None  # tanh soft-capping of logits (Gemma-2/3 style)
    has_sinks: bool = False  # learned per-head attention sinks (gpt-oss)
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim) (for MLA: of nope + rope dims)
    # MLA
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    # linear attention / SSM
    linear_variant: LinearVariant | None = None
    conv_kernel_size: int | None = None
    conv_channels: int | None = None
    state_dtype: str = "float32"
    qk_l2norm: bool = False  # the kernel L2-normalises q and k (Gated DeltaNet / KDA)

    if TYPE_CHECKING:
        # What the constructor accepts (names and enums by value, dtypes as torch dtypes or
        # aliases, None for "derive it"); the fields above are what __post_init__ leaves.
        # tests/test_typed_constructors.py checks that it matches the fields.
        def __init__(
            self,
            kind: LayerKind | str,
            num_heads: int,
            num_kv_heads: int,
            head_dim: int,
            head_dim_v: int | None = None,
            dtype: str | torch.dtype = "bfloat16",
            kv_dtype: str | torch.dtype | None = None,
            page_size: int = 16,
            causal: bool = True,
            sliding_window: int | None = None,
            attention_chunk_size: int | None = None,
            logits_soft_cap: float | None = None,
            has_sinks: bool = False,
            softmax_scale: float | None = None,
            kv_lora_rank: int | None = None,
            qk_rope_head_dim: int | None = None,
            qk_nope_head_dim: int | None = None,
            linear_variant: LinearVariant | str | None = None,
            conv_kernel_size: int | None = None,
            conv_channels: int | None = None,
            state_dtype: str | torch.dtype = "float32",
            qk_l2norm: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        try:
            set_(self, "kind", LayerKind(self.kind))
        except ValueError:
            raise ValueError(
                f"kind={self.kind!r} is not a layer kind; allowed: {[k.value for k in LayerKind]}"
            ) from None
        for name in ("num_heads", "num_kv_heads", "head_dim", "page_size"):
            _positive(name, getattr(self, name))
        if self.head_dim_v is None:
            set_(self, "head_dim_v", self.head_dim)
        _positive("head_dim_v", self.head_dim_v)
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_heads",
            self.num_heads,
            f"must be a multiple of num_kv_heads={self.num_kv_heads}",
        )
        set_(self, "dtype", _canonical_dtype(self.dtype, DTYPES, "dtype"))
        kv = self.dtype if self.kv_dtype is None else self.kv_dtype
        set_(self, "kv_dtype", _canonical_dtype(kv, KV_DTYPES, "kv_dtype"))
        set_(self, "state_dtype", _canonical_dtype(self.state_dtype, DTYPES, "state_dtype"))
        _require(
            self.state_dtype in _STATE_DTYPES,
            "state_dtype",
            self.state_dtype,
            f"allowed: {list(_STATE_DTYPES)}",
        )
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        if self.attention_chunk_size is not None:
            _positive("attention_chunk_size", self.attention_chunk_size)
        if self.logits_soft_cap is not None:
            _require(
                isinstance(self.logits_soft_cap, (int, float)) and self.logits_soft_cap > 0,
                "logits_soft_cap",
                self.logits_soft_cap,
                "expected a positive float or None",
            )
            set_(self, "logits_soft_cap", float(self.logits_soft_cap))
        if self.softmax_scale is not None:
            _require(
                isinstance(self.softmax_scale, (int, float)) and self.softmax_scale > 0,
                "softmax_scale",
                self.softmax_scale,
                "expected a positive float or None",
            )
            set_(self, "softmax_scale", float(self.softmax_scale))
        getattr(self, f"_validate_{self.kind.value}")()

    # -- per-kind validation ---------------------------------------------------------------
    def _unset(self, *names: str) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for name in names:
            value = getattr(self, name)
            _require(
                value == defaults[name],
                name,
                value,
                f"does not apply to kind={self.kind.value!r} layers; leave it at "
                f"{defaults[name]!r}",
            )

    def _validate_full(self) -> None:
        self._unset(
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "linear_variant",
            "conv_kernel_size",
            "conv_channels",
            "qk_l2norm",
        )

    def _validate_encoder(self) -> None:
        self._validate_full()
        _require(
            self.kv_dtype == self.dtype,
            "kv_dtype",
            self.kv_dtype,
            f"encoder layers keep no KV; it must equal dtype={self.dtype!r}",
        )

    def _validate_mla(self) -> None:
        rank = _positive("kv_lora_rank", self.kv_lora_rank)
        rope = _positive("qk_rope_head_dim", self.qk_rope_head_dim)
        _positive("qk_nope_head_dim", self.qk_nope_head_dim)
        _require(
            self.num_kv_heads == 1,
            "num_kv_heads",
            self.num_kv_heads,
            "MLA stores one shared latent per token: num_kv_heads must be 1",
        )
        _require(
            self.head_dim == rank + rope,
            "head_dim",
            self.head_dim,
            f"for MLA it is the absorbed query width kv_lora_rank + qk_rope_head_dim = "
            f"{rank + rope}",
        )
        _require(
            self.head_dim_v == rank,
            "head_dim_v",
            self.head_dim_v,
            f"for MLA the output is the latent: kv_lora_rank = {rank}",
        )
        self._unset("linear_variant", "conv_kernel_size", "conv_channels", "qk_l2norm")
        self._unset("sliding_window", "attention_chunk_size", "logits_soft_cap", "has_sinks")

    def _validate_linear(self) -> None:
        try:
            object.__setattr__(self, "linear_variant", LinearVariant(self.linear_variant))
        except ValueError:
            raise ValueError(
                f"linear_variant={self.linear_variant!r} is not supported; allowed: "
                f"{[v.value for v in LinearVariant]}"
            ) from None
        if self.linear_variant is LinearVariant.LIGHTNING:
            self._validate_lightning()
        else:
            _positive("conv_kernel_size", self.conv_kernel_size)
            _positive("conv_channels", self.conv_channels)
        if self.linear_variant is LinearVariant.SHORT_CONV:
            self._validate_short_conv()
        _require(
            self.kv_dtype == self.dtype,
            "kv_dtype",
            self.kv_dtype,
            f"linear layers keep no KV cache; it must equal dtype={self.dtype!r}",
        )
        self._unset("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
        self._unset("sliding_window", "attention_chunk_size", "logits_soft_cap", "has_sinks")
        if self.linear_variant is LinearVariant.MAMBA1:
            self._validate_mamba1()

    def _validate_mamba1(self) -> None:
        # Mamba1's state is [d_inner, d_state]: one head per channel, each with a one-wide value
        # (x of that channel) and the step's single B / C (no groups in Mamba1).
        _require(
            self.head_dim_v == 1,
            "head_dim_v",
            self.head_dim_v,
            "for mamba1 each head is one inner channel: head_dim_v must be 1",
        )
        _require(
            self.num_kv_heads == 1,
            "num_kv_heads",
            self.num_kv_heads,
            "mamba1 has one B / C per token shared by every channel: num_kv_heads must be 1",
        )
        _require(not self.qk_l2norm, "qk_l2norm", self.qk_l2norm, "mamba1 never L2-normalises")

    def _validate_lightning(self) -> None:
        """Lightning attention has no conv and one key head per value head."""
        for name in ("conv_kernel_size", "conv_channels"):
            _require(
                getattr(self, name) is None,
                name,
                getattr(self, name),
                "lightning attention has no conv; leave it None",
            )
        _require(
            self.num_kv_heads == self.num_heads,
            "num_kv_heads",
            self.num_kv_heads,
            f"lightning attention has as many key heads as value heads ({self.num_heads})",
        )
        self._unset("qk_l2norm")

    def _validate_short_conv(self) -> None:
        """The short conv has no heads and no recurrent state: one 'head' of the channel row."""
        channels = self.conv_channels
        for name, want in (
            ("num_heads", 1),
            ("num_kv_heads", 1),
            ("head_dim", channels),
            ("head_dim_v", channels),
        ):
            _require(
                getattr(self, name) == want,
                name,
                getattr(self, name),
                f"a short-conv layer has no heads: expected {want} (one head of the "
                f"conv_channels={channels} channel row)",
            )
        self._unset("qk_l2norm", "softmax_scale", "state_dtype")

    # -- derived quantities ----------------------------------------------------------------
    @property
    def scale(self) -> float:
        """Softmax (or linear-attention query) scale used when the layer does not give one."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        if self.kind is LayerKind.MLA:
            _, rope, nope = self.mla_dims
            return 1.0 / math.sqrt(nope + rope)
        if self.linear_variant in (
            LinearVariant.MAMBA2,
            LinearVariant.MAMBA1,
            LinearVariant.LIGHTNING,
        ):
            return 1.0  # SSD and the selective scan read C . h, lightning attention q . S, unscaled
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def has_kv_cache(self) -> bool:
        return self.kind in (LayerKind.FULL, LayerKind.MLA)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether the layer keeps per-request state slots (conv, SSM or both)."""
        return self.kind is LayerKind.LINEAR

    @property
    def has_conv(self) -> bool:
        """Whether the layer runs a causal conv with a conv state (every linear variant but
        lightning attention)."""
        return self.kind is LayerKind.LINEAR and self.linear_variant is not LinearVariant.LIGHTNING

    @property
    def has_ssm_state(self) -> bool:
        """Whether the layer keeps a recurrent state ``[H, Dk, Dv]`` (every linear variant but
        the short conv)."""
        return self.kind is LayerKind.LINEAR and self.linear_variant is not LinearVariant.SHORT_CONV

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in one layer's KV cache (K and V, or the MLA latent)."""
        itemsize = torch_dtype(self.kv_dtype).itemsize
        if self.kind is LayerKind.FULL:
            return self.num_kv_heads * (self.head_dim + self.head_dim_v) * itemsize
        if self.kind is LayerKind.MLA:
            rank, rope, _ = self.mla_dims
            return (rank + rope) * itemsize
        return 0

    @property
    def mla_dims(self) -> tuple[int, int, int]:
        """``(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim)`` of an MLA layer (validated
        positive on construction); ValueError for a layer of another kind."""
        rank, rope, nope = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim
        if rank is None or rope is None or nope is None:
            raise ValueError(f"{self.short()}: not an MLA layer, it has no MLA dims")
        return rank, rope, nope

    @property
    def conv_dims(self) -> tuple[int, int]:
        """``(conv_channels, conv_kernel_size)`` of a linear layer (validated positive on
        construction); ValueError for a layer of another kind."""
        channels, kernel = self.conv_channels, self.conv_kernel_size
        if channels is None or kernel is None:
            raise ValueError(f"{self.short()}: not a linear layer, it has no conv")
        return channels, kernel

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        """Shape of one request's recurrent state for this layer: ``[num_heads, dk, dv]``; ``()``
        for a layer without one (not linear, or a short conv)."""
        if not self.has_ssm_state:
            return ()
        return (self.num_heads, self.head_dim, self.head_dim_v)

    @property
    def conv_state_shape(self) -> tuple[int, ...]:
        """Shape of one request's conv state for this layer: ``[channels, kernel - 1]``; ``()``
        for a layer without a conv (not linear, or lightning attention)."""
        if not self.has_conv:
            return ()
        channels, kernel = self.conv_dims
        return (channels, kernel - 1)

    def state_bytes_per_request(self) -> int:
        """Bytes of one request's state slot in this layer: SSM state plus conv state (a state
        the layer does not keep counts 0, not ``prod(()) = 1`` element)."""
        if self.kind is not LayerKind.LINEAR:
            return 0
        ssm_shape, conv_shape = self.ssm_state_shape, self.conv_state_shape
        ssm = math.prod(ssm_shape) * torch_dtype(self.state_dtype).itemsize if ssm_shape else 0
        conv = math.prod(conv_shape) * torch_dtype(self.dtype).itemsize if conv_shape else 0
        return ssm + conv

    def with_(self, **changes: Any) -> LayerSpec:
        """A copy with some fields changed (validated again). Values as wide as the keys stay
        so: a new ``head_dim`` moves ``head_dim_v`` along unless the call sets it or the two
        differed (MLA, a wider value head)."""
        tied = self.head_dim_v == self.head_dim
        if tied and "head_dim" in changes and "head_dim_v" not in changes:
            changes["head_dim_v"] = changes["head_dim"]
        return replace(self, **changes)

    def short(self) -> str:
        """One-line human summary: ``full 32q/8kv d128 bf16 page16 window=4096``."""
        parts = [self.kind.value]
        if self.kind is LayerKind.LINEAR:
            parts.append(str(self.linear_variant))
        if self.linear_variant is LinearVariant.SHORT_CONV:  # no heads, no recurrent state
            channels, kernel = self.conv_dims
            return " ".join([*parts, f"conv {channels}x{kernel}", self.dtype])
        parts.append(f"{self.num_heads}q/{self.num_kv_heads}kv")
        dims = f"d{self.head_dim}"
        if self.head_dim_v != self.head_dim:
            dims += f"/{self.head_dim_v}"
        parts += [dims, self.dtype]
        if self.kv_dtype != self.dtype:
            parts.append(f"kv={self.kv_dtype}")
        if self.has_kv_cache:
            parts.append(f"page{self.page_size}")
        if not self.causal:
            parts.append("bidirectional")
        if self.sliding_window:
            parts.append(f"window={self.sliding_window}")
        if self.attention_chunk_size:
            parts.append(f"chunk={self.attention_chunk_size}")
        if self.logits_soft_cap:
            parts.append(f"softcap={self.logits_soft_cap:g}")
        if self.has_sinks:
            parts.append("sinks")
        if self.kind is LayerKind.LINEAR:
            parts.append(f"state={self.state_dtype}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers with equal specs; one backend instance serves the whole group."""

    group_id: str
    spec: LayerSpec
    layer_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        _require(bool(self.layer_indices), "layer_indices", self.layer_indices, "must not be empty")


def _op_role(spec: LayerSpec) -> str:
    """``"linear"`` for a linear / SSM op (conv and recurrent state), ``"attention"`` for the
    others (full, mla: KV pages; encoder: no state)."""
    return "linear" if spec.kind is LayerKind.LINEAR else "attention"


def layer_ops(groups: Iterable[LayerGroup]) -> dict[int, tuple[LayerGroup, ...]]:
    """Per model layer index, the groups that hold an op of that layer (in group order).

    Most layers hold one op. A parallel hybrid (Falcon-H1: attention and Mamba2 side by side
    in one decoder layer) holds two: one attention op (full / mla / encoder) and one linear op.
    That is the only mix allowed, because the persistent state is keyed by layer index: the
    attention op owns the layer's KV pages, the linear op its conv / SSM slot, and two ops of
    one role would share (and overwrite) the same one.

    :raises ValueError: a layer listed twice in one group, or holding two ops of one role
        (the message names the layer and the groups).
    """
    ops: dict[int, list[LayerGroup]] = {}
    for g in groups:
        if len(set(g.layer_indices)) != len(g.layer_indices):
            dup = sorted({i for i in g.layer_indices if g.layer_indices.count(i) > 1})
            raise ValueError(f"group {g.group_id!r} lists layers {dup} more than once")
        for i in g.layer_indices:
            held = ops.setdefault(i, [])
            same = [h for h in held if _op_role(h.spec) == _op_role(g.spec)]
            if same:
                role = _op_role(g.spec)
                raise ValueError(
                    f"layer {i} is in groups {same[0].group_id!r} and {g.group_id!r}, two "
                    f"{role} ops ({same[0].spec.kind.value} and {g.spec.kind.value}); a layer "
                    "holds one op, or one attention op and one linear op in parallel (their "
                    "KV pages and conv / SSM slot are the layer's, one of each)"
                )
            held.append(g)
    return {i: tuple(v) for i, v in sorted(ops.items())}


def group_layers(specs: Iterable[LayerSpec], *, prefix: str = "") -> list[LayerGroup]:
    """Group per-layer specs (index = position) into layer groups, in order of first appearance.

    Group ids are ``<kind>`` for the first group of a kind and ``<kind>.<n>`` for later ones, e.g.
    ``full``, ``full.1`` (gpt-oss's sliding and full layers), ``linear``.
    """
    order: dict[LayerSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        order.setdefault(spec, []).append(index)
    groups: list[LayerGroup] = []
    seen: dict[str, int] = {}
    for spec, indices in order.items():
        base = prefix + spec.kind.value
        n = seen.get(base, 0)
        seen[base] = n + 1
        gid = base if n == 0 else f"{base}.{n}"
        groups.append(LayerGroup(gid, spec, tuple(indices)))
    return groups


# ------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeviceCapabilities:
    """What a device offers; detected from torch or taken from a named target for offline plans."""

    vendor: str  # "nvidia", "amd", "cpu"
    name: str
    device_type: str  # torch device type: "cuda" or "cpu"
    compute_capability: tuple[int, int] | None = None  # (9, 0) for Hopper; None on CPU
    num_sms: int = 0
    memory_bytes: int = 0
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    supports_fp8: bool = False
    supports_cuda_graphs: bool = False

    def __post_init__(self) -> None:
        _require(
            self.device_type in ("cuda", "cpu"),
            "device_type",
            self.device_type,
            "allowed: 'cuda', 'cpu'",
        )
        if self.compute_capability is not None:
            cc = tuple(self.compute_capability)
            _require(
                len(cc) == 2 and all(isinstance(x, int) and x >= 0 for x in cc),
                "compute_capability",
                self.compute_capability,
                "expected (major, minor) integers",
            )
            object.__setattr__(self, "compute_capability", cc)
        _require(self.num_sms >= 0, "num_sms", self.num_sms, "must be >= 0")
        _require(self.memory_bytes >= 0, "memory_bytes", self.memory_bytes, "must be >= 0")
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        for d in self.dtypes:
            _canonical_dtype(d, KV_DTYPES, "dtypes")

    @property
    def sm(self) -> int | None:
        """Compute capability as an int (90 for Hopper), None on CPU."""
        if self.compute_capability is None:
            return None
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    @classmethod
    def target(cls, name: str) -> DeviceCapabilities:
        """A named target for offline planning: one of :data:`TARGETS`."""
        try:
            return TARGETS[name.lower()]
        except KeyError:
            raise ValueError(
                f"device target {name!r} is unknown; allowed: {sorted(TARGETS)}"
            ) from None

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> DeviceCapabilities:
        """Describe ``device`` (default: the current CUDA device, else the CPU) from torch."""
        dev = torch.device(device) if device is not None else None
        if dev is None:
            dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if dev.type == "cpu":
            return TARGETS["cpu"]
        if dev.type != "cuda":
            raise ValueError(f"device={dev!s}: only 'cuda' and 'cpu' devices are described")
        props = torch.cuda.get_device_properties(dev)
        cc = (props.major, props.minor)
        vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
        return cls(
            vendor=vendor,
            name=props.name,
            device_type="cuda",
            compute_capability=cc,
            num_sms=props.multi_processor_count,
            memory_bytes=props.total_memory,
            dtypes=frozenset({"float32", "float16"} | ({"bfloat16"} if cc >= (8, 0) else set())),
            supports_fp8=cc >= (8, 9),
            supports_cuda_graphs=True,
        )

    def short(self) -> str:
        if self.device_type == "cpu":
            return "cpu"
        return f"{self.name} (sm{self.sm}, {self.num_sms} SMs, {self.memory_bytes / 2**30:.0f} GiB)"


_GIB = 2**30
TARGETS: dict[str, DeviceCapabilities] = {
    "cpu": DeviceCapabilities(vendor="cpu", name="cpu", device_type="cpu"),
    "a100": DeviceCapabilities(
        vendor="nvidia",
        name="NVIDIA A100-SXM4-80GB",
        device_type="cuda",
        compute_capability=(8, 0),
        num_sms=108,
        memory_bytes=80 * _GIB,
        supports_fp8=False,
        supports_cuda_graphs=True,
    ),
    "h100": DeviceCapabilities(
        vendor="nvidia",
        name="NVIDIA H100 80GB HBM3",
        device_type="cuda",
        compute_capability=(9, 0),
        num_sms=132,
        memory_bytes=80 * _GIB,
        supports_fp8=True,
        supports_cuda_graphs=True,
    ),
    "h200": DeviceCapabilities(
        vendor="nvidia",
        name="NVIDIA H200",
        device_type="cuda",
        compute_capability=(9, 0),
        num_sms=132,
        memory_bytes=143771 * 2**20,
        supports_fp8=True,
        supports_cuda_graphs=True,
    ),
    "b200": DeviceCapabilities(
        vendor="nvidia",
        name="NVIDIA B200",
        device_type="cuda",
        compute_capability=(10, 0),
        num_sms=148,
        memory_bytes=180 * _GIB,
        supports_fp8=True,
        supports_cuda_graphs=True,
    ),
}


# ------------------------------------------------------------------------------------------
# Run demands
# ------------------------------------------------------------------------------------------
# What ExecutionConstraints.force accepts: {"full": "flashinfer"},
# "full=flashinfer,linear=triton_ssm" or (kind, backend) pairs.
_ForceMapping = str | dict[str, str] | Iterable[tuple[str, str]]


def _parse_mapping(value: _ForceMapping | None, field_name: str) -> tuple[tuple[str, str], ...]:
    """Accept ``{"full": "flashinfer"}`` or ``"full=flashinfer,linear=triton_ssm"``."""
    if value is None:
        return ()
    given = value
    pairs: Iterable[tuple[str, str]]
    if isinstance(value, str):
        items = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, val = part.partition("=")
            _require(bool(sep and key and val), field_name, value, "expected 'kind=backend,...'")
            items.append((key.strip(), val.strip()))
        pairs = items
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        pairs = value
    seen: dict[str, str] = {}
    for k, v in pairs:
        key, val = str(k).strip(), str(v).strip()
        _require(bool(key), field_name, given, f"an empty key (for {val!r})")
        # an empty value would force, or set, nothing without a word
        _require(bool(val), field_name, given, f"{key!r} names no backend (or value)")
        # Sorting below would make the alphabetically last value win: a repeat is a mistake.
        _require(
            key not in seen,
            field_name,
            given,
            f"{key!r} is given twice ({seen.get(key)!r} and {val!r}); keep one",
        )
        seen[key] = val
    return tuple(sorted(seen.items()))


@dataclass(frozen=True, slots=True)
class ExecutionConstraints:
    """What the run demands of every backend it selects.

    ``force`` maps a layer kind (``full``, ``mla``, ``linear``, ``encoder``) or a group id to a
    backend name (``flashinfer`` or namespaced ``vendor:flashinfer``) for every phase; a key with
    a phase prefix (``decode:full``, ``prefill:attn``) or a bare phase (``decode``) forces that
    phase only (see ``attn_core.selector.parse_forced``). A forced backend that cannot serve is
    an error, never silently replaced.
    """

    graph_mode: GraphMode = GraphMode.NONE
    max_batch_size: int = 256  # requests per step
    max_num_tokens: int = 8192  # tokens per step
    max_model_len: int = 32768  # tokens per request
    speculative_tokens: int = 0  # draft tokens verified per request per step
    page_size: int | None = None  # None: the selector picks one all groups accept
    kv_layout: str | None = None  # "NHD" / "HND"; None: any shared one
    kv_dtype: str | None = None  # e.g. "fp8_e4m3" overrides the model's KV dtype
    deterministic: bool = False
    # Refuse NaN / inf in any input about to be written into persistent state (KV pages, conv
    # and SSM slots), naming the request; costs one reduction per input and layer. Also
    # turned on by ATTN_CORE_CHECK_FINITE=1.
    check_finite: bool = False
    spec_verify_strategy: str | None = None  # linear layers: "native" or "replay"
    allow: frozenset[str] = frozenset()  # backend names allowed (empty: all)
    deny: frozenset[str] = frozenset()  # backend names never used
    force: tuple[tuple[str, str], ...] = ()  # ([phase:]kind or group id, or phase, backend)
    downgrade: DowngradePolicy = DowngradePolicy.WARN
    #: per backend (short or qualified name), option values checked against the backend's
    #: ``option_schema`` by the selector; wins over the CLI's and ATTN_CORE_BACKEND_OPTIONS
    backend_options: OptionTable = ()
    #: the same, from ``--option BACKEND.KEY=VALUE`` (set by the CLI; errors name the flag)
    cli_backend_options: OptionTable = ()

    if TYPE_CHECKING:
        # What the constructor accepts (enums by value, comma-separated names, force as a
        # mapping or "kind=backend,..."); the fields above are what __post_init__ leaves.
        # tests/test_typed_constructors.py checks that it matches the fields.
        def __init__(
            self,
            graph_mode: GraphMode | str = GraphMode.NONE,
            max_batch_size: int = 256,
            max_num_tokens: int = 8192,
            max_model_len: int = 32768,
            speculative_tokens: int = 0,
            page_size: int | None = None,
            kv_layout: str | None = None,
            kv_dtype: str | torch.dtype | None = None,
            deterministic: bool = False,
            check_finite: bool = False,
            spec_verify_strategy: str | None = None,
            allow: str | Iterable[str] = frozenset(),
            deny: str | Iterable[str] = frozenset(),
            force: _ForceMapping = (),
            downgrade: DowngradePolicy | str = DowngradePolicy.WARN,
            backend_options: Mapping[str, Mapping[str, object]] | OptionTable = (),
            cli_backend_options: Mapping[str, Mapping[str, object]] | OptionTable = (),
        ) -> None: ...

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        try:
            set_(self, "graph_mode", GraphMode(self.graph_mode))
        except ValueError:
            raise ValueError(
                f"graph_mode={self.graph_mode!r} is invalid; allowed: "
                f"{[m.value for m in GraphMode]}"
            ) from None
        try:
            set_(self, "downgrade", DowngradePolicy(self.downgrade))
        except ValueError:
            raise ValueError(
                f"downgrade={self.downgrade!r} is invalid; allowed: "
                f"{[m.value for m in DowngradePolicy]}"
            ) from None
        for name in ("max_batch_size", "max_num_tokens", "max_model_len"):
            _positive(name, getattr(self, name))
        _require(
            isinstance(self.speculative_tokens, int) and self.speculative_tokens >= 0,
            "speculative_tokens",
            self.speculative_tokens,
            "expected an integer >= 0",
        )
        if self.page_size is not None:
            _positive("page_size", self.page_size)
        if self.kv_layout is not None:
            _require(
                self.kv_layout in ("NHD", "HND"), "kv_layout", self.kv_layout, "allowed: NHD, HND"
            )
        if self.kv_dtype is not None:
            set_(self, "kv_dtype", _canonical_dtype(self.kv_dtype, KV_DTYPES, "kv_dtype"))
        if self.spec_verify_strategy is not None:
            _require(
                self.spec_verify_strategy in ("native", "replay"),
                "spec_verify_strategy",
                self.spec_verify_strategy,
                "allowed: native, replay",
            )
        for name in ("allow", "deny"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            set_(self, name, frozenset(value))
        set_(self, "force", _parse_mapping(self.force, "force"))
        for name in ("backend_options", "cli_backend_options"):
            set_(self, name, options_table(getattr(self, name)))

    @property
    def forced(self) -> dict[str, str]:
        return dict(self.force)

    def with_(self, **changes: Any) -> ExecutionConstraints:
        return replace(self, **changes)
