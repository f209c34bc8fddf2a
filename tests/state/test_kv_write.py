"""The core's paged KV writer: padding stores nothing, fp8 quantises, and it captures in a graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_core.state import kv_write
from attn_core.state.kv_write import FP8_DTYPE, quantize, write_kv_slots, write_slots


def _cache(dtype=torch.float32):
    return torch.zeros(4, 4, 2, 3, dtype=dtype)  # 4 pages x 4 tokens, 2 heads, d3


def test_padding_slots_store_nothing():
    x = torch.randn(5, 2, 3)
    cache = _cache()
    slots = torch.tensor([6, 1, -1, 13, -1])
    write_slots(x, cache, slots)
    flat = cache.view(16, 2, 3)
    torch.testing.assert_close(flat[6], x[0])
    torch.testing.assert_close(flat[1], x[1])
    torch.testing.assert_close(flat[13], x[3])
    written = {6, 1, 13}
    untouched = [i for i in range(16) if i not in written]
    assert flat[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_a_step_of_padding_only_changes_nothing(dtype):
    """The dummy step a server captures a graph with: every slot is -1, row 0 holds data."""
    cache = torch.randn(4, 4, 2, 3).to(dtype)
    before = cache.clone()
    write_slots(torch.randn(3, 2, 3), cache, torch.tensor([-1, -1, -1]), torch.tensor(1.0))
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_without_padding_the_plain_scatter_matches():
    x = torch.randn(3, 2, 3)
    a, b = _cache(), _cache()
    slots = torch.tensor([3, 4, 9])
    write_slots(x, a, slots, may_have_padding=False)
    write_slots(x, b, slots)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.view(16, 2, 3)[9], x[2])


def test_fp8_stores_scaled_clamped_values():
    x = torch.tensor([[[1.0, -2.0, 1000.0], [0.5, 0.25, -1000.0]]])
    cache = _cache(FP8_DTYPE)
    scale = torch.tensor(2.0)
    write_slots(x, cache, torch.tensor([5]), scale)
    got = cache.view(16, 2, 3)[5].float()
    expected = (x[0] / 2).clamp(-448, 448)
    torch.testing.assert_close(got, expected.to(FP8_DTYPE).float())
    assert quantize(x, torch.bfloat16, None).dtype == torch.bfloat16


@pytest.mark.gpu
def test_write_captures_in_a_cuda_graph_and_replays_new_slots():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    cache = _cache().to(dev)
    x = torch.zeros(3, 2, 3, device=dev)
    slots = torch.tensor([-1, -1, -1], device=dev)  # a dummy step of padding only
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        write_slots(x, cache, slots)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_slots(x, cache, slots)
    x.copy_(torch.randn(3, 2, 3))
    slots.copy_(torch.tensor([7, -1, 12]))
    cache.zero_()
    graph.replay()
    flat = cache.view(16, 2, 3).cpu()
    torch.testing.assert_close(flat[7], x[0].cpu())
    torch.testing.assert_close(flat[12], x[2].cpu())
    assert flat[[i for i in range(16) if i not in (7, 12)]].abs().sum() == 0
    slots.fill_(-1)  # replaying padding only leaves everything as it is
    before = cache.clone()
    graph.replay()
    assert torch.equal(cache, before)


def test_write_kv_slots_writes_both_like_two_write_slots():
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 5)
    kc, vc = _cache(), torch.zeros(4, 4, 2, 5)
    slots = torch.tensor([2, -1, 9, 15])
    write_kv_slots(k, v, kc, vc, slots)
    kc2, vc2 = _cache(), torch.zeros(4, 4, 2, 5)
    write_slots(k, kc2, slots)
    write_slots(v, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(vc.view(16, 2, 5)[15], v[3])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c, s: write_slots(torch.randn(2, 3, 3), c, s), r"expected shape \[T, 2, 3\]"),
        (lambda c, s: write_slots(torch.ones(2, 2, 3, dtype=torch.int32), c, s), "float tensor"),
        (lambda c, s: write_slots(torch.randn(2, 2, 3), c, s[:1]), "at least 2 entries"),
        (lambda c, s: write_slots(torch.randn(2, 2, 3), c, s.float()), "1-D integer"),
        (
            lambda c, s: write_slots(torch.randn(2, 2, 3), c.to(FP8_DTYPE), s, torch.ones(2)),
            "one-element tensor",
        ),
        (
            lambda c, s: write_slots(torch.randn(2, 2, 3), c.transpose(0, 1), s),
            "merge into one slot dim",
        ),
        (
            lambda c, s: write_kv_slots(torch.randn(2, 2, 3), torch.randn(1, 2, 3), c, c, s),
            "same token count",
        ),
    ],
    ids=["row", "dtype", "short-slots", "float-slots", "scale", "cache-strides", "k-v-tokens"],
)
def test_inputs_that_do_not_fit_the_cache_raise(call, match):
    """Checked from tensor metadata only: a kernel would corrupt the cache instead of raising."""
    with pytest.raises(ValueError, match=match):
        call(_cache(), torch.tensor([0, 1]))


class _RecordingKernels:
    """Stands in for the Triton writer module: records which writes reach it."""

    def __init__(self) -> None:
        self.launches: list[int] = []

    def launch(self, xs, caches, scales, slot_mapping, num_tokens) -> None:
        self.launches.append(num_tokens)
        for x, cache, scale in zip(xs, caches, scales, strict=True):
            kv_write.write_slots_torch(x, cache, slot_mapping, scale)


@pytest.mark.parametrize(
    ("tokens", "padding", "dtype"),
    [
        (1, False, torch.bfloat16),  # eager decode
        (256, False, torch.float16),
        (257, False, torch.bfloat16),  # prefill
        (1, True, torch.bfloat16),  # maybe padded (graph): the kernel masks it
        (1, False, FP8_DTYPE),  # fp8 quantises in the kernel
    ],
)
def test_every_write_with_a_kernel_for_its_device_takes_the_kernel(
    monkeypatch, tokens, padding, dtype
):
    """A cache with a kernel (CUDA) is written by one launch per call whatever the step:
    small unpadded eager writes no longer take ``index_copy_`` (see the module docs)."""
    kernels = _RecordingKernels()
    monkeypatch.setattr(kv_write, "_kernels", lambda cache: kernels)
    pages = -(-(tokens + 1) // 16)
    k_cache = torch.zeros(pages, 16, 2, 4, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(tokens, 2, 4), torch.randn(tokens, 2, 4)
    slots = torch.randperm(pages * 16)[:tokens]
    write_kv_slots(k, v, k_cache, v_cache, slots, may_have_padding=padding)
    write_slots(k, k_cache, slots, may_have_padding=padding)
    assert kernels.launches == [tokens, tokens]
    flat = v_cache.view(-1, 2, 4).float()
    assert torch.equal(flat[slots], quantize(v, dtype, None).float())


def test_slot_runs_split_where_slots_stop_being_consecutive():
    from attn_core.state.kv_write import slot_runs

    slots = np.array([32, 33, 34, 35, 8, 9, 10, 100], dtype=np.int64)
    assert slot_runs(slots) == [(0, 32, 4), (4, 8, 3), (7, 100, 1)]
    assert slot_runs(slots, max_runs=2) is None
    assert slot_runs(np.array([5, 6, -1], dtype=np.int64)) is None  # padding: the kernel's job
    assert slot_runs(np.zeros(0, dtype=np.int64)) == []


def test_write_kv_runs_matches_the_slot_writer():
    from attn_core.state.kv_write import slot_runs, write_kv_runs, write_kv_slots

    gen = torch.Generator().manual_seed(3)
    k = torch.randn(7, 2, 8, generator=gen).to(torch.bfloat16)
    v = torch.randn(7, 2, 4, generator=gen).to(torch.bfloat16)
    slots = np.array([12, 13, 14, 15, 16, 2, 3], dtype=np.int64)  # crosses a page; two runs
    caches = [torch.zeros(6, 4, 2, d, dtype=torch.bfloat16) for d in (8, 4)]
    want = [c.clone() for c in caches]
    write_kv_slots(k, v, *want, torch.from_numpy(slots))
    write_kv_runs(k, v, *caches, slot_runs(slots))
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(ValueError, match="contiguous rows of the cache's dtype"):
        write_kv_runs(k.transpose(1, 2).contiguous().transpose(1, 2), v, *caches, [(0, 0, 1)])
    with pytest.raises(ValueError, match="float32"):
        write_kv_runs(k.float(), v, *caches, [(0, 0, 1)])


class _BindingKernels(_RecordingKernels):
    """The Triton writer stand-in with :func:`bind`: the bound write records and writes too."""

    def __init__(self) -> None:
        super().__init__()
        self.bound: list[int] = []

    def bind(self, xs, caches, scales, slot_mapping, num_tokens):
        def bound(xs, caches, scales, slot_mapping):
            self.bound.append(num_tokens)
            for x, cache, scale in zip(xs, caches, scales, strict=True):
                kv_write.write_slots_torch(x, cache, slot_mapping, scale)

        return bound


def test_a_kv_writer_checks_its_first_write_then_launches_bound(monkeypatch):
    from attn_core.state.kv_write import KVWriter

    kernels = _BindingKernels()
    monkeypatch.setattr(kv_write, "_kernels", lambda cache: kernels)
    k_cache, v_cache = _cache(), _cache()
    with pytest.raises(ValueError, match="expected shape"):  # the first write is checked
        KVWriter()(
            torch.randn(2, 3, 3), torch.randn(2, 2, 3), k_cache, v_cache, torch.tensor([0, 1])
        )
    writer = KVWriter(may_have_padding=False)
    slots = torch.tensor([5, 9])
    for layer in range(3):
        k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
        writer(k, v, k_cache, v_cache, slots)
        assert torch.equal(k_cache.view(16, 2, 3)[[5, 9]], k), layer
        assert torch.equal(v_cache.view(16, 2, 3)[[5, 9]], v), layer
    assert (kernels.launches, kernels.bound) == ([2], [2, 2])


def test_a_kv_writer_without_a_kernel_writes_checked_every_time(monkeypatch):
    from attn_core.state.kv_write import KVWriter

    calls = []
    real = kv_write.write_kv_slots
    monkeypatch.setattr(
        kv_write, "write_kv_slots", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    writer = KVWriter()
    k_cache, v_cache = _cache(), _cache()
    for _ in range(3):
        writer(torch.randn(1, 2, 3), torch.randn(1, 2, 3), k_cache, v_cache, torch.tensor([3]))
    assert len(calls) == 3  # CPU caches: the torch path, checked per call
