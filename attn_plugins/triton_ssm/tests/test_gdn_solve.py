"""Gated DeltaNet's intra-chunk solve (``kernels.gdn_solve.kkt_solve``) against float64 torch.

Every chunk's ``(I + A)^-1``, ``A = beta k k^T 2^(g_i - g_j)`` strictly below the diagonal,
solved with ``torch.linalg.solve_triangular`` in float64 on varlen batches whose sequences end
inside and on chunk boundaries, with grouped key heads; the entries above the diagonal blocks
must come out zero in an uninitialised buffer (fla's ``recompute_w_u`` reads whole rows). CPU:
Triton's interpreter; CUDA: compiled, also at Qwen3-Next's head shape and against fla's own
kernel.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from slot_pass_check import chunk_spans

gdn_solve = K.gdn_solve  # the submodule, imported by the package after kernel_device
BT = gdn_solve.CHUNK


def _inputs(lens: list[int], H: int, HV: int, Kd: int, seed: int = 0):
    """``(k [T, H, K] bf16 unit rows, chunk-local cumulative log2 decay g [T, HV] float32,
    beta [T, HV] bf16, cu_seqlens, chunk_indices)`` on the tests' device."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    k = torch.nn.functional.normalize(torch.randn(T, H, Kd, generator=gen), dim=-1)
    step = -torch.rand(T, HV, generator=gen) * 0.3
    g = torch.empty_like(step)
    for s, e in chunk_spans(lens, BT):
        g[s:e] = step[s:e].cumsum(0)
    beta = torch.rand(T, HV, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    chunks = [(i, c) for i, n in enumerate(lens) for c in range((n + BT - 1) // BT)]
    idx = torch.tensor(chunks, dtype=torch.int32)
    bf16 = torch.bfloat16
    return k.to(bf16).to(DEV), g.to(DEV), beta.to(bf16).to(DEV), cu.to(DEV), idx.to(DEV)


def _solve64(k, g, beta, lens, HV):
    """``[T, HV, BT]`` float64: each chunk's ``(I + A)^-1`` rows (zeros past the chunk's end)."""
    k, g, beta = k.double().cpu(), g.double().cpu(), beta.double().cpu()
    H = k.shape[1]
    out = torch.zeros(k.shape[0], HV, BT, dtype=torch.float64)
    for s, e in chunk_spans(lens, BT):
        n = e - s
        for hv in range(HV):
            kc = k[s:e, hv // (HV // H)]
            gc = g[s:e, hv]
            a = beta[s:e, hv, None] * (kc @ kc.T) * torch.exp2(gc[:, None] - gc[None, :])
            a = torch.tril(a, -1)
            eye = torch.eye(n, dtype=torch.float64)
            out[s:e, hv, :n] = torch.linalg.solve_triangular(eye + a, eye, upper=False)
    return out


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_kkt_solve_matches_the_float64_solve(precision: str) -> None:
    lens, H, HV, Kd = [70, 5, BT, 130], 1, 2, 32
    k, g, beta, cu, idx = _inputs(lens, H, HV, Kd)
    # garbage where the kernel must write zeros: nothing may be left of it
    out = torch.full((k.shape[0], HV, BT), float("nan"), dtype=k.dtype, device=DEV)
    got = gdn_solve.kkt_solve(k, g, beta, cu, idx, out=out, block_k=16, precision=precision)
    assert got is out
    want = _solve64(k, g, beta, lens, HV)
    assert not torch.isnan(got).any(), "an entry of the chunk rows was left unwritten"
    err = (got.double().cpu() - want).abs().max().item()
    # bf16 storage of entries up to ~1: a rounding step is 2^-8 relative
    assert err < 1.6e-2, f"max |kkt_solve - float64 solve| = {err:.3g}"
    # above each chunk's diagonal exactly zero
    for s, e in chunk_spans(lens, BT):
        upper = torch.triu(torch.ones(e - s, BT, dtype=torch.bool), 1)
        assert (got[s:e].cpu().permute(1, 0, 2)[:, upper] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="Qwen3-Next's shape and fla's kernel: compiled only")
def test_kkt_solve_matches_fla_at_qwen3_next_shape() -> None:
    from attn_plugin_triton_ssm import compat

    f, reason = compat.stages("gdn")
    if reason:
        pytest.skip(reason)
    lens, H, HV, Kd = [8192, 300, 64], 16, 32, 128
    k, g, beta, cu, idx = _inputs(lens, H, HV, Kd, seed=1)
    ours = gdn_solve.kkt_solve(k, g, beta, cu, idx)
    # fla's kernel as the slot path launches it (it stores only the blocks on and below the
    # diagonal: zero-filled here)
    fla = f["kkt_solve_into"](
        torch.zeros_like(ours)[None], k=k[None], g=g[None], beta=beta[None], cu_seqlens=cu,
        chunk_indices=idx, chunk_size=BT,
    )  # fmt: skip
    want = _solve64(k, g, beta, lens, HV).to(DEV)
    err_ours = (ours.double() - want).abs().max().item()
    err_fla = (fla[0].double() - want).abs().max().item()
    assert err_ours <= max(1.25 * err_fla, 1e-2), (err_ours, err_fla)


def test_kkt_solve_computes_the_chunk_local_log2_cumsum_it_is_asked_for() -> None:
    """``g_cumsum_out``: ``g`` is each token's log decay; the kernel stores its chunk-local
    cumulative sum in log2 (what fla's ``chunk_local_cumsum(scale=RCP_LN2)`` gives the stages
    after it) and solves with it as if it had been given that."""
    lens, H, HV, Kd = [70, 5, BT, 130], 1, 2, 32
    k, g2, beta, cu, idx = _inputs(lens, H, HV, Kd, seed=3)
    # per-token natural-log decays whose chunk-local cumsum in log2 is the g2 above
    raw = torch.empty_like(g2)
    for s, e in chunk_spans(lens, BT):
        first = torch.zeros_like(g2[s : s + 1])
        raw[s:e] = torch.diff(g2[s:e], dim=0, prepend=first) * math.log(2.0)
    gc = torch.full_like(g2, float("nan"))
    got = gdn_solve.kkt_solve(k, raw, beta, cu, idx, g_cumsum_out=gc, block_k=16)
    torch.testing.assert_close(gc, g2, rtol=1e-5, atol=1e-5)
    want = gdn_solve.kkt_solve(k, g2, beta, cu, idx, block_k=16)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize(("warps", "block_k"), [(1, 32), (4, 64)], ids=["default", "4-warps"])
def test_kkt_solve_runs_the_four_substitutions_in_one_warp_local_loop(warps, block_k) -> None:
    """Compiled for sm90 (Qwen3-Next's heads): the kernel has one loop (the key dim is
    unrolled), so the four diagonal blocks' substitutions share it rather than running one
    after another, and the loop holds no barrier and no shared-memory access, on 4 warps too
    (its reductions stay inside warps; fla's first substitution loop syncs the block twice a
    step)."""
    pytest.importorskip("triton")
    from sm90_codegen import loops, sm90_ptx

    pointers = {
        "k_ptr": "*bf16", "g_ptr": "*bf16", "beta_ptr": "*bf16", "ai_ptr": "*bf16",
        "gc_ptr": "*fp32", "cu_ptr": "*i64", "chunks_ptr": "*i64", "LOG2E": "fp32",
    }  # fmt: skip
    constexprs = dict(H=16, HV=32, K=128, BK=block_k, PRECISION="tf32", CUMSUM=True, UPCAST=False)
    kernel = "attn_plugin_triton_ssm.kernels.gdn_solve:_kkt_solve_kernel"
    found = loops(sm90_ptx(kernel, pointers, constexprs, warps))
    assert len(found) == 1, f"expected one loop, found {len(found)}"
    body = found[0]
    assert "shfl" in body, "the loop found is not the substitution (it reduces across lanes)"
    assert "bar.sync" not in body and "barrier" not in body
    assert not re.search(r"\b(ld|st)\.shared", body)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"k": lambda t: t[:, :, :-1].contiguous()}, r"k: .*K a power of two"),
        ({"g": lambda t: t[:, 0].contiguous()}, r"g: expected shape \[70, \*\] \[T, HV\]"),
        ({"beta": lambda t: t[:-1]}, r"beta: expected shape \[\d+, 2\]"),
        ({"k": lambda t: t.to(torch.int32)}, r"k: expected dtype in \[.*'bfloat16'.*got int32"),
        ({"chunk_indices": lambda t: t[:, :1]}, r"chunk_indices: expected shape \[\*, 2\]"),
        ({"out": lambda t: t[:, :, :32]}, r"out: expected shape \[\d+, 2, 64\]"),
        ({"k": lambda t: t.expand(-1, 3, -1).contiguous()}, r"HV = 2 value heads .* H = 3 key"),
        ({"g": lambda t: t.t().contiguous().t()}, r"g: expected a packed tensor"),
    ],
    ids=[
        "k-dim",
        "g-heads",
        "beta-tokens",
        "k-dtype",
        "chunk-table",
        "out-width",
        "groups",
        "g-strided",
    ],
)
def test_kkt_solve_refuses_what_it_cannot_serve(change, match) -> None:
    """Misshapen or mistyped inputs: a ValueError / TypeError naming the argument, what was
    expected and what came, before anything is written."""
    lens, H, HV, Kd = [70], 1, 2, 32
    k, g, beta, cu, idx = _inputs(lens, H, HV, Kd)
    out = torch.zeros(k.shape[0], HV, BT, dtype=k.dtype, device=DEV)
    args = {"k": k, "g": g, "beta": beta, "chunk_indices": idx, "out": out}
    args.update({name: fn(args[name]) for name, fn in change.items()})
    with pytest.raises((ValueError, TypeError), match=match):
        gdn_solve.kkt_solve(args["k"], args["g"], args["beta"], cu, args["chunk_indices"],
                            out=args["out"])  # fmt: skip
    assert torch.count_nonzero(out) == 0
