"""``attn run`` drives Gemma-3, Nemotron-H and Kimi-Linear through their own decoder layers
(issue 22), and the other families of issue 22 through theirs, Falcon-H1's parallel
attention + Mamba2 layers included.

They run each transformers decoder layer's ``forward`` with the attention op hooked through
transformers' attention-function interface (Nemotron-H's Mamba2 mixers and Kimi-Linear's KDA
mixers replaced by class, its MLA modules by the absorbed form), and
match transformers' eager forward on CPU in fp32. The hook checks what transformers asks for
against the mapping, so a mapping that describes other math fails loudly instead of mismatching.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

import attn_core.e2e.configs as configs_mod
from attn_core.e2e import run_architecture
from attn_core.e2e.configs import init_std, tiny_config
from attn_core.testing.hf import since_transformers, transformers_before

pytest.importorskip("transformers")


def _config_path(tmp_path: Path, cfg: dict[str, object]) -> str:
    """``cfg`` written as ``tmp_path/config.json``; its path, as ``attn run`` takes it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _groups(run) -> dict[str, list[int]]:
    """A run's plan as ``{group id: layers}``."""
    return {g["group_id"]: g["layers"] for g in run.plan["groups"]}


@pytest.mark.parametrize("name", ["gemma-3", "nemotron-h", "kimi-linear", "falcon-h1"])
def test_run_sample_matches_transformers(name: str, run_on_cpu) -> None:
    report = run_on_cpu(name)
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()


def test_gemma3_layer_pattern_and_local_rope(run_on_cpu) -> None:
    report = run_on_cpu("gemma-3")
    groups = {g["group_id"]: g for g in report.runs[0].plan["groups"]}
    assert groups["full"]["layers"] == [0, 1] and "window=4" in groups["full"]["spec"]
    assert groups["full.1"]["layers"] == [2] and "window" not in groups["full.1"]["spec"]


def test_gemma3_attn_softcap_config_runs_as_transformers_computes(
    tmp_path: Path, run_on_cpu
) -> None:
    """transformers' Gemma-3 ignores attn_logit_softcapping; capping made the logits differ."""
    cfg = tiny_config("gemma-3")
    cfg["attn_logit_softcapping"] = 1.0  # tight enough to change every layer if applied
    path = _config_path(tmp_path, cfg)
    report = run_on_cpu(str(path))
    assert report.ok, report.format()


@pytest.mark.parametrize(
    ("layout_change", "what"),
    [({"query_pre_attn_scalar": 16}, "softmax scale"), ({"sliding_window": 8}, "sliding window")],
)
def test_hook_refuses_a_mapping_that_disagrees_with_the_module(
    monkeypatch: pytest.MonkeyPatch, layout_change: dict[str, int], what: str
) -> None:
    """The layout is parsed from a config that differs from the model's: the hook names the
    layer, the module and the quantity instead of computing other math."""
    real = configs_mod.specs_from_hf_config

    def wrong(cfg, **kw):
        return real({**cfg, **layout_change}, **kw)

    monkeypatch.setattr(configs_mod, "specs_from_hf_config", wrong)
    with pytest.raises(ValueError, match=rf"layer 0 \(Gemma3Attention\).*{what}"):
        run_architecture("gemma-3", prompts=1, max_new_tokens=1)


def test_run_refuses_a_soft_cap_the_module_does_not_apply(tmp_path: Path) -> None:
    """OLMo-2's attention never passes attn_logit_softcapping to the attention function: the
    mapping refuses the field (explain and run alike) rather than cap what the model does not."""
    import transformers

    from attn_core.e2e.main import run_main

    cfg = transformers.Olmo2Config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    ).to_dict()
    cfg["attn_logit_softcapping"] = 30.0
    path = _config_path(tmp_path, cfg)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=30.0 in layers 0-1.*refused"):
        run_main(
            str(path),
            device="cpu",
            dtype="fp32",
            prompts=1,
            max_new_tokens=1,
            graphs=False,
            registry=None,
            constraints=None,
            progress=False,
            console=lambda *a: None,
        )


def test_nemotron_h_time_step_floor_is_applied(tmp_path: Path, run_on_cpu) -> None:
    """time_step_min clamps softplus(dt + dt_bias) from below in transformers; at 0.5 (dt_bias
    starts at 1) the clamp is active for many tokens and heads, and the run still matches."""
    cfg = tiny_config("nemotron-h")
    cfg["time_step_min"] = 0.5
    path = _config_path(tmp_path, cfg)
    report = run_on_cpu(str(path))
    assert report.ok, report.format()


_DEEPSEEK_V2_SMALL: dict[str, object] = {
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,  # layer 0 dense MLP, layer 1 MoE
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "vocab_size": 256,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


# DeepSeek-V2's variants: V2-Lite (q_proj, no query LoRA) and query LoRA with YaRN rope
_DEEPSEEK_V2_VARIANTS: dict[str, dict[str, object]] = {
    "lite": {"q_lora_rank": None},
    "yarn": {
        "q_lora_rank": 32,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
}


def _deepseek_v2_config(variant: str, **sizes: object) -> dict[str, object]:
    """The DeepSeek-V2 config of the CPU test (``variant`` of :data:`_DEEPSEEK_V2_VARIANTS`),
    ``sizes`` changed (the GPU test's kernel shapes), as ``config.json`` holds it."""
    import transformers

    fields = {**_DEEPSEEK_V2_SMALL, **_DEEPSEEK_V2_VARIANTS[variant], **sizes}
    return transformers.DeepseekV2Config(**fields).to_dict()


@pytest.mark.parametrize("variant", list(_DEEPSEEK_V2_VARIANTS))
def test_run_deepseek_v2_matches_transformers(tmp_path: Path, variant: str, run_on_cpu) -> None:
    """DeepSeek-V2's MLA (complex freqs_cis rope on interleaved pairs, no rope_interleave
    field) runs in the absorbed form through the binding and matches transformers."""
    path = _config_path(tmp_path, _deepseek_v2_config(variant))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    assert "DeepseekV2ForCausalLM" in report.format() and "mla 4q/1kv d40/32" in report.format()


def _granite_4_h_config(position: str | None, **sizes: object) -> dict[str, object]:
    """The Granite-4.0-H config of the CPU test (``position_embedding_type`` ``position``),
    ``sizes`` changed (the GPU test's kernel shapes), with the hub's ``layer_types`` names."""
    import transformers

    fields: dict[str, object] = dict(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        hidden_size=64,
        intermediate_size=128,
        shared_intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=3.0,
        attention_multiplier=0.2,
        position_embedding_type=position,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = transformers.GraniteMoeHybridConfig(**{**fields, **sizes}).to_dict()
    cfg["layer_types"] = ["mamba", "attention", "mamba", "attention"]  # as hub configs say
    return cfg


@pytest.mark.parametrize("position", ["rope", None], ids=["rope", "nope"])
def test_run_granite_4_h_matches_transformers(
    tmp_path: Path, position: str | None, run_on_cpu
) -> None:
    """Granite-4.0-H: Mamba2 and attention layers by the hub's layer_types names, MoE plus a
    shared MLP, its embedding / residual / logits multipliers and attention_multiplier scale."""
    path = _config_path(tmp_path, _granite_4_h_config(position))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    groups = _groups(report.runs[0])
    assert groups == {"linear": [0, 2], "full": [1, 3]}


def _qwen3_5_config(cls_name: str, **sizes: object) -> dict[str, object]:
    """The Qwen3.5 config of the CPU test (``cls_name``: the dense or the MoE text config
    class), ``sizes`` changed (the GPU test's kernel shapes), as ``config.json`` holds it."""
    import transformers

    moe = (
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        }
        if "Moe" in cls_name
        else {}
    )
    fields: dict[str, object] = dict(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        vocab_size=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        **moe,
    )
    return getattr(transformers, cls_name)(**{**fields, **sizes}).to_dict()


_QWEN3_5_CLASSES = ["Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"]


@pytest.mark.parametrize("cls_name", _QWEN3_5_CLASSES)
def test_run_qwen3_5_matches_transformers(tmp_path: Path, cls_name: str, run_on_cpu) -> None:
    """Qwen3.5 (dense and MoE): Gated DeltaNet layers with separate q|k|v, z, b, a projections
    (no fix_query_key_value_ordering), gated full attention with partial multimodal rope."""
    import transformers

    assert not hasattr(
        transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet,
        "fix_query_key_value_ordering",
    )
    path = _config_path(tmp_path, _qwen3_5_config(cls_name))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    groups = _groups(report.runs[0])
    assert groups == {"linear": [0, 1, 2], "full": [3]}


# ------------------------------------------------------------------------------------------
# GPU: the configs above at kernel shapes on the plugins found by entry points (issue 22)
# ------------------------------------------------------------------------------------------
# The shapes of attn_core.e2e.configs' kernel samples: hidden 256, full attention heads of 128
# (Qwen3.5) or 64 (Granite: 256 / 4), Gated DeltaNet heads of 128, Mamba2 heads of 64 with state
# 128 (mamba_expand 2 * 256 = 8 heads * 64), DeepSeek's real MLA ranks 512 + 64 (FlashInfer's
# MLA), and configs.init_std for hidden 256; the rest as on CPU.
_KERNEL_INIT = init_std(256)
_QWEN3_5_KERNEL: dict[str, object] = dict(
    hidden_size=256,
    head_dim=128,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    initializer_range=_KERNEL_INIT,
)
_DEEPSEEK_V2_KERNEL: dict[str, object] = dict(
    hidden_size=256,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    initializer_range=_KERNEL_INIT,
)
_GRANITE_4_H_KERNEL: dict[str, object] = dict(
    hidden_size=256,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_chunk_size=64,
    initializer_range=_KERNEL_INIT,
)
#: Every CPU case above at kernel shapes: id -> its config.json contents.
_GPU_CONFIGS: dict[str, Callable[[], dict[str, object]]] = {
    "qwen3_5": lambda: _qwen3_5_config("Qwen3_5TextConfig", **_QWEN3_5_KERNEL),
    "qwen3_5_moe": lambda: _qwen3_5_config("Qwen3_5MoeTextConfig", **_QWEN3_5_KERNEL),
    **{
        f"deepseek_v2_{v}": (lambda v=v: _deepseek_v2_config(v, **_DEEPSEEK_V2_KERNEL))
        for v in _DEEPSEEK_V2_VARIANTS
    },
    "granite_4_h_rope": lambda: _granite_4_h_config("rope", **_GRANITE_4_H_KERNEL),
    "granite_4_h_nope": lambda: _granite_4_h_config(None, **_GRANITE_4_H_KERNEL),
}
_GRAPHS = pytest.mark.parametrize("graphs", [False, "decode"], ids=["eager", "graphs"])


@_GRAPHS
@pytest.mark.parametrize("case", list(_GPU_CONFIGS))
def test_issue_22_gpu_configs_plan_a_plugin_for_every_group_on_an_h200(
    tmp_path: Path, case: str, graphs: bool | str, h200_plan, monkeypatch
) -> None:
    """On CPU: the GPU test's configs have the shapes the GPU plugins serve; an H200's
    offline plan puts every group on a plugin, CUDA-graph decode granted. MLA graph decode is
    declared on FlashInfer 0.6 releases only (and not where no release can be read, as on a
    machine without it): the plan is made as with 0.6.7 installed."""
    fi_capability = pytest.importorskip("attn_plugin_flashinfer.capability")
    real = fi_capability.probe
    monkeypatch.setattr(
        fi_capability, "probe", lambda: dataclasses.replace(real(), version="0.6.7")
    )
    plan = h200_plan(_config_path(tmp_path, _GPU_CONFIGS[case]()), graphs=graphs)
    kinds = {g["spec"].split()[0] for g in plan["groups"]}
    assert kinds == ({"mla"} if case.startswith("deepseek") else {"linear", "full"}), plan


@pytest.mark.gpu
@_GRAPHS
@pytest.mark.parametrize("case", list(_GPU_CONFIGS))
def test_issue_22_family_on_gpu_plugins_matches_transformers(
    tmp_path: Path, case: str, graphs: bool | str, run_on_gpu_plugins
) -> None:
    """``attn run --model CONFIG.json --device cuda [--graphs]`` (bf16) on the plugins found by
    entry points: Qwen3.5 dense and MoE (Gated DeltaNet on triton_ssm, gated full attention),
    DeepSeek-V2 (MLA on FlashInfer's MLA), Granite-4.0-H (Mamba2 on triton_ssm, attention)
    match transformers, every group on a GPU plugin."""
    run_on_gpu_plugins(_config_path(tmp_path, _GPU_CONFIGS[case]()), graphs=graphs)


def test_run_multimodal_gemma3_config_drives_its_language_model(tmp_path: Path, run_on_cpu) -> None:
    """A full Gemma-3 config (model_type gemma3, the decoder in text_config): text prompts run
    its language model; Gemma3ForConditionalGeneration applies no final soft-cap although the
    text config sets one (Gemma3ForCausalLM would), and the run agrees with it."""
    import transformers

    text = {k: v for k, v in tiny_config("gemma-3").items() if k != "architectures"}
    assert text["final_logit_softcapping"] == 30.0
    cfg = transformers.Gemma3Config(
        text_config={**text, "model_type": "gemma3_text"},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    path = _config_path(tmp_path, cfg.to_dict())
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    assert "Gemma3ForConditionalGeneration" in report.format()
    # both stacks run: the SigLIP tower through the encoder path, the language model on text
    vision, text = report.runs
    assert (vision.name, text.name) == (f"{path} [vision]", f"{path} [text]")
    assert [g["group_id"] for g in vision.plan["groups"]] == ["vision.encoder"]
    assert vision.mode_counts == {"encoder": 1}
    assert {g["group_id"] for g in text.plan["groups"]} == {"text.full", "text.full.1"}
    assert "decode" in text.mode_counts


def test_run_kimi_linear_from_its_transformers_config(tmp_path: Path, run_on_cpu) -> None:
    """A config written by transformers' KimiLinearConfig (layer_types, no linear_attn_config
    lists: its default pattern puts MLA on layer 4) with a query LoRA, through a config path:
    KDA layers on both sides of the MLA one, MoE after layer 0, and the run matches."""
    import transformers

    cfg = transformers.KimiLinearConfig(
        num_hidden_layers=6,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=8,
        linear_conv_kernel_dim=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.1,
        tie_word_embeddings=False,
    ).to_dict()
    assert (
        cfg["layer_types"][4] == "full_attention"
        and cfg["layer_types"].count("full_attention") == 1
    )
    path = _config_path(tmp_path, cfg)
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    text = report.format()
    assert "linear kda 4q/4kv d8" in text and "[layers 0,1,2,3,5]" in text, text
    assert "mla 4q/1kv d40/32" in text and "[layers 4]" in text, text


def test_kimi_linear_mla_scale_is_checked_against_the_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mapping that folded a YaRN temperature into Kimi-Linear's MLA scale (as DeepSeek's
    does; Kimi-Linear applies no rope) is caught at the MLA module, not run as other math."""
    import attn_core.models.hf_config as hf_config_mod

    real_mla, real_specs = hf_config_mod._mla, configs_mod.specs_from_hf_config
    yarn = {"type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}
    monkeypatch.setattr(
        hf_config_mod, "_mla", lambda r, o, yarn_scale: real_mla(r, o, yarn_scale=True)
    )
    monkeypatch.setattr(
        configs_mod,
        "specs_from_hf_config",
        lambda cfg, **kw: real_specs({**cfg, "rope_scaling": yarn}, **kw),
    )
    with pytest.raises(ValueError, match=r"layer 3 \(KimiLinearAttention\).*softmax scale"):
        run_architecture("kimi-linear", prompts=1, max_new_tokens=1)


# ------------------------------------------------------------------------------------------
# Falcon-H1: attention and Mamba2 in parallel inside every decoder layer
# ------------------------------------------------------------------------------------------
def _falcon_h1_path(tmp_path: Path, **change: object) -> str:
    return _config_path(tmp_path, {**tiny_config("falcon-h1"), **change})


def test_falcon_h1_runs_both_ops_of_every_layer(run_on_cpu) -> None:
    """Both groups cover every layer; the run (chunked prefill, mixed steps, decode) matches
    transformers' eager forward at fp32 tolerance with every greedy token equal."""
    report = run_on_cpu("falcon-h1")
    assert report.ok, report.format()
    (run,) = report.runs
    groups = {g["group_id"]: (g["layers"], g["spec"]) for g in run.plan["groups"]}
    assert groups["linear"][0] == groups["full"][0] == [0, 1, 2]
    assert "mamba2 6q/2kv d16" in groups["linear"][1] and "full 4q/2kv d16" in groups["full"][1]
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()


@pytest.mark.parametrize(
    "change",
    [
        {"mamba_rms_norm": True, "mamba_norm_before_gate": True},  # norm, then the silu(z) gate
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False},  # gate, then the norm
        {"mamba_d_ssm": None, "mamba_n_heads": 8, "mamba_d_head": "auto"},  # expand * hidden
        {"time_step_limit": [0.5, float("inf")]},  # a dt floor active for many tokens
        {"key_multiplier": 3.0, "ssm_in_multiplier": 0.3, "ssm_out_multiplier": 2.0},
    ],
    ids=["norm-before-gate", "gate-before-norm", "d-ssm-from-expand", "dt-floor", "multipliers"],
)
def test_falcon_h1_mixer_variants_match_transformers(
    tmp_path: Path, change: dict[str, object], run_on_cpu
) -> None:
    report = run_on_cpu(_falcon_h1_path(tmp_path, **change))
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()


@pytest.mark.parametrize("kind", ["full", "linear"])
def test_falcon_h1_comparison_sees_each_branch(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """One op of every parallel layer zeroed (the other kept): the logits leave tolerance, so
    a wrong attention or a wrong Mamba2 op would not pass unseen behind the other branch."""
    from attn_core.binding import LayerAttentionBinding

    real = LayerAttentionBinding.forward

    def zeroed(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out.zero_() if self.spec.kind.value == kind else out

    monkeypatch.setattr(LayerAttentionBinding, "forward", zeroed)
    run = run_architecture("falcon-h1", prompts=2, max_new_tokens=3)
    assert not run.ok and run.match.max_abs_diff > 1e-2, run.format()


def test_falcon_h1_upper_dt_clamp_is_refused_by_run(tmp_path: Path, run_on_cpu) -> None:
    with pytest.raises(ValueError, match=r"time_step_limit=\[0.0, 1.0\].*layers 0-2.*refused"):
        run_on_cpu(_falcon_h1_path(tmp_path, time_step_limit=[0.0, 1.0]))


# ------------------------------------------------------------------------------------------
# Gated DeltaNet / KDA hybrids of transformers 5.24: Lara-Mini, Qwen4-Exp, Bailing-Hybrid
# ------------------------------------------------------------------------------------------
_GDN_SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
    eos_token_id=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@since_transformers("5.24.0", "LaraMiniConfig ('lara_mini')")
def test_run_lara_mini_matches_transformers(tmp_path: Path, run_on_cpu) -> None:
    """Lara-Mini: Qwen3.5's Gated DeltaNet (in_proj_qkv / _z / _b / _a) beside ungated GQA
    layers, ``sliding_attention`` ones with rope and ``full_attention`` ones with none (NoPE);
    the whole model's forward runs, so which layers get rope stays transformers' code."""
    import transformers

    cfg = transformers.LaraMiniConfig(num_hidden_layers=5, sliding_window=4, **_GDN_SMALL)
    assert cfg.layer_types == [
        "linear_attention",
        "sliding_attention",
        "linear_attention",
        "full_attention",
        "sliding_attention",
    ]
    report = run_on_cpu(_config_path(tmp_path, cfg.to_dict()))
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()
    assert _groups(run) == {"linear": [0, 2], "full": [1, 4], "full.1": [3]}, _groups(run)
    text = report.format()
    assert "linear gated_deltanet 4q/2kv d16" in text and "window=4  [layers 1,4]" in text, text


def test_run_qwen4_exp_linear_layers_match_transformers(tmp_path: Path, run_on_cpu) -> None:
    """Qwen4-Exp without attention layers: its Gated DeltaNet (Qwen3.5's, a sigmoid output
    gate) inside its hyper-connections (four residual streams mixed around each mixer); the
    whole model's forward runs, so the streams stay transformers' code."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        num_hidden_layers=3,
        layer_types=["linear_attention"] * 3,
        hc_lowrank=8,
        output_gate_type="sigmoid",
        **_GDN_SMALL,
    )
    report = run_on_cpu(_config_path(tmp_path, cfg.to_dict()))
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()
    assert _groups(run) == {"linear": [0, 1, 2]}


def test_qwen4_exp_indexed_attention_is_refused_naming_its_layers(tmp_path: Path) -> None:
    """Qwen4-Exp's attention layers are all QSA-indexed (every attention module has the
    indexer): no layer kind, so the config is refused, the feature and the layers named."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    from attn_core.models.hf_config import specs_from_hf_config

    cfg = Qwen4ExpTextConfig(num_hidden_layers=8, hc_lowrank=8, **_GDN_SMALL).to_dict()
    # the layers' name from transformers 5.18 on; qwen_sparse_attention before
    name = "qwen_sparse_attention" if transformers_before("5.18.0") else "indexed_attention"
    assert cfg["layer_types"].count(name) == 2
    with pytest.raises(ValueError) as err:
        specs_from_hf_config(cfg)
    msg = str(err.value)
    assert f"qwen4_exp_text: layer_types has {name!r} in layers 3,7" in msg, msg
    assert "QSA" in msg and "top-k" in msg and "no layer kind" in msg, msg
    assert "is not supported" not in msg, msg  # the model type maps; those layers do not
