"""Bookkeeping of the prefix cache: a tree of full token blocks and the snapshots on it.

Only ids are kept here (pages, slots); the :class:`~attn_core.state.PersistentState` owns the
allocators and does the copying. A block is ``page_size`` tokens; its key chains the parent's key
with the block's tokens, so equal keys mean equal whole prefixes. The stored tokens and parent key
are compared on every lookup, so a hash collision is a miss, never a wrong hit.

Eviction is LRU over leaves: evicting an inner block would strand its descendants, whose pages
would stay held but could never be matched again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["CachedBlock", "PrefixCache", "block_keys"]

_ROOT = 0x5EED  # key of the empty prefix


def block_keys(tokens: Sequence[int], page_size: int, num_blocks: int) -> list[int]:
    """Chained keys of the first ``num_blocks`` full blocks of ``tokens``.

    Python's hash of a tuple of ints does not depend on ``PYTHONHASHSEED``: keys are stable
    across processes.
    """
    keys = []
    parent = _ROOT
    for b in range(num_blocks):
        parent = hash((parent, tuple(tokens[b * page_size : (b + 1) * page_size])))
        keys.append(parent)
    return keys


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One cached block: ``page`` holds its KV (``None`` when the model keeps no paged KV);
    ``snapshot`` is a state slot holding the linear state after this block, or ``None``."""

    key: int
    parent: int | None  # None for the first block
    tokens: tuple[int, ...]
    depth: int  # 1 for the first block: the prefix ends at depth * page_size tokens
    page: int | None
    children: int = 0
    snapshot: int | None = None


class PrefixCache:
    """Blocks by key, in least-recently-used-first order, and their snapshots (also LRU)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._blocks: OrderedDict[int, CachedBlock] = OrderedDict()
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # block key -> slot
        self._page_owner: dict[int, int] = {}  # page -> key of the block holding it

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> Iterator[CachedBlock]:
        return iter(self._blocks.values())

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def snapshot_slots(self) -> list[int]:
        return list(self._snapshots.values())

    def get(self, key: int) -> CachedBlock | None:
        return self._blocks.get(key)

    def page_owner(self, page: int) -> CachedBlock | None:
        """The block that holds ``page``, or ``None``: a page backs at most one block."""
        key = self._page_owner.get(page)
        return None if key is None else self._blocks[key]

    def lookup(self, tokens: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks that match the longest block-aligned prefix of ``tokens``."""
        chain: list[CachedBlock] = []
        parent = _ROOT
        ps = self.page_size
        for b in range(len(tokens) // ps):
            block_tokens = tuple(tokens[b * ps : (b + 1) * ps])
            key = hash((parent, block_tokens))
            block = self._blocks.get(key)
            expected_parent = chain[-1].key if chain else None
            if block is None or block.tokens != block_tokens or block.parent != expected_parent:
                break
            chain.append(block)
            parent = key
        return chain

    def touch(self, blocks: Sequence[CachedBlock]) -> None:
        """Mark blocks (root first) and their snapshots most recently used."""
        for block in blocks:
            self._blocks.move_to_end(block.key)
            if block.snapshot is not None:
                self._snapshots.move_to_end(block.key)

    def insert(
        self, key: int, parent: CachedBlock | None, tokens: tuple[int, ...], page: int | None
    ) -> CachedBlock:
        block = CachedBlock(
            key, parent.key if parent else None, tokens, parent.depth + 1 if parent else 1, page
        )
        self._blocks[key] = block
        if page is not None:
            self._page_owner[page] = key
        if parent is not None:
            parent.children += 1
        return block

    def set_snapshot(self, block: CachedBlock, slot: int) -> None:
        block.snapshot = slot
        self._snapshots[block.key] = slot

    def drop_snapshot(self, block: CachedBlock) -> int:
        """Detach and return the block's snapshot slot (the caller frees it)."""
        slot = block.snapshot
        assert slot is not None
        block.snapshot = None
        del self._snapshots[block.key]
        return slot

    def remove_leaf(self, block: CachedBlock) -> None:
        """Remove a childless block (its page and snapshot must already be taken by the caller)."""
        if block.children:
            raise ValueError(f"block at depth {block.depth} still has {block.children} children")
        del self._blocks[block.key]
        if block.page is not None:
            del self._page_owner[block.page]
        if block.parent is not None:
            self._blocks[block.parent].children -= 1

    # -- eviction planning --------------------------------------------------------------------
    def evictable_pages(self, refcount: Callable[[int], int]) -> int:
        """Pages repeated leaf eviction could free: blocks whose page only the cache holds and
        whose descendants are all such blocks."""
        pinned: set[int] = set()
        n = 0
        # Children are one deeper than their parent: deepest first sees them before the parent.
        for block in sorted(self._blocks.values(), key=lambda b: -b.depth):
            free_able = block.key not in pinned and (
                block.page is None or refcount(block.page) == 1
            )
            if free_able:
                n += block.page is not None
            elif block.parent is not None:
                pinned.add(block.parent)
        return n

    def lru_evictable_leaf(self, refcount: Callable[[int], int]) -> CachedBlock | None:
        """The least recently used leaf whose page only the cache holds, or ``None``."""
        for block in self._blocks.values():
            if block.children == 0 and block.page is not None and refcount(block.page) == 1:
                return block
        return None

    def lru_snapshot(self, protect: int | None = None) -> CachedBlock | None:
        """The block with the least recently used snapshot (other than ``protect``'s slot)."""
        for key, slot in self._snapshots.items():
            if slot != protect:
                return self._blocks[key]
        return None
