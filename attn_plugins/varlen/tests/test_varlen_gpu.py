"""GPU tests of the varlen plugin: both backends against the reference backend, each run through
AttentionRuntime + BatchBuilder.build_encoder (encoder layers keep no state).

Run on the H200: ``python3 -m pytest attn_plugins/varlen/tests/test_varlen_gpu.py -q
-p no:cacheprovider``. The ``varlen`` cases skip when this torch has no ``varlen_attn``.
"""

from __future__ import annotations

import pytest
import torch
from attn_plugin_varlen import kernels, plugin

import attn_core.reference.plugin as ref_plugin
from attn_core.batch import BatchBuilder
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

_INFO, _MISSING = kernels.probe_varlen_attn()
_HAS_SM80 = torch.cuda.get_device_capability() >= (8, 0)
BACKENDS = [
    pytest.param(
        "varlen",
        marks=pytest.mark.skipif(
            _INFO is None or not _HAS_SM80, reason=f"varlen_attn unusable: {_MISSING}"
        ),
    ),
    "sdpa",
]
# Vision-tower shapes: one CLS-like token, a 24x24 grid (+1), small tiles, a long one.
LENGTHS = [1, 577, 64, 64, 64, 1000, 130]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _run(backend: str, spec: LayerSpec, lengths=LENGTHS, scale: float | None = None) -> None:
    groups = group_layers([spec])
    reg = Registry(strict=True)
    reg.register_plugin(ref_plugin, name="attn_core")
    reg.register_plugin(plugin, name="varlen")
    dev = DeviceCapabilities.detect()
    cons = dict(max_batch_size=32, max_num_tokens=4096)
    plan = select(groups, reg, dev, ExecutionConstraints(force=f"encoder={backend}", **cons))
    ref_plan = select(groups, reg, dev, ExecutionConstraints(force="encoder=reference", **cons))
    params = {0: {"scale": scale}} if scale is not None else None
    rt = AttentionRuntime(plan, reg, device="cuda", layer_params=params)
    rt_ref = AttentionRuntime(ref_plan, reg, device="cuda", layer_params=params)
    builder = BatchBuilder(None, max_batch_size=32, max_num_tokens=4096, device="cuda")
    batch = builder.build_encoder(lengths)
    dtype = getattr(torch, spec.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    t = batch.num_tokens

    def r(h: int, d: int) -> torch.Tensor:
        return torch.randn(t, h, d, device="cuda", generator=g).to(dtype)

    q = r(spec.num_heads, spec.head_dim)
    k = r(spec.num_kv_heads, spec.head_dim)
    v = r(spec.num_kv_heads, spec.head_dim_v)
    rt_ref.prepare(batch)
    want = rt_ref.binding(0).forward(q, k, v)
    rt.prepare(batch)
    out = torch.empty(t, spec.num_heads, spec.head_dim_v, dtype=dtype, device="cuda")
    got = rt.binding(0).forward(q, k, v, out=out)
    assert got is out
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _enc(**kw) -> LayerSpec:
    base = dict(kind="encoder", num_heads=16, num_kv_heads=16, head_dim=64, causal=False)
    base.update(kw)
    return LayerSpec(**base)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])
def test_bidirectional_vision_shapes(backend, head_dim):
    _run(backend, _enc(head_dim=head_dim))


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_gqa_fp16(backend):
    _run(backend, _enc(num_kv_heads=4, causal=True, dtype="float16"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(backend, causal):
    if backend == "varlen" and not _INFO.window:
        pytest.skip("this torch's varlen_attn has no window_size")
    _run(backend, _enc(sliding_window=100, causal=causal))


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend):
    _run(backend, _enc(), scale=0.3)


def test_sdpa_float32():
    _run("sdpa", _enc(dtype="float32", head_dim=40))


def test_sdpa_many_equal_images_batched():
    _run("sdpa", _enc(), lengths=[256] * 12 + [17])
