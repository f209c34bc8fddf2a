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


def _attend_chunks(q_rows, k_cache, v_cache, meta, scale, softcap=None):
    """What the kernel returns for the chunk rows: ``out [N, H, D]``, ``lse [H, N]``; empty
    rows hold NaN, garbage the merge must not read."""
    return attend_chunk_rows(
        q_rows, k_cache, v_cache, meta.page_table, meta.seqused_k, scale, softcap=softcap,
        empty=float("nan"),
    )  # fmt: skip


def _full_attention(q, k_cache, v_cache, page_table, seq_lens, scale, sinks, softcap=None):
    """Attention of each request's query over its ``seq_len`` keys in the cache (the new
    token's row already written there), sinks in the denominator; 0 for a request of no key."""
    b, h, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, h, d)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pages = page_table[i, : math.ceil(n / page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("hd,khd->hk", q[i].float(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None]], dim=1)
            v = torch.cat([v, torch.zeros(1, h, d)], dim=0)
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)
    return out


def _case(b=3, h=4, hkv=2, d=32, page=8, seq_lens=(83, 17, 60), seed=0):
    """A paged cache, page table, queries and the step's new K/V rows: request ``i`` has
    ``seq_lens[i] - 1`` cached keys and its new token at position ``seq_lens[i] - 1``, whose
    slot (``page_table`` row, that position) is not written yet."""
    torch.manual_seed(seed)
    max_pages = 12
    num_pages = b * max_pages + 1
    k_cache = torch.randn(num_pages, page, hkv, d)
    v_cache = torch.randn(num_pages, page, hkv, d)
    perm = torch.randperm(num_pages - 1)[: b * max_pages] + 1
    page_table = perm.reshape(b, max_pages).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (lens - 1).clamp(min=0).long()
    slots = page_table[torch.arange(b), pos // page].long() * page + pos % page
    slots = torch.where(lens > 0, slots, -1)
    return dict(
        q=torch.randn(b, h, d), k=torch.randn(b, hkv, d), v=torch.randn(b, hkv, d),
        k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=lens, slots=slots,
    )  # fmt: skip


def _run_merge(monkeypatch, how, c, meta, partial, lse, sinks, softcap, out, slots):
    """``split_kv.merge`` through the Triton kernel (the GPU, or Triton's interpreter) or its
    torch path (the core's KV writer, then ``merge_reference``); the caches are written in
    place on the CPU copies ``c`` holds."""
    scale = c["q"].shape[-1] ** -0.5
    if how == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        dev = "cpu"
    else:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    moved = split_kv.build_metadata(meta.plan, c["page_table"].to(dev), c["seq_lens"].to(dev))
    caches = [c["k_cache"].to(dev), c["v_cache"].to(dev)]
    got = out.to(dev)
    split_kv.merge(
        partial.to(dev), lse.to(dev), moved, None if sinks is None else sinks.to(dev), got,
        q=c["q"].to(dev), k=c["k"].to(dev), v=c["v"].to(dev), k_cache=caches[0],
        v_cache=caches[1], slot_mapping=slots.to(dev), scale=scale, softcap=softcap,
    )  # fmt: skip
    out.copy_(got.cpu())
    c["k_cache"].copy_(caches[0].cpu())
    c["v_cache"].copy_(caches[1].cpu())


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("how", ["torch", "triton"])
def test_split_decode_matches_attention_over_the_whole_context(
    monkeypatch, how, with_sinks, softcap
):
    """Chunks over the cached context, merged with the step's own key (and sinks), equal
    attention over the whole context with the new token; the merge stores the new K/V at its
    slot and nowhere else, and leaves ``out``'s rows past B as they were."""
    c = _case()
    b, h, d = c["q"].shape
    scale = d**-0.5
    sinks = torch.randn(h) * 2 if with_sinks else None
    plan = split_kv.SplitPlan(num_splits=4, pages_per_chunk=3, page_size=8)
    meta = split_kv.build_metadata(plan, c["page_table"], c["seq_lens"])
    assert meta.page_table.shape == (b * 4, 3)
    # cached keys: 82, 16 and 59 in chunks of 24 (request 1 leaves three chunks empty)
    assert meta.seqused_k.tolist() == [24, 24, 24, 10, 16, 0, 0, 0, 24, 24, 11, 0]
    assert meta.cu_seqlens_q.tolist() == list(range(b * 4 + 1))
    q_rows = split_kv.query_rows(c["q"], 4, torch.empty(b * 4 + 2, h, d))
    assert torch.equal(q_rows, c["q"].repeat_interleave(4, dim=0))
    partial, lse = _attend_chunks(q_rows, c["k_cache"], c["v_cache"], meta, scale, softcap)
    before_k, before_v = c["k_cache"].clone(), c["v_cache"].clone()
    out = torch.full((b + 2, h, d), 7.0)  # rows past B must stay as they were
    _run_merge(monkeypatch, how, c, meta, partial, lse, sinks, softcap, out, c["slots"])
    flat_k, flat_v = c["k_cache"].view(-1, 2, d), c["v_cache"].view(-1, 2, d)
    assert torch.equal(flat_k[c["slots"]], c["k"]) and torch.equal(flat_v[c["slots"]], c["v"])
    before_k.view(-1, 2, d)[c["slots"]] = c["k"]
    before_v.view(-1, 2, d)[c["slots"]] = c["v"]
    assert torch.equal(c["k_cache"], before_k) and torch.equal(c["v_cache"], before_v)
    want = _full_attention(c["q"], c["k_cache"], c["v_cache"], c["page_table"], c["seq_lens"],
                           scale, sinks, softcap)  # fmt: skip
    torch.testing.assert_close(out[:b], want, atol=2e-5, rtol=2e-5)
    assert torch.all(out[b:] == 7.0)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_merge_equals_the_reference_on_padding_rows_and_minus_inf(monkeypatch, with_sinks):
    """The kernel against ``merge_reference`` where the inputs are odd: a padding row of a
    captured graph (``seq_len`` 1: no cached key, slot -1: nothing stored), a row of no key at
    all (``seq_len`` 0: output 0, not NaN), a non-empty chunk whose log-sum-exp is -inf (weight
    0), NaN garbage in empty chunks' rows, and q / k / v / out views with row strides of their
    own (the layer's buffers)."""
    c = _case(b=4, seq_lens=(83, 1, 0, 40), seed=3)
    b, h, d = c["q"].shape
    scale = d**-0.5
    sinks = torch.randn(h) * 2 if with_sinks else None
    slots = c["slots"].clone()
    slots[1] = -1  # padding: writes nothing
    plan = split_kv.SplitPlan(num_splits=4, pages_per_chunk=3, page_size=8)
    meta = split_kv.build_metadata(plan, c["page_table"], c["seq_lens"])
    assert meta.seqused_k.view(b, 4)[1:3].sum() == 0
    q_rows = c["q"].repeat_interleave(4, dim=0)
    partial, lse = _attend_chunks(q_rows, c["k_cache"], c["v_cache"], meta, scale)
    lse[:, 1] = float("-inf")  # request 0, chunk 1: keys, but none that counts
    wide = torch.randn(b, 3 * h, d)  # q as a view of a fused projection
    wide[:, h : 2 * h] = c["q"]
    c["q"] = wide[:, h : 2 * h]
    before_k = c["k_cache"].clone()
    out_t = torch.full((b, 2 * h, d), 5.0)[:, :h]  # a strided view of the layer's buffer
    _run_merge(monkeypatch, "triton", c, meta, partial, lse, sinks, None, out_t, slots)
    assert torch.equal(c["k_cache"].view(-1, 2, d)[slots[slots >= 0]], c["k"][slots >= 0])
    before_k.view(-1, 2, d)[slots[slots >= 0]] = c["k"][slots >= 0]
    assert torch.equal(c["k_cache"], before_k)  # the padding row stored nothing
    logits = split_kv.new_token_logits(c["q"], c["k"], scale, None)
    out_r = torch.zeros(b, h, d)
    split_kv.merge_reference(partial, lse, meta, sinks, out_r, v=c["v"], new_logits=logits)
    torch.testing.assert_close(out_t, out_r, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(out_t).all()
    if sinks is None:
        torch.testing.assert_close(out_t[1], c["v"][1].repeat_interleave(h // 2, dim=0))
    assert torch.all(out_t[2] == 0)  # no key at all (and a sink alone weighs only zeros)


def test_query_rows_view_one_request_and_refuse_several_without_a_buffer():
    q = torch.randn(1, 4, 8)
    rows = split_kv.query_rows(q, 5, None)
    assert rows.shape == (5, 4, 8) and rows.stride(0) == 0 and rows.data_ptr() == q.data_ptr()
    with pytest.raises(ValueError, match="need a buffer"):
        split_kv.query_rows(torch.randn(2, 4, 8), 5, None)


def test_build_metadata_pads_a_short_page_table():
    plan = split_kv.SplitPlan(num_splits=3, pages_per_chunk=2, page_size=4)
    table = torch.arange(10, dtype=torch.int32).reshape(2, 5)  # 5 < 3 * 2 columns
    meta = split_kv.build_metadata(plan, table, torch.tensor([20, 9], dtype=torch.int32))
    assert meta.page_table.tolist() == [[0, 1], [2, 3], [4, 0], [5, 6], [7, 8], [9, 0]]
    assert meta.seqused_k.tolist() == [8, 8, 3, 8, 0, 0]  # of the 19 and 8 cached keys


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
    assert got.seqused_k.tolist() == want.seqused_k.tolist() == [4, 0, 0, 8, 8, 7]
    wide = torch.arange(16, dtype=torch.int32).reshape(2, 8)  # wider: the chunked rows copy
    copied = split_kv.build_metadata(plan, wide, lens)
    assert copied.page_table.data_ptr() != wide.data_ptr()
    assert copied.page_table.tolist() == [[0, 1], [2, 3], [4, 5], [8, 9], [10, 11], [12, 13]]
    other = split_kv.SplitPlan(num_splits=2, pages_per_chunk=3, page_size=4)
    with pytest.raises(ValueError, match="refilled"):
        split_kv.build_metadata(other, table, lens, out=kept)
