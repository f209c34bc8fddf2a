"""Every use of FlashInfer's internals by this plugin, in one module, gated by the installed
release.

The rest of the plugin calls FlashInfer's public API only: the wrappers' constructors,
``plan()`` (the group's softmax scale goes in as ``sm_scale``), ``run()`` and
``reset_workspace_buffer()``. Three things go further, here, and only for a release in
:data:`TESTED_RELEASES` whose sources they were written against (0.6.7, 0.6.13, 0.7.2.post1
and 0.7.4; their differences are in :class:`Release`):

- **fast plan** (:meth:`FastPath.replan_tensor_core_decode`): GQA decode through FlashInfer's
  tensor-core kernel reads the KV cache at 4.3-4.5 TB/s on an H200 against 2.7-3.0 TB/s for its
  CUDA-core kernel, but the wrapper's ``plan()`` then takes Python's ``max()`` over a tensor of
  the batch's KV lengths (~340 us at B=256) and repeats copies the context already made. The
  first decode plan of a wrapper goes through ``plan()``; later ones call the scheduler
  (``_cached_module.plan``) with the context's pinned host arrays and point the wrapper's
  device buffers at the context's metadata: the same plan, less host work.
- **direct run** (:meth:`FastPath.decode_runner`): ``run()`` checks and unpacks its arguments
  and builds a list of 43 before it calls the kernel, 16-29 us of host time per layer, which
  decides an eager decode step of one long request. The runner calls the compiled
  ``paged_run`` with the argument list ``run()`` would build, the softmax scale among them.
- **shared int workspace** (:meth:`FastPath.share_int_workspace`): every wrapper allocates
  8 MiB device + 8 MiB pinned memory of its own; a context keeps one decode graph wrapper per
  captured batch size, so it points them all at one pair. Off the fast path the public
  ``reset_workspace_buffer()`` shares the device buffer (each wrapper keeps its pinned one).

Nothing may become silently wrong on an upgrade:

- The import-level facts (:meth:`FastPath.probe`, at the plugin's probe, before any GPU work):
  the module has the decode wrapper class with the methods and properties the fast path calls,
  and ``flashinfer.utils`` the two helpers the direct run takes its defaults from. A release
  that lacks one gets the public path from the start, and ``attn list`` says which.
- The version gate: the installed distribution's version (``flashinfer-python``) must be one of
  :data:`TESTED_RELEASES`; any other release gets the public path, and ``attn list`` says so.
- Every private attribute the fast path reads or writes must exist on the wrapper before it
  is used (:data:`DECODE_ATTRIBUTES`): a rename refuses the fast path for that wrapper instead
  of writing an attribute nobody reads.
- The per-layer softmax scale is never written into a wrapper: ``plan(sm_scale=...)`` takes the
  group's, the direct run takes the layer's as an argument, and the context folds any other
  layer scale into ``q`` for ``run()`` (see ``context.py``).
- A self-check (:meth:`FastPath.self_check`, GPU only) runs the fast plan and the direct run
  against FlashInfer's public ``plan()``/``run()`` on a tiny case of a context's own
  configuration (dtype, heads, head dim, page, window, soft-cap), once per process and
  configuration, where a context of it is allocated (it compiles the kernel module that context
  needs, which a cold JIT cache makes too slow for the probe); if they disagree, or raise, the
  fast path is off for the process, a ``RuntimeWarning`` says why and ``attn list`` prints it.
  On CPU it is skipped (the CPU tests drive the same code through a stand-in FlashInfer,
  ``tests/fake_flashinfer.py``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

__all__ = [
    "DECODE_ATTRIBUTES",
    "DECODE_CLASS_ATTRIBUTES",
    "DISTRIBUTION",
    "TESTED_RELEASES",
    "UTILS_ATTRIBUTES",
    "DecodeRunner",
    "FastPath",
    "Release",
    "distribution_version",
    "fast_path",
    "installed_note",
    "tested_release",
]

DISTRIBUTION = "flashinfer-python"


@dataclass(frozen=True, slots=True)
class Release:
    """What differs between the tested releases in the internals the fast path uses.

    :ivar block_scale_args: the fa2 ``paged_run`` compiled function takes the key and value
        block-scale tensors (None here) between the item-length pointer and the soft-cap
        (0.6.13's NVFP4 KV; 0.6.7 has no such parameters).
    :ivar plan_tail: what the tensor-core decode ``plan()`` appends to the fa2 scheduler's
        arguments after ``num_colocated_ctas`` for one query token per request: 0.7.2.post1
        ``uniform_q_len`` (0 for one token), 0.7.4 ``uniform_q_len`` (1) and
        ``fixed_uniform_q_len`` (True); the 0.6 releases nothing.
    :ivar equal_kv_strides: the Python ``paged_run`` sends K/V caches of unequal strides to a
        second compiled module (0.7: the primary one is built for equal strides), so the direct
        run, which calls the primary one, must be given equal strides.
    :ivar cudnn_auto: ``backend="auto"`` may route a decode ``plan()`` to cuDNN
        (``_cudnn_auto`` on the wrapper, 0.7); the fast path takes fa2 wrappers only.
    """

    version: str
    block_scale_args: bool
    plan_tail: tuple[int | bool, ...] = ()
    equal_kv_strides: bool = False
    cudnn_auto: bool = False


#: The FlashInfer releases whose ``decode.py`` / ``prefill.py`` the fast path was written
#: against (the tensor-core decode ``plan()`` and ``run()``, the fa2 ``paged_run``). The 0.7
#: releases keep 0.6.13's compiled ``paged_run`` arguments and every attribute of
#: :data:`DECODE_ATTRIBUTES`; their scheduler takes more arguments (``plan_tail``).
TESTED_RELEASES: dict[str, Release] = {
    "0.6.7": Release("0.6.7", block_scale_args=False),
    "0.6.13": Release("0.6.13", block_scale_args=True),
    "0.7.2.post1": Release(
        "0.7.2.post1",
        block_scale_args=True,
        plan_tail=(0,),
        equal_kv_strides=True,
        cudnn_auto=True,
    ),
    "0.7.4": Release(
        "0.7.4",
        block_scale_args=True,
        plan_tail=(1, True),
        equal_kv_strides=True,
        cudnn_auto=True,
    ),
}
_TESTED_RANGE = ", ".join(TESTED_RELEASES)

#: Private attributes of a planned tensor-core decode wrapper the fast path reads or writes
#: (``_fixed_batch_size`` only on CUDA-graph wrappers, checked where used).
DECODE_ATTRIBUTES = (
    "_use_tensor_cores",
    "_backend",
    "_jit_module",
    "_cached_module",
    "_plan_info",
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_qo_indptr_buf",
    "_paged_kv_indptr_buf",
    "_paged_kv_indices_buf",
    "_paged_kv_last_page_len_buf",
    "_batch_size",
    "_max_kv_len",
    "_kv_layout",
    "_pos_encoding_mode",
    "_window_left",
    "_logits_soft_cap",
    "_rope_scale",
    "_rope_theta",
    "_num_qo_heads",
)
_WORKSPACE_ATTRIBUTES = ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer")
#: Class-level names of the decode wrapper the fast path calls, and ``flashinfer.utils``
#: helpers the direct run reads its defaults from: checked at probe (:meth:`FastPath.probe`).
DECODE_CLASS_ATTRIBUTES = ("plan", "run", "is_cuda_graph_enabled", "use_tensor_cores")
UTILS_ATTRIBUTES = ("_get_cache_alibi_slopes_buf", "device_support_pdl")

#: ``(q, k_cache, v_cache, out) -> None``: one layer of a planned decode step.
DecodeRunner = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None
]

_MARK = "_attn_core_public_plan_done"
_CHECKED = "_attn_core_attributes_checked"
_COMPILED = "_attn_core_compiled_paged_run"


def distribution_version() -> str | None:
    """The installed ``flashinfer-python`` distribution's version; None where it has none
    (not installed, or a stand-in module such as the CPU tests')."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def tested_release(version: str | None) -> tuple[Release | None, str]:
    """``(release, "")`` for a tested version, else ``(None, why not)``: the version gate, also
    read by :mod:`attn_plugin_flashinfer.capability` for the sink variant."""
    if version is None:
        return None, f"no {DISTRIBUTION} distribution found, its version unknown"
    try:
        normal = str(Version(version))
    except InvalidVersion:
        return None, f"flashinfer version {version!r} is not a version"
    release = TESTED_RELEASES.get(normal)
    if release is None:
        return None, (
            f"flashinfer {version} is not a release the fast path was written against "
            f"({_TESTED_RANGE})"
        )
    return release, ""


class FastPath:
    """The fast path for one installed FlashInfer (module and version): the gate, the
    self-check's verdict, and every private access. Get it with :func:`fast_path`."""

    #: Device types the self-check runs on (the CPU tests add "cpu" for the stand-in FlashInfer).
    CHECK_DEVICES: tuple[str, ...] = ("cuda",)

    def __init__(self, module: Any, version: str | None) -> None:
        self.module = module
        self.version = version
        self.release, self.gate_reason = tested_release(version)
        #: None: the self-check has not run; "": it passed; else why it failed.
        self.check: str | None = None
        #: the configurations the self-check passed on (:meth:`self_check`'s arguments)
        self.checked: set[tuple[Any, ...]] = set()
        #: None: the import-level facts were not checked (no module); "": they hold; else
        #: which one does not (:meth:`probe`).
        self.facts: str | None = None
        if module is not None and self.release is not None:
            self.probe()

    # -- status ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """The release is tested, its import-level facts hold and the self-check has not
        failed."""
        return self.release is not None and not self.facts and not self.check

    def off_reason(self) -> str | None:
        """Why the fast path is off (None: on)."""
        if self.release is None:
            return self.gate_reason
        if self.facts:
            return f"flashinfer {self.version}: {self.facts}"
        if self.check:
            return f"self-check against public plan()/run() failed: {self.check}"
        return None

    def note(self) -> str:
        """The line ``attn list`` prints after the backends' status."""
        off = self.off_reason()
        if off is not None:
            return f"fast plan: off ({off}; public plan() used)"
        checked = {None: "self-check at first GPU use", "": "self-check passed"}[self.check]
        facts = "import checks passed, " if self.facts == "" and self.check is None else ""
        return f"fast plan: on (flashinfer {self.version}, {facts}{checked})"

    def probe(self) -> str:
        """Check, without touching the GPU, what the fast path needs of the imported module
        beyond its version: the decode wrapper class and its :data:`DECODE_CLASS_ATTRIBUTES`,
        ``flashinfer.utils`` and its :data:`UTILS_ATTRIBUTES`. Keeps and returns the verdict
        ("" they hold, else the first missing one); the instance attributes a plan sets are
        checked per wrapper (:meth:`can_replan`) and the numbers by :meth:`self_check`."""
        cls = getattr(self.module, "BatchDecodeWithPagedKVCacheWrapper", None)
        if cls is None:
            self.facts = "the module has no BatchDecodeWithPagedKVCacheWrapper"
            return self.facts
        missing = [a for a in DECODE_CLASS_ATTRIBUTES if not hasattr(cls, a)]
        if missing:
            self.facts = f"BatchDecodeWithPagedKVCacheWrapper lacks {missing}"
            return self.facts
        try:
            utils = self._utils()
        except ImportError as exc:
            self.facts = f"flashinfer.utils is not importable ({exc})"
            return self.facts
        missing = [a for a in UTILS_ATTRIBUTES if not callable(getattr(utils, a, None))]
        self.facts = f"flashinfer.utils lacks {missing}" if missing else ""
        return self.facts

    def _attributes(self) -> tuple[str, ...]:
        """The instance attributes a planned decode wrapper must have for this release."""
        extra = ("_cudnn_auto",) if self.release is not None and self.release.cudnn_auto else ()
        return DECODE_ATTRIBUTES + extra

    # -- the shared int workspace ---------------------------------------------------------
    def share_int_workspace(self, wrapper: Any, float_ws: torch.Tensor, int_ws: torch.Tensor,
                            pinned: torch.Tensor) -> Any:  # fmt: skip
        """Point ``wrapper`` at the context's int workspace (and, on the fast path, its pinned
        staging buffer). Only one wrapper of a context is planned and run per step, so sharing
        is safe. Off the fast path: the public ``reset_workspace_buffer()`` where the wrapper
        has one (the MLA wrapper does not: it keeps its own)."""
        if self.enabled and all(hasattr(wrapper, a) for a in _WORKSPACE_ATTRIBUTES):
            wrapper._int_workspace_buffer = int_ws
            wrapper._pin_memory_int_workspace_buffer = pinned
        elif callable(getattr(wrapper, "reset_workspace_buffer", None)):
            wrapper.reset_workspace_buffer(float_ws, int_ws)
        return wrapper

    # -- fast plan ------------------------------------------------------------------------
    def can_replan(self, wrapper: Any) -> bool:
        """Whether :meth:`replan_tensor_core_decode` may plan ``wrapper``: the fast path is on,
        the wrapper is a tensor-core fa2 decode wrapper already planned once through ``plan()``
        and has every attribute of :data:`DECODE_ATTRIBUTES`."""
        if not (self.enabled and getattr(wrapper, _MARK, False)):
            return False
        checked = wrapper.__dict__.get(_CHECKED)
        if checked is None:
            checked = all(hasattr(wrapper, a) for a in self._attributes())
            setattr(wrapper, _CHECKED, checked)
        return bool(
            checked
            and wrapper._use_tensor_cores
            and wrapper._backend == "fa2"
            and wrapper._jit_module is None
            # 0.7: a plan() that "auto" sent to cuDNN leaves _backend "fa2" from an earlier one
            and not getattr(wrapper, "_cudnn_auto", False)
        )

    @staticmethod
    def mark_planned(wrapper: Any) -> None:
        """Record that ``wrapper`` went through the public ``plan()`` once (module loaded,
        every attribute ``run()`` reads set)."""
        setattr(wrapper, _MARK, True)

    def replan_tensor_core_decode(
        self,
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
        """Plan one decode step of ``P`` requests on a wrapper :meth:`can_replan` accepts, as
        the tested releases' ``plan()`` does for a tensor-core fa2 wrapper.

        :param qo_indptr_host: ``[P + 1]`` int32 pinned host, ``0, 1, ..., P``.
        :param kv_indptr_host: ``[P + 1]`` int32 pinned host, pages per request (CSR).
        :param kv_len_host: ``[P]`` int32 pinned host, KV length of each request.
        :param max_kv_len: ``max(kv_len_host)``.
        :param kv_indptr_dev: ``[P + 1]`` int32 device copy of ``kv_indptr_host``.
        :param kv_indices_dev: ``[kv_indptr[P]]`` int32 device page ids.
        :param last_page_len_dev: ``[P]`` int32 device.
        :param qo_indptr_dev: ``[P + 1]`` int32 device ``0..P``; None for a CUDA-graph wrapper,
            whose own buffers are fixed at construction (the captured kernels read them) and
            must then already hold this step's values.
        """
        if not self.can_replan(wrapper):
            raise RuntimeError("replan_tensor_core_decode on a wrapper can_replan refuses")
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
        # The fa2 prefill module's plan arguments of the tensor-core decode plan() (decode.py):
        # the same 19 in every tested release, then the release's plan_tail.
        tail = self.release.plan_tail if self.release is not None else ()
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
            *tail,  # 0.7: uniform_q_len [, fixed_uniform_q_len]
        )

    # -- direct run -----------------------------------------------------------------------
    def decode_runner(self, wrapper: Any, sm_scale: float) -> DecodeRunner | None:
        """The compiled kernel call of ``wrapper.run(q, (k_cache, v_cache), out=out, lse=lse)``
        at softmax scale ``sm_scale`` for the step the wrapper is planned for; None where the
        fast path does not know the wrapper's ``run()`` (then call it).

        Call it after the step's plan (it binds the plan's buffers and schedule) and only for
        a wrapper :meth:`can_replan` accepts. The runner checks nothing: ``q`` ``[P, H, D]``,
        ``k_cache``/``v_cache`` ``[pages, page_size, Hkv, D]`` (NHD) of the planned dtypes, a
        contiguous ``out`` like ``q`` and ``lse`` None or ``[P, H]`` float32 contiguous (the
        rows' base-2 log-sum-exp, written by the kernel), all on the wrapper's device.
        """
        release = self.release
        if (
            release is None
            or not self.can_replan(wrapper)
            or wrapper._kv_layout != "NHD"
            or wrapper._pos_encoding_mode != "NONE"
            or wrapper._plan_info is None
        ):
            return None
        found = self._compiled_paged_run(wrapper)
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
        # run()'s fa2 argument list after the output and the lse: mask mode, layout, window,
        # PDL, custom mask + indptr, alibi slopes, three item pointers, [block scales,]
        # soft-cap, scale, reciprocal rope scale and theta, item count.
        tail = (
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
            *((None, None) if release.block_scale_args else ()),  # key / value block scales
            wrapper._logits_soft_cap or 0.0,
            float(sm_scale),
            1.0 / rope_scale,
            1.0 / rope_theta,
            0,  # token_pos_in_items_len
        )

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor | None = None) -> None:  # fmt: skip
            compiled(*head, q, k_cache, v_cache, *indptrs, out, lse, *tail)

        if not release.equal_kv_strides:
            return run

        def run_equal_strides(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              out: torch.Tensor,
                              lse: torch.Tensor | None = None) -> None:  # fmt: skip
            # The module found is the one built for equal K/V strides; run() would route
            # other strides to a second module this runner does not call.
            if k_cache.stride() != v_cache.stride():
                raise ValueError(
                    f"flashinfer {release.version} direct decode run: K cache strides "
                    f"{k_cache.stride()} differ from V cache strides {v_cache.stride()}; "
                    "expected equal strides (the core's K and V caches of one shape)"
                )
            compiled(*head, q, k_cache, v_cache, *indptrs, out, lse, *tail)

        return run_equal_strides

    def _compiled_paged_run(self, wrapper: Any) -> tuple[Any, bool, torch.Tensor] | None:
        """``(compiled paged_run, run()'s enable_pdl default, run()'s alibi-slopes buffer)`` of
        a planned wrapper, found once per kernel module and kept on the wrapper; None where the
        module's ``paged_run`` is not the tested releases' closure over ``paged_run_func``."""
        module = wrapper._cached_module
        cached = wrapper.__dict__.get(_COMPILED)
        if cached is not None and cached[0] is module:
            return cached[1]
        found = None
        # The tested releases wrap the compiled function in a Python ``paged_run`` that
        # dispatches on the backend; the fa2 branch passes the arguments above through.
        compiled = None
        paged_run = getattr(module, "paged_run", None)
        if inspect.isfunction(paged_run):
            compiled = inspect.getclosurevars(paged_run).nonlocals.get("paged_run_func")
        if compiled is not None:
            utils = self._utils()
            device = wrapper._float_workspace_buffer.device
            alibi_slopes = utils._get_cache_alibi_slopes_buf(wrapper._num_qo_heads, device)
            found = (compiled, bool(utils.device_support_pdl(device)), alibi_slopes)
        setattr(wrapper, _COMPILED, (module, found))
        return found

    def _utils(self) -> Any:
        import importlib

        return importlib.import_module(f"{self.module.__name__}.utils")

    # -- the self-check -------------------------------------------------------------------
    def self_check(self, device: torch.device, *, dtype: torch.dtype = torch.bfloat16,
                   num_qo_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 128,
                   page_size: int = 16, window_left: int = -1,
                   logits_soft_cap: float = 0.0) -> str | None:  # fmt: skip
        """Run the fast plan and the direct run against the public ``plan()``/``run()`` on a
        tiny decode case on ``device`` (a CUDA device; elsewhere nothing runs), once per
        process and configuration; keep and return the verdict ("" passed on every
        configuration so far, else why not; None: skipped). A failure turns the fast path off
        for the process.

        A context passes its own dtype, heads, head dim, page size, window and soft-cap, so
        the kernel module compiled for the check is the one it needs anyway, and a group of
        another configuration is checked before the fast path serves it. The case: 3
        requests (a full page, a single token, a few pages) with random bf16/fp16 K/V. A wrapper
        planned publicly for other lengths, then re-planned by the fast path, must hold the
        plan info a fresh wrapper's public ``plan()`` gives and compute the same output through
        ``run()``; the direct run must give ``run()``'s output at the planned scale and the
        public plan's output at half of it (a layer's own scale reaches the kernel), and the
        log-sum-exp rows ``run(..., return_lse=True)`` gives (what attention sinks rescale by).
        """
        config = (device.type, dtype, num_qo_heads, num_kv_heads, head_dim, page_size,
                  window_left, float(logits_soft_cap))  # fmt: skip
        if (
            self.check
            or config in self.checked
            or self.release is None
            or self.facts
            or device.type not in self.CHECK_DEVICES
        ):
            return self.check
        try:
            failed = self._self_check(
                device, dtype, num_qo_heads, num_kv_heads, head_dim, page_size, window_left,
                logits_soft_cap,
            )  # fmt: skip
        except Exception as exc:  # any failure of the private path: the public path stays
            failed = f"{type(exc).__name__}: {exc}"
        if failed and self.checked:  # an earlier configuration passed: name this one
            failed = (
                f"{failed} (dtype={str(dtype).removeprefix('torch.')}, heads "
                f"{num_qo_heads}/{num_kv_heads}, head_dim={head_dim}, page_size={page_size}, "
                f"window_left={window_left}, logits_soft_cap={logits_soft_cap})"
            )
        self.check = failed
        if not failed:
            self.checked.add(config)
        if self.check:
            # Reported where it happens (the configuration's first context), not only in a later
            # attn list of the same process: the serving stack's log shows why steps cost more.
            warnings.warn(f"attn_plugin_flashinfer: {self.note()}", RuntimeWarning, stacklevel=2)
        return self.check

    def _self_check(self, device: torch.device, dt: torch.dtype, H: int, Hkv: int, D: int,
                    page: int, window_left: int, soft_cap: float) -> str:  # fmt: skip
        fi = self.module
        g = torch.Generator(device="cpu").manual_seed(0)
        first, second = [page + 3, 2 * page + 1, 3], [page, 1, 2 * page + 5]
        pages = sum(-(-n // page) for n in first + second)
        k_cache = torch.randn(pages, page, Hkv, D, generator=g).to(device=device, dtype=dt)
        v_cache = torch.randn(pages, page, Hkv, D, generator=g).to(device=device, dtype=dt)
        q = torch.randn(3, H, D, generator=g).to(device=device, dtype=dt)
        scale = 1.0 / math.sqrt(D)

        def metadata_for(lens: list[int]) -> dict[str, torch.Tensor]:
            npages = [-(-n // page) for n in lens]
            indptr = [0]
            for n in npages:
                indptr.append(indptr[-1] + n)
            host = dict(
                kv_indptr=torch.tensor(indptr, dtype=torch.int32),
                last=torch.tensor(
                    [n - (p - 1) * page for n, p in zip(lens, npages, strict=True)],
                    dtype=torch.int32,
                ),
                kv_len=torch.tensor(lens, dtype=torch.int32),
                qo=torch.arange(len(lens) + 1, dtype=torch.int32),
            )
            host["indices"] = torch.arange(indptr[-1], dtype=torch.int32, device=device)
            return host

        def public(lens: list[int], sm_scale: float) -> tuple[Any, torch.Tensor, torch.Tensor]:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(32 * 2**20, dtype=torch.uint8, device=device), "NHD",
                use_tensor_cores=True,
            )  # fmt: skip
            m = metadata_for(lens)
            w.plan(m["kv_indptr"], m["indices"], m["last"], H, Hkv, D, page,
                   pos_encoding_mode="NONE", window_left=window_left,
                   logits_soft_cap=soft_cap or None, sm_scale=sm_scale, q_data_type=dt,
                   kv_data_type=dt)  # fmt: skip
            out, lse = w.run(q, (k_cache, v_cache), return_lse=True)
            return w, out, lse

        wrapper, _, _ = public(first, scale)
        self.mark_planned(wrapper)
        if not self.can_replan(wrapper):
            missing = [a for a in self._attributes() if not hasattr(wrapper, a)]
            return f"the decode wrapper lacks {missing or 'a tensor-core fa2 module'}"
        m = metadata_for(second)
        self.replan_tensor_core_decode(
            wrapper, qo_indptr_host=m["qo"], kv_indptr_host=m["kv_indptr"],
            kv_len_host=m["kv_len"], max_kv_len=max(second),
            kv_indptr_dev=m["kv_indptr"].to(device), kv_indices_dev=m["indices"],
            last_page_len_dev=m["last"].to(device), qo_indptr_dev=m["qo"].to(device),
            num_qo_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page,
            window_left=window_left,
        )  # fmt: skip
        reference, expected, expected_lse = public(second, scale)
        if list(wrapper._plan_info) != list(reference._plan_info):
            return "the fast plan's schedule differs from plan()'s"
        got = wrapper.run(q, (k_cache, v_cache))
        if not torch.equal(got, expected):
            return "run() after the fast plan differs from run() after plan()"
        for sm_scale in (scale, 0.5 * scale):
            runner = self.decode_runner(wrapper, sm_scale)
            if runner is None:
                return "the compiled paged_run was not found"
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:2], float("nan"), device=device)
            runner(q, k_cache, v_cache, out, lse)
            want, want_lse = (
                (expected, expected_lse) if sm_scale == scale else public(second, sm_scale)[1:]
            )
            if not torch.allclose(out, want, atol=1e-3, rtol=1e-3):
                err = (out.float() - want.float()).abs().max().item()
                return f"the direct run at scale {sm_scale:.4g} differs from run() by {err:.3g}"
            if not torch.allclose(lse, want_lse, atol=1e-3, rtol=1e-4):
                err = (lse - want_lse).abs().max().item()
                return f"the direct run's log-sum-exp differs from run()'s by {err:.3g}"
        return ""


_FAST: dict[int, tuple[Any, FastPath]] = {}


def fast_path(module: Any, version: str | None = None) -> FastPath:
    """The :class:`FastPath` of the imported ``flashinfer`` ``module`` (one per module per
    process, so the self-check runs once); ``version`` defaults to the installed
    distribution's (:func:`distribution_version`)."""
    kept = _FAST.get(id(module))
    if kept is not None and kept[0] is module:
        return kept[1]
    fp = FastPath(module, distribution_version() if version is None else version)
    _FAST[id(module)] = (module, fp)
    return fp


def installed_note() -> str:
    """The fast path's line for ``attn list`` without importing flashinfer: the self-check's
    verdict where a context of this process already ran it, else the version gate's."""
    import sys

    module = sys.modules.get("flashinfer")
    kept = _FAST.get(id(module)) if module is not None else None
    if kept is not None and kept[0] is module:
        return kept[1].note()
    return FastPath(None, distribution_version()).note()
