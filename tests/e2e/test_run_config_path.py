"""``attn run --model CONFIG.json|FOLDER``: the inputs ``attn explain`` takes (issue 22, item 6).

A config.json of any model type ``attn explain`` maps runs at the config's own sizes (random
weights) and is compared with transformers; a config no mapping reads is refused with the
mapping's own error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_core.e2e.configs import tiny_config
from attn_core.e2e.main import _driven_model_types, resolve_models

pytest.importorskip("transformers")


def test_run_config_json_and_folder(tmp_path: Path, run_on_cpu) -> None:
    cfg = tiny_config("qwen3")
    cfg["rope_theta"] = 5000.0  # the config's own fields are what runs, not the sample's
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for model in (str(tmp_path / "config.json"), str(tmp_path)):
        report = run_on_cpu(model)
        assert report.ok, report.format()
        (run,) = report.runs
        assert run.name == str(Path(model))
        assert "Qwen3ForCausalLM" in report.format()


def test_run_drives_every_model_type_explain_maps() -> None:
    """Every mapped model type but the remote-code-only MiniMax forms, which transformers has
    no class for (``attn run`` refuses them, naming transformers' own form)."""
    from attn_core.e2e.main import _HUB_ONLY
    from attn_core.models import SUPPORTED_MODEL_TYPES

    assert sorted(_driven_model_types()) == sorted(set(SUPPORTED_MODEL_TYPES) - set(_HUB_ONLY))


def test_run_drives_every_sample() -> None:
    """Every sample; a whole Qwen-VL sample runs as its tower (the report says so), the whole
    Whisper sample only with --stack encoder (its decoder is refused)."""
    from attn_core.e2e.main import _ALIASES
    from attn_core.models import sample_names

    names = [n for n in sample_names() if n != "whisper"]
    want = list(dict.fromkeys(_ALIASES.get(n, n) for n in names))
    assert resolve_models(",".join(names)) == want
    assert "qwen2.5-vl-vision" in want and "qwen2.5-vl" not in want
    with pytest.raises(ValueError, match=r"whisper: cross-attention in decoder layers 0-31"):
        resolve_models("whisper")
    assert resolve_models("whisper", stack="encoder") == ["whisper-encoder"]


def test_run_config_error_is_the_mapping_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    config = {"model_type": "falcon_h1", "num_hidden_layers": 2, "time_step_limit": [0.0, 1.0]}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"time_step_limit=\[0.0, 1.0\] in the Mamba2 ops"):
        resolve_models(str(path))


@pytest.mark.parametrize(
    ("cls_name", "extra"),
    [
        ("LlamaConfig", {}),
        ("MistralConfig", {"sliding_window": 6}),
        ("Qwen2Config", {}),
        ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_run_configs_of_the_driven_model_types(
    tmp_path: Path, cls_name: str, extra: dict[str, object], run_on_cpu
) -> None:
    import transformers

    cfg = getattr(transformers, cls_name)(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        **extra,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()


def test_readme_names_what_run_drives_and_explain_maps() -> None:
    from attn_core.models import SUPPORTED_MODEL_TYPES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    start = readme.index("`attn explain` also takes the path")
    para = readme[start : readme.index("\n\n", start)]
    explain, run = para.split("`attn run --model`")
    named = sorted(t for t in SUPPORTED_MODEL_TYPES if f"`{t}`" in explain)
    assert named == sorted(SUPPORTED_MODEL_TYPES)
    assert "every model type above" in run and "and the samples" not in run
    from attn_core.e2e.main import _HUB_ONLY

    assert all(f"`{t}`" in run for t in _HUB_ONLY)  # the exceptions are named
    assert sorted(_driven_model_types()) == sorted(set(SUPPORTED_MODEL_TYPES) - set(_HUB_ONLY))


@pytest.mark.parametrize(
    ("cls_name", "fields"),
    [
        # plain Mamba (no B / C / dt norms) goes through the Falcon-Mamba adapter
        ("MambaConfig", dict(num_hidden_layers=2, hidden_size=64, state_size=8)),
        ("FalconMambaConfig", dict(num_hidden_layers=2, hidden_size=64, state_size=8)),
        (
            "JambaConfig",
            dict(
                num_hidden_layers=2,
                attn_layer_period=2,
                attn_layer_offset=1,
                num_experts=2,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                mamba_d_state=8,
            ),
        ),
    ],
)
def test_run_configs_of_the_mamba1_model_types(
    tmp_path: Path, cls_name: str, fields: dict[str, object], run_on_cpu
) -> None:
    import transformers

    cfg = getattr(transformers, cls_name)(
        vocab_size=256, initializer_range=0.1, tie_word_embeddings=False, **fields
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    report = run_on_cpu(str(path))
    assert report.ok, report.format()
    assert "linear mamba1" in report.format()
