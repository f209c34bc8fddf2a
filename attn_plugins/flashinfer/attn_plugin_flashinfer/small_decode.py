"""Small-batch paged decode with the step's K/V write fused in: two Triton launches in all.

Why: at a handful of requests FlashInfer's decode is latency-bound, not bandwidth-bound (at B=1,
ctx 4096 it reads the KV at about 1.2 of 4.2 TB/s), and the plugin's separate K/V write is one
launch more. Here one kernel writes the new rows into the cache *and* attends over the whole
context, split across the SMs, and a second one merges the splits: no write launch. From about
20k positions FlashInfer's kernels read faster, so a step uses this one only below
``context.SMALL_DECODE_MAX_KV_TOKENS`` (a captured one at ``max_model_len``, an eager one at
its requests' own lengths) (figures: docs/results.md).

How (flash-decoding): program ``(b, kv_head, split)`` covers one of ``num_splits`` equal,
``BLOCK_N``-aligned ranges of request ``b``'s ``seq_len`` positions, for the ``group`` query
heads that share ``kv_head``. It reads each K/V row through the page table, except the newest
position (``seq_len - 1``), whose row has not been written yet: that one it takes from the
step's ``k``/``v`` inputs, and the program whose range holds it also stores those rows at
``slot_mapping[b]`` (``< 0``, a padding row: nothing). No other program reads that slot, so
the fused write cannot race. Each program leaves its partial output (normalised, ``o / l``) and
base-2 log-sum-exp in float32; the merge kernel weights the partials by ``exp2(lse - max)``.
(Two launches, not one: a single launch in which the last program of each (request, kv head)
merges the splits after an atomic ticket ran slower at B=1, its merge on far fewer programs and
its registers lowering the split loop's occupancy.)

Both kernels are launched through a :class:`SmallDecodePlan` per step shape (:func:`plan`):
an eager decode step of one request is host-bound, and the plan checks once what
:class:`~attn_core.fast_launch.CachedLaunch`'s keys would check per launch, then calls both
kernels' C launch functions with the tensors' addresses, which takes a B=1 step below
FlashInfer's ``run()`` in host time (about half of what CachedLaunch's per-launch keys cost).
``pdl`` launches both as programmatic dependents (:mod:`attn_core.pdl`); the context leaves it
off, as it ran slower at one and four requests.

The ranges are cut from the device-side ``seq_lens`` inside the kernel, so a captured graph
stays right when a replay brings other lengths; ``num_splits`` (the grid) is fixed per padded
batch size. Plain attention only: no sliding window, soft-cap, sinks or fp8 cache (the context
sends those steps to FlashInfer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch
import triton
import triton.language as tl

from attn_core.fast_launch import BoundLaunch, CachedLaunch
from attn_core.pdl import gdc_launch_dependents, gdc_wait

__all__ = [
    "BLOCK_N",
    "DEFAULT_CONFIG",
    "MAX_SPLITS",
    "SmallDecodeBuffers",
    "SmallDecodeConfig",
    "SmallDecodePlan",
    "num_splits_for",
    "plan",
    "small_decode",
]

#: KV positions per inner iteration of the default tiling (a power of two; two pages of 16).
BLOCK_N = 32
#: Most splits per (request, kv head): bounds the partial buffers and the merge's work.
MAX_SPLITS = 128
_LOG2E = 1.4426950408889634
# Triton's CPU interpreter multiplies bf16 tiles as raw bits (3.9): under it (tests on CPU) the
# dots take float32 copies of the same rounded values, which changes nothing else.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    slot_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_pt,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched as a programmatic dependent (attn_core.pdl): wait for q/k/v, then let
        gdc_wait()  # the merge launch while this kernel runs
        gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK) * BLOCK
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    newest = seq_len - 1

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    head = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None],
        other=0.0,
    )
    k_new = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + d)
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    row_stride = NUM_KV_HEADS * D
    pt_row = page_table_ptr + b * stride_pt
    if PREFETCH:
        first = start + tl.arange(0, BLOCK)
        page = tl.load(pt_row + first // PAGE, mask=first < end, other=0)
    for n0 in range(start, end, BLOCK):
        pos = n0 + tl.arange(0, BLOCK)
        valid = pos < end
        if not PREFETCH:
            page = tl.load(pt_row + pos // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * PAGE + pos % PAGE
        offs = row[:, None] * row_stride + kvh * D + d[None, :]
        is_new = (pos == newest)[:, None]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        if PREFETCH:  # the next block's page ids, while K and V of this one are in flight
            ahead = pos + BLOCK
            page = tl.load(pt_row + ahead // PAGE, mask=ahead < end, other=0)
        k = tl.where(is_new, k_new[None, :], k)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale_log2  # [GROUP_PAD, BLOCK], base-2 logits
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.where(is_new, v_new[None, :], v)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Partials of the GROUP real heads: [B, NUM_HEADS, NUM_SPLITS(, D)]; an empty range leaves
    # lse = -inf (weight 0 in the merge) and o = 0.
    empty = end <= start
    part = (b * NUM_HEADS + head) * NUM_SPLITS + split
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
    o = tl.where(empty, 0.0, acc / tl.maximum(l_i, 1e-30)[:, None])
    tl.store(part_lse_ptr + part, lse, mask=g < GROUP)
    tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=(g < GROUP)[:, None])

    # The fused write: the program whose range holds the newest position stores its K/V rows.
    if (newest >= start) & (newest < end):
        slot = tl.load(slot_ptr + b)
        if slot >= 0:
            dst = slot.to(tl.int64) * row_stride + kvh * D + d
            tl.store(k_cache_ptr + dst, k_new)
            tl.store(v_cache_ptr + dst, v_new)


@triton.jit
def _merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the split kernel's partials
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    part = (b * NUM_HEADS + h) * NUM_SPLITS + sp
    used = sp < NUM_SPLITS
    lse = tl.load(part_lse_ptr + part, mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    o = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    total = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, total.to(out_ptr.dtype.element_ty))


_SPLIT = CachedLaunch(_split_kernel)
_MERGE = CachedLaunch(_merge_kernel)


class _LaunchOptions(TypedDict):
    """The keywords of CachedLaunch.launch / bind."""

    num_warps: int
    num_stages: int
    launch_pdl: bool


@dataclass(frozen=True, slots=True)
class SmallDecodeConfig:
    """Tiling of the split kernel: KV positions per inner step, warps, software-pipeline
    stages, whether the next step's page ids are loaded while this step's K/V are, and how
    many programs per SM the split count aims at (:func:`num_splits_for`).

    The default, 32 positions / 2 warps / 3 stages / prefetch / 4 programs per SM, was the
    fastest or within 6 % of it at B=1 ctx 4096 and 32768 and B=2 ctx 4096 among 44 tilings
    timed on the H200 (``bench_flashinfer.py --small-sweep``; 12.7 / 42.7 / 17.7 us per layer
    in that sweep, against 13.4 / 55.0 / 19.2 for 64 / 4 / 2 without prefetch at two per SM)."""

    block_n: int = BLOCK_N
    num_warps: int = 2
    num_stages: int = 3
    prefetch: bool = True
    programs_per_sm: int = 4

    @property
    def label(self) -> str:
        prefetch = "p" if self.prefetch else ""
        return (
            f"n{self.block_n}w{self.num_warps}s{self.num_stages}{prefetch}x{self.programs_per_sm}"
        )


DEFAULT_CONFIG = SmallDecodeConfig()


def num_splits_for(batch: int, num_kv_heads: int, max_len: int, sm_count: int,
                   config: SmallDecodeConfig = DEFAULT_CONFIG) -> int:  # fmt: skip
    """Splits per (request, kv head): about ``config.programs_per_sm`` programs per SM, at most
    :data:`MAX_SPLITS`, and no more than ``max_len`` has ``config.block_n`` blocks (no split
    that is always empty)."""
    want = math.ceil(config.programs_per_sm * sm_count / max(batch * num_kv_heads, 1))
    return max(1, min(want, MAX_SPLITS, math.ceil(max(max_len, 1) / config.block_n)))


@dataclass(slots=True)
class SmallDecodeBuffers:
    """Float32 partials of one step shape: ``o`` ``[B, H, S, D]`` and ``lse`` ``[B, H, S]``.
    Allocate them before a graph is captured: the captured kernels keep their addresses."""

    o: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, num_heads: int, num_splits: int, head_dim: int,
                 device: torch.device) -> SmallDecodeBuffers:  # fmt: skip
        shape = (batch, num_heads, num_splits)
        return cls(
            o=torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
            lse=torch.empty(shape, dtype=torch.float32, device=device),
        )

    @property
    def num_splits(self) -> int:
        return self.lse.shape[2]


class SmallDecodePlan:
    """Both launches of one step shape (:func:`plan`): grids and scalars, and once both kernels
    are compiled, each bound to its compiled kernel
    (:meth:`~attn_core.fast_launch.CachedLaunch.bind`).

    ``plan(q, k, v, k_cache, v_cache, page_table, seq_lens, slot_mapping, out, buffers)``
    launches for tensors of the shapes, strides, dtypes and device the plan was made for; a
    caller that has checked those once per step (the context) calls it per layer.

    Why: an eager decode step of one request is host-bound. Per launch, the key CachedLaunch
    builds and looks up cost as much host time as the C launch; a plan checks once what both
    launches' keys would, and per call takes the addresses, checks their alignment, the device
    and launch hooks once for both kernels, and calls the two C launchers.
    """

    __slots__ = (
        "config",
        "merge",
        "merge_grid",
        "merge_scalars",
        "pdl",
        "split",
        "split_grid",
        "split_scalars",
    )

    def __init__(self, key: tuple) -> None:
        (B, H, D), Hkv, qs, ks, vs, os_, page, pt_stride, S, scale, cfg, pdl = key[:12]
        group = H // Hkv
        self.config: SmallDecodeConfig = cfg
        self.pdl: bool = pdl
        self.split_grid = (B, Hkv, S)
        self.split_scalars = (
            scale * _LOG2E,
            qs[0],
            qs[1],
            ks[0],
            ks[1],
            vs[0],
            vs[1],
            pt_stride,
            S,  # NUM_SPLITS
            H,  # NUM_HEADS
            Hkv,  # NUM_KV_HEADS
            group,  # GROUP
            max(16, triton.next_power_of_2(group)),  # GROUP_PAD: rows of the QK dot
            D,
            page,  # PAGE
            cfg.block_n,  # BLOCK
            cfg.prefetch,  # PREFETCH
            _INTERPRETED,  # UPCAST
            pdl,  # PDL
        )
        self.merge_grid = (B, H)
        self.merge_scalars = (
            os_[0],
            os_[1],
            H,  # NUM_HEADS
            S,  # NUM_SPLITS
            triton.next_power_of_2(S),  # SPLITS_PAD
            D,
            pdl,  # PDL
        )
        self.split: BoundLaunch | None = None
        self.merge: BoundLaunch | None = None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
        buffers: SmallDecodeBuffers,
    ) -> None:
        o_buf, lse_buf = buffers.o, buffers.lse
        split, merge = self.split, self.merge
        if split is not None and merge is not None:
            pq, pk, pv = q.data_ptr(), k.data_ptr(), v.data_ptr()
            pkc, pvc = k_cache.data_ptr(), v_cache.data_ptr()
            ppt, psl, psm = page_table.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr()
            po, plse, pout = o_buf.data_ptr(), lse_buf.data_ptr(), out.data_ptr()
            # The bound launches check nothing: alignment, device and hooks here, once for both.
            stream = split.stream_for(pq | pk | pv | pkc | pvc | ppt | psl | psm | po | plse | pout)
            if stream is not None:
                split.launch(stream, pq, pk, pv, pkc, pvc, ppt, psl, psm, po, plse)
                merge.launch(stream, po, plse, pout)
                return
        # Through CachedLaunch's checks (the first call of a shape compiles), then bound.
        cfg, pdl = self.config, self.pdl
        split_args = (
            self.split_grid,
            (q, k, v, k_cache, v_cache, page_table, seq_lens, slot_mapping, o_buf, lse_buf),
            self.split_scalars,
        )
        merge_args = (self.merge_grid, (o_buf, lse_buf, out), self.merge_scalars)
        split_opts: _LaunchOptions = {
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            "launch_pdl": pdl,
        }
        merge_opts: _LaunchOptions = {"num_warps": 4, "num_stages": 1, "launch_pdl": pdl}
        _SPLIT.launch(*split_args, **split_opts)
        _MERGE.launch(*merge_args, **merge_opts)
        if split is None or merge is None:
            self.split = _SPLIT.bind(*split_args, **split_opts)
            self.merge = _MERGE.bind(*merge_args, **merge_opts)


#: Plans by step shape (:func:`plan`); cleared when full.
_PLANS: dict[tuple, SmallDecodePlan] = {}
_MAX_PLANS = 256


def plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    buffers: SmallDecodeBuffers,
    *,
    scale: float,
    config: SmallDecodeConfig | None = None,
    pdl: bool = False,
) -> SmallDecodePlan:
    """The :class:`SmallDecodePlan` of these arguments (as :func:`small_decode` takes them),
    made once per step shape: everything both launches specialise or depend on besides the
    addresses (shapes, strides, every tensor's dtype, the device)."""
    cfg = config or DEFAULT_CONFIG
    o_buf, lse_buf = buffers.o, buffers.lse
    key = (
        q.shape,
        k.shape[1],
        q.stride(),
        k.stride(),
        v.stride(),
        out.stride(),
        k_cache.shape[1],
        page_table.stride(0),
        lse_buf.shape[2],  # splits
        scale,
        cfg,
        pdl,
        q.dtype,
        k.dtype,
        v.dtype,
        k_cache.dtype,
        v_cache.dtype,
        out.dtype,
        page_table.dtype,
        seq_lens.dtype,
        slot_mapping.dtype,
        o_buf.dtype,
        lse_buf.dtype,
        q.get_device(),
    )
    found = _PLANS.get(key)
    if found is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        found = _PLANS[key] = SmallDecodePlan(key)
    return found


def small_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    buffers: SmallDecodeBuffers,
    *,
    scale: float,
    config: SmallDecodeConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Write the step's K/V rows into the paged cache and attend, one query token per request.

    :param q: ``[B, H, D]`` bf16/fp16, last dim contiguous (B = padded requests).
    :param k: ``[B, Hkv, D]`` (the step's new key rows), last dim contiguous; ``v`` likewise.
    :param k_cache: ``[num_pages, page_size, Hkv, D]`` contiguous (NHD), q's dtype; ``v_cache``
        likewise. Row ``slot_mapping[b]`` of each receives ``k[b]`` / ``v[b]``.
    :param page_table: ``[>= B, W]`` int32, page ids of each request's positions.
    :param seq_lens: ``[>= B]`` int32, KV length including the new token (>= 1).
    :param slot_mapping: ``[>= B]`` int64, cache row of the new token, ``< 0`` to skip.
    :param out: ``[B, H, D]`` written in place (any row/head strides, last dim contiguous).
    :param buffers: partials for this ``B`` (:meth:`SmallDecodeBuffers.allocate`).
    :param scale: softmax scale of the logits.
    :param config: tiling of the split kernel (default :data:`DEFAULT_CONFIG`).
    :param pdl: launch both kernels as programmatic dependents (:mod:`attn_core.pdl`; only
        where :func:`attn_core.pdl.pdl_enabled` says the device has it).
    :returns: ``out``.
    """
    args = (q, k, v, k_cache, v_cache, page_table, seq_lens, slot_mapping, out, buffers)
    plan(*args, scale=scale, config=config, pdl=pdl)(*args)
    return out
