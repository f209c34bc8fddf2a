"""GPU tests of the fa3 plugin on Hopper: the plugin against the reference backend, both run
through AttentionRuntime + BatchBuilder + PersistentState on one shared paged cache.

Each step the reference runs first (it writes the step's K/V, then attends), then fa3 (writes the
same K/V to the same slots, then attends); outputs are compared at bf16/fp16 tolerances. Skipped
without CUDA, without an sm90 GPU, or without flash-attn-4 / FA3.

Run on the H200: ``python3 -m pytest attn_plugins/fa3/tests/test_fa3_gpu.py -q -p no:cacheprovider``
"""

from __future__ import annotations

import pytest
import torch
from attn_plugin_fa3 import plugin, providers

import attn_core.reference.plugin as ref_plugin
from attn_core.batch import BatchBuilder
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers
from attn_core.state.manager import PersistentState

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm90, found {torch.cuda.get_device_capability()}"
    provider, reason = plugin.probe()
    return None if provider is not None else f"no FA3 provider: {reason}"


_SKIP = _skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

TOL = dict(atol=3e-2, rtol=3e-2)


class Harness:
    """One layer, two runtimes (fa3 and reference) over one PersistentState."""

    def __init__(
        self,
        spec: LayerSpec,
        *,
        sinks: bool = False,
        graph_mode: str = "none",
        max_batch: int = 16,
        max_tokens: int = 2048,
        max_len: int = 1024,
        spec_tokens: int = 0,
    ) -> None:
        self.spec = spec
        groups = group_layers([spec])
        reg = Registry(strict=True)
        reg.register_plugin(ref_plugin, name="attn_core")
        reg.register_plugin(plugin, name="fa3")
        dev = DeviceCapabilities.detect()
        common = dict(
            graph_mode=graph_mode,
            max_batch_size=max_batch,
            max_num_tokens=max_tokens,
            speculative_tokens=spec_tokens,
        )
        fa3_plan = select(groups, reg, dev, ExecutionConstraints(force="full=fa3", **common))
        ref_plan = select(groups, reg, dev, ExecutionConstraints(force="full=reference", **common))
        assert fa3_plan.choice("full").backend.qualified_name == "fa3:fa3"
        pages_per_req = -(-max_len // spec.page_size)
        self.state = PersistentState(
            groups, num_pages=max_batch * pages_per_req + 1, num_slots=0, device="cuda"
        )
        params = {}
        self.sinks = None
        if sinks:
            # bf16-representable sinks: the kernel takes bf16, the reference float32.
            g = torch.Generator().manual_seed(7)
            self.sinks = (torch.randn(spec.num_heads, generator=g) * 2).bfloat16().float().cuda()
            params = {0: {"sinks": self.sinks}}
        self.fa3 = AttentionRuntime(fa3_plan, reg, state=self.state, device="cuda",
                                    layer_params=params)  # fmt: skip
        self.ref = AttentionRuntime(ref_plan, reg, state=self.state, device="cuda",
                                    layer_params=params)  # fmt: skip
        self.builder = BatchBuilder(
            self.state,
            max_batch_size=max_batch,
            max_num_tokens=max_tokens,
            max_pages_per_request=pages_per_req,
            device="cuda",
        )
        self.dtype = getattr(torch, spec.dtype)
        self.gen = torch.Generator(device="cuda").manual_seed(0)

    def qkv(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec

        def r(h: int) -> torch.Tensor:
            x = torch.randn(t, h, s.head_dim, device="cuda", generator=self.gen)
            return x.to(self.dtype)

        return r(s.num_heads), r(s.num_kv_heads), r(s.num_kv_heads)

    def step(self, requests, *, spec_tokens: int = 0) -> float:
        """Run one step with both backends; return the max abs difference of real rows."""
        for r, _ in requests:
            if r not in self.state:
                self.state.add_request(r)
        batch = self.builder.build(requests, spec_tokens=spec_tokens)
        q, k, v = self.qkv(batch.padded_tokens)
        self.ref.prepare(batch)
        want = self.ref.binding(0).forward(q, k, v)
        self.fa3.prepare(batch)
        out = torch.empty_like(q)
        got = self.fa3.binding(0).forward(q, k, v, out=out)
        assert got.data_ptr() == out.data_ptr()
        n = batch.num_tokens
        torch.testing.assert_close(got[:n].float(), want[:n].float(), **TOL)
        for r, m in requests:
            self.state.advance(r, m)
        return (got[:n].float() - want[:n].float()).abs().max().item()


def _spec(**kw) -> LayerSpec:
    base = dict(kind="full", num_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    base.update(kw)
    return LayerSpec(**base)


WORKLOAD = [
    [("a", 300), ("b", 17), ("c", 129)],  # ragged prefill crossing page boundaries
    [("a", 1), ("b", 1), ("c", 1)],  # decode
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 40), ("c", 1), ("d", 77)],  # mixed: decodes, a chunk, a new request
    [("d", 1), ("a", 1)],  # decode, other batch order
]


@pytest.mark.parametrize("page_size", sorted(plugin.PAGE_SIZES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_decode_mixed_ragged(page_size, head_dim):
    h = Harness(_spec(head_dim=head_dim, page_size=page_size))
    for requests in WORKLOAD:
        h.step(requests)


def test_fp16_head_dim_96_mha():
    h = Harness(_spec(head_dim=96, num_heads=4, num_kv_heads=4, dtype="float16"))
    for requests in WORKLOAD:
        h.step(requests)


@pytest.mark.parametrize("page_size", [16, 128])
def test_sliding_window(page_size):
    h = Harness(_spec(sliding_window=64, page_size=page_size))
    for requests in WORKLOAD:
        h.step(requests)


def test_soft_cap():
    h = Harness(_spec(logits_soft_cap=5.0, softmax_scale=0.5))  # large logits: the cap bites
    for requests in WORKLOAD:
        h.step(requests)


def test_sinks_window_gpt_oss_like():
    h = Harness(_spec(head_dim=64, num_heads=16, sliding_window=128, has_sinks=True), sinks=True)
    for requests in WORKLOAD:
        h.step(requests)


def test_speculative_verify_steps():
    h = Harness(_spec(), spec_tokens=3)
    h.step([("a", 50), ("b", 9)])
    h.step([("a", 4), ("b", 4)], spec_tokens=3)
    h.step([("a", 4), ("b", 4)], spec_tokens=3)


def test_out_none_returns_a_tensor():
    h = Harness(_spec())
    h.state.add_request("a")
    batch = h.builder.build([("a", 5)])
    q, k, v = h.qkv(5)
    h.fa3.prepare(batch)
    got = h.fa3.binding(0).forward(q, k, v)
    assert got.shape == (5, 8, 128) and got.dtype == torch.bfloat16


def test_decode_cuda_graph_replays_new_batches():
    """Capture one padded decode step (8 rows), replay it for batches of 8, 5 and 3 real
    requests; every replay must match the reference and padding must write no KV."""
    pad = 8
    h = Harness(_spec(sliding_window=200, page_size=64), graph_mode="decode", max_batch=pad)
    names = [f"r{i}" for i in range(pad)]
    h.step([(n, 20 + 13 * i) for i, n in enumerate(names)])  # prefill, eager
    batch = h.builder.build([(n, 1) for n in names], pad_to=pad)
    q, k, v = h.qkv(pad)
    out = torch.empty_like(q)
    binding = h.fa3.binding(0)
    h.fa3.prepare(batch)
    binding.forward(q, k, v, out=out)  # warm-up: JIT compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.forward(q, k, v, out=out)
    for live in (pad, 5, 3):
        reqs = [(n, 1) for n in names[:live]]
        batch = h.builder.build(reqs, pad_to=pad)
        nq, nk, nv = h.qkv(pad)
        h.ref.prepare(batch)
        want = h.ref.binding(0).forward(nq, nk, nv)  # eager reference writes the real K/V
        k_before = h.state.kv_cache.layer(0).k.clone()
        h.fa3.update(batch)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:live].float(), want[:live].float(), **TOL)
        # padding rows (slot -1) must not have changed the cache: the replay rewrote exactly
        # what the reference had just written
        assert torch.equal(h.state.kv_cache.layer(0).k, k_before)
        for n, m in reqs:
            h.state.advance(n, m)


@pytest.mark.parametrize(
    "heads,kv_heads,sinks,softcap", [(64, 8, False, None), (32, 8, True, 30.0), (8, 2, False, None)]
)
def test_long_context_decode_is_split_and_matches(heads, kv_heads, sinks, softcap):
    """Small batch, long context: the decode runs as split-KV chunks merged by log-sum-exp (the
    plan says so) and matches the reference, with ragged lengths that leave chunks empty."""
    from attn_plugin_fa3 import split_kv

    spec = _spec(num_heads=heads, num_kv_heads=kv_heads, logits_soft_cap=softcap,
                 has_sinks=sinks)  # fmt: skip
    h = Harness(spec, sinks=sinks, max_batch=3, max_tokens=12288, max_len=9000)
    h.step([("a", 8000), ("b", 2500), ("c", 300)])  # fresh prefill: the non-paged call
    ctx = h.fa3.groups["full"].context
    assert ctx.dense
    sms = split_kv.sm_count(torch.device("cuda"))
    for i in range(2):
        h.step([("a", 1), ("b", 1), ("c", 1)])  # checked against the reference
        assert ctx.split is not None and ctx.split.plan.num_splits > 1
        # the chunks cover the cached context (8000 + i keys); the merge adds the new token
        assert ctx.split.plan == split_kv.plan_splits(3, 8000 + i, 16, kv_heads, sms)


@pytest.mark.parametrize("batch", [1, 4])
def test_split_decode_equals_the_unsplit_call_and_stores_the_new_kv(batch):
    """The split step (chunk call + merge that also stores the new K/V; at B=1 the query
    broadcast over its chunk rows, no copy) against the unsplit paged call over the same cache
    after the same K/V write, the reference and (where installed) FlashInfer's decode: the same
    output at bf16 tolerance, and the merge wrote the step's K/V rows exactly where the core's
    writer puts them."""
    spec = _spec(num_heads=64, num_kv_heads=8)
    h = Harness(spec, max_batch=batch, max_tokens=6000 * batch, max_len=6100)
    names = [f"r{i}" for i in range(batch)]
    h.step([(n, 6000 - 700 * i) for i, n in enumerate(names)])
    ctx = h.fa3.groups["full"].context
    assert ctx.broadcast_q == (plugin.broadcast_q_problem(ctx.provider, torch.device("cuda"),
                                                          spec) is None)  # fmt: skip
    for _ in range(2):
        reqs = [(n, 1) for n in names]
        batch_ = h.builder.build(reqs)
        q, k, v = h.qkv(batch)
        h.ref.prepare(batch_)
        want = h.ref.binding(0).forward(q, k, v)  # writes the step's K/V first
        layer = h.state.kv_cache.layer(0)
        written = (layer.k.clone(), layer.v.clone())
        layer.k.view(-1, 8, 128)[batch_.slot_mapping[:batch]] = 0  # the split path must rewrite
        layer.v.view(-1, 8, 128)[batch_.slot_mapping[:batch]] = 0
        h.fa3.prepare(batch_)
        assert ctx.split is not None
        got = h.fa3.binding(0).forward(q, k, v, out=torch.empty_like(q))
        assert torch.equal(layer.k, written[0]) and torch.equal(layer.v, written[1])
        kept = ctx.split
        ctx.split = None  # the same step through the unsplit paged call
        unsplit = h.fa3.binding(0).forward(q, k, v, out=torch.empty_like(q))
        ctx.split = kept
        torch.testing.assert_close(got.float(), unsplit.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.float(), want.float(), **TOL)
        fi = _flashinfer_decode(q, layer, batch_, spec)
        if fi is not None:  # FlashInfer's own decode over the same pages, where installed
            torch.testing.assert_close(got.float(), fi.float(), atol=1e-2, rtol=1e-2)
        for n, m in reqs:
            h.state.advance(n, m)


def _flashinfer_decode(q, layer, batch, spec) -> torch.Tensor | None:
    """FlashInfer's paged decode of ``q`` over the batch's pages (the new K/V written), or None
    without FlashInfer."""
    try:
        import flashinfer
    except ImportError:
        return None
    b, page = batch.num_reqs, spec.page_size
    seq = torch.from_numpy(batch.seq_lens_cpu[:b].astype("int64"))
    npages = (seq + page - 1) // page
    table = batch.page_table[:b].cpu()
    indices = torch.cat([table[i, : int(n)] for i, n in enumerate(npages)]).int()
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(npages, 0)
    last = (seq - (npages - 1) * page).int()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, spec.num_heads, spec.num_kv_heads, spec.head_dim, page,
           q_data_type=q.dtype)  # fmt: skip
    return w.run(q[:b], (layer.k, layer.v))


def test_broadcast_query_rows_pass_their_check_on_this_gpu():
    """flash-attn-4 reads a one-request decode's query broadcast over its chunk rows (stride 0)
    as it reads a copy, at the benchmark's shape (64 q / 8 kv heads, d128, bf16): where this
    fails the split path keeps copying the rows (correct, one launch slower), and the reason
    says why."""
    provider = plugin.checked_provider(torch.device("cuda"))
    problem = plugin.broadcast_q_problem(provider, torch.device("cuda"),
                                         _spec(num_heads=64, num_kv_heads=8))  # fmt: skip
    assert problem is None, problem


def test_fresh_prefill_runs_the_non_paged_kernel():
    h = Harness(_spec(sliding_window=300, logits_soft_cap=20.0), max_tokens=4096, max_len=2048)
    ctx = h.fa3.groups["full"].context
    h.step([("x", 1000), ("y", 37)])  # checked against the reference
    assert ctx.dense
    h.step([("x", 100), ("y", 1)])  # over a cached prefix: the paged call
    assert not ctx.dense


@pytest.mark.parametrize("pad", [1, 2])
def test_split_decode_cuda_graph_replays_new_lengths(pad):
    """Graph mode: the split is fixed per padded batch size from the page table's capacity, its
    metadata refilled in place, so one captured graph serves later steps of new lengths (one
    request: its query broadcast over the chunk rows; two: copied rows)."""
    names = ["a", "b"][:pad]
    h = Harness(_spec(num_heads=32, num_kv_heads=8), graph_mode="decode", max_batch=pad,
                max_tokens=8192, max_len=8192)  # fmt: skip
    h.step([("a", 3000), ("b", 700)][:pad])
    batch = h.builder.build([(n, 1) for n in names], pad_to=pad)
    q, k, v = h.qkv(pad)
    out = torch.empty_like(q)
    binding = h.fa3.binding(0)
    h.fa3.prepare(batch)
    ctx = h.fa3.groups["full"].context
    assert ctx.split is not None
    binding.forward(q, k, v, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.forward(q, k, v, out=out)
    for _ in range(3):
        batch = h.builder.build([(n, 1) for n in names], pad_to=pad)
        nq, nk, nv = h.qkv(pad)
        h.ref.prepare(batch)
        want = h.ref.binding(0).forward(nq, nk, nv)
        h.fa3.update(batch)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want.float(), **TOL)
        for n in names:
            h.state.advance(n, 1)


def test_private_entry_point_passes_its_self_check_here():
    """On the tested release the private call (writing into ``out``) agrees with the public
    function on this GPU, and the backend's note for ``attn list`` says so."""
    Harness(_spec())  # allocating a context runs the self-check once per process
    provider, _ = plugin.probe()
    assert provider is not None
    if provider.version in providers.TESTED_DIRECT_RELEASES:
        assert "self-check passed" in provider.note, provider.note
    else:
        assert "off (" in provider.note
    assert plugin.make_backend().notes == provider.note


def test_private_entry_point_passes_its_sinks_check_here():
    """With learnable sinks too (the check a group with sinks runs at its first context)."""
    provider, _ = plugin.probe()
    assert provider is not None
    if provider.version not in providers.TESTED_DIRECT_RELEASES:
        pytest.skip(f"flash-attn-4 {provider.version}: no private path to check")
    assert providers.self_check_sinks(provider, torch.device("cuda")) is None


# ------------------------------------------------------------------------------------------
# Chunked (local) attention through local virtual batches
# ------------------------------------------------------------------------------------------
# chunks of 256 tokens: prefills spanning several chunks (fresh: the non-paged kernel over the
# virtual requests), decodes landing on and crossing a boundary, a chunk over a cached prefix
# that crosses a boundary, mixed steps
CHUNKED_WORKLOAD = [
    [("a", 600), ("b", 255), ("c", 129)],
    [("a", 1), ("b", 1), ("c", 1)],  # b: position 255, the last of chunk 0
    [("a", 1), ("b", 1), ("c", 1)],  # b: position 256, the first of chunk 1
    [("a", 1), ("b", 300), ("c", 1), ("d", 77)],  # b's 257 .. 556 cross 512
    [("d", 1), ("a", 1), ("b", 1)],
]


@pytest.mark.parametrize("page_size", [16, 128, 256])
def test_chunked_small_chunk_matches_the_reference(page_size):
    h = Harness(_spec(attention_chunk_size=256, page_size=page_size))
    assert "full" in h.fa3.local_batchers
    for requests in CHUNKED_WORKLOAD:
        h.step(requests)


def test_chunked_8192_long_prefill_and_decodes_across_the_boundary():
    """Llama-4's chunk size at real shapes (40 q / 8 kv heads, head dim 128): a prefill of
    9000 tokens spans two chunks, then a request decodes across 8192 and another prefills over
    a cached prefix across it."""
    spec = _spec(num_heads=40, num_kv_heads=8, attention_chunk_size=8192)
    h = Harness(spec, max_batch=3, max_tokens=12288, max_len=12000)
    h.step([("a", 9000)])
    h.step([("b", 8190), ("a", 1)])
    for _ in range(4):  # b: positions 8190 .. 8193
        h.step([("a", 1), ("b", 1)])
    h.step([("c", 8000)])
    h.step([("c", 500), ("a", 1)])  # c: 8000 .. 8499 over its cached prefix, across 8192


@pytest.mark.parametrize("chunk", [256, 8192])
def test_chunked_decode_cuda_graph_replays_across_a_boundary(chunk):
    """Graph mode: the decode virtual batch is refilled in place each step, so one captured
    graph replays decodes before, on and after a chunk boundary (and through split-KV where the
    plan splits)."""
    pad = 4
    h = Harness(_spec(attention_chunk_size=chunk), graph_mode="decode", max_batch=pad,
                max_tokens=3 * chunk + 64, max_len=chunk + 64)  # fmt: skip
    names = [f"r{i}" for i in range(3)]
    h.step([(n, chunk - 2 + i) for i, n in enumerate(names)])  # ends at chunk-3 .. chunk-1
    batch = h.builder.build([(n, 1) for n in names], pad_to=pad)
    q, k, v = h.qkv(pad)
    out = torch.empty_like(q)
    binding = h.fa3.binding(0)
    h.fa3.prepare(batch)
    binding.forward(q, k, v, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.forward(q, k, v, out=out)
    for _ in range(4):
        batch = h.builder.build([(n, 1) for n in names], pad_to=pad)
        nq, nk, nv = h.qkv(pad)
        h.ref.prepare(batch)
        want = h.ref.binding(0).forward(nq, nk, nv)
        h.fa3.update(batch)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:3].float(), want[:3].float(), **TOL)
        for n in names:
            h.state.advance(n, 1)
