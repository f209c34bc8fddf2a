"""Configs of issue 22's sweep over transformers' model types through ``attn run`` on CPU.

Each case is what the sweep built (a config class's own defaults, sizes shrunk through config
attributes) that crashed, mismatched or was refused unclearly. A config transformers itself can
build and run matches transformers' eager forward; one whose transformers forward fails is
refused before any step, naming the layer, its attn-core group, the module, what the code
expected and what the config gave (not a traceback from deep inside a step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")

# MLA sizes of a tiny model: 4 query heads of nope 16 + rope 8, a 32-wide latent
_MLA: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _config(model_type: str, **fields: Any) -> dict[str, Any]:
    """``model_type``'s config class built from ``fields`` (the rest its defaults), as a dict."""
    return transformers.CONFIG_MAPPING[model_type](**fields).to_dict()


# -- 1. DeepSeek-V3 (and the A.X K1 / Kimi-K2 configs read as it) with a head_dim field --------


@pytest.mark.parametrize("model_type", ["deepseek_v3", "axk1"])
def test_mla_config_with_a_head_dim_other_than_its_rope_width_runs(
    tmp_path: Path, model_type: str, run_on_cpu
) -> None:
    """DeepseekV3Config derives ``head_dim = qk_rope_head_dim``, but a ``head_dim`` given in the
    config.json overrides it, and transformers' rotary embedding is then ``head_dim`` wide
    against MLA's ``qk_rope_head_dim`` rotary part: its own forward failed (``The size of tensor
    a (32) must match the size of tensor b (8)``, the sweep's crash). The model the config
    describes ropes ``qk_rope_head_dim`` channels (the mapping says so); ``attn run`` builds
    transformers' model with the head_dim the class derives, says so, and matches it."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} config class")
    cfg = _config(model_type, **_MLA, head_dim=16)
    assert cfg["head_dim"] == 16 and cfg["qk_rope_head_dim"] == 8
    report = run_on_cpu(_write(tmp_path, cfg))
    text = report.format()
    assert report.ok, text
    assert "MATCH" in text and "mla 4q/1kv d40/32" in text, text
    assert "head_dim=16" in text and "qk_rope_head_dim=8" in text, text


# -- 2. DeepSeek-V2's class defaults: num_experts_per_tok None -----------------------------------


def test_deepseek_v2_defaults_without_top_k_are_refused_naming_the_layer_and_field(
    tmp_path: Path, run_on_cpu
) -> None:
    """DeepseekV2Config defaults ``num_experts_per_tok`` (and ``n_group`` / ``topk_group``) to
    None, and with ``first_k_dense_replace`` 0 every layer is an MoE block: transformers' own
    forward calls ``topk(k=None)``. Refused before any step: the layer, its group, the module,
    the null field the module reads."""
    sizes = {k: v for k, v in _MLA.items() if k not in ("num_experts_per_tok", "n_group")}
    cfg = _config("deepseek_v2", **{**sizes, "topk_group": None, "first_k_dense_replace": 0})
    assert cfg["num_experts_per_tok"] is None
    want = (
        r"transformers' own forward of DeepseekV2ForCausalLM fails on this config in layer 0 "
        r"\(group 'mla', module model\.layers\.0\.mlp.*DeepseekV2Moe.*\): TypeError: topk\(\).*"
        r"null fields its code reads: num_experts_per_tok"
    )
    with pytest.raises(ValueError, match=want):
        run_on_cpu(_write(tmp_path, cfg))


def test_deepseek_v2_defaults_with_top_k_set_match_transformers(tmp_path: Path, run_on_cpu) -> None:
    """The same defaults with ``num_experts_per_tok`` set (greedy routing: ``n_group`` /
    ``topk_group`` stay None, as the class leaves them) run and match transformers."""
    sizes = {k: v for k, v in _MLA.items() if k not in ("n_group", "topk_group")}
    cfg = _config("deepseek_v2", **{**sizes, "first_k_dense_replace": 0})
    assert cfg["n_group"] is None and cfg["topk_method"] == "greedy"
    report = run_on_cpu(_write(tmp_path, cfg))
    assert report.ok, report.format()
    assert "MATCH" in report.format()


# -- 3. GLM-4.7-Flash (glm4_moe_lite): head_dim is an alias of qk_rope_head_dim ----------------


@pytest.mark.parametrize(
    ("head_dim", "rope"),
    [(16, 64), (64, 16)],
    ids=["alias-narrower", "alias-wider"],
)
def test_glm4_moe_lite_head_dim_alias_wins_as_in_transformers(
    tmp_path: Path, head_dim: int, rope: int, run_on_cpu
) -> None:
    """Glm4MoeLiteConfig's attribute_map names ``head_dim`` for ``qk_rope_head_dim``; a
    config.json with both sets the field from the alias last, so transformers ropes (and
    scales by) ``qk_nope_head_dim + head_dim``. The mapping read ``qk_rope_head_dim`` instead:
    scale 1/sqrt(192 + 64) = 0.0625 against transformers' 1/sqrt(192 + 16) = 0.0693 (and the
    other way round), refused by the adapter's scale check."""
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteAttention

    cls = transformers.CONFIG_MAPPING["glm4_moe_lite"]
    cfg = _config(
        "glm4_moe_lite",
        **{k: v for k, v in _MLA.items() if k not in ("qk_rope_head_dim", "qk_nope_head_dim")},
        qk_nope_head_dim=192,
        qk_rope_head_dim=rope,
    )
    cfg["head_dim"] = head_dim  # the alias, as a hub config.json may carry both
    module = Glm4MoeLiteAttention(cls.from_dict(cfg), 0)
    assert module.scaling == pytest.approx((192 + head_dim) ** -0.5)
    spec = specs_from_hf_config(cfg).layer_specs[0]
    assert spec.scale == pytest.approx(module.scaling, rel=1e-6)
    assert spec.mla_dims[1] == head_dim
    report = run_on_cpu(_write(tmp_path, cfg))
    text = report.format()
    assert report.ok, text
    assert f"mla 4q/1kv d{32 + head_dim}/32" in text and "MATCH" in text, text


def test_mla_with_fewer_kv_heads_than_query_heads_is_refused_naming_both(
    tmp_path: Path, run_on_cpu
) -> None:
    """MLA expands its keys to every query head; transformers' eager attention then repeats them
    ``num_attention_heads // num_key_value_heads`` times more, and its own forward fails. The
    sweep's num_key_value_heads=2 beside 4 query heads: refused saying what was expected."""
    cfg = _config("glm4_moe_lite", **{**_MLA, "num_key_value_heads": 2})
    want = (
        r"in layer 0 \(group 'mla', module model\.layers\.0\.self_attn.*Glm4MoeLiteAttention"
        r".*expected num_key_value_heads = num_attention_heads = 4, got 2"
    )
    with pytest.raises(ValueError, match=want):
        run_on_cpu(_write(tmp_path, cfg))


# -- 4. LFM2-MoE / LFM3 without layer_types ----------------------------------------------------


def test_lfm2_moe_without_layer_types_is_refused_by_explain_and_run(
    tmp_path: Path, run_on_cpu, capsys, monkeypatch
) -> None:
    """Lfm2MoeConfig derives no layer_types (Lfm2Config derives them from full_attn_idxs): its
    class defaults leave them None and transformers cannot build the model. The mapping used
    Lfm2's rule (every layer attention) and ``attn run`` then failed inside transformers with
    "'NoneType' object is not subscriptable"; both now refuse naming the field and layers."""
    from attn_core import cli
    from attn_core.registry import Registry

    cfg = _config("lfm2_moe", num_hidden_layers=2, hidden_size=64, vocab_size=128)
    assert cfg["layer_types"] is None
    path = _write(tmp_path, cfg)
    want = (
        r"lfm2 \(lfm2_moe\): layers 0-1: no layer_types, and Lfm2MoeConfig derives none .*"
        r"expected a list of 2 of \['conv', 'full_attention'\], got None"
    )
    with pytest.raises(ValueError, match=want) as err:
        run_on_cpu(path)
    monkeypatch.setattr(cli, "_registry", lambda args: Registry(strict=True))
    assert cli.main(["explain", path, "--target", "cpu"]) == 2
    assert str(err.value) in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["lfm2", "lfm3"])
def test_lfm_layer_types_derived_as_their_config_class_derives_them(model_type: str) -> None:
    """A config.json without layer_types: the mapping's layer kinds are the ones the config
    class writes (LFM3: full every 4th from layer 2, sliding every 4th from layer 4, conv
    else; LFM2: full_attn_idxs, all full by default), not LFM2's rule for both."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} config class")
    cfg = _config(model_type, num_hidden_layers=9, hidden_size=64, vocab_size=128)
    want = cfg.pop("layer_types")
    cfg.pop("full_attn_idxs", None)
    layout = specs_from_hf_config(cfg)
    kind = {"conv": "linear", "full_attention": "full", "sliding_attention": "full"}
    got = [layout.spec_of(i).kind.value for i in range(9)]
    windows = [layout.spec_of(i).sliding_window is not None for i in range(9)]
    assert got == [kind[t] for t in want], (got, want)
    assert windows == [t == "sliding_attention" for t in want], (windows, want)


# -- 5. CodeGen / GPT-J: rotary_dim; Gemma-3's nested sizes -------------------------------------


@pytest.mark.parametrize("model_type", ["codegen", "gptj"])
def test_rotary_dim_wider_than_the_head_is_refused_naming_both(
    tmp_path: Path, model_type: str, run_on_cpu
) -> None:
    """The class's default rotary_dim 64 beside a shrunk head of 16: transformers' own forward
    fails; refused naming the layer, the field and the head width."""
    cfg = _config(model_type, n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    assert cfg["rotary_dim"] == 64
    want = (
        r"in layer 0 \(group 'full', module .*h\.0\.attn.*\).*rotary_dim=64 is wider than the "
        r"head \(hidden_size 64 / num_attention_heads 4\): expected rotary_dim <= 16, got 64"
    )
    with pytest.raises(ValueError, match=want):
        run_on_cpu(_write(tmp_path, cfg))


def test_codegen_at_tiny_sizes_matches_transformers(tmp_path: Path, run_on_cpu) -> None:
    """CodeGen (fused qkv in its mp_num blocks, partial rotary) shrunk through its own names
    (n_embd, n_layer, n_head: hidden_size etc. are not in its to_dict) runs in seconds."""
    cfg = _config(
        "codegen", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128, n_positions=256
    )
    report = run_on_cpu(_write(tmp_path, cfg))
    assert report.ok, report.format()
    assert "MATCH" in report.format()


def test_gemma3_multimodal_config_shrunk_in_its_sub_configs_runs(
    tmp_path: Path, run_on_cpu
) -> None:
    """Gemma-3's sizes are in text_config / vision_config: shrinking the top level only (the
    sweep) leaves the real 26-layer, 262k-vocabulary model; shrunk there both stacks run."""
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 300,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    cfg = _config(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    report = run_on_cpu(_write(tmp_path, cfg))
    text_out = report.format()
    assert report.ok and len(report.runs) == 2, text_out
    assert text_out.count("MATCH") == 2 and "window=8" in text_out, text_out
