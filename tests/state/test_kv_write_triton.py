"""The Triton KV writer stores exactly the bytes of the torch writer, in one launch.

With a GPU these tests run the compiled kernel through the public API (CUDA tensors dispatch to
it). Without one they run the same kernel on CPU tensors under ``TRITON_INTERPRET=1`` (set by
``tests/conftest.py`` before anything imports Triton), with the writer's device dispatch
patched to pick the kernel for CPU tensors too.

Triton 3.x's interpreter rounds fp32 -> bf16 by truncation and fp32 -> fp8 without carrying
into the exponent (31.1 becomes 16), unlike the GPU's ``cvt.rn``. The interpreter fixture below
replaces its converter with torch's round-to-nearest-even casts, so the comparison checks the
kernel's logic (masking, addressing, scaling, clamping) bit for bit; the GPU run checks the
hardware casts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from attn_core.state import kv_write
from attn_core.state.kv_write import FP8_DTYPE, write_kv_slots, write_slots, write_slots_torch

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "without CUDA the Triton kernel runs only under TRITON_INTERPRET=1",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")
kv_write_triton = pytest.importorskip("attn_core.state.kv_write_triton")

PAGES, PAGE = 8, 16
SLOTS = PAGES * PAGE


@pytest.fixture(autouse=True)
def _kernel_on_this_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route CPU tensors to the kernel (interpreter) and give the interpreter exact casts."""
    if HAS_CUDA:
        return
    monkeypatch.setattr(kv_write, "_kernels", lambda cache: kv_write_triton)
    from triton.runtime import interpreter

    tl = pytest.importorskip("triton.language")
    to_torch = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }
    as_bits = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src not in to_torch or dst not in to_torch:
            return original(data, src, dst, rounding_mode)
        bits = np.ascontiguousarray(data).view(f"uint{src.primitive_bitwidth}")
        x = torch.from_numpy(bits.view(f"int{src.primitive_bitwidth}").copy())
        if src.primitive_bitwidth == 8:
            x = x.view(torch.uint8)
        y = x.view(to_torch[src]).to(to_torch[dst]).view(as_bits[dst.primitive_bitwidth])
        return y.numpy().view(f"uint{dst.primitive_bitwidth}")

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def _slots(T: int, pad: float = 0.3, *, first_pad: bool = False, seed: int = 0) -> torch.Tensor:
    """``[T]`` distinct slots with a fraction ``pad`` of ``-1`` anywhere (or the first)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(SLOTS, generator=g)[:T]
    slots[torch.rand(T, generator=g) < pad] = -1
    if first_pad:
        slots[0] = -1
    return slots.to(DEV)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, *, scale: float = 30.0, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _caches(row: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """A cache full of old data (so "stores nothing" is visible) and a copy for the torch path."""
    c = _rand((PAGES, PAGE, *row), torch.float32, scale=1.0, seed=seed).to(dtype)
    return c, c.clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Byte equality (NaNs too), with the first differing element in the message."""
    a, b = a.contiguous(), b.contiguous()
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).flatten()
    if diff.any():
        i = int(diff.nonzero()[0]) // a.element_size()
        raise AssertionError(
            f"{int(diff.sum())} bytes differ; first at element {i}: got "
            f"{a.flatten()[i].float().item()}, expected {b.flatten()[i].float().item()}"
        )


def _check_kv(k, v, kc, vc, slots, ks=None, vs=None, *, padding=True):
    """The fused writer against two torch writes, on copies of the same caches."""
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_slots(k, v, kc, vc, slots, ks, vs, may_have_padding=padding)
    write_slots_torch(k, kc2, slots, ks, may_have_padding=padding)
    write_slots_torch(v, vc2, slots, vs, may_have_padding=padding)
    _same(kc, kc2)
    _same(vc, vc2)


CASTS = [
    pytest.param(torch.float32, torch.float32, None, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, None, id="bf16"),
    pytest.param(torch.float16, torch.float16, None, id="fp16"),
    pytest.param(torch.float32, torch.bfloat16, None, id="fp32-into-bf16"),
    pytest.param(torch.bfloat16, FP8_DTYPE, "tensor", id="bf16-into-fp8-scale-tensor"),
    pytest.param(torch.float32, FP8_DTYPE, "float", id="fp32-into-fp8-scale-float"),
    pytest.param(torch.float16, FP8_DTYPE, None, id="fp16-into-fp8-no-scale"),
]


@pytest.mark.parametrize(("x_dtype", "cache_dtype", "scale"), CASTS)
@pytest.mark.parametrize("first_pad", [False, True], ids=["pad-inside", "pad-first"])
def test_k_and_v_match_the_torch_writer(x_dtype, cache_dtype, scale, first_pad):
    """Heads 3 x 80 for K, 3 x 48 for V (rows not powers of two, K and V of different sizes)."""
    T = 9
    k, v = _rand((T, 3, 80), x_dtype, seed=2), _rand((T, 3, 48), x_dtype, seed=3)
    kc, _ = _caches((3, 80), cache_dtype, 4)
    vc, _ = _caches((3, 48), cache_dtype, 5)
    ks = vs = None
    if scale == "tensor":
        ks, vs = torch.tensor(0.37, device=DEV), torch.tensor(2.5, device=DEV)
    elif scale == "float":
        ks, vs = 0.37, 2.5
    _check_kv(k, v, kc, vc, _slots(T, first_pad=first_pad), ks, vs)


def test_a_kept_write_shape_takes_each_calls_tensors_scales_and_token_count():
    """The second write of one shape reuses the arguments kept for it (launch's plan), with
    this call's K/V, caches, scale tensors and token count: other values, other slots."""
    kv_write_triton._PLANS.clear()
    for seed, (T, k_scale) in enumerate([(9, 0.37), (5, 3.0), (9, 0.05)]):
        k, v = _rand((T, 3, 80), torch.bfloat16, seed=seed), _rand((T, 3, 48), torch.bfloat16)
        kc, _ = _caches((3, 80), FP8_DTYPE, 4 + seed)
        vc, _ = _caches((3, 48), FP8_DTYPE, 5 + seed)
        ks, vs = torch.tensor(k_scale, device=DEV), torch.tensor(2 * k_scale, device=DEV)
        _check_kv(k, v, kc, vc, _slots(T, first_pad=bool(seed % 2)), ks, vs)
    assert len(kv_write_triton._PLANS) == 1  # the token count is not part of a plan


def test_rows_of_three_dims_are_reshaped_per_call_and_match():
    """Rows of 3+ dims are merged to ``[H, D]`` for the kernel (a reshape: a copy for a strided
    source), so launch passes the reshaped tensors and keeps no plan for the shape."""
    kv_write_triton._PLANS.clear()
    T = 6
    k = _rand((T, 2, 3, 8), torch.bfloat16, seed=7)
    v = _rand((T, 3, 2, 8), torch.bfloat16, seed=8).transpose(1, 2)  # strided: reshape copies
    kc, _ = _caches((2, 3, 8), torch.bfloat16, 9)
    vc, _ = _caches((2, 3, 8), torch.bfloat16, 10)
    _check_kv(k, v, kc, vc, _slots(T))
    assert not kv_write_triton._PLANS


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_mla_latent_single_tensor_matches(cache_dtype):
    """One MLA latent row of 576 (512 + 64) per token, one tensor per launch."""
    T = 6
    x = _rand((T, 576), torch.bfloat16, seed=6)
    c, c2 = _caches((576,), cache_dtype, 7)
    scale = torch.tensor(0.5, device=DEV)
    slots = _slots(T, seed=8)
    write_slots(x, c, slots, scale)
    write_slots_torch(x, c2, slots, scale)
    _same(c, c2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("T", [1, 5])
def test_a_batch_of_padding_only_changes_nothing(cache_dtype, T):
    k, v = _rand((T, 2, 64), torch.bfloat16), _rand((T, 2, 64), torch.bfloat16)
    kc, kc_before = _caches((2, 64), cache_dtype, 9)
    vc, vc_before = _caches((2, 64), cache_dtype, 10)
    slots = torch.full((T,), -1, dtype=torch.long, device=DEV)
    write_kv_slots(k, v, kc, vc, slots, torch.tensor(1.0, device=DEV), None)
    _same(kc, kc_before)
    _same(vc, vc_before)


def test_one_token_decode():
    k, v = _rand((1, 8, 128), torch.bfloat16), _rand((1, 8, 128), torch.bfloat16, seed=2)
    kc, _ = _caches((8, 128), torch.bfloat16, 11)
    vc, _ = _caches((8, 128), torch.bfloat16, 12)
    _check_kv(k, v, kc, vc, torch.tensor([37], device=DEV), padding=False)


def test_many_tokens_with_a_longer_int32_slot_mapping():
    """T = 120 of a graph's padded batch; slot_mapping is int32 and longer than T."""
    T = 120
    k, v = _rand((T, 2, 96), torch.float16), _rand((T, 2, 96), torch.float16, seed=2)
    kc, _ = _caches((2, 96), torch.float16, 13)
    vc, _ = _caches((2, 96), torch.float16, 14)
    slots = torch.cat([_slots(T, pad=0.1), torch.tensor([5, 6], device=DEV)]).int()
    _check_kv(k, v, kc, vc, slots)


def test_tiles_of_several_tokens_and_partial_rows(monkeypatch: pytest.MonkeyPatch):
    """The prefill tiling (BLOCK_T > 1, a row split into blocks with a partial last one)."""
    monkeypatch.setattr(kv_write_triton, "_config", lambda T, row, n: (4, 64, 1))
    T = 13  # not a multiple of BLOCK_T
    k, v = _rand((T, 3, 80), torch.bfloat16), _rand((T, 2, 40), torch.bfloat16, seed=2)
    kc, _ = _caches((3, 80), FP8_DTYPE, 15)
    vc, _ = _caches((2, 40), FP8_DTYPE, 16)
    scale = torch.tensor(0.25, device=DEV)
    _check_kv(k, v, kc, vc, _slots(T), scale, scale)


def test_strided_sources():
    """K and V sliced out of a fused qkv projection, and V with heads not contiguous."""
    T, H, D = 7, 2, 32
    qkv = _rand((T, 3 * H * D), torch.bfloat16).view(T, 3, H, D)
    k = qkv[:, 1]  # token stride 3*H*D, heads contiguous
    v = _rand((T, D, H), torch.bfloat16, seed=2).transpose(1, 2)  # head stride 1, dim stride H
    assert not k.is_contiguous() and v.stride() == (H * D, 1, H)
    kc, _ = _caches((H, D), torch.bfloat16, 17)
    vc, _ = _caches((H, D), torch.bfloat16, 18)
    _check_kv(k, v, kc, vc, _slots(T))


def test_fp8_special_values():
    """Ties, subnormals, saturation, NaN: the kernel's fp8 bytes equal torch's."""
    vals = [0.001, 0.0005, -0.003, 1e-5, 0.015, 1.0625, 1.03125, 1.09375, 31.1, 447.9]
    vals += [449.0, 464.0, 470.0, -1e6, 1e30, float("nan"), float("-inf"), 0.0, -0.0]
    x = torch.tensor(vals, dtype=torch.float32, device=DEV).view(1, -1)
    c, c2 = _caches((len(vals),), FP8_DTYPE, 19)
    slots = torch.tensor([3], device=DEV)
    write_slots(x, c, slots)
    write_slots_torch(x, c2, slots)
    _same(c, c2)


def test_a_slot_past_the_cache_stores_nothing():
    """The kernel cannot raise: an out-of-range slot is masked rather than written past the end."""
    x = _rand((3, 2, 8), torch.float32)
    c, before = _caches((2, 8), torch.float32, 20)
    write_slots(x, c, torch.tensor([SLOTS, -1, 2], device=DEV))
    flat, old = c.view(SLOTS, 2, 8), before.view(SLOTS, 2, 8)
    _same(flat[2], x[2])
    others = torch.arange(SLOTS, device=DEV) != 2
    _same(flat[others], old[others])


def test_launch_config_grows_tiles_only_for_large_batches():
    cfg = kv_write_triton._config
    assert cfg(1, 1024, 2) == (1, 1024, 2)  # decode: one token per program
    assert cfg(64, 1024, 2)[0] == 1
    block_t, block_r, warps = cfg(16384, 2048, 2)  # prefill: ~4096 elements per program
    assert block_t * block_r == 4096 and warps == 8
    assert cfg(3, 576, 1)[1] == 1024  # rows pad to a power of two


@pytest.mark.gpu
def test_fused_writer_replays_in_a_cuda_graph_with_new_slots_and_scale():
    """Captured once on a step of padding only; replays see new slots, data and fp8 scale."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    T, row = 6, (8, 128)
    k = torch.zeros(T, *row, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros_like(k)
    slots = torch.full((T + 2,), -1, dtype=torch.long, device=DEV)
    k_scale = torch.tensor(1.0, device=DEV)
    v_scale = torch.tensor(1.0, device=DEV)
    kc, _ = _caches(row, FP8_DTYPE, 21)
    vc, _ = _caches(row, FP8_DTYPE, 22)
    lat = torch.zeros(T, 576, dtype=torch.bfloat16, device=DEV)
    lc, _ = _caches((576,), torch.bfloat16, 23)

    def step() -> None:
        write_kv_slots(k, v, kc, vc, slots, k_scale, v_scale)
        write_slots(lat, lc, slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed, (ks, vs) in enumerate([(0.5, 3.0), (2.0, 0.125)]):
        k.copy_(_rand(k.shape, torch.bfloat16, seed=seed))
        v.copy_(_rand(v.shape, torch.bfloat16, seed=seed + 10))
        lat.copy_(_rand(lat.shape, torch.bfloat16, seed=seed + 20))
        slots[:T].copy_(_slots(T, seed=seed))
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        want = [c.clone() for c in (kc, vc, lc)]
        write_slots_torch(k, want[0], slots, k_scale)
        write_slots_torch(v, want[1], slots, v_scale)
        write_slots_torch(lat, want[2], slots)
        graph.replay()
        torch.cuda.synchronize()
        for got, exp in zip((kc, vc, lc), want, strict=True):
            _same(got, exp)

    slots.fill_(-1)  # replaying padding only leaves everything as it is
    before = [c.clone() for c in (kc, vc, lc)]
    graph.replay()
    torch.cuda.synchronize()
    for got, exp in zip((kc, vc, lc), before, strict=True):
        _same(got, exp)


def test_a_bound_write_hands_the_kernel_its_addresses_or_falls_back_to_launch(monkeypatch):
    """BoundWrite: the seven pointer arguments in the kernel's order (a scale tensor's address
    where the write shape has one, the cache's where not), on the current stream; a misaligned
    tensor or another current device goes through launch() and its checks instead."""
    from attn_core.fast_launch import BoundLaunch, CachedLaunch

    class Bound:
        device = -1
        stream_for = BoundLaunch.stream_for  # the real check, on a recording stand-in

        def __init__(self):
            self.calls = []

        def launch(self, stream, *ptrs):
            self.calls.append((stream, ptrs))

    launched = []
    monkeypatch.setattr(kv_write_triton, "launch", lambda *a: launched.append(a))
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    monkeypatch.setattr(CachedLaunch, "current_stream", staticmethod(lambda dev: 77))
    bound = Bound()
    write = kv_write_triton.BoundWrite(bound, (True, False), num_tokens=2)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k_scale, slots = torch.ones(()), torch.tensor([1, 2])
    write((k, v), (kc, vc), (k_scale, None), slots)
    ptrs = (slots, k, kc, k_scale, v, vc, vc)
    assert bound.calls == [(77, tuple(t.data_ptr() for t in ptrs))]
    assert launched == []
    odd = torch.zeros(2 * 2 * 8 + 2)[2:].view(2, 2, 8)  # 8 bytes into its storage
    write((odd, v), (kc, vc), (k_scale, None), slots)
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: 0))
    write((k, v), (kc, vc), (k_scale, None), slots)
    assert len(bound.calls) == 1 and [a[4] for a in launched] == [2, 2]
