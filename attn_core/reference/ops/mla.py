"""Reference multi-head latent attention (DeepSeek-V2/V3) in the absorbed form, over a paged cache.

Notation (``H`` heads, ``R = kv_lora_rank``, ``P = qk_rope_head_dim``, ``Dn = qk_nope_head_dim``,
``Dv = v_head_dim``). DeepSeek's ``kv_b_proj`` maps the normalised latent ``c_kv [R]`` to
per-head ``k_nope [Dn]`` and ``v [Dv]``; split per head it is ``W_UK [H, Dn, R]`` and
``W_V [H, Dv, R]``. Unabsorbed attention of head h reads::

    logit = (q_nope . W_UK[h] c_kv + q_pe . k_pe) * scale
    out   = sum softmax(logit) * W_V[h] c_kv

Moving ``W_UK`` onto the query (:func:`mla_absorb_query`) and ``W_V`` after the softmax
(:func:`mla_output_from_latent`, with ``w_uv = W_V^T [H, R, Dv]``) turns it into multi-query
attention over the latent, which is what the cache stores (FlashInfer MLA convention)::

    q      [T, H, R + P]        = concat(q_nope W_UK, q_pe)       (absorbed query)
    latent [.., R + P]          = concat(c_kv, k_pe)               (k_pe already roped)
    logit  = q . latent * scale;   o_latent [T, H, R] = softmax(logit) . c_kv

Batch layout (``page_table``, ``query_start_loc``, ``seq_lens``) and causality are those of
:func:`attn_core.reference.ops.attention.paged_attention`.
"""

from __future__ import annotations

import torch

from attn_core.reference.ops.attention import (
    ScaleLike,
    _attend,
    _check_batch,
    _check_dim,
    _check_options,
    _check_scale,
    _gather_tokens,
    _prepare_out,
    _write_slots,
    _zero_uncovered,
    dequantize_cache,
)

__all__ = [
    "mla_absorb_query",
    "mla_output_from_latent",
    "mla_paged_attention",
    "mla_split_kv_b_proj",
    "write_paged_latent",
]


def mla_split_kv_b_proj(
    weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split DeepSeek's ``kv_b_proj.weight`` into the absorption matrices.

    :param weight: ``[H * (Dn + Dv), R]`` (``nn.Linear(R, H * (Dn + Dv)).weight``).
    :returns: ``(w_uk [H, Dn, R], w_uv [H, R, Dv])``, views/transposes of ``weight``, its dtype.
    """
    _check_dim(weight, "weight", 2, "[H * (Dn + Dv), R]")
    per_head = qk_nope_head_dim + v_head_dim
    if weight.shape[0] != num_heads * per_head:
        raise ValueError(
            f"weight: expected {num_heads} * ({qk_nope_head_dim} + {v_head_dim}) = "
            f"{num_heads * per_head} rows, got {weight.shape[0]}"
        )
    w = weight.reshape(num_heads, per_head, weight.shape[1])
    w_uk = w[:, :qk_nope_head_dim, :]
    w_uv = w[:, qk_nope_head_dim:, :].transpose(1, 2)
    return w_uk, w_uv


def mla_absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Move the key up-projection onto the query: ``q_lat[t, h] = W_UK[h]^T q_nope[t, h]``.

    :param q_nope: ``[T, H, Dn]`` float.
    :param w_uk: ``[H, Dn, R]`` float.
    :returns: ``[T, H, R]`` in ``q_nope.dtype`` (computed in float32).
    """
    _check_dim(q_nope, "q_nope", 3, "[T, H, Dn]")
    _check_dim(w_uk, "w_uk", 3, "[H, Dn, R]")
    if tuple(w_uk.shape[:2]) != tuple(q_nope.shape[1:]):
        raise ValueError(
            f"w_uk: expected leading dims {tuple(q_nope.shape[1:])} (H, Dn of q_nope), "
            f"got {tuple(w_uk.shape[:2])}"
        )
    out = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())
    return out.to(q_nope.dtype)


def mla_output_from_latent(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Map the latent attention output to per-head values: ``o[t, h] = o_latent[t, h] W_UV[h]``.

    :param o_latent: ``[T, H, R]`` float, the output of :func:`mla_paged_attention`.
    :param w_uv: ``[H, R, Dv]`` float.
    :returns: ``[T, H, Dv]`` in ``o_latent.dtype`` (computed in float32).
    """
    _check_dim(o_latent, "o_latent", 3, "[T, H, R]")
    _check_dim(w_uv, "w_uv", 3, "[H, R, Dv]")
    if tuple(w_uv.shape[:2]) != tuple(o_latent.shape[1:]):
        raise ValueError(
            f"w_uv: expected leading dims {tuple(o_latent.shape[1:])} (H, R of o_latent), "
            f"got {tuple(w_uv.shape[:2])}"
        )
    out = torch.einsum("thr,hrv->thv", o_latent.float(), w_uv.float())
    return out.to(o_latent.dtype)


def write_paged_latent(
    kv: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: ScaleLike = 1.0,
) -> None:
    """Store the step's new latents ``concat(c_kv, k_pe)`` in a paged latent cache, in place.

    :param kv: ``[T, R + P]`` float.
    :param latent_cache: ``[num_pages, page_size, R + P]``, float or ``float8_e4m3fn``.
    :param slot_mapping: ``[T]`` integer (int64), ``page * page_size + offset``; ``-1`` skips.
    :param scale: fp8 only: the cache stores ``clamp(kv / scale, ±448)``.
    """
    _check_dim(kv, "kv", 2, "[T, R + P]")
    _check_dim(latent_cache, "latent_cache", 3, "[num_pages, page_size, R + P]")
    _write_slots(kv, latent_cache, slot_mapping, scale, "kv")


def mla_paged_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    causal: bool = True,
    latent_scale: ScaleLike = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA of a ragged batch over a paged latent cache.

    :param q: ``[T, H, R + P]`` float, ``concat(mla_absorb_query(q_nope, w_uk), q_pe)``.
    :param latent_cache: ``[num_pages, page_size, R + P]`` float or ``float8_e4m3fn``,
        ``concat(c_kv, k_pe)`` per token (new tokens already written).
    :param page_table: ``[B, max_pages]`` int32.
    :param query_start_loc: ``[B + 1]`` int32.
    :param seq_lens: ``[B]`` int32, KV length including the new tokens.
    :param kv_lora_rank: ``R``; the first ``R`` latent columns are the values.
    :param scale: softmax scale (DeepSeek: ``1/sqrt(Dn + P)``, times the YaRN mscale squared).
    :param causal: True: a query at position p sees latents ``0..p``.
    :param latent_scale: fp8 dequantisation scale of the cache.
    :param out: optional ``[T, H, R]`` tensor to write into.
    :returns: ``[T, H, R]`` in ``q.dtype`` (or ``out``); rows no request owns are zero.
    """
    _check_dim(q, "q", 3, "[T, H, R + P]")
    _check_dim(latent_cache, "latent_cache", 3, "[num_pages, page_size, R + P]")
    _check_options(None, None, scale)
    num_tokens, heads, width = q.shape
    if latent_cache.shape[2] != width:
        raise ValueError(
            f"latent_cache: expected {width} columns (R + P, as q), got {latent_cache.shape[2]}"
        )
    if (
        isinstance(kv_lora_rank, bool)
        or not isinstance(kv_lora_rank, int)
        or not (0 < kv_lora_rank <= width)
    ):
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r}: expected an integer in 1..{width}")
    qsl, lens = _check_batch(page_table, query_start_loc, seq_lens, num_tokens)
    ls = _check_scale(latent_scale, "latent_scale", q.device)

    result = _prepare_out(out, (num_tokens, heads, kv_lora_rank), q)
    _zero_uncovered(result, qsl)
    for b, length in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        latent = dequantize_cache(_gather_tokens(latent_cache, page_table[b], length), ls)
        latent = latent.to(q.device)[:, None, :]  # one shared KV head: MLA is MQA over the latent
        k_pos = torch.arange(length, device=q.device)
        o = _attend(
            q[start:end].float(),
            latent,
            latent[..., :kv_lora_rank],
            k_pos[length - (end - start) :],
            k_pos,
            scale=scale,
            causal=causal,
        )
        result[start:end] = o.to(result.dtype)
    return result
