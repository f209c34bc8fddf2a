"""Where the FlashAttention-3 API comes from, and one call shape for both sources.

Two providers, tried in this order:

1. ``flash_attn.cute.interface`` of **flash-attn-4** (4.0.0b14 + nvidia-cutlass-dsl 4.4.2, or
   4.0.0b40 + 4.8.1): its Hopper path is FlashAttention-3's design written in the CuTe DSL.
   Read from the 4.0.0b14 and 4.0.0b40 sources:

   * ``_flash_attn_fwd(q, k, v, cu_seqlens_q=, seqused_k=, max_seqlen_q=, max_seqlen_k=,
     page_table=, softmax_scale=, causal=, softcap=, window_size_left=, window_size_right=,
     learnable_sink=, score_mod=, out=)`` returns ``(out, lse)`` (4.0.0b40: ``(out, lse, p,
     row_max, o_lo)``, the last three None in a forward; only the first two are read); the public
     ``flash_attn_varlen_func`` wraps it in an autograd Function and takes no ``out``. This
     module is the plugin's only user of that private function (and of
     ``utils.create_softcap_scoremod``): it calls it, to write into the caller's ``out`` (and,
     for split decode's chunk rows, ``lse``), only for a release in
     :data:`TESTED_DIRECT_RELEASES` whose signature has every argument used here, and only
     once :func:`self_check` found it equal to the public function on small paged and
     chunk-row cases on this GPU; otherwise every call is the public function (and a copy into
     ``out``), and ``attn list`` says why (:attr:`Provider.note`).
   * query rows of stride 0 (a split decode of one request broadcasting its query over its
     chunk rows): nothing documents them, so :func:`check_broadcast_q` compares them with a
     copy at each layer shape on the GPU before a context uses them.
   * paged KV: ``k``/``v`` are ``[num_pages, page_size, Hkv, D]``, ``page_table`` int32
     ``[B, max_pages]``, unit stride in the last dim; ``seqused_k`` int32 ``[B]``. A page size
     equal to the kernel's ``tile_n`` loads KV with TMA; any other page size loads rows with
     cp.async through a per-row page lookup (``PagedKVManager``). That loader covers
     ``tile_n // 128`` rows per thread, so it is only correct when ``tile_n`` is a multiple of
     128 - true on sm90 for head dims <= 64 and <= 128 (tile 192x128 / 128x128) and for <= 96
     when causal or local (192x128), false for 192 / 256 (tile_n 64..112; 4.0.0b14 has no
     guard, later releases raise). Hence head dims {64, 96, 128} and causal only.
   * masks are aligned to the END of each sequence (``causal_row_offset = seqlen_k -
     seqlen_q``): the new tokens are the last ``q_len`` of the ``seqused_k`` keys, as the core
     lays them out. ``window_size=(W-1, 0)`` with ``causal=True`` is HF's sliding window ``W``.
   * soft-cap is a ``score_mod`` (``c * tanh(s * scale / c)``); the closure is built once per
     context here, so its hash is not recomputed per call.
   * ``learnable_sink``: ``[Hq]`` **bfloat16** only; the sink joins the softmax denominator.
     4.0.0b14 adds ``exp(sink - rowmax)`` without rebasing the max, so a sink far above every
     logit overflows (fixed upstream later).
   * sm90 has no split-KV in this path (``num_splits=1``): the forward is deterministic.
   * fp8 is sm100-only in flash-attn-4: KV must be bf16 / fp16 like q.

2. ``flash_attn_interface`` (official FlashAttention-3 build, ``hopper/``):
   ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=, cu_seqlens_q=,
   max_seqlen_q=, softmax_scale=, causal=, window_size=(l, r), softcap=)``; -1 means "no
   window". No learnable sinks in the official build.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "Provider",
    "check_broadcast_q",
    "describe_missing",
    "probe",
    "self_check",
    "self_check_sinks",
]

#: Head dims the paged path is correct for (see the module docstring).
FA4_HEAD_DIMS = frozenset({64, 96, 128})
FA3_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})
#: flash-attn-4 releases whose private ``_flash_attn_fwd`` this module was written against.
TESTED_DIRECT_RELEASES = frozenset({"4.0.0b14", "4.0.0b40"})
_FA4_FWD_ARGS = frozenset(
    {
        "cu_seqlens_q",
        "seqused_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "page_table",
        "softmax_scale",
        "causal",
        "softcap",
        "window_size_left",
        "window_size_right",
        "learnable_sink",
        "score_mod",
        "out",
    }
)
#: what ``_flash_attn_fwd`` must also take for the split-KV chunk call into caller buffers
_FA4_LSE_ARGS = frozenset({"return_lse", "lse", "out", "score_mod", "softcap"})


@dataclass(frozen=True, slots=True)
class Provider:
    """One source of the FA3 API, normalised to :meth:`run`.

    :ivar name: ``"flash-attn-4"`` or ``"flash_attn_interface"``.
    :ivar version: the distribution's version.
    :ivar sinks: whether learnable sinks are passed to the kernel.
    :ivar deterministic: whether the forward is deterministic run to run.
    :ivar head_dims: head dims this provider serves over paged KV.
    """

    name: str
    version: str
    sinks: bool
    deterministic: bool
    head_dims: frozenset[int]
    _run: Callable[..., torch.Tensor]
    _make_softcap: Callable[[float], object] | None = None
    _run_with_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    _run_dense: Callable[..., torch.Tensor] | None = None
    #: how the kernel is called, for ``attn list`` (e.g. why the private entry point is off)
    note: str = ""
    #: True when :meth:`run` goes through a private entry point that :func:`self_check` must
    #: compare with the public one before the first context uses it
    uses_private: bool = False

    @property
    def splits_kv(self) -> bool:
        """Whether :meth:`run_with_lse` exists: decode can be split over the KV range here."""
        return self._run_with_lse is not None

    @property
    def runs_dense(self) -> bool:
        """Whether :meth:`run_dense` exists (prefill without a cached prefix, no page table)."""
        return self._run_dense is not None

    def make_softcap(self, cap: float | None) -> object:
        """What :meth:`run` takes as ``softcap`` (built once per context)."""
        if cap is None:
            return None
        return self._make_softcap(cap) if self._make_softcap is not None else cap

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None,
        *,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        seqused_k: torch.Tensor,
        max_seqlen_k: int,
        page_table: torch.Tensor,
        scale: float,
        window_left: int | None,
        softcap: object,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of the step's queries over paged KV (new K/V already written).

        :param q: ``[T, Hq, D]`` bf16/fp16 (T = padded tokens of the step).
        :param k_cache: ``[num_pages, page_size, Hkv, D]``, q's dtype.
        :param v_cache: ``[num_pages, page_size, Hkv, D]``.
        :param out: ``[T, Hq, D]`` contiguous in q's dtype to write into, or None.
        :param cu_seqlens_q: ``[B + 1]`` int32 (device).
        :param max_seqlen_q: longest query run (host int).
        :param seqused_k: ``[B]`` int32, KV length of each request including the new tokens.
        :param max_seqlen_k: longest KV length (host int).
        :param page_table: ``[B, max_pages]`` int32.
        :param window_left: ``W - 1`` for a sliding window ``W``, None for none.
        :param softcap: what :meth:`make_softcap` returned.
        :param sinks: ``[Hq]`` bfloat16 or None.
        :returns: ``[T, Hq, D]`` (``out`` itself when it was used).
        """
        return self._run(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            page_table=page_table,
            scale=scale,
            window_left=window_left,
            softcap=softcap,
            sinks=sinks,
        )

    def run_with_lse(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        seqused_k: torch.Tensor,
        max_seqlen_k: int,
        page_table: torch.Tensor,
        scale: float,
        softcap: object,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per row over paged KV, no window, no sinks; with the log-sum-exp.

        :param q: ``[N, Hq, D]`` (N chunk rows of a split decode step), unit stride in D; rows
            of stride 0 only where :func:`check_broadcast_q` passed for the shape.
        :param seqused_k: ``[N]`` int32 keys of each row (0 allowed).
        :param page_table: ``[N, pages]`` int32.
        :param out: ``[N, Hq, D]`` contiguous in q's dtype, ``lse``: ``[Hq, N]`` float32
            contiguous: where the private entry point is on, the kernel writes into them (no
            allocation per call); otherwise they are ignored.
        :returns: ``(out [N, Hq, D] in q's dtype, lse [Hq, N] float32)``, natural log of the sum
            of ``exp(scale * q.k)`` (soft-capped when set) over each row's keys.
        """
        if self._run_with_lse is None:
            raise NotImplementedError(f"{self.name} has no log-sum-exp output here")
        return self._run_with_lse(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=cu_seqlens_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            page_table=page_table,
            scale=scale,
            softcap=softcap,
            out=out,
            lse=lse,
        )

    def run_dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        *,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
        window_left: int | None,
        softcap: object,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of each sequence over its own new tokens (no cached prefix).

        :param q: ``[T, Hq, D]``; ``k``/``v`` ``[T, Hkv, D]`` (rows past ``cu_seqlens[-1]`` are
            padding, not read).
        :param cu_seqlens: ``[B + 1]`` int32, the same for queries and keys.
        :returns: ``[T, Hq, D]`` (``out`` itself when it was used).
        """
        if self._run_dense is None:
            raise NotImplementedError(f"{self.name} has no non-paged varlen path here")
        return self._run_dense(
            q,
            k,
            v,
            out,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            scale=scale,
            window_left=window_left,
            softcap=softcap,
            sinks=sinks,
        )


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _fa4_provider(*, allow_private: bool = True, why_not: str = "") -> Provider:
    iface = importlib.import_module("flash_attn.cute.interface")
    version = _dist_version("flash-attn-4")
    fwd = getattr(iface, "_flash_attn_fwd", None)
    direct = False
    fwd_args: set[str] = set()
    if not allow_private:
        note = f"_flash_attn_fwd: off ({why_not}); public flash_attn_varlen_func used"
    elif version not in TESTED_DIRECT_RELEASES:
        note = (
            f"_flash_attn_fwd: off (flash-attn-4 {version} not in the tested releases "
            f"{', '.join(sorted(TESTED_DIRECT_RELEASES))}); public flash_attn_varlen_func used"
        )
    elif fwd is None:
        note = "_flash_attn_fwd: off (absent); public flash_attn_varlen_func used"
    else:
        try:
            fwd_args = set(inspect.signature(fwd).parameters)
        except (TypeError, ValueError):
            fwd_args = set()
        direct = fwd_args >= _FA4_FWD_ARGS
        note = (
            f"_flash_attn_fwd: on (flash-attn-4 {version}; self-check at first GPU use)"
            if direct
            else "_flash_attn_fwd: off (signature lacks arguments used here); public "
            "flash_attn_varlen_func used"
        )
    public = getattr(iface, "flash_attn_varlen_func", None)
    if not direct and public is None:
        raise ImportError("flash_attn.cute.interface has neither _flash_attn_fwd nor "
                          "flash_attn_varlen_func with paged-KV arguments")  # fmt: skip
    utils = getattr(iface, "utils", None)
    make_mod = getattr(utils, "create_softcap_scoremod", None) if direct else None

    def _softcap_args(softcap: object) -> dict[str, object]:
        # A score_mod closure (built by make_softcap) or a plain float cap.
        if callable(softcap):
            return {"score_mod": softcap, "softcap": 0.0}
        return {"softcap": float(softcap) if isinstance(softcap, (int, float)) else 0.0}

    def attend(q, k, v, out, *, kv, max_seqlen_q, max_seqlen_k, scale,
               window_left, softcap, sinks):  # fmt: skip
        """Causal attention; ``kv`` says where the keys are: ``seqused_k`` + ``page_table``
        (paged cache) or ``cu_seqlens_k`` (the step's own K/V)."""
        args = dict(kv, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    softmax_scale=scale, causal=True, learnable_sink=sinks)  # fmt: skip
        right = 0 if window_left is not None else None
        if direct:
            score_mod = softcap if make_mod is not None and softcap is not None else None
            results = fwd(q, k, v, **args, softcap=None if score_mod is not None else softcap,
                          window_size_left=window_left, window_size_right=right,
                          score_mod=score_mod, out=out)  # fmt: skip
            return results[0]
        result = public(q, k, v, **args, window_size=(window_left, right),
                        **_softcap_args(softcap))  # fmt: skip
        result = result[0] if isinstance(result, tuple) else result  # (out, lse) in 4.0.0b14
        if out is not None:
            out.copy_(result)
            return out
        return result

    def run(q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
            page_table, scale, window_left, softcap, sinks):  # fmt: skip
        kv = {"cu_seqlens_q": cu_seqlens_q, "seqused_k": seqused_k, "page_table": page_table}
        return attend(q, k_cache, v_cache, out, kv=kv, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, scale=scale, window_left=window_left,
                      softcap=softcap, sinks=sinks)  # fmt: skip

    run_with_lse = None
    # the private call writes the chunk rows into the caller's buffers (no allocation, no
    # autograd Function per call); same gate and self-check as run's
    direct_lse = direct and fwd_args >= _FA4_LSE_ARGS
    if public is not None and "return_lse" in inspect.signature(public).parameters:

        def run_with_lse(q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, max_seqlen_k,
                         page_table, scale, softcap, out=None, lse=None):  # fmt: skip
            # causal: one query aligned to the end of its row's keys sees all of them
            if direct_lse:
                score_mod = softcap if make_mod is not None and softcap is not None else None
                results = fwd(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                              seqused_k=seqused_k, max_seqlen_k=max_seqlen_k,
                              page_table=page_table, softmax_scale=scale, causal=True,
                              softcap=None if score_mod is not None else softcap,
                              score_mod=score_mod, return_lse=True, out=out,
                              lse=lse)  # fmt: skip
                return results[0], results[1]
            out, lse = public(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=1,
                seqused_k=seqused_k,
                max_seqlen_k=max_seqlen_k,
                page_table=page_table,
                softmax_scale=scale,
                causal=True,
                return_lse=True,
                **_softcap_args(softcap),
            )
            return out, lse

    def run_dense(q, k, v, out, *, cu_seqlens, max_seqlen, scale, window_left, softcap, sinks):
        kv = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens}
        return attend(q, k, v, out, kv=kv, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                      scale=scale, window_left=window_left, softcap=softcap,
                      sinks=sinks)  # fmt: skip

    return Provider(
        name="flash-attn-4",
        version=_dist_version("flash-attn-4"),
        sinks=True,
        deterministic=True,
        head_dims=FA4_HEAD_DIMS,
        _run=run,
        _make_softcap=make_mod,
        _run_with_lse=run_with_lse,
        _run_dense=run_dense,
        note=note,
        uses_private=direct,
    )


def _fa3_provider() -> Provider:
    fa3 = importlib.import_module("flash_attn_interface")
    fn = getattr(fa3, "flash_attn_with_kvcache", None)
    if fn is None:
        raise ImportError("flash_attn_interface has no flash_attn_with_kvcache")
    params = set(inspect.signature(fn).parameters)
    needed = {"cache_seqlens", "page_table", "cu_seqlens_q", "max_seqlen_q", "window_size"}
    if not needed <= params:
        raise ImportError(
            f"flash_attn_interface.flash_attn_with_kvcache lacks {sorted(needed - params)}"
        )

    def run(q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
            page_table, scale, window_left, softcap, sinks):  # fmt: skip
        if sinks is not None:
            raise ValueError("the official FlashAttention-3 build has no learnable sinks")
        result = fn(
            q,
            k_cache,
            v_cache,
            cache_seqlens=seqused_k,
            page_table=page_table,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            softmax_scale=scale,
            causal=True,
            window_size=(window_left if window_left is not None else -1, 0),
            softcap=softcap or 0.0,
        )
        return result[0] if isinstance(result, tuple) else result

    return Provider(
        name="flash_attn_interface",
        version=_dist_version("flash_attn_3"),
        sinks=False,
        deterministic=False,  # its split-KV heuristic may combine partial results
        head_dims=FA3_HEAD_DIMS,
        _run=run,
    )


def self_check(provider: Provider, device: torch.device) -> str | None:
    """Compare :meth:`Provider.run` (the private entry point) with the public
    ``flash_attn_varlen_func`` on a small paged step on ``device``: None when they agree, else
    why not (a release whose private function changed meaning must not serve silently).

    The case: 2 requests (5 + 3 new tokens over 40 / 17 cached), 4 query / 2 KV heads, head dim
    64, page 16, bf16, soft-cap 30 and a window of 24, written into ``out``. Where the provider
    splits decode steps, also :meth:`Provider.run_with_lse` into caller buffers (the private
    call where it is on) against the public function's ``return_lse=True`` on four chunk rows,
    one of them empty (compared where rows have keys)."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        g = torch.Generator(device=device).manual_seed(0)
        q, k_cache, v_cache, cu, used, table = _paged_case(device, g)
        hq = q.shape[1]
        out = torch.full_like(q, float("nan"))
        got = provider.run(q, k_cache, v_cache, out, cu_seqlens_q=cu, max_seqlen_q=5,
                           seqused_k=used, max_seqlen_k=45, page_table=table, scale=0.1,
                           window_left=23, softcap=provider.make_softcap(30.0),
                           sinks=None)  # fmt: skip
        want = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu, max_seqlen_q=5,
                                      seqused_k=used, max_seqlen_k=45, page_table=table,
                                      softmax_scale=0.1, causal=True, window_size=(23, 0),
                                      softcap=30.0)  # fmt: skip
        want = want[0] if isinstance(want, tuple) else want
        if got.data_ptr() != out.data_ptr():
            return "the private call did not write into out"
        err = (got.float() - want.float()).abs().max().item()
        if not err <= 1e-2:
            return f"the private call differs from flash_attn_varlen_func by {err:.3g}"
        if provider.splits_kv:
            rows = _chunk_rows_case(device, g, k_cache, v_cache)
            o_buf = torch.full_like(rows["q"], float("nan"))
            lse_buf = torch.full((hq, 4), float("nan"), device=device)
            o, lse = provider.run_with_lse(**rows, out=o_buf, lse=lse_buf)
            want_o, want_lse = flash_attn_varlen_func(
                rows["q"], k_cache, v_cache, cu_seqlens_q=rows["cu_seqlens_q"], max_seqlen_q=1,
                seqused_k=rows["seqused_k"], max_seqlen_k=rows["max_seqlen_k"],
                page_table=rows["page_table"], softmax_scale=rows["scale"], causal=True,
                return_lse=True,
            )  # fmt: skip
            problem = _rows_differ(o, lse, want_o, want_lse, rows["seqused_k"])
            if problem is not None:
                return f"the private chunk-row call (with log-sum-exp) {problem}"
    except Exception as exc:  # any failure of the private path means: use the public one
        return f"self-check raised {type(exc).__name__}: {exc}"
    return None


def self_check_sinks(provider: Provider, device: torch.device) -> str | None:
    """Compare :meth:`Provider.run` with learnable sinks (the private entry point's
    ``learnable_sink``) with the public ``flash_attn_varlen_func``'s on :func:`self_check`'s
    paged step (no soft-cap, no window; sinks of magnitude up to about 2, bf16): None when they
    agree, else why not. Run apart from :func:`self_check`, when a layer with sinks first needs
    the provider, as the sinks are one more kernel to compile."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        g = torch.Generator(device=device).manual_seed(3)
        q, k_cache, v_cache, cu, used, table = _paged_case(device, g)
        sinks = torch.randn(q.shape[1], device=device, generator=g).bfloat16()
        out = torch.full_like(q, float("nan"))
        got = provider.run(q, k_cache, v_cache, out, cu_seqlens_q=cu, max_seqlen_q=5,
                           seqused_k=used, max_seqlen_k=45, page_table=table, scale=0.1,
                           window_left=None, softcap=None, sinks=sinks)  # fmt: skip
        want = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu, max_seqlen_q=5,
                                      seqused_k=used, max_seqlen_k=45, page_table=table,
                                      softmax_scale=0.1, causal=True,
                                      learnable_sink=sinks)  # fmt: skip
        want = want[0] if isinstance(want, tuple) else want
        err = (got.float() - want.float()).abs().max().item()
        if not err <= 1e-2:
            return (
                f"the private call with learnable sinks differs from flash_attn_varlen_func "
                f"by {err:.3g}"
            )
    except Exception as exc:  # any failure of the private path means: use the public one
        return f"self-check with learnable sinks raised {type(exc).__name__}: {exc}"
    return None


def _paged_case(device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, cu_seqlens_q, seqused_k, page_table)`` of the self-checks'
    paged step: 2 requests (5 + 3 new tokens over 40 / 17 cached), 4 query / 2 KV heads, head
    dim 64, 8 pages of 16, bf16."""
    pages, page, hkv, hq, d = 8, 16, 2, 4, 64
    k_cache = torch.randn(pages, page, hkv, d, device=device, generator=g).bfloat16()
    v_cache = torch.randn(pages, page, hkv, d, device=device, generator=g).bfloat16()
    q = torch.randn(8, hq, d, device=device, generator=g).bfloat16()
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    used = torch.tensor([45, 20], dtype=torch.int32, device=device)
    table = torch.tensor([[3, 0, 6, 1], [5, 2, 7, 4]], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, cu, used, table


def _chunk_rows_case(
    device: torch.device, g: torch.Generator, k_cache: torch.Tensor, v_cache: torch.Tensor,
    num_heads: int = 4,
) -> dict:  # fmt: skip
    """The arguments of :meth:`Provider.run_with_lse` for four one-query chunk rows over a
    cache of 8 pages (of 16 tokens or more): 45, 20, 0 and 16 keys, the third row empty as past
    a request's context; q of ``num_heads`` heads in the cache's dtype."""
    d = k_cache.shape[-1]
    return {
        "q": torch.randn(4, num_heads, d, device=device, generator=g).to(k_cache.dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cu_seqlens_q": torch.arange(5, dtype=torch.int32, device=device),
        "seqused_k": torch.tensor([45, 20, 0, 16], dtype=torch.int32, device=device),
        "max_seqlen_k": 48,
        "page_table": torch.tensor(
            [[3, 0, 6], [5, 2, 7], [1, 1, 1], [4, 6, 0]], dtype=torch.int32, device=device
        ),
        "scale": 0.1,
        "softcap": None,
    }


def _rows_differ(
    o: torch.Tensor,
    lse: torch.Tensor | None,
    want_o: torch.Tensor,
    want_lse: torch.Tensor | None,
    seqused_k: torch.Tensor,
) -> str | None:
    """How two chunk-row results differ on the rows that have keys, or None where they agree
    (the merge reads nothing else of them)."""
    if lse is None or want_lse is None:
        return "returned no log-sum-exp"
    keep = seqused_k > 0
    err_o = (o[keep].float() - want_o[keep].float()).abs().max().item()
    err_l = (lse[:, keep].float() - want_lse[:, keep].float()).abs().max().item()
    if not (err_o <= 1e-2 and err_l <= 1e-3):
        return f"differs by {err_o:.3g} in the output, {err_l:.3g} in the log-sum-exp"
    return None


def check_broadcast_q(
    provider: Provider,
    device: torch.device,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    softcap: object = None,
) -> str | None:
    """Whether :meth:`Provider.run_with_lse` reads query rows of stride 0 (one request's query
    broadcast over its chunk rows, what a split decode of one request passes instead of a copy)
    as it reads the same rows copied, at a layer's shape, and distinct rows afterwards as before:
    None where the results agree on ``device``, else why not.

    Why a check: the kernel loads q through a TMA descriptor built from q's strides (or, for
    some GQA group sizes, per-thread copies), and nothing in flash-attn-4's interface says a
    zero stride is served; a kernel that mishandled it would be silently wrong, so the context
    compares both once per process and layer shape (the same kernel configuration the layer
    then runs: ``softcap`` is what :meth:`Provider.make_softcap` returned for the layer), and a
    mismatch keeps the copy."""
    if not provider.splits_kv:
        return f"{provider.name} has no chunk-row call"
    try:
        g = torch.Generator(device=device).manual_seed(1)
        shape = (8, page_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, device=device, generator=g).to(dtype)
        v_cache = torch.randn(shape, device=device, generator=g).to(dtype)
        rows = dict(_chunk_rows_case(device, g, k_cache, v_cache, num_heads), softcap=softcap)
        used = rows["seqused_k"]
        # Distinct contiguous rows first: the kernel of this shape compiles from them, as for a
        # copy (and, were a compile to fix q's strides, the broadcast below would differ).
        first_o, first_lse = provider.run_with_lse(**rows)
        broadcast = rows["q"][:1].expand(4, *rows["q"].shape[1:])
        o, lse = provider.run_with_lse(**dict(rows, q=broadcast))
        want_o, want_lse = provider.run_with_lse(**dict(rows, q=broadcast.contiguous()))
        problem = _rows_differ(o, lse, want_o, want_lse, used)
        if problem is not None:
            return f"query rows of stride 0: the chunk-row call {problem} from a copy"
        # and the broadcast call left the contiguous one as it was
        again_o, again_lse = provider.run_with_lse(**rows)
        problem = _rows_differ(again_o, again_lse, first_o, first_lse, used)
        if problem is not None:
            return f"after query rows of stride 0, the chunk-row call {problem} from before"
    except Exception as exc:  # any failure means: copy the rows
        return f"query rows of stride 0: the chunk-row call raised {type(exc).__name__}: {exc}"
    return None


def public_only(provider: Provider, why: str) -> Provider:
    """``provider``'s source without its private entry point (flash-attn-4 only)."""
    if provider.name != "flash-attn-4":
        return provider
    return _fa4_provider(allow_private=False, why_not=why)


def probe() -> tuple[Provider | None, list[str]]:
    """The first provider that imports, and why each one before it did not.

    Imports really happen (a wheel can be installed yet broken, e.g. a CuTe DSL without its
    ``cutlass.cute`` sources), so call this once, at registration.
    """
    reasons: list[str] = []
    for label, factory in (
        ("flash-attn-4 (flash_attn.cute)", _fa4_provider),
        ("FlashAttention-3 (flash_attn_interface)", _fa3_provider),
    ):
        try:
            return factory(), reasons
        except Exception as exc:  # an import can fail in many ways; keep the reason
            reasons.append(f"{label} is not importable: {type(exc).__name__}: {exc}")
    return None, reasons


def describe_missing() -> list[str]:
    """Without CUDA nothing is imported: just say which providers are installed at all."""
    found = []
    for module, label in (
        ("flash_attn.cute", "flash-attn-4"),
        ("flash_attn_interface", "FlashAttention-3"),
    ):
        try:
            present = importlib.util.find_spec(module) is not None
        except Exception:  # find_spec imports the parent package, which may itself fail
            present = False
        found.append(f"{label} {'installed' if present else 'not installed'}")
    return found
