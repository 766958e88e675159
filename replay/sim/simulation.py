"""Discrete-event cluster simulator: agent sessions served by simulated nodes, decided by the
same pure cores as the live services (directory, planner, router, eviction policy).

Deterministic for a seed: a virtual clock, a heap ordered by ``(time, sequence, kind)`` and
per-node numpy generators seeded from the run seed. No wall clock, no global randomness.

The event loop (docs/simulator.md has the full picture)
1. One ordered log, seq 1..n, exactly as the stream would hold it. ``emit(e)`` appends ``e``,
   folds it through every core in order (directory, planner, router), lets the simulator react
   to it (non-shadow ``RouteDecided`` -> enqueue on a node, ``SwitchRole`` -> the node drains
   and switches, ``RequestFinished`` -> the session's next step), then emits each core output
   in turn (depth-first: the directory is current whenever a node asks it something).
2. Reactions never run node work re-entrantly: a node only queues and schedules a "kick" at
   the current time; the heap runs it after the current event.
3. A ``Tick`` every ``tick_s`` of simulated time (planner windows close on ticks).
4. Sessions are a closed-loop pool: ``agents`` sessions run at a time; each finished session is
   replaced by the next of the pool (cycled, with fresh ids). ``arrivals_per_min`` instead
   starts sessions at Poisson times (open arrivals).
5. The profile's coefficients reach only the nodes; cores learn from ``IterationDone``.
6. One directory, not two (``SimConfig.share_directory``, on by default). The directory core
   and the router's embedded ``DirectoryCore`` fold the same events; the router only ever asks
   its copy ``lookup``, whose answer depends only on which node holds which block in which tier
   (``KvStored``/``KvEvicted``/``KvMoved``/``KvFetched``, a dropping switch, node
   (de)registration). Those facts reach both copies at the same place of the log; the copies
   differ only in *when* they fold ``RequestSubmitted`` (the router: after its lookup) and the
   router's own ``RouteDecided`` (the router: at decision time, not at the echo), and neither
   event changes where blocks are held. So the router's lookups are answered by the directory
   core itself (:class:`_RouterDirectory`): every decision, every event and every anomaly is
   the one the two-copy run makes (tests/replay/test_golden_log.py, tests/unit/replay/sim), for half
   the directory work. The directory core folds a submission inside the router's fold, right
   after the router's lookup (as the router's copy did), so it reuses that lookup's scan; its
   outputs keep their place (before the planner's and the router's).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.backends.sim.node import PrefillJob, SimNode
from engine.profiles import Profile
from events.catalog import (
    Event,
    KvStageOrdered,
    NodeRegistered,
    RequestFinished,
    RequestSubmitted,
    RouteDecided,
    SwitchRole,
    Tick,
)
from events.ids import NodeId, Role
from replay.sim.nextturn import SPEC_SUFFIX, output_blocks
from replay.sim.sessions import SessionSource, _salt_blocks  # noqa: F401  (re-exported: the simulation's source)
from replay.traces.format import Session, SessionCursor, reblock
from services.cores.directory.core import DirectoryCore

# kinds: only a tie-break after (time, seq); documented for the heap order.
K_CALL = 0


class EventQueue:
    """The virtual clock: a heap of ``(time, seq, kind, fn, args)``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.processed = 0

    def schedule(self, t: float, fn: Callable, *args) -> None:
        assert t >= self.now - 1e-9, f"event in the past: {t} < {self.now}"
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), K_CALL, fn, args))

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def step(self) -> bool:
        if not self._heap:
            return False
        t, _, _, fn, args = heapq.heappop(self._heap)
        self.now = t
        self.processed += 1
        fn(*args)
        return True


@dataclass
class SimConfig:
    nodes: int = 9
    duration_s: float = 3600.0  # measured part, after the warm-up
    warmup_s: float = 1800.0
    seed: int = 0
    agents: int | None = 126
    arrivals_per_min: float | None = None
    tick_s: float = 1.0
    stagger_s: float = 60.0  # closed loop: agents' first sessions start uniformly over this
    max_events: int | None = None  # safety valve for tests
    # Run the directory as its own core (it reports AnomalyReported into the log). Off, the
    # eviction policy reads the DirectoryCore embedded in the router: same class, same events,
    # half the directory work (the directory dominates the simulator's cost).
    directory_core: bool = True
    # the nodes' ids (default n00, n01, ...): a partition of a larger cluster keeps the global ids
    node_ids: tuple[str, ...] | None = None
    # With ``directory_core``: the router's lookups are answered by the directory core instead of
    # a second DirectoryCore folding the same events (module docstring, point 6). Same log; off
    # is the previous two-copy path, kept as the speed baseline (`evolving bench sim`).
    share_directory: bool = True
    # Closed loop only. False: every session of the source runs once, ``agents`` at a time, and the
    # run ends when the last one has finished (a trace ends the run, as a peer's trace replay does:
    # Dynamo's ``replay_concurrency``); True: a finished agent is replaced, the pool cycled (re-salted).
    refill: bool = True

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s


@dataclass
class RunResult:
    stack: str
    config: SimConfig
    log: list[Event]  # every event, in order: empty unless the run kept its log (``keep_log``)
    submitted: int
    finished: int
    unfinished: list[str]
    nodes: list[SimNode]
    anomalies: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the run (set by the driver, like wall_s)
    log_stats: dict = field(default_factory=dict)  # the event log writer's figures (replay/sim/simlog.py)
    events: int = 0  # events emitted (the log's length, kept or not)


class Simulation:
    """One run of one stack on one workload (see the module docstring)."""

    def __init__(self, profile: Profile, stack, sessions: Sequence[Session] | SessionSource, config: SimConfig,
                 record: Callable[[int, Event], None] | None = None, keep_log: bool = True,
                 observe: Callable[[Event], None] | None = None) -> None:
        self.source = sessions if isinstance(sessions, SessionSource) else SessionSource(list(sessions))
        self.p = profile
        self.stack = stack
        self.cfg = config
        self.q = EventQueue()
        self.bind_source_clock()
        self.rng = np.random.default_rng(config.seed)
        self.log: list[Event] = []
        self.keep_log = keep_log
        self.seq = 0
        self.record = record
        self.observe = observe  # e.g. the run's metrics folded as it goes (replay/sim/runs.py)
        ids = ([NodeId(x) for x in config.node_ids] if config.node_ids
               else [NodeId(f"n{i:02d}") for i in range(config.nodes)])
        roles = stack.initial_roles(config.nodes)
        seeds = np.random.SeedSequence(config.seed).spawn(config.nodes)
        self.nodes: dict[NodeId, SimNode] = {
            nid: SimNode(nid, roles[i], profile, self, int(seeds[i].generate_state(1)[0]), stack.fetch_mode)
            for i, nid in enumerate(ids)
        }
        for node in self.nodes.values():
            node.prefill_order = getattr(stack, "prefill_order", "fcfs")
        directory, planner, router = stack.make_cores(profile, config)
        self._shared: _RouterDirectory | None = None
        if config.directory_core:
            self.cores = [directory, planner, router]
            self.directory = directory
            if config.share_directory and type(getattr(router, "directory", None)) is DirectoryCore \
                    and type(directory) is DirectoryCore:
                self._shared = router.directory = _RouterDirectory(directory)
        else:  # eviction reads the router's embedded DirectoryCore (same class, same events)
            self.cores = [planner, router]
            self.directory = router.directory
        self.policy = stack.make_eviction(profile)
        # the data plane plans peer fetches when the router does not (every baseline router)
        self.plan_fetch = stack.fetch_mode != "none" and not stack.plans_fetch
        self.requests: dict[str, RequestSubmitted] = {}
        self.where: dict[str, NodeId] = {}  # queued request -> prefill node
        self.cursors: dict[str, SessionCursor] = {}  # request -> its session's cursor
        self.active_sessions = 0
        self._next_session = 0
        self.submitted = 0
        self.finished = 0
        self.finished_ids: set[str] = set()
        self.stopped = False
        self.progress: Callable[[float, Simulation], None] | None = None
        # (docs/simulator.md, "The next turn's KV"): with ``+prestage`` a decode
        # node keeps a finished turn's output KV (``output_kv``) and the router's stage orders
        # move prompt + output; with ``+specprefill`` the frontend sends the speculative prefill
        self.prestage = bool(getattr(stack, "prestage", False))
        self.specprefill = bool(getattr(stack, "specprefill", False))
        self._turn_kv: dict[str, list[int]] = {}  # the request just finished -> prompt + output blocks
        if self.prestage:
            for node in self.nodes.values():
                node.output_kv = self.output_kv

    def bind_source_clock(self) -> None:
        """A session source whose sessions depend on when they start (a shifting composition,
        replay/experiments/run.py) reads the simulated clock; other sources are untouched."""
        if hasattr(self.source, "bind_clock"):
            self.source.bind_clock(lambda: self.q.now)

    # ------------------------------------------------------------------ NodeHost
    @property
    def now(self) -> float:
        return self.q.now

    def schedule(self, t: float, fn, *args) -> None:
        self.q.schedule(t, fn, *args)

    def peer(self, node: NodeId) -> SimNode | None:
        return self.nodes.get(node)

    def choose_eviction(self, node: NodeId, tier, tokens: int, pinned: frozenset) -> list:
        return self.policy.choose(self.directory, node, tier, tokens, pinned)

    def emit(self, e: Event) -> None:
        self.seq += 1
        if self.keep_log:
            self.log.append(e)
        if self.record is not None:
            self.record(self.seq, e)
        if self.observe is not None:
            self.observe(e)
        if self._shared is not None and type(e) is RequestSubmitted:
            outs = self._apply_submission(e)
        else:
            outs = []
            for core in self.cores:
                outs.extend(core.apply(e))
        self._react(e)
        for o in outs:
            self.emit(o)

    def _apply_submission(self, e: RequestSubmitted) -> list[Event]:
        """A submission with one shared directory (module docstring, point 6): the directory
        core folds it where the router's copy did, inside the router's fold after its lookup;
        its outputs stay first, as if it had folded it before the planner and the router."""
        shared = self._shared
        shared.pending, shared.outs = e, []
        rest: list[Event] = []
        try:
            for core in self.cores[1:]:
                rest.extend(core.apply(e))
        finally:
            if shared.pending is e:  # the router did not fold it: fold it now
                shared.pending = None
                shared.outs = self.directory.apply(e)
        outs, shared.outs = shared.outs, []
        outs.extend(rest)
        return outs

    # ------------------------------------------------------------------ reactions
    def _react(self, e: Event) -> None:
        t = type(e)
        if t is RouteDecided:
            if e.shadow:
                return
            self._route(e)
        elif t is SwitchRole:
            node = self.nodes.get(e.node)
            if node is not None:
                node.order_switch(e.to_role, e.mechanism)
        elif t is RequestSubmitted:
            self.requests[e.request] = e
            self.submitted += 1
        elif t is RequestFinished:
            self._finished(e)
        elif t is KvStageOrdered:
            self._stage(e)

    def _route(self, e: RouteDecided) -> None:
        req = self.requests.get(e.request)
        if req is None or e.request in self.finished_ids:
            return
        old = self.where.get(e.request)
        job = None
        if old is not None:
            job = self.nodes[old].remove_queued(e.request)
            if job is None:
                return  # already started there: a late reroute changes nothing
        node = self.nodes.get(e.prefill_node)
        if node is None:
            return
        plan = e.fetch_plan
        if self.plan_fetch and not plan:  # the data plane's own plan: the directory's lookup
            plan = self.directory.lookup(req.blocks).fetch_plan(e.prefill_node)
        if job is None:
            job = PrefillJob(request=e.request, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                             max_tokens=req.max_tokens, decode_node=e.decode_node,
                             fetch_plan=plan, enqueued_s=self.now, priority=req.queue_priority())
        else:
            job.decode_node, job.fetch_plan, job.fetched, job.fetch_s = e.decode_node, plan, [], 0.0
        self.where[e.request] = e.prefill_node
        node.enqueue_prefill(job)

    def _finished(self, e: RequestFinished) -> None:
        rid = e.request
        assert rid not in self.finished_ids, f"request {rid} finished twice"
        self.finished_ids.add(rid)
        self.finished += 1
        self.where.pop(rid, None)
        req = self.requests.pop(rid, None)
        cur = self.cursors.pop(rid, None)
        if cur is None:
            return
        if self.specprefill and req is not None and not e.error:
            self._speculative_prefill(cur, req, e)
        self._take(cur, cur.on_finished(rid, self.now))

    # ------------------------------------------------------------------ the next turn's KV
    def output_kv(self, request: str, prompt_blocks: list[int]) -> list[int]:
        """The output's full blocks of a finishing request (``+prestage``: its decode node
        keeps them), recorded with the prompt's for the stage order that may follow."""
        req = self.requests.get(request)
        cur = self.cursors.get(request)
        out: list[int] = []
        if req is not None and cur is not None:
            out = output_blocks(cur, request, prompt_blocks, req.prompt_tokens, req.max_tokens, self.p.block_tokens)
        self._turn_kv = {request: list(prompt_blocks) + out}
        return out

    def _stage(self, order: KvStageOrdered) -> None:
        """A stage order (the router's, right after the turn's ``RequestFinished``): the
        destination pulls the KV over its fetch link (engine/backends/sim/node.py ``stage_in``)."""
        blocks = self._turn_kv.pop(order.request, None)
        dst, src = self.nodes.get(order.dst_node), self.nodes.get(order.src_node)
        if blocks and dst is not None and src is not None:
            dst.stage_in(order, src, blocks)

    def _speculative_prefill(self, cur: SessionCursor, req: RequestSubmitted, e: RequestFinished) -> None:
        """Dynamo's speculative next-turn prefill: the frontend sends the predicted next prompt
        (prompt + the output the next prompt keeps) as a ``max_tokens=1`` request, routed like any
        other, so its KV is cached where the router sends it (docs/simulator.md)."""
        bt = self.p.block_tokens
        blocks = list(req.blocks) + output_blocks(cur, req.request, req.blocks, req.prompt_tokens, e.output_tokens, bt)
        spec = RequestSubmitted(ts=self.now, src="frontend", request=f"{req.request}{SPEC_SUFFIX}", branch=req.branch,
                                version=req.version, blocks=blocks, prompt_tokens=req.prompt_tokens + e.output_tokens,
                                max_tokens=1, block_tokens=req.block_tokens)
        self.q.schedule(self.now, self._harness, spec)

    # ------------------------------------------------------------------ sessions
    def _take(self, cur: SessionCursor, events: Iterable[Event]) -> None:
        for ev in events:
            if isinstance(ev, RequestSubmitted):
                self.cursors[ev.request] = cur
            self.q.schedule(ev.ts, self._harness, ev)
        if cur.done:
            self._session_done()

    def _harness(self, ev: Event) -> None:
        if self.stopped:
            return
        self.emit(ev)

    def _start_session(self) -> None:
        if self.stopped or (not self.cfg.refill and self._next_session >= self._pool_size()):
            return
        k = self._next_session
        self._next_session += 1
        s = reblock(self.source.get(k), self.p.block_tokens)  # charge the trace's own block size
        cur = SessionCursor(s, prefix=f"{self.source.label(k)}:")
        self.active_sessions += 1
        self._take(cur, cur.start(self.now))

    def _session_done(self) -> None:
        self.active_sessions -= 1
        if self.cfg.arrivals_per_min is None and (self.cfg.refill or self._next_session < self._pool_size()):
            self.q.schedule(self.now, self._start_session)

    def _pool_size(self) -> int:
        """Sessions a run without refill plays (a generated source has no end: ``agents``)."""
        return len(self.source.sessions) if self.source.make is None else int(self.cfg.agents or 1)

    def _trace_ended(self) -> bool:
        return not self.cfg.refill and self.active_sessions == 0 and self._next_session >= self._pool_size()

    def _arrival(self) -> None:
        self._start_session()
        gap = float(self.rng.exponential(60.0 / self.cfg.arrivals_per_min))
        if self.now + gap < self.cfg.end_s:
            self.q.schedule(self.now + gap, self._arrival)

    def _tick(self) -> None:
        self.emit(Tick(ts=self.now, src="sim"))
        if self.progress is not None:
            self.progress(self.now, self)
        nxt = self.now + self.cfg.tick_s
        if nxt <= self.cfg.end_s:
            self.q.schedule(nxt, self._tick)

    # ------------------------------------------------------------------ run
    def start(self) -> None:
        p = self.p
        for nid, node in self.nodes.items():
            self.emit(NodeRegistered(ts=0.0, src=nid, node=nid, role=node.role, gpus=p.gpus_per_node,
                                     l1_capacity_tokens=p.l1_capacity_tokens,
                                     l2_capacity_tokens=p.l2_capacity_tokens,
                                     prefill_token_budget=p.prefill_token_budget,
                                     max_running_requests=p.max_running, t_fwd=p.t_fwd, profile=p.name))
        self.q.schedule(0.0, self._tick)
        if self.cfg.arrivals_per_min:
            self.q.schedule(0.0, self._arrival)
        else:
            n = int(self.cfg.agents or 1)
            if not self.cfg.refill:
                n = min(n, self._pool_size())
            starts = np.sort(self.rng.uniform(0.0, self.cfg.stagger_s, size=n)) if n > 1 else [0.0]
            for t in starts:
                self.q.schedule(float(t), self._start_session)

    def run(self) -> RunResult:
        self.start()
        end = self.cfg.end_s
        limit = self.cfg.max_events
        while self.q.peek_time() <= end:
            self.q.step()
            if limit is not None and self.q.processed >= limit:
                break
            if not self.cfg.refill and self._trace_ended():
                break
        self.stopped = True
        unfinished = sorted(self.requests)  # submitted, not finished
        anomalies = self.directory.anomalies() if self.cfg.directory_core else {}
        return RunResult(stack=self.stack.name, config=self.cfg, log=self.log, submitted=self.submitted,
                         finished=self.finished, unfinished=unfinished, nodes=list(self.nodes.values()),
                         anomalies=anomalies, events=self.seq)


class _RouterDirectory:
    """The router's directory when the simulator shares its directory core (module docstring,
    point 6): lookups go to the directory core; folds are the simulator's, except the
    submission being emitted, which the directory core folds when the router does."""

    __slots__ = ("core", "outs", "pending")

    def __init__(self, core: DirectoryCore) -> None:
        self.core = core
        self.pending: RequestSubmitted | None = None
        self.outs: list[Event] = []

    def lookup(self, blocks, branch=None):
        return self.core.lookup(blocks, branch)

    def apply(self, event: Event) -> list[Event]:
        if event is self.pending:
            self.pending = None
            self.outs = self.core.apply(event)
        return []  # the router drops its directory's anomalies; the core's are emitted

    def anomalies(self) -> dict[str, int]:
        return self.core.anomalies()

    def snapshot(self) -> bytes:
        return self.core.snapshot()


def node_roles(prefill: int, decode: int, nodes: int) -> list[Role]:
    if prefill + decode != nodes:
        raise ValueError(f"split {prefill}P{decode}D does not add up to {nodes} nodes")
    return ["prefill"] * prefill + ["decode"] * decode
