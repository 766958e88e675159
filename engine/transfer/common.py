"""Checks and bookkeeping shared by the transfer backends (registered pools, slot plans)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

from engine.transfer.base import PoolDescriptor, TransferCorrupt, TransferError, TransferStats
from kernels.layout import KvLayoutError, check_slots, coalesce_runs
from kernels.ops import as_slots
from kernels.pool import BlockPool


class Registry:
    """The pools a backend has registered, by id."""

    def __init__(self, endpoint_of: Callable[[], str]) -> None:
        self._endpoint_of = endpoint_of
        self.pools: dict[str, BlockPool] = {}

    def add(self, pool: BlockPool, pool_id: str) -> PoolDescriptor:
        if pool_id in self.pools:
            raise TransferError(f"pool id {pool_id!r} is already registered")
        if pool.device.type != "cpu":
            # TCP moves host memory; RDMA could register device memory (GPUDirect), not done yet.
            raise TransferError(f"pool {pool_id!r} is on {pool.device}; register a host pool")
        self.pools[pool_id] = pool
        return self.describe(pool_id)

    def remove(self, pool_id: str) -> BlockPool:
        if pool_id not in self.pools:
            raise TransferError(f"pool id {pool_id!r} is not registered")
        return self.pools.pop(pool_id)

    def describe(self, pool_id: str) -> PoolDescriptor:
        pool = self.pools[pool_id]
        return PoolDescriptor(
            endpoint=self._endpoint_of(),
            pool_id=pool_id,
            base_addr=pool.data_ptr(),
            slot_bytes=pool.block_bytes,
            num_slots=pool.num_slots,
            layout=pool.layout.fingerprint(),
        )

    def require(self, pool: BlockPool, what: str) -> None:
        if not any(p is pool for p in self.pools.values()):
            raise TransferError(f"{what}: the local pool is not registered with this backend")


def plan(
    peer: PoolDescriptor,
    remote_slots: Sequence[int],
    local: BlockPool,
    local_slots: Sequence[int],
    *,
    read: bool,
) -> list[tuple[int, int, int]]:
    """Validate one transfer and return its runs as ``(remote_slot, local_slot, count)``.

    The written side's slots must be unique (a read writes locally, a write remotely).
    """
    what = "read_blocks" if read else "write_blocks"
    remote = as_slots(remote_slots, what)
    loc = as_slots(local_slots, what)
    if peer.layout != local.layout.fingerprint():
        raise KvLayoutError(
            f"{what}: peer {peer.endpoint} has layout {peer.layout}, ours {local.layout.fingerprint()}"
        )
    check_slots(remote, peer.num_slots, f"{what} remote {peer.endpoint}/{peer.pool_id}", unique=not read)
    check_slots(loc, local.num_slots, f"{what} local", unique=read)
    return coalesce_runs(remote, loc)


def slot_checksums(pool: BlockPool, slots: Sequence[int]) -> list[int]:
    """BLAKE2b (8 bytes) of each slot's bytes: ``kernels.checksum.block_checksums``'s values,
    hashed from one host view (a device pool goes through the kernel's copy)."""
    if pool.device.type != "cpu":
        from kernels.checksum import block_checksums  # lazy: device pools only (a copy per block)

        return block_checksums(pool, list(slots))
    rows = pool.bytes.numpy()
    return [int.from_bytes(hashlib.blake2b(rows[s], digest_size=8).digest(), "little") for s in slots]


def verify_landed(pool: BlockPool, slots: Sequence[int], expect: Sequence[int], what: str) -> list[int]:
    """Checksum the blocks that landed in ``slots``; ``TransferCorrupt`` (naming the slots that
    differ) unless each equals ``expect``'s. Returns the checksums."""
    slots = as_slots(slots, what)
    if len(expect) != len(slots):
        raise KvLayoutError(f"{what}: {len(expect)} checksums for {len(slots)} slots")
    got = slot_checksums(pool, slots)
    bad = [s for s, g, e in zip(slots, got, expect, strict=True) if g != int(e)]
    if bad:
        raise TransferCorrupt(f"{what}: {len(bad)} of {len(slots)} blocks landed with a checksum that differs "
                              f"from the sender's (slots {bad[:8]}{'...' if len(bad) > 8 else ''}): refused", bad)
    return got


def cut_bytes(runs: list[tuple[int, int, int]], block_bytes: int) -> list[tuple[int, int, int]]:
    """The fault ``cut_transfers``: the runs as ``(remote_slot, local_slot, nbytes)`` cut to the
    first half of their bytes (mid-block when it falls there), the rest never sent."""
    keep = sum(n for _, _, n in runs) * block_bytes // 2
    out = []
    for r, loc, n in runs:
        if keep <= 0:
            break
        nbytes = min(n * block_bytes, keep)
        out.append((r, loc, nbytes))
        keep -= nbytes
    return out


class ReadWriteByTransfer:
    """``read_blocks`` / ``write_blocks`` of the port, for a backend whose one
    ``_transfer(peer, remote_slots, local, local_slots, *, read)`` moves either way (and honours
    ``cut_transfers`` through :meth:`_cut_next`)."""

    cut_transfers = 0  # the next N transfers move half of their bytes and report success (base.py)

    def _cut_next(self) -> bool:
        if self.cut_transfers > 0:
            self.cut_transfers -= 1
            return True
        return False

    def _transfer(self, peer: PoolDescriptor, remote_slots: Sequence[int], local: BlockPool,
                  local_slots: Sequence[int], *, read: bool) -> TransferStats:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_blocks(
        self, peer: PoolDescriptor, remote_slots: Sequence[int], local: BlockPool, local_slots: Sequence[int],
        expect: Sequence[int] | None = None,
    ) -> TransferStats:
        if expect is not None and len(expect) != len(local_slots):
            raise KvLayoutError(f"read_blocks: {len(expect)} checksums for {len(local_slots)} slots")
        stats = self._transfer(peer, remote_slots, local, local_slots, read=True)
        if expect is None:
            return stats
        got = verify_landed(local, local_slots, expect, f"read_blocks from {peer.endpoint}/{peer.pool_id}")
        return msgspec.structs.replace(stats, checksums=got)

    def write_blocks(
        self, local: BlockPool, local_slots: Sequence[int], peer: PoolDescriptor, remote_slots: Sequence[int],
        checksums: bool = False,
    ) -> TransferStats:
        stats = self._transfer(peer, remote_slots, local, local_slots, read=False)
        if not checksums:
            return stats
        return msgspec.structs.replace(stats, checksums=slot_checksums(local, as_slots(local_slots, "write_blocks")))
