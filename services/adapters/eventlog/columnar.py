"""Format 2 of the DuckDB event log: columnar batches from Arrow, block lists stored once.

Measured on a simulated run of the calibration sessions (docs/recorder.md, "Format"): 97% of
a format-1 log's JSON was block hashes (``blocks`` of RequestSubmitted, KvStored, KvEvicted,
KvMoved, KvFetched, ContextCompacted), each one written again in every event that names it
(a prompt's hashes come back in every later prompt of its branch, in its stores, moves and
fetches). Format 2 writes each distinct hash **once**, in ``block_dict(id, hash)`` (ids dense,
0, 1, 2, ... in order of first appearance), and an event's list as the ids
(``event_rows.block_ids UINTEGER[]``): a prompt's ids are consecutive runs, which DuckDB's
delta bit-packing stores in a few bits each.

Order is kept exactly. A list whose hashes come in ascending runs (the eviction policies order
ties by hash) is stored with its ids sorted within each run and ``block_keys`` holding each
id's run number; reading sorts each run by hash again. ``block_keys`` is NULL for the other
lists (kept in their order). An event without blocks (or with an empty list) has
``block_ids`` NULL and its payload as it was; an event with blocks has them taken out of its
payload (``"blocks":[]``, a key that can only be the event's own: a string value would carry
its quotes escaped) and put back in its place by the ``events`` view (SQL: the payload text is
the format-1 one, byte for byte) and by :func:`decode_row` (Python).

Everything here is pure encoding (Arrow tables in, Arrow tables out); the DuckDB side is in
:mod:`services.adapters.eventlog.duckdb_log`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np

from events.catalog import Event
from events.codec import CodecError, from_json, to_json

#: ``log_meta.format`` of the logs this module writes (format 1: no key, ``events`` a table).
FORMAT = "2"
FORMATS = ("1", FORMAT)

#: A list is stored by ascending-hash runs when it has at most one run per this many blocks.
_RUN_FACTOR = 8

SCHEMA_V2 = """
CREATE TABLE IF NOT EXISTS event_rows (
    seq UBIGINT NOT NULL,
    ts DOUBLE NOT NULL,
    type VARCHAR NOT NULL,
    src VARCHAR NOT NULL,
    subject VARCHAR NOT NULL,
    payload VARCHAR NOT NULL USING COMPRESSION zstd,
    block_starts UINTEGER[],
    block_lens UINTEGER[],
    block_segs UINTEGER[]
);
CREATE TABLE IF NOT EXISTS block_dict (id UINTEGER NOT NULL, hash UBIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS log_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS run_config (key VARCHAR PRIMARY KEY, value JSON NOT NULL);
"""

def events_view_sql(prefix: str = "") -> str:
    """The format-1 ``events`` relation (``seq, ts, type, src, subject, payload JSON``, the
    payload whole) over the format-2 tables; ``prefix``: a database qualifier (``src0.main.``)."""
    return f"""
SELECT r.seq, r.ts, r.type, r.src, r.subject,
       CAST(CASE WHEN r.block_starts IS NULL THEN r.payload
            ELSE replace(r.payload, '"blocks":[]', '"blocks":' || CAST(to_json(b.blocks) AS VARCHAR)) END
            AS JSON) AS payload
FROM {prefix}event_rows r
LEFT JOIN (
    SELECT u.seq, list(d.hash ORDER BY u.k, CASE WHEN u.keyed THEN d.hash ELSE 0 END) AS blocks
    FROM (SELECT seq, keyed, unnest(ids) AS id, unnest(keys) AS k
          FROM (SELECT seq, block_segs IS NOT NULL AS keyed,
                       flatten(list_transform(range(len(block_starts)),
                           lambda i: range(block_starts[i + 1], block_starts[i + 1] + block_lens[i + 1]))) AS ids,
                       CASE WHEN block_segs IS NULL THEN range(list_sum(block_lens)::BIGINT)
                       ELSE flatten(list_transform(range(len(block_segs)),
                           lambda i: list_resize([]::BIGINT[], block_lens[i + 1], block_segs[i + 1]))) END AS keys
                FROM {prefix}event_rows WHERE block_starts IS NOT NULL)) u
    JOIN {prefix}block_dict d ON d.id = u.id
    GROUP BY u.seq) b ON b.seq = r.seq"""


class BlockDict:
    """The log's hash -> id dictionary (ids dense from 0, in order of first appearance).

    Lookups are vectorized: an open-addressing hash table in NumPy arrays (the hashes are
    uniformly random 64-bit values, so their low bits are the slot; linear probing, at most 60%
    full). A batch's new hashes enter the table when the batch is stored (:meth:`commit`)."""

    _MAX_LOAD = 0.6

    def __init__(self, hashes: np.ndarray | Sequence[int] = ()) -> None:
        arr = np.asarray(hashes, dtype=np.uint64)
        self._by_id = [arr]
        self._flat: np.ndarray | None = arr
        self.size = len(arr)
        self._alloc(len(arr))
        self._insert(arr, np.arange(len(arr), dtype=np.uint32))

    def _alloc(self, n: int) -> None:
        cap = 1024
        while cap * self._MAX_LOAD < n:
            cap *= 2
        self._mask = np.uint64(cap - 1)
        self._keys = np.zeros(cap, dtype=np.uint64)
        self._vals = np.zeros(cap, dtype=np.uint32)  # id + 1; 0: an empty slot
        self._claim = np.empty(cap, dtype=np.intp)  # scratch of _insert (read only where just written)

    def _insert(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Put ``keys`` (distinct, not in the table) with their ``ids`` in the table."""
        slot = (keys & self._mask).astype(np.intp)
        todo = np.arange(len(keys))
        mask = int(self._mask)
        claim = self._claim
        while len(todo):
            s = slot[todo]
            free = self._vals[s] == 0
            cand, cs = todo[free], s[free]
            claim[cs] = cand  # one key per free slot this round: whichever write landed
            win = cand[claim[cs] == cand]
            self._keys[slot[win]] = keys[win]
            self._vals[slot[win]] = ids[win] + 1
            placed = np.zeros(len(keys), dtype=bool)
            placed[win] = True
            todo = todo[~placed[todo]]
            slot[todo] = (slot[todo] + 1) & mask

    def hashes(self) -> np.ndarray:
        """Every hash by id (``hashes()[i]`` is id ``i``'s)."""
        if self._flat is None or len(self._flat) != self.size:
            self._flat = np.concatenate(self._by_id)
            self._by_id = [self._flat]
        return self._flat

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, found)``: the id of each of ``h`` where known."""
        slot = (h & self._mask).astype(np.intp)
        v = self._vals[slot]  # the first probe over the whole batch (most keys end here)
        occupied = v != 0
        found = occupied & (self._keys[slot] == h)
        ids = np.where(found, v - 1, 0).astype(np.uint32)
        todo = np.flatnonzero(occupied & ~found)
        mask = int(self._mask)
        slot[todo] = (slot[todo] + 1) & mask
        while len(todo):
            s = slot[todo]
            v = self._vals[s]
            occupied = v != 0
            hit = occupied & (self._keys[s] == h[todo])
            ids[todo[hit]] = v[hit] - 1
            found[todo[hit]] = True
            todo = todo[occupied & ~hit]
            slot[todo] = (slot[todo] + 1) & mask
        return ids, found

    def encode(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``h``; hashes never seen get the next ids. Returns ``(ids, new hashes)``;
        call :meth:`commit` once they are stored, :meth:`undo` if not."""
        ids, found = self.lookup(h)
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
        """The ids given to ``new`` (the last :meth:`encode`'s) are stored: keep them."""
        if not len(new):
            return
        self._by_id.append(new)
        first = self.size - len(new)
        if self.size > len(self._keys) * self._MAX_LOAD:  # grow: every hash again
            self._alloc(self.size)
            self._insert(self.hashes(), np.arange(self.size, dtype=np.uint32))
        else:
            self._insert(new, np.arange(first, self.size, dtype=np.uint32))

    def undo(self, new: np.ndarray) -> None:
        """The batch that gave ``new`` their ids was not stored: give the ids back."""
        self.size -= len(new)


def encode_rows(rows: Sequence[tuple[int, str, Event]], bd: BlockDict) -> tuple[object, object, np.ndarray]:
    """A batch as ``(event_rows table, block_dict rows to add, the new hashes)``; the new hashes'
    ids are taken in ``bd`` (call ``bd.commit(new)`` once stored, ``bd.undo(new)`` if not)."""
    import pyarrow as pa  # lazy: 0.3-0.6 s to import; writers only (readers of a log never need it)

    n = len(rows)
    seq = np.fromiter((r[0] for r in rows), dtype=np.uint64, count=n)
    ts = np.fromiter((r[2].ts for r in rows), dtype=np.float64, count=n)
    typ = [type(r[2]).__name__ for r in rows]
    src = [r[2].src for r in rows]
    subject = [r[1] for r in rows]
    replace = msgspec.structs.replace
    lists: list[list[int]] = []
    has = np.zeros(n, dtype=bool)
    payload = []
    for i, (_, _, ev) in enumerate(rows):
        blocks = getattr(ev, "blocks", None)
        if blocks:
            has[i] = True
            lists.append(blocks)
            payload.append(to_json(replace(ev, blocks=[])).decode())
        else:
            payload.append(to_json(ev).decode())
    first_new = bd.size
    starts, lens, segs, new = _runs(lists, bd)
    try:
        u32 = pa.list_(pa.uint32())
        schema = pa.schema([("seq", pa.uint64()), ("ts", pa.float64()), ("type", pa.string()), ("src", pa.string()),
                            ("subject", pa.string()), ("payload", pa.string()),
                            ("block_starts", u32), ("block_lens", u32), ("block_segs", u32)])
        events = pa.Table.from_arrays(
            [pa.array(seq), pa.array(ts), pa.array(typ, pa.string()), pa.array(src, pa.string()),
             pa.array(subject, pa.string()), pa.array(payload, pa.string()),
             *_lists(pa, has, starts, lens, segs)], schema=schema)
        added = pa.Table.from_arrays([pa.array(np.arange(first_new, first_new + len(new), dtype=np.uint32)),
                                      pa.array(new, pa.uint64())], names=["id", "hash"])
    except BaseException:
        bd.undo(new)
        raise
    return events, added, new


def _runs(lists: list[list[int]], bd: BlockDict):
    """Per list: run starts, run lengths (over ids) and run segment numbers (None: in order).

    Returned flat with per-list run counts: ``(starts, lens, segs, new)`` where ``starts`` etc.
    are ``(values, counts_per_list)`` and ``segs`` holds a mask of the keyed lists."""
    m = len(lists)
    sizes = np.fromiter((len(b) for b in lists), dtype=np.int64, count=m)
    total = int(sizes.sum())
    h = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.uint64, count=total)
    ids, new = bd.encode(h)
    if not m:
        return (ids, sizes), (ids, sizes), (np.zeros(0, bool), ids, sizes), new
    off = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    lst = np.repeat(np.arange(m), sizes)  # list index of each element
    head = np.zeros(total, dtype=bool)
    head[off[:-1]] = True
    # ascending-hash segments: a new segment where the hash goes down (or a list starts)
    seg_start = head.copy()
    seg_start[1:] |= h[1:] < h[:-1]
    seg_global = np.cumsum(seg_start) - 1
    nseg = np.bincount(lst, weights=seg_start, minlength=m)
    keyed = (sizes >= 2 * _RUN_FACTOR) & (nseg * _RUN_FACTOR <= sizes)
    ek = keyed[lst]
    if ek.any():  # sort the ids of keyed lists within each segment
        idx = np.flatnonzero(ek)
        order = np.lexsort((ids[idx], seg_global[idx]))
        ids[idx] = ids[idx][order]
    # runs: a new run at a list start, a segment start (keyed lists) or a break in consecutive ids
    run_start = head.copy()
    run_start[1:] |= ids[1:] != ids[:-1] + 1
    run_start |= seg_start & ek
    rpos = np.flatnonzero(run_start)
    rlens = np.diff(np.append(rpos, total)).astype(np.uint32)
    rcount = np.bincount(lst[rpos], minlength=m)
    seg_first = seg_global[off[:-1]]  # each list's first segment number
    rsegs = (seg_global[rpos] - seg_first[lst[rpos]]).astype(np.uint32)
    return (ids[rpos], rcount), (rlens, rcount), (keyed, rsegs, rcount), new


def _lists(pa, has: np.ndarray, starts, lens, segs) -> list:
    """The three list columns (NULL where an event has no blocks; segs NULL unless keyed)."""
    n = len(has)
    counts = np.zeros(n, dtype=np.int32)
    counts[has] = starts[1]
    off = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=off[1:])
    mask = pa.array(~has)
    out = [pa.ListArray.from_arrays(pa.array(off), pa.array(starts[0].astype(np.uint32)), mask=mask),
           pa.ListArray.from_arrays(pa.array(off), pa.array(lens[0]), mask=mask)]
    keyed_list, rsegs, rcount = segs
    keyed = np.zeros(n, dtype=bool)
    keyed[has] = keyed_list
    kcounts = np.zeros(n, dtype=np.int32)
    kcounts[keyed] = rcount[keyed_list]
    koff = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(kcounts, out=koff[1:])
    run_keyed = np.repeat(keyed_list, rcount)
    out.append(pa.ListArray.from_arrays(pa.array(koff), pa.array(rsegs[run_keyed]), mask=pa.array(~keyed)))
    return out


def decode_blocks(hashes: np.ndarray, starts: Sequence[int], lens: Sequence[int], segs: Sequence[int] | None) -> list[int]:
    """An event's block list from its stored runs (and their segment numbers)."""
    if len(starts) == 1 and segs is None:
        return hashes[starts[0]:starts[0] + lens[0]].tolist()
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    base = np.repeat(np.asarray(starts, dtype=np.int64) - (np.cumsum(lens) - lens), lens)
    h = hashes[base + np.arange(total)]
    if segs is not None:
        h = h[np.lexsort((h, np.repeat(np.asarray(segs, dtype=np.int64), lens)))]
    return h.tolist()


def decode_row(seq: int, payload: str, blocks: list[int] | None) -> Event:
    """One stored row back to its event (``blocks``: the list taken out of its payload)."""
    try:
        ev = from_json(payload)
    except CodecError as exc:
        raise CodecError(f"event log row seq={seq}: {exc.reason}") from exc
    if blocks is not None:
        ev = msgspec.structs.replace(ev, blocks=blocks)
    return ev
