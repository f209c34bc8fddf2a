"""Review findings on specs_from_hf_config: each maps a config as transformers builds the model
from it, or refuses it naming the field, what was expected and what came.

Configs come from transformers' own config classes at small sizes; what transformers makes of
them is read from those classes and, where a model decides it in its modeling code (which
layers slide, the softmax scale), from the attention calls of a model built from the config
(random init, nothing downloaded).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from attn_core.models import load_sample, specs_from_hf_config
from attn_core.specs import LayerKind
from attn_core.testing.hf import mapping_refuses, small_decoder

transformers = pytest.importorskip("transformers")

_SMALL: dict[str, Any] = small_decoder(2)

# Granite-4.0-H's Mamba2 sizes that fit _SMALL (mamba_expand * hidden_size = 4 * 32)
_GRANITE_H: dict[str, Any] = {
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "layer_types": ["mamba", "attention"],
}


def _cfg(cls_name: str, **kwargs: Any) -> dict[str, Any]:
    logging.disable(logging.WARNING)  # token-id warnings of configs built this small
    try:
        return dict(getattr(transformers, cls_name)(**kwargs).to_dict())
    finally:
        logging.disable(logging.NOTSET)


def _hf(d: dict[str, Any]) -> Any:
    """transformers' config object read from the dict ``d`` (as from a config.json)."""
    logging.disable(logging.WARNING)
    try:
        return transformers.AutoConfig.for_model(
            d["model_type"], **{k: v for k, v in d.items() if k != "model_type"}
        )
    finally:
        logging.disable(logging.NOTSET)


_PROBED: dict[int, dict[str, Any]] = {}


def _probe(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
    """An attention function that records what each layer passes, then runs sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _PROBED[module.layer_idx] = {
        "sliding_window": kwargs.get("sliding_window"),
        "scaling": kwargs.get("scaling"),
    }
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _attention_calls(d: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per attention layer, the window and scale its module passes to the attention function
    in a forward of the model transformers builds from the dict ``d``."""
    transformers.AttentionInterface.register("attn_core_probe", _probe)
    config = _hf(d)
    config._attn_implementation = "attn_core_probe"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _PROBED.clear()
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long))
    return dict(_PROBED)


# ------------------------------------------------------------------------------------------
# 1. attention_multiplier's default is the config class's, used as the scale
# ------------------------------------------------------------------------------------------
def test_attention_multiplier_defaults_match_transformers_config_classes() -> None:
    import dataclasses

    from transformers import CONFIG_MAPPING

    from attn_core.models.hf_config import _ATTENTION_MULTIPLIER_DEFAULTS

    want = {}
    for model_type, cls in CONFIG_MAPPING.items():
        if not dataclasses.is_dataclass(cls):
            continue
        for f in dataclasses.fields(cls):
            # a None default is derived in __post_init__ (HyperCLOVA X: head_dim ** -0.5,
            # the mapping's own default scale)
            if f.name == "attention_multiplier" and f.default is not None:
                want[model_type] = f.default
    assert want == _ATTENTION_MULTIPLIER_DEFAULTS


@pytest.mark.parametrize(
    ("cls_name", "extra"),
    [
        ("GraniteConfig", {}),
        ("GraniteMoeConfig", {}),
        ("GraniteMoeSharedConfig", {}),
        ("GraniteMoeHybridConfig", _GRANITE_H),
    ],
)
def test_absent_attention_multiplier_maps_the_scale_transformers_uses(
    cls_name: str, extra: dict[str, Any]
) -> None:
    d = _cfg(cls_name, **_SMALL, **extra)
    del d["attention_multiplier"]
    layout = specs_from_hf_config(d, dtype="float32")
    calls = _attention_calls(d)
    assert calls, "no attention layer called the attention function"
    for i, call in calls.items():
        spec = layout.spec_of(i)
        assert spec.scale == pytest.approx(call["scaling"]), (d["model_type"], i)


# ------------------------------------------------------------------------------------------
# 2. Mistral and Qwen3-MoE slide every layer (layer_types unread), with the class's window
# ------------------------------------------------------------------------------------------
_MOE_SMALL: dict[str, Any] = {
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize(
    ("cls_name", "extra", "want"),
    [
        ("MistralConfig", {"head_dim": 16}, [4, 4]),
        ("Qwen3MoeConfig", {"head_dim": 16, "use_sliding_window": True, **_MOE_SMALL}, [4, 4]),
        ("LlamaConfig", {"head_dim": 16}, [None, None]),  # Llama never slides
    ],
)
def test_layer_types_transformers_ignores_are_not_read(
    cls_name: str, extra: dict[str, Any], want: list[int | None]
) -> None:
    d = _cfg(cls_name, **_SMALL, **extra)
    d["sliding_window"] = 4
    d["layer_types"] = ["full_attention", "sliding_attention"]
    calls = _attention_calls(d)
    layout = specs_from_hf_config(d)
    got = [layout.spec_of(i).sliding_window for i in range(2)]
    assert got == [calls[i]["sliding_window"] for i in range(2)] == want


@pytest.mark.parametrize(
    ("cls_name", "extra"),
    [
        ("MistralConfig", {"head_dim": 16}),
        ("Qwen3MoeConfig", {"head_dim": 16, "use_sliding_window": True, **_MOE_SMALL}),
        ("Qwen3Config", {"head_dim": 16, "use_sliding_window": True, "max_window_layers": 1}),
        ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 1}),
    ],
)
def test_absent_sliding_window_maps_the_config_class_default(
    cls_name: str, extra: dict[str, Any]
) -> None:
    d = _cfg(cls_name, **_SMALL, **extra)
    del d["sliding_window"]
    calls = _attention_calls(d)
    layout = specs_from_hf_config(d)
    got = [layout.spec_of(i).sliding_window for i in range(2)]
    assert got == [calls[i]["sliding_window"] for i in range(2)]
    assert 4096 in got


@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config"])
def test_absent_max_window_layers_slides_the_layers_the_config_class_slides(
    cls_name: str,
) -> None:
    """Qwen2 / Qwen3 with use_sliding_window and neither layer_types nor max_window_layers:
    the mapping slid no layer, the config class's default (28) slides the layers from 28 on."""
    import transformers

    fields = {**_SMALL, "num_hidden_layers": 30, "use_sliding_window": True, "sliding_window": 8}
    want = getattr(transformers, cls_name)(**fields).layer_types
    assert "sliding_attention" in want  # the case this test is about
    d = {**_cfg(cls_name, **fields)}
    d.pop("layer_types", None)
    d.pop("max_window_layers", None)
    layout = specs_from_hf_config(d)
    got = [
        "sliding_attention" if layout.spec_of(i).sliding_window else "full_attention"
        for i in range(30)
    ]
    assert got == want


def test_max_window_layers_defaults_match_transformers_config_classes() -> None:
    from transformers import CONFIG_MAPPING

    from attn_core.models.hf_config import _BY_MODEL_TYPE, _MAX_WINDOW_LAYERS_DEFAULTS, _dense

    dense = {t for t, f in _BY_MODEL_TYPE.items() if f.parse is _dense}
    want = {}
    for model_type in sorted(dense):
        value = getattr(CONFIG_MAPPING[model_type](), "max_window_layers", None)
        if value is not None:
            want[model_type] = value
    assert want == _MAX_WINDOW_LAYERS_DEFAULTS


def test_sliding_window_defaults_match_transformers_config_classes() -> None:
    from transformers import CONFIG_MAPPING

    from attn_core.models.hf_config import _BY_MODEL_TYPE, _SLIDING_WINDOW_DEFAULTS, _dense

    dense = {t for t, f in _BY_MODEL_TYPE.items() if f.parse is _dense}
    want = {}
    for model_type in sorted(dense):
        cfg = CONFIG_MAPPING[model_type](use_sliding_window=True)
        if getattr(cfg, "sliding_window", None) is not None:
            want[model_type] = cfg.sliding_window
    assert want == _SLIDING_WINDOW_DEFAULTS


# ------------------------------------------------------------------------------------------
# 3. MiniMax's layer pattern is MiniMaxConfig's (it never reads attn_type_list)
# ------------------------------------------------------------------------------------------
def test_minimax_ignores_attn_type_list_as_its_config_class_does() -> None:
    d = {k: v for k, v in load_sample("minimax").items() if k != "layer_types"}
    d["num_hidden_layers"] = 4
    d["attn_type_list"] = [0, 0, 0, 1]
    layout = specs_from_hf_config(d)
    want = ["full" if t == "full_attention" else "linear" for t in _hf(d).layer_types]
    assert [layout.spec_of(i).kind.value for i in range(4)] == want


# ------------------------------------------------------------------------------------------
# 4. Nemotron-H's attention head_dim is NemotronHConfig's head_dim
# ------------------------------------------------------------------------------------------
def _nemotron_h(
    blocks: tuple[str, ...] = ("mamba", "attention", "mamba"), **extra: Any
) -> dict[str, Any]:
    """A small NemotronHConfig dict of three layers, ``blocks`` their types."""
    return _cfg(
        "NemotronHConfig",
        **{**_SMALL, "num_hidden_layers": 3},
        layers_block_type=list(blocks),
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        **extra,
    )


def test_nemotron_h_reads_head_dim_not_attention_head_dim() -> None:
    from transformers.models.nemotron_h import modeling_nemotron_h

    d = _nemotron_h(("mamba", "attention", "mlp"))
    del d["head_dim"]
    d["attention_head_dim"] = 32
    layout = specs_from_hf_config(d)
    with torch.device("meta"):
        attn = modeling_nemotron_h.NemotronHAttention(_hf(d), 1)
    assert layout.spec_of(1).head_dim == attn.head_dim
    assert layout.spec_of(1).scale == pytest.approx(attn.scaling)


# ------------------------------------------------------------------------------------------
# 5. An upper dt clamp is refused in every Mamba2 hybrid, as in Falcon-H1
# ------------------------------------------------------------------------------------------
def _bamba(**extra: Any) -> dict[str, Any]:
    return _cfg(
        "BambaConfig",
        **{**_SMALL, "num_hidden_layers": 3},
        **{
            "attn_layer_indices": [1],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            **extra,
        },
    )


def _granite_h(**extra: Any) -> dict[str, Any]:
    return _cfg("GraniteMoeHybridConfig", **_SMALL, **{**_GRANITE_H, **extra})


_HYBRIDS = {"bamba": _bamba, "nemotron_h": _nemotron_h, "granitemoehybrid": _granite_h}


@pytest.mark.parametrize("model_type", sorted(_HYBRIDS))
def test_mamba2_hybrids_refuse_an_upper_time_step_limit(model_type: str) -> None:
    d = _HYBRIDS[model_type](time_step_limit=(0.0, 10.0))
    assert tuple(_hf(d).time_step_limit) == (0.0, 10.0)  # transformers clamps dt at 10
    mapping_refuses(d, model_type, "time_step_limit=", "10.0", "expected [lo, inf]", "upper")
    for fine in ((0.0, float("inf")), (0.001, float("inf")), None):
        d["time_step_limit"] = fine
        specs_from_hf_config(d)


def test_nemotron_h_legacy_mamba_dt_limit_is_read_as_transformers_reads_it() -> None:
    d = _nemotron_h()
    d["mamba_dt_limit"] = [0.0, 5.0]
    assert tuple(_hf(d).time_step_limit) == (0.0, 5.0)
    mapping_refuses(d, "nemotron_h", "mamba_dt_limit=", "5.0", "upper")


# ------------------------------------------------------------------------------------------
# 6. Wrongly typed fields: a ValueError naming the field, the expected type and the value
# ------------------------------------------------------------------------------------------
def _lfm2(**fields: Any) -> dict[str, Any]:
    d = {k: v for k, v in load_sample("lfm2").items() if k != "layer_types"}
    return {**d, "num_hidden_layers": 4, **fields}


def _deepseek(**fields: Any) -> dict[str, Any]:
    d = {k: v for k, v in load_sample("deepseek-v3").items() if k != "rope_scaling"}
    d.pop("rope_parameters", None)
    return {**d, **fields}


def _qwen2_5_vl(**vision: Any) -> dict[str, Any]:
    d = load_sample("qwen2.5-vl")
    return {**d, "vision_config": {**d["vision_config"], **vision}}


_WRONG_TYPES = {
    "lfm2-idx-str": (_lfm2(full_attn_idxs="2"), ["lfm2", "full_attn_idxs='2'", "a list"]),
    "lfm2-idx-int": (_lfm2(full_attn_idxs=3), ["lfm2", "full_attn_idxs=3", "a list"]),
    "granite-h-layer-types-str": (
        {**_granite_h(), "layer_types": "attention"},
        ["granitemoehybrid", "layer_types='attention'", "a list"],
    ),
    "bamba-idx-int": (
        {**_bamba(), "attn_layer_indices": 5},
        ["bamba", "attn_layer_indices=5", "a list"],
    ),
    "qwen2.5-vl-fullatt-int": (
        _qwen2_5_vl(fullatt_block_indexes=7),
        ["qwen2_5_vl", "fullatt_block_indexes=7", "a list"],
    ),
    "kimi-linear-config-list": (
        {**load_sample("kimi-linear"), "linear_attn_config": [1, 2]},
        ["kimi_linear", "linear_attn_config=[1, 2]", "a mapping"],
    ),
    "deepseek-rope-scaling-list": (
        _deepseek(rope_scaling=[1]),
        ["deepseek_v3", "rope_scaling=[1]", "a mapping"],
    ),
    "deepseek-rope-parameters-list": (
        _deepseek(rope_parameters=[1]),
        ["deepseek_v3", "rope_parameters=[1]", "a mapping"],
    ),
    "deepseek-yarn-without-factor": (
        _deepseek(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "mscale_all_dim": 1.0}),
        ["deepseek_v3", "rope_parameters", "'factor'", "yarn", "expected"],
    ),
}


@pytest.mark.parametrize("case", sorted(_WRONG_TYPES))
def test_a_wrongly_typed_field_is_a_value_error_naming_it(case: str) -> None:
    config, fragments = _WRONG_TYPES[case]
    mapping_refuses(config, *fragments)


def test_lfm2_full_attn_idxs_is_read_only_without_layer_types() -> None:
    """Lfm2Config derives layer_types from full_attn_idxs only when it has none."""
    d = _lfm2(full_attn_idxs=list(range(32)), layer_types=["conv", "full_attention"] * 2)
    layout = specs_from_hf_config(d)
    want = ["full" if t == "full_attention" else "linear" for t in _hf(d).layer_types]
    assert [layout.spec_of(i).kind.value for i in range(4)] == want


# ------------------------------------------------------------------------------------------
# 7. LFM2 has no sliding layers
# ------------------------------------------------------------------------------------------
def test_lfm2_sliding_attention_layer_is_refused() -> None:
    d = _lfm2(layer_types=["conv", "sliding_attention", "conv", "full_attention"], sliding_window=4)
    mapping_refuses(d, "lfm2", "'sliding_attention' in layer 1", "full_attention")
    # transformers' Lfm2Model builds masks for full_attention and conv layers only
    config = _hf(d)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(KeyError, match="sliding_attention"), torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long))


def test_lfm3_sliding_attention_still_maps() -> None:
    d = _cfg(
        "Lfm3Config",
        **{**_SMALL, "num_hidden_layers": 4},
        layer_types=["conv", "sliding_attention", "conv", "full_attention"],
        sliding_window=4,
    )
    layout = specs_from_hf_config(d)
    assert layout.spec_of(1).kind is LayerKind.FULL
    assert layout.spec_of(1).sliding_window == 4
