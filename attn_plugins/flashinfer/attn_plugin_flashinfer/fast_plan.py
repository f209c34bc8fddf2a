"""Re-plan a tensor-core decode wrapper without FlashInfer's Python ``plan()``.

Why: GQA decode through FlashInfer's tensor-core kernel (``use_tensor_cores=True``) reads the
KV cache at 4.3-4.5 TB/s on an H200 against 2.7-3.0 TB/s for its CUDA-core kernel (measured
with ``bench_flashinfer.py --variants``), but the wrapper's ``plan()`` then takes Python's
``max()`` over a torch tensor of the batch's KV lengths - an element-by-element loop, ~340 us at
B=256 - and issues a handful of small copies the context already made. Everything ``run()``
needs is the output of one C++ scheduler call (``module.plan``) plus four device buffers.

How: the first decode plan of a wrapper goes through the public ``plan()`` (it loads the kernel
module and sets every attribute ``run()`` reads: dtypes, window, soft-cap, scale). Later decode
plans of the same wrapper call the scheduler directly with the context's pinned host arrays and
point the wrapper's device buffers at the context's metadata, which the step's one
host-to-device copy already moved. The result is the same plan; only the host work differs.

Guarded: only FlashInfer versions in :data:`TESTED_VERSIONS` with the ``fa2`` backend take this
path (a GPU test checks it against the public ``plan()``); anything else runs ``plan()``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TESTED_VERSIONS", "can_replan", "mark_planned", "replan_tensor_core_decode"]

#: FlashInfer releases whose tensor-core decode ``plan()`` this module reproduces.
TESTED_VERSIONS = frozenset({"0.6.7"})

_MARK = "_attn_core_public_plan_done"


def can_replan(wrapper: Any, version: str | None) -> bool:
    """Whether ``wrapper`` may be re-planned by :func:`replan_tensor_core_decode`: a tensor-core
    decode wrapper of a tested FlashInfer version, already planned once through ``plan()``."""
    return (
        version in TESTED_VERSIONS
        and getattr(wrapper, _MARK, False)
        and getattr(wrapper, "_use_tensor_cores", False)
        and getattr(wrapper, "_backend", None) == "fa2"
        and getattr(wrapper, "_jit_module", None) is None
    )


def mark_planned(wrapper: Any) -> None:
    """Record that ``wrapper`` went through the public ``plan()`` once (module, attributes)."""
    setattr(wrapper, _MARK, True)


def replan_tensor_core_decode(
    wrapper: Any,
    *,
    qo_indptr_host: torch.Tensor,
    kv_indptr_host: torch.Tensor,
    kv_len_host: torch.Tensor,
    max_kv_len: int,
    kv_indptr_dev: torch.Tensor,
    kv_indices_dev: torch.Tensor,
    last_page_len_dev: torch.Tensor,
    qo_indptr_dev: torch.Tensor | None,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    window_left: int,
) -> None:
    """Plan one decode step of ``P`` requests on a wrapper that :func:`can_replan` accepts.

    :param qo_indptr_host: ``[P + 1]`` int32 pinned host, ``0, 1, ..., P``.
    :param kv_indptr_host: ``[P + 1]`` int32 pinned host, pages per request (CSR).
    :param kv_len_host: ``[P]`` int32 pinned host, KV length of each request.
    :param max_kv_len: ``max(kv_len_host)``.
    :param kv_indptr_dev: ``[P + 1]`` int32 device copy of ``kv_indptr_host``.
    :param kv_indices_dev: ``[kv_indptr[P]]`` int32 device page ids.
    :param last_page_len_dev: ``[P]`` int32 device.
    :param qo_indptr_dev: ``[P + 1]`` int32 device ``0..P``; None for a CUDA-graph wrapper,
        whose own buffers are fixed at construction (the captured kernels read them) and must
        then already hold this step's values.
    """
    P = kv_len_host.shape[0]
    if not wrapper.is_cuda_graph_enabled:
        wrapper._paged_kv_indptr_buf = kv_indptr_dev
        wrapper._paged_kv_indices_buf = kv_indices_dev
        wrapper._paged_kv_last_page_len_buf = last_page_len_dev
        wrapper._qo_indptr_buf = qo_indptr_dev
    elif wrapper._fixed_batch_size != P:
        raise ValueError(
            f"CUDA-graph decode wrapper captured for {wrapper._fixed_batch_size} requests, "
            f"the step has {P}"
        )
    wrapper._batch_size = P
    wrapper._max_kv_len = max_kv_len
    # The argument list of FlashInfer 0.6.7's fa2 prefill-module plan (decode.py, tensor cores).
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        qo_indptr_host,
        kv_indptr_host,
        kv_len_host,
        P,  # total_num_rows: one query row per request
        P,
        num_qo_heads,
        num_kv_heads,
        page_size,
        wrapper.is_cuda_graph_enabled,
        head_dim,
        head_dim,
        False,  # causal: one query token sees its whole context
        window_left,
        -1,  # fixed_split_size: let the scheduler choose
        False,  # disable_split_kv
        0,  # num_colocated_ctas
    )
