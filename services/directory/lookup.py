"""Longest-prefix lookup results (pure, no I/O).

Chained hashes make two prefixes equal when their last blocks are equal, so the directory
needs no tree: one dict probe per block of the request gives its slot, one numpy ``take`` gives
the holder bit masks (bit ``2n + tier`` per node ``n``), and a running AND along the blocks
keeps exactly the bits of the copies whose prefix is still unbroken: a node's prefix ends where
its bit leaves the running AND. The pool prefix ends at the first block no node holds.
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


_EVEN = 0x5555555555555555


def _prefix_ends(col: np.ndarray) -> tuple[dict[int, int], dict[int, int]]:
    """For one holder word along the blocks: ``bit -> prefix length`` of every copy bit set on
    the first block (tier prefixes), and of every node's "L1 or L2" bit (local prefixes, keyed
    by the node's L1 bit). Works on the runs of equal masks: a running AND over them keeps the
    bits whose prefix is unbroken, so a bit's prefix ends where it leaves the AND."""
    if not len(col):
        return {}, {}
    starts = [0, *(np.flatnonzero(col[1:] != col[:-1]) + 1).tolist()]
    masks = col[starts].tolist()
    tiers: dict[int, int] = {}
    local: dict[int, int] = {}
    acc_t = masks[0]
    acc_l = (acc_t | acc_t >> 1) & _EVEN
    for start, m in zip(starts[1:], masks[1:]):
        nt, nl = acc_t & m, acc_l & (m | m >> 1) & _EVEN
        _assign(tiers, acc_t & ~nt, start)
        _assign(local, acc_l & ~nl, start)
        acc_t, acc_l = nt, nl
        if not acc_t and not acc_l:
            break
    _assign(tiers, acc_t, len(col))
    _assign(local, acc_l, len(col))
    return tiers, local


def _assign(out: dict[int, int], bits: int, length: int) -> None:
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = length
        bits ^= low


class Lookup:
    """Result of :meth:`DirectoryCore.lookup` for one request's block list.

    ``per_node`` covers every live node (zeros included); ``pool_blocks`` is the longest prefix
    held anywhere. ``fetch_plan(node)`` lists the peer reads that bring ``node`` from its local
    prefix to the pool prefix.
    """

    __slots__ = ("_cols", "_ids", "_masks", "n_blocks", "per_node", "pool_blocks")

    def __init__(self, n_blocks: int, pool_blocks: int, masks: np.ndarray, live: list[tuple[NodeId, int]]) -> None:
        """``masks``: ``[pool_blocks, W]`` uint64 holder words (bit ``2n + tier``, 64 per word)."""
        self.n_blocks = n_blocks
        self.pool_blocks = pool_blocks
        self._masks = masks
        self._cols = {node: col for node, col in live}
        self._ids = sorted(live)  # (node id, column): ties go to the smallest id
        tiers: list[dict[int, int]] = []
        local: list[dict[int, int]] = []
        for w in range(masks.shape[1]):
            t, loc = _prefix_ends(masks[:, w])
            tiers.append(t)
            local.append(loc)
        per_node = {}
        for node, n in live:
            w, b = (2 * n) >> 6, (2 * n) & 63
            per_node[node] = NodeMatch(l1_blocks=tiers[w].get(b, 0) if tiers else 0,
                                       local_blocks=local[w].get(b, 0) if local else 0,
                                       l2_blocks=tiers[w].get(b + 1, 0) if tiers else 0)
        self.per_node = per_node

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
                if col == own:
                    continue
                j = 2 * col + t
                run = ((self._masks[pos:, j >> 6] >> np.uint64(j & 63)) & np.uint64(1)).astype(bool)
                if not run[0]:
                    continue
                end = self.pool_blocks if run.all() else pos + int(run.argmin())
                if best is None or end > best[0]:
                    best = (end, node)
            if best is not None:
                return best[1], best[0], tier
        return None
