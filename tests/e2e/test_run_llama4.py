"""``attn run --model llama-4``: chunked (local) rope layers and a global NoPE layer (issue 22).

The tiny config has chunks of 4 tokens (every prompt, 7 and 14 tokens, and its decodes cross
chunk boundaries), MoE and dense MLP layers, and a NoPE layer whose temperature-tuned query
scale changes every 2 positions. Each transformers decoder layer runs its own forward with the
attention op hooked; the result must match transformers' eager forward in fp32.
"""

from __future__ import annotations

import pytest

import attn_core.e2e.adapters as adapters_mod
import attn_core.e2e.configs as configs_mod
from attn_core.e2e import run_architecture

pytest.importorskip("transformers")


def test_llama4_matches_transformers(run_on_cpu) -> None:
    report = run_on_cpu("llama-4")
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()
    groups = {g["group_id"]: g for g in run.plan["groups"]}
    assert groups["full"]["layers"] == [0, 1, 3] and "chunk=4" in groups["full"]["spec"]
    assert groups["full.1"]["layers"] == [2] and "chunk" not in groups["full.1"]["spec"]


def test_the_chunk_mask_and_the_query_scale_both_matter(
    monkeypatch: pytest.MonkeyPatch, run_on_cpu
) -> None:
    """Leaving out either the chunk mask or the NoPE layer's position-dependent query scale
    makes the run MISMATCH: the comparison above would catch a backend or adapter without it."""
    monkeypatch.setattr(
        adapters_mod.CausalLMAdapter, "_temperature_scaled", lambda self, module, query: query
    )
    assert not run_on_cpu("llama-4").ok
    monkeypatch.undo()

    from attn_core.reference.ops import attention

    real = attention._visible
    monkeypatch.setattr(
        attention, "_visible", lambda q, k, causal, window, chunk=None: real(q, k, causal, window)
    )
    assert not run_on_cpu("llama-4").ok


def test_hook_refuses_a_mapping_without_the_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout that calls every layer full (the config relabelled): transformers masks layer 0
    by chunks, so the hook names the layer, the module and the chunk size."""
    real = configs_mod.specs_from_hf_config

    def wrong(cfg, **kw):
        return real({**cfg, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}, **kw)

    monkeypatch.setattr(configs_mod, "specs_from_hf_config", wrong)
    with pytest.raises(
        ValueError, match=r"layer 0 \(Llama4TextAttention\).*attention chunk size 4"
    ):
        run_architecture("llama-4", prompts=1, max_new_tokens=1)


def test_the_modules_scale_their_queries_again_after_the_step(run_on_cpu) -> None:
    """The adapter switches the NoPE modules' own scaling off during a step only."""
    from attn_core.e2e.configs import build_tiny

    model = build_tiny("llama-4")
    attn = model.hf.model.layers[2].self_attn
    assert attn.attn_temperature_tuning and not attn.use_rope
    assert run_on_cpu("llama-4").ok
    assert adapters_mod._temperature_tuned(attn)


def test_a_multimodal_llama4_config_runs_its_language_model(tmp_path, run_on_cpu) -> None:
    """``model_type: llama4`` (Llama4ForConditionalGeneration): its text_config is mapped and
    its language model runs on text prompts."""
    import json

    import transformers

    from attn_core.e2e.configs import tiny_config

    text = {k: v for k, v in tiny_config("llama-4").items() if k != "architectures"}
    vision = transformers.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision.to_dict()).to_dict()
    cfg["architectures"] = ["Llama4ForConditionalGeneration"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    (run,) = report.runs  # the language model; the tower has no adapter, and the report says so
    assert run.name == f"{path} [text]"
    assert any("chunk=4" in g["spec"] for g in run.plan["groups"]), run.format()
    assert any("stack vision (llama-4-vision) is not run here" in n for n in run.notes)
