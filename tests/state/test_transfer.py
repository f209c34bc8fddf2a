"""Offload / restore and export / import: bitwise round trips, layout checks, failures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core.specs import LayerGroup, LayerSpec, group_layers
from attn_core.state import OutOfPagesError, PersistentState, RequestExport

PS = 4
CUDA = torch.cuda.is_available()


def model(kv_dtype: str = "bfloat16", state_dtype: str = "float32", page_size: int = PS, hd=8):
    full = LayerSpec(
        kind="full",
        num_heads=4,
        num_kv_heads=2,
        head_dim=hd,
        head_dim_v=6,
        page_size=page_size,
        kv_dtype=kv_dtype,
    )
    mla = LayerSpec(
        kind="mla",
        num_heads=2,
        num_kv_heads=1,
        head_dim=10,
        head_dim_v=8,
        kv_lora_rank=8,
        qk_rope_head_dim=2,
        qk_nope_head_dim=4,
        page_size=page_size,
        kv_dtype=kv_dtype,
    )
    lin = LayerSpec(
        kind="linear",
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        head_dim_v=3,
        linear_variant="kda",
        conv_kernel_size=3,
        conv_channels=5,
        state_dtype=state_dtype,
    )
    enc = LayerSpec(kind="encoder", num_heads=2, num_kv_heads=2, head_dim=8, causal=False)
    return group_layers([lin, full, mla, lin, enc])  # layers 0,3 linear; 1 full; 2 mla


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(t.shape[0] * t.shape[1], -1)


def fill(s: PersistentState, rid, n: int, seed: int) -> None:
    """A request with n tokens of random KV and random state (any bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    s.add_request(rid)
    s.ensure_capacity(rid, n)
    rows = torch.tensor(s.slot_mapping(rid, 0, n), dtype=torch.long, device=s.device)
    for layer in s.kv_cache.layers():
        for t in layer.tensors().values():
            r = _rows(t)
            r[rows] = torch.randint(0, 256, (n, r.shape[1]), generator=g, dtype=torch.uint8).to(
                s.device
            )
    for layer in s.state_slots.layers():
        for t in layer.tensors().values():
            t[s.slot(rid)] = torch.randn(t.shape[1:], generator=g).to(t.dtype).to(s.device)
    s.advance(rid, n)


def read(s: PersistentState, rid) -> list[torch.Tensor]:
    rows = torch.tensor(
        s.slot_mapping(rid, 0, s.num_tokens(rid)), dtype=torch.long, device=s.device
    )
    out = [_rows(t)[rows].cpu() for la in s.kv_cache.layers() for t in la.tensors().values()]
    for la in s.state_slots.layers():
        for t in la.tensors().values():
            out.append(t[s.slot(rid)].reshape(-1).view(torch.uint8).cpu().clone())
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


DTYPES = [
    ("bfloat16", "float32"),
    ("fp8_e4m3", "float32"),
    ("bfloat16", "bfloat16"),
    ("fp8_e4m3", "bfloat16"),
]


def _devices():
    return [
        pytest.param("cpu"),
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")],
        ),
    ]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(("kv_dtype", "state_dtype"), DTYPES)
def test_offload_restore_is_bitwise(device, kv_dtype, state_dtype) -> None:
    s = PersistentState(model(kv_dtype, state_dtype), num_pages=8, num_slots=3, device=device)
    fill(s, "a", 7, seed=1)
    fill(s, "b", 9, seed=2)
    s.ensure_capacity("a", 12)  # capacity beyond the written tokens survives the round trip
    a, b = read(s, "a"), read(s, "b")
    nbytes = s.offload("a")
    assert nbytes > 0 and s.num_free_pages == 8 - 3 and s.num_free_slots == 2
    if device == "cuda":
        assert s._requests["a"].offloaded.buffer.is_pinned()
    fill(s, "c", 8, seed=3)  # reuses a's pages and slot
    s.release("c")
    fill(s, "d", 2, seed=4)  # so a comes back on other page ids
    s.restore("a")
    assert s.num_tokens("a") == 7 and s.capacity("a") == 12
    assert same(read(s, "a"), a) and same(read(s, "b"), b)
    s.check_invariants()


def test_offload_carries_a_pending_snapshot() -> None:
    s = PersistentState(model(), num_pages=6, num_slots=3)
    fill(s, "a", 4, seed=1)
    s.take_snapshot("a")
    snap_state = read(s, "a")[-4:]  # conv/ssm of layers 0 and 3 at 4 tokens
    s.offload("a")
    assert s.num_free_slots == 3
    s.restore("a")
    s.cache_prefix("a", [1, 2, 3, 4])
    s.add_request("b", prefix=s.match_prefix([1, 2, 3, 4]))
    assert same(read(s, "b")[-4:], snap_state)


def test_offload_of_shared_pages_keeps_them_for_others() -> None:
    s = PersistentState(model(), num_pages=6, num_slots=3)
    fill(s, "a", 8, seed=1)
    s.cache_prefix("a", list(range(8)))
    s.take_snapshot("a")
    s.cache_prefix("a", list(range(8)))
    a = read(s, "a")
    s.add_request("b", prefix=s.match_prefix(list(range(8))))
    b = read(s, "b")
    s.offload("a")
    assert same(read(s, "b"), b)  # b still reads the shared pages
    s.restore("a")
    assert same(read(s, "a"), a)
    s.check_invariants()


def test_restore_out_of_memory_leaves_request_offloaded() -> None:
    s = PersistentState(model(), num_pages=3, num_slots=3)
    fill(s, "a", 8, seed=1)
    s.offload("a")
    fill(s, "b", 9, seed=2)  # takes all 3 pages
    b = read(s, "b")
    with pytest.raises(OutOfPagesError, match="'a'"):
        s.restore("a")
    assert s.is_offloaded("a") and s.num_free_pages == 0 and same(read(s, "b"), b)
    s.release("b")
    s.restore("a")
    s.check_invariants()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(("kv_dtype", "state_dtype"), DTYPES)
def test_export_import_is_bitwise_across_page_sizes(device, kv_dtype, state_dtype) -> None:
    src = PersistentState(model(kv_dtype, state_dtype), num_pages=6, num_slots=2, device=device)
    fill(src, "a", 11, seed=1)
    src.kv_cache.set_scale(1, k=0.5, v=2.0)
    src.kv_cache.set_scale(2, k=0.125)
    exp = src.export_request("a")
    assert isinstance(exp, RequestExport) and exp.buffer.dtype == torch.uint8
    assert exp.buffer.dim() == 1 and exp.buffer.device.type == "cpu"
    meta = exp.meta
    assert meta.num_tokens == 11 and meta.page_size == PS and meta.nbytes == exp.buffer.numel()
    assert meta.layer(1).tensors[0].shape == (11, 2, 8)  # token-major k of the full layer
    assert meta.layer(1).k_scale == 0.5 and meta.layer(2).v_scale == 0.125
    # The receiver pages by 8 tokens and already holds another request.
    dst = PersistentState(
        model(kv_dtype, state_dtype, page_size=8), num_pages=5, num_slots=3, device=device
    )
    fill(dst, "other", 5, seed=2)
    other = read(dst, "other")
    dst.kv_cache.set_scale(1, k=0.5, v=2.0)
    dst.kv_cache.set_scale(2, k=0.125)
    dst.import_request("a", exp)
    assert dst.num_tokens("a") == 11 and len(dst.pages("a")) == 2
    assert same(read(dst, "a"), read(src, "a")) and same(read(dst, "other"), other)
    # Export of the import gives the same bytes (the format is page-size independent).
    assert torch.equal(dst.export_request("a").buffer, exp.buffer)
    dst.check_invariants()


def test_import_of_incompatible_layout_says_what_differs() -> None:
    src = PersistentState(model(), num_pages=4, num_slots=2)
    fill(src, "a", 5, seed=1)
    exp = src.export_request("a")
    wrong_dim = PersistentState(model(hd=16), num_pages=4, num_slots=2)
    with pytest.raises(ValueError, match=r"layer 1: k shape: export \[2, 8\], here \[2, 16\]"):
        wrong_dim.import_request("a", exp)
    fp8 = PersistentState(model(kv_dtype="fp8_e4m3"), num_pages=4, num_slots=2)
    with pytest.raises(ValueError, match="layer 2: latent dtype: export bfloat16, here float8"):
        fp8.import_request("a", exp)
    scaled = PersistentState(model(), num_pages=4, num_slots=2)
    scaled.kv_cache.set_scale(1, v=3.0)
    with pytest.raises(ValueError, match=r"layer 1: v_scale: export 1\.0, here 3\.0"):
        scaled.import_request("a", exp)
    full_only = [LayerGroup("full", model()[1].spec, (1,))]
    kv_only = PersistentState(full_only, num_pages=4, num_slots=0)
    with pytest.raises(ValueError, match=r"layers \[0, 2, 3\] are in the export"):
        kv_only.import_request("a", exp)
    for s in (wrong_dim, fp8, scaled, kv_only):
        assert "a" not in s and s.num_free_pages == 4


def _tampered(exp: RequestExport, **changes) -> RequestExport:
    """``exp`` with its metadata changed, the buffer kept."""
    return RequestExport(dataclasses.replace(exp.meta, **changes), exp.buffer)


def _retensor(exp: RequestExport, layer: int, tensor: str, **changes) -> RequestExport:
    """``exp`` with one tensor entry of one layer changed."""
    layers = []
    for entry in exp.meta.layers:
        if entry.layer_index == layer:
            tensors = tuple(
                dataclasses.replace(t, **changes) if t.name == tensor else t for t in entry.tensors
            )
            entry = dataclasses.replace(entry, tensors=tensors)
        layers.append(entry)
    return _tampered(exp, layers=tuple(layers))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("more-tokens", r"layer 1: k shape \[5, 2, 8\]: 5 tokens, the export says 10"),
        ("fewer-tokens", r"layer 1: k shape \[5, 2, 8\]: 5 tokens, the export says 2"),
        ("k-shape", r"layer 1: k: shape \[5, 2, 9\] of bfloat16 is 180 bytes, the entry says 160"),
        ("nbytes", r"the buffer is \d+ bytes, meta.nbytes says 64"),
        ("offset", r"layer 3: ssm: bytes \d+\.\.\d+ are past the buffer's end \d+"),
        ("buffer", r"the buffer is 100 bytes, meta.nbytes says \d+"),
        # a snapshot of the state is extra: it never stands in for the state itself (unpack
        # skips it, and the new slot would keep its previous owner's state)
        ("snapshot-only", r"layer 3: tensor 'ssm' missing from the export"),
        ("unknown-tensor", r"layer 3: tensor 'ssm_old' in the export is not kept here"),
    ],
)
def test_an_export_whose_metadata_disagrees_with_its_buffer_is_refused_with_nothing_held(
    case, message
) -> None:
    src = PersistentState(model(), num_pages=8, num_slots=4)
    fill(src, "a", 5, seed=1)
    exp = src.export_request("a")
    if case == "more-tokens":
        bad = _tampered(exp, num_tokens=exp.meta.num_tokens + 5)
    elif case == "fewer-tokens":
        bad = _tampered(exp, num_tokens=2)
    elif case == "k-shape":
        bad = _retensor(exp, 1, "k", shape=(5, 2, 9))
    elif case == "nbytes":
        bad = _tampered(exp, nbytes=64)
    elif case == "offset":
        ssm = next(t for t in exp.meta.layer(3).tensors if t.name == "ssm")
        bad = _retensor(exp, 3, "ssm", offset=exp.meta.nbytes - ssm.nbytes + 16)
    elif case == "snapshot-only":
        bad = _retensor(exp, 3, "ssm", name="snapshot.ssm")
    elif case == "unknown-tensor":
        bad = _retensor(exp, 3, "ssm", name="ssm_old")
    else:
        bad = RequestExport(exp.meta, exp.buffer[:100].clone())
    dst = PersistentState(model(), num_pages=8, num_slots=4)
    fill(dst, "other", 3, seed=2)
    other = read(dst, "other")
    free = (dst.num_free_pages, dst.num_free_slots)
    with pytest.raises(ValueError, match=message):
        dst.import_request("a", bad)
    assert "a" not in dst and (dst.num_free_pages, dst.num_free_slots) == free
    assert same(read(dst, "other"), other)
    dst.check_invariants()
    dst.import_request("a", exp)  # the genuine export still imports
    assert same(read(dst, "a"), read(src, "a"))


def test_a_failure_while_unpacking_gives_every_page_and_slot_back(monkeypatch) -> None:
    """Whatever fails after the pages were reserved (here: a copy into the cache), the
    request is not added and nothing leaks."""
    import attn_core.state.manager as manager

    src = PersistentState(model(), num_pages=8, num_slots=4)
    fill(src, "a", 5, seed=1)
    exp = src.export_request("a")
    dst = PersistentState(model(), num_pages=8, num_slots=4)

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(manager, "unpack_request", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        dst.import_request("a", exp)
    assert "a" not in dst and (dst.num_free_pages, dst.num_free_slots) == (8, 4)
    dst.check_invariants()
    src.offload("a")
    with pytest.raises(RuntimeError, match="copy failed"):
        src.restore("a")
    assert src.is_offloaded("a") and (src.num_free_pages, src.num_free_slots) == (8, 4)
    src.check_invariants()


def test_a_parallel_hybrid_layer_exports_its_kv_and_its_linear_state_as_two_entries() -> None:
    """Falcon-H1's layers hold attention and a Mamba2 mixer side by side: each layer's KV and
    conv / SSM state travel as two entries of one layer index (KV first) and import bitwise
    into a state of another page size; a receiver without the mixer's state names it."""
    from attn_core.e2e.configs import tiny_config
    from attn_core.models import specs_from_hf_config

    def hybrid(page_size: int) -> list[LayerGroup]:
        cfg = tiny_config("falcon-h1")
        return list(specs_from_hf_config(cfg, dtype="float32", page_size=page_size).groups)

    src = PersistentState(hybrid(4), num_pages=6, num_slots=2)
    fill(src, "a", 9, seed=3)
    exp = src.export_request("a")
    assert [(e.layer_index, e.kind) for e in exp.meta.layers] == [
        (i, kind) for i in (0, 1, 2) for kind in ("full", "linear")
    ]
    assert exp.meta.entries(1)[1].tensors[0].name == "conv"
    assert (
        exp.tensor(1, "k").shape[0] == 9
        and exp.tensor(1, "conv").shape == (src.state_slots.layer(1).tensors()["conv"].shape[1:])
    )
    dst = PersistentState(hybrid(16), num_pages=2, num_slots=2)
    dst.import_request("a", exp)
    assert same(read(dst, "a"), read(src, "a"))
    assert torch.equal(dst.export_request("a").buffer, exp.buffer)
    dst.check_invariants()
    kv_groups = [g for g in hybrid(4) if g.spec.has_kv_cache]
    attention_only = PersistentState(kv_groups, num_pages=4, num_slots=1)
    with pytest.raises(ValueError, match=r"layer 0: linear \(conv / SSM\) state: in the export"):
        attention_only.import_request("a", exp)
    assert "a" not in attention_only and attention_only.num_free_pages == 4
