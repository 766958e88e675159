"""Agent-aware KV directory: a pure state machine, no I/O, no clock (METHOD.md §4.1).

It folds the event stream into:

1. **Where KV lives.** A :class:`~services.cores.directory.table.BlockTable`: one slot per block,
   numpy columns per node for "holds it in L1 / L2", the copy's last access (``ts`` of the
   event that stored or used it) and the active-branch references.
2. **Branches.** id -> parent, mode, version, current context (block list) and, per phase,
   the node whose copy holds the branch's count (``holders``; ``-1`` = none).
3. **Active-branch counts per copy.** ``refs[block, node]`` = number of active branches whose
   counted context contains ``block`` and that have ``node`` as a holder in some phase (a
   branch whose two phases sit on one node counts once there). :meth:`count` exposes it only
   where the copy exists, so a count is never attached to an evicted copy; a copy stored again
   shows its branches' counts again.

Rules (the full table is in docs/directory.md): a fork inherits its parent's context and
holders (+1 on the reused blocks at the parent's copies); a sub-agent starts empty and never
counts the blocks of its parent's context at spawn; a request of the same version adds only
the blocks not yet counted; a new version (compaction) counts the new context and un-counts
the dropped blocks; a branch end un-counts everything. A count moves with the KV, not with
the routing decision: holders are set by ``KvStored(request/branch)``, ``KvFetched`` (P2P: the
prefill count moves to the destination), ``KvMoved`` (within a phase the count moves to the
destination; across phases both ends keep it) and ``RequestStarted`` (the phase's count moves
to the node whose copies the request uses); a non-shadow ``RouteDecided`` only attaches a phase
that has no holder yet (a branch's first request). A
switch decode -> prefill (or a removal, or a switch that drops KV) detaches every count on
the node; prefill -> decode keeps them.

Bad input (unknown branch, request, node or block, stale version, ...) is counted per kind and
answered with :class:`events.AnomalyReported`; it never raises and never makes a count negative.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Self

import msgspec
import numpy as np

from events.catalog import (
    AnomalyReported,
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    Event,
    FirstToken,
    KvEvicted,
    KvFetched,
    KvMoved,
    KvStored,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from events.ids import BlockHash, BranchId, NodeId, Tier
from services.cores.directory._native import add_fresh, common_prefix, is_suffix
from services.cores.directory._native import dropped as dropped_blocks
from services.cores.directory.lookup import LiveNodes, Lookup
from services.cores.directory.table import TIER_INDEX, BlockTable

PREFILL, DECODE = 0, 1
_PHASE_INDEX = {"prefill": PREFILL, "decode": DECODE}
SNAPSHOT_VERSION = 1


class _Node:
    __slots__ = ("alive", "id", "idx", "role")

    def __init__(self, node_id: str, idx: int, role: str | None) -> None:
        self.id = node_id
        self.idx = idx  # column in the block table
        self.role = role  # None: seen in a KV event before its registration
        self.alive = True


class _Branch:
    __slots__ = ("counted", "cslots", "ctx", "distinct", "excluded", "holders", "id", "last_req", "mode",
                 "parent", "version")

    def __init__(self, branch_id: str, parent: str | None, mode: str) -> None:
        self.id = branch_id
        self.parent = parent
        self.mode = mode
        self.version = 0
        self.ctx: list[int] = []  # blocks of the current context, in order
        self.counted: set[int] = set()  # set(ctx) - excluded
        # True only if ``ctx`` is known to repeat no block (False: not known; the rewrite then
        # takes the general path). Chained hashes never repeat, so it is True in practice.
        self.distinct = True
        self.excluded: frozenset[int] = frozenset()  # sub-agent: parent's context at spawn
        self.holders = [-1, -1]  # node index holding the count, per phase
        self.cslots: tuple[np.ndarray, int] | None = None  # table slots of counted, table gen
        self.last_req: _Request | None = None  # its latest request (its slots seed the next lookup)


class _Request:
    __slots__ = ("blocks", "branch", "id", "nodes", "pins", "slots")

    def __init__(self, request_id: str, branch: str, blocks: list[int]) -> None:
        self.id = request_id
        self.branch = branch
        self.blocks = blocks
        self.nodes = [-1, -1]  # routed prefill / decode node index
        self.pins: set[int] = set()  # node indices whose copies this request is using
        self.slots: tuple[np.ndarray, int] | None = None  # cached table slots of blocks, gen


# ----------------------------------------------------------------------------- snapshot types
class _NodeSnap(msgspec.Struct, array_like=True):
    id: str
    role: str | None
    alive: bool
    l1: list[tuple[int, float]]
    l2: list[tuple[int, float]]


class _BranchSnap(msgspec.Struct, array_like=True):
    id: str
    parent: str | None
    mode: str
    version: int
    ctx: list[int]
    excluded: list[int]
    holders: list[int]


class _RequestSnap(msgspec.Struct, array_like=True):
    id: str
    branch: str
    blocks: list[int]
    nodes: list[int]
    pins: list[int]


class _Snapshot(msgspec.Struct, array_like=True):
    version: int
    nodes: list[_NodeSnap]  # in index order (indices are positions in the holder masks)
    branches: list[_BranchSnap]  # sorted by id
    ended: list[str]
    requests: list[_RequestSnap]
    anomalies: list[tuple[str, int]]


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(_Snapshot)


class DirectoryCore:
    """The agent-aware KV directory (see the module docstring and docs/directory.md)."""

    name = "directory"

    #: Ended branches remembered (oldest forgotten first), as the gateway's branch table does.
    MAX_ENDED = 100_000

    def __init__(self, max_ended: int = MAX_ENDED) -> None:
        assert max_ended >= 0, "max_ended counts branches"
        self._max_ended = max_ended
        self._t = BlockTable()
        # the last lookup's (blocks list, slots, table gen): the RequestSubmitted that carries
        # the same list object reuses its slots instead of probing the table again
        # (and the context list it verified to be a prefix of them, so the fold skips that compare)
        self._scanned: tuple[Sequence[int], np.ndarray, int, list[int] | None] | None = None
        self._nodes: list[_Node] = []
        self._node_state = 0  # bumped whenever a node is added, removed or revived
        self._live: tuple[int, LiveNodes] | None = None
        self._node_idx: dict[str, int] = {}
        self._branches: dict[str, _Branch] = {}
        # ended branch ids (a late KV report of one is quiet, a request or a reopening is an
        # anomaly), at most max_ended: the oldest end is forgotten first (an unknown branch
        # again). ``_end_order`` keeps the order and travels in the snapshot, so a restored core
        # forgets the same ids as one that folded the whole history.
        self._ended: set[str] = set()
        self._end_order: deque[str] = deque()
        self._requests: dict[str, _Request] = {}
        self._anomalies: dict[str, int] = {}
        self._out: list[Event] = []

    # ------------------------------------------------------------------------- protocol
    def apply(self, event: Event) -> list[Event]:
        """Fold one event; returns the anomalies it caused (``AnomalyReported``), else ``[]``."""
        self._out = []
        # Block hashes are in [0, 2**64): the event type rejects anything else at decode
        # (events.ids.WireBlockHash), so a bad hash reaches the dead-letter path, not this core.
        # The cases are in the order of how often a simulated run sees them (KV facts and the
        # request lifecycle first): a class pattern is an isinstance test, tried in turn.
        match event:
            case KvStored():
                self._on_kv_stored(event)
            case RequestStarted():
                self._on_request_started(event)
            case KvEvicted():
                self._on_kv_evicted(event)
            case RouteDecided():
                self._on_route_decided(event)
            case RequestSubmitted():
                self._on_request_submitted(event)
            case FirstToken():
                self._on_first_token(event)
            case RequestFinished():
                self._on_request_finished(event)
            case KvMoved():
                self._on_kv_moved(event)
            case KvFetched():
                self._on_kv_fetched(event)
            case BranchOpened():
                self._on_branch_opened(event)
            case BranchEnded():
                self._on_branch_ended(event)
            case ContextCompacted():
                self._on_context_compacted(event)
            case NodeRegistered():
                self._on_node_registered(event)
            case RoleSwitched():
                self._on_role_switched(event)
            case NodeRemoved():
                self._on_node_removed(event)
            case _:
                return []
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------------- queries
    def lookup(self, blocks: Sequence[BlockHash], branch: BranchId | None = None) -> Lookup:
        """Longest cached prefixes of ``blocks`` per live node and tier and in the pool (one pass).

        ``branch``: the request's branch, if known. When the branch's previous request is a
        prefix of ``blocks`` (an agent's next turn), its resolved slots are reused and only the
        appended blocks are probed; the answer is the same either way."""
        prefix = verified = None
        if branch is not None:
            b = self._branches.get(branch)
            r = b.last_req if b is not None else None
            if r is not None and r.slots is not None and r.slots[1] == self._t.gen:
                k = len(r.blocks)
                # compiled compare in place: the slice ``blocks[:k]`` copied up to thousands of
                # references per lookup (4.5% of bench directory's fold in py-spy)
                if k <= len(blocks) and common_prefix(r.blocks, blocks) == k:
                    prefix, verified = r.slots[0], r.blocks
        pool, held, slots = self._t.scan(blocks, prefix)
        self._scanned = (blocks, slots, self._t.gen, verified)
        live = self._live
        if live is None or live[0] != self._node_state:
            live = self._live = (self._node_state, LiveNodes([(n.id, n.idx) for n in self._nodes if n.alive]))
        return Lookup(len(blocks), pool, held, live[1])

    def holders(self, block: BlockHash) -> list[tuple[NodeId, Tier]]:
        """Copies of ``block`` as sorted ``(node, tier)`` pairs."""
        s = self._t.find(block)
        if s is None:
            return []
        return sorted((n.id, tier) for n in self._nodes for tier, t in TIER_INDEX.items()
                      if self._t.holds(s, n.idx, t))

    def count(self, block: BlockHash, node: NodeId) -> int:
        """Active branches counted on ``node``'s copy of ``block`` (0 if the node holds no copy)."""
        n = self._node(node)
        s = self._t.find(block)
        if n is None or s is None or not self._t.holds(s, n.idx):
            return 0
        return int(self._t.refs[s, n.idx])

    def last_access(self, block: BlockHash, node: NodeId, tier: Tier) -> float:
        """``ts`` of the last store or use of that copy; raises ``KeyError`` if there is no copy."""
        n = self._node(node)
        s = self._t.find(block)
        if n is None or s is None or not self._t.holds(s, n.idx, TIER_INDEX[tier]):
            raise KeyError((block, node, tier))
        return float(self._t.last[s, 2 * n.idx + TIER_INDEX[tier]])

    def blocks_on(self, node: NodeId, tier: Tier) -> list[BlockHash]:
        """Blocks held by ``node`` in ``tier``, sorted."""
        return sorted(self.copies(node, tier))

    def copies(self, node: NodeId, tier: Tier) -> dict[BlockHash, float]:
        """``block -> last access`` of ``node``'s copies in ``tier``."""
        blocks, last, _ = self.tier_arrays(node, tier)
        return dict(zip(blocks.tolist(), last.tolist()))

    def tier_arrays(self, node: NodeId, tier: Tier) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(blocks uint64, last_access float64, count int32)`` of ``node``'s copies in ``tier``
        (unordered): what an eviction policy sorts, without per-block Python objects."""
        n = self._node(node)
        if n is None:
            return np.zeros(0, np.uint64), np.zeros(0, np.float64), np.zeros(0, np.int32)
        return self._t.tier_arrays(n.idx, tier)

    def eviction_order(self, node: NodeId, tier: Tier, count_aware: bool, limit: int | None = None,
                       pinned: AbstractSet[BlockHash] = frozenset()) -> np.ndarray:
        """``node``'s blocks in ``tier`` in eviction order (uint64), ``pinned`` left out, the
        first ``limit``: by ``(count > 0, last_access, block)`` if ``count_aware``, else by
        ``(last_access, block)``. Kept incrementally per copy column from its first call (see
        :class:`~services.cores.directory.eviction.CopyOrder`)."""
        n = self._node(node)
        if n is None:
            return np.zeros(0, dtype=np.uint64)
        return self._t.eviction_order(n.idx, tier, count_aware, limit, pinned if pinned else None)

    def counts_on(self, node: NodeId) -> Mapping[BlockHash, int]:
        """Raw active-branch references on ``node`` (includes blocks with no copy there)."""
        n = self._node(node)
        return self._t.refs_on(n.idx) if n else {}

    def pinned(self, node: NodeId) -> frozenset[BlockHash]:
        """Blocks of routed, unfinished requests that use ``node`` (never evict these)."""
        n = self._node(node)
        if n is None:
            return frozenset()
        out: set[int] = set()
        for r in self._requests.values():
            if n.idx in r.pins:
                out.update(r.blocks)
        return frozenset(out)

    def nodes(self) -> dict[NodeId, str | None]:
        """Live nodes and their roles."""
        return {n.id: n.role for n in self._nodes if n.alive}

    def branch(self, branch: BranchId) -> dict | None:
        """A read-only view of an active branch (for tests and tools)."""
        b = self._branches.get(branch)
        if b is None:
            return None
        ids = [self._nodes[h].id if h >= 0 else None for h in b.holders]
        return {"parent": b.parent, "mode": b.mode, "version": b.version, "blocks": list(b.ctx),
                "counted": sorted(b.counted), "prefill_holder": ids[PREFILL], "decode_holder": ids[DECODE]}

    def active_branches(self) -> list[BranchId]:
        return sorted(self._branches)

    def anomalies(self) -> dict[str, int]:
        """Anomalies met so far, by kind."""
        return dict(sorted(self._anomalies.items()))

    # ------------------------------------------------------------------------- snapshot
    def snapshot(self) -> bytes:
        """Whole state as msgpack; byte-identical for identical histories (everything sorted,
        but the ended branches: in the order they ended, which the bound forgets by)."""
        snap = _Snapshot(
            version=SNAPSHOT_VERSION,
            nodes=[_NodeSnap(n.id, n.role, n.alive, sorted(self.copies(n.id, "L1").items()),
                             sorted(self.copies(n.id, "L2").items())) for n in self._nodes],
            branches=[_BranchSnap(b.id, b.parent, b.mode, b.version, list(b.ctx), sorted(b.excluded),
                                  list(b.holders)) for _, b in sorted(self._branches.items())],
            ended=list(self._end_order),  # in end order (what the bound forgets first)
            requests=[_RequestSnap(r.id, r.branch, list(r.blocks), list(r.nodes), sorted(r.pins))
                      for _, r in sorted(self._requests.items())],
            anomalies=sorted(self._anomalies.items()),
        )
        return _ENC.encode(snap)

    @classmethod
    def from_snapshot(cls, data: bytes, max_ended: int = MAX_ENDED) -> Self:
        snap = _DEC.decode(data)
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"directory snapshot version {snap.version}, expected {SNAPSHOT_VERSION}")
        core = cls(max_ended)
        for ns in snap.nodes:
            n = core._add_node(ns.id, ns.role)
            n.alive = ns.alive
            core._node_state += 1  # invalidates the cached live-node view
            for tier, copies in (("L1", ns.l1), ("L2", ns.l2)):
                if copies:
                    blocks, ts = zip(*copies)
                    core._t.store(n.idx, tier, blocks, np.asarray(ts, dtype=np.float64))
        for bs in snap.branches:
            b = _Branch(bs.id, bs.parent, bs.mode)
            b.version, b.ctx, b.excluded = bs.version, bs.ctx, frozenset(bs.excluded)
            b.counted = set(b.ctx) - b.excluded
            b.distinct = len(set(b.ctx)) == len(b.ctx)
            core._branches[b.id] = b
            for h in sorted(set(bs.holders) - {-1}):
                core._t.add_refs(h, core._branch_slots(b), +1)
            b.holders = bs.holders
        core._end_order = deque(dict.fromkeys(snap.ended))  # (before the bound: sorted, one each)
        core._ended = set(core._end_order)
        core._trim_ended()
        for rs in snap.requests:
            r = _Request(rs.id, rs.branch, rs.blocks)
            r.nodes, r.pins = rs.nodes, set(rs.pins)
            core._requests[r.id] = r
        core._anomalies = dict(snap.anomalies)
        return core

    # ------------------------------------------------------------------------- anomalies
    def _anomaly(self, event: Event, kind: str, ref: str, detail: str = "") -> None:
        self._anomalies[kind] = self._anomalies.get(kind, 0) + 1
        self._out.append(AnomalyReported(ts=event.ts, src=self.name, component=self.name,
                                         kind=kind, ref=ref, detail=f"{type(event).__name__}: {detail}"))

    # ------------------------------------------------------------------------- nodes
    def _node(self, node: str) -> _Node | None:
        idx = self._node_idx.get(node)
        return self._nodes[idx] if idx is not None else None

    def _node_for_kv(self, event: Event, node: str) -> _Node:
        """The node a KV event names; an unknown one is added (role unknown) and reported."""
        n = self._node(node)
        if n is None:
            self._anomaly(event, "unknown_node", node, "KV of a node that never registered")
            n = self._add_node(node, None)
        elif not n.alive:
            self._anomaly(event, "removed_node", node, "KV of a removed node; node revived")
            n.alive = True
            self._node_state += 1  # invalidates the cached live-node view
        return n

    def _add_node(self, node: str, role: str | None) -> _Node:
        n = _Node(node, self._t.add_node(), role)
        self._nodes.append(n)
        self._node_state += 1  # invalidates the cached live-node view
        self._node_idx[node] = n.idx
        return n

    def _on_node_registered(self, ev: NodeRegistered) -> None:
        n = self._node(ev.node)
        if n is None:
            self._add_node(ev.node, ev.role)
            return
        n.alive = True
        self._node_state += 1  # invalidates the cached live-node view
        if n.role is not None and n.role != ev.role:
            self._switch(n, ev.role)
        n.role = ev.role

    def _on_node_removed(self, ev: NodeRemoved) -> None:
        n = self._node(ev.node)
        if n is None or not n.alive:
            self._anomaly(ev, "unknown_node", ev.node, "removal of an unknown or removed node")
            return
        self._detach_all(n, phases=(PREFILL, DECODE))
        self._drop_kv(n)
        n.alive = False
        self._node_state += 1  # invalidates the cached live-node view
        for r in self._requests.values():
            r.pins.discard(n.idx)

    def _on_role_switched(self, ev: RoleSwitched) -> None:
        n = self._node(ev.node)
        if n is None or not n.alive:
            self._anomaly(ev, "unknown_node", ev.node, "role switch of an unknown or removed node")
            return
        if ev.kv_dropped:
            self._detach_all(n, phases=(PREFILL, DECODE))
            self._drop_kv(n)
        elif n.role is not None and n.role != ev.role:
            self._switch(n, ev.role)
        n.role = ev.role

    def _switch(self, n: _Node, to_role: str) -> None:
        """decode -> prefill: every count on the node resets to 0 (its KV stays, evictable first).
        collocated -> prefill: the decode-phase counts reset. Any switch to decode keeps counts."""
        if to_role == "prefill" and n.role == "decode":
            self._detach_all(n, phases=(PREFILL, DECODE))
        elif to_role == "prefill" and n.role == "collocated":
            self._detach_all(n, phases=(DECODE,))

    def _detach_all(self, n: _Node, phases: tuple[int, ...]) -> None:
        for _, b in sorted(self._branches.items()):
            for ph in phases:
                if b.holders[ph] == n.idx:
                    self._set_holder(b, ph, -1)
        if len(phases) == 2:
            assert not self._t.refs[:, n.idx].any(), f"invariant: no count left on {n.id} after detaching all"

    def _drop_kv(self, n: _Node) -> None:
        self._t.drop_node(n.idx)

    # ------------------------------------------------------------------------- counts
    def _branch_slots(self, b: _Branch) -> np.ndarray:
        """Allocated table slots of the branch's counted blocks (cached while no slot is freed)."""
        c = b.cslots
        if c is not None and c[1] == self._t.gen:
            return c[0]
        blocks = list(b.counted)
        s = self._t.ensure(blocks)
        b.cslots = (s, self._t.gen)
        return s

    def _set_holder(self, b: _Branch, phase: int, idx: int) -> None:
        """Attach the branch's count for ``phase`` to node ``idx`` (-1: detach). The new copy
        gets +1 before the old one gets -1, so no slot of the branch is freed in between."""
        old = b.holders[phase]
        if old == idx:
            return
        other = b.holders[1 - phase]
        b.holders[phase] = idx
        if idx >= 0 and idx != other:
            self._t.add_refs(idx, self._branch_slots(b), +1)
        if old >= 0 and old != other:
            self._t.add_refs(old, self._branch_slots(b), -1)

    def _set_context(self, b: _Branch, blocks: list[int], r: _Request | None = None,
                     known_prefix: list[int] | None = None) -> bool:
        """Make ``blocks`` the branch's context: +1 on blocks newly counted, -1 on dropped ones.
        Returns whether it was a pure continuation (the old context is a prefix of the new).
        ``r``: the request carrying ``blocks``, whose cached slots spare probing the tail."""
        old = b.ctx
        # ``known_prefix``: a list the lookup of this very list already compared (the same
        # object as the old context: the compare of up to thousands of blocks is not redone)
        if known_prefix is not None and known_prefix is old:
            p = len(old)
        else:
            p = common_prefix(old, blocks)
        append = p == len(old)
        tail_slots = None
        # Every block of ``old`` is counted or excluded, so the blocks of the common prefix
        # ``blocks[:p] == old[:p]`` are never added, and only ``blocks[p:]`` is searched.
        tail = blocks[p:]
        # the tail's blocks counted nowhere yet, in order, each once, now counted (a compiled
        # loop; adding them before the drops below changes no drop: a block of the tail is kept)
        added = add_fresh(tail, b.counted, b.excluded)
        fresh_tail = len(added) == len(tail)  # the tail repeats no block and none of ``old``
        if append:  # continuation: only the appended blocks can be new
            if not b.excluded and fresh_tail:
                # the common case: every appended block is new and distinct, and the request's
                # cached slots of them are filled in place by the allocation below
                tail_slots = self._cached_tail(r, len(tail))
            dropped: list[int] = []
        elif b.distinct:
            # A rewrite (usually only the last, partial block changed). A block of
            # ``old[:p]`` is kept (it is in ``blocks[:p]``); one of ``old[p:]`` is dropped
            # unless ``blocks`` has it, and with no repeats in ``old`` it is not in
            # ``old[:p] == blocks[:p]``: only ``blocks[p:]`` needs a set.
            dropped = dropped_blocks(old[p:], b.counted, set(tail), b.excluded)
        else:
            dropped = dropped_blocks(old, b.counted, set(blocks), b.excluded)
        b.distinct = b.distinct and fresh_tail
        b.ctx = blocks
        holders = sorted({h for h in b.holders if h >= 0})
        if added:
            cached = b.cslots is not None and b.cslots[1] == self._t.gen
            s_add = self._t.ensure(added, tail_slots) if holders else None
            for h in holders:
                self._t.add_refs(h, s_add, +1)
            b.cslots = (np.concatenate([b.cslots[0], s_add]), self._t.gen) if cached and holders else None
        if dropped:
            s_drop = self._t.slots(dropped, len(dropped)) if holders else None
            b.counted.difference_update(dropped)
            # the cached counted slots lose the dropped ones (re-probing the whole context at
            # the next holder change cost more than the rest of a rewrite); exact while no
            # slot is freed, which the -1 below may do (then gen moves and the cache lapses)
            c = b.cslots
            b.cslots = None
            if c is not None and c[1] == self._t.gen and s_drop is not None and len(s_drop) <= 8:
                keep = c[0] != s_drop[0]  # a few dropped slots (np.isin costs ~100x more here)
                for x in s_drop[1:].tolist():
                    keep &= c[0] != x
                b.cslots = (c[0][keep], c[1])
            for h in holders:
                self._t.add_refs(h, s_drop, -1)
        return append

    # ------------------------------------------------------------------------- branches
    def _branch(self, event: Event, branch: str, create: bool = False, quiet_ended: bool = False) -> _Branch | None:
        b = self._branches.get(branch)
        if b is not None:
            return b
        if branch in self._ended:
            if quiet_ended:
                return None  # a late KV report of an ended branch: nothing to count
            self._anomaly(event, "ended_branch", branch, "event for a branch that already ended")
            return None
        self._anomaly(event, "unknown_branch", branch,
                      "opened implicitly as root" if create else "ignored")
        if not create:
            return None
        b = _Branch(branch, None, "root")
        self._branches[branch] = b
        return b

    def _on_branch_opened(self, ev: BranchOpened) -> None:
        if ev.branch in self._branches or ev.branch in self._ended:
            self._anomaly(ev, "duplicate_branch", ev.branch, "branch opened twice; ignored")
            return
        b = _Branch(ev.branch, ev.parent, ev.mode)
        self._branches[ev.branch] = b
        if ev.mode == "root":
            return
        parent = self._branches.get(ev.parent) if ev.parent is not None else None
        if parent is None:
            # A branch resumed after its parent ended is normal over HTTP: the harness reveals a
            # fork only with its first request. The parent's counts were released at its end, so
            # the child starts with an empty context and its first request counts its blocks.
            if ev.parent not in self._ended:
                self._anomaly(ev, "unknown_parent", str(ev.parent), f"{ev.mode} of an unknown parent")
            return
        if ev.mode == "subagent":
            b.excluded = frozenset(parent.ctx)
            return
        # fork: reuses the parent's context where the parent's KV lives (+1 on those copies);
        # a fork of a sub-agent inherits what the sub-agent does not count
        b.ctx = parent.ctx
        b.distinct = parent.distinct
        b.excluded = parent.excluded
        b.counted = set(parent.counted)
        b.cslots = parent.cslots
        for ph in (PREFILL, DECODE):
            self._set_holder(b, ph, parent.holders[ph])

    def _on_request_submitted(self, ev: RequestSubmitted) -> None:
        r = _Request(ev.request, ev.branch, ev.blocks)
        self._requests[ev.request] = r
        known_prefix = None
        if self._scanned is not None and self._scanned[0] is ev.blocks:
            r.slots = self._scanned[1:3]
            known_prefix = self._scanned[3]
        self._scanned = None
        b = self._branch(ev, ev.branch, create=True)
        if b is None:
            return
        b.last_req = r
        if ev.version < b.version:
            self._anomaly(ev, "stale_version", ev.branch, f"version {ev.version} < {b.version}; context kept")
            return
        rewrite = ev.version == b.version and b.ctx
        b.version = ev.version
        if not self._set_context(b, ev.blocks, r, known_prefix) and rewrite:
            self._anomaly(ev, "unversioned_rewrite", ev.branch, "context rewritten without a version bump")

    def _on_context_compacted(self, ev: ContextCompacted) -> None:
        b = self._branch(ev, ev.branch)
        if b is None:
            return
        if ev.version < b.version:
            self._anomaly(ev, "stale_version", ev.branch, f"compaction to {ev.version} at {b.version}; ignored")
            return
        if ev.version == b.version and b.ctx:
            return  # a request of this version already carried the rewritten context
        b.version = ev.version
        self._set_context(b, ev.blocks)

    def _on_branch_ended(self, ev: BranchEnded) -> None:
        b = self._branch(ev, ev.branch)
        if b is None:
            return
        for ph in (PREFILL, DECODE):
            self._set_holder(b, ph, -1)
        del self._branches[ev.branch]
        self._ended.add(ev.branch)
        self._end_order.append(ev.branch)
        self._trim_ended()

    def _trim_ended(self) -> None:
        while len(self._end_order) > self._max_ended:
            self._ended.discard(self._end_order.popleft())

    # ------------------------------------------------------------------------- requests
    def _request(self, event: Event, request: str | None) -> _Request | None:
        if request is None:
            return None
        r = self._requests.get(request)
        if r is None:
            self._anomaly(event, "unknown_request", request)
        return r

    def _on_route_decided(self, ev: RouteDecided) -> None:
        if ev.shadow:
            return
        r = self._request(ev, ev.request)
        pn = self._node(ev.prefill_node)
        dn = self._node(ev.decode_node)
        if pn is None or dn is None or not (pn.alive and dn.alive):
            self._anomaly(ev, "unknown_node", f"{ev.prefill_node},{ev.decode_node}", "route to an unknown node")
            return
        branch = r.branch if r is not None else ev.branch
        if r is not None:
            r.nodes = [pn.idx, dn.idx]
            r.pins = {pn.idx, dn.idx}
        b = self._branch(ev, branch) if branch is not None else None
        if b is not None:
            # A route moves no KV, so it moves no count: a branch already counted on some copy
            # keeps it there until its KV reaches the routed node (KvFetched, KvMoved, KvStored
            # or RequestStarted there). Moving it now would leave the only copies of a queued
            # branch's context uncounted, i.e. first in line for eviction. A phase
            # with no holder yet attaches to the routed node.
            for ph, idx in ((PREFILL, pn.idx), (DECODE, dn.idx)):
                if b.holders[ph] < 0:
                    self._set_holder(b, ph, idx)

    def _on_request_started(self, ev: RequestStarted) -> None:
        r = self._request(ev, ev.request)
        n = self._node(ev.node)
        if n is None or not n.alive:
            self._anomaly(ev, "unknown_node", ev.node, "request started on an unknown node")
            return
        if r is not None:
            r.pins.add(n.idx)
            s = self._t.resolve(r.blocks, r.slots)
            r.slots = (s, self._t.gen)
            self._t.touch(n.idx, s, float(ev.ts))
            # the request now uses this node's copies in this phase: the branch's count for the
            # phase moves here (within a phase the count moves to the copy in use)
            b = self._branches.get(r.branch)
            if b is not None:
                self._set_holder(b, _PHASE_INDEX[ev.phase], n.idx)

    def _on_first_token(self, ev: FirstToken) -> None:
        r = self._request(ev, ev.request)
        if r is not None and r.nodes[PREFILL] >= 0 and r.nodes[PREFILL] != r.nodes[DECODE]:
            r.pins.discard(r.nodes[PREFILL])

    def _on_request_finished(self, ev: RequestFinished) -> None:
        if self._request(ev, ev.request) is not None:
            del self._requests[ev.request]

    # ------------------------------------------------------------------------- KV facts
    def _phase_of(self, n: _Node, r: _Request | None) -> list[int]:
        """Phases whose count a KV store on ``n`` attaches: those the request was routed to on
        ``n``; else the node's role (collocated and unknown -> prefill, where KV is produced)."""
        if r is not None:
            phases = [ph for ph in (PREFILL, DECODE) if r.nodes[ph] == n.idx]
            if phases:
                return phases
        return [DECODE] if n.role == "decode" else [PREFILL]

    def _cached_tail(self, r: _Request | None, k: int) -> np.ndarray | None:
        """The request's cached slots of its last ``k`` blocks, if still exact: a view, so what
        an allocation fills in (``BlockTable.ensure`` writes the 0s it resolves in place) is in
        the request's cache too. Exact, as the cache only changes where a 0 becomes the block's
        slot, and no slot is freed in between (``gen``)."""
        if r is None or r.slots is None or r.slots[1] != self._t.gen or k > len(r.blocks):
            return None
        return r.slots[0][len(r.blocks) - k:]

    def _kv_slots(self, r: _Request | None, blocks: Sequence[int]) -> np.ndarray | None:
        """Cached slots for a KV event of request ``r`` whose blocks are a suffix of its prompt."""
        if r is None or not len(blocks) or not is_suffix(r.blocks, blocks):
            return None
        return self._cached_tail(r, len(blocks))

    def _on_kv_stored(self, ev: KvStored) -> None:
        """A write-through store (``write_through``) folds as the pair it replaces:
        the L1 store, then the L2 store, each step as its own event did (the L2 step reuses the
        slots the L1 step resolved: the blocks it just stored stay allocated)."""
        s = None
        for tier in ev.tiers():
            s = self._fold_stored(ev, tier, s)

    def _fold_stored(self, ev: KvStored, tier: str, s_prev: np.ndarray | None = None) -> np.ndarray:
        n = self._node_for_kv(ev, ev.node)
        r = self._request(ev, ev.request)
        if s_prev is not None:  # the same blocks' slots, from the write-through's L1 step
            s = self._t.store(n.idx, tier, ev.blocks, float(ev.ts), s_prev)
        else:  # (the request's cached slots, filled in place)
            s = self._t.store(n.idx, tier, ev.blocks, float(ev.ts), self._kv_slots(r, ev.blocks))
        branch = r.branch if r is not None else ev.branch
        if branch is None:
            return s
        b = self._branch(ev, branch, quiet_ended=True)
        if b is not None:
            for ph in self._phase_of(n, r):
                self._set_holder(b, ph, n.idx)
        return s

    def _on_kv_evicted(self, ev: KvEvicted) -> None:
        n = self._node(ev.node)
        if n is None:
            self._anomaly(ev, "unknown_node", ev.node, "eviction on an unknown node")
            return
        missing = self._t.evict(n.idx, ev.tier, ev.blocks)
        if missing:
            self._anomaly(ev, "unknown_block", ev.node, f"{missing} evicted block(s) not held in {ev.tier}")

    def _on_kv_moved(self, ev: KvMoved) -> None:
        src = self._node_for_kv(ev, ev.src_node)
        dst = self._node_for_kv(ev, ev.dst_node)
        r = self._request(ev, ev.request)
        cached = self._kv_slots(r, ev.blocks)  # (the request's cached slots, filled in place)
        # resolved once for the read and the store (the store re-probes the unknown ones)
        s0 = cached if cached is not None else self._t.slots(ev.blocks, len(ev.blocks))
        self._read(ev, src, ev.blocks, s0)
        self._t.store(dst.idx, ev.dst_tier, ev.blocks, float(ev.ts), s0)
        branch = r.branch if r is not None else ev.branch
        b = self._branch(ev, branch, quiet_ended=True) if branch is not None else None
        if b is None:
            return
        sp, dp = _PHASE_INDEX[ev.src_phase], _PHASE_INDEX[ev.dst_phase]
        if sp != dp:  # across phases both copies keep the count
            self._set_holder(b, sp, src.idx)
        self._set_holder(b, dp, dst.idx)  # within a phase the count moves: source -1

    def _read(self, ev: Event, n: _Node, blocks: Sequence[int], s: np.ndarray | None = None) -> None:
        """Blocks read from ``n`` (a move or fetch source): refresh their last access."""
        missing = self._t.read(n.idx, blocks, float(ev.ts), s)
        if missing:
            self._anomaly(ev, "unknown_block", n.id, f"{missing} block(s) read from a node without a copy")

    def _on_kv_fetched(self, ev: KvFetched) -> None:
        """Peer L2 -> own L2 -> GPU (METHOD §4.1): the destination holds the blocks in both tiers."""
        src = self._node_for_kv(ev, ev.src_node)
        dst = self._node_for_kv(ev, ev.dst_node)
        # the blocks resolved once for the read and both stores (the first store allocates the
        # unknown ones; the second finds them all)
        s = self._t.slots(ev.blocks, len(ev.blocks))
        self._read(ev, src, ev.blocks, s)
        s = self._t.store(dst.idx, "L2", ev.blocks, float(ev.ts), s)
        self._t.store(dst.idx, "L1", ev.blocks, float(ev.ts), s)
        # a P2P move for the request's prefill: the branch's prefill count moves to dst
        r = self._requests.get(ev.request)
        b = self._branches.get(r.branch) if r is not None else None
        if b is not None:
            self._set_holder(b, PREFILL, dst.idx)
