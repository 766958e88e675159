"""Block checksums that travel with a block: BLAKE2b (8-byte digest) over the block's bytes.

The bytes are read on the host (a device block is copied down first). 8 bytes of BLAKE2b make
an accidental match between two different blocks a 2^-64 event; it is a check against torn or
misplaced copies, not a security boundary.
"""

from __future__ import annotations

import hashlib

import torch

from kernels.pool import BlockPool


def block_checksum(pool: BlockPool, slot: int) -> int:
    row = pool.bytes[slot]
    data = row.cpu().numpy().tobytes() if row.device.type != "cpu" else row.numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_checksums(pool: BlockPool, slots: list[int]) -> list[int]:
    return [block_checksum(pool, s) for s in slots]


def fast_checksums(pool: BlockPool, slots: list[int]) -> list[int]:
    """A cheap checksum computed where the pool lives (one batched op, no copy of the blocks to
    the host): ``sum((2i + 1) * word_i) mod 2**64`` over the block's words (``BlockPool.words``:
    signed int64/int32/int16, or unsigned bytes for odd-sized blocks). Odd weights make any
    change of a single word change the sum; it is not a hash (crafted or some multi-word changes
    can collide). Use it on GPU pools, where BLAKE2b would need every block copied down;
    ``block_checksum`` stays the one that travels between nodes.
    """
    if not slots:
        return []
    words = pool.words()
    rows = words[torch.tensor(slots, dtype=torch.int64, device=pool.device)].to(torch.int64)
    weights = torch.arange(1, 2 * rows.shape[1], 2, dtype=torch.int64, device=pool.device)
    sums = (rows * weights).sum(dim=1)  # int64 arithmetic wraps modulo 2**64
    return [int(s) & (2**64 - 1) for s in sums.tolist()]
