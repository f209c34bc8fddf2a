"""Tiny Hugging Face configs and models for the end-to-end runner.

Every tiny config starts from the bundled sample (:func:`attn_core.models.load_sample`) and only
shrinks sizes, so the same ``specs_from_hf_config`` path that parses the real model parses it.
Weights are random (fixed seed); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch

from attn_core.models import (
    MULTI_STACK_MODEL_TYPES,
    ModelLayout,
    load_sample,
    specs_from_hf_config,
)

__all__ = [
    "ARCHITECTURES",
    "CONFIG_TOWERS",
    "ENCODER_RUNS",
    "SHAPES",
    "VISION_TOWERS",
    "TinyModel",
    "build_tiny",
    "first_layers",
    "init_std",
    "real_size_config",
    "tiny_config",
]

_VOCAB = 256

# Per sample: the fields that shrink it. Everything else (rope type, layer pattern rules, sinks,
# MLA ranks relations...) stays as in the sample.
_SHRINK: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_window_layers=2,
    ),
    "qwen3-next": dict(
        num_hidden_layers=4,  # full_attention_interval 4: linear, linear, linear, full
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "deepseek-v3": dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 dense MLP, layer 1 MoE
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
    ),
    "kimi-linear": dict(
        num_hidden_layers=5,  # KDA, KDA, KDA, MLA, KDA: a KDA layer after the MLA one too
        linear_attn_config={
            "kda_layers": [1, 2, 3, 5],  # 1-based, as the hub configs write them
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        first_k_dense_replace=1,  # layer 0 dense MLP, later layers MoE
        # the sample's token ids are past the tiny vocabulary (pad would index the embedding)
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "bamba": dict(
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,  # mamba_expand 2 * hidden 64 = 8 heads * 16
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_chunk_size=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,  # mamba, attention, mamba, attention
        expert_layer_period=2,
        expert_layer_offset=0,  # MoE after the Mamba layers, dense MLP after attention
        num_experts=4,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_state=16,
        mamba_dt_rank=8,
        mamba_expand=2,  # d_inner 128
    ),
    "falcon-mamba": dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,  # expand 2 * hidden 64, as transformers derives it
        state_size=16,
        time_step_rank=8,
    ),
    "gpt-oss": dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,  # small enough that the window really cuts prompts and decodes
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_per_token=2,
        pad_token_id=0,
        eos_token_id=2,
    ),
    "minimax": dict(
        num_hidden_layers=4,  # lightning, lightning, softmax, lightning (the real 7 : 1 mix)
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=4,  # transformers' block-wise prefill crosses blocks in every prompt
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "lfm2": dict(
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        block_multiple_of=16,
    ),
    "gemma-3": dict(
        num_hidden_layers=3,
        # sliding (local rope, rope_local_base_freq) and global layers from layer_types
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=8,  # scale 8**-0.5, not head_dim**-0.5: the mapping must say so
        sliding_window=4,
        final_logit_softcapping=30.0,  # the adapter applies it as Gemma3ForCausalLM does
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    ),
    "llama-4": dict(
        num_hidden_layers=4,
        # chunked rope layers around one global NoPE layer (the types transformers derives
        # from no_rope_layers when layer_types is absent)
        layer_types=[
            "chunked_attention",
            "chunked_attention",
            "full_attention",
            "chunked_attention",
        ],
        no_rope_layers=[1, 1, 0, 1],
        attention_chunk_size=4,  # every prompt (7 and 14 tokens) and its decodes cross chunks
        # the NoPE layer's query scale 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
        # changes every 2 positions here (8192 in the sample: 1 for every tiny prompt)
        floor_scale=2,
        attn_scale=0.5,
        moe_layers=[1, 3],  # dense MLP on layers 0 and 2, MoE on 1 and 3
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "nemotron-h": dict(
        num_hidden_layers=5,
        hybrid_override_pattern="M-M*-",  # Mamba2, MLP, Mamba2, attention, MLP
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=16,
    ),
    "falcon-h1": dict(
        num_hidden_layers=3,  # every layer: Mamba2 and attention side by side
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=96,  # not mamba_expand * hidden_size (128): the mapping reads mamba_d_ssm
        mamba_n_heads=6,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_chunk_size=4,  # transformers' chunked scan crosses chunks in every prompt
        # muP multipliers, all different from 1 (the attention input multiplier is 1 in the
        # sample), at magnitudes that leave both branches a large share of the logits: with
        # the sample's own (z, x, B, C, dt scaled by 0.25-0.5, the SSM branch by 0.24, the
        # logits by 0.04) zeroing the whole Mamba2 branch moved the tiny model's logits by
        # only 5e-4
        attention_in_multiplier=1.5,
        ssm_multipliers=[1.5, 2.0, 1.25, 0.8, 0.5],
        ssm_out_multiplier=1.5,
        lm_head_multiplier=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2.5-vl-vision": dict(
        depth=4,
        fullatt_block_indexes=[1, 3],
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=64,
    ),
    "qwen2-vl-vision": dict(depth=3, embed_dim=64, hidden_size=48, num_heads=4, mlp_ratio=2),
    # clips of 2 * 16 mel frames: 16 positions after the stride-2 conv
    "whisper-encoder": dict(
        encoder_layers=3,
        encoder_attention_heads=4,
        d_model=64,
        encoder_ffn_dim=128,
        num_mel_bins=8,
        max_source_positions=16,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=128,
        max_target_positions=16,  # the vocabulary stays: the encoder has no embedding of it
    ),
    # 16 patches of 8 x 8 per 32 x 32 image
    "siglip-vision": dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    ),
}
# ``shapes="kernel"``: still few layers and a small hidden size, but the attention shapes the
# GPU kernels serve (head dim 64 / 128, DeepSeek's real MLA ranks 512 + 64, Mamba2 heads of 64
# with state 128), so a GPU run selects the GPU plugins instead of falling back to the
# reference backend for head dims no kernel is built for.
_KERNEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": dict(hidden_size=256, head_dim=128),
    "qwen3-next": dict(
        hidden_size=256, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128
    ),
    "deepseek-v3": dict(
        hidden_size=256,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
    "kimi-linear": dict(
        hidden_size=256,
        linear_attn_config={
            "kda_layers": [1, 2, 3, 5],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
    "bamba": dict(
        hidden_size=256,  # attention head dim 256 / 4 = 64
        mamba_n_heads=8,
        mamba_d_head=64,  # mamba_expand 2 * hidden 256 = 8 heads * 64
        mamba_d_state=128,
        mamba_chunk_size=64,
    ),
    # Mamba1: the real d_state 16; attention head dim 256 / 4 = 64
    # MoE after the attention layers only: with experts after the Mamba layers at hidden 256,
    # transformers' own bf16 forward flips an expert route on one of the four prompts and its
    # logits land 5.6 away from its float32 ones on every later row (attn-core's stay within
    # 0.25 of float32), which no comparison with it can tell from a bug
    "jamba": dict(hidden_size=256, mamba_dt_rank=16, expert_layer_offset=1),
    "falcon-mamba": dict(hidden_size=256, intermediate_size=512, time_step_rank=16),
    "gpt-oss": dict(hidden_size=256, head_dim=64),
    "minimax": dict(hidden_size=256, head_dim=128, block_size=64),
    "lfm2": dict(hidden_size=256),  # attention heads of 64, a conv of 256 channels
    "gemma-3": dict(hidden_size=256, head_dim=128, query_pre_attn_scalar=128),
    # chunks of one 16-token page: GPU plugins serve chunked layers through local virtual
    # batches only when a chunk is whole pages (prompts of 3-17 tokens and their decodes cross 16)
    "llama-4": dict(hidden_size=256, head_dim=64, attention_chunk_size=16),
    "nemotron-h": dict(
        hidden_size=256,
        head_dim=128,
        attention_head_dim=128,
        mamba_head_dim=64,  # 8 heads * 64 = 2 * hidden 256
        ssm_state_size=128,
        chunk_size=64,
    ),
    "falcon-h1": dict(
        hidden_size=256,
        head_dim=128,  # 4 attention heads of 128 (head_dim is its own field in Falcon-H1)
        mamba_d_ssm=512,
        mamba_n_heads=8,
        mamba_d_head=64,  # 8 heads * 64 = mamba_d_ssm
        mamba_d_state=128,
        mamba_chunk_size=64,
    ),
    "qwen2.5-vl-vision": dict(hidden_size=256, out_hidden_size=256),  # 4 heads of 64
    "qwen2-vl-vision": dict(embed_dim=256, hidden_size=256),  # 4 heads of 64
    "siglip-vision": dict(hidden_size=256),  # 4 heads of 64
    "whisper-encoder": dict(d_model=256),  # 4 heads of 64
}
#: Sample names the runner drives, in report order.
ARCHITECTURES: tuple[str, ...] = tuple(_SHRINK)
#: The vision towers the runner drives (an encoder pass over images, no decode): the sample
#: and the families that run from a config.json.
VISION_TOWERS: tuple[str, ...] = ("qwen2.5-vl-vision", "qwen2-vl-vision", "siglip-vision")
#: Vision towers with no sample that run from a config.json only: the whole model's config
#: class (or the tower's own) picks the tower class, so each model type gets its own
#: (Qwen3-VL-MoE's, Qwen3.5-MoE's).
CONFIG_TOWERS: tuple[str, ...] = ("qwen3-vl-vision", "qwen3.5-vision", "clip-vision")
#: Multimodal model types whose language model runs inside the whole
#: ``*ForConditionalGeneration`` (AutoModelForImageTextToText): text prompts run its language
#: model, and its forward is the reference.
_WHOLE_MODEL_TEXT: frozenset[str] = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "llava",
        "llava_next",
    }
)
#: Audio encoders the runner drives (an encoder pass over mel clips, no decode).
AUDIO_ENCODERS: tuple[str, ...] = ("whisper-encoder",)
#: The encoder-only samples: the sample vision towers and the audio encoders.
ENCODER_MODELS: tuple[str, ...] = VISION_TOWERS + AUDIO_ENCODERS
#: Every encoder-only run: those and the towers that run from a config.json only.
ENCODER_RUNS: tuple[str, ...] = ENCODER_MODELS + CONFIG_TOWERS
#: ``tiny``: the smallest shapes (CPU tests); ``kernel``: head dims the GPU kernels serve.
SHAPES = ("tiny", "kernel")


def init_std(hidden_size: int) -> float:
    """The weight init std of a random test model of ``hidden_size``: 0.1 at hidden 64, and
    ``0.1 * sqrt(64 / hidden)`` wider. transformers' default 0.02 leaves the layers' share of
    the residual stream tiny at hidden 64, so logits would hardly depend on attention; 0.1 gives
    every layer weight. Wider layers keep the same per-layer share: at 0.1 and hidden 256 random
    Gated DeltaNet layers amplified bf16 rounding so much that transformers' own bf16 logits were
    10 away from its float32 logits."""
    return 0.1 * (64 / hidden_size) ** 0.5


def tiny_config(name: str, shapes: str = "tiny") -> dict[str, Any]:
    """The sample config ``name`` with sizes shrunk (a fresh dict, ``config.json`` shaped).

    For the vision towers the shrink applies to the tower's fields (``vision_config`` of the
    Qwen-VL samples: the tower is what runs).

    :param shapes: ``"tiny"`` (head dims of 16: fast on CPU) or ``"kernel"`` (head dims 64 /
        128 and DeepSeek's real MLA ranks, which FlashInfer, FlashAttention and the Triton SSM
        kernels serve; still a few layers of hidden size 256).
    """
    if name not in _SHRINK:
        raise ValueError(f"model {name!r} has no tiny config; available: {list(ARCHITECTURES)}")
    if shapes not in SHAPES:
        raise ValueError(f"shapes={shapes!r}: expected one of {SHAPES}")
    shrink = copy.deepcopy(_SHRINK[name])
    if shapes == "kernel":
        shrink.update(copy.deepcopy(_KERNEL_SHAPES[name]))
    cfg = load_sample(name)
    if name in VISION_TOWERS:
        return _with_tower_fields(cfg, {**shrink, "initializer_range": 0.1})
    if name in AUDIO_ENCODERS:  # Whisper initialises with init_std
        # the common names WhisperConfig maps onto its own fields would override the shrink
        for alias in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            cfg.pop(alias, None)
        return {**cfg, **shrink, "init_std": 0.1}
    cfg.update(shrink)
    cfg["vocab_size"] = _VOCAB
    cfg["initializer_range"] = init_std(cfg["hidden_size"])
    cfg["tie_word_embeddings"] = False
    cfg.pop("num_nextn_predict_layers", None)
    return cfg


# Fields that list layer indices (filtered to the kept layers, not cut by position).
# Lists of layer (block) indices: an index past the cut names no layer of the kept ones.
_INDEX_LISTS = (
    "attn_layer_indices",
    "fullatt_block_indexes",
    "moe_layers",
    "deepstack_visual_indexes",  # Qwen3-VL: the blocks whose DeepStack mergers run
)


def _per_layer(key: str) -> bool:
    """A field with one entry per layer: ``layer_types``, ``mlp_layer_types``,
    ``layers_block_type``, ``hybrid_override_pattern``, ``no_rope_layers`` (not any list that
    happens to have ``num_hidden_layers`` entries, such as a list of eos token ids)."""
    return key.endswith("layer_types") or key in (
        "layers_block_type",
        "hybrid_override_pattern",
        "no_rope_layers",  # Llama-4: 1 (rope) / 0 (NoPE) per layer
    )


def first_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    """``config`` keeping only its first ``n`` layers, every per-layer pattern kept for them.

    ``num_hidden_layers`` (``depth`` of a vision config, ``encoder_layers`` of Whisper)
    becomes ``n``; every list or string with one entry per layer (``layer_types``,
    ``layers_block_type``, ``hybrid_override_pattern``, ...) is cut to its first ``n``; index lists
    (``attn_layer_indices``, ``fullatt_block_indexes``, ``moe_layers``) keep the indices below
    ``n`` (Kimi-Linear's 1-based ``linear_attn_config`` lists those up to ``n``). Patterns
    given by a rule (``full_attention_interval``, ``sliding_window_pattern``,
    ``first_k_dense_replace``) hold for the first layers unchanged. Nested ``text_config`` /
    ``vision_config`` are cut the same way. Hidden sizes and head layouts are untouched.

    :raises ValueError: ``n`` not in ``1..num_layers``.
    """
    cfg = copy.deepcopy(config)
    for key in ("text_config", "vision_config"):
        if isinstance(cfg.get(key), dict):
            cfg[key] = first_layers(cfg[key], n)
    if isinstance(cfg.get("encoder_layers"), int):  # Whisper: its encoder is what runs
        total = cfg["encoder_layers"]
        if not 1 <= n <= total:
            raise ValueError(f"layers={n}: expected 1..{total} (the config's encoder_layers)")
        cfg["encoder_layers"] = n
        if "num_hidden_layers" in cfg:  # WhisperConfig's alias of encoder_layers
            cfg["num_hidden_layers"] = n
        return cfg
    count_key = "num_hidden_layers" if "num_hidden_layers" in cfg else "depth"
    total = cfg.get(count_key)
    if not isinstance(total, int) and isinstance(cfg.get("layers_block_type"), list):
        # Nemotron-H as transformers 5 writes it: the pattern's length is the layer count
        # (num_hidden_layers is a property of it, not a field: the cut pattern alone says n)
        count_key, total = "layers_block_type", len(cfg["layers_block_type"])
    if not isinstance(total, int):
        if any(isinstance(cfg.get(k), dict) for k in ("text_config", "vision_config")):
            return cfg
        raise ValueError(f"config has no num_hidden_layers (or depth) to cut to {n} layers")
    if not 1 <= n <= total:
        raise ValueError(f"layers={n}: expected 1..{total} (the config's {count_key})")
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, dict):  # Kimi-Linear's 1-based kda_layers / full_attn_layers
        for key in ("kda_layers", "full_attn_layers"):
            if isinstance(lac.get(key), list):
                lac[key] = [i for i in lac[key] if isinstance(i, int) and i <= n]
    for key, value in list(cfg.items()):
        if key in _INDEX_LISTS and isinstance(value, list):
            cfg[key] = [i for i in value if isinstance(i, int) and i < n]
        elif _per_layer(key) and isinstance(value, (list, str)) and len(value) == total:
            cfg[key] = value[:n]
    if count_key != "layers_block_type":  # that one is cut above, with every pattern
        cfg[count_key] = n
    return cfg


def _with_tower_fields(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``fields`` set on its vision tower (``vision_config``, or the config itself
    for a tower's own config such as SigLIP's)."""
    if isinstance(cfg.get("vision_config"), dict):
        cfg["vision_config"] = {**cfg["vision_config"], **fields}
    else:
        cfg.update(fields)
    return cfg


def real_size_config(name: str) -> dict[str, Any]:
    """The sample ``name`` at its real sizes (hidden size, heads, vocabulary), ready to build
    with random weights: no MTP layers, untied head, the init scale of :func:`tiny_config`."""
    if name not in _SHRINK:
        raise ValueError(f"model {name!r} is not one the runner drives: {list(ARCHITECTURES)}")
    cfg = load_sample(name)
    if name in VISION_TOWERS:
        return _with_tower_fields(cfg, {"initializer_range": 0.02})
    if name in AUDIO_ENCODERS:
        return cfg
    cfg["initializer_range"] = init_std(cfg["hidden_size"])
    cfg["tie_word_embeddings"] = False
    cfg.pop("num_nextn_predict_layers", None)
    return cfg


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A random-init transformers model, its config dict and the attn-core layout parsed from it.

    :ivar name: sample name (``"qwen3-next"``, ...).
    :ivar config: the ``config.json``-shaped dict both transformers and attn-core read.
    :ivar hf: the transformers module (``*ForCausalLM``; the vision tower for
        :data:`VISION_TOWERS` and :data:`CONFIG_TOWERS`, ``WhisperEncoder`` for
        ``whisper-encoder``) in eval mode, eager attention, on ``device`` in ``dtype``.
    :ivar layout: ``specs_from_hf_config(config, dtype=dtype, tp_size=tp_size, stack=...)``:
        of a multi-stack config, the stack that runs (:func:`run_stack`).
    :ivar checkpoint: the checkpoint folder the weights came from; None: random init.
    :ivar notes: lines the report prints: a config field transformers' model was built
        without, and why (:func:`_derived_head_dim`).
    """

    name: str
    config: dict[str, Any]
    hf: torch.nn.Module
    layout: ModelLayout
    checkpoint: str | None = None  # the folder whose safetensors weights were loaded
    notes: tuple[str, ...] = ()  # what of the config the transformers model was built without

    @property
    def is_encoder(self) -> bool:
        return self.name in ENCODER_RUNS


def run_stack(name: str, config: dict[str, Any]) -> str | None:
    """The stack of ``config`` that architecture ``name`` runs: ``"vision"`` for a tower,
    ``"encoder"`` for Whisper's encoder, ``"text"`` for a language model, of a multi-stack
    config (:data:`~attn_core.models.MULTI_STACK_MODEL_TYPES`); None for a single-stack one."""
    if config.get("model_type") not in MULTI_STACK_MODEL_TYPES:
        return None
    if name in VISION_TOWERS or name in CONFIG_TOWERS:
        return "vision"
    if name in AUDIO_ENCODERS:
        return "encoder"
    return "text"


def _tower_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision tower's own fields: the whole config's ``vision_config``, or the tower's own
    config (``model_type`` ``siglip_vision_model``, ``qwen2_vl_vision``, ...) as given."""
    sub = cfg.get("vision_config")
    fields = dict(sub) if isinstance(sub, dict) else dict(cfg)
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    return fields


_NOT_FIELDS = ("model_type", "architectures", "transformers_version")


def _hf_config(name: str, cfg: dict[str, Any]) -> tuple[Any, tuple[str, ...]]:
    """``(transformers config, notes)``: the config ``cfg`` describes, and what of ``cfg`` it
    was built without, and why (:func:`_derived_head_dim`)."""
    from transformers import AutoConfig

    tower = _tower_config(name, cfg)
    if tower is not None:
        return tower, ()
    fields = {
        k: _decode_floats(v) for k, v in cfg.items() if k not in ("model_type", "architectures")
    }
    _require_config_class(cfg["model_type"])
    fields, notes = _derived_head_dim(cfg["model_type"], fields)
    return AutoConfig.for_model(cfg["model_type"], **fields), tuple(notes)


def _tower_config(name: str, cfg: dict[str, Any]) -> Any:
    """The transformers config of an encoder run (a vision tower, Whisper's encoder); None for
    a causal LM."""
    if name == "qwen2.5-vl-vision":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

        return Qwen2_5_VLVisionConfig(**_tower_fields(cfg))
    if name == "qwen2-vl-vision":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

        return Qwen2VLVisionConfig(**_tower_fields(cfg))
    if name in CONFIG_TOWERS:
        return _auto_tower_config(cfg)
    if name == "siglip-vision":
        from transformers import SiglipVisionConfig

        return SiglipVisionConfig(**_tower_fields(cfg))
    if name == "whisper-encoder":
        from transformers import WhisperConfig

        return WhisperConfig(**{k: v for k, v in cfg.items() if k not in _NOT_FIELDS})
    return None


def _derived_head_dim(model_type: str, fields: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``fields`` without a ``head_dim`` that an MLA config class derives itself, when the
    given one differs, and a note saying so (else ``fields`` unchanged, no note).

    DeepseekV3Config (A.X K1's, Kimi-Linear's alike) sets ``head_dim = qk_rope_head_dim`` in
    its ``__post_init__``, and ``head_dim`` is no field of it: a config.json that carries one
    (hub configs of DeepSeek-V3-like models written by other tools) sets it afterwards, and
    transformers' rotary embedding, ``head_dim`` wide, then fails against the
    ``qk_rope_head_dim`` rotary part of q and k. The model the config describes ropes
    ``qk_rope_head_dim`` channels (as the mapping reads it): transformers' model is built
    with the class's own ``head_dim``. A class whose ``head_dim`` is a field keeps it."""
    from transformers import CONFIG_MAPPING

    from attn_core.models.hf_config import class_fields

    if fields.get("kv_lora_rank") is None or fields.get("head_dim") is None:
        return fields, []
    cls = CONFIG_MAPPING[model_type]
    if "head_dim" in class_fields(model_type) or "head_dim" in getattr(cls, "attribute_map", {}):
        return fields, []
    without = {k: v for k, v in fields.items() if k != "head_dim"}
    try:
        derived = getattr(cls(**without), "head_dim", None)
    except (TypeError, ValueError):  # the config is refused anyway when it is built
        return fields, []
    given = fields["head_dim"]
    if derived is None or derived == given:
        return fields, []
    note = (
        f"head_dim={given} in the config is not what {cls.__name__} derives (head_dim = "
        f"{derived}, the MLA rotary width qk_rope_head_dim={fields.get('qk_rope_head_dim')}); "
        f"given, transformers' rotary embedding would be {given} wide and its own forward "
        f"fail: transformers' model is built with the derived head_dim, as the mapping reads "
        f"the config"
    )
    return without, [note]


def _require_config_class(model_type: str) -> None:
    """Refuse a model type the installed transformers has no config class for (one added in a
    later release), naming the release, instead of AutoConfig's list of every known type."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        from attn_core.e2e.hf_version import installed_transformers

        raise ValueError(
            f"model_type {model_type!r}: the installed transformers "
            f"{installed_transformers()} has no config class for it (a later release may "
            f"add it); `attn run` builds the model with transformers"
        )


def _auto_tower_config(cfg: dict[str, Any]) -> Any:
    """The tower's transformers config: the ``vision_config`` of the whole model's config class
    (which fixes old hub ``model_type`` values), or the tower's own config as given."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in _NOT_FIELDS}
    whole = AutoConfig.for_model(cfg["model_type"], **fields)
    return whole.vision_config if "vision_config" in cfg else whole


def _whole_model_text(name: str, cfg: dict[str, Any]) -> bool:
    """Whether architecture ``name`` runs the language model of a multimodal config inside its
    whole ``*ForConditionalGeneration``."""
    return name not in ENCODER_RUNS and cfg.get("model_type") in _WHOLE_MODEL_TEXT


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _decode_floats(value: Any) -> Any:
    """A config.json value with transformers' JSON tags for special floats decoded: it writes
    ``inf`` as ``{"__float__": "Infinity"}`` (Nemotron-H's ``time_step_limit``), which its
    loader decodes but ``for_model`` keyword arguments would not."""
    if isinstance(value, dict):
        tag = value.get("__float__")
        if len(value) == 1 and tag in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[tag]
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def _construct(name: str, cfg: dict[str, Any], hf_cfg: Any) -> Any:
    """The transformers model of architecture ``name`` from ``hf_cfg`` (random init, on the
    current default device: a ``torch.device`` context picks it, ``meta`` allocates nothing)."""
    import transformers

    if name == "qwen2.5-vl-vision":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            hf_cfg, attn_implementation="eager"
        )
    elif name == "qwen2-vl-vision":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel,
        )

        model = Qwen2VisionTransformerPretrainedModel._from_config(
            hf_cfg, attn_implementation="eager"
        )
    elif name in CONFIG_TOWERS:
        model = transformers.AutoModel.from_config(hf_cfg, attn_implementation="eager")
    elif name == "siglip-vision":
        from transformers import SiglipVisionModel

        model = SiglipVisionModel._from_config(hf_cfg, attn_implementation="eager")
    elif name == "whisper-encoder":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        model = WhisperEncoder._from_config(hf_cfg, attn_implementation="eager")
    elif _whole_model_text(name, cfg):
        # the whole *ForConditionalGeneration (AutoModelForCausalLM has no Qwen-VL class):
        # text prompts run its language model, and its forward is the reference
        model = transformers.AutoModelForImageTextToText.from_config(
            hf_cfg, attn_implementation="eager"
        )
    else:
        # MoE blocks through batched_mm: transformers' default grouped_mm reads its expert
        # offsets on the host for float32 (H200: "Cannot copy between CPU and CUDA tensors
        # during CUDA graph capture"), so a decode step of DeepSeek-V3 could not be captured.
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                hf_cfg, attn_implementation="eager", experts_implementation="batched_mm"
            )
        except Exception as err:
            # transformers' own modeling code fails on this config (a field its classes
            # read without a default, e.g. a null head_dim; an assertion in a torch module
            # it builds, e.g. a pad_token_id outside the vocabulary): not a mapping question
            raise ValueError(
                f"transformers cannot build {type(hf_cfg).__name__} "
                f"({hf_cfg.model_type}) from this config: {type(err).__name__}: {err}; "
                f"set the field its modeling code reads (attn explain maps the config)"
            ) from err
    return model


def _refuse_if_too_large(
    name: str,
    cfg: dict[str, Any],
    hf_cfg: Any,
    device: torch.device,
    dtype: torch.dtype,
    *,
    loaded: bool,
) -> None:
    """Refuse, before it is built or loaded, a model whose weights would not fit in what
    ``device`` has free: built anyway, a full-size config on a small machine is killed by the
    kernel's out-of-memory killer minutes later, with no word of why. Sized from the same model
    built on the meta device (nothing allocated); one whose init reads tensor values has no
    meta build and is not sized.

    :param loaded: the weights load in ``dtype`` (a checkpoint); else they are built in the
        config's dtype and converted to ``dtype``, and the larger of the two counts."""
    try:
        with torch.device("meta"):
            model = _construct(name, cfg, hf_cfg)
    except Exception:
        return
    _check_fits(model, device, dtype, as_built=not loaded)


def _check_fits(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *, as_built: bool = True
) -> None:
    """Refuse ``model`` (built on the meta device) where its weights in ``dtype`` (and, with
    ``as_built``, in the dtype it was built in, if larger) exceed 90 % of what ``device`` has
    free."""
    size = dtype.itemsize
    if as_built:
        size = max(size, *(p.element_size() for p in model.parameters()))
    params = sum(p.numel() for p in model.parameters())
    need = params * size + sum(b.numel() * b.element_size() for b in model.buffers())
    free = available_memory(device)
    if free is not None and need > 0.9 * free:
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        raise ValueError(
            f"{type(model).__name__}{f' ({kind})' if kind else ''} at its config's sizes holds "
            f"{params / 1e9:.2f} B parameters, {need / 2**30:.1f} GiB in {str(dtype)[6:]}; "
            f"{device} has {free / 2**30:.1f} GiB free: run its first layers at real sizes "
            f"(attn run --layers N) or give a smaller config"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a model on ``device``: CUDA's free memory, the host's MemAvailable
    (Linux); None where neither can be read (no refusal then)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def build_tiny(
    name: str,
    *,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    tp_size: int = 1,
    page_size: int = 16,
    shapes: str = "tiny",
    config: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    stack: str | None = None,
) -> TinyModel:
    """Build the tiny transformers model ``name`` with random weights (seeded) and its layout.

    :param dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"``: the model's and the specs'.
    :param shapes: ``"tiny"`` or ``"kernel"`` (see :func:`tiny_config`).
    :param config: a ``config.json`` dict of architecture ``name`` to build instead of the
        shrunk sample, at its own sizes (``shapes`` is then not used).
    :param checkpoint: a folder holding ``config.json`` and safetensors weights (as
        ``save_pretrained`` writes them): the causal LM is loaded from it with
        ``from_pretrained`` instead of random init; ``config`` must be its config.
    :param stack: the stack of a multi-stack config the layout describes (default:
        :func:`run_stack`).
    """
    import transformers

    cfg = copy.deepcopy(config) if config is not None else tiny_config(name, shapes)
    from attn_core.specs import torch_dtype

    stack = stack if stack is not None else run_stack(name, cfg)
    if checkpoint is not None:
        if name in ENCODER_RUNS:
            raise ValueError(
                f"{checkpoint}: loading weights is supported for causal LMs; the encoder "
                f"({name}) runs with random weights from a config.json only"
            )
        hf_cfg, notes = _hf_config(name, cfg)  # the folder's own, or its first layers (--layers)
        _refuse_if_too_large(
            name, cfg, hf_cfg, torch.device(device), torch_dtype(dtype), loaded=True
        )
        # Any: transformers' from_pretrained wrapper types its result loosely
        # a Qwen-VL checkpoint is its whole *ForConditionalGeneration (no causal-LM class)
        auto: Any = (
            transformers.AutoModelForImageTextToText
            if _whole_model_text(name, cfg)
            else transformers.AutoModelForCausalLM
        )
        loaded: Any = auto.from_pretrained(
            checkpoint,
            config=hf_cfg,
            dtype=torch_dtype(dtype),
            attn_implementation="eager",
            experts_implementation="batched_mm",  # as below: capturable MoE blocks
        )
        loaded = loaded.to(device=device).eval()
        layout = specs_from_hf_config(
            cfg, dtype=dtype, tp_size=tp_size, page_size=page_size, stack=stack
        )
        return TinyModel(name, cfg, loaded, layout, checkpoint, notes)
    hf_cfg, notes = _hf_config(name, cfg)
    hf_cfg._attn_implementation = "eager"
    build_device = torch.device(device)
    if config is not None:  # a config.json at its own sizes: refused here if it cannot fit
        _refuse_if_too_large(name, cfg, hf_cfg, build_device, torch_dtype(dtype), loaded=False)
    torch.manual_seed(seed)
    # Built on the device it runs on: a CUDA build initialises its weights there, which at a
    # real-size vocabulary and hidden size (--layers N) takes a fraction of a second instead
    # of a minute of CPU random init; a CPU build is unchanged.
    with build_device if build_device.type == "cuda" else contextlib.nullcontext():
        model = _construct(name, cfg, hf_cfg)
    _spread_weights(model, seed)
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    _recompute_decay_buffers(model)
    layout = specs_from_hf_config(
        cfg, dtype=dtype, tp_size=tp_size, page_size=page_size, stack=stack
    )
    return TinyModel(name, cfg, model, layout, notes=notes)


def lightning_slopes(module: Any, device: torch.device) -> torch.Tensor:
    """A MiniMax lightning-attention module's per-head decay rates ``[H, 1, 1]`` float32 on
    ``device``, from the module's own ``get_slope_rate``. Called without arguments: transformers
    releases differ in whether it takes ``device`` (5.24 does, earlier 5.x releases do not), and
    it builds the rates in float32 on the CPU either way."""
    return module.get_slope_rate().to(device=device, dtype=torch.float32)


@torch.no_grad()
def _recompute_decay_buffers(model: torch.nn.Module) -> None:
    """MiniMax's lightning attention computes its slopes and decay tables as buffers at
    construction, in the config's dtype (bfloat16 for the sample): rounded there, and each
    table rounded on its own, so its block-wise prefill and its token loop disagree. Recompute
    them in float32 with the module's own functions (as its ``_init_weights`` does), then store
    them in the model dtype."""
    for module in model.modules():
        if not (hasattr(module, "get_slope_rate") and hasattr(module, "decay_factors")):
            continue
        mod: Any = module  # a MiniMaxLightningAttention (attributes resolved at run time)
        # on the CPU, then copied: earlier transformers 5.x releases build decay_factors'
        # position range on the CPU whatever the slopes' device (a CUDA model raised there)
        slope = lightning_slopes(mod, torch.device("cpu"))
        tables = (slope, *mod.decay_factors(slope))
        for name, value in zip(
            ("slope_rate", "query_decay", "key_decay", "diagonal_decay"), tables, strict=True
        ):
            buffer = getattr(mod, name)
            buffer.copy_(value.to(buffer.dtype))


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Make random logits decisive: HF's init (std 0.02) gives near-uniform next-token logits
    whose argmax flips on rounding noise; a wider lm_head / embedding separates them."""
    for name in ("lm_head", "embed_tokens"):
        mod = _find(model, name)
        if mod is not None:
            weight = mod.weight
            gen = torch.Generator(device=weight.device).manual_seed(seed + 1)
            weight.copy_(torch.randn(weight.shape, generator=gen, device=weight.device) * 0.5)


def _find(model: torch.nn.Module, suffix: str):
    for name, mod in model.named_modules():
        if name.endswith(suffix) and hasattr(mod, "weight"):
            return mod
    return None
