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


_ZERO = NodeMatch(l1_blocks=0, local_blocks=0, l2_blocks=0)
_EVEN_BITS: dict[int, int] = {}  # words -> the even bits of that many 64-bit words


def _prefix_ends(masks: np.ndarray) -> tuple[dict[int, int], dict[int, int]]:
    """For the ``[blocks, W]`` holder words along the blocks: ``bit -> prefix length`` of every
    copy bit set on the first block (tier prefixes), and of every node's "L1 or L2" bit (local
    prefixes, keyed by the node's L1 bit); bit ``j`` is bit ``j % 64`` of word ``j // 64``.
    Works on the runs of equal rows, all words at once (one Python int per run): a running
    AND over them keeps the bits whose prefix is unbroken, so a bit's prefix ends where it
    leaves the AND."""
    n, words = masks.shape
    if not n:
        return {}, {}
    if words == 1:
        col = masks[:, 0]
        starts = [0, *(np.flatnonzero(col[1:] != col[:-1]) + 1).tolist()]
        rows = col[starts].tolist()
    else:
        change = (masks[1:] != masks[:-1]).any(axis=1)
        starts = [0, *(np.flatnonzero(change) + 1).tolist()]
        rows = [sum(x << (64 * w) for w, x in enumerate(row)) for row in masks[starts].tolist()]
    even = _EVEN_BITS.get(words)
    if even is None:
        even = _EVEN_BITS[words] = int("01" * 32 * words, 2)
    tiers: dict[int, int] = {}
    local: dict[int, int] = {}
    acc_t = rows[0]
    acc_l = (acc_t | acc_t >> 1) & even
    for start, m in zip(starts[1:], rows[1:]):
        nt, nl = acc_t & m, acc_l & (m | m >> 1) & even
        _assign(tiers, acc_t & ~nt, start)
        _assign(local, acc_l & ~nl, start)
        acc_t, acc_l = nt, nl
        if not acc_t and not acc_l:
            break
    _assign(tiers, acc_t, n)
    _assign(local, acc_l, n)
    return tiers, local


def _assign(out: dict[int, int], bits: int, length: int) -> None:
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = length
        bits ^= low


class LiveNodes:
    """The live nodes as a lookup needs them, built once per change of the node set (the
    directory caches it) instead of once per lookup."""

    __slots__ = ("by_col", "cols", "ids", "zeros")

    def __init__(self, live: list[tuple[NodeId, int]]) -> None:
        self.cols = {node: col for node, col in live}
        self.by_col = {col: node for node, col in live}
        self.ids = sorted(live)
        self.zeros = dict.fromkeys(self.cols, _ZERO)


class Lookup:
    """Result of :meth:`DirectoryCore.lookup` for one request's block list.

    ``per_node`` covers every live node (zeros included); ``pool_blocks`` is the longest prefix
    held anywhere. ``fetch_plan(node)`` lists the peer reads that bring ``node`` from its local
    prefix to the pool prefix.
    """

    __slots__ = ("_cols", "_ids", "_masks", "n_blocks", "per_node", "pool_blocks")

    def __init__(self, n_blocks: int, pool_blocks: int, masks: np.ndarray,
                 live: list[tuple[NodeId, int]] | LiveNodes) -> None:
        """``masks``: ``[pool_blocks, W]`` uint64 holder words (bit ``2n + tier``, 64 per word);
        ``live``: ``(node id, column)`` of the live nodes, or a :class:`LiveNodes` of them."""
        if not isinstance(live, LiveNodes):
            live = LiveNodes(live)
        self.n_blocks = n_blocks
        self.pool_blocks = pool_blocks
        self._masks = masks
        self._cols = live.cols
        self._ids = live.ids  # (node id, column) sorted: ties go to the smallest id
        # every node starts at the shared zero match; only the copy bits set on the first block
        # (read off the running AND of the holder words) get a match of their own, so the cost
        # is O(words + holders + runs), not a pass per node
        by_col = live.by_col
        per_node = live.zeros.copy()
        tiers, local = _prefix_ends(masks)
        for bit, length in local.items():
            node = by_col.get(bit >> 1)
            if node is not None:
                per_node[node] = NodeMatch(l1_blocks=tiers.get(bit, 0), local_blocks=length,
                                           l2_blocks=tiers.get(bit + 1, 0))
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

        Cost: one pass of numpy over the ``[range, peers]`` holder bits computes, for every
        position and peer, where that peer's run ends; the loop then runs once per step.
        """
        own = self._cols.get(node)
        m = self.per_node.get(node)
        start = m.local_blocks if m else 0
        n = self.pool_blocks - start
        if n <= 0:
            return []
        words = self._masks[start:self.pool_blocks]
        # only peers holding some block of the range can be a source: read them off the OR of
        # the holder words (a peer holding nothing there never has the longest run)
        held = 0
        for w, x in enumerate(np.bitwise_or.reduce(words, axis=0).tolist()):
            held |= x << (64 * w)
        peers = [(nid, col) for nid, col in self._ids if col != own and (held >> (2 * col)) & 3]
        if not peers:
            return []
        cols = np.array([c for _, c in peers], dtype=np.int64)
        rows = np.arange(n)

        def holds(tier_bit: int) -> np.ndarray:  # [n, peers] bool
            j = 2 * cols + tier_bit
            return ((words[:, j >> 6] >> (j & 63).astype(np.uint64)) & np.uint64(1)).astype(bool)

        def run_end(h: np.ndarray) -> np.ndarray:  # first row >= r where h is False (n if none)
            gaps = np.where(h, n, rows[:, None] if h.ndim == 2 else rows)
            return np.minimum.accumulate(gaps[::-1], axis=0)[::-1]

        h2, h1 = holds(1), holds(0)
        end2, end1 = run_end(h2), run_end(h1)
        any2 = h2.any(axis=1)
        any_peer = any2 | h1.any(axis=1)
        next_held = run_end(~any_peer)  # first row >= r that some peer holds
        steps: list[FetchStep] = []
        pos = 0
        while pos < n:
            if not any_peer[pos]:
                pos = int(next_held[pos])
                continue
            ends, tier = (end2[pos], "L2") if any2[pos] else (end1[pos], "L1")
            k = int(np.argmax(ends))  # first maximum: peers are sorted by node id
            end = int(ends[k])
            steps.append(FetchStep(src_node=peers[k][0], first_block=start + pos, n_blocks=end - pos, tier=tier))
            pos = end
        return steps
