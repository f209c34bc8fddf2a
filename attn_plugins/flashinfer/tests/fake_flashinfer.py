"""A pure-PyTorch stand-in for the FlashInfer 0.6.7 wrappers the plugin uses (CPU tests only).

It mirrors the real constructors' and ``plan()``/``run()`` signatures (argument names and order,
read from the 0.6.7 sources) and FlashInfer's *semantics*, written independently of attn-core's
reference ops:

- a request's KV is ``(pages - 1) * page_size + last_page_len`` tokens of the pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``;
- queries are the last ``q_len`` positions (bottom-right aligned causal mask);
- ``window_left``: a query at position ``p`` sees keys ``p - window_left .. p`` (inclusive);
- soft-cap: ``cap * tanh(sm_scale * q.k / cap)``; ``sm_scale`` is read from ``self._sm_scale``
  at ``run()`` time, as FlashInfer does;
- fp8 caches are read as raw values (FlashInfer's kernels do not dequantise with a per-layer
  scale unless given ``k_scale``/``v_scale``, which the plugin never passes);
- CUDA-graph wrappers copy plan metadata into the buffers given at construction, and ``run()``
  reads those buffers, so a test that rewrites them through ``plan()`` sees the new batch.

Install with :func:`install` (puts it in ``sys.modules["flashinfer"]``).
"""

from __future__ import annotations

import math
import sys
import types

import torch

__version__ = "0.6.7-fake"


def _attend(q, k, v, *, causal, window_left, soft_cap, sm_scale):
    """``q [Lq, H, D]``, ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` -> ``[Lq, H, Dv]`` float32."""
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
    return torch.einsum("hqk,khd->qhd", p, vf)


def _gather(cache, indices, start, end, length):
    pages = indices[start:end].long()
    rows = cache.index_select(0, pages.to(cache.device))
    return rows.reshape(-1, *cache.shape[2:])[:length]


class _Base:
    def __init__(self, float_workspace_buffer):
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._sm_scale = None
        self.plans = 0

    def _store(self, name, value, graph):
        buf = getattr(self, name, None)
        if graph:
            buf[: len(value)].copy_(value)
        elif name == "_kv_indices":
            setattr(self, name, value.to(self.device))  # a device tensor: aliased, as on a GPU
        else:
            setattr(self, name, value.clone())  # host -> device: a copy, as on a GPU

    def _scale(self, d):
        return self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(d)

    def _paged(self, q, cache, qo_indptr, causal):
        k_cache, v_cache = cache
        ps = k_cache.shape[1]
        indptr = self._kv_indptr.tolist()
        last = self._last_page_len.tolist()
        out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
        for b in range(len(last)):
            npages = indptr[b + 1] - indptr[b]
            length = (npages - 1) * ps + last[b] if npages else 0
            qs, qe = qo_indptr[b], qo_indptr[b + 1]
            if qe == qs or length == 0:
                continue
            k = _gather(k_cache, self._kv_indices, indptr[b], indptr[b + 1], length)
            v = _gather(v_cache, self._kv_indices, indptr[b], indptr[b + 1], length)
            out[qs:qe] = _attend(
                q[qs:qe],
                k,
                v,
                causal=causal,
                window_left=self._window_left,
                soft_cap=self._soft_cap,
                sm_scale=self._scale(q.shape[-1]),
            )
        return out

    @staticmethod
    def _out(result, q, out):
        if out is None:
            return result.to(q.dtype)
        out.copy_(result)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Base):
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
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        self._kv_indptr = paged_kv_indptr_buffer
        self._kv_indices = paged_kv_indices_buffer
        self._last_page_len = paged_kv_last_page_len_buffer
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)

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
        if self._use_cuda_graph:
            assert len(last_page_len) == self._fixed_batch_size, "batch size fixed in graph mode"
        self._store("_kv_indptr", indptr, self._use_cuda_graph)
        self._store("_kv_indices", indices, self._use_cuda_graph)
        self._store("_last_page_len", last_page_len, self._use_cuda_graph)
        self._window_left = window_left
        self._soft_cap = logits_soft_cap or 0.0
        self._sm_scale = sm_scale
        self._q_dtype, self._kv_dtype = q_data_type, kv_data_type or q_data_type
        self._batch = len(last_page_len)
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=1, skip_softmax_threshold_scale_factor=None,
            kv_block_scales=None):  # fmt: skip
        assert k_scale is None and v_scale is None
        assert q.dtype == self._q_dtype and paged_kv_cache[0].dtype == self._kv_dtype
        if q.shape[0] != self._batch:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match batch_size")
        if out is not None:
            assert out.shape == q.shape and out.dtype == q.dtype
        qo = list(range(self._batch + 1))
        return self._out(self._paged(q, paged_kv_cache, qo, causal=False), q, out)


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
        assert kv_layout == "NHD" and not use_cuda_graph

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
        self._qo_indptr = qo_indptr.tolist()
        self._kv_indptr = paged_kv_indptr.clone()
        self._kv_indices = paged_kv_indices.to(self.device)
        self._last_page_len = paged_kv_last_page_len.clone()
        self._causal = causal
        self._window_left = window_left
        self._soft_cap = logits_soft_cap or 0.0
        self._sm_scale = sm_scale
        self._q_dtype, self._kv_dtype = q_data_type, kv_data_type or q_data_type
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            kv_block_scales=None, skip_softmax_threshold_scale_factor=None):  # fmt: skip
        assert k_scale is None and v_scale is None
        assert q.dtype == self._q_dtype and paged_kv_cache[0].dtype == self._kv_dtype
        if q.shape[0] != self._qo_indptr[-1]:
            raise ValueError("q.shape[0] does not match qo_indptr[-1]")
        result = self._paged(q, paged_kv_cache, self._qo_indptr, causal=self._causal)
        return self._out(result, q, out)


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
        self._sm_scale = sm_scale
        self.plans += 1

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
            out=None, lse=None, return_lse=False, enable_pdl=None):  # fmt: skip
        result = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
        for b in range(len(self._qo_indptr) - 1):
            qs, qe = self._qo_indptr[b], self._qo_indptr[b + 1]
            ks, ke = self._kv[b], self._kv[b + 1]
            if qe > qs:
                result[qs:qe] = _attend(
                    q[qs:qe],
                    k[ks:ke],
                    v[ks:ke],
                    causal=self._causal,
                    window_left=self._window_left,
                    soft_cap=self._soft_cap,
                    sm_scale=self._scale(q.shape[-1]),
                )
        return self._out(result, q, out)


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
        self._sm_scale = sm_scale
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
            result[qs:qe] = _attend(
                q[qs:qe],
                lat,
                lat[..., :r],
                causal=self._causal,
                window_left=-1,
                soft_cap=0.0,
                sm_scale=self._sm_scale,
            )
        if out is None:
            return result.to(q_nope.dtype)
        assert out.shape == q_nope.shape
        out.copy_(result)
        return out


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flashinfer`` return this module for the test (pytest ``monkeypatch``)."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module
