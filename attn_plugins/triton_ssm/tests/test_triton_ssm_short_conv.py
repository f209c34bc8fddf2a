"""LFM2's gated short conv: ``causal_conv1d_update`` with no activation and kernel 3 (LFM2's
``conv_L_cache``) against attn-core's reference decode conv, for decode and for speculative
verify (``update_state=False`` then ``causal_conv1d_commit``). Small shapes in Triton's
interpreter without CUDA; LFM2-1.2B's 2048 channels at B = 256 on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA

from attn_core.reference.decode import decode_conv1d

CUDA = torch.cuda.is_available()


def _case(B: int, C: int, dtype=torch.float32, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = B + 3
    state = torch.randn(S, C, 2, generator=g).to(dtype)
    idx = torch.randperm(S, generator=g)[:B].int()
    w = torch.randn(C, 3, generator=g).to(dtype)
    x = torch.randn(B, 3, C, generator=g).to(dtype)  # three tokens per request (verify)
    return (t.to(device) for t in (x, state, w, idx))


def _check(B: int, C: int, dtype, device, tol) -> None:
    x, state, w, idx = _case(B, C, dtype, device)
    # decode, token by token: the reference's fixed-shape conv on a copy of the pool
    ref_state = state.clone()
    want = [decode_conv1d(x[:, t], w, None, ref_state, idx, activation=None) for t in range(3)]
    verify_state = state.clone()
    for t in range(3):
        got = K.causal_conv1d_update(x[:, t], state, w, None, idx, activation=None)
        torch.testing.assert_close(got.float(), want[t].float(), **tol)
    torch.testing.assert_close(state.float(), ref_state.float(), **tol)
    # verify: all three drafts at once without touching the state, then keep two
    y = K.causal_conv1d_update(x, verify_state, w, None, idx, activation=None, update_state=False)
    torch.testing.assert_close(y.float(), torch.stack(want, 1).float(), **tol)
    keep_state = verify_state.clone()
    accepted = torch.full((B,), 2, dtype=torch.int32, device=device)
    K.causal_conv1d_commit(x, accepted, verify_state, w, idx)
    two = keep_state.clone()
    for t in range(2):
        decode_conv1d(x[:, t], w, None, two, idx, activation=None)
    torch.testing.assert_close(verify_state.float(), two.float(), **tol)


def test_decode_and_verify_match_the_reference() -> None:
    _check(3, 24, torch.float32, DEV, dict(atol=1e-5, rtol=1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lfm2_shape_on_gpu() -> None:
    _check(256, 2048, torch.bfloat16, "cuda", dict(atol=2e-2, rtol=2e-2))
