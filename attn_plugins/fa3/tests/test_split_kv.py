"""Split-KV decode on CPU: the split plan, the chunked metadata and both merges (PyTorch and the
Triton kernel in Triton's interpreter) against attention over the whole context.

The kernel's part (attention of one query over a chunk's keys, with its log-sum-exp) is played
here by plain PyTorch over the same chunked page table, so what is checked is the chunking, the
masking of empty chunks, the sinks and the merge arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch
from attn_plugin_fa3 import split_kv
from chunk_rows import attend_chunk_rows


def test_plan_splits_fills_the_gpu_only_when_one_call_does_not():
    # B=1, 8 KV heads, 32k: 8 CTAs of 132 SMs -> one wave of 16 x 8 CTAs, 2k-token chunks
    plan = split_kv.plan_splits(1, 32768, 16, 8, 132)
    assert plan is not None and plan.num_splits == 16 and plan.chunk_tokens == 2048
    # B=4, 128k: 32 CTAs -> 4 chunks each, one wave (no partial second wave)
    plan = split_kv.plan_splits(4, 131072, 16, 8, 132)
    assert plan is not None and plan.num_splits == 4
    assert plan.num_splits * plan.chunk_tokens >= 131072
    # enough CTAs already, or too short to pay for the merge
    assert split_kv.plan_splits(64, 8192, 16, 4, 132) is None
    assert split_kv.plan_splits(1, 1500, 16, 8, 132) is None
    # the longest request has no empty chunk
    plan = split_kv.plan_splits(2, 5000, 64, 2, 132)
    assert plan is not None
    assert (plan.num_splits - 1) * plan.chunk_tokens < 5000 <= plan.num_splits * plan.chunk_tokens


def _attend_chunks(q_rows, k_cache, v_cache, meta, scale):
    """What the kernel returns for the chunk rows: ``out [N, H, D]``, ``lse [H, N]``; empty
    rows hold NaN, garbage the merge must not read."""
    return attend_chunk_rows(
        q_rows, k_cache, v_cache, meta.page_table, meta.seqused_k, scale, empty=float("nan")
    )


def _full_attention(q, k_cache, v_cache, page_table, seq_lens, scale, sinks):
    b, h, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, h, d)
    for i in range(b):
        n = int(seq_lens[i])
        pages = page_table[i, : math.ceil(n / page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("hd,khd->hk", q[i].float(), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None]], dim=1)
            v = torch.cat([v, torch.zeros(1, h, d)], dim=0)
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)
    return out


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("merge", ["reference", "triton"])
def test_split_decode_matches_attention_over_the_whole_context(with_sinks, merge):
    torch.manual_seed(0)
    b, h, hkv, d, page = 3, 4, 2, 32, 8
    seq_lens = torch.tensor([83, 17, 60], dtype=torch.int32)  # request 1 leaves chunks empty
    max_pages = 12
    num_pages = b * max_pages + 1
    k_cache = torch.randn(num_pages, page, hkv, d)
    v_cache = torch.randn(num_pages, page, hkv, d)
    perm = torch.randperm(num_pages - 1)[: b * max_pages] + 1
    page_table = perm.reshape(b, max_pages).to(torch.int32)
    q = torch.randn(b, h, d)
    scale = d**-0.5
    sinks = torch.randn(h) * 2 if with_sinks else None
    plan = split_kv.SplitPlan(num_splits=4, pages_per_chunk=3, page_size=page)
    meta = split_kv.build_metadata(plan, page_table, seq_lens)
    assert meta.page_table.shape == (b * 4, 3)
    assert meta.seqused_k.tolist() == [24, 24, 24, 11, 17, 0, 0, 0, 24, 24, 12, 0]
    assert meta.cu_seqlens_q.tolist() == list(range(b * 4 + 1))
    q_rows = q.repeat_interleave(4, dim=0)
    partial, lse = _attend_chunks(q_rows, k_cache, v_cache, meta, scale)
    out = torch.full((b + 2, h, d), 7.0)  # rows past B must stay as they were
    if merge == "triton":  # compiled on a GPU machine, Triton's interpreter elsewhere
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        moved = split_kv.build_metadata(plan, page_table.to(dev), seq_lens.to(dev))
        got = out.to(dev)
        from attn_plugin_fa3 import split_kv_triton

        split_kv_triton.merge(
            partial.to(dev), lse.to(dev), moved, None if sinks is None else sinks.to(dev), got
        )
        out = got.cpu()
    else:
        split_kv.merge_reference(partial, lse, meta, sinks, out)
    want = _full_attention(q, k_cache, v_cache, page_table, seq_lens, scale, sinks)
    torch.testing.assert_close(out[:b], want, atol=2e-5, rtol=2e-5)
    assert torch.all(out[b:] == 7.0)


def test_build_metadata_pads_a_short_page_table():
    plan = split_kv.SplitPlan(num_splits=3, pages_per_chunk=2, page_size=4)
    table = torch.arange(10, dtype=torch.int32).reshape(2, 5)  # 5 < 3 * 2 columns
    meta = split_kv.build_metadata(plan, table, torch.tensor([20, 9], dtype=torch.int32))
    assert meta.page_table.tolist() == [[0, 1], [2, 3], [4, 0], [5, 6], [7, 8], [9, 0]]
    assert meta.seqused_k.tolist() == [8, 8, 4, 8, 1, 0]


def test_refilled_metadata_equals_a_fresh_build_and_views_a_table_of_the_splits_width():
    """Graph mode refills one metadata per padded batch size in place: the result equals a
    fresh build of the new step, keeps its addresses, and where the builder's page table has
    the split's width it is read in place (no copy per layer per step)."""
    plan = split_kv.SplitPlan(num_splits=3, pages_per_chunk=2, page_size=4)
    table = torch.arange(12, dtype=torch.int32).reshape(2, 6)  # exactly 3 * 2 columns
    lens = torch.tensor([20, 9], dtype=torch.int32)
    kept = split_kv.build_metadata(plan, table, lens)
    assert kept.page_table.data_ptr() == table.data_ptr()  # a view of the builder's table
    addresses = (kept.page_table.data_ptr(), kept.seqused_k.data_ptr())
    table.copy_(torch.arange(100, 112, dtype=torch.int32).reshape(2, 6))
    lens.copy_(torch.tensor([5, 24], dtype=torch.int32))
    got = split_kv.build_metadata(plan, table, lens, out=kept)
    want = split_kv.build_metadata(plan, table.clone(), lens.clone())
    assert got is kept and (got.page_table.data_ptr(), got.seqused_k.data_ptr()) == addresses
    assert got.page_table.tolist() == want.page_table.tolist()
    assert got.seqused_k.tolist() == want.seqused_k.tolist() == [5, 0, 0, 8, 8, 8]
    wide = torch.arange(16, dtype=torch.int32).reshape(2, 8)  # wider: the chunked rows copy
    copied = split_kv.build_metadata(plan, wide, lens)
    assert copied.page_table.data_ptr() != wide.data_ptr()
    assert copied.page_table.tolist() == [[0, 1], [2, 3], [4, 5], [8, 9], [10, 11], [12, 13]]
    other = split_kv.SplitPlan(num_splits=2, pages_per_chunk=3, page_size=4)
    with pytest.raises(ValueError, match="refilled"):
        split_kv.build_metadata(other, table, lens, out=kept)
