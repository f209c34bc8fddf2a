"""Write the step's new K/V into the paged cache, by ``slot_mapping``, graph-safely.

The cache ``[num_pages, page_size, Hkv, D]`` is viewed flat as ``[num_pages * page_size, Hkv,
D]`` and written with one ``index_copy_`` per tensor. Padding tokens of a CUDA-graph batch carry
slot ``-1`` ("write nothing"). Dropping them with a boolean mask would sync with the host and
change shapes, which a captured graph cannot do; instead they are redirected to the slot of the
batch's first token *with the first token's values*, so the duplicate write stores the same bytes
twice (``index_copy_`` with duplicate indices is only nondeterministic in which copy lands last).
The first token is always a real one: padding rows follow the real requests.
"""

from __future__ import annotations

import torch

__all__ = ["write_kv"]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    may_have_padding: bool,
) -> None:
    """Store ``k[t]`` / ``v[t]`` at slot ``slot_mapping[t]`` (``page * page_size + offset``).

    :param k: ``[T, Hkv, D]`` in the cache dtype.
    :param v: ``[T, Hkv, Dv]``.
    :param k_cache: ``[num_pages, page_size, Hkv, D]``, contiguous.
    :param v_cache: ``[num_pages, page_size, Hkv, Dv]``, contiguous.
    :param slot_mapping: ``[T]`` int64; ``-1`` marks padding (written nowhere).
    :param may_have_padding: False only when every slot is known to be ``>= 0`` (no padding
        and not capturing a graph that may be replayed with padding); then the plain write runs.
    """
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(
            f"k/v dtype {k.dtype}/{v.dtype} must equal the cache dtype {k_cache.dtype}/"
            f"{v_cache.dtype} (this backend stores KV unquantised)"
        )
    n = k.shape[0]
    if n == 0:
        return
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping[:n]
    if may_have_padding:
        valid = slots >= 0
        slots = torch.where(valid, slots, slots[:1])
        keep = valid.view(-1, 1, 1)
        k = torch.where(keep, k, k[:1])
        v = torch.where(keep, v, v[:1])
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
