"""docs/reference.md, the plugin author's reference, checked against the code.

The tables of fields (BackendCapabilities with defaults, Backend, AttentionBatch, the layer
binding) must list exactly what the classes have; the per-kind shapes and dtypes are evaluated and
compared with what a backend is handed in a real run through the core (a spy wrapping the
reference); the stated math (scale, soft-cap, sinks, masking), padding rows, encoder batches and
the ranking rule are run. A field added, removed or renamed without the page fails here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import attn_core.reference.plugin as ref
from attn_core.backend import REQUIRED, Backend, BackendCapabilities
from attn_core.batch import AttentionBatch, BatchMode
from attn_core.binding import LayerAttentionBinding
from attn_core.hookspecs import hookimpl
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import TuningData, check_backend, select
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    LayerKind,
    LayerSpec,
    group_layers,
    torch_dtype,
)
from attn_core.state import PersistentState
from attn_core.state.kv_cache import FullKVLayer, MLAKVLayer
from attn_core.state.slots import LinearStateLayer
from attn_core.testing.harness import Limits, Pair, Side
from attn_core.testing.workloads import Step, conv_params, layer_inputs, to_device

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reference.md"
TEXT = DOC.read_text()
CPU = DeviceCapabilities.target("cpu")


# ------------------------------------------------------------------------------------------
# reading the page
# ------------------------------------------------------------------------------------------
def _section(heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", TEXT, re.MULTILINE | re.DOTALL)
    assert m, f"{DOC.name} has no section '## {heading}'"
    return m.group(1)


def _tables(heading: str) -> list[list[dict[str, str]]]:
    """The section's tables, each a list of rows keyed by the header's cells."""
    tables, current = [], None
    for line in [*_section(heading).splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if current is None:
                current = {"header": cells, "rows": []}
            elif not set("".join(cells)) <= set("-: "):
                current["rows"].append(dict(zip(current["header"], cells, strict=True)))
        elif current is not None:
            tables.append(current["rows"])
            current = None
    assert tables, f"section {heading!r} has no table"
    return tables


def _code(cell: str) -> str:
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"expected a `code` cell, got {cell!r}"
    return m.group(1)


def _render(value: Any) -> str:
    """A default as the page writes it."""
    if value is REQUIRED or value is dataclasses.MISSING:
        return "required"
    if isinstance(value, frozenset):
        items = sorted(getattr(v, "value", v) for v in value)
        return "`" + ("{" + ", ".join(repr(v) for v in items) + "}" if items else "set()") + "`"
    return f"`{value!r}`"


def _defaults_table(cls: type, heading: str) -> None:
    (rows,) = _tables(heading)
    documented = [_code(r["field"]) for r in rows]
    fields = dataclasses.fields(cls)
    assert documented == [f.name for f in fields], (
        f"{DOC.name} '{heading}' lists {documented}, {cls.__name__} has {[f.name for f in fields]}"
    )
    for row, f in zip(rows, fields, strict=True):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        assert row["default"] == _render(default), (f.name, row["default"], _render(default))
        assert len(row["meaning"]) > 10, f"{f.name}: say what it means"


# ------------------------------------------------------------------------------------------
# the field tables
# ------------------------------------------------------------------------------------------
def test_the_guide_links_the_reference():
    assert "(reference.md)" in (ROOT / "docs" / "plugin-guide.md").read_text()


def test_every_capability_field_with_its_default():
    _defaults_table(BackendCapabilities, "BackendCapabilities")


def test_the_required_capabilities_are_the_ones_without_a_default():
    required = [f.name for f in dataclasses.fields(BackendCapabilities) if f.default is REQUIRED]
    assert required == ["device_types", "dtypes"]


def test_every_backend_field_with_its_default():
    _defaults_table(Backend, "Backend")


def _public_properties(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items() if isinstance(v, property) and not n.startswith("_")]


def test_every_batch_field_and_property():
    (rows,) = _tables("AttentionBatch")
    documented = [_code(r["field"]) for r in rows]
    expected = [f.name for f in dataclasses.fields(AttentionBatch)]
    expected += _public_properties(AttentionBatch)
    assert documented == expected


def _signature(fn: Any) -> str:
    """``name(a, b=None, *, c='x', **kw)`` without annotations and without ``self``."""
    parts, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return f"{fn.__name__}({', '.join(parts)})"


def test_every_binding_attribute_and_method():
    (rows,) = _tables("The layer binding")
    documented = [_code(r["attribute"]) for r in rows]
    slots = [s for s in LayerAttentionBinding.__slots__ if not s.startswith("_")]
    methods = [
        getattr(LayerAttentionBinding, n)
        for n, v in vars(LayerAttentionBinding).items()
        if inspect.isfunction(v) and not n.startswith("_")
    ]
    names = [d.partition("(")[0] for d in documented]
    assert sorted(names) == sorted(
        slots + _public_properties(LayerAttentionBinding) + [m.__name__ for m in methods]
    )
    for m in methods:  # the signatures as they are (a renamed argument fails)
        assert _signature(m) in documented, (_signature(m), documented)
    # the views behind layer.kv and layer.linear_state, attribute for attribute
    by = {_code(r["attribute"]): r["meaning"] for r in rows}
    kv_fields = {f.name for cls in (FullKVLayer, MLAKVLayer) for f in dataclasses.fields(cls)}
    assert set(re.findall(r"`\.(\w+)`", by["kv"])) == kv_fields
    state_fields = {f.name for f in dataclasses.fields(LinearStateLayer)}
    assert set(re.findall(r"`\.(\w+)`", by["linear_state"])) == state_fields


def test_every_context_method_and_when_the_runtime_needs_it():
    """The context table against the reference's contexts (signatures) and the runtime's
    build-time check (which method it refuses a context without, and when)."""
    import attn_core.runtime as runtime
    from attn_core.errors import PluginError

    rows = {_code(r["method"]).partition("(")[0]: r for r in _tables("The context")[0]}
    assert list(rows) == ["prepare", "forward", "update", "conv1d", "commit_speculative"]
    linear = ref.LinearContext
    for name, row in rows.items():
        assert _code(row["method"]) == _signature(getattr(linear, name)), name
    group = types.SimpleNamespace(spec=SPECS["linear gated_deltanet"], group_id="linear")
    backend = types.SimpleNamespace(plugin="p", name="b")

    def refused(without: str, **constraints: Any) -> bool:
        ctx = types.SimpleNamespace(**{n: lambda *a, **k: None for n in rows if n != without})
        try:
            runtime._check_context(ctx, None, group, backend, ExecutionConstraints(**constraints))
        except PluginError:
            return True
        return False

    assert refused("prepare") and refused("forward") and refused("conv1d")
    assert refused("update", graph_mode="decode") and not refused("update")
    assert refused("commit_speculative", speculative_tokens=2)
    assert not refused("commit_speculative")
    assert "when the run's graph mode is not `none`" in rows["update"]["needed"]
    assert "`speculative_tokens > 0`" in rows["commit_speculative"]["needed"]


# ------------------------------------------------------------------------------------------
# a run through the core: what a backend is handed
# ------------------------------------------------------------------------------------------
SPECS = {
    "full": LayerSpec(
        kind="full",
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        head_dim_v=8,
        page_size=4,
        dtype="bfloat16",
        kv_dtype="fp8_e4m3",
    ),
    "encoder": LayerSpec(
        kind="encoder", num_heads=6, num_kv_heads=2, head_dim=16, head_dim_v=8, causal=False
    ),
    "mla": LayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_dim=24,
        head_dim_v=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        page_size=4,
        kv_dtype="fp8_e4m3",
    ),
    **{
        f"linear {variant}": LayerSpec(
            kind="linear",
            linear_variant=variant,
            num_heads=4,
            num_kv_heads=hk,
            head_dim=8,
            head_dim_v=6,
            conv_kernel_size=4,
            conv_channels=4 * 6 + 2 * hk * 8,
            qk_l2norm=variant != "mamba2",
        )
        for variant, hk in (("gated_deltanet", 2), ("kda", 4), ("mamba2", 1))
    },
    # no conv: its conv state is [num_slots, 0]; the short conv has no forward (no row)
    "linear lightning": LayerSpec(
        kind="linear",
        linear_variant="lightning",
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        head_dim_v=6,
    ),
    "linear mamba1": LayerSpec(
        kind="linear",
        linear_variant="mamba1",
        num_heads=6,
        num_kv_heads=1,
        head_dim=8,
        head_dim_v=1,
        conv_kernel_size=4,
        conv_channels=6,
    ),
}


class _Spy:
    """A plugin serving what the reference serves, through the reference, recording each call."""

    ATTN_CORE_API_VERSION = "1.1"

    def __init__(self, tamper=None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.tamper = tamper

    @hookimpl
    def attn_core_register_backends(self, register):
        register(Backend(name="spy", capabilities=ref.CAPABILITIES))

    @hookimpl
    def attn_core_allocate_context(self, backend, group, device, constraints, state, workspace):
        inner = ref.attn_core_allocate_context(
            backend, group, device, constraints, state, workspace
        )
        return _SpyContext(inner, self)


class _SpyContext:
    def __init__(self, inner: Any, spy: _Spy) -> None:
        self.inner, self.spy, self.batch = inner, spy, None

    def prepare(self, batch):
        self.batch = batch
        self.inner.prepare(batch)

    def update(self, batch):
        self.batch = batch
        self.inner.update(batch)

    def conv1d(self, layer, x, weight, bias, *, activation="silu", out=None):
        return self.inner.conv1d(layer, x, weight, bias, activation=activation, out=out)

    def commit_speculative(self, batch, num_accepted):
        self.inner.commit_speculative(batch, num_accepted)

    def forward(self, layer, q, k, v, out, **inputs):
        self.spy.calls.append(
            dict(layer=layer, q=q, k=k, v=v, out=out, inputs=inputs, batch=self.batch)
        )
        result = self.inner.forward(layer, q, k, v, out, **inputs)
        if self.spy.tamper is not None:
            self.spy.tamper(self.batch, result)
        return result


def _registry(spy: _Spy) -> tuple[Registry, Backend, Backend]:
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    reg.register_plugin(spy, name="spy")
    return reg, reg.resolve("spy:spy"), reg.resolve("attn_core:reference")


def _spy_run(spec: LayerSpec, steps: list[Step], **side_kw: Any) -> tuple[list[dict], Side]:
    spy = _Spy()
    reg, backend, _ = _registry(spy)
    side = Side(
        "backend",
        backend,
        reg,
        spec,
        num_layers=1,
        limits=Limits(max_batch=4, max_tokens=32, max_len=32),
        device=torch.device("cpu"),
        device_caps=CPU,
        **side_kw,
    )
    gen = torch.Generator().manual_seed(0)
    conv = None
    if spec.has_conv:
        conv = tuple(t.to(torch_dtype(spec.dtype)) for t in conv_params(spec, gen))
    for step in steps:
        batch = side.begin(step)
        inputs = to_device(layer_inputs(spec, batch.padded_tokens, gen), spec, side.device)
        side.forward(0, inputs, side.poisoned_out(batch.padded_tokens), conv=conv)
        side.finish(step, batch, None)
    return spy.calls, side


def _steps(spec: LayerSpec) -> list[Step]:
    if spec.kind is LayerKind.ENCODER:
        return [Step([(0, 5), (1, 3)])]
    return [Step([(0, 5), (1, 3)], add=(0, 1)), Step([(0, 1), (1, 1)], pad_to=4)]


def _names(spec: LayerSpec, batch: AttentionBatch, side: Side) -> dict[str, int]:
    names = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    names["T"] = batch.padded_tokens
    if side.state is not None:
        names["num_pages"] = side.state.kv_cache.num_pages
        names["num_slots"] = side.state.state_slots.num_slots
    return names


def _shape(text: str, names: dict[str, int]) -> tuple[int, ...] | None:
    if text == "None":
        return None
    assert text.startswith("[") and text.endswith("]"), text
    inner = text[1:-1].strip()
    if not inner:
        return ()
    return tuple(eval(part, {"__builtins__": {}}, names) for part in inner.split(","))


def _dtype(text: str, spec: LayerSpec) -> torch.dtype:
    return torch.float32 if text == "float32" else torch_dtype(getattr(spec, text))


FORWARD_ROWS = {
    " ".join(re.findall(r"`(\w+)`", r["kind"])): r
    for r in _tables("Per-kind tensor conventions")[0]
}


def test_the_forward_table_has_one_row_per_kind_and_variant():
    assert sorted(FORWARD_ROWS) == sorted(SPECS)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_what_forward_is_handed_per_kind(kind):
    spec = SPECS[kind]
    row = FORWARD_ROWS[kind]
    calls, side = _spy_run(spec, _steps(spec))
    assert len(calls) == len(_steps(spec))
    dtype = torch_dtype(spec.dtype)
    for call in calls:
        names = _names(spec, call["batch"], side)
        for arg in ("q", "k", "v", "out"):
            want = _shape(_code(row[f"`{arg}`"]), names)
            got = call[arg]
            if want is None:
                assert got is None, f"{kind}: {arg} should be None"
                continue
            assert tuple(got.shape) == want, (kind, arg)
            assert got.dtype == dtype, (kind, arg)
        documented = re.findall(r"`(\w+)` `(\[[^`]*\])`( float32)?", row["keyword inputs"])
        assert {n for n, _, _ in documented} == set(call["inputs"]), kind
        for name, shape, f32 in documented:
            t = call["inputs"][name]
            assert tuple(t.shape) == _shape(shape, names), (kind, name)
            assert t.dtype == (torch.float32 if f32 else dtype), (kind, name, t.dtype)


STATE_ROWS = _tables("Per-kind tensor conventions")[1]


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_the_state_a_layer_owns_per_kind(kind):
    spec = SPECS[kind]
    base = kind.split()[0]
    calls, side = _spy_run(spec, _steps(spec)[:1])
    layer = calls[0]["layer"]
    names = _names(spec, calls[0]["batch"], side)
    rows = [r for r in STATE_ROWS if _code(r["kind"]) == base]
    if spec.kind is LayerKind.ENCODER:
        assert not rows and layer.kv is None and layer.linear_state is None
        return
    documented = set()
    for r in rows:
        path = _code(r["tensor"])
        assert path.startswith("layer.")
        t = layer
        for part in path.split(".")[1:]:
            t = getattr(t, part)
        kept = {"conv": spec.has_conv, "ssm": spec.has_ssm_state}.get(path.split(".")[-1], True)
        if spec.kind is LayerKind.LINEAR and not kept:
            # "a state the variant does not keep is [num_slots, 0]"
            assert tuple(t.shape) == (names["num_slots"], 0), (kind, path)
        else:
            assert tuple(t.shape) == _shape(_code(r["shape"]), names), (kind, path)
        assert t.dtype == _dtype(_code(r["dtype"]), spec), (kind, path, t.dtype)
        documented.add(path)
    # every tensor of the layer's views is in the table
    for view_name in ("kv", "linear_state"):
        view = getattr(layer, view_name)
        if view is None:
            continue
        for f in dataclasses.fields(view):
            if isinstance(getattr(view, f.name), torch.Tensor):
                assert f"layer.{view_name}.{f.name}" in documented, (kind, f.name)
    if spec.kind is LayerKind.MLA:
        assert layer.kv.v_scale is layer.kv.k_scale  # "the same tensor as its k_scale"


_BATCH_TENSOR = re.compile(r"^`(\[[^`]*\])` (int32|int64|bool)\b")


def test_the_batch_tables_shapes_and_dtypes_are_a_real_batchs():
    """Each tensor row of the AttentionBatch table (``[shape] dtype``), its host mirrors and the
    ``None`` cases, against the batches of a prefill and a padded decode step (full) and of a
    linear layer (the state slots)."""
    rows = {_code(r["field"]): r["meaning"] for r in _tables("AttentionBatch")[0]}
    tensors = {n: _BATCH_TENSOR.match(m) for n, m in rows.items() if _BATCH_TENSOR.match(m)}
    assert set(tensors) >= {"query_start_loc", "page_table", "slot_mapping", "state_indices",
                            "has_initial_state", "slot_mapping_cpu"}  # fmt: skip
    mirrors = {n: re.match(r"host mirror of `(\w+)`", m) for n, m in rows.items()}
    mirrors = {n: m.group(1) for n, m in mirrors.items() if m}
    assert set(mirrors) == {"query_start_loc_cpu", "seq_lens_cpu", "context_lens_cpu"}
    full, _ = _spy_run(SPECS["full"], _steps(SPECS["full"]))
    linear, _ = _spy_run(SPECS["linear gated_deltanet"], _steps(SPECS["linear gated_deltanet"]))
    seen = set()
    for call in full + linear:
        batch = call["batch"]
        names = {"padded_reqs": batch.padded_reqs, "padded_tokens": batch.padded_tokens}
        if batch.page_table is not None:
            names["max_pages_per_request"] = batch.page_table.shape[1]
        for name, m in tensors.items():
            t = getattr(batch, name)
            if t is None:  # documented: None without the layers it serves, or in decode steps
                assert "None" in rows[name], name
                continue
            seen.add(name)
            assert tuple(t.shape) == _shape(m.group(1), names), (name, batch.mode)
            dtype = t.dtype if isinstance(t, torch.Tensor) else torch.from_numpy(t[:0]).dtype
            assert dtype == getattr(torch, m.group(2)), (name, dtype)
            assert isinstance(t, torch.Tensor) != name.endswith("_cpu"), name  # numpy on host
        last = call is full[-1] or call is linear[-1]  # earlier steps' device buffers are reused
        for name, device in mirrors.items():
            host, dev = getattr(batch, name), getattr(batch, device)
            assert tuple(host.shape) == tuple(dev.shape) and str(host.dtype) in str(dev.dtype)
            assert not last or host.tolist() == dev.tolist(), name
        assert batch.query_lens_cpu.tolist() == np.diff(batch.query_start_loc_cpu).tolist()
        no_mirror = batch.mode is BatchMode.DECODE or batch.slot_mapping is None
        assert (batch.slot_mapping_cpu is None) == no_mirror, batch.mode
    assert seen == set(tensors)  # every documented tensor was seen at least once


def test_encoder_batches_are_as_documented():
    calls, _ = _spy_run(SPECS["encoder"], [Step([(0, 5), (1, 3)])])
    batch = calls[0]["batch"]
    assert batch.mode is BatchMode.ENCODER
    assert batch.request_ids == (0, 1)
    for name in ("page_table", "slot_mapping", "state_indices", "has_initial_state"):
        assert getattr(batch, name) is None, name
    assert batch.query_start_loc.tolist() == [0, 5, 8]
    assert batch.seq_lens.tolist() == [5, 3] and batch.context_lens.tolist() == [0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_padding_rows_are_as_documented_and_need_not_be_written():
    spec = SPECS["full"]
    calls, _ = _spy_run(spec, _steps(spec))
    batch = calls[1]["batch"]  # decode of 2 requests padded to 4
    assert (batch.num_reqs, batch.padded_reqs) == (2, 4)
    assert (batch.num_tokens, batch.padded_tokens) == (2, 4)
    assert batch.seq_lens.tolist()[2:] == [1, 1]
    assert batch.query_lens_cpu.tolist()[2:] == [1, 1]
    assert batch.page_table[2:, 0].tolist() == [0, 0]
    assert batch.slot_mapping.tolist()[2:] == [-1, -1]

    # A backend that leaves its padding rows NaN passes the kit's comparison of a padded step.
    def nan_padding(batch, result):
        result[batch.num_tokens :] = float("nan")

    reg, lazy, reference = _registry(_Spy(tamper=nan_padding))
    session = types.SimpleNamespace(
        device=torch.device("cpu"), device_caps=CPU, reference=reference, backend=lazy, registry=reg
    )
    gen = torch.Generator().manual_seed(1)
    pair = Pair(session, spec, gen, num_layers=1, limits=Limits(max_batch=8, max_tokens=64))
    pair.step(Step([(0, 5), (1, 3)], add=(0, 1)), "prefill")
    (got,) = pair.step(Step([(0, 1), (1, 1)], pad_to=4), "padded decode")
    assert got[2:].isnan().all() and not got[:2].isnan().any()


# ------------------------------------------------------------------------------------------
# the math, sinks and scales
# ------------------------------------------------------------------------------------------
def test_scale_then_soft_cap_then_mask_then_sinks():
    math_ = _section("Scale, soft-cap, sinks, masking")
    assert "`c * tanh(scale * q.k / c)`" in math_ and "the sink only joins" in math_
    spec = LayerSpec(
        kind="full",
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype="float32",
        logits_soft_cap=2.0,
        has_sinks=True,
        sliding_window=4,
        softmax_scale=0.3,
    )
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    calls, _ = _spy_run(spec, [Step([(0, 7)], add=(0,))], layer_params={0: {"sinks": sinks}})
    (call,) = calls
    layer, q, k, v = call["layer"], call["q"], call["k"], call["v"]
    assert layer.sinks is sinks and layer.scale == 0.3  # layer_params' tensor, as given
    kv_head = torch.arange(4) // 2  # GQA: query head h reads KV head h // (4 // 2)
    dots = torch.einsum("phd,jhd->hpj", q, k[:, kv_head])
    p, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    visible = (p - 4 < j) & (j <= p)  # causal, sliding window 4

    def attend(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.masked_fill(~visible, float("-inf"))
        logits = torch.cat([logits, sinks[:, None, None].expand(4, 7, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink joins the denominator only
        return torch.einsum("hpj,jhd->phd", probs, v[:, kv_head])

    out = call["out"]
    want = attend(2.0 * torch.tanh(layer.scale * dots / 2.0))  # the page's order
    assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
    other = attend(layer.scale * 2.0 * torch.tanh(dots / 2.0))  # scale after the cap
    assert not torch.allclose(out, other, atol=1e-2)  # the check tells the orders apart


def test_fp8_scales_are_the_caches_and_set_in_place():
    spec = SPECS["full"]
    calls, side = _spy_run(spec, _steps(spec)[:1])
    kv = calls[0]["layer"].kv
    k_scale = kv.k_scale
    assert k_scale.item() == 1.0 and k_scale.shape == () and k_scale.dtype == torch.float32
    side.state.kv_cache.set_scale(0, k=0.05, v=0.07)
    assert kv.k_scale is k_scale and math.isclose(k_scale.item(), 0.05, rel_tol=1e-6)
    assert math.isclose(kv.v_scale.item(), 0.07, rel_tol=1e-6)


def test_the_reference_serves_a_cache_in_another_dtype_as_its_default_claim_says():
    """mixed_kv_dtypes is left at its default (True) by the reference, so the selector chooses
    it for an fp16 layer over a bf16 cache: it serves that, keys and values rounded to the
    cache's dtype, the math in float32."""
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                     dtype="float16", kv_dtype="bfloat16")  # fmt: skip
    default = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
    assert default.mixed_kv_dtypes and ref.CAPABILITIES.mixed_kv_dtypes  # left at the default
    reference = _registry(_Spy())[2]
    assert check_backend(reference, spec, CPU, ExecutionConstraints()) == []  # admitted
    (call,) = _spy_run(spec, [Step([(0, 7)], add=(0,))])[0]
    layer, q, k, v = call["layer"], call["q"], call["k"], call["v"]
    assert layer.kv.k.dtype == torch.bfloat16 and q.dtype == torch.float16
    kv_head = torch.arange(4) // 2
    kb, vb = (t.to(torch.bfloat16).float()[:, kv_head] for t in (k, v))
    logits = layer.scale * torch.einsum("phd,jhd->hpj", q.float(), kb)
    p, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    probs = torch.softmax(logits.masked_fill(j > p, float("-inf")), dim=-1)
    want = torch.einsum("hpj,jhd->phd", probs, vb)
    assert torch.allclose(call["out"].float(), want, atol=2e-3), (call["out"] - want).abs().max()


def test_a_layer_with_sinks_and_no_tensor_is_refused_at_build_time():
    spec = SPECS["full"].with_(has_sinks=True, kv_dtype=None)
    with pytest.raises(Exception, match="has sinks in its spec but no sinks tensor"):
        _spy_run(spec, [])


def test_sinks_for_a_layer_whose_spec_has_none_are_refused_at_build_time():
    """The binding took them: the reference and fa3 then applied them, FlashInfer ignored them
    (its spec said no sinks), the official FA3 build failed: one model, three answers."""
    spec = SPECS["full"].with_(kv_dtype=None)
    assert not spec.has_sinks
    groups = group_layers([spec])
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    plan = select(groups, reg, CPU, ExecutionConstraints())
    state = PersistentState.from_plan(plan, num_pages=4, num_slots=0)
    sinks = {0: {"sinks": torch.zeros(spec.num_heads)}}
    with pytest.raises(ValueError, match=r"layer 0 .*sinks tensor was given.*has_sinks=False"):
        AttentionRuntime(plan, reg, state=state, layer_params=sinks)


# ------------------------------------------------------------------------------------------
# ranking and trust
# ------------------------------------------------------------------------------------------
def _ranked(*plugins: tuple[str, str, int], tuning: TuningData | None = None) -> str:
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, name, priority in plugins:
        mod = types.ModuleType(plugin)
        mod.ATTN_CORE_API_VERSION = "1.1"
        caps = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
        backend = Backend(name=name, capabilities=caps, priority=priority)
        mod.attn_core_register_backends = hookimpl(lambda register, b=backend: register(b))
        reg.register_plugin(mod, name=plugin)
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    plan = select(group_layers([spec]), reg, CPU, ExecutionConstraints(), tuning=tuning)
    return plan.choices[0].backend.qualified_name


def test_ranking_as_documented():
    ranking = " ".join(_section("Ranking").split())
    assert "the reference (`attn_core:reference`) ranks last" in ranking
    assert "whatever their `priority` (the default `0`, or below it) and their names" in ranking
    assert "registers at priority `0`" not in ranking  # the old tie on the name is gone
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "the reference ranks last, below every other admissible backend" in readme
    assert "(docs/reference.md#ranking)" in readme
    assert _ranked() == "attn_core:reference"
    # every other admissible backend outranks the reference, whatever its priority and name
    assert _ranked(("acme", "naive", 0)) == "acme:naive"
    assert _ranked(("sdpa", "sdpa", 0)) == "sdpa:sdpa"
    assert _ranked(("sdpa", "sdpa", -7)) == "sdpa:sdpa"
    assert _ranked(("aaa", "x", -1)) == "aaa:x"
    assert _ranked(("sdpa", "sdpa", 1)) == "sdpa:sdpa"
    assert _ranked(("sdpa", "sdpa", 1), ("acme", "naive", 5)) == "acme:naive"  # priority
    assert _ranked(("sdpa", "sdpa", 0), ("acme", "naive", 0)) == "acme:naive"  # then the name
    assert _ranked(("sdpa", "sdpa", 0), ("acme", "naive", -1)) == "sdpa:sdpa"
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    tuning = TuningData()
    tuning.record("attn_core:reference", spec, 9.0)
    assert _ranked(("acme", "naive", 5), tuning=tuning) == "attn_core:reference"  # measured first
    tuning.record("acme:naive", spec, 3.0)
    assert _ranked(("acme", "naive", 5), tuning=tuning) == "acme:naive"  # fastest first
    tuning.record("attn_core:reference", spec, 1.0)
    assert _ranked(("acme", "naive", 5), tuning=tuning) == "attn_core:reference"  # measured faster


def test_the_trust_model_links_the_readme_section():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^## Trust model$", readme, re.MULTILINE)
    assert "(../README.md#trust-model)" in _section("Trust model")
