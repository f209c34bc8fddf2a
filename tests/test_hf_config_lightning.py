"""Config mapping of MiniMax-Text-01 / MiniMax-M1 (lightning attention) and LFM2 (short conv),
checked against transformers' own modules built from the same configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attn_core.models import load_sample, specs_from_hf_config
from attn_core.specs import LayerKind, LinearVariant

transformers = pytest.importorskip("transformers")
hf_minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")
hf_lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")


def _hf(d: dict[str, Any]) -> Any:
    return transformers.AutoConfig.for_model(
        d["model_type"], **{k: v for k, v in d.items() if k != "model_type"}
    )


def test_minimax_lightning_and_full_layers_match_hf_modules() -> None:
    d = load_sample("minimax")
    layout = specs_from_hf_config(d)
    cfg = _hf(d)
    with torch.device("meta"):
        lightning = hf_minimax.MiniMaxLightningAttention(cfg, 0)
        full = hf_minimax.MiniMaxAttention(cfg, 7)
    lt, fa = layout.spec_of(0), layout.spec_of(7)
    assert lt.linear_variant is LinearVariant.LIGHTNING
    assert (lt.num_heads, lt.num_kv_heads) == (lightning.num_attention_heads,) * 2
    assert lt.head_dim == lt.head_dim_v == lightning.head_dim
    assert lt.ssm_state_shape == (64, 128, 128) and lt.conv_state_shape == ()
    assert lt.scale == 1.0 and not lt.qk_l2norm  # q . S unscaled, no q/k norm
    assert fa.kind is LayerKind.FULL and fa.head_dim == full.head_dim
    assert fa.scale == pytest.approx(full.scaling)
    kinds = ["linear" if t == "linear_attention" else "full" for t in cfg.layer_types]
    assert [layout.spec_of(i).kind.value for i in range(80)] == kinds


def test_minimax_m1_hub_config_reads_attn_type_list() -> None:
    """The hub's remote-code configs (model_type minimax_m1 / minimax_text_01) carry
    ``attn_type_list`` (0 lightning, 1 softmax) instead of layer_types."""
    d = load_sample("minimax")
    d.pop("layer_types")
    d["model_type"] = "minimax_m1"
    d["architectures"] = ["MiniMaxM1ForCausalLM"]
    d["attn_type_list"] = [0, 0, 0, 0, 0, 0, 0, 1] * 10
    hub = specs_from_hf_config(d)
    hf_form = specs_from_hf_config("minimax")
    assert hub.layer_specs == hf_form.layer_specs
    assert hub.architecture == "MiniMaxM1ForCausalLM" and hub.family == "minimax"
    d["model_type"] = "minimax_text_01"
    assert specs_from_hf_config(d).layer_specs == hf_form.layer_specs
    d["attn_type_list"] = [0, 2] * 40
    with pytest.raises(ValueError, match=r"attn_type_list.*0 \(lightning attention\)"):
        specs_from_hf_config(d)


def test_minimax_without_layer_types_follows_transformers_default() -> None:
    d = {k: v for k, v in load_sample("minimax").items() if k != "layer_types"}
    d["num_hidden_layers"] = 6
    layout = specs_from_hf_config(d)
    want = ["linear" if t == "linear_attention" else "full" for t in _hf(d).layer_types]
    assert [layout.spec_of(i).kind.value for i in range(6)] == want


def test_minimax_tensor_parallel_splits_lightning_heads() -> None:
    spec = specs_from_hf_config("minimax", tp_size=8).spec_of(0)
    assert (spec.num_heads, spec.num_kv_heads) == (8, 8)
    with pytest.raises(ValueError, match=r"num_attention_heads=64.*tp_size=3"):
        specs_from_hf_config("minimax", tp_size=3)


def test_lfm2_short_conv_matches_hf_module() -> None:
    d = load_sample("lfm2")
    layout = specs_from_hf_config(d)
    cfg = _hf(d)
    with torch.device("meta"):
        conv = hf_lfm2.Lfm2ShortConv(cfg, 0)
        attn = hf_lfm2.Lfm2Attention(cfg, 2)
    sc = layout.spec_of(0)
    assert sc.linear_variant is LinearVariant.SHORT_CONV
    assert sc.conv_dims == (conv.conv.weight.shape[0], conv.conv_kernel_size) == (2048, 3)
    assert sc.ssm_state_shape == () and sc.conv_state_shape == (2048, 2)
    assert sc.state_bytes_per_request() == 2048 * 2 * 2  # bf16 conv state, nothing else
    fa = layout.spec_of(2)
    assert fa.head_dim == attn.head_dim and fa.scale == pytest.approx(attn.scaling)
    kinds = ["full" if t == "full_attention" else "linear" for t in cfg.layer_types]
    assert [layout.spec_of(i).kind.value for i in range(16)] == kinds


def test_lfm2_full_attn_idxs_and_tensor_parallel() -> None:
    d = {k: v for k, v in load_sample("lfm2").items() if k != "layer_types"}
    d["full_attn_idxs"] = [1, 3]
    d["num_hidden_layers"] = 4
    layout = specs_from_hf_config(d)
    assert [layout.spec_of(i).kind.value for i in range(4)] == ["linear", "full"] * 2
    assert _hf(d).layer_types == ["conv", "full_attention"] * 2
    assert specs_from_hf_config("lfm2", tp_size=4).spec_of(0).conv_channels == 512


def test_conv_layer_type_in_another_family_is_refused() -> None:
    d = load_sample("qwen3")
    d["num_hidden_layers"] = 2
    d["layer_types"] = ["full_attention", "conv"]
    with pytest.raises(ValueError, match="'conv' in layer 1"):
        specs_from_hf_config(d)


def test_minimax_sliding_window_is_refused_naming_the_layers() -> None:
    d = load_sample("minimax")
    d["sliding_window"] = 4096
    with pytest.raises(ValueError, match=r"sliding_window=4096 on the softmax layers \(layers 7,"):
        specs_from_hf_config(d)
