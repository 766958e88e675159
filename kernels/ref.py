"""Reference KV block movement: one Python loop turn per block, row assignment only.

Deliberately naive (no index kernels, no word views, no streams): the fast paths in
``kernels.ops`` and ``kernels.triton_ops`` are tested against these functions.
"""

from __future__ import annotations

import torch

from kernels.pool import BlockPool


def ref_gather(pool: BlockPool, slots: list[int]) -> torch.Tensor:
    out = torch.empty((len(slots), pool.block_bytes), dtype=torch.uint8)
    for i, s in enumerate(slots):
        out[i] = pool.bytes[s].cpu()
    return out


def ref_scatter(pool: BlockPool, slots: list[int], staging: torch.Tensor) -> None:
    for i, s in enumerate(slots):
        pool.bytes[s] = staging[i].to(pool.device)


def ref_copy(src: BlockPool, src_slots: list[int], dst: BlockPool, dst_slots: list[int]) -> None:
    # Read everything first so overlapping slot sets in one pool behave like a gather then a scatter.
    rows = [src.bytes[s].clone() for s in src_slots]
    for d, row in zip(dst_slots, rows, strict=True):
        dst.bytes[d] = row.to(dst.device)


def ref_broadcast(src: BlockPool, src_slots: list[int], targets: list[tuple[BlockPool, list[int]]]) -> None:
    for dst, dst_slots in targets:
        ref_copy(src, src_slots, dst, dst_slots)
