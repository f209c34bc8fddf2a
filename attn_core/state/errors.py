"""Errors raised by the persistent state: one base class so a server can catch them all."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = [
    "DoubleFreeError",
    "OutOfPagesError",
    "OutOfSlotsError",
    "StaleprefixError",
    "StateError",
]

_NO_REQUEST = object()


class StateError(RuntimeError):
    """A state operation could not be done; the state is left exactly as it was before the call."""


class DoubleFreeError(StateError):
    """A page or slot was released more often than it was held (a bookkeeping bug upstream)."""


class StaleprefixError(StateError):
    """A :class:`~attn_core.state.PrefixHit` no longer matches the prefix cache (it was evicted)."""


class OutOfPagesError(StateError):
    """Not enough free KV pages, even after evicting every unused cached prefix.

    :ivar needed: pages the operation needed.
    :ivar free: pages that were free (before any eviction).
    :ivar evictable: pages the prefix cache could have given back.
    :ivar req_id: the request the pages were for, or ``None``.
    :ivar num_tokens: the token count the request asked for, or ``None``.
    :ivar requests: the requests of a whole step that needed the pages together, or ``None``.
    """

    def __init__(
        self,
        needed: int,
        free: int,
        *,
        evictable: int = 0,
        req_id: Hashable | None = None,
        num_tokens: int | None = None,
        page_size: int | None = None,
        requests: Sequence[Hashable] | None = None,
    ) -> None:
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.req_id = req_id
        self.num_tokens = num_tokens
        self.requests = tuple(requests) if requests is not None else None
        who = f"request {req_id!r} " if req_id is not None else ""
        if requests is not None:
            who = f"the step of requests {list(requests)!r} "
        what = ""
        if num_tokens is not None:
            what = f" to hold {num_tokens} tokens"
            if page_size is not None:
                what += f" (page_size {page_size})"
        super().__init__(
            f"{who}needs {needed} more KV pages{what} but only {free} are free"
            f" and {evictable} more can be evicted from the prefix cache; release or offload"
            " requests, or size the cache larger"
        )


class OutOfSlotsError(StateError):
    """Not enough free linear-state (conv + SSM) slots, even after evicting cached snapshots.

    :ivar needed: slots the operation needed.
    :ivar free: slots that were free (before any eviction).
    :ivar evictable: cached snapshots that could have been dropped.
    :ivar req_id: the request the slots were for, or ``None``.
    """

    def __init__(
        self,
        needed: int,
        free: int,
        *,
        evictable: int = 0,
        req_id: Hashable | None = None,
    ) -> None:
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.req_id = req_id
        who = f"request {req_id!r} " if req_id is not None else ""
        super().__init__(
            f"{who}needs {needed} linear-state slots but only {free} are free and {evictable}"
            " more can be taken from cached snapshots; release or offload requests, or give"
            " more num_slots"
        )
