"""Benchmark the varlen plugin's backends against their kernels called directly.

For each case and backend it times, with CUDA events (median of ``--iters`` after ``--warmup``):

- ``plugin``: ``binding.forward(q, k, v, out=out)`` through AttentionRuntime;
- ``direct``: ``varlen:varlen`` -> ``torch.nn.attention.varlen.varlen_attn`` on the same packed
  tensors; ``varlen:sdpa`` -> ``scaled_dot_product_attention`` on ``[n, H, L, D]`` tensors
  prepared beforehand (one call per run of equal lengths, no copies timed);

and reports ``ratio = plugin / direct`` and TFLOP/s (``4 * H * D * visible pairs``). A failing
case or backend is recorded in the JSON and the rest still run.

    python3 attn_plugins/varlen/bench/bench_varlen.py --out varlen_bench.json [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve()
for p in (_HERE.parents[1], _HERE.parents[3]):  # the plugin, the repository root
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import attn_plugin_varlen.kernels as kernels  # noqa: E402
import attn_plugin_varlen.plugin as plugin  # noqa: E402

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

# (name, sequence lengths, heads, head dim, causal)
CASES = [
    ("anchor_2x8192_h16_d128", [8192] * 2, 16, 128, False),
    ("anchor_2x8192_h16_d128_causal", [8192] * 2, 16, 128, True),
    ("vit_16x1024_h16_d64", [1024] * 16, 16, 64, False),
    ("qwen2vl_ragged_h16_d80", [1024, 4096, 256, 64, 2304, 576, 1296, 16], 16, 80, False),
    ("siglip_64x729_h16_d72", [729] * 64, 16, 72, False),
    ("whisper_8x1500_h20_d64", [1500] * 8, 20, 64, False),
]
QUICK = {"anchor_2x8192_h16_d128", "qwen2vl_ragged_h16_d80"}


def run_case(backend, name, lengths, heads, head_dim, causal, args) -> dict:
    spec = LayerSpec(kind="encoder", num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                     causal=causal)  # fmt: skip
    groups = group_layers([spec])
    reg = Registry(strict=True)
    reg.register_plugin(ref_plugin, name="attn_core")
    reg.register_plugin(plugin, name="varlen")
    total = sum(lengths)
    cons = ExecutionConstraints(force=f"encoder={backend}", max_batch_size=len(lengths),
                                max_num_tokens=total)  # fmt: skip
    plan = select(groups, reg, DeviceCapabilities.detect(), cons)
    rt = AttentionRuntime(plan, reg, device="cuda")
    builder = BatchBuilder(None, max_batch_size=len(lengths), max_num_tokens=total, device="cuda")
    batch = builder.build_encoder(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    out = torch.empty_like(q)
    rt.prepare(batch)
    binding = rt.binding(0)
    scale = binding.scale

    def plugin_fn():
        binding.forward(q, k, v, out=out)

    if backend == plugin.VARLEN:
        info, _ = kernels.probe_varlen_attn()
        cu, mx = batch.query_start_loc, batch.max_query_len
        window = kernels.flash_window(causal, None)

        def direct_fn():
            if info.window:
                info.fn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=window)
            else:
                info.fn(q, k, v, cu, cu, mx, mx, scale=scale, is_causal=causal)

    else:
        runs = kernels.equal_length_runs(np.asarray(batch.query_start_loc_cpu))
        prepared = []
        for start, length, count in runs:
            rows = slice(start, start + length * count)
            prepared.append(
                tuple(t[rows].unflatten(0, (-1, length)).transpose(1, 2).contiguous()
                      for t in (q, k, v))
            )  # fmt: skip

        def direct_fn():
            for qs, ks, vs in prepared:
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)

    plugin_fn()
    us_plugin = bench_util.cuda_time_us(plugin_fn, args.iters, args.warmup)
    us_direct = bench_util.cuda_time_us(direct_fn, args.iters, args.warmup)
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    flops = 4 * heads * head_dim * pairs
    return {
        "backend": f"varlen:{backend}",
        "case": name,
        "sequences": len(lengths),
        "tokens": total,
        "plugin_us": round(us_plugin, 2),
        "direct_us": round(us_direct, 2),
        "ratio_plugin_over_direct": round(us_plugin / us_direct, 3),
        "plugin_tflops": round(flops / us_plugin / 1e6, 1),
        "direct_tflops": round(flops / us_direct / 1e6, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help=f"only {sorted(QUICK)}")
    args = ap.parse_args()
    result = bench_util.new_result()
    if not torch.cuda.is_available():
        result["errors"].append({"case": "*", "error": "CUDA is not available"})
    else:
        bench_util.record_device(result)
        backends = [plugin.SDPA]
        info, missing = kernels.probe_varlen_attn()
        if info is not None:
            backends.insert(0, plugin.VARLEN)
        else:
            result["errors"].append({"case": "varlen:varlen", "error": missing})
        for case in CASES:
            if args.quick and case[0] not in QUICK:
                continue
            for backend in backends:
                bench_util.run_case(result, f"{backend}/{case[0]}", run_case, backend, *case, args)
    return bench_util.write_result(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
