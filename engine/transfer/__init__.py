"""KV block transfers between nodes: a port (``base.TransferBackend``) and one folder per backend.

- ``loopback/``: the in-process fake (pools in one process, copies through ``kernels.ops``);
  the unit and contract tests run against it.
- ``mooncake/``: Mooncake's transfer engine (TCP here, RDMA where the NICs have it).

A node registers its host pool and publishes the returned ``PoolDescriptor`` (endpoint, base
address, slot size, layout); a peer that has the descriptor reads blocks from that pool into
its own slots (peer fetch) or writes its blocks into it (prefill -> decode transfer). Every
block travels with its checksum and a receiver refuses one that differs (``TransferCorrupt``;
``common.verify_landed``, which needs torch like the backends).
"""

from engine.transfer.base import (
    PeerUnreachable,
    PoolDescriptor,
    TransferBackend,
    TransferCorrupt,
    TransferError,
    TransferFailed,
    TransferStats,
    TransferUnavailable,
)
from engine.transfer.factory import BACKENDS, make_transfer

__all__ = [
    "BACKENDS",
    "PeerUnreachable",
    "PoolDescriptor",
    "TransferBackend",
    "TransferCorrupt",
    "TransferError",
    "TransferFailed",
    "TransferStats",
    "TransferUnavailable",
    "make_transfer",
]
