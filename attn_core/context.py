"""The per-group context contract and typed workspace requirements.

A backend's context serves every layer of one group. Its life cycle::

    ctx = allocate_context(...)            # once per group: workspace sized for the largest batch
    for step in steps:
        ctx.prepare(batch)                 # once per step: planning (page tables, kernel plans)
        for layer in group:                # per layer: one direct call, no hook dispatch
            out = forward(layer, q, k, v, out, **inputs)

With CUDA graphs, a decode step is captured once per padded batch size after ``prepare``; before
each replay the core calls ``ctx.update(batch)``, which must copy the new batch's metadata *in
place* into the buffers the captured kernels read, so a replay computes the new batch - never the
one seen at capture.

``forward`` inputs per kind (shapes in :mod:`attn_core.specs`):

- ``full`` / ``encoder``: ``q, k, v``; the new tokens' ``k``/``v`` are written into the paged
  cache (``full``) before attending.
- ``mla``: ``q`` absorbed ``[T, H, R + P]``, ``k`` the new latent ``[T, R + P]``, ``v=None``.
- ``linear`` (Gated DeltaNet / KDA): ``q, k, v`` and keyword ``g`` (log decay: ``[T, Hv]``,
  ``[T, Hv, Dk]`` for KDA) and ``beta`` ``[T, Hv]``.
- ``linear`` (Mamba2): ``q=C [T, G, N]``, ``k=B [T, G, N]``, ``v=x [T, H, P]`` and keyword
  ``dt [T, H]``, ``A_log [H]``, ``D [H]``, ``dt_bias [H]``.
- linear layers also expose ``conv1d(layer, x [T, C], weight [C, K], bias [C] | None,
  activation)`` which runs the causal conv with the layer's conv state.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from attn_core.batch import AttentionBatch
    from attn_core.binding import LayerAttentionBinding

__all__ = ["AttentionContext", "WorkspaceRequirement"]


@dataclass(frozen=True, slots=True)
class WorkspaceRequirement:
    """One scratch buffer a backend needs, allocated once per group by the core.

    :param name: key under which the buffer appears in the :class:`attn_core.workspace.Workspace`.
    :param shape: buffer shape, sized for the run's largest batch / captured graph.
    :param dtype: element dtype.
    :param host: allocate in (pinned, when CUDA is used) host memory instead of on the device.
    :param zero: zero-initialise (otherwise contents are undefined).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.uint8
    host: bool = False
    zero: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"WorkspaceRequirement name={self.name!r}: expected a non-empty str")
        object.__setattr__(self, "shape", _sizes(self.name, self.shape))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(
                f"WorkspaceRequirement {self.name!r}: dtype={self.dtype!r}, expected a torch.dtype"
            )

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _sizes(name: str, shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints >= 0; any integer type counts (numpy's, from a
    sizing formula), a bool does not (``True`` would be one element), nor does a bare int or a
    string (not a shape)."""
    try:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise TypeError
        sizes = tuple(-1 if isinstance(s, (bool, np.bool_)) else operator.index(s) for s in shape)
    except TypeError:
        sizes = (-1,)
    if any(s < 0 for s in sizes):
        raise ValueError(
            f"WorkspaceRequirement {name!r}: shape={shape!r}, expected a tuple of sizes (ints >= 0)"
        )
    return sizes


@runtime_checkable
class AttentionContext(Protocol):
    """What ``attn_core_allocate_context`` returns (duck-typed; no base class needed).

    The methods every context may need; two more are needed only by some groups, so the
    protocol leaves them out: ``conv1d(layer, x, weight, bias, *, activation='silu',
    out=None)`` for linear groups, and ``commit_speculative(batch, num_accepted)`` for linear
    groups that verify drafts (docs/reference.md, "The context").
    """

    def prepare(self, batch: AttentionBatch) -> None:
        """Plan the step for ``batch`` (host work allowed; called once per step per group)."""

    def update(self, batch: AttentionBatch) -> None:
        """Copy ``batch``'s metadata in place into captured buffers before a graph replay."""

    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """Run one layer; write into ``out`` or return a tensor the core copies into it."""
        ...
