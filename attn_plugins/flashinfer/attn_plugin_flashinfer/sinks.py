"""Attention sinks over FlashInfer's plain kernels: rescale the output by its log-sum-exp.

A sink is one more softmax column per head, a logit ``sinks[h]`` that carries no value
(gpt-oss). For a query row with logits ``s_j`` (scaled, soft-capped, masked) and plain
attention output ``o = sum_j exp(s_j) v_j / Z``, ``Z = sum_j exp(s_j)``, the output with the
sink is ``sum_j exp(s_j) v_j / (Z + exp(sinks[h])) = o * sigmoid(ln Z - sinks[h])``.

So every FlashInfer wrapper that returns the log-sum-exp (``run(..., lse=buf,
return_lse=True)``, public in every release) serves sinks, with one elementwise pass over the
output: decode (tensor-core and CUDA-core), paged and ragged prefill, the captured graph
wrappers, soft-capped layers and an fp8 cache alike. FlashInfer writes the LSE in base 2
(``log2 Z``; 0.7's ``lse_base`` documents "log2" as the default), hence the ``ln 2`` below.

Why not FlashInfer's own sink support: the ``sinks`` argument of ``run()`` reaches only the
trtllm-gen (sm100) and cuDNN kernels, and ``BatchAttentionWithAttentionSinkWrapper`` (a JIT
variant of the paged prefill kernel) served gpt-oss's decode on the H200 at 3.5-7x the time of
the plain decode kernel.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["LN2", "apply_sinks_", "triton_runs_on"]

LN2 = math.log(2.0)
#: query rows (token x head) one program rescales
_ROWS = 16


def apply_sinks_(out: torch.Tensor, lse_log2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Rescale ``out`` in place to the output with attention sinks; returns ``out``.

    :param out: ``[T, H, D]`` plain attention output (bf16 / fp16 / fp32), unit last stride.
    :param lse_log2: ``[T, H]`` float32, base-2 log-sum-exp of each row's logits (FlashInfer's).
    :param sinks: ``[H]`` float32 sink logits.

    On CUDA one Triton launch; elsewhere (CPU tests without Triton's interpreter) torch ops.
    A row that saw no key (``lse = -inf``) becomes zeros, as the sink then takes all the mass.
    """
    T, H, D = out.shape
    if lse_log2.shape != (T, H) or sinks.shape != (H,):
        raise ValueError(
            f"sinks rescale: out [T={T}, H={H}, D={D}] needs lse [{T}, {H}] and sinks [{H}], "
            f"got {tuple(lse_log2.shape)} and {tuple(sinks.shape)}"
        )
    if T == 0:
        return out
    if triton_runs_on(out.device):
        _launch(out, lse_log2, sinks)
        return out
    factor = torch.sigmoid(lse_log2.float() * LN2 - sinks.float())  # [T, H]
    out.mul_(factor.unsqueeze(-1))  # in float32, rounded once into out's dtype
    return out


def triton_runs_on(device: torch.device) -> bool:
    """Whether the plugin's Triton kernels (this rescale, small_decode) run on tensors of
    ``device``: CUDA, and CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU
    tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_KERNEL = None


def _kernel():
    """The Triton kernel and its cached launch, made on first use (Triton imported only here)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        from attn_core.fast_launch import CachedLaunch

        @triton.jit
        def _sink_rescale_kernel(
            out,  # [T, H, D], unit last stride
            lse,  # [T, H] float32, base 2
            sinks,  # [H] float32
            rows,  # T * H
            H,
            D,
            stride_ot,
            stride_oh,
            stride_lt,
            stride_lh,
            ROWS: tl.constexpr,
            BLOCK_D: tl.constexpr,
        ):
            r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            live = r < rows
            t = (r // H).to(tl.int64)
            h = r % H
            x = tl.load(lse + t * stride_lt + h * stride_lh, mask=live, other=0.0)
            s = tl.load(sinks + h, mask=live, other=0.0)
            factor = tl.sigmoid(x * 0.6931471805599453 - s)
            d = tl.arange(0, BLOCK_D)
            ptrs = out + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
            m = live[:, None] & (d[None, :] < D)
            o = tl.load(ptrs, mask=m, other=0.0)
            tl.store(ptrs, (o.to(tl.float32) * factor[:, None]).to(o.dtype), mask=m)

        _KERNEL = CachedLaunch(_sink_rescale_kernel)
    return _KERNEL


def _launch(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    if out.stride(-1) != 1:
        raise ValueError(f"sinks rescale: out needs a unit last stride, got {out.stride()}")
    if lse.dtype != torch.float32 or sinks.dtype != torch.float32:
        raise ValueError(
            f"sinks rescale: lse and sinks must be float32, got {lse.dtype} and {sinks.dtype}"
        )
    T, H, D = out.shape
    block_d = 1 << max(D - 1, 1).bit_length()
    rows = T * H
    scalars = (
        rows, H, D, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), _ROWS, block_d,
    )  # fmt: skip
    _kernel().launch((-(-rows // _ROWS),), (out, lse, sinks), scalars, num_warps=4, num_stages=1)
