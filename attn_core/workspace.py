"""Workspace: the scratch buffers a backend declared, allocated once per layer group."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from attn_core.context import WorkspaceRequirement

__all__ = ["Workspace"]


class Workspace(Mapping[str, torch.Tensor]):
    """Named buffers, allocated once from :class:`WorkspaceRequirement` declarations.

    Buffers keep their address for the whole run, which is what CUDA-graph capture needs.
    """

    def __init__(
        self, requirements: Iterable[WorkspaceRequirement], device: torch.device | str
    ) -> None:
        device = torch.device(device)
        self.requirements: dict[str, WorkspaceRequirement] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        for req in requirements:
            if not isinstance(req, WorkspaceRequirement):
                raise TypeError(
                    f"workspace requirements must be WorkspaceRequirement, got {type(req).__name__}"
                )
            if req.name in self._buffers:
                raise ValueError(f"workspace buffer {req.name!r} declared twice")
            target = torch.device("cpu") if req.host else device
            pin = req.host and device.type == "cuda"
            alloc = torch.zeros if req.zero else torch.empty
            self._buffers[req.name] = alloc(
                req.shape, dtype=req.dtype, device=target, pin_memory=pin
            )
            self.requirements[req.name] = req

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(
                f"workspace has no buffer {name!r}; declared: {sorted(self._buffers)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.requirements.values())
