"""SGLang Model Gateway's cache-aware and sticky (session-affinity) routing policies, on blocks.

Pure: no I/O, no clock, no randomness. Shares :class:`~services.cores.router.base.RouterBase` (same fold, re-routing on a switch, cold start) and routes decode round robin over the sorted decode nodes; no peer fetch (see docs/router.md for the defaults and their sources).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import msgspec
import numpy as np

from events.catalog import BranchOpened, Event, RouteDecided
from services.cores.directory._native import SlotMap
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


class RouteTrees:
    """Every worker's approximate tree as one table: the blocks routed to each worker and when.

    A block has a slot (``SlotMap``: uint64 hash -> slot >= 1) while some worker holds it; per
    slot its hash, its depth (position in the prompt that last routed it) and how many workers
    hold it, and per worker and slot the last time it was routed there (NaN: not held). A
    route writes its prompt's slots with a few array operations, where the dicts it replaces
    (block -> owner mask, per worker block -> ts, block -> depth) took four dict operations a
    block: ~1.6 us a block on large trees, a fifth of a baseline row of the matrix. It answers
    exactly what the dicts answered (tests/property/test_route_trees.py holds it to them).
    Memory: a row of 8 bytes per worker for every block held anywhere, plus the hash table
    (measured for 1 M blocks held 1.5 times each, docs/router.md: 136 MiB at 9 workers, less
    than the dicts' 208; 831 MiB at 96 workers, 3.5x the dicts' 237)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.index = SlotMap()
        self.block = np.zeros(capacity, dtype=np.uint64)
        self.depth = np.zeros(capacity, dtype=np.int64)
        self.held = np.zeros(capacity, dtype=np.int32)  # workers holding the slot's block
        self.last = np.full((0, capacity), np.nan)  # worker x slot; slot 0 is never used
        self.sizes: list[int] = []  # blocks per worker
        self.free: list[int] = []
        self.top = 1  # slots below it were handed out once

    def add_worker(self) -> int:
        self.last = np.vstack([self.last, np.full((1, self.last.shape[1]), np.nan)])
        self.sizes.append(0)
        return len(self.sizes) - 1

    def __len__(self) -> int:
        return len(self.index)

    def _grow(self, need: int) -> None:
        cap = self.block.shape[0]
        while cap < need:
            cap *= 2
        if cap == self.block.shape[0]:
            return
        n = self.block.shape[0]
        for name in ("block", "depth", "held"):
            old = getattr(self, name)
            arr = np.zeros(cap, dtype=old.dtype)
            arr[:n] = old
            setattr(self, name, arr)
        last = np.full((self.last.shape[0], cap), np.nan)
        last[:, :n] = self.last
        self.last = last

    def _slots_for_new(self, k: int) -> np.ndarray:
        """``k`` slots: freed ones first (the last freed), then never used ones."""
        cut = len(self.free) - min(k, len(self.free))
        reuse = self.free[cut:]  # a copy: the free list keeps what is left
        del self.free[cut:]
        fresh = k - len(reuse)
        if fresh:
            self._grow(self.top + fresh)
        out = np.array(list(reuse) + list(range(self.top, self.top + fresh)), dtype=np.intp)
        self.top += fresh
        return out

    def insert(self, worker: int, blocks, ts: float) -> None:
        """Route ``blocks`` to ``worker`` at ``ts``: each is held there with last time ``ts``,
        and its depth is its position in ``blocks`` (the last one, should a block repeat)."""
        n = len(blocks)
        if not n:
            return
        slots = self.index.find_seq(blocks)
        missing = slots == 0
        if missing.any():
            keys = np.array([blocks[i] for i in np.flatnonzero(missing).tolist()], dtype=np.uint64)
            _, first = np.unique(keys, return_index=True)
            keys = keys[np.sort(first)]  # distinct, in order of first appearance
            new = self._slots_for_new(keys.shape[0])
            self.index.insert(keys, new)
            self.block[new] = keys
            slots = self.index.find_seq(blocks)
        pos = np.arange(n)
        uniq, last_at = np.unique(slots[::-1], return_index=True)
        if uniq.shape[0] != n:  # a block repeats: its last position counts
            slots, pos = uniq, (n - 1) - last_at
        row = self.last[worker]
        fresh = slots[np.isnan(row[slots])]
        if fresh.shape[0]:
            self.held[fresh] += 1
            self.sizes[worker] += fresh.shape[0]
        row[slots] = ts
        self.depth[slots] = pos

    def matched(self, blocks, workers: list[int]) -> list[int]:
        """Per worker, how many leading blocks of ``blocks`` it holds."""
        n = len(blocks)
        if not workers:
            return []
        if not n:
            return [0] * len(workers)
        slots = self.index.find_seq(blocks)
        gone = np.isnan(self.last[np.asarray(workers)[:, None], slots])  # slot 0 (unknown) is NaN
        first = gone.argmax(axis=1)
        return [int(f) if g[f] else n for f, g in zip(first, gone)]

    def drop(self, worker: int, slots: np.ndarray) -> None:
        """``worker`` no longer holds the blocks of ``slots`` (each held there, distinct); a
        block no worker holds loses its slot."""
        if not slots.shape[0]:
            return
        self.last[worker, slots] = np.nan
        self.sizes[worker] -= slots.shape[0]
        self.held[slots] -= 1
        gone = slots[self.held[slots] == 0]
        if gone.shape[0]:
            self.index.delete(self.block[gone])
            self.free.extend(np.sort(gone).tolist())

    def held_by(self, worker: int) -> np.ndarray:
        return np.flatnonzero(~np.isnan(self.last[worker]))

    def oldest(self, worker: int, k: int) -> np.ndarray:
        """The ``k`` slots ``worker`` routed least recently, deepest first among equal times
        (leaves before their parents), then by hash."""
        present = self.held_by(worker)
        order = np.lexsort((self.block[present], -self.depth[present], self.last[worker, present]))
        return present[order[:k]]

    @classmethod
    def from_rows(cls, workers: int, rows: list[tuple[int, int, list[float]]]) -> RouteTrees:
        """The trees :meth:`rows` described (a time below 0: not held; a block no worker
        holds is left out)."""
        stamps = np.array([st for _, _, st in rows], dtype=np.float64).reshape(len(rows), workers).T
        keep = (stamps >= 0).any(axis=0)
        n = int(keep.sum())
        t = cls(capacity=max(1024, 2 * (n + 1)))
        for _ in range(workers):
            t.add_worker()
        if n:
            slots = np.arange(1, n + 1, dtype=np.intp)
            keys = np.array([b for b, _, _ in rows], dtype=np.uint64)[keep]
            t.index.insert(keys, slots)
            t.block[slots] = keys
            t.depth[slots] = np.array([d for _, d, _ in rows], dtype=np.int64)[keep]
            held = stamps[:, keep] >= 0
            t.last[:, slots] = np.where(held, stamps[:, keep], np.nan)
            t.held[slots] = held.sum(axis=0)
            t.sizes = held.sum(axis=1).tolist()
            t.top = n + 1
        return t

    def blocks_of(self, worker: int) -> list[int]:
        return sorted(int(b) for b in self.block[self.held_by(worker)])

    def rows(self) -> list[tuple[int, int, list[float]]]:
        """(block, depth, last time per worker or -1.0) of every block, by block."""
        keys, slots = self.index.items()
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        stamps = np.where(np.isnan(self.last[:, slots]), -1.0, self.last[:, slots]).T.tolist()
        return [(int(b), int(d), st) for b, d, st in zip(keys.tolist(), self.depth[slots].tolist(), stamps)]


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
    (*higher* is better), the winner's rule is in the decision's choice. The trees are one
    table (:class:`RouteTrees`).
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
        self.trees = RouteTrees()
        self.next_eviction = float(self.eviction_interval_s)

    def _worker(self, node: str) -> int:
        idx = self.index.get(node)
        if idx is None:
            idx = self.index[node] = len(self.workers)
            self.workers.append(node)
            self.trees.add_worker()
        return idx

    def on_acting(self, rd: RouteDecided, r: RequestState | None) -> None:
        if r is None or not r.blocks or rd.shadow:
            return
        self.trees.insert(self._worker(rd.prefill_node), r.blocks, rd.ts)

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
            self.trees.drop(idx, self.trees.held_by(idx))

    def _evict(self) -> None:
        cap = max(0, int(self.max_tree_tokens) // self.block_tokens)
        trees = self.trees
        for idx, size in enumerate(trees.sizes):
            if size > cap:
                trees.drop(idx, trees.oldest(idx, size - cap))

    def _matches(self, blocks: list[int], candidates: list[str]) -> dict[str, int]:
        """Matched prefix blocks per candidate (0 for a worker never routed to)."""
        known = [n for n in candidates if n in self.index]
        matched = dict.fromkeys(candidates, 0)
        matched.update(zip(known, self.trees.matched(blocks, [self.index[n] for n in known])))
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
        return self.trees.sizes[idx] if idx is not None else 0

    def extra_snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_CacheAwareSnap(workers=self.workers, blocks=self.trees.rows(),
                                                      next_eviction=self.next_eviction))

    def restore_extra(self, data: bytes) -> None:
        snap = msgspec.msgpack.decode(data, type=_CacheAwareSnap)
        self.workers, self.index = [], {}
        self.trees = RouteTrees.from_rows(len(snap.workers), snap.blocks)
        for i, n in enumerate(snap.workers):
            self.index[n] = i
            self.workers.append(n)
        self.next_eviction = snap.next_eviction
