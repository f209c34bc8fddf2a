"""``attn run`` drives every dense family of the generic mapping through the layer-forward adapter.

Each transformers decoder layer runs its own forward (post-norms, fused qkv, partial rotary,
residual and embedding multipliers stay transformers' code) with the attention op hooked, so a
dense family that uses the common config names needs no adapter code: the named ones (Ministral,
Starcoder2, OLMo-2, Phi-3, Granite) and model types no family names (Arcee, GLM-4, Helium,
ERNIE-4.5, OLMo-3) all run at tiny sizes with random weights and match transformers' eager
forward on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attn_core.e2e.main import _driven_model_types
from attn_core.models import MODEL_TYPE_FAMILIES

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
        ("Olmo2Config", {}, ""),  # post-norm layers, q/k norms over the whole projection
        ("Phi3Config", {"partial_rotary_factor": 0.5}, ""),  # fused qkv_proj, partial rope
        (
            "GraniteConfig",  # embedding / residual / logits multipliers, attention_multiplier
            {
                "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5,
                "logits_scaling": 3.0,
                "attention_multiplier": 0.2,
            },
            "",
        ),
        ("Olmo3Config", {"head_dim": 16, "sliding_window": 4}, "window=4"),
        ("ArceeConfig", {"head_dim": 16}, ""),
        ("Glm4Config", {"head_dim": 16}, ""),
        ("HeliumConfig", {"head_dim": 16}, ""),
        ("Ernie4_5Config", {"head_dim": 16}, ""),
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


def test_every_named_dense_type_is_driven() -> None:
    dense = {t for t, f in MODEL_TYPE_FAMILIES.items() if f == "dense"}
    assert {"granite", "ministral", "olmo2", "phi3", "starcoder2"} <= dense
    assert dense <= set(_driven_model_types())
