"""Reference linear-attention / SSM ops against independent implementations.

Independent ground truth:
- Gated DeltaNet: fla-core's ``naive_recurrent_gated_delta_rule`` /
  ``naive_chunk_gated_delta_rule`` and transformers' Qwen3-Next
  ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``.
- KDA: fla-core's ``naive_recurrent_kda`` / ``naive_chunk_kda`` and transformers' Kimi-Linear
  ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``.
- Mamba2: transformers' Mamba2 ``mamba2_chunk_scan`` (segsum SSD) and
  ``mamba2_selective_state_update`` (decode step).
- Mamba1: fla-core's ``naive_recurrent_gla`` (Mamba1 is GLA with one head per channel, a
  per-state-entry gate ``dt * A``, ``q = C``, ``k = B``, ``v = dt * x``), transformers' Mamba
  ``mamba_selective_scan`` (prefill) and ``mamba_selective_state_update`` (decode step).
- causal conv1d: ``torch.nn.functional.conv1d`` and transformers' ``causal_conv1d_update``.

The transformers functions are wrapped by a hub-kernel decorator that swaps in fla's / mamba_ssm's
Triton kernels when those packages import (fla does, here): ``inspect.unwrap`` gets the torch code.
All these references take one padded batch ``[B, T, ...]``; the ops take a varlen batch, so each
request is compared with a reference call of batch 1.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from attn_core.reference.ops.linear import (
    causal_conv1d,
    gated_delta_rule,
    kda,
    mamba1_selective_scan,
    mamba2_ssd,
)

fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")
fla_kda = pytest.importorskip("fla.ops.kda.naive")
hf_qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
hf_mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
hf_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

hf_gdn_chunk = inspect.unwrap(hf_qwen3_next.torch_chunk_gated_delta_rule)
hf_gdn_recurrent = inspect.unwrap(hf_qwen3_next.torch_recurrent_gated_delta_rule)
hf_conv_update = inspect.unwrap(hf_qwen3_next.causal_conv1d_update)
hf_kda_chunk = inspect.unwrap(hf_kimi.chunk_kimi_delta_attention)
hf_kda_recurrent = inspect.unwrap(hf_kimi.recurrent_kimi_delta_attention)
hf_mamba2_scan = inspect.unwrap(hf_mamba2.mamba2_chunk_scan)
hf_mamba2_step = inspect.unwrap(hf_mamba2.mamba2_selective_state_update)
fla_gla = pytest.importorskip("fla.ops.gla.naive")
hf_mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
hf_mamba1_scan = inspect.unwrap(hf_mamba.mamba_selective_scan)
hf_mamba1_step = inspect.unwrap(hf_mamba.mamba_selective_state_update)

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

# Head layout of the small test layers: GVA with two value heads per query/key head.
HK, HV, DK, DV = 2, 4, 8, 6
# Mamba2: heads, head dim, groups, state size.
MH, MP, MG, MN = 4, 6, 2, 8
CONV_C, CONV_K = 12, 4
# Mamba1: inner channels (one head each), state size.
M1D, M1N = 6, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device)


def _batch(
    lens: list[int], slots: list[int], initial: list[bool], device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    si = torch.tensor(slots, dtype=torch.int32, device=device)
    hi = torch.tensor(initial, dtype=torch.bool, device=device)
    return qsl, si, hi


# --------------------------------------------------------------------------------------------
# Variants: per-token inputs, a call of the op, and an independent reference for one request
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    state_shape: tuple[int, ...]
    make: Callable[[int, torch.Generator, str], dict[str, torch.Tensor]]
    call: Callable[..., torch.Tensor]
    # (per-token inputs of one request, initial state or None) -> (outputs, final state)
    reference: Callable[
        [dict[str, torch.Tensor], torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
    ]


def _gdn_tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    return {
        "q": _randn(gen, n, HK, DK, device=device),
        "k": _randn(gen, n, HK, DK, device=device),
        "v": _randn(gen, n, HV, DV, device=device),
        # log decays from about -3 to 0: strong enough to matter, weak enough to keep memory.
        "g": F.logsigmoid(_randn(gen, n, HV, device=device) + 2.0),
        "beta": torch.sigmoid(_randn(gen, n, HV, device=device)),
    }


def _kda_tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    tokens = _gdn_tokens(n, gen, device)
    tokens["g"] = F.logsigmoid(_randn(gen, n, HV, DK, device=device) + 2.0)
    return tokens


def _mamba2_tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    return {
        "x": _randn(gen, n, MH, MP, device=device),
        "dt": _randn(gen, n, MH, device=device),
        "B": _randn(gen, n, MG, MN, device=device),
        "C": _randn(gen, n, MG, MN, device=device),
    }


def _conv_tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    return {"x": _randn(gen, n, CONV_C, device=device)}


# Layer parameters, fixed per test run (device moved on use).
_PARAMS_GEN = _gen(1234)
MAMBA2_PARAMS = {
    "A_log": torch.randn(MH, generator=_PARAMS_GEN) * 0.5,
    "D": torch.randn(MH, generator=_PARAMS_GEN),
    "dt_bias": torch.randn(MH, generator=_PARAMS_GEN),
}
CONV_PARAMS = {
    "weight": torch.randn(CONV_C, CONV_K, generator=_PARAMS_GEN),
    "bias": torch.randn(CONV_C, generator=_PARAMS_GEN),
}


def _on(params: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in params.items()}


def _call_gdn(t, pool, qsl, si, hi, **kw):
    return gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, qsl, si, hi, **kw)


def _call_kda(t, pool, qsl, si, hi, **kw):
    return kda(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, qsl, si, hi, **kw)


def _call_mamba2(t, pool, qsl, si, hi, **kw):
    p = _on(MAMBA2_PARAMS, t["x"].device)
    return mamba2_ssd(
        t["x"], t["dt"], p["A_log"], t["B"], t["C"], p["D"], p["dt_bias"], pool, qsl, si, hi, **kw
    )


def _call_conv(t, pool, qsl, si, hi, **kw):
    p = _on(CONV_PARAMS, t["x"].device)
    kw = {key: value for key, value in kw.items() if key == "out"}
    return causal_conv1d(t["x"], p["weight"], p["bias"], pool, qsl, si, hi, **kw)


def _f32(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.float() for key, value in t.items()}


def _ref_gdn(t, state):
    """fla's naive recurrent GDN (no GVA, no l2norm inside: both done here)."""
    t = _f32(t)
    group = HV // HK
    q = F.normalize(t["q"], dim=-1, eps=1e-12).repeat_interleave(group, 1)
    k = F.normalize(t["k"], dim=-1, eps=1e-12).repeat_interleave(group, 1)
    o, s = fla_gdn.naive_recurrent_gated_delta_rule(
        q[None],
        k[None],
        t["v"][None],
        t["beta"][None],
        t["g"][None],
        scale=DK**-0.5,
        initial_state=None if state is None else state[None].float(),
        output_final_state=True,
    )
    return o[0], s[0]


def _ref_kda(t, state):
    t = _f32(t)
    q, k = F.normalize(t["q"], dim=-1, eps=1e-12), F.normalize(t["k"], dim=-1, eps=1e-12)
    o, s = fla_kda.naive_recurrent_kda(
        q[None],
        k[None],
        t["v"][None],
        t["g"][None],
        t["beta"][None],
        scale=DK**-0.5,
        initial_state=None if state is None else state[None].float(),
        output_final_state=True,
    )
    return o[0], s[0]


def _ref_mamba2(t, state, chunk_size=16):
    """HF Mamba2 segsum scan; its state is [H, P, N], ours [H, N, P]."""
    t = _f32(t)
    p = _on(MAMBA2_PARAMS, t["x"].device)
    y, s = hf_mamba2_scan(
        t["x"][None],
        t["dt"][None],
        -p["A_log"].exp(),
        t["B"][None],
        t["C"][None],
        chunk_size,
        D=p["D"],
        dt_bias=p["dt_bias"],
        initial_states=None if state is None else state[None].float().transpose(-1, -2),
        dt_softplus=True,
        return_final_states=True,
    )
    return y[0], s[0].transpose(-1, -2)


def _ref_conv(t, state):
    p = _on(CONV_PARAMS, t["x"].device)
    x = t["x"].float().t()[None]  # [1, C, L]
    if state is None:
        state = torch.zeros(CONV_C, CONV_K - 1, device=x.device)
    state = state.float().clone()[None]
    y = hf_conv_update(x, state, p["weight"], p["bias"], "silu")
    return y[0].t(), state[0]


# -- Mamba1 ----------------------------------------------------------------------------------
def _mamba1_tokens(n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    return {
        "x": _randn(gen, n, M1D, 1, device=device),
        "dt": _randn(gen, n, M1D, device=device),
        "B": _randn(gen, n, 1, M1N, device=device),
        "C": _randn(gen, n, 1, M1N, device=device),
    }


MAMBA1_PARAMS = {
    # S4D-real init, A = -(1..N) per channel, perturbed so that channels differ
    "A_log": torch.arange(1, M1N + 1).float().log().expand(M1D, -1)
    + torch.randn(M1D, M1N, generator=_PARAMS_GEN) * 0.3,
    "D": torch.randn(M1D, generator=_PARAMS_GEN),
    "dt_bias": torch.randn(M1D, generator=_PARAMS_GEN),
}


def _call_mamba1(t, pool, qsl, si, hi, **kw):
    p = _on(MAMBA1_PARAMS, t["x"].device)
    return mamba1_selective_scan(
        t["x"], t["dt"], p["A_log"], t["B"], t["C"], p["D"], p["dt_bias"], pool, qsl, si, hi, **kw
    )


def _ref_mamba1(t, state):
    """fla's naive recurrent GLA: one head per channel, K = N, V = 1; its state [H, K, V] is
    ours. It scales q by K^-0.5, undone here."""
    t = _f32(t)
    p = _on(MAMBA1_PARAMS, t["x"].device)
    dt = F.softplus(t["dt"] + p["dt_bias"])  # [L, H]
    gk = dt[..., None] * -p["A_log"].exp()  # [L, H, N]
    n = t["x"].shape[0]
    q = t["C"].expand(n, M1D, M1N) * M1N**0.5
    k = t["B"].expand(n, M1D, M1N)
    v = t["x"] * dt[..., None]
    o, s = fla_gla.naive_recurrent_gla(
        q[None],
        k[None],
        v[None],
        gk[None],
        initial_state=None if state is None else state[None].float(),
        output_final_state=True,
    )
    return o[0] + t["x"] * p["D"][:, None], s[0]


GDN = Variant("gdn", (HV, DK, DV), _gdn_tokens, _call_gdn, _ref_gdn)
KDA = Variant("kda", (HV, DK, DV), _kda_tokens, _call_kda, _ref_kda)
MAMBA2 = Variant("mamba2", (MH, MN, MP), _mamba2_tokens, _call_mamba2, _ref_mamba2)
MAMBA1 = Variant("mamba1", (M1D, M1N, 1), _mamba1_tokens, _call_mamba1, _ref_mamba1)
CONV = Variant("conv", (CONV_C, CONV_K - 1), _conv_tokens, _call_conv, _ref_conv)
SSM_VARIANTS = [GDN, KDA, MAMBA2, MAMBA1]
ALL_VARIANTS = [*SSM_VARIANTS, CONV]
_IDS = [v.name for v in ALL_VARIANTS]


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _slice(t: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {key: value[start:end] for key, value in t.items()}


# --------------------------------------------------------------------------------------------
# Ragged batches with mixed has_initial_state, against the independent references
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["recurrent", "chunked", "auto"])
@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=_IDS)
def test_ragged_batch_matches_reference(variant: Variant, mode: str, device: str) -> None:
    if variant is CONV and mode != "auto":
        pytest.skip("conv has one form")
    gen = _gen(0)
    # Lengths cross chunk boundaries (chunk 16), include a decode token and one shorter than
    # the conv width; slots are permuted inside a larger pool.
    lens, slots, initial = [37, 1, 20, 2], [3, 0, 5, 1], [True, True, False, False]
    requests = [variant.make(n, gen, device) for n in lens]
    pool = _randn(gen, 6, *variant.state_shape, device=device)
    if variant is not CONV:
        pool = pool * 0.3
    before = pool.clone()
    out = variant.call(
        _concat(requests), pool, *_batch(lens, slots, initial, device), mode=mode, chunk_size=16
    )
    offsets = [0, *itertools.accumulate(lens)]
    for b, tokens in enumerate(requests):
        ref_o, ref_s = variant.reference(tokens, before[slots[b]] if initial[b] else None)
        torch.testing.assert_close(out[offsets[b] : offsets[b + 1]], ref_o, **F32)
        torch.testing.assert_close(pool[slots[b]], ref_s, **F32)
    untouched = [s for s in range(6) if s not in slots]
    torch.testing.assert_close(pool[untouched], before[untouched], atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_gdn_matches_hf_qwen3_next(mode: str, device: str) -> None:
    """Native GVA and in-kernel l2norm as Qwen3-Next runs them (batch of one request).

    Only our op runs on ``device``; the HF reference always runs on CPU. Its key heads are
    expanded to the value heads first (value head ``h`` reads key head ``h // (HV // HK)``, as the
    Qwen3-Next layer does): some transformers releases' torch path has no GVA of its own and fails
    on ``HK != HV`` inputs, and the expansion is a no-op for those that do."""
    gen = _gen(1)
    t = _gdn_tokens(45, gen, "cpu")
    state = _randn(gen, HV, DK, DV) * 0.3
    pool = state[None].clone().to(device)
    dev_t = {name: x.to(device) for name, x in t.items()}
    out = _call_gdn(dev_t, pool, *_batch([45], [0], [True], device), mode=mode, chunk_size=16)
    q, k = (t[name].repeat_interleave(HV // HK, dim=1) for name in ("q", "k"))
    args = (q[None], k[None], t["v"][None], t["g"][None], t["beta"][None])
    kw = {"initial_state": state[None].clone(), "output_final_state": True}
    chunk_o, chunk_s = hf_gdn_chunk(*args, chunk_size=16, use_qk_l2norm_in_kernel=True, **kw)
    rec_o, rec_s = hf_gdn_recurrent(*args, use_qk_l2norm_in_kernel=True, **kw)
    for ref_o, ref_s in ((chunk_o, chunk_s), (rec_o, rec_s)):
        torch.testing.assert_close(out.cpu(), ref_o[0].float(), **F32)
        torch.testing.assert_close(pool[0].cpu(), ref_s[0].float(), **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_default_chunk_matches_fla_naive_chunk(device: str) -> None:
    """Default chunk size 64 over two chunks, explicit scale, l2norm off, vs fla's chunk form."""
    gen = _gen(2)
    n, scale = 70, 0.3
    t = _gdn_tokens(n, gen, device)
    k = F.normalize(t["k"], dim=-1)  # without in-kernel l2norm, keep the delta rule contractive
    state = _randn(gen, HV, DK, DV, device=device) * 0.3
    pool = state[None].clone()
    out = gated_delta_rule(
        t["q"],
        k,
        t["v"],
        t["g"],
        t["beta"],
        pool,
        *_batch([n], [0], [True], device),
        scale=scale,
        use_qk_l2norm=False,
    )
    group = HV // HK
    ref_o, ref_s = fla_gdn.naive_chunk_gated_delta_rule(
        t["q"].repeat_interleave(group, 1)[None],
        k.repeat_interleave(group, 1)[None],
        t["v"][None],
        t["g"][None],
        t["beta"][None],
        chunk_size=64,
        scale=scale,
        initial_state=state[None].clone(),
        output_final_state=True,
    )
    torch.testing.assert_close(out, ref_o[0], **F32)
    torch.testing.assert_close(pool[0], ref_s[0], **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_kda_matches_fla_naive_chunk(device: str) -> None:
    gen = _gen(3)
    n = 32  # fla's naive chunk form needs whole chunks
    t = _kda_tokens(n, gen, device)
    state = _randn(gen, HV, DK, DV, device=device) * 0.3
    pool = state[None].clone()
    out = _call_kda(t, pool, *_batch([n], [0], [True], device), mode="chunked", chunk_size=16)
    q, k = F.normalize(t["q"], dim=-1, eps=1e-12), F.normalize(t["k"], dim=-1, eps=1e-12)
    ref_o, ref_s = fla_kda.naive_chunk_kda(
        q[None],
        k[None],
        t["v"][None],
        t["g"][None],
        t["beta"][None],
        initial_state=state[None].clone(),
        output_final_state=True,
        chunk_size=16,
    )
    torch.testing.assert_close(out, ref_o[0], **F32)
    torch.testing.assert_close(pool[0], ref_s[0], **F32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_kda_matches_hf_kimi_linear(mode: str, device: str) -> None:
    """The op as Kimi-Linear's KDA layer calls it: in-kernel l2norm of q and k (eps inside the
    sqrt), scale ``Dk ** -0.5``, the per-channel log gate as given, the state decayed before the
    delta update; a length that is no whole number of chunks, from a non-zero state.

    Kimi-Linear has as many key as value heads; the key heads are expanded first (see
    :func:`test_gdn_matches_hf_qwen3_next`), so the op's grouped heads are covered too."""
    gen = _gen(4)
    n = 45
    t = _kda_tokens(n, gen, "cpu")
    state = _randn(gen, HV, DK, DV) * 0.3
    pool = state[None].clone().to(device)
    dev_t = {name: x.to(device) for name, x in t.items()}
    out = _call_kda(dev_t, pool, *_batch([n], [0], [True], device), mode=mode, chunk_size=16)
    q, k = (t[name].repeat_interleave(HV // HK, dim=1) for name in ("q", "k"))
    args = (q[None], k[None], t["v"][None], t["g"][None], t["beta"][None])
    kw = {"initial_state": state[None].clone(), "output_final_state": True}
    chunk_o, chunk_s = hf_kda_chunk(*args, chunk_size=16, use_qk_l2norm_in_kernel=True, **kw)
    rec_o, rec_s = hf_kda_recurrent(*args, use_qk_l2norm_in_kernel=True, **kw)
    for ref_o, ref_s in ((chunk_o, chunk_s), (rec_o, rec_s)):
        torch.testing.assert_close(out.cpu(), ref_o[0].float(), **F32)
        torch.testing.assert_close(pool[0].cpu(), ref_s[0].float(), **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_mamba2_decode_matches_hf_selective_state_update(device: str) -> None:
    """A decode batch (one token per request) against HF's single-step update, as Mamba2Mixer
    calls it (per-channel expanded dt / A / D, state [B, H, P, N])."""
    gen = _gen(4)
    batch = 3
    t = _mamba2_tokens(batch, gen, device)
    p = _on(MAMBA2_PARAMS, torch.device(device))
    pool = _randn(gen, 5, MH, MN, MP, device=device) * 0.3
    slots = [4, 0, 2]
    hf_state = pool[slots].transpose(-1, -2).clone()
    out = _call_mamba2(t, pool, *_batch([1] * batch, slots, [True] * batch, device), mode="auto")
    ref = hf_mamba2_step(
        hf_state,
        t["x"],
        t["dt"][:, :, None].expand(-1, -1, MP),
        (-p["A_log"].exp())[:, None, None].expand(-1, MP, MN),
        t["B"],
        t["C"],
        D=p["D"][:, None].expand(-1, MP),
        dt_bias=p["dt_bias"][:, None].expand(-1, MP),
        dt_softplus=True,
    )
    torch.testing.assert_close(out, ref, **F32)
    torch.testing.assert_close(pool[slots], hf_state.transpose(-1, -2), **F32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_mamba1_matches_hf_mamba_selective_scan(mode: str, device: str) -> None:
    """Prefill from a zero state as MambaMixer runs it: x / dt ``[B, D, L]``, A ``[D, N]``,
    B / C ``[B, N, L]``, ``delta_bias = dt_proj.bias``, softplus, D skip (the z gate is the
    adapter's). The HF torch path runs on CPU only."""
    gen = _gen(11)
    t = _mamba1_tokens(37, gen, "cpu")
    p = MAMBA1_PARAMS
    pool = _randn(gen, 2, M1D, M1N, 1, device=device)  # garbage: has_initial_state=False
    dev_t = {name: x.to(device) for name, x in t.items()}
    out = _call_mamba1(dev_t, pool, *_batch([37], [1], [False], device), mode=mode, chunk_size=8)
    y, s = hf_mamba1_scan(
        t["x"][..., 0].T[None],
        t["dt"].T[None],
        -p["A_log"].exp(),
        t["B"][:, 0].T[None],
        t["C"][:, 0].T[None],
        D=p["D"],
        delta_bias=p["dt_bias"],
        delta_softplus=True,
        return_last_state=True,
    )
    torch.testing.assert_close(out[..., 0].cpu(), y[0].T, **F32)
    torch.testing.assert_close(pool[1, ..., 0].cpu(), s[0], **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_mamba1_decode_matches_hf_selective_state_update(device: str) -> None:
    """A decode batch against HF's single-step update (state ``[B, D, N]``, ours
    ``[B, D, N, 1]``)."""
    gen = _gen(12)
    batch = 3
    t = _mamba1_tokens(batch, gen, device)
    p = _on(MAMBA1_PARAMS, torch.device(device))
    pool = _randn(gen, 5, M1D, M1N, 1, device=device) * 0.3
    slots = [4, 0, 2]
    hf_state = pool[slots, ..., 0].clone()
    out = _call_mamba1(t, pool, *_batch([1] * batch, slots, [True] * batch, device), mode="auto")
    ref = hf_mamba1_step(
        hf_state,
        t["x"][..., 0],
        t["dt"],
        -p["A_log"].exp(),
        t["B"][:, 0],
        t["C"][:, 0],
        D=p["D"],
        dt_bias=p["dt_bias"],
        dt_softplus=True,
    )
    torch.testing.assert_close(out[..., 0], ref, **F32)
    torch.testing.assert_close(pool[slots, ..., 0], hf_state, **F32)


def test_mamba1_chunked_equals_recurrent_with_strong_decay() -> None:
    """Large dt (decays of e^-50 per token and beyond) over many small chunks: the pairwise
    form must not overflow where a ratio of cumulative decays would; no D / dt_bias."""
    gen = _gen(13)
    t = _mamba1_tokens(50, gen, "cpu")
    dt = t["dt"] * 4 + 6
    a_log = MAMBA1_PARAMS["A_log"]
    results = []
    for mode in ("recurrent", "chunked"):
        pool = _randn(_gen(14), 1, M1D, M1N, 1)
        y = mamba1_selective_scan(
            t["x"], dt, a_log, t["B"], t["C"], None, None, pool,
            *_batch([50], [0], [True], "cpu"), mode=mode, chunk_size=7,
        )  # fmt: skip
        assert torch.isfinite(y).all()
        results.append((y, pool))
    torch.testing.assert_close(results[1][0], results[0][0], **F32)
    torch.testing.assert_close(results[1][1], results[0][1], **F32)


def test_mamba1_shapes_are_checked() -> None:
    t = _mamba1_tokens(3, _gen(15), "cpu")
    pool = torch.zeros(1, M1D, M1N, 1)
    meta = _batch([3], [0], [False], "cpu")
    with pytest.raises(ValueError, match="A_log"):
        mamba1_selective_scan(
            t["x"], t["dt"], torch.zeros(M1D), t["B"], t["C"], None, None, pool, *meta
        )
    with pytest.raises(ValueError, match="B"):
        mamba1_selective_scan(
            t["x"], t["dt"], MAMBA1_PARAMS["A_log"], t["B"].expand(3, 2, M1N), t["C"],
            None, None, pool, *meta,
        )  # fmt: skip


def test_mamba2_chunked_equals_recurrent_with_dt_limit() -> None:
    """Strong decays over many small chunks, a dt clamp, no D / dt_bias, one group."""
    gen = _gen(5)
    n = 50
    x, dt = _randn(gen, n, MH, MP), _randn(gen, n, MH) + 1.0
    b, c = _randn(gen, n, 1, MN), _randn(gen, n, 1, MN)
    a_log = torch.full((MH,), 1.0)
    results = []
    for mode in ("recurrent", "chunked"):
        pool = torch.zeros(1, MH, MN, MP)
        y = mamba2_ssd(
            x,
            dt,
            a_log,
            b,
            c,
            None,
            None,
            pool,
            *_batch([n], [0], [False], "cpu"),
            dt_limit=(0.0, 1.5),
            chunk_size=8,
            mode=mode,
        )
        results.append((y, pool))
    torch.testing.assert_close(results[0][0], results[1][0], **F32)
    torch.testing.assert_close(results[0][1], results[1][1], **F32)
    # The clamp is applied: dt = 1.5 everywhere dt was large gives a different result than none.
    pool = torch.zeros(1, MH, MN, MP)
    unclamped = mamba2_ssd(
        x, dt, a_log, b, c, None, None, pool, *_batch([n], [0], [False], "cpu"), chunk_size=8
    )
    assert not torch.allclose(unclamped, results[1][0], atol=1e-3)


# --------------------------------------------------------------------------------------------
# causal conv1d against torch's conv1d
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_prefill_matches_torch_conv1d(activation: str | None, device: str) -> None:
    gen = _gen(6)
    lens = [9, 2, 1]
    x = _randn(gen, sum(lens), CONV_C, device=device)
    weight = _randn(gen, CONV_C, CONV_K, device=device)
    bias = _randn(gen, CONV_C, device=device) if activation else None
    pool = _randn(gen, 3, CONV_C, CONV_K - 1, device=device)  # garbage: must be ignored
    out = causal_conv1d(
        x,
        weight,
        bias,
        pool,
        *_batch(lens, [2, 0, 1], [False] * 3, device),
        activation=activation,
    )
    offsets = [0, *itertools.accumulate(lens)]
    for b, slot in enumerate([2, 0, 1]):
        xb = x[offsets[b] : offsets[b + 1]].t()[None]  # [1, C, L]
        ref = F.conv1d(xb, weight[:, None, :], bias, padding=CONV_K - 1, groups=CONV_C)
        ref = ref[0, :, : lens[b]].t()
        if activation:
            ref = F.silu(ref)
        torch.testing.assert_close(out[offsets[b] : offsets[b + 1]], ref, **F32)
        padded = F.pad(xb[0], (CONV_K - 1, 0))  # zeros, then the inputs
        torch.testing.assert_close(pool[slot], padded[:, -(CONV_K - 1) :], atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Life-cycle: one prefill == prefill + chunks + decodes, state carried through the pool
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=_IDS)
def test_lifecycle_split_equals_whole(variant: Variant, device: str) -> None:
    gen = _gen(7)
    lens = [45, 30]
    slots = [3, 1]
    requests = [variant.make(n, gen, device) for n in lens]
    # Whole prompts in one step.
    whole_pool = torch.zeros(4, *variant.state_shape, device=device)
    whole = variant.call(
        _concat(requests), whole_pool, *_batch(lens, slots, [False, False], device), chunk_size=16
    )
    whole_out = list(torch.split(whole, lens))

    # The same tokens over several steps: a first prefill chunk, a mixed step (a chunk and a
    # decode token), then decode steps whose batch shrinks as request 1 finishes. Step 0's pool
    # holds garbage in the slots (has_initial_state=False must ignore it); a padding request
    # (slot -1) rides along in every step.
    schedule = [(20, 11), (17, 1), (1, 12), *[(1, 1)] * 6, (1, 0)]
    assert [sum(c) for c in zip(*schedule, strict=True)] == lens
    pool = _randn(gen, 4, *variant.state_shape, device=device)
    spare = pool[[0, 2]].clone()
    done = [0, 0]
    outs: list[list[torch.Tensor]] = [[], []]
    for step, counts in enumerate(schedule):
        live = [b for b in (0, 1) if counts[b] > 0]
        parts = [_slice(requests[b], done[b], done[b] + counts[b]) for b in live]
        parts.append(variant.make(2, gen, device))  # the padding request's tokens
        step_lens = [counts[b] for b in live] + [2]
        step_slots = [slots[b] for b in live] + [-1]
        batch = _batch(step_lens, step_slots, [step > 0] * len(live) + [True], device)
        mode = "recurrent" if step % 2 else "auto"
        out = variant.call(_concat(parts), pool, *batch, chunk_size=16, mode=mode)
        pieces = torch.split(out, step_lens)
        for b, piece in zip(live, pieces, strict=False):
            outs[b].append(piece)
            done[b] += counts[b]
        assert torch.count_nonzero(pieces[-1]) == 0  # the padding request writes zeros
    for b in (0, 1):
        torch.testing.assert_close(torch.cat(outs[b]), whole_out[b], **F32)
    torch.testing.assert_close(pool[slots], whole_pool[slots], **F32)
    torch.testing.assert_close(pool[[0, 2]], spare, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Speculative verify: the state after every token
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", SSM_VARIANTS, ids=[v.name for v in SSM_VARIANTS])
def test_intermediate_states_are_prefix_states(variant: Variant, device: str) -> None:
    gen = _gen(8)
    lens, slots, initial = [5, 3], [1, 0], [True, False]
    requests = [variant.make(n, gen, device) for n in lens]
    pool = _randn(gen, 2, *variant.state_shape, device=device) * 0.3
    before = pool.clone()
    inter = torch.full((2, 6, *variant.state_shape), math.nan, device=device)
    tokens = _concat(requests)
    out = variant.call(
        tokens, pool, *_batch(lens, slots, initial, device), intermediate_states=inter
    )
    plain_pool = before.clone()
    plain = variant.call(tokens, plain_pool, *_batch(lens, slots, initial, device))
    torch.testing.assert_close(out, plain, **F32)
    torch.testing.assert_close(pool, plain_pool, **F32)
    for b, t in enumerate(requests):
        start = before[slots[b]] if initial[b] else None
        for i in range(lens[b]):
            _, ref_state = variant.reference(_slice(t, 0, i + 1), start)
            torch.testing.assert_close(inter[b, i], ref_state, **F32)
        assert torch.isnan(inter[b, lens[b] :]).all()  # untouched past the request's length


# --------------------------------------------------------------------------------------------
# bfloat16 inputs and state pool
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=_IDS)
def test_bf16_inputs_and_pool(variant: Variant, device: str) -> None:
    """bf16 in, bf16 state pool: float32 maths inside, so the result is the float32 reference
    on the same (rounded) values, up to the rounding of the output and the stored state."""
    gen = _gen(9)
    lens, slots, initial = [21, 1], [0, 1], [True, True]
    requests = [
        {key: value.to(torch.bfloat16) for key, value in variant.make(n, gen, device).items()}
        for n in lens
    ]
    pool = (_randn(gen, 2, *variant.state_shape, device=device) * 0.3).to(torch.bfloat16)
    before = pool.clone()
    out = variant.call(_concat(requests), pool, *_batch(lens, slots, initial, device))
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    offsets = [0, *itertools.accumulate(lens)]
    for b, t in enumerate(requests):
        ref_o, ref_s = variant.reference(t, before[slots[b]].float())
        got = out[offsets[b] : offsets[b + 1]].float()
        torch.testing.assert_close(got, ref_o, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(pool[slots[b]].float(), ref_s, atol=2e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# Buffers and errors
# --------------------------------------------------------------------------------------------


def test_out_buffer_is_written_and_returned() -> None:
    gen = _gen(10)
    t = _gdn_tokens(7, gen, "cpu")
    out = torch.empty(7, HV, DV)
    pool = torch.zeros(1, HV, DK, DV)
    got = _call_gdn(t, pool, *_batch([7], [0], [False], "cpu"), out=out)
    assert got is out
    ref_o, _ = _ref_gdn(t, None)
    torch.testing.assert_close(out, ref_o, **F32)


def test_zero_length_request_keeps_or_clears_its_state() -> None:
    gen = _gen(11)
    t = _gdn_tokens(3, gen, "cpu")
    pool = _randn(gen, 2, HV, DK, DV)
    kept = pool[0].clone()
    _call_gdn(t, pool, *_batch([0, 3, 0], [0, -1, 1], [True, True, False], "cpu"))
    torch.testing.assert_close(pool[0], kept, atol=0, rtol=0)
    assert torch.count_nonzero(pool[1]) == 0


def _gdn_args(n: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return _gdn_tokens(n, _gen(12), "cpu"), torch.zeros(2, HV, DK, DV)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "fast"}, "mode"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"qsl": [0, 1, 3, 5]}, "query_start_loc"),
        ({"qsl": [0, 3, 2, 4]}, "query_start_loc"),
        ({"slots": [0, 0, 1]}, "share a slot"),
        ({"slots": [0, 2, 1]}, "state_indices"),
        ({"initial_dtype": torch.int32}, "has_initial_state"),
        ({"qsl_dtype": torch.float32}, "query_start_loc"),
        ({"out": torch.empty(4, HV, DV + 1)}, "out"),
        ({"intermediate_states": torch.empty(3, 1, HV, DK, DV)}, "intermediate_states"),
    ],
)
def test_bad_arguments_raise(change: dict, message: str) -> None:
    t, pool = _gdn_args()
    qsl = torch.tensor(change.get("qsl", [0, 1, 3, 4]), dtype=change.get("qsl_dtype", torch.int32))
    si = torch.tensor(change.get("slots", [0, -1, 1]), dtype=torch.int32)
    hi = torch.ones(3, dtype=change.get("initial_dtype", torch.bool))
    kw = {k: v for k, v in change.items() if k in ("mode", "chunk_size", "out")}
    kw.update({k: v for k, v in change.items() if k == "intermediate_states"})
    with pytest.raises(ValueError, match=message):
        _call_gdn(t, pool, qsl, si, hi, **kw)


def test_shape_errors_name_the_tensor() -> None:
    t, pool = _gdn_args()
    batch = _batch([4], [0], [False], "cpu")
    with pytest.raises(ValueError, match="multiple of the 2 query/key heads"):
        gated_delta_rule(
            t["q"], t["k"], t["v"][:, :3], t["g"][:, :3], t["beta"][:, :3], pool, *batch
        )
    with pytest.raises(ValueError, match="g: expected shape"):
        kda(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, *batch)  # GDN's gate for KDA
    with pytest.raises(ValueError, match="ssm_state"):
        _call_gdn(t, pool.transpose(-1, -2), *batch)
    with pytest.raises(ValueError, match="activation"):
        _call_conv_bad_activation()


def _call_conv_bad_activation() -> None:
    x = torch.zeros(2, CONV_C)
    causal_conv1d(
        x,
        CONV_PARAMS["weight"],
        None,
        torch.zeros(1, CONV_C, CONV_K - 1),
        *_batch([2], [0], [False], "cpu"),
        activation="gelu",
    )
