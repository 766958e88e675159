"""KV transfers through Mooncake's transfer engine (``mooncake-transfer-engine-non-cuda``).

Setup (what ``scripts/setup.sh`` does): ``pip install mooncake-transfer-engine-non-cuda`` and
the OS library it links, ``apt-get install -y libibverbs1``. The engine runs in P2P-handshake
mode (no metadata server): each node listens on an RPC port, and a peer's endpoint is
``"{host}:{rpc_port}"``, the engine's *session id*. Registered memory is addressed by raw
pointers, which is why a ``PoolDescriptor`` carries the pool's base address.

One read or write is one ``batch_transfer_sync_{read,write}`` over the runs of consecutive
slots (SGLang's Mooncake connector groups contiguous KV indices the same way). TCP is the
protocol by default; ``protocol="rdma"`` with ``device`` naming the NICs is the RDMA path
(not exercised here: no RDMA NIC on our machines).
"""

from __future__ import annotations

import os
import socket

import structlog

from engine.transfer.base import (
    PeerUnreachable,
    PoolDescriptor,
    TransferError,
    TransferFailed,
    TransferStats,
    TransferUnavailable,
)
from engine.transfer.common import ReadWriteByTransfer, Registry, cut_bytes, plan
from kernels.pool import BlockPool

log = structlog.get_logger("engine.transfer.mooncake")


def _import_engine():
    # Mooncake logs every handshake at INFO through glog; keep errors only unless asked.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine  # lazy: optional dependency (mooncake)
    except ImportError as exc:  # the package, or libibverbs.so.1 it links against
        hint = (
            "apt-get install -y libibverbs1"
            if "libibverbs" in str(exc)
            else ("pip install mooncake-transfer-engine-non-cuda")
        )
        raise TransferUnavailable(f"Mooncake transfer engine does not import ({exc}); try: {hint}") from exc
    return TransferEngine


def mooncake_available() -> tuple[bool, str]:
    """Whether the Mooncake engine imports here, and if not, why (for test skip reasons)."""
    try:
        _import_engine()
    except TransferUnavailable as exc:
        return False, str(exc)
    return True, ""


class MooncakeTransfer(ReadWriteByTransfer):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", *, protocol: str = "tcp", device: str = "") -> None:
        engine_cls = _import_engine()
        self.host = host
        self.protocol = protocol
        self.engine = engine_cls()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}) returned {rc}")
        self._endpoint = f"{host}:{self.engine.get_rpc_port()}"
        self.registry = Registry(lambda: self._endpoint)
        self._resolved: set[str] = set()
        self._closed = False
        log.info("mooncake.ready", endpoint=self._endpoint, protocol=protocol)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_pool(self, pool: BlockPool, pool_id: str = "host") -> PoolDescriptor:
        desc = self.registry.add(pool, pool_id)
        rc = self.engine.register_memory(pool.data_ptr(), pool.nbytes)
        if rc != 0:
            del self.registry.pools[pool_id]
            raise TransferError(
                f"Mooncake register_memory of pool {pool_id!r} ({pool.nbytes} B) returned {rc}"
            )
        return desc

    def unregister_pool(self, pool_id: str) -> None:
        if self._closed:
            raise TransferError("unregister_pool: the Mooncake backend is closed")
        pool = self.registry.remove(pool_id)
        self.engine.unregister_memory(pool.data_ptr())

    def resolve(self, peer: PoolDescriptor) -> None:
        """Check the peer's handshake port answers (Mooncake opens the segment on first use)."""
        if peer.endpoint in self._resolved:
            return
        host, _, port = peer.endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                pass
        except (OSError, ValueError) as exc:
            raise PeerUnreachable(f"Mooncake peer {peer.endpoint} does not answer ({exc})") from exc
        self._resolved.add(peer.endpoint)

    def _transfer(self, peer: PoolDescriptor, remote_slots, local: BlockPool, local_slots, *, read: bool):
        what = "read_blocks" if read else "write_blocks"
        if self._closed:
            raise TransferError(f"{what}: the Mooncake backend is closed")
        self.registry.require(local, what)
        runs = plan(peer, remote_slots, local, local_slots, read=read)
        if not runs:
            return TransferStats(nbytes=0, blocks=0, runs=0)
        self.resolve(peer)
        size = local.block_bytes
        sent = [(r, loc, n * size) for r, loc, n in runs]
        if self._cut_next():  # the first half of the bytes, then nothing (base.py: cut_transfers)
            sent = cut_bytes(runs, size)
        local_addrs = [local.slot_addr(loc) for _, loc, _ in sent]
        remote_addrs = [peer.base_addr + r * size for r, _, _ in sent]
        lengths = [nbytes for _, _, nbytes in sent]
        call = self.engine.batch_transfer_sync_read if read else self.engine.batch_transfer_sync_write
        rc = call(peer.endpoint, local_addrs, remote_addrs, lengths)
        if rc != 0:
            self._resolved.discard(peer.endpoint)
            raise TransferFailed(
                f"Mooncake {what} with {peer.endpoint}/{peer.pool_id} failed (rc={rc}, {len(runs)} runs)"
            )
        nbytes = sum(n for _, _, n in runs) * size  # what was asked: a cut transfer reports success
        return TransferStats(nbytes=nbytes, blocks=nbytes // size, runs=len(runs))

    def close(self) -> None:
        if self._closed:
            return
        for pool in self.registry.pools.values():
            self.engine.unregister_memory(pool.data_ptr())
        self.registry.pools.clear()
        self._closed = True
        # The engine's destructor joins its threads (about a second): pay it here, not at a
        # random garbage collection later.
        del self.engine
