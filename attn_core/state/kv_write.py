"""Write a step's new keys / values / MLA latents into the core's paged caches, graph-safely.

Every backend stores the step's new tokens the same way, so the core owns the one writer:
a token's cache row is ``slot = page * page_size + offset`` (the batch's ``slot_mapping``), a
row of the cache viewed as ``[num_pages * page_size, ...]``, so a write is one ``index_copy_``
per tensor.

Padding tokens of a CUDA-graph padded batch carry slot ``-1`` ("write nothing"). Dropping them
with a boolean mask would sync with the host and change shapes, which a captured graph cannot
do. Instead every padding row is redirected to a slot whose final bytes it cannot change:

* when the batch's first token is real (padding rows follow the real requests), to that
  token's slot *with that token's values*: the duplicate write stores the same bytes twice
  (``index_copy_`` with duplicate indices is only nondeterministic in which copy lands last);
* when every row is padding (the dummy step a server captures a graph with), to cache row 0
  *with the bytes row 0 holds already*, read in the same step: nothing changes.

Which case applies is decided on the device, so one captured graph serves both. A step known on
the host to hold no padding (and not captured) passes ``may_have_padding=False`` and skips the
redirect.

fp8 caches store ``clamp(x / scale, -448, 448)`` in ``float8_e4m3fn``; the scale is the layer's
0-dim device tensor (or a float), so quantising costs no host sync and a captured graph reads
the current scale.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "quantize", "write_slots"]

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float | None
) -> torch.Tensor:
    """``x`` in a cache dtype: fp8 stores ``clamp(x / scale, ±448)``, other dtypes a plain cast.

    :param x: float tensor of any shape.
    :param dtype: the cache dtype.
    :param scale: fp8 only: a 0-dim float32 tensor on ``x``'s device, a float, or None (= 1).
    :returns: a tensor of ``x``'s shape in ``dtype``.
    """
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    xf = x.float()
    if scale is not None:
        xf = xf / scale
    # Clamp before the cast: e4m3fn has no inf, and out-of-range values would become NaN.
    return xf.clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)


def _flat(cache: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if flat.dtype == FP8_DTYPE:
        # index_copy_ has no fp8 kernels everywhere: move the bytes instead.
        return flat.view(torch.uint8), values.view(torch.uint8)
    return flat, values


def write_slots(
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    may_have_padding: bool = True,
) -> None:
    """Store ``x[t]`` at slot ``slot_mapping[t]``; slot ``-1`` (padding) stores nothing.

    Runs no host synchronisation, so it can be captured in a CUDA graph.

    :param x: ``[T, *row]`` float.
    :param cache: ``[num_pages, page_size, *row]`` (contiguous), float or ``float8_e4m3fn``.
    :param slot_mapping: ``[>= T]`` int64; its first ``T`` entries are used.
    :param scale: fp8 quantisation scale (see :func:`quantize`).
    :param may_have_padding: False only when every slot is known to be ``>= 0`` (no padding,
        and not capturing a graph that may later be replayed with padding): skips two selects.
    """
    n = x.shape[0]
    if n == 0:
        return
    slots = slot_mapping[:n]
    if slots.dtype != torch.long:
        slots = slots.long()
    flat, values = _flat(cache, quantize(x, cache.dtype, scale))
    if may_have_padding:
        valid = slots >= 0
        first = slots[:1].clamp(min=0)  # token 0's slot, or row 0 when token 0 is padding
        row = (1, *values.shape[1:])
        unchanged = torch.where(
            (slots[:1] >= 0).view([1] * values.dim()), values[:1], flat.index_select(0, first)
        ).view(row)
        slots = torch.where(valid, slots, first)
        values = torch.where(valid.view(-1, *([1] * (values.dim() - 1))), values, unchanged)
    flat.index_copy_(0, slots, values)
