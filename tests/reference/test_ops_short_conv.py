"""LFM2's gated short conv through the reference conv op, against transformers' module.

The attention core of a short-conv layer is the causal depthwise conv alone (no activation);
``in_proj``, the ``B * x`` input gate and the ``C *`` output gate stay in the model (the
adapter), as Mamba2's projections and gated norm do. This test builds that split from
transformers' ``Lfm2ShortConv`` weights and checks it against the module's own forward, for a
whole prompt and for the same prompt split over prefill chunks and decode tokens (the conv
state ``[C, K - 1]`` carries it), with and without a conv bias.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attn_core.reference.ops.conv import causal_conv1d

hf_lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
F32 = {"atol": 1e-5, "rtol": 1e-5}
HIDDEN = 24


def _module(kernel: int, bias: bool):
    cfg = hf_lfm2.Lfm2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=kernel,
        conv_bias=bias,
        layer_types=["conv", "full_attention"],
    )
    torch.manual_seed(0)
    layer = hf_lfm2.Lfm2ShortConv(cfg, 0).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return layer


def _split_step(layer, h, pool, lens, initial) -> torch.Tensor:
    """One step of the adapter's split: in_proj, B * x, the core's conv, C *, out_proj."""
    b, c, x = layer.in_proj(h).chunk(3, dim=-1)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    si = torch.arange(len(lens), dtype=torch.int32)
    hi = torch.tensor(initial)
    conv = causal_conv1d(
        (b * x).contiguous(),
        layer.conv.weight.squeeze(1),
        layer.conv.bias,
        pool,
        qsl,
        si,
        hi,
        activation=None,
    )
    return layer.out_proj(c * conv)


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_matches_hf_short_conv(kernel: int, bias: bool) -> None:
    layer = _module(kernel, bias)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, HIDDEN, generator=gen) for n in (13, 2)]
    with torch.no_grad():
        hf = [layer(p[None])[0] for p in prompts]
        # whole prompts, two requests in one step
        pool = torch.full((2, HIDDEN, kernel - 1), float("nan"))  # has_initial_state=False
        whole = _split_step(layer, torch.cat(prompts), pool, [13, 2], [False, False])
        torch.testing.assert_close(whole[:13], hf[0], **F32)
        torch.testing.assert_close(whole[13:], hf[1], **F32)
        # the same tokens over steps: chunks shorter than the kernel, then decode tokens
        pool = torch.zeros(2, HIDDEN, kernel - 1)
        got: list[list[torch.Tensor]] = [[], []]
        done = [0, 0]
        for step, counts in enumerate([(5, 1), (1, 1), (4, 0), *[(1, 0)] * 3]):
            live = [r for r in (0, 1) if counts[r]]
            h = torch.cat([prompts[r][done[r] : done[r] + counts[r]] for r in live])
            sub = pool[live].clone()
            out = _split_step(layer, h, sub, [counts[r] for r in live], [step > 0] * len(live))
            pool[live] = sub
            for r, piece in zip(live, torch.split(out, [counts[r] for r in live]), strict=True):
                got[r].append(piece)
                done[r] += counts[r]
        assert done == [13, 2]
        for r in (0, 1):
            torch.testing.assert_close(torch.cat(got[r]), hf[r], **F32)
