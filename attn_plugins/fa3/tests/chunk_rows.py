"""What FlashAttention-4's varlen call returns for one-query chunk rows, in plain PyTorch: the
split-KV tests' stand-in for the kernel (``run_with_lse``)."""

from __future__ import annotations

import torch


def attend_chunk_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqused_k: torch.Tensor,
    scale: float,
    *,
    softcap: float | None = None,
    empty: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over the row's pages.

    :param q: ``[N, H, D]``; ``k_cache`` / ``v_cache`` ``[pages, page_size, Hkv, D]``.
    :param page_table: ``[N, pages_per_row]`` int32; ``seqused_k``: ``[N]`` keys of each row.
    :param softcap: ``c * tanh(s / c)`` on the scaled logits, as the kernel's score_mod.
    :param empty: what a row with no keys holds in ``out`` (its ``lse`` is NaN for a NaN
        ``empty``, else -inf): garbage a merge must not read.
    :returns: ``out [N, H, D]`` in q's dtype and ``lse [H, N]`` float32.
    """
    n, h, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.full_like(q, empty)
    lse = torch.full((h, n), empty if empty != empty else float("-inf"))
    for r in range(n):
        used = int(seqused_k[r])
        if used == 0:
            continue
        pages = page_table[r, : -(-used // page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:used].float().repeat_interleave(h // hkv, 1)
        v = v_cache[pages].reshape(-1, hkv, d)[:used].float().repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,khd->hk", q[r].float(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        lse[:, r] = torch.logsumexp(s, dim=-1)
        out[r] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out, lse
