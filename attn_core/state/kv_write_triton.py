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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attn_core.pdl import gdc_launch_dependents, gdc_wait, pdl_enabled

__all__ = ["launch"]

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
    slot_ptr,
    slot_stride,
    T,
    num_slots,
    # tensor 0 (K, or the MLA latent)
    x0_ptr,
    c0_ptr,
    s0_ptr,
    s0_val,
    x0_st,
    x0_sh,
    x0_sd,
    c0_sslot,
    c0_sh,
    c0_sd,
    # tensor 1 (V); a single-tensor launch repeats tensor 0 here and never reads it
    x1_ptr,
    c1_ptr,
    s1_ptr,
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
    fp8 = torch.float8_e4m3fn
    pdl = pdl_enabled(slot_mapping.device)
    ops = [_operand(x, c, s, c.dtype == fp8) for x, c, s in zip(xs, caches, scales, strict=True)]
    a, b = ops[0], ops[-1]
    block_t, block_r, num_warps = config or _config(num_tokens, max(a.row, b.row), len(ops))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(max(a.row, b.row), block_r), len(ops))
    _write_kernel[grid](
        slot_mapping,
        slot_mapping.stride(0),
        num_tokens,
        a.cache.shape[0],
        a.x, a.cache, a.scale_ptr, a.scale_val, *a.x_strides, *a.c_strides,
        b.x, b.cache, b.scale_ptr, b.scale_val, *b.x_strides, *b.c_strides,
        H0=a.h, D0=a.d, SCALE0=a.scale_mode, FP8_0=a.fp8,
        H1=b.h, D1=b.d, SCALE1=b.scale_mode, FP8_1=b.fp8,
        BLOCK_T=block_t, BLOCK_R=block_r, PDL=pdl,
        num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
