"""Longest-prefix lookup results (pure, no I/O).

Chained hashes make two prefixes equal when their last blocks are equal, so the directory
needs no tree: one dict probe per block of the request gives its slot, one numpy gather gives
the ``[blocks, nodes, tiers]`` holder matrix, and every prefix is a "first False" along the
block axis. The scan stops at the first block that no node holds (the pool prefix).
"""

from __future__ import annotations

import msgspec
import numpy as np

from events.catalog import FetchStep
from events.ids import NodeId


class NodeMatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Longest prefixes of one request held on one node (in blocks).

    ``l1_blocks``: in GPU memory; ``local_blocks``: on the node in L1 or L2 (the part
    ``local_blocks - l1_blocks`` is restored from host, ``t_rst``); ``l2_blocks``: in host memory.
    """

    l1_blocks: int
    local_blocks: int
    l2_blocks: int = 0


class Lookup:
    """Result of :meth:`DirectoryCore.lookup` for one request's block list.

    ``per_node`` covers every live node (zeros included); ``pool_blocks`` is the longest prefix
    held anywhere. ``fetch_plan(node)`` lists the peer reads that bring ``node`` from its local
    prefix to the pool prefix.
    """

    __slots__ = ("_cols", "_ids", "_rows", "n_blocks", "per_node", "pool_blocks")

    def __init__(self, n_blocks: int, pool_blocks: int, held: np.ndarray, live: list[tuple[NodeId, int]]) -> None:
        """``held``: ``[pool_blocks, 2 * columns]`` holder matrix (column ``2n + tier``)."""
        self.n_blocks = n_blocks
        self.pool_blocks = pool_blocks
        self._cols = {node: col for node, col in live}
        self._ids = sorted(live)  # (node id, column): ties go to the smallest id
        # one contiguous row per (node, tier), padded with a False so argmin = first gap
        rows = np.zeros((held.shape[1], pool_blocks + 1), dtype=bool)
        rows[:, :pool_blocks] = held.T
        self._rows = rows
        l1 = rows[0::2].argmin(axis=1).tolist()
        l2 = rows[1::2].argmin(axis=1).tolist()
        local = (rows[0::2] | rows[1::2]).argmin(axis=1).tolist()
        self.per_node = {node: NodeMatch(l1_blocks=l1[col], local_blocks=local[col], l2_blocks=l2[col])
                         for node, col in live}

    def best(self) -> tuple[NodeId | None, int]:
        """The node with the longest local prefix (ties to the smallest node id) and its length."""
        best: tuple[NodeId | None, int] = (None, 0)
        for node, _ in self._ids:
            n = self.per_node[node].local_blocks
            if n > best[1]:
                best = (node, n)
        return best

    def tokens(self, node: NodeId, prompt_tokens: int, block_tokens: int, fetch: bool = True) -> tuple[int, int]:
        """``(t_c, t_uc)`` on ``node``: cached prompt tokens (after the fetch plan if ``fetch``)
        and the rest. Full blocks only; the router may cap ``t_c`` so one token is computed."""
        m = self.per_node.get(node)
        cached = self.pool_blocks if fetch else (m.local_blocks if m else 0)
        t_c = min(cached * block_tokens, prompt_tokens)
        return t_c, prompt_tokens - t_c

    def fetch_plan(self, node: NodeId) -> list[FetchStep]:
        """Steps fetching blocks ``[local_blocks(node), pool_blocks)`` from peers.

        Host copies (L2) are read where any peer has one, GPU copies (L1) only where no peer
        does. From each position the source is the peer whose copy in that tier covers the
        longest run, ties to the smallest node id; one step per maximal run. Blocks inside the
        range that only ``node`` itself holds are skipped.
        """
        own = self._cols.get(node)
        m = self.per_node.get(node)
        pos = m.local_blocks if m else 0
        steps: list[FetchStep] = []
        while pos < self.pool_blocks:
            found = self._longest_source(pos, own)
            if found is None:
                pos += 1
                continue
            src, end, tier = found
            steps.append(FetchStep(src_node=src, first_block=pos, n_blocks=end - pos, tier=tier))
            pos = end
        return steps

    def _longest_source(self, pos: int, own: int | None) -> tuple[NodeId, int, str] | None:
        for t, tier in ((1, "L2"), (0, "L1")):
            best: tuple[int, str] | None = None
            for node, col in self._ids:
                row = self._rows[2 * col + t]
                if col == own or not row[pos]:
                    continue
                end = pos + int(row[pos:].argmin())
                if best is None or end > best[0]:
                    best = (end, node)
            if best is not None:
                return best[1], best[0], tier
        return None
