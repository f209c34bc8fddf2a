"""Lightning attention (MiniMax-01) through the Mamba2 kernels, against attn-core's reference.

Lightning attention is Mamba2's recurrence with ``dt = 1``, ``A = -slope``, ``B = k``,
``C = q * scale``, ``x = v`` and one group per head; the plugin runs it through
``mamba2_decode`` (decode and per-token verify) and ``mamba2_prefill(impl="triton")`` (SSD
prefill). Here the kernels are checked at that mapping against
:func:`attn_core.reference.ops.lightning_attention` (itself checked against transformers'
MiniMax module): small shapes in Triton's interpreter without CUDA, and MiniMax's real shape
(64 heads of 128 per rank at tp 1, B = 256 decode) on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA

from attn_core.reference.ops import lightning_attention

CUDA = torch.cuda.is_available()


def _case(lens, *, H=4, Dk=16, Dv=32, slots=None, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    silu = torch.nn.functional.silu
    q, k = (silu(torch.randn(T, H, Dk, generator=g)) for _ in range(2))
    v = torch.randn(T, H, Dv, generator=g)
    # MiniMax's slopes span 2^-1 .. 2^-8; one head decays hard (e^-3 per token)
    slope = torch.cat([torch.tensor([3.0]), 2.0 ** -torch.linspace(1, 8, H - 1)])
    n = len(lens)
    slots = slots if slots is not None else list(range(n))
    pool = torch.randn(max(slots) + 2, H, Dk, Dv, generator=g) * 0.3
    idx = torch.tensor(slots, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    to = {"device": device}
    return (q.to(**to), k.to(**to), v.to(**to), slope.to(**to), pool.to(**to), idx.to(**to),
            cu.to(**to), cu)  # fmt: skip


def _reference(q, k, v, slope, pool, idx, cu):
    ref_pool = pool.clone()
    init = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
    y = lightning_attention(q, k, v, slope, ref_pool, cu, idx, init, mode="recurrent")
    return y, ref_pool


def test_prefill_through_the_triton_ssd_matches_the_reference() -> None:
    """Sequences ending inside and on 16-token chunks, slots out of order."""
    q, k, v, slope, pool, idx, cu, cu_host = _case([37, 16, 5, 1], slots=[4, 0, 2, 1])
    want, want_pool = _reference(q, k, v, slope, pool, idx, cu)
    T, H = v.shape[:2]
    got = K.mamba2_prefill(
        v, torch.ones(T, H, device=v.device), torch.log(slope), k, q, pool, idx, cu,
        dt_softplus=False, chunk_size=16, impl="triton", cu_seqlens_cpu=cu_host,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(pool, want_pool, atol=2e-4, rtol=2e-4)


def test_decode_through_mamba2_decode_matches_the_reference() -> None:
    """A padding row (slot -1) outputs zeros and leaves every slot alone."""
    q, k, v, slope, pool, idx, cu, _ = _case([1, 1, 1], slots=[3, 0, 1])
    idx_pad = torch.cat([idx, torch.tensor([-1], dtype=torch.int32, device=idx.device)])
    q4, k4, v4 = (torch.cat([t, t[:1]]) for t in (q, k, v))
    want, want_pool = _reference(q, k, v, slope, pool, idx, cu)
    got = K.mamba2_decode(
        v4, torch.ones(4, v.shape[1], device=v.device), torch.log(slope), k4, q4, pool, idx_pad,
        dt_softplus=False,
    )  # fmt: skip
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[3]) == 0
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_minimax_shape_on_gpu() -> None:
    """MiniMax-Text-01's lightning layer (64 heads of 128), bf16 activations, fp32 state:
    256 decodes and a 4-request prefill of 1000-4000 tokens through the compiled kernels."""
    H, D = 64, 128
    q, k, v, slope, pool, idx, cu, _ = _case([1] * 256, H=H, Dk=D, Dv=D, device="cuda")
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    want, want_pool = _reference(q, k, v, slope, pool, idx, cu)
    ones = torch.ones(256, H, device="cuda")
    got = K.mamba2_decode(v, ones, torch.log(slope), k, q, pool, idx, dt_softplus=False)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool, want_pool, atol=1e-3, rtol=1e-3)
    lens = [1000, 4000, 17, 2500]
    q, k, v, slope, pool, idx, cu, cu_host = _case(lens, H=H, Dk=D, Dv=D, device="cuda")
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    want, want_pool = _reference(q, k, v, slope, pool, idx, cu)
    T = sum(lens)
    got = K.mamba2_prefill(
        v, torch.ones(T, H, device="cuda"), torch.log(slope), k, q, pool, idx, cu,
        dt_softplus=False, impl="triton", cu_seqlens_cpu=cu_host,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(pool, want_pool, atol=5e-3, rtol=5e-3)
