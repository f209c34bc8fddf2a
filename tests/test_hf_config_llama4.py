"""Llama-4 text: chunked (local) and global NoPE layers, from transformers' own config classes.

Each layer's chunk size is checked against what transformers' modeling code decides for that
layer (``Llama4TextModel`` builds a chunked mask for ``layer_types[i] == "chunked_attention"``,
``Llama4TextAttention.use_rope`` is ``no_rope_layers[i]``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attn_core.models import specs_from_hf_config
from attn_core.specs import LayerKind
from attn_core.testing.hf import transformers_before

transformers = pytest.importorskip("transformers")


def _text(**kwargs: Any) -> Any:
    base = dict(
        num_hidden_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=16,
    )
    return transformers.Llama4TextConfig(**{**base, **kwargs})


def _chunks(layout: Any) -> list[int | None]:
    return [layout.spec_of(i).attention_chunk_size for i in range(layout.num_layers)]


def test_default_pattern_is_transformers_chunked_rope_layers_and_global_nope_layers() -> None:
    cfg = _text()
    layout = specs_from_hf_config(cfg.to_dict())
    want = [16 if t == "chunked_attention" else None for t in cfg.layer_types]
    assert _chunks(layout) == want == [16, 16, 16, None, 16, 16, 16, None]
    # the global layers are transformers' NoPE layers (use_rope = no_rope_layers[i] == 0)
    assert [c is None for c in want] == [not r for r in cfg.no_rope_layers]
    assert layout.family == "llama-4" and layout.architecture == "Llama4ForCausalLM"
    assert [g.group_id for g in layout.groups] == ["full", "full.1"]
    spec = layout.spec_of(0)
    assert spec.scale == 16**-0.5  # the softmax scale is head_dim ** -0.5 on every layer


def test_without_layer_types_the_pattern_is_derived_as_transformers_does() -> None:
    cfg = _text(no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 1]).to_dict()
    expected = [16 if t == "chunked_attention" else None for t in cfg["layer_types"]]
    del cfg["layer_types"]  # hub configs of the released models have none
    assert _chunks(specs_from_hf_config(cfg)) == expected == [16, None, 16, 16, None, 16, 16, 16]
    cfg["no_rope_layers"] = []  # empty: every no_rope_layer_interval-th layer is NoPE
    cfg["no_rope_layer_interval"] = 2
    assert _chunks(specs_from_hf_config(cfg)) == [16, None] * 4


def test_explicit_layer_types_win_and_no_chunk_size_means_every_layer_full() -> None:
    types = ["full_attention", "chunked_attention"] * 4
    assert _chunks(specs_from_hf_config(_text(layer_types=types).to_dict())) == [None, 16] * 4
    cfg = _text(attention_chunk_size=None).to_dict()
    if transformers_before("5.24.0"):
        # the class still marks its rope layers chunked_attention without a chunk size, which
        # its model cannot run (create_chunked_causal_mask raises): refused, naming the layers;
        # without them (as 5.24 writes the config) every layer is full
        with pytest.raises(ValueError, match=r"layer_types has chunked_attention in layers 0-2,"):
            specs_from_hf_config(cfg)
        del cfg["layer_types"]
    else:
        assert set(cfg["layer_types"]) == {"full_attention"}
    layout = specs_from_hf_config(cfg)
    assert _chunks(layout) == [None] * 8 and len(layout.groups) == 1


def test_multimodal_llama4_reads_its_text_config() -> None:
    text = _text()
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1)
    cfg = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    whole = specs_from_hf_config(cfg.to_dict())
    assert whole.stack_names == ("vision", "text")
    layout = whole.stack_layout("text")
    assert layout.model_type == "llama4" and layout.family == "llama-4"
    assert _chunks(layout) == _chunks(specs_from_hf_config(text.to_dict()))
    assert [g.group_id for g in layout.groups] == ["text.full", "text.full.1"]
    # the tower: Llama4VisionAttention's heads and scale, no mask in its eager function
    from transformers.models.llama4.modeling_llama4 import Llama4VisionAttention

    with torch.device("meta"):
        attn = Llama4VisionAttention(cfg.vision_config)
    tower = whole.stack_layout("vision")
    assert [g.group_id for g in tower.groups] == ["vision.encoder"]
    assert tower.num_layers == cfg.vision_config.num_hidden_layers
    spec = tower.spec_of(0)
    assert spec.kind is LayerKind.ENCODER and not spec.causal
    assert (spec.num_heads, spec.head_dim) == (attn.num_heads, attn.head_dim)
    assert spec.scale == pytest.approx(attn.scaling)


def test_llama4_vision_defaults_table_matches_transformers() -> None:
    from attn_core.models.hf_config import _LLAMA4_VISION_DEFAULTS

    cfg = transformers.Llama4VisionConfig()
    assert {k: getattr(cfg, k) for k in _LLAMA4_VISION_DEFAULTS} == _LLAMA4_VISION_DEFAULTS


def test_tensor_parallel_heads_and_a_bad_pattern_are_named() -> None:
    layout = specs_from_hf_config(_text().to_dict(), tp_size=2)
    assert (layout.spec_of(0).num_heads, layout.spec_of(0).num_kv_heads) == (2, 1)
    bad = {**_text().to_dict(), "layer_types": ["sliding_attention"] * 8}
    with pytest.raises(ValueError, match="'sliding_attention' in layers 0-7"):
        specs_from_hf_config(bad)
    bad = {**_text().to_dict(), "no_rope_layers": [1, 2] * 4}
    del bad["layer_types"]
    with pytest.raises(ValueError, match="no_rope_layers="):
        specs_from_hf_config(bad)


def test_explain_puts_the_chunked_group_on_gpu_plugins_through_virtual_batches(
    monkeypatch, capsys
) -> None:
    """``attn explain llama-4 --target h200``: FlashInfer and fa3 serve the chunked group through
    local virtual batches (FlashInfer chosen, fa3 admissible), and the text says so under the
    group; at a page size that does not divide the chunk both fall back to the reference with
    the reason. The global NoPE group keeps a GPU plugin."""
    import json

    from attn_core import cli, selector

    monkeypatch.setattr(selector, "_local_cuda_devices", lambda: [])  # the same on any machine
    assert cli.main(["explain", "llama-4", "--target", "h200", "--json"]) == 0
    groups = {g["group_id"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    chunked, full = groups["full"], groups["full.1"]
    assert "chunk=8192" in chunked["spec"] and "chunk" not in full["spec"]
    assert chunked["backend"] == "flashinfer:flashinfer"
    assert "fa3:fa3" in chunked["outranked"]
    assert not {r["backend"] for r in chunked["rejected"]} & {"fa3:fa3", "flashinfer:flashinfer"}
    assert full["backend"] != "attn_core:reference"
    assert cli.main(["explain", "llama-4", "--target", "h200"]) == 0
    text = capsys.readouterr().out
    assert (
        "chunked attention (chunks of 8192 tokens): served by attn_core:reference (native "
        "chunk mask), fa3:fa3 (local virtual batches), flashinfer:flashinfer (local virtual "
        "batches)"
    ) in text
    assert cli.main(["explain", "llama-4", "--target", "h200", "--page-size", "24", "--json"]) == 0
    groups = {g["group_id"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    chunked = groups["full"]
    assert chunked["backend"] == "attn_core:reference"
    (rej,) = [r for r in chunked["rejected"] if r["backend"] == "flashinfer:flashinfer"]
    assert rej["code"] == "page_size" and "chunks of 8192 tokens, page size 24" in rej["reason"]
