"""The engine worker: one process per node, the sim node model run in wall-clock time on the bus.

``python -m engine.worker --node n1 --role collocated --profile gb300-glm52 --nats-url URL``

What it does (the numbers are the order of a request's life on this node)
1. Start: fold the partition's stream from sequence 1 into its own ``DirectoryCore`` (other
   nodes' KV for fetch plans, active-branch counts for eviction), without acting on it. If the
   directory still believes this node is alive (an earlier run of the same id), publish
   ``NodeRemoved(reason="restarted")`` first: that run's KV is gone. Then ``NodeRegistered``.
2. From the head on, act on the stream: a non-shadow ``RouteDecided`` with ``prefill_node`` =
   this node enqueues a prefill job (``RequestSubmitted`` gave its blocks and lengths); a
   reroute away from this node takes the queued job off; ``SwitchRole`` on
   ``ei.<p>.cmd.<node>`` drains and switches in place (``SimNode.order_switch``; the node
   acknowledges with ``RoleSwitched``).
3. Prefill -> decode across processes: the node model hands the KV to its decode node in
   process (``NodeHost.peer(...).kv_arrived``). Here a remote peer is a proxy whose
   ``kv_arrived`` does nothing; the *decode* worker instead watches the stream for the
   ``FirstToken`` of a request routed to it and admits the request ``p2d_transfer_s`` later.
4. Every event the node emits (KV facts, ``IterationDone``, ``RequestStarted``, ``FirstToken``,
   ``RequestFinished``, ``RoleSwitched``) is applied to the local directory at once and
   published in order; its echo from the stream (same ``src``, after the start head) is
   skipped, so eviction sees this node's own KV without waiting for the round trip.
5. Tokens go to the gateway on core NATS (``services.gateway.tokens``): ``first`` from the
   prefill node, ``chunk`` messages from the decode node (after each decode run and every
   ``--token-interval-s`` while a run is going, estimated from the run's iteration time),
   ``done`` on ``RequestFinished``. The sim generates no text: ``"tok "`` per token.
6. ``NodeHeartbeat`` every ``--heartbeat-s`` (1 s). SIGTERM/SIGINT: ``NodeRemoved(reason=
   "shutdown")``, flush, exit 0.

Time: the node model's clock is ``epoch + (wall - epoch) * time_scale`` (seconds), the clock
the planner's ticker and the gateway use with the same ``--clock-epoch`` (default: the
worker's start), so ``--time-scale 1`` is real time and ``10`` runs the model ten times faster
than the wall clock (tests); event ``ts`` are model time. A scheduled callback runs with ``now`` = its own due time
even when the loop is late, so the model's timeline is exactly what it planned.

``--backend sglang`` is the GPU target and is not implemented yet: it exits with code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import math
import os
import signal
import sys
import time
from collections.abc import Callable

from engine.profiles import Profile, load_profile
from engine.simnode import DecodeJob, PrefillJob, SimNode
from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestSubmitted,
    RouteDecided,
    SwitchRole,
)
from events.ids import NodeId, Role
from events.wire import TokenMsg, sim_text
from services.directory.core import DirectoryCore
from services.directory.eviction import POLICIES
from services.logging import get_logger

log = get_logger("worker")
ROLES = ("collocated", "prefill", "decode")


class _TierView:
    """``block in view``: does ``node`` hold ``block`` in ``tier``, per the local directory."""

    def __init__(self, directory: DirectoryCore, node: str, tier: str) -> None:
        self.d, self.node, self.tier = directory, node, tier

    def __contains__(self, block: object) -> bool:
        return block in self.d.copies(self.node, self.tier)


class RemotePeer:
    """Another node as the node model sees it: its KV from the directory, its decode admission
    done by its own worker (so ``kv_arrived`` is a no-op here)."""

    def __init__(self, node: str, directory: DirectoryCore) -> None:
        self.id = node
        self.d = directory
        self.l1 = _TierView(directory, node, "L1")
        self.l2 = _TierView(directory, node, "L2")

    @property
    def status(self) -> str:
        return "up" if self.id in self.d.nodes() else "down"

    def kv_arrived(self, job: DecodeJob) -> None:
        pass


class WallClockHost:
    """``NodeHost`` over an asyncio loop: a heap of due callbacks run at their model time."""

    def __init__(self, time_scale: float, emit: Callable[[Event], None], choose, peer,
                 epoch: float | None = None, monotonic: Callable[[], float] = time.monotonic) -> None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {time_scale}")
        self.scale = time_scale
        self._mono = monotonic
        self._m0 = monotonic()
        self._t0 = time.time() if epoch is None else epoch
        self.now = self._t0
        self._heap: list = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._emit, self._choose, self._peer = emit, choose, peer

    def clock(self) -> float:
        """Model time now (not ``now``: that is the time of the callback being run)."""
        return self._t0 + (self._mono() - self._m0) * self.scale

    def catch_up(self) -> float:
        """Advance ``now`` to the clock for an input from outside (never backwards)."""
        self.now = max(self.now, self.clock())
        return self.now

    # NodeHost
    def emit(self, event: Event) -> None:
        self._emit(event)

    def schedule(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))
        self._wake.set()

    def choose_eviction(self, node, tier, tokens, pinned):
        return self._choose(node, tier, tokens, pinned)

    def peer(self, node):
        return self._peer(node)

    def run_due(self) -> int:
        """Run every callback due by the clock; returns how many ran."""
        n = 0
        while self._heap and self._heap[0][0] <= self.clock():
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            fn(*args)
            n += 1
        return n

    async def run(self) -> None:
        while True:
            self.run_due()
            self._wake.clear()
            delay = None
            if self._heap:
                delay = max(0.0, (self._heap[0][0] - self.clock()) / self.scale)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)


class EngineWorker:
    """One node: the sim node model, its directory, the bus and the token channel."""

    def __init__(self, bus, tokens, node: str, role: Role, profile: Profile, *, seed: int = 0,
                 time_scale: float = 1.0, fetch_mode: str = "async", eviction: str = "count_aware",
                 heartbeat_s: float = 1.0, token_interval_s: float = 0.2, clock_epoch: float | None = None,
                 epoch: float | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.bus, self.tokens = bus, tokens
        self.node_id = NodeId(node)
        self.src = node
        self.profile = profile
        self.directory = DirectoryCore()
        self.policy = POLICIES[eviction](profile.block_tokens)
        if epoch is None and clock_epoch is not None:  # the clock every process of a run shares
            epoch = clock_epoch + (time.time() - clock_epoch) * time_scale
        self.host = WallClockHost(time_scale, self._on_emit, self._choose, self._peer, epoch=epoch)
        self.node = SimNode(self.node_id, role, profile, self.host, seed, fetch_mode)
        self.heartbeat_s, self.token_interval_s = heartbeat_s, token_interval_s
        self._out: asyncio.Queue = asyncio.Queue()
        self._requests: dict[str, RequestSubmitted] = {}
        self._decode_for: dict[str, str] = {}  # request -> prefill node, for requests we decode
        self._queued_here: set[str] = set()
        self._reported: dict[str, int] = {}  # request -> tokens sent to the gateway
        self._head = 0
        self._tasks: list[asyncio.Task] = []
        self.live = asyncio.Event()
        self.published = 0

    # ------------------------------------------------------------------ NodeHost callbacks
    def _on_emit(self, event: Event) -> None:
        self.directory.apply(event)
        self._out.put_nowait(event)
        self._tokens_for(event)

    def _choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.directory, node, tier, tokens, pinned)

    def _peer(self, node):
        if node == self.node_id:
            return self.node
        return RemotePeer(node, self.directory)

    def _publish_own(self, event: Event) -> None:
        self.directory.apply(event)
        self._out.put_nowait(event)

    # ------------------------------------------------------------------ tokens
    def _token(self, **kw) -> None:
        self._out.put_nowait(TokenMsg(node=self.node_id, ts=self.host.now, simulated=True, **kw))

    def _tokens_for(self, e: Event) -> None:
        t = type(e)
        if t is FirstToken:
            self._queued_here.discard(e.request)  # prefill done: no longer movable by a reroute
            self._token(request=e.request, kind="first", tokens=1, total=1, text=sim_text(1))
        elif t is IterationDone and e.phase == "decode":
            for job in self.node.running.values():
                self._chunk(job, int(job.total_out - job.left + 1e-9))
        elif t is RequestFinished:
            sent = self._reported.pop(e.request, 1)
            rest = max(0, e.output_tokens - sent)
            self._token(request=e.request, kind="done", tokens=rest, total=e.output_tokens,
                        text=sim_text(rest), finish_reason="length")
            self._requests.pop(e.request, None)
            self._decode_for.pop(e.request, None)

    def _chunk(self, job: DecodeJob, produced: int) -> None:
        sent = self._reported.get(job.request, 1)
        produced = min(produced, job.total_out)
        if produced > sent:
            self._reported[job.request] = produced
            self._token(request=job.request, kind="chunk", tokens=produced - sent, total=produced,
                        text=sim_text(produced - sent))

    def progress(self) -> None:
        """Chunks for the decode run in progress, estimated from its iteration time (never more
        than the run will have produced at its end)."""
        n = self.node
        if not (n.busy and n.run_batch and n.run_iter_s > 0):
            return
        done = min(n.run_iters, int((self.host.clock() - n.run_start_s) / n.run_iter_s))
        for job in n.running.values():
            est = job.total_out - job.left + min(job.left, done * self.profile.t_acc)
            self._chunk(job, int(est + 1e-9))

    # ------------------------------------------------------------------ stream input
    def fold(self, seq: int, event: Event) -> None:
        """One delivery from the stream (in order). Before the start head: directory only."""
        own_echo = seq > self._head and getattr(event, "src", None) == self.src
        if not own_echo:
            self.directory.apply(event)
        t = type(event)
        if t is RequestSubmitted:  # also before the head: a request in flight may be routed later
            self._requests[event.request] = event
            return
        if t is RequestFinished and event.node != self.node_id:
            self._requests.pop(event.request, None)
        if seq <= self._head:
            return
        if t is RouteDecided and not event.shadow:
            self._on_route(event)
        elif t is SwitchRole and event.node == self.node_id:
            self.host.catch_up()
            log.info("switch_ordered", node=self.node_id, to_role=event.to_role, mechanism=event.mechanism)
            self.node.order_switch(event.to_role, event.mechanism)
        elif t is FirstToken and event.node != self.node_id and event.request in self._decode_for:
            self._admit_decode(event.request)

    def _on_route(self, e: RouteDecided) -> None:
        rid = e.request
        if e.decode_node == self.node_id and e.prefill_node != self.node_id:
            self._decode_for[rid] = e.prefill_node
        else:
            self._decode_for.pop(rid, None)
        if rid in self._queued_here and e.prefill_node != self.node_id:
            self.host.catch_up()
            if self.node.remove_queued(rid) is not None:
                self._queued_here.discard(rid)
            return
        if e.prefill_node != self.node_id:
            return
        req = self._requests.get(rid)
        if req is None:
            log.warning("route_without_request", request=rid)
            return
        now = self.host.catch_up()
        old = self.node.remove_queued(rid) if rid in self._queued_here else None
        job = old or PrefillJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                                max_tokens=req.max_tokens, decode_node=e.decode_node,
                                fetch_plan=e.fetch_plan, enqueued_s=now)
        if old is not None:
            job.decode_node, job.fetch_plan, job.fetched, job.fetch_s = e.decode_node, e.fetch_plan, [], 0.0
        self._queued_here.add(rid)
        self.node.enqueue_prefill(job)

    def _admit_decode(self, rid: str) -> None:
        req = self._requests.get(rid)
        src = self._decode_for.get(rid)
        if req is None or src is None:
            return
        now = self.host.catch_up()
        job = DecodeJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                        left=float(max(0, req.max_tokens - 1)), total_out=max(1, req.max_tokens),
                        context=float(req.prompt_tokens + 1), src_node=NodeId(src))
        self.host.schedule(now + self.profile.p2d_transfer_s(req.prompt_tokens), self.node.kv_arrived, job)

    # ------------------------------------------------------------------ tasks
    async def _publisher(self) -> None:
        while True:
            item = await self._out.get()
            try:
                if isinstance(item, TokenMsg):
                    await self.tokens.publish(item)
                else:
                    await self.bus.publish(item)
                    self.published += 1
            except Exception as exc:  # noqa: BLE001 - a lost publication is logged, the node goes on
                log.error("publish_failed", node=self.node_id, item=type(item).__name__, error=str(exc))
            finally:
                self._out.task_done()

    async def _consume(self, caught_up: asyncio.Event) -> None:
        if self._head == 0:
            caught_up.set()
        async with self.bus.consumer(None, start_seq=1) as c:
            async for d in c:
                try:
                    self.fold(d.seq, d.event)
                except Exception as exc:  # noqa: BLE001 - bad input never kills the node
                    log.error("fold_failed", node=self.node_id, seq=d.seq, event=type(d.event).__name__,
                              error=repr(exc))
                if d.seq >= self._head:
                    caught_up.set()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._publish_own(self.heartbeat())

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.token_interval_s)
            self.progress()

    def heartbeat(self) -> NodeHeartbeat:
        n = self.node
        return NodeHeartbeat(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=n.role,
                             running=len(n.running), queued=len(n.pqueue) + len(n.dwaiting),
                             l1_used_tokens=len(n.l1) * n.bt, l2_used_tokens=len(n.l2) * n.bt)

    def registration(self) -> NodeRegistered:
        p = self.profile
        return NodeRegistered(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=self.node.role,
                              gpus=p.gpus_per_node, l1_capacity_tokens=p.l1_capacity_tokens,
                              l2_capacity_tokens=p.l2_capacity_tokens,
                              prefill_token_budget=p.prefill_token_budget, max_running_requests=p.max_running,
                              t_fwd=p.t_fwd, profile=p.name)

    async def start(self) -> None:
        """Catch up with the stream, register, and start serving."""
        self._head = await self.bus.last_seq()
        caught_up = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._publisher(), name="publisher"))
        self._tasks.append(asyncio.create_task(self._consume(caught_up), name="consumer"))
        await caught_up.wait()
        if self.node_id in self.directory.nodes():
            self._publish_own(NodeRemoved(ts=self.host.catch_up(), src=self.src, node=self.node_id,
                                          reason="restarted"))
        self._publish_own(self.registration())
        self._tasks.append(asyncio.create_task(self.host.run(), name="node"))
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self._progress(), name="progress"))
        await self._out.join()
        self.live.set()
        log.info("worker_up", node=self.node_id, role=self.node.role, profile=self.profile.name,
                 head=self._head, time_scale=self.host.scale)

    async def stop(self, reason: str = "shutdown") -> None:
        """Publish ``NodeRemoved``, flush everything queued, cancel the tasks."""
        for t in self._tasks[2:]:
            t.cancel()
        self._publish_own(NodeRemoved(ts=self.host.catch_up(), src=self.src, node=self.node_id, reason=reason))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._out.join(), 10.0)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        log.info("worker_stopped", node=self.node_id, reason=reason)


# ---------------------------------------------------------------------- command line
def _env_epoch() -> float | None:
    raw = os.environ.get("EI_CLOCK_EPOCH", "").strip()
    return float(raw) if raw else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.worker",
                                description="one engine node: the sim node model on the bus")
    p.add_argument("--node", required=True, help="node id (unique in the partition)")
    p.add_argument("--role", choices=ROLES, default="collocated")
    p.add_argument("--profile", default="gb300-glm52", help="deploy/profiles/<name>.toml or a path")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--partition", default="default")
    p.add_argument("--backend", choices=("sim", "sglang"), default="sim")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="model seconds per wall-clock second (1 = real time, 10 = ten times faster)")
    p.add_argument("--clock-epoch", type=float, default=_env_epoch(),
                   help="epoch of the scaled clock shared by a run's processes (default: env "
                        "EI_CLOCK_EPOCH, else now)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fetch-mode", choices=("async", "at_start", "none"), default="async")
    p.add_argument("--eviction", choices=sorted(POLICIES), default="count_aware")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--token-interval-s", type=float, default=0.2)
    p.add_argument("--log-format", choices=["console", "json"], default=None)
    p.add_argument("--log-level", default=None)
    return p


async def run(args: argparse.Namespace) -> int:
    from services.bus import NatsBus
    from services.gateway.tokens import NatsTokens

    profile = load_profile(args.profile)
    bus = await NatsBus.connect(args.nats_url, partition=args.partition, name=f"engine-{args.node}")
    worker = EngineWorker(bus, NatsTokens(bus.nc, args.partition), args.node, args.role, profile,
                          seed=args.seed, time_scale=args.time_scale, fetch_mode=args.fetch_mode,
                          eviction=args.eviction, heartbeat_s=args.heartbeat_s,
                          token_interval_s=args.token_interval_s, clock_epoch=args.clock_epoch)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    await stop.wait()
    await worker.stop("shutdown")
    await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.logging import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    if args.backend == "sglang":
        print("engine.worker: the sglang backend is not implemented yet (GPU target); "
              "use --backend sim", file=sys.stderr)
        return 2
    try:
        load_profile(args.profile)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"engine.worker: bad --profile: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
