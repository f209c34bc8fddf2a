"""SigLIP and Qwen2-VL vision towers through ``attn run --model CONFIG.json`` (issue 22).

Configs are written by transformers' own config classes (tiny sizes); every block's hidden
states and the tower's output are compared with transformers' eager forward in fp32 on the
CPU, and a wrong attention must fail the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")


def _siglip(tmp_path: Path) -> Path:
    cfg = transformers.SiglipVisionConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,  # 16 patches per image
        initializer_range=0.1,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def _qwen2_vl(tmp_path: Path) -> Path:
    cfg = transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=3,
            embed_dim=64,  # 4 heads of 16
            hidden_size=48,  # the merger's output (the language model's width)
            num_heads=4,
            mlp_ratio=2,
            initializer_range=0.1,
        ),
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            # head dim 12: M-RoPE sections of 2 + 2 + 2 frequencies (the language model runs too)
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2]},
            initializer_range=0.1,
        ),
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


@pytest.mark.parametrize(
    ("make", "family", "steps"),
    [(_siglip, "siglip-vision", 3), (_qwen2_vl, "qwen2-vl-vision", 3)],
)
def test_tower_blocks_match_transformers_fp32_cpu(
    tmp_path: Path, make, family: str, steps: int, run_on_cpu
) -> None:
    path = make(tmp_path)
    layout = specs_from_hf_config(json.loads(path.read_text()))
    if layout.stacks:  # the whole Qwen2-VL config: the tower is the stack that runs
        assert [g.group_id for g in layout.groups] == ["vision.encoder", "text.full"]
        layout = layout.stack_layout("vision")
    assert layout.family == family
    assert [g.spec.kind.value for g in layout.groups] == ["encoder"]
    assert not layout.groups[0].spec.causal
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    run = report.runs[0]
    assert run.steps == steps and run.mode_counts == {"encoder": steps}
    assert run.match.max_abs_diff < 1e-4, run.format()
    if layout.stack:  # the whole config: the tower, then the language model on its own
        assert [r.name for r in report.runs] == [f"{path} [vision]", f"{path} [text]"]
        assert run.notes == ["runs stack vision of qwen2_vl"]  # every stack runs: no other note
        assert report.runs[1].notes == ["runs stack text of qwen2_vl"]
    else:
        assert len(report.runs) == 1


@pytest.mark.parametrize(
    ("make", "family"), [(_siglip, "siglip-vision"), (_qwen2_vl, "qwen2-vl-vision")]
)
def test_tower_comparison_detects_a_causal_mask(
    tmp_path: Path, make, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tower with causal attention in attn-core: the block outputs must differ."""
    import dataclasses

    from attn_core.e2e import main as main_mod
    from attn_core.e2e.main import run_architecture

    path = make(tmp_path)
    real = main_mod.build_tiny

    def causal(*args, **kwargs):
        tiny = real(*args, **kwargs)
        groups = tuple(
            dataclasses.replace(g, spec=dataclasses.replace(g.spec, causal=True))
            for g in tiny.layout.groups
        )
        specs = tuple(dataclasses.replace(s, causal=True) for s in tiny.layout.layer_specs)
        layout = dataclasses.replace(tiny.layout, groups=groups, layer_specs=specs)
        return dataclasses.replace(tiny, layout=layout)

    monkeypatch.setattr(main_mod, "build_tiny", causal)
    run = run_architecture(family, config=json.loads(path.read_text()), prompts=2)
    assert not run.ok
    assert run.match.max_abs_diff > 1e-2


@pytest.mark.parametrize("name", ["siglip-vision", "qwen2-vl-vision"])
@pytest.mark.parametrize(
    ("dtype", "shapes"), [("float32", "kernel"), ("bfloat16", "tiny"), ("bfloat16", "kernel")]
)
def test_tower_samples_kernel_shapes_and_bf16_cpu(name: str, dtype: str, shapes: str) -> None:
    """The GPU runs' head dim (64) and dtype parse and match on the CPU too (bf16 within the
    bf16 tolerance, fp32 tight)."""
    from attn_core.e2e import run_architecture

    run = run_architecture(name, prompts=3, dtype=dtype, shapes=shapes)
    assert run.ok, run.format()
    (group,) = run.plan["groups"]
    assert f"d{64 if shapes == 'kernel' else 16} " in group["spec"], run.format()
    if dtype == "float32":
        assert run.match.max_abs_diff < 1e-4, run.format()


def test_run_resolves_the_tower_names() -> None:
    from attn_core.e2e.main import resolve_models

    assert resolve_models("siglip, qwen2_vl") == ["siglip-vision", "qwen2-vl-vision"]
    assert resolve_models("siglip-vision,qwen2-vl") == ["siglip-vision", "qwen2-vl-vision"]


@pytest.mark.parametrize(
    ("name", "total"), [("qwen2-vl-vision", 32), ("qwen2.5-vl-vision", 32), ("siglip-vision", 27)]
)
def test_tower_first_layers_note_counts_the_towers_blocks(name: str, total: int) -> None:
    """``--layers 1`` of a Qwen-VL sample: the note counts the tower's blocks (its
    ``vision_config.depth``), not the language model's layers the config also holds."""
    from attn_core.e2e import run_architecture

    run = run_architecture(name, prompts=1, layers=1)
    assert run.ok, run.format()
    assert f"first 1 of {total} layers, at the config's real sizes" in run.notes, run.format()
