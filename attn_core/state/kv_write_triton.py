"""The paged KV writer as one Triton kernel: K and V (or one MLA latent) in a single launch.

:func:`attn_core.state.kv_write.write_slots` and :func:`~attn_core.state.kv_write.write_kv_slots`
call :func:`launch` for CUDA tensors. In torch the same write costs about six small kernels per
tensor (quantise, the padding redirect's where/clamp/index_select, index_copy_), which in a
captured decode step is mostly launch latency; here each program copies a tile of
``[BLOCK_T tokens, BLOCK_R row elements]`` of one tensor and a program id picks K or V.

Semantics are the torch writer's: ``cache[slot[t]] = cast(x[t])`` with fp8 e4m3 caches storing
``clamp(x / scale, -448, 448)``. A padding slot (``< 0``) stores nothing: a kernel can simply
mask the row, so no redirect is needed. A slot past the cache's end also stores nothing (a
kernel cannot raise; a store there would corrupt memory): callers that want that reported check
ranges on the host, as the reference backend does outside graph capture.

On sm90+ the kernel launches as a programmatic dependent (:mod:`attn_core.pdl`): in a captured
decode step the attention kernel after it (FlashInfer's launch that way) starts launching while
the write runs.

Nothing here synchronises with the host: the scale is read from its device tensor inside the
kernel, so a replayed CUDA graph uses the scale's current value, and the token count ``T`` may
be the padded count of a captured batch. Compile the kernel before capturing (one eager call
with the same dtypes), as for any Triton kernel.

Imported lazily by :mod:`attn_core.state.kv_write` (Triton is not a core dependency on CPU).
Tests run it on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attn_core.fast_launch import BoundLaunch, CachedLaunch
from attn_core.pdl import gdc_launch_dependents, gdc_wait, pdl_enabled
from attn_core.state.kv_write import scale_kind

__all__ = ["BoundWrite", "bind", "launch"]

# Scale modes of one tensor (constexpr: each combination compiles once).
_NO_SCALE, _SCALE_TENSOR, _SCALE_FLOAT = 0, 1, 2


@triton.jit
def _write_tile(
    x_ptr,
    c_ptr,
    scale_ptr,
    scale_val,
    tok,
    slot,
    valid,
    r0,
    sx_t,
    sx_h,
    sx_d,
    sc_slot,
    sc_h,
    sc_d,
    H: tl.constexpr,
    D: tl.constexpr,
    SCALE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Copy ``x[tok, r0:r0 + BLOCK_R]`` (row viewed as ``[H, D]``) to ``cache[slot, ...]``.

    ``tok``/``slot``/``valid`` are ``[BLOCK_T]`` (int64, int64, bool).
    """
    r = r0 + tl.arange(0, BLOCK_R)
    # A row with contiguous heads arrives as H == 1 (D = the whole row): h is then 0 and the
    # offsets are plain r, which the compiler can vectorise without reasoning about // and %.
    h = r // D
    d = r % D
    mask = valid[:, None] & (r < H * D)[None, :]
    src = x_ptr + tok[:, None] * sx_t + (h * sx_h + d * sx_d)[None, :]
    vals = tl.load(src, mask=mask)
    if FP8:
        vals = vals.to(tl.float32)
        if SCALE == 1:
            # div_rn: IEEE division, so the stored bytes equal torch's ``x / scale``.
            vals = tl.math.div_rn(vals, tl.load(scale_ptr).to(tl.float32))
        elif SCALE == 2:
            vals = tl.math.div_rn(vals, scale_val)
        # Clamp before the cast (e4m3fn has no inf); NaN stays NaN, as torch's clamp keeps it.
        vals = tl.clamp(vals, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    dst = c_ptr + slot[:, None] * sc_slot + (h * sc_h + d * sc_d)[None, :]
    tl.store(dst, vals.to(c_ptr.dtype.element_ty), mask=mask)


# T and the cache size change from call to call and gain nothing from Triton's specialisation
# (== 1, % 16): without it one compiled kernel serves every batch size.
@triton.jit(do_not_specialize=["T", "num_slots"])
def _write_kernel(
    # tensors first, then the rest, with T and num_slots last (CachedLaunch's layout: they
    # stay out of its key, as out of Triton's specialisation)
    slot_ptr,
    x0_ptr,  # tensor 0 (K, or the MLA latent)
    c0_ptr,
    s0_ptr,
    x1_ptr,  # tensor 1 (V); a single-tensor launch repeats tensor 0 here and never reads it
    c1_ptr,
    s1_ptr,
    slot_stride,
    s0_val,
    x0_st,
    x0_sh,
    x0_sd,
    c0_sslot,
    c0_sh,
    c0_sd,
    s1_val,
    x1_st,
    x1_sh,
    x1_sd,
    c1_sslot,
    c1_sh,
    c1_sd,
    H0: tl.constexpr,
    D0: tl.constexpr,
    SCALE0: tl.constexpr,
    FP8_0: tl.constexpr,
    H1: tl.constexpr,
    D1: tl.constexpr,
    SCALE1: tl.constexpr,
    FP8_1: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
    T,
    num_slots,
):
    """Grid ``(cdiv(T, BLOCK_T), cdiv(max row, BLOCK_R), 1 or 2)``: axis 2 picks K or V."""
    if PDL:  # launched as a programmatic dependent (attn_core.pdl): wait for the inputs, then
        gdc_wait()  # let the next kernel (the attention reading this cache) launch meanwhile
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    r0 = tl.program_id(1) * BLOCK_R
    in_range = tok < T
    slot = tl.load(slot_ptr + tok * slot_stride, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slot >= 0) & (slot < num_slots)
    # One launch for K and V: axis 2 picks the tensor (a single-tensor launch has one plane).
    if tl.program_id(2) == 1:
        _write_tile(
            x1_ptr, c1_ptr, s1_ptr, s1_val, tok, slot, valid, r0,
            x1_st, x1_sh, x1_sd, c1_sslot, c1_sh, c1_sd,
            H1, D1, SCALE1, FP8_1, BLOCK_R,
        )  # fmt: skip
    else:
        _write_tile(
            x0_ptr, c0_ptr, s0_ptr, s0_val, tok, slot, valid, r0,
            x0_st, x0_sh, x0_sd, c0_sslot, c0_sh, c0_sd,
            H0, D0, SCALE0, FP8_0, BLOCK_R,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Operand:
    """One tensor's kernel arguments: row viewed as ``[H, D]``, strides in elements."""

    x: torch.Tensor
    cache: torch.Tensor
    scale_ptr: torch.Tensor
    scale_val: float
    scale_mode: int
    fp8: bool
    h: int
    d: int
    x_strides: tuple[int, int, int]  # token, head, dim
    c_strides: tuple[int, int, int]  # slot, head, dim

    @property
    def row(self) -> int:
        return self.h * self.d


def _row_hd(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int, int, int]:
    """``(H, D, stride_h, stride_d)`` of a row of shape ``shape`` (dims after token / slot).

    A row of 0 or 1 dims is ``[1, D]``; of 2 dims ``[H, D]``; longer rows arrive merged into
    ``[prod(shape[:-1]), shape[-1]]`` by :func:`_operand`.
    """
    if len(shape) == 0:
        return 1, 1, 0, 1
    if len(shape) == 1:
        return 1, shape[0], 0, strides[0]
    return shape[0], shape[1], strides[0], strides[1]


def _operand(
    x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | float | None, fp8: bool
) -> _Operand:
    T = x.shape[0]
    row = tuple(cache.shape[2:])
    # The slot axis: page and offset merged (the torch writer's view of the cache).
    flat = cache.view(cache.shape[0] * cache.shape[1], *row)
    if len(row) > 2:  # rare; merge the leading row dims (a view for the cache, never a copy)
        flat = flat.view(flat.shape[0], -1, row[-1])
        x = x.reshape(T, -1, row[-1])
    h, d, xh, xd = _row_hd(x.shape[1:], x.stride()[1:])
    _, _, ch, cd = _row_hd(flat.shape[1:], flat.stride()[1:])
    if h > 1 and xh == d * xd and ch == d * cd:
        # Heads contiguous on both sides: one run of h*d elements per token (see _write_tile).
        # The head stride 0 still counts as "divisible by 16" in Triton's specialisation, which
        # with unit dim strides is what lets the loads and stores use 16-byte vectors.
        h, d, xh, ch = 1, h * d, 0, 0
    mode, ptr, val = _NO_SCALE, cache, 1.0
    if fp8 and isinstance(scale, torch.Tensor):
        mode, ptr = _SCALE_TENSOR, scale
    elif fp8 and scale is not None:
        mode, val = _SCALE_FLOAT, float(scale)
    return _Operand(
        x, flat, ptr, val, mode, fp8, h, d, (x.stride(0), xh, xd), (flat.stride(0), ch, cd)
    )


# Memoised: Triton's next_power_of_2 / cdiv cost microseconds of host time per call, which an
# eager decode step's write would pay per layer.
@functools.lru_cache(maxsize=4096)
def _config(T: int, row: int, tensors: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_R, num_warps)`` for ``T`` tokens of ``row`` elements, 1 or 2 tensors.

    A decode step is latency-bound: one token per program keeps every program's loads in flight
    at once. A prefill is bandwidth-bound: programs grow to ~4096 elements (8 KiB of bf16) while
    at least ~1024 programs remain, enough to fill an H200's 132 SMs several times over.
    """
    block_r = min(triton.next_power_of_2(row), 1024)
    n_r = triton.cdiv(row, block_r)
    block_t = 1
    while block_t * block_r < 4096 and triton.cdiv(T, 2 * block_t) * n_r * tensors >= 1024:
        block_t *= 2
    num_warps = min(8, max(1, block_t * block_r // 512))
    return block_t, block_r, num_warps


_WRITE = CachedLaunch(_write_kernel, unkeyed_tail=2)  # T, num_slots
#: Per write shape (:func:`launch`): the scalars that do not depend on the token count.
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 256


def _launch_args(
    xs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor | float | None],
    slot_mapping: torch.Tensor,
    num_tokens: int,
    config: tuple[int, int, int] | None,
) -> tuple:
    """``(grid, tensors, scalars, options)`` of one write: the write shape's plan, kept per
    shape (scalars that do not depend on the token count), and this call's tiling."""
    key = (
        slot_mapping.stride(0),
        *[
            (x.shape[1:], x.stride(), x.dtype, c.shape, c.stride(), c.dtype, scale_kind(sc))
            for x, c, sc in zip(xs, caches, scales, strict=True)
        ],
    )
    plan = _PLANS.get(key)
    if plan is None:
        fp8 = torch.float8_e4m3fn
        ops = [
            _operand(x, c, sc, c.dtype == fp8) for x, c, sc in zip(xs, caches, scales, strict=True)
        ]
        plan = _plan(ops, slot_mapping)
        if any(op.x is not x for op, x in zip(ops, xs, strict=True)):
            # A row of 3+ dims, reshaped for the kernel: launch with those tensors; keep no plan
            # (the reshape is this call's).
            xs = [op.x for op in ops]
        else:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    row, tensor_scale, scalars, num_slots = plan
    block_t, block_r, num_warps = config or _config(num_tokens, row, len(xs))
    pdl = pdl_enabled(slot_mapping.get_device())
    # The cache itself stands in for the kernel's flat view of it (same address and dtype), and
    # for an unused scale pointer.
    c0, c1 = caches[0], caches[-1]
    return (
        (-(-num_tokens // block_t), -(-row // block_r), len(xs)),
        (
            slot_mapping, xs[0], c0, scales[0] if tensor_scale[0] else c0,
            xs[-1], c1, scales[-1] if tensor_scale[1] else c1,
        ),
        (*scalars, block_t, block_r, pdl, num_tokens, num_slots),
        # num_stages: Triton's default on CUDA (the launch before CachedLaunch named none)
        {"num_warps": num_warps, "num_stages": 3, "launch_pdl": pdl},
    )  # fmt: skip


def launch(
    xs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor | float | None],
    slot_mapping: torch.Tensor,
    num_tokens: int,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Store ``xs[i][t]`` at slot ``slot_mapping[t]`` of ``caches[i]`` for one or two tensors.

    The caller (:mod:`attn_core.state.kv_write`) has checked shapes, devices and dtypes.
    Launched through :class:`~attn_core.fast_launch.CachedLaunch`, with the arguments that do
    not depend on the token count kept per write shape: an eager decode step's write costs a
    few microseconds of host time (Triton's own launcher took about 110 on the H200's host).

    :param xs: one or two ``[T, *row_i]`` float tensors (any strides).
    :param caches: matching ``[num_pages, page_size, *row_i]`` caches, float or
        ``float8_e4m3fn``; page and offset dims must merge into one slot dim without a copy.
    :param scales: fp8 caches only: a one-element float32 tensor on the cache's device (read in
        the kernel), a float, or None (= 1); ignored for other dtypes.
    :param slot_mapping: ``[>= T]`` integer on the cache's device; entry ``t`` < 0 or past the
        cache stores nothing.
    :param num_tokens: ``T`` (> 0), the rows of each ``x`` to write.
    :param config: ``(BLOCK_T, BLOCK_R, num_warps)`` instead of :func:`_config`'s choice
        (powers of two; for tuning sweeps).
    """
    grid, tensors, scalars, options = _launch_args(
        xs, caches, scales, slot_mapping, num_tokens, config
    )
    _WRITE.launch(grid, tensors, scalars, **options)


class BoundWrite:
    """One write shape's launch bound to its compiled kernel (:func:`bind`): ``write(k, v,
    k_cache, v_cache, slot_mapping, k_scale, v_scale)`` for tensors of the shapes, strides,
    dtypes, device and token count it was bound for (the caller's promise, as checked once by
    :func:`attn_core.state.kv_write.kv_writer`). Per call it reads the addresses and checks
    their alignment, the device and launch hooks; where those fail it launches through
    :func:`launch`.
    """

    __slots__ = ("_bound", "_tensor_scale", "num_tokens")

    def __init__(self, bound: BoundLaunch, tensor_scale: tuple[bool, bool],
                 num_tokens: int) -> None:  # fmt: skip
        self._bound = bound
        self._tensor_scale = tensor_scale
        self.num_tokens = num_tokens

    def __call__(self, xs: Sequence[torch.Tensor], caches: Sequence[torch.Tensor],
                 scales: Sequence[torch.Tensor | float | None],
                 slot_mapping: torch.Tensor) -> None:  # fmt: skip
        bound = self._bound
        c0, c1 = caches[0], caches[-1]
        s0, s1 = self._tensor_scale
        ps, px0, pc0, px1, pc1 = (
            slot_mapping.data_ptr(), xs[0].data_ptr(), c0.data_ptr(),
            xs[-1].data_ptr(), c1.data_ptr(),
        )  # fmt: skip
        # s0 / s1: bound for a tensor scale there (kv_writer checked it once)
        pk = scales[0].data_ptr() if s0 else pc0  # type: ignore[union-attr]
        pv = scales[-1].data_ptr() if s1 else pc1  # type: ignore[union-attr]
        stream = bound.stream_for(ps | px0 | pc0 | pk | px1 | pc1 | pv)
        if stream is not None:
            bound.launch(stream, ps, px0, pc0, pk, px1, pc1, pv)
        else:
            launch(xs, caches, scales, slot_mapping, self.num_tokens)


def bind(
    xs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor | float | None],
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> BoundWrite | None:
    """The :class:`BoundWrite` of these arguments, after one :func:`launch` of them compiled
    the kernel; None where a bound launch does not apply (see
    :meth:`~attn_core.fast_launch.CachedLaunch.bind`), or rows of 3+ dims (reshaped per call).
    """
    grid, tensors, scalars, options = _launch_args(
        xs, caches, scales, slot_mapping, num_tokens, None
    )
    if tensors[1] is not xs[0] or tensors[4] is not xs[-1]:
        return None
    bound = _WRITE.bind(grid, tensors, scalars, **options)
    if bound is None:
        return None
    tensor_scale = (tensors[3] is not caches[0], tensors[6] is not caches[-1])
    return BoundWrite(bound, tensor_scale, num_tokens)


def _plan(ops: list[_Operand], slot_mapping: torch.Tensor) -> tuple:
    """``(max row, (tensor 0 / 1 has a scale tensor), scalars, num_slots)`` of one write shape:
    what the launch takes besides the tensors and the token-count-dependent tiling."""
    a, b = ops[0], ops[-1]
    scalars = (
        slot_mapping.stride(0),
        a.scale_val, *a.x_strides, *a.c_strides,
        b.scale_val, *b.x_strides, *b.c_strides,
        a.h, a.d, a.scale_mode, a.fp8,
        b.h, b.d, b.scale_mode, b.fp8,
    )  # fmt: skip
    tensor_scale = (a.scale_mode == _SCALE_TENSOR, b.scale_mode == _SCALE_TENSOR)
    return max(a.row, b.row), tensor_scale, scalars, a.cache.shape[0]
