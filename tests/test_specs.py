"""LayerSpec / DeviceCapabilities / ExecutionConstraints: validation messages, value semantics."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from attn_core.specs import (
    DeviceCapabilities,
    DowngradePolicy,
    ExecutionConstraints,
    GraphMode,
    LayerKind,
    LayerSpec,
    LinearVariant,
    group_layers,
)

FULL = dict(kind="full", num_heads=8, num_kv_heads=2, head_dim=64)
MLA = dict(
    kind="mla",
    num_heads=16,
    num_kv_heads=1,
    head_dim=576,
    head_dim_v=512,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
)
GDN = dict(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    head_dim_v=64,
    conv_kernel_size=4,
    conv_channels=1024,
)


def _raises(match: str, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        LayerSpec(**kwargs)
    return str(info.value)


# ------------------------------------------------------------------------------------------
# LayerSpec validation: every message names the field, the value and what is allowed
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["num_heads", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("value", [-4, 0])
def test_non_positive_sizes_name_field_and_value(field, value):
    msg = _raises(re.escape(f"{field}={value}"), **{**FULL, field: value})
    assert "positive integer" in msg


def test_bool_is_not_a_head_count():
    _raises(r"num_kv_heads=True", **{**FULL, "num_kv_heads": True})


def test_q_heads_must_be_a_multiple_of_kv_heads():
    msg = _raises(r"num_heads=6", **{**FULL, "num_heads": 6, "num_kv_heads": 4})
    assert "multiple of num_kv_heads=4" in msg


def test_unknown_dtype_lists_allowed():
    msg = _raises(r"dtype='int8'", **{**FULL, "dtype": "int8"})
    assert "allowed" in msg
    for name in ("bfloat16", "float16", "float32"):
        assert name in msg


def test_unknown_kv_dtype_lists_fp8():
    msg = _raises(r"kv_dtype='int4'", **{**FULL, "kv_dtype": "int4"})
    assert "fp8_e4m3" in msg


def test_unknown_kind_lists_kinds():
    msg = _raises(r"kind='sparse'", **{**FULL, "kind": "sparse"})
    for kind in ("full", "mla", "linear", "encoder"):
        assert kind in msg


def test_state_dtype_float16_is_rejected():
    msg = _raises(r"state_dtype='float16'", **{**GDN, "state_dtype": "float16"})
    assert "float32" in msg and "bfloat16" in msg


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("sliding_window", 0, "positive integer"),
        ("attention_chunk_size", 0, "positive integer"),
        ("attention_chunk_size", 2.5, "positive integer"),
        ("logits_soft_cap", -1.0, "positive float"),
        ("softmax_scale", 0.0, "positive float"),
    ],
)
def test_optional_positive_fields(field, value, fragment):
    msg = _raises(re.escape(f"{field}={value!r}"), **{**FULL, field: value})
    assert fragment in msg


def test_mla_missing_rank_is_named():
    kwargs = {**MLA, "kv_lora_rank": None}
    _raises(r"kv_lora_rank=None", **kwargs)


def test_mla_needs_one_kv_head():
    msg = _raises(r"num_kv_heads=2", **{**MLA, "num_kv_heads": 2, "num_heads": 16})
    assert "must be 1" in msg


def test_mla_head_dim_is_rank_plus_rope():
    msg = _raises(r"head_dim=512 ", **{**MLA, "head_dim": 512})
    assert "576" in msg  # the value that would be right


def test_mla_head_dim_v_is_rank():
    msg = _raises(r"head_dim_v=128", **{**MLA, "head_dim_v": 128})
    assert "kv_lora_rank = 512" in msg


def test_mla_rejects_sliding_window():
    msg = _raises(r"sliding_window=128", **{**MLA, "sliding_window": 128})
    assert "does not apply to kind='mla'" in msg


def test_chunked_attention_is_for_full_and_encoder_layers_only():
    msg = _raises(r"attention_chunk_size=64", **{**MLA, "attention_chunk_size": 64})
    assert "does not apply to kind='mla'" in msg
    msg = _raises(r"attention_chunk_size=64", **{**GDN, "attention_chunk_size": 64})
    assert "does not apply to kind='linear'" in msg
    chunked = LayerSpec(**{**FULL, "attention_chunk_size": 64})
    assert chunked != LayerSpec(**FULL)  # a chunked layer never shares a group with a full one
    assert chunked.short() == "full 8q/2kv d64 bfloat16 page16 chunk=64"
    assert LayerSpec(**{**FULL, "kind": "encoder", "attention_chunk_size": 8}).attention_chunk_size


def test_linear_without_variant_lists_variants():
    kwargs = {**GDN, "linear_variant": None}
    msg = _raises(r"linear_variant=None", **kwargs)
    for v in ("gated_deltanet", "kda", "mamba2", "mamba1"):
        assert v in msg


def test_linear_needs_conv_fields():
    _raises(r"conv_kernel_size=None", **{**GDN, "conv_kernel_size": None})
    _raises(r"conv_channels=0", **{**GDN, "conv_channels": 0})


def test_linear_rejects_kv_dtype():
    msg = _raises(r"kv_dtype='fp8_e4m3'", **{**GDN, "kv_dtype": "fp8"})
    assert "no KV cache" in msg


def test_full_rejects_linear_fields():
    msg = _raises(r"linear_variant=", **{**FULL, "linear_variant": "kda"})
    assert "does not apply to kind='full'" in msg
    assert "leave it at None" in msg


def test_encoder_rejects_quantized_kv():
    msg = _raises(
        r"kv_dtype='fp8_e4m3'",
        kind="encoder",
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        kv_dtype="fp8_e4m3",
    )
    assert "encoder" in msg


# ------------------------------------------------------------------------------------------
# LayerSpec value semantics
# ------------------------------------------------------------------------------------------
def test_mla_and_conv_dims_are_typed_reads_of_their_kind():
    assert LayerSpec(**MLA).mla_dims == (512, 64, 128)
    assert LayerSpec(**GDN).conv_dims == (1024, 4)
    with pytest.raises(ValueError, match="not an MLA layer"):
        _ = LayerSpec(**FULL).mla_dims
    with pytest.raises(ValueError, match="not a linear layer"):
        _ = LayerSpec(**MLA).conv_dims


def test_spec_is_frozen():
    spec = LayerSpec(**FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_heads = 4  # type: ignore[misc]


def test_aliases_and_torch_dtypes_canonicalise_and_compare_equal():
    a = LayerSpec(**{**FULL, "dtype": "bf16"})
    b = LayerSpec(**{**FULL, "dtype": torch.bfloat16, "kv_dtype": "bfloat16"})
    c = LayerSpec(**{**FULL, "dtype": "bfloat16", "head_dim_v": 64})
    assert a.dtype == "bfloat16" and a.kv_dtype == "bfloat16" and a.head_dim_v == 64
    assert a == b == c
    assert len({a, b, c}) == 1
    assert hash(a) == hash(b)
    assert a.kind is LayerKind.FULL


def test_with_revalidates():
    spec = LayerSpec(**FULL)
    assert spec.with_(page_size=64).page_size == 64
    with pytest.raises(ValueError, match="page_size=0"):
        spec.with_(page_size=0)


def test_with_keeps_values_as_wide_as_keys():
    """A new head_dim moves an equal head_dim_v along (four plugin tests had built specs of
    64-wide keys over 128-wide values by accident); set, or already different, it stays."""
    spec = LayerSpec(**FULL)
    assert spec.head_dim == spec.head_dim_v
    assert spec.with_(head_dim=128).head_dim_v == 128
    assert spec.with_(head_dim=128, head_dim_v=32).head_dim_v == 32
    wide = spec.with_(head_dim_v=256)
    assert wide.with_(head_dim=128).head_dim_v == 256


def test_derived_quantities():
    full = LayerSpec(**FULL)
    assert math.isclose(full.scale, 1 / 8)
    assert full.kv_bytes_per_token == 2 * (64 + 64) * 2  # 2 kv heads, k + v, bf16
    fp8 = full.with_(kv_dtype="fp8")
    assert fp8.kv_dtype == "fp8_e4m3" and fp8.kv_bytes_per_token == 2 * 128
    mla = LayerSpec(**MLA)
    assert math.isclose(mla.scale, 1 / math.sqrt(192))
    assert mla.kv_bytes_per_token == 576 * 2
    gdn = LayerSpec(**GDN)
    assert gdn.linear_variant is LinearVariant.GATED_DELTANET
    assert gdn.ssm_state_shape == (8, 64, 64) and gdn.conv_state_shape == (1024, 3)
    assert gdn.state_bytes_per_request() == 8 * 64 * 64 * 4 + 1024 * 3 * 2
    assert gdn.kv_bytes_per_token == 0 and not gdn.has_kv_cache and gdn.has_recurrent_state
    mamba = LayerSpec(**{**GDN, "linear_variant": "mamba2", "num_kv_heads": 1})
    assert mamba.scale == 1.0


MAMBA1 = dict(
    kind="linear",
    linear_variant="mamba1",
    num_heads=8192,  # d_inner of Falcon-Mamba-7B: one head per inner channel
    num_kv_heads=1,
    head_dim=16,  # d_state
    head_dim_v=1,
    conv_kernel_size=4,
    conv_channels=8192,  # the conv runs over x only
)


def test_mamba1_state_is_hf_layout_and_sized_per_channel():
    spec = LayerSpec(**MAMBA1)
    assert spec.scale == 1.0
    # [d_inner, d_state, 1]: HF's [d_inner, d_state] cache with a one-wide value dim
    assert spec.ssm_state_shape == (8192, 16, 1) and spec.conv_state_shape == (8192, 3)
    assert spec.state_bytes_per_request() == 8192 * 16 * 4 + 8192 * 3 * 2
    assert spec.short() == "linear mamba1 8192q/1kv d16/1 bfloat16 state=float32"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"head_dim_v": 2}, "head_dim_v=2 is invalid: for mamba1 each head is one inner channel"),
        ({"num_kv_heads": 2}, "num_kv_heads=2 is invalid: mamba1 has one B / C per token"),
        ({"qk_l2norm": True}, "qk_l2norm=True is invalid: mamba1 never"),
    ],
)
def test_mamba1_refuses_groups_wide_values_and_l2norm(change: dict, match: str) -> None:
    _raises(match, **{**MAMBA1, **change})


def test_short_summary():
    spec = LayerSpec(**{**FULL, "sliding_window": 4096, "kv_dtype": "fp8"})
    assert spec.short() == "full 8q/2kv d64 bfloat16 kv=fp8_e4m3 page16 window=4096"


# ------------------------------------------------------------------------------------------
# group_layers
# ------------------------------------------------------------------------------------------
def test_group_layers_ids_indices_and_order():
    full = LayerSpec(**FULL)
    sliding = full.with_(sliding_window=128)
    gdn = LayerSpec(**GDN)
    specs = [gdn, gdn, gdn, full, sliding, gdn, full, sliding]
    groups = group_layers(specs)
    assert [g.group_id for g in groups] == ["linear", "full", "full.1"]
    assert [g.layer_indices for g in groups] == [(0, 1, 2, 5), (3, 6), (4, 7)]
    assert groups[2].spec == sliding
    prefixed = group_layers(specs, prefix="vision.")
    assert [g.group_id for g in prefixed] == ["vision.linear", "vision.full", "vision.full.1"]


def test_group_layers_equal_specs_from_aliases_share_a_group():
    a = LayerSpec(**{**FULL, "dtype": "bf16"})
    b = LayerSpec(**{**FULL, "dtype": "bfloat16"})
    assert len(group_layers([a, b])) == 1


def test_empty_group_is_rejected():
    from attn_core.specs import LayerGroup

    with pytest.raises(ValueError, match="layer_indices=\\(\\)"):
        LayerGroup("full", LayerSpec(**FULL), ())


# ------------------------------------------------------------------------------------------
# DeviceCapabilities
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "sm", "fp8"),
    [
        ("cpu", None, False),
        ("a100", 80, False),
        ("h100", 90, True),
        ("H200", 90, True),
        ("b200", 100, True),
    ],
)
def test_named_targets(name, sm, fp8):
    dev = DeviceCapabilities.target(name)
    assert dev.sm == sm
    assert dev.supports_fp8 is fp8
    assert dev.device_type == ("cpu" if name == "cpu" else "cuda")


def test_unknown_target_lists_allowed():
    with pytest.raises(ValueError, match="'mi300x' is unknown") as info:
        DeviceCapabilities.target("mi300x")
    for name in ("a100", "b200", "cpu", "h100", "h200"):
        assert name in str(info.value)


def test_device_validation():
    with pytest.raises(ValueError, match=r"device_type='tpu'.*'cuda', 'cpu'"):
        DeviceCapabilities(vendor="x", name="x", device_type="tpu")
    with pytest.raises(ValueError, match=r"compute_capability=\(9,\)"):
        DeviceCapabilities(vendor="x", name="x", device_type="cuda", compute_capability=(9,))
    with pytest.raises(ValueError, match="num_sms=-1"):
        DeviceCapabilities(vendor="x", name="x", device_type="cuda", num_sms=-1)
    with pytest.raises(ValueError, match="dtypes='int8'"):
        DeviceCapabilities(vendor="x", name="x", device_type="cpu", dtypes={"int8"})


def test_device_is_frozen_and_hashable():
    a = DeviceCapabilities(vendor="nvidia", name="x", device_type="cuda", compute_capability=[9, 0])
    b = DeviceCapabilities(vendor="nvidia", name="x", device_type="cuda", compute_capability=(9, 0))
    assert a == b and hash(a) == hash(b) and a.compute_capability == (9, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_sms = 1  # type: ignore[misc]


def test_detect_cpu():
    assert DeviceCapabilities.detect("cpu") == DeviceCapabilities.target("cpu")
    with pytest.raises(ValueError, match="device=meta"):
        DeviceCapabilities.detect("meta")


# ------------------------------------------------------------------------------------------
# ExecutionConstraints
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"graph_mode": "always"}, r"graph_mode='always'.*none.*decode.*full"),
        ({"downgrade": "maybe"}, r"downgrade='maybe'.*error.*warn.*allow"),
        ({"max_batch_size": 0}, r"max_batch_size=0.*positive"),
        ({"speculative_tokens": -1}, r"speculative_tokens=-1.*>= 0"),
        ({"page_size": 0}, r"page_size=0.*positive"),
        ({"kv_layout": "NDH"}, r"kv_layout='NDH'.*NHD, HND"),
        ({"kv_dtype": "int4"}, r"kv_dtype='int4'.*fp8_e4m3"),
        ({"spec_verify_strategy": "guess"}, r"spec_verify_strategy='guess'.*native, replay"),
        ({"force": "full"}, r"force='full'.*kind=backend"),
        ({"force": "full=a, full=b"}, r"force=.*'full' is given twice \('a' and 'b'\)"),
        ({"force": [("full", "b"), ("full", "a")]}, r"'full' is given twice \('b' and 'a'\)"),
        # the mapping forms were let through with an empty backend, which forced nothing
        ({"force": {"full": ""}}, r"force=.*'full' names no backend"),
        ({"force": {"decode:full": " "}}, r"force=.*'decode:full' names no backend"),
        ({"force": [("", "fa3")]}, r"force=.*an empty key"),
    ],
)
def test_constraint_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExecutionConstraints(**kwargs)


def test_constraint_parsing_and_hashing():
    a = ExecutionConstraints(
        force="linear=triton_ssm, full=vendor:flash",
        allow="a, b",
        graph_mode="decode",
        downgrade="error",
        kv_dtype="fp8",
    )
    b = ExecutionConstraints(
        force={"full": "vendor:flash", "linear": "triton_ssm"},
        allow={"b", "a"},
        graph_mode=GraphMode.DECODE,
        downgrade=DowngradePolicy.ERROR,
        kv_dtype="fp8_e4m3",
    )
    assert a.force == (("full", "vendor:flash"), ("linear", "triton_ssm"))
    assert a.forced == {"full": "vendor:flash", "linear": "triton_ssm"}
    assert a.allow == frozenset({"a", "b"})
    assert a == b and hash(a) == hash(b)
    assert a.with_(max_batch_size=8).max_batch_size == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.page_size = 16  # type: ignore[misc]
