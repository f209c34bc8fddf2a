"""Write the step's new K/V into the paged cache through the core's graph-safe writer.

The FlashAttention-4 Hopper path reads an unquantised cache, so this only adds the dtype check
to :func:`attn_core.state.kv_write.write_kv_slots` (one launch on CUDA for K and V; padding slots
``-1`` store nothing; no host sync).
"""

from __future__ import annotations

import torch

from attn_core.state.kv_write import write_kv_slots

__all__ = ["check_kv_dtypes", "write_kv"]


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
        and not capturing a graph that may be replayed with padding); lets the torch path (off
        CUDA) skip its padding redirect.
    """
    check_kv_dtypes(k, v, k_cache, v_cache)
    write_kv_slots(k, v, k_cache, v_cache, slot_mapping, may_have_padding=may_have_padding)


def check_kv_dtypes(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Raise unless the new K/V are in the cache's dtype (the split-KV merge stores them as
    they are, like :func:`write_kv`)."""
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(
            f"k/v dtype {k.dtype}/{v.dtype} must equal the cache dtype {k_cache.dtype}/"
            f"{v_cache.dtype} (this backend stores KV unquantised)"
        )
