"""Formats 2 and 3 of the DuckDB event log: columnar batches from Arrow, block lists stored once.

Measured on a simulated run of the calibration sessions (docs/recorder.md, "Format"): 97% of
a format-1 log's JSON was block hashes (``blocks`` of RequestSubmitted, KvStored, KvEvicted,
KvMoved, KvFetched, ContextCompacted), each one written again in every event that names it
(a prompt's hashes come back in every later prompt of its branch, in its stores, moves and
fetches). Format 2 writes each distinct hash once, in ``block_dict(id, hash)`` (ids dense,
0, 1, 2, ... in order of first appearance), and an event's list as runs of ids
(``block_starts``, ``block_lens``): a prompt's ids are consecutive runs. A writer with a bounded
dictionary (:class:`BlockDict` ``max_entries``: the recorder) stores a hash again, under a new
id, when it comes back after a generation unseen; readers decode by id and never notice.

Order is kept exactly. A list whose hashes come in ascending runs (the eviction policies order
ties by hash) is *keyed*: stored with its ids sorted within each ascending segment and
``block_segs`` holding each run's segment; reading sorts each segment by hash again.
``block_segs`` is NULL for the other lists (kept in their order). **Format 3** adds sparse
bitmaps for the keyed lists where they are smaller (an eviction is a scattered subset of its
prompts' ids, ~2.7 ids a run): per 64-bit word with a bit set, ``bitmap_words`` (``id // 64``),
``bitmap_segs`` (its segment) and ``bitmap_bits`` (the word); the run columns are NULL then.
An event without blocks (or with an empty list) has every list column NULL and its payload as
it was; an event with blocks has them taken out of its payload (``"blocks":[]``, a key that can
only be the event's own: a string value would carry its quotes escaped) and put back in its
place by the ``events`` view (SQL: the payload text is the format-1 one, byte for byte) and by
:func:`decode_row` (Python).

Everything here is pure encoding (Arrow tables in, Arrow tables out); the DuckDB side is in
:mod:`services.adapters.eventlog.duckdb_log`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from events.catalog import Event
from services.adapters.eventlog.blockdict import BlockDict
from services.adapters.eventlog.payload import decode_payload, encode_payload
from services.cores.directory._native import concat_u64

__all__ = ["FORMAT", "FORMATS", "SCHEMA_V2", "SCHEMA_V3", "BlockDict", "blocks_len_sql", "blocks_sql", "decode_bitmap", "decode_blocks",
           "decode_row", "encode_rows", "events_view_sql", "rows_from_sql"]

#: ``log_meta.format`` of the logs this module writes (format 1: no key, ``events`` a table;
#: format 2: runs only; format 3: runs, and bitmaps for the keyed lists where smaller).
FORMAT = "3"
FORMATS = ("1", "2", FORMAT)

#: Bits a stored run costs, roughly (a start and a length, bit-packed), and a bitmap word (the
#: word, its number, its segment): a keyed list is stored as a sparse bitmap when
#: ``_WORD_BITS * words < _RUN_BITS * runs``.
_RUN_BITS = 30
_WORD_BITS = 82

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

#: Format 3: format 2's tables, and a keyed list's segments as sparse bitmaps of ids (an
#: eviction's blocks are a scattered subset of their prompts' ids: ~2.7 blocks a run, 95% of a
#: format-2 log's runs): per 64-bit word with a bit set, its word number (``id // 64``), its
#: segment and the word (bit ``j``: id ``64 * word + j``). The run columns are NULL for such a list.
SCHEMA_V3 = SCHEMA_V2.replace("""    block_segs UINTEGER[]
);""", """    block_segs UINTEGER[],
    bitmap_words UINTEGER[],
    bitmap_segs UINTEGER[],
    bitmap_bits UBIGINT[]
);""")

#: The block dictionary as one list, ``h[id + 1]`` the hash of ``id`` (ids are dense from 0; a
#: missing id reads as NULL in its place), built once per query.
_DICT_SQL = """(SELECT list(d.hash ORDER BY g.i) AS h
    FROM range(0, (SELECT coalesce(max(id) + 1, 0) FROM {prefix}block_dict)) g(i)
    LEFT JOIN {prefix}block_dict d ON d.id = g.i)"""

#: A row's list from its runs, in order (``block_segs`` NULL) ...
_PLAIN_SQL = """flatten(list_transform(range(len(r.block_starts)), lambda i: list_transform(
        range(r.block_starts[i + 1], r.block_starts[i + 1] + r.block_lens[i + 1]), lambda x: d.h[x + 1])))"""
#: ... keyed: by segment, then by hash within a segment (runs) ...
_KEYED_SQL = """list_transform(list_sort(flatten(list_transform(range(len(r.block_starts)), lambda i: list_transform(
        range(r.block_starts[i + 1], r.block_starts[i + 1] + r.block_lens[i + 1]),
        lambda x: {{'k': r.block_segs[i + 1], 'h': d.h[x + 1]}})))), lambda e: e.h)"""
#: ... or from the bitmap words (format 3), keyed the same way.
_BITS_SQL = """list_transform(list_sort(flatten(list_transform(range(len(r.bitmap_bits)), lambda w: list_transform(
        list_filter(range(64), lambda j: ((r.bitmap_bits[w + 1] >> j) & 1) = 1),
        lambda j: {{'k': r.bitmap_segs[w + 1], 'h': d.h[64 * r.bitmap_words[w + 1] + j + 1]}})))), lambda e: e.h)"""


#: A row's block count from its runs (NULL where the list is: no runs), as :func:`blocks_sql`'s
#: list would have it: a run ``(start, len)`` is ``len`` hashes (a missing id is a NULL in its
#: place), a run with a NULL start or length none ...
_RUNS_LEN_SQL = """CASE WHEN r.block_starts IS NULL THEN NULL ELSE coalesce(list_sum(list_transform(
        range(len(r.block_starts)), lambda i: CASE WHEN r.block_starts[i + 1] IS NULL THEN 0
        ELSE coalesce(r.block_lens[i + 1], 0) END)), 0) END"""
#: ... and from the bitmap words, a word its set bits.
_BITS_LEN_SQL = "coalesce(list_sum(list_transform(r.bitmap_bits, lambda w: coalesce(bit_count(w), 0))), 0)"


def blocks_sql(fmt: str = FORMAT) -> str:
    """A row's block list (``UBIGINT[]``, NULL for a row without one) from its own columns, over
    ``r`` (the ``event_rows`` row) and ``d`` (the dictionary list, :func:`rows_from_sql`)."""
    blocks = f"CASE WHEN r.block_segs IS NOT NULL THEN {_KEYED_SQL.format()} ELSE {_PLAIN_SQL} END"
    if fmt != "2":
        blocks = f"CASE WHEN r.bitmap_bits IS NOT NULL THEN {_BITS_SQL.format()} ELSE {blocks} END"
    return blocks


def blocks_len_sql(fmt: str = FORMAT) -> str:
    """``len()`` of :func:`blocks_sql`'s list (``BIGINT``, NULL where it is NULL), over ``r``
    alone: no dictionary, no list built (the ``n_blocks`` of ``requests`` counted 18 M hashes on a
    9-node half hour by building their lists, ~0.8 CPU s)."""
    n = _RUNS_LEN_SQL
    if fmt != "2":
        n = f"CASE WHEN r.bitmap_bits IS NOT NULL THEN {_BITS_LEN_SQL} ELSE {n} END"
    return f"CAST({n} AS BIGINT)"


def rows_from_sql(prefix: str = "") -> str:
    """The FROM clause :func:`blocks_sql` reads: the stored rows ``r`` and the dictionary ``d``."""
    return f"{prefix}event_rows r, {_DICT_SQL.format(prefix=prefix)} d"


def events_view_sql(prefix: str = "", fmt: str = FORMAT) -> str:
    """The format-1 ``events`` relation (``seq, ts, type, src, subject, payload JSON``, the
    payload whole) over the format-2 or format-3 tables; ``prefix``: a database qualifier
    (``src0.main.``).

    Each row's list is rebuilt from its own columns by list functions over the dictionary list
    (one lookup per hash), so a query pays for the rows it reads: rebuilding every list of the
    log in one join and group, as before, took 36-48 s on the README demo's log (7.3 M hashes)
    for any typed view, ``ev_route_decided`` included, whose events have no list."""
    plain = "r.block_starts IS NULL" + (" AND r.bitmap_bits IS NULL" if fmt != "2" else "")
    return f"""
SELECT r.seq, r.ts, r.type, r.src, r.subject,
       CAST(CASE WHEN {plain} THEN r.payload
            ELSE replace(r.payload, '"blocks":[]', '"blocks":' || CAST(to_json({blocks_sql(fmt)}) AS VARCHAR)) END
            AS JSON) AS payload
FROM {rows_from_sql(prefix)}"""


def encode_rows(rows: Sequence[tuple[int, str, Event]], bd: BlockDict, fmt: str = FORMAT) -> tuple[object, object, np.ndarray]:
    """A batch as ``(event_rows table, block_dict rows to add, the new hashes)``; the new hashes'
    ids are taken in ``bd`` (call ``bd.commit(new)`` once stored, ``bd.undo(new)`` if not).
    ``fmt``: the log's format (``"2"``: runs only, no bitmap columns)."""
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
            payload.append(encode_payload(replace(ev, blocks=[])).decode())
        else:
            payload.append(encode_payload(ev).decode())
    first_new = bd.size
    starts, lens, segs, new, bits = _runs(lists, bd, bitmaps=fmt != "2")
    try:
        u32 = pa.list_(pa.uint32())
        fields = [("seq", pa.uint64()), ("ts", pa.float64()), ("type", pa.string()), ("src", pa.string()),
                  ("subject", pa.string()), ("payload", pa.string()),
                  ("block_starts", u32), ("block_lens", u32), ("block_segs", u32)]
        bm = bits[0]
        runs_null = ~has
        runs_null[np.flatnonzero(has)[bm]] = True
        cols = [pa.array(seq), pa.array(ts), pa.array(typ, pa.string()), pa.array(src, pa.string()),
                pa.array(subject, pa.string()), pa.array(payload, pa.string()),
                *_lists(pa, has, starts, lens, segs, null=runs_null)]
        if fmt != "2":
            fields += [("bitmap_words", u32), ("bitmap_segs", u32), ("bitmap_bits", pa.list_(pa.uint64()))]
            cols += _bitmap_lists(pa, has, *bits)
        events = pa.Table.from_arrays(cols, schema=pa.schema(fields))
        added = pa.Table.from_arrays([pa.array(np.arange(first_new, first_new + len(new), dtype=np.uint32)),
                                      pa.array(new, pa.uint64())], names=["id", "hash"])
    except BaseException:
        bd.undo(new)
        raise
    return events, added, new


def _runs(lists: list[list[int]], bd: BlockDict, bitmaps: bool = True):
    """Per list: run starts, run lengths (over ids) and run segment numbers (None: in order),
    or (``bitmaps``) for a keyed list where smaller, its segments as bitmaps.

    Returned flat with per-list run counts: ``(starts, lens, segs, new, bits)`` where ``starts``
    etc. are ``(values, counts_per_list)``, ``segs`` holds a mask of the keyed lists and
    ``bits`` is ``(bitmap mask per list, word numbers, word segments, words, words per such list)`` of the lists
    stored as bitmaps (no runs: their run counts are 0)."""
    m = len(lists)
    sizes = np.fromiter((len(b) for b in lists), dtype=np.int64, count=m)
    total = int(sizes.sum())
    h = concat_u64(lists, total)  # compiled: no generator step per hash, ints read from their digits
    ids, new = bd.encode(h)
    no_bits = (np.zeros(m, dtype=bool), np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint64),
               np.zeros(0, np.int64))
    if not m:
        return (ids, sizes), (ids, sizes), (np.zeros(0, bool), ids, sizes), new, no_bits
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
        # one sort of (segment << 32 | id): segments are numbered in order, so this sorts
        # within each; only the sorted ids are needed, not the permutation (a 2-key lexsort
        # was ~300 ns an id, 5% of a simulated run's CPU; this is ~20)
        idx = np.flatnonzero(ek)
        key = (seg_global[idx].astype(np.uint64) << np.uint64(32)) | ids[idx]
        key.sort()
        ids[idx] = key.astype(np.uint32)  # the low 32 bits: the ids
    # runs: a new run at a list start, a segment start (keyed lists) or a break in consecutive ids
    run_start = head.copy()
    run_start[1:] |= ids[1:] != ids[:-1] + 1
    run_start |= seg_start & ek
    rpos = np.flatnonzero(run_start)
    rlens = np.diff(np.append(rpos, total)).astype(np.uint32)
    rcount = np.bincount(lst[rpos], minlength=m)
    seg_first = seg_global[off[:-1]]  # each list's first segment number
    rsegs = (seg_global[rpos] - seg_first[lst[rpos]]).astype(np.uint32)
    bits = _bitmaps(h, ids, off, seg_global, keyed, rcount, lst) if bitmaps and keyed.any() else no_bits
    bm = bits[0]
    if bm.any():  # those lists' runs are not stored
        keep = ~bm[lst[rpos]]
        rpos, rlens, rsegs = rpos[keep], rlens[keep], rsegs[keep]
        rcount = np.where(bm, 0, rcount)
        keyed = keyed & ~bm
    return (ids[rpos], rcount), (rlens, rcount), (keyed, rsegs, rcount), new, bits


def _bitmaps(h: np.ndarray, ids: np.ndarray, off: np.ndarray, seg_global: np.ndarray, keyed: np.ndarray,
             rcount: np.ndarray, lst: np.ndarray):
    """The keyed lists that are smaller as sparse bitmaps (``_WORD_BITS * words < _RUN_BITS *
    runs``) and whose segments hold distinct hashes (a bitmap is a set), as ``(mask, word
    numbers, word segments, words, words per list)``: per such list (in order), each word with
    a bit set, the lists' words one after the other. One pass of array operations over every
    candidate list's blocks at once (``lst``: each block's list): a loop per list cost ~100 us
    a list, 3.5% of a simulated run's samples (docs/simulator.md §8, third pass)."""
    m = len(keyed)
    cand = keyed & (rcount >= 3)
    e = np.flatnonzero(cand[lst])  # the candidates' blocks, list after list
    if not len(e):
        return np.zeros(m, dtype=bool), np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint64), \
            np.zeros(0, np.int64)
    el = lst[e]
    first = e == off[el]  # a list's first block
    seg = seg_global[e] - seg_global[off[el]]  # segment within its list
    # a repeated hash in a segment: within a segment hashes ascend, so a repeat is h <= previous
    same_seg = np.zeros(len(e), dtype=bool)
    same_seg[1:] = ~first[1:] & (seg[1:] == seg[:-1])
    rep = np.zeros(len(e), dtype=bool)
    rep[1:] = same_seg[1:] & (h[e[1:]] <= h[e[:-1]])
    lid = ids[e].astype(np.int64)  # sorted within each segment
    key = seg * (1 << 27) + lid // 64  # (segment, word): ascending (ids < 2**32, words < 2**26)
    head = first.copy()
    head[1:] |= key[1:] != key[:-1]
    nw = np.bincount(el[head], minlength=m)
    dup = np.bincount(el[rep], minlength=m) > 0
    bm = cand & ~dup & (_WORD_BITS * nw < _RUN_BITS * rcount)
    keep = bm[el]
    lid, seg, head = lid[keep], seg[keep], head[keep]
    hpos = np.flatnonzero(head)
    bits = np.left_shift(np.uint64(1), (lid % 64).astype(np.uint64))
    words = np.bitwise_or.reduceat(bits, hpos) if len(hpos) else np.zeros(0, np.uint64)
    return bm, (lid[hpos] // 64).astype(np.uint32), seg[hpos].astype(np.uint32), words, nw[bm]


def _bitmap_lists(pa, has: np.ndarray, bm: np.ndarray, wnums: np.ndarray, wsegs: np.ndarray, words: np.ndarray,
                  nwords: np.ndarray) -> list:
    """The three bitmap columns (NULL but for the lists stored as bitmaps)."""
    n = len(has)
    rows = np.flatnonzero(has)[bm]
    isbm = np.zeros(n, dtype=bool)
    isbm[rows] = True
    counts = np.zeros(n, dtype=np.int32)
    counts[rows] = nwords
    offs = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=offs[1:])
    out = []
    for flat, dtype in ((wnums, np.uint32), (wsegs, np.uint32), (words, np.uint64)):
        out.append(pa.ListArray.from_arrays(pa.array(offs), pa.array(flat.astype(dtype)), mask=pa.array(~isbm)))
    return out


def _lists(pa, has: np.ndarray, starts, lens, segs, null: np.ndarray | None = None) -> list:
    """The three list columns (NULL where an event has no blocks, or ``null``; segs NULL unless keyed)."""
    n = len(has)
    counts = np.zeros(n, dtype=np.int32)
    counts[has] = starts[1]
    off = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=off[1:])
    mask = pa.array(~has if null is None else null)
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


def decode_bitmap(hashes: np.ndarray, wnums: Sequence[int], wsegs: Sequence[int], bits: Sequence[int]) -> list[int]:
    """An event's block list from its sparse bitmap (each segment in hash order)."""
    w = np.asarray(bits, dtype="<u8")
    pos = np.flatnonzero(np.unpackbits(w.view(np.uint8), bitorder="little"))  # set bits, word-major
    word = pos // 64
    h = hashes[64 * np.asarray(wnums, dtype=np.int64)[word] + pos % 64]
    return h[np.lexsort((h, np.asarray(wsegs, dtype=np.int64)[word]))].tolist()


def decode_row(seq: int, payload: str, blocks: list[int] | None, ts: float | None = None) -> Event:
    """One stored row back to its event (``blocks``: the list taken out of its payload; ``ts``:
    the row's ``ts`` column). Raises ``CodecError`` naming ``seq`` (:mod:`.payload`)."""
    ev = decode_payload(seq, payload, ts)
    if blocks is not None:
        ev = msgspec.structs.replace(ev, blocks=blocks)
    return ev
