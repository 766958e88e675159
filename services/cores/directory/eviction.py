"""Eviction order as reusable policy objects over a :class:`DirectoryCore` (pure, no I/O).

``policy.choose(directory, node, tier, tokens_to_free, pinned)`` returns blocks held by ``node``
in ``tier``, in eviction order, just enough to free ``tokens_to_free`` tokens (each block is
``block_tokens`` tokens; fewer if the node holds too few unpinned blocks), never a pinned block.

- :class:`CountAwareEviction` (METHOD.md §4.4) orders by ``(count > 0, last_access, block)``:
  blocks no active branch references (compacted history, finished sub-agents) go first, in LRU
  order, then referenced blocks in LRU order. A branch waiting a long time on a tool keeps its KV.
- :class:`LruEviction` (the HiCache baseline) orders by ``(last_access, block)``.

The order of a :class:`~services.cores.directory.core.DirectoryCore` is kept incrementally by its
block table (:class:`CopyOrder`: buckets by count class and last access, block order within),
so a choice reads the front buckets instead of sorting the node's copies;
:meth:`_Policy.sorted_order` is the definition (one ``lexsort`` of every copy), which the
property tests compare it with. Ties break on the block hash, so the order is deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Set as AbstractSet

import numpy as np

from events.ids import BlockHash, NodeId, Tier


class CopyOrder:
    """Eviction order of one copy column (node ``n``, tier ``t``), kept incrementally.

    Copies sit in buckets keyed by ``(count > 0, last_access)``; within a bucket the order is
    the block hash. The keys of each count class are kept sorted (``bisect``), so the policies'
    orders are read bucket by bucket from the front: ``CountAwareEviction`` walks the zero-count
    keys then the counted ones, ``LruEviction`` merges both by ``last_access`` (a bucket pair
    with equal ``last_access`` is one group sorted by block). Nothing is sorted per eviction
    but the few buckets it reads.

    Updates are appends: a copy stored, read or touched (``last_access`` moves) or whose count
    crosses zero is appended to its new bucket; its old entry is left behind and dropped when a
    read finds it stale (the copy is no longer held there, or its count class or
    ``last_access`` no longer match the bucket). A slot appears at most once among the valid
    entries of one bucket after de-duplication, and in no other bucket, so the order is exact.
    The table rebuilds a column from scratch when stale entries outnumber live ones 4 to 1.

    Pins (docs/simulator.md, "The eviction walk remembers its pinned blocks"): on the
    calibration sessions ~85% of a node's L1 copies are pinned, so a walk read ~44 K entries to
    find ~3 K victims. Under a :class:`~services.cores.directory._native.BlockCounts` of pins a
    read bucket remembers (``memo``) how many of its arrays it read and which valid copies were
    unpinned then; the next read checks only those, the arrays appended since, and the copies
    whose pin count fell to 0 since (the counts' release log, read from ``src``'s position and
    added to the bucket their current key names). Everything left out was pinned when it was
    read and has not been released, so it is still pinned: the order stays exact.
    """

    __slots__ = ("buckets", "entries", "keys", "live", "memo", "src")

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, float], list[np.ndarray]] = {}
        # per bucket read under a pin multiset: ``(arrays read, unpinned valid slots then, an upper
        # bound on the valid pinned ones)``; what it leaves out was pinned then, and comes back
        # through ``src``'s release log; a bucket with nothing valid and a bound of 0 is dropped
        self.memo: dict[tuple[int, float], tuple[int, np.ndarray, int]] = {}
        self.src: tuple | None = None  # (the pins' BlockCounts, its log epoch, its log position)
        self.keys: tuple[list[float], list[float]] = ([], [])  # sorted last_access per count class
        self.entries = 0
        self.live = 0  # valid copies at the last rebuild or full read

    def add(self, c: int, last: float, slots: np.ndarray) -> None:
        if not len(slots):
            return
        key = (c, last)
        arrays = self.buckets.get(key)
        if arrays is None:
            self.buckets[key] = [slots]
            bisect.insort(self.keys[c], last)
        else:
            arrays.append(slots)
        self.entries += len(slots)

    def drop(self, c: int, last: float) -> None:
        arrays = self.buckets.pop((c, last))
        self.memo.pop((c, last), None)
        self.entries -= sum(len(a) for a in arrays)
        keys = self.keys[c]
        del keys[bisect.bisect_left(keys, last)]

    def groups(self, count_aware: bool):
        """``[(count class, last_access), ...]`` groups in eviction order (a generator)."""
        if count_aware:
            for c in (0, 1):
                for last in list(self.keys[c]):
                    yield ((c, last),)
            return
        zero, one = list(self.keys[0]), list(self.keys[1])
        i = j = 0
        while i < len(zero) or j < len(one):
            if j >= len(one) or (i < len(zero) and zero[i] < one[j]):
                yield ((0, zero[i]),)
                i += 1
            elif i >= len(zero) or one[j] < zero[i]:
                yield ((1, one[j]),)
                j += 1
            else:
                yield ((0, zero[i]), (1, one[j]))
                i += 1
                j += 1


class _Policy:
    name = ""
    count_aware = False

    def __init__(self, block_tokens: int = 64) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens

    def order(self, directory, node: NodeId, tier: Tier,
              pinned: AbstractSet[BlockHash] = frozenset()) -> list[BlockHash]:
        """Every unpinned block of ``node``'s ``tier`` in eviction order."""
        return self._ordered(directory, node, tier, pinned).tolist()

    def _ordered(self, directory, node: NodeId, tier: Tier, pinned: AbstractSet[BlockHash],
                 limit: int | None = None) -> np.ndarray:
        incremental = getattr(directory, "eviction_order", None)
        if incremental is not None:  # a DirectoryCore: its incrementally kept order
            return incremental(node, tier, self.count_aware, limit, pinned)
        return self.sorted_order(directory, node, tier, pinned)

    def sorted_order(self, directory, node: NodeId, tier: Tier,
                     pinned: AbstractSet[BlockHash] = frozenset()) -> np.ndarray:
        """The definition: every copy of the tier sorted by the policy's key (one ``lexsort``)."""
        blocks, last, count = directory.tier_arrays(node, tier)
        if self.count_aware:
            idx = np.lexsort((blocks, last, count > 0))  # the last key is the primary one
        else:
            idx = np.lexsort((blocks, last))
        ordered = blocks[idx]
        if pinned and len(ordered):
            ordered = ordered[~np.isin(ordered, np.fromiter(pinned, dtype=np.uint64, count=len(pinned)))]
        return ordered

    def choose(
        self,
        directory,
        node: NodeId,
        tier: Tier,
        tokens_to_free: int,
        pinned: AbstractSet[BlockHash] = frozenset(),
    ) -> list[BlockHash]:
        """Blocks to evict from ``node``'s ``tier`` to free ``tokens_to_free`` tokens."""
        if tokens_to_free <= 0:
            return []
        n_blocks = -(-tokens_to_free // self.block_tokens)
        return self._ordered(directory, node, tier, pinned, n_blocks)[:n_blocks].tolist()


class CountAwareEviction(_Policy):
    """Zero-count blocks first (LRU among them), then counted blocks (LRU)."""

    name = "count_aware"
    count_aware = True


class LruEviction(_Policy):
    """Least recently used first, counts ignored (baseline)."""

    name = "lru"


POLICIES = {p.name: p for p in (CountAwareEviction, LruEviction)}
