"""Reference softmax attention: decoder attention over a paged KV cache, varlen encoder attention.

Clarity first: one request at a time, pages gathered with ``index_select``, logits and outputs
computed in float32 with one batched matmul per request, results cast to the query dtype (or to
``out``'s dtype). Works on any torch device; the per-request loop reads ``query_start_loc`` and
``seq_lens`` on the host, so it is not CUDA-graph capturable (a reference need not be).

Paged batch layout (``B`` requests, ``T`` query tokens in the step)::

    query_start_loc  [0, 3, 4, 4, 9]          request b's queries are q[qsl[b]:qsl[b+1]]
    q_len            [3, 1, 0, 5]             (0: the request has no query this step)
    seq_lens         [7, 20, 4, 5]            KV length, the step's new tokens included
    positions of b=0 [4, 5, 6]                = seq_len - q_len + i (queries are the LAST tokens)
    page_table[b]    [p0, p1, ...]            request b's pages in order; token j of request b
                                              lives in page page_table[b, j // page_size] at
                                              offset j % page_size

Masking (``p`` = query position, ``j`` = key position):

* causal: ``j <= p``; bidirectional (``causal=False``): every key of the request/sequence.
* ``sliding_window=W`` (HF convention, a query sees at most ``W`` keys, itself included):
  causal ``p - W < j <= p``; bidirectional ``|p - j| < W`` (FlashAttention's
  ``window_size=(W-1, W-1)``, as vLLM uses for encoder-only models).
* ``attention_chunk_size=C`` (chunked local attention, Llama-4; transformers'
  ``chunked_overlay``): a query sees only keys of its own chunk, ``j // C == p // C``; with
  causal masking ``p // C * C <= j <= p``. It combines with a sliding window (both must hold).
* ``logits_soft_cap=c``: ``logits = c * tanh(scale * q.k / c)`` (Gemma-2), before masking.
* ``sinks`` ``[Hq]``: one learned logit per head that joins the softmax denominator only
  (gpt-oss): ``softmax([logits, sink])`` with the sink column dropped afterwards.
* GQA / MQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

FP8 KV: a ``float8_e4m3fn`` cache stores ``clamp(x / scale, -448, 448)``; reading dequantises
with ``x = stored * scale``. The scales apply to fp8 caches only (as in vLLM); a cache of another
dtype is read and written as is.
"""

from __future__ import annotations

import itertools
import math

import torch

from attn_core.state import kv_write

__all__ = [
    "FP8_DTYPE",
    "dequantize_cache",
    "paged_attention",
    "quantize_for_cache",
    "varlen_attention",
    "write_paged_kv",
]

#: The one fp8 KV storage dtype the reference understands (``LayerSpec.kv_dtype="fp8_e4m3"``).
FP8_DTYPE = kv_write.FP8_DTYPE
#: Most float32 logits materialised at once (256 MiB): long prefills run in query blocks, so
#: the reference stays usable as ground truth at real context lengths on a GPU.
MAX_LOGITS_PER_BLOCK = 1 << 26

#: A per-layer quantisation scale: a Python number or a one-element tensor (kept on device).
ScaleLike = float | torch.Tensor


# ------------------------------------------------------------------------------------------
# Small shared helpers (also used by mla.py)
# ------------------------------------------------------------------------------------------
def _check_scale(scale: object, name: str, device: torch.device) -> float | torch.Tensor:
    """A quantisation scale as a float or a 0-dim float32 tensor on ``device``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name}: expected a float or a one-element tensor, got shape {tuple(scale.shape)}"
            )
        # Kept as a tensor so a scale that lives on the GPU costs no host sync.
        return scale.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: expected a float or a one-element tensor, got {type(scale)!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}={scale!r}: expected a finite positive number")
    return float(scale)


def _storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as raw bytes when fp8, so that indexing ops need no fp8 kernels."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def quantize_for_cache(x: torch.Tensor, dtype: torch.dtype, scale: ScaleLike = 1.0) -> torch.Tensor:
    """``x`` converted to a cache dtype: fp8 stores ``clamp(x / scale, ±448)``, others ``x``.

    :param x: any float tensor.
    :param dtype: the cache dtype.
    :param scale: float or one-element tensor; used only when ``dtype`` is ``float8_e4m3fn``.
    :returns: a tensor of ``x``'s shape in ``dtype``.
    """
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return kv_write.quantize(x, dtype, _check_scale(scale, "scale", x.device))


def dequantize_cache(x: torch.Tensor, scale: ScaleLike = 1.0) -> torch.Tensor:
    """Cache contents as float32: fp8 is multiplied by ``scale``, other dtypes are upcast only."""
    if x.dtype != FP8_DTYPE:
        return x.float()
    return x.float() * _check_scale(scale, "scale", x.device)


def _gather_tokens(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request from a paged cache, in the cache's dtype.

    :param cache: ``[num_pages, page_size, *rest]``.
    :param pages: ``[max_pages]`` integer, the request's row of the page table.
    :returns: ``[length, *rest]``.
    """
    page_size = cache.shape[1]
    num = -(-length // page_size)
    if num > pages.numel():
        raise ValueError(
            f"a request of {length} tokens needs {num} pages of {page_size}, but the page table "
            f"has only {pages.numel()} columns"
        )
    idx = pages[:num].to(device=cache.device, dtype=torch.long)
    picked = _storage(cache).index_select(0, idx)
    picked = picked.reshape(num * page_size, *cache.shape[2:])[:length]
    return picked.view(cache.dtype)


def _cache_inputs(
    src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: ScaleLike, name: str
) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor | None]:
    """``(src, slots, scale)`` checked and moved to ``cache``'s device for the core's writer."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != src.shape[0]:
        raise ValueError(
            f"slot_mapping: expected shape [{src.shape[0]}] (one slot per token of {name}), "
            f"got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise TypeError(f"slot_mapping: expected an integer tensor, got {slot_mapping.dtype}")
    if tuple(src.shape[1:]) != tuple(cache.shape[2:]):
        raise ValueError(
            f"{name}: expected per-token shape {tuple(cache.shape[2:])} to match the cache "
            f"[num_pages, page_size, ...] = {tuple(cache.shape)}, got {tuple(src.shape[1:])}"
        )
    num_pages, page_size = cache.shape[0], cache.shape[1]
    slots = slot_mapping.to(device=cache.device, dtype=torch.long)
    capturing = slots.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing:
        # The range check reads the slots on the host; a captured decode step skips it (its
        # slots come from the core's page allocator, checked when the batch was built).
        top = int(slots.max()) if slots.numel() else -1
        if top >= num_pages * page_size:
            raise ValueError(
                f"slot_mapping: slot {top} is out of range for a cache of {num_pages} "
                f"pages x {page_size} tokens"
            )
    checked = None if cache.dtype != FP8_DTYPE else _check_scale(scale, "scale", cache.device)
    return src.to(cache.device), slots, checked


def _write_slots(
    src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: ScaleLike, name: str
) -> None:
    """Write ``src[t]`` to slot ``slot_mapping[t]`` of a paged ``cache``; slot ``-1`` skips."""
    src, slots, checked = _cache_inputs(src, cache, slot_mapping, scale, name)
    kv_write.write_slots(src, cache, slots, checked)


def _visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None = None,
) -> torch.Tensor | None:
    """``[Lq, Lk]`` bool, True where query ``q_pos[i]`` may read key ``k_pos[j]``; None: all."""
    if not causal and sliding_window is None and chunk_size is None:
        return None
    dist = q_pos[:, None] - k_pos[None, :]  # > 0: the key is before the query
    mask = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if sliding_window is not None:
        mask &= (dist < sliding_window) if causal else (dist.abs() < sliding_window)
    if chunk_size is not None:  # positions are >= 0: floor division is the chunk index
        mask &= (q_pos[:, None] // chunk_size) == (k_pos[None, :] // chunk_size)
    return mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one request/sequence, all in float32.

    :param q: ``[Lq, Hq, D]`` float32.
    :param k: ``[Lk, Hkv, D]`` float32.
    :param v: ``[Lk, Hkv, Dv]`` float32.
    :param q_pos: ``[Lq]`` int64, position of each query in the sequence.
    :param k_pos: ``[Lk]`` int64, position of each key.
    :param sinks: ``[Hq]`` float32 or None.
    :returns: ``[Lq, Hq, Dv]`` float32.
    """
    lq, hq, d = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    block = max(1, MAX_LOGITS_PER_BLOCK // max(1, hq * k.shape[0]))
    if lq > block:  # each query row is independent: split the rows, join the outputs
        parts = [
            _attend(
                q[i : i + block],
                k,
                v,
                q_pos[i : i + block],
                k_pos,
                scale=scale,
                causal=causal,
                sliding_window=sliding_window,
                chunk_size=chunk_size,
                logits_soft_cap=logits_soft_cap,
                sinks=sinks,
            )
            for i in range(0, lq, block)
        ]
        return torch.cat(parts)
    group = hq // hkv
    # Head h = kv_head * group + g: viewing Hq as (Hkv, group) pairs query heads with KV heads.
    qg = q.reshape(lq, hkv, group, d)
    logits = torch.einsum("qhgd,khd->hgqk", qg, k) * scale  # [Hkv, group, Lq, Lk]
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    mask = _visible(q_pos, k_pos, causal, sliding_window, chunk_size)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(hkv, group, 1, 1).expand(hkv, group, lq, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgqk,khv->qhgv", probs, v)
    return out.reshape(lq, hq, dv)


def _check_options(
    sliding_window: int | None,
    logits_soft_cap: float | None,
    scale: float,
    attention_chunk_size: int | None = None,
) -> None:
    for name, value in (
        ("sliding_window", sliding_window),
        ("attention_chunk_size", attention_chunk_size),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"{name}={value!r}: expected None or an integer >= 1")
    if logits_soft_cap is not None and not (
        isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0
    ):
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r}: expected None or a number > 0")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale={scale!r}: expected a finite float (softmax scale)")


def _check_dim(t: torch.Tensor, name: str, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor {layout}, got {type(t)!r}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims {layout}, got shape {tuple(t.shape)}")


def _check_int(t: torch.Tensor, name: str) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32), got {t.dtype}")


def _prepare_out(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """The tensor results are written to: ``out`` (checked) or a new one of ``like``'s dtype."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"out: expected device {like.device}, got {out.device}")
    return out


def _check_batch(
    page_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[list[int], list[int]]:
    """Validate the paged batch description; return query_start_loc and seq_lens as lists."""
    _check_dim(page_table, "page_table", 2, "[B, max_pages]")
    _check_dim(query_start_loc, "query_start_loc", 1, "[B + 1]")
    _check_dim(seq_lens, "seq_lens", 1, "[B]")
    for t, name in ((page_table, "page_table"), (query_start_loc, "query_start_loc"),
                    (seq_lens, "seq_lens")):  # fmt: skip
        _check_int(t, name)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc: expected {batch + 1} entries for {batch} requests (seq_lens), "
            f"got {query_start_loc.shape[0]}"
        )
    if page_table.shape[0] < batch:
        raise ValueError(
            f"page_table: expected at least {batch} rows (one per request), "
            f"got {page_table.shape[0]}"
        )
    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    if qsl[0] < 0 or qsl[-1] > num_tokens or any(b < a for a, b in itertools.pairwise(qsl)):
        raise ValueError(
            f"query_start_loc={qsl}: expected non-decreasing offsets within the {num_tokens} "
            "query tokens"
        )
    for b, (start, end, length) in enumerate(zip(qsl, qsl[1:], lens, strict=False)):
        if end - start > length:
            raise ValueError(
                f"request {b}: {end - start} query tokens but seq_lens[{b}]={length}; seq_lens "
                "counts the KV tokens including the new ones, so it must be >= the query length"
            )
    return qsl, lens


def _zero_uncovered(result: torch.Tensor, qsl: list[int]) -> None:
    """Zero the rows no request owns (batch padding), so ``out`` never holds stale values."""
    result[: qsl[0]].zero_()
    result[qsl[-1] :].zero_()


# ------------------------------------------------------------------------------------------
# Public ops
# ------------------------------------------------------------------------------------------
def write_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
) -> None:
    """Store the step's new keys and values in a paged KV cache, in place.

    :param k: ``[T, Hkv, D]`` float.
    :param v: ``[T, Hkv, Dv]`` float.
    :param k_cache: ``[num_pages, page_size, Hkv, D]``, float or ``float8_e4m3fn``.
    :param v_cache: ``[num_pages, page_size, Hkv, Dv]``, same dtype as ``k_cache``.
    :param slot_mapping: ``[T]`` integer (int64), ``page * page_size + offset`` of each token;
        ``-1`` skips the token (padding).
    :param k_scale: fp8 only: the cache stores ``clamp(k / k_scale, ±448)``.
    :param v_scale: fp8 only: likewise for ``v``.
    """
    _check_dim(k, "k", 3, "[T, Hkv, D]")
    _check_dim(v, "v", 3, "[T, Hkv, Dv]")
    _check_dim(k_cache, "k_cache", 4, "[num_pages, page_size, Hkv, D]")
    _check_dim(v_cache, "v_cache", 4, "[num_pages, page_size, Hkv, Dv]")
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v: expected the same token count, got {k.shape[0]} and {v.shape[0]}"
        )
    k, slots, ks = _cache_inputs(k, k_cache, slot_mapping, k_scale, "k")
    v, _, vs = _cache_inputs(v, v_cache, slot_mapping, v_scale, "v")
    kv_write.write_kv_slots(k, v, k_cache, v_cache, slots, ks, vs)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoder attention of a ragged batch (prefill chunks, decodes, both) over a paged KV cache.

    The step's new K/V must already be in the cache (:func:`write_paged_kv`). See the module
    docstring for the batch layout and the masking rules.

    :param q: ``[T, Hq, D]`` float32 / bfloat16 / float16.
    :param k_cache: ``[num_pages, page_size, Hkv, D]``, float or ``float8_e4m3fn``.
    :param v_cache: ``[num_pages, page_size, Hkv, Dv]``, same dtype as ``k_cache``.
    :param page_table: ``[B, max_pages]`` int32, request b's pages in order.
    :param query_start_loc: ``[B + 1]`` int32, cumulative query lengths.
    :param seq_lens: ``[B]`` int32, KV length of each request including its new tokens.
    :param scale: softmax scale applied to ``q . k``.
    :param causal: True: a query at position p sees keys ``0..p``; False: all ``seq_len`` keys.
    :param sliding_window: a query sees at most this many keys, itself included.
    :param attention_chunk_size: a query sees only keys of its own chunk of this many
        positions (``j // C == p // C``), Llama-4's chunked attention.
    :param logits_soft_cap: ``c`` in ``c * tanh(logits / c)``.
    :param sinks: ``[Hq]`` float, per-head sink logits (denominator only).
    :param k_scale: fp8 dequantisation scale of ``k_cache`` (float or one-element tensor).
    :param v_scale: fp8 dequantisation scale of ``v_cache``.
    :param out: optional ``[T, Hq, Dv]`` tensor to write into (any float dtype).
    :returns: ``[T, Hq, Dv]`` in ``q.dtype`` (or ``out`` itself). Rows outside
        ``query_start_loc[0]:query_start_loc[-1]`` are zero.
    """
    _check_dim(q, "q", 3, "[T, Hq, D]")
    _check_dim(k_cache, "k_cache", 4, "[num_pages, page_size, Hkv, D]")
    _check_dim(v_cache, "v_cache", 4, "[num_pages, page_size, Hkv, Dv]")
    _check_options(sliding_window, logits_soft_cap, scale, attention_chunk_size)
    num_tokens, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    dv = v_cache.shape[3]
    if tuple(v_cache.shape[:3]) != (num_pages, page_size, hkv):
        raise ValueError(
            f"v_cache: expected leading dims {(num_pages, page_size, hkv)} like k_cache, "
            f"got {tuple(v_cache.shape[:3])}"
        )
    if dk != d:
        raise ValueError(f"k_cache: expected head_dim {d} (from q), got {dk}")
    if hq % hkv != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} KV heads")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must share a dtype")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(
            f"sinks: expected shape ({hq},) (one per query head), got {tuple(sinks.shape)}"
        )
    qsl, lens = _check_batch(page_table, query_start_loc, seq_lens, num_tokens)
    ks = _check_scale(k_scale, "k_scale", q.device)
    vs = _check_scale(v_scale, "v_scale", q.device)
    sinks_f = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32)

    result = _prepare_out(out, (num_tokens, hq, dv), q)
    _zero_uncovered(result, qsl)
    for b, length in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        pages = page_table[b]
        k = dequantize_cache(_gather_tokens(k_cache, pages, length), ks)
        v = dequantize_cache(_gather_tokens(v_cache, pages, length), vs)
        k_pos = torch.arange(length, device=q.device)
        q_pos = k_pos[length - (end - start) :]
        o = _attend(
            q[start:end].float(),
            k.to(q.device),
            v.to(q.device),
            q_pos,
            k_pos,
            scale=scale,
            causal=causal,
            sliding_window=sliding_window,
            chunk_size=attention_chunk_size,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks_f,
        )
        result[start:end] = o.to(result.dtype)
    return result


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encoder attention over packed variable-length sequences; each attends only within itself.

    :param q: ``[T, Hq, D]`` float.
    :param k: ``[T, Hkv, D]`` float.
    :param v: ``[T, Hkv, Dv]`` float.
    :param cu_seqlens: ``[N + 1]`` int32, sequence n is rows ``cu_seqlens[n]:cu_seqlens[n+1]``.
    :param scale: softmax scale applied to ``q . k``.
    :param causal: True: token i sees tokens ``0..i`` of its sequence; False: all of them.
    :param sliding_window: causal: ``i - W < j <= i``; bidirectional: ``|i - j| < W``.
    :param attention_chunk_size: a query sees only keys of its own chunk of this many
        positions (``j // C == p // C``), Llama-4's chunked attention.
    :param logits_soft_cap: ``c`` in ``c * tanh(logits / c)``.
    :param out: optional ``[T, Hq, Dv]`` tensor to write into.
    :returns: ``[T, Hq, Dv]`` in ``q.dtype`` (or ``out``). Rows outside
        ``cu_seqlens[0]:cu_seqlens[-1]`` are zero.
    """
    _check_dim(q, "q", 3, "[T, Hq, D]")
    _check_dim(k, "k", 3, "[T, Hkv, D]")
    _check_dim(v, "v", 3, "[T, Hkv, Dv]")
    _check_dim(cu_seqlens, "cu_seqlens", 1, "[N + 1]")
    _check_int(cu_seqlens, "cu_seqlens")
    _check_options(sliding_window, logits_soft_cap, scale, attention_chunk_size)
    num_tokens, hq, d = q.shape
    if k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        raise ValueError(
            f"q, k, v: expected the same token count, got {num_tokens}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[2] != d:
        raise ValueError(f"k: expected head_dim {d} (from q), got {k.shape[2]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v: expected {k.shape[1]} KV heads like k, got {v.shape[1]}")
    if hq % k.shape[1] != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of k's {k.shape[1]} KV heads")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if not cu or cu[0] < 0 or cu[-1] > num_tokens or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(
            f"cu_seqlens={cu}: expected non-decreasing offsets within the {num_tokens} tokens"
        )

    result = _prepare_out(out, (num_tokens, hq, v.shape[2]), q)
    _zero_uncovered(result, cu)
    for start, end in itertools.pairwise(cu):
        if end == start:
            continue
        pos = torch.arange(end - start, device=q.device)
        o = _attend(
            q[start:end].float(),
            k[start:end].float(),
            v[start:end].float(),
            pos,
            pos,
            scale=scale,
            causal=causal,
            sliding_window=sliding_window,
            chunk_size=attention_chunk_size,
            logits_soft_cap=logits_soft_cap,
        )
        result[start:end] = o.to(result.dtype)
    return result
