"""A pure-PyTorch stand-in for the FlashInfer 0.6.7 wrappers the plugin uses (CPU tests only).

It mirrors the real constructors' and ``plan()``/``run()`` signatures (argument names and order,
read from the 0.6.7 sources) and FlashInfer's *semantics*, written independently of attn-core's
reference ops:

- a request's KV is ``(pages - 1) * page_size + last_page_len`` tokens of the pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``;
- queries are the last ``q_len`` positions (bottom-right aligned causal mask);
- ``window_left``: a query at position ``p`` sees keys ``p - window_left .. p`` (inclusive);
- soft-cap: ``cap * tanh(sm_scale * q.k / cap)``; ``sm_scale`` is read from the attribute
  ``plan()`` stored it in (``_sm_scale``, or whatever a subclass names in ``_SCALE_ATTR``: a
  release that renamed it) at ``run()`` time, as FlashInfer does;
- fp8 caches are read as raw values (FlashInfer's kernels do not dequantise with a per-layer
  scale unless given ``k_scale``/``v_scale``, which the plugin never passes);
- CUDA-graph wrappers copy plan metadata into the buffers given at construction, and ``run()``
  reads those buffers, so a test that rewrites them through ``plan()`` sees the new batch.

The tensor-core decode wrapper (``use_tensor_cores=True``) mirrors the internals the plugin's
fast path (``attn_plugin_flashinfer.compat``) uses, under their real names: ``plan()`` loads a
"prefill module" (``_cached_module``) whose ``plan`` is a scheduler taking the fa2 argument list
and returning plan info, and whose ``paged_run`` is a Python function closing over the
"compiled" ``paged_run_func``; ``run()`` builds the release's argument list and calls it. The
compiled function computes attention only from the arguments it is handed (the plan info, the
indptr / indices / last-page buffers, window, soft-cap and scale), so a fast path that passes
the wrong buffers, scale or argument layout computes a wrong result or raises here too. Which
release's layout it has (0.6.13's fa2 ``paged_run`` takes two block-scale tensors before the
soft-cap, 0.6.7's does not; the 0.7 schedulers take one or two arguments more, and 0.7 wrappers
have ``_cudnn_auto``) is :data:`LAYOUT`, set by :func:`install` from :data:`LAYOUTS`.

Install with :func:`install` (puts it in ``sys.modules["flashinfer"]`` and
``sys.modules["flashinfer.utils"]`` and tells the plugin's compat module the version).
"""

from __future__ import annotations

import math
import sys
import types

import torch

__version__ = "0.6.7"
#: Each release's internals as read from its sources (written here independently of the
#: plugin's compat table): whether the compiled fa2 ``paged_run`` takes the two block-scale
#: tensors, what the tensor-core decode ``plan()`` passes the scheduler after
#: ``num_colocated_ctas`` (0.7.2.post1: ``uniform_q_len`` 0; 0.7.4: ``uniform_q_len`` 1,
#: ``fixed_uniform_q_len`` True) and whether wrappers carry ``_cudnn_auto`` (0.7).
LAYOUTS: dict[str, dict] = {
    "0.6.7": {"block_scale_args": False, "plan_tail": (), "cudnn_auto": False},
    "0.6.13": {"block_scale_args": True, "plan_tail": (), "cudnn_auto": False},
    "0.7.2.post1": {"block_scale_args": True, "plan_tail": (0,), "cudnn_auto": True},
    "0.7.4": {"block_scale_args": True, "plan_tail": (1, True), "cudnn_auto": True},
}
#: The internals' layout of the release this fake stands in for (set by :func:`install`).
LAYOUT = dict(LAYOUTS["0.6.7"])


def _attend(q, k, v, *, causal, window_left, soft_cap, sm_scale):
    """``q [Lq, H, D]``, ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` -> ``([Lq, H, Dv], [Lq, H])``
    float32: the output and each row's log-sum-exp in base 2 (FlashInfer's convention)."""
    lq, h, _ = q.shape
    length, hkv = k.shape[0], k.shape[1]
    rep = h // hkv
    kf = k.float().repeat_interleave(rep, dim=1)  # [L, H, D]
    vf = v.float().repeat_interleave(rep, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    qpos = torch.arange(length - lq, length).view(-1, 1)
    kpos = torch.arange(length).view(1, -1)
    mask = torch.ones(lq, length, dtype=torch.bool)
    if causal:
        mask &= kpos <= qpos
    if window_left >= 0:
        mask &= kpos >= qpos - window_left
    logits = logits.masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    lse2 = torch.logsumexp(logits, dim=-1).t() / math.log(2.0)  # [Lq, H]
    return torch.einsum("hqk,khd->qhd", p, vf), lse2


def _gather(cache, indices, start, end, length):
    pages = indices[start:end].long()
    rows = cache.index_select(0, pages.to(cache.device))
    return rows.reshape(-1, *cache.shape[2:])[:length]


def _paged_attention(q, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, *, causal,
                     window_left, soft_cap, sm_scale):  # fmt: skip
    """Attention of ``q`` rows ``qo_indptr[b]:qo_indptr[b+1]`` over request ``b``'s pages:
    ``(out [T, H, Dv], lse [T, H])`` float32 (rows of no request: zeros and -inf)."""
    k_cache, v_cache = cache
    ps = k_cache.shape[1]
    qo = [int(x) for x in qo_indptr]
    indptr = kv_indptr.tolist()
    last = last_page_len.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    lse = torch.full(q.shape[:2], float("-inf"))
    for b in range(len(last)):
        npages = indptr[b + 1] - indptr[b]
        length = (npages - 1) * ps + last[b] if npages else 0
        qs, qe = qo[b], qo[b + 1]
        if qe == qs or length == 0:
            continue
        k = _gather(k_cache, kv_indices, indptr[b], indptr[b + 1], length)
        v = _gather(v_cache, kv_indices, indptr[b], indptr[b + 1], length)
        out[qs:qe], lse[qs:qe] = _attend(
            q[qs:qe], k, v, causal=causal, window_left=window_left, soft_cap=soft_cap,
            sm_scale=sm_scale,
        )  # fmt: skip
    return out, lse


class _PrefillModule:
    """What ``get_batch_prefill_module("fa2", ...)`` returns: ``plan`` (the C++ scheduler) and
    ``paged_run`` (FlashInfer's Python function around the compiled ``paged_run_func``)."""

    def __init__(self, block_scale_args):
        self.block_scale_args = block_scale_args
        self.plan_calls = 0
        self.compiled_calls = 0  # every call of the compiled function
        self.python_run_calls = 0  # those through the Python paged_run (run()'s way)

        def paged_run_func(float_ws, int_ws, plan_info, q, k_cache, v_cache, qo_indptr,
                           kv_indptr, kv_indices, last_page_len, o, lse, mask_mode, layout,
                           window_left, enable_pdl, custom_mask, mask_indptr, alibi, prefix,
                           token_pos, max_item, *rest):  # fmt: skip
            # The release's layout, exactly: anything else raises (as a C++ binding would).
            expected = 7 if block_scale_args else 5
            if len(rest) != expected:
                raise TypeError(
                    f"paged_run(): incompatible function arguments: {22 + len(rest)} given, "
                    f"this release takes {22 + expected}"
                )
            if block_scale_args:
                key_scales, value_scales, *rest = rest
                assert key_scales is None and value_scales is None
            soft_cap, sm_scale, rope_rcp_scale, rope_rcp_theta, item_len = rest
            assert isinstance(sm_scale, float) and isinstance(soft_cap, float)
            assert (mask_mode, layout, item_len) == (0, 0, 0)
            assert (rope_rcp_scale, rope_rcp_theta) == (1.0, 1e-4)
            assert isinstance(enable_pdl, bool) and alibi is not None
            batch, rows = plan_info[0], plan_info[1]
            assert len(last_page_len) == batch and q.shape[0] == rows, (plan_info, q.shape)
            self.compiled_calls += 1
            result, rows_lse = _paged_attention(
                q, (k_cache, v_cache), qo_indptr.tolist(), kv_indptr[: batch + 1],
                kv_indices, last_page_len[:batch], causal=False, window_left=window_left,
                soft_cap=soft_cap, sm_scale=sm_scale,
            )  # fmt: skip
            o.copy_(result)
            if lse is not None:
                assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
                lse.copy_(rows_lse)

        def paged_run(float_ws, int_ws, plan_info, q, k_cache, v_cache, qo_indptr, kv_indptr,
                      kv_indices, last_page_len, o, lse, mask_mode, layout, window_left,
                      enable_pdl, custom_mask, mask_indptr, alibi, prefix, token_pos,
                      max_item, soft_cap, sm_scale, scale_q, scale_k, scale_v, rope_scale,
                      rope_theta, item_len, workspace_size, *rest):  # fmt: skip
            block = (None, None) if block_scale_args else ()
            self.python_run_calls += 1
            paged_run_func(float_ws, int_ws, plan_info, q, k_cache, v_cache, qo_indptr,
                           kv_indptr, kv_indices, last_page_len, o, lse, mask_mode, layout,
                           window_left, enable_pdl, custom_mask, mask_indptr, alibi, prefix,
                           token_pos, max_item, *block, soft_cap, sm_scale, 1.0 / rope_scale,
                           1.0 / rope_theta, item_len)  # fmt: skip

        self.paged_run = paged_run

    def plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_len, total_rows,
             batch, num_qo_heads, num_kv_heads, page_size, graph, head_dim_qk, head_dim_vo,
             causal, window_left, fixed_split_size, disable_split_kv, num_colocated_ctas,
             *tail):  # fmt: skip
        """The fa2 scheduler: these 19 arguments and exactly the release's ``plan_tail``
        (anything else raises, as a C++ binding would); plan info from the host arrays."""
        want = LAYOUT["plan_tail"]
        if len(tail) != len(want):
            raise TypeError(
                f"plan(): incompatible function arguments: {19 + len(tail)} given, this "
                f"release takes {19 + len(want)}"
            )
        if tuple(tail) != tuple(want) or [type(x) for x in tail] != [type(x) for x in want]:
            raise ValueError(f"plan(): uniform_q_len arguments {tail}, expected {want}")
        for flag in (graph, causal, disable_split_kv):
            assert isinstance(flag, bool)
        assert len(qo_indptr) == len(kv_indptr) == len(kv_len) + 1 == batch + 1
        assert (fixed_split_size, num_colocated_ctas, causal) == (-1, 0, False)
        self.plan_calls += 1
        return [batch, total_rows, num_qo_heads, num_kv_heads, page_size, int(kv_indptr[-1]),
                int(kv_len.sum()), head_dim_qk, head_dim_vo, window_left, int(graph)]  # fmt: skip


class _Base:
    def __init__(self, float_workspace_buffer):
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._sm_scale = None
        self.plans = 0

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        """The public way to share an int workspace (a new pinned buffer of its own)."""
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer
        self._pin_memory_int_workspace_buffer = torch.empty(16, dtype=torch.uint8)

    def _store(self, name, value, graph):
        buf = getattr(self, name, None)
        if graph:
            buf[: len(value)].copy_(value)
        elif name == "_kv_indices":
            setattr(self, name, value.to(self.device))  # a device tensor: aliased, as on a GPU
        else:
            setattr(self, name, value.clone())  # host -> device: a copy, as on a GPU

    #: Where plan() keeps the softmax scale and run() reads it (a test's subclass renames it,
    #: as a FlashInfer release might).
    _SCALE_ATTR = "_sm_scale"

    def _set_scale(self, sm_scale):
        setattr(self, self._SCALE_ATTR, sm_scale)

    def _scale(self, d):
        sm_scale = getattr(self, self._SCALE_ATTR, None)
        return sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)

    def _paged(self, q, cache, qo_indptr, causal):
        return _paged_attention(
            q, cache, qo_indptr, self._kv_indptr, self._kv_indices, self._last_page_len,
            causal=causal, window_left=self._window_left, soft_cap=self._soft_cap,
            sm_scale=self._scale(q.shape[-1]),
        )  # fmt: skip

    @staticmethod
    def _out(result, q, out, lse=None, return_lse=False):
        """``(result [T, H, Dv], lse [T, H])`` as run() hands them out: into ``out`` / the
        ``lse`` buffer where given, ``(out, lse)`` where ``return_lse``."""
        result, rows_lse = result
        if out is None:
            out = result.to(q.dtype)
        else:
            out.copy_(result)
        if not return_lse:
            return out
        if lse is None:
            lse = rows_lse
        else:
            assert lse.shape == q.shape[:2] and lse.dtype == torch.float32, lse.shape
            lse.copy_(rows_lse)
        return out, lse


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    """Tensor-core (``use_tensor_cores=True``) wrappers keep the real wrapper's attribute names
    and go through a :class:`_PrefillModule`; CUDA-core ones compute in ``run()``. A subclass
    may rename the indptr buffer (``_INDPTR_ATTR``), as a release might."""

    _INDPTR_ATTR = "_paged_kv_indptr_buf"

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        super().__init__(float_workspace_buffer)
        assert kv_layout == "NHD"
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        self._backend = backend
        self._jit_module = None
        self._cached_module = None
        self._plan_info = None
        setattr(self, self._INDPTR_ATTR, paged_kv_indptr_buffer)
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._qo_indptr_buf = None
        if LAYOUT["cudnn_auto"]:
            self._cudnn_auto = False  # 0.7: plan() sets it where "auto" picks cuDNN
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if use_tensor_cores:
                self._qo_indptr_buf = torch.arange(self._fixed_batch_size + 1, dtype=torch.int32)

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    @property
    def use_tensor_cores(self):
        return self._use_tensor_cores

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer
        self._pin_memory_int_workspace_buffer = torch.empty(16, dtype=torch.uint8)

    def _put(self, name, value):
        """plan(): host -> the wrapper's device buffer (graph: into the fixed one)."""
        if self._use_cuda_graph:
            getattr(self, name)[: len(value)].copy_(value)
        elif name == "_paged_kv_indices_buf":
            setattr(self, name, value.to(self.device))  # a device tensor: aliased, as on a GPU
        else:
            setattr(self, name, value.clone())

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv=False,
    ):
        assert pos_encoding_mode == "NONE"
        batch = len(last_page_len)
        if self._use_cuda_graph:
            assert batch == self._fixed_batch_size, "batch size fixed in graph mode"
        self._put(self._INDPTR_ATTR, indptr)
        self._put("_paged_kv_indices_buf", indices)
        self._put("_paged_kv_last_page_len_buf", last_page_len)
        self._batch_size = batch
        self._num_qo_heads = num_qo_heads
        if self._use_tensor_cores:
            qo_host = torch.arange(batch + 1, dtype=torch.int32)
            if not self._use_cuda_graph:
                self._qo_indptr_buf = qo_host.clone()
            ps = page_size
            npages = (indptr[1:] - indptr[:-1]).to(torch.int32)
            kv_lens = torch.where(npages > 0, (npages - 1) * ps + last_page_len, 0)
            self._max_kv_len = int(kv_lens.max())  # the ~340 us max() of the real plan()
            if self._backend == "auto":
                self._backend = "fa2"
            self._cached_module = _PrefillModule(LAYOUT["block_scale_args"])
            self._plan_info = self._cached_module.plan(
                self._float_workspace_buffer, self._int_workspace_buffer,
                self._pin_memory_int_workspace_buffer, qo_host, indptr, kv_lens.to(torch.int32),
                batch, batch, num_qo_heads, num_kv_heads, page_size, self.is_cuda_graph_enabled,
                head_dim, head_dim, False, window_left, -1, False, 0, *LAYOUT["plan_tail"],
            )  # fmt: skip
        self._pos_encoding_mode = pos_encoding_mode
        self._window_left = window_left
        self._logits_soft_cap = logits_soft_cap
        self._soft_cap = logits_soft_cap or 0.0
        self._rope_scale, self._rope_theta = rope_scale, rope_theta
        self._set_scale(sm_scale)
        self._q_dtype, self._kv_dtype = q_data_type, kv_data_type or q_data_type
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=1, skip_softmax_threshold_scale_factor=None,
            kv_block_scales=None):  # fmt: skip
        assert k_scale is None and v_scale is None and q_scale is None
        assert sinks is None, "the sinks argument reaches no sm90 kernel"
        assert q.dtype == self._q_dtype and paged_kv_cache[0].dtype == self._kv_dtype
        batch = self._paged_kv_last_page_len_buf.size(0)
        if q.shape[0] != batch:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match batch_size")
        if out is not None:
            assert out.shape == q.shape and out.dtype == q.dtype
        if not self._use_tensor_cores:
            qo = list(range(batch + 1))
            result = _paged_attention(
                q, paged_kv_cache, qo, getattr(self, self._INDPTR_ATTR),
                self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, causal=False,
                window_left=self._window_left, soft_cap=self._soft_cap,
                sm_scale=self._scale(q.shape[-1]),
            )  # fmt: skip
            return self._out(result, q, out, lse, return_lse)
        result = out if out is not None else torch.empty_like(q)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32)
        # The release's run_args for the tensor-core path, then the module's paged_run.
        self._cached_module.paged_run(
            self._float_workspace_buffer, self._int_workspace_buffer, self._plan_info, q,
            paged_kv_cache[0], paged_kv_cache[1], self._qo_indptr_buf,
            getattr(self, self._INDPTR_ATTR), self._paged_kv_indices_buf,
            self._paged_kv_last_page_len_buf, result, lse if return_lse else None, 0, 0,
            self._window_left, False,
            None, None, torch.empty(0), None, None, None, self._soft_cap,
            float(self._scale(q.shape[-1])), None, None, None, self._rope_scale or 1.0,
            self._rope_theta or 1e4, 0, 0, paged_kv_cache, self._num_qo_heads,
        )  # fmt: skip
        return (result, lse) if return_lse else result


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        super().__init__(float_workspace_buffer)
        assert kv_layout == "NHD"
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows = None
        if use_cuda_graph:
            # the real constructor's checks: every buffer given, lengths batch + 1 / batch
            for buf in (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                        paged_kv_last_page_len_buf):  # fmt: skip
                assert torch.is_tensor(buf), "graph mode needs every buffer"
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            assert len(paged_kv_indptr_buf) == self._fixed_batch_size + 1
            assert len(paged_kv_last_page_len_buf) == self._fixed_batch_size
        else:
            self._fixed_batch_size = 0

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len=0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv=False,
    ):
        assert max_sequence_kv is None, "0.6.7 breaks for non-cudnn backends with it"
        total_rows = int(qo_indptr[-1])
        batch = len(paged_kv_last_page_len)
        if self._use_cuda_graph:
            # FlashInfer's graph mode: the first plan fixes the row count the scheduler plans
            # for (the grid a captured kernel keeps); later plans may have fewer rows, never
            # more, and exactly the buffers' batch size
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_rows
            elif total_rows > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_rows} in cuda graph mode "
                    f"cannot exceed the number of rows set during initialization "
                    f"{self._max_total_num_rows}."
                )
            if batch != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed during the lifecycle of the wrapper in "
                    f"cuda graph mode, the runtime batch size {batch} mismatches the batch size "
                    f"{self._fixed_batch_size} set during initialization."
                )
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the buffer")
            # host -> the fixed device buffers (run() reads them: a graph replay sees them)
            self._qo_indptr_buf.copy_(qo_indptr)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len)
        self._qo_indptr = qo_indptr.tolist()
        self._kv_indptr = paged_kv_indptr.clone()
        self._kv_indices = paged_kv_indices.to(self.device)
        self._last_page_len = paged_kv_last_page_len.clone()
        self._causal = causal
        self._window_left = window_left
        self._soft_cap = logits_soft_cap or 0.0
        self._set_scale(sm_scale)
        self._q_dtype, self._kv_dtype = q_data_type, kv_data_type or q_data_type
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            kv_block_scales=None, skip_softmax_threshold_scale_factor=None):  # fmt: skip
        assert k_scale is None and v_scale is None
        assert sinks is None, "the sinks argument reaches no sm90 kernel"
        assert q.dtype == self._q_dtype and paged_kv_cache[0].dtype == self._kv_dtype
        # FlashInfer's host check (0.6.7 and 0.7.4), graph mode or not: q has the rows of the
        # last plan's qo_indptr, no more (a captured step's padding tokens past the last
        # request are not rows of the plan)
        if q.shape[0] != self._qo_indptr[-1]:
            raise ValueError(
                f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({self._qo_indptr[-1]})"
            )
        if self._use_cuda_graph:
            # A captured kernel reads only its buffers, with the grid of the capture's rows:
            # compute from the buffers' current content.
            result = _paged_attention(
                q, paged_kv_cache, self._qo_indptr_buf.tolist(), self._paged_kv_indptr_buf,
                self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf,
                causal=self._causal, window_left=self._window_left, soft_cap=self._soft_cap,
                sm_scale=self._scale(q.shape[-1]),
            )  # fmt: skip
            return self._out(result, q, out, lse, return_lse)
        result = self._paged(q, paged_kv_cache, self._qo_indptr, causal=self._causal)
        return self._out(result, q, out, lse, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        kv_indptr_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        super().__init__(float_workspace_buffer)
        assert kv_layout == "NHD" and not use_cuda_graph

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        window_left=-1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        **rest,
    ):
        self._qo_indptr = qo_indptr.tolist()
        self._kv = kv_indptr.tolist()
        self._causal = causal
        self._window_left = window_left
        self._soft_cap = logits_soft_cap or 0.0
        self._set_scale(sm_scale)
        self.plans += 1

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
            out=None, lse=None, return_lse=False, enable_pdl=None):  # fmt: skip
        result = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
        rows_lse = torch.full(q.shape[:2], float("-inf"))
        for b in range(len(self._qo_indptr) - 1):
            qs, qe = self._qo_indptr[b], self._qo_indptr[b + 1]
            ks, ke = self._kv[b], self._kv[b + 1]
            if qe > qs:
                result[qs:qe], rows_lse[qs:qe] = _attend(
                    q[qs:qe],
                    k[ks:ke],
                    v[ks:ke],
                    causal=self._causal,
                    window_left=self._window_left,
                    soft_cap=self._soft_cap,
                    sm_scale=self._scale(q.shape[-1]),
                )
        return self._out((result, rows_lse), q, out, lse, return_lse)


class BatchMLAPagedAttentionWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        super().__init__(float_workspace_buffer)
        self._use_cuda_graph = use_cuda_graph
        self._qo = qo_indptr
        self._kv_indptr = kv_indptr
        self._kv_indices = kv_indices
        self._kv_len = kv_len_arr

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        use_profiler=False,
    ):
        g = self._use_cuda_graph
        self._store("_qo", qo_indptr, g)
        self._store("_kv_indptr", kv_indptr, g)
        self._store("_kv_indices", kv_indices, g)
        self._store("_kv_len", kv_len_arr, g)
        self._causal = causal
        self._set_scale(sm_scale)
        self._page_size = page_size
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            profiler_buffer=None, kv_len=None, page_table=None,
            return_lse_base_on_e=False):  # fmt: skip
        assert ckv_cache.shape[1] == self._page_size
        qo = self._qo.tolist()
        indptr = self._kv_indptr.tolist()
        lens = self._kv_len.tolist()
        q = torch.cat([q_nope, q_pe], dim=-1)
        latent = torch.cat([ckv_cache, kpe_cache], dim=-1)
        r = ckv_cache.shape[-1]
        result = torch.zeros(q_nope.shape)
        for b in range(len(lens)):
            qs, qe = qo[b], qo[b + 1]
            if qe == qs:
                continue
            lat = _gather(latent, self._kv_indices, indptr[b], indptr[b + 1], lens[b])[:, None]
            result[qs:qe], _ = _attend(
                q[qs:qe],
                lat,
                lat[..., :r],
                causal=self._causal,
                window_left=-1,
                soft_cap=0.0,
                sm_scale=self._scale(q.shape[-1]),
            )
        if out is None:
            return result.to(q_nope.dtype)
        assert out.shape == q_nope.shape
        out.copy_(result)
        return out


def _alibi_slopes(num_heads, device):
    return torch.zeros(num_heads, device=device)


utils = types.ModuleType(__name__ + ".utils")
utils._get_cache_alibi_slopes_buf = _alibi_slopes
utils.device_support_pdl = lambda device: False


def install(monkeypatch, version: str = "0.6.7", *, layout_of: str | None = None
            ) -> types.ModuleType:  # fmt: skip
    """Make ``import flashinfer`` return this module for the test (pytest ``monkeypatch``), as
    release ``version`` (what the plugin's compat module reads as the installed distribution's
    version), with the internals' layout of release ``layout_of`` (default: ``version``'s; a
    different one stands in for a release whose internals changed under the same version; a
    release :data:`LAYOUTS` does not know has 0.7.4's)."""
    from attn_plugin_flashinfer import compat

    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    monkeypatch.setattr(module, "__name__", "flashinfer")
    monkeypatch.setattr(module, "__version__", version)
    for key, value in LAYOUTS.get(layout_of or version, LAYOUTS["0.7.4"]).items():
        monkeypatch.setitem(LAYOUT, key, value)
    monkeypatch.setattr(compat, "distribution_version", lambda: version)
    monkeypatch.setattr(compat, "_FAST", {})
    return module
