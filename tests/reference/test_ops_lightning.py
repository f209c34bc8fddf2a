"""Reference lightning attention (MiniMax-01) against independent implementations.

Independent ground truth:
- transformers' ``MiniMaxLightningAttention`` (its block-wise prefill path without a cache, and
  its token loop once a cache holds the state), run as a module with its own projections: the
  op is fed the module's activated q, k, v and slopes, the module's norm / gate / out_proj are
  applied to the op's output, and the module's output and cached state are compared.
- fla-core's ``naive_chunk_simple_gla`` with a constant gate ``g = -slope`` (simple GLA with a
  fixed decay is lightning attention).

Also: chunked == recurrent at every chunk size, a prompt split over steps equals it whole, the
per-token states of speculative verify, bfloat16 pools, and the argument checks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attn_core.reference.ops.linear import lightning_attention

fla_sgla = pytest.importorskip("fla.ops.simple_gla.naive")
hf_minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
F32 = {"atol": 1e-4, "rtol": 1e-4}
H, DK, DV = 4, 8, 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(lens: list[int], slots: list[int], initial: list[bool], device: str):
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    si = torch.tensor(slots, dtype=torch.int32, device=device)
    hi = torch.tensor(initial, dtype=torch.bool, device=device)
    return qsl, si, hi


def _tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    # SiLU-activated q, k, v as MiniMax feeds them (mostly positive, so states grow as they do)
    act = torch.nn.functional.silu
    return {
        "q": act(torch.randn(n, H, DK, generator=gen)).to(device),
        "k": act(torch.randn(n, H, DK, generator=gen)).to(device),
        "v": act(torch.randn(n, H, DV, generator=gen)).to(device),
    }


# MiniMax's slopes span three orders of magnitude: 2^-2 .. 2^-8 for 4 heads at layer 0.
SLOPE = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])


def _call(t, pool, qsl, si, hi, **kw):
    return lightning_attention(
        t["q"], t["k"], t["v"], SLOPE.to(t["q"].device), pool, qsl, si, hi, **kw
    )


def _ref(t: dict[str, torch.Tensor], state: torch.Tensor | None):
    """fla's naive chunked simple GLA with g = -slope on every token, scale 1."""
    q, k, v = (t[n].float()[None] for n in ("q", "k", "v"))
    g = (-SLOPE.to(q.device)).expand(q.shape[1], H)[None].contiguous()
    o, s = fla_sgla.naive_chunk_simple_gla(
        q,
        k,
        v,
        g,
        initial_state=None if state is None else state[None].float().clone(),
        output_final_state=True,
        chunk_size=4,
        scale=1.0,
    )
    return o[0], s[0]


def _concat(parts):
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _slice(t, start, end):
    return {key: value[start:end] for key, value in t.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["recurrent", "chunked", "auto"])
def test_ragged_batch_matches_fla_simple_gla(mode: str, device: str) -> None:
    gen = _gen(0)
    lens, slots, initial = [37, 1, 20, 2], [3, 0, 5, 1], [True, True, False, False]
    requests = [_tokens(n, gen, device) for n in lens]
    pool = torch.randn(6, H, DK, DV, generator=gen).to(device) * 0.3
    before = pool.clone()
    out = _call(
        _concat(requests), pool, *_batch(lens, slots, initial, device), mode=mode, chunk_size=16
    )
    offsets = [0, *itertools.accumulate(lens)]
    for b, tokens in enumerate(requests):
        ref_o, ref_s = _ref(tokens, before[slots[b]] if initial[b] else None)
        torch.testing.assert_close(out[offsets[b] : offsets[b + 1]], ref_o, **F32)
        torch.testing.assert_close(pool[slots[b]], ref_s, **F32)
    untouched = [s for s in range(6) if s not in slots]
    torch.testing.assert_close(pool[untouched], before[untouched], atol=0, rtol=0)


def _hf_layer(block_size: int, layer_idx: int = 1):
    cfg = hf_minimax.MiniMaxConfig(
        hidden_size=32,
        num_attention_heads=H,
        head_dim=DK,
        num_hidden_layers=4,
        block_size=block_size,
        layer_types=["full_attention", "linear_attention"] * 2,
    )
    torch.manual_seed(0)
    layer = hf_minimax.MiniMaxLightningAttention(cfg, layer_idx).eval()
    for p in layer.parameters():  # spread weights so the decay really shapes the output
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _hf_qkv(layer, hidden: torch.Tensor):
    qkv = layer.act_fn(layer.qkv_proj(hidden)).view(hidden.shape[0], H, 3 * DK)
    return [t.contiguous() for t in torch.split(qkv, DK, dim=-1)]


def _hf_post(layer, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    o = layer.norm(o.reshape(o.shape[0], -1))
    return layer.out_proj(torch.sigmoid(layer.output_gate(hidden)) * o)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_matches_hf_minimax_prefill_then_decode(mode: str) -> None:
    """A 19-token prompt (block size 8: two whole blocks and a partial one) through HF's block
    path, then three decode tokens through its cached token loop; the op with the module's
    q, k, v and ``slope_rate`` matches every output and the cached state ``[H, Dk, Dv]``."""
    layer = _hf_layer(block_size=8)
    slope = layer.slope_rate[:, 0, 0]
    assert slope.shape == (H,) and bool((slope > 0).all())
    gen = _gen(1)
    hidden = torch.randn(22, 32, generator=gen)
    cache = hf_minimax.MiniMaxCache()
    with torch.no_grad():
        # the cache positionally: its keyword is past_key_values before transformers 5.24,
        # cache from 5.24 on (a keyword the module does not take is swallowed by **kwargs)
        hf_prefill, _ = layer(hidden[None, :19], None, None, cache)
        steps = (19, 20, 21)
        hf_decode = [layer(hidden[None, t : t + 1], None, None, cache)[0] for t in steps]
        q, k, v = _hf_qkv(layer, hidden)
        pool = torch.zeros(1, H, DK, DK)  # MiniMax: value heads as wide as key heads
        meta = _batch([19], [0], [False], "cpu")
        o = lightning_attention(q[:19], k[:19], v[:19], slope, pool, *meta, mode=mode, chunk_size=8)
        torch.testing.assert_close(_hf_post(layer, hidden[:19], o), hf_prefill[0], **F32)
        for i, t in enumerate(steps):
            meta = _batch([1], [0], [True], "cpu")
            o = lightning_attention(q[t : t + 1], k[t : t + 1], v[t : t + 1], slope, pool, *meta)
            torch.testing.assert_close(
                _hf_post(layer, hidden[t : t + 1], o), hf_decode[i][0], **F32
            )
    torch.testing.assert_close(pool[0], cache.get_linear_cache(1)[0], **F32)


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunked_equals_recurrent_at_every_chunk_size(chunk_size: int) -> None:
    """Also with decays strong enough (slope 8: e^-8 per token) that a chunk forgets itself."""
    gen = _gen(2)
    t = _tokens(50, gen, "cpu")
    slope = torch.tensor([8.0, 1.0, 2.0**-4, 1e-4])
    state = torch.randn(1, H, DK, DV, generator=gen)
    outs = []
    pools = []
    for mode in ("recurrent", "chunked"):
        pool = state.clone()
        meta = _batch([50], [0], [True], "cpu")
        outs.append(
            lightning_attention(
                t["q"], t["k"], t["v"], slope, pool, *meta, mode=mode, chunk_size=chunk_size
            )
        )
        pools.append(pool)
    torch.testing.assert_close(outs[1], outs[0], **F32)
    torch.testing.assert_close(pools[1], pools[0], **F32)
    assert torch.isfinite(outs[1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_split_prompt_equals_whole(device: str) -> None:
    """Prefill chunks, a mixed step and decode steps carry the state as one whole prompt does;
    a padding request (slot -1) writes zeros and touches no slot."""
    gen = _gen(3)
    lens, slots = [45, 30], [3, 1]
    requests = [_tokens(n, gen, device) for n in lens]
    whole_pool = torch.zeros(4, H, DK, DV, device=device)
    whole = _call(
        _concat(requests), whole_pool, *_batch(lens, slots, [False, False], device), chunk_size=16
    )
    whole_out = list(torch.split(whole, lens))
    schedule = [(20, 11), (17, 1), (1, 12), *[(1, 1)] * 6, (1, 0)]
    pool = torch.randn(4, H, DK, DV, generator=gen).to(device)
    spare = pool[[0, 2]].clone()
    done = [0, 0]
    outs: list[list[torch.Tensor]] = [[], []]
    for step, counts in enumerate(schedule):
        live = [b for b in (0, 1) if counts[b] > 0]
        parts = [_slice(requests[b], done[b], done[b] + counts[b]) for b in live]
        parts.append(_tokens(2, gen, device))
        step_lens = [counts[b] for b in live] + [2]
        batch = _batch(
            step_lens, [slots[b] for b in live] + [-1], [step > 0] * len(live) + [True], device
        )
        out = _call(
            _concat(parts), pool, *batch, chunk_size=16, mode="recurrent" if step % 2 else "auto"
        )
        pieces = torch.split(out, step_lens)
        for b, piece in zip(live, pieces, strict=False):
            outs[b].append(piece)
            done[b] += counts[b]
        assert torch.count_nonzero(pieces[-1]) == 0
    for b in (0, 1):
        torch.testing.assert_close(torch.cat(outs[b]), whole_out[b], **F32)
    torch.testing.assert_close(pool[slots], whole_pool[slots], **F32)
    torch.testing.assert_close(pool[[0, 2]], spare, atol=0, rtol=0)


def test_intermediate_states_are_prefix_states() -> None:
    gen = _gen(4)
    lens, slots, initial = [5, 3], [1, 0], [True, False]
    requests = [_tokens(n, gen, "cpu") for n in lens]
    pool = torch.randn(2, H, DK, DV, generator=gen) * 0.3
    before = pool.clone()
    inter = torch.full((2, 6, H, DK, DV), math.nan)
    tokens = _concat(requests)
    out = _call(tokens, pool, *_batch(lens, slots, initial, "cpu"), intermediate_states=inter)
    plain_pool = before.clone()
    plain = _call(tokens, plain_pool, *_batch(lens, slots, initial, "cpu"))
    torch.testing.assert_close(out, plain, **F32)
    torch.testing.assert_close(pool, plain_pool, **F32)
    for b, t in enumerate(requests):
        start = before[slots[b]] if initial[b] else None
        for i in range(lens[b]):
            _, ref_state = _ref(_slice(t, 0, i + 1), start)
            torch.testing.assert_close(inter[b, i], ref_state, **F32)
        assert torch.isnan(inter[b, lens[b] :]).all()


def test_bf16_inputs_and_pool() -> None:
    gen = _gen(5)
    lens, slots = [21, 1], [0, 1]
    requests = [{k: v.to(torch.bfloat16) for k, v in _tokens(n, gen, "cpu").items()} for n in lens]
    pool = (torch.randn(2, H, DK, DV, generator=gen) * 0.3).to(torch.bfloat16)
    before = pool.clone()
    out = _call(_concat(requests), pool, *_batch(lens, slots, [True, True], "cpu"))
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    offsets = [0, *itertools.accumulate(lens)]
    for b, t in enumerate(requests):
        ref_o, ref_s = _ref(t, before[slots[b]].float())
        got = out[offsets[b] : offsets[b + 1]].float()
        torch.testing.assert_close(got, ref_o, atol=5e-2, rtol=1e-2)
        torch.testing.assert_close(pool[slots[b]].float(), ref_s, atol=5e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slope": torch.ones(H + 1)}, "slope"),
        ({"k": torch.ones(3, H - 1, DK)}, "k"),
        ({"pool": torch.zeros(2, H, DK, DV + 1)}, "ssm_state"),
    ],
)
def test_bad_arguments_name_the_tensor(change: dict, message: str) -> None:
    t = _tokens(3, _gen(6), "cpu")
    args = {**t, "slope": SLOPE, "pool": torch.zeros(2, H, DK, DV)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        lightning_attention(
            args["q"],
            args["k"],
            args["v"],
            args["slope"],
            args["pool"],
            *_batch([3], [0], [False], "cpu"),
        )
