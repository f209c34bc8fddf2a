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


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("block_c", "rpp", "num_warps"), [(None, None, None), (8, 2, 2), (16, 3, 4), (64, 8, 1)]
)
def test_packed_decode_matches_the_reference_with_padding_rows(
    state_dtype, block_c, rpp, num_warps
) -> None:
    # one token of a kernel-3 conv over packed [C, 2] slots takes the packed kernel: a channel
    # count no block divides, padding rows (-1), a bias and silu, bf16 tokens over a float32
    # pool; blocks narrower than a program's threads (a word held by several threads, on a
    # GPU), one block wider than the channels, a program with more requests than the batch
    g = torch.Generator().manual_seed(3)
    B, C, S = 5, 20, 9
    state = torch.randn(S, C, 2, generator=g).to(state_dtype)
    idx = torch.tensor([4, -1, 0, 7, -1], dtype=torch.int32)
    w = torch.randn(C, 3, generator=g)
    bias = torch.randn(C, generator=g)
    x = torch.randn(B, C, generator=g).bfloat16()
    ref_state = state.clone()
    want = decode_conv1d(x.float(), w, bias, ref_state, idx, activation="silu")
    want[idx < 0] = 0
    dev = [t.to(DEV) for t in (x, state, w, bias, idx)]
    got = K.causal_conv1d_update(*dev[:4], dev[4], activation="silu", packed_pairs=True,
                                 block_c=block_c, requests_per_program=rpp,
                                 num_warps=num_warps)  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), want.bfloat16().float(), atol=2e-2, rtol=2e-2)
    # the slots of real rows advanced by the token, padding rows' and free slots untouched
    torch.testing.assert_close(dev[1].cpu(), ref_state.to(state_dtype), atol=0, rtol=0)


def test_packed_decode_refuses_a_call_it_cannot_serve() -> None:
    x, state, w, idx = _case(3, 8)
    with pytest.raises(ValueError, match="packed_pairs: expected one token of a kernel-3 conv"):
        K.causal_conv1d_update(x, state, w, None, idx, update_state=False, packed_pairs=True)
    strided = torch.zeros(state.shape[0], 2, state.shape[1], device=DEV).transpose(1, 2)
    with pytest.raises(ValueError, match=r"packed_pairs: expected each slot's \[C, 2\] packed"):
        K.causal_conv1d_update(x[:, 0], strided, w, None, idx, packed_pairs=True)
    # packed, but a pair straddles two words of its width: the packed kernel loads it as one
    S, C = state.shape[:2]
    odd = torch.zeros(S * C * 2 + 1, device=DEV)[1:].view(S, C, 2)
    with pytest.raises(ValueError, match=r"packed_pairs: expected .* 8-byte aligned pairs"):
        K.causal_conv1d_update(x[:, 0], odd, w, None, idx, packed_pairs=True)


def test_a_misaligned_packed_pool_takes_the_general_kernel(monkeypatch) -> None:
    from attn_plugin_triton_ssm.kernels import conv1d

    monkeypatch.setattr(conv1d, "_conv1d_decode_pairs_kernel", None)  # not to be launched
    x, state, w, idx = _case(3, 8)
    S, C = state.shape[:2]
    odd = torch.empty(S * C * 2 + 1, device=DEV)[1:].view(S, C, 2)
    odd.copy_(state)
    want_state = state.clone()
    want = decode_conv1d(x[:, 0], w, None, want_state, idx, activation="silu")
    got = K.causal_conv1d_update(x[:, 0], odd, w, None, idx, activation="silu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(odd, want_state, atol=0, rtol=0)


def test_a_short_conv_decode_step_takes_the_packed_kernel_by_default(monkeypatch) -> None:
    # the general kernel reads the two state columns as strided loads at 0.53-0.57 of a copy's
    # rate where the packed one reaches 0.82-0.88 (H200): a decode step must not fall back to it
    from attn_plugin_triton_ssm.kernels import conv1d

    seen: list[tuple[str, int]] = []

    def spy(name, kernel):
        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    seen.append((name, kw["RPP"]))
                    return kernel[grid](*a, **kw)

                return launch

        return Spy()

    monkeypatch.setattr(conv1d, "_conv1d_decode_pairs_kernel",
                        spy("packed", conv1d._conv1d_decode_pairs_kernel))  # fmt: skip
    monkeypatch.setattr(
        conv1d, "_conv1d_update_kernel", spy("general", conv1d._conv1d_update_kernel)
    )
    x, state, w, idx = _case(257, 8)
    K.causal_conv1d_update(x[:, 0], state, w, None, idx, activation=None)
    assert seen == [("packed", 4)]  # four requests a program from B = 256, the last one alone
    K.causal_conv1d_update(x, state, w, None, idx, activation=None, update_state=False)
    assert seen[-1][0] == "general"  # a verify step's three tokens


@pytest.mark.parametrize("packed", [True, False])
def test_bad_tilings_strided_bias_and_out_over_x_are_refused(packed) -> None:
    x, state, w, idx = _case(3, 8)
    x1 = x[:, 0].contiguous()
    with pytest.raises(ValueError, match="requests_per_program: expected a positive count"):
        K.causal_conv1d_update(x1, state, w, None, idx, packed_pairs=packed,
                               requests_per_program=0)  # fmt: skip
    # a bias view with a stride: the kernels read [C] contiguous
    bias = torch.randn(8, 2, device=DEV)[:, 0]
    with pytest.raises(ValueError, match="bias"):
        K.causal_conv1d_update(x1, state, w, bias, idx, packed_pairs=packed)
    # the general kernel reads x for the new state after it stored the output
    with pytest.raises(ValueError, match=r"out: must not be x itself"):
        K.causal_conv1d_update(x1, state, w, None, idx, packed_pairs=packed, out=x1)
