"""The torch engine's paged KV: block bytes in ``kernels`` pools behind the node's ``KvPool``.

- L1: one ``BlockPool`` on the engine's device (the model reads and writes it in place);
  L2: one host pool (pinned when CUDA is present), written through from L1; a small host
  *staging* pool for KV in flight (the prefill -> decode hand-off, a request's partial last
  block). L2 and staging are what the transfer port registers (it moves host memory).
- Which slot holds which block: ``slot[tier][hash]``, a ``SlotAllocator`` per pool. The
  ``KvPool`` (engine/kvpool.py) decides what is held and evicts through the directory's policy;
  every ``KvEvicted`` it emits frees the blocks' slots here before the event goes on.
- A sequence's own blocks (its partial tail, the tokens it generates, a chunk being computed)
  are *private* slots of L1, counted as the pool's ``reserved_tokens`` (decode working memory),
  and become shared, hashed blocks once full and computed (``adopt``), or once pulled whole
  from a peer (``claim``).
- The staging slots are handed out by ``Staging``: a transfer larger than what is free moves
  through them in chunks, never failing for their lack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from engine.kvpool import KvPool
from events.catalog import Event, KvEvicted
from events.ids import BlockHash, NodeId
from kernels.layout import KvLayout, KvLayoutError
from kernels.ops import copy_blocks
from kernels.pool import BlockPool, SlotAllocator


def _pool(layout: KvLayout, n: int, device: str) -> BlockPool:
    # zeroed (BlockPool's default), not empty: attention multiplies the masked keys' values by
    # zero weights, and garbage NaN bytes in a never-written slot would turn that into NaN
    return BlockPool(layout, n, torch.device(device))


class Staging:
    """The node's staging slots, shared by the pulls it receives (the decode side: a peer writes
    into them) and the pulls it serves from L1 (the prefill side: L1 -> staging -> the peer).

    A transfer of more blocks than are free moves in chunks: ``take(n)`` gives between 1 and
    ``n`` slots as soon as any is free (lowest first), and the caller moves that chunk, gives
    the slots back, and takes the next. Receivers together hold at most ``num_slots - reserve``
    slots (``reserve``: a quarter of the pool, at least one; none in a pool of one): a sender
    gives its slots back without waiting on any peer, so two nodes pulling from each other with
    full pools cannot deadlock — each one's serving side always finds the reserve, in time."""

    def __init__(self, alloc: SlotAllocator) -> None:
        self.alloc = alloc
        n = alloc.num_slots
        self.reserve = max(1, n // 4) if n > 1 else 0
        self.receiving = 0  # slots held by receivers
        self._waiters: list[asyncio.Future] = []

    def grant(self, n: int, receiving: bool) -> int:
        """How many slots ``take(n)`` gets now (0: it waits)."""
        free = self.alloc.num_free
        if receiving:
            free = min(free, self.alloc.num_slots - self.reserve - self.receiving)
        return max(0, min(n, free))

    async def take(self, n: int, receiving: bool) -> list[int]:
        if n <= 0:
            return []
        if self.alloc.num_slots == 0:
            raise KvLayoutError("no staging pool (0 slots): this node moves no KV through staging")
        while not (k := self.grant(n, receiving)):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        if receiving:
            self.receiving += k
        return self.alloc.alloc(k)

    def give(self, slots: Sequence[int], receiving: bool) -> None:
        if not slots:
            return
        self.alloc.free(list(slots))
        if receiving:
            self.receiving -= len(slots)
        waiters, self._waiters = self._waiters, []
        for w in waiters:  # each re-checks its grant: the loop runs them one at a time
            if not w.done():
                w.set_result(None)


class PagedKv:
    """L1 / L2 / staging pools of one node and the block -> slot maps (module docstring)."""

    def __init__(self, node: NodeId, layout: KvLayout, l1_blocks: int, l2_blocks: int, staging_blocks: int,
                 device: str, *, choose, emit: Callable[[Event], None], now: Callable[[], float]) -> None:
        self.node, self.layout, self.bt = node, layout, layout.block_tokens
        self.pools = {"L1": _pool(layout, l1_blocks, device), "L2": _pool(layout, l2_blocks, "cpu"),
                      "stage": _pool(layout, staging_blocks, "cpu")}
        self.alloc = {t: SlotAllocator(p.num_slots) for t, p in self.pools.items()}
        self.staging = Staging(self.alloc["stage"])
        self.slot: dict[str, dict[BlockHash, int]] = {"L1": {}, "L2": {}}
        self._emit = emit
        self.pool = KvPool(node, self.bt, l1_blocks * self.bt, l2_blocks * self.bt,
                           choose=choose, emit=self._on_event, now=now)
        self.typed = self.pools["L1"].typed()

    def _on_event(self, e: Event) -> None:
        if type(e) is KvEvicted and e.node == self.node:
            slots = self.slot[e.tier]
            self.alloc[e.tier].free([slots.pop(b) for b in e.blocks if b in slots])
        self._emit(e)

    # ------------------------------------------------------------------ private L1 slots
    def take_private(self, n: int, pinned: Sequence[BlockHash] = ()) -> list[int] | None:
        """``n`` private L1 slots (evicting unpinned blocks as needed), or None if they do not fit."""
        if n <= 0:
            return []
        if not self.pool.make_room("L1", 0, pinned, extra_tokens=n * self.bt):
            return None
        self.pool.reserved_tokens += n * self.bt
        return self.alloc["L1"].alloc(n)

    def free_private(self, slots: Sequence[int]) -> None:
        if slots:
            self.pool.reserved_tokens -= len(slots) * self.bt
            self.alloc["L1"].free(list(slots))

    def adopt(self, hashes: Sequence[BlockHash], slots: Sequence[int], pinned: Sequence[BlockHash],
              request: str | None, through: Sequence[BlockHash] | None = None) -> set[int]:
        """Private L1 slots holding computed full blocks become the shared blocks ``hashes``
        (``KvStored`` L1 for those the pool did not hold); returns the slots adopted.

        ``through``: the sequence's full blocks, written through to L2 in the same step (their
        bytes copied from L1): one ``KvStored(write_through=True)`` when L1 and L2 add the same
        blocks and L2 needs no eviction, as the simulator's ``KvPool.store_through`` sends (issue
        24), else the L1 and the L2 event, in that order."""
        if not hashes and through is None:
            return set()
        self.pool.reserved_tokens -= len(hashes) * self.bt
        if through is None:
            new, new2 = set(self.pool.store("L1", list(hashes), pinned, request)), []
        else:
            l1_new, new2 = self.pool.store_through(list(hashes), pinned, request, l2_blocks=through)
            new = set(l1_new)
        adopted = set()
        for h, s in zip(hashes, slots, strict=True):
            if h in new and h not in self.slot["L1"]:
                self.slot["L1"][h] = s
                adopted.add(s)
        self.pool.reserved_tokens += (len(hashes) - len(adopted)) * self.bt
        if new2:
            self._copy_to_l2(new2)
        return adopted

    def claim(self, hashes: Sequence[BlockHash], slots: Sequence[int]) -> list[tuple[BlockHash, int]]:
        """Private L1 slots into which full blocks were pulled whole from a peer become the shared
        blocks ``hashes`` with no event of the pool's (the caller emits ``KvMoved``); a block L1
        came to hold meanwhile keeps its slot and the pulled copy's slot is freed. Returns the
        blocks claimed with their slots. No eviction: the private slots already counted."""
        new: list[tuple[BlockHash, int]] = []
        spare: list[int] = []
        for h, s in zip(hashes, slots, strict=True):
            if h in self.slot["L1"]:
                spare.append(s)
            else:
                self.slot["L1"][h] = s
                new.append((h, s))
        self.free_private(spare)
        self.pool.reserved_tokens -= len(new) * self.bt
        assert self.pool.make_room("L1", len(new)), "claim: private slots turned shared must fit L1"
        self.pool.add("L1", [h for h, _ in new])
        return new

    # ------------------------------------------------------------------ tiers
    def _copy_to_l2(self, new: Sequence[BlockHash]) -> None:
        """L2 slots for ``new`` (blocks the pool just added to L2) and their bytes from L1."""
        dst = self.alloc["L2"].alloc(len(new))
        copy_blocks(self.pools["L1"], [self.slot["L1"][h] for h in new], self.pools["L2"], dst).wait()
        self.slot["L2"].update(zip(new, dst, strict=True))

    def restore(self, hashes: Sequence[BlockHash], pinned: Sequence[BlockHash], request: str | None) -> int:
        """Copy L2 blocks into L1 (``KvStored`` L1); returns how many were restored."""
        want = [h for h in hashes if h in self.slot["L2"] and h not in self.slot["L1"]]
        new = self.pool.store("L1", want, pinned, request)
        if new:
            dst = self.alloc["L1"].alloc(len(new))
            copy_blocks(self.pools["L2"], [self.slot["L2"][h] for h in new], self.pools["L1"], dst).wait()
            self.slot["L1"].update(zip(new, dst, strict=True))
        return len(new)

    def add_l1(self, hashes: Sequence[BlockHash], pinned: Sequence[BlockHash]) -> list[tuple[BlockHash, int]] | None:
        """Slots for blocks arriving into L1 without an event of the pool's (a fetch or a move:
        the caller emits ``KvFetched``/``KvMoved``); None if they do not fit."""
        new = [h for h in dict.fromkeys(hashes) if h not in self.slot["L1"]]
        if not new:
            return []
        if not self.pool.make_room("L1", len(new), pinned):
            return None
        slots = self.alloc["L1"].alloc(len(new))
        self.pool.add("L1", new)
        self.slot["L1"].update(zip(new, slots, strict=True))
        return list(zip(new, slots, strict=True))

    def add_l2(self, hashes: Sequence[BlockHash], pinned: Sequence[BlockHash]) -> list[tuple[BlockHash, int]] | None:
        new = [h for h in dict.fromkeys(hashes) if h not in self.slot["L2"]]
        if not new:
            return []
        if not self.pool.make_room("L2", len(new), pinned):
            return None
        slots = self.alloc["L2"].alloc(len(new))
        self.pool.add("L2", new)
        self.slot["L2"].update(zip(new, slots, strict=True))
        return list(zip(new, slots, strict=True))

    def undo_l2(self, hashes: Sequence[BlockHash]) -> None:
        """Take back ``add_l2`` of ``hashes`` (their bytes never landed, or landed torn): the
        slots are freed and the pool no longer holds them; no event (none announced them)."""
        slots = self.slot["L2"]
        gone = [h for h in dict.fromkeys(hashes) if h in slots]
        self.alloc["L2"].free([slots.pop(h) for h in gone])
        self.pool.forget("L2", gone)

    def drop_all(self) -> None:
        self.pool.drop_all()  # KvEvicted frees every shared slot

    def held_prefix(self, hashes: Sequence[BlockHash], tier: str = "L1") -> int:
        return self.pool.held_run(hashes, 0, self.pool.tier(tier))
