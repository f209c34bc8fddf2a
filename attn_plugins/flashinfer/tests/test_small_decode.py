"""small_decode's kernels called directly, in every tiling the benchmark sweeps, against a torch
gather-and-softmax written here (float32), and the cache write checked row by row.

Without a GPU the kernels run in Triton's interpreter on small shapes (conftest sets
``TRITON_INTERPRET``); with one, on the H200's shapes (32 q / 8 kv heads, d128, page 16) and
contexts of several thousand tokens, so every split loops over many blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from attn_plugin_flashinfer.small_decode import (
    DEFAULT_CONFIG,
    SmallDecodeBuffers,
    SmallDecodeConfig,
    num_splits_for,
    small_decode,
)

from attn_core.bench_util import capture_graph
from attn_core.pdl import pdl_enabled

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if CUDA:
    H, HKV, D, PAGE, LENS = 32, 8, 128, 16, [(4096,), (1, 3000), (17, 2500, 700)]
else:
    H, HKV, D, PAGE, LENS = 8, 2, 64, 8, [(150,), (1, 77), (9, 130, 40)]

TILINGS = [
    SmallDecodeConfig(),  # the default: n32w2s3p, four programs per SM
    SmallDecodeConfig(64, 4, 2, prefetch=False, programs_per_sm=2),  # no prefetch, two per SM
    SmallDecodeConfig(32, 4, 3, prefetch=True, programs_per_sm=4),
    SmallDecodeConfig(16, 2, 4, prefetch=True, programs_per_sm=4),  # fastest at ctx 4096
    SmallDecodeConfig(128, 8, 2, prefetch=True),
    SmallDecodeConfig(16, 4, 2),
]


def _reference(q, k, v, k_cache, v_cache, page_table, seq_lens, slots, scale):
    """Output ``[B, H, D]`` float32 and the caches after the write."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    out = torch.empty(B, h, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        if slots[b] >= 0:
            k_cache.view(-1, hkv, d)[slots[b]] = k[b]
            v_cache.view(-1, hkv, d)[slots[b]] = v[b]
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        rows = page_table[b, pos // PAGE].long() * PAGE + pos % PAGE
        keys = k_cache.view(-1, hkv, d)[rows].float()
        vals = v_cache.view(-1, hkv, d)[rows].float()
        keys[-1], vals[-1] = k[b].float(), v[b].float()  # the new token, written or not
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, vals)
    return out, k_cache, v_cache


@pytest.mark.parametrize("lens", LENS, ids=lambda lens: "x".join(map(str, lens)))
@pytest.mark.parametrize("config", TILINGS, ids=lambda c: c.label)
def test_small_decode_matches_a_gather_reference_and_writes_only_its_slots(lens, config):
    _check(lens, config, torch.bfloat16)


def test_small_decode_float16():
    _check(LENS[-1], SmallDecodeConfig(), torch.float16)


def test_repeated_launches_agree_bit_for_bit():
    """Twenty launches into the same partial buffers (as the layers of a graph replay make)
    give the same bits: the merge sums the splits in a fixed order, and no launch reads what
    another left behind."""
    q, k, v, kc, vc, table, lens, slots, _ = _inputs(LENS[-1], torch.bfloat16, seed=5)
    slots = torch.full_like(slots, -1)  # write nothing: every launch sees the same cache
    buffers = SmallDecodeBuffers.allocate(q.shape[0], H, 2 * _splits(LENS[-1]), D, DEVICE)
    args = [t.to(DEVICE) for t in (q, k, v, kc, vc, table, lens, slots)]
    first = None
    for _ in range(20):
        out = torch.empty_like(args[0])
        small_decode(*args, out, buffers, scale=D**-0.5)
        first = out if first is None else first
        assert torch.equal(out, first)


def test_misaligned_inputs_take_their_own_compiled_kernel():
    """A q that starts 8 bytes into its storage (not 16-byte aligned) must not be launched
    through the kernel compiled for an aligned q (Triton specialises on alignment): the
    launch cache keys on it, and both give the reference's answer."""
    lens = LENS[0]
    q, k, v, kc, vc, table, seq, slots, _ = _inputs(lens, torch.bfloat16, seed=9)
    want, _, _ = _reference(q, k, v, kc, vc, table, seq, slots, D**-0.5)
    buffers = SmallDecodeBuffers.allocate(1, H, _splits(lens), D, DEVICE)
    rest = [t.to(DEVICE) for t in (k, v, kc, vc, table, seq, slots)]
    for offset in (0, 4, 0):  # elements of 2 bytes: aligned, 8 bytes off, aligned again
        storage = torch.empty(q.numel() + offset, dtype=q.dtype, device=DEVICE)
        q_dev = storage[offset:].view_as(q).copy_(q)
        out = torch.empty_like(q_dev)
        small_decode(q_dev, *rest, out, buffers, scale=D**-0.5)
        err = (out.float().cpu() - want).abs().max().item()
        assert err < 2e-2, f"q {2 * offset} bytes into its storage: error {err:.3g}"


def _splits(lens, config: SmallDecodeConfig = DEFAULT_CONFIG) -> int:
    """The plugin's split count for these requests on this device (4 SMs on CPU)."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if CUDA else 4
    return num_splits_for(len(lens), HKV, max(lens), sms, config)


def _inputs(lens, dtype, seed):
    """q, k, v, the caches, the page table (each request owns distinct, shuffled pages),
    lengths, slots (request 0 a padding row when there are several) and the scale (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    width = math.ceil(max(lens) / PAGE) + 1
    num_pages = B * width + 3
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    owner = torch.randperm(num_pages, generator=gen)[: B * width].view(B, width).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor(
        [int(owner[b, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)]
    )
    if B > 1:
        slots[0] = -1  # a padding row: attends, writes nothing
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, D, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, owner, seq_lens, slots, 1 / math.sqrt(D)


def _check(lens, config, dtype):
    q, k, v, k_cache, v_cache, owner, seq_lens, slots, scale = _inputs(
        lens, dtype, seed=len(lens) * 1000 + config.block_n
    )
    want, k_want, v_want = _reference(q, k, v, k_cache, v_cache, owner, seq_lens, slots, scale)
    B = len(lens)
    on = {"device": DEVICE}
    args = [t.to(**on) for t in (q, k, v, k_cache, v_cache, owner, seq_lens, slots)]
    out = torch.full((B, H, D), float("nan"), dtype=dtype, **on)
    n0 = _splits(lens, config)
    for n in sorted({n0, 2 * n0}):  # the plugin's split count and twice it
        buffers = SmallDecodeBuffers.allocate(B, H, n, D, DEVICE)
        kc, vc = args[3].clone(), args[4].clone()
        small_decode(*args[:3], kc, vc, *args[5:], out, buffers, scale=scale, config=config)
        err = (out.float().cpu() - want).abs().max().item()
        assert err < 2e-2, f"splits {n}: max |small_decode - reference| = {err:.3g}"
        assert torch.equal(kc.cpu(), k_want) and torch.equal(vc.cpu(), v_want), f"splits {n}"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (CUDA and pdl_enabled(DEVICE)), reason="needs PDL (sm90+ CUDA)")
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
def test_programmatic_dependent_launches_wait_for_what_they_read(captured):
    """Eight "layers" chained through their outputs (layer i's q is layer i-1's out, and every
    layer shares one set of partial buffers) launched as programmatic dependents give what the
    same chain gives with plain launches: each kernel waits for its predecessor before it
    reads q, the partials, or (the next layer) overwrites them."""
    lens = LENS[-1]
    q, k, v, kc, vc, table, seq, slots, scale = _inputs(lens, torch.bfloat16, seed=11)
    args = [t.to(DEVICE) for t in (k, v, kc, vc, table, seq, slots)]
    buffers = SmallDecodeBuffers.allocate(len(lens), H, _splits(lens), D, DEVICE)
    q0 = q.to(DEVICE)

    def chain(pdl: bool) -> list[torch.Tensor]:
        outs = [torch.empty_like(q0) for _ in range(8)]
        caches = (args[2].clone(), args[3].clone())

        def run():
            x = q0
            for out in outs:
                small_decode(x, *args[:2], *caches, *args[4:], out, buffers, scale=scale, pdl=pdl)
                x = out

        run()  # compile outside a capture
        if captured:
            graph = capture_graph(run)
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        return [out.float().cpu() for out in outs]

    plain, dependent = chain(False), chain(True)
    for i, (a, b) in enumerate(zip(plain, dependent, strict=True)):
        err = (a - b).abs().max().item()
        assert err < 1e-3, f"layer {i}: programmatic launches differ by {err:.3g}"


class _FakeCompiled:
    """What a Triton launch returns, reduced to the parts CachedLaunch calls: the C launcher
    ``run`` (recorded) and the ``[grid]`` runner."""

    function, packed_metadata = "function", ("metadata",)

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def run(self, g0, g1, g2, stream, function, metadata, *rest):
        self.log.append((self.name, "direct", rest[3:]))

    def __getitem__(self, grid):
        return lambda *args: self.log.append((self.name, "runner", args))


class _FakeJit:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def compile_and_run(*args, **options):
            self.log.append((self.name, "jit", args))
            return _FakeCompiled(self.name, self.log)

        return compile_and_run


def test_a_plan_binds_both_kernels_and_checks_alignment_device_and_hooks_per_call(monkeypatch):
    """After its first call (which compiles) a plan launches both kernels through their bound
    C launchers with the call's addresses; a misaligned tensor, another current device or a
    launch hook sends the call back through CachedLaunch's checks (on CPU, a stand-in for the
    compiled kernels: the interpreter compiles nothing)."""
    from attn_plugin_flashinfer import small_decode as sd
    from triton import knobs

    from attn_core import fast_launch
    from attn_core.fast_launch import CachedLaunch

    log: list = []
    # fast_launch's runner self-check counts as passed (tests/test_fast_launch.py runs it)
    monkeypatch.setattr(fast_launch._Checks, "runner", "")
    monkeypatch.setattr(sd, "_SPLIT", CachedLaunch(_FakeJit("split", log)))
    monkeypatch.setattr(sd, "_MERGE", CachedLaunch(_FakeJit("merge", log)))
    monkeypatch.setattr(sd, "_PLANS", {})
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: -1))
    monkeypatch.setattr(CachedLaunch, "current_stream", staticmethod(lambda dev: 99))
    q, k, v, kc, vc, table, lens, slots, scale = _inputs(LENS[1], torch.bfloat16, seed=3)
    buffers = SmallDecodeBuffers.allocate(q.shape[0], H, 4, D, torch.device("cpu"))

    def step(q, out):
        log.clear()
        small_decode(q, k, v, kc, vc, table, lens, slots, out, buffers, scale=scale)
        return [(name, how) for name, how, _ in log]

    out = torch.empty_like(q)
    assert step(q, out) == [("split", "jit"), ("merge", "jit")]
    assert step(q, out) == [("split", "direct"), ("merge", "direct")]
    ptrs = [t.data_ptr() for t in (q, k, v, kc, vc, table, lens, slots, buffers.o, buffers.lse)]
    assert log[0][2][: len(ptrs)] == tuple(ptrs)
    assert log[1][2][:3] == (buffers.o.data_ptr(), buffers.lse.data_ptr(), out.data_ptr())
    # Another q of the same shape: the same plan, its address.
    q2 = q.clone()
    assert step(q2, out) == [("split", "direct"), ("merge", "direct")]
    assert log[0][2][0] == q2.data_ptr()
    # out 8 bytes into its storage: CachedLaunch keys on alignment, compiling the merge anew.
    storage = torch.empty(out.numel() + 4, dtype=out.dtype)
    odd = storage[4:].view_as(out)
    assert step(q, odd) == [("split", "direct"), ("merge", "jit")]
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert step(q, out) == [("split", "runner"), ("merge", "runner")]
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(CachedLaunch, "current_device", staticmethod(lambda: 0))
    assert step(q, out) == [("split", "runner"), ("merge", "runner")]
