"""The event log writer's block dictionary: hash -> id, vectorized over a batch, bounded or not.

Pure: NumPy arrays in, NumPy arrays out (:mod:`services.adapters.eventlog.columnar` encodes
with it; docs/recorder.md, "Format").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.cores.directory._native import SlotMap


class _Table:
    """An open-addressing hash table from uint64 hashes to uint32 ids in NumPy arrays (the
    hashes are uniformly random 64-bit values, so their low bits are the slot; linear probing).
    ``vals`` holds id + 1; 0 is an empty slot."""

    def __init__(self, slots: int) -> None:
        self.mask = np.uint64(slots - 1)
        self.keys = np.zeros(slots, dtype=np.uint64)
        self.vals = np.zeros(slots, dtype=np.uint32)
        self.count = 0

    @property
    def slots(self) -> int:
        return len(self.keys)

    def clear(self) -> None:
        self.vals.fill(0)  # keys of empty slots are never compared
        self.count = 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(hashes, ids)`` of every entry."""
        nz = np.flatnonzero(self.vals)
        return self.keys[nz], self.vals[nz] - 1

    def insert(self, keys: np.ndarray, ids: np.ndarray, claim: np.ndarray) -> None:
        """Put ``keys`` (distinct, not in the table) with their ``ids`` in the table; ``claim``:
        scratch of at least ``slots`` entries (read only where just written)."""
        slot = (keys & self.mask).astype(np.intp)
        todo = np.arange(len(keys))
        mask = int(self.mask)
        while len(todo):
            s = slot[todo]
            free = self.vals[s] == 0
            cand, cs = todo[free], s[free]
            claim[cs] = cand  # one key per free slot this round: whichever write landed
            win = cand[claim[cs] == cand]
            self.keys[slot[win]] = keys[win]
            self.vals[slot[win]] = ids[win] + 1
            placed = np.zeros(len(keys), dtype=bool)
            placed[win] = True
            todo = todo[~placed[todo]]
            slot[todo] = (slot[todo] + 1) & mask
        self.count += len(keys)

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, found)``: the id of each of ``h`` where known."""
        slot = (h & self.mask).astype(np.intp)
        v = self.vals[slot]  # the first probe over the whole batch (most keys end here)
        occupied = v != 0
        found = occupied & (self.keys[slot] == h)
        ids = np.where(found, v - 1, 0).astype(np.uint32)
        todo = np.flatnonzero(occupied & ~found)
        mask = int(self.mask)
        slot[todo] = (slot[todo] + 1) & mask
        while len(todo):
            s = slot[todo]
            v = self.vals[s]
            occupied = v != 0
            hit = occupied & (self.keys[s] == h[todo])
            ids[todo[hit]] = v[hit] - 1
            found[todo[hit]] = True
            todo = todo[occupied & ~hit]
            slot[todo] = (slot[todo] + 1) & mask
        return ids, found


class _MapTable:
    """:class:`_Table`'s interface over the directory's compiled ``uint64 -> int`` table
    (:class:`~services.cores.directory._native.SlotMap`, values id + 1): an unbounded
    dictionary's. One C probe per hash instead of a dozen array passes over the batch: a
    simulated run's log looks up every block of every event (~40 M on 30 minutes of the
    calibration sessions; 15 ns a hash against 42, docs/simulator.md §8). It grows by itself
    (at 1/2 load), so the bounded dictionary, whose tables must keep their size, keeps
    :class:`_Table`."""

    def __init__(self, slots: int) -> None:
        self._map = SlotMap(slots)

    @property
    def count(self) -> int:
        return len(self._map)

    @property
    def slots(self) -> int:
        return self._map.capacity

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        keys, vals = self._map.items()
        return keys, (vals - 1).astype(np.uint32)

    def insert(self, keys: np.ndarray, ids: np.ndarray, claim: np.ndarray | None = None) -> None:
        self._map.insert(np.ascontiguousarray(keys, dtype=np.uint64), ids.astype(np.int64) + 1)

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        v = self._map.find(np.ascontiguousarray(h, dtype=np.uint64))
        found = v > 0
        return np.where(found, v - 1, 0).astype(np.uint32), found


def _slots_for(n: int, load: float) -> int:
    cap = 1024
    while cap * load < n:
        cap *= 2
    return cap


class BlockDict:
    """The writer's hash -> id dictionary (ids dense from 0, in order of first appearance).

    Lookups are vectorized over a batch (:class:`_Table`, at most 60% full; unbounded, the
    compiled :class:`_MapTable`, at most 50%). A batch's new
    hashes enter the table when the batch is stored (:meth:`commit`).

    ``max_entries`` bounds its memory (a long-running writer: the recorder). The dictionary
    then has two generations of at most ``max_entries`` hashes each, in tables of a fixed size:
    a hash is looked up in the current one, then in the previous one (found there, it keeps its
    id and moves to the current one); when the current one is full, it becomes the previous one
    and the old previous one is emptied and reused. A hash seen in neither (unseen for a whole
    generation) gets a new id and is stored again: readers decode by id, so the log reads the
    same, with a hash stored once per generation in which it recurs instead of once in all.
    Unbounded (``None``, a simulation's log): one table that doubles, every hash once."""

    _MAX_LOAD = 0.6
    _BOUNDED_LOAD = 0.5  # a bounded table's load at max_entries: a batch's overshoot fits under _MAX_LOAD

    def __init__(self, hashes: np.ndarray | Sequence[int] = (), ids: np.ndarray | Sequence[int] | None = None, *,
                 size: int | None = None, max_entries: int | None = None) -> None:
        keys = np.asarray(hashes, dtype=np.uint64)
        ids = np.arange(len(keys), dtype=np.uint32) if ids is None else np.asarray(ids, dtype=np.uint32)
        if len(keys):  # a hash stored under several ids (a bounded writer's log): its newest id
            order = np.argsort(ids, kind="stable")[::-1]
            _, first = np.unique(keys[order], return_index=True)
            keep = order[first]
            keys, ids = keys[keep], ids[keep]
        self.size = int(size if size is not None else (int(ids.max()) + 1 if len(ids) else 0))
        self.max_entries = max_entries
        self._old: _Table | None = None
        self._cur: _Table | _MapTable
        if max_entries is None:
            self._cur = _MapTable(_slots_for(len(keys), self._MAX_LOAD))
        else:
            assert max_entries >= 1, "a bounded dictionary holds at least one hash"
            if len(keys) > max_entries:  # the newest ids
                newest = np.argsort(ids, kind="stable")[-max_entries:]
                keys, ids = keys[newest], ids[newest]
            self._cur = _Table(_slots_for(max_entries, self._BOUNDED_LOAD))
            self._old = _Table(self._cur.slots)
        self._claim = np.empty(self._cur.slots, dtype=np.intp)
        self._cur.insert(keys, ids, self._claim)
        self._promoted: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def entries(self) -> int:
        """Hashes the dictionary holds now (every one seen when unbounded)."""
        return self._cur.count + (self._old.count if self._old is not None else 0)

    @property
    def nbytes(self) -> int:
        """Memory of its tables (fixed when bounded)."""
        tables = [t for t in (self._cur, self._old) if t is not None]
        return sum(16 * t.slots if isinstance(t, _MapTable) else t.keys.nbytes + t.vals.nbytes
                   for t in tables) + self._claim.nbytes

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, found)``: the id of each of ``h`` where known."""
        ids, found = self._cur.lookup(h)
        if self._old is not None and self._old.count and not found.all():
            miss = np.flatnonzero(~found)
            oids, ofound = self._old.lookup(h[miss])
            ids[miss[ofound]] = oids[ofound]
            found[miss[ofound]] = True
        return ids, found

    def encode(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``h``; hashes not held get the next ids. Returns ``(ids, new hashes)``;
        call :meth:`commit` once they are stored, :meth:`undo` if not."""
        ids, found = self._cur.lookup(h)
        self._promoted = None
        if self._old is not None and self._old.count and not found.all():
            miss = np.flatnonzero(~found)
            oids, ofound = self._old.lookup(h[miss])
            if ofound.any():
                hit = miss[ofound]
                ids[hit] = oids[ofound]
                found[hit] = True
                keys, first = np.unique(h[hit], return_index=True)
                self._promoted = (keys, ids[hit][first])
        if found.all():
            return ids, np.empty(0, dtype=np.uint64)
        miss = np.flatnonzero(~found)
        hm = h[miss]
        order = np.argsort(hm)  # equal hashes together (any order among them)
        sh = hm[order]
        head = np.ones(len(sh), dtype=bool)
        head[1:] = sh[1:] != sh[:-1]
        starts = np.flatnonzero(head)
        first = np.minimum.reduceat(order, starts)  # each distinct hash's first position
        group = np.cumsum(head) - 1  # sorted position -> distinct hash
        by_first = np.argsort(first)  # ids in order of first appearance (positions are distinct)
        rank = np.empty(len(starts), dtype=np.uint32)
        rank[by_first] = np.arange(len(starts), dtype=np.uint32)
        inv = np.empty(len(hm), dtype=np.intp)
        inv[order] = group
        ids[miss] = self.size + rank[inv]
        new = sh[starts][by_first]
        self.size += len(new)
        return ids, new

    def commit(self, new: np.ndarray) -> None:
        """The ids given to ``new`` (the last :meth:`encode`'s) are stored: keep them (and
        move the hashes that batch found in the previous generation to the current one)."""
        first = self.size - len(new)
        keys, ids = [new], [np.arange(first, self.size, dtype=np.uint32)]
        if self._promoted is not None:
            keys.append(self._promoted[0])
            ids.append(self._promoted[1])
            self._promoted = None
        keys, ids = np.concatenate(keys), np.concatenate(ids)
        if not len(keys):
            return
        cur = self._cur
        if isinstance(cur, _MapTable):  # unbounded: the compiled table grows by itself
            cur.insert(keys, ids)
            return
        if cur.count + len(keys) > cur.slots * self._MAX_LOAD:  # grow: every entry again
            held, held_ids = cur.items()
            self._cur = _Table(_slots_for(cur.count + len(keys), self._MAX_LOAD))
            if len(self._claim) < self._cur.slots:
                self._claim = np.empty(self._cur.slots, dtype=np.intp)
            self._cur.insert(held, held_ids, self._claim)
        self._cur.insert(keys, ids, self._claim)
        if self.max_entries is not None and self._cur.count >= self.max_entries:
            spare = self._old if self._old is not None and self._old.slots == self._cur.slots else None
            self._old = self._cur
            if spare is None:
                spare = _Table(self._old.slots)
            else:
                spare.clear()
            self._cur = spare

    def undo(self, new: np.ndarray) -> None:
        """The batch that gave ``new`` their ids was not stored: give the ids back."""
        self.size -= len(new)
        self._promoted = None
