"""Lightning attention and the gated short conv keep one of the two linear states each.

Lightning attention (MiniMax-01) has no conv: its slot holds the ``[H, Dk, Dv]`` SSM state and
nothing else. The short conv (LFM2) has no recurrent state: its slot holds the conv state
``[C, K - 1]`` and nothing else. The spec's byte accounting, the allocated pools and a whole
PersistentState agree, and an offloaded / restored slot round-trips.
"""

from __future__ import annotations

import pytest
import torch

from attn_core.specs import LayerSpec, LinearVariant, group_layers
from attn_core.state import PersistentState

C, K = 10, 3


def lightning(**kw) -> LayerSpec:
    return LayerSpec(
        kind="linear",
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        head_dim_v=6,
        linear_variant="lightning",
        dtype="float32",
        **kw,
    )


def short_conv(**kw) -> LayerSpec:
    return LayerSpec(
        kind="linear",
        num_heads=1,
        num_kv_heads=1,
        head_dim=C,
        linear_variant="short_conv",
        conv_kernel_size=K,
        conv_channels=C,
        dtype="bfloat16",
        **kw,
    )


def test_state_shapes_and_bytes() -> None:
    lt, sc = lightning(), short_conv()
    assert lt.linear_variant is LinearVariant.LIGHTNING
    assert (lt.has_conv, lt.has_ssm_state) == (False, True)
    assert lt.ssm_state_shape == (4, 8, 6) and lt.conv_state_shape == ()
    assert lt.state_bytes_per_request() == 4 * 8 * 6 * 4  # float32 state, no conv
    assert lt.scale == 1.0  # MiniMax reads q . S unscaled
    assert (sc.has_conv, sc.has_ssm_state) == (True, False)
    assert sc.ssm_state_shape == () and sc.conv_state_shape == (C, K - 1)
    assert sc.state_bytes_per_request() == C * (K - 1) * 2  # bf16 conv state only
    assert sc.head_dim_v == C
    with pytest.raises(ValueError, match="no conv"):
        _ = lt.conv_dims


@pytest.mark.parametrize(
    ("make", "change", "message"),
    [
        (lightning, {"conv_kernel_size": 4, "conv_channels": 8}, "lightning attention has no conv"),
        (lightning, {"num_kv_heads": 2}, "as many key heads as value heads"),
        (lightning, {"qk_l2norm": True}, "qk_l2norm"),
        (short_conv, {"num_heads": 2}, "short-conv layer has no heads"),
        (short_conv, {"head_dim": 4}, "short-conv layer has no heads"),
        (short_conv, {"state_dtype": "bfloat16"}, "state_dtype"),
    ],
)
def test_bad_specs_are_refused(make, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        make().with_(**change)


def test_short_conv_without_conv_is_refused() -> None:
    with pytest.raises(ValueError, match="conv_kernel_size"):
        LayerSpec(
            kind="linear", num_heads=1, num_kv_heads=1, head_dim=C, linear_variant="short_conv"
        )


def test_persistent_state_allocates_only_the_kept_state() -> None:
    specs = [lightning(), short_conv(), lightning()]
    state = PersistentState(group_layers(specs), num_pages=0, num_slots=3)
    slots = state.state_slots
    lt0, sc, lt2 = (slots.layer(i) for i in range(3))
    assert tuple(lt0.ssm.shape) == (3, 4, 8, 6) and lt0.conv.numel() == 0
    assert tuple(sc.conv.shape) == (3, C, K - 1) and sc.ssm.numel() == 0
    assert sc.conv.dtype == torch.bfloat16
    per_slot = 2 * (4 * 8 * 6 * 4) + C * (K - 1) * 2
    assert slots.slot_bytes == per_slot
    assert slots.nbytes == 3 * per_slot  # nothing allocated beyond what the specs count
    # slot copies and resets run over every layer, the empty pools included
    lt2.ssm[1].fill_(2.0)
    sc.conv[1].fill_(3.0)
    slots.copy_slot(1, 2)
    assert bool((lt2.ssm[2] == 2.0).all()) and bool((sc.conv[2] == 3.0).all())
    slots.zero_slot(2)
    assert not lt2.ssm[2].any() and not sc.conv[2].any()


def test_offload_restore_and_export_import_round_trip_the_kept_state() -> None:
    """The empty pools travel as zero bytes; the kept state comes back bit for bit (in a
    hybrid with a full-attention layer, as MiniMax and LFM2 have)."""
    full = LayerSpec(
        kind="full", num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32"
    )
    specs = [lightning(), short_conv(), full]
    state = PersistentState(group_layers(specs), num_pages=8, num_slots=3)
    state.add_request("r")
    slot = state.slot("r")
    gen = torch.Generator().manual_seed(0)
    lt, sc = state.state_slots.layer(0), state.state_slots.layer(1)
    lt.ssm[slot] = torch.randn(lt.ssm[slot].shape, generator=gen)
    sc.conv[slot] = torch.randn(sc.conv[slot].shape, generator=gen).to(sc.conv.dtype)
    want = (lt.ssm[slot].clone(), sc.conv[slot].clone())
    export = state.export_request("r")
    assert export.meta.nbytes >= lightning().state_bytes_per_request() + C * (K - 1) * 2
    moved = state.offload("r")
    assert moved == export.meta.nbytes
    state.restore("r")
    slot = state.slot("r")
    assert torch.equal(lt.ssm[slot], want[0]) and torch.equal(sc.conv[slot], want[1])
    state.import_request("copy", export)
    other = state.slot("copy")
    assert torch.equal(lt.ssm[other], want[0]) and torch.equal(sc.conv[other], want[1])
