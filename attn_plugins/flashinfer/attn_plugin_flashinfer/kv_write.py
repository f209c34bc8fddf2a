"""Write a step's new K/V (or MLA latents) into the core's paged caches, by slot.

The core addresses a token's cache row by ``slot = page * page_size + offset`` (the batch's
``slot_mapping``), which is a row of the cache viewed as ``[num_pages * page_size, ...]``: one
``index_copy_`` per tensor. ``flashinfer.page.append_paged_kv_cache`` is not used: it addresses
rows by (request, position) through the CSR page layout, which would need two more per-token
arrays per step for the same effect.

Padding rows of a graph-padded step (slot ``-1``) are handled by the caller's ``src``/``dst``
pair (see :func:`attn_plugin_flashinfer.planning.write_sources`): padding rewrites token 0's slot
with token 0's values, so the scatter has a fixed shape and needs no mask.

fp8 caches store ``clamp(x / scale, -448, 448)`` in ``float8_e4m3fn`` (the reference's rule); the
scale is the layer's 0-dim device tensor, so quantising costs no host sync and a captured graph
reads the current scale.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "quantize", "write_rows"]

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` in a cache dtype: fp8 stores ``clamp(x / scale, ±448)``, other dtypes a plain cast.

    :param x: float tensor of any shape.
    :param dtype: the cache dtype.
    :param scale: 0-dim float32 tensor (fp8 only; None means 1).
    """
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    xf = x.float()
    if scale is not None:
        xf = xf / scale
    return xf.clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)


def write_rows(
    x: torch.Tensor,
    cache: torch.Tensor,
    dst: torch.Tensor,
    src: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Scatter token rows of ``x`` into a paged ``cache`` in place.

    :param x: ``[T, *row]`` float, the step's new keys, values or latents.
    :param cache: ``[num_pages, page_size, *row]`` (contiguous), float or ``float8_e4m3fn``.
    :param dst: ``[N]`` int64 slots (``page * page_size + offset``), all valid (``>= 0``).
    :param src: ``[N]`` int64 rows of ``x`` to write; None writes ``x[:N]``.
    :param scale: fp8 quantisation scale (0-dim float32 tensor) or None.
    """
    n = dst.shape[0]
    rows = x[:n] if src is None else x.index_select(0, src)
    values = quantize(rows, cache.dtype, scale)
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if flat.dtype == FP8_DTYPE:
        # index_copy_ has no fp8 kernels everywhere: move the bytes instead.
        flat, values = flat.view(torch.uint8), values.view(torch.uint8)
    flat.index_copy_(0, dst, values)
