"""Linear-attention / SSM state: the slot allocator and the conv + recurrent state tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from attn_core.specs import LayerSpec, torch_dtype
from attn_core.state.errors import OutOfSlotsError, StateError
from attn_core.state.pages import RefcountedPool

__all__ = ["LinearStateLayer", "SlotAllocator", "StateSlots"]


class SlotAllocator(RefcountedPool):
    """Refcounted linear-state slot ids (requests and cached prefix snapshots both take slots)."""

    _what = "slot"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)

    @property
    def num_slots(self) -> int:
        return self._size

    def _out_of(self, needed: int) -> StateError:
        return OutOfSlotsError(needed, len(self._free))


@dataclass(eq=False, slots=True)
class LinearStateLayer:
    """One linear layer's state storage.

    :ivar conv: ``[num_slots, conv_channels, conv_kernel_size - 1]`` in ``spec.dtype``: the last
        ``K-1`` inputs of the causal conv, oldest first. ``[num_slots, 0]`` (no memory) for a
        layer without a conv (lightning attention).
    :ivar ssm: ``[num_slots, num_heads, head_dim, head_dim_v]`` in ``spec.state_dtype``: the
        recurrent state ``[dk, dv]`` per value head. ``[num_slots, 0]`` (no memory) for a layer
        without one (the short conv).
    """

    layer_index: int
    spec: LayerSpec
    conv: torch.Tensor
    ssm: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"conv": self.conv, "ssm": self.ssm}


class StateSlots:
    """Conv and SSM state for every linear layer of a model, indexed by slot id."""

    def __init__(
        self, specs: Mapping[int, LayerSpec], *, num_slots: int, device: torch.device | str
    ) -> None:
        self.device = torch.device(device)
        self.num_slots = num_slots
        self._layers: dict[int, LinearStateLayer] = {}
        for index, spec in sorted(specs.items()):
            # A state the variant does not keep is [num_slots, 0]: zero bytes, while copy_slot /
            # zero_slot / offload still treat every layer alike (an empty shape would give
            # [num_slots], one element per slot).
            conv_shape = spec.conv_state_shape or (0,)
            ssm_shape = spec.ssm_state_shape or (0,)
            self._layers[index] = LinearStateLayer(
                index,
                spec,
                torch.zeros(
                    (num_slots, *conv_shape), dtype=torch_dtype(spec.dtype), device=self.device
                ),
                torch.zeros(
                    (num_slots, *ssm_shape),
                    dtype=torch_dtype(spec.state_dtype),
                    device=self.device,
                ),
            )

    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(self._layers)

    def __contains__(self, layer_index: object) -> bool:
        return layer_index in self._layers

    def __len__(self) -> int:
        return len(self._layers)

    def layer(self, layer_index: int) -> LinearStateLayer:
        """The state of layer ``layer_index`` (a model layer index, not a position)."""
        try:
            return self._layers[layer_index]
        except KeyError:
            raise KeyError(
                f"layer {layer_index!r} has no linear state; linear layers: {list(self._layers)}"
            ) from None

    def layers(self) -> list[LinearStateLayer]:
        return list(self._layers.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot across all linear layers (conv + SSM)."""
        return sum(la.spec.state_bytes_per_request() for la in self._layers.values())

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for la in self._layers.values()
            for t in la.tensors().values()
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s conv and SSM state into slot ``dst`` in every layer (bitwise)."""
        for la in self._layers.values():
            la.conv[dst].copy_(la.conv[src])
            la.ssm[dst].copy_(la.ssm[src])

    def zero_slot(self, slot: int) -> None:
        """Reset slot ``slot`` to the initial (all-zero) state in every layer."""
        for la in self._layers.values():
            la.conv[slot].zero_()
            la.ssm[slot].zero_()
