"""End to end: tiny transformers models driven through attention bindings vs transformers itself.

Every architecture runs continuous batching (chunked prefill of 5 tokens, mixed prefill/decode
steps, greedy decode) on the reference backend and is compared with transformers' eager forward
of the same random-weight model: every logit of every fed position and every greedy token.
"""

from __future__ import annotations

import pytest
import torch

import attn_core.e2e.runner as runner_mod
from attn_core.e2e import (
    ARCHITECTURES,
    Engine,
    build_tiny,
    compare_generation,
    measure_overhead,
    run_architecture,
    run_main,
)
from attn_core.e2e.configs import ENCODER_MODELS
from attn_core.e2e.main import default_registry, make_prompts, plan_for, resolve_models

DECODERS = [n for n in ARCHITECTURES if n not in ENCODER_MODELS]
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_matches_transformers_fp32_cpu(name: str) -> None:
    run = run_architecture(name, prompts=4, max_new_tokens=6)
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.match.token_agreement == 1.0, run.format()
    assert run.match.tokens == 4 * 6
    # the schedule really mixed prefill chunks with decodes
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.mode_counts
    assert run.ok


@pytest.mark.parametrize("name", ["qwen3-next", "deepseek-v3"])
def test_moe_models_bf16_cpu_within_tolerance(name: str) -> None:
    """bf16 on both sides: most rows within 0.5 (a MoE routing flip may move one row)."""
    run = run_architecture(name, dtype="bfloat16", prompts=4, max_new_tokens=6)
    assert run.ok, run.format()
    assert run.match.rows_within >= 0.9 and run.match.min_rows_within == 0.9


def test_bf16_is_held_to_transformers_own_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 bound is model-relative: attn-core's logits against the same model in float32
    are no farther than transformers' own bf16 logits (up to the sampling factor). Attention
    outputs rounded to 3 mantissa bits stay inside the fixed atol 0.5 but fail that bound."""
    from attn_core.e2e.adapters import CausalLMAdapter
    from attn_core.e2e.compare import HF_ROUNDING_FACTOR

    good = run_architecture("qwen3", dtype="bfloat16", prompts=4, max_new_tokens=6)
    assert good.ok and good.match.within_hf_rounding, good.format()
    assert good.match.fp32_error is not None and good.match.hf_fp32_error is not None
    assert good.match.fp32_error <= HF_ROUNDING_FACTOR * good.match.hf_fp32_error
    assert "transformers' own" in good.match.short()

    real = CausalLMAdapter._attend

    def coarse(self, i, q, k, v, out, **inputs):
        result = real(self, i, q, k, v, out, **inputs)
        target = out if out is not None else result
        target.copy_(target.to(torch.float8_e4m3fn).to(target.dtype))
        return result

    monkeypatch.setattr(CausalLMAdapter, "_attend", coarse)
    bad = run_architecture("qwen3", dtype="bfloat16", prompts=4, max_new_tokens=6)
    assert not bad.match.within_hf_rounding and not bad.ok, bad.format()


def test_the_fixed_bf16_bound_is_waived_only_where_transformers_misses_it_too() -> None:
    """A real-size random MoE flips experts on rounding: where transformers' own bf16 rows miss
    the fixed bound against float32 as well, only the bound relative to transformers applies."""
    from attn_core.e2e.compare import MatchResult

    def match(hf_rows_within: float, fp32_error: float) -> MatchResult:
        return MatchResult(
            max_abs_diff=29.0,
            token_agreement=0.91,
            positions=68,
            tokens=32,
            atol=0.5,
            min_token_agreement=0.8,
            rows_within=0.71,
            min_rows_within=0.9,
            rtol=0.01,
            fp32_error=fp32_error,
            hf_fp32_error=1.0,
            hf_rows_within=hf_rows_within,
        )

    assert match(0.6, 0.9).ok and "waived" in match(0.6, 0.9).short()
    assert not match(0.95, 0.9).ok  # transformers meets the fixed bound: so must attn-core
    assert not match(0.6, 1.3).ok  # farther from float32 than transformers' own rounding
    assert not match(0.6, 1.05).ok  # no sampling room: at most transformers' own error
    assert match(0.6, 1.0).ok


@pytest.mark.parametrize("shapes", ["tiny", "kernel"])
@pytest.mark.parametrize("name", ["jamba", "falcon-mamba"])
def test_mamba1_models_bf16_cpu_within_tolerance(name: str, shapes: str) -> None:
    """bf16 on both sides, at the CPU shapes and at the shapes a GPU run uses (Jamba's MoE
    included); the Mamba1 layers run in float32 inside, transformers' torch path partly in bf16."""
    run = run_architecture(name, dtype="bfloat16", prompts=4, max_new_tokens=6, shapes=shapes)
    assert run.ok, run.format()
    assert any("mamba1" in g["spec"] for g in run.plan["groups"]), run.format()


@pytest.mark.parametrize("shapes", ["tiny", "kernel"])
def test_falcon_h1_bf16_cpu_within_tolerance(shapes: str) -> None:
    """bf16 on both sides, at the CPU shapes and at the shapes a GPU run uses: both ops of
    every parallel layer (Mamba2 state in float32) within the bf16 tolerance."""
    run = run_architecture(
        "falcon-h1", dtype="bfloat16", prompts=4, max_new_tokens=6, shapes=shapes
    )
    assert run.ok, run.format()
    layers = {g["group_id"]: g["layers"] for g in run.plan["groups"]}
    assert layers["linear"] == layers["full"] == [0, 1, 2], run.format()


@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("qwen2.5-vl-vision", 4),
        ("qwen2-vl-vision", 3),
        ("siglip-vision", 3),
        ("whisper-encoder", 3),
    ],
)
def test_vision_tower_blocks_match_transformers_fp32_cpu(name: str, blocks: int) -> None:
    run = run_architecture(name, prompts=3)
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert run.steps == blocks and run.ok


def test_comparison_detects_a_wrong_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeroed gpt-oss sinks change the logits beyond tolerance: the check can fail."""
    real = runner_mod.layer_params_for

    def zero_sinks(hf, layout):
        return {i: {"sinks": p["sinks"] * 0} for i, p in real(hf, layout).items()}

    monkeypatch.setattr(runner_mod, "layer_params_for", zero_sinks)
    run = run_architecture("gpt-oss", prompts=2, max_new_tokens=3)
    assert not run.ok
    assert run.match.max_abs_diff > 1e-2


def test_engine_handles_more_requests_than_batch_slots() -> None:
    """Six requests through a batch of two: admission waits for released slots and pages."""
    model = build_tiny("qwen3")
    registry = default_registry()
    plan = plan_for(
        model,
        registry,
        torch.device("cpu"),
        None,
        max_batch_size=2,
        max_num_tokens=10,
        max_model_len=40,
        graphs=False,
    )
    engine = Engine(model, plan, registry, chunk_size=5, max_batch_size=2, max_model_len=40)
    prompts = make_prompts(6)
    result = engine.generate(prompts, 4, admit_per_step=2)
    assert [len(t) for t in result.tokens] == [4] * 6
    assert compare_generation(model, result).ok
    assert engine.state.request_ids() == []


def test_graphs_full_is_lowered_where_a_group_captures_no_mixed_step() -> None:
    """The reference captures decode steps only: ``graphs="full"`` plans graph mode decode
    (the downgrade policy warns), the plan says what was asked, and the run still matches."""
    with pytest.warns(UserWarning, match="graph mode lowered full -> decode"):
        run = run_architecture("qwen3", prompts=2, max_new_tokens=3, graphs="full")
    assert (run.plan["graph_mode"], run.plan["graph_mode_requested"]) == ("decode", "full")
    prefill = run.plan["groups"][0]["phases"]["prefill"]
    assert (prefill["graph_mode_requested"], prefill["graph_mode"]) == ("full", "none")
    assert run.mixed_graph_replays == 0 and run.to_dict()["mixed_graph_replays"] == 0
    assert "CUDA graphs need a CUDA device" in run.format()
    assert run.ok, run.format()


def test_graph_mode_of_the_graphs_argument() -> None:
    from attn_core.e2e.runner import graph_mode_of
    from attn_core.specs import GraphMode

    assert [graph_mode_of(g) for g in (None, False, True, "none", "decode", "full")] == [
        GraphMode.NONE,
        GraphMode.NONE,
        GraphMode.DECODE,
        GraphMode.NONE,
        GraphMode.DECODE,
        GraphMode.FULL,
    ]
    with pytest.raises(ValueError):
        graph_mode_of("always")


def test_run_main_report() -> None:
    lines: list[str] = []
    report = run_main(
        "qwen3,bamba",
        device="cpu",
        dtype="fp32",
        prompts=2,
        max_new_tokens=3,
        graphs=True,
        registry=None,
        constraints=None,
        progress=True,
        console=lines.append,
    )
    assert report.ok and [r.name for r in report.runs] == ["qwen3", "bamba"]
    text = report.format()
    assert "attn_core:reference" in text and "2/2 architectures match" in text
    assert "CUDA graphs need a CUDA device" in text  # asked for graphs on CPU: said, not hidden
    assert report.to_dict()["runs"][1]["plan"]["groups"][0]["group_id"] == "linear"
    assert lines and "qwen3" in lines[0]


def test_resolve_models() -> None:
    assert resolve_models("all") == list(ARCHITECTURES)
    assert resolve_models("qwen2.5-vl, gpt_oss") == ["qwen2.5-vl-vision", "gpt-oss"]
    assert resolve_models("falcon_h1") == ["falcon-h1"]
    with pytest.raises(ValueError, match="llama-2"):
        resolve_models("llama-2")


def test_measure_overhead_cpu() -> None:
    rep = measure_overhead("qwen3-next", "cpu", batch_size=2, context_len=6, iters=3, warmup=1)
    assert rep.binding_ms > 0 and rep.direct_ms > 0
    assert rep.ratio == pytest.approx(rep.binding_ms / rep.direct_ms)
    assert rep.attention_layers == 4
    with pytest.raises(ValueError, match="encoder"):
        measure_overhead("qwen2.5-vl-vision", "cpu")


# ------------------------------------------------------------------------------------------
# GPU: bf16 with an explicit looser tolerance, and CUDA-graph decode
# ------------------------------------------------------------------------------------------
#: bf16 comparisons over more prompts where a few rows' error against float32 moves the mean
#: (Kimi-Linear's tiny sample: 1.18x transformers' own over 4 prompts on CPU, 0.79x over 8)
_BF16_PROMPTS = {"kimi-linear": 8}


def _bf16_prompts(name: str, default: int) -> int:
    return _BF16_PROMPTS.get(name, default)


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ARCHITECTURES])
def test_matches_transformers_bf16_gpu(name: str) -> None:
    run = run_architecture(
        name, device="cuda", dtype="bfloat16", prompts=_bf16_prompts(name, 4), max_new_tokens=6
    )
    assert run.ok, run.format()


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ARCHITECTURES])
def test_matches_transformers_fp32_gpu(name: str) -> None:
    run = run_architecture(name, device="cuda", dtype="float32", prompts=4, max_new_tokens=6)
    assert run.match.max_abs_diff < 1e-3, run.format()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=gpu)
        for n in (
            "qwen3",
            "bamba",
            "deepseek-v3",
            "gemma-3",
            "nemotron-h",
            "falcon-h1",
            "falcon-mamba",
            "kimi-linear",
            "llama-4",
        )
    ],
)
def test_cuda_graph_decode(name: str) -> None:
    """Decode steps replay captured graphs (runtime.update before replay) and still match."""
    run = run_architecture(
        name, device="cuda", dtype="float32", prompts=3, max_new_tokens=6, graphs=True
    )
    assert run.graph_replays > 0, run.format()
    assert run.match.max_abs_diff < 1e-3 and run.match.token_agreement == 1.0, run.format()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("qwen3", "float32"),
        ("deepseek-v3", "float32"),
        ("qwen3-next", "bfloat16"),
        ("gemma-3", "float32"),
        ("nemotron-h", "float32"),
        ("falcon-h1", "float32"),
        ("kimi-linear", "float32"),
        ("kimi-linear", "bfloat16"),
    ],
)
def test_kernel_shapes_match_transformers_cpu(name: str, dtype: str) -> None:
    """The GPU runs' shapes (head dim 128, MLA ranks 512 + 64) parse and match on CPU too;
    in bf16 the wider random Gated DeltaNet layers must stay well-conditioned (at init std 0.1
    transformers' own bf16 logits were 10 away from its float32 ones)."""
    run = run_architecture(name, prompts=2, max_new_tokens=3, shapes="kernel", dtype=dtype)
    dims = {g["spec"].split(" d")[1].split()[0] for g in run.plan["groups"]}
    assert dims & {"128", "576/512"}, run.format()
    assert run.ok, run.format()


# ------------------------------------------------------------------------------------------
# GPU: the plugins found by entry points serve the model (kernel shapes), not the reference
# ------------------------------------------------------------------------------------------
# Rejections that mean "no installed GPU plugin can serve this layer here" rather than a bug:
# the plugin cannot run (a wheel is missing), serves another kind, or lacks a feature the
# layer needs (FlashInfer has no attention sinks; gpt-oss needs FlashAttention's; the GPU
# plugins serve Llama-4's chunked layers through local virtual batches only when a chunk is
# whole pages).
_EXPECTED_REJECTIONS = {"unavailable", "kind", "linear_variant", "sinks", "chunked_attention"}


def _gpu_plugin_run(name: str, **kw):
    from attn_core.registry import Registry

    run = run_architecture(name, device="cuda", registry=Registry.discover(), **kw)
    print(run.format())
    groups = run.plan["groups"]
    served = {g["backend"] for g in groups} - {"attn_core:reference"}
    if not served:
        reasons: dict[str, set[str]] = {}
        for g in groups:
            for r in g["rejected"]:
                reasons.setdefault(r["backend"], set()).add(r["code"])
        unexpected = {b: c for b, c in reasons.items() if not c & _EXPECTED_REJECTIONS}
        assert not unexpected, f"GPU plugins rejected for unexpected reasons: {unexpected}"
        pytest.skip(f"no installed GPU plugin serves {name} here: {reasons}")
    return run


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ARCHITECTURES])
def test_gpu_plugins_match_transformers_bf16(name: str) -> None:
    run = _gpu_plugin_run(name, dtype="bfloat16", prompts=_bf16_prompts(name, 4), max_new_tokens=6)
    assert run.ok, run.format()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=gpu)
        for n in (
            "qwen3",
            "qwen3-next",
            "bamba",
            "deepseek-v3",
            "jamba",
            "falcon-h1",
            "falcon-mamba",
            "kimi-linear",
        )
    ],
)
def test_gpu_plugins_cuda_graph_decode_bf16(name: str) -> None:
    run = _gpu_plugin_run(
        name, dtype="bfloat16", prompts=_bf16_prompts(name, 3), max_new_tokens=6, graphs=True
    )
    assert run.graph_replays > 0, run.format()
    assert run.ok, run.format()


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) for n in ("qwen3", "gemma-3")])
def test_gpu_plugins_cuda_graph_full_bf16(name: str) -> None:
    """Graph mode full on the GPU plugins: prefill and mixed steps replay one captured mixed
    step (FlashInfer's paged prefill wrapper in CUDA-graph mode), decode steps their decode
    graphs, and the generation still matches transformers."""
    run = _gpu_plugin_run(name, dtype="bfloat16", prompts=3, max_new_tokens=6, graphs="full")
    if run.plan["graph_mode"] != "full":
        pytest.skip(f"no installed GPU plugin captures mixed steps of {name}: {run.format()}")
    assert run.mixed_graph_replays > 0 and run.graph_replays > 0, run.format()
    assert {"prefill", "mixed", "decode"} <= set(run.mode_counts), run.format()


@pytest.mark.parametrize("graphs", [pytest.param(g, marks=gpu) for g in (False, True)])
def test_gpu_plugins_serve_llama4_chunked_layers_bf16(graphs: bool) -> None:
    """Llama-4's chunked layers (kernel shapes: chunks of one 16-token page) on a GPU plugin
    (fa3 or FlashInfer) through local virtual batches, eager and with captured decode graphs;
    the decodes cross chunk boundaries."""
    run = _gpu_plugin_run("llama-4", dtype="bfloat16", prompts=4, max_new_tokens=6, graphs=graphs)
    chunked = [g for g in run.plan["groups"] if "chunk=" in g["spec"]]
    assert chunked, run.format()
    gpu_full = ("fa3:fa3", "flashinfer:flashinfer")
    for g in chunked:
        if g["backend"] == "attn_core:reference":
            codes = {r["code"] for r in g["rejected"] if r["backend"] in gpu_full}
            if codes <= {"unavailable"}:
                pytest.skip(f"neither fa3 nor FlashInfer is installed here: {g['rejected']}")
            raise AssertionError(f"GPU plugins rejected for {codes}: {run.format()}")
    if graphs:
        assert run.graph_replays > 0, run.format()
    assert run.ok, run.format()


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=gpu) for n in ("qwen3", "qwen3-next", "deepseek-v3", "gpt-oss")]
)
def test_real_size_first_layers_gpu_bf16(name: str) -> None:
    """Item 7: the sample's real hidden size, heads and vocabulary, first 2 layers, bf16, GPU
    plugins, CUDA graphs after a warm-up pass, with the overhead ratio."""
    run = _gpu_plugin_run(
        name,
        dtype="bfloat16",
        prompts=4,
        max_new_tokens=8,
        graphs=True,
        layers=2,
        overhead=True,
    )
    assert run.warmup_seconds is not None and run.overhead is not None, run.format()
    assert run.graph_replays > 0, run.format()
    assert run.ok, run.format()
