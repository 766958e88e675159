"""One node's KV pool: an L1 (GPU) and an L2 (host) tier of 64-token blocks, shared by every
engine backend. Pure: no clock, no I/O; time and the eviction order come from its owner.

What it guarantees (tests/unit/engine/test_kvpool.py pins each point)
1. A tier never holds more than its capacity in blocks. L1 also carries ``reserved_tokens``
   (decode working memory that is not a cached block: prompt tails and generated tokens),
   counted in whole blocks (ceil) against L1's capacity.
2. Eviction order is the policy's, i.e. the directory's (``services.cores.directory.eviction``):
   the pool asks ``choose(tier, tokens, pinned)`` for victims and drops only those it holds
   and that are not pinned. One eviction frees at least ``evict_batch`` of the tier (a low
   watermark, as SGLang's HiCache does), so the policy's sort runs once per batch.
3. Pinned blocks are never evicted: a block is pinned while any owner (a queued request with
   KV, a running request) pins it (``pin``/``unpin``, counted per owner), or while a call
   passes it as ``also_pinned``. The pins are counted per block as they change (``pin``
   adds the new owner's list and takes back its old one, from where the two differ), so an
   eviction reads the pinned blocks instead of rebuilding their set (rebuilt per
   eviction it was 15% of a calibration-session run, docs/simulator.md §8).
4. Every change a peer must know about is an event, emitted in the order it happens:
   ``KvStored`` for blocks added by ``store`` (never a block already held; ``store_through``
   writes L1 and L2 and sends one ``KvStored`` with ``write_through`` where the pair would say
   one thing), ``KvEvicted`` for evicted or dropped blocks. ``add`` changes a tier silently:
   the caller reports the change with its own event (``KvFetched``, ``KvMoved``), which the
   directory folds the same way.
5. ``observe_stored`` / ``observe_removed`` mirror a tier an engine manages itself (SGLang's
   radix cache and HiCache evict on their own): no capacity check, only the events.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from services.cores.directory._native import BlockCounts, BlockSet

from engine import _kvscan
from events.catalog import Event, KvEvicted, KvStored
from events.ids import BlockHash, NodeId, RequestId, Tier

AbstractSet.register(BlockCounts)  # a read-only set of its keys (``in``, ``len``, iteration, ``==``)
AbstractSet.register(BlockSet)  # a tier: ``in``, ``len``, iteration, ``==`` (and set-like writes)

#: Share of a tier freed by one eviction (low watermark).
EVICT_BATCH = 0.02
#: Lists remembered per tier by :meth:`KvPool.held_run` before the memo starts afresh.
_RUN_MEMO = 4096

#: ``choose(tier, tokens_to_free, pinned) -> blocks in eviction order`` (the directory's policy).
#: ``pinned`` is a read-only set view of the pool's pinned blocks, valid during the call: a
#: chooser that keeps it must copy it (``frozenset(pinned)``). A call's ``also_pinned`` is not
#: in it: the pool leaves those blocks out of the answer itself (:meth:`KvPool._without`).
Chooser = Callable[[Tier, int, AbstractSet], list]


class KvPool:
    """The two tiers of one node (see the module docstring)."""

    def __init__(self, node: NodeId, block_tokens: int, l1_capacity_tokens: int, l2_capacity_tokens: int,
                 *, choose: Chooser, emit: Callable[[Event], None], now: Callable[[], float],
                 evict_batch: float = EVICT_BATCH) -> None:
        assert block_tokens > 0, "block_tokens must be positive"
        self.node = node
        self.bt = block_tokens
        # the tiers: compiled uint64 sets (services/cores/directory/_native.pyx), probed by the
        # scans of engine/_kvscan.pyx with the hashes (docs/simulator.md §8)
        self.l1 = BlockSet()
        self.l2 = BlockSet()
        self.l1_cap_blocks = l1_capacity_tokens // block_tokens
        self.l2_cap_blocks = l2_capacity_tokens // block_tokens
        self.reserved_tokens = 0  # L1 tokens held outside cached blocks (decode working memory)
        self.evict_batch = evict_batch
        self._choose, self._emit, self._now = choose, emit, now
        self._pins: dict[Hashable, tuple[BlockHash, ...]] = {}  # owner -> the blocks it pins
        # block -> owners' list entries pinning it: a compiled uint64 multiset (services/cores/
        # directory/_native.pyx), probed without Python ints by the directory's eviction order
        self._pin_n = BlockCounts()
        # held_run's memo per tier set: id(list) -> (list, start, end), blocks[start:end] held.
        # A tier only loses blocks in _removed(), which forgets its memo.
        self._runs: dict[int, dict[int, tuple[Sequence[BlockHash], int, int]]] = {id(self.l1): {}, id(self.l2): {}}

    # ------------------------------------------------------------------ reads
    def tier(self, tier: Tier) -> BlockSet:
        return self.l1 if tier == "L1" else self.l2

    def capacity_blocks(self, tier: Tier) -> int:
        return self.l1_cap_blocks if tier == "L1" else self.l2_cap_blocks

    def holds(self, block: BlockHash, tier: Tier) -> bool:
        return block in self.tier(tier)

    def used_tokens(self, tier: Tier) -> int:
        return len(self.tier(tier)) * self.bt

    @staticmethod
    def prefix_len(blocks: Sequence[BlockHash], start: int, store: BlockSet | AbstractSet) -> int:
        """End of the run of ``blocks[start:]`` held in ``store`` (a tier, or any set): one
        compiled loop over the list probing the tier's table (``engine/_kvscan.pyx``;
        it replaced ``set.issuperset`` of 64-block slices, see docs/simulator.md §8)."""
        return _kvscan.prefix_len(blocks, start, store)

    def held_run(self, blocks: Sequence[BlockHash], start: int, store: BlockSet) -> int:
        """:meth:`prefix_len` of one of this pool's tiers, remembering the run it found per list.

        A request's prompt is measured against the same tier several times (enqueue, pin,
        prefill start, store, decode admission); a tier only loses blocks by eviction or a
        drop, which forget the tier's memo, so a run found earlier still holds and the scan
        resumes at its end (blocks added since can only lengthen it). Same answer as
        ``prefix_len``: tests/unit/engine/test_kvpool_prefix.py checks it against the walk."""
        memo = self._runs.get(id(store))
        if memo is None:  # not one of this pool's tiers
            return self.prefix_len(blocks, start, store)
        m = memo.get(id(blocks))
        if m is not None and m[0] is blocks and m[1] <= start <= m[2]:
            s0 = m[1]
            end = self.prefix_len(blocks, m[2], store)
        else:
            s0 = start
            end = self.prefix_len(blocks, start, store)
            if m is None and len(memo) >= _RUN_MEMO:
                memo.clear()
        memo[id(blocks)] = (blocks, s0, end)
        return end

    def _removed(self, store: BlockSet) -> None:
        """``store`` lost blocks: every run remembered on it may be broken."""
        memo = self._runs.get(id(store))
        if memo:
            memo.clear()

    def missing(self, blocks: Sequence[BlockHash], store: BlockSet) -> list[BlockHash]:
        """Blocks not in ``store``, in order, without duplicates (the held prefix is skipped
        at C speed: a prompt is usually a held prefix plus a new suffix)."""
        k = self.held_run(blocks, 0, store)
        if k == len(blocks):
            return []
        return _kvscan.missing_after(blocks, k, store)

    # ------------------------------------------------------------------ pins
    def pin(self, owner: Hashable, blocks: Sequence[BlockHash]) -> None:
        """``owner`` (a request in some phase) uses ``blocks``: none of them is evicted. Replaces
        what ``owner`` pinned before; only the blocks past the two lists' common prefix change
        counts (a queued request pins its held prefix, later its whole prompt)."""
        new = tuple(blocks)
        old = self._pins.get(owner)
        k = 0
        if old is not None:
            k = _kvscan.common_prefix(old, new)
        self._pin_n.add(new, k)  # first: a bad hash raises here, before anything changed
        if old is not None:
            self._pin_n.remove(old, k)
        self._pins[owner] = new

    def unpin(self, owner: Hashable) -> None:
        old = self._pins.pop(owner, None)
        if old is not None:
            self._pin_n.remove(old)

    def pinned(self) -> frozenset:
        """Every block some owner pins (a copy; :meth:`make_room` reads the live counts)."""
        return frozenset(self._pin_n)

    def is_pinned(self, block: BlockHash) -> bool:
        return block in self._pin_n

    # ------------------------------------------------------------------ writes
    def _reserved_blocks(self, tier: Tier, extra_tokens: int) -> int:
        return math.ceil((self.reserved_tokens + extra_tokens) / self.bt) if tier == "L1" else 0

    def make_room(self, tier: Tier, need_blocks: int, also_pinned: Sequence[BlockHash] = (),
                  extra_tokens: int = 0) -> bool:
        """Evict through the policy until ``need_blocks`` more blocks (and ``extra_tokens`` more
        reserved L1 tokens) fit; False if that is impossible without touching a pinned block."""
        store = self.tier(tier)
        cap = self.capacity_blocks(tier)
        used_extra = self._reserved_blocks(tier, extra_tokens)
        over = len(store) + used_extra + need_blocks - cap
        if over <= 0:
            return True
        want = max(over, int(cap * self.evict_batch))
        counts = self._pin_n
        chosen = self._choose(tier, want * self.bt, counts)
        if also_pinned and chosen:
            chosen = self._without(tier, want, chosen, also_pinned)
        victims = _kvscan.held_unpinned(chosen, store, counts)  # held and not pinned, in order
        if victims:
            store.difference_update(victims)
            self._removed(store)
            self._emit(KvEvicted(ts=self._now(), src=self.node, node=self.node, tier=tier, blocks=victims))
        return len(store) + used_extra + need_blocks <= cap

    def _without(self, tier: Tier, want: int, chosen: list, also_pinned: Sequence[BlockHash]) -> list:
        """The policy's first ``want`` blocks with ``also_pinned`` (pinned for this call only)
        left out, given ``chosen``, its first ``want`` with them in (as many: ``want``, or fewer
        when the tier has fewer unpinned blocks): the same order
        less those blocks. Usually none of them is among ``chosen`` (a request's own prompt was
        just used, so it comes late in an LRU order), and ``chosen`` is the answer; otherwise
        the policy is asked for as many more as there are such blocks and they are dropped.
        (Counting them into the pins and taking them back instead logged a release of every
        one per call, which the directory's next eviction order re-read: 5-8% of a
        calibration-session run, docs/simulator.md §8.)"""
        if not _kvscan.meets(chosen, also_pinned):  # none of also_pinned is among them (compiled)
            return chosen
        extra = set(also_pinned)
        more = self._choose(tier, (want + len(extra)) * self.bt, self._pin_n)
        return [b for b in more if b not in extra][:len(chosen)]

    def store(self, tier: Tier, blocks: Sequence[BlockHash], pinned: Sequence[BlockHash] = (),
              request: RequestId | None = None) -> list[BlockHash]:
        """Add the blocks not held yet to ``tier`` (after eviction); returns those added. When
        not all fit, the prefix that fits is kept (it still helps later lookups)."""
        new = self._put(tier, self.missing(blocks, self.tier(tier)), pinned)
        if new:
            self._emit(KvStored(ts=self._now(), src=self.node, node=self.node, tier=tier, blocks=new,
                                request=request))
        return new

    def store_through(self, blocks: Sequence[BlockHash], pinned: Sequence[BlockHash] = (),
                      request: RequestId | None = None, l2_blocks: Sequence[BlockHash] | None = None
                      ) -> tuple[list[BlockHash], list[BlockHash]]:
        """``store("L1", ...)`` then ``store("L2", ...)`` (write-through): the same tiers, the same
        evictions in the same order, and the blocks each added (returned); only when both add
        the same blocks and L2 has room for them without an eviction, the two ``KvStored`` are
        one, ``write_through`` (it folds as the pair, events/catalog.py).

        ``l2_blocks``: what is written through to L2 if not ``blocks``, taken from L1 once the
        L1 write is done (the blocks of it L1 holds then): the torch engine adopts its newly
        computed blocks into L1 and copies every full block of the sequence from L1's bytes."""
        new1 = self._put("L1", self.missing(blocks, self.l1), pinned)
        if l2_blocks is not None:
            l1 = self.l1
            l2_blocks = [b for b in l2_blocks if b in l1]
        # the L1 write left L2 as it was
        miss2 = self.missing(blocks if l2_blocks is None else l2_blocks, self.l2)
        if new1 and miss2 == new1 and len(self.l2) + len(miss2) <= self.l2_cap_blocks:
            self.l2.update(miss2)  # what _put("L2") does when make_room has nothing to evict
            self._emit(KvStored(ts=self._now(), src=self.node, node=self.node, tier="L1", blocks=new1,
                                request=request, write_through=True))
            return new1, miss2
        if new1:
            self._emit(KvStored(ts=self._now(), src=self.node, node=self.node, tier="L1", blocks=new1,
                                request=request))
        new2 = self._put("L2", miss2, pinned)
        if new2:
            self._emit(KvStored(ts=self._now(), src=self.node, node=self.node, tier="L2", blocks=new2,
                                request=request))
        return new1, new2

    def _put(self, tier: Tier, new: list[BlockHash], pinned: Sequence[BlockHash]) -> list[BlockHash]:
        """Make room for ``new`` (blocks ``tier`` lacks, in order) and add them, or the prefix
        of them that fits; returns those added. No ``KvStored``: the caller emits it."""
        if not new:
            return []
        store = self.tier(tier)
        if not self.make_room(tier, len(new), pinned):
            room = max(0, self.capacity_blocks(tier) - len(store) - self._reserved_blocks(tier, 0))
            new = new[:room]
            if not new:
                return []
        store.update(new)
        return new

    def add(self, tier: Tier, blocks: Iterable[BlockHash]) -> None:
        """Hold ``blocks`` in ``tier`` without an event (the caller emits the fact: a fetch or
        a P->D move). Room must have been made first."""
        self.tier(tier).update(blocks)

    def forget(self, tier: Tier, blocks: Iterable[BlockHash]) -> None:
        """Stop holding ``blocks`` without an event: the inverse of :meth:`add` when the bytes
        the caller was to announce never landed (a refused transfer)."""
        store = self.tier(tier)
        store.difference_update(blocks)
        self._removed(store)

    def drop_all(self) -> None:
        """Drop every block of both tiers (a restart): one ``KvEvicted`` per non-empty tier."""
        for tier, store in (("L1", self.l1), ("L2", self.l2)):
            if store:
                blocks = sorted(store)  # a tier iterates in table order: the event must not see it
                store.clear()
                self._removed(store)
                self._emit(KvEvicted(ts=self._now(), src=self.node, node=self.node, tier=tier, blocks=blocks))

    # ------------------------------------------------------------------ engine-managed tiers
    def observe_stored(self, tier: Tier, blocks: Sequence[BlockHash], request: RequestId | None = None
                       ) -> list[BlockHash]:
        """The engine stored ``blocks`` in ``tier`` on its own: record and report the new ones."""
        store = self.tier(tier)
        new = self.missing(blocks, store)
        if new:
            store.update(new)
            self._emit(KvStored(ts=self._now(), src=self.node, node=self.node, tier=tier, blocks=new,
                                request=request))
        return new

    def observe_removed(self, tier: Tier, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        """The engine evicted ``blocks`` from ``tier`` on its own: record and report those held."""
        store = self.tier(tier)
        gone = [b for b in dict.fromkeys(blocks) if b in store]
        if gone:
            store.difference_update(gone)
            self._removed(store)
            self._emit(KvEvicted(ts=self._now(), src=self.node, node=self.node, tier=tier, blocks=gone))
        return gone
