"""The capability matrix: battery cases derived from what a backend advertises, and only that.

Each :class:`Case` is one battery item: which check, on which layer spec, with which workload, and
which advertised capabilities it exercises (the labels of the final report). Where a capability
set is ``None`` ("any": head dims, page sizes) a representative subset is tested.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from attn_core.backend import BackendCapabilities
from attn_core.specs import DTYPES, GraphMode, LayerKind, LayerSpec, LinearVariant, Phase
from attn_core.testing.workloads import LARGE_MAGNITUDE

__all__ = ["CHECKS", "Case", "build_matrix", "kind_label"]

#: check name -> battery test function name
CHECKS = {
    "correctness": "test_correctness",
    "lifecycle": "test_lifecycle",
    "update": "test_update_refreshes_metadata",
    "graph": "test_cuda_graph_replay",
    "out": "test_out_contract",
    "state": "test_state",
}

ANY_HEAD_DIMS = (64, 128, 256, 80)  # "any": powers of two and one that is not (Phi)
ANY_PAGE_SIZES = (16, 1, 64)
ANY_MLA_DIMS = ((32, 16), (512, 64))  # (kv_lora_rank, qk_rope_head_dim); DeepSeek is 512 / 64
ANY_LINEAR_DIMS = ((32, 32), (64, 128), (128, 128))  # (dk, dv)
SOFT_CAP = 2.0  # small enough to bend random logits: a backend that ignores it is caught
WINDOW = 8
# chunks of 4 tokens: every workload's longer requests span several chunks, and decodes cross
# a chunk boundary (a backend that ignores the chunk mask, or is off by one at it, is caught)
CHUNK = 4


@dataclass(frozen=True, slots=True)
class Case:
    """One battery item.

    :ivar check: a key of :data:`CHECKS`.
    :ivar spec: the layer spec every layer of the test model has.
    :ivar workload: name of a workload in :mod:`attn_core.testing.workloads`.
    :ivar capabilities: report labels of the advertised capabilities this item exercises.
    :ivar spec_tokens: ``k`` for speculative-verify workloads.
    :ivar graph_mode: graph mode of the run's constraints.
    :ivar num_layers: layers in the group (two checks per-layer state separation).
    :ivar strategy: linear spec-verify strategy, or None.
    :ivar skip: a reason to skip on this device, or None.
    :ivar magnitude: inputs scaled by :func:`~attn_core.testing.workloads.scale_inputs` (1: the
        unit-scale random inputs); the output tolerance's ``atol`` is scaled alike.
    :ivar layer_scales: every layer after the first has a softmax scale of its own
        (``LayerAttentionBinding.scale``), unlike the spec's; the first keeps the spec's.
    """

    check: str
    spec: LayerSpec
    workload: str
    capabilities: tuple[str, ...]
    spec_tokens: int = 0
    graph_mode: GraphMode = GraphMode.NONE
    num_layers: int = 1
    strategy: str | None = None
    skip: str | None = None
    tag: str = ""
    magnitude: float = 1.0
    layer_scales: bool = False

    @property
    def id(self) -> str:
        parts = [kind_label(self.spec).replace("/", "-"), self.workload]
        if self.spec_tokens:
            parts.append(f"k{self.spec_tokens}")
        parts += self._spec_parts()
        if self.strategy:
            parts.append(self.strategy)
        if self.graph_mode is not GraphMode.NONE:  # a case per declared mode (decode, full)
            parts.append(f"graph-{self.graph_mode.value}")
        if self.tag:
            parts.append(self.tag)
        if self.magnitude != 1.0:
            parts.append(f"x{self.magnitude:g}")
        if self.layer_scales:
            parts.append("layer-scales")
        return "-".join(parts)

    @property
    def spec_label(self) -> str:
        """The layer spec alone (the id without the workload and the run's options): every
        check of one spec shares it, and ``--attn-shard`` keeps them in one shard."""
        return "-".join([kind_label(self.spec).replace("/", "-"), *self._spec_parts()])

    def _spec_parts(self) -> list[str]:
        s = self.spec
        dims = f"d{s.head_dim}" + (f"v{s.head_dim_v}" if s.head_dim_v != s.head_dim else "")
        parts = [dims, s.dtype]
        if s.kv_dtype != s.dtype:
            parts.append(f"kv-{s.kv_dtype}")
        if s.has_kv_cache:
            parts.append(f"p{s.page_size}")
        parts.append(f"h{s.num_heads}-{s.num_kv_heads}")
        if s.kind is LayerKind.LINEAR and s.state_dtype != "float32":
            parts.append(f"state-{s.state_dtype}")
        if s.linear_variant in _L2NORM_VARIANTS and not s.qk_l2norm:
            parts.append("no-l2norm")
        if not s.causal:
            parts.append("noncausal")
        if s.sliding_window:
            parts.append(f"win{s.sliding_window}")
        if s.attention_chunk_size:
            parts.append(f"chunk{s.attention_chunk_size}")
        if s.logits_soft_cap:
            parts.append("softcap")
        if s.has_sinks:
            parts.append("sinks")
        return parts


def kind_label(spec: LayerSpec) -> str:
    if spec.kind is LayerKind.LINEAR:
        return f"linear/{spec.linear_variant}"
    return spec.kind.value


# ------------------------------------------------------------------------------------------
# base specs
# ------------------------------------------------------------------------------------------
def _pick(values: Iterable, preferred: Iterable):
    values = set(values)
    for p in preferred:
        if p in values:
            return p
    return sorted(values, key=str)[0]


def _base_dtype(caps: BackendCapabilities) -> str:
    # float32 first: the tightest tolerance makes a wrong kernel hardest to hide.
    return _pick(caps.dtypes, ("float32", "bfloat16", "float16"))


def _head_dims(caps: BackendCapabilities, quick: bool) -> tuple[int, list[int]]:
    if caps.head_dims is None:
        return 64, ([] if quick else [d for d in ANY_HEAD_DIMS if d != 64])
    base = _pick(caps.head_dims, (64, 128, 256))
    rest = sorted(d for d in caps.head_dims if d != base)
    return base, rest[:1] if quick else rest


def _page_sizes(caps: BackendCapabilities, quick: bool) -> tuple[int, list[int]]:
    if caps.page_sizes is None:
        return 16, ([1] if quick else [p for p in ANY_PAGE_SIZES if p != 16])
    base = _pick(caps.page_sizes, (16, 32, 64))
    rest = sorted(p for p in caps.page_sizes if p != base)
    return base, rest[:1] if quick else rest


def _mla_dims(caps: BackendCapabilities) -> list[tuple[int, int]]:
    if caps.head_dims is None:
        return list(ANY_MLA_DIMS)
    pairs = [(r, w - r) for r in sorted(caps.head_dims) for w in sorted(caps.head_dims) if w > r]
    return pairs


def _linear_dims(caps: BackendCapabilities, quick: bool) -> list[tuple[int, int]]:
    if caps.head_dims is None:
        return list(ANY_LINEAR_DIMS[:2] if quick else ANY_LINEAR_DIMS)
    dims = sorted(caps.head_dims)
    pairs = [(d, d) for d in dims]
    return pairs[:2] if quick else pairs


def _base_spec(kind: LayerKind, caps: BackendCapabilities, quick: bool, variant=None) -> LayerSpec:
    dtype = _base_dtype(caps)
    if kind in (LayerKind.FULL, LayerKind.ENCODER):
        d, _ = _head_dims(caps, quick)
        ps, _ = _page_sizes(caps, quick)
        # full layers are causal where advertised; encoders bidirectional where advertised
        causal = caps.causal if kind is LayerKind.FULL else not caps.non_causal
        return LayerSpec(
            kind=kind,
            num_heads=4,
            num_kv_heads=2,
            head_dim=d,
            dtype=dtype,
            page_size=ps,
            causal=causal,
        )
    if kind is LayerKind.MLA:
        pairs = _mla_dims(caps)
        if not pairs:
            raise _NoSpec("no (kv_lora_rank, kv_lora_rank + rope) pair among the head dims")
        r, p = pairs[0]
        ps, _ = _page_sizes(caps, quick)
        return _mla_spec(r, p, dtype, ps)
    return _linear_spec(variant, *_linear_dims(caps, quick)[0], dtype, caps)


class _NoSpec(Exception):
    pass


def _mla_spec(r: int, p: int, dtype: str, page_size: int) -> LayerSpec:
    return LayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_dim=r + p,
        head_dim_v=r,
        kv_lora_rank=r,
        qk_rope_head_dim=p,
        qk_nope_head_dim=max(16, r // 4),
        dtype=dtype,
        page_size=page_size,
    )


def _linear_spec(
    variant: LinearVariant, dk: int, dv: int, dtype: str, caps: BackendCapabilities
) -> LayerSpec:
    mamba = variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1)
    if variant is LinearVariant.LIGHTNING:  # one key head per value head, no conv
        return LayerSpec(
            kind="linear",
            linear_variant=variant,
            num_heads=4,
            num_kv_heads=4,
            head_dim=dk,
            head_dim_v=dv,
            dtype=dtype,
            state_dtype=_pick(caps.state_dtypes, ("float32", "bfloat16")),
        )
    if variant is LinearVariant.SHORT_CONV:  # no heads, no SSM state: a conv of 4 * dv channels
        c = 4 * dv
        return LayerSpec(
            kind="linear",
            linear_variant=variant,
            num_heads=1,
            num_kv_heads=1,
            head_dim=c,
            conv_kernel_size=3,
            conv_channels=c,
            dtype=dtype,
        )
    # two key heads (Mamba2: two B / C groups, as Nemotron-H's eight): with one, every mapping
    # of heads to groups reads the same
    hv, hk = (4, 1) if variant is LinearVariant.MAMBA1 else (4, 2)
    channels = hv * dv + 2 * hk * dk  # x (or v) plus B and C (or q and k), as the models do
    if variant is LinearVariant.MAMBA1:
        # one head per inner channel (value width 1, the sweep's dv does not apply); Mamba1's
        # conv runs over x only, B and C come out of x_proj after it
        hv, dv = 8, 1
        channels = hv
    return LayerSpec(
        kind="linear",
        linear_variant=variant,
        num_heads=hv,
        num_kv_heads=hk,
        head_dim=dk,
        head_dim_v=dv,
        conv_kernel_size=4,
        conv_channels=channels,
        dtype=dtype,
        state_dtype=_pick(caps.state_dtypes, ("float32", "bfloat16")),
        qk_l2norm=not mamba,
    )


# ------------------------------------------------------------------------------------------
# the matrix
# ------------------------------------------------------------------------------------------
def _device_skip(spec: LayerSpec, device: torch.device | None, caps_device) -> str | None:
    if device is None or device.type != "cuda" or caps_device is None:
        return None
    if spec.dtype not in caps_device.dtypes:
        return f"the device does not support {spec.dtype}"
    if spec.kv_dtype == "fp8_e4m3" and not caps_device.supports_fp8:
        return "the device has no fp8 support"
    if spec.kv_dtype in DTYPES and spec.kv_dtype not in caps_device.dtypes:
        return f"the device does not support {spec.kv_dtype} (the KV cache's dtype)"
    return None


def build_matrix(
    caps: BackendCapabilities,
    *,
    quick: bool = False,
    device: torch.device | None = None,
    device_caps=None,
    has_cuda: bool = False,
) -> list[Case]:
    """Every battery case for a backend advertising ``caps``, in a stable order.

    :param quick: one representative per sweep and short workloads (CPU smoke run).
    :param device: the torch device the checks will run on.
    :param device_caps: its :class:`~attn_core.specs.DeviceCapabilities` (dtype / fp8 support).
    :param has_cuda: whether CUDA-graph capture can run.
    """
    cases: list[Case] = []
    kinds = sorted(caps.kinds, key=lambda k: list(LayerKind).index(k))
    for kind in kinds:
        variants = (
            sorted(caps.linear_variants, key=lambda v: v.value)
            if kind is LayerKind.LINEAR
            else [None]
        )
        for variant in variants:
            try:
                base = _base_spec(kind, caps, quick, variant)
            except _NoSpec as exc:
                label = kind.value
                cases.append(
                    Case(
                        "correctness",
                        LayerSpec(kind="full", num_heads=1, num_kv_heads=1, head_dim=8),
                        "decode",
                        (f"{label}: head dims",),
                        skip=str(exc),
                    )
                )
                continue
            cases += _kind_cases(base, caps, quick, has_cuda)
    out = []
    for c in cases:
        skip = c.skip or _device_skip(c.spec, device, device_caps)
        out.append(c if skip == c.skip else _replace(c, skip=skip))
    seen: set[tuple[str, str]] = set()
    unique = []
    for c in out:  # sweeps can meet (e.g. the base dtype): keep the first, merge labels
        key = (c.check, c.id)
        if key in seen:
            continue
        seen.add(key)
        unique.append(c)
    return unique


def _replace(case: Case, **changes) -> Case:
    from dataclasses import replace

    return replace(case, **changes)


#: the linear variants whose outputs scale by the layer's softmax scale (``o = S^T q *
#: scale``); Mamba's and the short conv's have none
_SCALED_VARIANTS = frozenset(
    {LinearVariant.GATED_DELTANET, LinearVariant.KDA, LinearVariant.LIGHTNING}
)
#: the variants whose layers choose whether the kernel L2-normalises q and k (``qk_l2norm``)
_L2NORM_VARIANTS = frozenset({LinearVariant.GATED_DELTANET, LinearVariant.KDA})


def _kind_cases(
    base: LayerSpec, caps: BackendCapabilities, quick: bool, has_cuda: bool
) -> list[Case]:
    kind = base.kind
    K = kind_label(base)
    L = (f"{K}: kind",)
    cases: list[Case] = []
    sweep = "ragged" if kind is LayerKind.ENCODER else "mixed"  # prefill + decode where possible

    def add(check, spec, workload, labels, **kw):
        cases.append(Case(check, spec, workload, tuple(labels), **kw))

    # -- named workloads on the base spec --------------------------------------------------
    if kind is LayerKind.ENCODER:
        workloads = ["prefill", "ragged", "tiny_batch"] + ([] if quick else ["long_context"])
    else:
        workloads = ["decode", "prefill", "mixed", "page_boundary", "tiny_batch"]
        if not quick:
            workloads += ["ragged", "long_context"]
    base_labels = [
        *L,
        f"{K}: dtype {base.dtype}",
        f"{K}: head_dim {base.head_dim}",
    ]
    if base.has_kv_cache:
        base_labels.append(f"{K}: page_size {base.page_size}")
    for w in workloads:
        add("correctness", base, w, base_labels, num_layers=2 if w == "mixed" else 1)
    # a layer's own softmax scale (Gemma-2's query_pre_attn_scalar, MLA's mscale, any
    # override), where the kind has one: the second of two layers scales unlike the spec
    if kind is not LayerKind.LINEAR or base.linear_variant in _SCALED_VARIANTS:
        add(
            "correctness",
            base,
            "ragged" if kind is LayerKind.ENCODER else "mixed",
            [f"{K}: per-layer softmax scale"],
            num_layers=2,
            layer_scales=True,
        )
    # verify cases test the verify phase: a backend that does not serve it has none
    if (
        kind is not LayerKind.ENCODER
        and caps.max_speculative_tokens
        and Phase.VERIFY in caps.phases
    ):
        ks = list(range(1, min(4, caps.max_speculative_tokens) + 1))
        if quick:
            ks = sorted({ks[0], ks[-1]})
        strategies = sorted(caps.spec_verify_strategies) if kind is LayerKind.LINEAR else [None]
        for k in ks:
            for strategy in strategies:
                label = f"{K}: speculative verify k={k}"
                if strategy and len(strategies) > 1:
                    label += f" ({strategy})"
                add("correctness", base, "verify", [*L, label], spec_tokens=k, strategy=strategy)

    if base.linear_variant in _L2NORM_VARIANTS:  # a layer may leave q and k as they come
        add("correctness", base.with_(qk_l2norm=False), "mixed", [f"{K}: without the q/k l2norm"])

    # -- dtypes, KV dtypes, state dtypes -----------------------------------------------------
    for dtype in sorted(caps.dtypes - {base.dtype}):
        spec = base.with_(dtype=dtype, kv_dtype=None)
        add("correctness", spec, sweep, [f"{K}: dtype {dtype}"])
    if "bfloat16" in caps.dtypes:
        # Unit-scale inputs are exact in float16 too: values past its range, which bfloat16
        # holds, tell a backend that computes a bfloat16 layer in float16 (it makes inf).
        spec = base.with_(dtype="bfloat16", kv_dtype=None)
        add("correctness", spec, sweep, [f"{K}: dtype bfloat16"], magnitude=LARGE_MAGNITUDE)
    if base.has_kv_cache:
        for kv in sorted(caps.kv_dtypes):
            if kv in caps.dtypes:
                continue  # equal to the activation dtype: covered above
            dtypes = [base.dtype] if quick or kv != "fp8_e4m3" else sorted(caps.dtypes)
            for dtype in dtypes:
                spec = base.with_(dtype=dtype, kv_dtype=kv)
                for w in ("mixed",) if quick else ("mixed", "page_boundary"):
                    add("correctness", spec, w, [f"{K}: kv_dtype {kv}"])
    if base.has_kv_cache and caps.mixed_kv_dtypes:
        # A cache in one compute dtype under a layer of another (fp16 over bf16): the sweeps
        # above keep each cache in its layer's dtype, but mixed_kv_dtypes (the default) lets the
        # selector choose the backend for every such pair.
        pairs = [(d, kv) for kv in sorted(caps.kv_dtypes & caps.dtypes)
                 for d in sorted(caps.dtypes - {kv})]  # fmt: skip
        for dtype, kv in pairs[:1] if quick else pairs:
            spec = base.with_(dtype=dtype, kv_dtype=kv)
            add("correctness", spec, "mixed", [f"{K}: mixed_kv_dtypes"])
    if base.has_ssm_state:  # the short conv keeps no SSM state: no state dtype to sweep
        for sd in sorted(caps.state_dtypes - {base.state_dtype}):
            add("correctness", base.with_(state_dtype=sd), "mixed", [f"{K}: state_dtype {sd}"])

    # -- head dims and head layouts ----------------------------------------------------------
    if kind in (LayerKind.FULL, LayerKind.ENCODER):
        _, dims = _head_dims(caps, quick)
        for d in dims:
            add(
                "correctness",
                base.with_(head_dim=d, head_dim_v=d),
                "mixed" if kind is LayerKind.FULL else "ragged",
                [f"{K}: head_dim {d}"],
            )
        if not quick:
            for h, hkv in ((4, 4), (4, 1)):
                add(
                    "correctness",
                    base.with_(num_heads=h, num_kv_heads=hkv),
                    "mixed" if kind is LayerKind.FULL else "ragged",
                    [f"{K}: MHA / MQA heads"],
                )
    elif kind is LayerKind.MLA:
        for r, p in _mla_dims(caps)[1:]:
            add(
                "correctness",
                _mla_spec(r, p, base.dtype, base.page_size),
                "mixed",
                [f"{K}: head_dim {r + p} (kv_lora_rank {r})"],
            )
    else:
        for dk, dv in _linear_dims(caps, quick)[1:]:
            spec = _linear_spec(LinearVariant(base.linear_variant), dk, dv, base.dtype, caps)
            add(
                "correctness",
                spec.with_(state_dtype=base.state_dtype) if spec.has_ssm_state else spec,
                "mixed",
                [f"{K}: head_dim {dk}/{dv}"],
            )

    # -- page sizes -------------------------------------------------------------------------
    if base.has_kv_cache:
        _, sizes = _page_sizes(caps, quick)
        for ps in sizes:
            add("correctness", base.with_(page_size=ps), "page_boundary", [f"{K}: page_size {ps}"])

    # -- options ------------------------------------------------------------------------------
    if kind in (LayerKind.FULL, LayerKind.ENCODER):
        w_opts = ("mixed", "decode") if kind is LayerKind.FULL else ("ragged",)
        if caps.sliding_window:
            for w in w_opts:
                add("correctness", base.with_(sliding_window=WINDOW), w, [f"{K}: sliding window"])
        if caps.chunked_attention:
            for w in w_opts:
                add(
                    "correctness",
                    base.with_(attention_chunk_size=CHUNK),
                    w,
                    [f"{K}: chunked attention"],
                )
        elif caps.chunked_virtual_batches and base.has_kv_cache:
            # local virtual batches need chunks of whole pages: chunks of one page, over
            # workloads whose requests span several pages (prefill, mixed, decode across them)
            for w in ("page_boundary", "ragged"):
                add(
                    "correctness",
                    base.with_(attention_chunk_size=base.page_size),
                    w,
                    [f"{K}: chunked attention (local virtual batches)"],
                )
        if caps.logits_soft_cap:
            for w in w_opts:
                add("correctness", base.with_(logits_soft_cap=SOFT_CAP), w, [f"{K}: soft-cap"])
        if caps.sinks and kind is LayerKind.FULL:
            for w in w_opts:
                add("correctness", base.with_(has_sinks=True), w, [f"{K}: sinks"])
            if caps.sliding_window:  # gpt-oss's sliding layers carry both
                gpt_oss = base.with_(has_sinks=True, sliding_window=WINDOW)
                for w in w_opts:
                    add("correctness", gpt_oss, w, [f"{K}: sinks + sliding window"])
    # the other masking mode, also advertised; over a KV or latent cache, later steps too,
    # where the cached context holds keys the step's own do not
    if kind is not LayerKind.LINEAR and caps.causal and caps.non_causal:
        other = not base.causal
        label = f"{K}: {'causal' if other else 'non-causal'}"
        masked = ("ragged",) if kind is LayerKind.ENCODER else ("prefill", "mixed", "decode")
        for workload in masked:
            add("correctness", base.with_(causal=other), workload, [label])

    # -- life cycle, out contract, state ---------------------------------------------------------
    add(
        "lifecycle",
        base,
        "lifecycle",
        [f"{K}: life cycle (many steps, changing batches)"],
        num_layers=2,
    )
    add("out", base, "out_contract", [f"{K}: out contract (out, strided out, None; guards)"])
    if kind is not LayerKind.ENCODER:
        add("update", base, "replay", [f"{K}: update() refreshes metadata (emulated replay)"])
        if GraphMode.FULL in caps.graph_modes:
            add(
                "update",
                base,
                "replay_mixed",
                [f"{K}: graph_mode full: update() refreshes a captured mixed step (emulated)"],
                graph_mode=GraphMode.FULL,
            )
        for mode in (GraphMode.DECODE, GraphMode.FULL):
            if mode in caps.graph_modes:
                add(
                    "graph",
                    base,
                    "replay",
                    [f"{K}: graph_mode {mode.value} (CUDA graph capture + replay)"],
                    graph_mode=mode,
                    skip=None if has_cuda else "CUDA is not available: capture needs a GPU",
                )
        if kind is LayerKind.LINEAR:
            add("state", base, "chunked_prefill", [f"{K}: state hand-off (chunked prefill)"])
            add("state", base, "prefix_restore", [f"{K}: prefix-cache restore (conv + SSM)"])
            # one decode step from the same state: a backend serving no decode steps leaves it
            # to the reference, which would pass against itself
            if base.has_ssm_state and base.state_dtype == "float32" and Phase.DECODE in caps.phases:
                add("state", base, "state_precision", [f"{K}: float32 state precision"])
        else:
            add("state", base, "chunked_prefill", [f"{K}: paged KV (chunked prefill == one)"])
            add("state", base, "prefix_restore", [f"{K}: prefix-cache restore (shared pages)"])
    return cases
