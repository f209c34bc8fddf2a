"""Write a step's new keys / values / MLA latents into the core's paged caches, graph-safely.

Every backend stores the step's new tokens the same way, so the core owns the one writer:
a token's cache row is ``slot = page * page_size + offset`` (the batch's ``slot_mapping``), a
row of the cache viewed as ``[num_pages * page_size, ...]``, so a write is one ``index_copy_``
per tensor.

Padding tokens of a CUDA-graph padded batch carry slot ``-1`` ("write nothing"). Dropping them
with a boolean mask would sync with the host and change shapes, which a captured graph cannot
do. Instead every padding row is redirected to a slot whose final bytes it cannot change:

* when the batch's first token is real (padding rows follow the real requests), to that
  token's slot *with that token's values*: the duplicate write stores the same bytes twice
  (``index_copy_`` with duplicate indices is only nondeterministic in which copy lands last);
* when every row is padding (the dummy step a server captures a graph with), to cache row 0
  *with the bytes row 0 holds already*, read in the same step: nothing changes.

Which case applies is decided on the device, so one captured graph serves both. A step known on
the host to hold no padding (and not captured) passes ``may_have_padding=False`` and skips the
redirect.

fp8 caches store ``clamp(x / scale, -448, 448)`` in ``float8_e4m3fn``; the scale is the layer's
0-dim device tensor (or a float), so quantising costs no host sync and a captured graph reads
the current scale.

Two implementations, picked by device (not a fallback: both have the semantics above):

* CUDA tensors: one Triton kernel (:mod:`attn_core.state.kv_write_triton`) that writes K and V
  (:func:`write_kv_slots`) or one tensor (:func:`write_slots`) in a single launch. A kernel
  masks padding rows, so it needs no redirect. Were Triton not importable (it ships with
  torch's Linux CUDA wheels), the torch path runs instead, with a warning the first time.
* Other devices: the torch path above (:func:`write_slots_torch`), about six small kernels per
  tensor, which on CPU costs nothing that matters.

The Triton kernel launches through :class:`attn_core.fast_launch.CachedLaunch`, and on sm90
as a programmatic dependent launch (:mod:`attn_core.pdl`). A backend that writes one shape per
layer of a step keeps a :class:`KVWriter`: the checks on its first write, a bound launch after.
Every CUDA write takes the kernel, small eager ones too: through CachedLaunch it costs the host
what two ``index_copy_`` calls do, and less GPU time (figures: docs/results.md); only through
Triton's own launcher would the two calls be cheaper.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import numpy as np
import torch

__all__ = [
    "FP8_DTYPE",
    "MAX_SLOT_RUNS",
    "KVWriter",
    "quantize",
    "scale_kind",
    "slot_runs",
    "write_kv_runs",
    "write_kv_slots",
    "write_slots",
    "write_slots_torch",
]

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float | None
) -> torch.Tensor:
    """``x`` in a cache dtype: fp8 stores ``clamp(x / scale, ±448)``, other dtypes a plain cast.

    :param x: float tensor of any shape.
    :param dtype: the cache dtype.
    :param scale: fp8 only: a 0-dim float32 tensor on ``x``'s device, a float, or None (= 1).
    :returns: a tensor of ``x``'s shape in ``dtype``.
    """
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    xf = x.float()
    if scale is not None:
        xf = xf / scale
    # Clamp before the cast: e4m3fn has no inf, and out-of-range values would become NaN.
    return xf.clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)


def _flat(cache: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if flat.dtype == FP8_DTYPE:
        # index_copy_ has no fp8 kernels everywhere: move the bytes instead.
        return flat.view(torch.uint8), values.view(torch.uint8)
    return flat, values


def write_slots(
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    may_have_padding: bool = True,
) -> None:
    """Store ``x[t]`` at slot ``slot_mapping[t]``; slot ``-1`` (padding) stores nothing.

    Runs no host synchronisation, so it can be captured in a CUDA graph. CUDA tensors are
    written by one Triton launch, others by :func:`write_slots_torch` (see the module docs).

    :param x: ``[T, *row]`` float (``T`` may be a graph's padded token count).
    :param cache: ``[num_pages, page_size, *row]`` (page and offset dims mergeable into one),
        float or ``float8_e4m3fn``.
    :param slot_mapping: ``[>= T]`` integer (int64 or int32); its first ``T`` entries are used.
    :param scale: fp8 quantisation scale (see :func:`quantize`); a tensor must live on the
        cache's device.
    :param may_have_padding: False only when every slot is known to be ``>= 0`` (no padding,
        and not capturing a graph that may later be replayed with padding): the torch path
        then skips two selects. The Triton kernel ignores it (masking padding is free there).
    :raises ValueError: ``x`` does not fit the cache (row shape, dtype, device), or
        ``slot_mapping`` / ``scale`` are not usable as described.
    """
    _check(x, cache, slot_mapping, scale, "x")
    if x.shape[0] == 0:
        return
    kernels = _kernels(cache)
    if kernels is None:
        write_slots_torch(x, cache, slot_mapping, scale, may_have_padding=may_have_padding)
    else:
        kernels.launch((x,), (cache,), (scale,), slot_mapping, x.shape[0])


def write_kv_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    may_have_padding: bool = True,
) -> None:
    """:func:`write_slots` for K and V at once: on CUDA one kernel launch writes both.

    :param k: ``[T, Hkv, D]`` float.
    :param v: ``[T, Hkv, Dv]`` float (same ``T``).
    :param k_cache: ``[num_pages, page_size, Hkv, D]``, float or ``float8_e4m3fn``.
    :param v_cache: ``[num_pages, page_size, Hkv, Dv]``, the same pages and page size.
    :param slot_mapping: ``[>= T]`` integer; ``-1`` marks padding (written nowhere).
    :param k_scale: fp8 quantisation scale of K (see :func:`quantize`), or None.
    :param v_scale: likewise for V.
    :param may_have_padding: as for :func:`write_slots`.
    :raises ValueError: as :func:`write_slots`, or K and V disagree on ``T`` or on the slots.
    """
    _check(k, k_cache, slot_mapping, k_scale, "k")
    _check(v, v_cache, slot_mapping, v_scale, "v")
    if k.shape[0] != v.shape[0] or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            f"k and v: expected the same token count and [num_pages, page_size], got "
            f"k {tuple(k.shape)} into {tuple(k_cache.shape)}, v {tuple(v.shape)} into "
            f"{tuple(v_cache.shape)}"
        )
    if k.shape[0] == 0:
        return
    kernels = _kernels(k_cache)
    n = k.shape[0]
    if kernels is not None:
        kernels.launch((k, v), (k_cache, v_cache), (k_scale, v_scale), slot_mapping, n)
    else:
        write_slots_torch(k, k_cache, slot_mapping, k_scale, may_have_padding=may_have_padding)
        write_slots_torch(v, v_cache, slot_mapping, v_scale, may_have_padding=may_have_padding)


def scale_kind(scale: torch.Tensor | float | None) -> object:
    """What a compiled write depends on of a scale: only *that* it is a tensor (its address and
    value are read per write), a float's value (baked into the launch), or None. The write
    kernel's plans key on it; so does a backend keeping one :class:`KVWriter` per kind."""
    return "tensor" if isinstance(scale, torch.Tensor) else scale


class KVWriter:
    """:func:`write_kv_slots` for one write shape, its checks made on the first call only.

    ``writer(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)``: the first call is a
    checked :func:`write_kv_slots`; on CUDA it then binds the write kernel
    (:func:`attn_core.state.kv_write_triton.bind`), and later calls only read the addresses
    and launch. The caller promises that later calls bring tensors of the first call's shapes,
    strides, dtypes and device, the same kinds of scale (tensor, float value, None) and the same
    token count: a backend's forward keeps one writer per step and per what may change between
    its layers (k/v strides, scales). Why: an eager decode step writes once per layer, and the
    checks and launch keys cost more host time than the launch; a checked write per layer
    nearly tripled the host time of FlashInfer's path at B=1.
    """

    __slots__ = ("_bound", "_may_have_padding", "_tried")

    def __init__(self, *, may_have_padding: bool = True) -> None:
        self._may_have_padding = may_have_padding
        self._bound: Any = None
        self._tried = False

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
    ) -> None:
        bound = self._bound
        if bound is not None:
            bound((k, v), (k_cache, v_cache), (k_scale, v_scale), slot_mapping)
            return
        write_kv_slots(
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            may_have_padding=self._may_have_padding,
        )  # fmt: skip
        if not self._tried:
            self._tried = True
            kernels = _kernels(k_cache)
            if kernels is not None and k.shape[0] > 0:
                self._bound = kernels.bind(
                    (k, v), (k_cache, v_cache), (k_scale, v_scale), slot_mapping, k.shape[0]
                )


def _check(
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | float | None,
    name: str,
) -> None:
    """Cheap checks (tensor metadata only, no host sync) that a kernel would otherwise turn
    into a corrupted cache rather than an error."""
    # Metadata only, and cheaply: an eager decode step's write pays these per layer.
    row = cache.shape[2:]
    if x.dim() < 1 or x.shape[1:] != row:
        raise ValueError(
            f"{name}: expected shape [T, {', '.join(map(str, row))}] to match the cache "
            f"[num_pages, page_size, ...] = {tuple(cache.shape)}, got {tuple(x.shape)}"
        )
    if not x.is_floating_point() or x.dtype == FP8_DTYPE or not cache.is_floating_point():
        raise ValueError(
            f"{name}: expected a float tensor (not fp8) written into a float or fp8 cache, got "
            f"{x.dtype} into a {cache.dtype} cache"
        )
    if min(cache.shape[:2]) > 1 and cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(
            f"{name} cache: expected [num_pages, page_size] dims that merge into one slot dim "
            f"(stride(0) == page_size * stride(1)), got strides {cache.stride()}"
        )
    device = cache.device
    if x.device != device or slot_mapping.device != device:
        raise ValueError(
            f"{name}: expected x, cache and slot_mapping on one device, got {x.device}, "
            f"{cache.device} and {slot_mapping.device}"
        )
    if (
        slot_mapping.dim() != 1
        or slot_mapping.shape[0] < x.shape[0]
        or slot_mapping.is_floating_point()
        or slot_mapping.dtype == torch.bool
    ):
        raise ValueError(
            f"slot_mapping: expected a 1-D integer tensor of at least {x.shape[0]} entries "
            f"(one per token of {name}), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if (
        isinstance(scale, torch.Tensor)
        and cache.dtype == FP8_DTYPE
        and (scale.numel() != 1 or scale.device != cache.device)
    ):
        raise ValueError(
            f"{name} scale: expected a one-element tensor on {cache.device}, got shape "
            f"{tuple(scale.shape)} on {scale.device}"
        )


_triton_kernels: ModuleType | None = None
_triton_missing = False


def _step_slots(slot_mapping: torch.Tensor, n: int) -> torch.Tensor:
    """The slots of a step's ``n`` tokens as int64 (what ``index_copy_`` takes)."""
    slots = slot_mapping if slot_mapping.shape[0] == n else slot_mapping[:n]
    return slots if slots.dtype == torch.long else slots.long()


def _kernels(cache: torch.Tensor) -> ModuleType | None:
    """The Triton writer for a CUDA ``cache``; None for other devices (torch path)."""
    global _triton_kernels, _triton_missing
    if not cache.is_cuda or _triton_missing:
        return None
    if _triton_kernels is None:
        try:
            from attn_core.state import kv_write_triton
        except ImportError as exc:  # torch's Linux CUDA wheels ship Triton; others may not
            _triton_missing = True
            warnings.warn(
                f"attn_core.state.kv_write: Triton is not importable ({exc}); CUDA KV writes "
                f"use the slower torch path (several kernels per tensor)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        _triton_kernels = kv_write_triton
    return _triton_kernels


def write_slots_torch(
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    may_have_padding: bool = True,
) -> None:
    """:func:`write_slots` in torch ops (the module docs' redirect), without input checks.

    What :func:`write_slots` runs off CUDA; tests and benchmarks compare the kernel with it.
    Arguments as for :func:`write_slots`.
    """
    n = x.shape[0]
    if n == 0:
        return
    slots = _step_slots(slot_mapping, n)
    flat, values = _flat(cache, quantize(x, cache.dtype, scale))
    if may_have_padding:
        valid = slots >= 0
        first = slots[:1].clamp(min=0)  # token 0's slot, or row 0 when token 0 is padding
        row = (1, *values.shape[1:])
        unchanged = torch.where(
            (slots[:1] >= 0).view([1] * values.dim()), values[:1], flat.index_select(0, first)
        ).view(row)
        slots = torch.where(valid, slots, first)
        values = torch.where(valid.view(-1, *([1] * (values.dim() - 1))), values, unchanged)
    flat.index_copy_(0, slots, values)


#: Most runs of consecutive slots :func:`slot_runs` reports: past it a step's K/V go to the
#: kernel (each run costs two ``copy_`` calls of host time).
MAX_SLOT_RUNS = 16


def slot_runs(slots: np.ndarray, max_runs: int | None = None) -> list[tuple[int, int, int]] | None:
    """The runs of consecutive cache slots in a step's host slot mapping, for
    :func:`write_kv_runs`: ``(first token, first slot, tokens)`` each, in token order.

    :param slots: ``[T]`` int64, a batch's ``slot_mapping_cpu`` (first T tokens).
    :param max_runs: default :data:`MAX_SLOT_RUNS`.
    :returns: None when a slot is padding (``< 0``) or there are more than ``max_runs`` runs.
    """
    max_runs = MAX_SLOT_RUNS if max_runs is None else max_runs
    n = slots.shape[0]
    if n == 0:
        return []
    if slots.min() < 0:
        return None
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    if breaks.shape[0] + 1 > max_runs:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    return [(a, int(slots[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def write_kv_runs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: list[tuple[int, int, int]],
) -> None:
    """Write K and V rows whose slots form ``runs`` (:func:`slot_runs`) as plain copies: one
    contiguous ``copy_`` per run and tensor, which torch issues as a device-to-device memcpy.

    Why: the memcpy runs beside a compute-bound kernel without taking its SMs, where the write
    kernel on a side stream waits for the SMs the prefill holds; beside a 16k-token ragged
    prefill the copies cost about a quarter of what the kernel did.

    :param k: ``[T, Hkv, D]`` contiguous, the cache's dtype (no fp8 quantisation here);
        ``v`` ``[T, Hkv, Dv]`` likewise.
    :param k_cache: ``[num_pages, page_size, Hkv, D]`` contiguous; ``v_cache`` likewise.
    :raises ValueError: a tensor is not contiguous or the dtypes differ (callers check first).
    """
    for x, cache in ((k, k_cache), (v, v_cache)):
        if not (x.is_contiguous() and cache.is_contiguous()) or x.dtype != cache.dtype:
            raise ValueError(
                f"write_kv_runs copies contiguous rows of the cache's dtype: got "
                f"{tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()}) into "
                f"{tuple(cache.shape)} {cache.dtype} (contiguous: {cache.is_contiguous()})"
            )
    k_rows = k_cache.view(-1, *k.shape[1:])
    v_rows = v_cache.view(-1, *v.shape[1:])
    for t0, s0, n in runs:
        k_rows[s0 : s0 + n].copy_(k[t0 : t0 + n])
        v_rows[s0 : s0 + n].copy_(v[t0 : t0 + n])
