"""Reference-counted id pools: KV pages (here) and linear-state slots (:mod:`.slots`).

The pools only count; they own no tensors. A page id indexes dimension 0 of every full and MLA
layer's cache tensor (one id space for the whole model), a slot id dimension 0 of every linear
layer's conv and SSM state tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from attn_core.state.errors import DoubleFreeError, OutOfPagesError, StateError

__all__ = ["PageAllocator", "RefcountedPool"]


class RefcountedPool:
    """A fixed set of ids ``0 .. size-1``, each free (refcount 0) or held (refcount >= 1).

    ``allocate`` is all-or-nothing; ``incref`` / ``decref`` validate every id before changing
    any, so a failing call leaves the pool as it was. Freed ids are reused last-freed-first.
    """

    _what = "id"

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{self._what} pool size={size!r}: expected an integer >= 0")
        self._size = size
        # numpy, so that a whole step's copy-on-write check is one vectorised read
        self._refs = np.zeros(size, dtype=np.int32)
        # A stack: pop() hands out the lowest ids first on a fresh pool.
        self._free = list(range(size - 1, -1, -1))
        #: Bumped by every allocate / incref / decref that changes a refcount: equal values
        #: mean no refcount changed in between (the BatchBuilder's steady-decode check).
        self.changes = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._size - len(self._free)

    def refcount(self, id_: int) -> int:
        self._check_id(id_)
        return int(self._refs[id_])

    @property
    def refcount_array(self) -> np.ndarray:
        """Refcount of every id (a read-only view; do not modify)."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    def is_free(self, id_: int) -> bool:
        return self.refcount(id_) == 0

    def free_ids(self) -> list[int]:
        """The free ids, in no promised order (a copy)."""
        return list(self._free)

    # -- changes -------------------------------------------------------------------------------
    def _out_of(self, needed: int) -> StateError:
        return StateError(f"needs {needed} {self._what}s but only {len(self._free)} are free")

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free ids (refcount 1 each), or raise and take none."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"allocate(n={n!r}): expected an integer >= 0")
        if n > len(self._free):
            raise self._out_of(n)
        free = self._free
        cut = len(free) - n
        ids = free[cut:][::-1]  # the last n, in the order n pops would give them
        del free[cut:]
        if n > 4:
            self._refs[ids] = 1
        else:
            for i in ids:
                self._refs[i] = 1
        self.changes += bool(ids)
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one holder to each id (an id listed twice gains two); every id must be held."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
            if self._refs[i] == 0:
                raise StateError(f"incref of free {self._what} {i}: only held ids can be shared")
        for i in ids:
            self._refs[i] += 1
        self.changes += bool(ids)

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one holder from each id; ids reaching zero are freed and returned.

        Raises :class:`DoubleFreeError` (changing nothing) if an id would drop below zero.
        """
        counts = Counter(ids)
        for i, c in counts.items():
            self._check_id(i)
            if self._refs[i] < c:
                raise DoubleFreeError(
                    f"double free of {self._what} {i}: refcount {self._refs[i]}, released {c}x"
                )
        freed = []
        self.changes += bool(counts)
        for i, c in counts.items():
            self._refs[i] -= c
            if self._refs[i] == 0:
                freed.append(i)
                self._free.append(i)
        return freed

    def _check_id(self, i: object) -> None:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self._size:
            raise ValueError(f"{self._what} id {i!r} is out of range: expected 0..{self._size - 1}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self._size}, free={self.num_free})"


class PageAllocator(RefcountedPool):
    """Refcounted KV page ids; a page shared by a prefix cache and requests has refcount > 1."""

    _what = "page"

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)

    @property
    def num_pages(self) -> int:
        return self._size

    def _out_of(self, needed: int) -> StateError:
        return OutOfPagesError(needed, len(self._free))

    def allocate(self, n: int) -> list[int]:
        return super().allocate(n)

    def refcounts(self, pages: Sequence[int]) -> list[int]:
        return [self.refcount(p) for p in pages]
