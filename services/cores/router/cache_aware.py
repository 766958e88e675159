"""SGLang Model Gateway's cache-aware and sticky (session-affinity) routing policies, on blocks.

Pure: no I/O, no clock, no randomness. Shares :class:`~services.cores.router.base.RouterBase` (same fold, re-routing on a switch, cold start) and routes decode round robin over the sorted decode nodes; no peer fetch (see docs/router.md for the defaults and their sources).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import msgspec

from events.catalog import BranchOpened, Event, RouteDecided
from services.cores.router.base import RouterBase, local_choice, node_score
from services.cores.router.state import RequestState


class StickyRouter(RouterBase):
    """Same branch -> same node. A branch's first request goes where its parent's went when the
    branch is a fork (it reuses the parent's context), else to the least loaded node; a branch
    whose node stops taking prefill is re-stuck to the least loaded node. Score: 0 for the
    sticky node, else outstanding prefill requests + 1."""

    default_name: ClassVar[str] = "sticky"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.stick: dict[str, str] = {}  # branch -> node of this router's decisions
        self.parents: dict[str, str] = {}  # fork branch -> parent branch

    def on_event(self, event: Event) -> None:
        if isinstance(event, BranchOpened) and event.mode == "fork" and event.parent:
            self.parents[event.branch] = event.parent

    def on_branch_ended(self, branch: str) -> None:
        self.stick.pop(branch, None)
        self.parents.pop(branch, None)

    def choose_prefill(self, r, candidates, lookup, now):
        target = self.stick.get(r.branch)
        if target is None and r.branch in self.parents:
            target = self.stick.get(self.parents[r.branch])
        if target not in candidates:
            target = min(candidates, key=lambda n: (self.state.outstanding_prefill(n), n))
        self.stick[r.branch] = target
        scores = [node_score(self, n, 0 if n == target else self.state.outstanding_prefill(n) + 1, r, lookup, now)
                  for n in candidates]
        return local_choice(self, target, r, lookup, now, scores)

    def extra_snapshot(self) -> bytes:
        return msgspec.msgpack.encode([sorted(self.stick.items()), sorted(self.parents.items())])

    def restore_extra(self, data: bytes) -> None:
        stick, parents = msgspec.msgpack.decode(data, type=list[list[tuple[str, str]]])
        self.stick, self.parents = dict(stick), dict(parents)


class _CacheAwareSnap(msgspec.Struct, kw_only=True):
    workers: list[str]
    blocks: list[tuple[int, int, list[float]]]  # block, depth, last access per worker (-1: absent)
    next_eviction: float


class CacheAwareRouter(RouterBase):
    """SGLang Model Gateway's cache-aware policy, on blocks instead of characters.

    Per worker, an *approximate* prefix tree of what was routed there (not KV events): the
    blocks of every acting decision are inserted on its prefill node. For a request:

    1. load = outstanding prefill requests per candidate; if ``max - min > balance_abs_threshold``
       and ``max > balance_rel_threshold * min`` the system is imbalanced: least load wins;
    2. else, if the longest prefix match (tokens / prompt tokens) exceeds ``cache_threshold``:
       the worker with the longest match wins;
    3. else the worker with the smallest tree (most free cache) wins.

    Ties to the smallest node id. Every ``eviction_interval_s`` (event time) a tree over
    ``max_tree_tokens`` drops its least recently routed blocks, deepest first among blocks
    routed at the same time (leaves before their parents). Score: matched prefix tokens
    (*higher* is better), the winner's rule is in the decision's choice.
    """

    default_name: ClassVar[str] = "cache_aware"
    defaults: ClassVar[dict[str, Any]] = {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "eviction_interval_s": 60.0,
        "max_tree_tokens": 2 ** 26,
    }

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.workers: list[str] = []  # index -> node id (append only)
        self.index: dict[str, int] = {}
        self.owners: dict[int, int] = {}  # block -> bitmask of worker indices
        self.last: list[dict[int, float]] = []  # per worker: block -> last routed ts
        self.depth: dict[int, int] = {}  # block -> position in its prompt (fixed by the chain)
        self.next_eviction = float(self.eviction_interval_s)

    def _worker(self, node: str) -> int:
        idx = self.index.get(node)
        if idx is None:
            idx = self.index[node] = len(self.workers)
            self.workers.append(node)
            self.last.append({})
        return idx

    def on_acting(self, rd: RouteDecided, r: RequestState | None) -> None:
        if r is None or not r.blocks or rd.shadow:
            return
        idx = self._worker(rd.prefill_node)
        bit = 1 << idx
        last = self.last[idx]
        owners, depth = self.owners, self.depth
        for i, b in enumerate(r.blocks):
            owners[b] = owners.get(b, 0) | bit
            last[b] = rd.ts
            depth[b] = i

    def on_event(self, event: Event) -> None:
        if event.ts >= self.next_eviction:
            self._evict()
            interval = float(self.eviction_interval_s)
            gap = event.ts - self.next_eviction
            if gap > 1000 * interval:
                # a first event stamped with wall-clock time (~1.8e9 s under `evolving up`): jump
                # to the interval before it instead of counting 1e8 intervals one at a time
                self.next_eviction += math.floor(gap / interval) * interval
            while self.next_eviction <= event.ts:
                self.next_eviction += interval

    def on_node_removed(self, node: str) -> None:
        idx = self.index.get(node)
        if idx is not None:
            self._drop(idx, list(self.last[idx]))

    def _drop(self, idx: int, blocks: list[int]) -> None:
        keep = ~(1 << idx)
        last = self.last[idx]
        for b in blocks:
            last.pop(b, None)
            m = self.owners.get(b, 0) & keep
            if m:
                self.owners[b] = m
            else:
                self.owners.pop(b, None)
                self.depth.pop(b, None)

    def _evict(self) -> None:
        cap = max(0, int(self.max_tree_tokens) // self.block_tokens)
        for idx, last in enumerate(self.last):
            if len(last) > cap:
                depth = self.depth
                order = sorted(last.items(), key=lambda kv: (kv[1], -depth.get(kv[0], 0), kv[0]))
                self._drop(idx, [b for b, _ in order[: len(last) - cap]])

    def _matches(self, blocks: list[int], candidates: list[str]) -> dict[str, int]:
        """Matched prefix blocks per candidate, one pass over the blocks."""
        alive = 0
        for n in candidates:
            idx = self.index.get(n)
            if idx is not None:
                alive |= 1 << idx
        matched = {n: 0 for n in candidates}
        owners = self.owners
        i = 0
        for b in blocks:
            m = owners.get(b, 0) & alive
            if m != alive:
                dropped = alive & ~m
                for n in candidates:
                    idx = self.index.get(n)
                    if idx is not None and dropped >> idx & 1:
                        matched[n] = i
                alive = m
                if not alive:
                    break
            i += 1
        if alive:
            for n in candidates:
                idx = self.index.get(n)
                if idx is not None and alive >> idx & 1:
                    matched[n] = i
        return matched

    def choose_prefill(self, r, candidates, lookup, now):
        loads = {n: self.state.outstanding_prefill(n) for n in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        matched = self._matches(r.blocks, candidates)
        prompt = max(1, self.prompt_tokens(r))
        bt = self.block_tokens
        scores = [node_score(self, n, min(matched[n] * bt, prompt), r, lookup, now) for n in candidates]
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            node = min(candidates, key=lambda n: (loads[n], n))
        else:
            best = min(candidates, key=lambda n: (-matched[n], n))
            rate = min(matched[best] * bt, prompt) / prompt
            if rate > self.cache_threshold:
                node = best
            else:
                node = min(candidates, key=lambda n: (self._tree_size(n), n))
        return local_choice(self, node, r, lookup, now, scores)

    def _tree_size(self, node: str) -> int:
        idx = self.index.get(node)
        return len(self.last[idx]) if idx is not None else 0

    def extra_snapshot(self) -> bytes:
        rows = []
        for b in sorted(self.owners):
            rows.append((b, self.depth.get(b, 0), [self.last[i].get(b, -1.0) for i in range(len(self.workers))]))
        return msgspec.msgpack.encode(_CacheAwareSnap(workers=self.workers, blocks=rows,
                                                      next_eviction=self.next_eviction))

    def restore_extra(self, data: bytes) -> None:
        snap = msgspec.msgpack.decode(data, type=_CacheAwareSnap)
        self.workers, self.index, self.owners = [], {}, {}
        self.last = []
        for n in snap.workers:
            self._worker(n)
        self.depth = {}
        for b, d, stamps in snap.blocks:
            self.depth[b] = d
            for i, ts in enumerate(stamps):
                if ts >= 0:
                    self.last[i][b] = ts
                    self.owners[b] = self.owners.get(b, 0) | (1 << i)
        self.next_eviction = snap.next_eviction
