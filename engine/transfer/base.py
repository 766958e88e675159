"""The KV transfer port: what a worker needs to move blocks between nodes' pools.

Life of a transfer (the same for every backend):
1. ``register_pool(pool, pool_id)`` makes a local pool reachable and returns its
   ``PoolDescriptor``; the node publishes it (``NodeRegistered`` carries it to peers).
2. ``resolve(descriptor)`` checks that a peer's pool can be reached and has our layout; reads
   and writes resolve on first use, so calling it is only needed to fail early.
3. ``read_blocks`` (peer fetch: the peer's slots -> our slots) and ``write_blocks`` (P->D: our
   slots -> the peer's slots) return when the bytes are in place, with what moved. Runs of
   consecutive slots on both sides go as one transfer (``kernels.layout.coalesce_runs``).
4. ``unregister_pool(pool_id)`` withdraws one pool (peers' transfers to it then fail);
   ``close()`` unregisters everything and the backend is unusable afterwards.

Checksums (BLAKE2b, 8 bytes per block, ``kernels.checksum.block_checksum``'s values): a read
given ``expect`` (the owner's checksums of the blocks, in the order of ``remote_slots``)
checksums what landed and raises ``TransferCorrupt`` when any block differs; a write with
``checksums=True`` returns the checksums of the bytes it sent, for the receiver to check what
landed with ``engine.transfer.verify_landed`` (a one-sided write cannot be checked by its sender).
Either way a receiver refuses a transfer whose checksums do not match. ``cut_transfers = N``
(a test and chaos hook on every backend) makes the next N transfers move only the first half of
their bytes and report success, as a link cut mid-way that the transport did not notice.

Bad input (unknown local pool, slot out of range, two layouts) raises ``KvLayoutError`` or
``TransferError`` before anything moves. Calls are synchronous: a worker hides them under queue
wait by running them in a thread (``asyncio.to_thread``), as SGLang's transfer threads do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from kernels.pool import BlockPool


class TransferError(RuntimeError):
    """A transfer could not be carried out (the message names the peer and what failed)."""


class TransferUnavailable(TransferError):
    """The backend's library is missing on this machine (the message says what to install)."""


class PeerUnreachable(TransferError):
    """The peer's endpoint does not answer or does not have the pool the descriptor names."""


class TransferFailed(TransferError):
    """The backend reported a failed transfer."""


class TransferCorrupt(TransferFailed):
    """The bytes that landed are not the sender's: their checksums differ (a transfer cut
    mid-way, torn or misplaced). The receiver refuses them: the slots hold garbage, and the
    blocks must be recomputed. ``slots`` are the receiving slots that differ."""

    def __init__(self, message: str, slots: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.slots = list(slots)


class PoolDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """Where a registered pool lives, as peers need it (small enough for ``NodeRegistered``)."""

    endpoint: str  # the backend's address of the node ("127.0.0.1:15578", "loopback:n1")
    pool_id: str  # which of the node's pools ("host", "gpu0", ...)
    base_addr: int  # address of slot 0 in the owner's memory
    slot_bytes: int
    num_slots: int
    layout: str  # KvLayout.fingerprint(): both sides must agree


class TransferStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    nbytes: int
    blocks: int
    runs: int  # transfers issued after coalescing consecutive slots
    #: per block, in the order of the slots asked: a verified read's landed checksums, a write's
    #: checksums of the bytes sent (``checksums=True``); empty otherwise
    checksums: list[int] = []


@runtime_checkable
class TransferBackend(Protocol):
    name: str

    @property
    def endpoint(self) -> str: ...

    def register_pool(self, pool: BlockPool, pool_id: str = "host") -> PoolDescriptor: ...

    def unregister_pool(self, pool_id: str) -> None: ...

    def resolve(self, peer: PoolDescriptor) -> None: ...

    def read_blocks(
        self, peer: PoolDescriptor, remote_slots: Sequence[int], local: BlockPool, local_slots: Sequence[int],
        expect: Sequence[int] | None = None,
    ) -> TransferStats: ...

    def write_blocks(
        self, local: BlockPool, local_slots: Sequence[int], peer: PoolDescriptor, remote_slots: Sequence[int],
        checksums: bool = False,
    ) -> TransferStats: ...

    def close(self) -> None: ...
