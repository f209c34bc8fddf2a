"""The split-KV merge as one Triton kernel (see :mod:`attn_plugin_fa3.split_kv`), with the step's
K/V write fused in.

One program per (request, head) reads the request's ``S`` chunk log-sum-exps and its ``S``
partial rows for that head as one ``[S, D]`` tile (each once, unit-stride rows: 16-byte vector
loads, all issued before any is waited for), computes the logit of the step's own key
``q . k_new`` (soft-capped where the layer caps), weights everything by ``exp(x - M)`` in
float32 and writes ``out[b, h, :]`` in ``out``'s dtype, straight into the layer's output buffer.
A chunk with no keys (``seqused_k == 0``) has weight 0, whatever its rows hold. The first
program of each KV head also stores the step's K/V rows at ``slot_mapping[b]`` (``< 0`` or past
the cache: nothing), which the chunk kernel before it never reads: no write launch before the
attention.

Launched through a :class:`MergePlan` per step shape, bound to the compiled kernel after its
first launch (:meth:`attn_core.fast_launch.CachedLaunch.bind`): an eager decode step of one
request is host-bound, and Triton's own launcher costs several times the bound launch's host
time. On sm90 it launches as a programmatic dependent of the chunk kernel (:mod:`attn_core.pdl`;
``ATTN_PDL=0`` turns that off).

Nothing here synchronises with the host; a captured graph replays it with the metadata refilled
in place. Tests run it on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from attn_core.fast_launch import BoundLaunch, CachedLaunch
from attn_core.pdl import gdc_launch_dependents, gdc_wait, pdl_enabled

if TYPE_CHECKING:
    from attn_plugin_fa3.split_kv import SplitMetadata

__all__ = ["MergePlan", "merge", "plan"]


@triton.jit
def _merge_kernel(
    partial_ptr,  # [B * S, H, D] chunk outputs
    lse_ptr,  # [H, B * S] float32
    seqused_ptr,  # [B * S] int32 cached keys of each chunk
    seq_lens_ptr,  # [B] int32 (0: no new key)
    sinks_ptr,  # [H] (unused without sinks)
    q_ptr,  # [B, H, D]
    k_ptr,  # [B, Hkv, D] the step's new rows
    v_ptr,
    slot_ptr,  # [B] int64 cache row of each new token, < 0: padding
    k_cache_ptr,  # [num_slots, Hkv, D] (pages merged)
    v_cache_ptr,
    out_ptr,  # [>= B, H, D]
    scale,
    softcap,
    stride_pt,
    stride_ph,
    stride_lh,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_slot,
    kc_slot,
    kc_head,
    vc_slot,
    vc_head,
    stride_ob,
    stride_oh,
    num_slots,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # a programmatic dependent of the chunk kernel: wait for its partials
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    s = tl.arange(0, SPLITS_PAD)
    row = b * NUM_SPLITS + s
    real = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    # Every load below is issued before any result is used: none waits on the chunk lengths
    # (an empty chunk's row is read, then dropped by `valid`: it may hold anything, NaN too).
    used = tl.load(seqused_ptr + row, mask=real, other=0)
    lse = tl.load(lse_ptr + h * stride_lh + row, mask=real, other=float("-inf"))
    parts = tl.load(
        partial_ptr + row[:, None] * stride_pt + h * stride_ph + d[None, :],
        mask=real[:, None] & dmask[None, :],
        other=0.0,
    )
    valid = used > 0
    lse = tl.where(valid, lse, float("-inf"))
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0)
    k_new = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + d, mask=dmask, other=0.0)
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask, other=0.0)
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slot_ptr + b * stride_slot).to(tl.int64)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=0) * scale
    if SOFTCAP:  # c * tanh(s / c), as the chunk kernel's score_mod; tanh without overflow
        x = s_new / softcap
        t = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        s_new = softcap * tl.where(x < 0, -th, th)
    s_new = tl.where(seq_len > 0, s_new, float("-inf"))
    m = tl.maximum(tl.max(lse, axis=0), s_new)
    if HAS_SINKS:
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key at all: every weight below is 0
    w = tl.exp(lse - m)  # [SPLITS_PAD], 0 for empty and padding chunks
    w_new = tl.exp(s_new - m)
    denom = tl.sum(w, axis=0) + w_new
    if HAS_SINKS:
        denom += tl.exp(sink - m)
    parts = tl.where(valid[:, None], parts.to(tl.float32), 0.0)  # 0 * NaN would be NaN
    acc = tl.sum(w[:, None] * parts, axis=0) + w_new * v_new.to(tl.float32)
    acc = tl.where(denom > 0.0, acc / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty), mask=dmask
    )
    # The fused K/V write: one program per (request, KV head) stores its rows.
    if (h % GROUP == 0) & (slot >= 0) & (slot < num_slots):
        tl.store(
            k_cache_ptr + slot * kc_slot + kvh * kc_head + d,
            k_new.to(k_cache_ptr.dtype.element_ty),
            mask=dmask,
        )
        tl.store(
            v_cache_ptr + slot * vc_slot + kvh * vc_head + d,
            v_new.to(v_cache_ptr.dtype.element_ty),
            mask=dmask,
        )


_MERGE = CachedLaunch(_merge_kernel)
_NUM_WARPS = 4


class MergePlan:
    """One merge shape's launch: grid and scalars, and once its kernel is compiled, the launch
    bound to it (:meth:`~attn_core.fast_launch.CachedLaunch.bind`).

    ``plan(tensors)`` launches for tensors of the shapes, strides, dtypes and device the plan
    was made for (:func:`plan` keys on all of them); per call it reads the twelve addresses,
    checks their alignment, the device and launch hooks once, and calls the C launcher.
    """

    __slots__ = ("bound", "grid", "pdl", "scalars")

    def __init__(self, grid: tuple[int, int], scalars: tuple, pdl: bool) -> None:
        self.grid = grid
        self.scalars = scalars
        self.pdl = pdl
        self.bound: BoundLaunch | None = None

    def __call__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        bound = self.bound
        if bound is not None:
            ptrs = [t.data_ptr() for t in tensors]
            stream = bound.stream_for(functools.reduce(operator.or_, ptrs))
            if stream is not None:
                bound.launch(stream, *ptrs)
                return
        pdl = self.pdl
        _MERGE.launch(
            self.grid, tensors, self.scalars, num_warps=_NUM_WARPS, num_stages=1, launch_pdl=pdl
        )
        if bound is None:
            self.bound = _MERGE.bind(
                self.grid, tensors, self.scalars, num_warps=_NUM_WARPS, num_stages=1,
                launch_pdl=pdl,
            )  # fmt: skip


#: Plans by merge shape (:func:`plan`); cleared when full.
_PLANS: dict[tuple, MergePlan] = {}
_MAX_PLANS = 256


def _flat_cache(cache: torch.Tensor) -> tuple[int, int]:
    """``(slot stride, head stride)`` of a ``[num_pages, page_size, Hkv, D]`` cache whose page
    and offset dims merge into one slot dim, unit stride in D."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(3) != 1:
        raise ValueError(
            "split-KV merge: the KV cache must merge [num_pages, page_size] into one slot dim "
            f"with unit stride in the head dim, got strides {cache.stride()}"
        )
    return cache.stride(1), cache.stride(2)


def plan(
    partial: torch.Tensor,
    lse: torch.Tensor,
    meta: SplitMetadata,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[MergePlan, tuple[torch.Tensor, ...]]:
    """The :class:`MergePlan` of these arguments (as :func:`merge` takes them), made once per
    shape, and the tensors it launches with."""
    b, s = meta.num_reqs, meta.plan.num_splits
    h, d = partial.shape[1], partial.shape[2]
    tensors = (
        partial, lse, meta.seqused_k, meta.seq_lens, sinks if sinks is not None else lse,
        q, k, v, slot_mapping, k_cache, v_cache, out,
    )  # fmt: skip
    device = q.get_device()
    pdl = device >= 0 and pdl_enabled(device)  # per call: ATTN_PDL is read each time
    key = (
        b, s, h, k.shape[1], d, partial.stride(), lse.stride(), q.stride(), k.stride(),
        v.stride(), slot_mapping.stride(0), k_cache.shape, k_cache.stride(), v_cache.stride(),
        out.stride(), scale, softcap, sinks is not None, *[t.dtype for t in tensors], device,
        pdl,
    )  # fmt: skip
    found = _PLANS.get(key)
    if found is not None:
        return found, tensors
    if (
        partial.stride(2) != 1
        or out.stride(2) != 1
        or lse.stride(1) != 1
        or q.stride(2) != 1
        or k.stride(2) != 1
        or v.stride(2) != 1
    ):
        raise ValueError(
            "split-KV merge needs unit stride in the head dim (partial, out, q, k, v) and over "
            "chunks (lse)"
        )
    if h % k.shape[1] or k.shape[1:] != v.shape[1:] or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"split-KV merge: {h} query heads over new K/V {tuple(k.shape)} / {tuple(v.shape)} "
            f"and a cache of rows {tuple(k_cache.shape[2:])}"
        )
    kc_slot, kc_head = _flat_cache(k_cache)
    vc_slot, vc_head = _flat_cache(v_cache)
    scalars = (
        float(scale), float(softcap or 1.0),
        partial.stride(0), partial.stride(1), lse.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        slot_mapping.stride(0), kc_slot, kc_head, vc_slot, vc_head,
        out.stride(0), out.stride(1), k_cache.shape[0] * k_cache.shape[1],
        s, max(triton.next_power_of_2(s), 2), h // k.shape[1], d, triton.next_power_of_2(d),
        sinks is not None, bool(softcap), pdl,
    )  # fmt: skip
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    found = _PLANS[key] = MergePlan((b, h), scalars, pdl)
    return found, tensors


def merge(
    partial: torch.Tensor,
    lse: torch.Tensor,
    meta: SplitMetadata,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Merge chunk outputs and the step's own key into ``out[:B]``, and store the step's K/V
    rows (:func:`attn_plugin_fa3.split_kv.merge` says what each argument holds).

    :param partial: ``[B * S, H, D]``, unit stride in D.
    :param lse: ``[H, B * S]`` float32, unit stride over chunks.
    :param sinks: ``[H]`` (any float dtype) or None.
    :param out: ``[>= B, H, D]``, unit stride in D.
    """
    found, tensors = plan(
        partial, lse, meta, sinks, out, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping, scale=scale, softcap=softcap,
    )  # fmt: skip
    found(tensors)
    return out
