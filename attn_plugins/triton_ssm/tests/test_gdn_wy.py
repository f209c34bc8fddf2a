"""Gated DeltaNet's intra-chunk WY representation in one kernel (``kernels.gdn_wy``).

``gdn_wy`` against the same quantities solved in float64 torch (``torch.linalg.inv`` of each
chunk's ``I + A``) and against fla-core's own two kernels (``chunk_gated_delta_rule_fwd_intra``),
on varlen batches whose sequences end inside and exactly on chunk boundaries, with grouped key
heads and head dims that are not powers of two (CPU: Triton's interpreter; CUDA: compiled).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from slot_pass_check import fla_stages_here

wy = K.gdn_wy  # the submodule, imported by the package after kernel_device
BT = wy.BT


def _inputs(lens, H, HV, Kd, Vd, dtype, beta_max=1.0, seed=0):
    """l2-normalised keys, values, beta in ``(0, beta_max)`` (float32) and the chunk-local
    cumulative log2 decay of every sequence; the chunk plan as fla's ``prepare_chunk_indices``
    lays it out."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    k = torch.nn.functional.normalize(torch.randn(T, H, Kd, generator=g), dim=-1).to(dtype)
    v = torch.randn(T, HV, Vd, generator=g).to(dtype)
    beta = torch.rand(T, HV, generator=g) * beta_max
    step = -torch.rand(T, HV, generator=g) * 0.3
    gc = torch.empty_like(step)
    chunks = []
    start = 0
    for n_seq, n in enumerate(lens):
        for i, c in enumerate(range(0, n, BT)):
            s, e = start + c, start + min(c + BT, n)
            gc[s:e] = step[s:e].cumsum(0)
            chunks.append((n_seq, i))
        start += n
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    chunk_indices = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 2)
    return k, v, gc, beta, cu, chunk_indices


def _solved(k, v, gc, beta, lens):
    """``w`` and ``u`` in float64 from the rounded inputs, chunk by chunk."""
    d = torch.float64
    kk = k.to(d).repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    vv, gg, bb = v.to(d), gc.to(d), beta.to(d)
    w, u = torch.empty_like(kk), torch.empty_like(vv)
    start = 0
    for n in lens:
        for c in range(0, n, BT):
            s, e = start + c, start + min(c + BT, n)
            decay = torch.exp2(gg[s:e, None] - gg[None, s:e]).permute(2, 0, 1)  # [HV, i, j]
            a = torch.einsum("ihc,jhc->hij", kk[s:e], kk[s:e]) * decay * bb[s:e].T[..., None]
            ai = torch.linalg.inv(torch.eye(e - s, dtype=d) + torch.tril(a, -1))
            u[s:e] = torch.einsum("hij,jhv->ihv", ai, vv[s:e] * bb[s:e, :, None])
            w[s:e] = torch.einsum(
                "hij,jhk->ihk", ai, kk[s:e] * (bb[s:e] * torch.exp2(gg[s:e]))[..., None]
            )
        start += n
    return w, u


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize(
    ("lens", "H", "HV", "Kd", "Vd", "dtype", "beta_max", "tol"),
    [
        ([64, 100, 17, 133], 2, 4, 32, 48, torch.float32, 1.0, 2e-6),
        ([128, 1], 1, 2, 16, 16, torch.float32, 2.0, 2e-6),  # beta up to 2: negative eigenvalues
        ([64, 100, 17, 133], 2, 4, 32, 48, torch.bfloat16, 1.0, 8e-3),
    ],
    ids=["float32", "float32-beta2", "bfloat16"],
)
@pytest.mark.parametrize("solve", ["ieee", "tf32x3"])
def test_wy_matches_the_chunks_solved_in_float64(lens, H, HV, Kd, Vd, dtype, beta_max, tol, solve):
    """Sequences ending mid-chunk and on a chunk's end, a one-token sequence, two value heads a
    key head, head dims under a block (masked columns), beta up to 2: ``w`` and ``u`` equal the
    float64 solve to float32's precision, or to the rounding of bf16 operands and outputs, with
    the solve's products on CUDA cores or as three tf32 products each."""
    k, v, gc, beta, cu, chunk_indices = _inputs(lens, H, HV, Kd, Vd, dtype, beta_max)
    want_w, want_u = _solved(k, v, gc, beta, lens)
    w, u = wy.gdn_wy(*(t.to(DEV) for t in (k, v, gc, beta, cu, chunk_indices)), block_k=16,
                     solve_precision=solve)  # fmt: skip
    assert (w.dtype, u.dtype) == (dtype, dtype)
    assert _rel(w.cpu(), want_w) < tol and _rel(u.cpu(), want_u) < tol, (
        _rel(w.cpu(), want_w),
        _rel(u.cpu(), want_u),
    )


def test_wy_of_a_sequence_does_not_depend_on_its_neighbours():
    """Each chunk reads its own tokens only: a sequence's ``w`` and ``u`` are the same alone and
    between two others (a chunk that read past its sequence's end would mix them)."""
    lens = [70, 50, 90]
    k, v, gc, beta, cu, chunk_indices = _inputs(lens, 1, 2, 32, 32, torch.float32)
    w, u = wy.gdn_wy(*(t.to(DEV) for t in (k, v, gc, beta, cu, chunk_indices)))
    s, e = 70, 120
    k1, v1, gc1, beta1 = (t[s:e].contiguous() for t in (k, v, gc, beta))
    cu1 = torch.tensor([0, e - s])
    w1, u1 = wy.gdn_wy(*(t.to(DEV) for t in (k1, v1, gc1, beta1, cu1, torch.tensor([[0, 0]]))))
    torch.testing.assert_close(w[s:e], w1, rtol=0, atol=0)
    torch.testing.assert_close(u[s:e], u1, rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
            DEV == "cpu", reason="fla's 16-bit dots are wrong in Triton's interpreter")),
    ],
)  # fmt: skip
def test_wy_matches_fla_intra_stage(dtype, monkeypatch):
    """Against fla-core's own ``chunk_gated_delta_rule_fwd_intra`` (its fused kkt-and-solve
    kernel, then ``recompute_w_u``) on the same inputs: the two differ only where fla's tf32
    block merges and ours in float32 round ``Ai`` to a different bf16 neighbour."""
    from attn_plugin_triton_ssm import compat

    fla_stages_here("gdn", DEV, monkeypatch)
    f = compat.stages("gdn")[0]
    lens = [64, 100, 17]
    k, v, gc, beta, cu, chunk_indices = _inputs(lens, 2, 4, 32, 32, dtype)
    k, v, gc, beta, cu, chunk_indices = (t.to(DEV) for t in (k, v, gc, beta, cu, chunk_indices))
    fw, fu, _ = f["intra"](k=k[None], v=v[None], g=gc[None], beta=beta[None], cu_seqlens=cu,
                           chunk_indices=chunk_indices, chunk_size=BT)  # fmt: skip
    w, u = wy.gdn_wy(k, v, gc, beta, cu, chunk_indices)
    tol = 2e-6 if dtype == torch.float32 and DEV == "cpu" else 6e-3
    want_w, want_u = _solved(k.cpu(), v.cpu(), gc.cpu(), beta.cpu(), lens)
    assert _rel(w.cpu(), fw[0].cpu().double()) < tol
    assert _rel(u.cpu(), fu[0].cpu().double()) < tol
    # and ours no further from the float64 solve than fla's
    assert _rel(w.cpu(), want_w) <= 1.1 * _rel(fw[0].cpu(), want_w) + 1e-7
    assert _rel(u.cpu(), want_u) <= 1.1 * _rel(fu[0].cpu(), want_u) + 1e-7


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "v": a["v"][:-1]}, r"v of shape \(3, 2, 16\)"),
        (lambda a: {**a, "beta": a["beta"][:, :1]}, r"beta of shape \(3, 2\)"),
        (lambda a: {**a, "g": a["g"].to(torch.bfloat16)}, "g in float32"),
        (lambda a: {**a, "k": a["k"].expand(3, 3, 16)}, "heads divide the value heads"),
        (lambda a: {**a, "chunk_indices": a["chunk_indices"][:, 0]}, r"chunk_indices \[NT, 2\]"),
    ],
    ids=["v-rows", "beta-heads", "g-dtype", "k-heads", "chunk-indices"],
)
def test_wy_refuses_misshapen_inputs(change, match):
    args = {
        "k": torch.zeros(3, 1, 16),
        "v": torch.zeros(3, 2, 16),
        "g": torch.zeros(3, 2),
        "beta": torch.zeros(3, 2),
        "cu_seqlens": torch.tensor([0, 3]),
        "chunk_indices": torch.tensor([[0, 0]]),
    }
    with pytest.raises(ValueError, match=match):
        wy.gdn_wy(**change(args))


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"block_v": 24}, "block_v must be a power of two >= 16, got 24"),
        ({"solve_precision": "tf32"}, "solve_precision must be 'ieee' or 'tf32x3', got 'tf32'"),
    ],
)
def test_wy_refuses_an_option_it_does_not_serve(option, match):
    with pytest.raises(ValueError, match=match):
        wy.gdn_wy(
            torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), torch.zeros(3, 1), torch.zeros(3, 1),
            torch.tensor([0, 3]), torch.tensor([[0, 0]]), **option,
        )  # fmt: skip
