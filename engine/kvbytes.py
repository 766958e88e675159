"""Byte-backed KV tiers: real bytes behind a ``KvPool`` tier's block ids.

``KvBytes`` gives one tier of one node's ``engine.kvpool.KvPool`` storage without changing the
pool: a ``kernels.pool.BlockPool`` with one slot per block the tier can hold, a map
``block hash -> slot`` and the BLAKE2b checksum of every block it holds.

Wiring (the pool is untouched; its events drive the bytes):
1. ``emit = kv_bytes.tap(emit)`` before building the ``KvPool``: every ``KvStored`` of this node
   and tier takes free slots and writes the blocks' bytes (``content``: the sim synthesizes
   them from the block hash, a real engine copies them down from its GPU pool); every
   ``KvEvicted`` frees the slots. The tap runs before the event goes on, so a peer that learns
   of a block can already read it.
2. Blocks that come from a peer (the caller does ``KvPool.make_room`` + ``add`` and emits
   ``KvFetched``/``KvMoved``) come in through ``receive``: local slots are taken, the bytes are
   read with the node's ``TransferBackend`` from the slots the owner named (``export``), and
   every block's checksum is compared with the one that travelled with it before it is kept.
3. ``push`` is the prefill -> decode direction: our slots written into slots the decode named.

Slots never run out while the pool's capacity is respected: ``make_room`` evicts (and so
frees slots) before the store that needs them, and the ``BlockPool`` has as many slots as the
tier has blocks (plus headroom for held slots, below).

For a worker whose transfers run while the node goes on (engine/kvplane.py):
- ``hold``/``release``: a slot a peer reads or a transfer writes is held; a block dropped
  meanwhile gives its slot back on the last release, never earlier.
- ``expect`` -> ``land``/``abandon``: the pool holds blocks whose bytes are still on their
  way (``pending``); ``land`` keeps them if their checksum matches the one that travelled with
  them, else the block stays without bytes (``has_bytes`` False), as after ``abandon``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from engine.transfer.base import PoolDescriptor, TransferBackend, TransferError
from events.catalog import Event, KvEvicted, KvStored
from kernels.checksum import block_checksum, block_checksums
from kernels.layout import KvLayout
from kernels.pool import BlockPool, SlotAllocator, host_pool


class ChecksumMismatch(TransferError):
    """A block arrived with bytes whose checksum differs from the one that travelled with it."""


_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def synthesize_many(pool: BlockPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
    """The sim's bytes for ``blocks`` into ``slots``: word ``i`` of block ``h`` is
    splitmix64(h + i * golden), in one batched op (int64 arithmetic wraps), so every node that
    stores block ``h`` writes the same bytes and computes the same checksum."""
    if not slots:
        return
    words = -(-pool.block_bytes // 8)
    h = torch.tensor([b - 2**64 if b >= 2**63 else b for b in blocks], dtype=torch.int64)
    z = h[:, None] + torch.arange(1, words + 1, dtype=torch.int64)[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    idx = torch.tensor(list(slots), dtype=torch.int64)
    pool.bytes[idx] = z.view(torch.uint8)[:, : pool.block_bytes].to(pool.device)


def synthesize(pool: BlockPool, slot: int, block: int) -> None:
    """The sim's bytes for one block (``synthesize_many``)."""
    synthesize_many(pool, [slot], [block])


def checksums(pool: BlockPool, slots: Sequence[int]) -> list[int]:
    """``kernels.checksum.block_checksums`` (BLAKE2b, 8 bytes, the same values), hashing rows
    of one host view instead of building a tensor per block (about 10x faster on small blocks)."""
    if pool.device.type != "cpu":
        return block_checksums(pool, list(slots))
    rows = pool.bytes.numpy()
    return [int.from_bytes(hashlib.blake2b(rows[s], digest_size=8).digest(), "little") for s in slots]


class KvBytes:
    """The bytes of one tier of one node's KV pool (see the module docstring)."""

    def __init__(
        self,
        node: str,
        tier: str,
        layout: KvLayout,
        capacity_blocks: int,
        *,
        pool: BlockPool | None = None,
        content: Callable[[BlockPool, int, int], None] = synthesize,
    ) -> None:
        self.node = node
        self.tier = tier
        self.pool = pool if pool is not None else host_pool(layout, capacity_blocks)
        assert self.pool.num_slots >= capacity_blocks, "the byte pool must hold the whole tier"
        self.content = content
        self.slots = SlotAllocator(self.pool.num_slots)
        self.slot_of: dict[int, int] = {}
        self.checksum_of: dict[int, int] = {}
        self.pending: dict[int, int] = {}  # block -> slot whose bytes are still on their way
        self._holds: dict[int, int] = {}  # slot -> holders (a peer's lease, a transfer in flight)
        self._free_later: set[int] = set()  # dropped slots still held: freed on the last release

    # -------------------------------------------------------------- events of our own pool
    def tap(self, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        def tapped(event: Event) -> None:
            self.observe(event)
            emit(event)

        return tapped

    def observe(self, event: Event) -> None:
        if isinstance(event, KvEvicted) and event.node == self.node and event.tier == self.tier:
            self._drop(event.blocks)
        elif isinstance(event, KvStored) and event.node == self.node and self.tier in event.tiers():
            self._store(event.blocks)

    def _store(self, blocks: Sequence[int]) -> None:
        new = [b for b in dict.fromkeys(blocks) if b not in self.slot_of]
        slots = self.slots.alloc(len(new))
        if self.content is synthesize:
            synthesize_many(self.pool, slots, new)
        else:
            for block, slot in zip(new, slots, strict=True):
                self.content(self.pool, slot, block)
        for block, slot, sum_ in zip(new, slots, checksums(self.pool, slots), strict=True):
            self.slot_of[block] = slot
            self.checksum_of[block] = sum_

    def _drop(self, blocks: Sequence[int]) -> None:
        gone = [b for b in dict.fromkeys(blocks) if b in self.slot_of]
        self._free([self.slot_of.pop(b) for b in gone])
        for b in gone:
            self.checksum_of.pop(b, None)
            self.pending.pop(b, None)

    # -------------------------------------------------------------- holds and pending blocks
    def _free(self, slots: Sequence[int]) -> None:
        """Free ``slots`` now, or on their last release while something holds them (a peer
        reading them, a transfer writing them): a held slot is never handed out again."""
        now = [s for s in slots if s not in self._holds]
        self._free_later.update(s for s in slots if s in self._holds)
        self.slots.free(now)

    def hold(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._holds[s] = self._holds.get(s, 0) + 1

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            n = self._holds[s] - 1
            if n:
                self._holds[s] = n
                continue
            del self._holds[s]
            if s in self._free_later:
                self._free_later.discard(s)
                self.slots.free([s])

    @property
    def held_slots(self) -> int:
        return len(self._holds)

    def has_bytes(self, block: int) -> bool:
        """Whether ``block``'s bytes are here and verified (held and not still arriving)."""
        return block in self.checksum_of

    def expect(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """The pool now holds ``blocks`` whose bytes come later (a fetch or a P->D move in
        flight): a held slot for each one not held yet, as ``(block, slot)``. ``land`` or
        ``abandon`` each pair exactly once."""
        new = [b for b in dict.fromkeys(blocks) if b not in self.slot_of]
        pairs = list(zip(new, self.slots.alloc(len(new)), strict=True))
        self.pool.poison([s for _, s in pairs])  # no earlier transfer's bytes pass as these (BlockPool.poison)
        for block, slot in pairs:
            self.slot_of[block] = slot
            self.pending[block] = slot
        self.hold([s for _, s in pairs])
        return pairs

    def land(self, block: int, slot: int, want: int, got: int) -> bool:
        """The bytes of a pending block are in ``slot``: keep them if ``got`` (their checksum,
        computed after the transfer) is ``want`` (the one that travelled with them). A block
        evicted meanwhile just lets its slot go. Returns whether the checksum matched."""
        ok = got == want
        if self.pending.get(block) == slot:
            del self.pending[block]
            if ok:
                self.checksum_of[block] = want
            else:
                del self.slot_of[block]
                self._free([slot])
        self.release([slot])
        return ok

    def abandon(self, block: int, slot: int) -> None:
        """The bytes of a pending block will not come (the peer lost it): the block stays in
        the pool without bytes (``has_bytes`` is False; a peer asking for it is told so)."""
        if self.pending.get(block) == slot:
            del self.pending[block]
            del self.slot_of[block]
            self._free([slot])
        self.release([slot])

    # -------------------------------------------------------------- between nodes
    def export(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Slots and checksums of ``blocks`` (what the owner answers a fetch request with)."""
        missing = [b for b in blocks if b not in self.checksum_of]
        if missing:
            raise TransferError(f"{self.node}/{self.tier} does not hold block {missing[0]:#x}")
        return [self.slot_of[b] for b in blocks], [self.checksum_of[b] for b in blocks]

    def receive(
        self,
        blocks: Sequence[int],
        *,
        transfer: TransferBackend,
        peer: PoolDescriptor,
        peer_slots: Sequence[int],
        checksums: Sequence[int],
    ) -> list[int]:
        """Read ``blocks`` from the peer's slots into new local slots and verify each checksum.
        Blocks already held are skipped. On a mismatch nothing is kept and the error names the
        first bad block."""
        todo = [
            (b, s, c) for b, s, c in zip(blocks, peer_slots, checksums, strict=True) if b not in self.slot_of
        ]
        if not todo:
            return []
        local = self.slots.alloc(len(todo))
        self.pool.poison(local)
        try:
            transfer.read_blocks(peer, [s for _, s, _ in todo], self.pool, local)
            for (block, _, want), slot in zip(todo, local, strict=True):
                got = block_checksum(self.pool, slot)
                if got != want:
                    raise ChecksumMismatch(
                        f"block {block:#x} from {peer.endpoint}: checksum {got:#x}, expected {want:#x}"
                    )
        except BaseException:
            self.slots.free(local)
            raise
        for (block, _, want), slot in zip(todo, local, strict=True):
            self.slot_of[block] = slot
            self.checksum_of[block] = want
        return [b for b, _, _ in todo]

    def push(
        self,
        blocks: Sequence[int],
        *,
        transfer: TransferBackend,
        peer: PoolDescriptor,
        peer_slots: Sequence[int],
    ) -> list[int]:
        """Write our ``blocks`` into the peer's ``peer_slots`` (P->D); returns their checksums,
        which travel with the blocks so the receiver can verify them."""
        slots, sums = self.export(blocks)
        transfer.write_blocks(self.pool, slots, peer, peer_slots)
        return sums

    def adopt(self, blocks: Sequence[int], slots: Sequence[int], checksums: Sequence[int]) -> None:
        """Take ownership of blocks a peer wrote into ``slots`` (reserved with ``reserve``),
        after verifying their checksums."""
        for block, slot, want in zip(blocks, slots, checksums, strict=True):
            got = block_checksum(self.pool, slot)
            if got != want:
                self.slots.free(list(slots))
                raise ChecksumMismatch(
                    f"block {block:#x} written by a peer: checksum {got:#x}, expected {want:#x}"
                )
        for block, slot, want in zip(blocks, slots, checksums, strict=True):
            self.slot_of[block] = slot
            self.checksum_of[block] = want

    def reserve(self, n: int) -> list[int]:
        """Free slots a peer may write into (the decode side of a P->D transfer), poisoned."""
        slots = self.slots.alloc(n)
        self.pool.poison(slots)
        return slots
