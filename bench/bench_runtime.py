"""Hot-path host timings of the core: batch building, prepare, and per-layer dispatch.

1. ``BatchBuilder.build`` + ``runtime.prepare`` per decode step for B = 1, 64, 256 requests of a
   hybrid model (one full-attention group, one Gated DeltaNet group; the reference backend,
   whose prepare only records the batch, so the time is the core's). Requests start with 100
   cached tokens and grow by one per step, so pages keep appearing. Target: < 100 us at B=256.
2. Dispatch overhead per layer: ``binding.forward(q, k, v, out=out)`` against the context's own
   ``forward`` called directly, with a trivial backend whose forward returns ``out`` at once.
   Target: < 2 us.

Usage::

    python bench/bench_runtime.py [--device cpu|cuda] [--steps 200] [--out result.json]
                                  [--profile]   # cProfile of build() at B=256
                                  [--count-calls]  # CUDA runtime calls (CPU: torch ops) per step
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attn_core.reference.plugin as reference  # noqa: E402
from attn_core.backend import Backend, BackendCapabilities  # noqa: E402
from attn_core.batch import BatchBuilder  # noqa: E402
from attn_core.bench_util import profile_table  # noqa: E402
from attn_core.hookspecs import hookimpl  # noqa: E402
from attn_core.registry import Registry  # noqa: E402
from attn_core.runtime import AttentionRuntime  # noqa: E402
from attn_core.selector import select  # noqa: E402
from attn_core.specs import (  # noqa: E402
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    group_layers,
)
from attn_core.state import PersistentState  # noqa: E402

BATCHES = (1, 64, 256)
CONTEXT = 100
PAGE = 16

FULL = LayerSpec(kind="full", num_heads=4, num_kv_heads=1, head_dim=64, page_size=PAGE)
GDN = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    conv_kernel_size=4,
    conv_channels=256,
    qk_l2norm=True,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_calls(device: torch.device, step, steps: int) -> dict[str, float]:
    """Calls per ``step()`` seen by the torch profiler: CUDA runtime / driver API calls on a
    CUDA device (each costs host time: copies, kernel launches, event records), top-level torch
    ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    counts: dict[str, int] = {}
    for ev in prof.events():
        name = ev.name
        if device.type == "cuda":
            keep = name.startswith("cu") and name not in ("cudaDeviceSynchronize",)
        else:
            keep = name.startswith("aten::") and ev.cpu_parent is None
        if keep:
            counts[name] = counts.get(name, 0) + 1
    return {k: v / steps for k, v in sorted(counts.items())}


def bench_build_prepare(
    device: torch.device,
    steps: int,
    profile: bool,
    count_calls: bool = False,
    staggered: bool = False,
) -> tuple[list, str]:
    """Host time of build + prepare per decode step. ``staggered``: request ``i`` starts with
    ``CONTEXT + i % PAGE`` tokens, so every step about ``B / PAGE`` requests cross into a new
    page (what a server sees); otherwise all cross together, once every ``PAGE`` steps."""
    rows, report = [], ""
    registry = Registry(strict=True)
    registry.register_plugin(reference, name="attn_core")
    specs = [GDN, GDN, GDN, FULL] * 2
    groups = group_layers(specs)
    max_b = max(BATCHES)
    constraints = ExecutionConstraints(
        max_batch_size=max_b, max_num_tokens=4 * max_b, downgrade="allow"
    )
    plan = select(groups, registry, DeviceCapabilities.detect(device), constraints)
    # warm-up, timed, counted and profiled steps
    pages_per_req = -(-(CONTEXT + 2 * steps + 5 + 32 + 16) // PAGE)
    for B in BATCHES:
        state = PersistentState(
            groups, num_pages=B * pages_per_req + 8, num_slots=B + 1, device=device
        )
        runtime = AttentionRuntime(plan, registry, state=state, device=device)
        builder = BatchBuilder(
            state,
            max_batch_size=max_b,
            max_num_tokens=4 * max_b,
            max_pages_per_request=pages_per_req,
            device=device,
        )
        reqs = [(f"r{i}", 1) for i in range(B)]
        for r, _ in reqs:
            state.add_request(r)
            n = CONTEXT + (int(r[1:]) % PAGE if staggered else 0)
            state.ensure_capacity(r, n)
            state.advance(r, n)
        for _ in range(5):  # warm-up (first sight of every page-table row)
            runtime.prepare(builder.build(reqs))
        _sync(device)
        build_t, prep_t = [], []
        for _ in range(steps):
            for r, _ in reqs:
                state.advance(r, 1)
            t0 = time.perf_counter()
            batch = builder.build(reqs)
            t1 = time.perf_counter()
            runtime.prepare(batch)
            t2 = time.perf_counter()
            build_t.append(t1 - t0)
            prep_t.append(t2 - t1)
        _sync(device)
        total = [a + b for a, b in zip(build_t, prep_t, strict=True)]
        rows.append(
            {
                "batch": B,
                "build_us": statistics.median(build_t) * 1e6,
                "prepare_us": statistics.median(prep_t) * 1e6,
                "total_us": statistics.median(total) * 1e6,
                "total_p90_us": sorted(total)[int(0.9 * len(total))] * 1e6,
                # how many builds took the steady-decode memo (warm-up included)
                "steady_builds": builder.path_counts["steady"],
                "builds": sum(builder.path_counts.values()),
            }
        )
        if count_calls and (max_b == B or staggered):

            def one_step(reqs=reqs, state=state, runtime=runtime, builder=builder) -> None:
                for r, _ in reqs:
                    state.advance(r, 1)
                runtime.prepare(builder.build(reqs))

            calls = _count_calls(device, one_step, 32)
            what = "CUDA API calls" if device.type == "cuda" else "top-level torch ops"
            how = "staggered contexts" if staggered else "page crossings included"
            report += f"{what} per decode step at B={B} (32 steps, {how}):\n"
            report += "".join(f"  {k:<32}{v:8.2f}\n" for k, v in calls.items())
            report += f"  {'total':<32}{sum(calls.values()):8.2f}\n\n"
        if profile and (max_b == B or staggered):
            # Only build() under the profiler: the bench's own advance() calls stay outside.
            # Same-context runs profile the steps that cross no page boundary (the median
            # step); staggered runs every step (each has crossings).
            prof, profiled = cProfile.Profile(), 0
            for _ in range(steps):
                for r, _ in reqs:
                    state.advance(r, 1)
                if staggered or state.num_tokens(reqs[0][0]) % PAGE:
                    profiled += 1
                    prof.enable()
                builder.build(reqs)
                prof.disable()
            what = f"BatchBuilder.build at B={B}, " + (
                "staggered contexts" if staggered else "steps without a page crossing"
            )
            report += profile_table(prof, profiled, what)
    return rows, report


class _TrivialContext:
    def prepare(self, batch) -> None:
        self.batch = batch

    def update(self, batch) -> None:
        self.batch = batch

    def forward(self, layer, q, k, v, out, **inputs):
        return out


def _trivial_plugin() -> types.ModuleType:
    mod = types.ModuleType("trivial")
    # the module's namespace written directly: ModuleType declares none of these attributes
    mod.__dict__["ATTN_CORE_API_VERSION"] = "1.1"
    caps = BackendCapabilities(
        kinds={"full"}, device_types={"cpu", "cuda"}, dtypes={"bfloat16", "float32"}
    )

    def register(register):
        register(Backend(name="noop", capabilities=caps, priority=1000))

    def allocate(backend, group, device, constraints, state, workspace):
        return _TrivialContext()

    mod.__dict__["attn_core_register_backends"] = hookimpl(register)
    mod.__dict__["attn_core_allocate_context"] = hookimpl(allocate)
    return mod


def bench_dispatch(device: torch.device, calls: int) -> dict:
    registry = Registry(strict=True)
    registry.register_plugin(_trivial_plugin(), name="trivial")
    spec = FULL.with_(dtype="float32")
    groups = group_layers([spec])
    plan = select(groups, registry, DeviceCapabilities.detect(device), ExecutionConstraints())
    state = PersistentState(groups, num_pages=64, num_slots=0, device=device)
    runtime = AttentionRuntime(plan, registry, state=state, device=device)
    builder = BatchBuilder(
        state, max_batch_size=8, max_num_tokens=64, max_pages_per_request=8, device=device
    )
    reqs = [(f"r{i}", 1) for i in range(8)]
    for r, _ in reqs:
        state.add_request(r)
    batch = builder.build(reqs)
    runtime.prepare(batch)
    binding = runtime.binding(0)
    ctx = runtime.groups[binding.group_id].context
    T = batch.padded_tokens
    q = torch.zeros(T, spec.num_heads, spec.head_dim, device=device)
    k = torch.zeros(T, spec.num_kv_heads, spec.head_dim, device=device)
    v = torch.zeros_like(k)
    out = torch.zeros_like(q)
    fwd = binding.forward
    direct = ctx.forward

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(5):  # best of 5 repetitions: the overhead, not the machine's noise
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    t_binding = timed(lambda: fwd(q, k, v, out=out))
    t_direct = timed(lambda: direct(binding, q, k, v, out))
    t_empty = timed(lambda: None)
    return {
        "calls": calls,
        "binding_forward_us": t_binding * 1e6,
        "direct_forward_us": t_direct * 1e6,
        "loop_and_lambda_us": t_empty * 1e6,
        "overhead_us": (t_binding - t_direct) * 1e6,
        "target_us": 2.0,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true", help="cProfile build() at B=256")
    parser.add_argument(
        "--count-calls", action="store_true", help="CUDA calls (CPU: torch ops) per step, B=256"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")

    rows, _ = bench_build_prepare(device, args.steps, profile=False)
    staggered, _ = bench_build_prepare(device, args.steps, profile=False, staggered=True)
    over = rows[-1]["build_us"] + rows[-1]["prepare_us"] > 100.0
    report = ""
    if args.profile or over or args.count_calls:
        _, report = bench_build_prepare(
            device, args.steps, profile=args.profile or over, count_calls=args.count_calls
        )
    if args.profile:  # where a staggered step's time goes
        _, more = bench_build_prepare(
            device, args.steps, profile=True, count_calls=args.count_calls, staggered=True
        )
        report += more
    dispatch = bench_dispatch(device, args.calls)

    print(f"device: {device} ({DeviceCapabilities.detect(device).short()})")
    print(f"decode step, {CONTEXT}+ cached tokens, page {PAGE}, groups: full + linear")
    for title, table in (
        ("same context everywhere: all requests cross a page together, 1 step in 16", rows),
        (f"staggered contexts: ~B/{PAGE} requests cross a page every step", staggered),
    ):
        print(title)
        print(f"{'B':>5}{'build us':>11}{'prepare us':>12}{'total us':>10}{'p90 us':>9}", end="")
        print(f"{'target':>8}{'memo steps':>12}")
        for r in table:
            target = "100" if r["batch"] == 256 else "-"
            print(
                f"{r['batch']:>5}{r['build_us']:>11.1f}{r['prepare_us']:>12.1f}"
                f"{r['total_us']:>10.1f}{r['total_p90_us']:>9.1f}{target:>8}"
                f"{r['steady_builds']:>6}/{r['builds']}"
            )
    print()
    print(f"{'per-layer call':<34}{'us':>8}")
    print(f"{'binding.forward (trivial backend)':<34}{dispatch['binding_forward_us']:>8.3f}")
    print(f"{'context.forward directly':<34}{dispatch['direct_forward_us']:>8.3f}")
    print(f"{'overhead (target < 2 us)':<34}{dispatch['overhead_us']:>8.3f}")
    if report:
        print()
        print(report)
    result = {
        "device": str(device),
        "build_prepare": rows,
        "build_prepare_staggered": staggered,
        "dispatch": dispatch,
    }
    if report:
        result["profile"] = report
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
