"""Multi-stack configs (issue 22): every stack's groups, named by the stack, each stack checked
against transformers' own attention modules (built on the meta device), and Whisper's encoder
mapped with its decoder refused (cross-attention has no layer kind)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attn_core.models import (
    MULTI_STACK_MODEL_TYPES,
    SAMPLE_STACKS,
    SUPPORTED_MODEL_TYPES,
    ModelLayout,
    load_sample,
    sample_names,
    specs_from_hf_config,
    stack_families,
)
from attn_core.specs import DeviceCapabilities, LayerKind

transformers = pytest.importorskip("transformers")


def on_meta(cls: type, *args: Any) -> Any:
    with torch.device("meta"):
        return cls(*args)


def _qwen2_vl(**text: Any) -> dict[str, Any]:
    """A Qwen2-VL config as transformers writes it (text_config and vision_config)."""
    base: dict[str, Any] = dict(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=2
    )
    return transformers.Qwen2VLConfig(
        vision_config=dict(depth=3, embed_dim=96, hidden_size=64, num_heads=6),
        text_config={**base, **text},
    ).to_dict()


def _whisper(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        encoder_layers=3,
        encoder_attention_heads=4,
        d_model=64,
        decoder_layers=2,
        decoder_attention_heads=4,
    )
    return transformers.WhisperConfig(**{**base, **fields}).to_dict()


# ------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL: the tower and the language model
# ------------------------------------------------------------------------------------------
def test_qwen2_vl_yields_the_tower_and_the_language_model() -> None:
    d = _qwen2_vl()
    layout = specs_from_hf_config(d, dtype="float32")
    assert layout.stack_names == ("vision", "text")
    assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full"]
    assert layout.num_layers == 3 + 4 and layout.layer_indices == ()
    vision, text = layout.stacks
    assert (vision.stack, vision.family, vision.num_layers) == ("vision", "qwen2-vl-vision", 3)
    assert (text.stack, text.family, text.num_layers) == ("text", "qwen2-vl-text", 4)
    assert vision.architecture == text.architecture == "Qwen2VLForConditionalGeneration"
    hf = transformers.Qwen2VLConfig(**{k: v for k, v in d.items() if k != "model_type"})
    from transformers.models.qwen2_vl import modeling_qwen2_vl as mq

    attn = on_meta(mq.Qwen2VLAttention, hf.text_config, 0)
    spec = text.spec_of(0)
    assert spec.kind is LayerKind.FULL and spec.causal and attn.is_causal
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        attn.num_heads,
        attn.num_key_value_heads,
        attn.head_dim,
    )
    assert spec.scale == pytest.approx(attn.scaling)
    assert spec.sliding_window is None is attn.sliding_window
    tower = on_meta(mq.VisionAttention, hf.vision_config)
    assert vision.spec_of(0).kind is LayerKind.ENCODER and tower.is_causal is False
    assert vision.spec_of(0).head_dim == tower.head_dim == 16


def test_qwen2_vl_sliding_layers_follow_the_text_config() -> None:
    d = _qwen2_vl(use_sliding_window=True, sliding_window=32, max_window_layers=2)
    text = specs_from_hf_config(d, stack="text")
    hf = transformers.Qwen2VLConfig(**{k: v for k, v in d.items() if k != "model_type"})
    from transformers.models.qwen2_vl import modeling_qwen2_vl as mq

    windows = [on_meta(mq.Qwen2VLAttention, hf.text_config, i).sliding_window for i in range(4)]
    assert windows == [None, None, 32, 32]
    assert [text.spec_of(i).sliding_window for i in range(4)] == windows
    assert [g.group_id for g in text.groups] == ["text.full", "text.full.1"]


def test_the_hub_flat_form_reads_the_same_language_model() -> None:
    """A hub config keeps the text fields at the top level; transformers moves them into
    text_config: both give the same stacks."""
    for name in ("qwen2-vl", "qwen2.5-vl"):
        flat = load_sample(name)
        assert "text_config" not in flat
        cls = transformers.AutoConfig.for_model
        nested = cls(flat["model_type"], **{k: v for k, v in flat.items() if k != "model_type"})
        assert specs_from_hf_config(nested.to_dict()).groups == specs_from_hf_config(name).groups


def test_a_stack_sample_is_that_stack_of_the_whole_sample() -> None:
    for stack_sample, (whole, stack) in SAMPLE_STACKS.items():
        assert stack_sample in sample_names() and whole in sample_names()
        assert load_sample(stack_sample) == load_sample(whole)
        assert specs_from_hf_config(stack_sample) == specs_from_hf_config(whole, stack=stack)


# ------------------------------------------------------------------------------------------
# Gemma-3 multimodal: SigLIP and the language model
# ------------------------------------------------------------------------------------------
def test_gemma3_multimodal_tower_matches_siglip_attention() -> None:
    vision_cfg = dict(hidden_size=96, num_attention_heads=6, num_hidden_layers=2)
    d = transformers.Gemma3Config(
        text_config=dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2),
        vision_config=vision_cfg,
    ).to_dict()
    layout = specs_from_hf_config(d)
    assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full", "text.full.1"]
    from transformers.models.siglip.modeling_siglip import SiglipAttention

    attn = on_meta(SiglipAttention, transformers.SiglipVisionConfig(**vision_cfg))
    spec = layout.stack_layout("vision").spec_of(0)
    assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
    assert (spec.num_heads, spec.head_dim, spec.scale) == (
        attn.num_heads,
        attn.head_dim,
        pytest.approx(attn.scale),
    )


def test_siglip_defaults_table_matches_transformers() -> None:
    from attn_core.models.hf_config import _SIGLIP_DEFAULTS

    cfg = transformers.SiglipVisionConfig()
    assert {k: getattr(cfg, k) for k in _SIGLIP_DEFAULTS} == _SIGLIP_DEFAULTS


@pytest.mark.parametrize(
    ("table", "cls"),
    [
        ("_QWEN3_VISION_DEFAULTS", "Qwen3VLVisionConfig"),
        ("_QWEN3_VISION_DEFAULTS", "Qwen3_5VisionConfig"),
        ("_QWEN3_VL_TEXT_DEFAULTS", "Qwen3VLTextConfig"),
    ],
)
def test_qwen3_vl_defaults_tables_match_transformers(table: str, cls: str) -> None:
    from attn_core.models import hf_config

    defaults = getattr(hf_config, table)
    cfg = getattr(transformers, cls)()
    assert {k: getattr(cfg, k) for k in defaults} == defaults


@pytest.mark.parametrize("cls", ["Qwen3VLConfig", "Qwen3_5MoeConfig"])
def test_qwen3_towers_match_the_attention_module(cls: str) -> None:
    """Every block of the tower: non-causal attention of the module's heads, head dim and
    scale (a tiny tower of transformers' class)."""
    vision = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=32, out_hidden_size=32)
    if cls == "Qwen3VLConfig":
        vision["deepstack_visual_indexes"] = [1]
    cfg = getattr(transformers, cls)(vision_config=vision)
    layout = specs_from_hf_config(cfg.to_dict(), stack="vision")
    tower = transformers.AutoModel.from_config(cfg.vision_config)
    for i, blk in enumerate(tower.blocks):
        spec, attn = layout.spec_of(i), blk.attn
        assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
        assert (spec.num_heads, spec.head_dim, spec.scale) == (
            attn.num_heads,
            attn.head_dim,
            pytest.approx(attn.scaling),
        )


# ------------------------------------------------------------------------------------------
# Whisper: the encoder; the decoder refused
# ------------------------------------------------------------------------------------------
def test_whisper_encoder_matches_the_attention_module() -> None:
    d = load_sample("whisper-encoder")
    layout = specs_from_hf_config("whisper-encoder")
    hf = transformers.WhisperConfig(**{k: v for k, v in d.items() if k != "model_type"})
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    layer = on_meta(WhisperEncoderLayer, hf)
    attn = layer.self_attn
    assert (layout.stack, layout.num_layers) == ("encoder", hf.encoder_layers)
    ((group),) = layout.groups
    assert group.group_id == "encoder.encoder" and group.layer_indices == tuple(range(32))
    spec = group.spec
    assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (20, 20, attn.head_dim)
    assert attn.num_heads == 20 and attn.head_dim == 64
    # transformers multiplies q by scaling and calls the op with scale 1: the same softmax
    assert spec.scale == pytest.approx(attn.scaling)
    assert spec.dtype == "float16"  # the config's torch_dtype


def test_whisper_decoder_is_refused_naming_cross_attention_and_its_layers() -> None:
    from transformers.models.whisper.modeling_whisper import WhisperDecoderLayer

    d = _whisper()
    hf = transformers.WhisperConfig(**{k: v for k, v in d.items() if k != "model_type"})
    # what the refusal names: every decoder layer attends to the encoder's output
    assert hasattr(on_meta(WhisperDecoderLayer, hf, 0), "encoder_attn")
    with pytest.raises(
        ValueError,
        match=r"whisper: cross-attention in decoder layers 0-1: no layer kind; the encoder maps "
        r"alone: stack='encoder'.*refused, not mapped in part",
    ):
        specs_from_hf_config(d)
    with pytest.raises(ValueError, match=r"cross-attention in decoder layers 0-1"):
        specs_from_hf_config(d, stack="decoder")
    assert specs_from_hf_config(d, stack="encoder").spec_of(0).num_heads == 4
    assert stack_families(d) == {"encoder": "whisper-encoder", "decoder": ""}


def test_whisper_aliases_and_defaults_are_transformers() -> None:
    from attn_core.models.hf_config import _WHISPER_ALIASES, _WHISPER_DEFAULTS

    assert transformers.WhisperConfig.attribute_map == _WHISPER_ALIASES
    cfg = transformers.WhisperConfig()
    assert {k: getattr(cfg, k) for k in _WHISPER_DEFAULTS} == _WHISPER_DEFAULTS
    # a config with the common names only is read through them; defaults fill the rest
    d = {"model_type": "whisper", "num_hidden_layers": 2, "hidden_size": 192}
    layout = specs_from_hf_config(d, stack="encoder")
    hf = transformers.WhisperConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert layout.num_layers == hf.encoder_layers == 2
    assert layout.spec_of(0).num_heads == hf.encoder_attention_heads == 6
    assert layout.spec_of(0).head_dim == hf.d_model // 6 == 32


def test_whisper_alias_that_disagrees_is_refused() -> None:
    d = {**_whisper(), "num_hidden_layers": 5}
    with pytest.raises(ValueError, match=r"num_hidden_layers=5 and encoder_layers=3 disagree"):
        specs_from_hf_config(d, stack="encoder")
    # transformers: the alias wins, so mapping encoder_layers would describe another model
    hf = transformers.WhisperConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert hf.encoder_layers == 5


def test_whisper_heads_split_over_tensor_parallel_ranks() -> None:
    assert specs_from_hf_config(_whisper(), stack="encoder", tp_size=2).spec_of(0).num_heads == 2
    with pytest.raises(ValueError, match="encoder_attention_heads=4 is not divisible by tp_size=3"):
        specs_from_hf_config(_whisper(), stack="encoder", tp_size=3)


# ------------------------------------------------------------------------------------------
# The multi-stack layout itself
# ------------------------------------------------------------------------------------------
def test_stacks_are_listed_for_every_multi_stack_model_type() -> None:
    samples = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "whisper": "whisper"}
    built = {
        "gemma3": transformers.Gemma3Config().to_dict(),
        "llama4": transformers.Llama4Config().to_dict(),
        "llava": transformers.LlavaConfig().to_dict(),
        "llava_next": transformers.LlavaNextConfig().to_dict(),
        "qwen3_vl": transformers.Qwen3VLConfig().to_dict(),
        "qwen3_vl_moe": transformers.Qwen3VLMoeConfig().to_dict(),
        "qwen3_5": transformers.Qwen3_5Config().to_dict(),
        "qwen3_5_moe": transformers.Qwen3_5MoeConfig().to_dict(),
    }
    for model_type, stacks in MULTI_STACK_MODEL_TYPES.items():
        cfg = load_sample(samples[model_type]) if model_type in samples else built[model_type]
        assert stack_families(cfg) == stacks, model_type
    assert stack_families(load_sample("qwen3")) == {}
    assert sorted(MULTI_STACK_MODEL_TYPES) == sorted(
        t
        for t in SUPPORTED_MODEL_TYPES
        if stack_families({"model_type": t, "text_config": {}, "vision_config": {}})
    )


def test_stack_errors_name_what_exists() -> None:
    with pytest.raises(
        ValueError, match=r"stack 'audio' is unknown; its stacks: \['vision', 'text'\]"
    ):
        specs_from_hf_config("qwen2.5-vl", stack="audio")
    with pytest.raises(ValueError, match=r"qwen3: stack='text': this model has one stack"):
        specs_from_hf_config("qwen3", stack="text")
    # a model type the generic dense mapping reads has one stack too
    dense = {k: v for k, v in load_sample("qwen3").items() if k != "architectures"}
    with pytest.raises(ValueError, match=r"olmo9: stack='text': this model has one stack"):
        specs_from_hf_config({**dense, "model_type": "olmo9"}, stack="text")
    layout = specs_from_hf_config("qwen2.5-vl")
    with pytest.raises(ValueError, match=r"layer 0 is ambiguous; use stack_layout\(name\)"):
        layout.group_of(0)
    with pytest.raises(ValueError, match=r"stack 'encoder' is unknown"):
        layout.stack_layout("encoder")
    text = layout.stack_layout("text")
    assert text.stack_layout("text") is text and text.stack_names == ("text",)


def test_a_multi_stack_layout_must_hold_its_stacks_groups() -> None:
    layout = specs_from_hf_config("qwen2.5-vl")
    vision, text = layout.stacks
    with pytest.raises(ValueError, match=r"expected the stacks' groups"):
        ModelLayout("qwen2_5_vl", "X", 60, (), (), vision.groups, stacks=(vision, text))
    with pytest.raises(ValueError, match=r"uniquely named single-stack layouts"):
        ModelLayout("qwen2_5_vl", "X", 64, (), (), vision.groups * 2, stacks=(vision, vision))


def test_selection_runs_per_group_of_every_stack() -> None:
    """select() over a multi-stack layout plans each group; a runtime serves one stack."""
    from attn_core.e2e.main import default_registry
    from attn_core.runtime import AttentionRuntime
    from attn_core.selector import select
    from attn_core.specs import ExecutionConstraints

    layout = specs_from_hf_config("qwen2.5-vl", dtype="float32")
    registry = default_registry()
    plan = select(layout.groups, registry, DeviceCapabilities.detect("cpu"), ExecutionConstraints())
    assert [c.group.group_id for c in plan.choices] == ["vision.encoder", "text.full"]
    assert {c.backend.qualified_name for c in plan.choices} == {"attn_core:reference"}
    with pytest.raises(
        ValueError, match=r"layer 0 is in groups 'vision.encoder' and 'text.full', two attention"
    ):
        AttentionRuntime(plan, registry, state=object(), device="cpu")
    vision = select(
        layout.stack_layout("vision").groups,
        registry,
        DeviceCapabilities.detect("cpu"),
        ExecutionConstraints(),
    )
    runtime = AttentionRuntime(vision, registry, state=None, device="cpu")
    assert sorted(runtime.bindings) == list(range(32))
