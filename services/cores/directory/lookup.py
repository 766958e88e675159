"""Longest-prefix lookup results (pure, no I/O).

Chained hashes make two prefixes equal when their last blocks are equal, so the directory
needs no tree: one dict probe per block of the request gives its slot, one numpy ``take`` gives
the holder bit masks (bit ``2n + tier`` per node ``n``), and a running AND along the blocks
keeps exactly the bits of the copies whose prefix is still unbroken: a node's prefix ends where
its bit leaves the running AND. The pool prefix ends at the first block no node holds.
"""

from __future__ import annotations

from bisect import bisect_right

import msgspec
import numpy as np

from events.catalog import FetchStep
from events.ids import NodeId
from services.cores.directory._native import runs as equal_runs
from services.cores.directory._native import runs_ends


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


def _runs(masks: np.ndarray) -> tuple[list[int], list[int]]:
    """The ``[blocks, W]`` holder words as runs of equal rows: ``(starts, rows)``, each row one
    Python int of ``64 W`` bits (bit ``j`` of the int = bit ``j % 64`` of word ``j // 64``)."""
    n, words = masks.shape
    if not n:
        return [], []
    if words == 1:  # one compiled pass (``_native.runs``)
        return equal_runs(masks[:, 0])
    change = masks[1:, 0] != masks[:-1, 0]
    for w in range(1, words):  # OR of per-word compares: cheaper than a 2-D any(axis=1)
        change |= masks[1:, w] != masks[:-1, w]
    starts = [0, *(np.flatnonzero(change) + 1).tolist()]
    return starts, [sum(x << (64 * w) for w, x in enumerate(row)) for row in masks[starts].tolist()]


def _prefix_ends(masks: np.ndarray, runs: tuple[list[int], list[int]] | None = None
                 ) -> tuple[dict[int, int], dict[int, int]]:
    """For the ``[blocks, W]`` holder words along the blocks: ``bit -> prefix length`` of every
    copy bit set on the first block (tier prefixes), and of every node's "L1 or L2" bit (local
    prefixes, keyed by the node's L1 bit); bit ``j`` is bit ``j % 64`` of word ``j // 64``.
    Works on the runs of equal rows (:func:`_runs`, all words at once): a running AND over
    them keeps the bits whose prefix is unbroken, so a bit's prefix ends where it leaves the
    AND."""
    n, words = masks.shape
    if not n:
        return {}, {}
    starts, rows = runs if runs is not None else _runs(masks)
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

    __slots__ = ("by_col", "cols", "ids", "live_bits", "zeros")

    def __init__(self, live: list[tuple[NodeId, int]]) -> None:
        self.cols = {node: col for node, col in live}
        self.by_col = {col: node for node, col in live}
        self.ids = sorted(live)
        self.zeros = dict.fromkeys(self.cols, _ZERO)
        self.live_bits = sum(3 << (2 * col) for col in self.by_col)  # both tier bits of each


class Lookup:
    """Result of :meth:`DirectoryCore.lookup` for one request's block list.

    ``per_node`` covers every live node (zeros included); ``pool_blocks`` is the longest prefix
    held anywhere. ``fetch_plan(node)`` lists the peer reads that bring ``node`` from its local
    prefix to the pool prefix.
    """

    __slots__ = ("_by_col", "_cols", "_ids", "_live_bits", "_masks", "_runs", "n_blocks", "per_node",
                 "pool_blocks")

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
        self._by_col = live.by_col
        self._live_bits = live.live_bits
        # every node starts at the shared zero match; only the copy bits set on the first block
        # (read off the running AND of the holder words) get a match of their own, so the cost
        # is O(words + holders + runs), not a pass per node
        by_col = live.by_col
        per_node = live.zeros.copy()
        if masks.shape[1] == 1:  # up to 32 nodes: runs and prefix ends in one compiled pass
            starts, rows, tiers, local = runs_ends(masks[:, 0])
            self._runs = (starts, rows)  # shared with fetch_plan
        else:
            self._runs = runs = _runs(masks)
            tiers, local = _prefix_ends(masks, runs)
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

        Cost: no numpy at all. It walks the runs of equal holder rows the lookup already
        computed (one Python int of copy bits per run, usually a handful per request): from
        each position, a running AND of the candidate bits along the runs leaves the copies
        whose run is longest; the loop turns once per step and per run crossed.
        """
        own = self._cols.get(node)
        m = self.per_node.get(node)
        start = m.local_blocks if m else 0
        end_all = self.pool_blocks
        if end_all - start <= 0:
            return []
        starts, rows = self._runs
        peers = self._live_bits & ~(3 << (2 * own)) if own is not None else self._live_bits
        l2_bits = _ODD_BITS.get(self._masks.shape[1])
        if l2_bits is None:
            l2_bits = _ODD_BITS[self._masks.shape[1]] = int("10" * 32 * self._masks.shape[1], 2)
        nr = len(starts)
        by_col = self._by_col
        steps: list[FetchStep] = []
        ri = bisect_right(starts, start) - 1  # the run holding the first block to fetch
        pos = start
        while pos < end_all:
            row = rows[ri] & peers
            if not row:  # no peer holds this run: skip to the next run
                ri += 1
                if ri >= nr:
                    break
                pos = starts[ri]
                continue
            cand = row & l2_bits
            tier = "L2"
            if not cand:
                cand, tier = row, "L1"  # no L2 here: the L1 copies
            k = ri + 1
            while k < nr:  # a copy's run ends at the first run without its bit
                nxt = cand & rows[k]
                if not nxt:
                    break
                cand, k = nxt, k + 1
            end = starts[k] if k < nr else end_all
            # the copies still in ``cand`` all end at ``end``: the smallest node id among them
            src = None
            while cand:
                low = cand & -cand
                nid = by_col[(low.bit_length() - 1) >> 1]
                if src is None or nid < src:
                    src = nid
                cand ^= low
            steps.append(FetchStep(src_node=src, first_block=pos, n_blocks=end - pos, tier=tier))
            pos, ri = end, k
        return steps


_ODD_BITS: dict[int, int] = {}  # words -> the odd (L2) bits of that many 64-bit words
