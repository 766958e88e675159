"""The directory's block table: one slot per known block, numpy columns per node (pure, no I/O).

Layout (``S`` slots; node ``n``'s copy in tier ``t`` (0 = L1, 1 = L2) is bit ``j = 2n + t``,
stored in word ``j // 64`` at bit ``j % 64``; ``W`` words cover ``32 W`` nodes):

- ``index: SlotMap`` (block hash -> slot; compiled, ``_native.pyx``): a request's block list
  is resolved by one C loop over the Python list (it replaced a ``dict`` read through
  ``np.fromiter(map(index.get, ...))`` and a vectorised numpy copy of it for long lists).
  Slot 0 is a sentinel that holds nothing, so an unknown block maps to 0 and numpy code needs
  no special case.
- ``held[S, W]`` uint64 — bit set: the node holds the block in that tier. A request's holder
  masks are one ``take`` of its slots; a running AND along them gives every node's prefix.
- ``last[S, 2N]`` float64 — last access of that copy (``ts`` of its store or last use).
- ``refs[S, N]`` int32 — active-branch references (see core.py); never negative.
- ``block[S]`` uint64 — the hash back from a slot.

A slot is freed (and reused) when no node holds the block and no branch references it; ``gen``
counts frees, so an array of slots cached at generation ``g`` is still exact while ``gen == g``.
Slot numbers never leak into outputs: everything returned is keyed or sorted by block hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from services.cores.directory._native import (
    BlockCounts,
    SlotMap,
    bucket_pick,
    fill_new,
    held_split,
    lookup_scan,
    picked_slots,
    refill,
    refs_add,
    unmark,
    unpinned,
    unused,
)
from services.cores.directory._native import mark as mark_copies
from services.cores.directory._native import read as read_copies
from services.cores.directory._native import touch as touch_prefixes
from services.cores.directory.eviction import CopyOrder

TIER_INDEX = {"L1": 0, "L2": 1}


class BlockTable:
    __slots__ = ("_mark", "_picked", "block", "free", "gen", "held", "index", "last", "n_nodes", "orders", "refs",
                 "size")

    def __init__(self, capacity: int = 1024, node_capacity: int = 4) -> None:
        self.index = SlotMap(4 * capacity)  # block hash -> slot
        self._mark = np.zeros(capacity, dtype=np.uint8)  # scratch of the eviction order's bucket reads
        self.block = np.zeros(capacity, dtype=np.uint64)
        self.held = np.zeros((capacity, -(-node_capacity // 32)), dtype=np.uint64)
        # column-major: the fold reads and writes one copy column (node, tier) at a time, and a
        # request's slots come in runs, so a column view's 1-D gather/scatter is near-sequential
        self.last = np.zeros((capacity, 2 * node_capacity), dtype=np.float64, order="F")
        self.refs = np.zeros((capacity, node_capacity), dtype=np.int32, order="F")
        self.free: list[int] = []
        self.size = 1  # slot 0 is the sentinel
        self.n_nodes = 0
        self.gen = 0
        # eviction order per copy column 2n + t, kept from the first time it is asked for
        self.orders: dict[int, CopyOrder] = {}
        # per copy column, the last eviction order given: ``(gen, blocks, their slots)``; the
        # ``KvEvicted`` of its victims takes their slots from it while ``gen`` has not moved
        self._picked: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------------- growth
    def add_node(self) -> int:
        idx = self.n_nodes
        ncap = self.refs.shape[1]
        if idx >= ncap:
            cap, extra = self.refs.shape[0], 4  # +4 columns: memory per slot grows with nodes only
            words = -(-(ncap + extra) // 32) - self.held.shape[1]
            if words > 0:
                self.held = np.concatenate([self.held, np.zeros((cap, words), np.uint64)], axis=1)
            self.last = np.asfortranarray(np.concatenate([self.last, np.zeros((cap, 2 * extra), np.float64)], axis=1))
            self.refs = np.asfortranarray(np.concatenate([self.refs, np.zeros((cap, extra), np.int32)], axis=1))
        self.n_nodes += 1
        return idx

    def _grow(self, need: int) -> None:
        cap = len(self.block)
        new = max(need, 2 * cap)
        self.block = np.resize(self.block, new)
        self._mark = np.zeros(new, dtype=np.uint8)
        for name in ("held", "last", "refs"):
            old = getattr(self, name)
            arr = np.zeros((new, old.shape[1]), dtype=old.dtype, order="C" if name == "held" else "F")
            arr[:cap] = old
            setattr(self, name, arr)

    # ------------------------------------------------------------------------- slots
    def slots(self, blocks: Iterable[int], n: int) -> np.ndarray:
        """Slots of ``n`` blocks (0 for an unknown block or a hash outside 64 bits)."""
        return self.index.find_seq(blocks, n)

    def find(self, block: int) -> int | None:
        """Slot of one block, ``None`` if unknown."""
        return self.index.get(block)

    def resolve(self, blocks: Sequence[int], cached: tuple[np.ndarray, int] | None) -> np.ndarray:
        """Slots of ``blocks`` reusing an earlier answer ``(slots, gen)`` for the same list: if no
        slot was freed since, only the blocks unknown then are probed again (compiled: the same
        array back when none was unknown)."""
        if cached is None or cached[1] != self.gen:
            return self.slots(blocks, len(blocks))
        return refill(self.index, blocks, cached[0])

    def ensure(self, blocks: Sequence[int], s: np.ndarray | None = None) -> np.ndarray:
        """Slots of ``blocks`` (``s``: already probed; filled in place), allocating the unknown
        ones: one compiled pass (``fill_new``) re-probes the 0s and allocates the rest, distinct
        blocks in order of first occurrence when at most ``FILL_MAX`` positions are unknown (a
        live event's few, a turn's appended ones), sorted by hash above (a branch's first prompt)."""
        if s is None:
            s = self.slots(blocks, len(blocks))
        size = fill_new(self.index, blocks, s, self.block, self.free, self.size)
        if size < 0:  # the table is full: grow it to at least -size slots, then allocate
            self._grow(-size)
            size = fill_new(self.index, blocks, s, self.block, self.free, self.size)
        self.size = size
        return s

    def release(self, s: np.ndarray) -> None:
        """Free the slots among ``s`` that no node holds and no branch references."""
        if len(s):
            self._free(unused(self.held, self.refs, s))

    def _free(self, dead: np.ndarray) -> None:
        """Free the slots ``dead`` (unused; repeats allowed): ``gen`` moves, and they join the
        free list in slot order."""
        if not len(dead):
            return
        dead = np.unique(dead)
        self.gen += 1
        self.index.delete(self.block[dead])
        # ``last`` of a freed slot is left as it is: every read of ``last`` is guarded by the
        # copy's held bit, and a store sets it (zeroing 2N columns per slot cost ms at 96 nodes)
        self.free.extend(dead.tolist())

    # ------------------------------------------------------------------------- copies
    def store(self, n: int, tier: str, blocks: Sequence[int], ts: float | np.ndarray,
              s: np.ndarray | None = None) -> np.ndarray:
        """``n`` holds ``blocks`` in ``tier`` (``s``: their slots if known); returns the slots."""
        if not len(blocks):
            return np.zeros(0, dtype=np.intp)
        s = self.ensure(blocks, s)
        j = 2 * n + TIER_INDEX[tier]
        if isinstance(ts, float):  # one compiled pass sets the bit and the last access
            mark_copies(self.held[:, j >> 6], s, _BIT[j & 63], self.last[:, j], ts)
        else:  # per-block times (a snapshot's restore)
            h = self.held[:, j >> 6]  # 1-D column views: numpy's fast fancy-index path
            h[s] = h[s] | _BIT[j & 63]  # fancy, not take: take copies a non-contiguous column whole
            self.last[:, j][s] = ts
        if j in self.orders:
            self._track(j, s, ts if isinstance(ts, float) else None)
        return s

    def evict(self, n: int, tier: str, blocks: Sequence[int]) -> int:
        """Drop copies; returns how many of ``blocks`` were not held there. The victims of the
        column's last eviction order (a pool's ``KvEvicted``) take their slots from that order
        while no slot has been freed since (``picked_slots``: the index's answer for any list,
        without probing the ones the order gave)."""
        if not len(blocks):
            return 0
        j = 2 * n + TIER_INDEX[tier]
        p = self._picked.pop(j, None)
        if p is not None and p[0] == self.gen:  # the victims of this column's last order: its slots
            s = picked_slots(self.index, blocks, p[1], p[2])
        else:
            s = self.slots(blocks, len(blocks))
        had = unmark(self.held[:, j >> 6], s, _BIT[j & 63])  # the slots holding the copy, bit cleared
        self.release(had)
        return len(s) - len(had)

    def drop_node(self, n: int) -> None:
        w, pair = (2 * n) >> 6, _BIT[(2 * n) & 63] | _BIT[(2 * n + 1) & 63]
        s = np.flatnonzero(self.held[: self.size, w] & pair)
        self.held[s, w] &= ~pair
        self.release(s)

    def column(self, s: np.ndarray, j: int) -> np.ndarray:
        """bool: do the slots ``s`` hold copy bit ``j`` (node ``j // 2``, tier ``j % 2``)?"""
        return (self.held[:, j >> 6][s] & _BIT[j & 63]).astype(bool)

    def touch(self, n: int, s: np.ndarray, ts: float) -> None:
        """Refresh the last access of the longest L1 prefix's GPU copies and the longest L2
        prefix's host copies of the blocks with slots ``s`` on node ``n``."""
        if not len(s):
            return
        j0 = 2 * n
        ks = touch_prefixes(self.held[:, j0 >> 6], s, _BIT[j0 & 63], _BIT[(j0 + 1) & 63], self.last[:, j0],
                           self.last[:, j0 + 1], float(ts))
        if self.orders:
            for j, k in zip((j0, j0 + 1), ks):
                if k and j in self.orders:
                    self._track(j, s[:k], float(ts))

    def read(self, n: int, blocks: Sequence[int], ts: float, s: np.ndarray | None = None) -> int:
        """Blocks read from node ``n``: refresh every copy there; returns how many it lacked."""
        if not len(blocks):
            return 0
        if s is None:
            s = self.slots(blocks, len(blocks))
        j0 = 2 * n
        tracked = j0 in self.orders or j0 + 1 in self.orders
        missing, c0, c1 = read_copies(self.held[:, j0 >> 6], s, _BIT[j0 & 63], _BIT[(j0 + 1) & 63],
                                       self.last[:, j0], self.last[:, j0 + 1], float(ts), tracked)
        if tracked:
            for j, c in ((j0, c0), (j0 + 1, c1)):
                if j in self.orders:
                    self._track(j, s[c], float(ts))
        return missing

    # ------------------------------------------------------------------------- counts
    def add_refs(self, n: int, s: np.ndarray, delta: int) -> None:
        """``delta`` (+1/-1) on node ``n`` for the distinct, allocated slots ``s`` (one compiled
        pass each way; a -1 frees the slots it leaves unused)."""
        if not len(s):
            return
        if delta > 0:
            refs_add(self.refs[:, n], s, 1, self.held, self.refs)
            self._count_class_moved(n, s, 1)
            return
        dead = refs_add(self.refs[:, n], s, -1, self.held, self.refs)
        if dead is None:
            raise AssertionError(f"invariant: counts on node column {n} are never negative")
        self._count_class_moved(n, s, 0)
        self._free(dead)

    def _count_class_moved(self, n: int, s: np.ndarray, now: int) -> None:
        """Tracked columns of node ``n``: copies whose count just became ``now`` (1 after +1,
        0 after -1) changed count class, so they move bucket."""
        if not self.orders or (2 * n not in self.orders and 2 * n + 1 not in self.orders):
            return
        moved = s[self.refs[s, n] == now]
        for j in (2 * n, 2 * n + 1):
            if j in self.orders:
                self._track(j, moved)

    # ------------------------------------------------------------------------- eviction order
    def _track(self, j: int, s: np.ndarray, ts: float | None = None) -> None:
        """Append the held copies among slots ``s`` of column ``j`` to their current bucket
        (``ts``: their common last access, if known)."""
        o = self.orders.get(j)
        if o is None or not len(s):
            return
        # the held ones, counted and not, in one compiled pass (add skips an empty part)
        one, zero = held_split(self.held[:, j >> 6], _BIT[j & 63], self.refs[:, j >> 1], s)
        if ts is not None:
            o.add(1, ts, one)
            o.add(0, ts, zero)
            return
        last = self.last[:, j]
        for c, part in ((0, zero), (1, one)):  # the order _add_grouped's (c, last) sort gives
            if len(part):
                _add_class(o, c, part, last.take(part))

    def _order(self, j: int) -> CopyOrder:
        """Column ``j``'s order, built from a scan the first time and when stale entries
        outnumber live ones 4 to 1."""
        o = self.orders.get(j)
        if o is not None and o.entries <= 4 * o.live + 4096:
            return o
        o = self.orders[j] = CopyOrder()
        s = np.flatnonzero(self.held[: self.size, j >> 6] & _BIT[j & 63])
        _add_grouped(o, s, self.refs[s, j >> 1] > 0, self.last[s, j])
        o.live = len(s)
        return o

    def _released(self, o: CopyOrder, j: int, bc: BlockCounts) -> None:
        """Bring column ``j``'s remembered buckets up to ``bc``'s release log: each held copy
        whose pin count fell to 0 since the last read joins the memo of the bucket its count
        class and last access name now (if that bucket has one; else a full read finds it)."""
        src = o.src
        if src is None or src[0] is not bc:
            o.memo.clear()
            epoch, pos, _ = bc.released_since(-1, 0)
            o.src = (bc, epoch, pos)
            return
        epoch, pos, keys = bc.released_since(src[1], src[2])
        o.src = (bc, epoch, pos)
        if keys is None:  # the log was cleared since: forget everything
            o.memo.clear()
            return
        if not len(keys) or not o.memo:
            return
        s = self.index.find(keys)
        s = s[s > 0]
        # the held ones by count class, then by last access (a stable sort: each key's slots
        # in release order, as a (count class, last) lexsort of them all gives)
        one, zero = held_split(self.held[:, j >> 6], _BIT[j & 63], self.refs[:, j >> 1], s)
        lastc = self.last[:, j]
        for c, part in ((0, zero), (1, one)):
            if not len(part):
                continue
            last = lastc.take(part)
            if len(part) > 1 and (last[1:] != last[:-1]).any():
                order = np.argsort(last, kind="stable")
                part, last = part[order], last[order]
                cuts = (np.flatnonzero(last[1:] != last[:-1]) + 1).tolist()
            else:
                cuts = []
            for a, b in zip([0, *cuts], [*cuts, len(part)]):
                key = (c, float(last[a]))
                m = o.memo.get(key)
                if m is not None:
                    o.memo[key] = (m[0], np.concatenate([m[1], part[a:b]]), m[2])

    def eviction_order(self, n: int, tier: str, count_aware: bool, limit: int | None,
                       pinned: AbstractSet[int] | None) -> np.ndarray:
        """Blocks of node ``n``'s copies in ``tier`` in eviction order, ``pinned`` (a set of
        hashes, or None) left out: ``(count > 0, last, block)`` if ``count_aware`` else
        ``(last, block)``; the first ``limit`` (all if ``None``)."""
        j = 2 * n + TIER_INDEX[tier]
        o = self._order(j)
        w, bit = j >> 6, _BIT[j & 63]
        out: list[np.ndarray] = []
        out_s: list[np.ndarray] | None = []  # their slots, while every group's are known
        got = 0
        # a membership test per block of the groups read (compiled): a node's pinned set is
        # ~10^5 blocks on the calibration sessions, and converting and sorting it per call cost
        # more than the whole walk
        spin = pinned if pinned else None
        # a BlockCounts is probed inside the validity pass (and its buckets remembered); another
        # container after it
        bc = spin if type(spin) is BlockCounts else None
        if bc is None:
            o.memo.clear()
            o.src = None
        else:
            self._released(o, j, bc)
        memo = o.memo
        held, refs, lastc, mark = self.held[:, w], self.refs[:, n], self.last[:, j], self._mark
        for group in o.groups(count_aware):
            parts = []
            for c, last in group:
                key = (c, last)
                arrays = o.buckets[key]
                m = memo.get(key) if bc is not None else None
                if m is not None:  # the unpinned copies of the last read, released and appended ones
                    if m[0] == len(arrays) and not len(m[1]) and m[2]:
                        # every copy pinned at the last read, none released or appended since:
                        # nothing to read (what the pass below would find and keep; most of a
                        # node's front buckets under pressure)
                        continue
                    arr = m[1] if m[0] == len(arrays) else np.concatenate([m[1], *arrays[m[0]:]])
                    valid, free = bucket_pick(held, bit, refs, bool(c), lastc, last, arr, mark, self.block, bc)
                    k = len(arr) if valid is None else len(valid)
                    if not k and not m[2]:  # nothing valid here and no pinned copy left behind
                        o.drop(c, last)
                        continue
                    # m[2]: an upper bound on the valid pinned copies not read (it only grows)
                    memo[key] = (len(arrays), free, m[2] + k - len(free))
                else:
                    arr = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
                    # still held, same count class and last access, each slot once (a copy
                    # appended twice with the same key), and not pinned: one compiled pass
                    valid, free = bucket_pick(held, bit, refs, bool(c), lastc, last, arr, mark, self.block, bc)
                    if valid is not None:
                        if not len(valid):
                            o.drop(c, last)
                            continue
                        o.entries -= len(arr) - len(valid)  # compact the bucket
                        arrays = o.buckets[key] = [valid]
                    elif len(arrays) > 1:
                        arrays = o.buckets[key] = [arr]
                    if bc is not None:
                        memo[key] = (1, free, (len(arr) if valid is None else len(valid)) - len(free))
                if len(free):
                    parts.append(free)
            if not parts:
                continue
            sl = parts[0] if len(parts) == 1 else np.concatenate(parts)
            blocks = self.block[sl]
            if spin is not None and bc is None:
                blocks = unpinned(blocks, spin)
                out_s = None
                blocks.sort()  # filtering then sorting: the same blocks as sorting the group then filtering
            else:  # sorted with their slots (a group's blocks are distinct: the same order as a sort)
                by = _by_block(blocks, len(blocks) if limit is None else limit - got)
                blocks = blocks[by]
                if out_s is not None:
                    out_s.append(sl[by])
            out.append(blocks)
            got += len(blocks)
            if limit is not None and got >= limit:
                break
        res = np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)
        if limit is not None:
            res = res[:limit]
        if out_s:
            self._picked[j] = (self.gen, res.copy(), np.concatenate(out_s)[: len(res)])  # (a caller may write to res)
        else:
            self._picked.pop(j, None)
        return res

    def refs_on(self, n: int) -> dict[int, int]:
        s = np.flatnonzero(self.refs[: self.size, n])
        return dict(zip(self.block[s].tolist(), self.refs[s, n].tolist()))

    # ------------------------------------------------------------------------- queries
    def tier_arrays(self, n: int, tier: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(blocks, last_access, refs)`` of node ``n``'s copies in ``tier``, in slot order."""
        j = 2 * n + TIER_INDEX[tier]
        s = np.flatnonzero(self.held[: self.size, j >> 6] & _BIT[j & 63])
        return self.block[s], self.last[s, j], self.refs[s, n]

    def holds(self, s: int, n: int, tier: int | None = None) -> bool:
        tiers = (0, 1) if tier is None else (tier,)
        return any(int(self.held[s, (2 * n + t) >> 6]) >> ((2 * n + t) & 63) & 1 for t in tiers)

    def scan(self, blocks: Sequence[int], prefix: np.ndarray | None = None) -> tuple[int, np.ndarray, np.ndarray]:
        """One pass: pool prefix length, the ``[pool, W]`` holder masks of it, and the slots
        of ``blocks`` (for reuse by the request's later events). ``prefix``: slots of the first
        ``len(prefix)`` blocks resolved at the current ``gen`` (0 where unknown then; those are
        probed again), so only the rest is probed."""
        # a hash outside 64 bits is in no table: slot 0, nothing holds it, the prefix ends there
        return lookup_scan(self.index, blocks, prefix, self.held)


_BIT = [np.uint64(1 << i) for i in range(64)]


def _by_block(blocks: np.ndarray, k: int) -> np.ndarray:
    """The head of ``blocks.argsort()`` (distinct hashes), at least its first ``k``: all of it, or
    only the ``k`` where that is cheaper (under 2/5 of them). The eviction walk's last group is
    cut at the walk's limit: under pressure the groups it cut held ~17 M blocks of which it took
    ~6 M (5 + 10 simulated minutes of the calibration sessions), so the rest is only partitioned
    off (``argpartition``: the same ``k`` blocks, as they are distinct)."""
    n = len(blocks)
    if 0 < k < n * 2 // 5:
        part = np.argpartition(blocks, k - 1)[:k]
        return part[blocks[part].argsort()]
    return blocks.argsort()


def _add_grouped(o: CopyOrder, s: np.ndarray, c: np.ndarray, last: np.ndarray) -> None:
    """Append slots ``s`` (count class ``c``, last access ``last``) bucket by bucket."""
    if not len(s):
        return
    order = np.lexsort((last, c))
    s, c, last = s[order], c[order], last[order]
    cuts = (np.flatnonzero((c[1:] != c[:-1]) | (last[1:] != last[:-1])) + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, len(s)]):
        o.add(int(c[a]), float(last[a]), s[a:b])


def _add_class(o: CopyOrder, c: int, s: np.ndarray, last: np.ndarray) -> None:
    """Append slots ``s`` of count class ``c`` (last access ``last``) bucket by bucket: what
    :func:`_add_grouped` does for one class (a stable sort: a bucket keeps the order of ``s``)."""
    if len(s) > 1 and (last[1:] != last[:-1]).any():
        order = np.argsort(last, kind="stable")
        s, last = s[order], last[order]
        cuts = (np.flatnonzero(last[1:] != last[:-1]) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(s)]):
            o.add(c, float(last[a]), s[a:b])
    else:
        o.add(c, float(last[0]), s)
