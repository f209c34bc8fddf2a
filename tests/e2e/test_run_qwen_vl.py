"""A whole Qwen2-VL / Qwen2.5-VL config through ``attn run`` (issue 22): both stacks run, the
vision tower through the encoder path and the language model (M-RoPE on text positions) through
the engine, each compared with transformers in fp32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")

_TEXT = dict(
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
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
)


def _config(tmp_path: Path, cls: str, **text) -> Path:
    vision = dict(depth=2, num_heads=4, initializer_range=0.1)
    if cls == "Qwen2VLConfig":
        vision.update(embed_dim=64, hidden_size=64, mlp_ratio=2)
    else:
        vision.update(
            hidden_size=64, intermediate_size=96, out_hidden_size=64, fullatt_block_indexes=[1]
        )
    cfg = getattr(transformers, cls)(vision_config=vision, text_config={**_TEXT, **text})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


@pytest.mark.parametrize("cls", ["Qwen2VLConfig", "Qwen2_5_VLConfig"])
def test_both_stacks_match_transformers_fp32_cpu(tmp_path: Path, cls: str, run_on_cpu) -> None:
    path = _config(tmp_path, cls)
    layout = specs_from_hf_config(str(path))
    assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full"]
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    vision, text = report.runs
    assert (vision.name, text.name) == (f"{path} [vision]", f"{path} [text]")
    assert vision.mode_counts == {"encoder": 2}
    assert [g["group_id"] for g in text.plan["groups"]] == ["text.full"]
    assert {"prefill", "decode"} <= set(text.mode_counts), text.format()
    assert text.match.max_abs_diff < 1e-4 and text.match.token_agreement == 1.0, text.format()


def test_sliding_layers_of_the_language_model_run_as_mapped(tmp_path: Path, run_on_cpu) -> None:
    """use_sliding_window with max_window_layers=1: layers 1-2 slide (window 4), layer 0 does
    not; the hook checks each call's window against the spec."""
    path = _config(
        tmp_path, "Qwen2VLConfig", use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    text = specs_from_hf_config(str(path), stack="text")
    assert [text.spec_of(i).sliding_window for i in range(3)] == [None, 4, 4]
    report = run_on_cpu(f"{path}")
    assert report.ok, report.format()


def test_the_language_model_alone(tmp_path: Path) -> None:
    from attn_core.e2e.main import resolve_models

    path = _config(tmp_path, "Qwen2VLConfig")
    assert resolve_models(str(path)) == [f"{path} [vision]", f"{path} [text]"]
    assert resolve_models(str(path), stack="text") == [f"{path} [text]"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_both_stacks_through_the_gpu_plugins_bf16(tmp_path: Path) -> None:
    """Head dim 64 on both stacks, so the installed GPU plugins (varlen for the tower,
    FlashInfer / FA3 for the language model) serve them rather than the reference."""
    from attn_core.e2e import run_main
    from attn_core.registry import Registry

    text = dict(
        hidden_size=256, rope_parameters={**_TEXT["rope_parameters"], "mrope_section": [8, 12, 12]}
    )
    vision = dict(
        depth=2,
        num_heads=4,
        hidden_size=256,
        intermediate_size=256,
        out_hidden_size=256,
        fullatt_block_indexes=[1],
        initializer_range=0.1,
    )
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config={**_TEXT, **text})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    report = run_main(
        str(path),
        device="cuda",
        dtype="bfloat16",
        prompts=3,
        max_new_tokens=4,
        graphs=False,
        registry=Registry.discover(),
        constraints=None,
        progress=False,
    )
    print(report.format())
    assert report.ok, report.format()
    backends = {g["group_id"]: g["backend"] for r in report.runs for g in r.plan["groups"]}
    assert set(backends) == {"vision.encoder", "text.full"}
    assert "attn_core:reference" not in backends.values(), backends
