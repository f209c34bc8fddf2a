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

Run, likewise (:func:`tensor_core_decode_runner`): ``run()`` checks and unpacks its arguments and
builds a list of 43 before it calls the module, 16-29 us of host time per layer on the H200's
hosts, which decides an eager decode step of one long request (its kernel takes ~40 us). The
runner calls the compiled ``paged_run`` function with the argument list ``run()`` would build,
bound once per step: the binding has checked q, k, v and out per call (shapes, dtypes, device),
and the plan fixed everything else.

Guarded: only FlashInfer versions in :data:`TESTED_VERSIONS` with the ``fa2`` backend take these
paths (GPU tests check plan and output against the public ``plan()`` and ``run()``); anything
else runs FlashInfer's own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "TESTED_VERSIONS",
    "can_replan",
    "mark_planned",
    "replan_tensor_core_decode",
    "tensor_core_decode_runner",
]

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


#: ``(q, k_cache, v_cache, out) -> None``: one layer of a planned decode step.
DecodeRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def tensor_core_decode_runner(wrapper: Any, sm_scale: float) -> DecodeRunner | None:
    """The compiled kernel call of ``wrapper.run(q, (k_cache, v_cache), out=out)`` for the step
    the wrapper is planned for, at softmax scale ``sm_scale``; None where this module does not
    know the wrapper's ``run()`` (then call it).

    Call it after the step's plan (it binds the plan's buffers and schedule) and only for a
    wrapper :func:`can_replan` accepts. The runner checks nothing: ``q`` ``[P, H, D]``,
    ``k_cache``/``v_cache`` ``[pages, page_size, Hkv, D]`` (NHD) of the planned dtypes, and a
    contiguous ``out`` like ``q``, all on the wrapper's device.
    """
    if (
        wrapper._kv_layout != "NHD"
        or wrapper._pos_encoding_mode != "NONE"
        or wrapper._plan_info is None
    ):
        return None
    found = _compiled_paged_run(wrapper)
    if found is None:
        return None
    compiled, pdl, alibi_slopes = found
    rope_scale = wrapper._rope_scale if wrapper._rope_scale is not None else 1.0
    rope_theta = wrapper._rope_theta if wrapper._rope_theta is not None else 1e4
    head = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._plan_info)
    indptrs = (
        wrapper._qo_indptr_buf,
        wrapper._paged_kv_indptr_buf,
        wrapper._paged_kv_indices_buf,
        wrapper._paged_kv_last_page_len_buf,
    )
    tail = (
        None,  # lse
        0,  # MaskMode.NON_CAUSAL
        0,  # TensorLayout.NHD
        wrapper._window_left,
        pdl,  # run()'s enable_pdl default
        None,  # custom mask
        None,  # mask indptr
        alibi_slopes,
        None,  # prefix length
        None,  # token positions in items
        None,  # max item length
        wrapper._logits_soft_cap or 0.0,
        sm_scale,
        1.0 / rope_scale,
        1.0 / rope_theta,
        0,  # token_pos_in_items_len
    )

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor) -> None:  # fmt: skip
        compiled(*head, q, k_cache, v_cache, *indptrs, out, *tail)

    return run


_COMPILED = "_attn_core_compiled_paged_run"


def _compiled_paged_run(wrapper: Any) -> tuple[Any, bool, torch.Tensor] | None:
    """``(compiled paged_run, run()'s enable_pdl default, run()'s alibi-slopes buffer)`` of a
    planned wrapper, found once per kernel module and kept on the wrapper (a step re-planned
    by :func:`replan_tensor_core_decode` keeps its module, heads and device); None where the
    module's ``paged_run`` is not 0.6.7's."""
    module = getattr(wrapper, "_cached_module", None)
    cached = wrapper.__dict__.get(_COMPILED)
    if cached is not None and cached[0] is module:
        return cached[1]
    found = None
    # FlashInfer 0.6.7 wraps the compiled function in a Python ``paged_run`` that dispatches on
    # the backend; the fa2 branch passes the first 22 arguments through, then the soft-cap,
    # the scale and the reciprocal rope scale and theta.
    compiled = None
    if module is not None:
        compiled = inspect.getclosurevars(module.paged_run).nonlocals.get("paged_run_func")
    if compiled is not None:
        from flashinfer.utils import _get_cache_alibi_slopes_buf, device_support_pdl

        device = wrapper._float_workspace_buffer.device
        alibi_slopes = _get_cache_alibi_slopes_buf(wrapper._num_qo_heads, device)
        found = (compiled, device_support_pdl(device), alibi_slopes)
    setattr(wrapper, _COMPILED, (module, found))
    return found
