"""The loopback transfer backend: nodes in one process, joined by a ``LoopbackFabric``.

It keeps the port's whole contract (descriptors, resolve, slot checks, run coalescing, stale
descriptors refused) and moves the bytes with ``kernels.ops.copy_blocks``, so tests of the
logic above the port need no network and no Mooncake. ``fail_reads`` lets a test make the
next N transfers fail as a broken link would; ``cut_transfers`` (every backend) makes them
move half of their bytes and succeed, for the checksums to refuse.
"""

from __future__ import annotations

from engine.transfer.base import PeerUnreachable, PoolDescriptor, TransferFailed, TransferStats
from engine.transfer.common import ReadWriteByTransfer, Registry, cut_bytes, plan
from kernels.ops import copy_blocks
from kernels.pool import BlockPool


class LoopbackFabric:
    """The in-process 'network': endpoint name -> backend."""

    def __init__(self) -> None:
        self.nodes: dict[str, LoopbackTransfer] = {}


class LoopbackTransfer(ReadWriteByTransfer):
    name = "loopback"

    def __init__(self, fabric: LoopbackFabric, node: str) -> None:
        self._endpoint = f"loopback:{node}"
        if self._endpoint in fabric.nodes:
            raise PeerUnreachable(f"{self._endpoint} is already on the loopback fabric")
        self.fabric = fabric
        fabric.nodes[self._endpoint] = self
        self.registry = Registry(lambda: self._endpoint)
        self.fail_transfers = 0

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_pool(self, pool: BlockPool, pool_id: str = "host") -> PoolDescriptor:
        return self.registry.add(pool, pool_id)

    def unregister_pool(self, pool_id: str) -> None:
        self.registry.remove(pool_id)

    def _peer_pool(self, peer: PoolDescriptor) -> BlockPool:
        node = self.fabric.nodes.get(peer.endpoint)
        if node is None:
            raise PeerUnreachable(f"no node at {peer.endpoint}")
        pool = node.registry.pools.get(peer.pool_id)
        if pool is None or pool.data_ptr() != peer.base_addr or pool.num_slots != peer.num_slots:
            raise PeerUnreachable(
                f"{peer.endpoint} has no pool {peer.pool_id!r} as described (stale descriptor?)"
            )
        return pool

    def resolve(self, peer: PoolDescriptor) -> None:
        self._peer_pool(peer)

    def _transfer(
        self, peer: PoolDescriptor, remote_slots, local: BlockPool, local_slots, *, read: bool
    ) -> TransferStats:
        self.registry.require(local, "read_blocks" if read else "write_blocks")
        runs = plan(peer, remote_slots, local, local_slots, read=read)
        remote = self._peer_pool(peer)
        if self.fail_transfers > 0:
            self.fail_transfers -= 1
            raise TransferFailed(f"loopback transfer to {peer.endpoint} failed (injected)")
        rs = [r + i for r, _, n in runs for i in range(n)]
        ls = [loc + i for _, loc, n in runs for i in range(n)]
        src, dst = (remote, local) if read else (local, remote)
        if self._cut_next():  # the first half of the bytes, then nothing (base.py: cut_transfers)
            bb = local.block_bytes
            for r, loc, nbytes in cut_bytes(runs, bb):
                s0, d0 = (r, loc) if read else (loc, r)
                flat_src, flat_dst = src.bytes.view(-1), dst.bytes.view(-1)
                flat_dst[d0 * bb:d0 * bb + nbytes].copy_(flat_src[s0 * bb:s0 * bb + nbytes])
        elif read:
            copy_blocks(remote, rs, local, ls).wait()
        else:
            copy_blocks(local, ls, remote, rs).wait()
        return TransferStats(nbytes=len(rs) * local.block_bytes, blocks=len(rs), runs=len(runs))

    def close(self) -> None:
        self.registry.pools.clear()
        self.fabric.nodes.pop(self._endpoint, None)
