"""Moving one request's state out of and into a :class:`KVCache` + :class:`StateSlots`.

Used for offload to host memory and for disaggregated prefill -> decode hand-off. The format is
one contiguous ``uint8`` buffer plus a small metadata dataclass. KV is stored token-major (only
the request's ``num_tokens`` written tokens, in order), so the receiving side may use a different
page size and any page ids. All copies go through byte views, so every dtype (float8 included)
round-trips bitwise.

Buffer layout: the tensors listed in :attr:`ExportMeta.layers`, each at its ``offset`` (aligned
to 16 bytes, zero padding between): first every KV layer in layer order (full: ``k
[num_tokens, num_kv_heads, head_dim]`` then ``v [num_tokens, num_kv_heads, head_dim_v]``; MLA:
``latent [num_tokens, kv_lora_rank + qk_rope_head_dim]``), then every linear layer in layer
order (``conv [C, K-1]``, ``ssm [num_heads, head_dim, head_dim_v]`` and, for offload only,
``snapshot.conv`` / ``snapshot.ssm``: a prefix snapshot not yet registered in the prefix cache).
:attr:`ExportMeta.layers` holds one entry per layer and kind of state, KV entries first where a
layer has both (a parallel hybrid such as Falcon-H1: its attention's KV and its Mamba mixer's
conv / SSM state are two entries of one layer index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attn_core.state.kv_cache import KVCache
from attn_core.state.layout import StateLayout, spec_hash
from attn_core.state.slots import StateSlots

__all__ = [
    "FORMAT_VERSION",
    "ExportMeta",
    "LayerEntry",
    "RequestExport",
    "TensorEntry",
    "export_problems",
    "layout_differences",
    "meta_problems",
    "pack_request",
    "token_index",
    "unpack_request",
]

FORMAT_VERSION = 1
_ALIGN = 16  # so that a slice of the buffer can be viewed as any dtype in place


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor in the buffer: ``buffer[offset : offset + nbytes]`` viewed as dtype, shape."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16", "float8_e4m3fn"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """What one layer contributed: its kind, spec hash, scales and tensors."""

    layer_index: int
    kind: str
    spec_hash: str
    summary: str  # LayerSpec.short(), for error messages
    tensors: tuple[TensorEntry, ...]
    k_scale: float | None = None
    v_scale: float | None = None


@dataclass(frozen=True, slots=True)
class ExportMeta:
    """Metadata of a :class:`RequestExport`.

    :ivar num_tokens: tokens whose KV is in the buffer (and whose linear state it holds).
    :ivar page_size: page size of the exporting side (information only: KV is token-major).
    :ivar num_pages: pages the request held when exported (offload restores as many).
    :ivar snapshot_length: length of the pending prefix snapshot carried, or ``None``.
    """

    num_tokens: int
    page_size: int
    num_pages: int
    layers: tuple[LayerEntry, ...]
    nbytes: int
    snapshot_length: int | None = None
    version: int = FORMAT_VERSION

    def layer(self, layer_index: int) -> LayerEntry:
        """The layer's first entry (its KV one where a parallel hybrid layer has two)."""
        for entry in self.layers:
            if entry.layer_index == layer_index:
                return entry
        raise KeyError(f"layer {layer_index} is not in this export")

    def entries(self, layer_index: int) -> tuple[LayerEntry, ...]:
        """Every entry of the layer: one, or KV then linear state for a parallel hybrid."""
        return tuple(e for e in self.layers if e.layer_index == layer_index)


@dataclass(frozen=True, slots=True)
class RequestExport:
    """One request's state: ``buffer`` is a 1-D ``uint8`` tensor of ``meta.nbytes`` bytes."""

    meta: ExportMeta
    buffer: torch.Tensor

    def tensor(self, layer_index: int, name: str) -> torch.Tensor:
        """A view of one stored tensor (e.g. ``tensor(3, "k")`` -> ``[num_tokens, Hkv, D]``)."""
        for entry in self.meta.entries(layer_index) or (self.meta.layer(layer_index),):
            for t in entry.tensors:
                if t.name == name:
                    raw = self.buffer[t.offset : t.offset + t.nbytes]
                    return raw.view(_DTYPES[t.dtype]).view(t.shape)
        raise KeyError(f"layer {layer_index} has no tensor {name!r} in this export")


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8)
}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


_KV_KINDS = ("full", "mla")


def _is_kv(entry: LayerEntry) -> bool:
    """The entry holds token-major KV (else a linear layer's conv / SSM state)."""
    return entry.kind in _KV_KINDS


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def token_index(
    pages: Sequence[int], num_tokens: int, page_size: int, device: torch.device
) -> torch.Tensor:
    """Row ``page * page_size + offset`` of each of the first ``num_tokens`` tokens; int64."""
    if num_tokens > len(pages) * page_size:
        raise ValueError(
            f"{num_tokens} tokens do not fit in {len(pages)} pages of {page_size} tokens"
        )
    p = torch.tensor(list(pages), dtype=torch.long)
    rows = (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:num_tokens]
    return rows.to(device)


def pack_request(
    layout: StateLayout,
    kv_cache: KVCache,
    state_slots: StateSlots,
    *,
    pages: Sequence[int],
    num_tokens: int,
    slot: int | None,
    snapshot: tuple[int, int] | None = None,
    out_device: torch.device | str = "cpu",
    pin_memory: bool = False,
) -> RequestExport:
    """Copy a request's KV tokens and state slot (bitwise) into one new buffer on ``out_device``.

    :param snapshot: ``(slot, length)`` of a pending prefix snapshot to carry, or ``None``.
    """
    # (layer, holds KV, name, dtype, shape, bytes)
    pieces: list[tuple[int, bool, str, torch.dtype, tuple[int, ...], torch.Tensor]] = []
    if layout.has_kv:
        idx = token_index(pages, num_tokens, layout.page_size, kv_cache.device)
        for i in kv_cache.layer_indices:
            layer = kv_cache.layer(i)
            rows = kv_cache.token_rows(i)
            for name, t in layer.tensors().items():
                data = rows[name][idx]  # gather: a new tensor, the pages may be freed after
                shape = (num_tokens, *t.shape[2:])
                pieces.append((i, True, name, t.dtype, shape, data.reshape(-1)))
    if layout.has_state:
        sources = [("", slot)] + ([("snapshot.", snapshot[0])] if snapshot else [])
        for i in state_slots.layer_indices:
            slots_layer = state_slots.layer(i)
            for prefix, s in sources:
                for name, t in slots_layer.tensors().items():
                    data = _as_bytes(t[s])
                    pieces.append((i, False, prefix + name, t.dtype, tuple(t.shape[1:]), data))
    offset = 0
    placed: list[tuple[TensorEntry, tuple[int, bool], torch.Tensor]] = []
    for i, kv, name, dtype, shape, data in pieces:
        entry = TensorEntry(name, _dtype_name(dtype), shape, offset, data.numel())
        placed.append((entry, (i, kv), data))
        offset += -(-data.numel() // _ALIGN) * _ALIGN
    buffer = torch.zeros(offset, dtype=torch.uint8, device=out_device, pin_memory=pin_memory)
    for entry, _, data in placed:
        # One copy per tensor, straight into the destination: no staging copy on the device.
        buffer[entry.offset : entry.offset + entry.nbytes].copy_(data)
    layers: list[LayerEntry] = []
    # KV before linear state where a layer has both (sorted by (layer, not KV))
    keyed = [((i, True), s) for i, s in layout.kv_specs.items()]
    keyed += [((i, False), s) for i, s in layout.linear_specs.items()]
    for (i, kv), spec in sorted(keyed, key=lambda item: (item[0][0], not item[0][1])):
        ks = vs = None
        if kv:
            ks = float(kv_cache.layer(i).k_scale)
            vs = float(kv_cache.layer(i).v_scale)
        entries = tuple(e for e, key, _ in placed if key == (i, kv))
        layers.append(
            LayerEntry(i, spec.kind.value, spec_hash(spec), spec.short(), entries, ks, vs)
        )
    meta = ExportMeta(
        num_tokens=num_tokens,
        page_size=layout.page_size,
        num_pages=len(pages),
        layers=tuple(layers),
        nbytes=offset,
        snapshot_length=snapshot[1] if snapshot else None,
    )
    return RequestExport(meta, buffer)


def export_problems(export: RequestExport) -> list[str]:
    """Every way an export's metadata disagrees with itself or its buffer (empty: consistent).

    An export may come from another process or machine: before anything is reserved for it,
    each tensor entry must lie inside the buffer, hold exactly the bytes its shape and dtype
    take, and every KV tensor must hold ``num_tokens`` tokens.
    """
    meta, buf = export.meta, export.buffer
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        got = f"{buf.dtype} {list(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf)
        return [f"buffer: expected a 1-D uint8 tensor, got {got}"]
    return meta_problems(meta, buf.numel())


def meta_problems(meta: ExportMeta, buffer_nbytes: int) -> list[str]:
    """:func:`export_problems` of ``meta`` and a buffer of ``buffer_nbytes`` bytes, without the
    buffer: a receiver checks the metadata before it receives (or allocates) the bytes."""
    problems = []
    if buffer_nbytes != meta.nbytes:
        problems.append(f"the buffer is {buffer_nbytes} bytes, meta.nbytes says {meta.nbytes}")
    if meta.num_tokens < 0 or meta.page_size <= 0 or meta.num_pages < 0:
        problems.append(
            f"num_tokens {meta.num_tokens}, page_size {meta.page_size}, num_pages "
            f"{meta.num_pages}: expected num_tokens >= 0, page_size > 0, num_pages >= 0"
        )
    end = min(buffer_nbytes, meta.nbytes)
    for entry in meta.layers:
        i = entry.layer_index
        for t in entry.tensors:
            dtype = _DTYPES.get(t.dtype)
            if dtype is None:
                problems.append(f"layer {i}: {t.name}: unknown dtype {t.dtype!r}")
                continue
            size = dtype.itemsize
            for d in t.shape:
                size *= d
            if any(d < 0 for d in t.shape) or size != t.nbytes:
                problems.append(
                    f"layer {i}: {t.name}: shape {list(t.shape)} of {t.dtype} is {size} bytes, "
                    f"the entry says {t.nbytes}"
                )
            if t.offset < 0 or t.offset % _ALIGN or t.offset + t.nbytes > end:
                problems.append(
                    f"layer {i}: {t.name}: bytes {t.offset}..{t.offset + t.nbytes} are past the "
                    f"buffer's end {end} or not {_ALIGN}-byte aligned"
                )
            if _is_kv(entry) and (not t.shape or t.shape[0] != meta.num_tokens):
                n = t.shape[0] if t.shape else 0
                problems.append(
                    f"layer {i}: {t.name} shape {list(t.shape)}: {n} tokens, the export says "
                    f"{meta.num_tokens}"
                )
    return problems


def _expected(layout: StateLayout, kv_cache: KVCache, state_slots: StateSlots) -> dict:
    """Per (layer, holds KV): (kind, spec hash, summary, {name: (dtype, shape without the token
    dim)}); a parallel hybrid layer has both keys."""
    out = {}
    for i, spec in layout.kv_specs.items():
        tensors = {
            n: (_dtype_name(t.dtype), tuple(t.shape[2:]))
            for n, t in kv_cache.layer(i).tensors().items()
        }
        out[i, True] = (spec.kind.value, spec_hash(spec), spec.short(), tensors)
    for i, spec in layout.linear_specs.items():
        tensors = {
            n: (_dtype_name(t.dtype), tuple(t.shape[1:]))
            for n, t in state_slots.layer(i).tensors().items()
        }
        out[i, False] = (spec.kind.value, spec_hash(spec), spec.short(), tensors)
    return out


def layout_differences(
    meta: ExportMeta, layout: StateLayout, kv_cache: KVCache, state_slots: StateSlots
) -> list[str]:
    """Every way ``meta`` does not fit this layout, as readable lines (empty: compatible)."""
    diffs: list[str] = []
    if meta.version != FORMAT_VERSION:
        diffs.append(f"format version: export {meta.version}, here {FORMAT_VERSION}")
    expected = _expected(layout, kv_cache, state_slots)
    got: dict[tuple[int, bool], LayerEntry] = {}
    for e in meta.layers:
        if (e.layer_index, _is_kv(e)) in got:
            what = "KV" if _is_kv(e) else "linear-state"
            diffs.append(f"layer {e.layer_index}: two {what} entries in the export")
        got[e.layer_index, _is_kv(e)] = e
    here = {i for i, _ in expected}
    if missing := sorted({i for i, _ in set(expected) - set(got)} - {i for i, _ in got}):
        diffs.append(f"layers {missing} keep state here but are not in the export")
    if extra := sorted({i for i, _ in got} - here):
        diffs.append(f"layers {extra} are in the export but keep no state here")
    for key in sorted(set(expected) ^ set(got)):
        i, kv = key
        if i in here and i in {j for j, _ in got}:  # the layer is on both sides, a kind is not
            what = "KV" if kv else "linear (conv / SSM) state"
            side = "here, not in the export" if key in expected else "in the export, not here"
            diffs.append(f"layer {i}: {what}: {side}")
    for key in sorted(set(expected) & set(got)):
        i, kv = key
        kind, h, summary, tensors = expected[key]
        entry = got[key]
        before = len(diffs)
        if entry.kind != kind:
            diffs.append(f"layer {i}: kind: export {entry.kind}, here {kind}")
            continue
        # a "snapshot." tensor is extra (a linear layer's speculative snapshot carried along):
        # it never stands in for the state itself, which import writes into the new slot; a
        # KV layer carries none
        seen: dict[str, tuple] = {}
        for t in entry.tensors:
            base = t.name if kv else t.name.removeprefix("snapshot.")
            if base not in tensors:
                diffs.append(f"layer {i}: tensor {t.name!r} in the export is not kept here")
                continue
            seen[t.name] = (t.dtype, t.shape[1:] if kv else t.shape)
        for name, (dtype, shape) in tensors.items():
            if name not in seen:
                diffs.append(f"layer {i}: tensor {name!r} missing from the export")
            for label in (name, f"snapshot.{name}"):
                if label not in seen:
                    continue
                if seen[label][0] != dtype:
                    diffs.append(f"layer {i}: {label} dtype: export {seen[label][0]}, here {dtype}")
                if seen[label][1] != shape:
                    diffs.append(
                        f"layer {i}: {label} shape: export {list(seen[label][1])}, "
                        f"here {list(shape)}"
                    )
        if entry.spec_hash != h and len(diffs) == before:
            diffs.append(f"layer {i}: spec: export [{entry.summary}], here [{summary}]")
        if kv:
            layer = kv_cache.layer(i)
            for which, mine in (("k_scale", layer.k_scale), ("v_scale", layer.v_scale)):
                theirs = getattr(entry, which)
                if theirs is not None and theirs != float(mine):
                    diffs.append(
                        f"layer {i}: {which}: export {theirs}, here {float(mine)} (the stored "
                        "KV would be dequantized wrongly; set_scale to match first)"
                    )
    return diffs


def unpack_request(
    export: RequestExport,
    layout: StateLayout,
    kv_cache: KVCache,
    state_slots: StateSlots,
    *,
    pages: Sequence[int],
    slot: int | None,
    snapshot_slot: int | None = None,
) -> None:
    """Write an export's tensors into ``pages`` / ``slot`` (bitwise). The layout must fit."""
    meta = export.meta
    buf = export.buffer
    if layout.has_kv:
        idx = token_index(pages, meta.num_tokens, layout.page_size, kv_cache.device)
    for entry in meta.layers:
        i = entry.layer_index
        for t in entry.tensors:
            raw = buf[t.offset : t.offset + t.nbytes].to(kv_cache.device)
            if _is_kv(entry):
                rows = kv_cache.token_rows(i)[t.name]
                rows[idx] = raw.view(meta.num_tokens, rows.shape[1])
            else:
                layer = state_slots.layer(i)
                is_snap = t.name.startswith("snapshot.")
                target_slot = snapshot_slot if is_snap else slot
                if target_slot is None:
                    continue  # a carried snapshot the caller chose not to restore
                dst = layer.tensors()[t.name.removeprefix("snapshot.")][target_slot]
                if dst.numel():
                    dst.reshape(-1).view(torch.uint8).copy_(raw)
