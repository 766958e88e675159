"""Eviction order as reusable policy objects over a :class:`DirectoryCore` (pure, no I/O).

``policy.choose(directory, node, tier, tokens_to_free, pinned)`` returns blocks held by ``node``
in ``tier``, in eviction order, just enough to free ``tokens_to_free`` tokens (each block is
``block_tokens`` tokens; fewer if the node holds too few unpinned blocks), never a pinned block.

- :class:`CountAwareEviction` (METHOD.md §4.4) orders by ``(count > 0, last_access, block)``:
  blocks no active branch references (compacted history, finished sub-agents) go first, in LRU
  order, then referenced blocks in LRU order. A branch waiting a long time on a tool keeps its KV.
- :class:`LruEviction` (the HiCache baseline) orders by ``(last_access, block)``.

The sort is a numpy ``lexsort`` over the node's copies: O(C log C) for C copies on the node,
vectorised. Ties break on the block hash, so the order is deterministic.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import numpy as np

from events.ids import BlockHash, NodeId, Tier


class _Policy:
    name = ""
    count_aware = False

    def __init__(self, block_tokens: int = 64) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens

    def order(self, directory, node: NodeId, tier: Tier,
              pinned: AbstractSet[BlockHash] = frozenset()) -> list[BlockHash]:
        """Every unpinned block of ``node``'s ``tier`` in eviction order."""
        return self._ordered(directory, node, tier, pinned).tolist()

    def _ordered(self, directory, node: NodeId, tier: Tier, pinned: AbstractSet[BlockHash]) -> np.ndarray:
        blocks, last, count = directory.tier_arrays(node, tier)
        if self.count_aware:
            idx = np.lexsort((blocks, last, count > 0))  # the last key is the primary one
        else:
            idx = np.lexsort((blocks, last))
        ordered = blocks[idx]
        if pinned and len(ordered):
            ordered = ordered[~np.isin(ordered, np.fromiter(pinned, dtype=np.uint64, count=len(pinned)))]
        return ordered

    def choose(
        self,
        directory,
        node: NodeId,
        tier: Tier,
        tokens_to_free: int,
        pinned: AbstractSet[BlockHash] = frozenset(),
    ) -> list[BlockHash]:
        """Blocks to evict from ``node``'s ``tier`` to free ``tokens_to_free`` tokens."""
        if tokens_to_free <= 0:
            return []
        n_blocks = -(-tokens_to_free // self.block_tokens)
        return self._ordered(directory, node, tier, pinned)[:n_blocks].tolist()


class CountAwareEviction(_Policy):
    """Zero-count blocks first (LRU among them), then counted blocks (LRU)."""

    name = "count_aware"
    count_aware = True


class LruEviction(_Policy):
    """Least recently used first, counts ignored (baseline)."""

    name = "lru"


POLICIES = {p.name: p for p in (CountAwareEviction, LruEviction)}
