"""Benchmark the triton_ssm kernels on a CUDA GPU; prints a table and writes JSON (--out).

Sections (each guarded: a failure is recorded in the JSON and the run goes on):

* copy: ``torch.clone`` of a 1 GiB tensor, GB/s of read + write (the HBM ceiling to compare with).
* gdn_decode: B = 64, 256, 1024, 2048, Hk=16, Hv=32, Dk=Dv=128, fp32 state; GB/s of state read +
  write for our kernel (a few block_v choices) and for fla ``fused_recurrent_gated_delta_rule``
  (its errors are caught and reported), and the ratio to copy bandwidth.
* gdn_prefill: T = 8192 and 32768 as one request and as 16 requests (cu_seqlens), our wrapper
  vs fla ``chunk_gated_delta_rule`` called directly; ms and tokens/s.
* mamba2_decode: B = 64..2048, H=128, N=128, P=64 (Mamba2-2.7B-like), fp32 state, GB/s.
* plugin: the same step through the attn-core plugin (``AttentionRuntime`` binding ->
  ``TritonSSMContext``) vs the bare kernel on the same tensors: ``gdn_decode`` at B = 64 / 256
  and ``gdn_prefill`` at T = 8192 (one request); ``overhead_pct`` (target: within 3 %).

Timing: ``triton.testing.do_bench`` (warmup, median over repetitions). The decode kernels write
the state in place, so every timed call starts from the previous call's state; the traffic is
the same.

Usage: ``python bench/bench_ssm.py --out results.json [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[3]))  # attn_core from a checkout

HK, HV, D = 16, 32, 128
GB = 1e9


def _bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn()``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _guard(results: list, section: str, params: dict, fn) -> dict:
    row = {"section": section, **params}
    try:
        row.update(fn())
    except Exception as e:  # a failing provider is a result, not the end of the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        row["traceback"] = traceback.format_exc(limit=3)
        torch.cuda.synchronize()
    results.append(row)
    shown = {k: v for k, v in row.items() if k != "traceback"}
    print(json.dumps(shown), flush=True)
    return row


def bench_copy() -> dict:
    x = torch.empty(2**30 // 4, dtype=torch.float32, device="cuda").uniform_()
    ms = _bench(lambda: x.clone())
    return {"ms": ms, "GBps": 2 * x.numel() * 4 / (ms * 1e-3) / GB}


def _decode_inputs(B: int, S: int):
    q = torch.randn(B, HK, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HV, D, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(B, HV, device="cuda") * 0.1
    beta = torch.rand(B, HV, device="cuda")
    state = torch.randn(S, HV, D, D, device="cuda") * 0.01
    idx = torch.randperm(S, device="cuda")[:B].int()
    return q, k, v, g, beta, state, idx


def bench_gdn_decode_ours(B: int, block_v: int | None, num_warps: int | None) -> dict:
    from attn_plugin_triton_ssm.kernels import gdn_decode

    q, k, v, g, beta, state, idx = _decode_inputs(B, B + 8)
    out = torch.empty_like(v)
    ms = _bench(
        lambda: gdn_decode(q, k, v, g, beta, state, idx, out=out, block_v=block_v,
                           num_warps=num_warps)
    )  # fmt: skip
    nbytes = 2 * B * HV * D * D * 4
    return {"ms": ms, "GBps": nbytes / (ms * 1e-3) / GB}


def bench_gdn_decode_fla(B: int) -> dict:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, g, beta, state, idx = _decode_inputs(B, B + 8)
    h0 = state[idx.long()].contiguous()  # fla takes one dense state per request

    def run():
        return fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    run()
    torch.cuda.synchronize()
    ms = _bench(run)
    nbytes = 2 * B * HV * D * D * 4
    return {"ms": ms, "GBps": nbytes / (ms * 1e-3) / GB, "note": "dense h0, no slot gather"}


def _prefill_inputs(T: int, n_seq: int):
    q = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, HV, D, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(T, HV, device="cuda")) * 0.1
    beta = torch.rand(T, HV, device="cuda", dtype=torch.bfloat16)
    bounds = torch.linspace(0, T, n_seq + 1).round().long()
    cu = bounds.to("cuda", torch.int32)
    state = torch.randn(n_seq + 4, HV, D, D, device="cuda") * 0.01
    idx = torch.arange(n_seq, device="cuda", dtype=torch.int32) + 2
    return q, k, v, g, beta, state, idx, cu


def bench_prefill_ours(T: int, n_seq: int) -> dict:
    from attn_plugin_triton_ssm.kernels import gdn_prefill

    q, k, v, g, beta, state, idx, cu = _prefill_inputs(T, n_seq)
    ms = _bench(lambda: gdn_prefill(q, k, v, g, beta, state, idx, cu), warmup=5, rep=30)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


def bench_prefill_fla(T: int, n_seq: int) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, state, idx, cu = _prefill_inputs(T, n_seq)
    h0 = state[idx.long()].contiguous()
    cu64 = cu.long()

    def run():
        return chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu64,
        )  # fmt: skip

    ms = _bench(run, warmup=5, rep=30)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


def bench_mamba2_decode(B: int, H=128, G=1, N=128, P=64) -> dict:
    from attn_plugin_triton_ssm.kernels import mamba2_decode

    S = B + 8
    x = torch.randn(B, H, P, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
    A_log = torch.randn(H, device="cuda")
    Bm = torch.randn(B, G, N, device="cuda", dtype=torch.bfloat16)
    Cm = torch.randn(B, G, N, device="cuda", dtype=torch.bfloat16)
    Dp, dt_bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    state = torch.randn(S, H, N, P, device="cuda") * 0.01
    idx = torch.randperm(S, device="cuda")[:B].int()
    out = torch.empty_like(x)
    ms = _bench(
        lambda: mamba2_decode(x, dt, A_log, Bm, Cm, state, idx, D=Dp, dt_bias=dt_bias, out=out)
    )
    return {"ms": ms, "GBps": 2 * B * H * N * P * 4 / (ms * 1e-3) / GB}


def _plugin_lane(B: int, T: int):
    """A one-layer Qwen3-Next-like GDN group through the real plugin and runtime, B requests."""
    from attn_plugin_triton_ssm import plugin

    from attn_core.batch import BatchBuilder
    from attn_core.registry import Registry
    from attn_core.runtime import AttentionRuntime
    from attn_core.selector import select
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers
    from attn_core.state import PersistentState

    spec = LayerSpec(
        kind="linear", linear_variant="gated_deltanet", num_heads=HV, num_kv_heads=HK,
        head_dim=D, head_dim_v=D, conv_kernel_size=4, conv_channels=2 * HK * D + HV * D,
        dtype="bfloat16", qk_l2norm=True,
    )  # fmt: skip
    registry = Registry()
    registry.register_plugin(plugin, name="triton_ssm")
    groups = group_layers([spec])
    constraints = ExecutionConstraints(max_batch_size=max(B, 8), max_num_tokens=max(T, B))
    plan = select(groups, registry, DeviceCapabilities.detect("cuda"), constraints)
    state = PersistentState(groups, num_pages=1, num_slots=B + 4, device="cuda")
    runtime = AttentionRuntime(plan, registry, state=state, device="cuda")
    builder = BatchBuilder(state, max_batch_size=max(B, 8), max_num_tokens=max(T, B),
                           device="cuda")  # fmt: skip
    for r in range(B):
        state.add_request(r)
    return runtime, builder, state.state_slots.layer(0).ssm


def _alternate(fn_a, fn_b, rounds=3, **kw) -> tuple[float, float]:
    """Best-of-rounds medians of two functions timed alternately (cancels clock drift)."""
    a = b = float("inf")
    for _ in range(rounds):
        a = min(a, _bench(fn_a, **kw))
        b = min(b, _bench(fn_b, **kw))
    return a, b


def bench_plugin_decode(B: int) -> dict:
    from attn_plugin_triton_ssm.kernels import gdn_decode

    runtime, builder, ssm = _plugin_lane(B, 1)
    batch = builder.build([(r, 1) for r in range(B)])
    runtime.prepare(batch)
    binding = runtime.binding(0)
    q, k, v, g, beta, _, _ = _decode_inputs(B, 1)
    out = torch.empty_like(v)
    idx = batch.state_indices
    plugin_ms, bare_ms = _alternate(
        lambda: binding.forward(q, k, v, out=out, g=g, beta=beta),
        lambda: gdn_decode(q, k, v, g, beta, ssm, idx, scale=binding.scale, use_qk_l2norm=True,
                           out=out),
    )  # fmt: skip
    nbytes = 2 * B * HV * D * D * 4
    return {"ms": plugin_ms, "bare_ms": bare_ms, "GBps": nbytes / (plugin_ms * 1e-3) / GB,
            "overhead_pct": 100 * (plugin_ms / bare_ms - 1),
            "within_3pct": plugin_ms <= 1.03 * bare_ms}  # fmt: skip


def bench_plugin_prefill(T: int) -> dict:
    from attn_plugin_triton_ssm.kernels import gdn_prefill

    runtime, builder, ssm = _plugin_lane(1, T)
    batch = builder.build([(0, T)])
    runtime.prepare(batch)
    binding = runtime.binding(0)
    q, k, v, g, beta, _, _, _ = _prefill_inputs(T, 1)
    out = torch.empty_like(v)
    slots, cu = batch.state_indices[:1], batch.query_start_loc[:2]
    plugin_ms, bare_ms = _alternate(
        lambda: binding.forward(q, k, v, out=out, g=g, beta=beta),
        lambda: gdn_prefill(q, k, v, g, beta, ssm, slots, cu, scale=binding.scale,
                            use_qk_l2norm=True, out=out),
        warmup=5, rep=30,
    )  # fmt: skip
    prepare_ms = _bench(lambda: runtime.prepare(batch), warmup=5, rep=30)
    return {"ms": plugin_ms, "bare_ms": bare_ms, "Mtok_per_s": T / (plugin_ms * 1e-3) / 1e6,
            "prepare_ms": prepare_ms, "overhead_pct": 100 * (plugin_ms / bare_ms - 1),
            "within_3pct": plugin_ms <= 1.03 * bare_ms}  # fmt: skip


def _table(results: list) -> str:
    lines = []
    for r in results:
        head = ", ".join(
            f"{k}={r[k]}"
            for k in ("provider", "B", "T", "n_seq", "block_v")
            if r.get(k) is not None
        )
        if "error" in r:
            val = "ERROR " + r["error"]
        elif "GBps" in r:
            val = f"{r['ms']:.4f} ms  {r['GBps']:8.1f} GB/s"
            if "of_copy" in r:
                val += f"  ({r['of_copy']:.2f} x copy)"
        else:
            val = f"{r['ms']:.3f} ms  {r['Mtok_per_s']:.2f} Mtok/s"
        if "overhead_pct" in r:
            val += f"  (bare {r['bare_ms']:.4f} ms, plugin {r['overhead_pct']:+.1f} %)"
        lines.append(f"{r['section']:<14} {head:<48} {val}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ssm: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fla
    import triton

    results: list[dict] = []
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": getattr(fla, "__version__", "?"),
    }
    print(json.dumps(meta), flush=True)
    copy = _guard(results, "copy", {"provider": "torch.clone 1GiB"}, bench_copy)
    copy_bw = copy.get("GBps")

    batches = [64, 1024] if args.quick else [64, 256, 1024, 2048]
    for B in batches:
        for bv, nw in ((None, None), (16, 4), (32, 4), (64, 8)):
            row = _guard(
                results, "gdn_decode", {"provider": "ours", "B": B, "block_v": bv or "auto",
                                        "num_warps": nw or "auto"},
                lambda B=B, bv=bv, nw=nw: bench_gdn_decode_ours(B, bv, nw),
            )  # fmt: skip
            if copy_bw and "GBps" in row:
                row["of_copy"] = row["GBps"] / copy_bw
        row = _guard(results, "gdn_decode", {"provider": "fla fused_recurrent", "B": B},
                     lambda B=B: bench_gdn_decode_fla(B))  # fmt: skip
        if copy_bw and "GBps" in row:
            row["of_copy"] = row["GBps"] / copy_bw

    for T in [8192] if args.quick else [8192, 32768]:
        for n_seq in (1, 16):
            p = {"T": T, "n_seq": n_seq}
            _guard(results, "gdn_prefill", {"provider": "ours (gdn_prefill)", **p},
                   lambda T=T, n=n_seq: bench_prefill_ours(T, n))  # fmt: skip
            _guard(results, "gdn_prefill", {"provider": "fla chunk direct", **p},
                   lambda T=T, n=n_seq: bench_prefill_fla(T, n))  # fmt: skip

    for B in batches:
        row = _guard(results, "mamba2_decode", {"provider": "ours", "B": B},
                     lambda B=B: bench_mamba2_decode(B))  # fmt: skip
        if copy_bw and "GBps" in row:
            row["of_copy"] = row["GBps"] / copy_bw

    for B in (64, 256):
        _guard(results, "plugin", {"provider": "binding.forward vs gdn_decode", "B": B},
               lambda B=B: bench_plugin_decode(B))  # fmt: skip
    _guard(results, "plugin", {"provider": "binding.forward vs gdn_prefill", "T": 8192,
                               "n_seq": 1}, lambda: bench_plugin_prefill(8192))  # fmt: skip

    print("\n" + _table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
