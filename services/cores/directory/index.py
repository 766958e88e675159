"""A vectorised hash index ``uint64 key -> slot`` (open addressing, pure numpy, no I/O).

Why not a ``dict``: a request carries hundreds to thousands of block hashes, and a Python dict
answers them one interpreter step and one or two cache misses at a time. Here a whole batch is
hashed and probed by numpy, one gather per probe round over every key still unresolved, so the
memory accesses of a batch overlap instead of queueing.

Layout: one ``uint64[capacity, 2]`` array of ``(key, value)`` cells (a probe touches one cache
line). Value 0 marks an empty cell and ``2**64 - 1`` a deleted one (a tombstone that keeps probe
chains intact); stored values (slots) are therefore in ``[1, 2**64 - 2]``. Position: Fibonacci
hashing (multiply by 2^64/phi, keep the top bits), then linear probing. Round 1 reads each
key's home cell, round 2 the next one; the keys still unresolved read windows of 16 cells per
round. Batches of at most ``SMALL_BATCH`` keys take a plain-Python path (fewer numpy calls).
The table is rebuilt at <= 1/4 load whenever used + deleted cells pass 1/2: chains stay short.
"""

from __future__ import annotations

import numpy as np

_PHI = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.uint64(0)
_DELETED = np.uint64(2**64 - 1)
_PHI_INT, _M64, _DELETED_INT = int(_PHI), 2**64 - 1, 2**64 - 1
_SINGLE_ROUNDS = 1  # probe rounds of one cell per key before windows of cells
SMALL_BATCH = 24  # batches up to this size are probed and inserted in plain Python
_WINDOW = 16
_STEPS = np.arange(_WINDOW, dtype=np.intp)


def first_occurrences(a: np.ndarray) -> np.ndarray:
    """Indices of one occurrence of each distinct value of ``a`` (the first one)."""
    if len(a) <= 64:  # numpy's unique costs tens of microseconds of overhead on tiny arrays
        seen: dict[int, int] = {}
        for i, v in enumerate(a.tolist()):
            seen.setdefault(v, i)
        return np.fromiter(seen.values(), dtype=np.intp, count=len(seen))
    return np.unique(a, return_index=True)[1]


class HashIndex:
    __slots__ = ("bits", "cells", "deleted", "used")

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(4, int(capacity - 1).bit_length()))

    def _alloc(self, bits: int) -> None:
        self.bits = bits
        self.cells = np.zeros((1 << bits, 2), dtype=np.uint64)
        self.used = 0
        self.deleted = 0

    def __len__(self) -> int:
        return self.used

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _PHI) >> np.uint64(64 - self.bits)).astype(np.intp)

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cell, value)`` of each key; cell -1 and value 0 where the key is absent."""
        mask = (1 << self.bits) - 1
        pos = self._home(keys)
        c = self.cells.take(pos, axis=0)  # a row take: ~10x faster than fancy indexing cells[pos]
        v = c[:, 1]
        hit = (c[:, 0] == keys) & (v != _EMPTY) & (v != _DELETED)
        cell = np.where(hit, pos, -1)
        val = np.where(hit, v, _EMPTY)
        todo = np.flatnonzero(~hit & (v != _EMPTY))
        start = pos[todo] + 1
        for _ in range(_SINGLE_ROUNDS):  # short chains: one cell per round (a cheap 1-D gather)
            if not len(todo):
                return cell, val
            p = start & mask
            c = self.cells.take(p, axis=0)
            v = c[:, 1]
            found = (c[:, 0] == keys[todo]) & (v != _EMPTY) & (v != _DELETED)
            cell[todo[found]] = p[found]
            val[todo[found]] = v[found]
            more = ~found & (v != _EMPTY)
            todo, start = todo[more], p[more] + 1
        while len(todo):  # the rare long chain: windows of cells per round
            win = (start[:, None] + _STEPS) & mask
            w = self.cells.take(win, axis=0)
            wv = w[:, :, 1]
            match = (w[:, :, 0] == keys[todo][:, None]) & (wv != _EMPTY) & (wv != _DELETED)
            stop = match | (wv == _EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(len(todo))
            found = match[rows, first]
            cell[todo[found]] = win[rows[found], first[found]]
            val[todo[found]] = wv[rows[found], first[found]]
            more = ~stop.any(axis=1)
            todo, start = todo[more], (start[more] + _WINDOW) & mask
        return cell, val

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Value of each key (uint64 array in, intp out), 0 where absent."""
        if len(keys) <= SMALL_BATCH:
            return np.array(self.find_few(keys.tolist()), dtype=np.intp)
        return self._probe(keys)[1].astype(np.intp)

    def find_few(self, keys: list[int]) -> list[int]:
        """:meth:`find` in plain Python, for a handful of keys."""
        cells, mask, shift = self.cells, (1 << self.bits) - 1, 64 - self.bits
        out = []
        for k in keys:
            p = ((k * _PHI_INT) & _M64) >> shift
            while True:
                cv = cells.item(p, 1)
                if cv == 0:
                    out.append(0)
                    break
                if cv != _DELETED_INT and cells.item(p, 0) == k:
                    out.append(cv)
                    break
                p = (p + 1) & mask
        return out

    def get(self, key: int) -> int | None:
        return self.find_few([int(key)])[0] or None

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Add distinct keys known to be absent, with values in ``[1, 2**64 - 2]``."""
        if not len(keys):
            return
        if 2 * (self.used + self.deleted + len(keys)) > (1 << self.bits):
            self._rebuild(self.used + len(keys))
        if len(keys) <= SMALL_BATCH:
            self._insert_few(keys.tolist(), np.asarray(vals).tolist())
            return
        mask = (1 << self.bits) - 1
        vals = np.asarray(vals).astype(np.uint64)
        start = self._home(keys)
        todo = np.arange(len(keys))
        while len(todo):
            # each key takes the first free cell of a window on its probe chain; keys that pick
            # the same cell: one wins, the others look again from the same start
            win = (start[todo][:, None] + _STEPS) & mask
            wv = self.cells[win, 1]
            free = (wv == _EMPTY) | (wv == _DELETED)
            has = free.any(axis=1)
            rows = np.flatnonzero(has)
            cell = win[rows, free[rows].argmax(axis=1)]
            first = first_occurrences(cell)
            won, cell = rows[first], cell[first]
            self.deleted -= int((self.cells[cell, 1] == _DELETED).sum())
            self.cells[cell, 0] = keys[todo[won]]
            self.cells[cell, 1] = vals[todo[won]]
            self.used += len(won)
            start[todo[~has]] += _WINDOW
            keep = np.ones(len(todo), dtype=bool)
            keep[won] = False
            todo = todo[keep]
            start[todo] &= mask

    def _insert_few(self, keys: list[int], vals: list[int]) -> None:
        """The same insertion, one key at a time in plain Python: cheaper than a dozen numpy
        calls when a batch has only a few keys (a request's newly appended blocks)."""
        cells, mask, shift = self.cells, (1 << self.bits) - 1, 64 - self.bits
        for k, v in zip(keys, vals):
            p = ((k * _PHI_INT) & _M64) >> shift
            while True:
                cv = cells.item(p, 1)
                if cv == 0 or cv == _DELETED_INT:
                    break
                p = (p + 1) & mask
            if cv == _DELETED_INT:
                self.deleted -= 1
            cells[p] = (k, v)
            self.used += 1

    def delete(self, keys: np.ndarray) -> None:
        """Remove keys (absent ones are ignored)."""
        cell = self._probe(keys)[0]
        cell = np.unique(cell[cell >= 0])
        self.cells[cell, 1] = _DELETED
        self.used -= len(cell)
        self.deleted += len(cell)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        v = self.cells[:, 1]
        live = (v != _EMPTY) & (v != _DELETED)
        return self.cells[live, 0], v[live].astype(np.intp)

    def _rebuild(self, live: int) -> None:
        keys, vals = self.items()
        self._alloc(max(4, int(4 * max(live, 1) - 1).bit_length()))
        self.insert(keys, vals)
