"""Shared harness of the plugin tests (no tests here; named test_plugin_* to sit with them): one
model, two lanes (reference backend, triton_ssm), the same steps and inputs through
AttentionRuntime + BatchBuilder + PersistentState on each.

Each lane owns its PersistentState; both add the same requests in the same order, so the slot
allocator hands out the same slots and states compare slot by slot.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import attn_core.reference.plugin as ref_plugin
from attn_core.batch import AttentionBatch, BatchBuilder
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    group_layers,
    torch_dtype,
)
from attn_core.state import PersistentState

TRITON = "triton_ssm:triton_ssm"
TRITON_MAMBA1 = "triton_ssm:triton_ssm_mamba1"
REFERENCE = "attn_core:reference"
LAYERS = (0, 1)


def make_registry() -> Registry:
    from attn_plugin_triton_ssm import plugin

    registry = Registry()
    registry.register_plugin(ref_plugin, name="attn_core")
    registry.register_plugin(plugin, name="triton_ssm")
    return registry


def available_registry(monkeypatch: Any, backend: str) -> Registry:
    """:func:`make_registry` for a test that needs ``backend`` (``TRITON``, ``TRITON_MAMBA1``):
    on a machine without CUDA its kernels run in Triton's interpreter; the test is skipped,
    with the backend's reason, where it is unavailable."""
    import pytest

    if not torch.cuda.is_available():
        monkeypatch.setenv("ATTN_TRITON_SSM_INTERPRET", "1")
    reg = make_registry()
    resolved = reg.resolve(backend)
    if not resolved.available:
        pytest.skip(f"triton_ssm unavailable: {resolved.unavailable_reason}")
    return reg


def make_spec(
    variant: str,
    *,
    hv: int = 4,
    hk: int = 2,
    dk: int = 16,
    dv: int = 16,
    channels: int = 48,
    kernel: int = 4,
    dtype: str = "float32",
    state_dtype: str = "float32",
) -> LayerSpec:
    if variant == "lightning":  # no conv, one key head per value head
        return LayerSpec(
            kind="linear",
            linear_variant=variant,
            num_heads=hv,
            num_kv_heads=hv,
            head_dim=dk,
            head_dim_v=dv,
            dtype=dtype,
            state_dtype=state_dtype,
        )
    if variant == "short_conv":  # no heads, no SSM state: the conv alone (LFM2's kernel 3)
        return LayerSpec(
            kind="linear",
            linear_variant=variant,
            num_heads=1,
            num_kv_heads=1,
            head_dim=channels,
            conv_kernel_size=3,
            conv_channels=channels,
            dtype=dtype,
        )
    return LayerSpec(
        kind="linear",
        linear_variant=variant,
        num_heads=hv,
        num_kv_heads=hk,
        head_dim=dk,
        head_dim_v=dv,
        conv_kernel_size=kernel,
        conv_channels=channels,
        dtype=dtype,
        state_dtype=state_dtype,
        qk_l2norm=variant not in ("mamba2", "mamba1"),
    )


@dataclass
class Lane:
    backend: str
    runtime: AttentionRuntime
    state: PersistentState
    builder: BatchBuilder
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    batch: AttentionBatch | None = None


def make_lane(
    registry: Registry,
    backend: str,
    spec: LayerSpec,
    device: str,
    target: DeviceCapabilities,
    constraints: ExecutionConstraints,
    *,
    num_slots: int = 8,
) -> Lane:
    groups = group_layers([spec] * len(LAYERS))
    plan = select(groups, registry, target, constraints.with_(force={"linear": backend}))
    assert plan.choices[0].backend.qualified_name == backend
    state = PersistentState(groups, num_pages=1, num_slots=num_slots, device=device)
    runtime = AttentionRuntime(plan, registry, state=state, device=device)
    builder = BatchBuilder(
        state,
        max_batch_size=constraints.max_batch_size,
        max_num_tokens=constraints.max_num_tokens,
        device=device,
    )
    return Lane(backend, runtime, state, builder)


def layer_params(spec: LayerSpec, device: str, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per-layer weights: conv weight / bias, and Mamba2's / Mamba1's A_log, D, dt_bias
    (Mamba1's A_log per channel and state entry, ``[H, Dk]``)."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(spec.dtype)
    out = {}
    for i in LAYERS:
        H = spec.num_heads
        p = {}
        if spec.has_conv:
            C, K = spec.conv_dims
            p["conv_w"] = (torch.randn(C, K, generator=gen) * 0.5).to(dt)
            p["conv_b"] = (torch.randn(C, generator=gen) * 0.1).to(dt)
        if spec.linear_variant.value == "lightning":  # decay rates e^-1.5 .. e^-0.01 per token
            p["slope"] = torch.rand(H, generator=gen) * 1.5 + 0.01
        if spec.linear_variant.value == "mamba2":
            p["A_log"] = torch.randn(H, generator=gen) * 0.5
            p["D"] = torch.randn(H, generator=gen)
            p["dt_bias"] = torch.randn(H, generator=gen) * 0.3
        if spec.linear_variant.value == "mamba1":
            p["A_log"] = torch.rand(H, spec.head_dim, generator=gen).mul(2).log1p()
            p["D"] = torch.randn(H, generator=gen)
            p["dt_bias"] = torch.randn(H, generator=gen) * 0.3
        out[i] = {k: v.to(device) for k, v in p.items()}
    return out


def step_inputs(spec: LayerSpec, tokens: int, device: str, seed: int) -> dict[int, dict]:
    """Per-layer random activations for ``tokens`` rows, in the layout of attn_core.specs."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(spec.dtype)
    T, Hk, Hv, Dk, Dv = tokens, spec.num_kv_heads, spec.num_heads, spec.head_dim, spec.head_dim_v

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    out = {}
    for i in LAYERS:
        x = {"conv_x": r(T, spec.conv_channels).to(dt)} if spec.has_conv else {}
        x["q"], x["k"] = r(T, Hk, Dk).to(dt), r(T, Hk, Dk).to(dt)
        x["v"] = r(T, Hv, Dv).to(dt)
        variant = spec.linear_variant.value
        if variant in ("lightning", "short_conv"):
            x["extra"] = {}  # lightning's slope is a layer parameter; the conv needs nothing
        elif variant in ("mamba2", "mamba1"):
            x["extra"] = {"dt": r(T, Hv, scale=0.5).to(dt)}
        else:
            g_shape = (T, Hv, Dk) if variant == "kda" else (T, Hv)
            x["extra"] = {
                "g": (-torch.rand(*g_shape, generator=gen) * 0.5).to(dt),
                "beta": torch.rand(T, Hv, generator=gen).to(dt),
            }
        out[i] = {
            k: (
                {kk: vv.to(device) for kk, vv in v.items()} if isinstance(v, dict) else v.to(device)
            )
            for k, v in x.items()
        }
    return out


def run_step(
    lane: Lane,
    requests: Sequence[tuple[Hashable, int]],
    inputs: dict[int, dict],
    *,
    spec_tokens: int = 0,
    pad_to: int | None = None,
    out_none: bool = False,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Build, prepare, and run conv1d + forward on every layer; returns (conv out, out).
    ``out_none``: pass ``out=None`` (the backend allocates what it returns)."""
    batch = lane.builder.build(requests, spec_tokens=spec_tokens, pad_to=pad_to)
    lane.batch = batch
    lane.runtime.prepare(batch)
    results = {}
    for i in LAYERS:
        b = lane.runtime.binding(i)
        x, p = inputs[i], lane.params[i]
        variant = b.spec.linear_variant.value
        conv = torch.zeros(0)  # lightning attention has no conv
        if "conv_x" in x:
            act = None if variant == "short_conv" else "silu"  # LFM2's conv has no activation
            conv = b.conv1d(
                x["conv_x"],
                p["conv_w"],
                p["conv_b"],
                activation=act,
                out=None if out_none else torch.empty_like(x["conv_x"]),
            )
        if variant == "short_conv":  # the conv is the layer's whole core
            results[i] = (conv, conv)
            continue
        extra = dict(x["extra"])
        if "A_log" in p:
            extra.update(A_log=p["A_log"], D=p["D"], dt_bias=p["dt_bias"])
        if "slope" in p:
            extra["slope"] = p["slope"]
        out = b.forward(
            x["q"], x["k"], x["v"], out=None if out_none else torch.empty_like(x["v"]), **extra
        )
        results[i] = (conv, out)
    return results


def states(lane: Lane) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {
        i: (
            lane.state.state_slots.layer(i).conv.clone(),
            lane.state.state_slots.layer(i).ssm.clone(),
        )
        for i in LAYERS
    }
