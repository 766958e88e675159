"""A vectorised hash index ``uint64 key -> int slot`` (open addressing, pure numpy, no I/O).

Why not a ``dict``: a request carries hundreds to thousands of block hashes, and a Python dict
answers them one interpreter step and one or two cache misses at a time. Here a whole batch is
hashed and probed by numpy: one gather per probe round over every key still unresolved, so the
memory accesses of a batch overlap instead of queueing.

Layout: ``keys``/``vals``/``state`` arrays of a power-of-two capacity; ``state`` is 0 (empty),
1 (used) or 2 (deleted, a tombstone that keeps probe chains intact). Position of a key:
Fibonacci hashing (multiply by 2^64/phi, keep the top bits), then linear probing. The table is
rebuilt at twice the live size whenever used + deleted cells pass half the capacity, so probe
chains stay short (expected < 2 probes).
"""

from __future__ import annotations

import numpy as np

_PHI = np.uint64(0x9E3779B97F4A7C15)
EMPTY, USED, DELETED = 0, 1, 2
_WINDOW = 16
_STEPS = np.arange(_WINDOW, dtype=np.intp)


def first_occurrences(a: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each distinct value of ``a`` (by value order for
    large arrays, by position for small ones; callers only need the set)."""
    if len(a) <= 64:  # numpy's unique costs tens of microseconds of overhead on tiny arrays
        seen: dict[int, int] = {}
        for i, v in enumerate(a.tolist()):
            seen.setdefault(v, i)
        return np.fromiter(seen.values(), dtype=np.intp, count=len(seen))
    return np.unique(a, return_index=True)[1]


class HashIndex:
    __slots__ = ("bits", "deleted", "keys", "state", "used", "vals")

    def __init__(self, capacity: int = 1024) -> None:
        bits = max(4, int(capacity - 1).bit_length())
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        cap = 1 << bits
        self.bits = bits
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.vals = np.zeros(cap, dtype=np.intp)
        self.state = np.zeros(cap, dtype=np.int8)
        self.used = 0
        self.deleted = 0

    def __len__(self) -> int:
        return self.used

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _PHI) >> np.uint64(64 - self.bits)).astype(np.intp)

    def _probe(self, keys: np.ndarray) -> np.ndarray:
        """Cell of each key, or -1 where the key is absent.

        Round 1 looks at each key's home cell (most keys end there); later rounds gather a
        window of ``_WINDOW`` consecutive cells per unresolved key, so a long probe chain costs
        one more vectorised round instead of one round per cell."""
        mask = (1 << self.bits) - 1
        pos = self._home(keys)
        st = self.state[pos]
        hit = (st == USED) & (self.keys[pos] == keys)
        out = np.where(hit, pos, -1)
        todo = np.flatnonzero(~hit & (st != EMPTY))
        start = pos[todo] + 1
        while len(todo):
            cells = (start[:, None] + _STEPS) & mask
            wst = self.state[cells]
            match = (wst == USED) & (self.keys[cells] == keys[todo][:, None])
            stop = match | (wst == EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(len(todo))
            found = match[rows, first]
            out[todo[found]] = cells[rows[found], first[found]]
            more = ~stop.any(axis=1)
            todo, start = todo[more], (start[more] + _WINDOW) & mask
        return out

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Value of each key (uint64 array), 0 where absent."""
        cell = self._probe(keys)
        out = self.vals[cell]
        out[cell < 0] = 0
        return out

    def get(self, key: int) -> int | None:
        v = int(self.find(np.array([key], dtype=np.uint64))[0])
        return v or None

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Add distinct keys known to be absent (their values must be non-zero)."""
        if not len(keys):
            return
        if 2 * (self.used + self.deleted + len(keys)) > (1 << self.bits):
            self._rebuild(self.used + len(keys))
        mask = (1 << self.bits) - 1
        start = self._home(keys)
        todo = np.arange(len(keys))
        while len(todo):
            # each key takes the first free cell of a window on its probe chain; keys that pick
            # the same cell: the first wins, the others look again from the same start
            cells = (start[todo][:, None] + _STEPS) & mask
            free = self.state[cells] != USED
            has = free.any(axis=1)
            rows = np.flatnonzero(has)
            cell = cells[rows, free[rows].argmax(axis=1)]
            first = first_occurrences(cell)
            win, cell = rows[first], cell[first]
            self.deleted -= int((self.state[cell] == DELETED).sum())
            self.keys[cell] = keys[todo[win]]
            self.vals[cell] = vals[todo[win]]
            self.state[cell] = USED
            self.used += len(win)
            start[todo[~has]] += _WINDOW
            keep = np.ones(len(todo), dtype=bool)
            keep[win] = False
            todo = todo[keep]
            start[todo] &= mask

    def delete(self, keys: np.ndarray) -> None:
        """Remove keys (absent ones are ignored)."""
        cell = self._probe(keys)
        cell = np.unique(cell[cell >= 0])
        self.state[cell] = DELETED
        self.used -= len(cell)
        self.deleted += len(cell)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self.state == USED
        return self.keys[live], self.vals[live]

    def _rebuild(self, live: int) -> None:
        keys, vals = self.items()
        self._alloc(max(4, int(4 * max(live, 1) - 1).bit_length()))
        self.insert(keys, vals)
