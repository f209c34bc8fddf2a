"""Which of a phase's backends serves one step, from the tuned switches of its plan.

The selector writes the switches (:attr:`attn_core.selector.PhaseChoice.by_step_size` and
``by_requests``) over backends; the runtime keeps the same switches over its contexts. Both
pick through :func:`pick_for_step`, so a plan and the runtime that runs it agree on every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["pick_for_step"]

T = TypeVar("T")


def pick_for_step(
    by_step_size: Sequence[tuple[int, T]],
    by_requests: Sequence[tuple[int, int, int, T]],
    default: T,
    size: int,
    requests: int | None = None,
) -> T:
    """The entry for a step of ``size`` (padded requests, or padded query tokens in prefill)
    in ``requests`` requests.

    :param by_step_size: ``(largest size, entry)`` ascending: the first whose bound is
        ``>= size``, the last one beyond.
    :param by_requests: ``(size above, size at most, requests at most, entry)``, tried first
        (with ``requests`` given): the first rule whose size range holds ``size`` and whose
        bound is ``>= requests``.
    :param default: the entry where both are empty.
    """
    if requests is not None:
        for above, at_most, max_requests, entry in by_requests:
            if above < size <= at_most and requests <= max_requests:
                return entry
    for bound, entry in by_step_size:
        if size <= bound:
            return entry
    return by_step_size[-1][1] if by_step_size else default
