"""Paged KV storage for every full-attention and MLA layer of a model (NHD layout).

One page id space serves all layers: page ``p`` of a request is row ``p`` of every layer's cache
tensor, so a request's page list (and the batch's page table) is the same for all layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from attn_core.specs import LayerKind, LayerSpec, torch_dtype

__all__ = ["FullKVLayer", "KVCache", "KVLayer", "MLAKVLayer"]


@dataclass(eq=False, slots=True)
class FullKVLayer:
    """One full-attention layer's paged KV.

    :ivar k: ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``spec.kv_dtype``.
    :ivar v: ``[num_pages, page_size, num_kv_heads, head_dim_v]`` in ``spec.kv_dtype``.
    :ivar k_scale: float32 0-dim tensor; stored K times ``k_scale`` is the real K (1.0 unless the
        KV is quantized). Set it in place (``fill_``) so captured graphs see the new value.
    :ivar v_scale: float32 0-dim tensor, the same for V.
    """

    layer_index: int
    spec: LayerSpec
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    kind = LayerKind.FULL

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}


@dataclass(eq=False, slots=True)
class MLAKVLayer:
    """One MLA layer's paged latent cache.

    :ivar latent: ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` in
        ``spec.kv_dtype``: the compressed KV followed by the rope part of K.
    :ivar k_scale: float32 0-dim tensor: the dequantization scale of the latent.
    :ivar v_scale: the same tensor object as ``k_scale`` (MLA keeps one latent, one scale).
    """

    layer_index: int
    spec: LayerSpec
    latent: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    kind = LayerKind.MLA

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"latent": self.latent}


KVLayer = FullKVLayer | MLAKVLayer


class KVCache:
    """The paged KV (and MLA latent) storage of every full and MLA layer, indexed by page id."""

    def __init__(
        self,
        specs: Mapping[int, LayerSpec],
        *,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        self.num_pages = num_pages
        self.page_size = page_size
        self._layers: dict[int, KVLayer] = {}
        for index, spec in sorted(specs.items()):
            dtype = torch_dtype(spec.kv_dtype)

            def scale() -> torch.Tensor:
                return torch.ones((), dtype=torch.float32, device=self.device)

            if spec.kind is LayerKind.FULL:
                shape = (num_pages, page_size, spec.num_kv_heads)
                self._layers[index] = FullKVLayer(
                    index,
                    spec,
                    torch.zeros((*shape, spec.head_dim), dtype=dtype, device=self.device),
                    torch.zeros((*shape, spec.head_dim_v), dtype=dtype, device=self.device),
                    scale(),
                    scale(),
                )
            elif spec.kind is LayerKind.MLA:
                rank, rope, _ = spec.mla_dims
                width = rank + rope
                s = scale()
                self._layers[index] = MLAKVLayer(
                    index,
                    spec,
                    torch.zeros((num_pages, page_size, width), dtype=dtype, device=self.device),
                    s,
                    s,
                )
            else:
                raise ValueError(
                    f"layer {index}: kind={spec.kind.value!r} keeps no paged KV; expected full/mla"
                )

    # -- access --------------------------------------------------------------------------------
    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(self._layers)

    def __contains__(self, layer_index: object) -> bool:
        return layer_index in self._layers

    def __len__(self) -> int:
        return len(self._layers)

    def layer(self, layer_index: int) -> KVLayer:
        """The KV storage of layer ``layer_index`` (a model layer index, not a position)."""
        try:
            return self._layers[layer_index]
        except KeyError:
            raise KeyError(
                f"layer {layer_index!r} has no paged KV; KV layers: {list(self._layers)}"
            ) from None

    def layers(self) -> list[KVLayer]:
        return list(self._layers.values())

    def set_scale(
        self, layer_index: int, *, k: float | None = None, v: float | None = None
    ) -> None:
        """Set a layer's dequantization scales in place (MLA: ``k`` and ``v`` are one scale)."""
        layer = self.layer(layer_index)
        if isinstance(layer, MLAKVLayer) and k is not None and v is not None and k != v:
            raise ValueError(f"layer {layer_index} is MLA with one latent scale; got k={k}, v={v}")
        if k is not None:
            layer.k_scale.fill_(float(k))
        if v is not None:
            layer.v_scale.fill_(float(v))

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        return self.page_size * sum(la.spec.kv_bytes_per_token for la in self._layers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of all page storage (scales not counted)."""
        return sum(
            t.numel() * t.element_size()
            for la in self._layers.values()
            for t in la.tensors().values()
        )

    # -- bulk byte access (dtype-agnostic, bitwise) ----------------------------------------------
    def token_rows(self, layer_index: int) -> dict[str, torch.Tensor]:
        """Byte views ``[num_pages * page_size, bytes_per_token]`` (uint8) of a layer's tensors.

        Row ``page * page_size + offset`` is one token. Gathers and scatters go through bytes so
        that float8 (which lacks many CPU kernels) is moved bitwise like any other dtype.
        """
        out = {}
        for name, t in self.layer(layer_index).tensors().items():
            # A contiguous tensor reshaped to 2-D is a view: writes go to the cache itself.
            out[name] = t.view(torch.uint8).view(t.shape[0] * t.shape[1], _row_bytes(t))
        return out

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy pages ``src[i]`` -> ``dst[i]`` in every layer (bitwise). Used for copy-on-write."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages but {len(dst)} destinations")
        if not src:
            return
        s = torch.tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        for la in self._layers.values():
            for t in la.tensors().values():
                raw = t.view(torch.uint8)
                raw[d] = raw[s]


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one token row of a ``[pages, page_size, ...]`` tensor."""
    n = t.element_size()
    for d in t.shape[2:]:
        n *= d
    return n
