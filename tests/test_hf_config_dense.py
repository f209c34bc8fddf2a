"""The generic dense mapping (issue 22, item 1): common field names need no per-family code.

Configs come from transformers' own config classes at small sizes; the mapping's heads, head_dim,
softmax scale and windows are checked against the attention module transformers builds from the
same config (random init, nothing downloaded).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from attn_core.models import MODEL_TYPE_FAMILIES, SUPPORTED_MODEL_TYPES, specs_from_hf_config
from attn_core.testing.hf import since_transformers, small_decoder, transformers_before

transformers = pytest.importorskip("transformers")

_SMALL: dict[str, Any] = small_decoder(3)

# (config class, extra kwargs); each keeps a feature that distinguishes it
_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("Phi3Config", {}),
    "phi3-sliding": ("Phi3Config", {"sliding_window": 8}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"attention_multiplier": 0.3}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": 16}),
    "ministral-head-dim": ("MinistralConfig", {"head_dim": 24, "sliding_window": 8}),
}


def _config(case: str) -> Any:
    cls_name, extra = _CASES[case]
    return getattr(transformers, cls_name)(**{**_SMALL, **extra})


def _attention(config: Any, layer: int) -> Any:
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.model.layers[layer].self_attn


@pytest.mark.parametrize("case", sorted(_CASES))
def test_dense_family_matches_transformers_attention(case: str) -> None:
    config = _config(case)
    layout = specs_from_hf_config(config.to_dict(), dtype="float32")
    assert layout.family == "dense"
    assert layout.layer_indices == tuple(range(config.num_hidden_layers))
    for i, spec in zip(layout.layer_indices, layout.layer_specs, strict=True):
        attn = _attention(config, i)
        assert spec.num_heads == config.num_attention_heads
        assert spec.num_heads // spec.num_kv_heads == attn.num_key_value_groups
        assert spec.head_dim == attn.head_dim
        assert math.isclose(spec.scale, attn.scaling, rel_tol=1e-6), (spec.scale, attn.scaling)
        want_window = getattr(attn, "sliding_window", None)
        if want_window is None:
            want_window = getattr(config, "sliding_window", None)
        assert spec.sliding_window == want_window


def test_sliding_layer_types_follow_the_config() -> None:
    config = transformers.MinistralConfig(
        **{**_SMALL, "head_dim": 16, "sliding_window": 8},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    layout = specs_from_hf_config(config.to_dict())
    assert [s.sliding_window for s in layout.layer_specs] == [8, None, 8]
    assert layout.family == "dense"


def test_new_model_type_with_common_names_needs_no_code() -> None:
    cfg = {**_config("olmo2").to_dict(), "model_type": "brand_new_lm"}
    cfg["architectures"] = ["BrandNewForCausalLM"]
    layout = specs_from_hf_config(cfg)
    assert layout.family == "dense"
    assert layout.architecture == "BrandNewForCausalLM"
    assert layout.layer_specs[0].num_kv_heads == 2


def test_tested_dense_types_are_listed() -> None:
    for t in ("phi3", "olmo2", "granite", "starcoder2", "ministral"):
        assert t in SUPPORTED_MODEL_TYPES
        assert MODEL_TYPE_FAMILIES[t] == "dense"


def test_a_softcap_the_generic_mapping_cannot_know_is_refused() -> None:
    """transformers' dense families do not apply ``attn_logit_softcapping`` (only Gemma-2-like
    models do, and those carry fields the generic mapping refuses anyway): mapping the cap would
    describe a model other than the one transformers runs, so it is refused, naming the field
    and the layers."""
    cfg = {**_config("olmo2").to_dict(), "attn_logit_softcapping": 30.0}
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=30.0 in layers 0-2.*refused"):
        specs_from_hf_config(cfg)
    cfg["attn_logit_softcapping"] = None  # as transformers writes an unset cap
    assert specs_from_hf_config(cfg).layer_specs[0].logits_soft_cap is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("query_pre_attn_scalar", 64),
        ("alibi", True),
        ("sliding_window_pattern", 4),
        ("kv_lora_rank", 16),
        ("max_window_layers", 2),
    ],
)
def test_fields_outside_the_mapping_are_refused(field: str, value: Any) -> None:
    cfg = {**_config("olmo2").to_dict(), field: value}
    with pytest.raises(ValueError) as err:
        specs_from_hf_config(cfg)
    msg = str(err.value)
    assert "olmo2" in msg and field in msg and "layers 0-2" in msg, msg


def test_unknown_type_with_unknown_fields_is_not_supported() -> None:
    cfg = {**_config("olmo2").to_dict(), "model_type": "brand_new_lm", "mixer_kind": "x"}
    with pytest.raises(ValueError) as err:
        specs_from_hf_config(cfg)
    msg = str(err.value)
    assert "'mixer_kind'" in msg and "not supported" in msg and "supported:" in msg, msg


def test_chunked_attention_is_refused() -> None:
    cfg = {**_config("olmo2").to_dict(), "attention_chunk_size": 8}
    with pytest.raises(ValueError, match="chunked attention"):
        specs_from_hf_config(cfg)


def test_layer_types_outside_full_and_sliding_are_refused() -> None:
    cfg = _config("olmo2").to_dict()
    cfg["layer_types"] = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"'linear_attention' in layer 1"):
        specs_from_hf_config(cfg)


def test_a_position_dependent_query_scale_before_the_op_maps_as_plain_attention() -> None:
    # Ministral-3 multiplies q by a function of the position (llama_4_scaling_beta) in its
    # attention module, before the attention function, as it applies RoPE: the op is plain
    # attention at the usual scale (tests/e2e/test_run_dense.py runs it against transformers
    # with every position from 2 on scaled).
    cfg = transformers.Ministral3Config(**_SMALL).to_dict()
    assert cfg["rope_parameters"]["llama_4_scaling_beta"]
    layout = specs_from_hf_config(cfg)
    (group,) = layout.groups
    assert group.spec.kind.value == "full" and group.spec.causal
    assert group.spec.scale == pytest.approx(group.spec.head_dim**-0.5)


def _defaults(model_type: str, **extra: Any) -> dict[str, Any]:
    """The config class's own defaults at small sizes (the fields it has)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    kwargs = {k: v for k, v in _SMALL.items() if k in default}
    if "num_hidden_layers" not in default:
        kwargs.pop("num_hidden_layers", None)
    return cls(**{**kwargs, **extra}).to_dict()


def test_gemma2_scale_and_softcap_are_its_own() -> None:
    """Gemma-2 scales by ``query_pre_attn_scalar ** -0.5`` and applies the soft-cap to the
    attention logits: both mapped, as its attention module computes them."""
    cfg = _defaults("gemma2", head_dim=16, query_pre_attn_scalar=32, num_hidden_layers=4)
    layout = specs_from_hf_config(cfg, dtype="float32")
    config = transformers.Gemma2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    for i, spec in enumerate(layout.layer_specs):
        attn = _attention(config, i)
        assert math.isclose(spec.scale, attn.scaling, rel_tol=1e-6)
        assert spec.logits_soft_cap == attn.attn_logit_softcapping == 50.0
        assert spec.sliding_window == attn.sliding_window


def test_sinks_of_the_families_that_have_them() -> None:
    layout = specs_from_hf_config(_defaults("granite_swa", num_hidden_layers=4))
    assert all(s.has_sinks for s in layout.layer_specs)
    assert not any(s.has_sinks for s in specs_from_hf_config(_defaults("mixtral")).layer_specs)


@pytest.mark.parametrize(("model_type", "extra"), [("exaone4", {}), ("cohere2", {})])
def test_a_config_without_layer_types_follows_sliding_window_pattern(
    model_type: str, extra: dict[str, Any]
) -> None:
    """An older config (no ``layer_types``): every ``sliding_window_pattern``-th layer is full,
    as transformers derives ``layer_types`` from it."""
    cfg = _defaults(model_type, num_hidden_layers=8, sliding_window=8, **extra)
    want = ["sliding" if t == "sliding_attention" else "full" for t in cfg.pop("layer_types")]
    cfg.setdefault("sliding_window_pattern", 4)
    got = ["sliding" if s.sliding_window else "full" for s in specs_from_hf_config(cfg).layer_specs]
    assert got == want


def test_max_window_layers_without_layer_types_is_refused() -> None:
    """Qwen2 slides the layers from ``max_window_layers`` on, Qwen2-MoE every other layer below
    it: without ``layer_types`` the mapping does not guess; with them it follows them."""
    cfg = _defaults("qwen2_moe", num_hidden_layers=4, use_sliding_window=True, sliding_window=8)
    cfg["max_window_layers"] = 2
    want = cfg.pop("layer_types")
    with pytest.raises(ValueError, match=r"max_window_layers=2 and no layer_types in layers 0-3"):
        specs_from_hf_config(cfg)
    cfg["layer_types"] = want
    got = [s.sliding_window for s in specs_from_hf_config(cfg).layer_specs]
    assert got == [8 if t == "sliding_attention" else None for t in want]
    assert got == [8, None, 8, None]  # Qwen2-MoE's own rule (defaults: every other layer)


def test_mla_under_another_model_type_reads_deepseek_names() -> None:
    cfg = _defaults(
        "glm4_moe_lite",
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    spec = specs_from_hf_config(cfg).layer_specs[0]
    assert spec.kind.value == "mla" and spec.mla_dims == (16, 8, 8)
    assert math.isclose(spec.scale, 16**-0.5)


@pytest.mark.parametrize(
    ("model_type", "extra", "pattern"),
    [
        (
            "bart",
            {},
            r"encoder-decoder model \(cross-attention in decoder layers 0-\d+\): no layer",
        ),
        ("bloom", {}, r"ALiBi position bias \(bloom adds it to every layer's logits\) in layers"),
        ("falcon", {"alibi": True}, r"ALiBi position bias \(alibi=True\) in layers 0-2"),
        ("xglm", {"num_layers": 3}, r"layers 0-2: their attention modules \['XGLMAttention'\]"),
        ("diffllama", {}, r"differential attention .* in layers 0-2: no layer kind"),
        ("bert-generation", {}, r"bidirectional attention \(a BERT-style encoder"),
        ("gemma2", {"use_bidirectional_attention": True}, r"bidirectional attention .* layers 0"),
        # OLMo-Hybrid now maps (the qwen3.5 family); another hybrid whose mixers none reads
        pytest.param(
            "bailing_hybrid",
            {},
            r"linear-attention / recurrent mixer fields \(linear_",
            marks=since_transformers("5.20.0", "BailingHybridConfig ('bailing_hybrid')"),
        ),
        ("mllama", {}, r"composite config .* alone: .*cross-attention layers"),
        # a multimodal config no family reads (Qwen3.5's and LLaVA's now map:
        # tests/e2e/test_run_qwen_vl.py, tests/e2e/test_run_llava.py)
        ("idefics3", {}, r"composite config .*its text_config \('llama'\) alone maps"),
        # composite configs that also carry a common size name at the top: still named as
        # composite, not as a list of unknown fields (text_config, vision_config, ...)
        (
            "gemma4",
            {"num_hidden_layers": 2},
            r"composite config \(text_config\) .*its text_config \('gemma4_text'\) al",
        ),
        (
            "emu3",
            {"num_hidden_layers": 2},
            r"composite config \(vq_config, text_config\) .*text_config \('emu3_text_m",
        ),
        # the language model's sizes at the top and another stack nested: the refusal still
        # lists the fields, and says the nested config is another stack
        ("git", {}, r"'vision_config' is a nested model config: a composite model"),
        (
            "moshi",
            {},
            r"'audio_encoder_config', 'depth_decoder_config' are nested model configs: a "
            r"composite model",
        ),
    ],
)
def test_refusals_name_the_feature_and_the_layers(
    model_type: str, extra: dict[str, Any], pattern: str
) -> None:
    cfg = _defaults(model_type, **extra)
    with pytest.raises(ValueError, match=pattern) as err:
        specs_from_hf_config(cfg)
    assert model_type in str(err.value)


def test_own_size_names_are_read_through_the_config_class() -> None:
    """GPT-2 names its sizes ``n_layer`` / ``n_head`` / ``n_embd``: its config class's
    ``attribute_map`` says they are the common names; ``scale_attn_by_inverse_layer_idx``
    divides layer ``i``'s scale by ``i + 1``. A model type transformers does not know, naming
    its sizes so, is refused saying that."""
    cfg = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, scale_attn_by_inverse_layer_idx=True
    ).to_dict()
    layout = specs_from_hf_config(cfg)
    config = transformers.GPT2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    for i, spec in enumerate(layout.layer_specs):
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 4, 16)
        assert math.isclose(spec.scale, model.transformer.h[i].attn.scaling, rel_tol=1e-6)
    cfg["model_type"] = "brand_new_gpt"
    with pytest.raises(ValueError, match=r"names its sizes its own way \(n_layer for num_hidden"):
        specs_from_hf_config(cfg)


@pytest.mark.parametrize(
    ("model_type", "extra", "pattern"),
    [
        # Falcon's attention takes hidden_size / heads; a head_dim field is not its config's
        ("falcon", {"head_dim": 8}, r"config field 'head_dim' in layers 0-2: not understood"),
        (
            "gpt_neo",
            {"attention_types": [[["global", "local"], 2]]},
            r"attention_types=.* gives 4 layers; expected num_hidden_layers=3",
        ),
        (
            "gpt_neo",
            {"attention_types": [[["global", "sparse", "local"], 1]]},
            r"attention_types has \['sparse'\]; GPT-Neo's layers are \['global', 'local'\]",
        ),
    ],
)
def test_module_adapted_model_types_refuse_what_they_do_not_read(
    model_type: str, extra: dict[str, Any], pattern: str
) -> None:
    """Falcon and GPT-Neo (their attention modules replaced by the adapter's) map only their
    config class's own fields and layer patterns."""
    if model_type == "falcon":
        cfg = _defaults(model_type, num_hidden_layers=3)
    else:  # a valid GPT-Neo config, its pattern then changed (the class checks its length)
        cfg = _defaults(
            model_type, num_layers=3, attention_types=[[["global", "local"], 1], [["global"], 1]]
        )
    with pytest.raises(ValueError, match=pattern):
        specs_from_hf_config({**cfg, **extra})


@pytest.mark.parametrize(
    ("model_type", "classes"),
    [
        ("xglm", ["XGLMAttention"]),
        # Falcon's modules use the interface from transformers 5.25 on
        (
            "falcon",
            ["FalconAttention", "FalconFlashAttention2"] if transformers_before("5.25.0") else [],
        ),
        ("bloom", ["BloomAttention"]),
        ("mpt", ["MptAttention"]),
        ("gpt_neo", ["GPTNeoAttention", "GPTNeoFlashAttention2", "GPTNeoSelfAttention"]),
        # through the interface, in each style the generic adapter drives: no refusal
        ("llama", []),
        ("gpt2", []),
        ("opt", []),
        ("gpt_bigcode", []),
        # GPT-J's modules use the interface from transformers 5.24 on; before, their own code
        ("gptj", ["GPTJAttention", "GPTJFlashAttention2"] if transformers_before("5.24.0") else []),
        ("gpt_neox", []),
        ("jetmoe", []),
        ("deepseek_v3", []),
        ("falcon_h1", []),
        ("mamba", []),  # no attention class at all: not this test's to refuse
        ("brand_new_lm", []),  # no transformers module: the run's own check decides
    ],
)
def test_attention_in_own_code_is_read_from_the_modeling_module(
    model_type: str, classes: list[str]
) -> None:
    """A modeling module that never refers to ``ALL_ATTENTION_FUNCTIONS`` computes attention
    in its own code: its attention classes are named (the mapping refuses the model with them,
    but for Falcon's rotary layouts and GPT-Neo, whose modules the adapter replaces); any module
    that uses the interface, or none, gives no names."""
    from attn_core.models.hf_config import _attention_in_own_code

    assert _attention_in_own_code(model_type) == classes


def test_a_layer_pattern_field_is_read_only_through_the_layer_types_beside_it() -> None:
    """AFMoE's class derives layer_types from global_attn_every_n_layers: with them the mapping
    follows layer_types; a config.json holding the pattern alone is refused (the rule that
    turns it into layers is the class's code, not something to guess)."""
    cfg = transformers.CONFIG_MAPPING["afmoe"](
        **{**_SMALL, "num_hidden_layers": 4, "sliding_window": 8}
    ).to_dict()
    assert cfg["global_attn_every_n_layers"] and "full_attention" in cfg["layer_types"]
    layout = specs_from_hf_config(cfg)
    windows = {i: g.spec.sliding_window for g in layout.groups for i in g.layer_indices}
    assert [windows[i] for i in range(4)] == [
        8 if t == "sliding_attention" else None for t in cfg["layer_types"]
    ]
    del cfg["layer_types"]
    with pytest.raises(ValueError, match=r"'global_attn_every_n_layers'.*not understood"):
        specs_from_hf_config(cfg)


def test_per_layer_head_counts_give_each_layer_its_spec() -> None:
    """Laguna's num_attention_heads_per_layer: layers of 4 and 8 query heads are two groups
    (the KV heads and head_dim shared); a list of the wrong length is refused, named."""
    cfg = transformers.CONFIG_MAPPING["laguna"](
        **{**_SMALL, "num_hidden_layers": 4, "head_dim": 16,
           "num_attention_heads_per_layer": [4, 8, 4, 8]}
    ).to_dict()  # fmt: skip
    layout = specs_from_hf_config(cfg)
    heads = {i: g.spec.num_heads for g in layout.groups for i in g.layer_indices}
    assert [heads[i] for i in range(4)] == [4, 8, 4, 8]
    assert {g.spec.num_kv_heads for g in layout.groups} == {2}
    bad = {**cfg, "num_attention_heads_per_layer": [4, 8]}
    with pytest.raises(ValueError, match=r"num_attention_heads_per_layer: expected 4 positive"):
        specs_from_hf_config(bad)


def _gemma4_text(**extra: Any) -> dict[str, Any]:
    return transformers.CONFIG_MAPPING["gemma4_text"](
        **{**_SMALL, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 8,
           "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, **extra}
    ).to_dict()  # fmt: skip


def test_gemma4_per_layer_overrides_and_kv_sharing() -> None:
    """Gemma-4's per_layer_config gives its full layer another head_dim and KV heads; the op's
    scale is 1 (q and k RMS-normed); KV sharing, which no layer kind describes, is refused with
    its layers, and so is an override the mapping does not read."""
    cfg = _gemma4_text(per_layer_config={"5": {"head_dim": 32, "num_key_value_heads": 1}})
    layout = specs_from_hf_config(cfg)
    by_layer = {i: g.spec for g in layout.groups for i in g.layer_indices}
    assert (by_layer[5].head_dim, by_layer[5].num_kv_heads, by_layer[5].sliding_window) == (
        32, 1, None
    )  # fmt: skip
    assert (by_layer[0].head_dim, by_layer[0].num_kv_heads, by_layer[0].sliding_window) == (
        16, 2, 8
    )  # fmt: skip
    assert {s.scale for s in by_layer.values()} == {1.0}
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=2\) in layers 4-5: no layer kind"):
        specs_from_hf_config(_gemma4_text(num_kv_shared_layers=2))
    with pytest.raises(ValueError, match=r"per_layer_config\['5'\] sets \['sliding_window'\]"):
        specs_from_hf_config({**cfg, "per_layer_config": {"5": {"sliding_window": 4}}})


def test_mimo_sliding_layers_have_twice_the_kv_heads_and_sinks() -> None:
    """MiMo-V2-Flash's module gives its sliding layers 2 x num_key_value_heads and learned
    sinks, its full layers neither; values are v_head_dim wide on every layer."""
    cfg = transformers.CONFIG_MAPPING["mimo_v2_flash"](
        **{**_SMALL, "num_hidden_layers": 4, "head_dim": 16, "v_head_dim": 32, "sliding_window": 8}
    ).to_dict()
    layout = specs_from_hf_config(cfg)
    by_layer = {i: g.spec for g in layout.groups for i in g.layer_indices}
    for i, t in enumerate(cfg["layer_types"]):
        spec = by_layer[i]
        sliding = t == "sliding_attention"
        assert (spec.num_kv_heads, spec.has_sinks, spec.sliding_window) == (
            (4, True, 8) if sliding else (2, False, None)
        ), (i, spec)
        assert (spec.head_dim, spec.head_dim_v) == (16, 32)
    assert {t for t in cfg["layer_types"]} == {"full_attention", "sliding_attention"}


def test_dbrx_attention_fields_are_read_nested_and_unknown_ones_refused() -> None:
    cfg = transformers.CONFIG_MAPPING["dbrx"](
        d_model=64, n_heads=4, n_layers=2, attn_config={"kv_n_heads": 2, "clip_qkv": 8.0}
    ).to_dict()
    cfg.pop("num_key_value_heads", None)
    (group,) = specs_from_hf_config(cfg).groups
    assert (group.spec.num_heads, group.spec.num_kv_heads) == (4, 2)
    bad = {**cfg, "attn_config": {**cfg["attn_config"], "qk_ln": True}}
    with pytest.raises(ValueError, match=r"attn_config sets \['qk_ln'\]"):
        specs_from_hf_config(bad)


def test_head_dim_defaults_match_transformers_for_every_supported_model_type():
    """A config that leaves ``head_dim`` out gets what transformers' config class gives it:
    Qwen3Config defaults to 128 whatever the hidden size, where the mapping used to take
    hidden_size // num_attention_heads (64 at 512 / 8) and ``attn run`` then failed on a
    shape mismatch."""
    import logging

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from attn_core.models.hf_config import _HEAD_DIM_DEFAULTS

    fixed = {}
    logging.disable(logging.WARNING)  # token-id range warnings of configs built this small
    try:
        for model_type in SUPPORTED_MODEL_TYPES:
            if model_type not in CONFIG_MAPPING:
                continue
            try:
                cfg = CONFIG_MAPPING[model_type](
                    hidden_size=512, num_attention_heads=8, num_key_value_heads=8
                )
                head_dim = getattr(cfg, "head_dim", None)
            except Exception:  # a composite or per-layer config: no single head_dim
                continue
            if head_dim is not None and head_dim != 512 // 8:
                fixed[model_type] = head_dim
    finally:
        logging.disable(logging.NOTSET)
    assert fixed == _HEAD_DIM_DEFAULTS


def test_a_qwen3_config_without_head_dim_maps_transformers_default():
    cfg = {
        "model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "hidden_size": 512, "intermediate_size": 1024,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    layout = specs_from_hf_config(cfg, dtype="bfloat16")
    assert {g.spec.head_dim for g in layout.groups} == {128}


def test_a_head_dim_that_does_not_divide_is_refused_as_run_refuses_it():
    """explain planned d62 for hidden size 500 over 8 heads; transformers (attn run) refuses
    to build that model."""
    cfg = {
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "hidden_size": 500, "intermediate_size": 1024,
        "vocab_size": 1000,
    }  # fmt: skip
    with pytest.raises(
        ValueError, match="hidden_size 500 is not a multiple of num_attention_heads 8"
    ):
        specs_from_hf_config(cfg, dtype="bfloat16")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_more_kv_heads_than_query_heads_is_refused_naming_both_fields(model_type):
    """The error came from LayerSpec ("num_heads=8 is invalid: must be a multiple of
    num_kv_heads=16"), naming neither config field nor the model."""
    cfg = {
        "model_type": model_type, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 16, "hidden_size": 512, "head_dim": 64,
        "intermediate_size": 1024, "vocab_size": 1000,
    }  # fmt: skip
    with pytest.raises(ValueError) as info:
        specs_from_hf_config(cfg, dtype="bfloat16")
    message = str(info.value)
    assert "num_attention_heads=8" in message and "num_key_value_heads=16" in message, message
    assert model_type in message and "multiple" in message, message


def test_a_bad_field_value_of_a_generically_mapped_model_is_not_called_unsupported():
    """gemma2 (no family names it; the generic dense mapping reads it): a bad value was
    reported, then wrapped as "model_type='gemma2' is not supported" with the whole list."""
    cfg = {
        "model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "hidden_size": 512,
        "intermediate_size": 1024, "vocab_size": 1000, "sliding_window": -5,
        "query_pre_attn_scalar": 64,
    }  # fmt: skip
    with pytest.raises(ValueError) as info:
        specs_from_hf_config(cfg, dtype="bfloat16")
    message = str(info.value)
    assert "sliding_window=-5: expected a positive int" in message, message
    assert "not supported" not in message and "supported:" not in message, message
