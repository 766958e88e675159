"""The simulated engine node: prefill / decode / collocated, with an L1 (GPU) and L2 (host) KV pool.

No asyncio, no wall clock: the caller passes time through a :class:`NodeHost` (``now``,
``schedule``, ``emit``) and the node reports what it did as catalog events. The same class
backs the discrete-event cluster simulator (replay/sim/simulation.py) and can back a live sim engine
(a host that schedules on an event loop and publishes on the bus).

Request lifecycle on a node (numbers match the docstring of replay/sim/simulation.py and docs/simulator.md)
1. ``enqueue_prefill``: a non-shadow ``RouteDecided`` names this node. With the shared pool and
   asynchronous fetch, the planned peer blocks are fetched now (one fetch link per node, FIFO);
   the request is eligible for prefill once its fetch is done (``KvStored`` L2+L1 at that time).
2. Prefill start: the node measures its own cached prefix (own L1, then own L2 = restore
   ``t_rst``; with fetch-at-start the peer fetch is done now and its time is added to this
   iteration). ``RequestStarted(phase=prefill)`` carries the tokens actually reused.
3. Prefill iterations take up to ``token_budget`` new tokens in the node's ``prefill_order``
   (prefill_order.py): ``fcfs`` (running chunk first, then queued eligible requests FCFS) or
   ``short_first`` (shortest expected remaining prefill first with aging, iterations bounded in
   time); time = eq. 1 with the profile's coefficients x noise.
4. Last chunk done: ``KvStored`` (L1 and, write-through, L2: one event with ``write_through``
   when both tiers add the same blocks, ``KvPool.store_through``) for the new blocks,
   ``FirstToken``, then KV transfer to the decode node over the GPU path (``p2d_transfer_s``).
5. Decode admission (``kv_arrived``): when the decode L1 holds the prompt's blocks plus the
   request's working tokens (evicting through the policy), ``KvMoved`` P->D and
   ``RequestStarted(phase=decode)``.
6. Decode is continuously batched: a *run* is a sequence of iterations with the same batch B;
   every iteration takes eq. 2 x one noise draw per run and accepts ``t_acc`` tokens per
   request. A run ends at the first completion, or at the next iteration boundary when a
   request is admitted. One ``IterationDone(iterations=n)`` per run.
7. ``RequestFinished``; the prompt's KV stays cached in L1 and is written to L2 for later
   requests ("decode nodes only write to the pool").
8. ``+prestage``: the output's full blocks are written to L2 with the
   prompt's (``output_kv``); a ``KvStageOrdered`` naming this node as the destination is
   carried out by ``stage_in``: the finished turn's blocks that this node lacks and the source
   holds in L2 are pulled over this node's fetch link (``fetch_s``) at low priority: staging
   transfers queue among themselves after the requests' fetches already queued, and a
   request's fetch issued later goes ahead of them (the staging in flight lands that much
   later). They land in the ordered tier (room made through the eviction policy; no room:
   nothing lands), reported as ``KvMoved(src_phase=decode, dst_phase=prefill)``.
9. ``cancel`` (the client went away): a queued prefill or a decode waiting for
   admission is dropped at once; one in an iteration (a prefill chunk, a decode run, decodes
   riding along a prefill) stops at that iteration's end, a decode run being cut at its next
   iteration boundary. ``RequestFinished(error="cancelled")`` with the tokens produced so far;
   the KV is kept as for a finished request (the prompt's blocks stay cached, unpinned: 7.).

Role switch (``SwitchRole``): stop nothing, drain the work of the phase the node leaves
(queued and running), then ``in_place`` (0.7 s, KV kept), ``restart`` (down ``restart_s``,
all KV dropped) or ``in_place_drop_kv`` (0.7 s, all KV dropped); then ``RoleSwitched``.
An ``in_place`` switch to prefill (METHOD.md §4.1: a role change only changes which requests
the router sends; §4.4: running requests finish in place) serves prefill from the order on:
while decodes it already runs remain, each prefill iteration carries them along as one decode
step (a mixed batch, as a symmetric engine's single scheduling loop runs them: SGLang's mixed
chunked prefill), costing their per-request share of eq. 2 (``d2 * B + d_ctx * context``; the
fixed cost and the expert reads are the prefill pass's), and the node decodes alone only when
no prefill is eligible. Before, such a node alternated 0.25 s decode runs with prefill
iterations until its decodes (thousands of tokens on Putnam) were done, halving the only
prefill node's capacity for minutes after a warm-up ending at 1P8D.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engine._kvscan import held_unpinned
from engine.backend import DecodeJob, PrefillJob
from engine.backends.sim.prefill_order import (
    LONG_S,
    LONG_SHARE,
    PREFILL_ORDERS,
    chunk_s,
    chunk_within,
    iteration_cap_s,
    order_key,
    remaining_s,
)
from engine.kvpool import EVICT_BATCH, BlockSet, KvPool
from engine.profiles import Profile
from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    KvFetched,
    KvMoved,
    KvStageOrdered,
    KvStored,
    RequestFinished,
    RequestStarted,
    RoleSwitched,
)
from events.ids import BlockHash, NodeId, RequestId, Role, SwitchMechanism, Tier

#: How prefill nodes reach KV held by peers: "async" (fetch while queued; ours), "at_start"
#: (fetch when prefill starts, time added to prefill; memory-pool baseline), "none" (node-local
#: cache only; HiCache per node).
FETCH_MODES = ("async", "at_start", "none")
__all__ = ["COLLOCATED_DECODE_SLICE_S", "EVICT_BATCH", "FETCH_MODES", "PREFILL_ORDERS", "DecodeJob", "NodeHost",
           "PrefillJob", "SimNode"]
#: A collocated node runs decode for at most this long between prefill iterations.
COLLOCATED_DECODE_SLICE_S = 0.25


def clipped_noise_mean(rel: float) -> float:
    """``E[max(0.5, 1 + rel Z)]``, Z standard normal: the mean of the clipped noise factor, which
    the node divides out so an iteration's expected time is the profile's. ``1 + rel (a Phi(a) +
    phi(a))`` with ``a = -0.5 / rel``. At the GB300 profiles' 3% it is 1.0 to the last bit (no draw
    changes); at the 40-80% of a calibration on a loaded CPU (docs/simulator.md, "Validated against
    live") the clipping alone had made iterations 5-12% slower on average than the profile says."""
    a = -0.5 / rel
    return 1.0 + rel * (a * 0.5 * math.erfc(-a / math.sqrt(2.0)) + math.exp(-a * a / 2.0) / math.sqrt(2.0 * math.pi))


class NodeHost(Protocol):
    """What a node needs from its driver."""

    now: float

    def emit(self, event: Event) -> None: ...

    def schedule(self, t: float, fn, *args) -> None: ...

    def choose_eviction(self, node: NodeId, tier: Tier, tokens: int, pinned: frozenset) -> list[BlockHash]: ...

    def peer(self, node: NodeId) -> SimNode | None: ...


class SimNode:
    """One engine node (see the module docstring)."""

    def __init__(self, node: NodeId, role: Role, profile: Profile, host: NodeHost, seed: int,
                 fetch_mode: str = "async") -> None:
        assert fetch_mode in FETCH_MODES, fetch_mode
        self.id = node
        self.role: Role = role
        self.p = profile
        self.host = host
        self.rng = np.random.default_rng(seed)
        self.fetch_mode = fetch_mode
        self.bt = profile.block_tokens
        self.pool = KvPool(node, profile.block_tokens, profile.l1_capacity_tokens, profile.l2_capacity_tokens,
                           choose=self._choose, emit=self._emit, now=self._now)
        self.l1_cap_blocks = self.pool.l1_cap_blocks
        self.l2_cap_blocks = self.pool.l2_cap_blocks
        # prefill
        self.pqueue: list[PrefillJob] = []
        self.prefill_order = "fcfs"  # or "short_first" (prefill_order.py); the driver sets it
        self._cap_s = iteration_cap_s(profile)
        self.fetch_link_free_s = 0.0
        # decode
        self.running: dict[RequestId, DecodeJob] = {}
        self.dwaiting: deque[DecodeJob] = deque()
        self.run_start_s = 0.0
        self.run_iter_s = 0.0
        self.run_iters = 0
        self.run_batch = 0
        self.run_ctx = 0  # context tokens the current decode run attends over (its timing)
        self.run_cut = False
        # executor
        self.busy = False
        self.gen = 0
        self.kick_pending = False
        self.last_was_decode = False
        self.status = "up"  # up | draining | switching | down
        self.switch_to: Role | None = None
        self.switch_mech: SwitchMechanism = "in_place"
        self.switch_ordered_s = 0.0
        self.drained = 0
        # counters for metrics and tests
        self.busy_prefill_s = 0.0
        self.busy_acc = 0.0
        self.busy_start = 0.0
        self.prefill_wait_s = 0.0
        self.prefill_started = 0
        # ``+prestage``: (request, prompt blocks) -> the output's full blocks,
        # kept with the prompt's in host memory when the request finishes; None: output KV is not
        # cached (the default model, docs/simulator.md §2.7)
        self.output_kv = None
        self.staged_tokens = 0  # tokens landed by stage orders (tests, figures read KvMoved)
        self.stage_link_free_s = 0.0  # the fetch link's staging queue (behind the requests' fetches)
        self.stage_shift = 0.0  # fetch time that went ahead of the staging in flight, in total
        # 9. requests cancelled while in an iteration of this node: they end at its end
        self.cancelling: set[RequestId] = set()

    # ------------------------------------------------------------------ small helpers
    def _noise(self, rel: float) -> float:
        if rel <= 0:
            return 1.0
        return max(0.5, 1.0 + rel * float(self.rng.standard_normal())) / clipped_noise_mean(rel)

    def does_prefill(self) -> bool:
        return self.role in ("prefill", "collocated")

    def does_decode(self) -> bool:
        return self.role in ("decode", "collocated")

    def _emit(self, e: Event) -> None:
        self.host.emit(e)

    def _now(self) -> float:
        return self.host.now

    def _choose(self, tier: Tier, tokens: int, pinned: frozenset) -> list[BlockHash]:
        return self.host.choose_eviction(self.id, tier, tokens, pinned)

    def kick(self) -> None:
        """Schedule the executor at the current time (never re-entrant)."""
        if not self.kick_pending and not self.busy:
            self.kick_pending = True
            self.host.schedule(self.host.now, self._on_kick)

    def _on_kick(self) -> None:
        self.kick_pending = False
        self._next()

    # ------------------------------------------------------------------ KV store (engine/kvpool.py)
    @property
    def l1(self) -> BlockSet:
        return self.pool.l1

    @property
    def l2(self) -> BlockSet:
        return self.pool.l2

    @property
    def working_tokens(self) -> int:
        """Decode L1 tokens not held as cached blocks (tails + output): the pool's reservation."""
        return self.pool.reserved_tokens

    @working_tokens.setter
    def working_tokens(self, value: int) -> None:
        self.pool.reserved_tokens = value

    def holds(self, block: BlockHash, tier: Tier) -> bool:
        return self.pool.holds(block, tier)

    def _prefix_len(self, blocks: Sequence[BlockHash], start: int, store: BlockSet) -> int:
        return self.pool.held_run(blocks, start, store)

    def _missing(self, blocks: Sequence[BlockHash], store: BlockSet) -> list[BlockHash]:
        return self.pool.missing(blocks, store)

    def _make_room(self, tier: Tier, need_blocks: int, also_pinned: Sequence[BlockHash] = (),
                   extra_tokens: int = 0) -> bool:
        return self.pool.make_room(tier, need_blocks, also_pinned, extra_tokens)

    def _store(self, tier: Tier, blocks: Sequence[BlockHash], pinned: Sequence[BlockHash] = (),
               request: RequestId | None = None) -> list[BlockHash]:
        return self.pool.store(tier, blocks, pinned, request)

    def drop_all_kv(self) -> None:
        self.pool.drop_all()

    def pinned(self) -> frozenset:
        return self.pool.pinned()

    def _pin_prefill(self, job: PrefillJob) -> None:
        """A queued job pins its blocks once it holds KV here (started, or fetched KV landed);
        before that, the prefix this node already holds (own GPU, then own host), the KV the
        job will reuse here. Unpinned, that prefix was evicted during long queue waits (issue
        12: under count-aware eviction first of all, since the branch's count stays on the
        node that last held its KV until the KV moves here)."""
        if job.started or job.fetched:
            self.pool.pin(("p", job.request), job.blocks)
            return
        blocks = job.blocks
        k = self._prefix_len(blocks, self._prefix_len(blocks, 0, self.l1), self.l2)
        if k:
            self.pool.pin(("p", job.request), blocks[:k])
        else:
            self.pool.unpin(("p", job.request))

    def _dequeue(self, job: PrefillJob) -> None:
        self.pqueue.remove(job)
        self.pool.unpin(("p", job.request))

    # ------------------------------------------------------------------ 1. prefill enqueue
    def enqueue_prefill(self, job: PrefillJob) -> None:
        now = self.host.now
        job.ready_s = now
        tokens = 0
        if self.prefill_order != "fcfs" or (self.fetch_mode == "async" and job.fetch_plan):
            local = self._prefix_len(job.blocks, self._prefix_len(job.blocks, 0, self.l1), self.l2)
        if self.fetch_mode == "async" and job.fetch_plan:
            got = self._collect_fetch(job, local)
            tokens = sum(len(b) for _, b in got) * self.bt
            if tokens:
                start = max(now, self.fetch_link_free_s)
                dur = self.p.fetch_s(tokens)
                self.fetch_link_free_s = start + dur
                if self.stage_link_free_s > start:  # a request's fetch goes ahead of staging (8.)
                    self.stage_link_free_s += dur
                    self.stage_shift += dur
                job.fetch_start_s, job.fetch_s = now, start + dur - now
                job.fetch_busy_mark = self._busy_total(now)
                job.ready_s = start + dur
                job.fetched = got
                self.host.schedule(job.ready_s, self._fetch_done, job)
        if self.prefill_order != "fcfs":  # what it will likely find cached at its start
            job.est_uc = max(1, job.prompt_tokens - local * self.bt - tokens)
        # Higher priority (the agent hint) goes ahead of lower-priority jobs not yet started;
        # equal priorities (all 0 without hints) keep arrival order (``short_first`` sorts the
        # queue at each iteration: _prefill_batch_order).
        i = len(self.pqueue)
        while i > 0 and not self.pqueue[i - 1].started and self.pqueue[i - 1].priority < job.priority:
            i -= 1
        self.pqueue.insert(i, job)
        self._pin_prefill(job)
        if self._mixes_decode_into_prefill():
            self._cut_decode_run()  # the prefill need not wait for the decode run to end
        self.kick()

    def _collect_fetch(self, job: PrefillJob, local_blocks: int) -> list:
        """Validate the router's fetch plan against what the peers hold now: each step is
        read only while its source holds the blocks (no KV is read from a node that lacks it);
        the fetched prefix stops at the first gap."""
        got = []
        pos = local_blocks
        for step in sorted(job.fetch_plan, key=lambda s: s.first_block):
            if step.first_block + step.n_blocks <= pos:
                continue
            if step.first_block > pos:
                break
            src = self.host.peer(step.src_node)
            if src is None or src is self or src.status == "down":
                break
            store = src.l2 if step.tier == "L2" else src.l1
            end = step.first_block + step.n_blocks
            if isinstance(store, (BlockSet, set, frozenset)):
                j = min(KvPool.prefix_len(job.blocks, pos, store), end)  # held from pos on (a compiled scan)
            else:  # a live worker's view of a peer's tier (engine/worker/host.py): one lookup a block
                j = pos
                while j < end and j < len(job.blocks) and job.blocks[j] in store:
                    j += 1
            if j > pos:
                got.append((src.id, list(job.blocks[pos:j])))
            if j < end:
                break
            pos = j
        return got

    def _fetch_done(self, job: PrefillJob) -> None:
        if job not in self.pqueue or not job.fetched:
            return  # rerouted away meanwhile; the fetched KV is simply not used here
        now = self.host.now
        # hidden: the part of the fetch during which this node was busy anyway
        hidden = min(job.fetch_s, self._busy_total(now) - job.fetch_busy_mark)
        job.fetched = self._receive(job, job.fetched, job.fetch_s, hidden)
        self._pin_prefill(job)
        if self._mixes_decode_into_prefill():
            self._cut_decode_run()
        self.kick()

    def _receive(self, job: PrefillJob, got: list, duration: float, hidden: float) -> list:
        """Land fetched blocks in own L2, then L1 (peer L2 -> own L2 -> GPU, METHOD §4.1;
        ``KvFetched``: the directory records both). When the GPU tier has no room (its blocks
        pinned by the running and the queued requests), the blocks stay in host memory
        (``KvMoved`` P2P into L2: the count moves as a fetch's does) and are restored into the
        GPU when the prefill starts (``t_rst``). Before, no GPU room meant
        the whole prompt was recomputed: on the calibration sessions at the pressure profile,
        336-425K-token prompts whose KV was in the pool took minutes of prefill each and
        queued their nodes behind them (docs/experiments.md, "Why ours loses reuse")."""
        pins = job.blocks
        kept = []
        for src, blocks in got:
            new2 = self._missing(blocks, self.l2)
            if not self._make_room("L2", len(new2), pins):
                break  # no room even in host memory: the rest is recomputed
            new1 = self._missing(blocks, self.l1)
            to_gpu = self._make_room("L1", len(new1), pins)
            self.pool.add("L2", blocks)
            kept.append((src, blocks))
            if to_gpu:
                self.pool.add("L1", blocks)
                self._emit(KvFetched(ts=self.host.now, src=self.id, request=job.request, src_node=src,
                                     dst_node=self.id, blocks=list(blocks), duration_s=duration, hidden_s=hidden))
            else:
                self._emit(KvMoved(ts=self.host.now, src=self.id, src_node=src, dst_node=self.id,
                                   blocks=list(blocks), src_phase="prefill", dst_phase="prefill", dst_tier="L2",
                                   request=job.request))
        return kept

    def _busy_total(self, t: float) -> float:
        return self.busy_acc + (t - self.busy_start if self.busy else 0.0)

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        """Take a queued, not started request off this node (reroute)."""
        for i, j in enumerate(self.pqueue):
            if j.request == request and not j.started:
                del self.pqueue[i]
                self.pool.unpin(("p", j.request))
                return j
        return None

    # ------------------------------------------------------------------ 9. cancel
    def cancel(self, request: RequestId) -> bool:
        """Stop ``request`` wherever it is on this node (module docstring, 9.); False when the
        node does not hold it (never routed here, in transfer to this node, finished)."""
        in_prefill = self.busy and not self.last_was_decode  # a prefill iteration is under way
        for job in self.pqueue:
            if job.request != request:
                continue
            if job.started and in_prefill:
                self.cancelling.add(request)  # its chunk is in the iteration: ends with it
            else:
                self._dequeue(job)
                self._finish_cancelled(request, 0)
                self.kick()
            return True
        for job in self.dwaiting:
            if job.request == request:
                self.dwaiting.remove(job)
                self._finish_cancelled(request, job.total_out - round(job.left))
                self.kick()
                return True
        job = self.running.get(request)
        if job is None:
            return False
        if self.busy:  # in a decode run (cut it) or riding along / waiting behind a prefill iteration
            self.cancelling.add(request)
            self._cut_decode_run()
        else:
            self._finish_decode(job, "cancelled")
            self.kick()
        return True

    def _finish_cancelled(self, request: RequestId, output_tokens: int) -> None:
        self.cancelling.discard(request)
        self._emit(RequestFinished(ts=self.host.now, src=self.id, request=request, node=self.id,
                                   output_tokens=max(0, output_tokens), error="cancelled"))
        if self.status == "draining":
            self.drained += 1

    def _end_cancelled(self) -> None:
        """After an iteration: the requests cancelled during it that it did not finish."""
        if not self.cancelling:
            return
        for job in [j for j in self.pqueue if j.request in self.cancelling]:
            self._dequeue(job)
            self._finish_cancelled(job.request, 0)
        for job in [j for j in self.running.values() if j.request in self.cancelling]:
            self._finish_decode(job, "cancelled")

    # ------------------------------------------------------------------ executor
    def _next(self) -> None:
        if self.busy or self.status in ("switching", "down"):
            return
        if self.status == "draining":
            self._maybe_finish_drain()  # the phase it leaves is done: switch now, even if the
            if self.status != "up" and self.status != "draining":  # kept phase has work
                return
        # Work of a phase the node no longer serves (a transfer that landed after a switch)
        # still finishes here: no request is ever stranded.
        pre_ok = (self.does_prefill() or bool(self.pqueue)) and self._eligible_prefill()
        dec_ok = False
        if self.does_decode() or self.running or self.dwaiting:
            self._admit()
            dec_ok = bool(self.running)
        # A node that is not collocated and holds decodes (the router's "no decode node"
        # fallback, a transfer landing after a switch) runs them along its prefill iterations:
        # choosing prefill whenever one is eligible starved them behind a steady flow of
        # prefills (`evolving chaos --engines`: a worker ran no decode for minutes)
        if pre_ok and dec_ok and (self._mixes_decode_into_prefill() or self.role != "collocated"):
            self._start_prefill_iteration(carry_decode=True)
        elif pre_ok and (not dec_ok or self.last_was_decode or self.role != "collocated"):
            self._start_prefill_iteration()
        elif dec_ok:
            self._start_decode_run()
        else:
            self._maybe_finish_drain()

    def _eligible_prefill(self) -> bool:
        now = self.host.now
        return any(j.started or j.ready_s <= now for j in self.pqueue)

    # ------------------------------------------------------------------ 2.-4. prefill
    def _begin_job(self, job: PrefillJob) -> float:
        """Measure the cached prefix at prefill start; returns fetch time charged now."""
        now = self.host.now
        blocks = job.blocks
        l1n = self._prefix_len(blocks, 0, self.l1)
        localn = self._prefix_len(blocks, l1n, self.l2)
        charged = 0.0
        fetched_tokens = sum(len(b) for _, b in job.fetched) * self.bt
        if self.fetch_mode == "at_start" and job.fetch_plan:
            got = self._collect_fetch(job, localn)
            tokens = sum(len(b) for _, b in got) * self.bt
            if tokens:
                charged = self.p.fetch_s(tokens)
                kept = self._receive(job, got, charged, 0.0)
                fetched_tokens = sum(len(b) for _, b in kept) * self.bt
                if kept:
                    l1n = self._prefix_len(blocks, 0, self.l1)
                    localn = self._prefix_len(blocks, l1n, self.l2)
        # restore own host blocks into GPU memory (eq. 1's t_rst)
        restore = self._to_restore(blocks, l1n, localn)
        pins = blocks
        if restore:
            self._store("L1", restore, pins, job.request)
        cached_blocks = max(l1n, localn)
        t_c = min(cached_blocks * self.bt, max(0, job.prompt_tokens - 1))
        job.t_c = t_c
        job.t_uc = max(1, job.prompt_tokens - t_c)
        job.t_rst = len(restore) * self.bt
        job.started = True
        self._pin_prefill(job)
        job.start_fetch_s = charged
        self.prefill_wait_s += now - job.enqueued_s
        self.prefill_started += 1
        self._emit(RequestStarted(ts=now, src=self.id, request=job.request, node=self.id, phase="prefill",
                                  cached_tokens=t_c, restored_tokens=job.t_rst,
                                  fetched_tokens=min(fetched_tokens, t_c)))
        return charged

    def _to_restore(self, blocks: Sequence[BlockHash], l1n: int, localn: int) -> list[BlockHash]:
        """``blocks[l1n:localn]`` not in L1, in order (duplicates kept): held in L2 as measured,
        they are L2's blocks that L1 lacks, which one compiled scan gives; if a fetch since
        evicted some from L2, each is tested."""
        part = blocks[l1n:localn]
        if KvPool.prefix_len(part, 0, self.l2) == len(part):
            return held_unpinned(part, self.l2, self.l1)
        return [b for b in part if b not in self.l1]

    def _mixes_decode_into_prefill(self) -> bool:
        """Switching in place to prefill: its running decodes ride along prefill iterations."""
        return self.status == "draining" and self.switch_mech == "in_place" and self.switch_to == "prefill"

    def _prefill_batch_order(self, now: float) -> list[PrefillJob]:
        if self.prefill_order == "fcfs":
            return self.pqueue
        return sorted(self.pqueue, key=lambda j: order_key(self.p, j, now))

    @staticmethod
    def _left(job: PrefillJob, long: set, time_left: float, long_left: float) -> float:
        return min(time_left, long_left) if job.request in long else time_left

    def _start_prefill_iteration(self, carry_decode: bool = False) -> None:
        now = self.host.now
        budget = self.p.prefill_token_budget
        batch: list[tuple[PrefillJob, int, float]] = []
        sum_uc = sum_rst = sum_tc = 0
        sum_A = 0.0
        extra = 0.0
        bounded = self.prefill_order == "short_first"
        order = self._prefill_batch_order(now)
        time_left = long_left = self._cap_s - self.p.c0
        if bounded:  # 3. while a short request is eligible, long ones share LONG_SHARE of the time
            long = {j.request for j in order if remaining_s(self.p, j) > LONG_S}
            if any(j.request not in long and (j.started or j.ready_s <= now) for j in order):
                long_left *= LONG_SHARE
        for job in order:
            if budget <= 0 or (bounded and batch and time_left <= 0):
                break
            if not job.started:
                if job.ready_s > now:
                    continue
                if bounded and batch and chunk_within(self.p, self._left(job, long, time_left, long_left),
                                                      job.prompt_tokens - job.est_uc) <= 0:
                    continue  # no token of it would fit: do not start it in this iteration
                extra += self._begin_job(job)
                sum_rst += job.t_rst
            remaining = job.t_uc - job.done_uc
            chunk = min(remaining, budget)
            before = job.t_c + job.done_uc
            if bounded:  # the iteration's predicted time stays within the cap (prefill_order.py)
                left = self._left(job, long, time_left, long_left)
                chunk = min(chunk, max(0 if batch else 1, chunk_within(self.p, left, before)))
                if chunk <= 0:
                    continue
                spent = chunk_s(self.p, chunk, before)
                time_left -= spent
                if job.request in long:
                    long_left -= spent
            A = chunk * before + chunk * (chunk + 1) / 2.0
            batch.append((job, chunk, A))
            budget -= chunk
            sum_uc += chunk
            sum_A += A
            sum_tc += before
        assert batch, "a prefill iteration needs an eligible request"
        noise = self._noise(self.p.prefill_noise)
        dur = self.p.prefill_iteration_s(sum_uc, sum_A, sum_rst) * noise
        carried = list(self.running.values()) if carry_decode else []
        dec_s = 0.0
        if carried:  # the per-request part of eq. 2; the fixed cost and expert reads are shared
            ctx = sum(j.context for j in carried)
            dec_s = (self.p.d2 * len(carried) + self.p.d_ctx * ctx) * noise
        total = dur + extra + dec_s
        self.busy = True
        self.busy_start = now
        self.last_was_decode = False
        self.busy_prefill_s += total
        self.gen += 1
        self.host.schedule(now + total, self._end_prefill_iteration, self.gen, batch,
                           (dur, sum_uc, sum_A, sum_rst, sum_tc), carried, dec_s)

    def _end_prefill_iteration(self, gen: int, batch, stats, carried=(), dec_s: float = 0.0) -> None:
        now = self.host.now
        self.busy = False
        self.busy_acc += now - self.busy_start
        dur, sum_uc, sum_A, sum_rst, sum_tc = stats
        self._emit(IterationDone(ts=now, src=self.id, node=self.id, phase="prefill", duration_s=dur,
                                 batch=len(batch), sum_t_uc=sum_uc, sum_A=sum_A, sum_t_rst=sum_rst,
                                 sum_t_c=sum_tc, queued=len(self.pqueue) - len(batch)))
        if carried:
            self._carried_decode_step(carried, dec_s)
        for job, chunk, _ in batch:
            if job.request in self.cancelling:
                continue  # no first token: _end_cancelled drops it
            job.done_uc += chunk
            if job.done_uc >= job.t_uc:
                self._dequeue(job)
                self._finish_prefill(job)
        self._end_cancelled()
        self._next()

    def _carried_decode_step(self, carried: list[DecodeJob], dec_s: float) -> None:
        """One decode iteration of the running requests that rode along a prefill iteration
        (``IterationDone(phase=decode)`` timing only their share of the mixed iteration)."""
        acc_total = 0.0
        finished = []
        ctx = sum(j.context for j in carried)  # what the step attended over (its timing's d_ctx term)
        for job in carried:
            acc = min(job.left, self.p.t_acc)
            job.left -= acc
            job.context += acc
            acc_total += acc
            if job.left <= 1e-9 or job.request in self.cancelling:
                finished.append(job)
        self._emit(IterationDone(ts=self.host.now, src=self.id, node=self.id, phase="decode", duration_s=dec_s,
                                 batch=len(carried), t_fwd=self.p.t_fwd, accepted_tokens=round(acc_total),
                                 sum_t_c=round(ctx), queued=len(self.dwaiting), iterations=1))
        for job in finished:
            self._finish_decode(job, "cancelled" if job.request in self.cancelling else "")

    def _finish_prefill(self, job: PrefillJob) -> None:
        now = self.host.now
        self.pool.store_through(job.blocks, job.blocks, job.request)  # L1, written through to L2
        self._emit(FirstToken(ts=now, src=self.id, request=job.request, node=self.id))
        out = job.output_tokens or job.max_tokens  # the live sim backend's drawn length, else the budget
        djob = DecodeJob(request=job.request, blocks=job.blocks, prompt_tokens=job.prompt_tokens,
                         left=float(max(0, out - 1)), total_out=max(1, out),
                         context=float(job.prompt_tokens + 1), src_node=self.id, max_tokens=job.max_tokens,
                         ignore_eos=job.ignore_eos, osl=job.osl, sampling=job.sampling)
        dst = self.host.peer(job.decode_node)
        if dst is None:
            dst = self
        if dst is self:
            self.host.schedule(now, self.kv_arrived, djob)
        else:
            self.host.schedule(now + self.p.p2d_transfer_s(job.prompt_tokens), dst.kv_arrived, djob)

    # ------------------------------------------------------------------ 5.-7. decode
    def kv_arrived(self, job: DecodeJob) -> None:
        self.dwaiting.append(job)
        self._cut_decode_run()
        self.kick()

    def _cut_decode_run(self) -> None:
        if self.busy and self.run_batch and not self.run_cut:
            self._cut_run()

    def _job_working_tokens(self, job: DecodeJob) -> int:
        return job.prompt_tokens - len(job.blocks) * self.bt + job.total_out

    def _admit(self) -> None:
        now = self.host.now
        while self.dwaiting and len(self.running) < self.p.max_running:
            job = self.dwaiting[0]
            work = self._job_working_tokens(job)
            new = self._missing(job.blocks, self.l1)
            if not self._make_room("L1", len(new), job.blocks, extra_tokens=work):
                if not self.running:  # it can never fit: serve it without caching its blocks
                    self.dwaiting.popleft()
                    self._start_decode_job(job, [], work)
                    continue
                break
            self.dwaiting.popleft()
            self._start_decode_job(job, new, work)
        del now

    def _start_decode_job(self, job: DecodeJob, new: list, work: int) -> None:
        now = self.host.now
        if new:
            self.pool.add("L1", new)
        if job.src_node != self.id:
            self._emit(KvMoved(ts=now, src=self.id, src_node=job.src_node, dst_node=self.id, blocks=new,
                               src_phase="prefill", dst_phase="decode", dst_tier="L1", request=job.request))
        elif new:
            self._emit(KvStored(ts=now, src=self.id, node=self.id, tier="L1", blocks=new, request=job.request))
        self.working_tokens += work
        self.running[job.request] = job
        self.pool.pin(("d", job.request), job.blocks)
        self._emit(RequestStarted(ts=now, src=self.id, request=job.request, node=self.id, phase="decode"))
        if job.left <= 0:
            self._finish_decode(job)

    def _start_decode_run(self) -> None:
        now = self.host.now
        B = len(self.running)
        ctx = int(sum(j.context for j in self.running.values()))
        it = self.p.decode_iteration_s(B, ctx) * self._noise(self.p.decode_noise)
        k = min(math.ceil(j.left / self.p.t_acc) for j in self.running.values())
        k = max(1, k)
        if self.role == "collocated" and any(True for _ in self.pqueue):
            k = min(k, max(1, int(COLLOCATED_DECODE_SLICE_S / it)))
        self.busy = True
        self.busy_start = now
        self.last_was_decode = True
        self.run_start_s, self.run_iter_s, self.run_iters, self.run_batch = now, it, k, B
        self.run_ctx = ctx
        self.run_cut = False
        self.gen += 1
        self.host.schedule(now + k * it, self._end_decode_run, self.gen)

    def _cut_run(self) -> None:
        """A request waits for admission: end the run at the next iteration boundary."""
        now = self.host.now
        done = int((now - self.run_start_s) / self.run_iter_s) + 1
        if done < self.run_iters:
            self.run_iters = done
            self.gen += 1
            self.host.schedule(self.run_start_s + done * self.run_iter_s, self._end_decode_run, self.gen)
        self.run_cut = True

    def _end_decode_run(self, gen: int) -> None:
        if gen != self.gen:
            return  # superseded by a cut
        now = self.host.now
        self.busy = False
        self.busy_acc += now - self.busy_start
        n = self.run_iters
        acc_total = 0
        finished = []
        for job in self.running.values():
            acc = min(job.left, n * self.p.t_acc)
            job.left -= acc
            job.context += acc
            acc_total += acc
            if job.left <= 1e-9 or job.request in self.cancelling:
                finished.append(job)
        self._emit(IterationDone(ts=now, src=self.id, node=self.id, phase="decode", duration_s=self.run_iter_s,
                                 batch=self.run_batch, t_fwd=self.p.t_fwd,
                                 accepted_tokens=round(acc_total / max(1, n)), sum_t_c=self.run_ctx,
                                 queued=len(self.dwaiting), iterations=n))
        self.run_batch = 0
        for job in finished:
            self._finish_decode(job, "cancelled" if job.request in self.cancelling else "")
        self._end_cancelled()
        self._next()

    def _finish_decode(self, job: DecodeJob, error: str = "") -> None:
        now = self.host.now
        self.cancelling.discard(job.request)
        del self.running[job.request]
        self.pool.unpin(("d", job.request))
        self.working_tokens -= self._job_working_tokens(job)
        blocks = job.blocks
        if self.output_kv is not None:  # +prestage: the output's KV stays too (module docstring, 8)
            out = self.output_kv(job.request, job.blocks)
            if out:
                blocks = list(job.blocks) + out
        self._store("L2", blocks, (), job.request)  # before the request is forgotten
        produced = job.total_out - round(job.left) if error else job.total_out
        self._emit(RequestFinished(ts=now, src=self.id, request=job.request, node=self.id,
                                   output_tokens=produced, error=error))
        if self.status == "draining":
            self.drained += 1

    # ------------------------------------------------------------------ 8. stage orders
    def stage_in(self, order: KvStageOrdered, src: SimNode, blocks: Sequence[BlockHash]) -> None:
        """Carry out a stage order addressed to this node (module docstring, 8): pull, over
        this node's fetch link (behind the requests' fetches), the run of ``blocks`` (a
        finished turn's prompt + output) that this node or ``src``'s host tier holds, the
        blocks this node lacks. They land in ``order.tier`` at the end of the transfer."""
        if src is self or src.status == "down" or self.status == "down":
            return
        mine_1, mine_2, theirs = self.l1, self.l2, src.l2
        want = []
        for b in blocks:
            if b in mine_1 or b in mine_2:
                continue
            if b not in theirs:
                break  # the run stops at the first block neither holds: later ones are no prefix
            want.append(b)
        if not want:
            return
        now = self.host.now
        start = max(now, self.fetch_link_free_s, self.stage_link_free_s)
        dur = self.p.fetch_s(len(want) * self.bt)
        self.stage_link_free_s = start + dur
        self.host.schedule(start + dur, self._stage_done, order, src, want, self.stage_shift)

    def _stage_done(self, order: KvStageOrdered, src: SimNode, want: list, shift: float) -> None:
        if self.stage_shift > shift:  # requests' fetches went ahead meanwhile: it lands later
            self.host.schedule(self.host.now + (self.stage_shift - shift), self._stage_done, order, src, want,
                               self.stage_shift)
            return
        tier = order.tier
        store, other = (self.l2, self.l1) if tier == "L2" else (self.l1, self.l2)
        # what the source still holds (it may have evicted meanwhile: the read would have failed)
        # and this node still lacks
        got = [b for b in want if b in src.l2 and b not in store and b not in other]
        if not got or self.status == "down" or not self._make_room(tier, len(got)):
            return
        self.pool.add(tier, got)
        self.staged_tokens += len(got) * self.bt
        self._emit(KvMoved(ts=self.host.now, src=self.id, src_node=src.id, dst_node=self.id, blocks=got,
                           src_phase="decode", dst_phase="prefill", dst_tier=tier, branch=order.branch))

    # ------------------------------------------------------------------ role switch
    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        if self.status in ("switching", "down"):
            return
        if to_role == self.role and self.status == "up":
            self._emit(RoleSwitched(ts=self.host.now, src=self.id, node=self.id, role=self.role))
            return
        self.status = "draining"
        self.switch_to = to_role
        self.switch_mech = mechanism
        self.switch_ordered_s = self.host.now
        self.drained = 0
        if self._mixes_decode_into_prefill() and any(j.ready_s <= self.host.now for j in self.pqueue):
            self._cut_decode_run()
        self.kick()

    def _leaving(self) -> tuple[bool, bool]:
        """(leaves prefill, leaves decode) for the ordered switch."""
        to = self.switch_to
        keeps_p = to in ("prefill", "collocated")
        keeps_d = to in ("decode", "collocated")
        return (self.does_prefill() and not keeps_p, self.does_decode() and not keeps_d)

    def _maybe_finish_drain(self) -> None:
        if self.status != "draining" or self.busy:
            return
        lp, ld = self._leaving()
        if lp and self.pqueue:
            return
        if ld and (self.running or self.dwaiting):
            return
        self.status = "switching"
        if self.switch_mech == "restart":
            self.drop_all_kv()
            delay = self.p.restart_s
        elif self.switch_mech == "in_place_drop_kv":
            self.drop_all_kv()
            delay = self.p.switch_in_place_s
        else:
            delay = self.p.switch_in_place_s
        self.host.schedule(self.host.now + delay, self._switch_done)

    def _switch_done(self) -> None:
        now = self.host.now
        self.role = self.switch_to or self.role
        self.status = "up"
        self._emit(RoleSwitched(ts=now, src=self.id, node=self.id, role=self.role, drained=self.drained,
                                duration_s=now - self.switch_ordered_s,
                                kv_dropped=self.switch_mech != "in_place"))
        self.switch_to = None
        self.kick()
