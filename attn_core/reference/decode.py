"""Graph-safe decode steps of the reference backend (one new token per request).

These run without reading any length back to the host, so a decode step can be captured in a CUDA
graph and replayed with new metadata. Padding rows (``state_indices == -1``, ``slot_mapping ==
-1``) read harmless data and write nothing. All math in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_core.specs import CONV_ACTIVATIONS

__all__ = [
    "decode_conv1d",
    "decode_full_attention",
    "decode_linear_step",
    "decode_mla_attention",
]


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """``cache [P, page, ...]``, ``page_table [B, W]`` -> ``[B, W * page, ...]``."""
    b, w = page_table.shape
    g = cache.index_select(0, page_table.reshape(-1).long())
    return g.reshape(b, w * cache.shape[1], *cache.shape[2:])


def _masked_softmax_out(
    logits: torch.Tensor,  # [B, H, L]
    values: torch.Tensor,  # [B, H, L, Dv] or broadcastable
    visible: torch.Tensor,  # [B, 1, L] bool
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    logits = logits.masked_fill(~visible, float("-inf"))
    # the values too: the gathered row holds other requests' pages and stale slots, and a
    # masked-out NaN or infinity there would still reach the output (0 x NaN is NaN)
    values = values.masked_fill(~visible.unsqueeze(-1), 0.0)
    m = logits.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().view(1, -1, 1))
    p = (logits - m).exp()
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + (sinks.float().view(1, -1, 1) - m).exp()
    return torch.matmul((p / denom).unsqueeze(-2), values).squeeze(-2)


def decode_full_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` over paged KV; returns ``[B, Hq, Dv]`` float32.

    ``page_table [B, W]`` int32 (the whole table width is gathered: fixed shapes),
    ``seq_lens [B]`` int32 including the new token, which sits at position ``seq_len - 1``.
    ``attention_chunk_size = C``: the token sees keys of its own chunk only,
    ``(seq_len - 1) // C * C <= j`` (computed on the device: graph-safe).
    """
    hq = q.shape[1]
    k = _gather_pages(k_cache, page_table).float() * k_scale  # [B, L, Hkv, D]
    v = _gather_pages(v_cache, page_table).float() * v_scale
    hkv = k.shape[2]
    rep = hq // hkv
    k = k.permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)  # [B, Hq, L, D]
    v = v.permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    logits = torch.matmul(k, q.float().unsqueeze(-1)).squeeze(-1) * scale  # [B, Hq, L]
    if logits_soft_cap is not None:
        logits = torch.tanh(logits / logits_soft_cap) * logits_soft_cap
    pos = torch.arange(k.shape[2], device=q.device).view(1, 1, -1)
    last = seq_lens.view(-1, 1, 1).long()
    visible = pos < last
    if sliding_window is not None:
        visible = visible & (pos >= last - sliding_window)
    if attention_chunk_size is not None:  # the chunk of the new token, at position last - 1
        visible = visible & (pos >= (last - 1) // attention_chunk_size * attention_chunk_size)
    return _masked_softmax_out(logits, v, visible, sinks)


def decode_mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    latent_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Absorbed MLA decode: ``q [B, H, R + P]`` -> ``[B, H, R]`` float32."""
    lat = _gather_pages(latent_cache, page_table).float() * latent_scale  # [B, L, R + P]
    logits = torch.matmul(lat.unsqueeze(1), q.float().unsqueeze(-1)).squeeze(-1) * scale
    pos = torch.arange(lat.shape[1], device=q.device).view(1, 1, -1)
    visible = pos < seq_lens.view(-1, 1, 1).long()
    return _masked_softmax_out(logits, lat[..., :kv_lora_rank].unsqueeze(1), visible, None)


def _safe_rows(state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    valid = state_indices >= 0
    return state_indices.clamp_min(0).long(), valid


def _scatter_rows(pool: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, new: torch.Tensor):
    """``pool[rows[b]] = new[b]`` for valid rows only, with fixed shapes (graph-safe).

    Padding rows are redirected to the first valid row and write that row's value, so duplicate
    indices always carry equal values (``index_copy_`` is then deterministic).
    """
    b = torch.arange(rows.shape[0], device=rows.device)
    first = valid.to(torch.int32).argmax()
    src = torch.where(valid, b, first)
    target = rows[src]
    value = torch.where(valid.any(), new[src].to(pool.dtype), pool[target])
    pool.index_copy_(0, target, value)


def decode_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One conv step: ``x [B, C]``, ``conv_state [S, C, K-1]`` updated in place; -> ``[B, C]``."""
    rows, valid = _safe_rows(state_indices)
    window = torch.cat([conv_state[rows].float(), x.float().unsqueeze(-1)], dim=-1)  # [B,C,K]
    y = (window * weight.float().unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation={activation!r}: expected one of {list(CONV_ACTIVATIONS)}")
    _scatter_rows(conv_state, rows, valid, window[..., 1:])
    return y.to(x.dtype)


def decode_linear_step(
    variant: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    dt: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    slope: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrent step of Gated DeltaNet, KDA, Mamba2, Mamba1 or lightning attention for
    ``B`` requests.

    ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``ssm_state [S, Hv, Dk, Dv]`` (updated in place for
    rows with ``state_indices >= 0``); lightning attention reads ``slope [Hv]`` (``S = e^{-slope}
    S + k v^T``, ``o = S^T q * scale``). Returns ``[B, Hv, Dv]`` in ``v.dtype``.
    """
    rows, valid = _safe_rows(state_indices)
    hv = v.shape[1]
    rep = hv // q.shape[1]
    qf = q.float().repeat_interleave(rep, dim=1)
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float()
    s = ssm_state[rows].float()  # [B, Hv, Dk, Dv]
    if variant in ("mamba2", "mamba1"):
        if dt is None or A_log is None or D is None or dt_bias is None:
            raise ValueError(f"decode_linear_step: {variant} needs dt, A_log, D and dt_bias")
        dtf = F.softplus(dt.float() + dt_bias.float())  # [B, H]
        if variant == "mamba1":  # A_log [H, N]: a decay per state entry, Dv = 1
            decay = torch.exp(dtf[..., None] * -torch.exp(A_log.float()))[..., None]
        else:  # A_log [H]: one decay per head
            decay = torch.exp(dtf * -torch.exp(A_log.float()))[..., None, None]
        s = s * decay + kf.unsqueeze(-1) * (dtf[..., None] * vf).unsqueeze(-2)
        y = torch.einsum("bhk,bhkv->bhv", qf, s) + D.float()[None, :, None] * vf
    elif variant == "lightning":
        if slope is None:
            raise ValueError("decode_linear_step: lightning needs slope")
        decay = torch.exp(-slope.float())[None, :, None, None]
        s = s * decay + kf.unsqueeze(-1) * vf.unsqueeze(-2)
        y = torch.einsum("bhk,bhkv->bhv", qf * scale, s)
    else:
        if use_qk_l2norm:
            qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
            kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        if g is None or beta is None:
            raise ValueError(f"decode_linear_step: {variant} needs g and beta")
        gf = g.float()
        if variant == "kda":
            s = s * gf.exp().unsqueeze(-1)  # per-channel decay over Dk
        else:
            s = s * gf.exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", kf, s)
        delta = (vf - pred) * beta.float().unsqueeze(-1)
        s = s + kf.unsqueeze(-1) * delta.unsqueeze(-2)
        y = torch.einsum("bhk,bhkv->bhv", qf * scale, s)
    _scatter_rows(ssm_state, rows, valid, s)
    return y.to(v.dtype)
