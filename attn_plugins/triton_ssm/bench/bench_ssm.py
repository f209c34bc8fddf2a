"""Benchmark the triton_ssm kernels on a CUDA GPU; prints a table and writes JSON (--out).

Every provider runs in a worker subprocess: an illegal memory access poisons the CUDA context of
the process that made it, so a faulting call is recorded as that job's error, a new worker takes
the remaining jobs, and the run goes on.

Sections:

* copy: ``torch.clone`` of 1 GiB and of tensors the size of each batch's state (GB/s of read +
  write, the HBM ceiling to compare with).
* gdn_decode: B = 64, 256, 1024, 2048, Hk=16, Hv=32, Dk=Dv=128, fp32 state in a pool of B + 8
  slots, random slot order; GB/s of state read + write for our kernel (defaults, and with
  ``--sweep`` a grid of block_v / num_warps / programs_per_sm), and for fla
  ``fused_recurrent_gated_delta_rule`` on a dense gathered state.
* gdn_prefill (``--prefill``): T = 8192 and 32768 as one request and as 16 (cu_seqlens), our
  wrapper vs fla ``chunk_gated_delta_rule`` called directly; ms and tokens/s. Our row also
  times fla in the same process, alternating three times (min of each): its ratio is the one to
  quote (separate jobs drifted by up to 2.5x between runs on the H200). In CUDA graphs also
  the variants (``--gdn-variants`` picks them by name): into a given ``out``, the state pass's
  tilings, with fla's ``recompute_w_u`` folded in or not whatever the batch (``wy in pass``,
  ``w u stored``; the default folds it where the batch fills the GPU), the output computed
  in it (``fused output``), and either way with our solve (``our solve, ...``: the decay's
  cumsum and each chunk's ``(I + A)^-1`` from ``kernels.gdn_solve``).
* gdn_solve (``--only gdn_solve``): GDN's intra-chunk solve alone at Qwen3-Next's heads, T =
  8192 as one request and 32768 as 16: ``gdn_solve.kkt_solve`` at its default and at each of
  ``SOLVE_TILINGS`` against fla's fused kkt-and-solve kernel, CUDA graphs in alternating
  rounds, medians, and the largest difference from fla's ``(I + A)^-1``.
* kda_prefill (``--prefill``): Kimi-Linear's KDA layer (32 heads, Dk=Dv=128), T = 8192 and
  32768 as one request and as 16: our ``kda_prefill`` (the state pass over slots) against fla
  ``chunk_kda`` with the states gathered and scattered around it (``slot_pass=False``) and
  against ``chunk_kda`` alone on dense states, all three in the same process, alternating three
  times (min of each), eager and in CUDA graphs; the ratios ours / fla.
* prefill_profile (``--profile``): GPU time per kernel (torch.profiler) of our GDN prefill
  (as the default chooses, and with ``wy_in_pass`` forced on and off), fla's, and the Triton
  SSD (chunk 64 and 256) with and without the hi/lo split, T = 8192 as 1 and 16 requests.
* mamba2_sweep (``--mamba2-sweep``): the Triton SSD at the granite shape (T = 8192 as one
  request, 32768 as 16) in each variant of ``SSD_SWEEP`` (chunk 64 / 128 / 256, token tile,
  scan warps, heads per program, the cb pass, float32 or bf16 entering states, with and
  without the hi/lo split), each checked against the default's output and final states and
  against the float32 torch chunked SSD (max relative difference printed); one row per
  variant, emitted as it is timed. Alone:
  ``bench_ssm.py --mamba2-sweep --only mamba2_sweep --no-fla --budget-s 300 --out x.json``.
* l2norm_sweep (``--l2norm-sweep``): ``l2norm_qk`` block sizes at Qwen3-Next's q/k shape,
  GB/s and max error against torch.
* mamba2_decode: B = 64..2048, H=128, N=128, P=64 (Mamba2-2.7B-like), fp32 state, GB/s.
* mamba2_prefill (``--prefill``): granite-4.0-h-small-like (H=128, P=64, N=128, G=1), T = 8192
  and 32768 as one and 16 requests: ``impl="triton"`` (chunk 64, 128 and 256, each with and
  without the hi/lo split), ``impl="fla"``, ``impl="torch"`` (T = 8192, one request); tokens/s, the
  ratio to fla's rate in the same run and to the published fused SSD rate.
* mamba2_vs_mamba_ssm (``--vs-mamba-ssm``, or ``--only mamba2_vs_mamba_ssm``): the same granite
  shape, T = 8192 and 32768 as one and 16 requests: our SSD (``impl="triton"``, our default
  chunk unless ``--our-chunk``) against mamba_ssm's Triton ``mamba_chunk_scan_combined`` (chunk
  ``--mamba-ssm-chunk``, default 256 as in its Mamba2 module; ``dt_bias``, ``dt_softplus=True``,
  the ``D`` skip, no ``z``; its default bf16 inter-chunk states and ``state_dtype=float32``),
  from the installed mamba_ssm, else from the sources ``scripts/pack_mamba_ssm_triton.sh``
  packs into ``.ext/mamba_ssm_triton`` (``mamba_ssm_ssd.py``; an error row saying how where
  neither is there). The 16 requests go to it as its batch and, a second row, as one packed
  row with ``seq_idx`` (zero initial states there). Alternating rounds in one process, median
  of each; tokens/s of both, our rate over its, and the check: max relative difference of the
  outputs and final states (``MISMATCH`` above 2e-2), and of both to the float32 torch SSD.
  Alone: ``bench_ssm.py --only mamba2_vs_mamba_ssm --no-fla --budget-s 280 --out x.json``.
* lightning_decode: MiniMax-Text-01's lightning layer (H=64, Dk=Dv=128, one rank), B = 64..2048,
  fp32 state: ours (the Mamba2 decode kernel with dt = 1, A_log = log slope, as the plugin
  calls it) and fla ``fused_recurrent_simple_gla`` (``g_gamma`` = -slope) on a dense gathered
  state; GB/s of state read + write (ratio to copy in the table).
* lightning_prefill (``--prefill``): the same layer, T = 8192 and 32768 as one and 16 requests:
  ours (``mamba2_prefill(impl="triton")`` with the lightning mapping, chunk 64) and fla
  ``chunk_simple_gla`` with ``g_gamma`` (the kernel fla's ``chunk_lightning_attn`` calls) on
  gathered initial states; tokens/s and the ratio to fla's rate in the same run.
* short_conv_decode: LFM2-1.2B's short conv (2048 channels, kernel 3), B = 64..2048,
  ``causal_conv1d_update`` with no activation, bf16 conv state; GB/s of conv state read + write
  plus the token's input and output.
* mamba1_decode: B = 64..2048, Falcon-Mamba-7B / Jamba mixer (d_inner 8192, d_state 16), fp32
  state, GB/s of state read + write (A_log, read by every request, stays in L2), with 1, 2 and
  4 requests per program.
* mamba1_prefill (``--prefill``): the same mixer, T = 8192 as one and as 16 requests: our
  ``mamba1_scan`` (default, the time-chunked scan with ``time_chunk`` 128, 256, 512),
  mamba_ssm's CUDA ``selective_scan`` forward (the kernel Mamba1
  models ship with: the installed package's ``selective_scan_fn``, else the extension
  ``mamba_ssm_scan.py`` builds from the sources ``scripts/pack_mamba_ssm_src.sh`` packs into
  ``.ext/mamba_ssm_src``, 1-2 minutes on first use; an error row saying so where neither is
  there; the row's ``provider`` names which ran, only the kernel call is timed) and attn-core's
  torch reference (chunked, T = 2048 only: it is slow); tokens/s. The mamba_ssm rows also run
  our ``mamba1_scan`` on the same inputs: max abs and relative difference of the output and
  the final state, ``MISMATCH`` above 2e-2; the ``time_chunk`` rows diff
  the same way against our plain sequential walk (``time_chunk=0``).
* mamba1_chunk_rule (``--prefill``): T = 8192 as 1..32 requests, the walk (``time_chunk=0``),
  chunks of 256 and the default (``auto_time_chunk``): where the automatic chunking should
  switch on.
* mamba1_lanes (``--only mamba1_lanes``): T = 8192 as 1, 4 and 16 requests, with z: the lanes
  kernel (``mamba1_scan(lanes=True)``, whole channels a thread) as its default, the walk and
  chunked (128 / 256 / 512 tokens; 256 or 128 channels a program), the tile kernel's default
  and walk (``lanes=False``), and mamba_ssm's
  CUDA selective scan (as in mamba1_prefill), in 5 alternating rounds in one process, medians;
  each of ours diffed against the tile walk, the lanes default against mamba_ssm.
* plugin_step (``--plugin``): a 4-layer GDN decode step (conv1d + recurrent update) at B = 64,
  256 through the runtime's bindings vs the same kernels called directly; ratio of times, eager
  (host launch cost included) and with each step captured in a CUDA graph.

Timing: ``triton.testing.do_bench`` (L2 flushed between calls, median). The decode kernels
write the state in place, so each timed call starts from the previous call's state; the
traffic is the same.

Usage: ``python bench/bench_ssm.py --out results.json [--quick] [--sweep] [--prefill] [--plugin]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HK, HV, D = 16, 32, 128
#: Kimi-Linear's KDA layer: 32 heads (as many key as value heads), d 128.
KDA_H, KDA_D = 32, 128
GB = 1e9
BATCHES = [64, 256, 1024, 2048]
#: The fused SSD kernel's published prefill rate on an H100 (about 2.3e7 tokens/s). The
#: mamba2_vs_mamba_ssm section measures mamba_ssm's kernel itself, on the same GPU.
MAMBA2_PUBLISHED_MTOK = 23.0
# (block_v, num_warps, programs_per_sm); programs_per_sm 0 = one program per work item (the
# default), n > 0 a persistent grid of n programs per SM.
SWEEP = [
    (bv, nw, pps)
    for bv, nw in ((16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))
    for pps in (0, 1, 2, 4, 8)
] + [(8, 1, 0), (8, 1, 2), (128, 16, 0), (128, 16, 1)]
#: (block_v, num_warps, num_stages) of the GDN prefill state pass timed beside the default.
#: 16-wide value blocks double the programs of one long sequence (its pass is a chain of
#: chunks, so parallelism comes from heads and value blocks only); on the H200 they did not
#: pay (0.573 ms against 0.538 at BV 32, T = 8192 as one sequence).
PASS_TILINGS = [
    (16, 4, 3), (32, 4, 3), (32, 4, 4), (32, 8, 3), (64, 4, 2), (64, 4, 3),
]  # fmt: skip
#: The state-pass alternatives of ``gdn_chunk_prefill_slots`` by the names the GDN rows and
#: the profile give them (the plain call is the default's choice between the first two).
GDN_PASS_MODES: dict[str, dict[str, Any]] = {
    "w u stored": dict(wy_in_pass=False),
    "wy in pass": dict(wy_in_pass=True),
    "fused output": dict(fuse_output=True),
    # the decay's cumsum and each chunk's (I + A)^-1 from our one kernel (kernels.gdn_solve) in
    # place of fla's cumsum and kkt-and-solve kernel
    "our solve, w u stored": dict(wy_in_pass=False, solve="ours"),
    "our solve, wy in pass": dict(wy_in_pass=True, solve="ours"),
}
#: gdn_prefill's variants timed when ``--gdn-variants`` names none: each alternative at its
#: default tiling (the plain call is the default's choice of pass); the tilings
#: (``pass BV=...``, ``wy in pass, pass BV=...``) only when named, so the whole table stays
#: one run
DEFAULT_GDN_VARIANTS = (
    "gather_scatter", "out given", "w u stored, pass default tiling",
    "wy in pass, pass default tiling", "fused output, pass default tiling",
    "our solve, w u stored, pass default tiling", "our solve, wy in pass, pass default tiling",
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# worker side: one process runs jobs in order and prints one JSON line per result
# --------------------------------------------------------------------------------------------
def _bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn()``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _state_bytes(B: int) -> int:
    return 2 * B * HV * D * D * 4  # fp32 state read + written


def job_copy(nbytes: int) -> dict:
    import torch

    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    ms = _bench(lambda: x.clone())
    return {"ms": ms, "GBps": 2 * nbytes / (ms * 1e-3) / GB}


def _decode_inputs(B: int, S: int, seed: int = 0, per_channel_g: bool = False):
    """Qwen3-Next-shaped delta-rule decode inputs (``per_channel_g``: KDA's ``[B, HV, D]``
    gate) over a pool of ``S`` fp32 state slots, ``B`` of them in random order."""
    import torch

    torch.manual_seed(seed)
    q = torch.randn(B, HK, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HV, D, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(B, HV, *((D,) if per_channel_g else ()), device="cuda") * 0.1
    beta = torch.rand(B, HV, device="cuda")
    state = torch.randn(S, HV, D, D, device="cuda") * 0.01
    idx = torch.randperm(S, device="cuda")[:B].int()
    return q, k, v, g, beta, state, idx


def job_gdn_decode_ours(B: int, block_v=None, num_warps=None, programs_per_sm=None) -> dict:
    import torch
    from attn_plugin_triton_ssm.kernels import gdn_decode

    q, k, v, g, beta, state, idx = _decode_inputs(B, B + 8)
    out = torch.empty_like(v)

    def run():
        gdn_decode(q, k, v, g, beta, state, idx, out=out, block_v=block_v, num_warps=num_warps,
                   programs_per_sm=programs_per_sm)  # fmt: skip

    run()
    torch.cuda.synchronize()
    ms = _bench(run)
    return {"ms": ms, "GBps": _state_bytes(B) / (ms * 1e-3) / GB}


def job_gdn_decode_sweep(batches: list[int], emit) -> dict:
    """Every SWEEP config at B = 64 and 1024, then the four best (by their mean GB/s there) at
    the other batches."""
    scores: dict[tuple, list[float]] = {}
    first = [b for b in batches if b in (64, 1024)] or batches[:1]
    rest = [b for b in batches if b not in first]
    for B in first:
        for bv, nw, pps in SWEEP:
            row = _run_guarded(
                job_gdn_decode_ours, B=B, block_v=bv, num_warps=nw, programs_per_sm=pps
            )
            emit({"section": "gdn_decode", "provider": "ours sweep", "B": B, "block_v": bv,
                  "num_warps": nw, "programs_per_sm": pps, **row})  # fmt: skip
            scores.setdefault((bv, nw, pps), []).append(row.get("GBps", 0.0))
    best = sorted(scores, key=lambda c: -sum(scores[c]) / len(scores[c]))[:4]
    for B in rest:
        for bv, nw, pps in best:
            row = _run_guarded(
                job_gdn_decode_ours, B=B, block_v=bv, num_warps=nw, programs_per_sm=pps
            )
            emit({"section": "gdn_decode", "provider": "ours sweep", "B": B, "block_v": bv,
                  "num_warps": nw, "programs_per_sm": pps, **row})  # fmt: skip
    return {"best": [list(c) for c in best]}


def _run_guarded(fn, **kw) -> dict:
    """For errors that leave the context usable (compile errors, out of resources)."""
    try:
        return fn(**kw)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def job_gdn_decode_fla(B: int) -> dict:
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, g, beta, state, idx = _decode_inputs(B, B + 8)
    h0 = state[idx.long()].contiguous()  # fla takes one dense state per request

    def run():
        # Keywords only: fla 0.6's positional order is (q, k, v, g, gk, gv, beta, ...), so a
        # positional beta lands in gk ([B, T, HV] read as [B, T, HV, K]: out of bounds).
        return fused_recurrent_gated_delta_rule(
            q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    run()
    torch.cuda.synchronize()
    ms = _bench(run)
    return {
        "ms": ms,
        "GBps": _state_bytes(B) / (ms * 1e-3) / GB,
        "note": "dense h0 in, new ht out (no slot gather/scatter)",
    }


def _prefill_inputs(T: int, n_seq: int):
    import torch

    torch.manual_seed(0)
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


def job_prefill_ours(
    T: int, n_seq: int, with_fla: bool = True, variants_only: list[str] | None = None
) -> dict:
    """Our gdn_prefill; with ``with_fla``, fla's chunk_gated_delta_rule on the same inputs timed
    in the same process, alternating three times (min of each), so GPU clock and warm-up drift
    hit both alike and the ratio is comparable run to run. ``variants_only``: time only the
    variants whose names start with one of these (``--gdn-variants``; None:
    :data:`DEFAULT_GDN_VARIANTS`)."""
    import torch
    from attn_plugin_triton_ssm.kernels import gdn_prefill

    q, k, v, g, beta, state, idx, cu = _prefill_inputs(T, n_seq)
    # as the plugin calls it: int64 offsets on both sides, built once per step
    cu64, cu_cpu = cu.long(), cu.long().cpu()

    def ours():
        return gdn_prefill(q, k, v, g, beta, state, idx, cu64, cu_seqlens_cpu=cu_cpu)

    if not with_fla:
        ms = _bench(ours, warmup=25, rep=100)
        return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    h0 = state[idx.long()].contiguous()

    def fla_direct():  # fla called as well as it can be: host offsets too (no sync)
        return chunk_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu64,
            cu_seqlens_cpu=cu_cpu,
        )  # fmt: skip

    times: dict[str, list[float]] = {"ours": [], "fla": []}
    for _ in range(3):
        times["ours"].append(_bench(ours, warmup=25, rep=100))
        times["fla"].append(_bench(fla_direct, warmup=25, rep=100))
    ms, fla_ms = min(times["ours"]), min(times["fla"])
    res: dict = {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6, "fla_ms": fla_ms,
                 "ratio_to_fla": ms / fla_ms}  # fmt: skip
    # The same two captured in CUDA graphs: GPU time alone, without the host launch cost of
    # fla's ~10 kernels, which on a busy host decides the eager times above.
    from attn_core.bench_util import capture_graph

    try:
        g_ours, g_fla = capture_graph(ours), capture_graph(fla_direct)
    except Exception as exc:  # reported; the eager numbers stand
        res["graph_error"] = f"{type(exc).__name__}: {exc}"
        return res
    graph: dict[str, list[float]] = {"ours": [], "fla": []}
    for _ in range(3):
        graph["ours"].append(_bench(g_ours.replay, warmup=10, rep=100))
        graph["fla"].append(_bench(g_fla.replay, warmup=10, rep=100))
    res["graph_ms"], res["graph_fla_ms"] = min(graph["ours"]), min(graph["fla"])
    res["graph_ratio_to_fla"] = res["graph_ms"] / res["graph_fla_ms"]
    # Where the gain over fla's public function comes from: the same wrapper gathering and
    # scattering the states around it (slot_pass=False), and the state pass's tilings.
    from attn_plugin_triton_ssm.kernels import gdn_chunk

    def gather():
        return gdn_prefill(q, k, v, g, beta, state, idx, cu64, cu_seqlens_cpu=cu_cpu,
                           slot_pass=False)  # fmt: skip

    variants: dict[str, Callable[..., Any]] = {"gather_scatter": gather}
    out_buf = torch.empty_like(v)
    # as the plugin calls it: into the layer's output buffer (fla's output pass writes it)
    variants["out given"] = lambda: gdn_prefill(
        q, k, v, g, beta, state, idx, cu64, cu_seqlens_cpu=cu_cpu, out=out_buf
    )
    # the state pass as the default chooses (fla's recompute_w_u folded in where the batch
    # fills the GPU), reading fla's stored w and u, with recompute_w_u folded in, or with the
    # output computed in it too; each at its default tiling, then at every tiling of
    # PASS_TILINGS (8 warps not with the WY folded in: refused)
    modes = {"": {}, **{f"{name}, ": mode for name, mode in GDN_PASS_MODES.items()}}
    for prefix, mode in modes.items():
        for tiling in (None, *PASS_TILINGS):
            if mode.get("wy_in_pass") and tiling is not None and tiling[1] > 4:
                continue
            opts, name = {}, prefix + "pass default tiling"
            if tiling is not None:
                bv, nw, ns = tiling
                opts = dict(block_v=bv, num_warps=nw, num_stages=ns)
                name = f"{prefix}pass BV={bv} warps={nw} stages={ns}"
            variants[name] = lambda mode=mode, opts=opts: gdn_chunk.gdn_chunk_prefill_slots(
                q, k, v, g, beta, state, idx, cu64, cu_cpu, scale=k.shape[-1] ** -0.5,
                use_qk_l2norm=True, **mode, **opts,
            )  # fmt: skip
    # a list once it has passed through the worker's JSON
    keep = tuple(variants_only) if variants_only is not None else DEFAULT_GDN_VARIANTS
    variants = {n: fn for n, fn in variants.items() if n.startswith(keep)}
    for name, fn in variants.items():
        try:
            gr = capture_graph(fn)
            res[f"graph_ms[{name}]"] = min(_bench(gr.replay, warmup=10, rep=100) for _ in range(2))
            res[f"graph_ratio_to_fla[{name}]"] = res[f"graph_ms[{name}]"] / res["graph_fla_ms"]
        except Exception as exc:  # reported per variant
            res[f"graph_ms[{name}]"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return res


def _kda_prefill_inputs(T: int, n_seq: int, H=KDA_H, D=KDA_D):
    import torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # per key channel, as Kimi's gate -exp(A_log) * softplus(...) gives: small, some larger
    g = torch.nn.functional.logsigmoid(torch.randn(T, H, D, device="cuda")) * 0.1
    beta = torch.rand(T, H, device="cuda", dtype=torch.bfloat16)
    cu = torch.linspace(0, T, n_seq + 1).round().long().to("cuda")
    state = torch.randn(n_seq + 4, H, D, D, device="cuda") * 0.01
    idx = torch.arange(n_seq, device="cuda", dtype=torch.int32) + 2
    return q, k, v, g, beta, state, idx, cu


def job_kda_prefill(T: int, n_seq: int) -> dict:
    """Our kda_prefill (the state pass over slots), the same wrapper gathering and scattering
    the states around fla's public chunk_kda (``slot_pass=False``: what it ran before), and
    chunk_kda alone on dense states (no gather, no scatter: fla at its best), timed in the same
    process alternating three times (min of each), eager and in CUDA graphs."""
    import torch
    from attn_plugin_triton_ssm.kernels import kda_prefill
    from fla.ops.kda import chunk_kda

    q, k, v, g, beta, state, idx, cu = _kda_prefill_inputs(T, n_seq)
    cu_cpu = cu.cpu()  # int64 offsets on both sides, built once per step, as the plugin does
    h0 = state[idx.long()].contiguous()

    def ours():  # slot_pass=True: an error row (not a silent fallback) where the pass is off
        return kda_prefill(q, k, v, g, beta, state, idx, cu, cu_seqlens_cpu=cu_cpu,
                           slot_pass=True)  # fmt: skip

    out_buf = torch.empty_like(v)

    def ours_out():  # as the plugin calls it: into the layer's output buffer
        return kda_prefill(q, k, v, g, beta, state, idx, cu, cu_seqlens_cpu=cu_cpu,
                           slot_pass=True, out=out_buf)  # fmt: skip

    def gather():
        return kda_prefill(q, k, v, g, beta, state, idx, cu, cu_seqlens_cpu=cu_cpu,
                           slot_pass=False)  # fmt: skip

    def fla_dense():
        return chunk_kda(
            q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )  # fmt: skip

    calls = {"ours": ours, "out given": ours_out, "gather": gather, "fla": fla_dense}

    def alternate(fns: dict, warmup: int) -> dict:
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(_bench(fn, warmup=warmup, rep=100))
        return {name: min(ts) for name, ts in times.items()}

    best = alternate(calls, warmup=25)
    ms = best["ours"]
    res = {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6, "fla_ms": best["fla"],
           "ratio_to_fla": ms / best["fla"], "gather_ms": best["gather"],
           "ratio_to_gather": ms / best["gather"], "out_given_ms": best["out given"],
           "out_given_ratio_to_fla": best["out given"] / best["fla"]}  # fmt: skip
    from attn_core.bench_util import capture_graph

    try:
        graphs = {name: capture_graph(fn).replay for name, fn in calls.items()}
    except Exception as exc:  # reported; the eager numbers stand
        res["graph_error"] = f"{type(exc).__name__}: {exc}"
        return res
    best = alternate(graphs, warmup=10)
    res["graph_ms"], res["graph_fla_ms"] = best["ours"], best["fla"]
    res["graph_gather_ms"] = best["gather"]
    res["graph_ratio_to_fla"] = best["ours"] / best["fla"]
    res["graph_ratio_to_gather"] = best["ours"] / best["gather"]
    res["graph_out_given_ms"] = best["out given"]
    res["graph_out_given_ratio_to_fla"] = best["out given"] / best["fla"]
    return res


def job_prefill_profile(T: int, n_seq: int) -> dict:
    """GPU time per kernel (torch.profiler, mean over 5 calls) of our GDN prefill, fla's
    chunk_gated_delta_rule and the Triton SSD (granite shape, chunk 64 and 256, with and
    without the hi/lo split): which stage to work on (the SSD's state kernel is sequential
    over a sequence's 64-token sub-blocks whatever the chunk; its scan's work grows with it)."""
    import torch
    from attn_plugin_triton_ssm.kernels import gdn_prefill
    from attn_plugin_triton_ssm.kernels.gdn_chunk import gdn_chunk_prefill_slots
    from attn_plugin_triton_ssm.kernels.ssd import mamba2_ssd_triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, state, idx, cu = _prefill_inputs(T, n_seq)
    cu64, cu_cpu = cu.long(), cu.long().cpu()
    h0 = state[idx.long()].contiguous()
    ssd_inputs = _mamba2_prefill_inputs(T, n_seq)
    calls: dict[str, Callable[..., Any]] = {
        "gdn ours": lambda: gdn_prefill(q, k, v, g, beta, state, idx, cu64, cu_seqlens_cpu=cu_cpu),
        **{
            f"gdn ours, {name}": lambda mode=mode: gdn_chunk_prefill_slots(
                q, k, v, g, beta, state, idx, cu64, cu_cpu, scale=k.shape[-1] ** -0.5,
                use_qk_l2norm=True, **mode,
            )
            for name, mode in GDN_PASS_MODES.items()
            if name != "fused output"
        },
        "gdn fla": lambda: chunk_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu64,
            cu_seqlens_cpu=cu_cpu,
        ),
        **{
            f"ssd chunk={q} precise={p}": lambda p=p, q=q: mamba2_ssd_triton(
                **ssd_inputs, precise=p, chunk_size=q
            )
            for q in (64, 256)
            for p in (True, False)
        },
    }  # fmt: skip
    res = {}
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = [
            (e.key, e.device_time_total / 5, e.count // 5)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ]
        rows.sort(key=lambda r: -r[1])
        res[f"kernels[{name}]"] = {
            "total_us": round(sum(r[1] for r in rows), 1),
            "top": [(key[:70], round(us, 1), n) for key, us, n in rows[:8]],
        }
    return res


#: ``(num_warps, block_k, precision)`` of ``gdn_solve.kkt_solve`` timed beside its default
SOLVE_TILINGS = [
    (1, 64, "tf32"), (2, 32, "tf32"), (2, 64, "tf32"), (4, 64, "tf32"), (4, 128, "tf32"),
    (8, 64, "tf32"), (1, 32, "ieee"), (4, 64, "ieee"),
]  # fmt: skip


def job_gdn_solve(T: int, n_seq: int, rounds: int = 5) -> dict:
    """GDN's intra-chunk solve alone at Qwen3-Next's heads: ours (``gdn_solve.kkt_solve``, at
    its default and at every tiling of :data:`SOLVE_TILINGS`) against fla's fused
    kkt-and-solve kernel (autotuned, launched as its ``chunk_gated_delta_rule_fwd_intra``
    launches it, into a zero-filled ``Ai``), CUDA-graph replays in ``rounds`` alternating
    rounds, medians; and the largest difference from fla's ``Ai``."""
    import statistics

    import torch
    from attn_plugin_triton_ssm import compat
    from attn_plugin_triton_ssm.kernels import gdn_chunk, gdn_solve

    from attn_core.bench_util import capture_graph

    q, k, _, g, beta, _, _, cu = _prefill_inputs(T, n_seq)
    f, reason = compat.stages("gdn")
    if reason:
        return {"error": reason}
    cu64 = cu.long()
    _, kn = gdn_chunk.l2norm_qk(q[None], k[None])
    chunks = f["chunk_indices"](cu64, gdn_solve.CHUNK, cu_seqlens_cpu=cu64.cpu())
    gc = f["cumsum"](g[None], chunk_size=gdn_solve.CHUNK, scale=f["RCP_LN2"], cu_seqlens=cu64,
                     chunk_indices=chunks)  # fmt: skip
    fla_ai = torch.zeros(1, T, g.shape[1], gdn_solve.CHUNK, device="cuda", dtype=k.dtype)

    def fla():
        return f["kkt_solve_into"](fla_ai, k=kn, g=gc, beta=beta[None], cu_seqlens=cu64,
                                   chunk_indices=chunks, chunk_size=gdn_solve.CHUNK)  # fmt: skip

    ours_ai = torch.empty_like(fla_ai[0])

    def ours(**tiling: Any) -> Callable[[], object]:
        return lambda: gdn_solve.kkt_solve(kn[0], gc[0], beta, cu64, chunks, out=ours_ai, **tiling)

    calls = {"fla": fla, "ours default": ours()}
    for w, bk, p in SOLVE_TILINGS:
        calls[f"ours warps={w} BK={bk} {p}"] = ours(num_warps=w, block_k=bk, precision=p)
    res: dict = {}
    graphs = {}
    for name, fn in calls.items():
        try:
            fn()
            torch.cuda.synchronize()
            if name != "fla":
                res[f"maxdiff[{name}]"] = (ours_ai.float() - fla_ai[0].float()).abs().max().item()
            graphs[name] = capture_graph(fn)
        except Exception as exc:  # reported per tiling (one that cannot compile)
            res[f"us[{name}]"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, gr in graphs.items():
            times[name].append(_bench(gr.replay, warmup=5, rep=50) * 1e3)
    for name, ts in times.items():
        res[f"us[{name}]"] = statistics.median(ts)
        if name != "fla":
            res[f"ratio_to_fla[{name}]"] = statistics.median(
                t / t_fla for t, t_fla in zip(ts, times["fla"], strict=True)
            )
    return res


def job_prefill_fla(T: int, n_seq: int) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, state, idx, cu = _prefill_inputs(T, n_seq)
    h0 = state[idx.long()].contiguous()
    cu64 = cu.long()

    def run():
        return chunk_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu64,
        )  # fmt: skip

    ms = _bench(run, warmup=5, rep=30)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


def mamba2_decode_call(B: int, H=128, G=1, N=128, P=64):
    """Mamba2 decode at ``B`` requests (bf16 activations, fp32 state in a pool of ``B + 8``
    slots in random order): ``(run(**tiling), bytes of state read)``."""
    import torch
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

    def run(**tiling):
        return mamba2_decode(x, dt, A_log, Bm, Cm, state, idx, D=Dp, dt_bias=dt_bias, out=out,
                             **tiling)  # fmt: skip

    return run, B * H * N * P * 4


def job_mamba2_decode(B: int, H=128, G=1, N=128, P=64) -> dict:
    run, nbytes = mamba2_decode_call(B, H, G, N, P)
    ms = _bench(run)
    return {"ms": ms, "GBps": 2 * nbytes / (ms * 1e-3) / GB}


# -- lightning attention (MiniMax-01) and the short conv (LFM2) ---------------------------
LIGHTNING_H, LIGHTNING_D = 64, 128  # MiniMax-Text-01, one rank
SHORT_CONV_C, SHORT_CONV_K = 2048, 3  # LFM2-1.2B


def _lightning_slope(H: int):
    """MiniMax's slopes at layer 0: ``2^(-8 (h + 1) / H)``."""
    import torch

    return (2.0 ** (-8.0 * (torch.arange(H, device="cuda") + 1) / H)).float()


def _lightning_decode_inputs(B: int, H: int, D: int):
    """MiniMax-Text-01 lightning decode inputs: q, k, v ``[B, H, D]`` bf16, the slopes, a pool
    of ``B + 8`` fp32 ``[H, D, D]`` state slots and ``B`` of them in random order."""
    import torch

    S = B + 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    state = torch.randn(S, H, D, D, device="cuda") * 0.01
    idx = torch.randperm(S, device="cuda")[:B].int()
    return q, k, v, _lightning_slope(H), state, idx


def lightning_decode_call(B: int, H=LIGHTNING_H, D=LIGHTNING_D):
    """Ours, as the plugin calls it (the Mamba2 decode kernel with ``dt = 1``, ``A_log =
    log(slope)``, no softplus): ``(run(**tiling), bytes of state read)``."""
    import torch
    from attn_plugin_triton_ssm.kernels import mamba2_decode

    q, k, v, slope, state, idx = _lightning_decode_inputs(B, H, D)
    ones, a_log, out = torch.ones(B, H, device="cuda"), torch.log(slope), torch.empty_like(v)

    def run(**tiling):
        return mamba2_decode(v, ones, a_log, k, q, state, idx, dt_softplus=False, out=out,
                             **tiling)  # fmt: skip

    return run, B * H * D * D * 4


def job_lightning_decode(B: int, provider: str, H=LIGHTNING_H, D=LIGHTNING_D) -> dict:
    nbytes = 2 * B * H * D * D * 4
    if provider == "ours":
        run, _ = lightning_decode_call(B, H, D)
        ms = _bench(run)
    else:
        from fla.ops.simple_gla import fused_recurrent_simple_gla

        q, k, v, slope, state, idx = _lightning_decode_inputs(B, H, D)
        h0 = state[idx.long()].contiguous()  # fla reads a dense state: gathered once, untimed
        ms = _bench(lambda: fused_recurrent_simple_gla(
            q[:, None], k[:, None], v[:, None], g_gamma=-slope, scale=1.0, initial_state=h0,
            output_final_state=True))  # fmt: skip
    return {"ms": ms, "GBps": nbytes / (ms * 1e-3) / GB}


def job_lightning_prefill(T: int, n_seq: int, provider: str, H=LIGHTNING_H, D=LIGHTNING_D) -> dict:
    import torch

    torch.manual_seed(0)
    cu_cpu = torch.linspace(0, T, n_seq + 1).round().int()
    cu = cu_cpu.to("cuda")
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slope = _lightning_slope(H)
    state = torch.randn(n_seq + 4, H, D, D, device="cuda") * 0.01
    idx = torch.arange(n_seq, device="cuda", dtype=torch.int32) + 2
    if provider == "ours":
        from attn_plugin_triton_ssm.kernels import mamba2_prefill

        ones, a_log = torch.ones(T, H, device="cuda"), torch.log(slope)

        def run():
            return mamba2_prefill(v, ones, a_log, k, q, state, idx, cu, dt_softplus=False,
                                  impl="triton", cu_seqlens_cpu=cu_cpu)  # fmt: skip
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        cu64, cu64_cpu = cu.long(), cu_cpu.long()

        def run():  # fla on the slot pool: gather the initial states, scatter the finals
            h0 = state.index_select(0, idx.long())
            y, ht = chunk_simple_gla(q[None], k[None], v[None], g_gamma=-slope, scale=1.0,
                                     initial_state=h0, output_final_state=True,
                                     cu_seqlens=cu64, cu_seqlens_cpu=cu64_cpu)  # fmt: skip
            state.index_copy_(0, idx.long(), ht)
            return y

    ms = _bench(run, warmup=3, rep=20)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


def short_conv_decode_call(B: int, C=SHORT_CONV_C, K=SHORT_CONV_K):
    """LFM2's short conv decode (no activation, bf16 conv state in ``B + 8`` slots):
    ``(run(**tiling), bytes read: the conv state and the token)``; as many are written."""
    import torch
    from attn_plugin_triton_ssm.kernels import causal_conv1d_update

    S = B + 8
    x = torch.randn(B, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, K, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(S, C, K - 1, device="cuda", dtype=torch.bfloat16)
    idx = torch.randperm(S, device="cuda")[:B].int()
    out = torch.empty_like(x)

    def run(**tiling):
        return causal_conv1d_update(x, state, w, None, idx, activation=None, out=out, **tiling)

    return run, B * C * (K - 1) * 2 + B * C * 2


def job_short_conv_decode(B: int, C=SHORT_CONV_C, K=SHORT_CONV_K) -> dict:
    run, nbytes = short_conv_decode_call(B, C, K)
    ms = _bench(run)
    return {"ms": ms, "GBps": 2 * nbytes / (ms * 1e-3) / GB}  # state read + write, x in, y out


MAMBA1_D, MAMBA1_N = 8192, 16  # Falcon-Mamba-7B / Jamba: d_inner, d_state


def mamba1_decode_call(B: int, Dn=MAMBA1_D, N=MAMBA1_N):
    """A Falcon-Mamba / Jamba mixer's decode (bf16 activations, fp32 state in ``B + 8`` slots
    in random order; ``A_log`` is read by every request and stays in L2):
    ``(run(**tiling), bytes of state read)``."""
    import torch
    from attn_plugin_triton_ssm.kernels import mamba1_decode

    S = B + 8
    x = torch.randn(B, Dn, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(B, Dn, device="cuda", dtype=torch.bfloat16)
    A_log = torch.randn(Dn, N, device="cuda")
    Bm = torch.randn(B, N, device="cuda", dtype=torch.bfloat16)
    Cm = torch.randn(B, N, device="cuda", dtype=torch.bfloat16)
    Dp, dt_bias = torch.randn(Dn, device="cuda"), torch.randn(Dn, device="cuda")
    state = torch.randn(S, Dn, N, device="cuda") * 0.01
    idx = torch.randperm(S, device="cuda")[:B].int()
    out = torch.empty_like(x)

    def run(**tiling):
        return mamba1_decode(x, dt, A_log, Bm, Cm, state, idx, D=Dp, dt_bias=dt_bias, out=out,
                             **tiling)  # fmt: skip

    return run, B * Dn * N * 4


def job_mamba1_decode(B: int, Dn=MAMBA1_D, N=MAMBA1_N, requests_per_program: int = 1) -> dict:
    run, nbytes = mamba1_decode_call(B, Dn, N)
    ms = _bench(lambda: run(requests_per_program=requests_per_program))
    return {"ms": ms, "GBps": 2 * nbytes / (ms * 1e-3) / GB}


#: Largest max |ours - mamba_ssm| / max |mamba_ssm| (output, final state) the mamba1_prefill
#: check passes; bf16 outputs differ by rounding steps (~4e-3 of a value), a wrong decay or
#: skip term by tens of percent. Above it the row reads MISMATCH.
MAMBA1_CHECK_TOL = 2e-2


def _diff(name: str, ours, ref) -> dict:
    """``{name_maxabs, name_maxrel}``: max |ours - ref| and that over max |ref| (NaN stays NaN)."""
    d = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return {f"{name}_maxabs": d, f"{name}_maxrel": d / scale if scale else float("inf")}


def _check_verdict(*maxrels: float, tol: float = MAMBA1_CHECK_TOL) -> str:
    """``"ok"`` if every relative difference is at most ``tol``, else ``"MISMATCH"``; a NaN
    fails (``<=`` is False for it, where ``max()`` could drop it)."""
    return "ok" if all(r <= tol for r in maxrels) else "MISMATCH"


def _mamba_ssm_scan():
    """``(scan, provider)``: ``scan(u, delta, A, B, C, D, delta_bias=, delta_softplus=)`` returns
    ``(out, last_state)`` from mamba_ssm's CUDA selective-scan forward: the installed package
    if it imports, else the extension built from ``.ext/mamba_ssm_src`` (``mamba_ssm_scan.py``;
    the first call on a machine compiles for 1-2 minutes). Raises with the reason if
    neither is there."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as e:
        reason = f"mamba_ssm not importable ({e})"
    else:

        def scan_pkg(u, d, A, b, c, D, **kw):
            return selective_scan_fn(u, d, A, b, c, D, return_last_state=True, **kw)

        import mamba_ssm

        return scan_pkg, f"mamba_ssm {getattr(mamba_ssm, '__version__', '?')} selective_scan_fn"
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import mamba_ssm_scan

    commit = mamba_ssm_scan.source_commit()
    if commit is None:
        raise RuntimeError(
            f"skipped: {reason}, and no .ext/mamba_ssm_src to build it from "
            "(scripts/pack_mamba_ssm_src.sh on the development machine, then carry .ext)"
        )
    mod = mamba_ssm_scan.load()

    def scan_src(u, d, A, b, c, D, **kw):
        return mamba_ssm_scan.selective_scan_fwd(u, d, A, b, c, D, module=mod, **kw)

    return scan_src, f"mamba_ssm selective_scan_cuda (built from source {commit[:12]})"


def _mamba_ssm_layout(n_seq: int, *tensors):
    """Each packed ``[T, C]`` tensor as mamba_ssm's ``[n_seq, C, T / n_seq]`` (contiguous)."""
    return tuple(
        t.view(n_seq, t.shape[0] // n_seq, t.shape[1]).transpose(1, 2).contiguous() for t in tensors
    )


def _mamba1_prefill_inputs(T: int, n_seq: int, Dn: int, N: int) -> tuple:
    """``(x, dt, A_log, B, C, D, dt_bias, idx, cu)``: a Mamba1 mixer's prefill inputs (bf16
    tokens, seed 0), ``T`` tokens as ``n_seq`` equal requests in slots ``0 .. n_seq - 1``."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(T, Dn, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(T, Dn, device="cuda", dtype=torch.bfloat16) * 0.5
    A_log = torch.rand(Dn, N, device="cuda").add(0.5).log()
    Bm = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    Cm = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    Dp, dt_bias = torch.randn(Dn, device="cuda"), torch.randn(Dn, device="cuda") - 2.0
    idx = torch.arange(n_seq, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, T + 1, T // n_seq, dtype=torch.int32, device="cuda")
    return x, dt, A_log, Bm, Cm, Dp, dt_bias, idx, cu


def job_mamba1_prefill(
    T: int, n_seq: int, impl: str, Dn=MAMBA1_D, N=MAMBA1_N, block_d: int | None = None,
    time_chunk: int | None = None,
) -> dict:  # fmt: skip
    """One Mamba1 mixer's scan over ``T`` tokens in ``n_seq`` equal requests (bf16 in, fp32
    state): ``impl`` = ``ours`` | ``mamba_ssm`` | ``reference``. ``time_chunk`` (ours): passed
    to ``mamba1_scan``; nonzero, the row also diffs that output and final state against the
    sequential kernel (``time_chunk=0``) on the same inputs, from one random initial state."""
    import torch

    x, dt, A_log, Bm, Cm, Dp, dt_bias, idx, cu = _mamba1_prefill_inputs(T, n_seq, Dn, N)
    state = torch.zeros(n_seq, Dn, N, device="cuda")
    if impl == "ours":
        from attn_plugin_triton_ssm.kernels import mamba1_scan

        def run():
            return mamba1_scan(x, dt, A_log, Bm, Cm, state, idx, cu_seqlens=cu, D=Dp,
                               dt_bias=dt_bias, block_d=block_d,
                               time_chunk=time_chunk)  # fmt: skip

        if time_chunk:  # a variant: timed and checked against the walk (time_chunk=0)
            ms = _bench(run, warmup=3, rep=10)
            row: dict = {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}
            try:  # against the sequential kernel, both from one nonzero initial state
                init = torch.randn(n_seq, Dn, N, device="cuda") * 0.1
                ys, sts = [], []
                # this row's variant, then the plain walk (no chunks, no pipelining)
                for tc, bd in ((time_chunk, block_d), (0, None)):
                    st = init.clone()
                    kw = dict(cu_seqlens=cu, D=Dp, dt_bias=dt_bias, block_d=bd)
                    ys.append(mamba1_scan(x, dt, A_log, Bm, Cm, st, idx, time_chunk=tc, **kw))
                    sts.append(st)
                row.update(_diff("out", ys[0], ys[1]))
                row.update(_diff("state", sts[0], sts[1]))
                row["check"] = _check_verdict(row["out_maxrel"], row["state_maxrel"])
                row["check_against"] = "ours time_chunk=0"
            except Exception as e:
                row["check"] = f"check failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return row
    elif impl == "mamba_ssm":
        scan, provider = _mamba_ssm_scan()

        # its layout: u, delta [n_seq, D, L]; B, C [n_seq, N, L]; one call for the batch.
        # Transposed here, outside the timed call.
        u, d, b, c = _mamba_ssm_layout(n_seq, x, dt, Bm, Cm)
        A = -A_log.exp()

        def run():
            return scan(u, d, A, b, c, Dp, delta_bias=dt_bias, delta_softplus=True)

        ms = _bench(run, warmup=3, rep=10)
        row = {"provider": provider, "ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}
        try:  # our kernel on the same inputs against this output and final state
            y_ref, last_ref = run()
            from attn_plugin_triton_ssm.kernels import mamba1_scan

            st = torch.zeros(n_seq, Dn, N, device="cuda")
            y = mamba1_scan(x, dt, A_log, Bm, Cm, st, idx, cu_seqlens=cu, D=Dp,
                            dt_bias=dt_bias)  # fmt: skip
            row.update(_diff("out", y, y_ref.transpose(1, 2).reshape(T, Dn)))
            row.update(_diff("state", st, last_ref))
            row["check"] = _check_verdict(row["out_maxrel"], row["state_maxrel"])
        except Exception as e:
            row["check"] = f"check failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    elif impl == "reference":
        from attn_core.reference.ops import mamba1_selective_scan

        pool = state[..., None]
        initial = torch.zeros(n_seq, dtype=torch.bool, device="cuda")

        def run():
            return mamba1_selective_scan(
                x[..., None], dt, A_log, Bm[:, None], Cm[:, None], Dp, dt_bias, pool, cu, idx,
                initial, mode="chunked",
            )  # fmt: skip
    else:
        raise ValueError(f"impl={impl!r}")
    ms = _bench(run, warmup=3, rep=10)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


def _mamba2_prefill_inputs(T: int, n_seq: int, H=128, G=1, N=128, P=64, device: str = "cuda",
                           dtype: str = "bfloat16") -> dict:  # fmt: skip
    """Inputs of a Mamba2 mixer prefill, granite-4.0-h-small-like by default (128 heads of 64,
    state 128, one group): ``T`` tokens as ``n_seq`` requests in slots 2.. of a pool;
    ``dtype`` of ``x``, ``dt``, ``B``, ``C`` (the rest float32)."""
    import torch

    torch.manual_seed(0)
    act = getattr(torch, dtype)
    cu_cpu = torch.linspace(0, T, n_seq + 1).round().int()
    return {
        "x": torch.randn(T, H, P, device=device, dtype=act),
        "dt": torch.randn(T, H, device=device, dtype=act),
        "A_log": torch.randn(H, device=device),
        "B": torch.randn(T, G, N, device=device, dtype=act),
        "C": torch.randn(T, G, N, device=device, dtype=act),
        "D": torch.randn(H, device=device),
        "dt_bias": torch.randn(H, device=device),
        "ssm_state": torch.randn(n_seq + 4, H, N, P, device=device) * 0.01,
        "state_indices": torch.arange(n_seq, device=device, dtype=torch.int32) + 2,
        "cu_seqlens_cpu": cu_cpu,
    }


def job_mamba2_prefill(T: int, n_seq: int, impl: str, H=128, G=1, N=128, P=64,
                       chunk_size: int | None = None, precise: bool = True) -> dict:  # fmt: skip
    """granite-4.0-h-small-like Mamba2 mixer shape (128 heads of 64, state 128, one group).
    ``precise=False`` (impl="triton" only) calls the SSD kernels directly without the hi/lo
    split of their float32 dot operands."""
    from attn_plugin_triton_ssm.kernels import mamba2_prefill
    from attn_plugin_triton_ssm.kernels.ssd import mamba2_ssd_triton

    a = _mamba2_prefill_inputs(T, n_seq, H, G, N, P)
    cu_cpu = a.pop("cu_seqlens_cpu")
    cu = cu_cpu.to("cuda")

    def run():
        if not precise:
            return mamba2_ssd_triton(**a, cu_seqlens_cpu=cu_cpu, chunk_size=chunk_size or 64,
                                     precise=False)  # fmt: skip
        return mamba2_prefill(**a, cu_seqlens=cu, impl=impl, cu_seqlens_cpu=cu_cpu,
                              chunk_size=chunk_size)  # fmt: skip

    ms = _bench(run, warmup=3, rep=20)
    return {"ms": ms, "Mtok_per_s": T / (ms * 1e-3) / 1e6}


#: Largest max |ours - mamba_ssm| / max |mamba_ssm| (output, final states) the
#: mamba2_vs_mamba_ssm check passes: mamba_ssm rounds its inter-chunk states (by default) and
#: its decayed ``C B^T`` blocks to bf16 before the dots (~2^-9 of a value each), ours keeps
#: them in float32; a wrong decay, skip or state layout is off by tens of percent.
MAMBA2_CHECK_TOL = 2e-2
#: ``state_dtypes`` of :func:`job_mamba2_vs_mamba_ssm`: ``"default"`` (its ``state_dtype=None``:
#: inter-chunk states in the activations' dtype, what its Mamba2 module runs) and float32
#: (our SSD's default, the same precision as ours).
MAMBA_SSM_STATE_DTYPES = ("default", "float32")
#: Our SSD's variants beside the default that :func:`job_mamba2_vs_mamba_ssm` times in the same
#: rounds, as the triton_ssm options select them: ``ssd_states=activations`` (entering states
#: stored in bf16) and ``ssd_dots=activations`` (float32 dot operands rounded to bf16, no hi/lo
#: split, states in bf16: what mamba_ssm computes).
OUR_SSD_VARIANTS: dict[str, dict[str, object]] = {
    "ours_states_act": {"states_dtype": "activations"},
    "ours_dots_act": {"precise": False},
    "ours_no_decay_pass": {"precompute_decay": False},
    "ours_c256": {"chunk": 256},
    "ours_fused": {"fused": True},
    "ours_fused_bt32": {"fused": True, "chunk": 64, "block_t": 32},
    "ours_fused_w8": {"fused": True, "num_warps": (4, 8)},
    "ours_fused_plain": {"fused": True, "precise": False},
    "ours_fused_decay_pass": {"fused": True, "precompute_decay": True},
}


def _mamba_ssm_ssd():
    """``(mamba_chunk_scan_combined, provider)``: the installed mamba_ssm's, else the one
    ``scripts/pack_mamba_ssm_triton.sh`` packed into ``.ext/mamba_ssm_triton``
    (``mamba_ssm_ssd.py``). Raises ``RuntimeError("skipped: ...")`` with the fix if neither
    imports (einops missing included)."""
    return _bench_module("mamba_ssm_ssd").load()


def _bench_module(name: str):
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import importlib

    return importlib.import_module(name)


def _mamba_ssm_variant(sd: str) -> str:
    """The row's key prefix of one of :data:`MAMBA_SSM_STATE_DTYPES`."""
    return "mamba_ssm" if sd == "default" else f"mamba_ssm_{sd}"


def job_mamba2_vs_mamba_ssm(
    T: int, n_seq: int, layout: str = "batch", chunk_size: int = 256,
    our_chunk: int | None = None, state_dtypes: tuple[str, ...] = MAMBA_SSM_STATE_DTYPES,
    rounds: int = 5, with_ref: bool = True, impl: str = "triton", H=128, G=1, N=128, P=64,
    device: str = "cuda", dtype: str = "bfloat16",
    our_variants: tuple[str, ...] = tuple(OUR_SSD_VARIANTS),
) -> dict:  # fmt: skip
    """Our SSD prefill (``mamba2_prefill(impl="triton")`` as :func:`job_mamba2_prefill` times
    it, chunk ``our_chunk``, None: our default) against mamba_ssm's Triton
    ``mamba_chunk_scan_combined`` (chunk ``chunk_size``, each of ``state_dtypes``) at the
    granite shape, in ONE process: ``rounds`` alternating rounds of ``_bench`` each, median
    per provider; ``speed`` = our tokens/s over its. First the check: our output and final
    states from the same initial states (``layout="varlen"``: zero, see ``mamba_ssm_ssd.py``)
    against its (max abs / relative difference, ``check`` ok or MISMATCH above
    :data:`MAMBA2_CHECK_TOL`), and both against the float32 torch chunked SSD (``with_ref``).
    ``device="cpu"`` (TRITON_INTERPRET=1, MAMBA_DETERMINISTIC=1, small shapes, ``impl`` as
    wanted) runs the check only; there ``dtype="float32"``: Triton 3.9's interpreter computes
    ``tl.dot`` of bf16 operands wrong (~1e10 off), which mamba_ssm's kernels run in x's dtype.
    ``our_variants`` (names in :data:`OUR_SSD_VARIANTS`) are timed in the same rounds, each
    checked against the float32 torch SSD (``NAME_ref_out_maxrel`` ...; ``NAME_speed`` = its
    tokens/s over mamba_ssm's default)."""
    import statistics

    import torch
    from attn_plugin_triton_ssm.kernels import mamba2_prefill
    from attn_plugin_triton_ssm.kernels.ssd import DEFAULT_CHUNK, mamba2_ssd_triton

    mss = _bench_module("mamba_ssm_ssd")
    fn, provider = _mamba_ssm_ssd()
    a = _mamba2_prefill_inputs(T, n_seq, H, G, N, P, device=device, dtype=dtype)
    cu_cpu = a.pop("cu_seqlens_cpu")
    cu = cu_cpu.to(device)
    idx = a["state_indices"].long()
    if layout == "varlen":  # its initial_states would reach the first request only
        a["ssm_state"][idx] = 0.0
    state0 = a["ssm_state"].clone()
    row: dict = {"mamba_ssm": provider, "layout": layout, "chunk_size": chunk_size,
                 "our_chunk": our_chunk or DEFAULT_CHUNK, "impl": impl}  # fmt: skip

    def ours_on(state, impl=impl, chunk=our_chunk, states_dtype=None, precise=True, **ssd):
        if states_dtype == "activations":
            states_dtype = a["x"].dtype
        if ssd:  # options of the Triton SSD itself (precompute_decay ...)
            return mamba2_ssd_triton(a["x"], a["dt"], a["A_log"], a["B"], a["C"], state,
                                     a["state_indices"], cu_cpu, D=a["D"], dt_bias=a["dt_bias"],
                                     chunk_size=chunk or DEFAULT_CHUNK, precise=precise,
                                     states_dtype=states_dtype or torch.float32, **ssd)  # fmt: skip
        return mamba2_prefill(a["x"], a["dt"], a["A_log"], a["B"], a["C"], state,
                              a["state_indices"], cu, D=a["D"], dt_bias=a["dt_bias"],
                              cu_seqlens_cpu=cu_cpu, impl=impl, chunk_size=chunk,
                              states_dtype=states_dtype, precise=precise)  # fmt: skip

    # its calls, prepared (initial states gathered from state0) before ours overwrites slots
    theirs = {_mamba_ssm_variant(sd): mss.call(fn, a, cu_cpu, layout, chunk_size,
                                               None if sd == "default" else getattr(torch, sd))
              for sd in state_dtypes}  # fmt: skip
    st = state0.clone()
    y = ours_on(st)
    s_ours = st[idx]
    ref = None
    if with_ref:
        try:
            st_r = state0.clone()
            ref = (ours_on(st_r, impl="torch", chunk=None), st_r[idx])
            row.update(_diff("ours_ref_out", y, ref[0]))
            row.update(_diff("ours_ref_state", s_ours, ref[1]))
        except Exception as e:  # e.g. out of memory: the comparison with mamba_ssm stands
            row["ref_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            ref = None
    failed = []
    for name, (run, unpack) in theirs.items():
        try:
            y_m, s_m = unpack(run())
            row.update(_diff(f"{name}_out", y, y_m))
            row.update(_diff(f"{name}_state", s_ours, s_m))
            row[f"{name}_check"] = _check_verdict(row[f"{name}_out_maxrel"],
                                                  row[f"{name}_state_maxrel"],
                                                  tol=MAMBA2_CHECK_TOL)  # fmt: skip
            if ref is not None:
                row.update(_diff(f"{name}_ref_out", y_m, ref[0]))
                row.update(_diff(f"{name}_ref_state", s_m, ref[1]))
        except Exception as e:
            row[f"{name}_check"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            failed.append(name)
    for name in our_variants:
        kw = OUR_SSD_VARIANTS[name]
        try:
            st_v = state0.clone()
            y_v = ours_on(st_v, **kw)
            if ref is not None:
                row.update(_diff(f"{name}_ref_out", y_v, ref[0]))
                row.update(_diff(f"{name}_ref_state", st_v[idx], ref[1]))
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            failed.append(name)
    del y, s_ours, ref
    checks = [row[f"{_mamba_ssm_variant(sd)}_check"] for sd in state_dtypes]
    row["check"] = "ok" if all(c == "ok" for c in checks) else next(c for c in checks if c != "ok")
    if device == "cpu":  # dry run: the check only
        return row

    pool = a["ssm_state"]  # overwritten by each of our calls, as in job_mamba2_prefill
    fns = {"ours": lambda: ours_on(pool), **{n: r for n, (r, _) in theirs.items()
                                             if n not in failed}}  # fmt: skip
    for name in our_variants:
        if name not in failed:
            fns[name] = lambda kw=OUR_SSD_VARIANTS[name]: ours_on(pool, **kw)
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(_bench(f, warmup=3, rep=20))
    med = {n: statistics.median(ts) for n, ts in times.items()}
    row.update(ms=med["ours"], Mtok_per_s=T / (med["ours"] * 1e-3) / 1e6,
               ms_rounds=times["ours"])  # fmt: skip
    base = _mamba_ssm_variant("default")
    for name in fns:
        if name == "ours":
            continue
        row[f"{name}_ms"], row[f"{name}_ms_rounds"] = med[name], times[name]
        row[f"{name}_Mtok_per_s"] = T / (med[name] * 1e-3) / 1e6
        if name in OUR_SSD_VARIANTS:  # this variant's tokens/s over mamba_ssm's default
            if base in med:
                row[f"{name}_speed"] = med[base] / med[name]
        else:
            row[f"{name}_speed"] = med[name] / med["ours"]  # our tokens/s over its
    return row


#: Mamba2 SSD variants timed by ``--mamba2-sweep``, most telling first (a job cut off by the
#: budget keeps the rows it emitted). Defaults: chunk 64 (one 64-token tile per chunk),
#: ``block_t`` min(chunk, 64), 8 heads per scan program, 64 state rows, P tile 64, warps (4, 4),
#: stages (3, 1), float32 entering states split by the scan, hi/lo split, ``C B^T`` dotted in
#: the scan. Sweeps from (32 rows, warps (4, 8), stages (3, 2)) on the H200 set those at chunk
#: 64, when a chunk was one [Q, Q] tile: scan warps 4 gave 1.46x, 64 state rows 1.21x, one
#: scan stage 1.08x. Chunks 128 / 256 now run on 64-token tiles and store 2 / 4x fewer
#: entering states than chunk 64 (the traffic per token, kernels/ssd.py): the rows below pick
#: the chunk, the states' dtype and layout, the scan's warps and the cb pass. ``states_dtype``
#: is a name (the driver imports no torch).
SSD_SWEEP: list[dict] = [
    {},
    {"chunk_size": 128},
    {"chunk_size": 256},
    {"chunk_size": 64, "states_dtype": "bfloat16"},
    {"chunk_size": 128, "states_dtype": "bfloat16"},
    {"chunk_size": 256, "states_dtype": "bfloat16"},
    {"chunk_size": 64, "precise": False},
    {"chunk_size": 128, "precise": False},
    {"chunk_size": 256, "precise": False},
    {"chunk_size": 64, "split_states": True},
    {"chunk_size": 256, "split_states": True},
    {"chunk_size": 256, "split_states": True, "num_warps": (4, 8)},
    {"chunk_size": 128, "num_warps": (4, 8)},
    {"chunk_size": 256, "num_warps": (4, 8)},
    {"chunk_size": 128, "precompute_cb": True},
    {"chunk_size": 256, "precompute_cb": True},
    {"chunk_size": 128, "precompute_cb": True, "num_warps": (4, 8)},
    {"chunk_size": 256, "precompute_cb": True, "num_warps": (4, 8)},
    {"chunk_size": 256, "block_t": 32},
    {"chunk_size": 256, "block_t": 32, "num_warps": (4, 8)},
    {"chunk_size": 256, "block_t": 32, "precompute_cb": True, "num_warps": (4, 8)},
    {"chunk_size": 256, "heads_per_program": 4},
    {"chunk_size": 256, "heads_per_program": 2},
    {"chunk_size": 256, "num_stages": (3, 2)},
    {"chunk_size": 256, "block_n": 32},
    {"chunk_size": 64, "num_warps": (4, 8)},
    {"chunk_size": 256, "precise": False, "states_dtype": "bfloat16", "num_warps": (4, 8)},
    {"chunk_size": 256, "precise": False, "states_dtype": "bfloat16", "precompute_cb": True,
     "num_warps": (4, 8)},
]  # fmt: skip


def _rel(a, b) -> float:
    """max |a - b| / max |b| (float32)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def job_mamba2_sweep(T: int, n_seq: int, emit, H=128, G=1, N=128, P=64) -> dict:
    """The Triton SSD at the granite shape in each :data:`SSD_SWEEP` variant. Each variant's
    output and final states are first compared with the default's from the same initial
    states (``maxrel_default``: max |difference| / max |default|) and with the float32 torch
    chunked SSD (``maxrel_ref``, ``impl="torch"``, where it ran), so a variant that is fast
    but wrong shows. One row is emitted per variant as soon as it is timed."""
    import torch
    from attn_plugin_triton_ssm.kernels import mamba2_prefill
    from attn_plugin_triton_ssm.kernels.ssd import mamba2_ssd_triton

    a = _mamba2_prefill_inputs(T, n_seq, H, G, N, P)
    state0 = a.pop("ssm_state")
    sl = a["state_indices"].long()

    def run(state, opts):
        kw = dict(opts)
        if "states_dtype" in kw:
            kw["states_dtype"] = getattr(torch, kw["states_dtype"])
        return mamba2_ssd_triton(**a, ssm_state=state, **kw)

    ref_state = state0.clone()
    ref_y = run(ref_state, {}).float()
    torch_ref = None
    try:
        st = state0.clone()
        cu_cpu = a["cu_seqlens_cpu"]
        y_t = mamba2_prefill(a["x"], a["dt"], a["A_log"], a["B"], a["C"], st,
                             a["state_indices"], cu_cpu.to(a["x"].device), D=a["D"],
                             dt_bias=a["dt_bias"], cu_seqlens_cpu=cu_cpu, impl="torch")  # fmt: skip
        torch_ref = (y_t.float(), st[sl])
        del y_t
    except Exception as exc:  # e.g. out of memory: the default comparison still stands
        emit({"section": "mamba2_sweep", "T": T, "n_seq": n_seq, "provider": "torch reference",
              "error": f"{type(exc).__name__}: {str(exc)[:120]}"})  # fmt: skip
    for opts in SSD_SWEEP:
        name = " ".join(f"{k}={v}" for k, v in opts.items()) or "default"
        row = {"section": "mamba2_sweep", "T": T, "n_seq": n_seq, "provider": name}
        try:
            state = state0.clone()
            y = run(state, opts).float()
            row["maxrel_default"] = max(_rel(y, ref_y), _rel(state[sl], ref_state[sl]))
            if torch_ref is not None:
                row["maxrel_ref"] = max(_rel(y, torch_ref[0]), _rel(state[sl], torch_ref[1]))
            del y
            ms = _bench(lambda opts=opts, state=state: run(state, opts), warmup=3, rep=20)
            row.update(ms=ms, Mtok_per_s=T / (ms * 1e-3) / 1e6)
        except Exception as exc:  # a variant that does not compile or fit is reported
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        emit(row)
    return {"provider": "done", "variants": len(SSD_SWEEP)}


def job_l2norm_sweep(T: int) -> dict:
    """``l2norm_qk`` of Qwen3-Next's q and k (``[T, 16, 128]`` bf16) per (block_rows,
    num_warps): GB/s of read + write, and max |error| against torch in float32."""
    import torch
    from attn_plugin_triton_ssm.kernels.gdn_chunk import l2norm_qk

    q = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16) * 0.1
    want = [(x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)) for x in (q, k)]
    nbytes = 4 * q.numel() * q.element_size()
    res = {}
    for br in (8, 16, 32, 64, 128):
        for nw in (2, 4, 8):
            name = f"rows={br} warps={nw}"
            got = l2norm_qk(q, k, block_rows=br, num_warps=nw)
            errs = [(g.float() - w).abs().max().item() for g, w in zip(got, want, strict=True)]
            res[f"err[{name}]"] = max(errs)
            ms = _bench(lambda br=br, nw=nw: l2norm_qk(q, k, block_rows=br, num_warps=nw))
            res[f"GBps[{name}]"] = nbytes / (ms * 1e-3) / GB
    return res


def job_plugin_step(B: int, layers: int = 4, device: str = "cuda", hk=HK, hv=HV, d=D) -> dict:
    """A GDN decode step (conv1d + recurrent update) of ``layers`` layers, B requests, through
    the runtime's bindings vs the same triton_ssm kernels called directly on the same tensors.
    ``device="cpu"`` (with TRITON_INTERPRET=1 and small shapes) dry-runs the job's code."""
    import torch
    from attn_plugin_triton_ssm import kernels as K

    from attn_core.batch import BatchBuilder
    from attn_core.registry import Registry
    from attn_core.runtime import AttentionRuntime
    from attn_core.selector import select
    from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, group_layers
    from attn_core.state import PersistentState

    channels = 2 * hk * d + hv * d
    spec = LayerSpec(kind="linear", linear_variant="gated_deltanet", num_heads=hv,
                     num_kv_heads=hk, head_dim=d, head_dim_v=d, conv_kernel_size=4,
                     conv_channels=channels, dtype="bfloat16", state_dtype="float32",
                     qk_l2norm=True)  # fmt: skip
    groups = group_layers([spec] * layers)
    registry = Registry.discover()
    constraints = ExecutionConstraints(
        max_batch_size=B, max_num_tokens=B, force={"linear": "triton_ssm:triton_ssm"}
    )
    plan = select(groups, registry, DeviceCapabilities.detect(device), constraints)
    state = PersistentState(groups, num_pages=1, num_slots=B + 8, device=device)
    runtime = AttentionRuntime(plan, registry, state=state, device=device)
    builder = BatchBuilder(
        state, max_batch_size=B, max_num_tokens=B, max_pages_per_request=1, device=device
    )
    for req in range(B):
        state.add_request(req)
        state.advance(req, 3)  # as if prefilled: decode reads the slots' (random) state
    batch = builder.build([(r, 1) for r in range(B)])
    runtime.prepare(batch)
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x = r(B, channels)
    w, bias = r(channels, 4), r(channels)
    q, k, v = r(B, hk, d), r(B, hk, d), r(B, hv, d)
    g = -torch.rand(B, hv, generator=gen, device=device) * 0.5
    beta = torch.rand(B, hv, generator=gen, device=device)
    conv_out, out = torch.empty_like(x), torch.empty_like(v)
    bindings = [runtime.binding(i) for i in range(layers)]
    idx = batch.state_indices

    def through_plugin():
        for b in bindings:
            b.conv1d(x, w, bias, out=conv_out)
            b.forward(q, k, v, out=out, g=g, beta=beta)

    def direct():
        for i in range(layers):
            st = state.state_slots.layer(i)
            K.causal_conv1d_update(x, st.conv, w, bias, idx, activation="silu", out=conv_out)
            K.gdn_decode(q, k, v, g, beta, st.ssm, idx, scale=d**-0.5, use_qk_l2norm=True,
                         out=out)  # fmt: skip

    if device == "cpu":  # dry run: one call each
        through_plugin(), direct()
        return {"ok": True}
    from attn_core.bench_util import capture_graph

    # Eager (host launch cost included, which is the plugin's per-call Python) and each step
    # captured in a CUDA graph (what a server replays: GPU time only). Interleaved, so clock or
    # thermal drift hits both alike.
    graphs = {"plugin": capture_graph(through_plugin), "direct": capture_graph(direct)}
    fns = {"plugin": through_plugin, "direct": direct}
    times: dict[str, list[float]] = {
        k: [] for k in ("plugin", "direct", "plugin_graph", "direct_graph")
    }
    for _ in range(3):
        for how in ("plugin", "direct"):
            times[how].append(_bench(fns[how]))
            times[f"{how}_graph"].append(_bench(graphs[how].replay))
    best = {k: min(v) for k, v in times.items()}
    return {"ms": best["plugin"], "direct_ms": best["direct"],
            "ratio": best["plugin"] / best["direct"],
            "graph_ms": best["plugin_graph"], "graph_direct_ms": best["direct_graph"],
            "graph_ratio": best["plugin_graph"] / best["direct_graph"],
            "layers": layers}  # fmt: skip


def job_mamba1_lanes(T: int, n_seq: int, rounds: int = 5, Dn=MAMBA1_D, N=MAMBA1_N) -> dict:
    """Mamba1 prefill (T tokens as ``n_seq`` equal requests, bf16 in, fp32 state, z gate): the
    lanes kernel (a channel a thread) as the walk and chunked, the tile kernel's default and
    mamba_ssm's CUDA selective scan, timed in ``rounds`` alternating rounds in this process
    (medians). Each of ours is diffed against the tile kernel's walk from one random initial
    state; the lanes default against mamba_ssm from zero."""
    import statistics

    import torch
    from attn_plugin_triton_ssm.kernels import mamba1_scan

    x, dt, A_log, Bm, Cm, Dp, dt_bias, idx, cu = _mamba1_prefill_inputs(T, n_seq, Dn, N)
    z = torch.randn(T, Dn, device="cuda", dtype=torch.bfloat16)
    init = torch.randn(n_seq, Dn, N, device="cuda") * 0.1
    ours: dict[str, dict[str, object]] = {
        "tiles default": dict(lanes=False),
        "tiles walk": dict(lanes=False, time_chunk=0),
        "lanes default": dict(lanes=True),
        "lanes walk": dict(lanes=True, time_chunk=0),
        "lanes walk block_d=128": dict(lanes=True, time_chunk=0, block_d=128),
        "lanes chunk 128": dict(lanes=True, time_chunk=128),
        "lanes chunk 256": dict(lanes=True, time_chunk=256),
        "lanes chunk 512": dict(lanes=True, time_chunk=512),
        "lanes chunk 256 block_d=128": dict(lanes=True, time_chunk=256, block_d=128),
    }
    state = torch.zeros(n_seq, Dn, N, device="cuda")

    def call(st, **kw):
        return mamba1_scan(x, dt, A_log, Bm, Cm, st, idx, cu_seqlens=cu, D=Dp, dt_bias=dt_bias,
                           z=z, **kw)  # fmt: skip

    def checked(out, want_out, st, want_st) -> tuple:
        """``(out max rel, state max rel, verdict)``."""
        d = {**_diff("out", out, want_out), **_diff("state", st, want_st)}
        return d["out_maxrel"], d["state_maxrel"], _check_verdict(d["out_maxrel"],
                                                                   d["state_maxrel"])  # fmt: skip

    fns: dict[str, Callable[..., Any]] = {
        name: (lambda kw=kw: call(state, **kw)) for name, kw in ours.items()
    }
    row: dict = {"checks": {}}
    want_st = init.clone()
    want = call(want_st, lanes=False, time_chunk=0)  # the tile walk: what the others match
    for name, kw in ours.items():
        if name != "tiles walk":
            st = init.clone()
            row["checks"][name] = checked(call(st, **kw), want, st, want_st)
    try:
        scan, provider = _mamba_ssm_scan()
        u, d_, zz, b, c = _mamba_ssm_layout(n_seq, x, dt, z, Bm, Cm)
        A = -A_log.exp()
        fns["mamba_ssm"] = lambda: scan(u, d_, A, b, c, Dp, z=zz, delta_bias=dt_bias,
                                        delta_softplus=True)  # fmt: skip
        row["mamba_ssm_provider"] = provider
        y_ref, last_ref = fns["mamba_ssm"]()
        st = torch.zeros(n_seq, Dn, N, device="cuda")
        y = call(st, lanes=True)
        row["checks"]["lanes default vs mamba_ssm"] = checked(
            y, y_ref.transpose(1, 2).reshape(T, Dn), st, last_ref
        )
    except Exception as e:  # reported; ours are timed without it
        row["mamba_ssm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_bench(fn, warmup=3, rep=20))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best_lanes = min((n for n in med if n.startswith("lanes")), key=med.__getitem__)
    row.update(variants_ms=med, rounds=rounds, best=best_lanes, ms=med[best_lanes],
               Mtok_per_s=T / (med[best_lanes] * 1e-3) / 1e6)  # fmt: skip
    return row


JOBS: dict[str, Callable[..., dict]] = {
    "copy": job_copy,
    "mamba1_lanes": job_mamba1_lanes,
    "gdn_decode_ours": job_gdn_decode_ours,
    "gdn_decode_fla": job_gdn_decode_fla,
    "prefill_ours": job_prefill_ours,
    "prefill_fla": job_prefill_fla,
    "prefill_profile": job_prefill_profile,
    "gdn_solve": job_gdn_solve,
    "kda_prefill": job_kda_prefill,
    "mamba2_sweep": job_mamba2_sweep,
    "l2norm_sweep": job_l2norm_sweep,
    "mamba2_decode": job_mamba2_decode,
    "mamba2_prefill": job_mamba2_prefill,
    "mamba2_vs_mamba_ssm": job_mamba2_vs_mamba_ssm,
    "mamba1_decode": job_mamba1_decode,
    "mamba1_prefill": job_mamba1_prefill,
    "plugin_step": job_plugin_step,
    "lightning_decode": job_lightning_decode,
    "lightning_prefill": job_lightning_prefill,
    "short_conv_decode": job_short_conv_decode,
}


#: Jobs that emit rows as they go (``emit`` keyword), so that a job cut off by the budget or
#: by a fault keeps what it measured.
_EMITTING = {"mamba2_sweep"}


def worker(jobs: list[dict]) -> int:
    """Run ``jobs`` (``{"id", "fn", "kw", "row"}``) in order; one JSON line per result."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    def emit(row: dict) -> None:
        print("@@ROW " + json.dumps(row), flush=True)

    import torch
    import triton

    meta = {"torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
    try:
        import fla

        meta["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        meta["fla"] = None
    emit({"meta": meta})

    for job in jobs:
        t0 = time.time()
        row = dict(job["row"])
        if job["fn"] == "gdn_decode_sweep":
            res = job_gdn_decode_sweep(job["kw"]["batches"], emit)
        else:
            kw = dict(job["kw"], emit=emit) if job["fn"] in _EMITTING else job["kw"]
            try:
                res = JOBS[job["fn"]](**kw)
            except Exception as e:  # not a fault: the context is still usable
                res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                       "traceback": traceback.format_exc(limit=3)}  # fmt: skip
        row.update(res)
        row["wall_s"] = round(time.time() - t0, 2)
        print("@@DONE " + json.dumps({"id": job["id"], "row": row}), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# driver side: no CUDA in this process
# --------------------------------------------------------------------------------------------
def run_isolated(jobs: list[dict], results: list[dict], timeout_s: float) -> None:
    """Run ``jobs`` in worker subprocesses; a worker that dies (fault, timeout) marks its current
    job as failed and a fresh worker continues with the rest."""
    pending = list(jobs)
    deadline = time.time() + timeout_s
    while pending:
        left = deadline - time.time()
        if left <= 1:
            for job in pending:
                results.append({**job["row"], "error": "skipped: bench time budget spent"})
                print(json.dumps(results[-1]), flush=True)
            return
        cmd = [sys.executable, __file__, "--worker", json.dumps(pending)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = "timeout", -9
        done = set()
        for line in stdout.splitlines():
            if line.startswith("@@ROW "):
                results.append(json.loads(line[6:]))
                print(json.dumps(results[-1]), flush=True)
            elif line.startswith("@@DONE "):
                rec = json.loads(line[7:])
                done.add(rec["id"])
                results.append(rec["row"])
                shown = {k: v for k, v in rec["row"].items() if k != "traceback"}
                print(json.dumps(shown), flush=True)
        pending = [j for j in pending if j["id"] not in done]
        if pending and rc != 0:
            failed = pending.pop(0)
            tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
            results.append(
                {**failed["row"], "error": f"worker died (rc={rc}): " + " | ".join(tail)}
            )
            print(json.dumps(results[-1]), flush=True)
        elif pending:  # exited cleanly without finishing: should not happen
            break


def _vs_mamba_ssm_text(r: dict) -> str:
    """The mamba2_vs_mamba_ssm row's lines after our ms and Mtok/s: each mamba_ssm variant's
    rate, our rate over it, the differences to it and the check; the float32 torch
    reference's differences."""

    def rel(key: str) -> str:
        return f"{r[key]:.1e}" if key in r else "-"

    val = f"  ({r.get('mamba_ssm', '?')}, {r.get('layout')}, its chunk {r.get('chunk_size')}, ours "
    val += f"{r.get('our_chunk')})"
    for sd in MAMBA_SSM_STATE_DTYPES:
        name = _mamba_ssm_variant(sd)
        if f"{name}_check" not in r and f"{name}_ms" not in r:
            continue
        states = "its default states" if sd == "default" else f"state_dtype={sd}"
        line = f"\n{'':<16}mamba_ssm ({states}): "
        if f"{name}_ms" in r:
            line += (f"{r[f'{name}_ms']:.3f} ms  {r[f'{name}_Mtok_per_s']:.2f} Mtok/s, ours "
                     f"{r[f'{name}_speed']:.2f} x its rate")  # fmt: skip
        else:
            line += "not timed"
        line += (f"; ours vs it: out rel {rel(f'{name}_out_maxrel')}, state rel "
                 f"{rel(f'{name}_state_maxrel')} {r.get(f'{name}_check', '')}")  # fmt: skip
        if f"{name}_ref_out_maxrel" in r:
            line += (f"; it vs float32 torch: out rel {rel(f'{name}_ref_out_maxrel')}, state rel "
                     f"{rel(f'{name}_ref_state_maxrel')}")  # fmt: skip
        val += line
    for name, kw in OUR_SSD_VARIANTS.items():
        if f"{name}_ms" not in r and f"{name}_error" not in r:
            continue
        opt = ", ".join(f"{k}={v}" for k, v in kw.items())
        line = f"\n{'':<16}ours ({opt}): "
        if f"{name}_error" in r:
            line += f"failed: {r[f'{name}_error']}"
        else:
            line += f"{r[f'{name}_ms']:.3f} ms  {r[f'{name}_Mtok_per_s']:.2f} Mtok/s"
            if f"{name}_speed" in r:
                line += f", {r[f'{name}_speed']:.2f} x mamba_ssm's rate (its default states)"
        if f"{name}_ref_out_maxrel" in r:
            line += (f"; vs float32 torch: out rel {rel(f'{name}_ref_out_maxrel')}, state rel "
                     f"{rel(f'{name}_ref_state_maxrel')}")  # fmt: skip
        val += line
    if "ours_ref_out_maxrel" in r:
        val += (f"\n{'':<16}ours vs float32 torch: out rel {rel('ours_ref_out_maxrel')}, state "
                f"rel {rel('ours_ref_state_maxrel')}")  # fmt: skip
    elif "ref_error" in r:
        val += f"\n{'':<16}float32 torch reference: {r['ref_error'][:100]}"
    return val


def _mamba1_lanes_text(r: dict) -> str:
    """Every variant's median ms, its rate over mamba_ssm's and the tile default's, and its
    check."""
    med = r["variants_ms"]
    val = f"  best: {r['best']}, {r['rounds']} alternating rounds, medians"
    for name, ms in med.items():
        val += f"\n{'':<16}{name:<28} {ms:7.3f} ms"
        if "mamba_ssm" in med and name != "mamba_ssm":
            val += f"  {med['mamba_ssm'] / ms:5.2f} x mamba_ssm's rate"
        if name.startswith("lanes"):
            val += f"  {med['tiles default'] / ms:5.2f} x the tile default's"
        if name in r["checks"]:
            out, st, verdict = r["checks"][name]
            val += f"  vs tiles walk: out rel {out:.1e}, state rel {st:.1e} {verdict}"
    for name in ("lanes default vs mamba_ssm",):
        if name in r["checks"]:
            out, st, verdict = r["checks"][name]
            val += f"\n{'':<16}{name}: out rel {out:.1e}, state rel {st:.1e} {verdict}"
    if "mamba_ssm_error" in r:
        val += f"\n{'':<16}mamba_ssm: {r['mamba_ssm_error']}"
    elif "mamba_ssm_provider" in r:
        val += f"\n{'':<16}({r['mamba_ssm_provider']})"
    return val


def _table(results: list, copy_bw: float | None) -> str:
    lines = []
    for r in results:
        if "section" not in r:
            continue
        head = ", ".join(
            f"{k}={r[k]}"
            for k in ("provider", "B", "T", "n_seq", "nbytes", "block_v", "num_warps",
                      "programs_per_sm")
            if r.get(k) is not None
        )  # fmt: skip
        if "error" in r:
            val = "ERROR " + r["error"][:160]
        elif "GBps" in r:
            val = f"{r['ms']:.4f} ms  {r['GBps']:8.1f} GB/s"
            if copy_bw and r["section"] != "copy":
                val += f"  ({r['GBps'] / copy_bw:.2f} x copy)"
        elif "Mtok_per_s" in r:
            val = f"{r['ms']:.3f} ms  {r['Mtok_per_s']:.2f} Mtok/s"
            if r["section"] == "lightning_prefill" and r.get("provider") == "ours":
                fla = next((f["Mtok_per_s"] for f in results if f.get("section") == r["section"]
                            and f.get("provider") == "fla chunk_simple_gla"
                            and (f.get("T"), f.get("n_seq")) == (r["T"], r["n_seq"])
                            and "Mtok_per_s" in f), None)  # fmt: skip
                if fla:
                    val += f"  ({r['Mtok_per_s'] / fla:.2f} x fla)"
            if r["section"] == "mamba2_prefill":
                fla = next((f["Mtok_per_s"] for f in results if f.get("section") == r["section"]
                            and f.get("provider", "").startswith("impl=fla")
                            and (f.get("T"), f.get("n_seq")) == (r["T"], r["n_seq"])
                            and "Mtok_per_s" in f), None)  # fmt: skip
                if fla and not r["provider"].startswith("impl=fla"):
                    val += f"  ({r['Mtok_per_s'] / fla:.2f} x fla)"
                val += f"  ({r['Mtok_per_s'] / MAMBA2_PUBLISHED_MTOK:.2f} x published fused SSD)"
            if r["section"] == "mamba1_prefill" and "check" in r:
                if "out_maxrel" in r:
                    who = f"vs {r['check_against']}" if "check_against" in r else "ours vs it"
                    val += (f"  {who}: out max|d| {r['out_maxabs']:.1e} (rel "
                            f"{r['out_maxrel']:.1e}), state max|d| {r['state_maxabs']:.1e} "
                            f"(rel {r['state_maxrel']:.1e})")  # fmt: skip
                if r["check"] != "ok":
                    val += f"  {r['check']}"
            if r["section"] == "mamba2_vs_mamba_ssm":
                val += _vs_mamba_ssm_text(r)
            if r["section"] == "mamba1_lanes":
                val += _mamba1_lanes_text(r)
            if r["section"] == "mamba2_sweep":
                val += f"  ({r['Mtok_per_s'] / MAMBA2_PUBLISHED_MTOK:.2f} x published fused SSD)"
                val += f"  max rel. diff: to default {r.get('maxrel_default', float('nan')):.1e}"
                val += f", to float32 torch {r.get('maxrel_ref', float('nan')):.1e}"
            if "ratio_to_fla" in r:
                val += f"  fla (same process, interleaved) {r['fla_ms']:.3f} ms, ratio "
                val += f"{r['ratio_to_fla']:.3f}"
            if "ratio_to_gather" in r:
                val += f"; fla + gather/scatter {r['gather_ms']:.3f} ms, ratio "
                val += f"{r['ratio_to_gather']:.3f}"
            if "graph_ratio_to_fla" in r:
                val += f"; CUDA graphs: ours {r['graph_ms']:.3f} ms, fla {r['graph_fla_ms']:.3f} "
                val += f"ms, ratio {r['graph_ratio_to_fla']:.3f}"
            if "graph_ratio_to_gather" in r:
                val += f", fla + gather/scatter {r['graph_gather_ms']:.3f} ms, ratio "
                val += f"{r['graph_ratio_to_gather']:.3f}"
            elif "graph_error" in r:
                val += f"; no CUDA graph ({r['graph_error'][:80]})"
            if "graph_out_given_ratio_to_fla" in r:
                val += f"\n{'':<16}out given: {r['graph_out_given_ms']:.3f} ms, ratio to fla "
                val += f"{r['graph_out_given_ratio_to_fla']:.3f} (CUDA graphs)"
            for key, ms in r.items():
                if key.startswith("graph_ms["):
                    ms = f"{ms:.3f} ms" if isinstance(ms, float) else ms
                    val += f"\n{'':<16}{key[len('graph_ms[') : -1]}: {ms}"
        elif "ratio" in r:
            val = f"plugin {r['ms']:.4f} ms  direct {r['direct_ms']:.4f} ms  ratio {r['ratio']:.3f}"
            if "graph_ratio" in r:
                val += (f"; graphs {r['graph_ms']:.4f} / {r['graph_direct_ms']:.4f} ms"
                        f"  ratio {r['graph_ratio']:.3f}")  # fmt: skip
        elif r["section"] == "mamba2_sweep":  # the job's closing row: its rows came before
            continue
        elif r["section"] == "l2norm_sweep":
            val = "".join(
                f"\n{'':<16}{key[len('GBps[') : -1]}: {bw:.0f} GB/s  "
                f"(max err {r[key.replace('GBps', 'err')]:.1e})"
                for key, bw in r.items()
                if key.startswith("GBps[")
            )
        elif r["section"] == "gdn_solve":
            val = "".join(
                f"\n{'':<16}{key[3:-1]}: {us:.1f} us"
                + (
                    f"  ({r[f'ratio_to_fla[{key[3:-1]}]']:.3f} of fla,"
                    f" max diff {r[f'maxdiff[{key[3:-1]}]']:.1e})"
                    if key != "us[fla]"
                    else ""
                )
                if isinstance(us, float)
                else f"\n{'':<16}{key[3:-1]}: {us}"
                for key, us in r.items()
                if key.startswith("us[")
            )
        elif r["section"] == "prefill_profile":
            val = ""
            for key, prof in r.items():
                if key.startswith("kernels["):
                    val += f"\n{'':<16}{key[len('kernels[') : -1]}: {prof['total_us']} us GPU"
                    for name, us, count in prof["top"]:
                        val += f"\n{'':<20}{us:8.1f} us  x{count}  {name}"
        else:
            continue
        lines.append(f"{r['section']:<14} {head:<72} {val}")
    return "\n".join(lines)


def _vs_mamba_ssm_jobs(
    job,
    chunk_size: int = 256,
    our_chunk: int | None = None,
    tokens: tuple[int, ...] = (8192, 32768),
) -> list[dict]:
    """The mamba2_vs_mamba_ssm jobs: each of ``tokens`` as one request and as 16 of equal
    length, mamba_ssm given them as its batch; the 16 also as one packed row (``seq_idx``,
    what a server's mixed batch passes). ``job`` is ``main``'s job builder."""
    jobs = []
    for T in tokens:
        for n_seq in (1, 16):
            for layout in ("batch", "varlen") if n_seq > 1 else ("batch",):
                p = {"section": "mamba2_vs_mamba_ssm", "T": T, "n_seq": n_seq,
                     "provider": f"ours vs mamba_ssm {layout}"}  # fmt: skip
                jobs.append(job("mamba2_vs_mamba_ssm", p, T=T, n_seq=n_seq, layout=layout,
                                chunk_size=chunk_size, our_chunk=our_chunk))  # fmt: skip
    return jobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="B = 64 and 1024 only")
    ap.add_argument("--sweep", action="store_true", help="sweep block_v/num_warps/programs_per_sm")
    ap.add_argument("--prefill", action="store_true", help="also the prefill section")
    ap.add_argument("--no-fla", action="store_true", help="skip the fla comparisons")
    ap.add_argument("--plugin", action="store_true", help="plugin step vs direct kernels")
    ap.add_argument(
        "--profile", action="store_true", help="GPU time per kernel of the prefill pipelines"
    )
    ap.add_argument(
        "--mamba2-sweep", action="store_true", help="Triton SSD tilings at the granite shape"
    )
    ap.add_argument("--l2norm-sweep", action="store_true", help="l2norm_qk block sizes")
    ap.add_argument(
        "--vs-mamba-ssm", action="store_true",
        help="our SSD against mamba_ssm's Triton mamba_chunk_scan_combined (section "
        "mamba2_vs_mamba_ssm; also run by --only mamba2_vs_mamba_ssm)",
    )  # fmt: skip
    ap.add_argument(
        "--mamba-ssm-chunk",
        type=int,
        default=256,
        help="mamba2_vs_mamba_ssm: mamba_ssm's chunk_size (256: its Mamba2 default)",
    )
    ap.add_argument(
        "--our-chunk",
        type=int,
        default=None,
        help="mamba2_vs_mamba_ssm: our SSD's chunk_size (default: ours)",
    )
    ap.add_argument(
        "--vs-mamba-ssm-tokens",
        default="8192,32768",
        help="mamba2_vs_mamba_ssm: the token counts, comma-separated",
    )
    ap.add_argument(
        "--gdn-variants",
        help="gdn_prefill: time only the variants whose names start with one of these "
        "(separated by commas without a space, since names hold ', ': e.g. "
        "'out given,wy in pass, pass BV=32,pass BV=64'); default: each alternative at its "
        "default tiling, no tiling sweep",
    )
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget")
    ap.add_argument(
        "--only",
        help="comma-separated sections to run (gdn_decode, mamba2_decode, mamba1_decode, "
        "gdn_prefill, gdn_solve, kda_prefill, mamba2_prefill, mamba2_vs_mamba_ssm, mamba1_prefill, "
        "mamba1_chunk_rule, mamba1_lanes, "
        "lightning_decode, "
        "lightning_prefill, short_conv_decode, plugin_step); the copy rows always run",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.out is None:
        ap.error("--out is required")

    t0 = time.time()
    batches = [64, 1024] if args.quick else BATCHES
    n = iter(range(10**6))

    def job(fn: str, row: dict, **kw) -> dict:
        return {"id": next(n), "fn": fn, "kw": kw, "row": row}

    ours = [job("copy", {"section": "copy", "provider": "torch.clone", "nbytes": 2**30},
                nbytes=2**30)]  # fmt: skip
    for B in batches:
        nb = _state_bytes(B) // 2
        ours.append(job("copy", {"section": "copy", "provider": "torch.clone", "nbytes": nb},
                        nbytes=nb))  # fmt: skip
    for B in batches:
        ours.append(job("gdn_decode_ours", {"section": "gdn_decode", "provider": "ours default",
                                            "B": B}, B=B))  # fmt: skip
    for B in batches:
        ours.append(job("mamba2_decode", {"section": "mamba2_decode", "provider": "ours",
                                          "B": B}, B=B))  # fmt: skip
    for B in batches:
        ours.append(job("lightning_decode", {"section": "lightning_decode", "provider": "ours",
                                             "B": B}, B=B, provider="ours"))  # fmt: skip
        ours.append(job("short_conv_decode", {"section": "short_conv_decode",
                                              "provider": "ours", "B": B}, B=B))  # fmt: skip
        ours.append(job("mamba1_decode", {"section": "mamba1_decode", "provider": "ours",
                                          "B": B}, B=B))  # fmt: skip
        for rpp in (2, 4):  # A_log shared by rpp requests per program: does it pay?
            ours.append(job("mamba1_decode", {"section": "mamba1_decode", "B": B,
                                              "provider": f"ours requests_per_program={rpp}"},
                            B=B, requests_per_program=rpp))  # fmt: skip
    if args.sweep:
        ours.append(job("gdn_decode_sweep", {"section": "sweep_done"}, batches=batches))
    fla = [
        job(
            "gdn_decode_fla",
            {"section": "gdn_decode", "provider": "fla fused_recurrent", "B": B},
            B=B,
        )
        for B in batches
    ] + [
        job(
            "lightning_decode",
            {"section": "lightning_decode", "provider": "fla fused_recurrent_simple_gla", "B": B},
            B=B,
            provider="fla",
        )
        for B in batches
    ]
    prefill = []
    if "gdn_solve" in (args.only or "").split(","):
        for T, n_seq in ((8192, 1), (32768, 16)):
            p = {"section": "gdn_solve", "T": T, "n_seq": n_seq}
            prefill.append(job("gdn_solve", p, T=T, n_seq=n_seq))
    # a comma followed by a space is part of a name ("wy in pass, pass BV=..."), not a separator
    gdn_variants = re.split(r",(?! )", args.gdn_variants) if args.gdn_variants else None
    if args.prefill:
        for T in [8192] if args.quick else [8192, 32768]:
            for n_seq in (1, 16):
                p = {"section": "gdn_prefill", "T": T, "n_seq": n_seq}
                prefill.append(job("prefill_ours", {**p, "provider": "ours (gdn_prefill)"},
                                   T=T, n_seq=n_seq, with_fla=not args.no_fla,
                                   variants_only=gdn_variants))  # fmt: skip
                if not args.no_fla:
                    prefill.append(job("prefill_fla", {**p, "provider": "fla chunk direct"},
                                       T=T, n_seq=n_seq))  # fmt: skip
    if args.prefill and not args.no_fla:  # each KDA row times fla beside ours
        for T in [8192] if args.quick else [8192, 32768]:
            for n_seq in (1, 16):
                p = {"section": "kda_prefill", "T": T, "n_seq": n_seq}
                prefill.append(job("kda_prefill", {**p, "provider": "ours (kda_prefill)"},
                                   T=T, n_seq=n_seq))  # fmt: skip

    if args.prefill:
        for T in [8192] if args.quick else [8192, 32768]:
            for n_seq in (1, 16):
                p = {"section": "mamba2_prefill", "T": T, "n_seq": n_seq}
                prefill.append(job("mamba2_prefill", {**p, "provider": "impl=fla (simple_gla)"},
                                   T=T, n_seq=n_seq, impl="fla"))  # fmt: skip
                for chunk in (64, 128, 256):
                    prefill.append(job("mamba2_prefill",
                                       {**p, "provider": f"impl=triton chunk {chunk}"}, T=T,
                                       n_seq=n_seq, impl="triton", chunk_size=chunk))  # fmt: skip
                    prefill.append(job("mamba2_prefill",
                                       {**p, "provider": f"impl=triton chunk {chunk} no hi/lo"},
                                       T=T, n_seq=n_seq, impl="triton", chunk_size=chunk,
                                       precise=False))  # fmt: skip
        p = {"section": "mamba2_prefill", "T": 8192, "n_seq": 1, "provider": "impl=torch"}
        prefill.append(job("mamba2_prefill", p, T=8192, n_seq=1, impl="torch"))
        for T in [8192] if args.quick else [8192, 32768]:
            for n_seq in (1, 16):
                p = {"section": "lightning_prefill", "T": T, "n_seq": n_seq}
                for name, provider in (("ours", "ours"), ("fla chunk_simple_gla", "fla")):
                    if provider == "fla" and args.no_fla:
                        continue
                    prefill.append(job("lightning_prefill", {**p, "provider": name}, T=T,
                                       n_seq=n_seq, provider=provider))  # fmt: skip
        for n_seq in (1, 16):
            p = {"section": "mamba1_prefill", "T": 8192, "n_seq": n_seq}
            for impl in ("ours", "mamba_ssm"):
                prefill.append(job("mamba1_prefill", {**p, "provider": impl}, T=8192,
                                   n_seq=n_seq, impl=impl))  # fmt: skip
            for L in (128, 256, 512):  # time-chunked (off by default): which L, if any, wins?
                prefill.append(job("mamba1_prefill", {**p, "provider": f"ours time_chunk={L}"},
                                   T=8192, n_seq=n_seq, impl="ours", time_chunk=L))  # fmt: skip
        p = {"section": "mamba1_prefill", "T": 2048, "n_seq": 1, "provider": "reference (torch)"}
        prefill.append(job("mamba1_prefill", p, T=2048, n_seq=1, impl="reference"))
        # where the automatic time chunk switches on: the walk, chunks, and the default
        for n_seq in (1, 2, 4, 8, 16, 32):
            p = {"section": "mamba1_chunk_rule", "T": 8192, "n_seq": n_seq}
            for name, tc in (("ours time_chunk=0", 0), ("ours time_chunk=256", 256),
                             ("ours (default)", None)):  # fmt: skip
                prefill.append(job("mamba1_prefill", {**p, "provider": name}, T=8192,
                                   n_seq=n_seq, impl="ours", time_chunk=tc))  # fmt: skip
    if args.profile:
        for n_seq in (1, 16):
            p = {"section": "prefill_profile", "T": 8192, "n_seq": n_seq}
            prefill.append(job("prefill_profile", p, T=8192, n_seq=n_seq))
    if "mamba1_lanes" in (args.only or "").split(","):
        for n_seq in (1, 4, 16):
            p = {"section": "mamba1_lanes", "T": 8192, "n_seq": n_seq, "provider": "ours"}
            prefill.append(job("mamba1_lanes", p, T=8192, n_seq=n_seq))
    if args.mamba2_sweep:
        for T, n_seq in ((8192, 1), (32768, 16)):
            p = {"section": "mamba2_sweep", "T": T, "n_seq": n_seq}
            prefill.append(job("mamba2_sweep", p, T=T, n_seq=n_seq))
    if args.vs_mamba_ssm or "mamba2_vs_mamba_ssm" in (args.only or "").split(","):
        tokens = tuple(int(t) for t in args.vs_mamba_ssm_tokens.split(","))
        prefill += _vs_mamba_ssm_jobs(job, args.mamba_ssm_chunk, args.our_chunk, tokens)
    if args.l2norm_sweep:
        for T in (8192, 32768):
            prefill.append(job("l2norm_sweep", {"section": "l2norm_sweep", "T": T}, T=T))
    if args.plugin:
        for B in (64, 256):
            ours.append(job("plugin_step", {"section": "plugin_step", "provider": "gdn decode",
                                            "B": B}, B=B))  # fmt: skip

    if args.only:
        chosen = set(args.only.split(","))
        keep = {"copy", "sweep_done", *chosen}
        ours, fla, prefill = ([j for j in js if j["row"]["section"] in keep]
                              for js in (ours, fla, prefill))  # fmt: skip
        if not any(c.endswith("_decode") or c == "plugin_step" for c in chosen):
            # the per-batch copy rows are the decode rows' ceiling; a prefill-only run keeps
            # its budget for the prefill jobs (their first call compiles for a minute or more)
            ours = [j for j in ours if j["row"]["section"] != "copy" or j["kw"]["nbytes"] == 2**30]
    results: list[dict] = []
    budget = args.budget_s
    run_isolated(ours, results, budget * 0.7)
    if not args.no_fla:
        run_isolated(fla, results, max(5.0, budget - (time.time() - t0)) * 0.6)
    if prefill:
        run_isolated(prefill, results, max(5.0, budget - (time.time() - t0)))

    copy_bw = next((r["GBps"] for r in results if r.get("section") == "copy"
                    and r.get("nbytes") == 2**30 and "GBps" in r), None)  # fmt: skip
    print("\n" + _table(results, copy_bw))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": sys.version.split()[0],
        "wall_s": round(time.time() - t0, 1),
        "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ},
    }
    args.out.write_text(json.dumps({"meta": meta, "copy_GBps": copy_bw, "results": results},
                                   indent=2))  # fmt: skip
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
