"""``attn run --model CHECKPOINT_DIR`` and the warm-up pass (issue 22, item 6).

A folder written by ``save_pretrained`` (config.json and safetensors) is loaded with its
weights instead of random init, and the run matches transformers' forward of that model. On
request (default: CUDA only) a warm-up generation runs first and its time, JIT compile and
graph capture, is reported on its own line, not inside the throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attn_core.e2e import build_tiny, run_architecture
from attn_core.e2e.configs import tiny_config

pytest.importorskip("transformers")


def _save_checkpoint(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """A tiny model of sample ``name`` with weights no seed-0 init gives, saved to ``folder``."""
    model = build_tiny(name, seed=7).hf
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    model.save_pretrained(folder)
    assert any(folder.glob("*.safetensors"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _run_saved_multimodal(model: torch.nn.Module, folder: Path, run_on_cpu) -> None:
    """Save a multimodal ``model`` (its LM head scaled for decisive greedy tokens) to
    ``folder`` and run the folder: its language model runs with the saved weights and matches;
    the tower is not run, and the report says so."""
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    report = run_on_cpu(str(folder))
    assert report.ok, report.format()
    (run,) = report.runs
    assert run.name == f"{folder} [text]" and run.weights == str(folder)
    assert "stack vision is not run: weights load for language models only" in run.notes


@pytest.mark.parametrize("name", ["qwen3", "nemotron-h", "kimi-linear", "falcon-h1"])
def test_checkpoint_folder_loads_its_weights(name: str, tmp_path: Path, run_on_cpu) -> None:
    saved = _save_checkpoint(name, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    loaded = build_tiny(name, config=cfg, checkpoint=str(tmp_path)).hf.state_dict()
    assert saved.keys() == loaded.keys()
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]), k
    random = build_tiny(name, config=cfg).hf.state_dict()
    assert not all(torch.equal(v, random[k]) for k, v in saved.items())

    report = run_on_cpu(str(tmp_path))
    assert report.ok, report.format()
    assert f"weights: {tmp_path}" in report.format()
    assert report.runs[0].weights == str(tmp_path)


def test_config_folder_without_weights_is_random_init(tmp_path: Path) -> None:
    from attn_core.e2e.main import _resolve

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3")))
    (given,) = _resolve(str(tmp_path))
    assert given.checkpoint is None


def test_warmup_is_reported_apart_from_the_throughput() -> None:
    run = run_architecture("qwen3", prompts=2, max_new_tokens=3, warmup=True)
    assert run.ok, run.format()  # the timed pass after the warm-up still matches
    assert run.warmup_seconds is not None and run.warmup_seconds > 0
    text = run.format()
    assert "warm-up pass (JIT compile, CUDA-graph capture; not in the figures above)" in text
    cold = run_architecture("qwen3", prompts=2, max_new_tokens=3)  # CPU default: none
    assert cold.warmup_seconds is None and "no warm-up pass" in cold.format()


def test_cli_warmup_flag() -> None:
    from attn_core.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["run"]).warmup is None
    assert parser.parse_args(["run", "--warmup"]).warmup is True
    assert parser.parse_args(["run", "--no-warmup"]).warmup is False


def test_checkpoint_first_layers_load_those_layers_weights(tmp_path: Path) -> None:
    saved = _save_checkpoint("qwen3", tmp_path)  # 2 layers
    cfg = json.loads((tmp_path / "config.json").read_text())
    run = run_architecture(
        "qwen3", config=cfg, checkpoint=str(tmp_path), layers=1, prompts=2, max_new_tokens=3
    )
    assert run.ok, run.format()
    assert "note: first 1 of 2 layers" in run.format()
    from attn_core.e2e.configs import first_layers

    loaded = build_tiny(
        "qwen3", config=first_layers(cfg, 1), checkpoint=str(tmp_path)
    ).hf.state_dict()
    assert not any(k.startswith("model.layers.1.") for k in loaded)
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k


def test_a_qwen2_vl_checkpoint_loads_its_language_model(tmp_path: Path, run_on_cpu) -> None:
    """A saved Qwen2VLForConditionalGeneration: its language model runs with the folder's
    weights; the tower is not run (weights load for language models only), and the report says
    so."""
    import transformers

    cfg = transformers.Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
    )
    torch.manual_seed(7)
    model = transformers.Qwen2VLForConditionalGeneration(cfg)
    _run_saved_multimodal(model, tmp_path, run_on_cpu)


@pytest.mark.parametrize(
    ("cls", "family", "text"),
    [
        ("Qwen3VLConfig", "qwen3-vl-text", {}),
        (
            "Qwen3_5Config",
            "qwen3.5",
            dict(
                layer_types=["linear_attention", "full_attention"],
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
            ),
        ),
    ],
)
def test_a_qwen3_vl_or_qwen3_5_checkpoint_loads_its_language_model(
    tmp_path: Path, cls: str, family: str, text: dict, run_on_cpu
) -> None:
    """A saved Qwen3VLForConditionalGeneration / Qwen3_5ForConditionalGeneration: its language
    model runs with the folder's weights (every saved tensor of it loaded as saved), the tower
    is not run and the report says so."""
    import transformers

    cfg = getattr(transformers, cls)(
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64),
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
            **text,
        ),
    )
    torch.manual_seed(7)
    model = getattr(transformers, cls.replace("Config", "ForConditionalGeneration"))(cfg)
    _run_saved_multimodal(model, tmp_path, run_on_cpu)
    whole = json.loads((tmp_path / "config.json").read_text())
    loaded = build_tiny(family, config=whole, checkpoint=str(tmp_path)).hf.state_dict()
    saved = model.state_dict()
    assert loaded.keys() == saved.keys()
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k


def test_a_checkpoint_too_large_for_the_device_is_refused_before_it_loads(
    tmp_path: Path, run_on_cpu, monkeypatch
) -> None:
    """The checkpoint's model, sized on the meta device in the run's dtype (its weights load
    in it), against the device's free memory: refused before ``from_pretrained`` reads a byte."""
    import transformers

    import attn_core.e2e.configs as configs

    _save_checkpoint("qwen3", tmp_path)

    def must_not_load(*args, **kwargs):
        raise AssertionError("from_pretrained ran")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", must_not_load)
    monkeypatch.setattr(configs, "available_memory", lambda device: 1024)  # 1 KiB free
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM \(qwen3\) at its config's sizes holds "
                       r".* GiB in float32; cpu has 0\.0 GiB free"):  # fmt: skip
        run_on_cpu(str(tmp_path))
