"""Causal depthwise conv1d over a varlen batch whose conv state lives in a slot pool.

Also holds the varlen batch plumbing shared with :mod:`attn_core.reference.ops.linear`: the
checks of ``query_start_loc`` / ``state_indices`` / ``has_initial_state`` and the per-request
split of the batch.

Batch layout (the same for every op here)::

    x                 [T, ...]   tokens of all requests, concatenated in request order
    query_start_loc   [B + 1]    int32 cu-seqlens: request b owns x[qsl[b] : qsl[b + 1]]
    state_indices     [B]        int32: request b reads / writes pool slot state_indices[b];
                                 a negative index (vLLM's PAD_SLOT_ID = -1) marks a padding
                                 request: its outputs are zero and no slot is touched
    has_initial_state [B]        bool: False starts request b from zeros, ignoring the slot

Prefill chunks and decode steps (one token) go through the same functions; the pool is updated
in place with each request's final state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from attn_core.specs import CONV_ACTIVATIONS

__all__ = ["causal_conv1d"]

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class VarlenRequest:
    """One request of a varlen batch, as host integers."""

    index: int  # b, the request's position in the batch
    start: int  # first token in the concatenated token dimension
    end: int  # one past its last token
    slot: int  # pool slot; negative for a padding request
    has_initial_state: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _check_index_tensor(
    name: str, value: object, dtypes: tuple[torch.dtype, ...], length: int | None
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {value.dtype}")
    if length is not None and value.shape[0] != length:
        raise ValueError(
            f"{name}: expected {length} entries (one per request), got {value.shape[0]}"
        )
    return value


def varlen_requests(
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    num_tokens: int,
    num_slots: int,
) -> list[VarlenRequest]:
    """Check the batch layout tensors and split the batch into requests.

    :param query_start_loc: ``[B + 1]`` int32 (int64 accepted) cu-seqlens, starting at 0 and
        ending at ``num_tokens``, non-decreasing (zero-length requests are allowed).
    :param state_indices: ``[B]`` int32 (int64 accepted) pool slots, each ``< num_slots``; a
        negative value marks a padding request. Two real requests may not share a slot.
    :param has_initial_state: ``[B]`` bool.
    :returns: one :class:`VarlenRequest` per request, in batch order.
    """
    _check_index_tensor("query_start_loc", query_start_loc, _INT_DTYPES, None)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc: expected B + 1 >= 1 entries, got an empty tensor")
    num_requests = query_start_loc.shape[0] - 1
    _check_index_tensor("state_indices", state_indices, _INT_DTYPES, num_requests)
    _check_index_tensor("has_initial_state", has_initial_state, (torch.bool,), num_requests)
    # One host sync per call: the reference walks requests in Python.
    starts = [int(v) for v in query_start_loc.tolist()]
    slots = [int(v) for v in state_indices.tolist()]
    initial = [bool(v) for v in has_initial_state.tolist()]
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc: expected to start at 0 and end at the token count {num_tokens}, "
            f"got {starts[0]} ... {starts[-1]}"
        )
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"query_start_loc: expected non-decreasing offsets, got {starts}")
    real = [s for s in slots if s >= 0]
    if any(s >= num_slots for s in real):
        raise ValueError(
            f"state_indices: expected slots in [0, {num_slots}) (or negative for padding), "
            f"got {slots}"
        )
    if len(set(real)) != len(real):
        raise ValueError(f"state_indices: two requests share a slot, got {slots}")
    return [
        VarlenRequest(b, start, end, slot, init)
        for b, ((start, end), slot, init) in enumerate(
            zip(itertools.pairwise(starts), slots, initial, strict=True)
        )
    ]


def check_shape(name: str, tensor: object, expected: tuple[int | None, ...]) -> torch.Tensor:
    """Raise unless ``tensor`` is a tensor of ``expected`` shape (``None`` matches any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    shape = tuple(tensor.shape)
    if len(shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(shape, expected, strict=False)
    ):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(shape)}")
    return tensor


def check_same_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Raise unless ``tensor`` lives on ``device`` (pools and buffers are never moved)."""
    if tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")


def prepare_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The caller's ``out`` after checking it, or a new tensor of ``shape``/``dtype``."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_shape("out", out, shape)
    check_same_device("out", out, device)
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d per request, continuing from (and updating) the conv state.

    For request ``b`` with inputs ``x_b`` (``L`` tokens) and ``xpad = [state ; x_b]`` along time
    (the slot's ``K - 1`` saved inputs, or zeros without initial state)::

        y[t, c] = act(sum_j weight[c, j] * xpad[t + j, c] + bias[c]),   t = 0 .. L - 1

    and the slot then holds the last ``K - 1`` rows of ``xpad`` (so a chunk shorter than
    ``K - 1`` keeps part of the old state). Computed in float32.

    :param x: ``[T, C]`` inputs, any float dtype.
    :param weight: ``[C, K]`` depthwise filter (HF's ``conv1d.weight.squeeze(1)``).
    :param bias: ``[C]`` or None.
    :param conv_state: ``[S, C, K - 1]`` slot pool, oldest input first; updated in place, stored
        in its own dtype.
    :param query_start_loc: ``[B + 1]`` int32 cu-seqlens.
    :param state_indices: ``[B]`` int32 slots (negative: padding request, output zeros).
    :param has_initial_state: ``[B]`` bool.
    :param activation: ``"silu"`` (alias ``"swish"``) or None.
    :param out: optional ``[T, C]`` output buffer (written and returned).
    :returns: ``[T, C]`` in ``x.dtype`` (or ``out``).
    """
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {list(CONV_ACTIVATIONS)}, got {activation!r}"
        )
    check_shape("x", x, (None, None))
    num_tokens, channels = x.shape
    check_shape("weight", weight, (channels, None))
    width = weight.shape[1]
    if width < 1:
        raise ValueError("weight: expected a kernel width K >= 1, got 0")
    if bias is not None:
        check_shape("bias", bias, (channels,))
    check_shape("conv_state", conv_state, (None, channels, width - 1))
    check_same_device("conv_state", conv_state, x.device)
    requests = varlen_requests(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=num_tokens,
        num_slots=conv_state.shape[0],
    )
    out = prepare_out(out, (num_tokens, channels), x.dtype, x.device)
    w = weight.to(device=x.device, dtype=torch.float32)
    b = None if bias is None else bias.to(device=x.device, dtype=torch.float32)

    for req in requests:
        if req.slot < 0:
            out[req.start : req.end].zero_()
            continue
        if req.has_initial_state:
            prev = conv_state[req.slot].to(device=x.device, dtype=torch.float32)
        else:
            prev = torch.zeros(channels, width - 1, dtype=torch.float32, device=x.device)
        xpad = torch.cat([prev, x[req.start : req.end].to(torch.float32).t()], dim=1)
        conv_state[req.slot] = xpad[:, xpad.shape[1] - (width - 1) :]
        if req.num_tokens == 0:
            continue
        # windows[c, t, j] = xpad[c, t + j]: the K inputs that output t sees.
        windows = xpad.unfold(1, width, 1)
        y = (windows * w[:, None, :]).sum(-1)
        if b is not None:
            y = y + b[:, None]
        if activation is not None:
            y = torch.nn.functional.silu(y)
        out[req.start : req.end] = y.t()
    return out
