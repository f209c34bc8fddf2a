"""PersistentState: per-request ownership of KV pages and linear-state slots.

The core owns this state; backends only receive views (``kv_cache.layer(i)``,
``state_slots.layer(i)``, page tables, slot ids). Every public method either does all of its
work or raises and changes nothing that any request can see (cached, unused prefixes may be
evicted only when the operation is sure to succeed).

Lifecycle of one request::

    state.add_request(rid, prefix=state.match_prefix(tokens))   # shares cached pages / state
    state.ensure_capacity(rid, n + step)   # pages for the tokens about to be written (+ CoW)
    ...backends write KV at state.slot_mapping(rid, n, n + step) and update state.slot(rid)...
    state.advance(rid, step)                # those tokens are now written
    state.take_snapshot(rid)                # optional, at a block boundary (linear layers)
    state.cache_prefix(rid, tokens)         # register its full pages for later requests
    state.release(rid)                      # or offload(rid) / restore(rid), export / import
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from attn_core.specs import LayerGroup, LayerKind, LayerSpec
from attn_core.state.errors import OutOfPagesError, OutOfSlotsError, StaleprefixError, StateError
from attn_core.state.kv_cache import KVCache
from attn_core.state.layout import StateLayout
from attn_core.state.memory import size_for_budget
from attn_core.state.pages import PageAllocator
from attn_core.state.prefix_cache import CachedBlock, PrefixCache, block_keys
from attn_core.state.slots import SlotAllocator, StateSlots
from attn_core.state.transfer import (
    RequestExport,
    export_problems,
    layout_differences,
    pack_request,
    unpack_request,
)

if TYPE_CHECKING:
    from attn_core.selector import Plan

__all__ = ["PersistentState", "PrefixHit", "RequestRows"]


def _token_ids(tokens: Sequence[int]) -> Sequence[int]:
    """``tokens`` as the prefix cache keys them: a tensor's elements hash by identity, so a
    tensor of ids becomes a list of ints (a list or an array of ints is kept as it is)."""
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens


#: Every epoch value of every PersistentState of the process, drawn once: a batch built by one
#: state never matches another's epoch, so the binding refuses it before its slot and page
#: indices reach another pool (two fresh states would both be at epoch 0 otherwise).
_EPOCHS = itertools.count()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What :meth:`PersistentState.match_prefix` found; pass it to ``add_request(prefix=...)``.

    :ivar num_tokens: tokens whose KV (and linear state) the new request gets for free.
    :ivar pages: the cached pages holding them (shared, refcounted on ``add_request``).
    :ivar snapshot: the state slot holding the linear state after ``num_tokens`` tokens, or
        ``None`` (model without linear layers, or no hit).
    :ivar block_keys: keys of the matched blocks; used to detect a hit made stale by eviction.
    """

    num_tokens: int = 0
    pages: tuple[int, ...] = ()
    snapshot: int | None = None
    block_keys: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True, slots=True)
class RequestRows:
    """Read-only per-request arrays, indexed by the dense rows :meth:`PersistentState.step_rows`
    returns: what a BatchBuilder reads of a whole step with numpy instead of one Python call
    per request. Valid until the next request is added (the arrays may then be reallocated):
    read :attr:`PersistentState.rows` again each step.

    :ivar num_tokens: ``int64``, tokens whose KV / state is written.
    :ivar num_pages: ``int64``, pages held.
    :ivar slot: ``int32``, linear-state slot (-1: none).
    :ivar page_version: ``int64``, bumped whenever the request's pages are replaced (not when
        pages are appended): a page-table row copied at one version stays right until it
        changes.
    """

    num_tokens: np.ndarray
    num_pages: np.ndarray
    slot: np.ndarray
    page_version: np.ndarray


def _block_pages(blocks: Sequence[CachedBlock]) -> tuple[int, ...]:
    """The KV pages of cached blocks of a model with paged KV (each block holds one)."""
    pages = []
    for block in blocks:
        if block.page is None:
            raise StateError(f"prefix-cache block {block.key} holds no KV page")
        pages.append(block.page)
    return tuple(pages)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _read_only_rows(state: PersistentState) -> RequestRows:
    return RequestRows(
        _read_only(state._row_num_tokens),
        _read_only(state._row_num_pages),
        _read_only(state._row_slot),
        _read_only(state._row_page_version),
    )


@dataclass(eq=False, slots=True)
class _Request:
    req_id: Hashable
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    slot: int | None = None
    snapshot: tuple[int, int] | None = None  # (slot, length): taken, not yet in the cache
    offloaded: RequestExport | None = None
    row: int = -1  # dense index into PersistentState's per-request arrays


_row_of = attrgetter("row")


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r}: expected an integer >= 0")
    return value


class PersistentState:
    """KV pages, linear-state slots and a prefix cache for one model on one device.

    :param groups: the model's layer groups; full / MLA layers get paged KV, linear layers get
        conv + SSM state slots, encoder layers nothing.
    :param num_pages: KV pages (ignored, 0, when no layer keeps paged KV).
    :param num_slots: linear-state slots, shared by running requests and cached prefix snapshots
        (ignored, 0, when no layer is linear).
    :param device: where the storage lives.
    :param page_size: tokens per page; ``None`` takes the one the KV groups' specs share
        (``ValueError`` naming the groups if they differ).
    :param kv_dtype: overrides the KV dtype of every full and MLA layer (e.g. ``"fp8_e4m3"``).
    """

    def __init__(
        self,
        groups: Sequence[LayerGroup],
        *,
        num_pages: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        _check_count("num_pages", num_pages)
        _check_count("num_slots", num_slots)
        self.groups = tuple(groups)
        self.layout = StateLayout.from_groups(self.groups, page_size=page_size, kv_dtype=kv_dtype)
        self.device = torch.device(device)
        num_pages = num_pages if self.layout.has_kv else 0
        num_slots = num_slots if self.layout.has_state else 0
        self.page_allocator = PageAllocator(num_pages)
        self.slot_allocator = SlotAllocator(num_slots)
        self.kv_cache = KVCache(
            self.layout.kv_specs,
            num_pages=num_pages,
            page_size=self.layout.page_size,
            device=self.device,
        )
        self.state_slots = StateSlots(self.layout.linear_specs, num_slots=num_slots, device=device)
        self.prefix_cache = PrefixCache(self.layout.page_size)
        self._requests: dict[Hashable, _Request] = {}
        # Dense per-request arrays, so the BatchBuilder reads a whole step's lengths, page
        # counts and slots with numpy instead of one Python call per request.
        self._free_rows: list[int] = []
        self._row_of: dict[Hashable, int] = {}
        self._row_num_tokens = np.zeros(0, dtype=np.int64)
        self._row_num_pages = np.zeros(0, dtype=np.int64)
        self._row_slot = np.zeros(0, dtype=np.int32)
        self._row_live = np.zeros(0, dtype=bool)
        self._row_page_version = np.zeros(0, dtype=np.int64)
        self._row_mark = np.zeros(0, dtype=np.int64)  # scratch of step_rows' duplicate test
        self._order = np.arange(256, dtype=np.int64)
        self._rows = _read_only_rows(self)
        self._version = 0
        #: Bumped whenever pages are freed or replaced, or gain a holder (a cached prefix, a
        #: request that shares them): a batch built before no longer holds (its writes were
        #: planned for pages that were private then). Unique in the process (``_EPOCHS``), so
        #: that a batch of another state is refused too; compare it for equality only.
        self.epoch = next(_EPOCHS)
        #: Bumped whenever a request's dense row, liveness, slot, page count or page version
        #: changes (every ``_publish`` and ``release``); not by ``advance``. With
        #: ``page_allocator.changes`` it tells the BatchBuilder that a step's rows and pages
        #: are as at the last step.
        self.changes = 0

    #: The one KV layout the core's cache stores (``[pages, page_size, heads, dim]``).
    kv_layout = "NHD"

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        *,
        num_pages: int,
        num_slots: int,
        device: torch.device | str | None = None,
    ) -> PersistentState:
        """The state a plan's backends read: its groups, page size and KV dtype.

        :param device: where the storage lives; default the plan's device type (``"cuda"`` or
            ``"cpu"``).
        :raises ValueError: the plan asks for a KV layout the core's cache does not store.
        """
        if plan.kv_layout not in (None, cls.kv_layout):
            raise ValueError(
                f"the plan's backends read kv_layout {plan.kv_layout}: the core's KV cache "
                f"stores {cls.kv_layout} only (ExecutionConstraints(kv_layout='NHD') selects "
                "backends that read it)"
            )
        if device is None:
            device = "cpu" if plan.device.vendor == "cpu" else "cuda"
        return cls(
            [c.group for c in plan.choices],
            num_pages=num_pages,
            num_slots=num_slots,
            device=device,
            page_size=plan.page_size,
            kv_dtype=plan.constraints.kv_dtype,
        )

    def plan_differences(self, plan: Plan) -> list[str]:
        """Every way this state disagrees with what ``plan``'s backends will read (page size,
        KV layout and dtype, the layers that keep state, their specs); empty: they agree."""
        diffs: list[str] = []
        layout = self.layout
        if layout.has_kv and plan.page_size is not None and plan.page_size != self.page_size:
            diffs.append(f"page_size: plan {plan.page_size}, state {self.page_size}")
        if layout.has_kv and plan.kv_layout not in (None, self.kv_layout):
            diffs.append(f"kv_layout: plan {plan.kv_layout}, state {self.kv_layout}")
        # keyed by (layer, "kv" | "linear"): a parallel hybrid's layer keeps both
        planned: dict[tuple[int, str], LayerSpec] = {}
        for choice in plan.choices:
            spec = choice.group.spec
            if spec.has_kv_cache:
                spec = spec.with_(
                    page_size=self.page_size,
                    kv_dtype=plan.constraints.kv_dtype or spec.kv_dtype,
                )
                store = "kv"
            elif spec.kind is LayerKind.LINEAR:
                store = "linear"
            else:
                continue
            planned.update({(i, store): spec for i in choice.group.layer_indices})
        here = {(i, "kv"): s for i, s in layout.kv_specs.items()}
        here.update({(i, "linear"): s for i, s in layout.linear_specs.items()})

        def named(keys: set[tuple[int, str]]) -> str:
            return "[" + ", ".join(f"{i} ({store})" for i, store in sorted(keys)) + "]"

        if extra := set(planned) - set(here):
            diffs.append(f"layers {named(extra)}: in the plan, keep no state here")
        if missing := set(here) - set(planned):
            diffs.append(f"layers {named(missing)}: keep state here, not in the plan")
        for i, store in sorted(set(planned) & set(here)):
            want, have = planned[i, store], here[i, store]
            if want.has_kv_cache and want.kv_dtype != have.kv_dtype:
                diffs.append(f"layer {i}: kv_dtype: plan {want.kv_dtype}, state {have.kv_dtype}")
            elif want != have:
                diffs.append(f"layer {i}: spec: plan [{want.short()}], state [{have.short()}]")
        return diffs

    @classmethod
    def from_memory_budget(
        cls,
        groups: Sequence[LayerGroup],
        budget_bytes: int,
        *,
        device: torch.device | str = "cpu",
        num_slots: int | None = None,
        page_size: int | None = None,
        kv_dtype: str | None = None,
    ) -> PersistentState:
        """As many pages as fit in ``budget_bytes`` after ``num_slots`` state slots
        (see :func:`~attn_core.state.memory.size_for_budget`)."""
        est = size_for_budget(
            groups, budget_bytes, num_slots=num_slots, page_size=page_size, kv_dtype=kv_dtype
        )
        return cls(
            groups,
            num_pages=est.num_pages,
            num_slots=est.num_slots,
            device=device,
            page_size=page_size,
            kv_dtype=kv_dtype,
        )

    # ------------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def has_kv(self) -> bool:
        """Whether the model has full or MLA layers (requests hold pages)."""
        return self.layout.has_kv

    @property
    def has_state(self) -> bool:
        """Whether the model has linear layers (each request holds a state slot)."""
        return self.layout.has_state

    @property
    def num_pages(self) -> int:
        return self.page_allocator.num_pages

    @property
    def num_slots(self) -> int:
        return self.slot_allocator.num_slots

    @property
    def num_free_pages(self) -> int:
        return self.page_allocator.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slot_allocator.num_free

    @property
    def nbytes(self) -> int:
        """Bytes of page and slot storage on the device (scales not counted)."""
        return self.kv_cache.nbytes + self.state_slots.nbytes

    def __repr__(self) -> str:
        return (
            f"PersistentState(pages {self.num_pages - self.num_free_pages}/{self.num_pages} used, "
            f"slots {self.num_slots - self.num_free_slots}/{self.num_slots} used, "
            f"page_size={self.page_size}, requests={len(self._requests)}, "
            f"cached blocks={len(self.prefix_cache)}, device={self.device})"
        )

    def layer_spec(self, layer_index: int) -> LayerSpec:
        """The effective spec of a KV or linear layer (``kv_dtype`` / ``page_size`` applied)."""
        spec = self.layout.kv_specs.get(layer_index) or self.layout.linear_specs.get(layer_index)
        if spec is None:
            raise KeyError(f"layer {layer_index!r} keeps no persistent state")
        return spec

    def __contains__(self, req_id: object) -> bool:
        try:
            return req_id in self._requests
        except TypeError:
            raise TypeError(f"req_id {req_id!r} is not hashable") from None

    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def is_offloaded(self, req_id: Hashable) -> bool:
        return self._get(req_id, live=False).offloaded is not None

    def num_tokens(self, req_id: Hashable) -> int:
        """Tokens of ``req_id`` whose KV / state is written (offloaded requests too)."""
        return self._get(req_id, live=False).num_tokens

    def capacity(self, req_id: Hashable) -> int:
        """Tokens the request's pages can hold (unbounded, -1, without paged KV)."""
        req = self._get(req_id)
        return len(req.pages) * self.page_size if self.has_kv else -1

    def pages(self, req_id: Hashable) -> list[int]:
        """The request's page ids in token order (a copy); the same for every KV layer."""
        return list(self._get(req_id).pages)

    def page_table_row(self, req_id: Hashable) -> list[int]:
        """One row of the batch page table: the request's page ids in token order (a copy)."""
        return list(self._get(req_id).pages)

    def slot(self, req_id: Hashable) -> int:
        """The request's linear-state slot (index into dim 0 of every ``conv`` / ``ssm``)."""
        req = self._get(req_id)
        if req.slot is None:
            raise StateError(
                f"request {req_id!r} has no state slot: the model has no linear layers "
                "(check has_state)"
            )
        return req.slot

    def slot_mapping(self, req_id: Hashable, start: int, end: int) -> list[int]:
        """KV row of tokens ``start .. end-1``: ``page * page_size + offset`` each.

        The rows index ``k.view(-1, Hkv, D)`` (and ``latent.view(-1, R + P)``) of every layer.
        ``end`` must be within the request's capacity (call ``ensure_capacity`` first). Empty
        when the model keeps no paged KV.
        """
        req = self._get(req_id)
        if not self.has_kv:
            if not 0 <= start <= end:
                raise ValueError(f"slot_mapping({req_id!r}, {start}, {end}): expected start <= end")
            return []
        ps = self.page_size
        cap = len(req.pages) * ps
        if not (0 <= start <= end <= cap):
            raise ValueError(
                f"slot_mapping({req_id!r}, {start}, {end}): expected 0 <= start <= end <= "
                f"capacity {cap}; call ensure_capacity({req_id!r}, {end}) first"
            )
        pages = req.pages
        return [pages[t // ps] * ps + t % ps for t in range(start, end)]

    # ------------------------------------------------------------------------------------------
    # Request lifecycle
    # ------------------------------------------------------------------------------------------
    def add_request(self, req_id: Hashable, *, prefix: PrefixHit | None = None) -> None:
        """Start tracking ``req_id``: a zeroed state slot (linear models), no pages yet.

        With ``prefix`` (from :meth:`match_prefix`) the request starts at ``prefix.num_tokens``
        written tokens: it shares the cached pages and its slot gets a copy of the snapshot.
        Raises ``ValueError`` for a known id, :class:`StaleprefixError` if the hit was evicted
        since, :class:`OutOfSlotsError` if no slot can be had.
        """
        self._check_new_id(req_id)
        blocks: list[CachedBlock] = []
        if prefix is not None:
            if not isinstance(prefix, PrefixHit):
                raise TypeError(f"prefix: expected PrefixHit or None, got {type(prefix).__name__}")
            if prefix.num_tokens:
                blocks = self._validate_hit(prefix)
        protect = prefix.snapshot if prefix else None
        _, slots = self._reserve(0, int(self.has_state), req_id=req_id, protect_snapshot=protect)
        pages = list(prefix.pages) if prefix else []
        self.page_allocator.incref(pages)
        if pages:  # shared now: a batch built before may write them without copying first
            self.epoch = next(_EPOCHS)
        slot = slots[0] if slots else None
        if slot is not None:
            if prefix and prefix.snapshot is not None:
                self.state_slots.copy_slot(prefix.snapshot, slot)
            else:
                self.state_slots.zero_slot(slot)  # a reused slot holds another request's state
        self.prefix_cache.touch(blocks)
        req = _Request(req_id, pages, prefix.num_tokens if prefix else 0, slot)
        self._requests[req_id] = req
        self._assign_row(req)

    def ensure_capacity(self, req_id: Hashable, new_len: int) -> list[int]:
        """Make the request hold ``new_len`` tokens; returns the pages appended.

        Pages about to be written (tokens ``num_tokens .. new_len-1``) that are shared with the
        prefix cache or another request are first copied to fresh pages (copy-on-write). All or
        nothing: raises :class:`OutOfPagesError` naming the request, the tokens and the free
        pages, with nothing changed.
        """
        req = self._get(req_id)
        _check_count("new_len", new_len)
        return self._prepare(req, req.num_tokens, max(new_len, req.num_tokens))

    def prepare_write(self, req_id: Hashable, start: int, end: int) -> list[int]:
        """Make tokens ``start .. end-1`` writable: capacity for ``end`` and private copies of
        every shared page they touch (copy-on-write). Returns the pages appended."""
        req = self._get(req_id)
        _check_count("start", start)
        _check_count("end", end)
        if end < start:
            raise ValueError(f"prepare_write({req_id!r}, {start}, {end}): end < start")
        return self._prepare(req, start, end)

    def append_pages(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """One fresh page at the end of each request's page list, for requests whose pages are
        full (a decode step crossing a page boundary); all or nothing.

        :meth:`ensure_capacity` for ``num_tokens + 1`` tokens does the same one request at a
        time; this is its bulk form for the BatchBuilder, where a step of B requests has about
        ``B / page_size`` of them crossing. Pages appended to a request are new (refcount 1), so
        no copy-on-write is ever needed.

        :returns: ``[len(req_ids)]`` int64, the page given to each request.
        :raises OutOfPagesError: fewer pages free (and evictable) than requests; nothing changed.
        :raises StateError: a request's last page is not full (use :meth:`ensure_capacity`).
        """
        try:  # one C-level lookup per request; _get names an unknown or unhashable id
            reqs = list(map(self._requests.__getitem__, req_ids))
        except (KeyError, TypeError):
            reqs = [self._get(r) for r in req_ids]
        if not reqs or not self.has_kv:
            return np.zeros(0, dtype=np.int64)
        n = len(reqs)
        if len(set(req_ids)) != n:
            dup = next(r for r in req_ids if req_ids.count(r) > 1)
            raise ValueError(f"append_pages: request {dup!r} appears twice")
        rows = np.fromiter(map(_row_of, reqs), np.int64, n)
        # (count_nonzero: a C call; ndarray.any() / all() go through Python wrappers)
        if np.count_nonzero(self._row_live[rows]) != n:
            for r in req_ids:
                self._get(r)  # raises for the first offloaded request
        ps = self.page_size
        not_full = self._row_num_tokens[rows] != self._row_num_pages[rows] * ps
        if np.count_nonzero(not_full):
            req = reqs[int(np.argmax(not_full))]
            raise StateError(
                f"append_pages({req.req_id!r}): {req.num_tokens} tokens in "
                f"{len(req.pages)} pages of {ps}; the last page is not full"
            )
        # the step's requests are short of pages together, not the first alone
        pages, _ = self._reserve(n, 0, requests=req_ids)
        for req, page in zip(reqs, pages, strict=True):
            req.pages.append(page)
        self._row_num_pages[rows] += 1
        self.changes += 1
        return np.asarray(pages, dtype=np.int64)

    def reserve_step(
        self,
        append_to: Sequence[Hashable],
        grow: Sequence[tuple[Hashable, int]],
    ) -> np.ndarray:
        """Pages for one step of several requests, all or nothing.

        :param append_to: requests whose pages are full that get one fresh page each (as
            :meth:`append_pages`).
        :param grow: ``(request, end)`` pairs made to hold ``end`` tokens, the ones about to be
            written made private (as :meth:`ensure_capacity`).
        :returns: ``[len(append_to)]`` int64, the page given to each of ``append_to``.
        :raises OutOfPagesError: the step needs more pages than are free or evictable; no
            request changed.
        :raises ValueError: a request appears twice.
        """
        ids = [*append_to, *(r for r, _ in grow)]
        if len(set(ids)) != len(ids):
            dup = next(r for r in ids if ids.count(r) > 1)
            raise ValueError(f"reserve_step: request {dup!r} appears twice in one step")
        if not self.has_kv or not ids:
            return np.zeros(0, dtype=np.int64)
        plans = []
        need = len(append_to)
        pending: Counter[int] = Counter()
        for req_id, end in grow:
            req = self._get(req_id)
            _check_count("end", end)
            end = max(end, req.num_tokens)
            new = max(0, self.layout.pages_for(end) - len(req.pages))
            need += new + len(self._cow_pages(req, req.num_tokens, end, pending))
            plans.append((req, end))
        pa = self.page_allocator
        if need > pa.num_free:
            evictable = self.prefix_cache.evictable_pages(pa.refcount)
            if need > pa.num_free + evictable:
                raise OutOfPagesError(
                    need, pa.num_free, evictable=evictable, requests=ids, page_size=self.page_size
                )
        # Everything below fits: evicting cached prefixes only ever frees pages for the next.
        appended = self.append_pages(append_to) if append_to else np.zeros(0, dtype=np.int64)
        for req, end in plans:
            self._prepare(req, req.num_tokens, end)
        return appended

    def advance(self, req_id: Hashable, n: int) -> int:
        """Record ``n`` more written tokens; returns the new ``num_tokens``."""
        req = self._get(req_id)
        _check_count("n", n)
        new = req.num_tokens + n
        if self.has_kv and new > len(req.pages) * self.page_size:
            raise StateError(
                f"advance({req_id!r}, {n}) to {new} tokens exceeds the capacity "
                f"{len(req.pages) * self.page_size}; call ensure_capacity({req_id!r}, {new}) first"
            )
        req.num_tokens = new
        self._row_num_tokens[req.row] = new
        return new

    def release(self, req_id: Hashable) -> None:
        """Forget the request and free its pages, slot and pending snapshot (cached blocks stay)."""
        req = self._get(req_id, live=False)
        if req.offloaded is None:
            self._free_device(req)
        del self._requests[req_id]
        self._row_of.pop(req_id, None)
        self._row_live[req.row] = False
        self._free_rows.append(req.row)
        self.epoch = next(_EPOCHS)
        self.changes += 1

    # ------------------------------------------------------------------------------------------
    # Prefix cache
    # ------------------------------------------------------------------------------------------
    def take_snapshot(self, req_id: Hashable) -> int:
        """Copy the request's conv + SSM state into a new slot, as the state after its current
        ``num_tokens`` (which must be a positive multiple of ``page_size``); the next
        :meth:`cache_prefix` registers it. Replaces an earlier pending snapshot. Returns the
        snapshot's length."""
        req = self._get(req_id)
        if not self.has_state:
            raise StateError("take_snapshot: the model has no linear layers, nothing to snapshot")
        n = req.num_tokens
        if n == 0 or n % self.page_size:
            raise ValueError(
                f"take_snapshot({req_id!r}) at {n} tokens: the length must be a positive "
                f"multiple of page_size={self.page_size} (a prefix-cache block boundary)"
            )
        if req.slot is None:  # every live request of a model with linear layers holds one
            raise StateError(f"take_snapshot({req_id!r}): the request holds no state slot")
        _, (slot,) = self._reserve(0, 1, req_id=req_id)
        self.state_slots.copy_slot(req.slot, slot)
        if req.snapshot is not None:
            self.slot_allocator.decref([req.snapshot[0]])
        req.snapshot = (slot, n)
        return n

    def cache_prefix(self, req_id: Hashable, tokens: Sequence[int]) -> int:
        """Register the request's full, written blocks of ``tokens`` (and its pending snapshot,
        when it ends on one of them) in the prefix cache. Returns the tokens now cached.

        ``tokens`` are the request's tokens from position 0; the KV in its pages must be the KV
        of these tokens. Blocks already cached are kept (the request's copy is not added).
        """
        req = self._get(req_id)
        tokens = _token_ids(tokens)
        ps = self.page_size
        if self.has_kv:
            n_blocks = min(len(tokens), req.num_tokens) // ps
        elif req.snapshot is not None and req.snapshot[1] <= len(tokens):
            # Without paged KV a block is only worth keeping on the way to a snapshot.
            n_blocks = req.snapshot[1] // ps
        else:
            n_blocks = 0
        keys = block_keys(tokens, ps, n_blocks)
        cache = self.prefix_cache
        chain: list[CachedBlock] = []
        shared = False
        for b, key in enumerate(keys):
            block_tokens = tuple(int(t) for t in tokens[b * ps : (b + 1) * ps])
            parent = chain[-1] if chain else None
            block = cache.get(key)
            if block is None:
                page = req.pages[b] if self.has_kv else None
                if page is not None and cache.page_owner(page) is not None:
                    # The page already backs another prefix: the tokens given do not match
                    # the KV this request holds (they changed since it was cached). Stop here.
                    break
                if page is not None:
                    self.page_allocator.incref([page])
                    shared = True
                block = cache.insert(key, parent, block_tokens, page)
            elif block.tokens != block_tokens or block.parent != (parent.key if parent else None):
                break  # a hash collision: cache nothing past it
            chain.append(block)
        cache.touch(chain)
        if shared:  # the request's pages back a cached prefix: a batch built before is stale
            self.epoch = next(_EPOCHS)
        if req.snapshot is not None:
            slot, length = req.snapshot
            k = length // ps
            if 0 < k <= len(chain):
                block = chain[k - 1]
                if block.snapshot is None:
                    cache.set_snapshot(block, slot)
                else:
                    self.slot_allocator.decref([slot])
                req.snapshot = None
        return len(chain) * ps

    def match_prefix(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> PrefixHit:
        """The longest cached prefix of ``tokens`` usable by a new request.

        With linear layers a hit must end where a snapshot was taken (a block boundary);
        without them it may end inside a page (``max_tokens``), which is then shared and copied
        on the first write. Pass ``max_tokens=len(tokens) - 1`` to keep at least one token to
        compute. Marks the hit most recently used; nothing is held until ``add_request``.
        """
        tokens = _token_ids(tokens)
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        if limit <= 0 or not (self.has_kv or self.has_state):
            return PrefixHit()
        ps = self.page_size
        chain = self.prefix_cache.lookup(tokens)
        snapshot = None
        if self.has_state:
            k = min(len(chain), limit // ps)
            while k > 0 and chain[k - 1].snapshot is None:
                k -= 1
            n = k * ps
            if k:
                snapshot = chain[k - 1].snapshot
        else:
            n = min(len(chain) * ps, limit)
            k = -(-n // ps)
        used = chain[:k]
        if not used:
            return PrefixHit()
        self.prefix_cache.touch(used)
        pages = _block_pages(used) if self.has_kv else ()
        return PrefixHit(n, pages, snapshot, tuple(b.key for b in used))

    def clear_prefix_cache(self) -> int:
        """Drop every cached block and snapshot no request holds; returns pages freed."""
        freed = 0
        refcount = self.page_allocator.refcount
        while (block := self.prefix_cache.lru_evictable_leaf(refcount)) is not None:
            self._evict_block(block)
            freed += 1
        while (block := self.prefix_cache.lru_snapshot()) is not None:
            self._drop_snapshot(block)
        return freed

    # ------------------------------------------------------------------------------------------
    # Offload, export / import
    # ------------------------------------------------------------------------------------------
    def offload(self, req_id: Hashable) -> int:
        """Move the request's KV (written tokens) and state (and pending snapshot) to host
        memory (pinned when the device is CUDA) and free its pages and slots. Returns the bytes
        moved. Shared pages stay with their other holders."""
        req = self._get(req_id)
        export = pack_request(
            self.layout,
            self.kv_cache,
            self.state_slots,
            pages=req.pages,
            num_tokens=req.num_tokens,
            slot=req.slot,
            snapshot=req.snapshot,
            out_device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        self._free_device(req)
        req.offloaded = export
        self._publish(req, new_pages=True)
        return export.meta.nbytes

    def restore(self, req_id: Hashable) -> None:
        """Bring an offloaded request back (new page / slot ids, same capacity, same bytes).
        All or nothing: :class:`OutOfPagesError` / :class:`OutOfSlotsError` leave it offloaded."""
        req = self._get(req_id, live=False)
        export = req.offloaded
        if export is None:
            raise StateError(f"restore({req_id!r}): the request is not offloaded")
        meta = export.meta
        n_pages = max(meta.num_pages, self.layout.pages_for(meta.num_tokens)) if self.has_kv else 0
        has_snap = meta.snapshot_length is not None and self.has_state
        n_slots = int(self.has_state) + int(has_snap)
        pages, slots = self._reserve(n_pages, n_slots, req_id=req_id, num_tokens=meta.num_tokens)
        slot = slots[0] if self.has_state else None
        snap = slots[1] if has_snap else None
        with self._given_back_on_failure(pages, slots):
            unpack_request(
                export,
                self.layout,
                self.kv_cache,
                self.state_slots,
                pages=pages,
                slot=slot,
                snapshot_slot=snap,
            )
        req.pages = pages
        req.slot = slot
        length = meta.snapshot_length  # not None where snap is (has_snap)
        req.snapshot = (snap, length) if snap is not None and length is not None else None
        req.offloaded = None
        self._publish(req, new_pages=True)

    def export_request(
        self,
        req_id: Hashable,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ) -> RequestExport:
        """A copy of the request's written KV tokens and linear state in one ``uint8`` buffer on
        ``device`` (pinned by default when copying from CUDA to the CPU). The request is kept."""
        req = self._get(req_id)
        out = torch.device(device)
        if pin_memory is None:
            pin_memory = out.type == "cpu" and self.device.type == "cuda"
        return pack_request(
            self.layout,
            self.kv_cache,
            self.state_slots,
            pages=req.pages[: self.layout.pages_for(req.num_tokens)],
            num_tokens=req.num_tokens,
            slot=req.slot,
            out_device=out,
            pin_memory=pin_memory,
        )

    def import_request(self, req_id: Hashable, export: RequestExport) -> None:
        """Add ``req_id`` with the tokens and state of ``export`` (from any state of the same
        layout; the page size may differ). ``ValueError`` listing every difference if the
        layout does not fit; out-of-memory errors leave everything as it was."""
        self._check_new_id(req_id)
        if not isinstance(export, RequestExport):
            raise TypeError(f"export: expected RequestExport, got {type(export).__name__}")
        problems = export_problems(export)
        if problems:
            raise ValueError(
                f"import_request({req_id!r}): the export is inconsistent: " + "; ".join(problems)
            )
        diffs = layout_differences(export.meta, self.layout, self.kv_cache, self.state_slots)
        if diffs:
            raise ValueError("the export does not fit this state's layout: " + "; ".join(diffs))
        n = export.meta.num_tokens
        pages, slots = self._reserve(
            self.layout.pages_for(n), int(self.has_state), req_id=req_id, num_tokens=n
        )
        slot = slots[0] if slots else None
        with self._given_back_on_failure(pages, slots):
            unpack_request(
                export, self.layout, self.kv_cache, self.state_slots, pages=pages, slot=slot
            )
        req = _Request(req_id, pages, n, slot)
        self._requests[req_id] = req
        self._assign_row(req)

    # ------------------------------------------------------------------------------------------
    # Consistency
    # ------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise :class:`StateError` listing every bookkeeping inconsistency (for tests/debug).

        Every page's refcount equals its holders (request page lists plus cache blocks), free
        pages have none, the free list has no duplicates; every slot is held by exactly one of a
        request, a pending snapshot or a cached snapshot, or is free.
        """
        problems: list[str] = []
        for name, pool, holders in (
            ("page", self.page_allocator, self._page_holders()),
            ("slot", self.slot_allocator, self._slot_holders()),
        ):
            free = pool.free_ids()
            if len(free) != len(set(free)):
                problems.append(f"{name} free list has duplicates")
            free_set = set(free)
            for i in range(pool.size):
                rc, held = pool.refcount(i), holders.get(i, 0)
                if rc != held:
                    problems.append(f"{name} {i}: refcount {rc} but {held} holders")
                if (i in free_set) != (rc == 0):
                    problems.append(f"{name} {i}: refcount {rc} but free={i in free_set}")
            if name == "slot" and any(v > 1 for v in holders.values()):
                problems.append("a slot has more than one holder")
        for req in self._requests.values():  # the dense row arrays the BatchBuilder reads
            row = req.row
            want = (req.num_tokens, len(req.pages), -1 if req.slot is None else req.slot)
            got = (
                int(self._row_num_tokens[row]),
                int(self._row_num_pages[row]),
                int(self._row_slot[row]),
            )
            if got != want or bool(self._row_live[row]) != (req.offloaded is None):
                problems.append(f"request {req.req_id!r}: row {row} holds {got}, not {want}")
        for block in self.prefix_cache.blocks():
            children = sum(1 for b in self.prefix_cache.blocks() if b.parent == block.key)
            if children != block.children:
                problems.append(f"block depth {block.depth}: {block.children} != {children} kids")
        if problems:
            raise StateError("inconsistent state: " + "; ".join(problems))

    def _page_holders(self) -> Counter[int]:
        c: Counter[int] = Counter()
        for req in self._requests.values():
            c.update(req.pages)
        c.update(b.page for b in self.prefix_cache.blocks() if b.page is not None)
        return c

    def _slot_holders(self) -> Counter[int]:
        c: Counter[int] = Counter()
        for req in self._requests.values():
            if req.slot is not None:
                c[req.slot] += 1
            if req.snapshot is not None:
                c[req.snapshot[0]] += 1
        c.update(self.prefix_cache.snapshot_slots())
        return c

    # ------------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------------
    def _check_new_id(self, req_id: Hashable) -> None:
        """``req_id`` can key a new request: hashable (the dict lookup would raise a bare
        ``unhashable type``) and not taken."""
        if req_id in self:  # raises the named TypeError for an unhashable id
            raise ValueError(f"request {req_id!r} already exists; release it first")

    def _get(self, req_id: Hashable, *, live: bool = True) -> _Request:
        try:
            req = self._requests[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None
        except TypeError:
            raise TypeError(f"req_id {req_id!r} is not hashable") from None
        if live and req.offloaded is not None:
            raise StateError(f"request {req_id!r} is offloaded; restore({req_id!r}) it first")
        return req

    # -- dense per-request arrays (read by the BatchBuilder) ----------------------------------
    @property
    def rows(self) -> RequestRows:
        """The per-request arrays, read-only (see :class:`RequestRows`)."""
        return self._rows

    @property
    def page_refcounts(self) -> np.ndarray:
        """``[num_pages]`` int32 refcount of every page, read-only: a page with more than one
        holder (another request, the prefix cache) is copied before it is written."""
        return self.page_allocator.refcount_array

    @property
    def page_changes(self) -> int:
        """Bumped whenever a page refcount changes: equal values mean equal refcounts."""
        return self.page_allocator.changes

    def step_rows(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """Dense row of each request of one step (int64), for reads of :attr:`rows`.

        :raises KeyError: naming an unknown request.
        :raises StateError: naming offloaded requests.
        :raises ValueError: naming a request that appears twice (its rows would write the same
            KV slots and state slot).
        """
        n = len(req_ids)
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, req_ids), np.int64, n)
        except KeyError as exc:
            raise KeyError(f"unknown request {exc.args[0]!r}") from None
        if not n:
            return rows
        if np.count_nonzero(self._row_live[rows]) != n:
            bad = [r for r, ok in zip(req_ids, self._row_live[rows], strict=True) if not ok]
            raise StateError(f"requests {bad} are offloaded; restore them first")
        # Duplicates in O(n): each row marks itself with its position; a row written twice
        # keeps only the later mark.
        if len(self._order) < n:
            self._order = np.arange(max(n, 2 * len(self._order)), dtype=np.int64)
        order = self._order[:n]
        mark = self._row_mark
        mark[rows] = order
        if np.count_nonzero(mark[rows] != order):
            first = int(np.flatnonzero(mark[rows] != order)[0])
            raise ValueError(
                f"request {req_ids[first]!r} appears twice in one step (positions {first} and "
                f"{int(mark[rows[first]])}): each request takes one row of a batch"
            )
        return rows

    def _assign_row(self, req: _Request) -> None:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self._row_of) + len(self._free_rows)
            if row >= len(self._row_num_tokens):
                grow = max(64, 2 * len(self._row_num_tokens))
                for name in (
                    "_row_num_tokens",
                    "_row_num_pages",
                    "_row_slot",
                    "_row_live",
                    "_row_page_version",
                    "_row_mark",
                ):
                    old = getattr(self, name)
                    new = np.zeros(grow, dtype=old.dtype)
                    new[: len(old)] = old
                    setattr(self, name, new)
                self._rows = _read_only_rows(self)
        req.row = row
        self._row_of[req.req_id] = row
        self._publish(req, new_pages=True)

    def _publish(self, req: _Request, *, new_pages: bool = False) -> None:
        self.changes += 1
        row = req.row
        self._row_num_tokens[row] = req.num_tokens
        self._row_num_pages[row] = len(req.pages)
        self._row_slot[row] = -1 if req.slot is None else req.slot
        self._row_live[row] = req.offloaded is None
        if new_pages:
            self._version += 1
            self._row_page_version[row] = self._version

    @contextmanager
    def _given_back_on_failure(self, pages: list[int], slots: list[int]) -> Iterator[None]:
        """Free freshly reserved ``pages`` and ``slots`` if the block raises (a copy into them
        failed): the request they were for is then not added, and nothing leaks."""
        try:
            yield
        except BaseException:
            self.page_allocator.decref(pages)
            self.slot_allocator.decref(slots)
            raise

    def _free_device(self, req: _Request) -> None:
        self.page_allocator.decref(req.pages)
        slots = [s for s in (req.slot, req.snapshot[0] if req.snapshot else None) if s is not None]
        self.slot_allocator.decref(slots)
        req.pages = []
        req.slot = None
        req.snapshot = None
        self.epoch = next(_EPOCHS)

    def _validate_hit(self, hit: PrefixHit) -> list[CachedBlock]:
        ps = self.page_size
        stale = StaleprefixError(
            f"prefix hit of {hit.num_tokens} tokens is stale (evicted since match_prefix); "
            "match again"
        )
        blocks: list[CachedBlock] = []
        for key in hit.block_keys:
            block = self.prefix_cache.get(key)
            if block is None:
                raise stale
            blocks.append(block)
        pages = tuple(b.page for b in blocks)
        if self.has_kv and (len(blocks) != -(-hit.num_tokens // ps) or pages != tuple(hit.pages)):
            raise stale
        if not self.has_kv and hit.pages:  # another state's hit: no page here is its
            raise stale
        if self.has_state and (
            len(blocks) * ps != hit.num_tokens or blocks[-1].snapshot != hit.snapshot
        ):
            raise stale
        return blocks

    def _cow_pages(
        self, req: _Request, start: int, end: int, pending: Counter[int] | None = None
    ) -> list[int]:
        """Indices into ``req.pages`` of the pages that writing tokens ``start .. end-1`` must
        copy first (shared with the prefix cache or another request).

        :param pending: holders that copies planned earlier in the same step will drop, by page;
            updated with this request's copies.
        """
        ps = self.page_size
        touched = range(start // ps, min(len(req.pages), -(-end // ps))) if end > start else ()
        refcount = self.page_allocator.refcount
        cow = []
        for j in touched:
            page = req.pages[j]
            holders = refcount(page) - (pending[page] if pending is not None else 0)
            if holders > 1:
                cow.append(j)
                if pending is not None:
                    pending[page] += 1
        return cow

    def _prepare(self, req: _Request, start: int, end: int) -> list[int]:
        if not self.has_kv:
            return []
        pa = self.page_allocator
        new = max(0, self.layout.pages_for(end) - len(req.pages))
        cow = self._cow_pages(req, start, end)
        pages, _ = self._reserve(new + len(cow), 0, req_id=req.req_id, num_tokens=end)
        fresh, extra = pages[: len(cow)], pages[len(cow) :]
        if cow:
            old = [req.pages[j] for j in cow]
            self.kv_cache.copy_pages(old, fresh)
            for j, p in zip(cow, fresh, strict=True):
                req.pages[j] = p
            pa.decref(old)  # still held by the cache / other requests: never freed here
        req.pages.extend(extra)
        if cow:
            self.epoch = next(_EPOCHS)
        if cow or extra:
            self._publish(req, new_pages=bool(cow))
        return extra

    def _reserve(
        self,
        n_pages: int,
        n_slots: int,
        *,
        req_id: Hashable | None = None,
        num_tokens: int | None = None,
        protect_snapshot: int | None = None,
        requests: Sequence[Hashable] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Allocate pages and slots, evicting unused cached prefixes (LRU) if needed.

        Checks that both fit before evicting anything, so a failure changes nothing.
        """
        pa, sa, cache = self.page_allocator, self.slot_allocator, self.prefix_cache
        if n_pages > pa.num_free:
            evictable = cache.evictable_pages(pa.refcount)
            if n_pages > pa.num_free + evictable:
                raise OutOfPagesError(
                    n_pages,
                    pa.num_free,
                    evictable=evictable,
                    req_id=req_id,
                    num_tokens=num_tokens,
                    page_size=self.page_size,
                    requests=requests,
                )
        if n_slots > sa.num_free:
            snaps = cache.snapshot_slots()
            evictable = len(snaps) - (protect_snapshot in snaps)
            if n_slots > sa.num_free + evictable:
                raise OutOfSlotsError(n_slots, sa.num_free, evictable=evictable, req_id=req_id)
        while n_pages > pa.num_free:
            block = cache.lru_evictable_leaf(pa.refcount)
            assert block is not None, "evictable_pages promised more pages"
            self._evict_block(block)
        while n_slots > sa.num_free:
            block = cache.lru_snapshot(protect=protect_snapshot)
            assert block is not None, "snapshot count promised more slots"
            self._drop_snapshot(block)
        # (a kind not asked for is not touched: decode steps reserve pages only)
        return pa.allocate(n_pages) if n_pages else [], sa.allocate(n_slots) if n_slots else []

    def _evict_block(self, block: CachedBlock) -> None:
        if block.snapshot is not None:
            self.slot_allocator.decref([self.prefix_cache.drop_snapshot(block)])
        self.prefix_cache.remove_leaf(block)
        if block.page is not None:
            self.page_allocator.decref([block.page])

    def _drop_snapshot(self, block: CachedBlock) -> None:
        cache = self.prefix_cache
        self.slot_allocator.decref([cache.drop_snapshot(block)])
        # Without paged KV a block is kept only on the way to a snapshot: prune dead ends.
        b: CachedBlock | None = block
        while b is not None and b.page is None and b.children == 0 and b.snapshot is None:
            parent = cache.get(b.parent) if b.parent is not None else None
            cache.remove_leaf(b)
            b = parent
