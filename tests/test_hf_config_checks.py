"""specs_from_hf_config is loud and specific (issue 22, item 4).

Configs come from transformers' own config classes at small sizes. A parser's per-layer result
must agree with the config's ``layer_types``; a feature no layer kind describes (chunked
attention outside Llama-4, Falcon-H1's upper dt clamp) is refused with the
feature and the layers that have it, never mapped partially.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from attn_core.models import specs_from_hf_config
from attn_core.specs import LayerKind, LinearVariant
from attn_core.testing.hf import mapping_refuses

transformers = pytest.importorskip("transformers")


def _cfg(cls_name: str, **kwargs: Any) -> dict[str, Any]:
    return dict(getattr(transformers, cls_name)(**kwargs).to_dict())


def _kimi() -> dict[str, Any]:
    return _cfg(
        "KimiLinearConfig",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    )


def _granite() -> dict[str, Any]:
    return _cfg(
        "GraniteMoeHybridConfig",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        layer_types=["mamba", "mamba", "attention", "mamba"],
    )


def test_kimi_linear_read_as_deepseek_v3_is_refused() -> None:
    # All layers would be MLA; 3 of 4 are Kimi Delta Attention.
    cfg = {**_kimi(), "model_type": "deepseek_v3"}
    mapping_refuses(cfg, "deepseek_v3", "layers 0-2", "linear_attention", "mla")


def test_granite_read_as_bamba_is_refused() -> None:
    # attn_layer_indices is absent, so bamba would map the attention layer 2 to Mamba2.
    cfg = {**_granite(), "model_type": "bamba"}
    mapping_refuses(cfg, "bamba", "layer 2", "full_attention", "linear")


def test_kimi_linear_maps_kda_and_mla_layers() -> None:
    layout = specs_from_hf_config(_kimi())
    kinds = [layout.spec_of(i).linear_variant or layout.spec_of(i).kind for i in range(4)]
    assert [getattr(k, "value", k) for k in kinds] == ["kda", "kda", "kda", "mla"]


def test_kimi_linear_lists_that_disagree_with_layer_types_are_refused() -> None:
    # transformers builds the model from layer_types: layer 0 MLA, layer 3 KDA.
    cfg = {**_kimi(), "layer_types": ["full_attention"] + ["linear_attention"] * 3}
    mapping_refuses(
        cfg, "kimi_linear", "layer_types", "layer 0: config says full_attention, mapped linear"
    )


@pytest.mark.parametrize(
    ("lists", "fragments"),
    [
        ({"kda_layers": [1, 2], "full_attn_layers": [4]}, ("leave layers 2 (0-based) out",)),
        ({"kda_layers": [1, 2, 3, 4], "full_attn_layers": [4]}, ("layer 3 (0-based) twice",)),
        ({"kda_layers": [0, 1, 2], "full_attn_layers": [4]}, ("kda_layers=[0, 1, 2]", "1-based")),
    ],
)
def test_kimi_linear_lists_must_name_every_layer_once(
    lists: dict[str, list[int]], fragments: tuple[str, ...]
) -> None:
    cfg = _kimi()
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], **lists}
    del cfg["layer_types"]
    mapping_refuses(cfg, "kimi-linear (kimi_linear)", *fragments)


def test_kimi_linear_mla_with_rope_is_refused() -> None:
    mapping_refuses({**_kimi(), "mla_use_nope": False}, "mla_use_nope=False", "layer 3", "no rope")


def test_falcon_mamba_intermediate_size_must_follow_expand() -> None:
    cfg = _cfg("FalconMambaConfig", num_hidden_layers=2, hidden_size=64)
    cfg["intermediate_size"] = 64
    mapping_refuses(cfg, "intermediate_size=64 but expand * hidden_size = 128")


def test_jamba_attn_layer_offset_must_fall_in_the_period() -> None:
    cfg = {**_cfg("JambaConfig", num_hidden_layers=4), "attn_layer_offset": 8}
    mapping_refuses(cfg, "attn_layer_offset=8", "0..7")


def test_qwen3_next_linear_value_heads_must_group_over_the_key_heads() -> None:
    """The delta rule's value heads share key heads in groups: the error names both config
    fields (it came from LayerSpec, naming neither, nor the model)."""
    cfg = {
        **_cfg("Qwen3NextConfig", num_hidden_layers=4, hidden_size=64),
        "linear_num_value_heads": 3,
        "linear_num_key_heads": 2,
    }
    mapping_refuses(cfg, "linear_num_value_heads=3", "linear_num_key_heads=2")


def _falcon_h1(**kwargs: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=96,  # not mamba_expand * hidden_size: the mapping must read mamba_d_ssm
        mamba_n_heads=6,
        mamba_n_groups=2,
        mamba_d_state=16,
    )
    return _cfg("FalconH1Config", **{**fields, **kwargs})


def test_falcon_h1_maps_attention_and_mamba2_in_parallel_in_every_layer() -> None:
    """Both ops of every layer, each in its own group, checked against the modules."""
    cfg = _falcon_h1(head_dim=24, key_multiplier=0.5, mamba_rms_norm=True)
    layout = specs_from_hf_config(cfg)
    assert layout.family == "falcon-h1" and layout.architecture == "FalconH1ForCausalLM"
    assert layout.layer_indices == (0, 0, 1, 1, 2, 2)
    assert layout.parallel_layers == (0, 1, 2)
    assert {g.group_id: g.layer_indices for g in layout.groups} == {
        "linear": (0, 1, 2),
        "full": (0, 1, 2),
    }
    hf = transformers.FalconH1Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    mod = transformers.models.falcon_h1.modeling_falcon_h1
    with torch.device("meta"):
        attn = mod.FalconH1Attention(hf, 1)
        mamba = mod.FalconH1Mixer(hf, 1)
    full, linear = layout.spec_of(1, LayerKind.FULL), layout.spec_of(1, LayerKind.LINEAR)
    # key_multiplier scales k before the op: the scale is transformers' head_dim ** -0.5
    assert full.scale == pytest.approx(attn.scaling) and full.head_dim == attn.head_dim == 24
    assert (full.num_heads, full.num_kv_heads) == (4, 2)
    assert linear.linear_variant is LinearVariant.MAMBA2
    assert (linear.num_heads, linear.num_kv_heads) == (mamba.num_heads, mamba.n_groups)
    assert (linear.head_dim, linear.head_dim_v) == (mamba.ssm_state_size, mamba.head_dim)
    assert linear.conv_channels == mamba.conv_dim and linear.conv_kernel_size == 4
    with pytest.raises(ValueError, match=r"layer 1 holds parallel ops in groups 'linear' and"):
        layout.spec_of(1)
    # transformers' own layer_types ("hybrid" on every layer) agree with the mapping
    assert specs_from_hf_config({**cfg, "layer_types": ["hybrid"] * 3}) == layout
    assert "parallel   layers 0-2" in layout.short()


def test_falcon_h1_under_tensor_parallelism_splits_both_ops() -> None:
    layout = specs_from_hf_config(_falcon_h1(), tp_size=2)
    full, linear = layout.spec_of(0, LayerKind.FULL), layout.spec_of(0, LayerKind.LINEAR)
    assert (full.num_heads, full.num_kv_heads) == (2, 1)
    assert (linear.num_heads, linear.num_kv_heads) == (3, 1)
    assert linear.conv_channels == 3 * 16 + 2 * 1 * 16


def test_falcon_h1_defaults_are_falcon_h1_configs() -> None:
    from attn_core.models.hf_config import _FALCON_H1_DEFAULTS

    for name, value in _FALCON_H1_DEFAULTS.items():  # the class's field defaults
        assert getattr(transformers.FalconH1Config, name) == value, name


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (
            {"time_step_limit": [0.0, 0.1]},
            ("falcon-h1 (falcon_h1)", "time_step_limit=[0.0, 0.1]", "layers 0-2", "upper"),
        ),
        ({"time_step_limit": [0.1]}, ("time_step_limit=[0.1]", "layers 0-2", "0 <= lo")),
        ({"time_step_limit": [-1.0, 2.0]}, ("time_step_limit=[-1.0, 2.0]", "0 <= lo")),
        ({"ssm_multipliers": [1.0, 1.0]}, ("ssm_multipliers=[1.0, 1.0]", "layers 0-2", "5")),
        ({"mamba_d_head": 7}, ("mamba_d_head=7 * mamba_n_heads=6", "inner width 96")),
        (
            {"layer_types": ["hybrid", "attention", "hybrid"]},
            ("'attention' in layer 1", "['hybrid']"),
        ),
    ],
    ids=[
        "dt-upper-clamp",
        "dt-limit-not-a-pair",
        "dt-negative-floor",
        "ssm-multipliers",
        "head-split",
        "layer-types",
    ],
)
def test_falcon_h1_refuses_what_it_cannot_map(
    change: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    mapping_refuses({**_falcon_h1(), **change}, *fragments)


def test_llama4_chunked_layers_without_a_chunk_size_are_refused() -> None:
    cfg = {**_cfg("Llama4TextConfig", num_hidden_layers=4), "attention_chunk_size": None}
    mapping_refuses(
        cfg, "llama4_text", "chunked_attention in layers 0-2", "attention_chunk_size is null"
    )


def test_chunked_attention_refused_by_a_supported_family() -> None:
    # A Llama-4 text config relabelled llama: Llama has no chunked attention, so no mapping.
    cfg = {
        **_cfg("Llama4TextConfig", num_hidden_layers=4, attention_chunk_size=64),
        "model_type": "llama",
    }
    mapping_refuses(cfg, "llama", "chunked attention (attention_chunk_size=64)", "layers 0-2")
    mapping_refuses(cfg, "llama", "does not read it", "llama-4")


def test_unknown_layer_type_is_named_with_its_layers() -> None:
    cfg = _cfg(
        "Qwen3Config",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg["layer_types"] = ["full_attention", "hyper_attention", "hyper_attention", "full_attention"]
    mapping_refuses(cfg, "qwen3", "'hyper_attention'", "layers 1-2")


def test_wrong_family_layer_type_is_named_with_its_layers() -> None:
    cfg = _cfg(
        "Qwen3Config",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg["layer_types"] = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    mapping_refuses(cfg, "qwen3", "'linear_attention'", "layer 1")


def test_unsupported_type_names_its_layer_types() -> None:
    # Granite-4.0-H itself now maps; a model_type no family names, with its fields, is refused.
    msg = mapping_refuses(
        {**_granite(), "model_type": "new_hybrid"}, "new_hybrid", "not supported", "supported:"
    )
    assert re.search(r"linear_attention in layers 0-1,3", msg), msg
    assert re.search(r"full_attention in layer 2", msg), msg
    # ministral and phi3 now map (the generic dense path); a model_type no family names with a
    # field that path does not understand is refused with the field and its layer_types.
    cfg = {**_cfg("MinistralConfig", num_hidden_layers=2), "model_type": "new_lm", "moe_x": 1}
    msg = mapping_refuses(cfg, "'new_lm'", "'moe_x'", "sliding_attention", "not supported")
    assert "layers 0-1" in msg
    cfg = {**_cfg("Phi3Config", num_hidden_layers=2), "model_type": "new_lm", "moe_x": 1}
    mapping_refuses(cfg, "'new_lm'", "'moe_x'", "no layer_types")


def test_agreeing_layer_types_still_parse() -> None:
    # The samples' own layer_types agree with their mapping; a qwen3 config whose layer_types
    # say sliding_attention while sliding_window is null is full attention, as transformers has it.
    cfg = _cfg(
        "Qwen3Config",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cfg["sliding_window"] = None
    layout = specs_from_hf_config(cfg)
    assert all(s.sliding_window is None for s in layout.layer_specs)
    for name in ("qwen3", "qwen3-next", "gpt-oss", "gemma-3", "bamba", "deepseek-v3"):
        specs_from_hf_config(name)


def test_nemotron_h_pattern_and_block_types_must_agree() -> None:
    cfg = _cfg(
        "NemotronHConfig",
        num_hidden_layers=4,
        hybrid_override_pattern="M-M*",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
    )
    assert specs_from_hf_config(cfg).layer_indices == (0, 2, 3)
    cfg["hybrid_override_pattern"] = "M-MM"
    mapping_refuses(cfg, "nemotron_h", "layer 3", "'M'", "full_attention")


def test_granite_4_h_maps_mamba2_and_attention_by_layer_types() -> None:
    import transformers

    cfg = _granite()
    layout = specs_from_hf_config(cfg)
    assert layout.family == "granite-4.0-h"
    assert [layout.spec_of(i).kind.value for i in range(4)] == [
        "linear",
        "linear",
        "full",
        "linear",
    ]
    hf = transformers.GraniteMoeHybridConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    mod = transformers.models.granitemoehybrid.modeling_granitemoehybrid
    with torch.device("meta"):
        attn = mod.GraniteMoeHybridAttention(hf, 2)
        mamba = mod.GraniteMoeHybridMambaLayer(hf, 0)
    full, linear = layout.spec_of(2), layout.spec_of(0)
    assert full.scale == pytest.approx(attn.scaling) and full.head_dim == attn.head_dim
    assert (linear.num_heads, linear.num_kv_heads) == (mamba.num_heads, mamba.n_groups)
    assert (linear.head_dim, linear.head_dim_v) == (mamba.ssm_state_size, mamba.head_dim)
    assert linear.conv_channels == mamba.conv_dim
    # the hub's own names (mamba / attention) read the same
    hub = {**cfg, "layer_types": ["mamba", "mamba", "attention", "mamba"]}
    assert specs_from_hf_config(hub).layer_specs == layout.layer_specs
