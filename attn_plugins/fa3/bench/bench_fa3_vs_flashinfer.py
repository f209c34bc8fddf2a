"""The fa3 plugin against the fastest other kernels, in alternating rounds in one process.

Decode (bf16, page 16, the same paged cache): ``binding.forward`` of the fa3 plugin (KV write +
attention; split-KV on or off) against FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``
called directly over the same pages (planned once; the faster of its tensor-core and CUDA-core
kernels). Prefill without a cached prefix: the fa3 plugin (KV write + non-paged varlen call)
against FlashAttention-4's own ``flash_attn_varlen_func`` on contiguous q/k/v.

Reports the median over rounds of each time and of the per-round ratios, eager
(``fa3_over_flashinfer``) and for the split step replayed from a CUDA graph
(``fa3_graph_over_flashinfer``, FlashInfer's call eager)::

    python3 attn_plugins/fa3/bench/bench_fa3_vs_flashinfer.py --out fa3_vs_fi.json [--rounds 15]
        [--case b1_ctx32k --case b4_ctx128k] [--sweep]

``--case`` keeps the cases whose name contains one of the given strings; ``--sweep`` adds other
split counts, the chunk kernel alone, and the split step without programmatic dependent launch
of the merge (``ATTN_PDL=0``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve()
for p in (_HERE.parents[1], _HERE.parents[3]):  # the plugin, the repository root
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import attn_plugin_fa3.plugin as plugin  # noqa: E402
import attn_plugin_fa3.split_kv as split_kv  # noqa: E402

import attn_core.reference.plugin as ref_plugin  # noqa: E402
from attn_core import bench_util, pdl  # noqa: E402
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

PAGE = 16
# (name, q heads, kv heads, batch, context before the step)
DECODE = [
    ("decode_64/8_b1_ctx128k", 64, 8, 1, 131072),
    ("decode_64/8_b1_ctx32k", 64, 8, 1, 32768),
    ("decode_32/8_b4_ctx128k", 32, 8, 4, 131072),
    ("decode_28/4_b64_ctx8k", 28, 4, 64, 8192),
    ("decode_32/8_b1024_ctx2k", 32, 8, 1024, 2048),
]
# (name, q heads, kv heads, batch, tokens per sequence)
PREFILL = [
    ("prefill_28/4_b2_s8192", 28, 4, 2, 8192),
    ("prefill_32/8_b2_s8192", 32, 8, 2, 8192),
]


def _setup(h: int, hkv: int, batch: int, ctx: int, q_len: int):
    spec = LayerSpec(kind="full", num_heads=h, num_kv_heads=hkv, head_dim=128, page_size=PAGE)
    groups = group_layers([spec])
    reg = Registry(strict=True)
    reg.register_plugin(ref_plugin, name="attn_core")
    reg.register_plugin(plugin, name="fa3")
    total = ctx + q_len
    pages = -(-total // PAGE)
    tokens = batch * q_len
    cons = ExecutionConstraints(force="full=fa3", max_batch_size=batch, max_num_tokens=tokens,
                                max_model_len=total)  # fmt: skip
    plan = select(groups, reg, DeviceCapabilities.detect(), cons)
    state = PersistentState(groups, num_pages=batch * pages + 1, num_slots=0, device="cuda")
    rt = AttentionRuntime(plan, reg, state=state, device="cuda")
    builder = BatchBuilder(state, max_batch_size=batch, max_num_tokens=tokens,
                           max_pages_per_request=pages, device="cuda")  # fmt: skip
    layer = state.kv_cache.layer(0)
    assert isinstance(layer, FullKVLayer)  # a full-attention spec: K and V pages
    layer.k.normal_()
    layer.v.normal_()
    for r in range(batch):
        state.add_request(r)
        if ctx:
            state.ensure_capacity(r, ctx)
            state.advance(r, ctx)
    b = builder.build([(r, q_len) for r in range(batch)])
    rt.prepare(b)
    return rt, b, layer


def _flashinfer_decode(batch, layer, h: int, hkv: int):
    import flashinfer

    seq = torch.from_numpy(batch.seq_lens_cpu[: batch.num_reqs].astype("int64"))
    npages = (seq + PAGE - 1) // PAGE
    table = batch.page_table[: batch.num_reqs].cpu()
    indices = torch.cat([table[i, : int(n)] for i, n in enumerate(npages)]).int()
    indptr = torch.zeros(batch.num_reqs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(npages, 0)
    last = (seq - (npages - 1) * PAGE).int()
    calls = {}
    for tc in (False, True):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        try:  # the CUDA-core kernel serves group sizes 1, 2, 4, 8 only (not 28/4)
            w.plan(indptr, indices, last, h, hkv, 128, PAGE, q_data_type=torch.bfloat16)
        except RuntimeError:
            continue
        calls["tc" if tc else "cc"] = w
    return calls


def _median(xs):
    return statistics.median(xs)


def bench_decode(name, h, hkv, batch, ctx, rounds, sweep) -> dict:
    rt, b, layer = _setup(h, hkv, batch, ctx, 1)
    binding = rt.binding(0)
    ctx_obj = rt.groups["full"].context
    splits = ctx_obj.split.plan.num_splits if ctx_obj.split is not None else 1
    q = torch.randn(batch, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    fi_out = torch.empty_like(q)
    wrappers = _flashinfer_decode(b, layer, h, hkv)
    saved = ctx_obj.split

    def fa3_split():
        ctx_obj.split = saved
        binding.forward(q, k, v, out=out)

    def fa3_unsplit():
        ctx_obj.split = None
        binding.forward(q, k, v, out=out)

    fns = {"fa3": fa3_split, "fa3_unsplit": fa3_unsplit}
    if sweep and saved is not None:  # other split counts, to see the planner's choice in context
        pages = -(-ctx // PAGE)  # the chunks cover the cached context; the merge adds the token
        for n in (2, 4, 8, 12, 16, 20, 24, 32):
            if n == saved.plan.num_splits:
                continue
            alt = split_kv.build_metadata(
                split_kv.SplitPlan(n, -(-pages // n), PAGE), b.page_table, b.seq_lens[:batch]
            )

            def fa3_alt(alt=alt):
                ctx_obj.split = alt
                binding.forward(q, k, v, out=out)

            fns[f"fa3_s{n}"] = fa3_alt
    if sweep and saved is not None:  # the chunk kernel alone (no KV write, q copy, merge)
        prov = ctx_obj.provider
        nsp = saved.plan.num_splits
        q_rows = q[:batch].repeat_interleave(nsp, dim=0)

        def chunks_only():
            prov.run_with_lse(q_rows, layer.k, layer.v, cu_seqlens_q=saved.cu_seqlens_q,
                              seqused_k=saved.seqused_k, max_seqlen_k=saved.plan.chunk_tokens,
                              page_table=saved.page_table, scale=binding.scale,
                              softcap=None)  # fmt: skip

        fns["fa4_chunks_only"] = chunks_only

        def fa3_no_pdl():  # the merge launched plainly after the chunk kernel
            os.environ[pdl.ENV_VAR] = "0"
            try:
                fa3_split()
            finally:
                os.environ.pop(pdl.ENV_VAR, None)

        fns["fa3_no_pdl"] = fa3_no_pdl
    if saved is not None:  # the same call replayed from a CUDA graph: GPU time without host cost
        fa3_split()
        torch.cuda.synchronize()
        fns["fa3_graph"] = bench_util.capture_graph(fa3_split).replay
    for tag, w in wrappers.items():

        def flashinfer_run(w=w):
            return w.run(q, (layer.k, layer.v), out=fi_out)

        fns[f"flashinfer_{tag}"] = flashinfer_run
    # correctness of the timed call: the split output against FlashInfer's
    fa3_split()
    fns["flashinfer_tc"]()
    torch.cuda.synchronize()
    err = (out.float() - fi_out.float()).abs().max().item()
    times = bench_util.alternating_us(fns, rounds, warmup=3)
    fi_key = min((n for n in times if n.startswith("flashinfer")), key=lambda n: _median(times[n]))
    ratio = [a / c for a, c in zip(times["fa3"], times[fi_key], strict=True)]
    ratio_unsplit = [a / c for a, c in zip(times["fa3_unsplit"], times[fi_key], strict=True)]
    graph = times.get("fa3_graph")
    graph_ratio = (
        round(_median([a / c for a, c in zip(graph, times[fi_key], strict=True)]), 3)
        if graph
        else None
    )
    kv_bytes = batch * (ctx + 1) * hkv * 128 * 2 * 2
    return {
        "case": name,
        "splits": splits,
        # one request: its query broadcast over the chunk rows (no copy launch)
        "broadcast_q": bool(ctx_obj.broadcast_q and batch == 1),
        "max_abs_diff_vs_flashinfer": round(err, 5),
        **{f"{n}_us": round(_median(t), 2) for n, t in times.items()},
        "flashinfer_kernel": fi_key,
        "fa3_over_flashinfer": round(_median(ratio), 3),
        "fa3_graph_over_flashinfer": graph_ratio,
        "fa3_unsplit_over_flashinfer": round(_median(ratio_unsplit), 3),
        "fa3_kv_TB/s": round(kv_bytes / _median(times["fa3"]) / 1e6, 2),
    }


def bench_prefill(name, h, hkv, batch, seq, rounds) -> dict:
    from flash_attn.cute.interface import flash_attn_varlen_func

    rt, b, _layer = _setup(h, hkv, batch, 0, seq)
    binding = rt.binding(0)
    assert rt.groups["full"].context.dense, "a fresh prefill must take the non-paged path"
    t = batch * seq
    q = torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    cu = b.query_start_loc
    scale = binding.scale

    def direct():
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq,
                               max_seqlen_k=seq, softmax_scale=scale, causal=True)  # fmt: skip

    fns = {"fa3": lambda: binding.forward(q, k, v, out=out), "fa4_direct": direct}
    times = bench_util.alternating_us(fns, rounds, warmup=3)
    ratio = [d / p for p, d in zip(times["fa3"], times["fa4_direct"], strict=True)]
    flops = 4 * h * 128 * batch * seq * (seq + 1) / 2
    return {
        "case": name,
        **{f"{n}_us": round(_median(tt), 1) for n, tt in times.items()},
        "fa3_TFLOP/s": round(flops / _median(times["fa3"]) / 1e6, 1),
        "fa4_direct_TFLOP/s": round(flops / _median(times["fa4_direct"]) / 1e6, 1),
        "fa3_rate_over_fa4_direct": round(_median(ratio), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="also time other split counts")
    ap.add_argument("--case", action="append", default=[],
                    help="only cases whose name contains this (repeatable)")  # fmt: skip
    args = ap.parse_args()

    def wanted(name: str) -> bool:
        return not args.case or any(c in name for c in args.case)

    result = bench_util.new_result()
    provider, reason = plugin.probe()
    result["provider"] = None if provider is None else f"{provider.name} {provider.version}"
    if provider is None:
        result["errors"].append({"case": "*", "error": reason})
        return bench_util.write_result(result, args.out)
    bench_util.record_device(result)
    for case in DECODE:
        if wanted(case[0]):
            bench_util.run_case(result, case[0], bench_decode, *case, args.rounds, args.sweep)
    for case in PREFILL:
        if wanted(case[0]):
            bench_util.run_case(result, case[0], bench_prefill, *case, args.rounds)
    return bench_util.write_result(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
