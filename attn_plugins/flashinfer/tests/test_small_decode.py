"""small_decode's kernels called directly, in every tiling the benchmark sweeps, against a torch
gather-and-softmax written here (float32), and the cache write checked row by row.

Without a GPU the kernels run in Triton's interpreter on small shapes (conftest sets
``TRITON_INTERPRET``); with one, on the H200's shapes (32 q / 8 kv heads, d128, page 16) and
contexts of several thousand tokens, so every split loops over many blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from attn_plugin_flashinfer.small_decode import (
    SmallDecodeBuffers,
    SmallDecodeConfig,
    num_splits_for,
    small_decode,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if CUDA:
    H, HKV, D, PAGE, LENS = 32, 8, 128, 16, [(4096,), (1, 3000), (17, 2500, 700)]
else:
    H, HKV, D, PAGE, LENS = 8, 2, 64, 8, [(150,), (1, 77), (9, 130, 40)]

TILINGS = [
    SmallDecodeConfig(),  # the default
    SmallDecodeConfig(prefetch=True),
    SmallDecodeConfig(32, 4, 3, prefetch=True),  # the fastest in the H200 sweep
    SmallDecodeConfig(128, 8, 2, prefetch=True),
    SmallDecodeConfig(16, 4, 2),
]


def _reference(q, k, v, k_cache, v_cache, page_table, seq_lens, slots, scale):
    """Output ``[B, H, D]`` float32 and the caches after the write."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B = q.shape[0]
    group = H // HKV
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        if slots[b] >= 0:
            k_cache.view(-1, HKV, D)[slots[b]] = k[b]
            v_cache.view(-1, HKV, D)[slots[b]] = v[b]
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        rows = page_table[b, pos // PAGE].long() * PAGE + pos % PAGE
        keys = k_cache.view(-1, HKV, D)[rows].float()
        vals = v_cache.view(-1, HKV, D)[rows].float()
        keys[-1], vals[-1] = k[b].float(), v[b].float()  # the new token, written or not
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, vals)
    return out, k_cache, v_cache


@pytest.mark.parametrize("lens", LENS, ids=lambda lens: "x".join(map(str, lens)))
@pytest.mark.parametrize("config", TILINGS, ids=lambda c: c.label)
def test_small_decode_matches_a_gather_reference_and_writes_only_its_slots(lens, config):
    _check(lens, config, torch.bfloat16)


def test_small_decode_float16():
    _check(LENS[-1], SmallDecodeConfig(), torch.float16)


def _check(lens, config, dtype):
    gen = torch.Generator().manual_seed(len(lens) * 1000 + config.block_n)
    B = len(lens)
    width = math.ceil(max(lens) / PAGE) + 1
    num_pages = B * width + 3
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    # each request owns distinct pages, in a shuffled order
    owner = torch.randperm(num_pages, generator=gen)[: B * width].view(B, width).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor(
        [int(owner[b, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)]
    )
    if B > 1:
        slots[0] = -1  # a padding row: attends, writes nothing
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, D, generator=gen).to(dtype)
    scale = 1 / math.sqrt(D)
    want, k_want, v_want = _reference(q, k, v, k_cache, v_cache, owner, seq_lens, slots, scale)

    on = {"device": DEVICE}
    args = [t.to(**on) for t in (q, k, v, k_cache, v_cache, owner, seq_lens, slots)]
    out = torch.full((B, H, D), float("nan"), dtype=dtype, **on)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if CUDA else 4
    splits = num_splits_for(B, HKV, max(lens), sms)
    for n in sorted({splits, 2 * splits}):  # the plugin's split count and the sweep's double
        buffers = SmallDecodeBuffers.allocate(B, H, n, D, DEVICE)
        kc, vc = args[3].clone(), args[4].clone()
        small_decode(*args[:3], kc, vc, *args[5:], out, buffers, scale=scale, config=config)
        err = (out.float().cpu() - want).abs().max().item()
        assert err < 2e-2, f"splits {n}: max |small_decode - reference| = {err:.3g}"
        assert torch.equal(kc.cpu(), k_want) and torch.equal(vc.cpu(), v_want), f"splits {n}"
