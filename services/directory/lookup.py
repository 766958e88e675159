"""Longest-prefix lookup over the directory's block -> holder bitmask table (pure, no I/O).

A holder mask packs two bits per node index ``i``: bit ``2*i`` = the node holds the block in
GPU memory (L1), bit ``2*i + 1`` = in host memory (L2). Chained hashes make a prefix equal
when its last block is equal, so a flat ``dict[block, mask]`` is enough: one pass over the
request's blocks, one dict probe per block, stops at the first block that no node holds.

The pass records the masks run-length encoded (``segments``: ``(start, mask)`` at every change),
so per-node prefixes and fetch plans are computed from a handful of segments, not per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from events.catalog import FetchStep
from events.ids import BlockHash, NodeId


class NodeMatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Longest prefixes of one request held on one node (in blocks).

    ``l1_blocks``: in GPU memory; ``local_blocks``: on the node in L1 or L2 (the part
    ``local_blocks - l1_blocks`` is restored from host, ``t_rst``); ``l2_blocks``: in host memory.
    """

    l1_blocks: int
    local_blocks: int
    l2_blocks: int = 0


def scan(where: dict[int, int], blocks: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
    """One pass: (pool prefix length, run-length encoded holder masks of that prefix)."""
    get = where.get
    segments: list[tuple[int, int]] = []
    prev = -1
    i = 0
    for b in blocks:
        m = get(b, 0)
        if m != prev:
            if m == 0:
                break
            segments.append((i, m))
            prev = m
        i += 1
    return i, segments


def _prefix(segments: list[tuple[int, int]], pool: int, bits: int) -> int:
    """Length of the prefix whose every mask intersects ``bits``."""
    for start, m in segments:
        if not m & bits:
            return start
    return pool


class Lookup:
    """Result of :meth:`DirectoryCore.lookup` for one request's block list.

    ``per_node`` covers every live node (zeros included); ``pool_blocks`` is the longest
    prefix held anywhere. ``fetch_plan(node)`` lists the peer reads that bring ``node`` from
    its local prefix to the pool prefix.
    """

    __slots__ = ("_ids", "_index", "_segments", "n_blocks", "per_node", "pool_blocks")

    def __init__(
        self,
        n_blocks: int,
        pool_blocks: int,
        segments: list[tuple[int, int]],
        live: Sequence[tuple[NodeId, int]],
    ) -> None:
        self.n_blocks = n_blocks
        self.pool_blocks = pool_blocks
        self._segments = segments
        self._index = {node: idx for node, idx in live}
        self._ids = {idx: node for node, idx in live}
        per_node: dict[NodeId, NodeMatch] = {}
        for node, idx in live:
            l1 = 1 << (2 * idx)
            l2 = l1 << 1
            per_node[node] = NodeMatch(
                l1_blocks=_prefix(segments, pool_blocks, l1),
                local_blocks=_prefix(segments, pool_blocks, l1 | l2),
                l2_blocks=_prefix(segments, pool_blocks, l2),
            )
        self.per_node = per_node

    def best(self) -> tuple[NodeId | None, int]:
        """The node with the longest local prefix (ties to the smallest node id) and its length."""
        best: tuple[NodeId | None, int] = (None, 0)
        for node in sorted(self.per_node):
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
        longest run, ties to the smallest node id; one step per maximal run.
        """
        own = self._index.get(node)
        m = self.per_node.get(node)
        pos = m.local_blocks if m else 0
        segs = self._segments
        steps: list[FetchStep] = []
        while pos < self.pool_blocks:
            k = _segment_at(segs, pos)
            found = self._longest_source(k, own)
            if found is None:  # only ``node`` itself holds this stretch: nothing to fetch
                pos = segs[k + 1][0] if k + 1 < len(segs) else self.pool_blocks
                continue
            src, end, tier = found
            steps.append(FetchStep(src_node=self._ids[src], first_block=pos, n_blocks=end - pos, tier=tier))
            pos = end
        return steps

    def _longest_source(self, k: int, own: int | None) -> tuple[int, int, str] | None:
        segs = self._segments
        mask = segs[k][1]
        for shift, tier in ((1, "L2"), (0, "L1")):
            best_idx, best_end, best_id = -1, -1, ""
            for idx, node in self._ids.items():
                bit = 1 << (2 * idx + shift)
                if idx == own or not mask & bit:
                    continue
                j = k + 1
                while j < len(segs) and segs[j][1] & bit:
                    j += 1
                end = segs[j][0] if j < len(segs) else self.pool_blocks
                if end > best_end or (end == best_end and node < best_id):
                    best_idx, best_end, best_id = idx, end, node
            if best_idx >= 0:
                return best_idx, best_end, tier
        return None


def _segment_at(segments: list[tuple[int, int]], pos: int) -> int:
    """Index of the segment containing block position ``pos`` (binary search)."""
    lo, hi = 0, len(segments) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if segments[mid][0] <= pos:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["BlockHash", "Lookup", "NodeMatch", "scan"]
