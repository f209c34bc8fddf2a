"""Chunked (local) attention in the reference: paged prefill / mixed, graph-safe decode, varlen.

Ground truths: a dense masked softmax written here (key ``j`` visible to query ``p`` iff
``j <= p`` and ``j // C == p // C``) and the mask of transformers' ``chunked_causal_mask_function``
(what Llama-4's chunked layers use), so the chunk convention is transformers', not ours.
"""

from __future__ import annotations

import pytest
import torch
from test_ops_attention import DEVICES, WORKLOADS, _allclose, fill_kv_cache, make_batch
from transformers import masking_utils

from attn_core.reference.decode import decode_full_attention
from attn_core.reference.ops import paged_attention, varlen_attention

CHUNK = 3


def dense_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, scale: float, causal: bool
) -> torch.Tensor:
    """Masked softmax over one whole sequence: ``q [L, Hq, D]``, ``k, v [L, Hkv, D]`` ->
    ``[L, Hq, D]`` float32 (GQA: query head h reads KV head ``h // (Hq // Hkv)``)."""
    length, hq = q.shape[0], q.shape[1]
    rep = hq // k.shape[1]
    kk = k.float().repeat_interleave(rep, dim=1)
    vv = v.float().repeat_interleave(rep, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    p = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    visible = (p // chunk) == (j // chunk)
    if causal:
        visible &= j <= p
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def hf_chunked_mask(length: int, chunk: int) -> torch.Tensor:
    """transformers' chunked causal mask ``[L, L]`` bool (no left padding)."""
    fn = masking_utils.chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))
    idx = torch.arange(length)
    return fn(0, 0, idx[:, None], idx[None, :])


def test_the_dense_mask_is_transformers_chunked_causal_mask():
    for length, chunk in ((9, 3), (10, 4), (5, 8), (7, 1)):
        p = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        mine = (j <= p) & (j >= p // chunk * chunk)  # [floor(p / C) * C, p]
        assert torch.equal(hf_chunked_mask(length, chunk), mine), (length, chunk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workload", ["prefill", "mixed", "page_boundaries", "spec_verify"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_paged_chunked_matches_dense_and_transformers(device, workload, hq, hkv):
    batch = make_batch(
        WORKLOADS[workload], hq=hq, hkv=hkv, d=8, dv=8, dtype=torch.float32, device=device
    )
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    args = (batch.q, k_cache, v_cache, batch.page_table, batch.query_start_loc, batch.seq_lens)
    out = paged_attention(*args, scale=0.4, attention_chunk_size=CHUNK)
    full = paged_attention(*args, scale=0.4)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        length = batch.k[b].shape[0]
        qf, kb, vb = (t[b].cpu() for t in (batch.q_full, batch.k, batch.v))
        expected = dense_chunked(qf, kb, vb, CHUNK, 0.4, True)
        _allclose(out[qsl[b] : qsl[b + 1]], expected[length - ql :], 2e-5, 1e-5)
        # the same through transformers' mask, as an additive mask on SDPA
        mask = hf_chunked_mask(length, CHUNK)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            qf.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            attn_mask=mask,
            scale=0.4,
            enable_gqa=True,
        )[0].transpose(0, 1)
        _allclose(out[qsl[b] : qsl[b + 1]], sdpa[length - ql :], 2e-5, 1e-5)
    if max(batch.seq_lens.tolist()) > CHUNK:  # the chunk mask really cut something
        assert (out - full)[: qsl[-1]].abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 2, 4, 16])
def test_decode_chunked_matches_dense(device, chunk):
    """The graph-safe decode path: one token per request at position ``seq_len - 1``."""
    batch = make_batch(
        WORKLOADS["decode"], hq=4, hkv=2, d=8, dv=8, dtype=torch.float32, device=device
    )
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    q = batch.q[: len(batch.q_lens)]
    out = decode_full_attention(
        q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale=0.4,
        attention_chunk_size=chunk,
    )  # fmt: skip
    paged = paged_attention(
        q, k_cache, v_cache, batch.page_table, batch.query_start_loc, batch.seq_lens,
        scale=0.4, attention_chunk_size=chunk,
    )  # fmt: skip
    for b in range(len(batch.q_lens)):
        qf, kb, vb = (t[b].cpu() for t in (batch.q_full, batch.k, batch.v))
        expected = dense_chunked(qf, kb, vb, chunk, 0.4, True)
        _allclose(out[b], expected[-1], 2e-5, 1e-5)
    _allclose(out, paged, 2e-5, 1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_chunked_matches_dense(causal):
    gen = torch.Generator().manual_seed(7)
    lens = [7, 1, 5]
    q = torch.randn(sum(lens), 4, 8, generator=gen)
    k, v = (torch.randn(sum(lens), 2, 8, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 7, 8, 13], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, scale=0.3, causal=causal, attention_chunk_size=CHUNK)
    for start, end in zip(cu.tolist(), cu.tolist()[1:], strict=False):
        sl = slice(start, end)
        _allclose(out[sl], dense_chunked(q[sl], k[sl], v[sl], CHUNK, 0.3, causal), 2e-5, 1e-5)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_bad_chunk_size_is_refused(bad):
    batch = make_batch(
        WORKLOADS["decode"], hq=2, hkv=2, d=4, dv=4, dtype=torch.float32, device="cpu"
    )
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    with pytest.raises(ValueError, match="attention_chunk_size="):
        paged_attention(
            batch.q, k_cache, v_cache, batch.page_table, batch.query_start_loc, batch.seq_lens,
            scale=1.0, attention_chunk_size=bad,
        )  # fmt: skip
