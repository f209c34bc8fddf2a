"""The reference backend driven through the whole runtime (select -> state -> builder -> binding).

Chunked prefill, mixed and decode steps must give what one shot over the whole sequence gives:
SDPA for full attention, plain softmax math for MLA and the encoder, a fresh-state one-shot call
of the reference linear ops (themselves checked against fla's naive kernels in
tests/reference) for Gated DeltaNet, KDA, Mamba2 and Mamba1, and ``F.conv1d`` for the causal conv.
Also: a request restored from the prefix cache, and speculative verify + commit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_core.batch import BatchBuilder
from attn_core.reference import ops
from attn_core.runtime import AttentionRuntime
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerKind, group_layers
from attn_core.state import PersistentState

CPU = DeviceCapabilities.target("cpu")
LIMITS = dict(max_batch_size=8, max_num_tokens=64)
ATOL = 2e-5


# ------------------------------------------------------------------------------------------
# Harness: per-request token inputs, steps, and outputs collected per request and layer
# ------------------------------------------------------------------------------------------
class Model:
    def __init__(self, specs, registry, *, num_pages=64, num_slots=16):
        self.specs = specs
        self.groups = group_layers(specs)
        self.state = PersistentState(self.groups, num_pages=num_pages, num_slots=num_slots)
        plan = select(
            self.groups, registry, CPU, ExecutionConstraints(**LIMITS, speculative_tokens=2)
        )
        self.runtime = AttentionRuntime(plan, registry, state=self.state)
        self.builder = BatchBuilder(self.state, **LIMITS, max_pages_per_request=16)
        gen = torch.Generator().manual_seed(0)
        self.params = [_layer_params(s, gen) for s in specs]

    def run(self, requests, seqs, *, spec_tokens=0, advance=True):
        """One step. ``requests``: [(req_id, start, n)] with ``seqs[req_id]`` the per-layer
        token inputs; returns {req_id: [per-layer outputs (dict)]}."""
        batch = self.builder.build([(r, n) for r, _, n in requests], spec_tokens=spec_tokens)
        self.runtime.prepare(batch)
        results = {r: [] for r, _, _ in requests}
        for i, spec in enumerate(self.specs):
            tok = {
                name: torch.cat([seqs[r][i][name][s : s + n] for r, s, n in requests])
                for name in seqs[requests[0][0]][i]
            }
            binding = self.runtime.binding(i)
            res = {}
            if spec.kind is LayerKind.LINEAR:
                res["conv"] = binding.conv1d(tok.pop("x"), self.params[i]["conv_w"], None)
            q, k, v = tok.pop("q"), tok.pop("k"), tok.pop("v", None)
            out = torch.empty(q.shape[0], spec.num_heads, spec.head_dim_v)
            extra = {n: p for n, p in self.params[i].items() if n != "conv_w"}
            res["out"] = binding.forward(q, k, v, out=out, **tok, **extra)
            off = 0
            for r, _, n in requests:
                results[r].append({name: t[off : off + n] for name, t in res.items()})
                off += n
        if advance:
            for r, _, n in requests:
                self.state.advance(r, n)
        return batch, results


def _layer_params(spec, gen):
    p = {}
    if spec.kind is LayerKind.LINEAR:
        p["conv_w"] = torch.randn(spec.conv_channels, spec.conv_kernel_size, generator=gen) * 0.5
        if spec.linear_variant.value == "mamba2":
            H = spec.num_heads
            p["A_log"] = torch.rand(H, generator=gen).log()
            p["D"] = torch.randn(H, generator=gen)
            p["dt_bias"] = torch.randn(H, generator=gen) * 0.1
        if spec.linear_variant.value == "mamba1":  # A_log per channel and state entry
            H, N = spec.num_heads, spec.head_dim
            p["A_log"] = torch.rand(H, N, generator=gen).mul(2).log1p()
            p["D"] = torch.randn(H, generator=gen)
            p["dt_bias"] = torch.randn(H, generator=gen) * 0.1
    return p


def _token_inputs(spec, L, gen):
    H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    if spec.kind is LayerKind.FULL:
        return {"q": r(L, H, D), "k": r(L, Hkv, D), "v": r(L, Hkv, Dv)}
    if spec.kind is LayerKind.MLA:
        return {"q": r(L, H, D), "k": r(L, D)}
    t = {"q": r(L, Hkv, D), "k": r(L, Hkv, D), "v": r(L, H, Dv), "x": r(L, spec.conv_channels)}
    variant = spec.linear_variant.value
    if variant in ("mamba2", "mamba1"):
        t["dt"] = r(L, H)
    else:
        g_shape = (L, H, D) if variant == "kda" else (L, H)
        t["g"] = F.logsigmoid(r(*g_shape)) * 0.5
        t["beta"] = torch.sigmoid(r(L, H))
    return t


def _sequence(specs, L, seed):
    gen = torch.Generator().manual_seed(seed)
    return [_token_inputs(s, L, gen) for s in specs]


# ------------------------------------------------------------------------------------------
# One-shot expectations (independent of the runtime)
# ------------------------------------------------------------------------------------------
def _expect(spec, inputs, params):
    if spec.kind is LayerKind.FULL:
        rep = spec.num_heads // spec.num_kv_heads
        q = inputs["q"].transpose(0, 1)
        k = inputs["k"].repeat_interleave(rep, 1).transpose(0, 1)
        v = inputs["v"].repeat_interleave(rep, 1).transpose(0, 1)
        return {"out": F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)}
    if spec.kind is LayerKind.MLA:
        q, lat = inputs["q"], inputs["k"]
        L = q.shape[0]
        scores = torch.einsum("thd,sd->hts", q, lat) * spec.scale
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return {"out": torch.einsum("hts,sr->thr", probs, lat[:, : spec.kv_lora_rank])}
    L = inputs["q"].shape[0]
    x = inputs["x"]
    K = spec.conv_kernel_size
    conv = F.conv1d(F.pad(x.T[None], (K - 1, 0)), params["conv_w"][:, None], groups=x.shape[1])
    pool = torch.zeros(1, *spec.ssm_state_shape)
    meta = (
        torch.tensor([0, L], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([False]),
    )
    variant = spec.linear_variant.value
    if variant in ("mamba2", "mamba1"):
        scan = ops.mamba2_ssd if variant == "mamba2" else ops.mamba1_selective_scan
        out = scan(
            inputs["v"],
            inputs["dt"],
            params["A_log"],
            inputs["k"],
            inputs["q"],
            params["D"],
            params["dt_bias"],
            pool,
            *meta,
            mode="recurrent",
        )
    else:
        fn = ops.kda if variant == "kda" else ops.gated_delta_rule
        out = fn(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            inputs["g"],
            inputs["beta"],
            pool,
            *meta,
            scale=spec.scale,
            use_qk_l2norm=spec.qk_l2norm,
            mode="recurrent",
        )
    return {"out": out, "conv": F.silu(conv[0].T)}


def _cat(chunks):
    return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}


def _assert_close(got, want, what):
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], atol=ATOL, rtol=1e-4, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


# ------------------------------------------------------------------------------------------
# Chunked prefill, mixed and decode steps == one shot
# ------------------------------------------------------------------------------------------
def test_prefill_then_decode_equals_one_shot(tiny_specs, ref_registry):
    specs = [tiny_specs[k] for k in ("full", "mla", "gdn", "kda", "mamba2", "mamba1")]
    model = Model(specs, ref_registry)
    lens = {"r0": 7, "r1": 5}
    seqs = {r: _sequence(specs, L, seed) for seed, (r, L) in enumerate(lens.items())}
    for r in lens:
        model.state.add_request(r)
    steps = [
        [("r0", 0, 4), ("r1", 0, 2)],  # prefill
        [("r0", 4, 1), ("r1", 2, 3)],  # mixed
        [("r0", 5, 1)],  # decode
        [("r0", 6, 1)],  # decode
    ]
    chunks = {r: [] for r in lens}
    modes = []
    for step in steps:
        batch, res = model.run(step, seqs)
        modes.append(batch.mode.value)
        for r, outs in res.items():
            chunks[r].append(outs)
    assert modes == ["prefill", "mixed", "decode", "decode"]
    for r, L in lens.items():
        for i, spec in enumerate(specs):
            got = _cat([c[i] for c in chunks[r]])
            assert got["out"].shape[0] == L
            _assert_close(got, _expect(spec, seqs[r][i], model.params[i]), f"{r} {spec.short()}")


def test_encoder_equals_sdpa(tiny_specs, ref_registry):
    spec = tiny_specs["encoder"]
    groups = group_layers([spec])
    plan = select(groups, ref_registry, CPU, ExecutionConstraints(**LIMITS))
    runtime = AttentionRuntime(plan, ref_registry)
    batch = BatchBuilder(None, **LIMITS).build_encoder([5, 3])
    runtime.prepare(batch)
    torch.manual_seed(3)
    q, k, v = (torch.randn(8, 4, 16) for _ in range(3))
    out = runtime.binding(0).forward(q, k, v, out=torch.empty_like(q))
    for s, e in ((0, 5), (5, 8)):
        want = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], want, atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# Prefix cache: a restored request == one that computed its prefix
# ------------------------------------------------------------------------------------------
def test_prefix_cache_restore_equals_recompute(tiny_specs, ref_registry):
    specs = [tiny_specs["full"], tiny_specs["gdn"]]
    model = Model(specs, ref_registry)
    state = model.state
    tokens = list(range(1000, 1011))  # 11 tokens; the first 8 (two pages) get cached
    seq = _sequence(specs, 11, seed=7)
    seqs = {"A": seq, "B": seq, "C": seq}

    state.add_request("A")
    model.run([("A", 0, 8)], seqs)
    state.take_snapshot("A")
    assert state.cache_prefix("A", tokens[:8]) == 8
    state.release("A")

    hit = state.match_prefix(tokens, max_tokens=10)
    assert hit.num_tokens == 8 and hit.snapshot is not None
    state.add_request("B", prefix=hit)
    assert state.num_tokens("B") == 8
    _, got = model.run([("B", 8, 3)], seqs)

    state.add_request("C")
    _, full = model.run([("C", 0, 11)], seqs)
    for i in range(len(specs)):
        want = {name: t[8:] for name, t in full["C"][i].items()}
        _assert_close(got["B"][i], want, f"layer {i}")


# ------------------------------------------------------------------------------------------
# Speculative verify k=2 + commit == decoding the accepted tokens one by one
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["gdn", "mamba2", "mamba1"])
@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_verify_and_commit_equal_sequential_decode(tiny_specs, ref_registry, variant, accepted):
    specs = [tiny_specs["full"], tiny_specs[variant]]
    model = Model(specs, ref_registry)
    state, runtime = model.state, model.runtime
    seq = _sequence(specs, 9, seed=11)
    seqs = {"v": seq, "d": seq}
    for r in seqs:
        state.add_request(r)
    model.run([("v", 0, 5), ("d", 0, 5)], seqs)  # the same prefill for both

    batch, ver = model.run([("v", 5, 3)], seqs, spec_tokens=2, advance=False)
    assert batch.mode.value == "verify"
    runtime.commit_speculative(batch, torch.tensor([accepted], dtype=torch.int32))
    state.advance("v", accepted)
    seq_outs = []
    for t in range(accepted):
        _, dec = model.run([("d", 5 + t, 1)], seqs)
        seq_outs.append(dec["d"])
    for i in range(len(specs)):
        want = _cat([o[i] for o in seq_outs])
        got = {name: t[:accepted] for name, t in ver["v"][i].items()}
        _assert_close(got, want, f"verify layer {i}")

    # the committed state is the state after the accepted tokens
    lin = state.state_slots.layer(1)
    sv, sd = state.slot("v"), state.slot("d")
    torch.testing.assert_close(lin.ssm[sv], lin.ssm[sd], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(lin.conv[sv], lin.conv[sd], atol=0, rtol=0)
    # and the next step agrees (for the full layer too: the rejected KV is overwritten)
    nxt = {"v": seq, "d": seq}
    _, a = model.run([("v", 5 + accepted, 1), ("d", 5 + accepted, 1)], nxt)
    for i in range(len(specs)):
        _assert_close(a["v"][i], a["d"][i], f"next step layer {i}")
