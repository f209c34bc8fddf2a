"""A whole LLaVA config (CLIP vision tower, Llama language model) through ``attn run`` (issue
22): both stacks run, the tower (class token, pre-layernorm) through the encoder path and the
language model through the engine inside LlavaForConditionalGeneration, each compared with
transformers in fp32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")

# Two CLIP layers over 32 x 32 images of 8 x 8 patches: 16 patches and the class token each.
_TOWER = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    initializer_range=0.1,
)
_TEXT = dict(
    model_type="llama",
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    bos_token_id=1,  # inside the tiny vocabulary
    eos_token_id=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
_TOKENS = 2 * (16 + 1)  # the run's two images, class token and patches each


def _config(tmp_path: Path, cls: str = "LlavaConfig", **fields) -> Path:
    """A tiny LLaVA (or LLaVA-NeXT) config as transformers' own config class writes it."""
    cfg = getattr(transformers, cls)(vision_config=_TOWER, text_config=_TEXT, **fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def test_both_stacks_map(tmp_path: Path) -> None:
    """Every tower layer is mapped (vision_feature_layer=-2 reads the next to last, but the
    last still runs), non-causal over head_dim 16; the text stack is Llama's GQA."""
    layout = specs_from_hf_config(str(_config(tmp_path)))
    assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full"]
    vision, text = layout.stacks
    assert (vision.family, text.family) == ("clip-vision", "qwen3")
    assert vision.groups[0].layer_indices == (0, 1)
    spec = vision.spec_of(0)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.causal) == (4, 4, 16, False)
    assert (text.spec_of(0).num_heads, text.spec_of(0).num_kv_heads) == (4, 2)
    assert text.groups[0].layer_indices == (0, 1, 2)


@pytest.mark.parametrize("cls", ["LlavaConfig", "LlavaNextConfig"])
def test_both_stacks_match_transformers_fp32_cpu(tmp_path: Path, cls: str, run_on_cpu) -> None:
    """LLaVA-NeXT's tower runs over each image's anyres tiles, each a full image_size image:
    the batch of fixed-size images the run feeds it."""
    path = _config(tmp_path, cls)
    layout = specs_from_hf_config(str(path))
    assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full"]
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    vision, text = report.runs
    assert (vision.name, text.name) == (f"{path} [vision]", f"{path} [text]")
    assert vision.mode_counts == {"encoder": 2}
    # every row compared: both layers' hidden states and the last hidden state
    assert vision.match.positions == 3 * _TOKENS, vision.format()
    assert vision.match.max_abs_diff < 1e-4, vision.format()
    assert [g["group_id"] for g in text.plan["groups"]] == ["text.full"]
    assert {"prefill", "decode"} <= set(text.mode_counts), text.format()
    assert text.match.max_abs_diff < 1e-4 and text.match.token_agreement == 1.0, text.format()


def test_a_wrong_tower_output_fails_the_comparison(tmp_path: Path) -> None:
    """The tower's comparison covers the class token and every layer: one value off by 1e-3
    in a layer's class-token row, or a tower that lost its pre-layernorm, fails it."""
    import torch

    from attn_core.e2e.compare import compare_vision
    from attn_core.e2e.configs import build_tiny
    from attn_core.e2e.main import default_registry, encoder_runner
    from attn_core.e2e.vision import encoder_inputs

    cfg = json.loads(_config(tmp_path).read_text())
    model = build_tiny("clip-vision", config=cfg, stack="vision")
    pixels, grid_thw, tokens = encoder_inputs(model, 2)
    assert tokens == _TOKENS
    runner = encoder_runner(model, default_registry(), torch.device("cpu"), None, tokens)
    result = runner.forward(pixels, grid_thw)
    assert compare_vision(model, result, pixels, grid_thw).ok
    for features in [result.blocks[0], result.merged]:
        kept = features[0, 5].clone()  # image 0's class token
        features[0, 5] += 1e-3
        assert not compare_vision(model, result, pixels, grid_thw).ok
        features[0, 5] = kept
    hf: Any = model.hf
    norm = hf.pre_layrnorm
    hf.pre_layrnorm = torch.nn.Identity()
    try:
        skipped = runner.forward(pixels, grid_thw)
    finally:
        hf.pre_layrnorm = norm
    assert not compare_vision(model, skipped, pixels, grid_thw).ok


def test_the_language_model_alone(tmp_path: Path) -> None:
    from attn_core.e2e.main import resolve_models

    path = _config(tmp_path)
    assert resolve_models(str(path)) == [f"{path} [vision]", f"{path} [text]"]
    assert resolve_models(str(path), stack="text") == [f"{path} [text]"]


def test_another_tower_class_is_refused(tmp_path: Path) -> None:
    """LLaVA with a SigLIP tower: not mapped in part."""
    path = _config(tmp_path)
    cfg = json.loads(path.read_text())
    cfg["vision_config"] = {**_TOWER, "model_type": "siglip_vision_model"}
    with pytest.raises(ValueError, match=r"vision_config model_type 'siglip_vision_model'"):
        specs_from_hf_config(cfg)


def test_a_clip_tower_config_alone_matches_transformers(tmp_path: Path, run_on_cpu) -> None:
    """A CLIPVisionConfig on its own (``clip_vision_model``) runs as the tower."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.CLIPVisionConfig(**_TOWER).to_dict()))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.mode_counts == {"encoder": 2}
    assert run.match.positions == 3 * _TOKENS and run.match.max_abs_diff < 1e-4, run.format()


@pytest.mark.parametrize(("text_type", "family"), [("mistral", "qwen3"), ("phi3", "dense")])
def test_the_text_stack_is_read_by_its_text_configs_family(
    tmp_path: Path, text_type: str, family: str, run_on_cpu
) -> None:
    """A Mistral or Phi-3 language model: the family its model_type maps to alone (Phi-3's
    the generic dense mapping, run through the whole model's forward), matching transformers.
    """
    text = {**_TEXT, "model_type": text_type, "pad_token_id": 0}  # inside the tiny vocabulary
    cfg = transformers.LlavaConfig(vision_config=_TOWER, text_config=text)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert specs_from_hf_config(str(path), stack="text").family == family
    report = run_on_cpu(str(path), stack="text")
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.match.max_abs_diff < 1e-4 and run.match.token_agreement == 1.0, run.format()
