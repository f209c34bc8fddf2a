"""SigLIP and Qwen2-VL vision towers mapped to the encoder layer kind (issue 22), from configs
written by transformers' own config classes; their runs are in tests/e2e/test_run_towers.py."""

from __future__ import annotations

from typing import Any

import pytest

from attn_core.models import MODEL_TYPE_FAMILIES, specs_from_hf_config
from attn_core.specs import LayerKind

transformers = pytest.importorskip("transformers")


def _siglip(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        num_hidden_layers=5, hidden_size=96, num_attention_heads=6, intermediate_size=64
    )
    return transformers.SiglipVisionConfig(**{**base, **fields}).to_dict()


def _qwen2_vl_vision(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(depth=3, embed_dim=128, hidden_size=40, num_heads=8)
    return transformers.Qwen2VLVisionConfig(**{**base, **fields}).to_dict()


def test_siglip_every_layer_is_the_same_bidirectional_encoder_attention() -> None:
    layout = specs_from_hf_config(_siglip(), dtype="float32")
    assert (layout.model_type, layout.family) == ("siglip_vision_model", "siglip-vision")
    assert layout.architecture == "SiglipVisionModel"
    ((group),) = layout.groups
    assert group.layer_indices == (0, 1, 2, 3, 4)
    spec = group.spec
    assert spec.kind is LayerKind.ENCODER and not spec.causal
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (6, 6, 16)
    assert spec.scale == pytest.approx(16**-0.5)


def test_qwen2_vl_tower_width_is_embed_dim_not_hidden_size() -> None:
    """hidden_size is the merger's output (the language model's width): head dim 128 / 8."""
    whole = transformers.Qwen2VLConfig(
        vision_config=dict(depth=3, embed_dim=128, hidden_size=40, num_heads=8),
        text_config=dict(
            num_hidden_layers=2, hidden_size=40, num_attention_heads=4, num_key_value_heads=2
        ),
    ).to_dict()
    for cfg, model_type in ((whole, "qwen2_vl"), (whole["vision_config"], "qwen2_vl_vision")):
        layout = specs_from_hf_config(cfg, dtype="float32")
        if layout.stacks:
            layout = layout.stack_layout("vision")
        assert (layout.model_type, layout.family) == (model_type, "qwen2-vl-vision")
        ((group),) = layout.groups
        assert group.layer_indices == (0, 1, 2)
        spec = group.spec
        assert spec.kind is LayerKind.ENCODER and not spec.causal
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 8, 16)
        assert layout.encoder_full_attention_layers == ()  # no windowed blocks


def test_towers_split_heads_over_tensor_parallel_ranks() -> None:
    assert specs_from_hf_config(_siglip(), tp_size=2).groups[0].spec.num_heads == 3
    assert specs_from_hf_config(_qwen2_vl_vision(), tp_size=4).groups[0].spec.num_heads == 2
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        specs_from_hf_config(_siglip(), tp_size=4)
    with pytest.raises(ValueError, match="num_heads=8 is not divisible by tp_size=3"):
        specs_from_hf_config(_qwen2_vl_vision(), tp_size=3)


def test_tower_width_not_a_multiple_of_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"embed_dim=100 is not a multiple of num_heads=8"):
        specs_from_hf_config({**_qwen2_vl_vision(), "embed_dim": 100})


def test_towers_are_listed_with_their_families() -> None:
    assert MODEL_TYPE_FAMILIES["siglip_vision_model"] == "siglip-vision"
    assert MODEL_TYPE_FAMILIES["qwen2_vl"] == "qwen2-vl"  # the whole model: both stacks
    assert MODEL_TYPE_FAMILIES["qwen2_vl_vision"] == "qwen2-vl-vision"


@pytest.mark.parametrize("name", ["siglip-vision", "qwen2-vl-vision"])
def test_sample_tower_spec_matches_transformers_attention_module(name: str) -> None:
    """Head layout, scale and causality as transformers' own attention module has them."""
    import torch

    from attn_core.models import load_sample

    d = load_sample(name)
    spec = specs_from_hf_config(name).spec_of(0)
    with torch.device("meta"):
        if name == "siglip-vision":
            from transformers.models.siglip.modeling_siglip import SiglipAttention

            attn = SiglipAttention(transformers.SiglipVisionConfig(**d))
            scale = attn.scale
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

            attn = VisionAttention(transformers.Qwen2VLVisionConfig(**d["vision_config"]))
            scale = attn.scaling
    assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        attn.num_heads,
        attn.num_heads,
        attn.head_dim,
    )
    assert spec.scale == pytest.approx(scale)


@pytest.mark.parametrize(
    ("cls", "family"), [("LlavaConfig", "llava"), ("LlavaNextConfig", "llava-next")]
)
@pytest.mark.parametrize(
    "vision",
    [
        None,  # the config class's own tower defaults (24 layers of 16 heads, width 1024)
        {"num_hidden_layers": 3},  # a given vision_config: CLIPVisionConfig's defaults
        {"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6},
    ],
)
def test_llava_clip_tower_matches_transformers_attention_module(
    cls: str, family: str, vision: Any
) -> None:
    """LLaVA's CLIP tower: as many encoder layers as the CLIPVisionModel LlavaConfig builds
    (all of them, whatever ``vision_feature_layer`` reads), each with CLIPAttention's heads,
    scale and causality; the text stack the family its Llama text_config maps to."""
    import torch
    from transformers.models.clip.modeling_clip import CLIPAttention

    cfg = getattr(transformers, cls)(vision_config=vision)
    layout = specs_from_hf_config(cfg.to_dict())
    tower, text = layout.stacks
    assert (layout.family, tower.family, text.family) == (family, "clip-vision", "qwen3")
    vc = cfg.vision_config
    ((group),) = tower.groups
    assert group.group_id == "vision.encoder"
    assert group.layer_indices == tuple(range(vc.num_hidden_layers))
    with torch.device("meta"):
        attn = CLIPAttention(vc)
    spec = group.spec
    assert spec.kind is LayerKind.ENCODER and not spec.causal and attn.is_causal is False
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        attn.num_heads,
        attn.num_heads,
        attn.head_dim,
    )
    assert spec.scale == pytest.approx(attn.scale)
    assert text.num_layers == cfg.text_config.num_hidden_layers


def test_a_clip_tower_config_alone_maps() -> None:
    d = transformers.CLIPVisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    layout = specs_from_hf_config(d.to_dict())
    assert (layout.family, layout.architecture) == ("clip-vision", "CLIPVisionModel")
    assert layout.groups[0].layer_indices == (0, 1)
    assert layout.spec_of(0).head_dim == 16
