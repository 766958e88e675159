"""The engine worker: one process per node, an engine backend (engine/backend.py) on the bus.

``python -m engine.worker --node n1 --role collocated --profile gb300-glm52 --nats-url URL``
``python -m engine.worker --backend sglang --sglang-url http://h:30000 ...`` (engine/backends/sglang)

The worker depends only on the port: ``--backend sim`` runs the simulated node model in
wall-clock time, ``--backend sglang`` drives one SGLang server. What it does (the numbers are
the order of a request's life on this node)
1. Start, as the services do (services/adapters/runner.py): restore the worker's view (services/cores/worker_view.py:
   directory + requests in flight) from its snapshot ``engine-<node>`` and fold the tail of the
   stream after it (from sequence 1 without a usable snapshot) up to the head seen at start,
   without acting on it. If the directory still believes this node is alive (an earlier run
   of the same id), publish ``NodeRemoved(reason="restarted")`` first: that run's KV is gone.
   Then ``NodeRegistered``. A snapshot is written every ``--snapshot-every`` folded events and
   at a clean stop, only when every event this node published has come back from the stream
   (its own events are applied at once, before their echo: a snapshot taken between the two
   would apply them twice after a restart).
2. From the head on, act on the stream: a non-shadow ``RouteDecided`` with ``prefill_node`` =
   this node enqueues a prefill job (``RequestSubmitted`` gave its blocks and lengths); a
   reroute away from this node takes the queued job off; ``SwitchRole`` on
   ``ei.<p>.cmd.<node>`` drains and switches (``backend.order_switch``; the backend
   acknowledges with ``RoleSwitched``).
3. Prefill -> decode across processes: the sim node hands the KV to its decode node in
   process (``NodeHost.peer(...).kv_arrived``). Here a remote peer is a proxy whose
   ``kv_arrived`` does nothing; the *decode* worker instead watches the stream for the
   ``FirstToken`` of a request routed to it and calls ``backend.kv_arrived`` ``p2d_transfer_s``
   later (the SGLang backend ignores that call: SGLang's own PD transfer pairs the servers).
4. Every event the node emits (KV facts, ``IterationDone``, ``RequestStarted``, ``FirstToken``,
   ``RequestFinished``, ``RoleSwitched``) is applied to the local directory at once and
   published in order; its echo from the stream (same ``src``, after the start head) is
   skipped, so eviction sees this node's own KV without waiting for the round trip.
5. Tokens go to the gateway on core NATS (``services.adapters.bus.tokens``), as the backend reports
   them (``host.token``): the sim's are ``"tok "`` per token (engine/backends/sim/backend.py),
   SGLang's are the streamed text. ``backend.progress()`` runs every ``--token-interval-s``.
6. ``NodeHeartbeat`` every ``--heartbeat-s`` (1 s). SIGTERM/SIGINT: ``NodeRemoved(reason=
   "shutdown")``, flush, exit 0.
7. ``--kv-bytes`` (sim backend): real bytes behind the node's KV pool (engine/kvplane.py). Every
   KV fact the node emits goes through the data plane before it is published: stores write
   bytes, a ``KvFetched`` reads the blocks from the peer's host pool, a ``KvMoved`` has the
   prefill node write them into this node's slots (Mooncake over TCP between processes), every
   checksum verified. ``NodeRegistered.transfer_endpoint`` tells peers where; the counts are
   logged (``kv_bytes`` every 10 heartbeats, ``kv_bytes_summary`` at stop).

Time: the node model's clock is ``epoch + (wall - epoch) * time_scale`` (seconds), the clock
the planner's ticker and the gateway use with the same ``--clock-epoch`` (default: the
worker's start), so ``--time-scale 1`` is real time and ``10`` runs the model ten times faster
than the wall clock (tests); event ``ts`` are model time. A scheduled callback runs with ``now`` = its own due time
even when the loop is late, so the model's timeline is exactly what it planned.

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
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError

from engine.backend import BackendUnavailable, DecodeJob, EngineBackend, PrefillJob
from engine.backends.sglang.backend import SglangBackend, config_from_args
from engine.backends.sglang.options import add_arguments, check_args
from engine.backends.sim.backend import SimBackend
from engine.profiles import Profile, load_profile
from engine.transfer import TransferError, make_transfer
from events.catalog import (
    Event,
    FirstToken,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RouteDecided,
    SwitchRole,
)
from events.ids import NodeId, Role
from events.wire import TokenMsg
from kernels.layout import KvLayoutError
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.security import CredentialsError, add_cli_options
from services.adapters.bus.tokens import NatsTokens
from services.adapters.logging import configure_logging, get_logger
from services.cores.contract import Sequenced
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import POLICIES
from services.cores.worker_view import WorkerView
from services.drivers.options import bus_auth

if TYPE_CHECKING:  # torch is imported only with --kv-bytes
    from engine.kvplane import KvBytesConfig

log = get_logger("worker")
ROLES = ("collocated", "prefill", "decode")
BACKENDS = ("sim", "sglang")


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
    """``WorkerHost`` (engine/backend.py) over an asyncio loop: a heap of due callbacks run at their model time."""

    def __init__(self, time_scale: float, emit: Callable[[Event], None], choose, peer,
                 epoch: float | None = None, monotonic: Callable[[], float] = time.monotonic,
                 token: Callable[[TokenMsg], None] | None = None) -> None:
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
        self._emit, self._choose, self._peer, self._token = emit, choose, peer, token

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

    def token(self, msg: TokenMsg) -> None:
        if self._token is not None:
            self._token(msg)

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
    """One node: an engine backend, the worker's view of the partition, the bus and the token
    channel. ``backend`` is ``"sim"`` or a factory ``(host, worker) -> EngineBackend``."""

    def __init__(self, bus, tokens, node: str, role: Role, profile: Profile, *, seed: int = 0,
                 time_scale: float = 1.0, fetch_mode: str = "async", eviction: str = "count_aware",
                 heartbeat_s: float = 1.0, token_interval_s: float = 0.2, clock_epoch: float | None = None,
                 epoch: float | None = None, backend: str | Callable = "sim", snapshot_every: int = 2000,
                 kv_bytes: KvBytesConfig | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.bus, self.tokens = bus, tokens
        self.node_id = NodeId(node)
        self.src = node
        self.profile = profile
        self.view = WorkerView()
        self.policy = POLICIES[eviction](profile.block_tokens)
        if epoch is None and clock_epoch is not None:  # the clock every process of a run shares
            epoch = clock_epoch + (time.time() - clock_epoch) * time_scale
        self.host = WallClockHost(time_scale, self._on_emit, self._choose, self._peer, epoch=epoch,
                                  token=self._out_token)
        if backend == "sim":
            self.backend: EngineBackend = SimBackend(self.host, node, role, profile, seed=seed, fetch_mode=fetch_mode)
        elif callable(backend):
            self.backend = backend(self.host, self)
        else:
            raise ValueError(f"backend must be one of {BACKENDS} or a factory, got {backend!r}")
        self.heartbeat_s, self.token_interval_s = heartbeat_s, token_interval_s
        self.snapshot_every = snapshot_every
        self.snapshot_key = f"engine-{node}"
        self._out: asyncio.Queue = asyncio.Queue()
        self._decode_for: dict[str, str] = {}  # request -> prefill node, for requests we decode
        self._queued_here: set[str] = set()
        self._head = 0
        self.applied_seq = 0  # last stream sequence folded into the view
        self.restored_from = 0  # snapshot position the worker started from (0: folded from 1)
        self._unechoed = 0  # own events published whose echo has not come back yet
        self._since_snap = 0
        self._tasks: list[asyncio.Task] = []
        self.live = asyncio.Event()
        self.published = 0
        self.publish_retries = 0  # publications that failed at least once and were tried again
        self._boot = uuid.uuid4().hex[:12]  # message ids of this run: a restart never reuses one
        self._msg_seq = 0
        self.kv = None  # engine.kvplane.KvDataPlane with --kv-bytes
        if kv_bytes is not None:
            if self.backend.name != "sim":
                raise ValueError("--kv-bytes runs with the sim backend (SGLang moves its own KV)")
            from engine.kvplane import KvDataPlane  # lazy: optional dependency (torch; --kv-bytes only)

            transfer = make_transfer(kv_bytes.transfer, node=node, host=kv_bytes.host, fabric=kv_bytes.fabric)
            self.kv = KvDataPlane(node, profile.block_tokens, profile.l1_capacity_tokens // profile.block_tokens,
                                  profile.l2_capacity_tokens // profile.block_tokens, kv_bytes, transfer)

    # ------------------------------------------------------------------ view
    @property
    def directory(self) -> DirectoryCore:
        return self.view.directory

    @property
    def node(self):
        """The sim node model (tests and the sim backend only)."""
        return getattr(self.backend, "node", None)

    # ------------------------------------------------------------------ WorkerHost callbacks
    def _on_emit(self, event: Event) -> None:
        if self.kv is not None:
            self.kv.observe(event)  # bytes follow the fact before peers learn of it
        self.view.apply(event)
        self._unechoed += 1
        self._out.put_nowait(event)
        if type(event) is FirstToken:
            self._queued_here.discard(event.request)  # prefill done: no longer movable by a reroute

    def _out_token(self, msg: TokenMsg) -> None:
        self._out.put_nowait(msg)

    def _choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.directory, node, tier, tokens, pinned)

    def _peer(self, node):
        if node == self.node_id:
            return self.backend
        return RemotePeer(node, self.directory)

    def _publish_own(self, event: Event) -> None:
        self.view.apply(event)
        self._unechoed += 1
        self._out.put_nowait(event)

    # ------------------------------------------------------------------ stream input
    def fold(self, seq: int, event: Event) -> None:
        """One delivery from the stream (in order). Up to the start head: the view only."""
        own_echo = seq > self._head and getattr(event, "src", None) == self.src
        self._peers_of(seq, event)
        if own_echo:
            self._unechoed = max(0, self._unechoed - 1)
        else:
            self.view.apply(event)
        self.applied_seq = max(self.applied_seq, seq)
        self._since_snap += 1
        if seq <= self._head:
            return
        t = type(event)
        if t is RouteDecided and not event.shadow:
            self._on_route(event)
        elif t is SwitchRole and event.node == self.node_id:
            self.host.catch_up()
            log.info("switch_ordered", node=self.node_id, to_role=event.to_role, mechanism=event.mechanism)
            self.backend.order_switch(event.to_role, event.mechanism)
        elif t is FirstToken and event.node != self.node_id and event.request in self._decode_for:
            self._admit_decode(event.request)

    def _peers_of(self, seq: int, event: Event) -> None:
        if self.kv is None:
            return
        # a NodeRemoved keeps the endpoint: liveness may remove a node that is only late (its
        # next heartbeat revives it without a new registration); a dead peer fails the transfer
        if type(event) is NodeRegistered:
            self.kv.peer_registered(event.node, event.transfer_endpoint)

    def _on_route(self, e: RouteDecided) -> None:
        rid = e.request
        if e.decode_node == self.node_id and e.prefill_node != self.node_id:
            self._decode_for[rid] = e.prefill_node
        else:
            self._decode_for.pop(rid, None)
        if rid in self._queued_here and e.prefill_node != self.node_id:
            self.host.catch_up()
            if self.backend.remove_queued(rid) is not None:
                self._queued_here.discard(rid)
            return
        if e.prefill_node != self.node_id:
            return
        req = self.view.requests.get(rid)
        if req is None:
            log.warning("route_without_request", request=rid)
            return
        now = self.host.catch_up()
        old = self.backend.remove_queued(rid) if rid in self._queued_here else None
        job = old or PrefillJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                                max_tokens=req.max_tokens, decode_node=e.decode_node,
                                fetch_plan=e.fetch_plan, enqueued_s=now)
        if old is not None:
            job.decode_node, job.fetch_plan, job.fetched, job.fetch_s = e.decode_node, e.fetch_plan, [], 0.0
        self._queued_here.add(rid)
        self.backend.enqueue_prefill(job)

    def _admit_decode(self, rid: str) -> None:
        req = self.view.requests.get(rid)
        src = self._decode_for.get(rid)
        if req is None or src is None:
            return
        now = self.host.catch_up()
        job = DecodeJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                        left=float(max(0, req.max_tokens - 1)), total_out=max(1, req.max_tokens),
                        context=float(req.prompt_tokens + 1), src_node=NodeId(src))
        self.host.schedule(now + self.profile.p2d_transfer_s(req.prompt_tokens), self.backend.kv_arrived, job)

    # ------------------------------------------------------------------ snapshots
    async def load_snapshot(self) -> None:
        """Restore the view from ``engine-<node>`` when there is a readable one, else start at 0."""
        data = await self.bus.get_snapshot(self.snapshot_key)
        if data is None:
            return
        try:
            seqd = Sequenced.restore(data, WorkerView)
        except Exception as exc:  # noqa: BLE001 - any unreadable snapshot: fold from sequence 1
            log.error("snapshot_unreadable", node=self.node_id, error=f"{type(exc).__name__}: {exc}",
                      action="folding from sequence 1")
            return
        self.view, self.applied_seq = seqd.core, seqd.applied_seq
        self.restored_from = seqd.applied_seq

    async def snapshot(self) -> bool:
        """Write the view's snapshot if it is consistent (no own event awaiting its echo)."""
        if self._unechoed or self.applied_seq == 0:
            return False
        data = Sequenced(self.view, self.applied_seq).snapshot()
        try:
            await self.bus.put_snapshot(self.snapshot_key, data)
        except Exception as exc:  # noqa: BLE001 - a lost snapshot only lengthens the next start
            log.error("snapshot_failed", node=self.node_id, error=str(exc))
            return False
        self._since_snap = 0
        return True

    # ------------------------------------------------------------------ tasks
    async def _publisher(self) -> None:
        while True:
            item = await self._out.get()
            try:
                if isinstance(item, TokenMsg):
                    await self.tokens.publish(item)  # core NATS: buffered by the client while it reconnects
                else:
                    await self._publish_event(item)
            except Exception as exc:  # noqa: BLE001 - a lost publication is logged, the node goes on
                if not isinstance(item, TokenMsg):
                    self._unechoed = max(0, self._unechoed - 1)  # its echo will never come
                log.error("publish_failed", node=self.node_id, item=type(item).__name__,
                          error=str(exc) or type(exc).__name__)
            finally:
                self._out.task_done()

    async def _publish_event(self, event: Event) -> None:
        """Publish ``event`` with a message id of its own (``node:run:n``) and, while the bus
        cannot take it (server down, a cluster electing a leader), try again with the same id,
        in order (the queue waits): the stream's duplicate window drops a retry whose first try
        was stored after all. Retries stop inside that window (beyond it a retry could store
        the event twice); an error that a retry cannot fix (a refused event) is raised at once."""
        self._msg_seq += 1
        msg_id = f"{self.src}:{self._boot}:{self._msg_seq}"
        settings = getattr(self.bus, "settings", None)
        window = getattr(settings, "duplicate_window_s", 120.0) or 120.0
        deadline = time.monotonic() + 0.8 * window
        delay, failures = 0.05, 0
        while True:
            try:
                await self.bus.publish(event, msg_id=msg_id)
            except Exception as exc:
                if not _retryable(exc) or time.monotonic() + delay > deadline:
                    raise
                failures += 1
                if failures == 1:
                    self.publish_retries += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("publish_retrying", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                                attempt=failures, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            self.published += 1
            if failures:
                log.info("publish_recovered", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                         attempts=failures + 1)
            return

    async def _consume(self, caught_up: asyncio.Event) -> None:
        if self._head <= self.applied_seq:
            caught_up.set()
        async with self.bus.consumer(None, start_seq=self.applied_seq + 1) as c:
            async for d in c:
                try:
                    self.fold(d.seq, d.event)
                except Exception as exc:  # noqa: BLE001 - bad input never kills the node
                    log.error("fold_failed", node=self.node_id, seq=d.seq, event=type(d.event).__name__,
                              error=repr(exc))
                if d.seq >= self._head:
                    caught_up.set()
                if self._since_snap >= self.snapshot_every and not self._unechoed:
                    await self.snapshot()

    async def _heartbeats(self) -> None:
        beats = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._publish_own(self.heartbeat())
            beats += 1
            if self.kv is not None and beats % 10 == 0:
                log.info("kv_bytes", node=self.node_id, **self.kv.summary())

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.token_interval_s)
            self.host.catch_up()
            self.backend.progress()

    def heartbeat(self) -> NodeHeartbeat:
        ld = self.backend.load()
        return NodeHeartbeat(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=ld.role,
                             running=ld.running, queued=ld.queued,
                             l1_used_tokens=ld.l1_used_tokens, l2_used_tokens=ld.l2_used_tokens)

    def registration(self) -> NodeRegistered:
        p = self.profile
        return NodeRegistered(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=self.backend.role,
                              gpus=p.gpus_per_node, l1_capacity_tokens=p.l1_capacity_tokens,
                              l2_capacity_tokens=p.l2_capacity_tokens,
                              prefill_token_budget=p.prefill_token_budget, max_running_requests=p.max_running,
                              t_fwd=p.t_fwd, profile=p.name,
                              transfer_endpoint=self.kv.endpoint if self.kv is not None else "")

    async def start(self) -> None:
        """Start the backend, restore snapshot + tail, register, and start serving."""
        await self.backend.start()
        if self.kv is not None:
            await self.kv.start()
        await self.load_snapshot()
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
        log.info("worker_up", node=self.node_id, role=self.backend.role, backend=self.backend.name,
                 profile=self.profile.name, restored_from=self.restored_from, head=self._head,
                 time_scale=self.host.scale)

    async def stop(self, reason: str = "shutdown") -> None:
        """Publish ``NodeRemoved``, flush everything queued, snapshot, cancel the tasks."""
        for t in self._tasks[2:]:
            t.cancel()
        self._publish_own(NodeRemoved(ts=self.host.catch_up(), src=self.src, node=self.node_id, reason=reason))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._out.join(), 10.0)
        for _ in range(100):  # let the echoes come back, so the snapshot is consistent
            if not self._unechoed:
                break
            await asyncio.sleep(0.02)
        await self.snapshot()
        if self.kv is not None:
            await self.kv.drain()
            summary = self.kv.summary()
            (log.error if summary["failed"] else log.info)("kv_bytes_summary", node=self.node_id, **summary)
            await self.kv.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self.backend.close()
        log.info("worker_stopped", node=self.node_id, reason=reason)


def _retryable(exc: BaseException) -> bool:
    """A publication error that may pass on a retry: the bus unreachable or JetStream not
    answering (yet). A JetStream API error other than 503 (a refused message) will not."""
    if isinstance(exc, ServiceUnavailableError):
        return True
    if isinstance(exc, APIError):
        return False
    return isinstance(exc, NatsError | TimeoutError | OSError | ConnectionError)


# ---------------------------------------------------------------------- command line
def _env_epoch() -> float | None:
    raw = os.environ.get("EI_CLOCK_EPOCH", "").strip()
    return float(raw) if raw else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.worker",
                                description="one engine node on the bus: the sim node model or one SGLang server "
                                            "(engine/backend.py is the port; docs/engines.md)")
    p.add_argument("--node", required=True, help="node id (unique in the partition)")
    p.add_argument("--role", choices=ROLES, default="collocated", help="initial role (default collocated)")
    p.add_argument("--profile", default="gb300-glm52",
                   help="deploy/profiles/<name>.toml or a path: capacities and block size the node registers "
                        "with (and the sim's ground-truth timings)")
    p.add_argument("--nats-url", default=os.environ.get("EI_NATS_URL") or None,
                   required=not os.environ.get("EI_NATS_URL"),
                   help="NATS server, e.g. nats://127.0.0.1:4222, or a comma-separated list of a cluster's "
                        "servers (default: env EI_NATS_URL)")
    p.add_argument("--stream-replicas", type=int, default=int(os.environ.get("EI_STREAM_REPLICAS") or 1),
                   help="replicas of the stream and of this node's snapshot bucket (env EI_STREAM_REPLICAS)")
    p.add_argument("--partition", default="default", help="bus partition (default: default)")
    p.add_argument("--backend", choices=BACKENDS, default="sim",
                   help="sim: simulated node; sglang: drive one SGLang server (options below)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="model seconds per wall-clock second (1 = real time, 10 = ten times faster; "
                        "sglang needs 1)")
    p.add_argument("--clock-epoch", type=float, default=_env_epoch(),
                   help="epoch of the scaled clock shared by a run's processes (default: env "
                        "EI_CLOCK_EPOCH, else now)")
    p.add_argument("--seed", type=int, default=0, help="sim: noise seed")
    p.add_argument("--fetch-mode", choices=("async", "at_start", "none"), default="async",
                   help="sim: how peer KV is fetched (docs/simulator.md)")
    p.add_argument("--eviction", choices=sorted(POLICIES), default="count_aware",
                   help="eviction order of the node's KV pool (the directory's policy)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between NodeHeartbeat events")
    p.add_argument("--token-interval-s", type=float, default=0.2,
                   help="seconds between token progress reports to the gateway")
    p.add_argument("--snapshot-every", type=int, default=2000,
                   help="folded events between snapshots of the worker's view (engine-<node>)")
    p.add_argument("--kv-bytes", action="store_true",
                   help="sim: real bytes behind the KV pool, moved between workers with Mooncake over TCP and "
                        "checksum-verified (engine/kvplane.py, docs/kernels.md)")
    p.add_argument("--kv-block-bytes", type=int, default=1024,
                   help="--kv-bytes: bytes per KV block (a multiple of 2 x block_tokens; default 1024)")
    p.add_argument("--transfer", choices=("mooncake",), default="mooncake",
                   help="--kv-bytes: transfer backend between worker processes (loopback is in-process only)")
    p.add_argument("--transfer-host", default="127.0.0.1",
                   help="--kv-bytes: address the transfer engine and the KV control channel listen on")
    p.add_argument("--log-format", choices=["console", "json"], default=None,
                   help="log lines as console text or JSON (default: the services' setting)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error (default info)")
    add_arguments(p)
    add_cli_options(p)
    return p


async def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    backend: str | Callable = "sim"
    if args.backend == "sglang":
        cfg = config_from_args(args)
        backend = lambda host, w: SglangBackend(host, w.src, args.role, profile, cfg)
        try:
            if not cfg.wait_s:  # fail before touching the bus: one line, exit 2
                await SglangBackend.preflight(cfg)
        except BackendUnavailable as exc:
            print(f"engine.worker: {exc}", file=sys.stderr)
            return 2
    try:
        creds = bus_auth(args).credentials()
    except CredentialsError as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        return 2
    bus = await NatsBus.connect(args.nats_url, partition=args.partition, name=f"engine-{args.node}",
                                credentials=None if creds.empty else creds,
                                settings=StreamSettings(replicas=args.stream_replicas))
    kv = None
    if args.kv_bytes:
        import torch  # lazy: optional dependency (torch; --kv-bytes only)

        from engine.kvplane import KvBytesConfig  # lazy: optional dependency (torch; --kv-bytes only)

        # small batched ops on a node that shares its cores: intra-op threads only spin (a 2000-block
        # store took 120-480 ms with torch's default threads on a loaded 2-core box, 7-25 ms with one)
        torch.set_num_threads(1)
        kv = KvBytesConfig(block_bytes=args.kv_block_bytes, transfer=args.transfer, host=args.transfer_host)
    try:
        worker = EngineWorker(bus, NatsTokens(bus.nc, args.partition), args.node, args.role, profile,
                              seed=args.seed, time_scale=args.time_scale, fetch_mode=args.fetch_mode,
                              eviction=args.eviction, heartbeat_s=args.heartbeat_s,
                              token_interval_s=args.token_interval_s, clock_epoch=args.clock_epoch,
                              backend=backend, snapshot_every=args.snapshot_every, kv_bytes=kv)
    except (TransferError, KvLayoutError) as exc:
        print(f"engine.worker: --kv-bytes: {exc}", file=sys.stderr)
        await bus.close()
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
    except BackendUnavailable as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        await bus.close()
        return 2
    await stop.wait()
    await worker.stop("shutdown")
    await bus.close()
    return 0


def _kv_bytes_preflight(args: argparse.Namespace) -> str:
    """Why ``--kv-bytes`` cannot run here (one line), before touching the bus; "" when it can."""
    if args.backend != "sim":
        return "--kv-bytes runs with --backend sim (SGLang moves its own KV)"
    try:
        import torch  # noqa: F401  # lazy: optional dependency (torch; --kv-bytes only)
    except ImportError:
        return "--kv-bytes needs torch (pip install -e '.[kv]')"
    if args.transfer == "mooncake":
        from engine.transfer.mooncake import mooncake_available  # lazy: optional dependency (torch, mooncake)

        ok, why = mooncake_available()
        if not ok:
            return f"--kv-bytes moves bytes between worker processes with Mooncake, which is missing: {why}"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    try:
        load_profile(args.profile)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"engine.worker: bad --profile: {exc}", file=sys.stderr)
        return 2
    if args.kv_bytes:
        err = _kv_bytes_preflight(args)
        if err:
            print(f"engine.worker: {err}", file=sys.stderr)
            return 2
    if args.backend == "sglang":
        err = check_args(args)
        if err:
            print(f"engine.worker: {err}", file=sys.stderr)
            return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
