"""``attn run`` drives dense families of the generic mapping through the generic adapter.

Ministral (sliding and full layers from its layer_types) and Starcoder2 (LayerNorm, biases,
sliding on every layer) run at tiny sizes with random weights and match transformers' eager
forward on CPU. The dense families whose modules the adapter cannot drive (OLMo-2's post-norm
layers, Phi-3's fused qkv, Granite's multipliers) stay refused by run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attn_core.e2e.main import _driven_model_types, resolve_models

transformers = pytest.importorskip("transformers")

_SMALL: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _write(tmp_path: Path, cls_name: str, **extra: Any) -> Path:
    cfg = getattr(transformers, cls_name)(**{**_SMALL, **extra})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


@pytest.mark.parametrize(
    ("cls_name", "extra", "windows"),
    [
        (
            "MinistralConfig",
            {
                "head_dim": 16,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "window=4",
        ),
        ("Starcoder2Config", {"sliding_window": 4}, "window=4"),
    ],
)
def test_run_dense_family_matches_transformers(
    tmp_path: Path, cls_name: str, extra: dict[str, Any], windows: str, run_on_cpu
) -> None:
    path = _write(tmp_path, cls_name, **extra)
    report = run_on_cpu(str(path))
    text = report.format()
    assert report.ok, text
    assert windows in text and "MATCH" in text, text


@pytest.mark.parametrize("cls_name", ["Olmo2Config", "Phi3Config", "GraniteConfig"])
def test_run_refuses_dense_families_it_does_not_drive(tmp_path: Path, cls_name: str) -> None:
    path = _write(tmp_path, cls_name)
    with pytest.raises(ValueError, match="no adapter for it yet"):
        resolve_models(str(path))


def test_driven_dense_types() -> None:
    driven = set(_driven_model_types())
    assert {"ministral", "starcoder2"} <= driven
    assert not {"olmo2", "phi3", "granite"} & driven
