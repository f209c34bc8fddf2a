"""Benchmark of the FlashInfer plugin against FlashInfer called directly (H200).

Sections (each isolated: a failure is recorded in the JSON and the next section runs):

1. ``copy``: device copy bandwidth, ``y.copy_(x)`` of 1 GiB (read + write bytes / time).
2. ``decode``: paged decode, bf16, 32 q / 8 kv heads, d128, page 16, B = 1, 64, 256, context
   4096 and 32768. ``plugin`` = ``binding.forward`` (K/V write + run) after one ``prepare``;
   ``direct`` = the same planned FlashInfer wrapper's ``run()``; ``FI append+run`` = FlashInfer
   doing the plugin's whole job (its ``append_paged_kv_cache`` kernel, then ``run()``); plugin
   and direct are timed in 30 alternating turns of many eager calls each, every turn between
   two CUDA events (``bench_util.alternating_us``; ratio: min over min, median over median and
   the median of the turns' ratios); at B=1 that is host-bound: host time per call is reported
   too, and section 5 repeats B=1 inside a CUDA graph; GB/s = K+V bytes / time. The plugin on
   FlashInfer is also timed through the wrapper's ``run()`` instead of the fast path's direct
   call (compat.py).
   Up to SMALL_DECODE_MAX_BATCH requests within SMALL_DECODE_MAX_KV_TOKENS positions the plugin
   runs small_decode (fused write + attention); where it does, the host time of its two bound
   launches alone and of one, and the step with the launches through Triton's launcher object,
   through CachedLaunch's per-launch key, and through Triton's own ``kernel[grid]`` launcher
   (with ``--profile``, a cProfile of the step). The plugin on FlashInfer is timed too.
3. ``prefill``: ragged causal prefill, B*S = 16k tokens (B=2, S=8192), 16 heads, d128: plugin
   (write + ragged run) vs the ragged wrapper's ``run()``; TFLOP/s = 2 * B * S^2 * H * D / t.
   Direct, plugin and the plugin with its KV write on the caller's stream are timed call by
   call in 60 alternating rounds (ratio: min over min, median over median, and the median of
   the rounds' own ratios): the kernel's clock drifts by ~10 % over a run.
4. ``prepare``: host time of ``runtime.prepare(batch)`` for a B=256 decode step (ctx 4096),
   ``time.perf_counter``, median and p90 of many calls (target < 150 us).
5. ``graph``: a 32-layer decode step captured in one CUDA graph (B = 1-16 and 64 at ctx 4096,
   B = 1 and 8 at 32768): replay time per layer of the plugin as configured (small batches:
   the fused small_decode kernels), of the plugin forced onto FlashInfer, of FlashInfer's
   kernel alone, of FlashInfer's append + kernel and of the small_decode kernels called
   directly, captured the same way. ``--graph-cases BxCTX,...`` picks the cases,
   ``--force-small`` takes small_decode past the plugin's limits, ``--small-sweep`` times 44
   tilings of it too.
6. ``sinks``: gpt-oss's layer shape (64 q / 8 kv heads, d64, page 16, sinks), eager decode at
   ``--sinks-cases`` and a ragged prefill of 2 x 4096: the plugin on a sinks layer (plain
   kernel + log-sum-exp + rescale) against the plugin on the same layer without sinks, the
   plain wrapper's ``run()`` called directly and FlashInfer's ``AttentionSink`` variant
   (``BatchAttentionWithAttentionSinkWrapper``) called directly on the same cache, in 20
   alternating turns; the sinks output is checked against the variant's
   (``--no-sink-variant`` leaves the variant out). Then a 32-layer decode step with and without
   sinks captured in one CUDA graph at ``--sinks-graph-cases``.

Usage (from the repository root, on the GPU machine)::

    python attn_plugins/flashinfer/bench/bench_flashinfer.py --out bench-out/flashinfer.json

JIT-compiled kernels are cached under ``<repo>/.jit`` (``FLASHINFER_WORKSPACE_BASE``), so a run
after the GPU tests compiles nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import TypedDict

_HERE = Path(__file__).resolve()
_REPO = _HERE.parents[3]
for p in (_REPO, _HERE.parents[1]):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(_REPO / ".jit"))

import torch  # noqa: E402

from attn_core.bench_util import alternating_us, back_to_back_us, capture_graph, profile_calls  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16


def _iters_for(us_guess: float, budget_s: float = 1.0, lo: int = 20, hi: int = 2000) -> int:
    return int(min(hi, max(lo, budget_s * 1e6 / max(us_guess, 1.0))))


class _SetupArgs(TypedDict):
    """Keyword arguments of :func:`_setup` that one case passes to several setups."""

    batch: int
    ctx: int
    max_tokens: int | None
    cached: bool


def _setup(spec, *, batch: int, ctx: int, layers: int = 1, graph: bool = False,
           max_tokens: int | None = None, cached: bool = True,
           layer_params: dict | None = None):  # fmt: skip
    """Runtime + state for requests of up to ``ctx`` tokens; with ``cached``, ``batch`` requests
    of ``ctx - 1`` cached tokens (pages reserved, contents left as allocated)."""
    import attn_plugin_flashinfer.plugin as fi_plugin

    from attn_core.batch import BatchBuilder
    from attn_core.registry import Registry
    from attn_core.runtime import AttentionRuntime
    from attn_core.selector import select
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints, group_layers
    from attn_core.state.manager import PersistentState

    reg = Registry()
    reg.register_plugin(fi_plugin, name="flashinfer")
    groups = group_layers([spec] * layers)
    max_len = ctx + PAGE
    constraints = ExecutionConstraints(
        graph_mode="decode" if graph else "none",
        max_batch_size=batch,
        max_num_tokens=max_tokens or max(batch, 256),
        max_model_len=max_len,
        force={"full": "flashinfer:flashinfer"},
    )
    plan = select(groups, reg, DeviceCapabilities.detect(), constraints)
    pages = batch * (math.ceil(max_len / PAGE) + 1)
    state = PersistentState(groups, num_pages=pages, num_slots=0, device="cuda")
    runtime = AttentionRuntime(plan, reg, state=state, device="cuda", layer_params=layer_params)
    builder = BatchBuilder(
        state,
        max_batch_size=batch,
        max_num_tokens=constraints.max_num_tokens,
        max_pages_per_request=math.ceil(max_len / PAGE),
        device="cuda",
    )
    if cached:
        for r in range(batch):
            state.add_request(r)
            state.ensure_capacity(r, ctx - 1)
            state.advance(r, ctx - 1)
    return runtime, state, builder


def _context(runtime):
    return next(iter(runtime.groups.values())).context


def bench_copy() -> dict:
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = back_to_back_us(lambda: y.copy_(x), iters=50)
    return {"bytes": n, "us": us, "GB/s": 2 * n / us / 1e3}


def bench_decode(spec, batch: int, ctx: int, profile: bool = False) -> dict:
    runtime, _state, builder = _setup(spec, batch=batch, ctx=ctx)
    ctx_obj = _context(runtime)
    # FlashInfer's plan first (``direct`` runs its wrapper); the plugin as configured after.
    small_max, ctx_obj.small_decode_max_batch = ctx_obj.small_decode_max_batch, 0
    b = builder.build([(r, 1) for r in range(batch)])
    runtime.prepare(b)
    binding = runtime.binding(0)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    kv = binding.kv
    wrapper = ctx_obj.step.wrapper

    def plugin():
        binding.forward(q, k, v, out=out)

    def direct():
        wrapper.run(q, (kv.k, kv.v), out=out)

    # FlashInfer doing the plugin's whole job directly: its own KV append kernel, then run().
    import flashinfer

    pages_per = math.ceil(ctx / PAGE)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per
    kv_indices = b.page_table[:batch, :pages_per].reshape(-1).contiguous()
    last_len = torch.full((batch,), (ctx - 1) % PAGE + 1, dtype=torch.int32, device="cuda")
    append_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    batch_idx, positions = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, batch)

    def direct_with_write():
        flashinfer.append_paged_kv_cache(
            k, v, batch_idx, positions, (kv.k, kv.v), kv_indices, kv_indptr, last_len
        )
        wrapper.run(q, (kv.k, kv.v), out=out)

    def host_us(fn, n: int = 200) -> float:
        """Host time per call to enqueue ``fn`` (the GPU is idle at the start)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e6 / n

    plugin()  # JIT compile (or load) outside the timing
    direct_with_write()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    direct()
    torch.cuda.synchronize()
    guess = (time.perf_counter() - t0) * 1e6
    iters = _iters_for(guess)
    t_direct = back_to_back_us(direct, iters)
    t_plugin = back_to_back_us(plugin, iters)
    t_direct_write = back_to_back_us(direct_with_write, iters)
    t_plugin_fi, host_plugin_fi = t_plugin, host_us(plugin)
    # The plugin on FlashInfer through its wrapper's run() instead of the fast path's direct call
    # (compat.py) of the compiled kernel (context.direct_decode_run): what that saves of host time.
    ctx_obj.direct_decode_run = False
    t_plugin_fi_run, host_plugin_fi_run = back_to_back_us(plugin, iters), host_us(plugin)
    ctx_obj.direct_decode_run = True
    # The plugin as configured: up to SMALL_DECODE_MAX_BATCH requests within the KV budget take
    # small_decode's fused write + attention (and where its host time goes).
    ctx_obj.small_decode_max_batch = small_max
    runtime.prepare(builder.build([(r, 1) for r in range(batch)]))
    kind = ctx_obj.step.kind.value
    small = {}
    plugin()
    torch.cuda.synchronize()
    # Plugin and direct in turns of `repeat` calls, adjacent in time (bench_util.alternating_us):
    # a host-bound step's time follows the shared host's speed, which moves within a run.
    repeat = max(1, iters // 30)
    rounds = alternating_us({"direct": direct, "plugin": plugin}, rounds=30, repeat=repeat)
    t_plugin, t_direct = min(rounds["plugin"]), min(rounds["direct"])
    per_round = [p / d for p, d in zip(rounds["plugin"], rounds["direct"], strict=True)]
    if kind == "decode_small":
        if profile:
            what = f"plugin forward, B={batch} ctx={ctx} small"
            print(profile_calls(lambda _i: plugin(), 500, what), flush=True)
        small.update(_small_host_costs(ctx_obj, binding, plugin, host_us, iters))
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    res = {
        "B": batch,
        "ctx": ctx,
        "kind": kind,
        "plugin_us": t_plugin,
        "plugin_fi_us": t_plugin_fi,
        "plugin_fi_host_us": host_plugin_fi,
        "plugin_fi_run_us": t_plugin_fi_run,
        "plugin_fi_run_host_us": host_plugin_fi_run,
        **small,
        "direct_us": t_direct,
        "ratio": t_plugin / t_direct,
        "ratio_median_over_median": statistics.median(rounds["plugin"])
        / statistics.median(rounds["direct"]),
        "ratio_median_of_rounds": statistics.median(per_round),
        "calls_per_turn": repeat,
        "plugin_fi_ratio": t_plugin_fi / t_direct,
        "direct_with_write_us": t_direct_write,
        "ratio_vs_direct_with_write": t_plugin / t_direct_write,
        "plugin_host_us": host_us(plugin),
        "direct_host_us": host_us(direct),
        "kv_GB": kv_bytes / 1e9,
        "direct_GB/s": kv_bytes / t_direct / 1e3,
        "plugin_GB/s": kv_bytes / t_plugin / 1e3,
    }
    return res


def _small_host_costs(ctx_obj, binding, plugin, host_us, iters: int) -> dict:
    """Where a small eager step's host time goes: the step as configured, its plan's two
    launches alone, one bound launch alone, the plan calling Triton's launcher object instead of
    the C function under it, and CachedLaunch / Triton's own launcher per launch."""
    from attn_plugin_flashinfer import small_decode

    from attn_core import fast_launch

    res: dict = {}
    (plan,) = ctx_obj._small_plans.values()
    step, batch, kv = ctx_obj.step, ctx_obj.batch, binding.kv
    q = torch.randn(batch.padded_reqs, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch.padded_reqs, HKV, D, dtype=torch.bfloat16, device="cuda")
    v, out = torch.randn_like(k), torch.empty_like(q)
    args = (q, k, v, kv.k, kv.v, batch.page_table, batch.seq_lens, batch.slot_mapping, out,
            step.small)  # fmt: skip
    entry = next(iter(small_decode._SPLIT._compiled.values()))
    # The C-call form the first bound launch saw (fast_launch's self-check); None: unknown.
    res["launcher_form"] = fast_launch._Checks.c_launch.get(type(entry.run)) if entry.run else None
    res["fast_launch"] = fast_launch.status()
    res["plan_two_launches_host_us"] = host_us(lambda: plan(*args))
    ptrs = [t.data_ptr() for t in args[:8]] + [step.small.o.data_ptr(), step.small.lse.data_ptr()]
    stream = torch.cuda.current_stream().cuda_stream
    res["one_bound_launch_host_us"] = host_us(lambda: plan.split.launch(stream, *ptrs))
    torch.cuda.synchronize()
    # The same plan through Triton's launcher object (its Python __call__), not the C function.
    saved = fast_launch._c_launch
    fast_launch._c_launch = lambda run: None
    try:
        small_decode._PLANS.clear()
        ctx_obj._small_plans.clear()
        plugin()
        plugin()
        res["plugin_runner_call_us"] = back_to_back_us(plugin, iters)
        res["plugin_runner_call_host_us"] = host_us(plugin)
    finally:
        fast_launch._c_launch = saved
        small_decode._PLANS.clear()
        ctx_obj._small_plans.clear()
        plugin()
    # Every launch through CachedLaunch.launch (its key per launch), and through Triton's own
    # launcher (no cache at all).
    saved_plan_call = small_decode.SmallDecodePlan.__call__

    def unbound(self, *a):
        self.split = self.merge = None
        saved_plan_call(self, *a)
        self.split = self.merge = None

    small_decode.SmallDecodePlan.__call__ = unbound  # type: ignore[method-assign]  # timing patch
    try:
        ctx_obj._small_plans.clear()
        plugin()
        res["plugin_cached_launch_us"] = back_to_back_us(plugin, iters)
        res["plugin_cached_launch_host_us"] = host_us(plugin)
        small_decode._SPLIT.enabled = small_decode._MERGE.enabled = False
        plugin()
        res["plugin_small_triton_launcher_us"] = back_to_back_us(plugin, iters)
        res["plugin_small_triton_launcher_host_us"] = host_us(plugin)
    finally:
        small_decode._SPLIT.enabled = small_decode._MERGE.enabled = True
        small_decode.SmallDecodePlan.__call__ = saved_plan_call  # type: ignore[method-assign]  # restore
        small_decode._PLANS.clear()
        ctx_obj._small_plans.clear()
        plugin()
    return res


def bench_decode_variants(batch: int, ctx: int) -> dict:
    """FlashInfer's paged decode called directly, in each kernel choice the plugin could make:
    CUDA-core decode kernel vs tensor-core (prefill-kernel) decode, NHD vs HND page layout.
    Random page tables over a pool of exactly the pages needed; GB/s = K+V bytes / time."""
    import flashinfer

    pages_per = math.ceil(ctx / PAGE)
    n_pages = batch * pages_per
    perm = torch.randperm(n_pages, device="cuda").to(torch.int32)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    last_len = torch.full((batch,), (ctx - 1) % PAGE + 1, dtype=torch.int32)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    res: dict = {"B": batch, "ctx": ctx}
    for layout in ("NHD", "HND"):
        shape = (n_pages, PAGE, HKV, D) if layout == "NHD" else (n_pages, HKV, PAGE, D)
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        for tc in (False, True):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc)
            w.plan(kv_indptr, perm.cpu(), last_len, H, HKV, D, PAGE, q_data_type=torch.bfloat16)
            w.run(q, (k, v), out=out)
            torch.cuda.synchronize()

            def run(w=w, k=k, v=v):
                return w.run(q, (k, v), out=out)

            us = back_to_back_us(run, 50)
            res[f"{layout}_{'tc' if tc else 'cc'}_us"] = us
            res[f"{layout}_{'tc' if tc else 'cc'}_GB/s"] = kv_bytes / us / 1e3
        del k, v
    return res


def bench_prepare_profile(spec, batch: int = 256, ctx: int = 4096) -> dict:
    """cProfile of 100 ``runtime.prepare`` calls (B=256 decode): where the host time goes."""
    runtime, _state, builder = _setup(spec, batch=batch, ctx=ctx)
    reqs = [(r, 1) for r in range(batch)]
    batches = [builder.build(reqs) for _ in range(3)]
    runtime.prepare(batches[0])
    torch.cuda.synchronize()
    table = profile_calls(
        lambda i: runtime.prepare(batches[i % 3]), 100, f"runtime.prepare, B={batch} decode"
    )
    print(table, flush=True)
    return {"B": batch, "profile": table}


def bench_prefill(batch: int = 2, seq: int = 8192, heads: int = 16) -> dict:
    from attn_core.specs import LayerSpec

    spec = LayerSpec(kind="full", num_heads=heads, num_kv_heads=heads, head_dim=D, page_size=PAGE)
    runtime, state, builder = _setup(
        spec, batch=batch, ctx=seq, max_tokens=batch * seq, cached=False
    )
    for r in range(batch):
        state.add_request(r)
    b = builder.build([(r, seq) for r in range(batch)])
    runtime.prepare(b)
    binding = runtime.binding(0)
    ctx_obj = _context(runtime)
    T = batch * seq
    q = torch.randn(T, heads, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    out = torch.empty_like(q)
    wrapper = ctx_obj.step.wrapper

    def plugin():
        binding.forward(q, k, v, out=out)

    def direct():
        wrapper.run(q, k, v, out=out)

    # FlashInfer doing the plugin's whole job: its append kernel into the paged cache, then run.
    import flashinfer

    kv = binding.kv
    pages_per = math.ceil(seq / PAGE)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per
    kv_indices = b.page_table[:batch, :pages_per].reshape(-1).contiguous()
    last_len = torch.full((batch,), (seq - 1) % PAGE + 1, dtype=torch.int32, device="cuda")
    append_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    batch_idx, positions = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, T)

    def fi_append():
        flashinfer.append_paged_kv_cache(
            k, v, batch_idx, positions, (kv.k, kv.v), kv_indices, kv_indptr, last_len
        )

    def direct_with_write():
        fi_append()
        wrapper.run(q, k, v, out=out)

    from attn_core.state.kv_write import write_kv_slots

    def core_write():  # the plugin's own write: K and V in one launch
        write_kv_slots(k, v, kv.k, kv.v, b.slot_mapping, may_have_padding=False)

    plugin()
    direct_with_write()
    torch.cuda.synchronize()
    # The direct kernel, the plugin as configured (K/V write on a side stream) and the plugin
    # with the write before the attention on one stream, one call of each in turn, each call
    # timed on its own (bench_util.alternating_us): the GPU's clock drifts by ~10 % over a run
    # (power and heat), and calls adjacent in time see the same clock. Reported: min over min,
    # median over median and the median of the per-round ratios (each round's calls adjacent).
    overlap = ctx_obj.overlap_kv_write

    def plugin_serial():
        ctx_obj.overlap_kv_write = False
        try:
            plugin()
        finally:
            ctx_obj.overlap_kv_write = overlap

    rounds = alternating_us(
        {"direct": direct, "plugin": plugin, "serial": plugin_serial}, rounds=60, warmup=3
    )
    t_direct, t_plugin, t_plugin_serial = (min(rounds[n]) for n in ("direct", "plugin", "serial"))
    per_round = [p / d for p, d in zip(rounds["plugin"], rounds["direct"], strict=True)]
    median_ratio = statistics.median(rounds["plugin"]) / statistics.median(rounds["direct"])
    t_direct_write = back_to_back_us(direct_with_write, 20, warmup=3)
    t_fi_append = back_to_back_us(fi_append, 20, warmup=3)
    t_core_write = back_to_back_us(core_write, 20, warmup=3)
    flops = 2 * batch * seq * seq * heads * D  # causal: half of 4 * S^2 * H * D per sequence
    probe = _copy_engine_probe(direct, k, v, kv)
    res = {
        "B": batch,
        "S": seq,
        "heads": heads,
        "kind": ctx_obj.step.kind.value,
        "plugin_us": t_plugin,
        "plugin_overlaps_kv_write": overlap,
        "plugin_serial_write_us": t_plugin_serial,
        "direct_us": t_direct,
        "ratio": t_plugin / t_direct,
        "ratio_median_over_median": median_ratio,
        "ratio_median_of_rounds": statistics.median(per_round),
        "ratio_rounds_p10_p90": _p10_p90(per_round),
        "direct_us_median": statistics.median(rounds["direct"]),
        "plugin_us_median": statistics.median(rounds["plugin"]),
        "direct_us_max": max(rounds["direct"]),
        "direct_TFLOP/s": flops / t_direct / 1e6,
        "plugin_TFLOP/s": flops / t_plugin / 1e6,
        "direct_with_write_us": t_direct_write,
        "ratio_vs_direct_with_write": t_plugin / t_direct_write,
        "fi_append_us": t_fi_append,
        "core_write_us": t_core_write,
        "kv_write_GB/s": 2 * 2 * T * heads * D * 2 / t_core_write / 1e3,
        "copy_engine_probe": probe,
    }
    return res


def _p10_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 10], ordered[(9 * len(ordered)) // 10]


def _copy_engine_probe(direct, k, v, kv) -> dict:
    """Whether the ragged prefill's K/V bytes can move beside FlashInfer's prefill kernel
    without taking SMs: the kernel alone, then with a side-stream copy of the same bytes into
    the cache (torch ``copy_`` of contiguous tensors = a device-to-device cudaMemcpyAsync), and
    the copy alone; also the copy enqueued after the kernel's launch, and K and V copied on two
    side streams at once. (cudaMemcpyBatchAsync with the prefer-overlap flag, called through ctypes,
    returned error 1 (invalid value) on CUDA 13.0, so it is not probed.)"""
    n = k.numel()
    dk, dv = kv.k.view(-1)[:n], kv.v.view(-1)[:n]
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    out: dict = {}

    def torch_copy():
        dk.copy_(k.view(-1))
        dv.copy_(v.view(-1))

    def with_side(copy):
        def step():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                copy()
            direct()
            main.wait_stream(side)

        return step

    def copy_after_the_kernel():  # the copy enqueued after FlashInfer's launch, not before
        ready = torch.cuda.Event()
        ready.record(main)
        direct()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            torch_copy()
        main.wait_stream(side)

    side_v = torch.cuda.Stream()

    def k_and_v_on_two_streams():  # two copy engines at once
        side.wait_stream(main)
        side_v.wait_stream(main)
        with torch.cuda.stream(side):
            dk.copy_(k.view(-1))
        with torch.cuda.stream(side_v):
            dv.copy_(v.view(-1))
        direct()
        main.wait_stream(side)
        main.wait_stream(side_v)

    cases = {
        "direct": direct,
        "direct+torch_copy_side": with_side(torch_copy),
        "direct+copy_after_launch": copy_after_the_kernel,
        "direct+k_v_two_streams": k_and_v_on_two_streams,
        "torch_copy_alone": torch_copy,
    }
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3):
        for name, fn in cases.items():
            rounds[name].append(back_to_back_us(fn, 20, warmup=3))
    out.update({f"{name}_us": min(ts) for name, ts in rounds.items()})
    nbytes = 2 * 2 * n * k.element_size()  # K and V, read + write
    out["torch_copy_alone_GB/s"] = nbytes / out["torch_copy_alone_us"] / 1e3
    return out


def bench_prepare(spec, batch: int = 256, ctx: int = 4096, iters: int = 300) -> dict:
    runtime, _state, builder = _setup(spec, batch=batch, ctx=ctx)
    reqs = [(r, 1) for r in range(batch)]
    times = []
    for i in range(iters + 20):
        b = builder.build(reqs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runtime.prepare(b)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 20:
            times.append((t1 - t0) * 1e6)
    times.sort()
    # FlashInfer's own public plan() for the same step (the plugin re-plans tensor-core decode
    # without it, see compat.py): same host metadata, timed alone.
    from attn_plugin_flashinfer.context import _Offsets

    c = _context(runtime)
    wrapper = c.step.wrapper
    row, o = c.host[c._half], _Offsets(c.B)
    args = (
        row[o.kv_indptr : o.kv_indptr + batch + 1],
        c.kv_indices[: batch * math.ceil(ctx / PAGE)],
        row[o.last_page_len : o.last_page_len + batch],
        H,
        HKV,
        D,
        PAGE,
    )
    kwargs = dict(pos_encoding_mode="NONE", q_data_type=torch.bfloat16, non_blocking=True)
    plan_times = []
    for i in range(iters // 2 + 10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wrapper.plan(*args, **kwargs)
        t1 = time.perf_counter()
        if i >= 10:
            plan_times.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    res = {
        "B": batch,
        "ctx": ctx,
        "median_us": statistics.median(times),
        "p90_us": times[int(0.9 * len(times))],
        "min_us": times[0],
        "flashinfer_plan_median_us": statistics.median(plan_times),
        "tensor_core_decode": bool(wrapper.use_tensor_cores),
        "target_us": 150,
    }
    return res


def _sync(label: str) -> None:
    """Wait for the GPU; a fault raised here names the last thing launched before it."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        raise RuntimeError(f"CUDA fault at or before: {label}") from exc


def _replay_rounds(graphs: dict, layers: int, rounds: int) -> dict[str, list[float]]:
    """Per graph, ``rounds`` timings (us per layer of 50 back-to-back replays), the graphs
    taken in turn in every round; each replayed once first."""
    for name, g in graphs.items():
        g.replay()
        _sync(f"first replay of {name}")
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(back_to_back_us(g.replay, 50) / layers)
    return times


def bench_graph(spec, layers: int = 32, batch: int = 64, ctx: int = 4096,
                sweep: bool = False, force_small: bool = False) -> dict:  # fmt: skip
    """A ``layers``-layer decode step captured in one CUDA graph, per layer: the plugin as
    configured (``plugin``: the fused small_decode kernels up to SMALL_DECODE_MAX_BATCH
    requests, FlashInfer's graph wrapper above), the plugin forced onto FlashInfer
    (``plugin_fi``), FlashInfer's kernel alone (``bare``), FlashInfer's append + kernel (the
    plugin's whole job in FlashInfer) and, for small batches, the small_decode kernels called
    directly (``small_direct``; ``force_small``: whatever the batch limit). Replay times are the
    minimum of three interleaved rounds."""
    from attn_plugin_flashinfer.small_decode import small_decode

    runtime, _state, builder = _setup(spec, batch=batch, ctx=ctx, layers=layers, graph=True)
    ctx_obj = _context(runtime)
    small_max = ctx_obj.small_decode_max_batch
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    outs = [torch.empty_like(q) for _ in range(layers)]
    bindings = [runtime.binding(i) for i in range(layers)]

    def plugin_step():
        for i, bd in enumerate(bindings):
            bd.forward(q, k, v, out=outs[i])

    # FlashInfer's path first: plan it (the bare graphs read that plan), capture it.
    ctx_obj.small_decode_max_batch = 0
    b = builder.build([(r, 1) for r in range(batch)], pad_to=batch)
    runtime.prepare(b)
    fi_kind = ctx_obj.step.kind.value
    wrapper = ctx_obj.step.wrapper
    graphs = {"plugin_fi": capture_graph(plugin_step)}
    _sync("plugin_fi capture")
    # The same with the K/V write launched as a plain kernel (not a programmatic dependent).
    saved_pdl = os.environ.get("ATTN_PDL")
    os.environ["ATTN_PDL"] = "0"
    try:
        graphs["plugin_fi_nopdl"] = capture_graph(plugin_step)
    finally:
        if saved_pdl is None:
            del os.environ["ATTN_PDL"]
        else:
            os.environ["ATTN_PDL"] = saved_pdl
    _sync("plugin_fi_nopdl capture")

    def bare_step():
        for i, bd in enumerate(bindings):
            wrapper.run(q, (bd.kv.k, bd.kv.v), out=outs[i])

    import flashinfer

    batch_idx = torch.arange(batch, dtype=torch.int32, device="cuda")
    positions = (b.seq_lens[:batch] - 1).to(torch.int32)
    kv_indptr, last_len = ctx_obj.dev_meta[: batch + 1], ctx_obj._last_page_len_dev(batch)

    def bare_append_step():
        for i, bd in enumerate(bindings):
            flashinfer.append_paged_kv_cache(
                k, v, batch_idx, positions, (bd.kv.k, bd.kv.v), ctx_obj.kv_indices, kv_indptr,
                last_len,
            )  # fmt: skip
            wrapper.run(q, (bd.kv.k, bd.kv.v), out=outs[i])

    graphs["bare"] = capture_graph(bare_step)
    _sync("bare capture")
    graphs["bare_append"] = capture_graph(bare_append_step)
    _sync("bare_append capture")
    t_bare_eager = back_to_back_us(bare_step, 20)
    if force_small:
        small_max = batch  # small_decode whatever the policy says, to compare the two paths
    ctx_obj.small_decode_max_batch = small_max
    kind = fi_kind
    if batch <= small_max:
        nb = builder.build([(r, 1) for r in range(batch)], pad_to=batch)
        runtime.prepare(nb)
        kind = ctx_obj.step.kind.value
        graphs["plugin"] = capture_graph(plugin_step)
        _sync("plugin (small) capture")
        pdl, ctx_obj.pdl = ctx_obj.pdl, not ctx_obj.pdl  # small_decode's launches the other way
        try:
            graphs["plugin_pdl_flipped"] = capture_graph(plugin_step)
        finally:
            ctx_obj.pdl = pdl
        _sync("plugin (small, PDL flipped) capture")
        from attn_plugin_flashinfer.small_decode import (
            SmallDecodeBuffers,
            SmallDecodeConfig,
            num_splits_for,
        )

        def small_direct_step(bufs, config):
            for i, bd in enumerate(bindings):
                small_decode(
                    q, k, v, bd.kv.k, bd.kv.v, nb.page_table, nb.seq_lens, nb.slot_mapping,
                    outs[i], bufs, scale=bd.scale, config=config, pdl=ctx_obj.pdl,
                )  # fmt: skip

        # The kernels alone: as the plugin runs them, at half and twice the splits, and
        # with --small-sweep over tilings too.
        splits = ctx_obj.step.small.num_splits
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        variants: list[tuple[int, SmallDecodeConfig | None, str]] = [(splits, None, "small_direct")]
        variants += [
            (n, None, f"small_direct_s{n}") for n in {max(1, splits // 2), 2 * splits} - {splits}
        ]
        if sweep:  # around the fastest of a wider sweep (n32w4s3p at four programs per SM)
            grid = [
                SmallDecodeConfig(bn, w, st, True, programs_per_sm=pps)
                for bn in (16, 32)
                for w in (2, 4)
                for st in (2, 3, 4)
                for pps in (2, 4, 8)
            ]
            grid += [SmallDecodeConfig(64, 4, st, True, pps) for st in (2, 3) for pps in (2, 4)]
            grid += [SmallDecodeConfig(bn, 2, 3, False, 4) for bn in (16, 32)]
            for c in grid:
                n = num_splits_for(batch, HKV, ctx + PAGE, sms, c)
                variants.append((n, c, f"sweep_{c.label}_s{n}"))
        keep = []  # the partials must outlive the graphs that write them
        for n, config, name in variants:
            bufs = SmallDecodeBuffers.allocate(batch, H, n, D, torch.device("cuda"))
            keep.append(bufs)
            try:

                def step_fn(bufs=bufs, config=config):
                    small_direct_step(bufs, config)

                graphs[name] = capture_graph(step_fn)
            except Exception as exc:  # a tiling that does not fit (shared memory): skip it
                if config is None:
                    raise
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                torch.cuda.synchronize()
                continue
            _sync(f"{name} capture")
    rounds = _replay_rounds(graphs, layers, rounds=3)
    per_layer = {name: min(ts) for name, ts in rounds.items()}
    per_layer.setdefault("plugin", per_layer["plugin_fi"])  # above the limit: the same graph
    # host cost of update() before a replay (new batch built outside the timing)
    upd = []
    for _ in range(50):
        nb = builder.build([(r, 1) for r in range(batch)], pad_to=batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runtime.update(nb)
        upd.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    res = {
        "layers": layers,
        "B": batch,
        "ctx": ctx,
        "kind": kind,
        "plugin_graph_us_per_layer": per_layer["plugin"],
        "plugin_fi_graph_us_per_layer": per_layer["plugin_fi"],
        "bare_graph_us_per_layer": per_layer["bare"],
        "bare_eager_us_per_layer": t_bare_eager / layers,
        "ratio_vs_bare_graph": per_layer["plugin"] / per_layer["bare"],
        "plugin_fi_ratio_vs_bare_graph": per_layer["plugin_fi"] / per_layer["bare"],
        "small_pdl": ctx_obj.pdl,
        "plugin_fi_nopdl_graph_us_per_layer": per_layer["plugin_fi_nopdl"],
        "plugin_small_pdl_flipped_graph_us_per_layer": per_layer.get("plugin_pdl_flipped"),
        "bare_append_graph_us_per_layer": per_layer["bare_append"],
        "ratio_vs_bare_append_graph": per_layer["plugin"] / per_layer["bare_append"],
        "plugin_GB/s": kv_bytes / per_layer["plugin"] / 1e3,
        "bare_GB/s": kv_bytes / per_layer["bare"] / 1e3,
        "update_host_median_us": statistics.median(upd),
    }
    if "small_direct" in per_layer:
        res["small_splits"] = splits
        res["small_direct_graph_us_per_layer"] = per_layer["small_direct"]
        res["ratio_vs_small_direct"] = per_layer["plugin"] / per_layer["small_direct"]
        res["small_direct_variants_us"] = {
            name.removeprefix("small_direct_"): t
            for name, t in per_layer.items()
            if name.startswith("small_direct_")
        }
        sweep_times = {
            name.removeprefix("sweep_"): t
            for name, t in per_layer.items()
            if name.startswith("sweep_")
        }
        if sweep_times:
            res["small_sweep_us"] = dict(sorted(sweep_times.items(), key=lambda kv: kv[1]))
    return res


#: gpt-oss's attention layer: q heads, kv heads, head dim
SINK_SHAPE = (64, 8, 64)


def _sink_specs():
    from attn_core.specs import LayerSpec

    Hs, Hkvs, Ds = SINK_SHAPE
    plain = LayerSpec(kind="full", num_heads=Hs, num_kv_heads=Hkvs, head_dim=Ds, page_size=PAGE)
    return plain, plain.with_(has_sinks=True)


def bench_sinks(batch: int, ctx: int, prefill: bool = False, variant: bool = True) -> dict:
    """gpt-oss's full layers: ``batch`` decode requests at ``ctx`` (or, ``prefill``, ``batch``
    new requests of ``ctx`` tokens) through the plugin with and without sinks, FlashInfer's
    plain wrapper and (``variant``) its sink variant called directly, on one cache. Without
    the variant (its JIT build took over 5 minutes on a cold cache of FlashInfer 0.7.4) no
    output is compared."""
    import flashinfer

    Hs, Hkvs, Ds = SINK_SHAPE
    plain_spec, sink_spec = _sink_specs()
    sinks = torch.randn(Hs, device="cuda", dtype=torch.float32)
    tokens = batch * ctx if prefill else batch
    setup: _SetupArgs = dict(batch=batch, ctx=ctx, max_tokens=max(tokens, 256), cached=not prefill)
    rt_s, _, builder_s = _setup(sink_spec, layer_params={0: {"sinks": sinks}}, **setup)
    rt_p, _, builder_p = _setup(plain_spec, **setup)
    step = [(r, ctx if prefill else 1) for r in range(batch)]
    for rt, builder in ((rt_s, builder_s), (rt_p, builder_p)):
        ctx_obj = _context(rt)
        ctx_obj.small_decode_max_batch = 0  # FlashInfer's decode: small_decode takes no sinks
        if prefill:
            for r in range(batch):
                rt.state.add_request(r)
        rt.prepare(builder.build(step))
    q = torch.randn(tokens, Hs, Ds, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, Hkvs, Ds, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out_s, out_p, out_d, out_v = (torch.empty_like(q) for _ in range(4))
    b_s, b_p = rt_s.binding(0), rt_p.binding(0)
    kind = _context(rt_s).step.kind.value
    plain_wrapper = _context(rt_p).step.wrapper
    kv_s = b_s.kv

    def with_sinks():
        b_s.forward(q, k, v, out=out_s)

    def without():
        b_p.forward(q, k, v, out=out_p)

    with_sinks()  # the K/V of the step in the sinks cache before the direct calls read it
    fns = {"sinks": with_sinks, "plain": without}
    if variant:  # FlashInfer's sink variant over the sinks runtime's cache and pages
        batch_obj = _context(rt_s).batch
        pages = math.ceil(ctx / PAGE)
        qo = torch.arange(batch + 1, dtype=torch.int32) * (ctx if prefill else 1)
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        indices = batch_obj.page_table[:batch, :pages].reshape(-1).contiguous()
        last = torch.full((batch,), (ctx - 1) % PAGE + 1, dtype=torch.int32)
        sink_wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda"), "NHD",
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=Ds,
            head_dim_vo=Ds, window_left=-1,
        )  # fmt: skip
        sink_wrapper.plan(qo, kv_indptr, indices, last, Hs, Hkvs, Ds, PAGE, causal=True,
                          window_left=-1, sm_scale=sink_spec.scale,
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip

        def sink_variant():
            sink_wrapper.run(q, (kv_s.k, kv_s.v), sinks, float(sink_spec.scale), out=out_v)

        fns["variant"] = sink_variant

    kv_p = b_p.kv
    if prefill:  # the ragged wrapper reads the step's own k/v

        def direct():
            plain_wrapper.run(q, k, v, out=out_d)
    else:

        def direct():
            plain_wrapper.run(q, (kv_p.k, kv_p.v), out=out_d)

    fns["direct"] = direct
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    err = (out_s.float() - out_v.float()).abs().max().item() if variant else None
    t0 = time.perf_counter()
    direct()
    torch.cuda.synchronize()
    repeat = max(1, _iters_for((time.perf_counter() - t0) * 1e6) // 20)
    rounds = alternating_us(fns, rounds=20, repeat=repeat)
    med = {name: statistics.median(times) for name, times in rounds.items()}
    return {
        "B": batch,
        "ctx": ctx,
        "phase": "prefill" if prefill else "decode",
        "kind": kind,
        **{f"{name}_us": us for name, us in med.items()},
        "sinks_over_plain": med["sinks"] / med["plain"],
        "sinks_over_direct": med["sinks"] / med["direct"],
        "sinks_over_variant": med["sinks"] / med["variant"] if variant else None,
        "max_abs_diff_vs_variant": err,
    }


def bench_sinks_graph(batch: int, ctx: int, layers: int = 32) -> dict:
    """A ``layers``-layer decode step of gpt-oss's full layers captured in one CUDA graph, with
    sinks (FlashInfer's decode, its log-sum-exp and the rescale launch) and without (the same
    decode kernel: small_decode off in both), per layer; replays timed in 5 alternating
    rounds, medians."""
    Hs, Hkvs, Ds = SINK_SHAPE
    plain_spec, sink_spec = _sink_specs()
    sinks = torch.randn(Hs, device="cuda", dtype=torch.float32)
    q = torch.randn(batch, Hs, Ds, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, Hkvs, Ds, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    graphs, keep = {}, []  # the runtimes and outputs must outlive the graphs
    for name, spec, params in (
        ("sinks", sink_spec, {i: {"sinks": sinks} for i in range(layers)}),
        ("plain", plain_spec, None),
    ):
        runtime, _state, builder = _setup(spec, batch=batch, ctx=ctx, layers=layers, graph=True,
                                          layer_params=params)  # fmt: skip
        _context(runtime).small_decode_max_batch = 0  # small_decode takes no sinks
        runtime.prepare(builder.build([(r, 1) for r in range(batch)], pad_to=batch))
        outs = [torch.empty_like(q) for _ in range(layers)]
        bindings = [runtime.binding(i) for i in range(layers)]

        def step(bindings=bindings, outs=outs):
            for i, bd in enumerate(bindings):
                bd.forward(q, k, v, out=outs[i])

        graphs[name] = capture_graph(step)
        keep.append((runtime, outs))
        _sync(f"sinks graph {name} capture")
    rounds = _replay_rounds(graphs, layers, rounds=5)
    med = {name: statistics.median(ts) for name, ts in rounds.items()}
    return {
        "B": batch,
        "ctx": ctx,
        "layers": layers,
        "sinks_graph_us_per_layer": med["sinks"],
        "plain_graph_us_per_layer": med["plain"],
        "sinks_over_plain": med["sinks"] / med["plain"],
    }


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _run(results: dict, name: str, fn, *args, **kwargs) -> None:
    t0 = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
        value["wall_s"] = round(time.perf_counter() - t0, 2)
        results.setdefault(name, []).append(value)
        print(f"[{name}] {json.dumps(value)}", flush=True)
    except Exception as exc:
        results.setdefault("errors", []).append(
            {"section": name, "args": repr((args, kwargs)), "error": f"{type(exc).__name__}: {exc}"}
        )
        traceback.print_exc()
        print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", flush=True)
    finally:
        _free()


def _table(results: dict) -> str:
    lines = []
    if "copy" in results:
        lines.append(f"copy bandwidth (1 GiB, r+w): {results['copy'][0]['GB/s']:.0f} GB/s")
    if "decode" in results:
        copy_bw = results["copy"][0]["GB/s"] if "copy" in results else float("nan")
        lines.append(
            "decode bf16 32q/8kv d128 page16 |   B |   ctx | plugin us (kind)      | direct us | "
            "ratio min/min, median/median, median of turns | FI append+run us | ratio | "
            "host us plugin/direct | GB/s plugin | % of copy | "
            "plugin on FI: us (ratio) / host us; through run(): us / host us | small: host us "
            "of its two bound launches / of one; us / host us through the launcher object, "
            "CachedLaunch, Triton's launcher"
        )
        for r in results["decode"]:
            launcher = (
                f"{r['plan_two_launches_host_us']:.1f} / {r['one_bound_launch_host_us']:.1f} "
                f"({r['launcher_form']}); {r['plugin_runner_call_us']:.1f} / "
                f"{r['plugin_runner_call_host_us']:.1f}, {r['plugin_cached_launch_us']:.1f} / "
                f"{r['plugin_cached_launch_host_us']:.1f}, "
                f"{r['plugin_small_triton_launcher_us']:.1f} / "
                f"{r['plugin_small_triton_launcher_host_us']:.1f}"
                if "plan_two_launches_host_us" in r
                else "-"
            )
            lines.append(
                f"{'':32} | {r['B']:3d} | {r['ctx']:5d} | {r['plugin_us']:9.1f} "
                f"({r['kind']:12}) | {r['direct_us']:9.1f} | {r['ratio']:5.3f}, "
                f"{r['ratio_median_over_median']:5.3f}, {r['ratio_median_of_rounds']:5.3f} | "
                f"{r['direct_with_write_us']:16.1f} | {r['ratio_vs_direct_with_write']:5.3f} | "
                f"{r['plugin_host_us']:9.1f} / {r['direct_host_us']:<9.1f} | "
                f"{r['plugin_GB/s']:11.0f} | {100 * r['plugin_GB/s'] / copy_bw:8.0f}% | "
                f"{r['plugin_fi_us']:.1f} ({r['plugin_fi_ratio']:.3f}) / "
                f"{r['plugin_fi_host_us']:.1f}; {r['plugin_fi_run_us']:.1f} / "
                f"{r['plugin_fi_run_host_us']:.1f} | {launcher}"
            )
    for r in results.get("prefill", []):
        lines.append(
            f"ragged prefill B={r['B']} S={r['S']} {r['heads']} heads d128 causal: plugin "
            f"{r['plugin_us']:.0f} us ({r['plugin_TFLOP/s']:.0f} TFLOP/s; KV write on the same "
            f"stream {r['plugin_serial_write_us']:.0f} us), direct "
            f"{r['direct_us']:.0f} us ({r['direct_TFLOP/s']:.0f} TFLOP/s), ratio min/min "
            f"{r['ratio']:.3f}, median/median {r['ratio_median_over_median']:.3f} ("
            f"{r['plugin_us_median']:.0f} / {r['direct_us_median']:.0f} us), median of the "
            f"rounds' ratios {r['ratio_median_of_rounds']:.3f} (p10-p90 "
            f"{r['ratio_rounds_p10_p90'][0]:.3f}-{r['ratio_rounds_p10_p90'][1]:.3f}; direct "
            f"{r['direct_us']:.0f}-{r['direct_us_max']:.0f} us over the run); "
            f"FI append+run {r['direct_with_write_us']:.0f} us (ratio "
            f"{r['ratio_vs_direct_with_write']:.3f}); KV write: core {r['core_write_us']:.0f} us "
            f"({r['kv_write_GB/s']:.0f} GB/s), FI append {r['fi_append_us']:.0f} us"
        )
        probe = r.get("copy_engine_probe") or {}
        lines.append(
            "  copy-engine probe: "
            + ", ".join(
                f"{n} {x:.1f}" if isinstance(x, float) else f"{n} {x}" for n, x in probe.items()
            )
        )
    for r in results.get("decode_variants", []):
        cells = ", ".join(
            f"{name} {r[name + '_us']:.1f} us ({r[name + '_GB/s']:.0f} GB/s)"
            for name in ("NHD_cc", "NHD_tc", "HND_cc", "HND_tc")
        )
        lines.append(f"direct decode kernels B={r['B']} ctx={r['ctx']}: {cells}")
    for r in results.get("prepare", []):
        lines.append(
            f"prepare() host time, B={r['B']} decode: median {r['median_us']:.1f} us, "
            f"p90 {r['p90_us']:.1f} us (target < {r['target_us']} us); FlashInfer plan() alone "
            f"{r['flashinfer_plan_median_us']:.1f} us"
        )
    if results.get("graph"):
        lines.append(
            "decode graph, us per layer |   B |   ctx | plugin (kind)         | ratio vs bare | "
            "plugin on FI (ratio) | bare FI kernel | FI append+kernel (ratio) | "
            "small_decode direct (ratio) | GB/s plugin / bare | update() host us"
        )
    for r in results.get("graph", []):
        small = (
            f"{r['small_direct_graph_us_per_layer']:.2f} ({r['ratio_vs_small_direct']:.3f}) at "
            f"{r['small_splits']} splits; "
            + ", ".join(f"{n}: {t:.2f}" for n, t in r["small_direct_variants_us"].items())
            if "small_direct_graph_us_per_layer" in r
            else "-"
        )
        lines.append(
            f"{r['layers']:2d} layers {'':15} | {r['B']:3d} | {r['ctx']:5d} | "
            f"{r['plugin_graph_us_per_layer']:7.2f} ({r['kind']:12}) | "
            f"{r['ratio_vs_bare_graph']:13.3f} | "
            f"{r['plugin_fi_graph_us_per_layer']:7.2f} "
            f"({r['plugin_fi_ratio_vs_bare_graph']:.3f}) | "
            f"{r['bare_graph_us_per_layer']:14.2f} | "
            f"{r['bare_append_graph_us_per_layer']:7.2f} ({r['ratio_vs_bare_append_graph']:.3f}) | "
            f"{small} | {r['plugin_GB/s']:.0f} / {r['bare_GB/s']:.0f} | "
            f"{r['update_host_median_us']:.1f}"
        )
        flipped = r.get("plugin_small_pdl_flipped_graph_us_per_layer")
        lines.append(
            f"{'':27}plugin on FI with the K/V write launched plainly (no PDL): "
            f"{r['plugin_fi_nopdl_graph_us_per_layer']:.2f}"
            + (
                f"; small_decode with PDL {'off' if r['small_pdl'] else 'on'}: {flipped:.2f}"
                if flipped is not None
                else ""
            )
        )
        if "small_sweep_us" in r:
            best = list(r["small_sweep_us"].items())[:6]
            lines.append(
                f"{'':27}small_decode tilings, fastest first (us per layer): "
                + ", ".join(f"{name} {t:.2f}" for name, t in best)
            )
    for e in results.get("errors", []):
        lines.append(f"ERROR in {e['section']} {e['args']}: {e['error']}")
    if "sinks" in results:
        lines.append(
            "sinks, gpt-oss 64q/8kv d64 page16 | phase   |  B |   ctx | plugin with sinks us | "
            "without us | FI run() us | FI sink variant us | with / without | with / run() | "
            "with / variant | max |diff| to the variant"
        )
        for r in results["sinks"]:
            has_variant = r["sinks_over_variant"] is not None
            lines.append(
                f"  {r['phase']:7} | {r['B']:3} | {r['ctx']:5} | {r['sinks_us']:9.1f} | "
                f"{r['plain_us']:9.1f} | {r['direct_us']:9.1f} | "
                + (f"{r['variant_us']:9.1f} | " if has_variant else "        - | ")
                + f"{r['sinks_over_plain']:.3f} | {r['sinks_over_direct']:.3f} | "
                + (
                    f"{r['sinks_over_variant']:.3f} | {r['max_abs_diff_vs_variant']:.2e}"
                    if has_variant
                    else "- | -"
                )
            )
    if "sinks_graph" in results:
        lines.append(
            "sinks in a CUDA graph, gpt-oss 64q/8kv d64 | B | ctx | layers | with sinks us/layer | "
            "without | with / without"
        )
        for r in results["sinks_graph"]:
            lines.append(
                f"  {r['B']:3} | {r['ctx']:5} | {r['layers']} | "
                f"{r['sinks_graph_us_per_layer']:7.2f} | {r['plain_graph_us_per_layer']:7.2f} | "
                f"{r['sinks_over_plain']:.3f}"
            )
    return "\n".join(lines)


def _cases(text: str) -> list[tuple[int, int]]:
    """``"1x4096,64x32768"`` -> ``[(1, 4096), (64, 32768)]`` (BATCHxCTX, as the options take)."""
    cases = []
    for case in text.split(","):
        batch, ctx = (int(x) for x in case.split("x"))
        cases.append((batch, ctx))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/flashinfer.json", help="JSON output path")
    parser.add_argument("--quick", action="store_true", help="ctx 4096 only, B=1 and 64")
    parser.add_argument(
        "--variants", action="store_true", help="direct decode kernel choices (layout, cores)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile of prepare() at B=256 and of a small eager decode forward",
    )
    parser.add_argument(
        "--small-sweep", action="store_true", help="graph section: small_decode tilings too"
    )
    parser.add_argument(
        "--force-small",
        action="store_true",
        help="graph section: small_decode at every case, past the plugin's batch limit",
    )
    parser.add_argument(
        "--graph-cases",
        default="64x4096,1x4096,2x4096,4x4096,8x4096,16x4096,1x32768,8x32768",
        help="graph section: comma-separated BATCHxCTX cases",
    )
    parser.add_argument(
        "--decode-cases",
        help="decode section: comma-separated BATCHxCTX cases instead of B = 1, 64, 256 at ctx "
        "4096 and 32768 (say 1x16384,1x24576 for where small_decode and FlashInfer cross)",
    )
    parser.add_argument(
        "--sinks-cases",
        # not a one-request case first: 1 x 4096, first, measured 41 us for the sinks where
        # 1 x 32768 measured 3.3
        default="64x4096,1x4096,1x32768,8x32768",
        help="sinks section: comma-separated BATCHxCTX decode cases",
    )
    parser.add_argument(
        "--sinks-graph-cases",
        default="1x4096,64x4096,8x32768",
        help="sinks section: comma-separated BATCHxCTX cases of a 32-layer captured decode step",
    )
    parser.add_argument(
        "--no-sink-variant",
        action="store_true",
        help="sinks section: leave out FlashInfer's sink variant (and the output comparison "
        "with it): its JIT build is the slowest of the section on a cold cache",
    )
    parser.add_argument(
        "--only",
        help="comma-separated sections: decode, variants, prefill, prepare, profile, graph, "
        "sinks (the copy bandwidth always runs)",
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None

    def want(section: str) -> bool:
        return only is None or section in only

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    from attn_plugin_flashinfer import capability

    from attn_core.specs import LayerSpec

    av = capability.probe()
    if not av.available:
        print(f"flashinfer backend unavailable: {av.reason}", file=sys.stderr)
        return 2
    spec = LayerSpec(kind="full", num_heads=H, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "flashinfer": av.version,
        "torch": torch.__version__,
    }
    started = time.perf_counter()
    _run(results, "copy", bench_copy)
    contexts = (4096,) if args.quick else (4096, 32768)
    batches = (1, 64) if args.quick else (1, 64, 256)
    decode_cases = [(b, c) for c in contexts for b in batches]
    if args.decode_cases:
        decode_cases = _cases(args.decode_cases)
    for batch, ctx in decode_cases if want("decode") else ():
        _run(results, "decode", bench_decode, spec, batch, ctx, profile=args.profile)
    if args.variants and want("variants"):
        for batch, ctx in ((64, 4096), (256, 4096), (64, 32768)):
            _run(results, "decode_variants", bench_decode_variants, batch, ctx)
    if want("prefill"):
        _run(results, "prefill", bench_prefill)
    if want("prepare"):
        _run(results, "prepare", bench_prepare, spec)
    if args.profile and want("profile"):
        _run(results, "prepare_profile", bench_prepare_profile, spec)
    if want("graph"):
        for batch, ctx in _cases(args.graph_cases):
            _run(results, "graph", bench_graph, spec, batch=batch, ctx=ctx,
                 sweep=args.small_sweep, force_small=args.force_small)  # fmt: skip
    if want("sinks"):
        variant = not args.no_sink_variant
        for batch, ctx in _cases(args.sinks_cases):
            _run(results, "sinks", bench_sinks, batch, ctx, variant=variant)
        _run(results, "sinks", bench_sinks, 2, 4096, prefill=True, variant=variant)
        for batch, ctx in _cases(args.sinks_graph_cases):
            _run(results, "sinks_graph", bench_sinks_graph, batch, ctx)
    results["total_s"] = round(time.perf_counter() - started, 1)
    table = _table(results)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["table"] = table
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out} ({results['total_s']} s)")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
