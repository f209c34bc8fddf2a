"""Reference attention ops checked against independent implementations.

Ground truths: ``torch.nn.functional.scaled_dot_product_attention`` on dense (unpaged) sequences,
and HF transformers' eager attention code (gpt-oss sinks, Gemma-2 soft-cap, Llama GQA,
DeepSeek-V3 MLA, Qwen2.5-VL vision attention). Masks for the HF functions come from
``transformers.masking_utils`` so that the window convention is HF's, not ours.
"""

from __future__ import annotations

import itertools
import math
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import masking_utils

from attn_core.reference.ops import (
    FP8_DTYPE,
    mla_absorb_query,
    mla_output_from_latent,
    mla_paged_attention,
    mla_split_kv_b_proj,
    paged_attention,
    varlen_attention,
    write_paged_kv,
    write_paged_latent,
)

_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")]
    ),
]
# (dtype, atol, rtol): float32 is compared tightly; bfloat16 inputs are compared with the
# float32 ground truth of the same (bf16-rounded) inputs, so the gap is the bf16 output rounding.
DTYPES = [
    pytest.param(torch.float32, 2e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1.6e-2, 1.6e-2, id="bf16"),
]

# Named workloads: (q_len, seq_len) per request, page_size 4. Query i of a request sits at
# position seq_len - q_len + i.
PAGE_SIZE = 4
WORKLOADS = {
    "decode": [(1, 1), (1, 3), (1, 4), (1, 5), (1, 9)],
    "prefill": [(3, 3), (4, 4), (5, 5), (8, 8)],
    "mixed": [(2, 7), (1, 4), (0, 6), (5, 5), (3, 8), (1, 1)],
    "page_boundaries": [(1, 3), (2, 4), (5, 5), (3, 3), (1, 4), (4, 5)],
    "spec_verify": [(3, 6), (3, 9), (3, 12)],
}


def _allclose(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------
# Batch construction: dense per-request tensors, scattered into randomly permuted pages
# ------------------------------------------------------------------------------------------
@dataclass
class Batch:
    q_full: list[torch.Tensor]  # per request [L, Hq, D]: a query for EVERY position
    k: list[torch.Tensor]  # per request [L, Hkv, D]
    v: list[torch.Tensor]  # per request [L, Hkv, Dv]
    q_lens: list[int]
    q: torch.Tensor  # [T + pad, Hq, D], the last q_len queries of each request, packed
    page_table: torch.Tensor  # [B, max_pages] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [sum L + 1] int64, all tokens then one -1 padding slot
    num_pages: int


def make_batch(
    workload: list[tuple[int, int]],
    *,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    pad_tokens: int = 2,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [ql for ql, _ in workload]
    lens = [sl for _, sl in workload]
    pages_per = [-(-sl // PAGE_SIZE) for sl in lens]
    num_pages = sum(pages_per) + 3  # spare pages stay unused (and hold garbage below)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(pages_per) + 1
    page_table = torch.full((len(workload), max_pages), num_pages - 1, dtype=torch.int32)
    slots, cursor = [], 0
    for b, (sl, npg) in enumerate(zip(lens, pages_per, strict=True)):
        pages = perm[cursor : cursor + npg]
        cursor += npg
        page_table[b, :npg] = torch.tensor(pages, dtype=torch.int32)
        slots += [pages[j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE for j in range(sl)]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q_full = [rnd(sl, hq, d) for sl in lens]
    k = [rnd(sl, hkv, d) for sl in lens]
    v = [rnd(sl, hkv, dv) for sl in lens]
    q_parts = [qf[qf.shape[0] - ql :] for qf, ql in zip(q_full, q_lens, strict=True)]
    q = torch.cat([*q_parts, rnd(pad_tokens, hq, d)])  # padded rows no request owns
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        q_full=q_full,
        k=k,
        v=v,
        q_lens=q_lens,
        q=q,
        page_table=page_table.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([*slots, -1], dtype=torch.int64, device=device),
        num_pages=num_pages,
    )


def fill_kv_cache(
    batch: Batch,
    cache_dtype: torch.dtype,
    *,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    hkv, d = batch.k[0].shape[1:]
    dv = batch.v[0].shape[2]
    device = batch.q.device
    # Garbage (not zeros) in unused slots: a read past seq_len would show up as a mismatch.
    k_cache = (torch.randn(batch.num_pages, PAGE_SIZE, hkv, d, device=device) * 50).to(cache_dtype)
    v_cache = (torch.randn(batch.num_pages, PAGE_SIZE, hkv, dv, device=device) * 50).to(cache_dtype)
    k_new = torch.cat([*batch.k, torch.full_like(batch.k[0][:1], 1e4)])  # padding token: skipped
    v_new = torch.cat([*batch.v, torch.full_like(batch.v[0][:1], 1e4)])
    write_paged_kv(
        k_new, v_new, k_cache, v_cache, batch.slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    return k_cache, v_cache


def sdpa_last(
    q_full: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int, scale: float, causal: bool
) -> torch.Tensor:
    """Dense SDPA over a whole sequence (float32), rows of the last ``q_len`` positions."""
    out = F.scaled_dot_product_attention(
        q_full.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    out = out[0].transpose(0, 1)
    return out[out.shape[0] - q_len :]


def hf_mask(mask_fn, length: int) -> torch.Tensor:
    """Additive ``[1, 1, L, L]`` float32 mask from a transformers.masking_utils mask function."""
    idx = torch.arange(length)
    allowed = mask_fn(0, 0, idx[:, None], idx[None, :])
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]


def stub_module(hq: int, hkv: int, **extra: object) -> types.SimpleNamespace:
    """The attributes HF's eager_attention_forward functions read from ``module``."""
    return types.SimpleNamespace(num_key_value_groups=hq // hkv, training=False, **extra)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D]`` -> HF's ``[1, H, L, D]`` float32."""
    return x.float().cpu().transpose(0, 1)[None]


# ------------------------------------------------------------------------------------------
# Full attention, paged, against dense SDPA
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_paged_matches_dense_sdpa(device, dtype, atol, rtol, workload, hq, hkv):
    batch = make_batch(WORKLOADS[workload], hq=hq, hkv=hkv, d=16, dv=8, dtype=dtype, device=device)
    k_cache, v_cache = fill_kv_cache(batch, dtype)
    scale = 0.3
    out = paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.page_table,
        batch.query_start_loc,
        batch.seq_lens,
        scale=scale,
    )
    assert out.dtype == dtype and out.shape == (batch.q.shape[0], hq, 8)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        expected = sdpa_last(batch.q_full[b], batch.k[b], batch.v[b], ql, scale, causal=True)
        _allclose(out[qsl[b] : qsl[b + 1]], expected, atol, rtol)
    assert torch.all(out[qsl[-1] :] == 0), "rows no request owns must be zero"


@pytest.mark.parametrize("device", DEVICES)
def test_paged_bidirectional_matches_sdpa(device):
    batch = make_batch(
        WORKLOADS["mixed"], hq=4, hkv=2, d=8, dv=8, dtype=torch.float32, device=device
    )
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    out = paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.page_table,
        batch.query_start_loc,
        batch.seq_lens,
        scale=0.5,
        causal=False,
    )
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        q_last = batch.q_full[b][batch.q_full[b].shape[0] - ql :]
        expected = sdpa_last(q_last, batch.k[b], batch.v[b], ql, 0.5, causal=False)
        _allclose(out[qsl[b] : qsl[b + 1]], expected, 2e-5, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_out_is_written_in_place(device):
    batch = make_batch(
        WORKLOADS["mixed"], hq=2, hkv=1, d=8, dv=4, dtype=torch.float32, device=device
    )
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    args = (batch.q, k_cache, v_cache, batch.page_table, batch.query_start_loc, batch.seq_lens)
    expected = paged_attention(*args, scale=0.4)
    out = torch.full((batch.q.shape[0], 2, 4), float("nan"), dtype=torch.bfloat16, device=device)
    returned = paged_attention(*args, scale=0.4, out=out)
    assert returned is out
    assert not torch.isnan(out).any(), "every row, padding included, must be written"
    _allclose(out, expected, 1e-2, 1e-2)


def test_write_paged_kv_places_each_token_at_its_slot():
    batch = make_batch(
        WORKLOADS["mixed"], hq=2, hkv=2, d=4, dv=4, dtype=torch.float32, device="cpu"
    )
    before_k, _ = fill_kv_cache(batch, torch.float32)
    for b, length in enumerate(batch.seq_lens.tolist()):
        for j in range(length):
            page = int(batch.page_table[b, j // PAGE_SIZE])
            assert torch.equal(before_k[page, j % PAGE_SIZE], batch.k[b][j])
    # The padding token (slot -1, value 1e4) must not have been written anywhere.
    assert not (before_k == 1e4).any()


# ------------------------------------------------------------------------------------------
# Full attention against HF transformers' eager attention functions
# ------------------------------------------------------------------------------------------
def _run_paged(batch: Batch, cache_dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    k_cache, v_cache = fill_kv_cache(batch, cache_dtype)
    return paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.page_table,
        batch.query_start_loc,
        batch.seq_lens,
        **kwargs,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_sinks_and_window_match_hf_gpt_oss(device, dtype, atol, rtol, window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    hq, hkv, scale = 4, 2, 0.35
    batch = make_batch(WORKLOADS["mixed"], hq=hq, hkv=hkv, d=8, dv=8, dtype=dtype, device=device)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)) * 2
    out = _run_paged(batch, dtype, scale=scale, sliding_window=window, sinks=sinks.to(device))
    module = stub_module(hq, hkv, sinks=sinks)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        length = batch.k[b].shape[0]
        mask_fn = (
            masking_utils.causal_mask_function
            if window is None
            else masking_utils.sliding_window_causal_mask_function(window)
        )
        expected, _ = eager_attention_forward(
            module,
            heads_first(batch.q_full[b]),
            heads_first(batch.k[b]),
            heads_first(batch.v[b]),
            hf_mask(mask_fn, length),
            scaling=scale,
        )
        _allclose(out[qsl[b] : qsl[b + 1]], expected[0, length - ql :], atol, rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("window", [None, 4])
def test_soft_cap_matches_hf_gemma2(device, dtype, atol, rtol, window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    hq, hkv, d, cap = 4, 2, 16, 2.0
    scale = d**-0.5 * 4  # large logits, so the cap really bites
    batch = make_batch(
        WORKLOADS["page_boundaries"], hq=hq, hkv=hkv, d=d, dv=d, dtype=dtype, device=device
    )
    out = _run_paged(batch, dtype, scale=scale, logits_soft_cap=cap, sliding_window=window)
    uncapped = _run_paged(batch, dtype, scale=scale, sliding_window=window)
    assert (out.float() - uncapped.float()).abs().max() > 1e-2, "soft cap had no effect"
    module = stub_module(hq, hkv, head_dim=d)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        length = batch.k[b].shape[0]
        mask_fn = (
            masking_utils.causal_mask_function
            if window is None
            else masking_utils.sliding_window_causal_mask_function(window)
        )
        expected, _ = eager_attention_forward(
            module,
            heads_first(batch.q_full[b]),
            heads_first(batch.k[b]),
            heads_first(batch.v[b]),
            hf_mask(mask_fn, length),
            scaling=scale,
            softcap=cap,
        )
        _allclose(out[qsl[b] : qsl[b + 1]], expected[0, length - ql :], atol, rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("hq", "hkv"), [(6, 3), (6, 1), (4, 4)])
def test_gqa_matches_hf_llama(device, hq, hkv):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    batch = make_batch(
        WORKLOADS["spec_verify"], hq=hq, hkv=hkv, d=8, dv=8, dtype=torch.float32, device=device
    )
    scale = 8**-0.5
    out = _run_paged(batch, scale=scale)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        length = batch.k[b].shape[0]
        expected, _ = eager_attention_forward(
            stub_module(hq, hkv),
            heads_first(batch.q_full[b]),
            heads_first(batch.k[b]),
            heads_first(batch.v[b]),
            hf_mask(masking_utils.causal_mask_function, length),
            scaling=scale,
        )
        _allclose(out[qsl[b] : qsl[b + 1]], expected[0, length - ql :], 2e-5, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_long_requests_run_in_query_blocks(device, monkeypatch):
    """A tiny logits budget forces query blocking (2 rows per block); results stay exact."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from attn_core.reference.ops import attention

    monkeypatch.setattr(attention, "MAX_LOGITS_PER_BLOCK", 4 * 9 * 2)
    batch = make_batch(
        WORKLOADS["prefill"] + [(7, 9)], hq=4, hkv=2, d=8, dv=8, dtype=torch.float32, device=device
    )
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2), device="cpu").to(device)
    out = _run_paged(batch, scale=0.3, sliding_window=3, sinks=sinks)
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        length = batch.k[b].shape[0]
        expected, _ = eager_attention_forward(
            stub_module(4, 2, sinks=sinks.cpu()),
            heads_first(batch.q_full[b]),
            heads_first(batch.k[b]),
            heads_first(batch.v[b]),
            hf_mask(masking_utils.sliding_window_causal_mask_function(3), length),
            scaling=0.3,
        )
        _allclose(out[qsl[b] : qsl[b + 1]], expected[0, length - ql :], 2e-5, 1e-5)


# ------------------------------------------------------------------------------------------
# FP8 KV cache
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tensor_scales", [False, True], ids=["float_scales", "tensor_scales"])
def test_fp8_kv_cache(device, tensor_scales):
    batch = make_batch(
        WORKLOADS["mixed"], hq=4, hkv=2, d=16, dv=16, dtype=torch.float32, device=device
    )
    k_scale, v_scale = 0.02, 0.01
    ks = torch.tensor(k_scale, device=device) if tensor_scales else k_scale
    vs = torch.tensor(v_scale, device=device) if tensor_scales else v_scale
    k_cache, v_cache = fill_kv_cache(batch, FP8_DTYPE, k_scale=ks, v_scale=vs)
    assert k_cache.dtype == FP8_DTYPE
    scale = 0.25
    out = paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.page_table,
        batch.query_start_loc,
        batch.seq_lens,
        scale=scale,
        k_scale=ks,
        v_scale=vs,
    )
    qsl = batch.query_start_loc.tolist()
    for b, ql in enumerate(batch.q_lens):
        # The stored values, read back and dequantised by hand, page by page.
        length = batch.k[b].shape[0]
        rows = [(int(batch.page_table[b, j // PAGE_SIZE]), j % PAGE_SIZE) for j in range(length)]
        k_deq = torch.stack([k_cache[p, o].float() for p, o in rows]) * k_scale
        v_deq = torch.stack([v_cache[p, o].float() for p, o in rows]) * v_scale
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each stored value.
        torch.testing.assert_close(k_deq, batch.k[b], atol=1e-3, rtol=2**-4)
        got = out[qsl[b] : qsl[b + 1]]
        # Exactly-ish the attention over the explicitly dequantised cache ...
        _allclose(got, sdpa_last(batch.q_full[b], k_deq, v_deq, ql, scale, True), 2e-5, 1e-5)
        # ... and within fp8 tolerance of the full-precision attention.
        fp32 = sdpa_last(batch.q_full[b], batch.k[b], batch.v[b], ql, scale, True)
        _allclose(got, fp32, 0.1, 0.1)


def test_fp8_write_clamps_to_e4m3_range():
    k_cache = torch.zeros(1, 2, 1, 2, dtype=FP8_DTYPE)
    v_cache = torch.zeros(1, 2, 1, 2, dtype=FP8_DTYPE)
    k = torch.tensor([[[1000.0, -1000.0]], [[1.0, -0.5]]])
    write_paged_kv(k, k, k_cache, v_cache, torch.tensor([0, 1]), k_scale=0.5, v_scale=4.0)
    assert k_cache.float().tolist() == [[[[448.0, -448.0]], [[2.0, -1.0]]]]
    # 1000 / 4 = 250 is not an e4m3 value: the step in [128, 256) is 16, so it rounds to 256.
    assert v_cache.float().tolist() == [[[[256.0, -256.0]], [[0.25, -0.125]]]]
    assert not torch.isnan(k_cache.float()).any()


# ------------------------------------------------------------------------------------------
# Encoder (varlen) attention
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)])
def test_varlen_matches_sdpa_per_sequence(device, dtype, atol, rtol, causal, hq, hkv):
    gen = torch.Generator().manual_seed(3)
    lens = [5, 1, 0, 9, 3]
    total = sum(lens)
    q = torch.randn(total + 2, hq, 8, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(total + 2, hkv, 8, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(total + 2, hkv, 4, generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = varlen_attention(q, k, v, cu, scale=0.4, causal=causal)
    assert out.dtype == dtype and out.shape == (total + 2, hq, 4)
    cu_list = cu.tolist()
    for start, end in itertools.pairwise(cu_list):
        if end == start:
            continue
        sl = slice(start, end)
        expected = sdpa_last(q[sl], k[sl], v[sl], end - start, 0.4, causal)
        _allclose(out[sl], expected, atol, rtol)
    assert torch.all(out[total:] == 0)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_varlen_bidirectional_window_matches_flash_convention(window):
    """Bidirectional window W sees |i - j| < W (FlashAttention window_size=(W-1, W-1))."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(7, 2, 4, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 7], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, scale=0.5, sliding_window=window)
    idx = torch.arange(7)
    # HF's bidirectional overlay is inclusive of its argument: |i - j| <= window - 1.
    overlay = masking_utils.sliding_window_bidirectional_overlay(window - 1)
    allowed = overlay(0, 0, idx[:, None], idx[None, :])
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=0.5
    ).transpose(0, 1)
    _allclose(out, expected, 2e-5, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_matches_hf_qwen2_5_vl_vision_attention(device):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    torch.manual_seed(5)
    config = Qwen2_5_VLVisionConfig(hidden_size=32, num_heads=4)
    config._attn_implementation = "eager"
    attn = qwen.Qwen2_5_VLVisionAttention(config).eval()
    lens = [6, 3, 8]
    total, heads, hd = sum(lens), 4, 8
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    hidden = torch.randn(total, 32)
    angles = torch.rand(total, hd // 2) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        expected = attn(hidden, cu_seqlens=cu, position_embeddings=(cos, sin))
        qkv = attn.qkv(hidden).reshape(total, 3, heads, hd).unbind(1)
        q, k = qwen.apply_rotary_pos_emb_vision(qkv[0], qkv[1], cos, sin)
        o = varlen_attention(
            q.to(device), k.to(device), qkv[2].to(device), cu.to(device), scale=attn.scaling
        )
        got = attn.proj(o.cpu().reshape(total, heads * hd))
    _allclose(got, expected, 2e-5, 1e-5)


# ------------------------------------------------------------------------------------------
# MLA against HF DeepSeek-V3 attention
# ------------------------------------------------------------------------------------------
MLA_DIMS = {"hidden": 48, "heads": 4, "rank": 32, "rope": 8, "nope": 16, "v": 12}


def _deepseek_attention(q_lora_rank: int | None, rope_interleave: bool):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    torch.manual_seed(6)
    config = DeepseekV3Config(
        hidden_size=MLA_DIMS["hidden"],
        num_attention_heads=MLA_DIMS["heads"],
        num_key_value_heads=MLA_DIMS["heads"],
        kv_lora_rank=MLA_DIMS["rank"],
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=MLA_DIMS["rope"],
        qk_nope_head_dim=MLA_DIMS["nope"],
        v_head_dim=MLA_DIMS["v"],
        rope_interleave=rope_interleave,
        attn_implementation="eager",
    )
    attn = ds.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():  # random RMSNorm weights, so the norm is not the identity
        attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
        if attn.q_a_layernorm is not None:
            attn.q_a_layernorm.weight.uniform_(0.5, 1.5)
    return ds, attn, ds.DeepseekV3RotaryEmbedding(config)


def _mla_inputs(ds, attn, rope, hidden: torch.Tensor):
    """HF's own projections and rope: (q_nope [L,H,Dn], q_pe [L,H,P], latent [L,R+P])."""
    length = hidden.shape[0]
    h = hidden[None]
    if attn.q_lora_rank is None:
        q = attn.q_proj(h)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
    q = q.view(1, length, -1, attn.qk_head_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    c_kv, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(h), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    c_kv = attn.kv_a_layernorm(c_kv)
    cos, sin = rope(h, torch.arange(length)[None])
    apply = (
        ds.apply_rotary_pos_emb_interleave
        if attn.config.rope_interleave
        else (ds.apply_rotary_pos_emb)
    )
    q_rot, k_rot = apply(q_rot, k_rot[:, None], cos, sin)
    latent = torch.cat([c_kv[0], k_rot[0, 0]], dim=-1)
    return q_nope[0].transpose(0, 1), q_rot[0].transpose(0, 1), latent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "latent_dtype", "tol"),
    [
        (torch.float32, torch.float32, 2e-5),
        (torch.bfloat16, torch.bfloat16, 3e-2),
        (torch.float32, FP8_DTYPE, 0.15),
    ],
    ids=["fp32", "bf16", "fp8_latent"],
)
@pytest.mark.parametrize(("q_lora_rank", "interleave"), [(None, True), (24, False)])
def test_mla_absorbed_paged_matches_hf_deepseek_v3(
    device, dtype, latent_dtype, tol, q_lora_rank, interleave
):
    ds, attn, rope = _deepseek_attention(q_lora_rank, interleave)
    heads, rank = MLA_DIMS["heads"], MLA_DIMS["rank"]
    workload = WORKLOADS["mixed"]
    gen = torch.Generator().manual_seed(7)
    hiddens = [torch.randn(sl, MLA_DIMS["hidden"], generator=gen) for _, sl in workload]
    w_uk, w_uv = mla_split_kv_b_proj(
        attn.kv_b_proj.weight.detach(),
        num_heads=heads,
        qk_nope_head_dim=MLA_DIMS["nope"],
        v_head_dim=MLA_DIMS["v"],
    )
    # Pages, slots and query layout come from the shared batch builder (its k/v are unused).
    batch = make_batch(
        workload, hq=1, hkv=1, d=1, dv=1, dtype=torch.float32, device=device, pad_tokens=1
    )
    expected, q_parts, latents = [], [], []
    with torch.no_grad():
        for hidden, (ql, sl) in zip(hiddens, workload, strict=True):
            mask = hf_mask(masking_utils.causal_mask_function, sl)
            out, _ = attn(hidden[None], rope(hidden[None], torch.arange(sl)[None]), mask)
            expected.append(out[0, sl - ql :])
            q_nope, q_pe, latent = _mla_inputs(ds, attn, rope, hidden)
            q_abs = torch.cat([mla_absorb_query(q_nope, w_uk), q_pe], dim=-1)
            q_parts.append(q_abs[sl - ql :])
            latents.append(latent)
    q = torch.cat([*q_parts, torch.randn(1, heads, rank + MLA_DIMS["rope"])])
    kv = torch.cat([*latents, torch.full((1, rank + MLA_DIMS["rope"]), 1e4)])  # padding: skipped
    cache = torch.randn(batch.num_pages, PAGE_SIZE, kv.shape[1], device=device).to(latent_dtype)
    latent_scale = 0.05 if latent_dtype == FP8_DTYPE else 1.0
    write_paged_latent(kv.to(device, dtype), cache, batch.slot_mapping, scale=latent_scale)
    o_latent = mla_paged_attention(
        q.to(device, dtype),
        cache,
        batch.page_table,
        batch.query_start_loc,
        batch.seq_lens,
        kv_lora_rank=rank,
        scale=attn.scaling,
        latent_scale=latent_scale,
    )
    assert o_latent.shape == (q.shape[0], heads, rank) and o_latent.dtype == dtype
    assert torch.all(o_latent[-1] == 0)
    with torch.no_grad():
        o = mla_output_from_latent(o_latent[:-1].float().cpu(), w_uv.float())
        got = attn.o_proj(o.reshape(o.shape[0], -1))
    want = torch.cat(expected)
    err = (got - want).abs().max() / want.abs().max()
    assert err < tol, f"relative max error {err:.3g} > {tol}"
    if dtype == torch.float32 and latent_dtype == torch.float32:
        _allclose(got, want, 2e-5, 1e-5)


def test_mla_absorption_helpers_match_unabsorbed_products():
    gen = torch.Generator().manual_seed(8)
    t, h, dn, r, dv = 3, 2, 5, 7, 4
    q_nope = torch.randn(t, h, dn, generator=gen)
    c_kv = torch.randn(6, r, generator=gen)
    weight = torch.randn(h * (dn + dv), r, generator=gen)
    w_uk, w_uv = mla_split_kv_b_proj(weight, num_heads=h, qk_nope_head_dim=dn, v_head_dim=dv)
    kv = (c_kv @ weight.T).view(6, h, dn + dv)  # what kv_b_proj produces, per head
    k_nope, value = kv[..., :dn], kv[..., dn:]
    logits = torch.einsum("thd,khd->thk", q_nope, k_nope)
    absorbed = torch.einsum("thr,kr->thk", mla_absorb_query(q_nope, w_uk), c_kv)
    _allclose(absorbed, logits, 1e-4, 1e-5)
    probs = torch.softmax(torch.randn(t, h, 6, generator=gen), dim=-1)
    direct = torch.einsum("thk,khv->thv", probs, value)
    via_latent = mla_output_from_latent(torch.einsum("thk,kr->thr", probs, c_kv), w_uv)
    _allclose(via_latent, direct, 1e-4, 1e-5)


# ------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------
def test_errors_name_expected_and_got():
    batch = make_batch([(2, 3)], hq=4, hkv=2, d=8, dv=8, dtype=torch.float32, device="cpu")
    k_cache, v_cache = fill_kv_cache(batch, torch.float32)
    args = [batch.q, k_cache, v_cache, batch.page_table, batch.query_start_loc, batch.seq_lens]
    with pytest.raises(ValueError, match=r"q: expected 3 dims .*got shape \(4, 32\)"):
        paged_attention(batch.q.flatten(1), *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(batch.q[:, :3], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=1"):
        paged_attention(*args[:5], torch.tensor([1], dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="sliding_window=0"):
        paged_attention(*args, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        paged_attention(*args, scale=1.0, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="integer tensor"):
        paged_attention(*args[:4], batch.query_start_loc.float(), batch.seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="out: expected shape"):
        paged_attention(*args, scale=1.0, out=torch.empty(1, 4, 8))
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        write_paged_kv(batch.k[0], batch.v[0], k_cache, v_cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        write_paged_kv(batch.k[0][:1], batch.v[0][:1], k_cache, v_cache, torch.tensor([10**6]))
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(*args, scale=1.0, k_scale=torch.ones(2))


def test_soft_cap_formula_is_exact():
    """Two keys pin the capped logit: p(key 0) = sigmoid(c * tanh(6 / c)) for logits 6 and 0."""
    q = torch.tensor([[[3.0]], [[3.0]]])  # [T=2, H=1, D=1]
    k = torch.tensor([[[2.0]], [[0.0]]])
    v = torch.tensor([[[1.0]], [[0.0]]])  # output = probability of key 0
    cu = torch.tensor([0, 2], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, scale=1.0, logits_soft_cap=5.0)
    capped = 5.0 * math.tanh(6.0 / 5.0)
    assert out[1, 0, 0].item() == pytest.approx(1.0 / (1.0 + math.exp(-capped)), rel=1e-6)
