"""The paged KV write on CUDA: two torch ``write_slots`` against the one-launch Triton writer.

Cases (times from CUDA events; each case first checks that both writers store the same bytes):

1. Decode, B = 1 and B = 64 tokens of 8 KV heads x 128, bf16, page 16, with padding possible
   (``may_have_padding=True``, so the torch path runs its redirect; the last token of B = 64 is
   padding):

   - eager: one K+V write per call, host launch cost included (what an uncaptured step pays);
   - graph: a 32-layer step (32 layers' caches) captured in one CUDA graph, time per layer.

2. Prefill: 16384 tokens of 16 heads x 128 bf16 into a bf16 cache, and into an fp8 cache with a
   scale tensor; us, GB/s (bytes read + written, slots included) and the ratio to a 1 GiB
   device-to-device copy timed in the same run (its GB/s counts the read and the write).

Usage::

    python bench/bench_kv_write.py [--iters 200] [--layers 32] [--out result.json] [--sweep]

``--sweep`` instead times the Triton writer's prefill tilings (for tuning ``_config``).

Needs a CUDA device (exits 2 without one).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attn_core.bench_util import back_to_back_us, capture_graph  # noqa: E402
from attn_core.state import kv_write_triton  # noqa: E402
from attn_core.state.kv_write import (  # noqa: E402
    FP8_DTYPE,
    write_kv_slots,
    write_slots_torch,
)

PAGE = 16
DECODE_HEADS, PREFILL_HEADS, HEAD_DIM = 8, 16, 128
DECODE_BATCHES = (1, 64)
PREFILL_TOKENS = 16384


class _Layer:
    """One layer's K/V caches (``[pages, PAGE, heads, HEAD_DIM]``) and its scales."""

    def __init__(self, pages: int, heads: int, dtype: torch.dtype) -> None:
        shape = (pages, PAGE, heads, HEAD_DIM)
        self.k = torch.zeros(shape, device="cuda").to(dtype)
        self.v = torch.zeros(shape, device="cuda").to(dtype)
        fp8 = dtype == FP8_DTYPE
        self.k_scale = torch.tensor(0.5, device="cuda") if fp8 else None
        self.v_scale = torch.tensor(2.0, device="cuda") if fp8 else None

    def torch_write(self, k, v, slots) -> None:
        write_slots_torch(k, self.k, slots, self.k_scale)
        write_slots_torch(v, self.v, slots, self.v_scale)

    def fused_write(self, k, v, slots) -> None:
        write_kv_slots(k, v, self.k, self.v, slots, self.k_scale, self.v_scale)


def _inputs(T: int, heads: int, pages: int, pad_last: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(T)
    k = torch.randn(T, heads, HEAD_DIM, device="cuda", generator=g).bfloat16()
    v = torch.randn(T, heads, HEAD_DIM, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(pages * PAGE, device="cuda", generator=g)[:T]
    if pad_last and T > 1:
        slots[-1] = -1
    return k, v, slots


def _check_same(layer_dtype: torch.dtype, pages: int, heads: int, k, v, slots) -> None:
    """Both writers store identical bytes for these inputs (else the timing means nothing)."""
    a, b = _Layer(pages, heads, layer_dtype), _Layer(pages, heads, layer_dtype)
    a.torch_write(k, v, slots)
    b.fused_write(k, v, slots)
    for x, y in ((a.k, b.k), (a.v, b.v)):
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            raise SystemExit(f"the writers disagree ({layer_dtype}, T={k.shape[0]})")


def bench_decode(batch: int, layers: int, iters: int) -> dict:
    pages = max(256, 4 * batch)
    k, v, slots = _inputs(batch, DECODE_HEADS, pages, pad_last=True)
    _check_same(torch.bfloat16, pages, DECODE_HEADS, k, v, slots)
    caches = [_Layer(pages, DECODE_HEADS, torch.bfloat16) for _ in range(layers)]
    row = {"case": f"decode B={batch}", "T": batch}
    for name in ("torch", "fused"):
        one = getattr(caches[0], f"{name}_write")

        def eager(one: Callable[..., None] = one) -> None:
            one(k, v, slots)

        row[f"{name}_eager_us"] = back_to_back_us(eager, iters)
        writes = [getattr(c, f"{name}_write") for c in caches]

        def step(writes=writes) -> None:
            for w in writes:
                w(k, v, slots)

        graph = capture_graph(step)
        row[f"{name}_graph_us_per_layer"] = (
            back_to_back_us(graph.replay, max(iters // 4, 20)) / layers
        )
    # An uncaptured step without padding: the torch writer is one index_copy_ per tensor, the
    # fused one a Triton launch; eager time here is host launch cost, which decides which of the
    # two an eager decode step should take.
    real = slots.clone()
    real[-1] = pages * PAGE - 1
    lay = caches[0]

    def torch_no_pad() -> None:
        write_slots_torch(k, lay.k, real, may_have_padding=False)
        write_slots_torch(v, lay.v, real, may_have_padding=False)

    row["torch_nopad_eager_us"] = back_to_back_us(torch_no_pad, iters)
    row["fused_nopad_eager_us"] = back_to_back_us(
        lambda: kv_write_triton.launch((k, v), (lay.k, lay.v), (None, None), real, len(real)),
        iters,
    )
    # what write_kv_slots does with such a step (it picks by EAGER_TORCH_MAX_TOKENS)
    row["dispatch_nopad_eager_us"] = back_to_back_us(
        lambda: write_kv_slots(k, v, lay.k, lay.v, real, may_have_padding=False), iters
    )
    return row


def bench_prefill(dtype: torch.dtype, iters: int, copy_gbs: float) -> dict:
    T, heads = PREFILL_TOKENS, PREFILL_HEADS
    pages = T // PAGE + 64
    k, v, slots = _inputs(T, heads, pages, pad_last=False)
    _check_same(dtype, pages, heads, k, v, slots)
    layer = _Layer(pages, heads, dtype)
    out_bytes = torch.empty((), dtype=dtype).element_size()
    moved = 2 * T * heads * HEAD_DIM * (k.element_size() + out_bytes) + T * slots.element_size()
    row = {"case": f"prefill T={T} into {str(dtype).removeprefix('torch.')}", "T": T}
    for name in ("torch", "fused"):
        write = getattr(layer, f"{name}_write")

        def call(write: Callable[..., None] = write) -> None:
            write(k, v, slots)

        us = back_to_back_us(call, iters)
        gbs = moved / us / 1e3
        row[f"{name}_us"] = us
        row[f"{name}_GB/s"] = gbs
        row[f"{name}_of_copy"] = gbs / copy_gbs
    return row


def sweep_prefill(iters: int, copy_gbs: float, rounds: int = 5) -> list[dict]:
    """The Triton writer's ``(BLOCK_T, BLOCK_R, num_warps)`` against its own choice, for
    16384-token bf16 prefills of 8 and 16 KV heads, with slots in page order (a prefill's) and
    shuffled: each configuration timed in ``rounds`` interleaved rounds (best and median kept,
    so that drift hits every configuration alike); GB/s and the fraction of copy bandwidth."""
    rows = []
    T = PREFILL_TOKENS
    candidates = [
        (bt, br, nw)
        for bt, br in ((4, 1024), (8, 512), (16, 512), (8, 1024), (16, 1024), (8, 2048))
        for nw in (4, 8)
    ]
    for heads in (8, 16):
        row_elems = heads * HEAD_DIM
        pages = T // PAGE + 64
        k, v, shuffled = _inputs(T, heads, pages, pad_last=False)
        ordered = torch.arange(T, device="cuda") + 3 * PAGE  # page-aligned, consecutive
        lay = _Layer(pages, heads, torch.bfloat16)
        moved = 2 * T * row_elems * 2 * 2 + T * 8
        configs = [None] + [c for c in candidates if c[1] <= row_elems]
        for slots_name, slots in (("page order", ordered), ("shuffled", shuffled)):
            times: dict = {cfg: [] for cfg in configs}
            for _ in range(rounds):
                for cfg in configs:

                    def run(cfg=cfg, slots=slots, k=k, v=v, lay=lay) -> None:
                        kv_write_triton.launch((k, v), (lay.k, lay.v), (None, None), slots, T, cfg)

                    times[cfg].append(back_to_back_us(run, iters))
            for cfg, ts in times.items():
                best = min(ts)
                rows.append(
                    {
                        "heads": heads,
                        "slots": slots_name,
                        "config": cfg or "default",
                        "us": best,
                        "median_us": sorted(ts)[len(ts) // 2],
                        "GB/s": moved / best / 1e3,
                        "of_copy": moved / best / 1e3 / copy_gbs,
                    }
                )
    return rows


def bench_copy(iters: int) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = back_to_back_us(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / us / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--layers", type=int, default=32, help="layers in the decode graph")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--sweep", action="store_true", help="only sweep the Triton writer's prefill tiling"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_write: needs a CUDA device", file=sys.stderr)
        return 2

    copy_gbs = bench_copy(max(args.iters // 10, 10))
    print(f"{torch.cuda.get_device_name()}: 1 GiB device copy {copy_gbs:.0f} GB/s (read+write)")
    if args.sweep:
        rows = sweep_prefill(max(args.iters // 4, 20), copy_gbs)
        print(f"prefill T={PREFILL_TOKENS} bf16 K+V: (BLOCK_T, BLOCK_R, num_warps)")
        for r in sorted(rows, key=lambda r: (r["heads"], r["slots"], r["us"])):
            print(
                f"  {r['heads']:>2} heads, {r['slots']:<10} {r['config']!s:<16}"
                f"{r['us']:>8.1f} us (median {r['median_us']:>6.1f}) {r['GB/s']:>6.0f} GB/s"
                f" {r['of_copy']:>5.0%} of copy"
            )
        if args.out:
            args.out.write_text(json.dumps({"copy_GB/s": copy_gbs, "sweep": rows}, indent=2))
        return 0
    decode = [bench_decode(b, args.layers, args.iters) for b in DECODE_BATCHES]
    print(f"\ndecode, {DECODE_HEADS} kv heads x {HEAD_DIM} bf16, page {PAGE}, padding possible")
    print(f"{'case':<14}{'torch x2 eager':>16}{'fused eager':>13}{'torch x2 graph':>16}"
          f"{'fused graph':>13}{'graph speed-up':>16}")  # fmt: skip
    for r in decode:
        print(
            f"{r['case']:<14}{r['torch_eager_us']:>13.1f} us{r['fused_eager_us']:>10.1f} us"
            f"{r['torch_graph_us_per_layer']:>13.2f} us{r['fused_graph_us_per_layer']:>10.2f} us"
            f"{r['torch_graph_us_per_layer'] / r['fused_graph_us_per_layer']:>15.1f}x"
        )
    print("(graph: per layer of a captured step of --layers layers)")
    for r in decode:
        print(
            f"{r['case']}, no padding, eager: torch x2 {r['torch_nopad_eager_us']:.1f} us, "
            f"fused {r['fused_nopad_eager_us']:.1f} us (host launch cost); write_kv_slots "
            f"{r['dispatch_nopad_eager_us']:.1f} us"
        )
    prefill = [bench_prefill(d, max(args.iters // 4, 20), copy_gbs)
               for d in (torch.bfloat16, FP8_DTYPE)]  # fmt: skip
    print(f"\nprefill, {PREFILL_HEADS} heads x {HEAD_DIM} bf16 K and V")
    for r in prefill:
        print(f"{r['case']}")
        for name in ("torch", "fused"):
            print(
                f"  {name + (' x2' if name == 'torch' else ''):<10}{r[f'{name}_us']:>9.1f} us"
                f"{r[f'{name}_GB/s']:>8.0f} GB/s  {r[f'{name}_of_copy']:.0%} of copy"
            )
    if args.out:
        result = {"copy_GB/s": copy_gbs, "decode": decode, "prefill": prefill}
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
