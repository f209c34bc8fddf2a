"""Benchmark the fa3 plugin against the kernel called directly (no KV write, no core).

For each case it times, with CUDA events (median of ``--iters`` after ``--warmup``):

- ``plugin``: ``binding.forward(q, k, v, out=out)`` through AttentionRuntime (KV write by
  slot_mapping + the varlen call);
- ``direct``: the library's public call on the same cache and metadata
  (``flash_attn.cute.interface.flash_attn_varlen_func`` or ``flash_attn_interface.
  flash_attn_with_kvcache``);
- ``kv_write``: the plugin's KV write alone.

and reports ``ratio = plugin / direct``, attention TFLOP/s (``4 * H * D * visible pairs``) and the
KV bytes read per second. Each case is independent: a failure is recorded in the JSON and the
next case runs.

    python3 attn_plugins/fa3/bench/bench_fa3.py --out fa3_bench.json [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve()
for p in (_HERE.parents[1], _HERE.parents[3]):  # the plugin, the repository root
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import attn_plugin_fa3.kv_write as kv_write  # noqa: E402
import attn_plugin_fa3.plugin as plugin  # noqa: E402

import attn_core.reference.plugin as ref_plugin  # noqa: E402
from attn_core import bench_util  # noqa: E402
from attn_core.batch import BatchBuilder  # noqa: E402
from attn_core.registry import Registry  # noqa: E402
from attn_core.runtime import AttentionRuntime  # noqa: E402
from attn_core.selector import select  # noqa: E402
from attn_core.specs import (  # noqa: E402
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    group_layers,
)
from attn_core.state import FullKVLayer  # noqa: E402
from attn_core.state.manager import PersistentState  # noqa: E402

# (name, batch, context before the step, new tokens per request, page size, window)
CASES = [
    ("decode_b64_ctx4096_p16", 64, 4096, 1, 16, None),
    ("decode_b64_ctx4096_p128", 64, 4096, 1, 128, None),
    ("decode_b256_ctx4096_p16", 256, 4096, 1, 16, None),
    ("decode_b1_ctx4096_p16", 1, 4096, 1, 16, None),
    ("decode_b64_ctx32768_p128", 64, 32768, 1, 128, None),
    ("decode_b64_ctx4096_p16_win1024", 64, 4096, 1, 16, 1024),
    ("prefill_b2_s8192_p128", 2, 0, 8192, 128, None),
    ("prefill_b2_s8192_p16", 2, 0, 8192, 16, None),
    ("chunk_b4_ctx4096_q512_p16", 4, 4096, 512, 16, None),
]
QUICK = {"decode_b64_ctx4096_p16", "decode_b64_ctx4096_p128", "prefill_b2_s8192_p128"}


def _direct_call(provider_name: str):
    if provider_name == "flash-attn-4":
        from flash_attn.cute.interface import flash_attn_varlen_func

        def fa4_call(q, kc, vc, batch, scale, window):
            return flash_attn_varlen_func(
                q, kc, vc,
                cu_seqlens_q=batch.query_start_loc, max_seqlen_q=batch.max_query_len,
                seqused_k=batch.seq_lens, max_seqlen_k=batch.max_seq_len,
                page_table=batch.page_table, softmax_scale=scale, causal=True,
                window_size=(window - 1 if window else None, 0 if window else None),
            )  # fmt: skip

        return fa4_call
    from flash_attn_interface import flash_attn_with_kvcache

    def call(q, kc, vc, batch, scale, window):
        return flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=batch.seq_lens, page_table=batch.page_table,
            cu_seqlens_q=batch.query_start_loc, max_seqlen_q=batch.max_query_len,
            softmax_scale=scale, causal=True, window_size=(window - 1 if window else -1, 0),
        )  # fmt: skip

    return call


def run_case(name, batch_size, ctx, q_len, page, window, args, direct) -> dict:
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    spec = LayerSpec(kind="full", num_heads=h, num_kv_heads=hkv, head_dim=d, page_size=page,
                     sliding_window=window)  # fmt: skip
    groups = group_layers([spec])
    reg = Registry(strict=True)
    reg.register_plugin(ref_plugin, name="attn_core")
    reg.register_plugin(plugin, name="fa3")
    total = ctx + q_len
    pages_per_req = -(-total // page)
    tokens = batch_size * q_len
    cons = ExecutionConstraints(force="full=fa3", max_batch_size=batch_size, max_num_tokens=tokens,
                                max_model_len=total)  # fmt: skip
    plan = select(groups, reg, DeviceCapabilities.detect(), cons)
    state = PersistentState(groups, num_pages=batch_size * pages_per_req + 1, num_slots=0,
                            device="cuda")  # fmt: skip
    rt = AttentionRuntime(plan, reg, state=state, device="cuda")
    builder = BatchBuilder(state, max_batch_size=batch_size, max_num_tokens=tokens,
                           max_pages_per_request=pages_per_req, device="cuda")  # fmt: skip
    layer = state.kv_cache.layer(0)
    assert isinstance(layer, FullKVLayer)  # a full-attention spec: K and V pages
    layer.k.normal_()
    layer.v.normal_()
    for r in range(batch_size):
        state.add_request(r)
        if ctx:
            state.ensure_capacity(r, ctx)
            state.advance(r, ctx)  # the context's KV is the random cache content
    batch = builder.build([(r, q_len) for r in range(batch_size)])
    q = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rt.prepare(batch)
    binding = rt.binding(0)
    scale = binding.scale

    def plugin_fn():
        binding.forward(q, k, v, out=out)

    def direct_fn():
        direct(q, layer.k, layer.v, batch, scale, window)

    def write_fn():
        kv_write.write_kv(k, v, layer.k, layer.v, batch.slot_mapping, may_have_padding=False)

    t0 = time.perf_counter()
    plugin_fn()  # first call compiles (flash-attn-4 JIT)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    us_plugin = bench_util.cuda_time_us(plugin_fn, args.iters, args.warmup)
    us_direct = bench_util.cuda_time_us(direct_fn, args.iters, args.warmup)
    us_write = bench_util.cuda_time_us(write_fn, args.iters, args.warmup)
    # visible (query, key) pairs of a causal step (window-limited when set)
    pairs = 0
    for i in range(q_len):
        p = ctx + i + 1
        pairs += min(p, window) if window else p
    pairs *= batch_size
    flops = 4 * h * d * pairs
    kv_bytes = batch_size * min(total, window or total) * hkv * d * 2 * 2  # K and V, bf16
    return {
        "case": name,
        "batch": batch_size,
        "ctx": ctx,
        "q_len": q_len,
        "page_size": page,
        "window": window,
        "first_call_s": round(compile_s, 3),
        "plugin_us": round(us_plugin, 2),
        "direct_us": round(us_direct, 2),
        "kv_write_us": round(us_write, 2),
        "ratio_plugin_over_direct": round(us_plugin / us_direct, 3),
        "plugin_tflops": round(flops / us_plugin / 1e6, 1),
        "direct_tflops": round(flops / us_direct / 1e6, 1),
        "plugin_kv_gbs": round(kv_bytes / us_plugin / 1e3, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help=f"only {sorted(QUICK)}")
    args = ap.parse_args()
    result = bench_util.new_result()
    provider, reason = plugin.probe()
    result["provider"] = None if provider is None else f"{provider.name} {provider.version}"
    if provider is None:
        result["errors"].append({"case": "*", "error": reason})
    else:
        bench_util.record_device(result)
        direct = _direct_call(provider.name)
        for case in CASES:
            if args.quick and case[0] not in QUICK:
                continue
            bench_util.run_case(result, case[0], run_case, *case, args, direct)
    return bench_util.write_result(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
