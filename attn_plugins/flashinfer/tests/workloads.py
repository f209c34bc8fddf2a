"""Named batch workloads run through AttentionRuntime + BatchBuilder + PersistentState.

The same script of steps runs once with the flashinfer backend and once with the reference
backend (``attn_core:reference``), on identical inputs; the tests compare the outputs. Used by
the CPU tests (with the fake FlashInfer of :mod:`fake_flashinfer`) and the GPU tests (real
FlashInfer), so the plumbing checked on CPU is exactly what runs on the H200.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import attn_plugin_flashinfer.plugin as flashinfer_plugin
import torch

import attn_core.reference.plugin as reference_plugin
from attn_core.batch import BatchBuilder
from attn_core.registry import REFERENCE_BACKEND, Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerKind,
    LayerSpec,
    group_layers,
    torch_dtype,
)
from attn_core.state.manager import PersistentState

REFERENCE = REFERENCE_BACKEND

# A step: [(request id, new tokens), ...]; requests appear in the step they start.
Step = Sequence[tuple[int, int]]

#: Named workloads (prefill-only, decode, mixed, ragged lengths, page boundaries).
WORKLOADS: dict[str, list[Step]] = {
    # pure prefill (ragged path), then decodes across a page boundary, then a chunked prefill
    # of a long request next to decodes (paged prefill path: context > 0)
    "prefill_decode_mixed": [
        [(0, 13), (1, 5), (2, 16)],
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (3, 20), (2, 1)],
        [(3, 9), (0, 1), (1, 1)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ],
    # a request whose prefill comes in chunks, with decodes between
    "chunked_prefill": [
        [(0, 7), (1, 33)],
        [(0, 1), (1, 1)],
        [(0, 40), (1, 1)],
        [(0, 1), (1, 17)],
    ],
}


@dataclass
class Harness:
    """One runtime (flashinfer or reference) with its own state and batch builder."""

    spec: LayerSpec
    backend: str
    device: torch.device
    runtime: AttentionRuntime
    state: PersistentState
    builder: BatchBuilder
    num_layers: int
    positions: dict[int, int] = field(default_factory=dict)

    @property
    def context(self):
        return next(iter(self.runtime.groups.values())).context


def registry() -> Registry:
    reg = Registry()
    reg.register_plugin(reference_plugin, name="attn_core")
    reg.register_plugin(flashinfer_plugin, name="flashinfer")
    return reg


def make(
    spec: LayerSpec,
    backend: str,
    device: torch.device | str,
    *,
    num_layers: int = 2,
    num_pages: int = 96,
    max_batch: int = 8,
    max_tokens: int = 160,
    max_model_len: int = 384,
    spec_tokens: int = 0,
    graph: bool | str = False,
    target: DeviceCapabilities | None = None,
    kv_scales: tuple[float, float] | None = None,
    layer_scales: Sequence[float] | None = None,
) -> Harness:
    """A runtime whose only group is served by ``backend`` (forced through the selector).

    :param graph: the run's graph mode: True is ``decode``, a string names it (``"full"``).
    :param layer_scales: each layer's own softmax scale (``LayerAttentionBinding.scale``), in
        place of the spec's.
    """
    device = torch.device(device)
    groups = group_layers([spec] * num_layers)
    if isinstance(graph, str):
        graph_mode = GraphMode(graph)
    else:
        graph_mode = GraphMode.DECODE if graph else GraphMode.NONE
    constraints = ExecutionConstraints(
        graph_mode=graph_mode,
        max_batch_size=max_batch,
        max_num_tokens=max_tokens,
        max_model_len=max_model_len,
        speculative_tokens=spec_tokens,
        force={spec.kind.value: backend},
    )
    if target is None:
        target = DeviceCapabilities.detect(device) if device.type == "cuda" else None
        target = target or DeviceCapabilities.target("h200")
    reg = registry()
    plan = select(groups, reg, target, constraints)
    assert plan.choices[0].backend.qualified_name == backend, plan.to_dict()
    state = PersistentState(groups, num_pages=num_pages, num_slots=0, device=device)
    if kv_scales is not None:
        for i in range(num_layers):
            if spec.kind is LayerKind.MLA:
                state.kv_cache.set_scale(i, k=kv_scales[0], v=kv_scales[0])
            else:
                state.kv_cache.set_scale(i, k=kv_scales[0], v=kv_scales[1])
    layer_params: dict[int, dict] = {i: {"scale": s} for i, s in enumerate(layer_scales or ())}
    if spec.has_sinks:  # one sink logit per head and layer, the same for every backend
        g = torch.Generator().manual_seed(1234)
        for i in range(num_layers):
            sinks = (torch.randn(spec.num_heads, generator=g) * 2.0).to(device)
            layer_params.setdefault(i, {})["sinks"] = sinks
    runtime = AttentionRuntime(plan, reg, state=state, device=device, layer_params=layer_params)
    builder = BatchBuilder(
        state,
        max_batch_size=max_batch,
        max_num_tokens=max_tokens,
        max_pages_per_request=math.ceil(max_model_len / spec.page_size),
        device=device,
    )
    return Harness(spec, backend, device, runtime, state, builder, num_layers)


def inputs(spec: LayerSpec, step: int, layer: int, tokens: int, device, *, seed: int = 0):
    """Deterministic q, k, v for one layer of one step (same for every backend)."""
    g = torch.Generator().manual_seed(hash((seed, step, layer)) % (2**31))
    dtype = torch_dtype(spec.dtype)
    H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if spec.kind is LayerKind.MLA:
        return rnd(tokens, H, D) * 0.5, rnd(tokens, D), None
    return rnd(tokens, H, D), rnd(tokens, Hkv, D), rnd(tokens, Hkv, Dv)


def run_step(h: Harness, step_index: int, step: Step, *, spec_tokens: int = 0,
             pad_to: int | None = None, pad_tokens_to: int | None = None, seed: int = 0,
             update: bool = False,
             input_rows: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Build, prepare and run one step on every layer; returns each layer's real-token output.

    :param pad_tokens_to: with ``pad_to``, a captured mixed step's token count (graph mode
        full: ``BatchBuilder.build(pad_tokens_to=...)``).
    :param update: ``runtime.update(batch)`` (what precedes a graph replay) instead of
        ``prepare``.
    :param input_rows: draw each layer's inputs for this many rows and pass the first
        ``padded_tokens`` (default: ``padded_tokens``): an unpadded step then sees the same
        real-token inputs as the same step padded to ``input_rows`` tokens.
    """
    for rid, _ in step:
        if rid not in h.positions:
            h.state.add_request(rid)
            h.positions[rid] = 0
    batch = h.builder.build(
        list(step), spec_tokens=spec_tokens, pad_to=pad_to, pad_tokens_to=pad_tokens_to
    )
    if update:
        h.runtime.update(batch)
    else:
        h.runtime.prepare(batch)
    outs = []
    spec = h.spec
    for layer in range(h.num_layers):
        rows = batch.padded_tokens
        drawn = inputs(spec, step_index, layer, input_rows or rows, h.device, seed=seed)
        q, k, v = (x[:rows] if x is not None else None for x in drawn)
        out = torch.full(
            (batch.padded_tokens, spec.num_heads, spec.head_dim_v),
            float("nan"),
            dtype=q.dtype,
            device=h.device,
        )
        h.runtime.binding(layer).forward(q, k, v, out=out)
        outs.append(out[: batch.num_tokens].float().cpu())
    for rid, n in step:
        h.state.advance(rid, n)
        h.positions[rid] += n
    return outs


def run_script(h: Harness, script: Sequence[Step], **kw) -> list[list[torch.Tensor]]:
    return [run_step(h, i, step, **kw) for i, step in enumerate(script)]


def max_error(a: Sequence[Sequence[torch.Tensor]], b: Sequence[Sequence[torch.Tensor]]) -> float:
    """Largest absolute difference over every step and layer (NaN counts as infinite)."""
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        for x, y in zip(sa, sb, strict=True):
            assert x.shape == y.shape, (x.shape, y.shape)
            d = (x - y).abs()
            if torch.isnan(d).any():
                return float("inf")
            worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst
