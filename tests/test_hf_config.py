"""specs_from_hf_config against the bundled sample configs and against transformers itself.

The expected head counts, windows, scales and layer patterns are checked two ways: against numbers
written out here from the models' published configs, and against what transformers' own config
classes and attention modules derive from the same dict (modules built on the meta device, so no
weights are allocated).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from typing import Any

import pytest
import torch

from attn_core.models import (
    SUPPORTED_MODEL_TYPES,
    ModelLayout,
    load_sample,
    sample_names,
    specs_from_hf_config,
)
from attn_core.specs import LayerGroup, LayerKind, LayerSpec, LinearVariant

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "bamba",
    "deepseek-v3",
    "falcon-h1",
    "falcon-mamba",
    "gemma-3",
    "gpt-oss",
    "jamba",
    "kimi-linear",
    "lfm2",
    "llama-4",
    "minimax",
    "nemotron-h",
    "qwen2-vl",
    "qwen2-vl-vision",
    "qwen2.5-vl",
    "qwen2.5-vl-vision",
    "qwen3",
    "qwen3-next",
    "siglip-vision",
    "whisper-encoder",
]
# Files the stack samples name (SAMPLE_STACKS); ``whisper`` itself is refused (its decoder).
WHOLE_SAMPLES = {"qwen2-vl-vision": "qwen2-vl", "qwen2.5-vl-vision": "qwen2.5-vl"}


def hf_config(d: dict[str, Any]) -> Any:
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(d["model_type"], **kwargs)


def on_meta(cls: type, *args: Any) -> Any:
    with torch.device("meta"):
        return cls(*args)


def summary(layout: ModelLayout) -> list[tuple[str, str, int, int, int]]:
    return [
        (g.group_id, g.spec.kind.value, len(g.layer_indices), g.spec.num_heads, g.spec.num_kv_heads)
        for g in layout.groups
    ]


# ------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------
def test_sample_names_lists_every_bundled_config() -> None:
    assert sample_names() == sorted([*SAMPLES, "whisper"])


def test_load_sample_returns_a_fresh_dict() -> None:
    d = load_sample("qwen3")
    d["num_hidden_layers"] = 1
    assert load_sample("qwen3")["num_hidden_layers"] == 36


def test_load_sample_unknown_name_lists_samples() -> None:
    with pytest.raises(ValueError, match=r"'llama-9'.*qwen3-next"):
        load_sample("llama-9")


EXPECTED_GROUPS = {
    # group id, kind, layers, heads, kv heads (tp=1)
    "qwen3": [("full", "full", 36, 32, 8)],
    "qwen3-next": [("linear", "linear", 36, 32, 16), ("full", "full", 12, 16, 2)],
    "deepseek-v3": [("mla", "mla", 61, 128, 1)],
    "bamba": [("linear", "linear", 29, 128, 1), ("full", "full", 3, 32, 8)],
    # Mamba1: one head per inner channel (d_inner = 2 * 4096), one B / C group
    "jamba": [("linear", "linear", 28, 8192, 1), ("full", "full", 4, 32, 8)],
    "falcon-mamba": [("linear", "linear", 64, 8192, 1)],
    # parallel hybrid: every layer in both groups (Mamba2 24 heads / 1 group, GQA 8q/2kv)
    "falcon-h1": [("linear", "linear", 36, 24, 1), ("full", "full", 36, 8, 2)],
    "nemotron-h": [("linear", "linear", 24, 128, 8), ("full", "full", 4, 32, 8)],
    "gpt-oss": [("full", "full", 12, 64, 8), ("full.1", "full", 12, 64, 8)],
    "gemma-3": [("full", "full", 22, 4, 1), ("full.1", "full", 4, 4, 1)],
    "qwen2.5-vl-vision": [("vision.encoder", "encoder", 32, 16, 16)],
    "qwen2-vl-vision": [("vision.encoder", "encoder", 32, 16, 16)],
    # the whole Qwen-VL configs: the tower and the language model (28 GQA layers)
    "qwen2.5-vl": [("vision.encoder", "encoder", 32, 16, 16), ("text.full", "full", 28, 28, 4)],
    "qwen2-vl": [("vision.encoder", "encoder", 32, 16, 16), ("text.full", "full", 28, 28, 4)],
    # whisper-large-v3's encoder: 32 layers of 20 heads of 64
    "whisper-encoder": [("encoder.encoder", "encoder", 32, 20, 20)],
    "siglip-vision": [("encoder", "encoder", 27, 16, 16)],
    "minimax": [("linear", "linear", 70, 64, 64), ("full", "full", 10, 64, 8)],
    "lfm2": [("linear", "linear", 10, 1, 1), ("full", "full", 6, 32, 8)],
    # KDA layers 1-3,5-7,...,25-26 and MLA layers 4,8,...,24,27 (1-based in the config)
    "kimi-linear": [("linear", "linear", 20, 32, 32), ("mla", "mla", 7, 32, 1)],
    # 36 chunked rope layers, every 4th a global NoPE layer
    "llama-4": [("full", "full", 36, 40, 8), ("full.1", "full", 12, 40, 8)],
}
EXPECTED_MODEL_TYPE = {
    "qwen3": "qwen3",
    "qwen3-next": "qwen3_next",
    "deepseek-v3": "deepseek_v3",
    "bamba": "bamba",
    "jamba": "jamba",
    "falcon-mamba": "falcon_mamba",
    "falcon-h1": "falcon_h1",
    "nemotron-h": "nemotron_h",
    "gpt-oss": "gpt_oss",
    "gemma-3": "gemma3_text",
    "qwen2.5-vl-vision": "qwen2_5_vl",
    "qwen2-vl-vision": "qwen2_vl",
    "qwen2.5-vl": "qwen2_5_vl",
    "qwen2-vl": "qwen2_vl",
    "whisper-encoder": "whisper",
    "siglip-vision": "siglip_vision_model",
    "minimax": "minimax",
    "lfm2": "lfm2",
    "kimi-linear": "kimi_linear",
    "llama-4": "llama4_text",
}


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_groups(name: str) -> None:
    layout = specs_from_hf_config(name)
    assert summary(layout) == EXPECTED_GROUPS[name]
    assert layout.model_type == EXPECTED_MODEL_TYPE[name]
    assert layout.architecture == load_sample(name)["architectures"][0]
    assert layout.tp_size == 1
    # a multi-stack layout's groups are its stacks', each stack's partition its layers
    if layout.stacks:
        assert layout.groups == tuple(g for s in layout.stacks for g in s.groups)
        assert not layout.layer_indices
        assert all(s.family == SAMPLE_STACK_FAMILIES[name][s.stack] for s in layout.stacks)
    else:
        assert layout.family == SAMPLE_STACK_FAMILIES.get(name, name)
    for stack in layout.stacks or (layout,):
        # groups partition the stack's ops (a parallel layer's index once per op), and
        # group_of agrees with layer_specs
        grouped = sorted(i for g in stack.groups for i in g.layer_indices)
        assert grouped == list(stack.layer_indices)
        assert all(g.group_id.startswith(f"{stack.stack}.") for g in stack.groups if stack.stack)
        for index, spec in zip(stack.layer_indices, stack.layer_specs, strict=True):
            assert stack.group_of(index, spec.kind).spec == spec
            if index not in stack.parallel_layers:
                assert stack.spec_of(index) is stack.group_of(index).spec
        dtype = "float16" if name == "whisper-encoder" else "bfloat16"  # its torch_dtype
        assert all(s.dtype == dtype for s in stack.layer_specs)
    assert (layout.parallel_layers != ()) == (name == "falcon-h1")


# The family that parses each stack (a sample named for one stack: that stack's).
SAMPLE_STACK_FAMILIES: dict[str, Any] = {
    "whisper-encoder": "whisper-encoder",
    "qwen2-vl": {"vision": "qwen2-vl-vision", "text": "qwen2-vl-text"},
    "qwen2.5-vl": {"vision": "qwen2.5-vl-vision", "text": "qwen2-vl-text"},
}


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_builds_with_its_transformers_config_class(name: str) -> None:
    d = load_sample(name)
    cfg = hf_config(d)
    assert cfg.model_type == d["model_type"]
    layout = specs_from_hf_config(name)
    if name == "qwen2.5-vl-vision":
        assert isinstance(cfg, transformers.Qwen2_5_VLConfig)
        assert cfg.vision_config.depth == layout.num_layers
        assert list(cfg.vision_config.fullatt_block_indexes) == [7, 15, 23, 31]
    elif name == "qwen2-vl-vision":
        assert isinstance(cfg, transformers.Qwen2VLConfig)
        assert cfg.vision_config.depth == layout.num_layers
    elif name in ("qwen2-vl", "qwen2.5-vl"):
        assert [s.num_layers for s in layout.stacks] == [
            cfg.vision_config.depth,
            cfg.text_config.num_hidden_layers,
        ]
    elif name == "whisper-encoder":
        assert isinstance(cfg, transformers.WhisperConfig)
        assert cfg.encoder_layers == layout.num_layers
    else:
        assert cfg.num_hidden_layers == layout.num_layers


@pytest.mark.parametrize("name", SAMPLES)
def test_transformers_to_dict_gives_the_same_layout(name: str) -> None:
    """transformers re-serialises (rope_parameters, layer_types, layers_block_type, dtype)."""
    raw = specs_from_hf_config(name)
    cfg = hf_config(load_sample(name))
    # a Qwen-VL sample is flat (the hub's form); transformers writes its text_config
    stack = raw.stack or None
    from_dict = specs_from_hf_config(cfg.to_dict(), stack=stack)
    from_object = specs_from_hf_config(cfg, stack=stack)
    assert from_dict.groups == raw.groups
    assert from_object.layer_specs == raw.layer_specs
    assert [s.groups for s in from_object.stacks] == [s.groups for s in raw.stacks]


# ------------------------------------------------------------------------------------------
# Per-model details, checked against transformers' own modules
# ------------------------------------------------------------------------------------------
def test_qwen3_dense_matches_hf_attention() -> None:
    d = load_sample("qwen3")
    layout = specs_from_hf_config(d)
    attn = on_meta(transformers.models.qwen3.modeling_qwen3.Qwen3Attention, hf_config(d), 0)
    spec = layout.spec_of(0)
    assert spec.head_dim == attn.head_dim == 128
    assert spec.num_heads == attn.q_proj.out_features // attn.head_dim
    assert spec.num_kv_heads == attn.k_proj.out_features // attn.head_dim
    assert spec.scale == pytest.approx(attn.scaling)
    assert spec.sliding_window is None and spec.causal


def test_qwen3_next_layers() -> None:
    d = load_sample("qwen3-next")
    layout = specs_from_hf_config(d)
    assert layout.num_layers == 48
    assert layout.group_of(3).group_id == "full"
    assert layout.group_of(0).group_id == "linear"
    full_layers = next(g for g in layout.groups if g.group_id == "full").layer_indices
    assert full_layers == tuple(range(3, 48, 4))
    # layer types agree with transformers' own derivation from full_attention_interval
    hf = hf_config(d)
    assert [layout.spec_of(i).kind.value for i in range(48)] == [
        "full" if t == "full_attention" else "linear" for t in hf.layer_types
    ]
    linear = layout.spec_of(0)
    gdn = on_meta(transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet, hf, 0)
    assert linear.linear_variant is LinearVariant.GATED_DELTANET
    assert (linear.num_heads, linear.num_kv_heads) == (gdn.num_v_heads, gdn.num_k_heads)
    assert (linear.head_dim, linear.head_dim_v) == (gdn.head_k_dim, gdn.head_v_dim)
    assert linear.conv_channels == gdn.conv1d.in_channels == 8192
    assert linear.conv_kernel_size == gdn.conv1d.kernel_size[0] == 4
    assert linear.qk_l2norm and linear.state_dtype == "float32"
    assert linear.ssm_state_shape == (32, 128, 128)
    attn = on_meta(transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextAttention, hf, 3)
    full = layout.spec_of(3)
    assert (full.num_heads, full.num_kv_heads, full.head_dim) == (16, 2, attn.head_dim)
    assert full.num_kv_heads == attn.k_proj.out_features // attn.head_dim


def test_qwen3_next_tensor_parallel() -> None:
    tp2 = specs_from_hf_config("qwen3-next", tp_size=2)
    assert summary(tp2) == [("linear", "linear", 36, 16, 8), ("full", "full", 12, 8, 1)]
    assert tp2.spec_of(0).conv_channels == 2 * 8 * 128 + 16 * 128
    assert tp2.tp_size == 2
    # 2 KV heads over 4 ranks: replicated, one per rank (vLLM)
    tp4 = specs_from_hf_config("qwen3-next", tp_size=4)
    assert summary(tp4) == [("linear", "linear", 36, 8, 4), ("full", "full", 12, 4, 1)]


def test_deepseek_v3_mla_matches_hf() -> None:
    d = load_sample("deepseek-v3")
    layout = specs_from_hf_config(d)
    spec = layout.spec_of(0)
    assert spec.kind is LayerKind.MLA
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim) == (512, 64, 128)
    assert (spec.head_dim, spec.head_dim_v) == (576, 512)
    assert spec.kv_bytes_per_token == 576 * 2
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert spec.softmax_scale == pytest.approx(mscale**2 / math.sqrt(192))
    attn = on_meta(
        transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention, hf_config(d), 0
    )
    assert spec.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert spec.num_heads == attn.num_heads


def test_deepseek_without_yarn_uses_plain_scale() -> None:
    d = load_sample("deepseek-v3")
    d["rope_scaling"] = None
    spec = specs_from_hf_config(d).spec_of(0)
    attn = on_meta(
        transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention, hf_config(d), 0
    )
    assert spec.softmax_scale == pytest.approx(1 / math.sqrt(192)) == pytest.approx(attn.scaling)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_deepseek_v2_mla_matches_hf(rope_type: str) -> None:
    kw: dict[str, Any] = dict(
        num_hidden_layers=3, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32
    )
    if rope_type == "yarn":
        kw["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        }
    hf = transformers.DeepseekV2Config(**kw)
    assert not hasattr(hf, "rope_interleave")
    layout = specs_from_hf_config(hf.to_dict())
    assert layout.family == "deepseek-v3" and layout.architecture == "DeepseekV2ForCausalLM"
    attn = on_meta(transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention, hf, 1)
    for i in range(3):
        spec = layout.spec_of(i)
        assert spec.kind is LayerKind.MLA and spec.mla_dims == (64, 16, 32)
        assert spec.num_heads == attn.num_heads
        assert spec.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    if rope_type == "yarn":
        assert attn.scaling != pytest.approx(48**-0.5)


def test_kimi_linear_matches_hf_modules() -> None:
    """KDA heads, head size, conv width and channels as the KDA module builds them; the MLA
    ranks and the plain scale (no rope, so no YaRN temperature) as the MLA module does."""
    d = load_sample("kimi-linear")
    layout = specs_from_hf_config(d)
    cfg = hf_config(d)
    modeling = transformers.models.kimi_linear.modeling_kimi_linear
    assert (
        [i for i in layout.layer_indices if layout.spec_of(i).kind is LayerKind.MLA]
        == [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        == [3, 7, 11, 15, 19, 23, 26]
    )
    kda = on_meta(modeling.KimiLinearDeltaAttention, cfg, 0)
    spec = layout.spec_of(0)
    assert spec.linear_variant is LinearVariant.KDA and spec.qk_l2norm
    assert (spec.num_heads, spec.num_kv_heads) == (kda.num_heads, kda.num_heads)
    assert spec.head_dim == spec.head_dim_v == kda.head_dim
    assert spec.conv_kernel_size == kda.conv_kernel_size
    assert spec.conv_channels == kda.conv_dim == kda.conv1d.weight.shape[0]
    assert spec.state_dtype == "float32"
    mla = on_meta(modeling.KimiLinearAttention, cfg, 3)
    spec = layout.spec_of(3)
    assert spec.mla_dims == (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim)
    assert spec.num_heads == mla.num_heads
    assert spec.softmax_scale == pytest.approx(mla.scaling, rel=1e-12)
    # a YaRN rope_scaling does not change the scale: the MLA layers apply no rope at all
    d["rope_scaling"] = {"type": "yarn", "factor": 40, "mscale_all_dim": 1.0}
    assert specs_from_hf_config(d).spec_of(3) == spec


def test_kimi_linear_without_lists_follows_layer_types_or_the_default() -> None:
    d = load_sample("kimi-linear")
    del d["linear_attn_config"]
    d["num_hidden_layers"] = 9
    d["linear_num_heads"], d["linear_head_dim"], d["linear_conv_kernel_dim"] = 4, 16, 3
    cfg = transformers.KimiLinearConfig(**d)
    layout = specs_from_hf_config(d)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [4, 8]
    assert [i for i in layout.layer_indices if layout.spec_of(i).kind is LayerKind.MLA] == full
    spec = layout.spec_of(0)
    assert (spec.num_heads, spec.head_dim, spec.conv_kernel_size) == (4, 16, 3)
    d["layer_types"] = ["full_attention"] + ["linear_attention"] * 8
    assert specs_from_hf_config(d).spec_of(0).kind is LayerKind.MLA


def test_bamba_mamba2_matches_hf_mixer() -> None:
    d = load_sample("bamba")
    layout = specs_from_hf_config(d)
    assert next(g for g in layout.groups if g.group_id == "full").layer_indices == (9, 18, 27)
    mixer = on_meta(transformers.models.bamba.modeling_bamba.BambaMixer, hf_config(d), 0)
    spec = layout.spec_of(0)
    assert spec.linear_variant is LinearVariant.MAMBA2
    assert spec.num_heads == mixer.num_heads == 128
    assert spec.num_kv_heads == mixer.n_groups == 1
    assert (spec.head_dim, spec.head_dim_v) == (mixer.ssm_state_size, mixer.head_dim)
    assert spec.conv_channels == mixer.conv_dim == 2 * 4096 + 2 * 1 * 128
    assert spec.conv_kernel_size == mixer.conv_kernel_size
    assert not spec.qk_l2norm and spec.scale == 1.0
    # tp=2: heads split, the single group replicated on both ranks
    tp2 = specs_from_hf_config(d, tp_size=2).spec_of(0)
    assert (tp2.num_heads, tp2.num_kv_heads, tp2.conv_channels) == (64, 1, 4096 + 2 * 128)


@pytest.mark.parametrize(
    ("name", "module", "mixer_cls", "layer"),
    [
        ("jamba", "jamba.modeling_jamba", "JambaMambaMixer", 0),
        ("falcon-mamba", "falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer", 0),
    ],
)
def test_mamba1_matches_hf_mixer(name: str, module: str, mixer_cls: str, layer: int) -> None:
    d = load_sample(name)
    cfg = hf_config(d)
    modeling = importlib.import_module(f"transformers.models.{module}")
    mixer = on_meta(getattr(modeling, mixer_cls), cfg, 0)
    layout = specs_from_hf_config(d)
    spec = layout.spec_of(layer)
    assert spec.linear_variant is LinearVariant.MAMBA1
    assert spec.num_heads == mixer.intermediate_size == 8192
    assert (spec.num_kv_heads, spec.head_dim, spec.head_dim_v) == (1, mixer.ssm_state_size, 1)
    assert tuple(mixer.A_log.shape) == (spec.num_heads, spec.head_dim)  # the A_log input
    assert spec.conv_channels == mixer.conv1d.in_channels == mixer.intermediate_size
    assert spec.conv_kernel_size == mixer.conv_kernel_size
    assert spec.ssm_state_shape[:2] == (mixer.intermediate_size, mixer.ssm_state_size)
    assert not spec.qk_l2norm and spec.scale == 1.0
    tp2 = specs_from_hf_config(d, tp_size=2).spec_of(layer)
    assert (tp2.num_heads, tp2.num_kv_heads, tp2.conv_channels) == (4096, 1, 4096)


def test_jamba_attention_layers_follow_period_and_offset() -> None:
    d = load_sample("jamba")
    layout = specs_from_hf_config(d)
    cfg = hf_config(d)
    full = next(g for g in layout.groups if g.group_id == "full")
    assert list(full.layer_indices) == [
        i for i, t in enumerate(cfg.layers_block_type) if t == "attention"
    ]
    assert full.layer_indices == (4, 12, 20, 28)
    attn = on_meta(transformers.models.jamba.modeling_jamba.JambaAttention, cfg, 4)
    assert full.spec.head_dim == attn.head_dim
    assert full.spec.scale == pytest.approx(attn.scaling)


def test_nemotron_h_pattern_and_mlp_layers() -> None:
    d = load_sample("nemotron-h")
    layout = specs_from_hf_config(d)
    hf = hf_config(d)
    expected = [i for i, t in enumerate(hf.layers_block_type) if t != "mlp"]
    assert list(layout.layer_indices) == expected
    assert next(g for g in layout.groups if g.group_id == "full").layer_indices == (7, 18, 29, 40)
    with pytest.raises(ValueError, match=r"layer 1 carries no attention"):
        layout.group_of(1)
    mixer = on_meta(transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer, hf, 0)
    spec = layout.spec_of(0)
    assert (spec.num_heads, spec.num_kv_heads) == (mixer.num_heads, mixer.n_groups)
    assert (spec.head_dim, spec.head_dim_v) == (mixer.ssm_state_size, mixer.head_dim)
    assert spec.conv_channels == mixer.conv_dim
    attn = on_meta(transformers.models.nemotron_h.modeling_nemotron_h.NemotronHAttention, hf, 7)
    full = layout.spec_of(7)
    assert full.head_dim == attn.head_dim
    assert full.num_kv_heads == attn.k_proj.out_features // attn.head_dim
    tp2 = specs_from_hf_config(d, tp_size=2).spec_of(0)
    assert (tp2.num_heads, tp2.num_kv_heads) == (64, 4)
    assert tp2.conv_channels == 64 * 64 + 2 * 4 * 128


def test_gpt_oss_sliding_full_and_sinks() -> None:
    d = load_sample("gpt-oss")
    layout = specs_from_hf_config(d)
    hf = hf_config(d)
    mod = transformers.models.gpt_oss.modeling_gpt_oss
    for i in (0, 1, 22, 23):
        attn = on_meta(mod.GptOssAttention, hf, i)
        spec = layout.spec_of(i)
        assert spec.sliding_window == attn.sliding_window  # 128 on even layers, None on odd
        assert spec.has_sinks and attn.sinks.shape == (spec.num_heads,)
        assert spec.scale == pytest.approx(attn.scaling)
    assert layout.group_of(0).group_id == "full" and layout.spec_of(0).sliding_window == 128
    assert layout.group_of(1).group_id == "full.1" and layout.spec_of(1).sliding_window is None


def test_gemma3_pattern_scale_and_softcap() -> None:
    d = load_sample("gemma-3")
    layout = specs_from_hf_config(d)
    hf = hf_config(d)
    mod = transformers.models.gemma3.modeling_gemma3
    globals_ = next(g for g in layout.groups if g.group_id == "full.1").layer_indices
    assert globals_ == (5, 11, 17, 23)
    for i in range(d["num_hidden_layers"]):
        attn = on_meta(mod.Gemma3Attention, hf, i)
        spec = layout.spec_of(i)
        assert spec.sliding_window == attn.sliding_window
        assert spec.softmax_scale == pytest.approx(attn.scaling)
        assert spec.logits_soft_cap is None is attn.attn_logit_softcapping
    # A scalar that differs from head_dim (Gemma-3-27B: 168) and a Gemma-2-style soft-cap, which
    # Gemma3Attention keeps but never passes to the attention function: it is not mapped.
    d.update(attn_logit_softcapping=50.0, query_pre_attn_scalar=168, head_dim=128)
    spec = specs_from_hf_config(d).spec_of(5)
    attn = on_meta(mod.Gemma3Attention, hf_config(d), 5)
    assert attn.attn_logit_softcapping == 50.0
    assert "softcap" not in inspect.getsource(mod.Gemma3Attention.forward)
    assert spec.logits_soft_cap is None
    assert spec.softmax_scale == pytest.approx(168**-0.5) == pytest.approx(attn.scaling)


def test_gemma3_multimodal_text_config_uses_hf_defaults() -> None:
    # google/gemma-3-4b-it's text_config lists only a few fields; the rest are class defaults.
    d = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    whole = specs_from_hf_config(d)
    assert whole.stack_names == ("vision", "text")
    # the absent vision fields are SiglipVisionConfig's defaults, as transformers fills them
    vision_cfg = hf_config(d).vision_config
    vision = whole.stack_layout("vision")
    assert vision.num_layers == vision_cfg.num_hidden_layers
    assert vision.spec_of(0).num_heads == vision_cfg.num_attention_heads
    assert vision.spec_of(0).head_dim == vision_cfg.hidden_size // vision_cfg.num_attention_heads
    layout = whole.stack_layout("text")
    assert specs_from_hf_config(d, stack="text") == layout
    hf = hf_config(d).text_config
    assert layout.model_type == "gemma3" and layout.num_layers == 34
    assert [layout.spec_of(i).sliding_window for i in range(34)] == [
        1024 if t == "sliding_attention" else None for t in hf.layer_types
    ]
    spec = layout.spec_of(0)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )


def test_gemma3_defaults_table_matches_transformers() -> None:
    from attn_core.models.hf_config import _GEMMA3_DEFAULTS

    cfg = transformers.Gemma3TextConfig()
    for name, value in _GEMMA3_DEFAULTS.items():
        if name == "sliding_window_pattern":  # a constructor kwarg, not an attribute
            assert cfg._sliding_window_pattern == value
        else:
            assert getattr(cfg, name) == value, name


def test_qwen2_5_vl_vision_encoder() -> None:
    d = load_sample("qwen2.5-vl-vision")
    layout = specs_from_hf_config(d, stack="vision")
    vision = hf_config(d).vision_config
    attn = on_meta(
        transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention, vision
    )
    spec = layout.spec_of(0)
    assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 16, attn.head_dim)
    assert spec.head_dim == 80
    assert spec.scale == pytest.approx(attn.scaling)
    assert layout.encoder_full_attention_layers == (7, 15, 23, 31)
    assert len(layout.groups) == 1  # window and full blocks share one spec
    assert specs_from_hf_config(d, dtype="float16", stack="vision").spec_of(0).dtype == "float16"
    assert specs_from_hf_config(d, tp_size=2, stack="vision").spec_of(0).num_heads == 8


# ------------------------------------------------------------------------------------------
# Dense aliases
# ------------------------------------------------------------------------------------------
def test_llama_derives_head_dim_and_ignores_window() -> None:
    d = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "torch_dtype": "float16",
    }
    layout = specs_from_hf_config(d)
    attn = on_meta(transformers.models.llama.modeling_llama.LlamaAttention, hf_config(d), 0)
    assert summary(layout) == [("full", "full", 4, 32, 8)]
    assert layout.spec_of(0).head_dim == attn.head_dim == 128
    assert layout.spec_of(0).dtype == "float16"


def test_mistral_slides_on_every_layer() -> None:
    d = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "sliding_window": 4096,
    }
    layout = specs_from_hf_config(d)
    assert summary(layout) == [("full", "full", 4, 32, 8)]
    assert layout.spec_of(3).sliding_window == 4096
    # no "architectures" in the dict: the transformers causal-LM class for the model_type
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    assert layout.architecture == names["mistral"] == "MistralForCausalLM"


@pytest.mark.parametrize("name", ["qwen3", "qwen3-next", "deepseek-v3", "bamba", "gpt-oss"])
def test_default_architecture_is_the_transformers_class(name: str) -> None:
    d = load_sample(name)
    del d["architectures"]
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    assert specs_from_hf_config(d).architecture == names[d["model_type"]]


def test_qwen2_use_sliding_window_follows_max_window_layers() -> None:
    d = {
        "model_type": "qwen2",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 6,
        "use_sliding_window": True,
        "sliding_window": 2048,
        "max_window_layers": 4,
    }
    layout = specs_from_hf_config(d)
    hf = hf_config(d)
    assert [layout.spec_of(i).sliding_window for i in range(6)] == [
        2048 if t == "sliding_attention" else None for t in hf.layer_types
    ]
    assert [layout.spec_of(i).sliding_window for i in range(6)] == [None] * 4 + [2048] * 2
    d["use_sliding_window"] = False
    assert all(s.sliding_window is None for s in specs_from_hf_config(d).layer_specs)


# ------------------------------------------------------------------------------------------
# Options and errors
# ------------------------------------------------------------------------------------------
def test_tp_size_halves_heads_for_every_sample() -> None:
    for name in SAMPLES:
        one, two = specs_from_hf_config(name), specs_from_hf_config(name, tp_size=2)
        assert len(one.groups) == len(two.groups)
        for g1, g2 in zip(one.groups, two.groups, strict=True):
            if g1.spec.linear_variant is LinearVariant.SHORT_CONV:  # no heads: channels split
                assert g2.spec.conv_channels * 2 == g1.spec.conv_channels, name
                assert g2.layer_indices == g1.layer_indices
                continue
            assert g2.spec.num_heads * 2 == g1.spec.num_heads, name
            kv = g1.spec.num_kv_heads
            assert g2.spec.num_kv_heads == (kv // 2 if kv >= 2 else 1), name
            assert g2.layer_indices == g1.layer_indices


@pytest.mark.parametrize(
    ("name", "tp_size", "field"),
    [
        ("qwen3", 3, "num_attention_heads=32"),
        ("qwen3-next", 3, "num_attention_heads=16"),
        ("deepseek-v3", 3, "num_attention_heads=128"),
        ("bamba", 3, "mamba_n_heads=128"),
        ("qwen2.5-vl-vision", 3, "vision_config.num_heads=16"),
        ("gemma-3", 8, "num_attention_heads=4"),
        ("kimi-linear", 3, "linear_attn_config.num_heads=32"),
    ],
)
def test_tp_size_that_does_not_divide_raises(name: str, tp_size: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}.*tp_size={tp_size}"):
        specs_from_hf_config(name, tp_size=tp_size)


def test_kv_heads_that_cannot_be_replicated_raise() -> None:
    d = load_sample("qwen3")
    d["num_key_value_heads"] = 3
    d["num_attention_heads"] = 24
    with pytest.raises(ValueError, match=r"num_key_value_heads=3.*tp_size=4"):
        specs_from_hf_config(d, tp_size=4)
    assert specs_from_hf_config(d, tp_size=3).spec_of(0).num_kv_heads == 1
    # 8 KV heads over 16 ranks: one per rank
    assert specs_from_hf_config("qwen3", tp_size=16).spec_of(0).num_kv_heads == 1


@pytest.mark.parametrize("tp_size", [0, -2, 1.5, True])
def test_bad_tp_size(tp_size: Any) -> None:
    with pytest.raises(ValueError, match="tp_size"):
        specs_from_hf_config("qwen3", tp_size=tp_size)


def test_unknown_model_type_lists_supported() -> None:
    with pytest.raises(ValueError) as err:
        specs_from_hf_config({"model_type": "falcon", "num_hidden_layers": 2})
    message = str(err.value)
    assert "'falcon'" in message
    for model_type in ("qwen3_next", "deepseek_v3", "bamba", "jamba", "falcon_mamba", "gpt_oss"):
        assert model_type in message
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "gemma3_text", "qwen2_5_vl"}
    with pytest.raises(ValueError, match="model_type=None"):
        specs_from_hf_config({"num_hidden_layers": 2})


def test_missing_field_is_named() -> None:
    d = load_sample("qwen3-next")
    del d["linear_key_head_dim"]
    with pytest.raises(ValueError, match="'linear_key_head_dim' is missing"):
        specs_from_hf_config(d)


def test_layer_types_length_mismatch_raises() -> None:
    d = load_sample("gpt-oss")
    d["layer_types"] = d["layer_types"][:-1]
    with pytest.raises(ValueError, match="num_hidden_layers=24"):
        specs_from_hf_config(d)


def test_config_json_path_and_folder(tmp_path: Any) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_sample("qwen3-next")))
    expected = specs_from_hf_config("qwen3-next")
    assert specs_from_hf_config(path) == expected
    assert specs_from_hf_config(str(path)) == expected
    assert specs_from_hf_config(tmp_path) == expected  # a model folder holding config.json


def test_unknown_path_or_name() -> None:
    with pytest.raises(ValueError, match=r"neither a config.json path.*qwen3-next"):
        specs_from_hf_config("/nonexistent/config.json")
    with pytest.raises(TypeError, match="got int"):
        specs_from_hf_config(42)  # type: ignore[arg-type]


def test_dtype_kv_dtype_and_page_size() -> None:
    layout = specs_from_hf_config("qwen3-next", dtype="float16", kv_dtype="fp8_e4m3", page_size=64)
    full, linear = layout.spec_of(3), layout.spec_of(0)
    assert (full.dtype, full.kv_dtype, full.page_size) == ("float16", "fp8_e4m3", 64)
    # linear layers keep no KV cache: kv_dtype follows dtype, state stays float32
    assert (linear.dtype, linear.kv_dtype, linear.state_dtype) == ("float16", "float16", "float32")
    d = load_sample("qwen3")
    del d["torch_dtype"]
    d["dtype"] = "float32"  # transformers 5 writes "dtype"
    assert specs_from_hf_config(d).spec_of(0).dtype == "float32"
    del d["dtype"]
    assert specs_from_hf_config(d).spec_of(0).dtype == "bfloat16"


def test_layout_is_frozen_hashable_and_validated() -> None:
    layout = specs_from_hf_config("gpt-oss")
    assert hash(layout) == hash(specs_from_hf_config("gpt-oss"))
    with pytest.raises(AttributeError):
        layout.num_layers = 3  # type: ignore[misc]
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="in no group"):
        ModelLayout("x", "X", 2, (spec,), (0,), (), 1)
    with pytest.raises(ValueError, match="non-decreasing"):
        ModelLayout("x", "X", 2, (spec, spec), (1, 0), (), 1)
    # a layer holds one attention op and one linear op at most: two full ops would share its
    # KV pages
    other = spec.with_(num_heads=8)
    two = (LayerGroup("full", spec, (0,)), LayerGroup("full.1", other, (0,)))
    with pytest.raises(ValueError, match=r"layer 0 is in groups 'full' and 'full.1', two atten"):
        ModelLayout("x", "X", 1, (spec, other), (0, 0), two, 1)
    # an op listed in a group whose spec is not the layer's
    with pytest.raises(ValueError, match=r"layers \[1\] have an op in no group"):
        ModelLayout("x", "X", 2, (spec, other), (0, 1), (LayerGroup("full", spec, (0, 1)),), 1)
    assert "gpt_oss" in layout.short() and "window=128" in layout.short()
