"""Decode tilings of every triton_ssm variant against copy bandwidth, at B >= 256.

For each variant and batch (B = 256, 1024, 2048; fp32 state in a pool of B + 8 slots, random
slot order) every tiling of the variant's grid is timed beside a copy (``copy_`` into a buffer
made once) of the same number of state bytes, in ``--rounds`` alternating rounds in one
process; a config's figure is the median over rounds of ``copy time / kernel time`` (state read
+ write against a copy that reads and writes as many bytes). The table gives, per variant and
B, the default tiling's ratio and the best config's; the JSON keeps every row. Each row also
gives ``ratio_all``, the same time over every byte the step moves (the state plus the token's
inputs and outputs, which Mamba1's step reads and writes 5 % beside its state), and
``ratio_to_inplace``: against an in-place elementwise pass over as many bytes (``mul_(1.0)``,
torch's vectorised kernel), which reads and writes the same addresses as a state update does,
where a copy writes elsewhere.

Variants (shapes of the models that use them):

* ``gdn``: Qwen3-Next, Hk=16, Hv=32, Dk=Dv=128 (``gdn_decode``: block_v, num_warps,
  programs_per_sm, and the default tiling writing its states to other slots,
  ``out_of_place``); ``kda``: the same heads with a per-channel gate (``kda_decode``).
* ``mamba2``: H=128, N=128, P=64 (``mamba2_decode``: block_p, num_warps, streaming).
* ``lightning``: MiniMax-Text-01, H=64, Dk=Dv=128, through ``mamba2_decode`` as the plugin
  calls it.
* ``mamba1``: Falcon-Mamba / Jamba, d_inner 8192, d_state 16 (``mamba1_decode``: block_d,
  num_warps, requests_per_program, cache_hints, pipeline, loads_first).
* ``short_conv``: LFM2-1.2B, 2048 channels, kernel 3, bf16 conv state (``causal_conv1d_update``:
  the packed kernel's block_c, requests_per_program, num_warps, and the general kernel's with
  ``packed_pairs=False``); bytes: conv state read + write plus the token in and out.
  ``gdn_conv``: the same kernel at Qwen3-Next's GDN conv, 8192 channels, kernel 4.

Each variant runs in its own subprocess, so a fault ends only that variant's row set. Inputs
and shapes are those of ``bench_ssm.py``'s decode rows (its ``*_decode_call`` builders).

The kernel is timed as CUDA-graph replays by default (how a server runs decode; a small state
such as the short conv's is otherwise timed as launch and host time), or as eager calls with
``--timing eager``; the copy both ways, the faster counts.

Usage: ``python bench_decode_sweep.py --out sweep.json [--variants mamba1,lightning]
[--batches 256,1024,2048] [--rounds 3] [--budget-s 330] [--timing graph|eager]
[--setting block_d]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# the shapes and inputs of bench_ssm.py's decode rows (this folder is on the path when either
# runs as a script)
from bench_ssm import (
    LIGHTNING_D,
    LIGHTNING_H,
    MAMBA1_D,
    MAMBA1_N,
    _decode_inputs,
    _state_bytes,
    lightning_decode_call,
    mamba1_decode_call,
    mamba2_decode_call,
    short_conv_decode_call,
)

VARIANTS = ("mamba1", "lightning", "mamba2", "gdn", "kda", "short_conv", "gdn_conv")
BATCHES = (256, 1024, 2048)


def _bench(fn: Callable[[], object], graph: bool, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of ``fn()``: replays of it captured in a CUDA graph (``graph``, how a
    server runs decode: no launch or host time, which decide small states such as the short
    conv's 8 KiB per request), else eager calls."""
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _grid(**axes: tuple) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*axes.values())]


def _tilings(run: Callable[..., object]) -> Callable[[dict], Callable[[], object]]:
    return lambda cfg: lambda: run(**cfg)


def _delta_case(B: int, kda: bool):
    import torch
    from attn_plugin_triton_ssm.kernels import gdn_decode, kda_decode

    # a pool of 2B + 8 slots: B read in random order, B others for the out-of-place rows
    q, k, v, g, beta, state, idx = _decode_inputs(B, 2 * B + 8, per_channel_g=kda)
    taken = torch.zeros(state.shape[0], dtype=torch.bool, device=idx.device)
    taken[idx.long()] = True
    free = (~taken).nonzero()[:, 0]
    out_idx = free[torch.randperm(free.numel(), device=free.device)[:B]].int()
    out = torch.empty_like(v)
    fn = kda_decode if kda else gdn_decode

    def run(out_of_place: bool = False, **tiling):
        # out of place: the new states go to other slots, as a copy writes elsewhere (an
        # in-place update reads and writes the same addresses)
        return fn(q, k, v, g, beta, state, idx, out=out,
                  state_indices_out=out_idx if out_of_place else None, **tiling)  # fmt: skip

    # 8 and 16 warps (cross-warp reductions) ran at 0.40-0.75 of copy, 128-wide blocks at
    # 0.60-0.75; loading two work items ahead, or leaving the loads to Triton's pipeliner,
    # measured the same as the default's one (0.91-0.93): the step is not short of loads in
    # flight
    # programs_per_sm 0 (the default): one program per item; 2: the persistent grid that fits
    # on an sm90 SM at 64-wide blocks and 4 warps
    tilings = _grid(block_v=(16, 32, 64), num_warps=(2, 4), programs_per_sm=(0, 2))
    configs = [{}, {"out_of_place": True}, *tilings]
    token_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta, out))
    return _tilings(run), configs, _state_bytes(B) // 2, token_bytes


#: Mamba2-2.7B-like decode heads (one B/C group), as ``mamba2_decode_call`` is called here
MAMBA2_H, MAMBA2_N, MAMBA2_P = 128, 128, 64


def _mamba2_case(B: int, lightning: bool):
    if lightning:
        run, half_bytes = lightning_decode_call(B)
        P = LIGHTNING_D
        # v in, o out, k and q (as B and C, one per head) [B, H, D] bf16; dt [B, H] float32
        token_bytes = B * (4 * LIGHTNING_H * LIGHTNING_D * 2 + LIGHTNING_H * 4)
    else:
        run, half_bytes = mamba2_decode_call(B, H=MAMBA2_H, N=MAMBA2_N, P=MAMBA2_P)
        P = MAMBA2_P
        # x in, y out [B, H, P] bf16; B and C [B, 1, N] bf16; dt [B, H] bf16
        token_bytes = B * (2 * MAMBA2_H * P * 2 + 2 * MAMBA2_N * 2 + MAMBA2_H * 2)
    blocks = (16, 32, 64, 128) if P >= 128 else (16, 32, 64)
    warps = (4, 8, 16) if P >= 128 else (2, 4, 8)
    grid = _grid(block_p=blocks, num_warps=warps, streaming=(False, True))
    return _tilings(run), [{}, {"streaming": True}, *grid], half_bytes, token_bytes


def _mamba1_case(B: int):
    run, half_bytes = mamba1_decode_call(B)
    # 32 and 256 channels per program, 8 warps, and 8 or 16 unrolled requests a program
    # (0.40-0.86 against the default's 0.85-0.87) lost everywhere in earlier sweeps, as did
    # 128 channels on 1 or 2 warps
    grid = _grid(block_d=(64,), num_warps=(1, 2), requests_per_program=(1, 2, 4),
                 cache_hints=(False, True))  # fmt: skip
    grid += _grid(block_d=(128,), num_warps=(4,), requests_per_program=(1, 4))
    # the requests as a software-pipelined loop: state tiles in flight in shared memory (a
    # tile in registers costs as many registers again: compiled for sm90, every unrolled
    # tiling holds about 64 KiB in flight an SM); 32 channels a warp, 120-134 registers
    for block_d, warps in ((32, 1), (64, 2)):
        grid += _grid(block_d=(block_d,), num_warps=(warps,), requests_per_program=(8, 16),
                      pipeline=(3, 4, 5))  # fmt: skip
        # every request's tile loaded before any is updated (94-159 registers)
        grid += _grid(block_d=(block_d,), num_warps=(warps,), requests_per_program=(2, 4),
                      loads_first=(True,))  # fmt: skip
    # x, dt in and y out [B, d_inner] bf16, B and C [B, d_state] bf16
    token_bytes = B * (3 * MAMBA1_D * 2 + 2 * MAMBA1_N * 2)
    return _tilings(run), [{}, {"cache_hints": True}, *grid], half_bytes, token_bytes


def _short_conv_case(B: int, C: int = 2048, K: int = 3):
    run, half_bytes = short_conv_decode_call(B, C, K)
    # the general kernel (two strided column loads and the weights per request); 8 requests a
    # program and blocks under 256 channels lost to these everywhere in earlier sweeps
    general = _grid(packed_pairs=(False,), block_c=(256, 1024), requests_per_program=(1, 4))
    configs = [{}, *general]
    if K == 3:  # the packed kernel-3 path: a channel's two state values moved as one word
        configs += _grid(block_c=(256, 512, 1024, 2048), requests_per_program=(1, 2, 4),
                         num_warps=(2, 4, 8))  # fmt: skip
    return _tilings(run), configs, half_bytes, 0  # half_bytes counts the token already


CASES: dict[str, Callable[[int], tuple]] = {
    "gdn": lambda B: _delta_case(B, kda=False),
    "kda": lambda B: _delta_case(B, kda=True),
    "mamba2": lambda B: _mamba2_case(B, lightning=False),
    "lightning": lambda B: _mamba2_case(B, lightning=True),
    "mamba1": _mamba1_case,
    "short_conv": _short_conv_case,
    # the conv in front of Qwen3-Next's GDN layers: q, k, v channels 2 * 16 * 128 + 32 * 128
    "gdn_conv": lambda B: _short_conv_case(B, C=8192, K=4),
}


def worker(
    variant: str,
    batches: list[int],
    rounds: int,
    deadline: float,
    graph: bool,
    setting: str | None = None,
) -> int:
    """Time one variant (``setting``: only the default tiling and the configs that set it).
    Prints one ``@@ROW`` JSON line per timed (B, config, round), and per config the kernel
    refused, as soon as it is known: a worker cut by its deadline or a fault keeps what it
    measured."""
    import torch

    def emit(row: dict) -> None:
        print("@@ROW " + json.dumps(row), flush=True)

    for B in batches:
        if time.time() > deadline:
            break
        make, configs, half_bytes, token_bytes = CASES[variant](B)
        if setting:
            configs = [c for c in configs if not c or setting in c]
        src = torch.empty(half_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
        # into a buffer made once: a clone inside the timed CUDA graph allocates from the
        # graph's pool on every call and ran at 2713 GB/s at 1 GiB (4250 eager), so ratios
        # against it read above 1
        dst = torch.empty_like(src)
        copy = functools.partial(dst.copy_, src)
        inplace = functools.partial(torch.empty_like(src).uniform_().mul_, 1.0)
        runs = []
        for cfg in configs:
            fn = make(cfg)
            try:
                fn()  # compile; a config the kernel refuses is recorded, not fatal
                torch.cuda.synchronize()
                runs.append((cfg, fn))
            except Exception as e:  # a tiling the kernel refuses is a result
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                emit({"variant": variant, "B": B, "config": cfg or "default", "error": error})
        for r in range(rounds):
            for cfg, fn in runs:
                if time.time() > deadline:
                    break
                # the faster of a replayed and an eager copy: large copies ran at 2760 GB/s as
                # graph replays against 4250 eager on the H200; small ones lose the launch
                copy_ms = min(_bench(copy, graph), _bench(copy, False))
                inplace_ms = min(_bench(inplace, graph), _bench(inplace, False))
                ms = _bench(fn, graph)
                emit({"variant": variant, "B": B, "config": cfg or "default", "round": r,
                      "ms": ms, "copy_ms": copy_ms, "inplace_ms": inplace_ms,
                      "bytes": 2 * half_bytes,
                      "token_bytes": token_bytes,
                      "timing": "graph" if graph else "eager"})  # fmt: skip
    return 0


def aggregate(rounds: list[dict]) -> list[dict]:
    """Per (variant, B, config): the median over rounds of ``copy_ms / ms`` and of ``ms``
    (errors passed through); plus a ``copy`` row per (variant, B)."""
    out: list[dict] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rounds:
        groups.setdefault((r["variant"], r["B"], json.dumps(r["config"])), []).append(r)
    copies: dict[tuple, list[dict]] = {}
    for (variant, B, cfg), rows in groups.items():
        timed = [r for r in rows if "ms" in r]
        row: dict = {"variant": variant, "B": B, "config": json.loads(cfg)}
        if not timed:
            row["error"] = rows[0].get("error", "not timed")
        else:
            ms = statistics.median(r["ms"] for r in timed)
            nbytes = timed[0]["bytes"]
            ratio = statistics.median(r["copy_ms"] / r["ms"] for r in timed)
            gbps = nbytes / (ms * 1e-3) / 1e9
            share = 1 + timed[0].get("token_bytes", 0) / nbytes  # all bytes moved / state bytes
            row.update(ms=ms, GBps=gbps, rounds=len(timed), ratio_to_copy=ratio,
                       ratio_all=ratio * share)  # fmt: skip
            if all("inplace_ms" in r for r in timed):
                inplace = statistics.median(r["inplace_ms"] / r["ms"] for r in timed)
                row["ratio_to_inplace"] = inplace
            copies.setdefault((variant, B), []).extend(timed)
        out.append(row)
    for (variant, B), rows in copies.items():
        ms = statistics.median(r["copy_ms"] for r in rows)
        out.append({"variant": variant, "B": B, "config": "copy", "ms": ms,
                    "GBps": rows[0]["bytes"] / (ms * 1e-3) / 1e9})  # fmt: skip
        if all("inplace_ms" in r for r in rows):
            ms = statistics.median(r["inplace_ms"] for r in rows)
            out.append({"variant": variant, "B": B, "config": "inplace", "ms": ms,
                        "GBps": rows[0]["bytes"] / (ms * 1e-3) / 1e9})  # fmt: skip
    return out


def _summary(rows: list[dict]) -> str:
    """Per (variant, B): copy and in-place GB/s, the default's ratio to copy, and the three
    best configs as ``copy ratio / all-bytes ratio / in-place ratio``."""
    lines = [f"{'variant':<11} {'B':>5}  {'copy GB/s':>9}  {'in-place':>8}  {'default':>7}  "
             "best (time against a copy of the state bytes / the same over every byte "
             "moved / against an in-place pass over the state bytes)"]  # fmt: skip
    keys = sorted(
        {(r["variant"], r["B"]) for r in rows}, key=lambda k: (VARIANTS.index(k[0]), k[1])
    )
    nan = float("nan")
    for variant, B in keys:
        mine = [r for r in rows if (r["variant"], r["B"]) == (variant, B)]
        copy = next((r["GBps"] for r in mine if r["config"] == "copy"), nan)
        inplace = next((r["GBps"] for r in mine if r["config"] == "inplace"), nan)
        timed = [r for r in mine if "ratio_to_copy" in r]
        default = next((r["ratio_to_copy"] for r in timed if r["config"] == "default"), None)
        best = sorted(timed, key=lambda r: -r["ratio_to_copy"])[:3]
        errors = sum("error" in r for r in mine)
        shown = ", ".join(
            f"{r['ratio_to_copy']:.3f}/{r.get('ratio_all', r['ratio_to_copy']):.3f}/"
            f"{r.get('ratio_to_inplace', nan):.3f} {r['config']}"
            for r in best
        )
        default_text = "-" if default is None else f"{default:.3f}"
        lines.append(
            f"{variant:<11} {B:>5}  {copy:9.0f}  {inplace:8.0f}  {default_text:>7}  {shown}"
            + (f"  [{errors} errors]" if errors else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=False, help="JSON results path")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument(
        "--timing",
        choices=("graph", "eager"),
        default="graph",
        help="time kernel and copy as CUDA-graph replays (default) or eager calls",
    )
    ap.add_argument(
        "--setting",
        help="time only the default tiling and the configs that set this keyword ("
        "block_d, ...): a quick look at one tiling's family",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        return worker(
            args.worker, batches, args.rounds, args.deadline, args.timing == "graph", args.setting
        )
    if args.out is None:
        ap.error("--out is required")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    t0 = time.time()
    raw: list[dict] = []
    failures: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n, variant in enumerate(variants):
        left = args.budget_s - (time.time() - t0)
        share = left / (len(variants) - n)  # what is left, split over the variants still to run
        deadline = time.time() + share * 0.9
        cmd = [sys.executable, __file__, "--worker", variant, "--batches", args.batches,
               "--rounds", str(args.rounds), "--deadline", str(deadline),
               "--timing", args.timing]  # fmt: skip
        if args.setting:
            cmd += ["--setting", args.setting]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(share, 5))
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "timeout", -9
        got = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("@@ROW ")]
        raw += got
        if rc != 0:
            tail = " | ".join([ln for ln in err.strip().splitlines() if ln.strip()][-3:])
            failures.append({"variant": variant, "error": f"rc={rc}: {tail}"})
        print(f"{variant}: {len(got)} timings, rc={rc}, {time.time() - t0:.0f}s", flush=True)
        rows = aggregate(raw)  # written after every variant: a cut run keeps the ones before
        payload = {"rows": rows, "failures": failures, "raw": raw,
                   "wall_s": round(time.time() - t0, 1)}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1))
    print("\n" + _summary(aggregate(raw)))
    for f in failures:
        print(f"{f['variant']}: worker error {f['error']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
