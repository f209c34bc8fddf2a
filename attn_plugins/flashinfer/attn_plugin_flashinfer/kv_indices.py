"""FlashInfer's ``kv_indices`` packed from the page table on the GPU, in one Triton launch.

Why: :func:`planning.gather_kv_indices` packs them with four torch calls (a ``searchsorted``
and index arithmetic), which cost ~47 us of ``prepare()``'s ~100 us of host time at B=256 on
the H200's host (profiled): each torch call is microseconds of Python and
dispatch. One kernel, one program per request, copies the first ``pages[b]`` entries of row
``b`` to ``kv_indices[kv_indptr[b]:]``; after its first launch for a batch size it goes through
a bound launch (:class:`attn_core.fast_launch.BoundLaunch`), a few microseconds.

The sizes come from the device copy of ``kv_indptr`` the step already made, so nothing waits
for the GPU and a CUDA-graph replay's ``update()`` may run it as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_core.fast_launch import BoundLaunch, CachedLaunch

__all__ = ["KVIndexGather"]

#: Page-table entries one program copies per loop iteration (a 4096-token request at page 16
#: is one iteration; 32768 tokens, eight).
BLOCK = 256


@triton.jit
def _gather_kv_indices_kernel(
    page_table,  # [B, >= W] int32, row stride `table_stride`
    kv_indptr,  # [B + 1] int32
    kv_indices,  # [>= kv_indptr[B]] int32
    table_stride,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(kv_indptr + b)
    count = tl.load(kv_indptr + b + 1) - start
    row = page_table + b.to(tl.int64) * table_stride
    for j in range(0, count, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(kv_indices + start + offs, tl.load(row + offs, mask=mask), mask=mask)


_LAUNCH = CachedLaunch(_gather_kv_indices_kernel)


class KVIndexGather:
    """Packs ``kv_indices`` for a context, one bound launch per (batch size, row stride).

    :meth:`__call__` takes int32 CUDA tensors on one device; the caller (the context's
    ``_plan``) guarantees that ``kv_indptr`` holds this step's page counts and that
    ``kv_indices`` is long enough (it knows ``kv_indptr[B]`` on the host).
    """

    def __init__(self) -> None:
        # by (batch size, row stride); None: bind refused once, launches go through the key
        self._bound: dict[tuple[int, int], BoundLaunch | None] = {}

    def __call__(
        self,
        page_table: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        num_requests: int,
    ) -> None:
        """Write request ``b``'s first ``kv_indptr[b+1] - kv_indptr[b]`` page ids (row ``b`` of
        ``page_table``) to ``kv_indices[kv_indptr[b]:]``, for every ``b < num_requests``.

        :param page_table: ``[>= num_requests, W]`` int32, unit column stride.
        :param kv_indptr: ``[num_requests + 1]`` int32, on the same device.
        :param kv_indices: ``[>= kv_indptr[num_requests]]`` int32, on the same device.
        """
        for name, t in (("page_table", page_table), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices)):  # fmt: skip
            if t.dtype != torch.int32:
                raise ValueError(f"{name}: int32 expected, got {t.dtype}")
        if page_table.stride(1) != 1:
            raise ValueError(f"page_table: unit column stride expected, got {page_table.stride()}")
        B, stride = num_requests, page_table.stride(0)
        if B == 0:
            return
        ptrs = (page_table.data_ptr(), kv_indptr.data_ptr(), kv_indices.data_ptr())
        key = (B, stride)
        bound = self._bound.get(key)
        if bound is not None:
            stream = bound.stream_for(ptrs[0] | ptrs[1] | ptrs[2])
            if stream is not None:
                bound.launch(stream, *ptrs)
                return
        tensors, scalars = (page_table, kv_indptr, kv_indices), (stride, BLOCK)
        _LAUNCH.launch((B,), tensors, scalars, num_warps=4, num_stages=1)
        if key not in self._bound:  # bind once, as kv_write.KVWriter does
            self._bound[key] = _LAUNCH.bind((B,), tensors, scalars, num_warps=4, num_stages=1)
