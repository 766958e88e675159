"""Block checksums that travel with a block: BLAKE2b (8-byte digest) over the block's bytes.

The bytes are read on the host (a device block is copied down first). 8 bytes of BLAKE2b make
an accidental match between two different blocks a 2^-64 event; it is a check against torn or
misplaced copies, not a security boundary.
"""

from __future__ import annotations

import hashlib

from kernels.pool import BlockPool


def block_checksum(pool: BlockPool, slot: int) -> int:
    row = pool.bytes[slot]
    data = row.cpu().numpy().tobytes() if row.device.type != "cpu" else row.numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_checksums(pool: BlockPool, slots: list[int]) -> list[int]:
    return [block_checksum(pool, s) for s in slots]
