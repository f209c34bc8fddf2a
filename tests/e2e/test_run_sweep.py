"""Configs of issue 22's sweep over transformers' model types through ``attn run`` on CPU.

Each case is what the sweep built (a config class's own defaults, sizes shrunk through config
attributes) that crashed, mismatched or was refused unclearly. A config transformers itself can
build and run matches transformers' eager forward; one whose transformers forward fails is
refused before any step, naming the layer, its attn-core group, the module, what the code
expected and what the config gave (not a traceback from deep inside a step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attn_core.models import specs_from_hf_config

transformers = pytest.importorskip("transformers")

# MLA sizes of a tiny model: 4 query heads of nope 16 + rope 8, a 32-wide latent
_MLA: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _config(model_type: str, **fields: Any) -> dict[str, Any]:
    """``model_type``'s config class built from ``fields`` (the rest its defaults), as a dict."""
    return transformers.CONFIG_MAPPING[model_type](**fields).to_dict()


# -- 3. GLM-4.7-Flash (glm4_moe_lite): head_dim is an alias of qk_rope_head_dim ----------------


@pytest.mark.parametrize(
    ("head_dim", "rope"),
    [(16, 64), (64, 16)],
    ids=["alias-narrower", "alias-wider"],
)
def test_glm4_moe_lite_head_dim_alias_wins_as_in_transformers(
    tmp_path: Path, head_dim: int, rope: int, run_on_cpu
) -> None:
    """Glm4MoeLiteConfig's attribute_map names ``head_dim`` for ``qk_rope_head_dim``; a
    config.json with both sets the field from the alias last, so transformers ropes (and
    scales by) ``qk_nope_head_dim + head_dim``. The mapping read ``qk_rope_head_dim`` instead:
    scale 1/sqrt(192 + 64) = 0.0625 against transformers' 1/sqrt(192 + 16) = 0.0693 (and the
    other way round), refused by the adapter's scale check."""
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteAttention

    cls = transformers.CONFIG_MAPPING["glm4_moe_lite"]
    cfg = _config(
        "glm4_moe_lite",
        **{k: v for k, v in _MLA.items() if k not in ("qk_rope_head_dim", "qk_nope_head_dim")},
        qk_nope_head_dim=192,
        qk_rope_head_dim=rope,
    )
    cfg["head_dim"] = head_dim  # the alias, as a hub config.json may carry both
    module = Glm4MoeLiteAttention(cls.from_dict(cfg), 0)
    assert module.scaling == pytest.approx((192 + head_dim) ** -0.5)
    spec = specs_from_hf_config(cfg).layer_specs[0]
    assert spec.scale == pytest.approx(module.scaling, rel=1e-6)
    assert spec.mla_dims[1] == head_dim
    report = run_on_cpu(_write(tmp_path, cfg))
    text = report.format()
    assert report.ok, text
    assert f"mla 4q/1kv d{32 + head_dim}/32" in text and "MATCH" in text, text
