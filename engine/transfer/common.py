"""Checks and bookkeeping shared by the transfer backends (registered pools, slot plans)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.transfer.base import PoolDescriptor, TransferError, TransferStats
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


class ReadWriteByTransfer:
    """``read_blocks`` / ``write_blocks`` of the port, for a backend whose one
    ``_transfer(peer, remote_slots, local, local_slots, *, read)`` moves either way."""

    def _transfer(self, peer: PoolDescriptor, remote_slots: Sequence[int], local: BlockPool,
                  local_slots: Sequence[int], *, read: bool) -> TransferStats:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_blocks(
        self, peer: PoolDescriptor, remote_slots: Sequence[int], local: BlockPool, local_slots: Sequence[int]
    ) -> TransferStats:
        return self._transfer(peer, remote_slots, local, local_slots, read=True)

    def write_blocks(
        self, local: BlockPool, local_slots: Sequence[int], peer: PoolDescriptor, remote_slots: Sequence[int]
    ) -> TransferStats:
        return self._transfer(peer, remote_slots, local, local_slots, read=False)
