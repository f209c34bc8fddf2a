"""The two kernel paths of the varlen plugin and the probe that says which one this torch has.

Packed layout (``N`` sequences, ``T`` tokens)::

    cu_seqlens  [0, 5, 5, 12]      sequence n is rows cu_seqlens[n]:cu_seqlens[n+1] of q/k/v
    q           [T, Hq, D]         k [T, Hkv, D], v [T, Hkv, Dv], out [T, Hq, Dv]

Masking (``i`` query, ``j`` key position inside one sequence; ``W`` = ``sliding_window``, the HF
convention "a query sees at most W keys, itself included"):

* causal: ``j <= i``; bidirectional: every key of the sequence;
* causal window: ``i - W < j <= i``  (FlashAttention ``window_size=(W-1, 0)``);
* bidirectional window: ``|i - j| < W`` (FlashAttention ``window_size=(W-1, W-1)``).

These are the rules of :func:`attn_core.reference.ops.varlen_attention`, the ground truth.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "VarlenAttnInfo",
    "equal_length_runs",
    "flash_window",
    "probe_varlen_attn",
    "run_varlen_attn",
    "sdpa_supports_gqa",
    "sdpa_varlen",
    "window_mask",
]


# ------------------------------------------------------------------------------------------
# torch.nn.attention.varlen.varlen_attn
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VarlenAttnInfo:
    """What this torch's ``varlen_attn`` accepts (its signature changed between releases).

    :ivar fn: ``varlen_attn`` itself.
    :ivar fn_out: ``varlen_attn_out`` (writes into a caller tensor) when it takes the same
        keywords, else None.
    :ivar window: accepts ``window_size=(left, right)`` (causal is ``(-1, 0)``).
    :ivar is_causal: accepts ``is_causal=`` instead (older releases; no window then).
    :ivar gqa_flag: needs ``enable_gqa=True`` when query and KV head counts differ.
    """

    fn: Callable[..., torch.Tensor]
    fn_out: Callable[..., object] | None
    window: bool
    is_causal: bool
    gqa_flag: bool


def probe_varlen_attn() -> tuple[VarlenAttnInfo | None, str | None]:
    """Import ``varlen_attn`` and read its signature; ``(info, None)`` or ``(None, reason)``."""
    try:
        from torch.nn.attention import varlen as mod
    except Exception as exc:  # an import may fail in many ways; the reason is what matters
        return None, (
            f"torch {torch.__version__} has no torch.nn.attention.varlen "
            f"({type(exc).__name__}: {exc}); it needs torch >= 2.10"
        )
    fn = getattr(mod, "varlen_attn", None)
    if fn is None:
        return None, f"torch {torch.__version__}: torch.nn.attention.varlen has no varlen_attn"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        return None, f"cannot read the signature of varlen_attn: {exc}"
    window = "window_size" in params
    is_causal = "is_causal" in params
    if not (window or is_causal):
        return None, (
            f"torch {torch.__version__}: varlen_attn takes neither window_size nor is_causal "
            f"(parameters: {list(params)})"
        )
    fn_out = getattr(mod, "varlen_attn_out", None)
    if fn_out is not None:
        out_params: Mapping[str, inspect.Parameter]
        try:
            out_params = inspect.signature(fn_out).parameters
        except (TypeError, ValueError):
            out_params = {}
        wanted = {"out", "scale", "window_size" if window else "is_causal"}
        if "enable_gqa" in params:
            wanted.add("enable_gqa")
        if not wanted <= set(out_params):
            fn_out = None
    info = VarlenAttnInfo(
        fn=fn, fn_out=fn_out, window=window, is_causal=is_causal, gqa_flag="enable_gqa" in params
    )
    return info, None


def flash_window(causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` for a mask (``-1`` = unbounded)."""
    if sliding_window is None:
        return (-1, 0) if causal else (-1, -1)
    left = sliding_window - 1
    return (left, 0) if causal else (left, left)


def run_varlen_attn(
    info: VarlenAttnInfo,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encoder attention through ``varlen_attn`` (one launch for the ragged batch).

    :param q: ``[T, Hq, D]`` bf16/fp16 on CUDA, unit stride in the last dim.
    :param k: ``[T, Hkv, D]``, same dtype.
    :param v: ``[T, Hkv, D]`` (FlashAttention-2 needs ``Dv == D``).
    :param cu_seqlens: ``[N + 1]`` int32 on the same device.
    :param max_seqlen: longest sequence (a host int; never read back from the device).
    :param out: optional contiguous ``[T, Hq, D]`` to write into (when this torch has
        ``varlen_attn_out``); otherwise a new tensor is returned.
    :returns: ``[T, Hq, D]`` in ``q.dtype``.
    """
    kwargs: dict[str, object] = {"scale": scale}
    if info.window:
        kwargs["window_size"] = flash_window(causal, sliding_window)
    else:
        if sliding_window is not None:
            raise ValueError(
                f"sliding_window={sliding_window}: this torch's varlen_attn has no window_size"
            )
        kwargs["is_causal"] = causal
    if info.gqa_flag and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if out is not None and info.fn_out is not None and out.is_contiguous():
        info.fn_out(out, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
        return out
    return info.fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


# ------------------------------------------------------------------------------------------
# SDPA, one call per run of equal-length sequences
# ------------------------------------------------------------------------------------------
def sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a C builtin without a signature: try it
        try:
            t = torch.zeros(1, 2, 1, 8)
            F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_SDPA_GQA = sdpa_supports_gqa()


def equal_length_runs(cu_seqlens: np.ndarray) -> list[tuple[int, int, int]]:
    """Consecutive sequences of one length, merged: ``[(start_row, length, count), ...]``.

    Empty sequences are dropped. ``[0, 4, 8, 12, 15]`` -> ``[(0, 4, 3), (12, 3, 1)]``: the
    three 4-token images run as one batched call over a view of q/k/v (no copy).
    """
    cu = [int(x) for x in cu_seqlens]
    runs: list[tuple[int, int, int]] = []
    for start, end in itertools.pairwise(cu):
        length = end - start
        if length <= 0:
            continue
        if runs and runs[-1][1] == length and runs[-1][0] + runs[-1][1] * runs[-1][2] == start:
            s, n_len, count = runs[-1]
            runs[-1] = (s, n_len, count + 1)
        else:
            runs.append((start, length, 1))
    return runs


def window_mask(
    length: int, causal: bool, sliding_window: int, device: torch.device
) -> torch.Tensor:
    """``[length, length]`` bool, True where query ``i`` may read key ``j`` (SDPA convention)."""
    pos = torch.arange(length, device=device)
    dist = pos[:, None] - pos[None, :]
    if causal:
        return (dist >= 0) & (dist < sliding_window)
    return dist.abs() < sliding_window


def sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_cpu: np.ndarray,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encoder attention with SDPA, one call per run of consecutive equal-length sequences.

    :param q: ``[T, Hq, D]`` float (any device SDPA runs on).
    :param k: ``[T, Hkv, D]``.
    :param v: ``[T, Hkv, Dv]``.
    :param cu_seqlens_cpu: ``[N + 1]`` host offsets (numpy); read on the host, so no sync.
    :param out: optional ``[T, Hq, Dv]`` to write into.
    :returns: ``[T, Hq, Dv]`` in ``q.dtype`` (``out`` when given); rows outside
        ``cu_seqlens[0]:cu_seqlens[-1]`` are zero.
    """
    num_tokens, hq, _ = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    if out is None:
        out = torch.empty((num_tokens, hq, dv), dtype=q.dtype, device=q.device)
    first, last = int(cu_seqlens_cpu[0]), int(cu_seqlens_cpu[-1])
    if first > 0:
        out[:first].zero_()
    if last < num_tokens:
        out[last:].zero_()
    rep = hq // hkv
    masks: dict[int, torch.Tensor] = {}
    for start, length, count in equal_length_runs(cu_seqlens_cpu):
        rows = slice(start, start + length * count)

        def heads_first(t: torch.Tensor, rows: slice = rows, length: int = length) -> torch.Tensor:
            return t[rows].unflatten(0, (-1, length)).transpose(1, 2)  # [n, H, L, D]

        qs, ks, vs = heads_first(q), heads_first(k), heads_first(v)
        extra: dict[str, Any] = {}  # keywords this torch's SDPA takes
        if rep > 1:
            if _SDPA_GQA:
                extra["enable_gqa"] = True
            else:  # older torch: expand the KV heads (a copy, but correct)
                ks = ks.repeat_interleave(rep, dim=1)
                vs = vs.repeat_interleave(rep, dim=1)
        if sliding_window is not None and sliding_window < length:
            mask = masks.get(length)
            if mask is None:
                mask = masks[length] = window_mask(length, causal, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, **extra)
        else:  # a window at least as long as the sequence masks nothing
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, **extra)
        out[rows].unflatten(0, (-1, length)).copy_(o.transpose(1, 2))
    return out
