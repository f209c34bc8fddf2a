"""Whisper's encoder through ``attn run`` (issue 22): every layer's attention through an encoder
binding, every block's hidden states and the final layer norm's output compared with
transformers' WhisperEncoder in fp32 on the CPU; the decoder (cross-attention) is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")


def _whisper(tmp_path: Path) -> Path:
    """A tiny config written by transformers' WhisperConfig (its common-name aliases too)."""
    cfg = transformers.WhisperConfig(
        encoder_layers=2,
        encoder_attention_heads=4,
        d_model=64,  # 4 heads of 16
        encoder_ffn_dim=96,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=96,
        num_mel_bins=8,
        max_source_positions=12,  # 24 mel frames per clip
        init_std=0.1,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def test_whisper_config_without_a_stack_is_refused_naming_the_decoder(
    tmp_path: Path, run_on_cpu
) -> None:
    path = _whisper(tmp_path)
    with pytest.raises(ValueError, match=r"whisper: cross-attention in decoder layers 0-1"):
        run_on_cpu(str(path))
    with pytest.raises(ValueError, match=r"--stack encoder"):
        specs_from_hf_config(str(path))


def test_whisper_encoder_config_matches_transformers_fp32_cpu(tmp_path: Path) -> None:
    from attn_core.e2e import run_main

    path = _whisper(tmp_path)
    report = run_main(
        str(path),
        device="cpu",
        dtype="fp32",
        prompts=3,
        max_new_tokens=1,
        graphs=False,
        registry=None,
        constraints=None,
        progress=False,
        stack="encoder",
    )
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.name == f"{path} [encoder]"
    assert run.steps == 2 and run.mode_counts == {"encoder": 2}
    assert run.tokens == 3 * 12  # three clips of max_source_positions frames
    assert [g["group_id"] for g in run.plan["groups"]] == ["encoder.encoder"]
    assert run.match.max_abs_diff < 1e-4, run.format()
    assert any(
        "stack decoder (unmapped) is not run here: whisper: cross-attention" in n for n in run.notes
    )


def test_whisper_sample_names_its_stacks_in_the_report(run_on_cpu) -> None:
    report = run_on_cpu("whisper-encoder")
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.notes[0] == "runs stack encoder of whisper (stacks encoder, decoder)"
    assert "cross-attention in decoder layers 0-31: no layer kind" in run.notes[1]
    # the sample's whole name with --stack encoder is the same run
    from attn_core.e2e.main import resolve_models

    assert resolve_models("whisper", stack="encoder") == ["whisper-encoder"]
    with pytest.raises(ValueError, match=r"drives no stack 'decoder'"):
        resolve_models("whisper", stack="decoder")


@pytest.mark.parametrize(("dtype", "shapes"), [("float32", "kernel"), ("bfloat16", "tiny")])
def test_whisper_encoder_sample_kernel_shapes_and_bf16_cpu(dtype: str, shapes: str) -> None:
    from attn_core.e2e import run_architecture

    run = run_architecture("whisper-encoder", prompts=2, dtype=dtype, shapes=shapes)
    assert run.ok, run.format()
    (group,) = run.plan["groups"]
    assert f"d{64 if shapes == 'kernel' else 16} " in group["spec"], run.format()


def test_whisper_comparison_detects_a_causal_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder with causal attention in attn-core: the block outputs must differ."""
    from attn_core.e2e import main as main_mod
    from attn_core.e2e.main import run_architecture

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
    run = run_architecture("whisper-encoder", prompts=2)
    assert not run.ok
    assert run.match.max_abs_diff > 1e-2


def test_whisper_first_layers_cut_the_encoder() -> None:
    """``--layers N`` of Whisper: the encoder's layers (and their alias) are cut."""
    from attn_core.e2e.configs import first_layers
    from attn_core.models import load_sample

    cut = first_layers(load_sample("whisper-encoder"), 2)
    assert (cut["encoder_layers"], cut["num_hidden_layers"]) == (2, 2)
    assert specs_from_hf_config(cut, stack="encoder").num_layers == 2
    with pytest.raises(
        ValueError, match=r"layers=33: expected 1..32 \(the config's encoder_layers\)"
    ):
        first_layers(load_sample("whisper-encoder"), 33)
